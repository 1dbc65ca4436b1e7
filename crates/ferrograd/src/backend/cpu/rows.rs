//! CPU kernels of the row family (backend/rows.rs): softmax and log-softmax, layer norm,
//! each with its backward. Every input is read as independent rows (R, N) of its last dim, so
//! rows run in parallel (rayon) once a tensor is large. Arguments arrive validated.
//!
//! Per-row statistics (max, sums of exponentials, mean, variance) accumulate in f64 whatever
//! the element type, with the max subtracted before exponentials. Sums across rows (weight
//! gradients) add fixed blocks of rows in order, so results do not depend on the thread
//! count. The row access helpers here are shared with the loss kernels (cross-entropy).
//!
//! Layer norm of f32 rows may write its output, and read its output's gradient, as f16/bf16
//! (autocast's residual stream feeding a half-precision matmul): values round through f32
//! exactly as the f32 kernel followed by a cast would store them.

use std::any::{Any, TypeId};

use half::{bf16, f16};
use rayon::prelude::*;

use super::CpuBackend;
use super::data::{CpuData, Elem, with_float};
use super::elementwise::PAR_MIN;
use super::vmath::{lane_sum, simd_fn};
use super::{CpuRead, read, write};
use crate::backend::rows::{
    LayerNorm, LayerNormBackward, Residual, RowKernels, Softmax, SoftmaxBackward,
};
use crate::backend::{Storage, View, rows_cols};
use crate::base::{DType, Layout};
use crate::base::{Error, Result};

/// Calls `$f::<T>(args)` with `T` the float element type named by `$dtype`.
/// (The element types are named at the call site: callers import half's f16 and bf16.)
macro_rules! dispatch {
    ($dtype:expr, $op:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::F16 => $f::<f16>($($arg),*),
            DType::BF16 => $f::<bf16>($($arg),*),
            dtype => Err(Error::UnsupportedDType {
                op: $op,
                dtype,
                hint: "this op needs a floating-point tensor; convert with .to_dtype(DType::F32)",
            }),
        }
    };
}
pub(super) use dispatch;

impl RowKernels for CpuBackend {
    fn softmax(&self, a: &Softmax) -> Result<()> {
        dispatch!(a.x.storage.dtype(), "softmax", softmax(a))
    }
    fn softmax_backward(&self, a: &SoftmaxBackward) -> Result<()> {
        dispatch!(a.y.storage.dtype(), "softmax_backward", softmax_backward(a))
    }
    fn layer_norm(&self, a: &LayerNorm) -> Result<()> {
        // A half output of f32 rows (the validator allows no other mix).
        match (a.x.storage.dtype(), a.y.dtype()) {
            (DType::F32, DType::F16) => layer_norm::<f32, f16>(a),
            (DType::F32, DType::BF16) => layer_norm::<f32, bf16>(a),
            (x, _) => dispatch!(x, "layer_norm", layer_norm_same(a)),
        }
    }
    fn layer_norm_backward(&self, a: &LayerNormBackward) -> Result<()> {
        const OP: &str = "layer_norm_backward";
        // The gradient of a half output of f32 rows (the validator allows no other mix).
        match (a.x.storage.dtype(), a.gy.storage.dtype()) {
            (DType::F32, DType::F16) => layer_norm_backward::<f32, f16>(a),
            (DType::F32, DType::BF16) => layer_norm_backward::<f32, bf16>(a),
            (x, _) => dispatch!(x, OP, layer_norm_backward_same(a)),
        }
    }
}

// ---- access to inputs and outputs -----------------------------------------------------------

/// The inputs, read-locked once per distinct storage: two views of one buffer share a guard
/// (locking one RwLock twice from a thread can deadlock behind a waiting writer).
pub(super) struct Inputs<'a> {
    views: &'a [View<'a>],
    guards: Vec<CpuRead<'a>>,
    slot: Vec<usize>,
}

