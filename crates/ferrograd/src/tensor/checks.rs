//! The operand checks every op starts with: same device, same dtype, a float dtype. They sit
//! next to the tensor so that the tensor itself, the backward engine and the ops share them.

use super::Tensor;
use crate::base::{Error, Result};

pub(crate) fn check_same_device(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch {
            op,
            a: a.device(),
            b: b.device(),
        });
    }
    Ok(())
}

fn check_same_dtype(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DType {
            op,
            expected: a.dtype(),
            got: b.dtype(),
        });
    }
    Ok(())
}

pub(crate) fn check_float(op: &'static str, t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op,
            dtype: t.dtype(),
            hint: "this op needs a floating-point tensor; convert with .to_dtype(DType::F32)",
        });
    }
    Ok(())
}

/// Both checks every binary op needs.
pub(crate) fn check_pair(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    check_same_device(op, a, b)?;
    check_same_dtype(op, a, b)
}
