//! CUDA elementwise ops: download (to_host), strided copy with dtype conversion, fill, unary,
//! binary and in-place binary. Each op is one kernel launch (kernels/elementwise.cu, after the
//! shared prelude kernels/prelude.cuh); operands travel as `Strided` views whose dims the host
//! has already merged where memory allows, so contiguous operands index as a flat array.
//! A binary op with one f16/bf16 operand beside f32 ones runs kernels named by both operand
//! dtypes (`binary_f32_bf16`, `add_vec_bf16_f32`), which widen the half operand as they read.

use cudarc::driver::LaunchConfig;

use super::launch::{
    Arg, Module, Strided, dev_ptr, dtype_code, grid, i64_of, launch, quads_aligned, suffix, temp,
};
use super::multi_tensor::{Groups, Row, Table};
use super::{CudaDevice, codes};
use crate::backend::check::within as check_bounds;
use crate::backend::{BinaryOp, ElementwiseKernels, HostValues, Storage, UnaryOp, View};
use crate::base::DType;
use crate::base::Result;
use crate::memory::Allocation;

/// kernels/elementwise.cu compiled per float dtype (that dtype's op kernels) and once for
/// what takes no single dtype (`SHARED`: strided copy, fill, casts, an f16/bf16 operand beside
/// f32): a run compiles only what its dtypes need (all at once took NVRTC 12 s on a 2-core
/// host; a bf16-autocast run needs about half).
pub(super) static SHARED: Module =
    Module::with_defines("elementwise", "#define EW_SHARED\n", SOURCE);
pub(super) static BY_DTYPE: [Module; 4] = [
    Module::with_defines("elementwise_f32", "#define EW_F32\n", SOURCE),
    Module::with_defines("elementwise_f64", "#define EW_F64\n", SOURCE),
    Module::with_defines("elementwise_f16", "#define EW_F16\n", SOURCE),
    Module::with_defines("elementwise_bf16", "#define EW_BF16\n", SOURCE),
];
const SOURCE: &str = include_str!("kernels/elementwise.cu");

/// The module of the kernels named by the operand dtypes `dts`: one float dtype's own, else
/// (an f16/bf16 operand beside f32) the shared one.
fn kernels(dts: &[DType]) -> &'static Module {
    match dts {
        [DType::F32] => &BY_DTYPE[0],
        [DType::F64] => &BY_DTYPE[1],
        [DType::F16] => &BY_DTYPE[2],
        [DType::BF16] => &BY_DTYPE[3],
        _ => &SHARED,
    }
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
        // cast_*(const S*, D*, i64): both views contiguous from their offsets.
        let args = [Arg::Ptr(src), Arg::Ptr(dst), Arg::I64(n as i64)];
        // Eight elements per thread where the addresses allow (the kernel checks).
        return launch(d, &SHARED, name, grid(n.div_ceil(8)), &args);
    }
    // copy_strided(const void*, int, Strided, void*, int, Strided, int, i64)
    let args = [
        Arg::Ptr(src),
        Arg::I32(dtype_code(sd)),
        Arg::Struct(ss),
        Arg::Ptr(dst),
        Arg::I32(dtype_code(dd)),
        Arg::Struct(ds),
        Arg::I32(sd.size_in_bytes() as i32),
        Arg::I64(n as i64),
    ];
    launch(d, &SHARED, "copy_strided", grid(n), &args)
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
    let tmp = temp(d, n * dt.size_in_bytes(), "cuda temp")?;
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
    // Element counts and devices were validated by the family (backend/elementwise.rs).
    let n = src.layout.numel();
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

