//! CUDA launchers of the index family (backend/index.rs; kernels in kernels/index.cu):
//! gather rows by id, deterministic scatter-add (one block per destination row, positions in
//! id order), and `where` over strided operands. Arguments arrive validated. Integer ids are
//! copied to the host and checked there before any kernel runs, so a bad one is an
//! `Error::Index` naming it and nothing is written, as on the CPU (one synchronisation per
//! such op).

use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::launch::{
    Arg, BLOCK, MAX_ROW_BLOCKS, Module, addr, host_i64s, i64_of, launch, merge_dims_n, suffix,
    upload_words,
};
use super::{CudaDevice, ptr};
use crate::backend::View;
use crate::backend::capture::{self, IdCheck};
use crate::backend::index::check_row_ids;
use crate::backend::index::{IndexAdd, IndexKernels, IndexSelect, Where};
use crate::base::{DType, Layout};
use crate::base::{Error, Result};

pub(super) static KERNELS: Module = Module::new("index", include_str!("kernels/index.cu"));
/// Dims a `where` handles after merging (WHERE_MAX_DIMS in index.cu).
const WHERE_MAX_DIMS: usize = 8;

impl IndexKernels for CudaDevice {
    fn index_select(&self, a: &IndexSelect) -> Result<()> {
        index_select(self, a)
    }
    fn index_add(&self, a: &IndexAdd) -> Result<()> {
        index_add(self, a)
    }
    fn select_where(&self, a: &Where) -> Result<()> {
        select_where(self, a)
    }
}

/// Shape and per-operand strides of a `where` (struct WhereArgs in index.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct WhereArgs {
    shape: [i64; WHERE_MAX_DIMS],
    sc: [i64; WHERE_MAX_DIMS],
    sa: [i64; WHERE_MAX_DIMS],
    sb: [i64; WHERE_MAX_DIMS],
    rank: i32,
}

// SAFETY: a plain #[repr(C)] struct of integers, laid out as its C++ twin.
unsafe impl DeviceRepr for WhereArgs {}

// ---- index select / index add -----------------------------------------------------------------

/// A validated strided (rows, cols) view: (rows, cols, row stride, col stride).
fn matrix(l: &Layout) -> (usize, usize, i64, i64) {
    let (shape, strides) = (l.shape(), l.strides());
    (shape[0], shape[1], strides[0] as i64, strides[1] as i64)
}

/// The ids read back and checked against `rows`, in row-major order.
fn row_ids(d: &CudaDevice, op: &'static str, ids: &View, rows: usize) -> Result<Vec<i64>> {
    let values = host_i64s(d, ids)?;
    check_row_ids(op, &values, rows)?;
    // A capture notes the check, to run it again on the values of each replay.
    capture::note_ids(ptr(ids.storage)?, ids.layout, IdCheck::Rows { rows });
    Ok(values)
}

/// Kernel suffix of an element size (the gather and `where` move bits, whatever the type).
fn size_suffix(dtype: DType) -> &'static str {
    match dtype.size_in_bytes() {
        1 => "1",
        2 => "2",
        4 => "4",
        _ => "8",
    }
}

/// out[p, :] = weight[ids[p], :]
fn index_select(d: &CudaDevice, a: &IndexSelect) -> Result<()> {
    const OP: &str = "index_select";
    let (w, o) = (&a.weight, a.out);
    let (rows, cols, rs, cs) = matrix(w.layout);
    let ids = row_ids(d, OP, &a.ids, rows)?;
    let dtype = w.storage.dtype();
    if ids.is_empty() || cols == 0 {
        return Ok(());
    }
    // Contiguous ids are read in place; others go up as the row-major copy just checked.
    let id_view = &a.ids;
    let staged;
    let id_addr = if id_view.layout.is_contiguous() {
        addr(id_view)?
    } else {
        // Uploaded by value: a replayed graph would read the captured step's ids.
        capture::refuse("index_select reads its ids through a non-contiguous view");
        staged = upload_words(d, &ids, "index_select")?;
        staged.addr()
    };
    let args = [
        Arg::Ptr(addr(w)?),
        Arg::I64(rs),
        Arg::I64(cs),
        Arg::Ptr(id_addr),
        Arg::Ptr(ptr(o)?),
        i64_of(ids.len()),
        i64_of(cols),
    ];
    let name = format!("index_select_{}", size_suffix(dtype));
    launch(
        d,
        &KERNELS,
        &name,
        CudaDevice::grid_1d(ids.len() * cols),
        &args,
    )
}

/// Positions grouped by destination row (a stable counting sort), flattened for the kernel:
/// [group count, dest rows (`capacity` slots), group starts (`capacity` + 1), positions (N)],
/// only rows that receive something, unused slots zero; the capacity is the group count
/// when None. Returns the table and its capacity, or None when the groups outnumber it.
fn group_table(ids: &[i64], capacity: Option<usize>) -> Option<(Vec<i64>, usize)> {
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&p| ids[p]); // stable: positions of one row stay in id order
    let mut dest = Vec::new();
    let mut start = Vec::new();
    for (k, &p) in order.iter().enumerate() {
        if dest.last() != Some(&ids[p]) {
            dest.push(ids[p]);
            start.push(k as i64);
        }
    }
    let count = dest.len();
    let capacity = capacity.unwrap_or(count);
    if count > capacity {
        return None;
    }
    dest.resize(capacity, 0);
    start.resize(capacity + 1, ids.len() as i64);
    let words = std::iter::once(count as i64)
        .chain(dest)
        .chain(start)
        .chain(order.into_iter().map(|p| p as i64))
        .collect();
    Some((words, capacity))
}