impl<'a> Inputs<'a> {
    pub(super) fn read(views: &'a [View<'a>]) -> Result<Inputs<'a>> {
        let mut guards = Vec::new();
        let mut owners: Vec<&Storage> = Vec::new();
        let mut slot = Vec::with_capacity(views.len());
        for v in views {
            match owners.iter().position(|s| s.same(v.storage)) {
                Some(i) => slot.push(i),
                None => {
                    guards.push(read(v.storage)?);
                    owners.push(v.storage);
                    slot.push(guards.len() - 1);
                }
            }
        }
        Ok(Inputs {
            views,
            guards,
            slot,
        })
    }

    pub(super) fn data(&self, i: usize) -> &CpuData {
        &self.guards[self.slot[i]]
    }

    fn layout(&self, i: usize) -> &Layout {
        self.views[i].layout
    }

    fn dtype(&self, i: usize) -> DType {
        self.views.get(i).map_or(DType::F32, |v| v.storage.dtype())
    }

    /// The element range of input `i`, which must be contiguous with `len` elements.
    fn range(&self, op: &'static str, i: usize, len: usize) -> Result<std::ops::Range<usize>> {
        let l = self.layout(i);
        if !l.is_contiguous() || l.numel() != len || l.offset() + len > self.data(i).len() {
            return Err(Error::invalid(
                op,
                format!(
                    "input {i} must be contiguous with {len} elements, got shape {:?}",
                    l.shape()
                ),
            ));
        }
        Ok(l.offset()..l.offset() + len)
    }

    /// Input `i` as a contiguous slice of `len` elements of `T`.
    pub(super) fn slice<T: Elem>(&self, op: &'static str, i: usize, len: usize) -> Result<&[T]> {
        let r = self.range(op, i, len)?;
        match typed::<T>(self.data(i)) {
            Some(v) => Ok(&v[r]),
            None => Err(Error::DType {
                op,
                expected: self.dtype(0),
                got: self.dtype(i),
            }),
        }
    }

    /// Input `i` as I64 values (class targets).
    pub(super) fn i64s(&self, op: &'static str, i: usize, len: usize) -> Result<&[i64]> {
        let r = self.range(op, i, len)?;
        match self.data(i) {
            CpuData::I64(v) => Ok(&v[r]),
            other => Err(Error::DType {
                op,
                expected: DType::I64,
                got: other.dtype(),
            }),
        }
    }

    /// Input `i` widened to f64: the small per-row statistics and the scalar loss gradient,
    /// which may have a float dtype other than the rows'.
    pub(super) fn f64s(&self, op: &'static str, i: usize, len: usize) -> Result<Vec<f64>> {
        let r = self.range(op, i, len)?;
        let d = self.data(i);
        Ok(r.map(|k| d.get_f64(k)).collect())
    }
}

/// A host buffer as its elements, when they are of type `T`.
pub(super) fn typed<T: Elem>(d: &CpuData) -> Option<&[T]> {
    let any: &dyn Any = match d {
        CpuData::F32(v) => v,
        CpuData::F64(v) => v,
        CpuData::F16(v) => v,
        CpuData::BF16(v) => v,
        CpuData::I64(v) => v,
        CpuData::U8(v) => v,
    };
    any.downcast_ref::<Vec<T>>().map(Vec::as_slice)
}

/// An output buffer as a mutable slice of `T`, checked to hold `len` elements.
pub(super) fn typed_mut<'d, T: Elem>(
    op: &'static str,
    d: &'d mut CpuData,
    len: usize,
) -> Result<&'d mut [T]> {
    let dtype = d.dtype();
    let any: &mut dyn Any = match d {
        CpuData::F32(v) => v,
        CpuData::F64(v) => v,
        CpuData::F16(v) => v,
        CpuData::BF16(v) => v,
        CpuData::I64(v) => v,
        CpuData::U8(v) => v,
    };
    match any.downcast_mut::<Vec<T>>() {
        Some(v) if v.len() == len => Ok(v.as_mut_slice()),
        Some(v) => Err(Error::invalid(
            op,
            format!("output holds {} elements, expected {len}", v.len()),
        )),
        None => Err(Error::invalid(
            op,
            format!("output dtype {dtype} differs from the input's"),
        )),
    }
}

/// Writes f64 values into a float output of any dtype (statistics, losses).
pub(super) fn store_f64(op: &'static str, out: &Storage, values: &[f64]) -> Result<()> {
    write(out, |d| {
        if d.len() != values.len() {
            return Err(Error::invalid(
                op,
                format!(
                    "output holds {} elements, expected {}",
                    d.len(),
                    values.len()
                ),
            ));
        }
        with_float!(d, op, v => v.iter_mut().zip(values).for_each(|(o, &x)| *o = Elem::from_f64(x)));
        Ok(())
    })
}

// ---- row iteration --------------------------------------------------------------------------