/// `copy_many`: the contiguous f32 → bf16/f16 casts among `pairs` in one launch per
/// destination dtype (cast_many_* over a multi-tensor table), anything else one `copy` each.
pub(crate) fn copy_many(d: &CudaDevice, pairs: &[(View, View)]) -> Result<()> {
    let mut casts = Groups::<2>::new();
    for &(src, dst) in pairs {
        let (sd, dd) = (src.storage.dtype(), dst.storage.dtype());
        if many_cast_kernel(dd).is_none()
            || sd != DType::F32
            || !src.layout.is_contiguous()
            || !dst.layout.is_contiguous()
        {
            copy(d, src, dst)?;
            continue;
        }
        check_bounds("copy_many", &src)?;
        check_bounds("copy_many", &dst)?;
        let at = |v: View, dt: DType| -> Result<u64> {
            Ok(dev_ptr(d, "copy_many", v.storage)?
                + (v.layout.offset() * dt.size_in_bytes()) as u64)
        };
        let row = Row {
            addrs: [at(src, sd)?, at(dst, dd)?],
            n: src.layout.numel(),
        };
        casts.push(dd, row);
    }
    for (dd, rows) in casts.iter() {
        let (Some(name), Some(table)) =
            (many_cast_kernel(*dd), Table::upload(d, rows, "cast_table")?)
        else {
            continue;
        };
        // cast_many_*(const CastEntry*, int, i64)
        let args = [
            Arg::Ptr(table.addr),
            Arg::I32(table.count),
            Arg::I64(table.chunks),
        ];
        launch(d, &SHARED, name, table.config(), &args)?;
    }
    Ok(())
}

/// The multi-tensor kernel casting f32 tensors to `dd`, where there is one.
fn many_cast_kernel(dd: DType) -> Option<&'static str> {
    match dd {
        DType::BF16 => Some("cast_many_f32_bf16"),
        DType::F16 => Some("cast_many_f32_f16"),
        _ => None,
    }
}

pub(crate) fn fill(d: &CudaDevice, dst: &Storage, value: f64) -> Result<()> {
    let n = dst.len();
    if n == 0 {
        return Ok(());
    }
    let (bits, size) = element_bits(dst.dtype(), value);
    // fill_bits(void*, int, u64, i64); the storage holds n elements of `size` bytes.
    let args = [
        Arg::Ptr(dev_ptr(d, "fill", dst)?),
        Arg::I32(size as i32),
        Arg::U64(bits),
        Arg::I64(n as i64),
    ];
    launch(d, &SHARED, "fill_bits", grid(n), &args)
}

/// The bits of `value` stored as `dtype`, as the CPU backend would store it (same conversion
/// code), and their size in bytes.
fn element_bits(dtype: DType, value: f64) -> (u64, usize) {
    let one = HostValues::F64(vec![value]).into_le_bytes(dtype);
    let mut word = [0u8; 8];
    word[..one.len()].copy_from_slice(&one);
    (u64::from_le_bytes(word), one.len())
}

/// Inverted dropout on the device, the mask drawn per element and never stored
/// (backend/philox.rs says which draw each element gets).
pub(crate) fn dropout_apply(
    d: &CudaDevice,
    x: View,
    out: &Storage,
    keep: f64,
    key: u64,
) -> Result<()> {
    let n = out.len();
    if n == 0 {
        return Ok(());
    }
    let dt = out.dtype();
    let suffix = suffix("dropout", dt)?;
    check_bounds("dropout", &x)?;
    let (bits, _) = element_bits(dt, 1.0 / keep);
    let xp = dev_ptr(d, "dropout", x.storage)? + (x.layout.offset() * dt.size_in_bytes()) as u64;
    let op = dev_ptr(d, "dropout", out)?;
    // Groups of four elements move as one vector where both start on such a group's bytes.
    let aligned = quads_aligned(dt, &[xp, op]);
    // dropout_apply_*(const S*, S*, u64, u64, const u64*, double, i64, int); x is contiguous
    // (the family checks).
    let args = [
        Arg::Ptr(xp),
        Arg::Ptr(op),
        Arg::U64(bits),
        Arg::U64(key),
        Arg::Ptr(d.dropout_seed()?),
        Arg::F64(keep),
        Arg::I64(n as i64),
        Arg::I32(aligned as i32),
    ];
    let kernel = format!("dropout_apply_{suffix}");
    // One thread per Philox call: eight elements.
    launch(d, kernels(&[dt]), &kernel, grid(n.div_ceil(8)), &args)
}

