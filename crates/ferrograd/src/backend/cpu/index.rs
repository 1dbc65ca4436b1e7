//! CPU kernels of the index family (backend/index.rs): gather rows by id (embedding forward), add rows into their
//! ids' rows in order (embedding backward), and pick elementwise by a U8 condition (where,
//! masked_fill). Every id is checked before anything is written, so a bad id leaves the
//! output untouched and comes back as an `Error::Index` that names it.
//!
//! Arguments arrive validated (backend/index.rs); the id values are checked here.

use rayon::prelude::*;

use super::CpuBackend;
use super::data::{CpuData, Elem, with_float_pair};
use super::elementwise::{PAR_MIN, at, for_each_out, rows};
use super::{CpuRead, read, write};
use crate::backend::index::{IndexAdd, IndexKernels, IndexSelect, Where};
use crate::backend::{Storage, View};
use crate::base::Layout;
use crate::base::{Error, Result};

impl IndexKernels for CpuBackend {
    fn index_select(&self, a: &IndexSelect) -> Result<()> {
        index_select(a.weight, a.ids, a.out)
    }
    fn index_add(&self, a: &IndexAdd) -> Result<()> {
        index_add(a.grad, a.ids, a.out)
    }
    fn select_where(&self, a: &Where) -> Result<()> {
        select_where(a.cond, a.a, a.b, a.out)
    }
}

/// A strided 2-D view: element (r, c) lives at `offset + r * rs + c * cs`.
struct Matrix {
    rows: usize,
    cols: usize,
    rs: isize,
    cs: isize,
    offset: usize,
}

impl Matrix {
    /// A validated 2-D layout (backend/index.rs checks the rank).
    fn of(l: &Layout) -> Matrix {
        let (shape, strides) = (l.shape(), l.strides());
        Matrix {
            rows: shape[0],
            cols: shape[1],
            rs: strides[0],
            cs: strides[1],
            offset: l.offset(),
        }
    }

    #[inline(always)]
    fn at(&self, r: usize, c: usize) -> usize {
        (self.offset as isize + r as isize * self.rs + c as isize * self.cs) as usize
    }
}

/// The ids (any layout, row-major order) as row numbers, each checked against `rows`.
fn row_ids(op: &'static str, ids: View, rows: usize) -> Result<Vec<usize>> {
    let d = read(ids.storage)?;
    let CpuData::I64(v) = &*d else {
        return Err(Error::UnsupportedDType {
            op,
            dtype: d.dtype(),
            hint: "indices must be int64 (DType::I64)",
        });
    };
    ids.layout
        .offsets()
        .enumerate()
        .map(|(pos, o)| {
            let id = v[o];
            usize::try_from(id).ok().filter(|&r| r < rows).ok_or_else(|| Error::Index {
                op,
                detail: format!(
                    "index {id} (at position {pos} of the ids) is out of range for {rows} rows; valid indices are 0..{rows}"
                ),
            })
        })
        .collect()
}

/// Runs `f(row index, row)` over the `cols`-wide rows of `out`, in parallel when large.
fn for_each_row<T: Send>(
    out: &mut [T],
    cols: usize,
    work: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    if cols == 0 {
        return;
    }
    if work >= PAR_MIN {
        out.par_chunks_mut(cols)
            .enumerate()
            .for_each(|(i, row)| f(i, row));
    } else {
        out.chunks_mut(cols)
            .enumerate()
            .for_each(|(i, row)| f(i, row));
    }
}

// ---- index select: out[i, :] = weight[ids[i], :] ---------------------------------------------

fn index_select(w: View, ids: View, out: &Storage) -> Result<()> {
    let m = Matrix::of(w.layout);
    let ids = row_ids("index_select", ids, m.rows)?;
    let wd = read(w.storage)?;
    write(out, |o| {
        with_float_pair!(&*wd, o, "index_select", wv, ov => gather(wv, &m, &ids, ov));
        Ok(())
    })
}

fn gather<T: Elem>(w: &[T], m: &Matrix, ids: &[usize], out: &mut [T]) {
    for_each_row(out, m.cols, out.len(), |i, row| {
        for (c, o) in row.iter_mut().enumerate() {
            *o = w[m.at(ids[i], c)];
        }
    });
}

// ---- index add: out[ids[p], :] += g[p, :] for p in order -------------------------------------

/// Positions grouped by the row they add into, each group in the original order (a stable
/// counting sort): row r receives `order[start[r]..start[r + 1]]`. Grouping lets rows run in
/// parallel while every row still adds its contributions in id order: deterministic.
struct Groups {
    start: Vec<usize>,
    order: Vec<usize>,
}

impl Groups {
    fn new(ids: &[usize], rows: usize) -> Groups {
        let mut start = vec![0usize; rows + 1];
        for &r in ids {
            start[r + 1] += 1;
        }
        for r in 0..rows {
            start[r + 1] += start[r];
        }
        let mut next = start.clone();
        let mut order = vec![0usize; ids.len()];
        for (p, &r) in ids.iter().enumerate() {
            order[next[r]] = p;
            next[r] += 1;
        }
        Groups { start, order }
    }

