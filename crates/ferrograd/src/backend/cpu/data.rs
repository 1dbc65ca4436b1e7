//! Host buffers of each dtype, the element trait the float kernels are generic over, and the
//! dispatch macro that picks the typed buffer.

use half::{bf16, f16};

use crate::backend::HostValues;
use crate::base::DType;
use crate::base::{Error, Result};

pub enum CpuData {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I64(Vec<i64>),
    U8(Vec<u8>),
}

/// Float element types the CPU kernels compute in. f16/bf16 arithmetic widens to f32 per
/// operation (half's `Float` impl), which is slow but exact to their rounding.
pub trait Elem: num_traits::Float + Send + Sync + Default + 'static {
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    /// exp at this type's precision: f64 through libm, the narrower types through the
    /// vector-friendly `exp_f32` (at most 1 ulp of f32).
    #[inline(always)]
    fn exp_v(self) -> Self {
        Self::from_f64(Self::exp_of(self.to_f64()))
    }
    /// exp of an f64 intermediate whose result is stored at this type's precision.
    fn exp_of(d: f64) -> f64;
    /// `v` rounded to f32 and then to this type: what an f32 computation followed by a cast
    /// stores (f64 keeps `v`).
    #[inline(always)]
    fn round_through_f32(v: f64) -> Self {
        Self::from_f64(v as f32 as f64)
    }
    /// ln and tanh at this type's precision: f64 through std, the narrower types through
    /// the vector-friendly `ln_f32` and `tanh_f32` (at most 1 ulp of f32 each).
    #[inline(always)]
    fn ln_v(self) -> Self {
        Self::from_f64(super::vmath::ln_f32(self.to_f64() as f32) as f64)
    }
    #[inline(always)]
    fn tanh_v(self) -> Self {
        Self::from_f64(super::vmath::tanh_f32(self.to_f64() as f32) as f64)
    }
}

macro_rules! impl_elem {
    (@exp narrow) => {
        #[inline(always)]
        fn exp_of(d: f64) -> f64 {
            super::vmath::exp_f32(d as f32) as f64
        }
    };
    (@exp f32) => {
        impl_elem!(@exp narrow);
        #[inline(always)]
        fn exp_v(self) -> Self {
            super::vmath::exp_f32(self)
        }
        #[inline(always)]
        fn ln_v(self) -> Self {
            super::vmath::ln_f32(self)
        }
        #[inline(always)]
        fn tanh_v(self) -> Self {
            super::vmath::tanh_f32(self)
        }
    };
    (@exp f64) => {
        #[inline(always)]
        fn exp_of(d: f64) -> f64 {
            d.exp()
        }
        #[inline(always)]
        fn round_through_f32(v: f64) -> Self {
            v
        }
        #[inline(always)]
        fn ln_v(self) -> Self {
            self.ln()
        }
        #[inline(always)]
        fn tanh_v(self) -> Self {
            self.tanh()
        }
    };
    ($t:ty, $from:expr, $to:expr, $exp:tt) => {
        impl Elem for $t {
            impl_elem!(@exp $exp);
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                $to(self)
            }
        }
    };
}
impl_elem!(f32, |v| v as f32, |x: f32| x as f64, f32);
impl_elem!(f64, |v| v, |x: f64| x, f64);
impl_elem!(f16, crate::base::f16_of, |x: f16| x.to_f64(), narrow);
impl_elem!(bf16, crate::base::bf16_of, |x: bf16| x.to_f64(), narrow);

/// Runs `$body` with `$v` bound to the typed float buffer; integer buffers are an error.
macro_rules! with_float {
    ($data:expr, $op:expr, $v:ident => $body:expr) => {
        match $data {
            $crate::backend::cpu::CpuData::F32($v) => $body,
            $crate::backend::cpu::CpuData::F64($v) => $body,
            $crate::backend::cpu::CpuData::F16($v) => $body,
            $crate::backend::cpu::CpuData::BF16($v) => $body,
            other => {
                return Err($crate::base::Error::UnsupportedDType {
                    op: $op,
                    dtype: other.dtype(),
                    hint: "this op needs a floating-point tensor; convert with .to_dtype(DType::F32)",
                })
            }
        }
    };
}
pub(crate) use with_float;