/// Op code (U_* in codes.rs) and f64 parameter of a unary op.
fn unary_code(op: UnaryOp) -> (i32, f64) {
    match op {
        UnaryOp::Neg => (codes::U_NEG, 0.0),
        UnaryOp::Exp => (codes::U_EXP, 0.0),
        UnaryOp::Log => (codes::U_LOG, 0.0),
        UnaryOp::Sqrt => (codes::U_SQRT, 0.0),
        UnaryOp::Tanh => (codes::U_TANH, 0.0),
        UnaryOp::Sigmoid => (codes::U_SIGMOID, 0.0),
        UnaryOp::Relu => (codes::U_RELU, 0.0),
        UnaryOp::GeluTanh => (codes::U_GELU_TANH, 0.0),
        UnaryOp::GeluErf => (codes::U_GELU_ERF, 0.0),
        UnaryOp::Abs => (codes::U_ABS, 0.0),
        UnaryOp::AddScalar(c) => (codes::U_ADD_SCALAR, c),
        UnaryOp::MulScalar(c) => (codes::U_MUL_SCALAR, c),
        UnaryOp::PowScalar(c) => (codes::U_POW_SCALAR, c),
        UnaryOp::Step => (codes::U_STEP, 0.0),
        UnaryOp::Clamp { lo, .. } => (codes::U_CLAMP, lo),
    }
}

/// Op code (B_* in codes.rs) and f64 parameter of a binary op.
fn binary_code(op: BinaryOp) -> (i32, f64) {
    match op {
        BinaryOp::Add => (codes::B_ADD, 0.0),
        BinaryOp::Sub => (codes::B_SUB, 0.0),
        BinaryOp::Mul => (codes::B_MUL, 0.0),
        BinaryOp::Div => (codes::B_DIV, 0.0),
        BinaryOp::Pow => (codes::B_POW, 0.0),
        BinaryOp::Maximum => (codes::B_MAXIMUM, 0.0),
        BinaryOp::AddScaled(alpha) => (codes::B_ADD_SCALED, alpha),
        BinaryOp::Assign => (codes::B_ASSIGN, 0.0),
        BinaryOp::ReluBackward => (codes::B_RELU_BACKWARD, 0.0),
        BinaryOp::TanhBackward => (codes::B_TANH_BACKWARD, 0.0),
        BinaryOp::SigmoidBackward => (codes::B_SIGMOID_BACKWARD, 0.0),
        BinaryOp::GeluTanhBackward => (codes::B_GELU_TANH_BACKWARD, 0.0),
        BinaryOp::GeluErfBackward => (codes::B_GELU_ERF_BACKWARD, 0.0),
        BinaryOp::Eq => (codes::B_EQ, 0.0),
    }
}

/// The output must hold `n` elements.
pub(crate) fn unary(d: &CudaDevice, op: UnaryOp, x: View, out: &Storage) -> Result<()> {
    let dt = x.storage.dtype();
    let suffix = suffix("unary", dt)?;
    let n = x.layout.numel();
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
    let (xp, op_out) = (dev_ptr(d, "unary", x.storage)?, dev_ptr(d, "unary", out)?);
    // gelu_tanh_vec_*(const S*, S*, i64)
    let hot = (op == UnaryOp::GeluTanh).then_some("gelu_tanh_vec");
    if launch_hot(d, hot, &[dt], &[vec_addr(xp, &xs, dt), aligned(op_out)], n)? {
        return Ok(());
    }
    // unary_*(int, double, double, const S*, Strided, S*, i64)
    let args = [
        Arg::I32(code),
        Arg::F64(p),
        Arg::F64(q),
        Arg::Ptr(xp),
        Arg::Struct(&xs),
        Arg::Ptr(op_out),
        Arg::I64(n as i64),
    ];
    launch(
        d,
        kernels(&[dt]),
        &format!("unary_{suffix}"),
        vector_grid(n, dt),
        &args,
    )
}

