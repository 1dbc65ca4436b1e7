//! CUDA launchers of the attention family (backend/attention.rs; kernels in
//! kernels/attention.cu).

use crate::backend::attention::{Attention, AttentionBackward, AttentionKernels};
use crate::base::{DType, Device, Error, Result};

use super::CudaDevice;

impl AttentionKernels for CudaDevice {
    fn supports_attention(&self, _: DType, _: usize) -> bool {
        false
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
