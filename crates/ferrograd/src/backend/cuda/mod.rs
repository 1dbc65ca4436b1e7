//! The CUDA backend: one context and one compute stream per device (cudarc, loaded at run
//! time, so the same binary runs with or without a GPU and says plainly when there is none).
//! Memory comes from the device's caching allocator (segments reserved with cuMemAlloc), so
//! a storage's data is just the address of its block. Kernels are `.cu` sources compiled by
//! NVRTC once per device for its compute capability; GEMMs go through cuBLAS.

mod codes;
mod device;
mod elementwise;
mod index;
mod info;
mod launch;
mod loss;
mod matmul;
mod memory;
mod multi_tensor;
mod optim;
mod reduce;
mod rows;

pub use device::{CudaDevice, allow_tf32, device, device_count, driver_present, set_allow_tf32};
pub use info::{CudaInfo, GpuInfo, cuda_info};
pub use memory::CudaMemory;

use super::{
    Backend, BackendData, BinaryOp, ElementwiseKernels, HostValues, MatmulKernels, MatmulSpec,
    ReduceKernels, ReduceOp, Storage, UnaryOp, View,
};
use crate::error::{Error, Result};
use crate::tensor::{DType, Device};

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

impl ElementwiseKernels for CudaDevice {
    fn copy(&self, src: View, dst: View) -> Result<()> {
        elementwise::copy(self, src, dst)
    }

    fn fill(&self, dst: &Storage, value: f64) -> Result<()> {
        elementwise::fill(self, dst, value)
    }

    fn unary(&self, op: UnaryOp, x: View, out: &Storage) -> Result<()> {
        elementwise::unary(self, op, x, out)
    }

    fn binary(&self, op: BinaryOp, a: View, b: View, out: &Storage) -> Result<()> {
        elementwise::binary(self, op, a, b, out)
    }

    fn binary_inplace(&self, op: BinaryOp, dst: &Storage, src: View) -> Result<()> {
        elementwise::binary_inplace(self, op, dst, src)
    }
}

impl ReduceKernels for CudaDevice {
    fn reduce(&self, op: ReduceOp, x: View, dims: &[usize], out: &Storage) -> Result<()> {
        reduce::reduce(self, op, x, dims, out)
    }
}

impl MatmulKernels for CudaDevice {
    fn matmul(&self, spec: &MatmulSpec, a: View, b: View, out: &Storage) -> Result<()> {
        matmul::matmul(self, spec, a, b, out)
    }

    fn matmul_acc(
        &self,
        spec: &MatmulSpec,
        a: View,
        b: View,
        out: &Storage,
        beta: f64,
    ) -> Result<()> {
        matmul::matmul_acc(self, spec, a, b, out, beta)
    }
}
