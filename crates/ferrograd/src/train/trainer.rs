//! The `Trainer`: every memory strategy composed in one readable training step. Each strategy
//! lives in its own file; the Trainer only puts them in order.
//!
//!   built once:  recompute policy on the model  →  freeze by name  →  optimizer over what
//!                still trains  →  step in backward (gradient-free where the optimizer allows)
//!   each step:   accumulate (forward under autocast → backward(scale(loss / N)), per
//!                micro-batch)  →  all-reduce of gradients across data-parallel ranks (a
//!                `GradSync`: only the last micro-batch's backward reduces)  →  unscale  →  clip  →  step (skipped on inf/NaN)  →  update scale  →  zero_grad
//!
//! With `step_in_backward` the optimizer runs inside backward, parameter by parameter, so the
//! second half of a step is empty: that rules out what needs every gradient first (accumulation
//! over micro-batches, global-norm clipping, a GradScaler's skip decision) — such combinations
//! are refused when the trainer is built, with the reason.

use std::sync::Arc;
use std::time::Instant;

use super::accumulate::{Accumulation, MicroBatch, accumulate};
use super::{GradScaler, InBackwardPath, StepInBackward, freeze};
use crate::amp::AmpDType;
use crate::backend::capture;
use crate::base::{Error, Result};
use crate::dist::GradSync;
use crate::memory::{self, CategoryBytes};
use crate::nn::{Module, Recompute};
use crate::optim::{Optimizer, WarmupCosine, clip_coefficient_queued, clip_grad_norm_queued};
use crate::tensor::{DType, Device, Readout, Tensor};

/// How a step is run. `Default` is plain f32 training: one micro-batch, no clipping.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainerConfig {
    /// Micro-batches per optimizer step (gradient accumulation); each loss is scaled by 1/N.
    pub accum: usize,
    /// Clip the global gradient norm to this value before the step.
    pub clip: Option<f64>,
    /// Run forward and loss under `autocast(dtype)` (F16 or BF16). F16 also gets a
    /// `GradScaler`; BF16 has f32's range and needs none.
    pub amp: Option<DType>,
    /// Update each parameter inside backward as soon as its gradient is complete.
    pub step_in_backward: bool,
    /// zero_grad frees gradients (true, PyTorch's default) or zeroes them in place.
    pub set_to_none: bool,
    /// The learning rate for each step; without it the optimizer's rate stays.
    pub schedule: Option<WarmupCosine>,
    /// Which blocks of the model recompute their activations in backward
    /// (`Trainer::for_model` sets it on the model).
    pub recompute: Recompute,
    /// Name patterns of parameters to freeze (`transformer.h.0.*`; `Trainer::for_model`
    /// freezes them before the optimizer is built over what still trains).
    pub freeze: Vec<String>,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        TrainerConfig {
            accum: 1,
            clip: None,
            amp: None,
            step_in_backward: false,
            set_to_none: true,
            schedule: None,
            recompute: Recompute::Off,
            freeze: Vec::new(),
        }
    }
}

impl TrainerConfig {
    /// Refuses combinations that cannot work, saying why.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::invalid("Trainer", msg));
        if self.accum == 0 {
            return bad("accum must be at least 1 micro-batch".into());
        }
        if let Some(c) = self.clip
            && !(c.is_finite() && c > 0.0)
        {
            return bad(format!("clip must be a positive number, got {c}"));
        }
        if let Some(d) = self.amp {
            AmpDType::try_from(d)?;
        }
        if self.step_in_backward {
            let reason = if self.accum > 1 {
                Some(
                    "gradient accumulation (--accum) needs all micro-batches' gradients before the step",
                )
            } else if self.clip.is_some() {
                Some("global-norm clipping (--clip) needs every gradient before any step")
            } else if self.amp == Some(DType::F16) {
                Some(
                    "f16 needs a GradScaler, which must see every gradient to decide whether to skip the step; use bf16",
                )
            } else {
                None
            };
            if let Some(reason) = reason {
                return bad(format!(
                    "step-in-backward cannot be combined with this: {reason}"
                ));
            }
        }
        Ok(())
    }

    /// Whether the config changes the model (recompute or freeze), so the trainer must be
    /// built with `Trainer::for_model`.
    pub fn touches_the_model(&self) -> bool {
        self.recompute != Recompute::Off || !self.freeze.is_empty()
    }

    /// Whether steps go through a GradScaler (f16 autocast).
    pub fn uses_scaler(&self) -> bool {
        self.amp == Some(DType::F16)
    }
}

