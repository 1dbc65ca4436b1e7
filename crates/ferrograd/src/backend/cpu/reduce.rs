//! Reductions over any set of dims of a strided input: the kept dims index the output, the
//! reduced dims are walked in row-major order. Sums accumulate in f64. Nothing is allocated
//! beyond the output: offsets are computed as the walk goes (a list of them would be memory
//! the allocator never sees, as large as the input for an expanded view).

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
/// Partial sums computed in parallel at once (kept on the stack), then added in order.
const SUM_GROUP: usize = 256;

/// A set of dims walked in row-major order: (size, stride) pairs, outermost first.
#[derive(Clone, Debug)]
struct Walk {
    dims: Vec<(usize, isize)>,
}

impl Walk {
    fn new(l: &Layout, which: &[usize]) -> Walk {
        let dims = which
            .iter()
            .map(|&d| (l.shape()[d], l.strides()[d]))
            .collect();
        Walk { dims }
    }

    fn len(&self) -> usize {
        self.dims.iter().map(|&(n, _)| n).product()
    }

    /// Contiguous with unit stride: read as one slice.
    fn is_contiguous(&self) -> bool {
        let (shape, strides): (Vec<usize>, Vec<isize>) = self.dims.iter().copied().unzip();
        Layout::new(shape, strides, 0).is_contiguous()
    }

    /// The relative offset of the `i`-th element.
    fn offset_of(&self, mut i: usize) -> isize {
        let mut off = 0isize;
        for &(n, s) in self.dims.iter().rev() {
            off += (i % n) as isize * s;
            i /= n;
        }
        off
    }

    /// Calls `f` with the relative offsets of elements `start..start + count`, in order.
    fn for_each(&self, start: usize, count: usize, mut f: impl FnMut(isize)) {
        if count == 0 {
            return;
        }
        let rank = self.dims.len();
        let mut index: Vec<usize> = Vec::with_capacity(rank);
        let mut rest = start;
        for &(n, _) in self.dims.iter().rev() {
            index.push(rest % n);
            rest /= n;
        }
        index.reverse();
        let mut off = self.offset_of(start);
        for _ in 0..count {
            f(off);
            for d in (0..rank).rev() {
                let (n, s) = self.dims[d];
                index[d] += 1;
                off += s;
                if index[d] < n {
                    break;
                }
                off -= s * n as isize;
                index[d] = 0;
            }
        }
    }
}

/// The outputs (kept dims) and the elements reduced into each (reduced dims). Reduced dims of
/// stride 0 (an expanded view) repeat the same elements: they are not walked but counted in
/// `repeat` (a sum multiplies by it; max, min and argmax are unchanged by repeats), so the
/// sum of a broadcast over 10^15 elements costs what its distinct elements cost.
struct Plan {
    base: usize,
    outer: Walk,
    inner: Walk,
    inner_contiguous: bool,
    repeat: usize,
}

fn plan(xl: &Layout, dims: &[usize]) -> Plan {
    let kept: Vec<usize> = (0..xl.rank()).filter(|d| !dims.contains(d)).collect();
    let (repeated, walked): (Vec<usize>, Vec<usize>) =
        dims.iter().partition(|&&d| xl.strides()[d] == 0);
    let inner = Walk::new(xl, &walked);
    Plan {
        base: xl.offset(),
        outer: Walk::new(xl, &kept),
        inner_contiguous: inner.is_contiguous(),
        inner,
        repeat: repeated.iter().map(|&d| xl.shape()[d]).product(),
    }
}