pub(crate) fn binary(d: &CudaDevice, op: BinaryOp, a: View, b: View, out: &Storage) -> Result<()> {
    let (da, db) = (a.storage.dtype(), b.storage.dtype());
    // The operand dtypes the kernels are named by: one, or both when one is f16/bf16 beside
    // f32 (the family allows no other mix).
    let dts: &[DType] = if da == db { &[da] } else { &[da, db] };
    let suffix = dts
        .iter()
        .map(|&dt| suffix("binary", dt))
        .collect::<Result<Vec<_>>>()?
        .join("_");
    let n = a.layout.numel();
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
    let (ap, bp, op_out) = (
        dev_ptr(d, "binary", a.storage)?,
        dev_ptr(d, "binary", b.storage)?,
        dev_ptr(d, "binary", out)?,
    );
    // add_vec_*(const S*, const S*, S*, i64)
    let hot = (op == BinaryOp::Add).then_some("add_vec");
    let addrs = [
        vec_addr(ap, &sa, da),
        vec_addr(bp, &sb, db),
        aligned(op_out),
    ];
    if launch_hot(d, hot, dts, &addrs, n)? {
        return Ok(());
    }
    // binary_*(int, double, const S*, Strided, const S*, Strided, S*, i64); out never
    // aliases an input.
    let args = [
        Arg::I32(code),
        Arg::F64(p),
        Arg::Ptr(ap),
        Arg::Struct(&sa),
        Arg::Ptr(bp),
        Arg::Struct(&sb),
        Arg::Ptr(op_out),
        Arg::I64(n as i64),
    ];
    launch(
        d,
        kernels(dts),
        &format!("binary_{suffix}"),
        vector_grid(n, narrowest(dts)),
        &args,
    )
}

/// The dtype of the smallest elements among `dts` (non-empty): a vector kernel moves 16
/// bytes of it per step.
fn narrowest(dts: &[DType]) -> DType {
    dts.iter()
        .copied()
        .min_by_key(|dt| dt.size_in_bytes())
        .unwrap_or(DType::F32)
}

pub(crate) fn binary_inplace(d: &CudaDevice, op: BinaryOp, dst: &Storage, src: View) -> Result<()> {
    let dt = dst.dtype();
    let suffix = suffix("binary_inplace", dt)?;
    let n = dst.len();
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
    if scratch.is_none()
        && let Some((rows, cols)) = row_broadcast(&ss, n)
    {
        return inplace_rows(
            d,
            suffix,
            (code, p),
            dst,
            sp + ss.offset as u64 * dt.size_in_bytes() as u64,
            rows,
            cols,
        );
    }
    let dst_ptr = dev_ptr(d, "binary_inplace", dst)?;
    let hot = match op {
        BinaryOp::Add => Some("add_inplace_vec"),
        BinaryOp::GeluTanhBackward => Some("gelu_tanh_backward_inplace_vec"),
        _ => None,
    };
    // *_inplace_vec_*(S*, const S*, i64); src is never a partial alias here (see above).
    if launch_hot(d, hot, &[dt], &[aligned(dst_ptr), vec_addr(sp, &ss, dt)], n)? {
        drop(scratch);
        return Ok(());
    }
    // inplace_*(int, double, S*, const S*, Strided, i64); src is the view or the n-element
    // scratch copy, kept alive past the launch.
    let args = [
        Arg::I32(code),
        Arg::F64(p),
        Arg::Ptr(dst_ptr),
        Arg::Ptr(sp),
        Arg::Struct(&ss),
        Arg::I64(n as i64),
    ];
    let cfg = vector_grid(n, dt);
    launch(d, kernels(&[dt]), &format!("inplace_{suffix}"), cfg, &args)?;
    drop(scratch);
    Ok(())
}