    fn of(&self, r: usize) -> &[usize] {
        &self.order[self.start[r]..self.start[r + 1]]
    }
}

fn index_add(g: View, ids: View, out: &Storage) -> Result<()> {
    let m = Matrix::of(g.layout);
    if m.cols == 0 {
        // Zero-width rows: nothing to add (and no row count to check the ids against).
        return Ok(());
    }
    let ids = row_ids("index_add", ids, out.len() / m.cols)?;
    let groups = Groups::new(&ids, out.len() / m.cols);
    let gd = read(g.storage)?;
    write(out, |o| {
        with_float_pair!(&*gd, o, "index_add", gv, ov => scatter_add(gv, &m, &groups, ov));
        Ok(())
    })
}

/// Sums in f64 (one rounding per output element), so half-precision gradients of frequent ids
/// do not lose their small contributions.
fn scatter_add<T: Elem>(g: &[T], m: &Matrix, groups: &Groups, out: &mut [T]) {
    let work = out.len() + m.rows * m.cols;
    for_each_row(out, m.cols, work, |r, row| {
        let positions = groups.of(r);
        if positions.is_empty() {
            return;
        }
        let mut acc: Vec<f64> = row.iter().map(|&x| Elem::to_f64(x)).collect();
        for &p in positions {
            for (c, a) in acc.iter_mut().enumerate() {
                *a += Elem::to_f64(g[m.at(p, c)]);
            }
        }
        for (o, a) in row.iter_mut().zip(acc) {
            *o = T::from_f64(a);
        }
    });
}

// ---- where: out = cond ? a : b -----------------------------------------------------------------

/// Read guards for views that may share a storage: each storage is locked once.
struct Reads<'a> {
    guards: Vec<CpuRead<'a>>,
    which: Vec<usize>,
}

impl<'a> Reads<'a> {
    fn new(views: &[View<'a>]) -> Result<Reads<'a>> {
        let mut storages: Vec<&Storage> = Vec::new();
        let mut guards = Vec::new();
        let mut which = Vec::new();
        for v in views {
            match storages.iter().position(|s| s.same(v.storage)) {
                Some(i) => which.push(i),
                None => {
                    storages.push(v.storage);
                    guards.push(read(v.storage)?);
                    which.push(guards.len() - 1);
                }
            }
        }
        Ok(Reads { guards, which })
    }

    fn get(&self, i: usize) -> &CpuData {
        &self.guards[self.which[i]]
    }
}

/// Runs `$body` with `$x`, `$y`, `$z` bound to three buffers of one element type (any dtype).
macro_rules! with_same3 {
    ($a:expr, $b:expr, $o:expr, $x:ident, $y:ident, $z:ident => $body:expr) => {
        match ($a, $b, $o) {
            (CpuData::F32($x), CpuData::F32($y), CpuData::F32($z)) => $body,
            (CpuData::F64($x), CpuData::F64($y), CpuData::F64($z)) => $body,
            (CpuData::F16($x), CpuData::F16($y), CpuData::F16($z)) => $body,
            (CpuData::BF16($x), CpuData::BF16($y), CpuData::BF16($z)) => $body,
            (CpuData::I64($x), CpuData::I64($y), CpuData::I64($z)) => $body,
            (CpuData::U8($x), CpuData::U8($y), CpuData::U8($z)) => $body,
            (a, b, o) => {
                let got = if a.dtype() != o.dtype() {
                    a.dtype()
                } else {
                    b.dtype()
                };
                return Err(Error::DType {
                    op: "where",
                    expected: o.dtype(),
                    got,
                });
            }
        }
    };
}

fn select_where(c: View, a: View, b: View, out: &Storage) -> Result<()> {
    let flat = c.layout.is_contiguous() && a.layout.is_contiguous() && b.layout.is_contiguous();
    let (rc, ra, rb) = (
        rows(c.layout, flat),
        rows(a.layout, flat),
        rows(b.layout, flat),
    );
    let reads = Reads::new(&[c, a, b])?;
    let CpuData::U8(cv) = reads.get(0) else {
        return Err(Error::UnsupportedDType {
            op: "where",
            dtype: reads.get(0).dtype(),
            hint: "the condition must be a U8 mask (0 = false, non-zero = true)",
        });
    };
    write(out, |o| {
        with_same3!(reads.get(1), reads.get(2), o, av, bv, ov => {
            for_each_out(ov.as_mut_slice(), &ra, |ch, row, off| {
                let (bc, ba, bb) = (rc.bases[row], ra.bases[row], rb.bases[row]);
                for (j, o) in ch.iter_mut().enumerate() {
                    let k = off + j;
                    *o = if at(cv, bc, rc.stride, k) != 0 { at(av, ba, ra.stride, k) } else { at(bv, bb, rb.stride, k) };
                }
            })
        });
        Ok(())
    })
}
