//! The one place CUDA launchers get their operands and launch from: the device address of a
//! view, temporaries through the device's caching allocator, ids read back for host checks,
//! kernel-name suffixes and dtype codes, launch shapes, and the launch call itself. Operand
//! *validation* is not here: the family modules (backend/rows.rs...) check shapes, dtypes and
//! lengths once before any backend runs.

use std::sync::OnceLock;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use super::{CudaDevice, codes, ptr};
use crate::backend::{Storage, View};
use crate::base::{DType, Device, Layout};
use crate::base::{Error, Result};
use crate::memory::{Allocation, Category};

/// Threads per block of the row and reduction kernels (BLOCK in the .cu files).
pub(crate) const BLOCK: u32 = 256;
/// Most blocks a row kernel launches; rows beyond are taken by a grid-stride loop.
pub(crate) const MAX_ROW_BLOCKS: usize = 1 << 20;

/// The prelude of every kernel file (after the generated codes).
const PRELUDE: &str = include_str!("kernels/prelude.cuh");

/// One kernel module: its NVRTC cache key and its kernel file. The source NVRTC compiles is
/// the generated code header, the module's own `#define`s (a file compiled once per
/// configuration, such as attention.cu per dtype and head dim), the prelude and the file,
/// assembled once on first use.
pub(crate) struct Module {
    key: &'static str,
    defines: &'static str,
    body: &'static str,
    src: OnceLock<String>,
}

impl Module {
    pub(crate) const fn new(key: &'static str, body: &'static str) -> Module {
        Module::with_defines(key, "", body)
    }

    pub(crate) const fn with_defines(
        key: &'static str,
        defines: &'static str,
        body: &'static str,
    ) -> Module {
        Module {
            key,
            defines,
            body,
            src: OnceLock::new(),
        }
    }

    /// The instantiations this module compiles from a file shared by several modules: the
    /// lines after the file's last `#if defined(NAME)` or `#elif defined(NAME)` (its module
    /// section, at the end), NAME being the macro its defines set, up to the next `#elif`,
    /// `#else` or `#endif`. For tests of which module holds which kernels.
    #[cfg(test)]
    pub(crate) fn own_block(&self) -> Option<&'static str> {
        let name = self.defines.strip_prefix("#define ")?.trim();
        let start = self.body.rfind(&format!("defined({name})"))?;
        let from = start + self.body[start..].find('\n')? + 1;
        let rest = &self.body[from..];
        let end = ["\n#elif", "\n#else", "\n#endif"]
            .iter()
            .filter_map(|m| rest.find(m))
            .min()?;
        Some(&rest[..end])
    }

    /// The module's NVRTC cache key (unique among modules).
    pub(crate) fn key(&self) -> &'static str {
        self.key
    }

    /// The kernel file (with the headers the launcher prepends) this module compiles.
    #[cfg(test)]
    pub(crate) fn body(&self) -> &'static str {
        self.body
    }

    /// codes header + defines + prelude.cuh + the kernel file.
    pub(crate) fn source(&'static self) -> &'static str {
        self.src
            .get_or_init(|| [codes::header().as_str(), self.defines, PRELUDE, self.body].concat())
    }
}

/// One kernel argument. Launch arguments are read through references, so they live in a
/// slice that outlasts the launch call. `Ptr` is a device address (a C++ pointer parameter;
/// 0 is null), `U64` an `unsigned long long`, `I64` a `long long`, `F64` a `double`, `F32` a `float`, `I32` an `int`, and
/// `Struct` a `#[repr(C)]` parameter struct laid out as its C++ twin.
#[derive(Clone, Copy)]
pub(crate) enum Arg<'a> {
    Ptr(u64),
    U64(u64),
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

/// The shared memory a kernel gets without opting in.
const STATIC_SMEM_LIMIT: u32 = 48 << 10;

