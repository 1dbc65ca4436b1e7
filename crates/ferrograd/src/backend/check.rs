//! Operand checks shared by the family validators (rows, loss, index, optim...): one wording
//! for each kind of mistake, whatever the family. Backends never call these: a family's entry
//! function validates once and the kernels trust what they receive.

use super::{Storage, View};
use crate::base::{DType, Device, Layout};
use crate::base::{Error, Result};

/// The hint of every "needs a float tensor" error.
pub(crate) const FLOAT_HINT: &str =
    "this op needs a floating-point tensor; convert with .to_dtype(DType::F32)";

/// `dtype` is a float type (f32, f64, f16, bf16).
pub(crate) fn float(op: &'static str, dtype: DType) -> Result<()> {
    if !dtype.is_float() {
        return Err(Error::UnsupportedDType {
            op,
            dtype,
            hint: FLOAT_HINT,
        });
    }
    Ok(())
}

pub(crate) fn same_dtype(op: &'static str, expected: DType, got: DType) -> Result<()> {
    if expected != got {
        return Err(Error::DType { op, expected, got });
    }
    Ok(())
}

/// Whether a kernel over elements of `dtype` reads or writes one operand in `other`: its own
/// dtype, or f16/bf16 beside f32 (autocast's f32 residual stream meets its half-precision
/// activations there). A half value widens to f32 exactly and an f32 value rounds to half
/// once, so such a kernel computes what a cast kernel followed by the f32 kernel would.
pub(crate) fn mixes_with(dtype: DType, other: DType) -> bool {
    dtype == other || (dtype == DType::F32 && matches!(other, DType::F16 | DType::BF16))
}

/// `other`, the dtype of operand `what`, is one a kernel over `dtype` handles (`mixes_with`).
pub(crate) fn mixed(op: &'static str, what: &str, dtype: DType, other: DType) -> Result<()> {
    if !mixes_with(dtype, other) {
        return Err(Error::invalid(
            op,
            format!(
                "{what} has dtype {other}; it must be {dtype} (or f16/bf16 when the op runs in f32): convert it with .to_dtype(DType::{dtype:?})"
            ),
        ));
    }
    Ok(())
}

/// `v` is contiguous with `len` elements inside its storage, of `dtype`.
pub(crate) fn dense(
    op: &'static str,
    what: &str,
    v: &View,
    len: usize,
    dtype: DType,
) -> Result<()> {
    let l = v.layout;
    if !l.is_contiguous() || l.numel() != len || l.offset() + len > v.storage.len() {
        return Err(Error::invalid(
            op,
            format!(
                "{what} must be contiguous with {len} elements, got shape {:?}",
                l.shape()
            ),
        ));
    }
    same_dtype(op, dtype, v.storage.dtype())
}

/// `v` is contiguous with `len` elements of any float dtype (statistics, a loss gradient).
pub(crate) fn dense_float(op: &'static str, what: &str, v: &View, len: usize) -> Result<()> {
    float(op, v.storage.dtype())?;
    dense(op, what, v, len, v.storage.dtype())
}

/// An output storage of `len` elements of `dtype`.
pub(crate) fn out(op: &'static str, s: &Storage, len: usize, dtype: DType) -> Result<()> {
    if s.dtype() != dtype {
        return Err(Error::invalid(
            op,
            format!(
                "output dtype {} differs from the input's {dtype}",
                s.dtype()
            ),
        ));
    }
    len_of(op, s, len)
}

/// An output storage of `len` elements of any float dtype.
pub(crate) fn out_float(op: &'static str, s: &Storage, len: usize) -> Result<()> {
    float(op, s.dtype())?;
    len_of(op, s, len)
}

pub(crate) fn len_of(op: &'static str, s: &Storage, len: usize) -> Result<()> {
    if s.len() != len {
        return Err(Error::shape(
            op,
            format!("output holds {} elements, the op writes {len}", s.len()),
        ));
    }
    Ok(())
}

/// Every storage lives on `device` (the device whose backend runs the op).
pub(crate) fn on_device<'a>(
    op: &'static str,
    device: Device,
    storages: impl IntoIterator<Item = &'a Storage>,
) -> Result<()> {
    for s in storages {
        if s.device() != device {
            return Err(Error::DeviceMismatch {
                op,
                a: device,
                b: s.device(),
            });
        }
    }
    Ok(())
}

/// No storage appears twice (an in-place kernel would update it twice, or lock it twice).
pub(crate) fn distinct(op: &'static str, storages: &[&Storage], what: &'static str) -> Result<()> {
    for (i, a) in storages.iter().enumerate() {
        if storages[i + 1..].iter().any(|b| a.same(b)) {
            return Err(Error::invalid(op, what));
        }
    }
    Ok(())
}

/// (rows, cols): a layout read as rows of its last dim (a 0-dim tensor is one row of one).
pub fn rows_cols(l: &Layout) -> (usize, usize) {
    match l.shape().split_last() {
        Some((&n, lead)) => (lead.iter().product(), n),
        None => (1, 1),
    }
}

/// Every element a view can reach lies inside its storage (a kernel reading past the end
/// would corrupt or fault the whole device context, not just return an error).
pub(crate) fn within(op: &'static str, v: &View) -> Result<()> {
    let l = v.layout;
    if l.numel() == 0 {
        return Ok(());
    }
    let (mut lo, mut hi) = (l.offset() as i128, l.offset() as i128);
    for (&n, &s) in l.shape().iter().zip(l.strides()) {
        let reach = (n as i128 - 1) * s as i128;
        if reach < 0 {
            lo += reach;
        } else {
            hi += reach;
        }
    }
    if lo < 0 || hi >= v.storage.len() as i128 {
        return Err(Error::invalid(
            op,
            format!(
                "view (shape {:?}, strides {:?}, offset {}) reaches outside its storage of {} elements",
                l.shape(),
                l.strides(),
                l.offset(),
                v.storage.len()
            ),
        ));
    }
    Ok(())
}