/// Runs `f(r, out_row, scratch)` for each row `r` of `out` (`rows` rows of `n`) and returns
/// the results in row order. Rows run in parallel once `out` is large; each thread keeps one
/// f64 scratch buffer.
pub(super) fn map_rows<T: Send, U: Send>(
    out: &mut [T],
    rows: usize,
    n: usize,
    f: impl Fn(usize, &mut [T], &mut Vec<f64>) -> U + Sync + Send,
) -> Vec<U> {
    let mut scratch = Vec::new();
    if n == 0 {
        return (0..rows).map(|r| f(r, &mut [], &mut scratch)).collect();
    }
    if out.len() >= PAR_MIN && rows > 1 {
        out.par_chunks_mut(n)
            .enumerate()
            .map_init(Vec::new, |s, (r, o)| f(r, o, s))
            .collect()
    } else {
        out.chunks_mut(n)
            .enumerate()
            .map(|(r, o)| f(r, o, &mut scratch))
            .collect()
    }
}

/// `f(r)` for every row index, in parallel when the rows hold `work` >= PAR_MIN elements.
pub(super) fn map_indices<U: Send>(
    rows: usize,
    work: usize,
    f: impl Fn(usize) -> U + Sync + Send,
) -> Vec<U> {
    if work >= PAR_MIN && rows > 1 {
        (0..rows).into_par_iter().map(f).collect()
    } else {
        (0..rows).map(f).collect()
    }
}

#[inline]
pub(super) fn row<T>(v: &[T], r: usize, n: usize) -> &[T] {
    &v[r * n..(r + 1) * n]
}

/// (max, log Σ exp(x - max)) of a row; the log-sum-exp is their sum. All -inf (or NaN) rows
/// give NaN, as PyTorch's.
#[inline(always)]
pub(super) fn max_and_log_sum<T: Elem>(x: &[T]) -> (f64, f64) {
    let max = x
        .iter()
        .map(|&v| v.to_f64())
        .fold(f64::NEG_INFINITY, f64::max);
    let sum = lane_sum(x.len(), |j| T::exp_of(x[j].to_f64() - max));
    (max, sum.ln())
}

simd_fn!(fn softmax_row_v[T: Elem](log: bool, x: &[T], y: &mut [T], buf: &mut Vec<f64>) = softmax_row;);
simd_fn!(fn softmax_backward_row_v[T: Elem](log: bool, y: &[T], gy: &[T], gx: &mut [T]) = softmax_backward_row;);
simd_fn!(fn layer_norm_row_v[T: Elem, Y: Elem](x: &[T], w: Option<&[T]>, b: Option<&[T]>, eps: f64, y: &mut [Y]) -> (f64, f64) = layer_norm_row;);
simd_fn!(fn layer_norm_backward_row_v[T: Elem, G: Elem](x: &[T], gy: &[G], args: RowArgs<T>, gx: &mut [T], gh: &mut Vec<f64>) = layer_norm_backward_row;);

// ---- softmax --------------------------------------------------------------------------------

fn softmax<T: Elem>(a: &Softmax) -> Result<()> {
    const OP: &str = "softmax";
    let log = a.log;
    let views = [a.x];
    let ins = Inputs::read(&views)?;
    let (rows, n) = rows_cols(a.x.layout);
    let x = ins.slice::<T>(OP, 0, rows * n)?;
    write(a.y, |d| {
        let y = typed_mut::<T>(OP, d, rows * n)?;
        map_rows(y, rows, n, |r, yr, buf| {
            softmax_row_v(log, row(x, r, n), yr, buf)
        });
        Ok(())
    })
}

#[inline(always)]
fn softmax_row<T: Elem>(log: bool, x: &[T], y: &mut [T], buf: &mut Vec<f64>) {
    let max = x
        .iter()
        .map(|&v| v.to_f64())
        .fold(f64::NEG_INFINITY, f64::max);
    buf.clear();
    buf.extend(x.iter().map(|&v| v.to_f64() - max));
    if log {
        let log_sum = lane_sum(buf.len(), |j| T::exp_of(buf[j])).ln();
        y.iter_mut()
            .zip(buf.iter())
            .for_each(|(o, d)| *o = T::from_f64(d - log_sum));
    } else {
        buf.iter_mut().for_each(|d| *d = T::exp_of(*d));
        let inv = 1.0 / lane_sum(buf.len(), |j| buf[j]);
        y.iter_mut()
            .zip(buf.iter())
            .for_each(|(o, e)| *o = T::from_f64(e * inv));
    }
}