/// The address of a view's first element when the view walks memory contiguously from a
/// 16-byte boundary (what the specialised vector kernels require), else None.
fn vec_addr(base: u64, s: &Strided, dt: DType) -> Option<u64> {
    let contiguous = s.rank == 0 || (s.rank == 1 && s.strides[0] == 1);
    let addr = base + s.offset as u64 * dt.size_in_bytes() as u64;
    (contiguous && addr.is_multiple_of(16)).then_some(addr)
}

/// `addr` when it is 16-byte aligned.
fn aligned(addr: u64) -> Option<u64> {
    addr.is_multiple_of(16).then_some(addr)
}

/// Whether `dt` has the specialised kernels (kernels/elementwise.cu's HOT_KERNELS).
fn has_hot_kernels(dt: DType) -> bool {
    matches!(dt, DType::F32 | DType::F16 | DType::BF16)
}

/// Launches the specialised kernel `{stem}_{dtypes}` over `n` elements (`dtypes` the operand
/// dtypes joined by `_`: one, or two for a half operand beside f32 ones), its arguments the
/// operand addresses then n, when there is one (`stem` and the dtypes) and every operand
/// allows it (a None address does not); returns whether it launched.
fn launch_hot(
    d: &CudaDevice,
    stem: Option<&str>,
    dts: &[DType],
    addrs: &[Option<u64>],
    n: usize,
) -> Result<bool> {
    let (Some(stem), true) = (stem, dts.iter().all(|&dt| has_hot_kernels(dt))) else {
        return Ok(false);
    };
    let Some(ptrs) = addrs.iter().copied().collect::<Option<Vec<u64>>>() else {
        return Ok(false);
    };
    let args: Vec<Arg> = ptrs
        .into_iter()
        .map(Arg::Ptr)
        .chain([Arg::I64(n as i64)])
        .collect();
    let names: Vec<&str> = dts.iter().map(|dt| dt.name()).collect();
    let kernel = format!("{stem}_{}", names.join("_"));
    launch(
        d,
        kernels(dts),
        &kernel,
        vector_grid(n, narrowest(dts)),
        &args,
    )?;
    Ok(true)
}

/// One thread per 16-byte vector of `n` elements of `dt`: the unary, binary and in-place
/// kernels move contiguous, aligned operands as vectors and cover any n with grid-stride
/// loops, so a strided operand is still done in full (a few elements per thread).
fn vector_grid(n: usize, dt: DType) -> LaunchConfig {
    grid(n.div_ceil(16 / dt.size_in_bytes()))
}

/// (rows, cols) when src is one row broadcast over dst's n elements (a bias): merged dims
/// (rows, cols) with strides (0, 1).
fn row_broadcast(ss: &Strided, n: usize) -> Option<(usize, usize)> {
    let (rows, cols) = (ss.shape[0] as usize, ss.shape[1] as usize);
    let row = ss.rank == 2 && ss.strides[0] == 0 && ss.strides[1] == 1;
    // The row stripes go on the grid's y dim, which holds at most 65535 blocks.
    let fits = rows.div_ceil(16) <= 65_535;
    (row && fits && rows * cols == n).then_some((rows, cols))
}

