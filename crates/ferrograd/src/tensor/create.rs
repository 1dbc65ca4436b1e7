//! Creating tensors: zeros, ones, full, arange, from_vec, seeded rand/randn. New tensors count
//! as `input` until re-labelled (parameters, optimizer state...).

use std::sync::Arc;

use half::{bf16, f16};

use super::generate::Draw;
use super::random::{Generator, with_default};
use super::{DType, Device, Layout, Tensor};
use crate::backend::{self, HostValues, Storage};
use crate::base::{Error, Result, bf16_of, f16_of};
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

/// Most I64 elements an upload keeps a host copy of (8 MiB): token ids and targets.
const MAX_REMEMBERED_IDS: usize = 1 << 20;
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
host_float!(f16, DType::F16, |x: f16| x.to_f64(), f16_of);
host_float!(bf16, DType::BF16, |x: bf16| x.to_f64(), bf16_of);

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
    crate::base::checked_numel(op, shape)
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
        // Ids and targets sent to a GPU keep a host copy for their range checks.
        let remembered = match (&values, device, dtype) {
            (HostValues::I64(v), Device::Cuda(_), DType::I64) if v.len() <= MAX_REMEMBERED_IDS => {
                Some(Arc::<[i64]>::from(v.as_slice()))
            }
            _ => None,
        };
        let storage = Storage::new(device, dtype, len, Category::Input, "from_vec", |addr| {
            be.upload(dtype, values, addr)
        })?;
        if let Some(v) = remembered {
            storage.remember_upload(v);
        }
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

    /// `start, start+step, ...` below `end` (like `torch.arange`). Start and end must be
    /// finite and the step finite, non-zero and pointing from start towards end.
    #[track_caller]
    pub fn arange(start: f64, end: f64, step: f64, dtype: DType, device: Device) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let n = arange_len(start, end, step)?;
        let integer = !dtype.is_float();
        let mut i = 0usize;
        let mut next = || {
            let v = start + step * i as f64;
            i += 1;
            // Integer dtypes take the value truncated, as an i64 upload would.
            if integer { v as i64 as f64 } else { v }
        };
        Tensor::generate(&[n], dtype, device, "arange", Draw::F64(&mut next))
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
        if dtype == DType::F32 {
            let (low, high) = (low as f32, high as f32);
            let mut next = || g.next_uniform_f32(low, high);
            Tensor::generate(shape, dtype, device, "rand", Draw::F32(&mut next))
        } else {
            let mut next = || g.next_uniform(low, high);
            Tensor::generate(shape, dtype, device, "rand", Draw::F64(&mut next))
        }
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
        let mut next = || g.next_normal(mean, std);
        Tensor::generate(shape, dtype, device, "randn", Draw::F64(&mut next))
    }
}

/// How many values `arange(start, end, step)` holds; a range that never ends, or ends past
/// what memory can index, is refused.
fn arange_len(start: f64, end: f64, step: f64) -> Result<usize> {
    let refuse = |why: String| Err(Error::invalid("arange", why));
    if !start.is_finite() || !end.is_finite() {
        return refuse(format!(
            "unsupported range {start} -> {end}: start and end must be finite numbers"
        ));
    }
    if !step.is_finite() || step == 0.0 {
        return refuse(format!("step {step} must be a finite, non-zero number"));
    }
    let n = ((end - start) / step).ceil();
    if n < 0.0 {
        return refuse(format!(
            "step {step} never reaches {end} from {start}: its sign must point towards the end"
        ));
    }
    if n.is_nan() || n > isize::MAX as f64 {
        return Err(Error::shape(
            "arange",
            format!("{start} to {end} by {step} is more elements than fit in memory"),
        ));
    }
    Ok(n as usize)
}
