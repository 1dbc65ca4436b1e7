//! (being written) elementwise kernels: to_host, copy, fill, unary, binary, binary_inplace.

use super::CudaDevice;
use crate::backend::{BinaryOp, HostValues, Storage, UnaryOp, View};
use crate::error::{Error, Result};
use crate::tensor::Device;

fn todo_err(op: &'static str, d: &CudaDevice) -> Error {
    Error::NotSupportedOnDevice {
        op,
        device: Device::Cuda(d.ordinal()),
    }
}

pub(crate) fn to_host(d: &CudaDevice, _src: View) -> Result<HostValues> {
    Err(todo_err("to_host", d))
}
pub(crate) fn copy(d: &CudaDevice, _src: View, _dst: View) -> Result<()> {
    Err(todo_err("copy", d))
}
pub(crate) fn fill(d: &CudaDevice, _dst: &Storage, _value: f64) -> Result<()> {
    Err(todo_err("fill", d))
}
pub(crate) fn unary(d: &CudaDevice, _op: UnaryOp, _x: View, _out: &Storage) -> Result<()> {
    Err(todo_err("unary", d))
}
pub(crate) fn binary(
    d: &CudaDevice,
    _op: BinaryOp,
    _a: View,
    _b: View,
    _out: &Storage,
) -> Result<()> {
    Err(todo_err("binary", d))
}
pub(crate) fn binary_inplace(
    d: &CudaDevice,
    _op: BinaryOp,
    _dst: &Storage,
    _src: View,
) -> Result<()> {
    Err(todo_err("binary_inplace", d))
}
