//! (being written) fused ops.

use super::CudaDevice;
use crate::backend::{FusedOp, Storage, View};
use crate::error::{Error, Result};
use crate::tensor::Device;

pub(crate) fn run(
    d: &CudaDevice,
    _op: &FusedOp,
    _inputs: &[View],
    _outputs: &[&Storage],
) -> Result<()> {
    Err(Error::NotSupportedOnDevice {
        op: "fused",
        device: Device::Cuda(d.ordinal()),
    })
}
