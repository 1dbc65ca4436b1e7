//! The main job's optimizer: AdamW (the default) or SGD with momentum, chosen by
//! `--optimizer`, or AdamW with its state sharded over data-parallel ranks (`--zero 1`),
//! behind one type so the `Trainer`, the step in backward and the saved state handle all.
//! With `--weights bf16`, AdamW keeps an f32 master copy and f32 moments of every parameter.

use std::str::FromStr;
use std::sync::Arc;

use crate::autograd::GradProduct;
use crate::base::{Error, Result};
use crate::dist::{ProcessGroup, Zero1};
use crate::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};
use crate::tensor::Tensor;

/// Which optimizer a run uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OptimizerChoice {
    /// AdamW with betas (0.9, 0.99).
    #[default]
    AdamW,
    /// SGD with momentum (plain momentum: its step in backward is gradient-free).
    Sgd,
}

impl OptimizerChoice {
    /// The weight decay when none is given: AdamW's decoupled 0.1; none for SGD (its L2 term
    /// would make the step in backward fall back to per-parameter hooks).
    pub fn default_weight_decay(self) -> f64 {
        match self {
            OptimizerChoice::AdamW => 0.1,
            OptimizerChoice::Sgd => 0.0,
        }
    }
}

impl FromStr for OptimizerChoice {
    type Err = Error;

    fn from_str(s: &str) -> Result<OptimizerChoice> {
        match s {
            "adamw" => Ok(OptimizerChoice::AdamW),
            "sgd" => Ok(OptimizerChoice::Sgd),
            _ => Err(Error::invalid(
                "optimizer",
                format!("unknown optimizer '{s}': use 'adamw' or 'sgd'"),
            )),
        }
    }
}

impl std::fmt::Display for OptimizerChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OptimizerChoice::AdamW => write!(f, "adamw"),
            OptimizerChoice::Sgd => write!(f, "sgd"),
        }
    }
}

/// The optimizer of a run: every `Optimizer` call goes to the chosen one.
pub enum JobOptimizer {
    AdamW(Adam),
    Sgd(Sgd),
    /// AdamW sharded over the ranks of a group (ZeRO-1).
    Zero1(Zero1),
}

/// The settings a run's optimizer is built from.
#[derive(Clone, Copy, Debug)]
pub struct OptimizerSettings {
    pub choice: OptimizerChoice,
    pub lr: f64,
    pub weight_decay: f64,
    /// SGD's momentum (AdamW ignores it).
    pub momentum: f64,
    /// AdamW keeps an f32 master copy (and f32 moments) of every f16/bf16 parameter, so small
    /// updates accumulate instead of rounding away (`--weights bf16`). AdamW only.
    pub master_weights: bool,
}

impl JobOptimizer {
    /// The chosen optimizer over `params`.
    pub fn new(params: Vec<Tensor>, s: &OptimizerSettings) -> Result<JobOptimizer> {
        Ok(match s.choice {
            OptimizerChoice::AdamW => {
                let adam = Adam::adamw(params, adamw_config(s))?;
                JobOptimizer::AdamW(if s.master_weights {
                    adam.with_master_weights()?
                } else {
                    adam
                })
            }
            OptimizerChoice::Sgd if s.master_weights => {
                return Err(Error::invalid(
                    "train",
                    "--weights bf16 keeps f32 master weights inside AdamW, and SGD has none (its bf16 updates would round away): use --optimizer adamw, or --weights f32",
                ));
            }
            OptimizerChoice::Sgd => {
                let cfg = SgdConfig {
                    lr: s.lr,
                    momentum: s.momentum,
                    weight_decay: s.weight_decay,
                    ..SgdConfig::default()
                };
                JobOptimizer::Sgd(Sgd::new(params, cfg)?)
            }
        })
    }

    /// AdamW over `named` with its state sharded over `group`'s ranks.
    pub fn zero1(
        named: Vec<(String, Tensor)>,
        s: &OptimizerSettings,
        group: Arc<dyn ProcessGroup>,
    ) -> Result<JobOptimizer> {
        if s.choice != OptimizerChoice::AdamW {
            return Err(Error::invalid(
                "train",
                "--zero 1 shards AdamW's moments; it cannot run with --optimizer sgd",
            ));
        }
        if s.master_weights {
            return Err(Error::invalid("train", ZERO_MASTER_WEIGHTS));
        }
        Ok(JobOptimizer::Zero1(Zero1::adamw(
            named,
            adamw_config(s),
            group,
        )?))
    }

