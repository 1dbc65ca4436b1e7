//! Backends: the narrow contract between tensor ops and devices. Backends know nothing of
//! autograd: they receive storages with layouts and an op kind passed as data, and write into
//! output storages that the caller has already allocated through the device's allocator.
//!
//! `cpu` is the reference implementation. A device backend (CUDA) and the shape-only `meta`
//! backend implement the same trait.

pub mod cpu;
pub mod cuda;
mod meta;
mod ops;
mod storage;

pub use ops::{BinaryOp, FusedOp, MatmulSpec, ReduceOp, UnaryOp};
pub use storage::{BackendData, Storage};

use crate::base::Result;
use crate::base::{DType, Device, Layout};

/// A storage seen through a layout: the input of every backend op.
#[derive(Clone, Copy)]
pub struct View<'a> {
    pub storage: &'a Storage,
    pub layout: &'a Layout,
}

/// What a backend does. Outputs are contiguous storages allocated by the caller, never
/// aliasing an input (except `binary_inplace`'s destination).
pub trait Backend: Send + Sync {
    /// Fresh device data of `len` elements, zero-filled, at `addr` (the address the device's
    /// allocator handed out; 0 on the host, where the backend owns its buffers).
    fn zeros(&self, dtype: DType, len: usize, addr: u64) -> Result<BackendData>;
    /// Fresh device data whose contents are unspecified, for an op output that its kernel
    /// overwrites entirely. Zero-filled unless the backend can skip it (PyTorch's `empty`).
    fn empty(&self, dtype: DType, len: usize, addr: u64) -> Result<BackendData> {
        self.zeros(dtype, len, addr)
    }
    /// Uploads host values into fresh data at `addr`.
    fn upload(&self, dtype: DType, values: HostValues, addr: u64) -> Result<BackendData>;
    /// Downloads a view as contiguous host values.
    fn to_host(&self, src: View) -> Result<HostValues>;
    /// Copies `src` into the (possibly strided) region `dst` of the same shape, converting
    /// dtype if they differ. `dst` must not overlap `src`.
    fn copy(&self, src: View, dst: View) -> Result<()>;
    fn fill(&self, dst: &Storage, value: f64) -> Result<()>;
    fn unary(&self, op: UnaryOp, x: View, out: &Storage) -> Result<()>;
    /// `a` and `b` are already broadcast to the output shape (stride 0 where stretched).
    fn binary(&self, op: BinaryOp, a: View, b: View, out: &Storage) -> Result<()>;
    /// `dst = op(dst, src)` where `dst` is a whole contiguous storage and `src` is broadcast
    /// to its shape. `src` may share `dst`'s storage.
    fn binary_inplace(&self, op: BinaryOp, dst: &Storage, src: View) -> Result<()>;
    /// Reduces `dims` (sorted, unique); the output is contiguous with those dims kept as 1.
    fn reduce(&self, op: ReduceOp, x: View, dims: &[usize], out: &Storage) -> Result<()>;
    /// Batched `out = a @ b` where a: (..., m, k), b: (..., k, n) with equal batch dims.
    fn matmul(&self, spec: &MatmulSpec, a: View, b: View, out: &Storage) -> Result<()>;
    /// Batched `out = a @ b + beta·out`: a GEMM that accumulates into its output (the fused
    /// SGD step writes a weight gradient straight into the momentum buffer). With beta = 0
    /// the output is not read. Backends without it answer beta = 0 only.
    fn matmul_acc(
        &self,
        spec: &MatmulSpec,
        a: View,
        b: View,
        out: &Storage,
        beta: f64,
    ) -> Result<()> {
        if beta == 0.0 {
            return self.matmul(spec, a, b, out);
        }
        Err(crate::base::Error::NotSupportedOnDevice {
            op: "matmul_acc",
            device: out.device(),
        })
    }
    /// Ops with their own kernels (softmax, layer norm, cross-entropy, embedding...).
    fn fused(&self, op: &FusedOp, inputs: &[View], outputs: &[&Storage]) -> Result<()>;
}

/// Host-side values crossing the device boundary.
#[derive(Clone, Debug, PartialEq)]
pub enum HostValues {
    F64(Vec<f64>),
    /// f32 values travel without widening (large parameter initialisations).
    F32(Vec<f32>),
    I64(Vec<i64>),
}

/// The backend that serves `device`.
pub fn backend(device: Device) -> Result<&'static dyn Backend> {
    match device {
        Device::Cpu => Ok(&cpu::CpuBackend),
        Device::Meta => Ok(&meta::MetaBackend),
        Device::Cuda(ordinal) => cuda::backend(ordinal),
    }
}

impl HostValues {
    pub fn len(&self) -> usize {
        match self {
            HostValues::F64(v) => v.len(),
            HostValues::F32(v) => v.len(),
            HostValues::I64(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Bytes a new allocation on `device` can still get: the host's available memory, or a
/// GPU's free memory as its driver reports it (the device is opened first).
pub fn available_memory(device: Device) -> Result<u64> {
    match device {
        Device::Cpu => Ok(crate::memory::HostPolicy::available_memory().unwrap_or(u64::MAX)),
        Device::Meta => Ok(u64::MAX),
        Device::Cuda(_) => {
            backend(device)?;
            Ok(crate::memory::allocator(device)?.mem_info().free)
        }
    }
}

/// Waits until all queued work on `device` has finished (a no-op on the host). Timing GPU
/// work needs it, as `torch.cuda.synchronize()` does.
pub fn synchronize(device: Device) -> Result<()> {
    match device {
        Device::Cuda(i) => cuda::device(i)?.synchronize(),
        _ => Ok(()),
    }
}
