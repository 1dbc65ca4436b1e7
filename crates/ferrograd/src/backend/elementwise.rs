//! The elementwise family: unary and binary ops (already broadcast), in-place binary, copy
//! (with dtype conversion) and fill. Here: the op kinds, the `ElementwiseKernels` trait that
//! every backend implements, and the entry functions. The in-place entry points
//! (`binary_inplace`, `copy`, `fill`) bump the destination's version, so autograd sees every
//! in-place write. Not here: the kernels (backend/cpu/elementwise.rs,
//! backend/cuda/elementwise.rs + kernels/elementwise.cu).

use super::{Storage, View, backend, check};
use crate::base::{Error, Result};

/// Elementwise ops of one input. Scalar parameters travel inside the variant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryOp {
    Neg,
    Exp,
    Log,
    Sqrt,
    Tanh,
    Sigmoid,
    Relu,
    GeluTanh,
    GeluErf,
    Abs,
    /// x + c
    AddScalar(f64),
    /// x * c
    MulScalar(f64),
    /// x ^ c
    PowScalar(f64),
    /// 1 if x > 0 else 0, in x's dtype
    Step,
    /// min(max(x, lo), hi), NaN kept (torch.clamp); lo and hi rounded to x's dtype first
    Clamp {
        lo: f64,
        hi: f64,
    },
}

/// Elementwise ops of two inputs (already broadcast), of the output's dtype — or one of them
/// f16/bf16 beside an f32 output (see `binary`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Maximum,
    /// a + alpha * b (used by in-place accumulation and optimizer updates)
    AddScaled(f64),
    /// copy b into a (in-place only)
    Assign,
    /// grad * (y > 0): ReLU backward from the saved output
    ReluBackward,
    /// grad * (1 - y^2): tanh backward from the saved output
    TanhBackward,
    /// grad * y * (1 - y): sigmoid backward from the saved output
    SigmoidBackward,
    /// grad * gelu'(x), tanh approximation, from the saved input
    GeluTanhBackward,
    /// grad * gelu'(x), exact erf form, from the saved input
    GeluErfBackward,
    /// 1.0 where a == b else 0.0 (used by max backward)
    Eq,
}

/// The elementwise kernels of one device. Outputs are contiguous storages allocated by the
/// caller, never aliasing an input (except `binary_inplace`'s destination). Call them through
/// the entry functions below, which record in-place writes.
pub trait ElementwiseKernels {
    /// Copies `src` into the (possibly strided) region `dst` of the same shape, converting
    /// dtype if they differ. `dst` must not overlap `src`.
    fn copy(&self, src: View, dst: View) -> Result<()>;
    /// Every `copy(src, dst)` of `pairs` (disjoint destinations, none overlapping a source),
    /// with the results `copy` would give; a backend may run them in fewer launches.
    fn copy_many(&self, pairs: &[(View, View)]) -> Result<()> {
        pairs.iter().try_for_each(|&(src, dst)| self.copy(src, dst))
    }
    fn fill(&self, dst: &Storage, value: f64) -> Result<()>;
    /// Inverted dropout in one pass: `out[i] = x[i] · m_i`, with the mask value m_i = 1/keep
    /// (rounded to the dtype) where Philox's draw `philox::uniform(key, i)` is below `keep`,
    /// else 0; the product rounds once, as a multiply by a stored mask would. x is contiguous,
    /// of out's dtype and length (a float dtype, 0 < keep ≤ 1). The backward calls it again on
    /// the gradient with the same key, so no mask is ever stored.
    fn dropout_apply(&self, x: View, out: &Storage, keep: f64, key: u64) -> Result<()>;
    fn unary(&self, op: UnaryOp, x: View, out: &Storage) -> Result<()>;
    /// `a` and `b` are already broadcast to the output shape (stride 0 where stretched). One
    /// of them may be f16/bf16 when out is f32: it is read widened to f32 (exact).
    fn binary(&self, op: BinaryOp, a: View, b: View, out: &Storage) -> Result<()>;
    /// `dst = op(dst, src)` where `dst` is a whole contiguous storage and `src` is broadcast
    /// to its shape. `src` may share `dst`'s storage.
    fn binary_inplace(&self, op: BinaryOp, dst: &Storage, src: View) -> Result<()>;
}

/// Copies `src` into `dst` (see `ElementwiseKernels::copy`); bumps `dst`'s version.
pub fn copy(src: View, dst: View) -> Result<()> {
    check::on_device("copy", dst.storage.device(), [src.storage])?;
    same_count("copy", src, dst)?;
    backend(dst.storage.device())?.copy(src, dst)?;
    dst.storage.bump_version();
    Ok(())
}