/// Runs `$body` with `$a`, `$b` bound to two float buffers of the same type.
macro_rules! with_float_pair {
    ($x:expr, $y:expr, $op:expr, $a:ident, $b:ident => $body:expr) => {
        match ($x, $y) {
            ($crate::backend::cpu::CpuData::F32($a), $crate::backend::cpu::CpuData::F32($b)) => {
                $body
            }
            ($crate::backend::cpu::CpuData::F64($a), $crate::backend::cpu::CpuData::F64($b)) => {
                $body
            }
            ($crate::backend::cpu::CpuData::F16($a), $crate::backend::cpu::CpuData::F16($b)) => {
                $body
            }
            ($crate::backend::cpu::CpuData::BF16($a), $crate::backend::cpu::CpuData::BF16($b)) => {
                $body
            }
            (x, y) => {
                return Err($crate::base::Error::DType {
                    op: $op,
                    expected: x.dtype(),
                    got: y.dtype(),
                })
            }
        }
    };
}
pub(crate) use with_float_pair;

/// Expands `$go!(Variant)` with the float variant name of `$data` (F32, F64, F16, BF16), so a
/// kernel can match several buffers of that one variant; integer buffers are an error.
macro_rules! per_float_variant {
    ($data:expr, $op:expr, $hint:expr, $go:ident) => {
        match $data {
            $crate::backend::cpu::CpuData::F32(_) => $go!(F32),
            $crate::backend::cpu::CpuData::F64(_) => $go!(F64),
            $crate::backend::cpu::CpuData::F16(_) => $go!(F16),
            $crate::backend::cpu::CpuData::BF16(_) => $go!(BF16),
            other => Err($crate::base::Error::UnsupportedDType {
                op: $op,
                dtype: other.dtype(),
                hint: $hint,
            }),
        }
    };
}
pub(crate) use per_float_variant;

