//! Reductions over any set of dims of a strided input: the kept dims index the output, the
//! reduced dims are walked as a list of relative offsets. Sums accumulate in f64.

use rayon::prelude::*;

use super::data::{CpuData, Elem, with_float};
use super::elementwise::PAR_MIN;
use super::{CpuBackend, read, write};
use crate::backend::{ReduceKernels, ReduceOp, Storage, View};
use crate::base::Layout;
use crate::base::Result;

/// Elements summed sequentially before partial sums are combined.
const SUM_CHUNK: usize = 1 << 12;

/// The elements reduced into one output, relative to its base offset.
enum Inner {
    /// `n` consecutive elements (reduced dims trailing and contiguous): read as a slice.
    Contiguous(usize),
    Offsets(Vec<isize>),
}

/// Base offsets of each output element and the elements reduced into it.
fn plan(xl: &Layout, dims: &[usize]) -> (Vec<usize>, Inner) {
    let (shape, strides) = (xl.shape(), xl.strides());
    let kept: Vec<usize> = (0..shape.len()).filter(|d| !dims.contains(d)).collect();
    let outer = Layout::new(
        kept.iter().map(|&d| shape[d]).collect(),
        kept.iter().map(|&d| strides[d]).collect(),
        xl.offset(),
    );
    let inner = Layout::new(
        dims.iter().map(|&d| shape[d]).collect(),
        dims.iter().map(|&d| strides[d]).collect(),
        0,
    );
    let rel = if inner.is_contiguous() {
        Inner::Contiguous(inner.numel())
    } else {
        Inner::Offsets(relative_offsets(&inner))
    };
    (outer.offsets().collect(), rel)
}

/// Offsets (possibly negative strides) relative to the layout's offset 0.
fn relative_offsets(l: &Layout) -> Vec<isize> {
    let mut out = Vec::with_capacity(l.numel());
    let mut idx = vec![0usize; l.rank()];
    for _ in 0..l.numel() {
        out.push(
            idx.iter()
                .zip(l.strides())
                .map(|(&i, &s)| i as isize * s)
                .sum(),
        );
        for d in (0..l.rank()).rev() {
            idx[d] += 1;
            if idx[d] < l.shape()[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

fn reduce_one<T: Elem>(op: ReduceOp, x: &[T], base: usize, inner: &Inner) -> f64 {
    match inner {
        // An empty reduced dim has no elements to read (its base may point past the buffer).
        Inner::Contiguous(0) => reduce_values(op, &x[..0], |v: &T| Elem::to_f64(*v)),
        Inner::Contiguous(n) => reduce_values(op, &x[base..base + n], |v: &T| Elem::to_f64(*v)),
        Inner::Offsets(rel) => reduce_values(op, rel, |r: &isize| {
            x[(base as isize + r) as usize].to_f64()
        }),
    }
}

/// Reduces the values `get` reads from `items` (a slice of elements or of offsets).
fn reduce_values<I: Sync>(op: ReduceOp, items: &[I], get: impl Fn(&I) -> f64 + Sync) -> f64 {
    match op {
        ReduceOp::Sum => {
            // Fixed chunks added in order: the same bits on every run and thread count
            // (rayon's `sum` splits adaptively, so its rounding changed from run to run).
            // Starting from +0.0 as PyTorch does (`Iterator::sum` starts at -0.0).
            let part = |c: &[I]| c.iter().map(&get).fold(0.0, |acc, v| acc + v);
            let parts: Vec<f64> = if items.len() >= PAR_MIN {
                items.par_chunks(SUM_CHUNK).map(part).collect()
            } else {
                items.chunks(SUM_CHUNK).map(part).collect()
            };
            parts.into_iter().fold(0.0, |acc, v| acc + v)
        }
        ReduceOp::Max => items.iter().map(&get).fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Min => items.iter().map(&get).fold(f64::INFINITY, f64::min),
        ReduceOp::ArgMax => {
            let mut best = (0usize, f64::NEG_INFINITY);
            for (j, it) in items.iter().enumerate() {
                let v = get(it);
                if v > best.1 || v.is_nan() {
                    best = (j, v);
                }
            }
            best.0 as f64
        }
    }
}

pub(crate) fn reduce(
    op: ReduceOp,
    x: &CpuData,
    xl: &Layout,
    dims: &[usize],
    out: &mut CpuData,
) -> Result<()> {
    let (bases, rel) = plan(xl, dims);
    with_float!(x, "reduce", xv => {
        let value = |i: usize| reduce_one(op, xv, bases[i], &rel);
        match out {
            CpuData::I64(o) => fill_out(o, &value, |v| v as i64),
            other => with_float!(other, "reduce", o => fill_out(o, &value, Elem::from_f64)),
        }
    });
    Ok(())
}

fn fill_out<U: Send>(
    o: &mut [U],
    value: &(dyn Fn(usize) -> f64 + Sync),
    conv: impl Fn(f64) -> U + Sync,
) {
    if o.len() >= 64 {
        o.par_iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = conv(value(i)));
    } else {
        o.iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = conv(value(i)));
    }
}

impl ReduceKernels for CpuBackend {
    fn reduce(&self, op: ReduceOp, x: View, dims: &[usize], out: &Storage) -> Result<()> {
        let xd = read(x.storage)?;
        write(out, |o| reduce(op, &xd, x.layout, dims, o))
    }
}
