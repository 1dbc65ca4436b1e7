//! Binary elementwise ops with broadcasting, and ops with a scalar operand.
//! Each backward sums the gradient back over broadcast dims (`sum_to`).
//! Two float tensors of different dtypes are type-promoted as in PyTorch (`promoted`). An
//! add or subtract of an f32 tensor and an f16/bf16 one (autocast's residual stream plus a
//! half-precision branch) reads the half operand directly (`widened`), with no cast kernel.

use super::{check_pair, check_same_device, skipped_output};
use crate::autograd::{SavedTensor, record};
use crate::backend::{BinaryOp, UnaryOp, View, elementwise};
use crate::base::{Error, Result};
use crate::tensor::{DType, Tensor, broadcast_shape};

/// `out = op(a, b)` with broadcasting, no autograd.
pub(crate) fn binary_forward(
    op: BinaryOp,
    a: &Tensor,
    b: &Tensor,
    name: &'static str,
) -> Result<Tensor> {
    check_pair(name, a, b)?;
    super::check_float(name, a)?;
    binary_kernel(op, a, b, a.dtype(), name)
}

/// `out = op(a, b)` in `dtype` with broadcasting, no autograd; the operands are checked.
fn binary_kernel(
    op: BinaryOp,
    a: &Tensor,
    b: &Tensor,
    dtype: DType,
    name: &'static str,
) -> Result<Tensor> {
    let shape = broadcast_shape(name, a.shape(), b.shape())?;
    let (la, lb) = (a.broadcast_layout(&shape)?, b.broadcast_layout(&shape)?);
    let out = Tensor::output_uninit(&shape, dtype, a.device(), name)?;
    elementwise::binary(
        op,
        View {
            storage: a.storage(),
            layout: &la,
        },
        View {
            storage: b.storage(),
            layout: &lb,
        },
        out.storage(),
    )?;
    Ok(out)
}

/// `out = op(x)`, no autograd.
pub(crate) fn unary_forward(op: UnaryOp, x: &Tensor, name: &'static str) -> Result<Tensor> {
    super::check_float(name, x)?;
    let out = Tensor::output_uninit(x.shape(), x.dtype(), x.device(), name)?;
    elementwise::unary(op, x.view(), out.storage())?;
    Ok(out)
}

/// PyTorch's type promotion for two float tensors of different dtypes on one device: F64
/// wins, else F32 (f32 with a half, or f16 with bf16), except that a 0-dim operand does not
/// widen a dimensioned one (bf16 (B, T, C) * f32 0-dim stays bf16). None when there is
/// nothing to promote; integer/float mixes and device mismatches stay errors (`check_pair`).
pub(crate) fn promoted_dtype(a: &Tensor, b: &Tensor) -> Option<DType> {
    let (da, db) = (a.dtype(), b.dtype());
    if da == db || !da.is_float() || !db.is_float() || a.device() != b.device() {
        return None;
    }
    Some(match (a.dims() == 0, b.dims() == 0) {
        (true, false) => db,
        (false, true) => da,
        _ if da == DType::F64 || db == DType::F64 => DType::F64,
        _ => DType::F32,
    })
}

/// Whether `a` and `b` are an f32 tensor and an f16/bf16 one (in either order) that promote
/// to f32: an add or subtract then reads the half one directly.
fn widened(a: &Tensor, b: &Tensor) -> bool {
    let half = |d: DType| matches!(d, DType::F16 | DType::BF16);
    let (da, db) = (a.dtype(), b.dtype());
    let f32_with_half = (da == DType::F32 && half(db)) || (db == DType::F32 && half(da));
    f32_with_half && promoted_dtype(a, b) == Some(DType::F32)
}

/// `a ± b` (op Add or Sub) for an f32 and an f16/bf16 operand (`widened`): one kernel reading
/// the half operand widened to f32, equal bit for bit to promoting it first. Backward: the
/// gradients of promotion then the op — g (negated for b of a Sub) summed to each operand's
/// shape, and cast to the half operand's dtype for it.
fn widened_op(a: &Tensor, b: &Tensor, op: BinaryOp, name: &'static str) -> Result<Tensor> {
    let out = binary_kernel(op, a, b, DType::F32, name)?;
    Ok(record_add_sub(a, b, out, op == BinaryOp::Sub, name))
}

