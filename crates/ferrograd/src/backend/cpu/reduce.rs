//! Reductions over any set of dims of a strided input: the kept dims index the output, the
//! reduced dims are walked as a list of relative offsets. Sums accumulate in f64.

use rayon::prelude::*;

use super::data::{CpuData, Elem, with_float, with_float_pair};
use super::elementwise::PAR_MIN;
use super::vmath::simd_fn;
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
    let lead = dims.len();
    if op == ReduceOp::Sum
        && xl.is_contiguous()
        && lead < xl.rank()
        && dims.iter().enumerate().all(|(i, &d)| i == d)
    {
        // A sum over leading dims of a contiguous tensor (bias gradients): column sums of an
        // (R, N) matrix, walked row by row.
        let rows: usize = xl.shape()[..lead].iter().product();
        let n = xl.numel() / rows.max(1);
        let off = xl.offset();
        with_float_pair!(x, out, "reduce", xv, ov => {
            column_sums(&xv[off..off + rows * n], rows, ov)
        });
        return Ok(());
    }
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

/// out[j] = Σ_r x[r, j] for an (R, N) row-major `x`: each column summed in f64 in row order,
/// in chunks of SUM_CHUNK rows whose partial sums are then added in order, so the bits equal
/// the general path's. Column blocks run in parallel when the matrix is large.
fn column_sums<T: Elem>(x: &[T], rows: usize, out: &mut [T]) {
    let n = out.len();
    const BLOCK: usize = 64;
    let block = |b: usize, o: &mut [T]| {
        let (j0, w) = (b * BLOCK, o.len());
        let mut total = [0.0f64; BLOCK];
        let mut part = [0.0f64; BLOCK];
        for start in (0..rows).step_by(SUM_CHUNK) {
            part[..w].fill(0.0);
            for r in start..(start + SUM_CHUNK).min(rows) {
                add_row_v(&mut part[..w], &x[r * n + j0..r * n + j0 + w]);
            }
            total[..w]
                .iter_mut()
                .zip(&part[..w])
                .for_each(|(t, p)| *t += p);
        }
        o.iter_mut()
            .zip(&total[..w])
            .for_each(|(o, &t)| *o = T::from_f64(t));
    };
    if rows * n >= PAR_MIN && n > BLOCK {
        out.par_chunks_mut(BLOCK)
            .enumerate()
            .for_each(|(b, o)| block(b, o));
    } else {
        out.chunks_mut(BLOCK)
            .enumerate()
            .for_each(|(b, o)| block(b, o));
    }
}

#[inline(always)]
fn add_row<T: Elem>(acc: &mut [f64], x: &[T]) {
    acc.iter_mut().zip(x).for_each(|(a, &v)| *a += v.to_f64());
}
simd_fn!(fn add_row_v[T: Elem](acc: &mut [f64], x: &[T]) = add_row;);

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

#[cfg(test)]
mod tests {
    use super::*;

    /// The column-sum path gives the general path's bits (more than one SUM_CHUNK of rows).
    #[test]
    fn leading_dim_sums_match_the_general_path() {
        for shape in [vec![3, 5000, 70], vec![7, 1], vec![0, 4], vec![2, 3, 130]] {
            let l = Layout::contiguous(&shape);
            let n = l.numel();
            let xs: Vec<f32> = (0..n)
                .map(|i| ((i * 7919 % 1013) as f32 - 500.0) * 1e-3)
                .collect();
            let x = CpuData::F32(xs.clone());
            for lead in 1..shape.len() {
                let dims: Vec<usize> = (0..lead).collect();
                let cols: usize = shape[lead..].iter().product();
                let mut got = CpuData::F32(vec![f32::NAN; cols]);
                reduce(ReduceOp::Sum, &x, &l, &dims, &mut got).unwrap();
                let (bases, rel) = plan(&l, &dims);
                let want: Vec<f32> = (0..cols)
                    .map(|i| reduce_one(ReduceOp::Sum, &xs, bases[i], &rel) as f32)
                    .collect();
                let CpuData::F32(got) = got else {
                    unreachable!()
                };
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{shape:?} over {dims:?}");
            }
        }
    }
}
