//! Optimizers. `step` updates parameters in place from their `.grad` under no_grad;
//! `zero_grad` frees gradients by default (set_to_none, as PyTorch ≥ 2.0). Also: learning-rate
//! schedules (`WarmupCosine`) and gradient clipping (`clip_grad_norm`, `clip_grad_value`).

mod adam;
mod clip;
mod device_count;
mod schedule;
mod sgd;

pub use adam::{Adam, AdamConfig, AdamState};
pub use clip::{clip_coefficient_queued, clip_grad_norm, clip_grad_norm_queued, clip_grad_value};
pub use schedule::WarmupCosine;
pub use sgd::{Sgd, SgdConfig};

use crate::autograd::GradProduct;
use crate::base::{Error, Result};
use crate::tensor::Tensor;

/// Clears one parameter's `.grad`: frees it, or zeroes it in place detached from any graph.
pub fn zero_grad_of(p: &Tensor, set_to_none: bool) -> Result<()> {
    match p.grad() {
        None => Ok(()),
        Some(_) if set_to_none => p.set_grad(None),
        Some(g) => {
            let plain = if g.grad_fn().is_some() { g.detach() } else { g };
            plain.zero_()?;
            p.set_grad(Some(plain))
        }
    }
}

pub trait Optimizer {
    fn step(&mut self) -> Result<()>;
    /// Updates parameter `index` alone from its `.grad` (the step-in-backward strategy calls
    /// it as each gradient completes). Per-parameter state makes this the same update that
    /// `step` would apply to it.
    fn step_param(&mut self, index: usize) -> Result<()>;
    fn params(&self) -> &[Tensor];

    /// The optimizer's name in reports: "SGD", "AdamW".
    fn name(&self) -> &'static str;

    /// The learning rate of the next step.
    fn lr(&self) -> f64;

    /// Sets the learning rate of later steps (a schedule calls it before each step). A
    /// negative or NaN rate is an error.
    fn set_lr(&mut self, lr: f64) -> Result<()>;

    /// set_to_none = true frees the gradient bytes; false zeroes them in place. Either way a
    /// `.grad` left by a create_graph backward loses its graph (the graph refers back to the
    /// parameter, so keeping both would hold them alive forever), as PyTorch's detach_().
    fn zero_grad_with(&mut self, set_to_none: bool) -> Result<()> {
        for p in self.params() {
            zero_grad_of(p, set_to_none)?;
        }
        Ok(())
    }

    /// Whether `step` itself reduces the gradients across data-parallel ranks (a sharded
    /// optimizer, ZeRO): before it, each rank's `.grad` holds only its own batch's gradient,
    /// so clipping or inf checks on them would differ between ranks.
    fn reduces_gradients_in_step(&self) -> bool {
        false
    }

    /// `step` on every gradient multiplied by `scale` (a 0-dim tensor on the gradients'
    /// device: `clip_coefficient_queued`'s clipping coefficient). By default the gradients
    /// are scaled in place first; an optimizer that can multiply as it reads each gradient
    /// (Adam's fused step) leaves `.grad` as it was and saves that pass over every gradient.
    fn step_with_grad_scale(&mut self, scale: &Tensor) -> Result<()> {
        clip::scale_grads(self.params(), scale)?;
        self.step()
    }

    /// `zero_grad()` with PyTorch's default, set_to_none = true.
    fn zero_grad(&mut self) -> Result<()> {
        self.zero_grad_with(true)
    }

    // The gradient-free step: an optimizer whose update is linear in the gradient can take
    // each gradient contribution straight into its state, so no gradient is ever made.
    // `StepInBackward::install_fused` drives these; the defaults say "not supported".

    /// What makes this optimizer's step gradient-free, for reports ("SGD momentum"), or
    /// None when it is not (then the three methods below are never called).
    fn gradient_free(&self) -> Option<&'static str> {
        None
    }

    /// Adds a gradient contribution of parameter `index`, offered as a product, into the
    /// state; `first` marks the step's first contribution. False, touching nothing, when
    /// the product does not fit (the caller then makes an ordinary gradient).
    fn accumulate_product(
        &mut self,
        _index: usize,
        _product: &GradProduct<'_>,
        _first: bool,
    ) -> Result<bool> {
        Ok(false)
    }

    /// Adds an ordinary gradient of parameter `index` into the state, after at least one
    /// product of the same step was accumulated.
    fn accumulate_gradient(&mut self, _index: usize, _grad: &Tensor) -> Result<()> {
        Err(no_gradient_free_step(self.name()))
    }

    /// Updates parameter `index` from what its step accumulated.
    fn apply_accumulated(&mut self, _index: usize) -> Result<()> {
        Err(no_gradient_free_step(self.name()))
    }

    // CUDA graphs: a captured step replays its kernels with the arguments they were captured
    // with, so every value that changes from step to step (the rate, the step count) must
    // reach them through device memory that the host rewrites before each replay.

    /// Whether a captured step of this optimizer can be replayed; the reason when not.
    fn graph_support(&self) -> std::result::Result<(), String> {
        Err(format!(
            "{} passes its rate to the kernels as an argument, which a replayed graph would repeat",
            self.name()
        ))
    }

    /// Before the capture and before every replay: writes the coming step's per-step values
    /// to the device, in stream order (only called when `graph_support` is Ok).
    fn prepare_graph_step(&mut self) -> Result<()> {
        Err(Error::invalid(
            self.name(),
            "this optimizer's steps cannot be replayed by a graph",
        ))
    }

    /// After each replay: the host's bookkeeping of the step the graph ran (step counts).
    fn graph_step_replayed(&mut self) {}

    /// Makes the optimizer's state now instead of at each parameter's first step, so that it
    /// is allocated beside the parameters rather than among a step's activations (whose
    /// segments then come back whole before a capture). Default: no state to make.
    fn make_state(&mut self) -> Result<()> {
        Ok(())
    }

    /// After a capture that failed (nothing ran on the device): undoes what the captured
    /// step counted on the host.
    fn graph_step_abandoned(&mut self) {}

    // Loss scaling decided on the device: the host does not read a GradScaler's found_inf
    // flag before the step (a step that must not wait for the device, captured or not); the
    // optimizer takes the flag and the device skips the update.

    /// Whether `step_unless_found_inf` is supported.
    fn skips_on_device(&self) -> bool {
        false
    }

    /// `step`, except that the device changes nothing when `found_inf` (one F32 element on
    /// the parameters' device) is nonzero. The device counts the steps that ran; the host's
    /// counts include them once `settle_counts` has read them.
    fn step_unless_found_inf(&mut self, _found_inf: &Tensor) -> Result<()> {
        Err(Error::invalid(
            self.name(),
            "this optimizer cannot skip a step on the device; read the GradScaler's check on the host (GradScaler::step)",
        ))
    }

    /// Reads the step counts that the device kept for `step_unless_found_inf` into the
    /// host's (waiting for the device): call it before reading counts or saving state.
    fn settle_counts(&mut self) -> Result<()> {
        Ok(())
    }
}

fn no_gradient_free_step(name: &'static str) -> Error {
    Error::invalid(
        name,
        "this optimizer has no gradient-free step; use the per-parameter step instead",
    )
}

/// A learning rate must be a non-negative number (infinity is left to the caller).
pub(crate) fn check_lr(op: &'static str, lr: f64) -> Result<()> {
    if lr.is_nan() || lr < 0.0 {
        return Err(Error::invalid(
            op,
            format!("the learning rate must be non-negative, got {lr}"),
        ));
    }
    Ok(())
}
