//! SGD with momentum, dampening, Nesterov and weight decay: PyTorch's algorithm.
//!
//!   g ← grad + wd·p
//!   buf ← g                          (first step)
//!   buf ← μ·buf + (1 − dampening)·g  (later steps)
//!   g ← g + μ·buf (nesterov) or buf
//!   p ← p − lr·g
//!
//! Momentum buffers are created at the first step and count as optimizer state.

use super::{Optimizer, check_lr};
use crate::autograd::no_grad;
use crate::backend::FusedOp;
use crate::error::{Error, Result};
use crate::memory::Category;
use crate::tensor::Tensor;

#[derive(Clone, Debug)]
pub struct SgdConfig {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

pub struct Sgd {
    params: Vec<Tensor>,
    cfg: SgdConfig,
    momentum_buffers: Vec<Option<Tensor>>,
}

impl Sgd {
    pub fn new(params: Vec<Tensor>, cfg: SgdConfig) -> Result<Sgd> {
        check_lr("SGD", cfg.lr)?;
        if cfg.momentum < 0.0 || cfg.weight_decay < 0.0 {
            return Err(Error::invalid(
                "SGD",
                "momentum and weight_decay must be non-negative",
            ));
        }
        if cfg.nesterov && (cfg.momentum <= 0.0 || cfg.dampening != 0.0) {
            return Err(Error::invalid(
                "SGD",
                "Nesterov momentum requires a momentum > 0 and zero dampening",
            ));
        }
        let n = params.len();
        Ok(Sgd {
            params,
            cfg,
            momentum_buffers: vec![None; n],
        })
    }

    pub fn config(&self) -> &SgdConfig {
        &self.cfg
    }

    /// The momentum buffer of parameter `i`, if created.
    pub fn momentum_buffer(&self, i: usize) -> Option<&Tensor> {
        self.momentum_buffers.get(i).and_then(Option::as_ref)
    }

    /// One fused pass per parameter: reads the gradient once, updates buffer and parameter.
    fn update(&mut self, i: usize, grad: Tensor) -> Result<()> {
        let c = &self.cfg;
        let p = &self.params[i];
        if grad.shape() != p.shape() || grad.dtype() != p.dtype() {
            return Err(Error::shape(
                "SGD",
                format!(
                    "gradient {:?} does not match parameter {:?}",
                    grad.shape(),
                    p.shape()
                ),
            ));
        }
        let grad = if grad.is_contiguous() {
            grad
        } else {
            grad.contiguous_copy()?
        };
        let first_step = c.momentum != 0.0 && self.momentum_buffers[i].is_none();
        if first_step {
            let b = Tensor::alloc(
                p.shape(),
                p.dtype(),
                p.device(),
                Category::OptimizerState,
                "sgd_momentum",
            )?;
            self.momentum_buffers[i] = Some(b);
        }
        let op = FusedOp::SgdStep {
            lr: c.lr,
            momentum: c.momentum,
            dampening: c.dampening,
            weight_decay: c.weight_decay,
            nesterov: c.nesterov,
            first_step,
        };
        let mut outputs = vec![p.storage().as_ref()];
        if let Some(b) = &self.momentum_buffers[i] {
            outputs.push(b.storage().as_ref());
        }
        p.backend()?.fused(&op, &[grad.view()], &outputs)?;
        outputs.iter().for_each(|s| s.bump_version());
        Ok(())
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        let _g = no_grad();
        for i in 0..self.params.len() {
            if let Some(grad) = self.params[i].grad() {
                self.update(i, grad)?;
            }
        }
        Ok(())
    }

    fn step_param(&mut self, index: usize) -> Result<()> {
        let _g = no_grad();
        let grad = self.params.get(index).and_then(Tensor::grad);
        match grad {
            Some(g) => self.update(index, g),
            None => Ok(()),
        }
    }

    fn params(&self) -> &[Tensor] {
        &self.params
    }

    fn lr(&self) -> f64 {
        self.cfg.lr
    }

    fn set_lr(&mut self, lr: f64) -> Result<()> {
        check_lr("SGD", lr)?;
        self.cfg.lr = lr;
        Ok(())
    }
}