impl Plan {
    /// Output `i`'s reduction.
    fn value<T: Elem>(&self, op: ReduceOp, x: &[T], i: usize) -> f64 {
        let n = self.inner.len();
        if n == 0 || self.repeat == 0 {
            return reduce_values(op, 0, |_, _, _: &mut dyn FnMut(f64)| {});
        }
        let base = (self.base as isize + self.outer.offset_of(i)) as usize;
        let value =
            if self.inner_contiguous {
                let items = &x[base..base + n];
                reduce_values(op, n, |start, count, f: &mut dyn FnMut(f64)| {
                    items[start..start + count]
                        .iter()
                        .for_each(|v| f(Elem::to_f64(*v)))
                })
            } else {
                reduce_values(op, n, |start, count, f: &mut dyn FnMut(f64)| {
                    self.inner.for_each(start, count, |r| {
                        f(x[(base as isize + r) as usize].to_f64())
                    })
                })
            };
        match op {
            ReduceOp::Sum if self.repeat > 1 => value * self.repeat as f64,
            _ => value,
        }
    }
}

/// Reduces `n` values; `visit(start, count, f)` calls `f` with values `start..start + count`
/// in order.
fn reduce_values<V>(op: ReduceOp, n: usize, visit: V) -> f64
where
    V: Fn(usize, usize, &mut dyn FnMut(f64)) + Sync,
{
    match op {
        ReduceOp::Sum => sum_in_chunks(n, &visit),
        ReduceOp::Max | ReduceOp::Min => {
            // NaN wins, as in PyTorch (f64::max would skip it).
            let pick = if op == ReduceOp::Max {
                f64::max
            } else {
                f64::min
            };
            let mut acc = if op == ReduceOp::Max {
                f64::NEG_INFINITY
            } else {
                f64::INFINITY
            };
            visit(0, n, &mut |v| {
                acc = if v.is_nan() || acc.is_nan() {
                    f64::NAN
                } else {
                    pick(acc, v)
                }
            });
            acc
        }
        ReduceOp::ArgMax => {
            // The first maximum, or the first NaN if there is one (PyTorch's argmax).
            let (mut best, mut best_v, mut j) = (0usize, f64::NEG_INFINITY, 0usize);
            visit(0, n, &mut |v| {
                if !best_v.is_nan() && (v > best_v || v.is_nan()) {
                    (best, best_v) = (j, v);
                }
                j += 1;
            });
            best as f64
        }
    }
}

/// Fixed chunks of SUM_CHUNK added in order: the same bits on every run and thread count
/// (rayon's `sum` splits adaptively, so its rounding changed from run to run). Starting from
/// +0.0 as PyTorch does (`Iterator::sum` starts at -0.0). Chunk sums are computed
/// SUM_GROUP at a time into a stack array, so no scratch grows with the input.
fn sum_in_chunks<V>(n: usize, visit: &V) -> f64
where
    V: Fn(usize, usize, &mut dyn FnMut(f64)) + Sync,
{
    let chunk_sum = |c: usize| {
        let start = c * SUM_CHUNK;
        let mut acc = 0.0;
        visit(start, SUM_CHUNK.min(n - start), &mut |v| acc += v);
        acc
    };
    let chunks = n.div_ceil(SUM_CHUNK);
    let mut total = 0.0;
    let mut parts = [0.0f64; SUM_GROUP];
    for first in (0..chunks).step_by(SUM_GROUP) {
        let group = &mut parts[..SUM_GROUP.min(chunks - first)];
        if n >= PAR_MIN {
            group
                .par_iter_mut()
                .enumerate()
                .for_each(|(k, p)| *p = chunk_sum(first + k));
        } else {
            group
                .iter_mut()
                .enumerate()
                .for_each(|(k, p)| *p = chunk_sum(first + k));
        }
        total = group.iter().fold(total, |acc, v| acc + v);
    }
    total
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
        && x.dtype() == out.dtype()
        && xl.is_contiguous()
        && 0 < lead
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
    let plan = plan(xl, dims);
    with_float!(x, "reduce", xv => {
        let value = |i: usize| plan.value(op, xv, i);
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
                let plan = plan(&l, &dims);
                let want: Vec<f32> = (0..cols)
                    .map(|i| plan.value(ReduceOp::Sum, &xs, i) as f32)
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
