//! Pointwise losses fused into single passes: MSE forward reduces (x - y)² without
//! materialising the difference; its backward writes 2 (x - y) · g / N directly.

use rayon::prelude::*;

use super::data::{CpuData, Elem, per_float_variant};
use super::{read, write};
use crate::backend::{FusedOp, Storage, View};
use crate::base::{Error, Result};

/// Elements per partial sum; partials are added in order, so results do not depend on the
/// number of threads.
const CHUNK: usize = 1 << 12;

pub(crate) fn run(op: &FusedOp, inputs: &[View], outputs: &[&Storage]) -> Result<()> {
    let contiguous = inputs.iter().all(|v| v.layout.is_contiguous());
    match (op, inputs, outputs) {
        (FusedOp::MseLoss, [x, y], [out]) if contiguous => mse(x, y, out),
        (FusedOp::MseLossBackward, [x, y, g], [gx]) if contiguous => mse_backward(x, y, g, gx),
        _ => Err(Error::invalid(
            "mse_loss",
            "expects contiguous inputs of the same shape",
        )),
    }
}

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

fn mse(x: &View, y: &View, out: &Storage) -> Result<()> {
    let (xd, yd) = (read(x.storage)?, read(y.storage)?);
    let n = x.layout.numel().max(1) as f64;
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

fn mse_backward(x: &View, y: &View, g: &View, gx: &Storage) -> Result<()> {
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
