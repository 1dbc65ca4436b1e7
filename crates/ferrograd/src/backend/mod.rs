//! Backends: the narrow contract between tensor ops and devices. Backends know nothing of
//! autograd: they receive storages with layouts and typed arguments, and write into output
//! storages that the caller has already allocated through the device's allocator.
//!
//! Ops come in families, one module each (elementwise, reduce, matmul, rows, loss, index,
//! optim): the family module holds the typed arguments, their one validator, the family trait
//! that every backend implements, and entry functions that validate once, dispatch to the
//! device's backend and bump the version of every storage written in place. `cpu` is the
//! reference implementation; `cuda` mirrors it file for file; `meta` runs the validation only.

mod check;
pub mod cpu;
pub mod cuda;
pub mod elementwise;
pub mod index;
pub mod loss;
pub mod matmul;
mod meta;
pub mod optim;
pub mod reduce;
pub mod rows;
mod storage;

pub use check::rows_cols;
pub use elementwise::{BinaryOp, ElementwiseKernels, UnaryOp};
pub use index::IndexKernels;
pub use loss::LossKernels;
pub use matmul::{MatmulKernels, MatmulSpec};
pub use optim::OptimKernels;
pub use reduce::{ReduceKernels, ReduceOp};
pub use rows::RowKernels;
pub use storage::{BackendData, Storage};

use crate::error::Result;
use crate::tensor::{DType, Device, Layout};

/// A storage seen through a layout: the input of every backend op.
#[derive(Clone, Copy)]
pub struct View<'a> {
    pub storage: &'a Storage,
    pub layout: &'a Layout,
}

/// What a backend does: data movement here, ops through the family traits. Call the ops
/// through the families' entry functions (`rows::layer_norm`...), which validate the
/// arguments and record in-place writes; the trait methods trust their arguments.
pub trait Backend:
    ElementwiseKernels
    + ReduceKernels
    + MatmulKernels
    + RowKernels
    + LossKernels
    + IndexKernels
    + OptimKernels
    + Send
    + Sync
{
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

/// Waits until all queued work on `device` has finished (a no-op on the host). Timing GPU
/// work needs it, as `torch.cuda.synchronize()` does.
pub fn synchronize(device: Device) -> Result<()> {
    match device {
        Device::Cuda(i) => cuda::device(i)?.synchronize(),
        _ => Ok(()),
    }
}