    /// Whether AdamW steps f16/bf16 parameters through f32 master copies.
    pub fn master_weights(&self) -> bool {
        matches!(self, JobOptimizer::AdamW(a) if a.has_master_weights())
    }

    pub fn choice(&self) -> OptimizerChoice {
        match self {
            JobOptimizer::AdamW(_) | JobOptimizer::Zero1(_) => OptimizerChoice::AdamW,
            JobOptimizer::Sgd(_) => OptimizerChoice::Sgd,
        }
    }

    fn inner(&self) -> &dyn Optimizer {
        match self {
            JobOptimizer::AdamW(o) => o,
            JobOptimizer::Sgd(o) => o,
            JobOptimizer::Zero1(o) => o,
        }
    }

    fn inner_mut(&mut self) -> &mut dyn Optimizer {
        match self {
            JobOptimizer::AdamW(o) => o,
            JobOptimizer::Sgd(o) => o,
            JobOptimizer::Zero1(o) => o,
        }
    }
}

/// Why `--zero 1` refuses half-precision weights (the job checks it before building anything).
pub(super) const ZERO_MASTER_WEIGHTS: &str = "--zero 1 shards AdamW's moments but not master weights, which --weights bf16 needs: use --weights f32 with --zero 1, or --weights bf16 without it";

/// The run's AdamW: betas (0.9, 0.99).
fn adamw_config(s: &OptimizerSettings) -> AdamConfig {
    AdamConfig {
        lr: s.lr,
        betas: (0.9, 0.99),
        weight_decay: s.weight_decay,
        ..AdamConfig::default()
    }
}

impl Optimizer for JobOptimizer {
    fn step(&mut self) -> Result<()> {
        self.inner_mut().step()
    }

    fn step_param(&mut self, index: usize) -> Result<()> {
        self.inner_mut().step_param(index)
    }

    fn step_with_grad_scale(&mut self, scale: &Tensor) -> Result<()> {
        self.inner_mut().step_with_grad_scale(scale)
    }

    fn params(&self) -> &[Tensor] {
        self.inner().params()
    }

    fn name(&self) -> &'static str {
        self.inner().name()
    }

    fn lr(&self) -> f64 {
        self.inner().lr()
    }

    fn set_lr(&mut self, lr: f64) -> Result<()> {
        self.inner_mut().set_lr(lr)
    }

    fn zero_grad_with(&mut self, set_to_none: bool) -> Result<()> {
        self.inner_mut().zero_grad_with(set_to_none)
    }

    fn gradient_free(&self) -> Option<&'static str> {
        self.inner().gradient_free()
    }

    fn reduces_gradients_in_step(&self) -> bool {
        self.inner().reduces_gradients_in_step()
    }

    fn accumulate_product(
        &mut self,
        index: usize,
        product: &GradProduct<'_>,
        first: bool,
    ) -> Result<bool> {
        self.inner_mut().accumulate_product(index, product, first)
    }

    fn accumulate_gradient(&mut self, index: usize, grad: &Tensor) -> Result<()> {
        self.inner_mut().accumulate_gradient(index, grad)
    }

    fn apply_accumulated(&mut self, index: usize) -> Result<()> {
        self.inner_mut().apply_accumulated(index)
    }

    fn graph_support(&self) -> std::result::Result<(), String> {
        self.inner().graph_support()
    }

    fn prepare_graph_step(&mut self) -> Result<()> {
        self.inner_mut().prepare_graph_step()
    }

    fn graph_step_replayed(&mut self) {
        self.inner_mut().graph_step_replayed()
    }

    fn graph_step_abandoned(&mut self) {
        self.inner_mut().graph_step_abandoned()
    }

    fn make_state(&mut self) -> Result<()> {
        self.inner_mut().make_state()
    }

    fn skips_on_device(&self) -> bool {
        self.inner().skips_on_device()
    }

    fn step_unless_found_inf(&mut self, found_inf: &Tensor) -> Result<()> {
        self.inner_mut().step_unless_found_inf(found_inf)
    }

    fn settle_counts(&mut self) -> Result<()> {
        self.inner_mut().settle_counts()
    }
}