/// dst (rows, cols) op= the row at `src` (inplace_rows_* in kernels/elementwise.cu).
fn inplace_rows(
    d: &CudaDevice,
    suffix: &str,
    (code, p): (i32, f64),
    dst: &Storage,
    src: u64,
    rows: usize,
    cols: usize,
) -> Result<()> {
    const STRIPE: usize = 16; // ROW_STRIPE
    let dst_ptr = dev_ptr(d, "binary_inplace", dst)?;
    let module = kernels(&[dst.dtype()]);
    // 16-byte vectors, one per thread over the flat rows, when every row starts on a vector
    // boundary.
    let per_vector = 16 / dst.dtype().size_in_bytes();
    let vectors =
        cols.is_multiple_of(per_vector) && dst_ptr.is_multiple_of(16) && src.is_multiple_of(16);
    let add = code == codes::B_ADD && has_hot_kernels(dst.dtype());
    let (cfg, kernel) = if vectors && add {
        // add_rows_vec_*(S*, const S*, i64, i64): the bias add, specialised
        let cfg = grid(rows * cols / per_vector);
        let args = [Arg::Ptr(dst_ptr), Arg::Ptr(src), i64_of(rows), i64_of(cols)];
        return launch(d, module, &format!("add_rows_vec_{suffix}"), cfg, &args);
    } else if vectors {
        let cfg = grid(rows * cols / per_vector);
        (cfg, format!("inplace_rows_vec_{suffix}"))
    } else {
        let cfg = LaunchConfig {
            grid_dim: (cols.div_ceil(256) as u32, rows.div_ceil(STRIPE) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        (cfg, format!("inplace_rows_{suffix}"))
    };
    let args = [
        Arg::I32(code),
        Arg::F64(p),
        Arg::Ptr(dst_ptr),
        Arg::Ptr(src),
        i64_of(rows),
        i64_of(cols),
    ];
    launch(d, module, &kernel, cfg, &args)
}

impl ElementwiseKernels for CudaDevice {
    fn copy(&self, src: View, dst: View) -> Result<()> {
        copy(self, src, dst)
    }
    fn copy_many(&self, pairs: &[(View, View)]) -> Result<()> {
        copy_many(self, pairs)
    }
    fn dropout_apply(&self, x: View, out: &Storage, keep: f64, key: u64) -> Result<()> {
        dropout_apply(self, x, out, keep, key)
    }
    fn fill(&self, dst: &Storage, value: f64) -> Result<()> {
        fill(self, dst, value)
    }
    fn unary(&self, op: UnaryOp, x: View, out: &Storage) -> Result<()> {
        unary(self, op, x, out)
    }
    fn binary(&self, op: BinaryOp, a: View, b: View, out: &Storage) -> Result<()> {
        binary(self, op, a, b, out)
    }
    fn binary_inplace(&self, op: BinaryOp, dst: &Storage, src: View) -> Result<()> {
        binary_inplace(self, op, dst, src)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each launch goes to the module that instantiates its kernels (kernels/elementwise.cu's
    /// module blocks): a kernel in another module would fail to load on a GPU only.
    #[test]
    fn every_kernel_name_is_in_the_module_the_launcher_picks() {
        for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let s = suffix("test", dt).unwrap_or_default();
            let block = kernels(&[dt]).own_block().unwrap_or_default();
            assert!(block.contains(&format!("ELEMENTWISE_KERNELS({s},")), "{s}");
            assert!(block.contains(&format!("DROPOUT_KERNEL({s},")), "{s}");
            let hot = block.contains(&format!("HOT_KERNELS({s},"));
            assert_eq!(hot, has_hot_kernels(dt), "{s}");
        }
        let shared = kernels(&[DType::F32, DType::BF16])
            .own_block()
            .unwrap_or_default();
        for pair in ["f32_f16", "f32_bf16", "f16_f32", "bf16_f32"] {
            assert!(
                shared.contains(&format!("WIDENED_KERNELS({pair},")),
                "{pair}"
            );
            let cast = format!("CAST_KERNEL(cast_{pair},");
            assert!(shared.contains(&cast), "{cast}");
        }
        let src = SHARED.own_block().unwrap_or_default();
        assert_eq!(src, shared);
        for dd in [DType::BF16, DType::F16] {
            let name = many_cast_kernel(dd).unwrap_or_default();
            assert!(
                shared.contains(&format!("CAST_MANY_KERNEL({name},")),
                "{name}"
            );
        }
        assert_eq!(many_cast_kernel(DType::F64), None);
    }

    /// The multi-tensor casts walk the table's chunks with the block and chunk sizes its
    /// grid and chunk numbering assume (multi_tensor.rs).
    #[test]
    fn many_casts_use_the_tables_block_and_chunk() {
        use super::super::multi_tensor::{BLOCK, CHUNK};
        assert!(SOURCE.contains(&format!("#define CAST_MANY_BLOCK {BLOCK}\n")));
        assert!(SOURCE.contains(&format!("#define CAST_CHUNK {CHUNK}\n")));
    }
}