/// Records `out = a + b` (`a - b` when `negate_b`) for autograd, however `out` was computed
/// (a fused kernel may write it): g (negated for b of a Sub) summed to each operand's shape,
/// and cast to each operand's dtype where it differs from out's.
pub(super) fn record_add_sub(
    a: &Tensor,
    b: &Tensor,
    out: Tensor,
    negate_b: bool,
    name: &'static str,
) -> Tensor {
    let (sa, sb) = (a.shape().to_vec(), b.shape().to_vec());
    let (da, db) = (a.dtype(), b.dtype());
    record(name, &[a, b], out, move |_, _| {
        move |g: &Tensor, n: &[bool]| {
            let gb = || {
                let g = if negate_b { g.neg()? } else { g.clone() };
                g.sum_to(&sb)?.to_dtype(db)
            };
            Ok(vec![
                grad_if(n[0], || g.sum_to(&sa)?.to_dtype(da))?,
                grad_if(n[1], gb)?,
            ])
        }
    })
}

/// Both operands in their promoted dtype (autograd-aware casts: each gradient comes back in
/// its operand's own dtype), or None when they need no promotion.
fn promoted(a: &Tensor, b: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
    promoted_dtype(a, b)
        .map(|d| Ok((a.to_dtype(d)?, b.to_dtype(d)?)))
        .transpose()
}

fn grad_if(need: bool, f: impl FnOnce() -> Result<Tensor>) -> Result<Option<Tensor>> {
    if need { f().map(Some) } else { Ok(None) }
}

fn saved_if(need: bool, t: &Tensor) -> Option<SavedTensor> {
    need.then(|| SavedTensor::new(t))
}

fn get(s: &Option<SavedTensor>) -> Tensor {
    // The closure saved exactly what the requested gradients read.
    super::unpack(s.as_ref().expect("saved tensor for a requested gradient"))
}

/// d(a^b)/db = a^b · ln a, taken as 0 where a == 0 (PyTorch's convention: the limit for
/// b > 0, instead of 0 · -inf = NaN).
fn exponent_grad_factor(a: &Tensor, y: &Tensor) -> Result<Tensor> {
    let zero = Tensor::scalar(0.0, a.dtype(), a.device())?;
    let at_zero = binary_forward(BinaryOp::Eq, a, &zero, "pow_backward")?.to_dtype(DType::U8)?;
    y.mul(&a.log()?)?.masked_fill(&at_zero, 0.0)
}

