//! CUDA elementwise ops: download (to_host), strided copy with dtype conversion, fill, unary,
//! binary and in-place binary. Each op is one kernel launch (kernels/elementwise.cu, after the
//! shared prelude kernels/strided.cuh); operands travel as `Strided` views whose dims the host
//! has already merged where memory allows, so contiguous operands index as a flat array.

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use super::{CudaDevice, host_bytes};
use crate::backend::{BinaryOp, HostValues, Storage, UnaryOp, View};
use crate::base::{DType, Device, Layout};
use crate::base::{Error, Result};
use crate::memory::{Allocation, Category};

/// NVRTC module of the elementwise kernels.
const KEY: &str = "elementwise";
const SRC: &str = concat!(
    include_str!("kernels/strided.cuh"),
    include_str!("kernels/elementwise.cu")
);

/// Most dims a kernel operand may have after merging (`MAX_RANK` in strided.cuh).
pub(crate) const MAX_RANK: usize = 8;

/// A view as the kernels take it (`struct Strided` in strided.cuh): element offset, then
/// shape and strides in elements.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Strided {
    offset: i64,
    rank: i32,
    /// 1 when the view has fewer than 2^31 elements: kernels then locate elements with
    /// 32-bit division, several times cheaper on the GPU than 64-bit.
    index32: i32,
    shape: [i64; MAX_RANK],
    strides: [i64; MAX_RANK],
}

// SAFETY: #[repr(C)] plain integers laid out exactly as `struct Strided` in strided.cuh
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
    let mut out_shape: Vec<usize> = Vec::with_capacity(shape.len());
    let mut out_strides: Vec<isize> = Vec::with_capacity(shape.len());
    for (&n, &s) in shape.iter().zip(strides) {
        if n == 1 {
            continue;
        }
        match (out_shape.last_mut(), out_strides.last_mut()) {
            (Some(pn), Some(ps)) if *ps == s * n as isize => {
                *pn *= n;
                *ps = s;
            }
            _ => {
                out_shape.push(n);
                out_strides.push(s);
            }
        }
    }
    (out_shape, out_strides)
}

/// The dtype code of strided.cuh (`DT_*`).
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

