//! The CPU backend: the reference semantics. Plain loops, parallel with rayon where a tensor
//! is large enough for it to pay, GEMM from the `gemm` crate. The hot loops are compiled for
//! AVX-512 or AVX2 + FMA when the machine has them (`vmath::simd_fn!`, the same bits on every
//! path), and exp, tanh and ln at f32 precision are vectorisable polynomials (`vmath`, 1 ulp).

mod attention;
mod data;
mod elementwise;
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

/// Kernel scratch on the host, counted by the CPU allocator as `workspace` while it lives, so
/// every byte a kernel takes is attributed (and an impossible size is a typed OOM error).
pub(crate) struct Scratch<T> {
    values: Vec<T>,
    _counted: crate::memory::Allocation,
}

impl<T: bytemuck::Pod> Scratch<T> {
    /// `len` elements whose contents are unspecified until written.
    pub(crate) fn uninit(len: usize, origin: &'static str) -> Result<Scratch<T>> {
        let bytes = len.saturating_mul(std::mem::size_of::<T>());
        let counted = crate::memory::allocator(crate::base::Device::Cpu)?.malloc(
            bytes,
            crate::memory::Category::Workspace,
            origin,
        )?;
        Ok(Scratch {
            values: data::try_vec_uninit(len)?,
            _counted: counted,
        })
    }
}

impl<T> std::ops::Deref for Scratch<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.values
    }
}

impl<T> std::ops::DerefMut for Scratch<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.values
    }
}

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

/// The `n` values of `values` in a host vector; a size the host cannot hold (a read of a
/// huge expanded view) is an error, never an abort.
fn host_vec<T>(n: usize, values: impl Iterator<Item = T>) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        Error::invalid(
            "to_host",
            format!("the host could not hold {n} values; read a smaller part (narrow) first"),
        )
    })?;
    v.extend(values);
    Ok(v)
}

/// The host runs each op as it is called: nothing to capture.
impl crate::backend::capture::Capture for CpuBackend {}

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
                HostValues::I64(host_vec(src.layout.numel(), offs.map(|i| d.get_i64(i)))?)
            }
            _ => HostValues::F64(host_vec(src.layout.numel(), offs.map(|i| d.get_f64(i)))?),
        })
    }
}