/// What one step did, for logs and progress bars.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// The step's index (0 for the first step of a run that started fresh).
    pub step: u64,
    /// The mean of the micro-batch losses (unscaled), read from the device when looked at
    /// (`report.loss.value()`): a loop that reads it every step waits for every step.
    pub loss: Readout,
    pub lr: f64,
    /// The global gradient norm before clipping, when clipping.
    pub grad_norm: Option<Readout>,
    /// With f16 loss scaling: [1 if the step found inf/NaN gradients and was skipped else 0,
    /// the loss scale after this step's update], decided on the GPU and read when looked at
    /// (`stepped`, `scale`).
    pub loss_scale: Option<Readout>,
    /// Which step in backward ran (None: the optimizer stepped after backward).
    pub in_backward: Option<InBackwardPath>,
    pub tokens: usize,
    /// The host's time for the step: its work is queued on the device, not waited for, so
    /// throughput is measured over many steps, ended by a read (see `Readout`).
    pub seconds: f64,
    pub memory_allocated: u64,
    pub max_memory_allocated: u64,
    pub memory_reserved: u64,
    /// With data parallelism, each rank's peak so far in bytes, in rank order (empty
    /// otherwise); gathered on the device, read when looked at.
    pub rank_peaks: Readout,
}

impl StepReport {
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.seconds.max(1e-12)
    }

    /// False when a GradScaler skipped the step for inf/NaN gradients (waits for the step).
    pub fn stepped(&self) -> Result<bool> {
        match &self.loss_scale {
            Some(r) => Ok(r.value()? == 0.0),
            None => Ok(true),
        }
    }

    /// The loss scale after this step's update, with f16 loss scaling (waits for the step).
    pub fn scale(&self) -> Result<Option<f64>> {
        match &self.loss_scale {
            Some(r) => Ok(r.values()?.get(1).copied()),
            None => Ok(None),
        }
    }
}

/// The report of a step whose scaler decided on the host.
fn host_loss_scale(stepped: bool, scaler: &GradScaler) -> Result<Readout> {
    Ok(Readout::ready(vec![
        if stepped { 0.0 } else { 1.0 },
        scaler.get_scale()?,
    ]))
}

impl std::fmt::Display for StepReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mb = |b: u64| b as f64 / 1048576.0;
        write!(
            f,
            "step {:>5} | loss {:.4} | lr {:.2e} | {:.0} tok/s | mem {:.1} MiB (peak {:.1}, reserved {:.1})",
            self.step,
            self.loss.value().unwrap_or(f64::NAN),
            self.lr,
            self.tokens_per_s(),
            mb(self.memory_allocated),
            mb(self.max_memory_allocated),
            mb(self.memory_reserved)
        )?;
        let rank_peaks = self.rank_peaks.values().unwrap_or_default();
        if !rank_peaks.is_empty() {
            let peaks: Vec<String> = rank_peaks
                .iter()
                .map(|&b| memory::format_size(b as u64))
                .collect();
            write!(f, " | rank peaks {}", peaks.join(", "))?;
        }
        if let Some(n) = &self.grad_norm {
            write!(f, " | norm {:.3}", n.value().unwrap_or(f64::NAN))?;
        }
        if let Ok(Some(s)) = self.scale() {
            write!(f, " | scale {s}")?;
        }
        if let Ok(false) = self.stepped() {
            write!(f, " | skipped (inf/NaN gradients)")?;
        }
        Ok(())
    }
}

/// An optimizer that reduces gradients in its own step leaves each rank's gradients
/// unreduced before it: clipping and a GradScaler would decide on different values per rank.
fn check_sharded<O: Optimizer>(optimizer: &O, config: &TrainerConfig) -> Result<()> {
    if !optimizer.reduces_gradients_in_step() {
        return Ok(());
    }
    let what = if config.clip.is_some() {
        "global-norm clipping (--clip)"
    } else if config.uses_scaler() {
        "f16 loss scaling"
    } else if config.step_in_backward {
        "step in backward"
    } else {
        return Ok(());
    };
    Err(Error::invalid(
        "Trainer",
        format!(
            "{what} cannot be combined with {}: it needs the reduced gradients, which a sharded optimizer only makes inside its step; use DDP instead, or bf16",
            optimizer.name()
        ),
    ))
}

/// Where the optimizer lives: called after backward, or hooked into it.
enum Stepper<O: Optimizer + Send + 'static> {
    AfterBackward(O),
    InBackward(StepInBackward<O>),
}

pub struct Trainer<O: Optimizer + Send + 'static> {
    config: TrainerConfig,
    stepper: Stepper<O>,
    scaler: Option<GradScaler>,
    device: Device,
    step: u64,
    grad_sync: Option<Arc<dyn GradSync>>,
}