fn too_many_groups() -> Error {
    Error::invalid("index_add", "more id groups than the table holds")
}

/// gweight[ids[p], :] += g[p, :] for p in order, one block per destination row.
///
/// The grouping is made on the host from the ids. A captured step reads it from a buffer of
/// its own, sized for the most groups the ids can make (one per id, at most one per row),
/// which the graph makes again from each replay's ids (`capture::note_derived_buffer`).
fn index_add(d: &CudaDevice, a: &IndexAdd) -> Result<()> {
    const OP: &str = "index_add";
    let (g, o) = (&a.grad, a.out);
    let (n, cols, rs, cs) = matrix(g.layout);
    let s = suffix(OP, g.storage.dtype())?;
    if cols == 0 {
        // Zero-width rows: nothing to add (and no row count to check the ids against).
        return Ok(());
    }
    let rows = o.len() / cols;
    let ids = row_ids(d, OP, &a.ids, rows)?;
    if n == 0 {
        return Ok(());
    }
    let room = d.is_capturing().then_some(n.min(rows));
    let (words, capacity) = group_table(&ids, room).ok_or_else(too_many_groups)?;
    let table = d.step_buffer(&words, OP)?;
    let derive = move |ids: &[i64]| -> Result<Vec<i64>> {
        check_row_ids(OP, ids, rows)?;
        Ok(group_table(ids, Some(capacity))
            .ok_or_else(too_many_groups)?
            .0)
    };
    let ids_at = ptr(a.ids.storage)?;
    capture::note_derived_buffer(table.addr(), ids_at, a.ids.layout, Box::new(derive));
    let at = |i: usize| table.addr() + (i * 8) as u64;
    let args = [
        Arg::Ptr(addr(g)?),
        Arg::I64(rs),
        Arg::I64(cs),
        Arg::Ptr(at(1)),
        Arg::Ptr(at(1 + capacity)),
        Arg::Ptr(at(2 * capacity + 2)),
        Arg::Ptr(at(0)),
        Arg::Ptr(ptr(o)?),
        i64_of(cols),
    ];
    // Threads walk the columns: no more than the row is wide (in whole warps).
    let threads = cols.next_multiple_of(32).min(BLOCK as usize) as u32;
    let cfg = LaunchConfig {
        grid_dim: (capacity.clamp(1, MAX_ROW_BLOCKS) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(d, &KERNELS, &format!("index_add_{s}"), cfg, &args)
}

// ---- where ------------------------------------------------------------------------------------

/// out = cond != 0 ? a : b; all three broadcast to one shape, out contiguous.
fn select_where(d: &CudaDevice, args: &Where) -> Result<()> {
    const OP: &str = "where";
    let (c, a, b, o) = (&args.cond, &args.a, &args.b, args.out);
    let shape = c.layout.shape();
    let numel = c.layout.numel();
    if numel == 0 {
        return Ok(());
    }
    let strides = [c.layout.strides(), a.layout.strides(), b.layout.strides()];
    let (sh, st) = merge_dims_n(shape, strides);
    if sh.len() > WHERE_MAX_DIMS {
        return Err(Error::invalid(
            OP,
            format!(
                "the operands step through {} separate dims (at most {WHERE_MAX_DIMS} are supported); make them contiguous first",
                sh.len()
            ),
        ));
    }
    let mut w = WhereArgs {
        rank: sh.len() as i32,
        ..Default::default()
    };
    for (i, &n) in sh.iter().enumerate() {
        w.shape[i] = n as i64;
        w.sc[i] = st[0][i] as i64;
        w.sa[i] = st[1][i] as i64;
        w.sb[i] = st[2][i] as i64;
    }
    let args = [
        Arg::Ptr(addr(c)?),
        Arg::Ptr(addr(a)?),
        Arg::Ptr(addr(b)?),
        Arg::Ptr(ptr(o)?),
        i64_of(numel),
        Arg::Struct(&w),
    ];
    let name = format!("where_{}", size_suffix(o.dtype()));
    launch(d, &KERNELS, &name, CudaDevice::grid_1d(numel), &args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_keep_id_order_within_a_row() {
        // ids: row 3 at positions 0 and 2, row 1 at 1 and 3.
        let (flat, capacity) = group_table(&[3, 1, 3, 1, 0], None).unwrap();
        assert_eq!(capacity, 3);
        assert_eq!(flat[0], 3); // groups
        assert_eq!(&flat[1..4], &[0, 1, 3]); // destination rows
        assert_eq!(&flat[4..8], &[0, 1, 3, 5]); // group starts
        assert_eq!(&flat[8..], &[4, 1, 3, 0, 2]); // positions
    }

    #[test]
    fn a_table_with_room_pads_its_groups_and_keeps_its_size() {
        // Room for 5 groups (a captured step's: one per id): 3 used, the rest inert.
        let (flat, capacity) = group_table(&[3, 1, 3, 1, 0], Some(5)).unwrap();
        assert_eq!(capacity, 5);
        assert_eq!(flat.len(), 1 + 5 + 6 + 5);
        assert_eq!(flat[0], 3);
        assert_eq!(&flat[1..6], &[0, 1, 3, 0, 0]);
        assert_eq!(&flat[6..12], &[0, 1, 3, 5, 5, 5]);
        assert_eq!(&flat[12..], &[4, 1, 3, 0, 2]);
        // Another batch of the same size makes a table of the same size.
        let (other, _) = group_table(&[0, 1, 2, 3, 4], Some(5)).unwrap();
        assert_eq!(other.len(), flat.len());
        assert_eq!(other[0], 5);
        // More groups than the room is refused.
        assert!(group_table(&[0, 1, 2, 3, 4], Some(4)).is_none());
    }
}