fn softmax_backward<T: Elem>(a: &SoftmaxBackward) -> Result<()> {
    const OP: &str = "softmax_backward";
    let log = a.log;
    let views = [a.y, a.gy];
    let ins = Inputs::read(&views)?;
    let (rows, n) = rows_cols(a.y.layout);
    let (y, gy) = (
        ins.slice::<T>(OP, 0, rows * n)?,
        ins.slice::<T>(OP, 1, rows * n)?,
    );
    write(a.gx, |d| {
        let gx = typed_mut::<T>(OP, d, rows * n)?;
        map_rows(gx, rows, n, |r, gr, _| {
            softmax_backward_row_v(log, row(y, r, n), row(gy, r, n), gr)
        });
        Ok(())
    })
}

#[inline(always)]
fn softmax_backward_row<T: Elem>(log: bool, y: &[T], gy: &[T], gx: &mut [T]) {
    let pairs = || y.iter().zip(gy).map(|(&a, &b)| (a.to_f64(), b.to_f64()));
    if log {
        let s = lane_sum(gy.len(), |j| gy[j].to_f64());
        gx.iter_mut()
            .zip(pairs())
            .for_each(|(o, (y, g))| *o = T::from_f64(g - T::exp_of(y) * s));
    } else {
        let s = lane_sum(y.len(), |j| y[j].to_f64() * gy[j].to_f64());
        gx.iter_mut()
            .zip(pairs())
            .for_each(|(o, (y, g))| *o = T::from_f64(y * (g - s)));
    }
}

// ---- layer norm -----------------------------------------------------------------------------

fn layer_norm_same<T: Elem>(a: &LayerNorm) -> Result<()> {
    layer_norm::<T, T>(a)
}

/// Rows of `T` normalised into an output of `Y` (`T`, or a half type for f32 rows). With a
/// residual branch, its sum with x is written first and normalised from there (the CPU has
/// no memory traffic to save by fusing the two passes).
fn layer_norm<T: Elem, Y: Elem>(a: &LayerNorm) -> Result<()> {
    let Some(res) = a.residual else {
        return layer_norm_rows::<T, Y>(a);
    };
    residual_sum::<T, Y>(a.x, res)?;
    let layout = Layout::contiguous(a.x.layout.shape());
    let s = View {
        storage: res.sum,
        layout: &layout,
    };
    layer_norm_rows::<T, Y>(&LayerNorm {
        x: s,
        residual: None,
        ..*a
    })
}

/// sum = x + h, each rounded in `T` as the add op rounds it (h widened to `T` exactly first).
fn residual_sum<T: Elem, Y: Elem>(x: View, res: Residual) -> Result<()> {
    const OP: &str = "layer_norm";
    let views = [x, res.h];
    let ins = Inputs::read(&views)?;
    let (rows, n) = rows_cols(x.layout);
    let (x, h) = (
        ins.slice::<T>(OP, 0, rows * n)?,
        ins.slice::<Y>(OP, 1, rows * n)?,
    );
    write(res.sum, |d| {
        let s = typed_mut::<T>(OP, d, rows * n)?;
        map_rows(s, rows, n, |r, sr, _| {
            sr.iter_mut()
                .zip(row(x, r, n).iter().zip(row(h, r, n)))
                .for_each(|(o, (&x, &h))| *o = x + T::from_f64(h.to_f64()));
        });
        Ok(())
    })
}

fn layer_norm_rows<T: Elem, Y: Elem>(a: &LayerNorm) -> Result<()> {
    const OP: &str = "layer_norm";
    let (eps, weight, bias) = (a.eps, a.weight.is_some(), a.bias.is_some());
    // [x, weight?, bias?]: one lock per distinct storage.
    let mut views = [a.x; 3];
    let params = a.weight.iter().chain(&a.bias);
    params.enumerate().for_each(|(i, v)| views[1 + i] = *v);
    let ins = Inputs::read(&views[..1 + weight as usize + bias as usize])?;
    let (rows, n) = rows_cols(a.x.layout);
    let x = ins.slice::<T>(OP, 0, rows * n)?;
    let w = weight.then(|| ins.slice::<T>(OP, 1, n)).transpose()?;
    let b = bias
        .then(|| ins.slice::<T>(OP, 1 + weight as usize, n))
        .transpose()?;
    let stats = write(a.y, |d| {
        let y = typed_mut::<Y>(OP, d, rows * n)?;
        Ok(map_rows(y, rows, n, |r, yr, _| {
            layer_norm_row_v(row(x, r, n), w, b, eps, yr)
        }))
    })?;
    let (mean, rstd): (Vec<f64>, Vec<f64>) = stats.into_iter().unzip();
    store_f64(OP, a.mean, &mean)?;
    store_f64(OP, a.rstd, &rstd)
}

