//! Unary elementwise ops. Each backward reads the saved output where the derivative is a
//! function of it (exp, sqrt, tanh, sigmoid, relu), else the saved input. The fused backward
//! kernels are not differentiable, so a backward recorded under create_graph takes the same
//! derivative written with tensor ops instead (`recorded_backward`).

use super::binary::{binary_forward, unary_forward};
use crate::autograd::{SavedTensor, is_grad_enabled, record};
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
pub(super) fn backward_into_grad(
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

/// The GELU's forward op and its backward (g · gelu'(x)) for `approx`.
pub(super) fn gelu_kernels(approx: GeluApprox) -> (UnaryOp, BinaryOp) {
    match approx {
        GeluApprox::None => (UnaryOp::GeluErf, BinaryOp::GeluErfBackward),
        GeluApprox::Tanh => (UnaryOp::GeluTanh, BinaryOp::GeluTanhBackward),
    }
}

impl Tensor {
    /// Backward from the saved output: g ∘ f'(y) through one fused kernel.
    fn unary_from_output(&self, op: UnaryOp, back: BinaryOp, name: &'static str) -> Result<Tensor> {
        let out = unary_forward(op, self, name)?;
        Ok(record(name, &[self], out, |out, _| {
            let y = SavedTensor::output(out);
            move |g: &Tensor, _: &[bool]| {
                if is_grad_enabled() {
                    return Ok(vec![Some(recorded_backward(back, g, &y.unpack())?)]);
                }
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
            let y = SavedTensor::output(out);
            move |g: &Tensor, _: &[bool]| {
                Ok(vec![Some(g.div(&super::unpack(&y).mul_scalar(2.0)?)?)])
            }
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
            move |g: &Tensor, _: &[bool]| Ok(vec![Some(g.div(&super::unpack(&x))?)])
        }))
    }

    /// GELU. Backward: g * gelu'(x) from the saved input.
    #[track_caller]
    pub fn gelu(&self, approx: GeluApprox) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let (op, back) = gelu_kernels(approx);
        let out = unary_forward(op, self, "gelu")?;
        Ok(record("gelu", &[self], out, |_, _| {
            let x = SavedTensor::new(self);
            move |g: &Tensor, _: &[bool]| {
                if is_grad_enabled() {
                    return Ok(vec![Some(g.mul(&x.unpack().gelu_derivative(approx)?)?)]);
                }
                Ok(vec![Some(backward_into_grad(
                    back,
                    g,
                    x.get(),
                    "gelu_backward",
                )?)])
            }
        }))
    }

    /// gelu'(x), recorded: the fused kernel's value (its gradient input set to ones), with a
    /// backward of gg · gelu''(x) written with tensor ops. Only a create_graph backward uses it.
    pub(super) fn gelu_derivative(&self, approx: GeluApprox) -> Result<Tensor> {
        let back = match approx {
            GeluApprox::None => BinaryOp::GeluErfBackward,
            GeluApprox::Tanh => BinaryOp::GeluTanhBackward,
        };
        let ones = Tensor::ones(self.shape(), self.dtype(), self.device())?;
        let out = binary_forward(back, &ones, self, "gelu_derivative")?;
        Ok(record("gelu_derivative", &[self], out, |_, _| {
            let x = SavedTensor::new(self);
            move |gg: &Tensor, _: &[bool]| {
                let x = super::unpack(&x);
                Ok(vec![Some(gg.mul(&gelu_second_derivative(&x, approx)?)?)])
            }
        }))
    }
}

/// g ∘ f'(y) for the ops whose derivative is a function of their output y, with tensor ops
/// (recorded under create_graph; y carries the op's node as history).
fn recorded_backward(back: BinaryOp, g: &Tensor, y: &Tensor) -> Result<Tensor> {
    let one_minus = |t: &Tensor| t.neg()?.add_scalar(1.0);
    match back {
        // exp: g · y
        BinaryOp::Mul => g.mul(y),
        // tanh: g · (1 - y²)
        BinaryOp::TanhBackward => g.mul(&one_minus(&y.mul(y)?)?),
        // sigmoid: g · y · (1 - y)
        BinaryOp::SigmoidBackward => g.mul(&y.mul(&one_minus(y)?)?),
        // relu: g · [y > 0], a constant mask (the second derivative is zero almost everywhere)
        BinaryOp::ReluBackward => {
            let ones = Tensor::ones(y.shape(), y.dtype(), y.device())?;
            g.mul(&binary_forward(
                BinaryOp::ReluBackward,
                &ones,
                &y.detach(),
                "relu_mask",
            )?)
        }
        other => Err(crate::base::Error::autograd(format!(
            "create_graph: no recorded backward for {other:?}"
        ))),
    }
}

/// gelu''(x). Exact: φ(x)(2 - x²), φ the standard normal density. Tanh form, with
/// u = k(x + c x³), t = tanh u: (1 - t²)(u' - x t u'² + x u''/2), u' = k(1 + 3c x²), u'' = 6kc x.
fn gelu_second_derivative(x: &Tensor, approx: GeluApprox) -> Result<Tensor> {
    let x2 = x.mul(x)?;
    match approx {
        GeluApprox::None => {
            let phi = x2
                .mul_scalar(-0.5)?
                .exp()?
                .mul_scalar(1.0 / (2.0 * std::f64::consts::PI).sqrt())?;
            phi.mul(&x2.neg()?.add_scalar(2.0)?)
        }
        GeluApprox::Tanh => {
            let (k, c) = ((2.0 / std::f64::consts::PI).sqrt(), 0.044715);
            let t = x.add(&x2.mul(x)?.mul_scalar(c)?)?.mul_scalar(k)?.tanh()?;
            let du = x2.mul_scalar(3.0 * c)?.add_scalar(1.0)?.mul_scalar(k)?;
            let ddu_half = x.mul_scalar(3.0 * k * c)?;
            let inner = du
                .sub(&x.mul(&t)?.mul(&du.mul(&du)?)?)?
                .add(&x.mul(&ddu_half)?)?;
            t.mul(&t)?.neg()?.add_scalar(1.0)?.mul(&inner)
        }
    }
}
