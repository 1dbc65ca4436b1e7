//! CPU kernels of the loss family (backend/loss.rs): cross-entropy over rows of class logits
//! (per-row log-sum-exp in f64, the mean added in row order) and the MSE fused into single
//! passes — forward reduces (x - y)² without materialising the difference, backward writes
//! 2 (x - y) · g / N directly. Arguments arrive validated; targets are checked here, before
//! anything is written, since that needs their values.

use half::{bf16, f16};
use rayon::prelude::*;

use super::CpuBackend;
use super::data::{CpuData, Elem, per_float_variant};
use super::elementwise::PAR_MIN;
use super::rows::{Inputs, dispatch, map_indices, max_and_log_sum, store_f64, typed, typed_mut};
use super::{read, write};
use crate::backend::loss::{
    CrossEntropy, CrossEntropyBackward, CrossEntropyWithGrad, LossKernels, MseLoss, MseLossBackward,
};
use crate::backend::{View, rows_cols};
use crate::base::DType;
use crate::base::{Error, Result};

/// Elements per partial sum; partials are added in order, so results do not depend on the
/// number of threads.
const CHUNK: usize = 1 << 12;

impl LossKernels for CpuBackend {
    fn cross_entropy(&self, a: &CrossEntropy) -> Result<()> {
        dispatch!(a.logits.storage.dtype(), "cross_entropy", cross_entropy(a))
    }
    fn cross_entropy_backward(&self, a: &CrossEntropyBackward) -> Result<()> {
        dispatch!(
            a.logits.storage.dtype(),
            "cross_entropy_backward",
            cross_entropy_backward(a)
        )
    }
    fn cross_entropy_with_grad(&self, a: &CrossEntropyWithGrad) -> Result<()> {
        dispatch!(
            a.logits.storage.dtype(),
            "cross_entropy",
            cross_entropy_with_grad(a)
        )
    }
    fn mse_loss(&self, a: &MseLoss) -> Result<()> {
        mse(&a.x, &a.y, a.loss)
    }
    fn mse_loss_backward(&self, a: &MseLossBackward) -> Result<()> {
        mse_backward(&a.x, &a.y, &a.gloss, a.gx)
    }
}

// ---- cross-entropy --------------------------------------------------------------------------

/// Every target is a class in [0, C) or the ignored index; the first one that is not is named.
fn check_targets(targets: &[i64], classes: usize, ignore_index: i64) -> Result<()> {
    let bad = targets
        .iter()
        .enumerate()
        .find(|&(_, &t)| t != ignore_index && (t < 0 || t as u64 >= classes as u64));
    match bad {
        None => Ok(()),
        Some((i, &t)) => Err(Error::Index {
            op: "cross_entropy",
            detail: format!(
                "target {t} at position {i} is not a class index: targets must be in [0, {classes}) or equal ignore_index ({ignore_index})"
            ),
        }),
    }
}

/// The elements a row-strided (R, C) view spans from its offset: (R - 1)·ld + C.
fn rows_span(rows: usize, c: usize, ld: usize) -> usize {
    if rows == 0 { 0 } else { (rows - 1) * ld + c }
}

/// Row `r` of rows `ld` apart.
fn strided_row<T>(v: &[T], r: usize, c: usize, ld: usize) -> &[T] {
    &v[r * ld..r * ld + c]
}

/// (rows, classes, row stride) of the logits (validated by the family).
fn logit_rows(v: &View) -> Result<(usize, usize, usize)> {
    let (rows, c) = rows_cols(v.layout);
    let ld = v
        .layout
        .row_stride()
        .ok_or_else(|| Error::invalid("cross_entropy", "the logits' rows are not evenly spaced"))?;
    Ok((rows, c, ld))
}

/// The logits' elements from their offset, as a slice of T.
fn logit_slice<'a, T: Elem>(d: &'a CpuData, v: &View) -> Result<&'a [T]> {
    let (rows, c, ld) = logit_rows(v)?;
    let off = v.layout.offset();
    let all = typed::<T>(d).ok_or_else(|| {
        Error::invalid(
            "cross_entropy",
            "the logits' storage is not of the logits' dtype",
        )
    })?;
    Ok(&all[off..off + rows_span(rows, c, ld)])
}

