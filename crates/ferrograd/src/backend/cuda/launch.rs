//! The one place CUDA launchers get their operands and launch from: the device address of a
//! view, temporaries through the device's caching allocator, ids read back for host checks,
//! kernel-name suffixes and dtype codes, launch shapes, and the launch call itself. Operand
//! *validation* is not here: the family modules (backend/rows.rs...) check shapes, dtypes and
//! lengths once before any backend runs.

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use super::{CudaDevice, ptr};
use crate::backend::View;
use crate::error::{Error, Result};
use crate::memory::{Allocation, Category};
use crate::tensor::{DType, Device};

/// Threads per block of the row and reduction kernels (BLOCK in the .cu files).
pub(crate) const BLOCK: u32 = 256;
/// Most blocks a row kernel launches; rows beyond are taken by a grid-stride loop.
pub(crate) const MAX_ROW_BLOCKS: usize = 1 << 20;

/// One kernel module: its NVRTC cache key and its source.
pub(crate) struct Module {
    pub key: &'static str,
    pub src: &'static str,
}

/// One kernel argument. Launch arguments are read through references, so they live in a
/// slice that outlasts the launch call. `Ptr` is a device address (a C++ pointer parameter;
/// 0 is null), `I64` a `long long`, `F64` a `double`, `F32` a `float`, `I32` an `int`, and
/// `Struct` a `#[repr(C)]` parameter struct laid out as its C++ twin.
#[derive(Clone, Copy)]
pub(crate) enum Arg<'a> {
    Ptr(u64),
    I64(i64),
    F64(f64),
    F32(f32),
    I32(i32),
    Struct(&'a dyn ArgStruct),
}

/// A `#[repr(C)]` kernel parameter struct (strides of a strided walk, optimizer scalars...).
pub(crate) trait ArgStruct: Sync {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>);
}

impl<T: DeviceRepr + Sync> ArgStruct for T {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(self);
    }
}

/// An element count or index as a kernel's `long long`.
pub(crate) fn i64_of(v: usize) -> Arg<'static> {
    Arg::I64(v as i64)
}

/// Launches kernel `name` of `module` with `args`, in order.
pub(crate) fn launch(
    d: &CudaDevice,
    module: &Module,
    name: &str,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<()> {
    let f = d.function(module.key, module.src, name)?;
    let mut b = d.stream().launch_builder(&f);
    for a in args {
        match a {
            Arg::Ptr(v) => {
                b.arg(v);
            }
            Arg::I64(v) => {
                b.arg(v);
            }
            Arg::F64(v) => {
                b.arg(v);
            }
            Arg::F32(v) => {
                b.arg(v);
            }
            Arg::I32(v) => {
                b.arg(v);
            }
            Arg::Struct(v) => v.push(&mut b),
        }
    }
    // SAFETY: every launcher passes the kernel's parameters in order with matching sizes;
    // pointers are live device blocks (inputs, caller-allocated outputs, or temporaries that
    // stay allocated until the launch is queued: later users of a freed block are ordered
    // after it on this device's single stream), and the sizes and element counts passed
    // bound every access (the family validators checked them against the storages).
    unsafe { b.launch(cfg) }.map_err(|e| d.err(&format!("launching {name}"), e))?;
    Ok(())
}

/// One block of BLOCK threads per row (rows > 0).
pub(crate) fn rows_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, MAX_ROW_BLOCKS) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Kernel-name suffix of a float dtype; any other dtype is an error (never a silent f32).
pub(crate) fn suffix(op: &'static str, dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::F64 => Ok("f64"),
        DType::F16 => Ok("f16"),
        DType::BF16 => Ok("bf16"),
        dtype => Err(Error::UnsupportedDType {
            op,
            dtype,
            hint: "this op needs a floating-point tensor; convert with .to_dtype(DType::F32)",
        }),
    }
}

/// The code of a float dtype passed to kernels that take a buffer whose dtype may differ
/// from the rows' (statistics, losses): FG_F32.. in kernels/prelude.cuh.
pub(crate) fn float_code(op: &'static str, dtype: DType) -> Result<i32> {
    suffix(op, dtype)?;
    Ok(dtype_code(dtype))
}

/// The code of any dtype, as the kernels' `dtype` parameters read it (kernels/prelude.cuh).
pub(crate) fn dtype_code(dt: DType) -> i32 {
    match dt {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        DType::I64 => 4,
        DType::U8 => 5,
    }
}

/// Device address of a view's first element.
pub(crate) fn addr(v: &View) -> Result<u64> {
    Ok(ptr(v.storage)? + (v.layout.offset() * v.storage.dtype().size_in_bytes()) as u64)
}

/// A device temporary from this device's allocator, counted as `temporary` while alive.
/// Work queued later on the (single) stream is ordered after the kernels that use it, so
/// dropping it right after queueing those kernels is safe.
pub(crate) fn temp(d: &CudaDevice, bytes: usize, origin: &'static str) -> Result<Allocation> {
    crate::memory::allocator(Device::Cuda(d.ordinal()))?.malloc(
        bytes.max(8),
        Category::Temporary,
        origin,
    )
}

/// Uploads host words into a fresh temporary.
pub(crate) fn upload_words<T: bytemuck::Pod>(
    d: &CudaDevice,
    values: &[T],
    origin: &'static str,
) -> Result<Allocation> {
    let t = temp(d, std::mem::size_of_val(values), origin)?;
    d.copy_to_device(t.addr(), bytemuck::cast_slice(values))?;
    Ok(t)
}

/// The I64 values of a validated view (any layout, inside its storage), in row-major order,
/// read back to the host.
pub(crate) fn host_i64s(d: &CudaDevice, v: &View) -> Result<Vec<i64>> {
    let l = v.layout;
    if l.numel() == 0 {
        return Ok(Vec::new());
    }
    // The span of storage elements the layout reaches (stride 0 reads one element).
    let (mut lo, mut hi) = (l.offset() as isize, l.offset() as isize);
    for (&n, &s) in l.shape().iter().zip(l.strides()) {
        let reach = (n as isize - 1) * s;
        if reach < 0 {
            lo += reach;
        } else {
            hi += reach;
        }
    }
    let (lo, hi) = (lo as usize, hi as usize);
    let bytes = d.copy_to_host(ptr(v.storage)? + (lo * 8) as u64, (hi - lo + 1) * 8)?;
    let mut span = vec![0i64; hi - lo + 1];
    bytemuck::cast_slice_mut::<i64, u8>(&mut span).copy_from_slice(&bytes);
    if l.is_contiguous() {
        return Ok(span);
    }
    Ok(l.offsets().map(|o| span[o - lo]).collect())
}
