//! (being written) cuBLAS GEMM.

use super::CudaDevice;
use crate::backend::{MatmulSpec, Storage, View};
use crate::error::{Error, Result};
use crate::tensor::Device;

pub(crate) fn matmul(
    d: &CudaDevice,
    _spec: &MatmulSpec,
    _a: View,
    _b: View,
    _out: &Storage,
) -> Result<()> {
    Err(Error::NotSupportedOnDevice {
        op: "matmul",
        device: Device::Cuda(d.ordinal()),
    })
}
