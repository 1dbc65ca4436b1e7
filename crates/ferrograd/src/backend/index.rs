//! The index family: gather rows by id (embedding forward), add rows into their ids' rows in
//! order (embedding backward), and pick elementwise by a U8 condition (where, masked_fill).
//! Here: the typed arguments, their one validator, the `IndexKernels` trait that every
//! backend implements, and the entry functions (validate once, dispatch, and record the
//! in-place write of `index_add`). Id values are checked by the kernels (that needs their
//! values) before anything is written: a bad id is an `Error::Index` naming it. Not here: the
//! kernels (backend/cpu/index.rs, backend/cuda/index.rs + kernels/index.cu).

use super::{Storage, View, backend, check};
use crate::base::DType;
use crate::base::{Error, Result};

/// `out (N, D)[p, :] = weight[ids[p], :]`. weight (V, D) strided allowed; ids I64 of any
/// layout with N elements, read in row-major order, each in 0..V.
pub struct IndexSelect<'a> {
    pub weight: View<'a>,
    pub ids: View<'a>,
    pub out: &'a Storage,
}

/// `out (V, D)[ids[p], :] += grad[p, :]` for p in order, summed in f64 and rounded once
/// (deterministic). grad (N, D) strided allowed (stride 0 too); ids as in `IndexSelect`.
/// Accumulates into `out` (the caller zero-initialises a fresh one).
pub struct IndexAdd<'a> {
    pub grad: View<'a>,
    pub ids: View<'a>,
    pub out: &'a Storage,
}

/// out = cond != 0 ? a : b; cond U8, a and b broadcast to one shape (strided allowed); a, b
/// and out share one dtype (any).
pub struct Where<'a> {
    pub cond: View<'a>,
    pub a: View<'a>,
    pub b: View<'a>,
    pub out: &'a Storage,
}

/// The index kernels of one device. Arguments arrive validated (entry functions below).
pub trait IndexKernels {
    fn index_select(&self, a: &IndexSelect) -> Result<()>;
    fn index_add(&self, a: &IndexAdd) -> Result<()>;
    fn select_where(&self, a: &Where) -> Result<()>;
}

pub fn index_select(a: &IndexSelect) -> Result<()> {
    const OP: &str = "index_select";
    let device = a.out.device();
    check::on_device(OP, device, [a.weight.storage, a.ids.storage])?;
    let dtype = a.weight.storage.dtype();
    check::float(OP, dtype)?;
    let (_, cols) = matrix(OP, &a.weight)?;
    ids(OP, &a.ids)?;
    check::out(OP, a.out, a.ids.layout.numel() * cols, dtype)?;
    backend(device)?.index_select(a)
}

/// Bumps `out`'s version: it is written in place.
pub fn index_add(a: &IndexAdd) -> Result<()> {
    const OP: &str = "index_add";
    let device = a.out.device();
    check::on_device(OP, device, [a.grad.storage, a.ids.storage])?;
    let dtype = a.grad.storage.dtype();
    check::float(OP, dtype)?;
    let (n, cols) = matrix(OP, &a.grad)?;
    ids(OP, &a.ids)?;
    check::same_dtype(OP, dtype, a.out.dtype())?;
    if cols > 0 {
        if !a.out.len().is_multiple_of(cols) {
            return Err(Error::shape(
                OP,
                format!(
                    "output of {} elements is not a whole number of {cols}-wide rows",
                    a.out.len()
                ),
            ));
        }
        if a.ids.layout.numel() != n {
            return Err(Error::shape(
                OP,
                format!("{} ids for {n} gradient rows", a.ids.layout.numel()),
            ));
        }
    }
    backend(device)?.index_add(a)?;
    a.out.bump_version();
    Ok(())
}

pub fn select_where(a: &Where) -> Result<()> {
    const OP: &str = "where";
    let device = a.out.device();
    check::on_device(OP, device, [a.cond.storage, a.a.storage, a.b.storage])?;
    let shape = a.cond.layout.shape();
    if a.a.layout.shape() != shape || a.b.layout.shape() != shape {
        return Err(Error::shape(
            OP,
            format!(
                "cond {:?}, a {:?} and b {:?} must be broadcast to one shape first",
                shape,
                a.a.layout.shape(),
                a.b.layout.shape()
            ),
        ));
    }
    if a.cond.storage.dtype() != DType::U8 {
        return Err(Error::UnsupportedDType {
            op: OP,
            dtype: a.cond.storage.dtype(),
            hint: "the condition must be a U8 mask (0 = false, non-zero = true)",
        });
    }
    let dtype = a.out.dtype();
    check::same_dtype(OP, dtype, a.a.storage.dtype())?;
    check::same_dtype(OP, dtype, a.b.storage.dtype())?;
    for v in [&a.cond, &a.a, &a.b] {
        check::within(OP, v)?;
    }
    check::len_of(OP, a.out, a.cond.layout.numel())?;
    backend(device)?.select_where(a)
}

/// (rows, cols) of a strided 2-D view that stays inside its storage.
fn matrix(op: &'static str, v: &View) -> Result<(usize, usize)> {
    match v.layout.shape() {
        &[rows, cols] => {
            check::within(op, v)?;
            Ok((rows, cols))
        }
        s => Err(Error::shape(
            op,
            format!("expected a 2-D (rows, cols) input, got shape {s:?}"),
        )),
    }
}

/// I64 ids inside their storage.
fn ids(op: &'static str, v: &View) -> Result<()> {
    if v.storage.dtype() != DType::I64 {
        return Err(Error::UnsupportedDType {
            op,
            dtype: v.storage.dtype(),
            hint: "indices must be int64 (DType::I64)",
        });
    }
    check::within(op, v)
}

/// Every id selects one of `rows` rows (the first that does not is named).
pub(crate) fn check_row_ids(op: &'static str, ids: &[i64], rows: usize) -> Result<()> {
    let bad = ids
        .iter()
        .enumerate()
        .find(|&(_, &id)| id < 0 || id as u64 >= rows as u64);
    if let Some((pos, &id)) = bad {
        return Err(Error::Index {
            op,
            detail: format!(
                "index {id} (at position {pos} of the ids) is out of range for {rows} rows; valid indices are 0..{rows}"
            ),
        });
    }
    Ok(())
}