fn cross_entropy<T: Elem>(a: &CrossEntropy) -> Result<()> {
    const OP: &str = "cross_entropy";
    let ignore_index = a.ignore_index;
    let (rows, c, ld) = logit_rows(&a.logits)?;
    let tv = [a.targets];
    let ins = Inputs::read(&tv)?;
    let t = ins.i64s(OP, 0, rows)?;
    check_targets(t, c, ignore_index)?;
    let xd = read(a.logits.storage)?;
    let x = logit_slice::<T>(&xd, &a.logits)?;
    // Per row: log-sum-exp (saved for backward) and -log p(target) (0 when ignored).
    let per_row = map_indices(rows, rows * c, |r| {
        lse_and_nll(strided_row(x, r, c, ld), t[r], ignore_index)
    });
    drop(xd);
    let count = t.iter().filter(|&&v| v != ignore_index).count();
    // 0 / 0 = NaN when every target is ignored, as PyTorch's mean reduction.
    let loss = per_row.iter().map(|p| p.1).sum::<f64>() / count as f64;
    let lse: Vec<f64> = per_row.into_iter().map(|p| p.0).collect();
    store_f64(OP, a.loss, &[loss])?;
    store_f64(OP, a.lse, &lse)
}

/// A row's log-sum-exp and -log p(target) (0 when the target is ignored).
fn lse_and_nll<T: Elem>(xr: &[T], target: i64, ignore: i64) -> (f64, f64) {
    let (max, log_sum) = max_and_log_sum(xr);
    let lse = max + log_sum;
    let nll = if target == ignore {
        0.0
    } else {
        lse - xr[target as usize].to_f64()
    };
    (lse, nll)
}

/// One gradient row from its logits row: (softmax - onehot)·scale, rounded through f32 (as an
/// f32 softmax and a cast would), zeros for an ignored target. `x` may be `out` itself.
fn grad_row<T: Elem>(
    out: &mut [T],
    x: Option<&[T]>,
    target: i64,
    ignore: i64,
    lse: f64,
    scale: f64,
) {
    if target == ignore {
        out.fill(T::zero());
        return;
    }
    for j in 0..out.len() {
        let v = x.map_or(out[j], |x| x[j]);
        let p = T::exp_of(v.to_f64() - lse);
        let hot = if j as i64 == target { 1.0 } else { 0.0 };
        out[j] = T::round_through_f32((p - hot) * scale);
    }
}

fn cross_entropy_backward<T: Elem>(a: &CrossEntropyBackward) -> Result<()> {
    const OP: &str = "cross_entropy_backward";
    let ignore_index = a.ignore_index;
    let (rows, c, ld) = logit_rows(&a.logits)?;
    let views = [a.targets, a.lse, a.gloss];
    let ins = Inputs::read(&views)?;
    let t = ins.i64s(OP, 0, rows)?;
    check_targets(t, c, ignore_index)?;
    let lse = ins.f64s(OP, 1, rows)?;
    let gloss = ins.f64s(OP, 2, 1)?[0];
    let count = t.iter().filter(|&&v| v != ignore_index).count();
    let scale = gloss / count as f64;
    let (goff, span) = (a.glogits.layout.offset(), rows_span(rows, c, ld));
    let in_place = a.glogits.storage.same(a.logits.storage);
    let xd = if in_place {
        None
    } else {
        Some(read(a.logits.storage)?)
    };
    let x = xd
        .as_ref()
        .map(|d| logit_slice::<T>(d, &a.logits))
        .transpose()?;
    write(a.glogits.storage, |d| {
        let all = typed_mut::<T>(OP, d, a.glogits.storage.len())?;
        let gx = &mut all[goff..goff + span];
        map_rows_mut(gx, ld, rows * c, |r, gr| {
            let xr = x.map(|x| strided_row(x, r, c, ld));
            grad_row(&mut gr[..c], xr, t[r], ignore_index, lse[r], scale);
        });
        Ok(())
    })
}

/// `f(r, row)` for each row `ld` apart of `x` (the last may be shorter), in parallel once the
/// rows hold `work` >= PAR_MIN elements; the results in row order.
fn map_rows_mut<T: Send, R: Send>(
    x: &mut [T],
    ld: usize,
    work: usize,
    f: impl Fn(usize, &mut [T]) -> R + Sync + Send,
) -> Vec<R> {
    if work >= PAR_MIN {
        x.par_chunks_mut(ld)
            .enumerate()
            .map(|(r, row)| f(r, row))
            .collect()
    } else {
        x.chunks_mut(ld)
            .enumerate()
            .map(|(r, row)| f(r, row))
            .collect()
    }
}

