//! Backends: the narrow contract between tensor ops and devices. Backends know nothing of
//! autograd: they receive storages with layouts and typed arguments, and write into output
//! storages that the caller has already allocated through the device's allocator.
//!
//! Ops come in families, one module each (elementwise, reduce, matmul, rows, attention,
//! loss, index, optim): the family module holds the typed arguments, their one validator, the family trait
//! that every backend implements, and entry functions that validate once, dispatch to the
//! device's backend and bump the version of every storage written in place. `cpu` is the
//! reference implementation; `cuda` mirrors it file for file; `meta` runs the validation only.

pub mod attention;
pub mod capture;
mod check;
pub mod cpu;
pub mod cuda;
pub mod elementwise;
pub mod index;
pub mod loss;
pub mod matmul;
mod meta;
pub mod optim;
pub mod philox;
pub mod reduce;
pub mod rows;
mod storage;

pub use attention::AttentionKernels;
pub(crate) use check::mixes_with;
pub use check::rows_cols;
pub use elementwise::{BinaryOp, ElementwiseKernels, UnaryOp};
pub use index::IndexKernels;
pub use loss::LossKernels;
pub use matmul::{MatmulKernels, MatmulSpec};
pub(crate) use meta::plans_for_cuda;
pub use meta::{MetaTarget, PlanningScope, plan_as};
pub use optim::OptimKernels;
pub use reduce::{ReduceKernels, ReduceOp};
pub use rows::RowKernels;
pub use storage::{BackendData, Storage};

use crate::base::Result;
use crate::base::{DType, Device, Layout};

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
    AttentionKernels
    + ElementwiseKernels
    + ReduceKernels
    + MatmulKernels
    + RowKernels
    + LossKernels
    + IndexKernels
    + OptimKernels
    + capture::Capture
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

    /// The values stored as `dtype`, as little-endian bytes (a device upload). Converts as
    /// the CPU backend stores host values (`CpuData::from_host`): floats round to nearest,
    /// integers from floats saturate (`as`), U8 is `value != 0`.
    pub(crate) fn into_le_bytes(self, dtype: DType) -> Vec<u8> {
        fn each<const N: usize>(v: impl Iterator<Item = [u8; N]>) -> Vec<u8> {
            v.flatten().collect()
        }
        match (dtype, self) {
            (DType::F32, HostValues::F32(v)) => bytemuck::cast_slice(&v).to_vec(),
            (DType::I64, HostValues::I64(v)) => bytemuck::cast_slice(&v).to_vec(),
            (DType::U8, HostValues::I64(v)) => v.iter().map(|&x| (x != 0) as u8).collect(),
            (d, HostValues::F32(v)) => {
                HostValues::F64(v.iter().map(|&x| x as f64).collect()).into_le_bytes(d)
            }
            (d, HostValues::I64(v)) => {
                HostValues::F64(v.iter().map(|&x| x as f64).collect()).into_le_bytes(d)
            }
            (DType::F64, HostValues::F64(v)) => bytemuck::cast_slice(&v).to_vec(),
            (DType::F32, HostValues::F64(v)) => each(v.iter().map(|&x| (x as f32).to_le_bytes())),
            (DType::F16, HostValues::F64(v)) => {
                each(v.iter().map(|&x| crate::base::f16_of(x).to_le_bytes()))
            }
            (DType::BF16, HostValues::F64(v)) => {
                each(v.iter().map(|&x| crate::base::bf16_of(x).to_le_bytes()))
            }
            (DType::I64, HostValues::F64(v)) => each(v.iter().map(|&x| (x as i64).to_le_bytes())),
            (DType::U8, HostValues::F64(v)) => v.iter().map(|&x| (x != 0.0) as u8).collect(),
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuData;

    /// The device upload bytes equal the CPU backend's stored values, for every dtype pair.
    #[test]
    fn upload_bytes_match_the_cpu_conversion() {
        let f = vec![0.1, -2.5, 65520.0, f64::NAN, 1e300, -0.0, 3.0];
        let i = vec![0, 1, -7, i64::MAX];
        let hosts = [
            HostValues::F64(f.clone()),
            HostValues::F32(f.iter().map(|&x| x as f32).collect()),
            HostValues::I64(i),
        ];
        for dtype in [
            DType::F32,
            DType::F64,
            DType::F16,
            DType::BF16,
            DType::I64,
            DType::U8,
        ] {
            for h in &hosts {
                let want = match CpuData::from_host(dtype, h.clone()).unwrap() {
                    CpuData::F32(v) => bytemuck::cast_slice(&v).to_vec(),
                    CpuData::F64(v) => bytemuck::cast_slice(&v).to_vec(),
                    CpuData::F16(v) => bytemuck::cast_slice(&v).to_vec(),
                    CpuData::BF16(v) => bytemuck::cast_slice(&v).to_vec(),
                    CpuData::I64(v) => bytemuck::cast_slice(&v).to_vec(),
                    CpuData::U8(v) => v,
                };
                assert_eq!(h.clone().into_le_bytes(dtype), want, "{dtype} {h:?}");
            }
        }
    }
}