/// Kernel name suffix of a float dtype; other dtypes are an error.
pub(crate) fn float_suffix(op: &'static str, dt: DType) -> Result<&'static str> {
    match dt {
        DType::F32 => Ok("f32"),
        DType::F64 => Ok("f64"),
        DType::F16 => Ok("f16"),
        DType::BF16 => Ok("bf16"),
        other => Err(Error::UnsupportedDType {
            op,
            dtype: other,
            hint: "this op needs a floating-point tensor; convert with .to_dtype(DType::F32)",
        }),
    }
}

/// The device address of a storage that must live on `d`.
pub(crate) fn dev_ptr(d: &CudaDevice, op: &'static str, s: &Storage) -> Result<u64> {
    let here = Device::Cuda(d.ordinal());
    if s.device() != here {
        return Err(Error::DeviceMismatch {
            op,
            a: here,
            b: s.device(),
        });
    }
    super::ptr(s)
}

/// Checks that every element a view can reach lies inside its storage (a kernel reading
/// past the end would corrupt or fault the whole context, not just return an error).
pub(crate) fn check_bounds(op: &'static str, v: &View) -> Result<()> {
    let l = v.layout;
    if l.numel() == 0 {
        return Ok(());
    }
    let (mut lo, mut hi) = (l.offset() as i128, l.offset() as i128);
    for (&n, &s) in l.shape().iter().zip(l.strides()) {
        let reach = (n as i128 - 1) * s as i128;
        if reach < 0 {
            lo += reach;
        } else {
            hi += reach;
        }
    }
    if lo < 0 || hi >= v.storage.len() as i128 {
        return Err(Error::invalid(
            op,
            format!(
                "view (shape {:?}, strides {:?}, offset {}) reaches outside its storage of {} elements",
                l.shape(),
                l.strides(),
                l.offset(),
                v.storage.len()
            ),
        ));
    }
    Ok(())
}

/// Device scratch memory from the device's allocator, counted as `temporary` while alive.
/// Work queued later on the (single) stream is ordered after the kernels that use it, so
/// dropping it right after queueing those kernels is safe.
pub(crate) fn temp(d: &CudaDevice, bytes: usize) -> Result<Allocation> {
    crate::memory::allocator(Device::Cuda(d.ordinal()))?.malloc(
        bytes.max(1),
        Category::Temporary,
        "cuda temp",
    )
}

/// A grid-stride launch shape for `n` elements.
fn grid(n: usize) -> LaunchConfig {
    CudaDevice::grid_1d(n)
}

fn launch_err(d: &CudaDevice, name: &str, e: impl std::fmt::Debug) -> Error {
    d.err(&format!("launching {name}"), e)
}

/// Queues `copy_strided`: the `n` elements of view `ss` of buffer `src` (dtype `sd`) into view
/// `ds` of `dst` (dtype `dd`).
#[allow(clippy::too_many_arguments)]
fn launch_copy(
    d: &CudaDevice,
    src: u64,
    sd: DType,
    ss: &Strided,
    dst: u64,
    dd: DType,
    ds: &Strided,
    n: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    if let Some(name) = contiguous_cast(sd, ss, dd, ds) {
        // Element offsets → addresses: the cast kernels take plain contiguous pointers.
        let src = src + (ss.offset as u64) * sd.size_in_bytes() as u64;
        let dst = dst + (ds.offset as u64) * dd.size_in_bytes() as u64;
        let f = d.function(KEY, SRC, name)?;
        let n64 = n as i64;
        let mut b = d.stream().launch_builder(&f);
        b.arg(&src).arg(&dst).arg(&n64);
        // SAFETY: cast_*(const S*, D*, i64) with both views contiguous from their offsets and
        // bounds-checked for n elements (as for copy_strided).
        unsafe { b.launch(grid(n)) }.map_err(|e| launch_err(d, name, e))?;
        return Ok(());
    }
    let f = d.function(KEY, SRC, "copy_strided")?;
    let (sdc, ddc) = (dtype_code(sd), dtype_code(dd));
    let size = sd.size_in_bytes() as i32;
    let n64 = n as i64;
    let mut b = d.stream().launch_builder(&f);
    b.arg(&src)
        .arg(&sdc)
        .arg(ss)
        .arg(&dst)
        .arg(&ddc)
        .arg(ds)
        .arg(&size)
        .arg(&n64);
    // SAFETY: argument types and order match copy_strided; both views were bounds-checked
    // against their storages (or address a fresh contiguous scratch buffer of n elements).
    unsafe { b.launch(grid(n)) }.map_err(|e| launch_err(d, "copy_strided", e))?;
    Ok(())
}

/// The kernel of a cast between two contiguous views among f32, f16 and bf16 (autocast's
/// casts, on the largest tensors of a step): one per dtype pair, converting through f32 with
/// no per-element dtype switch. None for anything else (copy_strided handles it).
fn contiguous_cast(sd: DType, ss: &Strided, dd: DType, ds: &Strided) -> Option<&'static str> {
    let contiguous = |s: &Strided| s.rank == 1 && s.strides[0] == 1;
    if !contiguous(ss) || !contiguous(ds) {
        return None;
    }
    match (sd, dd) {
        (DType::F32, DType::BF16) => Some("cast_f32_bf16"),
        (DType::BF16, DType::F32) => Some("cast_bf16_f32"),
        (DType::F32, DType::F16) => Some("cast_f32_f16"),
        (DType::F16, DType::F32) => Some("cast_f16_f32"),
        _ => None,
    }
}

/// A contiguous device copy of a view, in its own dtype, in scratch memory.
pub(crate) fn gather(d: &CudaDevice, op: &'static str, v: View) -> Result<Allocation> {
    check_bounds(op, &v)?;
    let dt = v.storage.dtype();
    let n = v.layout.numel();
    let tmp = temp(d, n * dt.size_in_bytes())?;
    let src = dev_ptr(d, op, v.storage)?;
    launch_copy(
        d,
        src,
        dt,
        &Strided::of(op, v.layout)?,
        tmp.addr(),
        dt,
        &Strided::flat(n),
        n,
    )?;
    Ok(tmp)
}

