//! Creating tensors: zeros, ones, full, arange, from_vec, seeded rand/randn. New tensors count
//! as `input` until re-labelled (parameters, optimizer state...).

use std::sync::Arc;

use half::{bf16, f16};

use super::random::{Generator, with_default};
use super::{DType, Device, Layout, Tensor};
use crate::backend::{self, HostValues, Storage};
use crate::base::{Error, Result};
use crate::memory::Category;

/// Host element types that tensors can be built from and read into.
pub trait HostElem: Copy + 'static {
    const DTYPE: DType;
    fn to_host(v: Vec<Self>) -> HostValues;
    fn from_host(v: HostValues) -> Vec<Self>;
}

macro_rules! host_float {
    ($t:ty, $d:expr, $to:expr, $from:expr) => {
        impl HostElem for $t {
            const DTYPE: DType = $d;
            fn to_host(v: Vec<Self>) -> HostValues {
                HostValues::F64(v.into_iter().map($to).collect())
            }
            fn from_host(v: HostValues) -> Vec<Self> {
                match v {
                    HostValues::F64(v) => v.into_iter().map($from).collect(),
                    HostValues::F32(v) => v.into_iter().map(|x| $from(x as f64)).collect(),
                    HostValues::I64(v) => v.into_iter().map(|x| $from(x as f64)).collect(),
                }
            }
        }
    };
}
impl HostElem for f32 {
    const DTYPE: DType = DType::F32;
    fn to_host(v: Vec<Self>) -> HostValues {
        HostValues::F32(v)
    }
    fn from_host(v: HostValues) -> Vec<Self> {
        match v {
            HostValues::F32(v) => v,
            HostValues::F64(v) => v.into_iter().map(|x| x as f32).collect(),
            HostValues::I64(v) => v.into_iter().map(|x| x as f32).collect(),
        }
    }
}
host_float!(f64, DType::F64, |x: f64| x, |x: f64| x);
host_float!(f16, DType::F16, |x: f16| x.to_f64(), f16::from_f64);
host_float!(bf16, DType::BF16, |x: bf16| x.to_f64(), bf16::from_f64);

macro_rules! host_int {
    ($t:ty, $d:expr) => {
        impl HostElem for $t {
            const DTYPE: DType = $d;
            fn to_host(v: Vec<Self>) -> HostValues {
                HostValues::I64(v.into_iter().map(|x| x as i64).collect())
            }
            fn from_host(v: HostValues) -> Vec<Self> {
                match v {
                    HostValues::I64(v) => v.into_iter().map(|x| x as $t).collect(),
                    HostValues::F64(v) => v.into_iter().map(|x| x as $t).collect(),
                    HostValues::F32(v) => v.into_iter().map(|x| x as $t).collect(),
                }
            }
        }
    };
}
host_int!(i64, DType::I64);
host_int!(u8, DType::U8);

fn numel_of(op: &'static str, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            Error::shape(
                op,
                format!("shape {shape:?} has more elements than fit in memory"),
            )
        })
}

impl Tensor {
    /// A new zero-filled contiguous tensor with the given category; `origin` names the op.
    pub(crate) fn alloc(
        shape: &[usize],
        dtype: DType,
        device: Device,
        category: Category,
        origin: &'static str,
    ) -> Result<Tensor> {
        Tensor::alloc_with(shape, dtype, device, category, origin, true)
    }

    fn alloc_with(
        shape: &[usize],
        dtype: DType,
        device: Device,
        category: Category,
        origin: &'static str,
        zeroed: bool,
    ) -> Result<Tensor> {
        let len = numel_of(origin, shape)?;
        let be = backend::backend(device)?;
        let storage = Storage::new(device, dtype, len, category, origin, |addr| {
            if zeroed {
                be.zeros(dtype, len, addr)
            } else {
                be.empty(dtype, len, addr)
            }
        })?;
        Ok(Tensor::from_storage(
            Arc::new(storage),
            Layout::contiguous(shape),
        ))
    }

    /// An op output: a fresh contiguous tensor counted as `temporary`.
    pub(crate) fn output(
        shape: &[usize],
        dtype: DType,
        device: Device,
        origin: &'static str,
    ) -> Result<Tensor> {
        Tensor::alloc(shape, dtype, device, Category::Temporary, origin)
    }

    /// An op output whose kernel writes every element: not zero-filled where the backend
    /// can skip it (the GPU and the CPU), so large outputs cost no memset.
    pub(crate) fn output_uninit(
        shape: &[usize],
        dtype: DType,
        device: Device,
        origin: &'static str,
    ) -> Result<Tensor> {
        Tensor::alloc_with(shape, dtype, device, Category::Temporary, origin, false)
    }