/// An f64 result of a kernel over `T` stored as `Y`: rounded to `T` as `T`'s own output
/// would be, then converted as a cast of that output converts (nothing more when `Y` is `T`).
#[inline(always)]
fn store<T: Elem, Y: Elem>(v: f64) -> Y {
    if TypeId::of::<T>() == TypeId::of::<Y>() {
        Y::from_f64(v)
    } else {
        Y::from_f64(T::from_f64(v).to_f64())
    }
}

/// Normalises one row into `y`; returns (mean, rstd). Two passes: the variance of the
/// centred values, not E[x²] - E[x]², which cancels badly when |mean| >> std.
#[inline(always)]
fn layer_norm_row<T: Elem, Y: Elem>(
    x: &[T],
    w: Option<&[T]>,
    b: Option<&[T]>,
    eps: f64,
    y: &mut [Y],
) -> (f64, f64) {
    let n = x.len() as f64;
    let mean = lane_sum(x.len(), |j| x[j].to_f64()) / n;
    let var = lane_sum(x.len(), |j| (x[j].to_f64() - mean).powi(2)) / n;
    let rstd = 1.0 / (var + eps).sqrt();
    // One loop per case, no branch inside: each vectorises.
    let xhat = |v: T| (v.to_f64() - mean) * rstd;
    let out = y.iter_mut().zip(x);
    match (w, b) {
        (Some(w), Some(b)) => out
            .zip(w.iter().zip(b))
            .for_each(|((o, &v), (&w, &b))| *o = store::<T, Y>(xhat(v) * w.to_f64() + b.to_f64())),
        (Some(w), None) => out
            .zip(w)
            .for_each(|((o, &v), &w)| *o = store::<T, Y>(xhat(v) * w.to_f64())),
        (None, Some(b)) => out
            .zip(b)
            .for_each(|((o, &v), &b)| *o = store::<T, Y>(xhat(v) + b.to_f64())),
        (None, None) => out.for_each(|(o, &v)| *o = store::<T, Y>(xhat(v))),
    }
    (mean, rstd)
}

fn layer_norm_backward_same<T: Elem>(a: &LayerNormBackward) -> Result<()> {
    layer_norm_backward::<T, T>(a)
}

/// Gradients of rows of `T` from an output gradient of `G` (`T`, or a half type for f32
/// rows).
fn layer_norm_backward<T: Elem, G: Elem>(a: &LayerNormBackward) -> Result<()> {
    const OP: &str = "layer_norm_backward";
    let weight = a.weight.is_some();
    let k = weight as usize;
    // A prior in gx's own storage is read from gx as it is overwritten (a lock on it for
    // reading would block the write); any other is an input like gy.
    let in_place = a.prior.is_some_and(|p| std::ptr::eq(p.storage, a.gx));
    let prior = a.prior.filter(|_| !in_place);
    // [x, weight?, mean, rstd, gy, prior?]: one lock per distinct storage.
    let views: Vec<View> = [
        Some(a.x),
        a.weight,
        Some(a.mean),
        Some(a.rstd),
        Some(a.gy),
        prior,
    ]
    .into_iter()
    .flatten()
    .collect();
    let ins = Inputs::read(&views)?;
    let (rows, n) = rows_cols(a.x.layout);
    let x = ins.slice::<T>(OP, 0, rows * n)?;
    let w = weight.then(|| ins.slice::<T>(OP, 1, n)).transpose()?;
    let (mean, rstd) = (ins.f64s(OP, 1 + k, rows)?, ins.f64s(OP, 2 + k, rows)?);
    let gy = ins.slice::<G>(OP, 3 + k, rows * n)?;
    let prior = prior
        .map(|_| ins.slice::<T>(OP, 4 + k, rows * n))
        .transpose()?;
    let accumulate = a.prior.is_some();
    write(a.gx, |d| {
        let gx = typed_mut::<T>(OP, d, rows * n)?;
        map_rows(gx, rows, n, |r, gr, buf| {
            if let Some(p) = prior {
                gr.copy_from_slice(row(p, r, n));
            }
            let rs = RowStats {
                mean: mean[r],
                rstd: rstd[r],
            };
            let args = RowArgs {
                w,
                s: rs,
                accumulate,
            };
            layer_norm_backward_row_v(row(x, r, n), row(gy, r, n), args, gr, buf)
        });
        Ok(())
    })?;
    if a.gweight.is_some() || a.gbias.is_some() {
        let (gw, gb) = layer_norm_param_grads(x, gy, &mean, &rstd, rows, n);
        if let Some(out) = a.gweight {
            store_f64(OP, out, &gw)?;
        }
        if let Some(out) = a.gbias {
            store_f64(OP, out, &gb)?;
        }
    }
    Ok(())
}

