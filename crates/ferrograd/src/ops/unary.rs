//! Unary elementwise ops. Each backward reads the saved output where the derivative is a
//! function of it (exp, sqrt, tanh, sigmoid, relu), else the saved input.

use super::binary::{binary_forward, unary_forward};
use crate::autograd::{SavedTensor, record};
use crate::backend::{BinaryOp, UnaryOp, elementwise};
use crate::base::Result;
use crate::tensor::Tensor;

/// GELU flavours, as `approximate` in PyTorch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GeluApprox {
    /// 0.5 x (1 + erf(x / √2))
    None,
    /// 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))
    Tanh,
}

/// `op(g, saved)`, written into `g`'s own buffer when nothing else can see it (the engine
/// hands each node a gradient it owns). This keeps one (B, T, C) buffer fewer alive at the
/// backward peak than allocating a fresh result, as PyTorch's threshold_backward does.
fn backward_into_grad(
    op: BinaryOp,
    g: &Tensor,
    saved: &Tensor,
    name: &'static str,
) -> Result<Tensor> {
    if g.is_exclusive() && g.shape() == saved.shape() && g.dtype() == saved.dtype() {
        elementwise::binary_inplace(op, g.storage(), saved.view())?;
        return Ok(g.clone());
    }
    binary_forward(op, g, saved, name)
}

impl Tensor {
    /// Backward from the saved output: g ∘ f'(y) through one fused kernel.
    fn unary_from_output(&self, op: UnaryOp, back: BinaryOp, name: &'static str) -> Result<Tensor> {
        let out = unary_forward(op, self, name)?;
        Ok(record(name, &[self], out, |out, _| {
            let y = SavedTensor::new(out);
            move |g: &Tensor, _: &[bool]| {
                Ok(vec![Some(backward_into_grad(back, g, y.get(), name)?)])
            }
        }))
    }

    /// e^x. Backward: g * y.
    #[track_caller]
    pub fn exp(&self) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if let Some([x]) = super::autocast::cast_f32([self])? {
            return x.exp();
        }
        self.unary_from_output(UnaryOp::Exp, BinaryOp::Mul, "exp")
    }

    /// tanh x. Backward: g * (1 - y²).
    #[track_caller]
    pub fn tanh(&self) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.unary_from_output(UnaryOp::Tanh, BinaryOp::TanhBackward, "tanh")
    }

    /// 1 / (1 + e^-x). Backward: g * y * (1 - y).
    #[track_caller]
    pub fn sigmoid(&self) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.unary_from_output(UnaryOp::Sigmoid, BinaryOp::SigmoidBackward, "sigmoid")
    }

    /// max(x, 0). Backward: g where y > 0 (PyTorch saves the output too).
    #[track_caller]
    pub fn relu(&self) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.unary_from_output(UnaryOp::Relu, BinaryOp::ReluBackward, "relu")
    }

    /// √x. Backward: g / (2 y).
    #[track_caller]
    pub fn sqrt(&self) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let out = unary_forward(UnaryOp::Sqrt, self, "sqrt")?;
        Ok(record("sqrt", &[self], out, |out, _| {
            let y = SavedTensor::new(out);
            move |g: &Tensor, _: &[bool]| Ok(vec![Some(g.div(&y.get().mul_scalar(2.0)?)?)])
        }))
    }

    /// ln x. Backward: g / x.
    #[track_caller]
    pub fn log(&self) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if let Some([x]) = super::autocast::cast_f32([self])? {
            return x.log();
        }
        let out = unary_forward(UnaryOp::Log, self, "log")?;
        Ok(record("log", &[self], out, |_, _| {
            let x = SavedTensor::new(self);
            move |g: &Tensor, _: &[bool]| Ok(vec![Some(g.div(x.get())?)])
        }))
    }

    /// GELU. Backward: g * gelu'(x) from the saved input.
    #[track_caller]
    pub fn gelu(&self, approx: GeluApprox) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let (op, back) = match approx {
            GeluApprox::None => (UnaryOp::GeluErf, BinaryOp::GeluErfBackward),
            GeluApprox::Tanh => (UnaryOp::GeluTanh, BinaryOp::GeluTanhBackward),
        };
        let out = unary_forward(op, self, "gelu")?;
        Ok(record("gelu", &[self], out, |_, _| {
            let x = SavedTensor::new(self);
            move |g: &Tensor, _: &[bool]| {
                Ok(vec![Some(backward_into_grad(
                    back,
                    g,
                    x.get(),
                    "gelu_backward",
                )?)])
            }
        }))
    }
}