impl CpuData {
    pub fn dtype(&self) -> DType {
        match self {
            CpuData::F32(_) => DType::F32,
            CpuData::F64(_) => DType::F64,
            CpuData::F16(_) => DType::F16,
            CpuData::BF16(_) => DType::BF16,
            CpuData::I64(_) => DType::I64,
            CpuData::U8(_) => DType::U8,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            CpuData::F32(v) => v.len(),
            CpuData::F64(v) => v.len(),
            CpuData::F16(v) => v.len(),
            CpuData::BF16(v) => v.len(),
            CpuData::I64(v) => v.len(),
            CpuData::U8(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A zeroed buffer; allocation failure is an error, never an abort.
    pub fn zeros(dtype: DType, len: usize) -> Result<CpuData> {
        Ok(match dtype {
            DType::F32 => CpuData::F32(try_vec(len)?),
            DType::F64 => CpuData::F64(try_vec(len)?),
            DType::F16 => CpuData::F16(try_vec(len)?),
            DType::BF16 => CpuData::BF16(try_vec(len)?),
            DType::I64 => CpuData::I64(try_vec(len)?),
            DType::U8 => CpuData::U8(try_vec(len)?),
        })
    }

    /// A buffer whose contents are unspecified, for a kernel that writes every element before
    /// anything reads it (PyTorch's `empty`): no zero-fill pass.
    pub fn uninit(dtype: DType, len: usize) -> Result<CpuData> {
        Ok(match dtype {
            DType::F32 => CpuData::F32(try_vec_uninit(len)?),
            DType::F64 => CpuData::F64(try_vec_uninit(len)?),
            DType::F16 => CpuData::F16(try_vec_uninit(len)?),
            DType::BF16 => CpuData::BF16(try_vec_uninit(len)?),
            DType::I64 => CpuData::I64(try_vec_uninit(len)?),
            DType::U8 => CpuData::U8(try_vec_uninit(len)?),
        })
    }

    /// Host values stored as `dtype`. A conversion's new buffer comes from a fallible
    /// allocation: a host that cannot hold it is an error, never an abort.
    pub fn from_host(dtype: DType, values: HostValues) -> Result<CpuData> {
        fn conv<A: Copy, B: bytemuck::Pod>(v: &[A], f: impl Fn(A) -> B) -> Result<Vec<B>> {
            let mut out = try_vec_uninit::<B>(v.len())?;
            out.iter_mut().zip(v).for_each(|(o, &x)| *o = f(x));
            Ok(out)
        }
        Ok(match (dtype, values) {
            (DType::F32, HostValues::F32(v)) => CpuData::F32(v),
            (DType::F64, HostValues::F64(v)) => CpuData::F64(v),
            (DType::I64, HostValues::I64(v)) => CpuData::I64(v),
            (DType::F64, HostValues::F32(v)) => CpuData::F64(conv(&v, |x| x as f64)?),
            (DType::F16, HostValues::F32(v)) => CpuData::F16(conv(&v, f16::from_f32)?),
            (DType::BF16, HostValues::F32(v)) => CpuData::BF16(conv(&v, bf16::from_f32)?),
            (DType::I64, HostValues::F32(v)) => CpuData::I64(conv(&v, |x| x as f64 as i64)?),
            (DType::U8, HostValues::F32(v)) => CpuData::U8(conv(&v, |x| (x as f64 != 0.0) as u8)?),
            (DType::F32, HostValues::F64(v)) => CpuData::F32(conv(&v, |x| x as f32)?),
            (DType::F16, HostValues::F64(v)) => CpuData::F16(conv(&v, crate::base::f16_of)?),
            (DType::BF16, HostValues::F64(v)) => CpuData::BF16(conv(&v, crate::base::bf16_of)?),
            (DType::I64, HostValues::F64(v)) => CpuData::I64(conv(&v, |x| x as i64)?),
            (DType::U8, HostValues::F64(v)) => CpuData::U8(conv(&v, |x| (x != 0.0) as u8)?),
            (DType::U8, HostValues::I64(v)) => CpuData::U8(conv(&v, |x| (x != 0) as u8)?),
            (DType::F32, HostValues::I64(v)) => CpuData::F32(conv(&v, |x| x as f64 as f32)?),
            (DType::F64, HostValues::I64(v)) => CpuData::F64(conv(&v, |x| x as f64)?),
            (DType::F16, HostValues::I64(v)) => {
                CpuData::F16(conv(&v, |x| crate::base::f16_of(x as f64))?)
            }
            (DType::BF16, HostValues::I64(v)) => {
                CpuData::BF16(conv(&v, |x| crate::base::bf16_of(x as f64))?)
            }
        })
    }

    /// Element `i` as f64 (integers converted).
    pub fn get_f64(&self, i: usize) -> f64 {
        match self {
            CpuData::F32(v) => v[i] as f64,
            CpuData::F64(v) => v[i],
            CpuData::F16(v) => v[i].to_f64(),
            CpuData::BF16(v) => v[i].to_f64(),
            CpuData::I64(v) => v[i] as f64,
            CpuData::U8(v) => v[i] as f64,
        }
    }

    pub fn get_i64(&self, i: usize) -> i64 {
        match self {
            CpuData::I64(v) => v[i],
            CpuData::U8(v) => v[i] as i64,
            other => other.get_f64(i) as i64,
        }
    }
}

fn alloc_failed(len: usize) -> Error {
    Error::invalid(
        "allocate",
        format!(
            "the host could not allocate {len} elements; use smaller sizes or free other tensors"
        ),
    )
}

/// A buffer of `len` elements straight from the allocator, not filled. Only plain-data
/// element types (every bit pattern a valid value: the `Pod` bound) reach it, and its callers
/// (`Backend::empty`) hand it to a kernel that writes every element before any is read.
pub(crate) fn try_vec_uninit<T: bytemuck::Pod>(len: usize) -> Result<Vec<T>> {
    if len == 0 || std::mem::size_of::<T>() == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(len).map_err(|_| alloc_failed(len))?;
    // SAFETY: the layout is non-zero-sized; the pointer comes from the global allocator with
    // exactly this layout (capacity = len), which Vec::from_raw_parts requires. T is Pod, so
    // any bytes are a valid T, and the contract above has every element written before read.
    unsafe {
        let ptr = std::alloc::alloc(layout) as *mut T;
        if ptr.is_null() {
            return Err(alloc_failed(len));
        }
        Ok(Vec::from_raw_parts(ptr, len, len))
    }
}

/// A zero-filled buffer from the allocator's zeroed path (calloc): large buffers arrive as
/// fresh zero pages with no memset pass. Failure is an error, never an abort.
fn try_vec<T: bytemuck::Zeroable>(len: usize) -> Result<Vec<T>> {
    let fail = || {
        Error::invalid(
            "allocate",
            format!(
                "the host could not allocate {len} elements; use smaller sizes or free other tensors"
            ),
        )
    };
    if len == 0 || std::mem::size_of::<T>() == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(len).map_err(|_| fail())?;
    // SAFETY: the layout is non-zero-sized; all-zero bytes are a valid T (Zeroable); the
    // pointer comes from the global allocator with exactly this layout, which is what
    // Vec::from_raw_parts requires (capacity = len).
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout) as *mut T;
        if ptr.is_null() {
            return Err(fail());
        }
        Ok(Vec::from_raw_parts(ptr, len, len))
    }
}
