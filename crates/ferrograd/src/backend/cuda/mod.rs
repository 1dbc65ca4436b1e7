//! The CUDA backend: one context and one compute stream per device (cudarc, loaded at run
//! time, so the same binary runs with or without a GPU and says plainly when there is none).
//! Memory comes from the device's caching allocator (segments reserved with cuMemAlloc), so
//! a storage's data is just the address of its block. Kernels are `.cu` sources compiled by
//! NVRTC once per device for its compute capability, their PTX kept on disk for later runs
//! (kernel_cache.rs); GEMMs go through cuBLAS.

mod attention;
mod capture;
mod codes;
mod device;
mod elementwise;
mod gemm_lt;
mod gemm_tune;
mod index;
mod info;
mod kernel_cache;
mod launch;
mod loss;
mod matmul;
mod memory;
mod multi_tensor;
mod optim;
mod reduce;
mod rows;
mod timing;
mod warm;

pub use device::{CudaDevice, allow_tf32, device, device_count, driver_present, set_allow_tf32};
pub use info::{CudaInfo, GpuInfo, KernelCacheInfo, cuda_info};
pub use memory::CudaMemory;
pub use timing::{KernelTime, take_host_waits, take_kernel_times};
pub use warm::{Filled, Warmed, compile_all_kernels, emit_all_ptx, fill_kernel_cache};
// What the planner asks of a GPU without one: the fused attention's coverage, cuBLAS's
// workspace, which matmul operands cuBLAS needs copied, and the kernels' larger temporaries.
pub(crate) use attention::supports as supports_attention;
pub(crate) use launch::temp_bytes;
pub(crate) use loss::{nll_lse_scratch_bytes, nll_scratch_bytes};
pub(crate) use matmul::{
    WORKSPACE_BYTES as CUBLAS_WORKSPACE_BYTES, operand_copy_shape, out_row_align,
};
pub(crate) use reduce::scratch_bytes as reduce_scratch_bytes;
pub(crate) use rows::param_scratch_bytes as layer_norm_param_scratch_bytes;
pub(crate) use rows::sums_half as layer_norm_sums_half;

use super::{Backend, BackendData, HostValues, Storage, View};
use crate::base::{DType, Device};
use crate::base::{Error, Result};

/// A storage's block on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaBuffer {
    pub ptr: u64,
    pub bytes: usize,
}

/// The device address of a CUDA storage.
pub(crate) fn ptr(s: &Storage) -> Result<u64> {
    match &*s.read() {
        BackendData::Cuda(b) => Ok(b.ptr),
        _ => Err(Error::DeviceMismatch {
            op: "cuda kernel",
            a: s.device(),
            b: Device::Cuda(0),
        }),
    }
}

/// The backend of GPU `ordinal`, initialising the device on first use.
pub fn backend(ordinal: usize) -> Result<&'static dyn Backend> {
    Ok(device(ordinal)?)
}

impl Backend for CudaDevice {
    fn zeros(&self, dtype: DType, len: usize, addr: u64) -> Result<BackendData> {
        let bytes = len * dtype.size_in_bytes();
        self.memset_zero(addr, bytes)?;
        Ok(BackendData::Cuda(CudaBuffer { ptr: addr, bytes }))
    }

    fn empty(&self, dtype: DType, len: usize, addr: u64) -> Result<BackendData> {
        // No memset: the op's kernel writes every element before anything reads them.
        let bytes = len * dtype.size_in_bytes();
        Ok(BackendData::Cuda(CudaBuffer { ptr: addr, bytes }))
    }

    fn upload(&self, dtype: DType, values: HostValues, addr: u64) -> Result<BackendData> {
        let bytes = values.into_le_bytes(dtype);
        self.copy_to_device(addr, &bytes)?;
        Ok(BackendData::Cuda(CudaBuffer {
            ptr: addr,
            bytes: bytes.len(),
        }))
    }

    fn to_host(&self, src: View) -> Result<HostValues> {
        elementwise::to_host(self, src)
    }
}
