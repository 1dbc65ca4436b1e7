//! Custom functions: a user-written forward and backward, with tensors saved for backward
//! through the context (like `torch.autograd.Function`).

use super::grad_mode::no_grad;
use super::{record, should_record};
use crate::base::Result;
use crate::tensor::{SavedTensor, Tensor, take_pending_saves};

/// What a custom function's forward can keep for its backward.
#[derive(Default)]
pub struct FunctionCtx {
    saved: Vec<SavedTensor>,
    needs_input_grad: Vec<bool>,
}

impl FunctionCtx {
    /// Keeps tensors for backward; released with the graph node.
    pub fn save_for_backward(&mut self, tensors: &[&Tensor]) {
        self.saved
            .extend(tensors.iter().map(|t| SavedTensor::new(t)));
    }
    pub fn saved_tensors(&self) -> Vec<Tensor> {
        self.saved.iter().map(|s| s.get().clone()).collect()
    }
    /// Which inputs need a gradient (valid in backward).
    pub fn needs_input_grad(&self) -> &[bool] {
        &self.needs_input_grad
    }
}

/// A user-defined differentiable op with one output.
pub trait CustomFunction: Send + 'static {
    fn name(&self) -> &'static str {
        "custom_function"
    }
    /// Runs without recording a graph; save what backward needs in `ctx`.
    fn forward(&mut self, ctx: &mut FunctionCtx, inputs: &[Tensor]) -> Result<Tensor>;
    /// One gradient (or None) per input.
    fn backward(&mut self, ctx: &FunctionCtx, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>>;
}

/// Runs `f` on `inputs`, recording its backward when any input requires grad.
pub fn apply_custom<F: CustomFunction>(mut f: F, inputs: &[Tensor]) -> Result<Tensor> {
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let mut ctx = FunctionCtx::default();
    // Saves made by the forward belong to this function's node alone.
    let _ = take_pending_saves();
    let out = {
        let _g = no_grad();
        f.forward(&mut ctx, inputs)?
    };
    if !should_record(&refs) {
        return Ok(out);
    }
    let name = f.name();
    Ok(record(name, &refs, out, move |_, needs| {
        ctx.needs_input_grad = needs.to_vec();
        move |g: &Tensor, _: &[bool]| f.backward(&ctx, g)
    }))
}
