//! The loss family: cross-entropy over class logits and the mean squared error, each with its
//! backward, fused into single kernels, and cross-entropy's loss and gradient in one call (the
//! fused classifier's). Here: the typed arguments, their one validator, the
//! `LossKernels` trait that every backend implements, and the entry functions (validate once,
//! then dispatch). Class targets are checked against the class count by the kernels (that
//! needs their values), before anything is written. Not here: the kernels
//! (backend/cpu/loss.rs, backend/cuda/loss.rs + kernels/loss.cu).

use super::check::{self, rows_cols};
use super::{Storage, View, backend};
use crate::base::DType;
use crate::base::{Error, Result};

/// Mean over targets != ignore_index of `-log softmax(logits)[target]` (NaN when all are
/// ignored). logits (R, C) rows of unit stride, evenly spaced (contiguous, or padded to the
/// GEMM's aligned row stride); targets I64 (R) contiguous, each in [0, C) or
/// ignore_index (else `Error::Index` naming it); loss () and lse (R) of any float dtype.
pub struct CrossEntropy<'a> {
    pub logits: View<'a>,
    pub targets: View<'a>,
    pub loss: &'a Storage,
    pub lse: &'a Storage,
    pub ignore_index: i64,
}

/// glogits (R, C) = (softmax - onehot) · gloss / count, zero rows where the target is ignored,
/// computed in f32 precision or wider and rounded once to the logits' dtype (what an f32
/// softmax followed by a cast gives). lse (R) as saved by the forward; gloss () of any float
/// dtype. glogits has the logits' row layout and may be the logits themselves (the fused
/// classifier overwrites logits nothing else reads).
pub struct CrossEntropyBackward<'a> {
    pub logits: View<'a>,
    pub targets: View<'a>,
    pub lse: View<'a>,
    pub gloss: View<'a>,
    pub glogits: View<'a>,
    pub ignore_index: i64,
}

/// `CrossEntropy`'s loss, then the logits overwritten by `CrossEntropyBackward`'s gradient
/// for the loss gradient gloss, in one call: the fused classifier's chunk, whose logits nothing
/// else reads. Where the backend can, one pass per row (the logits cross memory once each way);
/// no log-sum-exp is kept.
pub struct CrossEntropyWithGrad<'a> {
    pub logits: View<'a>,
    pub targets: View<'a>,
    pub loss: &'a Storage,
    pub gloss: View<'a>,
    pub ignore_index: i64,
}

/// loss () = mean((x - y)²) in one pass; x, y contiguous of one shape and float dtype.
pub struct MseLoss<'a> {
    pub x: View<'a>,
    pub y: View<'a>,
    pub loss: &'a Storage,
}

/// gx = 2 (x - y) · gloss / N in one pass; gloss () of any float dtype.
pub struct MseLossBackward<'a> {
    pub x: View<'a>,
    pub y: View<'a>,
    pub gloss: View<'a>,
    pub gx: &'a Storage,
}

/// The loss kernels of one device. Arguments arrive validated (entry functions below).
pub trait LossKernels {
    fn cross_entropy(&self, a: &CrossEntropy) -> Result<()>;
    fn cross_entropy_backward(&self, a: &CrossEntropyBackward) -> Result<()>;
    fn cross_entropy_with_grad(&self, a: &CrossEntropyWithGrad) -> Result<()>;
    fn mse_loss(&self, a: &MseLoss) -> Result<()>;
    fn mse_loss_backward(&self, a: &MseLossBackward) -> Result<()>;
}

pub fn cross_entropy(a: &CrossEntropy) -> Result<()> {
    const OP: &str = "cross_entropy";
    let device = a.loss.device();
    check::on_device(OP, device, [a.logits.storage, a.targets.storage, a.lse])?;
    let (rows, _) = logits_and_targets(OP, &a.logits, &a.targets)?;
    check::out_float(OP, a.loss, 1)?;
    check::out_float(OP, a.lse, rows)?;
    backend(device)?.cross_entropy(a)
}

