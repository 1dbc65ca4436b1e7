//! CUDA launchers of the attention family (backend/attention.rs; kernels in
//! kernels/attention.cu).

use crate::backend::attention::{Attention, AttentionBackward, AttentionKernels};
use crate::base::{DType, Device, Error, Result};

use super::CudaDevice;

/// Whether the fused kernels cover `dtype` and `head_dim` on a GPU (none yet: attention runs
/// as matmul, softmax, matmul). A free function, so the planner can ask without a GPU.
pub(crate) fn supports(_dtype: DType, _head_dim: usize) -> bool {
    false
}

impl AttentionKernels for CudaDevice {
    fn supports_attention(&self, dtype: DType, head_dim: usize) -> bool {
        supports(dtype, head_dim)
    }
    fn attention(&self, _: &Attention) -> Result<()> {
        Err(Error::NotSupportedOnDevice {
            op: "attention",
            device: Device::Cuda(0),
        })
    }
    fn attention_backward(&self, _: &AttentionBackward) -> Result<()> {
        Err(Error::NotSupportedOnDevice {
            op: "attention_backward",
            device: Device::Cuda(0),
        })
    }
}