/// Per row: the log-sum-exp and -log p(target) as `cross_entropy` computes them, then the
/// row overwritten by its gradient as `cross_entropy_backward` computes it — the same values,
/// bit for bit, from one visit of each row.
fn cross_entropy_with_grad<T: Elem>(a: &CrossEntropyWithGrad) -> Result<()> {
    const OP: &str = "cross_entropy";
    let ignore_index = a.ignore_index;
    let (rows, c, ld) = logit_rows(&a.logits)?;
    let views = [a.targets, a.gloss];
    let ins = Inputs::read(&views)?;
    let t = ins.i64s(OP, 0, rows)?;
    check_targets(t, c, ignore_index)?;
    let count = t.iter().filter(|&&v| v != ignore_index).count();
    let scale = ins.f64s(OP, 1, 1)?[0] / count as f64;
    let (off, span) = (a.logits.layout.offset(), rows_span(rows, c, ld));
    let nll = write(a.logits.storage, |d| {
        let all = typed_mut::<T>(OP, d, a.logits.storage.len())?;
        let x = &mut all[off..off + span];
        Ok(map_rows_mut(x, ld, rows * c, |r, xr| {
            let xr = &mut xr[..c];
            let (lse, nll) = lse_and_nll(xr, t[r], ignore_index);
            // The backward reads the log-sum-exp as the forward saved it: f32 statistics
            // below f64.
            let saved = if size_of::<T>() == 8 {
                lse
            } else {
                lse as f32 as f64
            };
            grad_row(xr, None, t[r], ignore_index, saved, scale);
            nll
        }))
    })?;
    // Added in row order, as `cross_entropy` adds them; 0 / 0 = NaN when all are ignored.
    store_f64(OP, a.loss, &[nll.iter().sum::<f64>() / count as f64])
}

// ---- MSE ------------------------------------------------------------------------------------

/// out = (a - b) · scale
fn scaled_diff<T: Elem>(out: &mut [T], a: &[T], b: &[T], scale: f64) {
    let s = T::from_f64(scale);
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(o, (p, q))| {
            o.iter_mut()
                .zip(p.iter().zip(q))
                .for_each(|(o, (&u, &v))| *o = (u - v) * s)
        });
}

/// The element slice a contiguous view covers.
fn span<'a, T>(v: &'a [T], view: &View) -> &'a [T] {
    let off = view.layout.offset();
    &v[off..off + view.layout.numel()]
}

fn mse(x: &View, y: &View, out: &crate::backend::Storage) -> Result<()> {
    let (xd, yd) = (read(x.storage)?, read(y.storage)?);
    // No elements: 0 / 0 = NaN, as PyTorch's mean reduction gives.
    let n = x.layout.numel() as f64;
    macro_rules! go {
        ($v:ident) => {{
            let (CpuData::$v(a), CpuData::$v(b)) = (&*xd, &*yd) else {
                return Err(mismatch());
            };
            let total = sum_sq_diff(span(a, x), span(b, y));
            write(out, |o| match o {
                CpuData::$v(o) => Ok(o[0] = Elem::from_f64(total / n)),
                _ => Err(mismatch()),
            })
        }};
    }
    per_float_variant!(
        &*xd,
        "mse_loss",
        "mse_loss needs floating-point tensors",
        go
    )
}

fn sum_sq_diff<T: Elem>(a: &[T], b: &[T]) -> f64 {
    let part = |(p, q): (&[T], &[T])| {
        p.iter().zip(q).fold(0.0f64, |acc, (&u, &v)| {
            let d = u.to_f64() - v.to_f64();
            acc + d * d
        })
    };
    let parts: Vec<f64> = a
        .par_chunks(CHUNK)
        .zip(b.par_chunks(CHUNK))
        .map(part)
        .collect();
    parts.into_iter().fold(0.0, |acc, v| acc + v)
}

fn mse_backward(x: &View, y: &View, g: &View, gx: &crate::backend::Storage) -> Result<()> {
    let (xd, yd, gd) = (read(x.storage)?, read(y.storage)?, read(g.storage)?);
    let scale = 2.0 * gd.get_f64(g.layout.offset()) / x.layout.numel().max(1) as f64;
    macro_rules! go {
        ($v:ident) => {{
            let (CpuData::$v(a), CpuData::$v(b)) = (&*xd, &*yd) else {
                return Err(mismatch());
            };
            let (a, b) = (span(a, x), span(b, y));
            write(gx, |o| match o {
                CpuData::$v(o) => Ok(scaled_diff(o, a, b, scale)),
                _ => Err(mismatch()),
            })
        }};
    }
    per_float_variant!(
        &*xd,
        "mse_loss",
        "mse_loss needs floating-point tensors",
        go
    )
}

fn mismatch() -> Error {
    Error::invalid(
        "mse_loss",
        "input, target and gradient must share one dtype",
    )
}