impl Tensor {
    /// a + b. Backward: (g, g), each summed to its input's shape.
    #[track_caller]
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if widened(self, other) {
            return widened_op(self, other, BinaryOp::Add, "add");
        }
        if let Some((a, b)) = promoted(self, other)? {
            return a.add(&b);
        }
        let out = binary_forward(BinaryOp::Add, self, other, "add")?;
        let (sa, sb) = (self.shape().to_vec(), other.shape().to_vec());
        Ok(record("add", &[self, other], out, move |_, _| {
            move |g: &Tensor, n: &[bool]| {
                Ok(vec![
                    grad_if(n[0], || g.sum_to(&sa))?,
                    grad_if(n[1], || g.sum_to(&sb))?,
                ])
            }
        }))
    }

    /// `self + other` (same shapes) recorded for autograd without computing its value: the
    /// output is a stand-in (`OutputValue::Skipped`), the backward that of `add`.
    pub(crate) fn add_graph_only(&self, other: &Tensor) -> Result<Tensor> {
        check_same_device("add", self, other)?;
        if self.shape() != other.shape() {
            return Err(Error::shape(
                "add",
                format!(
                    "an add whose value is skipped takes operands of one shape, not {:?} and {:?}",
                    self.shape(),
                    other.shape()
                ),
            ));
        }
        let dtype = promoted_dtype(self, other).unwrap_or(self.dtype());
        let out = skipped_output(self.shape(), dtype, self.device())?;
        Ok(record_add_sub(self, other, out, false, "add"))
    }

    /// a - b. Backward: (g, -g).
    #[track_caller]
    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if widened(self, other) {
            return widened_op(self, other, BinaryOp::Sub, "sub");
        }
        if let Some((a, b)) = promoted(self, other)? {
            return a.sub(&b);
        }
        let out = binary_forward(BinaryOp::Sub, self, other, "sub")?;
        let (sa, sb) = (self.shape().to_vec(), other.shape().to_vec());
        Ok(record("sub", &[self, other], out, move |_, _| {
            move |g: &Tensor, n: &[bool]| {
                Ok(vec![
                    grad_if(n[0], || g.sum_to(&sa))?,
                    grad_if(n[1], || g.neg()?.sum_to(&sb))?,
                ])
            }
        }))
    }

    /// a * b. Backward: (g * b, g * a); saves only the factor each gradient needs.
    #[track_caller]
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if let Some((a, b)) = promoted(self, other)? {
            return a.mul(&b);
        }
        let out = binary_forward(BinaryOp::Mul, self, other, "mul")?;
        let (sa, sb) = (self.shape().to_vec(), other.shape().to_vec());
        Ok(record("mul", &[self, other], out, |_, needs| {
            let (a, b) = (saved_if(needs[1], self), saved_if(needs[0], other));
            move |g: &Tensor, n: &[bool]| {
                Ok(vec![
                    grad_if(n[0], || g.mul(&get(&b))?.sum_to(&sa))?,
                    grad_if(n[1], || g.mul(&get(&a))?.sum_to(&sb))?,
                ])
            }
        }))
    }

    /// a / b. Backward: (g / b, -g * a / b²).
    #[track_caller]
    pub fn div(&self, other: &Tensor) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if let Some((a, b)) = promoted(self, other)? {
            return a.div(&b);
        }
        let out = binary_forward(BinaryOp::Div, self, other, "div")?;
        let (sa, sb) = (self.shape().to_vec(), other.shape().to_vec());
        Ok(record("div", &[self, other], out, |_, needs| {
            let (a, b) = (saved_if(needs[1], self), SavedTensor::new(other));
            move |g: &Tensor, n: &[bool]| {
                let b = &super::unpack(&b);
                Ok(vec![
                    grad_if(n[0], || g.div(b)?.sum_to(&sa))?,
                    grad_if(n[1], || {
                        g.mul(&get(&a))?.div(&b.mul(b)?)?.neg()?.sum_to(&sb)
                    })?,
                ])
            }
        }))
    }

    /// a ^ b elementwise. Backward: (g * b * a^(b-1), g * a^b * ln a).
    #[track_caller]
    pub fn pow(&self, other: &Tensor) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if let Some([a, b]) = super::autocast::cast_f32([self, other])? {
            return a.pow(&b);
        }
        if let Some((a, b)) = promoted(self, other)? {
            return a.pow(&b);
        }
        let out = binary_forward(BinaryOp::Pow, self, other, "pow")?;
        let (sa, sb) = (self.shape().to_vec(), other.shape().to_vec());
        Ok(record("pow", &[self, other], out, |out, needs| {
            let (a, b) = (SavedTensor::new(self), SavedTensor::new(other));
            let y = needs[1].then(|| SavedTensor::output(out));
            move |g: &Tensor, n: &[bool]| {
                let (a, b) = (&super::unpack(&a), &super::unpack(&b));
                Ok(vec![
                    grad_if(n[0], || {
                        g.mul(&b.mul(&a.pow(&b.add_scalar(-1.0)?)?)?)?.sum_to(&sa)
                    })?,
                    grad_if(n[1], || {
                        g.mul(&exponent_grad_factor(a, &get(&y))?)?.sum_to(&sb)
                    })?,
                ])
            }
        }))
    }

    /// x + c. Backward: g.
    #[track_caller]
    pub fn add_scalar(&self, c: f64) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let out = unary_forward(UnaryOp::AddScalar(c), self, "add_scalar")?;
        Ok(record("add_scalar", &[self], out, |_, _| {
            |g: &Tensor, _: &[bool]| Ok(vec![Some(g.clone())])
        }))
    }

    /// x - c.
    #[track_caller]
    pub fn sub_scalar(&self, c: f64) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.add_scalar(-c)
    }

    /// x * c. Backward: g * c.
    #[track_caller]
    pub fn mul_scalar(&self, c: f64) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let out = unary_forward(UnaryOp::MulScalar(c), self, "mul_scalar")?;
        Ok(record("mul_scalar", &[self], out, move |_, _| {
            move |g: &Tensor, _: &[bool]| Ok(vec![Some(g.mul_scalar(c)?)])
        }))
    }

    /// x / c.
    #[track_caller]
    pub fn div_scalar(&self, c: f64) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.mul_scalar(1.0 / c)
    }

    /// x ^ c. Backward: g * c * x^(c-1).
    #[track_caller]
    pub fn pow_scalar(&self, c: f64) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if let Some([x]) = super::autocast::cast_f32([self])? {
            return x.pow_scalar(c);
        }
        let out = unary_forward(UnaryOp::PowScalar(c), self, "pow_scalar")?;
        Ok(record("pow_scalar", &[self], out, |_, _| {
            let x = SavedTensor::new(self);
            move |g: &Tensor, _: &[bool]| {
                let x = super::unpack(&x);
                Ok(vec![Some(g.mul(&x.pow_scalar(c - 1.0)?.mul_scalar(c)?)?)])
            }
        }))
    }

    /// -x. Backward: -g.
    #[track_caller]
    pub fn neg(&self) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let out = unary_forward(UnaryOp::Neg, self, "neg")?;
        Ok(record("neg", &[self], out, |_, _| {
            |g: &Tensor, _: &[bool]| Ok(vec![Some(g.neg()?)])
        }))
    }
}
