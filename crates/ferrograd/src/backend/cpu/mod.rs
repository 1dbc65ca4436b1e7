//! The CPU backend: the reference semantics. Plain loops, parallel with rayon where a tensor
//! is large enough for it to pay, GEMM from the `gemm` crate.

mod data;
mod elementwise;
mod index;
mod loss;
mod matmul;
mod optim;
mod reduce;
mod rows;

pub use data::{CpuData, Elem};
#[allow(unused_imports)]
pub(crate) use data::{with_float, with_float_pair};

use std::ops::Deref;

use super::{
    Backend, BackendData, BinaryOp, ElementwiseKernels, HostValues, MatmulKernels, MatmulSpec,
    ReduceKernels, ReduceOp, Storage, UnaryOp, View,
};
use crate::error::{Error, Result};
use crate::tensor::{DType, Layout};

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

impl ElementwiseKernels for CpuBackend {
    fn copy(&self, src: View, dst: View) -> Result<()> {
        let s = read(src.storage)?;
        write(dst.storage, |d| {
            elementwise::copy(&s, src.layout, d, dst.layout)
        })
    }

    fn fill(&self, dst: &Storage, value: f64) -> Result<()> {
        write(dst, |d| elementwise::fill(d, value))
    }

    fn unary(&self, op: UnaryOp, x: View, out: &Storage) -> Result<()> {
        let xd = read(x.storage)?;
        write(out, |o| elementwise::unary(op, &xd, x.layout, o))
    }

    fn binary(&self, op: BinaryOp, a: View, b: View, out: &Storage) -> Result<()> {
        let ad = read(a.storage)?;
        if a.storage.same(b.storage) {
            return write(out, |o| {
                elementwise::binary(op, &ad, a.layout, &ad, b.layout, o)
            });
        }
        let bd = read(b.storage)?;
        write(out, |o| {
            elementwise::binary(op, &ad, a.layout, &bd, b.layout, o)
        })
    }

    fn binary_inplace(&self, op: BinaryOp, dst: &Storage, src: View) -> Result<()> {
        if dst.same(src.storage) {
            // Read a private copy of src first: the kernel writes dst while it reads.
            let copy = {
                let s = read(src.storage)?;
                let mut c = CpuData::zeros(s.dtype(), src.layout.numel())?;
                elementwise::copy(
                    &s,
                    src.layout,
                    &mut c,
                    &Layout::contiguous(src.layout.shape()),
                )?;
                c
            };
            let l = Layout::contiguous(src.layout.shape());
            return write(dst, |d| elementwise::binary_inplace(op, d, &copy, &l));
        }
        let s = read(src.storage)?;
        write(dst, |d| elementwise::binary_inplace(op, d, &s, src.layout))
    }
}

impl ReduceKernels for CpuBackend {
    fn reduce(&self, op: ReduceOp, x: View, dims: &[usize], out: &Storage) -> Result<()> {
        let xd = read(x.storage)?;
        write(out, |o| reduce::reduce(op, &xd, x.layout, dims, o))
    }
}

impl MatmulKernels for CpuBackend {
    fn matmul(&self, spec: &MatmulSpec, a: View, b: View, out: &Storage) -> Result<()> {
        let ad = read(a.storage)?;
        if a.storage.same(b.storage) {
            return write(out, |o| {
                matmul::matmul(spec, &ad, a.layout, &ad, b.layout, o)
            });
        }
        let bd = read(b.storage)?;
        write(out, |o| {
            matmul::matmul(spec, &ad, a.layout, &bd, b.layout, o)
        })
    }

    fn matmul_acc(
        &self,
        spec: &MatmulSpec,
        a: View,
        b: View,
        out: &Storage,
        beta: f64,
    ) -> Result<()> {
        let ad = read(a.storage)?;
        if a.storage.same(b.storage) {
            return write(out, |o| {
                matmul::matmul_acc(spec, &ad, a.layout, &ad, b.layout, o, beta)
            });
        }
        let bd = read(b.storage)?;
        write(out, |o| {
            matmul::matmul_acc(spec, &ad, a.layout, &bd, b.layout, o, beta)
        })
    }
}