/// `copy` of each (source, destination) pair, all on one device, in as few launches as the
/// backend manages (the GPU: one per dtype pair for contiguous casts); bumps each
/// destination's version.
pub fn copy_many(pairs: &[(View, View)]) -> Result<()> {
    let Some((_, first)) = pairs.first() else {
        return Ok(());
    };
    let device = first.storage.device();
    for &(src, dst) in pairs {
        check::on_device("copy_many", device, [src.storage, dst.storage])?;
        same_count("copy_many", src, dst)?;
    }
    backend(device)?.copy_many(pairs)?;
    pairs.iter().for_each(|(_, dst)| dst.storage.bump_version());
    Ok(())
}

/// A copy's source and destination must hold the same number of elements.
fn same_count(op: &'static str, src: View, dst: View) -> Result<()> {
    if dst.layout.numel() == src.layout.numel() {
        return Ok(());
    }
    Err(Error::shape(
        op,
        format!(
            "source shape {:?} and destination shape {:?} hold different element counts",
            src.layout.shape(),
            dst.layout.shape()
        ),
    ))
}

/// Sets every element of `dst` to `value`; bumps its version.
pub fn fill(dst: &Storage, value: f64) -> Result<()> {
    backend(dst.device())?.fill(dst, value)?;
    dst.bump_version();
    Ok(())
}

/// `out = x · mask` with the mask drawn from `key` (see `ElementwiseKernels::dropout_apply`):
/// the same key gives the same mask on every device. Bumps out's version.
pub fn dropout_apply(x: View, out: &Storage, keep: f64, key: u64) -> Result<()> {
    const OP: &str = "dropout";
    if !out.dtype().is_float() {
        return Err(Error::invalid(
            OP,
            format!("dropout needs a float tensor, not {}", out.dtype()),
        ));
    }
    if !(keep > 0.0 && keep <= 1.0) {
        return Err(Error::invalid(
            OP,
            format!("the kept fraction must be in (0, 1], got {keep}"),
        ));
    }
    check::on_device(OP, out.device(), [x.storage])?;
    check::same_dtype(OP, x.storage.dtype(), out.dtype())?;
    check::dense(OP, "the input", &x, out.len(), out.dtype())?;
    backend(out.device())?.dropout_apply(x, out, keep, key)?;
    out.bump_version();
    Ok(())
}

pub fn unary(op: UnaryOp, x: View, out: &Storage) -> Result<()> {
    check::on_device("unary", out.device(), [x.storage])?;
    check::same_dtype("unary", x.storage.dtype(), out.dtype())?;
    holds("unary", out, x.layout.numel())?;
    backend(out.device())?.unary(op, x, out)
}

/// `a` and `b` arrive broadcast to one shape; `out` holds that many elements. The operands
/// have out's dtype, except that one may be f16/bf16 when out is f32 (autocast's f32
/// residual stream plus a half-precision branch): the kernel reads it widened to f32, which
/// is exact, so the result equals casting it first and running the f32 op — without the
/// cast's kernel and buffer.
pub fn binary(op: BinaryOp, a: View, b: View, out: &Storage) -> Result<()> {
    check::on_device("binary", out.device(), [a.storage, b.storage])?;
    let (dtype, da, db) = (out.dtype(), a.storage.dtype(), b.storage.dtype());
    // At most one operand differs from out (f16 + bf16 needs a cast first).
    let both_differ = da != dtype && db != dtype;
    for d in [da, db] {
        if both_differ || !check::mixes_with(dtype, d) {
            check::same_dtype("binary", dtype, d)?;
        }
    }
    if a.layout.shape() != b.layout.shape() {
        return Err(Error::shape(
            "binary",
            format!(
                "operands must be broadcast to one shape first, got {:?} and {:?}",
                a.layout.shape(),
                b.layout.shape()
            ),
        ));
    }
    holds("binary", out, a.layout.numel())?;
    backend(out.device())?.binary(op, a, b, out)
}

/// `dst = op(dst, src)` (see `ElementwiseKernels::binary_inplace`); bumps `dst`'s version.
pub fn binary_inplace(op: BinaryOp, dst: &Storage, src: View) -> Result<()> {
    check::on_device("binary_inplace", dst.device(), [src.storage])?;
    check::same_dtype("binary_inplace", dst.dtype(), src.storage.dtype())?;
    if src.layout.numel() != dst.len() {
        return Err(Error::shape(
            "binary_inplace",
            format!(
                "source shape {:?} does not cover the destination's {} elements",
                src.layout.shape(),
                dst.len()
            ),
        ));
    }
    backend(dst.device())?.binary_inplace(op, dst, src)?;
    dst.bump_version();
    Ok(())
}

/// `out` has room for the `n` elements an op writes.
fn holds(op: &'static str, out: &Storage, n: usize) -> Result<()> {
    if out.len() < n {
        return Err(Error::invalid(
            op,
            format!(
                "output storage holds {} elements, the result has {n}",
                out.len()
            ),
        ));
    }
    Ok(())
}
