//! The CPU backend: the reference semantics. Plain loops, parallel with rayon where a tensor
//! is large enough for it to pay, GEMM from the `gemm` crate. The hot loops are compiled for
//! AVX-512 or AVX2 + FMA when the machine has them (`vmath::simd_fn!`, the same bits on every
//! path), and exp, tanh and ln at f32 precision are vectorisable polynomials (`vmath`, 1 ulp).

mod data;
mod elementwise;
// One head of fused attention, tested here; the attention kernel family that runs it over a
// batch is not part of the backend yet.
#[allow(dead_code)]
mod flash;
mod index;
mod loss;
mod matmul;
mod optim;
mod reduce;
mod rows;
mod vmath;

pub use data::{CpuData, Elem};
#[allow(unused_imports)]
pub(crate) use data::{with_float, with_float_pair};

use std::ops::Deref;

use super::{Backend, BackendData, HostValues, Storage, View};
use crate::base::DType;
use crate::base::{Error, Result};

pub struct CpuBackend;

/// Read access to a storage's host buffer.
pub(crate) struct CpuRead<'a>(std::sync::RwLockReadGuard<'a, BackendData>);

impl Deref for CpuRead<'_> {
    type Target = CpuData;
    fn deref(&self) -> &CpuData {
        match &*self.0 {
            BackendData::Cpu(d) => d,
            // Storages are created by the backend of their own device.
            _ => unreachable!("a non-CPU storage reached the CPU backend"),
        }
    }
}

pub(crate) fn read(s: &Storage) -> Result<CpuRead<'_>> {
    let g = s.read();
    match &*g {
        BackendData::Cpu(_) => Ok(CpuRead(g)),
        _ => Err(Error::NotSupportedOnDevice {
            op: "cpu kernel",
            device: s.device(),
        }),
    }
}

/// Runs `f` with mutable access to a storage's host buffer.
pub(crate) fn write<R>(s: &Storage, f: impl FnOnce(&mut CpuData) -> Result<R>) -> Result<R> {
    let mut g = s.write();
    match &mut *g {
        BackendData::Cpu(d) => f(d),
        _ => Err(Error::NotSupportedOnDevice {
            op: "cpu kernel",
            device: s.device(),
        }),
    }
}

impl Backend for CpuBackend {
    fn zeros(&self, dtype: DType, len: usize, _addr: u64) -> Result<BackendData> {
        Ok(BackendData::Cpu(CpuData::zeros(dtype, len)?))
    }

    fn empty(&self, dtype: DType, len: usize, _addr: u64) -> Result<BackendData> {
        Ok(BackendData::Cpu(CpuData::uninit(dtype, len)?))
    }

    fn upload(&self, dtype: DType, values: HostValues, _addr: u64) -> Result<BackendData> {
        Ok(BackendData::Cpu(CpuData::from_host(dtype, values)?))
    }

    fn to_host(&self, src: View) -> Result<HostValues> {
        let d = read(src.storage)?;
        let offs = src.layout.offsets();
        Ok(match &*d {
            CpuData::I64(_) | CpuData::U8(_) => {
                HostValues::I64(offs.map(|i| d.get_i64(i)).collect())
            }
            _ => HostValues::F64(offs.map(|i| d.get_f64(i)).collect()),
        })
    }
}