pub fn cross_entropy_backward(a: &CrossEntropyBackward) -> Result<()> {
    const OP: &str = "cross_entropy_backward";
    let device = a.glogits.storage.device();
    let ins = [a.logits, a.targets, a.lse, a.gloss];
    check::on_device(OP, device, ins.iter().map(|v| v.storage))?;
    let (rows, _) = logits_and_targets(OP, &a.logits, &a.targets)?;
    check::dense_float(OP, "lse", &a.lse, rows)?;
    check::dense_float(OP, "the loss gradient", &a.gloss, 1)?;
    check::same_dtype(OP, a.logits.storage.dtype(), a.glogits.storage.dtype())?;
    let same_rows = a.glogits.layout.shape() == a.logits.layout.shape()
        && a.glogits.layout.row_stride() == a.logits.layout.row_stride();
    if !same_rows {
        return Err(crate::base::Error::invalid(
            OP,
            "the logits' gradient must have the logits' shape and row stride",
        ));
    }
    check::within(OP, &a.glogits)?;
    backend(device)?.cross_entropy_backward(a)
}

pub fn cross_entropy_with_grad(a: &CrossEntropyWithGrad) -> Result<()> {
    const OP: &str = "cross_entropy";
    let device = a.loss.device();
    let ins = [a.logits, a.targets, a.gloss];
    check::on_device(OP, device, ins.iter().map(|v| v.storage))?;
    logits_and_targets(OP, &a.logits, &a.targets)?;
    check::out_float(OP, a.loss, 1)?;
    check::dense_float(OP, "the loss gradient", &a.gloss, 1)?;
    backend(device)?.cross_entropy_with_grad(a)
}

/// (R, C) of float logits read as evenly spaced rows of their last dim, with R contiguous
/// I64 targets.
fn logits_and_targets(op: &'static str, logits: &View, targets: &View) -> Result<(usize, usize)> {
    let dtype = logits.storage.dtype();
    check::float(op, dtype)?;
    let (rows, c) = rows_cols(logits.layout);
    if logits.layout.row_stride().is_none() {
        return Err(crate::base::Error::invalid(
            op,
            format!(
                "the logits must be rows of unit stride, evenly spaced; got shape {:?} strides {:?} (make them contiguous)",
                logits.layout.shape(),
                logits.layout.strides()
            ),
        ));
    }
    check::within(op, logits)?;
    check::dense(op, "the targets", targets, rows, DType::I64)?;
    Ok((rows, c))
}

pub fn mse_loss(a: &MseLoss) -> Result<()> {
    const OP: &str = "mse_loss";
    let device = a.loss.device();
    check::on_device(OP, device, [a.x.storage, a.y.storage])?;
    let (_, dtype) = pair(OP, &a.x, &a.y)?;
    check::out(OP, a.loss, 1, dtype)?;
    backend(device)?.mse_loss(a)
}

pub fn mse_loss_backward(a: &MseLossBackward) -> Result<()> {
    const OP: &str = "mse_loss";
    let device = a.gx.device();
    check::on_device(OP, device, [a.x.storage, a.y.storage, a.gloss.storage])?;
    let (n, dtype) = pair(OP, &a.x, &a.y)?;
    check::dense_float(OP, "the loss gradient", &a.gloss, 1)?;
    check::out(OP, a.gx, n, dtype)?;
    backend(device)?.mse_loss_backward(a)
}

/// (numel, dtype) of an input/target pair: contiguous, one float dtype and size.
fn pair(op: &'static str, x: &View, y: &View) -> Result<(usize, DType)> {
    let dtype = x.storage.dtype();
    check::float(op, dtype)?;
    let n = x.layout.numel();
    check::dense(op, "the input", x, n, dtype)?;
    check::dense(op, "the target", y, n, dtype)?;
    Ok((n, dtype))
}

/// Every target is a class in [0, C) or the ignored index (the first that is not is named);
/// returns how many are not ignored.
pub(crate) fn check_class_targets(
    targets: &[i64],
    classes: usize,
    ignore_index: i64,
) -> Result<usize> {
    let bad = targets
        .iter()
        .enumerate()
        .find(|&(_, &t)| t != ignore_index && (t < 0 || t as u64 >= classes as u64));
    if let Some((i, &t)) = bad {
        return Err(Error::Index {
            op: "cross_entropy",
            detail: format!(
                "target {t} at position {i} is not a class index: targets must be in [0, {classes}) or equal ignore_index ({ignore_index})"
            ),
        });
    }
    Ok(targets.iter().filter(|&&t| t != ignore_index).count())
}