pub(crate) fn to_host(d: &CudaDevice, src: View) -> Result<HostValues> {
    let dt = src.storage.dtype();
    let (n, es) = (src.layout.numel(), dt.size_in_bytes());
    let bytes = if n == 0 {
        Vec::new()
    } else if src.layout.is_contiguous() {
        check_bounds("to_host", &src)?;
        let base = dev_ptr(d, "to_host", src.storage)?;
        d.copy_to_host(base + (src.layout.offset() * es) as u64, n * es)?
    } else {
        let tmp = gather(d, "to_host", src)?;
        // copy_to_host waits for the gather kernel (same stream) and for itself.
        d.copy_to_host(tmp.addr(), n * es)?
    };
    Ok(host_values(dt, &bytes))
}

/// Little-endian device bytes of `dt` as host values (f32 stays f32; f16/bf16 widen to f64).
fn host_values(dt: DType, bytes: &[u8]) -> HostValues {
    fn words<const N: usize>(bytes: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
        bytes.chunks_exact(N).map(|c| {
            let mut w = [0u8; N];
            w.copy_from_slice(c);
            w
        })
    }
    match dt {
        DType::F32 => HostValues::F32(words::<4>(bytes).map(f32::from_le_bytes).collect()),
        DType::F64 => HostValues::F64(words::<8>(bytes).map(f64::from_le_bytes).collect()),
        DType::F16 => HostValues::F64(
            words::<2>(bytes)
                .map(|w| half::f16::from_bits(u16::from_le_bytes(w)).to_f64())
                .collect(),
        ),
        DType::BF16 => HostValues::F64(
            words::<2>(bytes)
                .map(|w| half::bf16::from_bits(u16::from_le_bytes(w)).to_f64())
                .collect(),
        ),
        DType::I64 => HostValues::I64(words::<8>(bytes).map(i64::from_le_bytes).collect()),
        DType::U8 => HostValues::I64(bytes.iter().map(|&b| b as i64).collect()),
    }
}

