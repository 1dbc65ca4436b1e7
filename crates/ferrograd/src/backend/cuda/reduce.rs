//! (being written) reductions.

use super::CudaDevice;
use crate::backend::{ReduceOp, Storage, View};
use crate::error::{Error, Result};
use crate::tensor::Device;

pub(crate) fn reduce(
    d: &CudaDevice,
    _op: ReduceOp,
    _x: View,
    _dims: &[usize],
    _out: &Storage,
) -> Result<()> {
    Err(Error::NotSupportedOnDevice {
        op: "reduce",
        device: Device::Cuda(d.ordinal()),
    })
}