impl<O: Optimizer + Send + 'static> Trainer<O> {
    /// A trainer for the parameters of `optimizer`, whose memory is reported for `device`.
    /// A config with a recomputation policy or freeze patterns needs the model: use
    /// `Trainer::for_model`.
    pub fn new(optimizer: O, config: TrainerConfig, device: Device) -> Result<Trainer<O>> {
        if config.touches_the_model() {
            return Err(Error::invalid(
                "Trainer",
                "recompute and freeze act on the model: build the trainer with Trainer::for_model",
            ));
        }
        Self::build(optimizer, config, device)
    }

    /// Composes every strategy of `config` around `model`: sets its recomputation policy,
    /// freezes the parameters matching `config.freeze`, builds the optimizer over the
    /// parameters that still train (`optimizer_for`), and installs the step in backward.
    pub fn for_model(
        model: &mut dyn Module,
        config: TrainerConfig,
        device: Device,
        optimizer_for: impl FnOnce(Vec<Tensor>) -> Result<O>,
    ) -> Result<Trainer<O>> {
        config.validate()?;
        model.set_recompute_policy(config.recompute)?;
        for pattern in &config.freeze {
            freeze(&*model, pattern)?;
        }
        let trainable: Vec<Tensor> = model
            .parameters()
            .into_iter()
            .filter(Tensor::requires_grad)
            .collect();
        Self::build(optimizer_for(trainable)?, config, device)
    }

    fn build(optimizer: O, config: TrainerConfig, device: Device) -> Result<Trainer<O>> {
        config.validate()?;
        check_sharded(&optimizer, &config)?;
        let mut scaler = config.uses_scaler().then(GradScaler::new);
        if let Some(s) = &mut scaler
            && capture::can_capture(device)
            && optimizer.skips_on_device()
        {
            // On a GPU the skip decision and the scale's update stay there: no step waits.
            s.stage_on(device)?;
        }
        let stepper = if config.step_in_backward {
            // The gradient-free path where the optimizer allows it, else per-parameter hooks.
            Stepper::InBackward(StepInBackward::install_fused(optimizer)?)
        } else {
            Stepper::AfterBackward(optimizer)
        };
        Ok(Trainer {
            config,
            stepper,
            scaler,
            device,
            step: 0,
            grad_sync: None,
        })
    }

    /// Runs data-parallel: gradients are reduced by `sync` (e.g. `Ddp::grad_sync`) during the
    /// backward of each step's last micro-batch, before unscale, clip and step. A step in
    /// backward is refused: each parameter would step before its gradient is averaged.
    pub fn with_grad_sync(mut self, sync: Arc<dyn GradSync>) -> Result<Trainer<O>> {
        if self.config.step_in_backward {
            return Err(Error::invalid(
                "Trainer",
                "step in backward cannot run data-parallel: each parameter would step on its own rank's gradient before the ranks average them",
            ));
        }
        self.grad_sync = Some(sync);
        Ok(self)
    }

    pub fn config(&self) -> &TrainerConfig {
        &self.config
    }

    /// The device whose memory the reports show.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Whether gradients are reduced across data-parallel ranks.
    pub(super) fn has_grad_sync(&self) -> bool {
        self.grad_sync.is_some()
    }

    /// Which step in backward runs (None: the optimizer steps after backward).
    pub fn in_backward_path(&self) -> Option<&InBackwardPath> {
        match &self.stepper {
            Stepper::AfterBackward(_) => None,
            Stepper::InBackward(s) => Some(s.path()),
        }
    }

    /// The index of the next step.
    pub fn step_index(&self) -> u64 {
        self.step
    }

    /// Continues counting from `step` (after loading saved state).
    pub fn set_step_index(&mut self, step: u64) {
        self.step = step;
    }

    pub fn scaler(&self) -> Option<&GradScaler> {
        self.scaler.as_ref()
    }

    pub fn scaler_mut(&mut self) -> Option<&mut GradScaler> {
        self.scaler.as_mut()
    }

    /// Runs `f` with the optimizer (read or restore its state, change its rate...), its
    /// step counts read from the device first where the device kept them (waits for it).
    pub fn with_optimizer<R>(&mut self, f: impl FnOnce(&mut O) -> R) -> Result<R> {
        self.with_optimizer_unsettled(|o| o.settle_counts())??;
        self.with_optimizer_unsettled(f)
    }

    /// `with_optimizer` without the wait, for the step's own calls.
    pub(super) fn with_optimizer_unsettled<R>(&mut self, f: impl FnOnce(&mut O) -> R) -> Result<R> {
        match &mut self.stepper {
            Stepper::AfterBackward(o) => Ok(f(o)),
            Stepper::InBackward(s) => s.with_optimizer(f),
        }
    }

    /// One optimizer step over `config.accum` micro-batches: `loss_of(i)` runs the forward of
    /// micro-batch i (under autocast when configured) and returns its loss.
    pub fn step(&mut self, loss_of: impl FnMut(usize) -> Result<MicroBatch>) -> Result<StepReport> {
        let start = Instant::now();
        memory::recorder::set_step(self.step);
        let lr = self.set_scheduled_lr()?;
        let how = Accumulation {
            micro_batches: self.config.accum,
            amp: self.config.amp,
            scaler: self.scaler.as_ref(),
        };
        let done = self.accumulate_synced(&how, loss_of)?;
        let (grad_norm, loss_scale) = self.finish_step()?;
        let report = StepReport {
            step: self.step,
            loss: done.mean_loss,
            lr,
            grad_norm,
            loss_scale,
            in_backward: self.in_backward_path().cloned(),
            tokens: done.tokens,
            seconds: start.elapsed().as_secs_f64(),
            memory_allocated: memory::memory_allocated(self.device)?,
            max_memory_allocated: memory::max_memory_allocated(self.device)?,
            memory_reserved: memory::memory_reserved(self.device)?,
            rank_peaks: Readout::ready(Vec::new()),
        };
        self.step += 1;
        Ok(report)
    }

    /// The micro-batches; with a `GradSync`, only the last one's backward reduces gradients,
    /// and all of them must have been reduced before the step.
    pub(super) fn accumulate_synced(
        &self,
        how: &Accumulation<'_>,
        mut loss_of: impl FnMut(usize) -> Result<MicroBatch>,
    ) -> Result<super::Accumulated> {
        let Some(sync) = &self.grad_sync else {
            return accumulate(how, loss_of);
        };
        let last = how.micro_batches - 1;
        let done = accumulate(how, |i| {
            sync.set_require_sync(i == last);
            loss_of(i)
        });
        sync.set_require_sync(true);
        let done = done?;
        sync.finish()?;
        Ok(done)
    }

    /// unscale → clip → step → update → zero_grad; returns the norm before clipping and,
    /// with a scaler, its report (`StepReport::loss_scale`). A scaler staged on the device
    /// leaves the skip decision and the scale's update there: nothing is read back.
    pub(super) fn finish_step(&mut self) -> Result<(Option<Readout>, Option<Readout>)> {
        let Stepper::AfterBackward(opt) = &mut self.stepper else {
            // Every parameter already stepped inside backward and dropped its gradient.
            return Ok((None, None));
        };
        let _phase = memory::recorder::phase_scope(memory::recorder::Phase::Optimizer);
        if let Some(s) = &mut self.scaler {
            s.unscale_(opt)?;
        }
        // Clipping is queued on the device: the norm is read only if the step's report shows it.
        let clip = self.config.clip;
        let (grad_norm, loss_scale) = match (&mut self.scaler, clip) {
            (Some(s), _) => {
                let norm = clip
                    .map(|max| clip_grad_norm_queued(opt.params(), max, 2.0))
                    .transpose()?;
                let report = if s.staged_device().is_some() {
                    let found_inf = s.step_on_device(opt)?;
                    s.update_on_device(&found_inf)?
                } else {
                    let stepped = s.step(opt)?;
                    s.update()?;
                    host_loss_scale(stepped, s)?
                };
                (norm, Some(report))
            }
            // The optimizer multiplies by the coefficient as it reads each gradient.
            (None, Some(max)) => {
                let (norm, coef) = clip_coefficient_queued(opt.params(), max, 2.0)?;
                match coef {
                    Some(c) => opt.step_with_grad_scale(&c)?,
                    None => opt.step()?,
                }
                (Some(norm), None)
            }
            (None, None) => {
                opt.step()?;
                (None, None)
            }
        };
        opt.zero_grad_with(self.config.set_to_none)?;
        Ok((grad_norm, loss_scale))
    }

    /// Sets this step's rate from the schedule (if any); returns the rate in use.
    pub(super) fn set_scheduled_lr(&mut self) -> Result<f64> {
        let scheduled = self.config.schedule.map(|s| s.lr_at(self.step));
        self.with_optimizer_unsettled(|o| {
            if let Some(lr) = scheduled {
                o.set_lr(lr)?;
            }
            Ok(o.lr())
        })?
    }

    /// Bytes by category at the highest `memory_allocated` since the last peak reset.
    pub fn by_category_at_peak(&self) -> Result<CategoryBytes> {
        Ok(memory::allocator(self.device)?.by_category_at_peak())
    }
}