#[derive(Clone, Copy)]
struct RowStats {
    mean: f64,
    rstd: f64,
}

/// What a layer-norm backward row reads besides x and gy: the weight, the row's statistics,
/// and whether gx already holds a prior gradient to add to.
struct RowArgs<'a, T> {
    w: Option<&'a [T]>,
    s: RowStats,
    accumulate: bool,
}

/// gx = rstd (ĝ - mean(ĝ) - x̂ mean(ĝ x̂)) with x̂ = (x - mean) rstd and ĝ = gy · weight;
/// prior + that when accumulating.
#[inline(always)]
fn layer_norm_backward_row<T: Elem, G: Elem>(
    x: &[T],
    gy: &[G],
    args: RowArgs<T>,
    gx: &mut [T],
    gh: &mut Vec<f64>,
) {
    let RowArgs { w, s, accumulate } = args;
    let n = x.len() as f64;
    let xhat = |v: T| (v.to_f64() - s.mean) * s.rstd;
    gh.clear();
    match w {
        Some(w) => gh.extend(gy.iter().zip(w).map(|(&g, &w)| g.to_f64() * w.to_f64())),
        None => gh.extend(gy.iter().map(|&g| g.to_f64())),
    }
    let gh = &gh[..x.len()];
    let mean_g = lane_sum(gh.len(), |j| gh[j]) / n;
    let mean_gx = lane_sum(gh.len(), |j| gh[j] * xhat(x[j])) / n;
    let local = |g: f64, v: T| T::from_f64(s.rstd * (g - mean_g - xhat(v) * mean_gx));
    let outs = gx.iter_mut().zip(gh.iter().zip(x));
    if accumulate {
        // Rounded as `prior + local` in T, what the engine's separate add would store.
        outs.for_each(|(o, (&g, &v))| *o = *o + local(g, v));
    } else {
        outs.for_each(|(o, (&g, &v))| *o = local(g, v));
    }
}

/// (Σ_r gy x̂, Σ_r gy) per column. Fixed blocks of rows are summed in parallel, then the
/// blocks in order, so the result does not depend on scheduling.
fn layer_norm_param_grads<T: Elem, G: Elem>(
    x: &[T],
    gy: &[G],
    mean: &[f64],
    rstd: &[f64],
    rows: usize,
    n: usize,
) -> (Vec<f64>, Vec<f64>) {
    let block = (PAR_MIN / n.max(1)).max(1);
    let partial = |start: usize| {
        let (mut gw, mut gb) = (vec![0.0; n], vec![0.0; n]);
        for r in start..(start + block).min(rows) {
            for (j, (&xv, &g)) in row(x, r, n).iter().zip(row(gy, r, n)).enumerate() {
                let g = g.to_f64();
                gw[j] += g * (xv.to_f64() - mean[r]) * rstd[r];
                gb[j] += g;
            }
        }
        (gw, gb)
    };
    let starts: Vec<usize> = (0..rows).step_by(block).collect();
    let parts: Vec<(Vec<f64>, Vec<f64>)> = if starts.len() > 1 {
        starts.par_iter().map(|&s| partial(s)).collect()
    } else {
        starts.iter().map(|&s| partial(s)).collect()
    };
    let (mut gw, mut gb) = (vec![0.0; n], vec![0.0; n]);
    for (pw, pb) in parts {
        gw.iter_mut().zip(pw).for_each(|(a, b)| *a += b);
        gb.iter_mut().zip(pb).for_each(|(a, b)| *a += b);
    }
    (gw, gb)
}