/// Launches kernel `name` of `module` with `args`, in order.
pub(crate) fn launch(
    d: &CudaDevice,
    module: &'static Module,
    name: &str,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<()> {
    let f = d.function(module.key, module.source(), name)?;
    if cfg.shared_mem_bytes > STATIC_SMEM_LIMIT {
        // More than 48 KiB of dynamic shared memory is an opt-in per kernel.
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            cfg.shared_mem_bytes as i32,
        )
        .map_err(|e| d.err(&format!("raising {name}'s shared memory"), e))?;
    }
    let mut b = d.stream().launch_builder(&f);
    for a in args {
        match a {
            Arg::Ptr(v) | Arg::U64(v) => {
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
    super::timing::timed(
        d,
        || name.to_string(),
        || {
            unsafe { b.launch(cfg) }.map_err(|e| d.err(&format!("launching {name}"), e))?;
            Ok(())
        },
    )
}

/// One block of BLOCK threads per row (rows > 0).
pub(crate) fn rows_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, MAX_ROW_BLOCKS) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A grid-stride launch shape for `n` elements.
pub(crate) fn grid(n: usize) -> LaunchConfig {
    CudaDevice::grid_1d(n)
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
/// from the rows' (statistics, losses).
pub(crate) fn float_code(op: &'static str, dtype: DType) -> Result<i32> {
    suffix(op, dtype)?;
    Ok(dtype_code(dtype))
}

/// The code of any dtype (DT_* in codes.rs), as the kernels' dtype parameters read it.
pub(crate) fn dtype_code(dt: DType) -> i32 {
    match dt {
        DType::F32 => codes::DT_F32,
        DType::F64 => codes::DT_F64,
        DType::F16 => codes::DT_F16,
        DType::BF16 => codes::DT_BF16,
        DType::I64 => codes::DT_I64,
        DType::U8 => codes::DT_U8,
    }
}

/// The device address of a storage that must live on `d` (not another GPU).
pub(crate) fn dev_ptr(d: &CudaDevice, op: &'static str, s: &Storage) -> Result<u64> {
    let here = Device::Cuda(d.ordinal());
    if s.device() != here {
        return Err(Error::DeviceMismatch {
            op,
            a: here,
            b: s.device(),
        });
    }
    ptr(s)
}

/// Device address of a view's first element.
pub(crate) fn addr(v: &View) -> Result<u64> {
    Ok(ptr(v.storage)? + (v.layout.offset() * v.storage.dtype().size_in_bytes()) as u64)
}

/// Whether every address in `addrs` (0: an absent operand) is a multiple of four elements of
/// `dtype`: the test for moving a group of four elements as one 8- or 16-byte vector
/// (`Quad` in prelude.cuh).
pub(crate) fn quads_aligned(dtype: DType, addrs: &[u64]) -> bool {
    let quad = 4 * dtype.size_in_bytes() as u64;
    addrs.iter().all(|a| a.is_multiple_of(quad))
}

/// What a device temporary of `bytes` takes: at least one 8-byte word, so that every
/// temporary has an address (the planner rounds the same way).
pub(crate) fn temp_bytes(bytes: usize) -> usize {
    bytes.max(8)
}

/// A device temporary from this device's allocator, counted as `temporary` while alive.
/// Work queued later on the (single) stream is ordered after the kernels that use it, so
/// dropping it right after queueing those kernels is safe.
pub(crate) fn temp(d: &CudaDevice, bytes: usize, origin: &'static str) -> Result<Allocation> {
    crate::memory::allocator(Device::Cuda(d.ordinal()))?.malloc(
        temp_bytes(bytes),
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

/// The I64 values of a validated view (any layout, inside its storage), in row-major order:
/// from the host copy of an unchanged upload when there is one, else read back (which waits
/// for the device).
pub(crate) fn host_i64s(d: &CudaDevice, v: &View) -> Result<Vec<i64>> {
    let l = v.layout;
    if l.numel() == 0 {
        return Ok(Vec::new());
    }
    if let Some(uploaded) = v.storage.uploaded_i64s() {
        return Ok(l.offsets().map(|o| uploaded[o]).collect());
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

// ---- strided operands -------------------------------------------------------------------------

/// Most dims a kernel operand may have after merging (`MAX_RANK` in prelude.cuh).
pub(crate) const MAX_RANK: usize = 8;

/// A view as the kernels take it (`struct Strided` in prelude.cuh): element offset, then
/// shape and strides in elements.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Strided {
    pub(crate) offset: i64,
    pub(crate) rank: i32,
    /// 1 when the view has fewer than 2^31 elements: kernels then locate elements with
    /// 32-bit division, several times cheaper on the GPU than 64-bit.
    pub(crate) index32: i32,
    pub(crate) shape: [i64; MAX_RANK],
    pub(crate) strides: [i64; MAX_RANK],
}

// SAFETY: #[repr(C)] plain integers laid out exactly as `struct Strided` in prelude.cuh
// (i64, i32, i32, i64[8], i64[8]: no implicit padding on either side).
unsafe impl DeviceRepr for Strided {}

impl Strided {
    /// A view of `shape`/`strides` at `offset`, with mergeable dims merged.
    pub(crate) fn new(
        op: &'static str,
        offset: usize,
        shape: &[usize],
        strides: &[isize],
    ) -> Result<Strided> {
        let (shape, strides) = merge_dims(shape, strides);
        if shape.len() > MAX_RANK {
            return Err(Error::invalid(
                op,
                format!(
                    "the CUDA kernels take views of at most {MAX_RANK} non-mergeable dims, this one has {}; call .contiguous() first",
                    shape.len()
                ),
            ));
        }
        let numel: usize = shape.iter().product();
        let mut s = Strided {
            offset: offset as i64,
            rank: shape.len() as i32,
            index32: i32::from(numel <= i32::MAX as usize),
            shape: [1; MAX_RANK],
            strides: [0; MAX_RANK],
        };
        for (d, (&n, &st)) in shape.iter().zip(&strides).enumerate() {
            s.shape[d] = n as i64;
            s.strides[d] = st as i64;
        }
        Ok(s)
    }

    pub(crate) fn of(op: &'static str, l: &Layout) -> Result<Strided> {
        Strided::new(op, l.offset(), l.shape(), l.strides())
    }

    /// `n` contiguous elements from offset 0.
    pub(crate) fn flat(n: usize) -> Strided {
        let mut s = Strided {
            offset: 0,
            rank: 1,
            index32: i32::from(n <= i32::MAX as usize),
            shape: [1; MAX_RANK],
            strides: [0; MAX_RANK],
        };
        s.shape[0] = n as i64;
        s.strides[0] = 1;
        s
    }

    /// Stride of the innermost merged dim (None for a single element).
    pub(crate) fn inner_stride(&self) -> Option<i64> {
        (self.rank > 0).then(|| self.strides[self.rank as usize - 1])
    }
}

/// Drops size-1 dims and merges neighbours that memory walks as one dim
/// (`stride[d] == stride[d+1] * shape[d+1]`). The row-major order of elements is unchanged,
/// so the i-th element of the merged view is the i-th of the original.
pub(crate) fn merge_dims(shape: &[usize], strides: &[isize]) -> (Vec<usize>, Vec<isize>) {
    let (sh, [st]) = merge_dims_n(shape, [strides]);
    (sh, st)
}

/// `merge_dims` for K operands walked together (one shape, per-operand strides): a pair of
/// neighbours merges only where it does for every operand. Returns (shape, strides per
/// operand), outermost first.
pub(crate) fn merge_dims_n<const K: usize>(
    shape: &[usize],
    strides: [&[isize]; K],
) -> (Vec<usize>, [Vec<isize>; K]) {
    let mut sh: Vec<usize> = Vec::with_capacity(shape.len());
    let mut st: [Vec<isize>; K] = std::array::from_fn(|_| Vec::with_capacity(shape.len()));
    for (i, &n) in shape.iter().enumerate() {
        if n == 1 {
            continue;
        }
        let mergeable =
            !sh.is_empty() && (0..K).all(|k| st[k].last() == Some(&(strides[k][i] * n as isize)));
        match sh.last_mut() {
            Some(last) if mergeable => {
                *last *= n;
                for k in 0..K {
                    if let Some(s) = st[k].last_mut() {
                        *s = strides[k][i];
                    }
                }
            }
            _ => {
                sh.push(n);
                for k in 0..K {
                    st[k].push(strides[k][i]);
                }
            }
        }
    }
    (sh, st)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_contiguous_dims_and_drops_ones() {
        assert_eq!(merge_dims(&[2, 3, 4], &[12, 4, 1]), (vec![24], vec![1]));
        assert_eq!(merge_dims(&[2, 1, 3], &[3, 99, 1]), (vec![6], vec![1]));
        assert_eq!(merge_dims(&[1, 1], &[5, 7]), (vec![], vec![]));
    }

    #[test]
    fn keeps_transposed_and_broadcast_dims() {
        // a transpose of (3, 4): strides (1, 3) cannot merge
        assert_eq!(merge_dims(&[4, 3], &[1, 4]), (vec![4, 3], vec![1, 4]));
        // (2, 3) broadcast from (3,): the stride-0 dim stays separate
        assert_eq!(merge_dims(&[2, 3], &[0, 1]), (vec![2, 3], vec![0, 1]));
        // fully broadcast scalar: one stride-0 dim
        assert_eq!(merge_dims(&[2, 3], &[0, 0]), (vec![6], vec![0]));
        // a narrowed row block of a (4, 5) matrix: rows 5 apart, 2 columns
        assert_eq!(merge_dims(&[4, 2], &[5, 1]), (vec![4, 2], vec![5, 1]));
    }

    #[test]
    fn merge_dims_n_collapses_contiguous_and_keeps_broadcast() {
        let (sh, st) = merge_dims_n(&[2, 3, 4], [&[12, 4, 1], &[12, 4, 1], &[0, 0, 0]]);
        assert_eq!(sh, vec![24]);
        assert_eq!(st, [vec![1], vec![1], vec![0]]);
        // A broadcast middle dim splits the walk.
        let (sh, st) = merge_dims_n(&[2, 3, 4], [&[12, 4, 1], &[4, 0, 1], &[12, 4, 1]]);
        assert_eq!(sh, vec![2, 3, 4]);
        assert_eq!(st[1], vec![4, 0, 1]);
        // Size-1 dims vanish.
        let (sh, _) = merge_dims_n(&[1, 5, 1], [&[5, 1, 1], &[5, 1, 1], &[0, 1, 0]]);
        assert_eq!(sh, vec![5]);
    }

    #[test]
    fn strided_rejects_too_many_dims() {
        let shape = vec![2usize; 9];
        // every other element: no two dims merge
        let strides: Vec<isize> = (0..9u32).map(|d| 4isize.pow(8 - d)).collect();
        assert!(Strided::new("t", 0, &shape, &strides).is_err());
        let contiguous = crate::base::contiguous_strides(&shape);
        assert_eq!(Strided::new("t", 0, &shape, &contiguous).unwrap().rank, 1);
    }

    #[test]
    fn strided_matches_the_kernel_struct_size() {
        // struct Strided in prelude.cuh: 8 + 4 + 4 + 64 + 64 bytes
        assert_eq!(std::mem::size_of::<Strided>(), 144);
    }
}