pub(crate) fn copy(d: &CudaDevice, src: View, dst: View) -> Result<()> {
    let n = src.layout.numel();
    if dst.layout.numel() != n {
        return Err(Error::shape(
            "copy",
            format!(
                "source shape {:?} and destination shape {:?} hold different element counts",
                src.layout.shape(),
                dst.layout.shape()
            ),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    check_bounds("copy", &src)?;
    check_bounds("copy", &dst)?;
    let (sp, dp) = (
        dev_ptr(d, "copy", src.storage)?,
        dev_ptr(d, "copy", dst.storage)?,
    );
    launch_copy(
        d,
        sp,
        src.storage.dtype(),
        &Strided::of("copy", src.layout)?,
        dp,
        dst.storage.dtype(),
        &Strided::of("copy", dst.layout)?,
        n,
    )
}

pub(crate) fn fill(d: &CudaDevice, dst: &Storage, value: f64) -> Result<()> {
    let n = dst.len();
    if n == 0 {
        return Ok(());
    }
    // The element's bytes as the CPU backend would store `value` (same conversion code).
    let one = host_bytes(dst.dtype(), HostValues::F64(vec![value]))?;
    let mut word = [0u8; 8];
    word[..one.len()].copy_from_slice(&one);
    let bits = u64::from_le_bytes(word);
    let size = one.len() as i32;
    let ptr = dev_ptr(d, "fill", dst)?;
    let n64 = n as i64;
    let f = d.function(KEY, SRC, "fill_bits")?;
    let mut b = d.stream().launch_builder(&f);
    b.arg(&ptr).arg(&size).arg(&bits).arg(&n64);
    // SAFETY: fill_bits(void*, int, u64, i64); the storage holds n elements of `size` bytes.
    unsafe { b.launch(grid(n)) }.map_err(|e| launch_err(d, "fill_bits", e))?;
    Ok(())
}

/// Op code and f64 parameter of a unary op (`U_*` in elementwise.cu).
fn unary_code(op: UnaryOp) -> (i32, f64) {
    match op {
        UnaryOp::Neg => (0, 0.0),
        UnaryOp::Exp => (1, 0.0),
        UnaryOp::Log => (2, 0.0),
        UnaryOp::Sqrt => (3, 0.0),
        UnaryOp::Tanh => (4, 0.0),
        UnaryOp::Sigmoid => (5, 0.0),
        UnaryOp::Relu => (6, 0.0),
        UnaryOp::GeluTanh => (7, 0.0),
        UnaryOp::GeluErf => (8, 0.0),
        UnaryOp::Abs => (9, 0.0),
        UnaryOp::AddScalar(c) => (10, c),
        UnaryOp::MulScalar(c) => (11, c),
        UnaryOp::PowScalar(c) => (12, c),
        UnaryOp::Step => (13, 0.0),
        UnaryOp::Clamp { lo, .. } => (14, lo),
    }
}

/// Op code and f64 parameter of a binary op (`B_*` in elementwise.cu).
fn binary_code(op: BinaryOp) -> (i32, f64) {
    match op {
        BinaryOp::Add => (0, 0.0),
        BinaryOp::Sub => (1, 0.0),
        BinaryOp::Mul => (2, 0.0),
        BinaryOp::Div => (3, 0.0),
        BinaryOp::Pow => (4, 0.0),
        BinaryOp::Maximum => (5, 0.0),
        BinaryOp::AddScaled(alpha) => (6, alpha),
        BinaryOp::Assign => (7, 0.0),
        BinaryOp::ReluBackward => (8, 0.0),
        BinaryOp::TanhBackward => (9, 0.0),
        BinaryOp::SigmoidBackward => (10, 0.0),
        BinaryOp::GeluTanhBackward => (11, 0.0),
        BinaryOp::GeluErfBackward => (12, 0.0),
        BinaryOp::Eq => (13, 0.0),
    }
}

fn same_dtype(op: &'static str, expected: DType, got: DType) -> Result<()> {
    if expected != got {
        return Err(Error::DType { op, expected, got });
    }
    Ok(())
}

/// The output must hold `n` elements.
fn check_out(op: &'static str, out: &Storage, n: usize) -> Result<()> {
    if out.len() < n {
        return Err(Error::invalid(
            op,
            format!(
                "output storage holds {} elements, the result has {n}",
                out.len()
            ),
        ));
    }
    Ok(())
}

pub(crate) fn unary(d: &CudaDevice, op: UnaryOp, x: View, out: &Storage) -> Result<()> {
    let dt = x.storage.dtype();
    let suffix = float_suffix("unary", dt)?;
    same_dtype("unary", dt, out.dtype())?;
    let n = x.layout.numel();
    check_out("unary", out, n)?;
    if n == 0 {
        return Ok(());
    }
    check_bounds("unary", &x)?;
    let (code, p) = unary_code(op);
    // The second parameter: only clamp's upper bound uses it.
    let q = match op {
        UnaryOp::Clamp { hi, .. } => hi,
        _ => 0.0,
    };
    let xs = Strided::of("unary", x.layout)?;
    let (xp, op_) = (dev_ptr(d, "unary", x.storage)?, dev_ptr(d, "unary", out)?);
    let n64 = n as i64;
    let name = format!("unary_{suffix}");
    let f = d.function(KEY, SRC, &name)?;
    let mut b = d.stream().launch_builder(&f);
    b.arg(&code)
        .arg(&p)
        .arg(&q)
        .arg(&xp)
        .arg(&xs)
        .arg(&op_)
        .arg(&n64);
    // SAFETY: unary_*(int, double, double, const S*, Strided, S*, i64); x is bounds-checked
    // and out holds at least n elements of the same dtype.
    unsafe { b.launch(grid(n)) }.map_err(|e| launch_err(d, &name, e))?;
    Ok(())
}

pub(crate) fn binary(d: &CudaDevice, op: BinaryOp, a: View, b: View, out: &Storage) -> Result<()> {
    let dt = a.storage.dtype();
    let suffix = float_suffix("binary", dt)?;
    same_dtype("binary", dt, b.storage.dtype())?;
    same_dtype("binary", dt, out.dtype())?;
    if a.layout.shape() != b.layout.shape() {
        return Err(Error::shape(
            "binary",
            format!(
                "operands must be broadcast to one shape first, got {:?} and {:?}",
                a.layout.shape(),
                b.layout.shape()
            ),
        ));
    }
    let n = a.layout.numel();
    check_out("binary", out, n)?;
    if n == 0 {
        return Ok(());
    }
    check_bounds("binary", &a)?;
    check_bounds("binary", &b)?;
    let (code, p) = binary_code(op);
    let (sa, sb) = (
        Strided::of("binary", a.layout)?,
        Strided::of("binary", b.layout)?,
    );
    let (ap, bp) = (
        dev_ptr(d, "binary", a.storage)?,
        dev_ptr(d, "binary", b.storage)?,
    );
    let op_ = dev_ptr(d, "binary", out)?;
    let n64 = n as i64;
    let name = format!("binary_{suffix}");
    let f = d.function(KEY, SRC, &name)?;
    let mut lb = d.stream().launch_builder(&f);
    lb.arg(&code)
        .arg(&p)
        .arg(&ap)
        .arg(&sa)
        .arg(&bp)
        .arg(&sb)
        .arg(&op_)
        .arg(&n64);
    // SAFETY: binary_*(int, double, const S*, Strided, const S*, Strided, S*, i64); a and b
    // are bounds-checked, out holds at least n elements; out never aliases an input.
    unsafe { lb.launch(grid(n)) }.map_err(|e| launch_err(d, &name, e))?;
    Ok(())
}

pub(crate) fn binary_inplace(d: &CudaDevice, op: BinaryOp, dst: &Storage, src: View) -> Result<()> {
    let dt = dst.dtype();
    let suffix = float_suffix("binary_inplace", dt)?;
    same_dtype("binary_inplace", dt, src.storage.dtype())?;
    let n = dst.len();
    if src.layout.numel() != n {
        return Err(Error::shape(
            "binary_inplace",
            format!(
                "source shape {:?} does not cover the destination's {n} elements",
                src.layout.shape()
            ),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    check_bounds("binary_inplace", &src)?;
    // Reading what other threads overwrite would race; only the exact element-for-element
    // alias is safe, anything else reads a private copy of src.
    let exact_alias = src.layout.is_contiguous() && src.layout.offset() == 0;
    let scratch = if dst.same(src.storage) && !exact_alias {
        Some(gather(d, "binary_inplace", src)?)
    } else {
        None
    };
    let (sp, ss) = match &scratch {
        Some(t) => (t.addr(), Strided::flat(n)),
        None => (
            dev_ptr(d, "binary_inplace", src.storage)?,
            Strided::of("binary_inplace", src.layout)?,
        ),
    };
    let (code, p) = binary_code(op);
    let dp = dev_ptr(d, "binary_inplace", dst)?;
    let n64 = n as i64;
    let name = format!("inplace_{suffix}");
    let f = d.function(KEY, SRC, &name)?;
    let mut b = d.stream().launch_builder(&f);
    b.arg(&code).arg(&p).arg(&dp).arg(&sp).arg(&ss).arg(&n64);
    // SAFETY: inplace_*(int, double, S*, const S*, Strided, i64); dst holds n elements, src
    // is bounds-checked (or the n-element scratch copy, kept alive past the launch).
    unsafe { b.launch(grid(n)) }.map_err(|e| launch_err(d, &name, e))?;
    drop(scratch);
    Ok(())
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
        // struct Strided in strided.cuh: 8 + 4 + 4 + 64 + 64 bytes
        assert_eq!(std::mem::size_of::<Strided>(), 144);
    }
}