    pub(crate) fn from_host_values(
        values: HostValues,
        shape: &[usize],
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        let len = numel_of("from_vec", shape)?;
        let n = values.len();
        if n != len {
            return Err(Error::shape(
                "from_vec",
                format!("{n} values cannot fill shape {shape:?} ({len} elements)"),
            ));
        }
        let be = backend::backend(device)?;
        let storage = Storage::new(device, dtype, len, Category::Input, "from_vec", |addr| {
            be.upload(dtype, values, addr)
        })?;
        Ok(Tensor::from_storage(
            Arc::new(storage),
            Layout::contiguous(shape),
        ))
    }

    /// A tensor holding `data` with `shape`, on `device`; its dtype is `T`'s.
    #[track_caller]
    pub fn from_vec<T: HostElem>(data: Vec<T>, shape: &[usize], device: Device) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        Tensor::from_host_values(T::to_host(data), shape, T::DTYPE, device)
    }

    /// Like `from_vec` but stored as `dtype` (values converted).
    #[track_caller]
    pub fn from_vec_as<T: HostElem>(
        data: Vec<T>,
        shape: &[usize],
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        Tensor::from_host_values(T::to_host(data), shape, dtype, device)
    }

    /// A 0-dim tensor.
    #[track_caller]
    pub fn scalar(value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        Tensor::from_vec_as(vec![value], &[], dtype, device)
    }

    #[track_caller]
    pub fn zeros(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        Tensor::alloc(shape, dtype, device, Category::Input, "zeros")
    }

    #[track_caller]
    pub fn ones(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        Tensor::full(shape, 1.0, dtype, device)
    }

    #[track_caller]
    pub fn full(shape: &[usize], value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let t = Tensor::alloc(shape, dtype, device, Category::Input, "full")?;
        backend::elementwise::fill(t.storage(), value)?;
        Ok(t)
    }

    #[track_caller]
    pub fn zeros_like(&self) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        Tensor::zeros(self.shape(), self.dtype(), self.device())
    }

    #[track_caller]
    pub fn ones_like(&self) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        Tensor::ones(self.shape(), self.dtype(), self.device())
    }

    /// `start, start+step, ...` below `end` (like `torch.arange`).
    #[track_caller]
    pub fn arange(start: f64, end: f64, step: f64, dtype: DType, device: Device) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if step == 0.0 || (end - start) / step < 0.0 {
            return Err(Error::invalid(
                "arange",
                format!("step {step} never reaches {end} from {start}"),
            ));
        }
        let n = ((end - start) / step).ceil() as usize;
        let values: Vec<f64> = (0..n).map(|i| start + step * i as f64).collect();
        let host = if dtype.is_float() {
            HostValues::F64(values)
        } else {
            HostValues::I64(values.into_iter().map(|v| v as i64).collect())
        };
        Tensor::from_host_values(host, &[n], dtype, device)
    }

    /// Uniform in [0, 1) from the default generator.
    #[track_caller]
    pub fn rand(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        with_default(|g| Tensor::rand_with(shape, dtype, device, g))
    }

    /// Standard normal from the default generator.
    #[track_caller]
    pub fn randn(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        with_default(|g| Tensor::randn_with(shape, dtype, device, g))
    }

    #[track_caller]
    pub fn rand_with(
        shape: &[usize],
        dtype: DType,
        device: Device,
        g: &mut Generator,
    ) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        Tensor::uniform_with(shape, 0.0, 1.0, dtype, device, g)
    }

    #[track_caller]
    pub fn uniform_with(
        shape: &[usize],
        low: f64,
        high: f64,
        dtype: DType,
        device: Device,
        g: &mut Generator,
    ) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let n = numel_of("rand", shape)?;
        let values = if dtype == DType::F32 {
            HostValues::F32(g.uniform_f32(n, low as f32, high as f32))
        } else {
            HostValues::F64(g.uniform(n, low, high))
        };
        Tensor::from_host_values(values, shape, dtype, device)
    }

    #[track_caller]
    pub fn randn_with(
        shape: &[usize],
        dtype: DType,
        device: Device,
        g: &mut Generator,
    ) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        Tensor::normal_with(shape, 0.0, 1.0, dtype, device, g)
    }

    #[track_caller]
    pub fn normal_with(
        shape: &[usize],
        mean: f64,
        std: f64,
        dtype: DType,
        device: Device,
        g: &mut Generator,
    ) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let n = numel_of("randn", shape)?;
        let values = if dtype == DType::F32 {
            HostValues::F32(
                g.normal(n, mean, std)
                    .into_iter()
                    .map(|x| x as f32)
                    .collect(),
            )
        } else {
            HostValues::F64(g.normal(n, mean, std))
        };
        Tensor::from_host_values(values, shape, dtype, device)
    }
}
