//! CUDA launchers of the fused ops (kernels in kernels/fused.cu): row kernels (softmax,
//! layer norm, cross-entropy) with one block per row, index kernels (gather, deterministic
//! scatter-add, where), the MSE loss and the SGD step. Semantics, dtypes of the statistics and
//! error messages follow the CPU reference (backend/cpu/fused_*.rs).
//!
//! Integer ids and class targets are copied to the host and checked there before any kernel
//! runs, so a bad one is an `Error::Index` naming it and nothing is written, as on the CPU
//! (one synchronisation per such op). Sums across rows or blocks (weight gradients, losses)
//! add fixed partitions in a fixed order: results do not depend on scheduling.

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use super::{CudaDevice, ptr};
use crate::backend::{FusedOp, Storage, View};
use crate::base::{DType, Device, Layout};
use crate::base::{Error, Result};
use crate::memory::{Allocation, Category};

const MODULE: &str = "fused";
const SRC: &str = include_str!("kernels/fused.cu");
/// Threads per block of the reduction kernels (BLOCK in fused.cu).
const BLOCK: u32 = 256;
/// Most blocks a row kernel launches; rows beyond are taken by a grid-stride loop.
const MAX_ROW_BLOCKS: usize = 1 << 20;
/// Most partial sums of the two-stage MSE reduction (fixed by n alone: deterministic).
const MAX_PARTIALS: usize = 1024;
/// Dims a `where` handles after merging (WHERE_MAX_DIMS in fused.cu).
const WHERE_MAX_DIMS: usize = 8;

pub(crate) fn run(
    d: &CudaDevice,
    op: &FusedOp,
    inputs: &[View],
    outputs: &[&Storage],
) -> Result<()> {
    d.bind()?;
    match *op {
        FusedOp::Softmax { log } => softmax(d, log, inputs, outputs),
        FusedOp::SoftmaxBackward { log } => softmax_backward(d, log, inputs, outputs),
        FusedOp::LayerNorm { eps, weight, bias } => {
            layer_norm(d, eps, weight, bias, inputs, outputs)
        }
        FusedOp::LayerNormBackward { weight, bias } => {
            layer_norm_backward(d, weight, bias, inputs, outputs)
        }
        FusedOp::CrossEntropy { ignore_index } => cross_entropy(d, ignore_index, inputs, outputs),
        FusedOp::CrossEntropyBackward { ignore_index } => {
            cross_entropy_backward(d, ignore_index, inputs, outputs)
        }
        FusedOp::IndexSelect => index_select(d, inputs, outputs),
        FusedOp::IndexAdd => index_add(d, inputs, outputs),
        FusedOp::Where => select_where(d, inputs, outputs),
        FusedOp::MseLoss => mse(d, inputs, outputs),
        FusedOp::MseLossBackward => mse_backward(d, inputs, outputs),
        FusedOp::SgdStep {
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
            first_step,
        } => {
            let h = [lr, weight_decay, momentum, 1.0 - dampening];
            sgd(d, h, nesterov, first_step, inputs, outputs)
        }
        FusedOp::AdamStep { .. } => super::optim::adam(d, op, inputs, outputs),
        FusedOp::UnscaleCheck { inv_scale } => {
            super::amp::unscale_check(d, inv_scale, inputs, outputs)
        }
    }
}

// ---- launching --------------------------------------------------------------------------------

/// Shape and per-operand strides of a `where` (struct WhereArgs in fused.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct WhereArgs {
    shape: [i64; WHERE_MAX_DIMS],
    sc: [i64; WHERE_MAX_DIMS],
    sa: [i64; WHERE_MAX_DIMS],
    sb: [i64; WHERE_MAX_DIMS],
    rank: i32,
}

// SAFETY: a plain #[repr(C)] struct of integers, laid out as its C++ twin.
unsafe impl DeviceRepr for WhereArgs {}

/// One kernel argument. Launch arguments are read through references, so they live in a
/// slice that outlasts the launch call. `Ptr` is a device address (a C++ pointer parameter;
/// 0 is null), `I64` a `long long`, `F64` a `double`, `I32` an `int`.
#[derive(Clone, Copy)]
enum Arg<'a> {
    Ptr(u64),
    I64(i64),
    F64(f64),
    I32(i32),
    Where(&'a WhereArgs),
}

fn launch(d: &CudaDevice, name: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
    let f = d.function(MODULE, SRC, name)?;
    let mut b = d.stream().launch_builder(&f);
    for a in args {
        match a {
            Arg::Ptr(v) => b.arg(v),
            Arg::I64(v) => b.arg(v),
            Arg::F64(v) => b.arg(v),
            Arg::I32(v) => b.arg(v),
            Arg::Where(v) => b.arg(*v),
        };
    }
    // SAFETY: every launcher passes the kernel's parameters in order with matching sizes;
    // pointers are live device blocks (inputs, caller-allocated outputs, or temporaries that
    // stay allocated until the launch is queued: later users of a freed block are ordered
    // after it on this device's single stream), and the sizes and element counts passed
    // bound every access (checked against the storages by the launchers).
    unsafe { b.launch(cfg) }.map_err(|e| d.err(&format!("launching {name}"), e))?;
    Ok(())
}

/// One block of BLOCK threads per row (rows > 0).
fn rows_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, MAX_ROW_BLOCKS) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn i64_of(v: usize) -> Arg<'static> {
    Arg::I64(v as i64)
}

// ---- operands ---------------------------------------------------------------------------------

/// Kernel-name suffix of a float dtype.
fn suffix(op: &'static str, dtype: DType) -> Result<&'static str> {
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

/// The `kind` code of a float buffer whose dtype may differ from the rows' (statistics).
fn kind(op: &'static str, dtype: DType) -> Result<i32> {
    Ok(match suffix(op, dtype)? {
        "f32" => 0,
        "f64" => 1,
        "f16" => 2,
        _ => 3,
    })
}

/// Device address of a view's first element.
fn addr(v: &View) -> Result<u64> {
    Ok(ptr(v.storage)? + (v.layout.offset() * v.storage.dtype().size_in_bytes()) as u64)
}

/// Address of input `i`, which must be contiguous with `len` elements of `dtype`.
fn dense(op: &'static str, inputs: &[View], i: usize, len: usize, dtype: DType) -> Result<u64> {
    let v = input(op, inputs, i)?;
    let l = v.layout;
    if !l.is_contiguous() || l.numel() != len || l.offset() + len > v.storage.len() {
        return Err(Error::invalid(
            op,
            format!(
                "input {i} must be contiguous with {len} elements, got shape {:?}",
                l.shape()
            ),
        ));
    }
    if v.storage.dtype() != dtype {
        return Err(Error::DType {
            op,
            expected: dtype,
            got: v.storage.dtype(),
        });
    }
    addr(v)
}

/// Address of input `i`, contiguous with `len` elements of any float dtype, and its kind.
fn dense_stat(op: &'static str, inputs: &[View], i: usize, len: usize) -> Result<(u64, i32)> {
    let dtype = input(op, inputs, i)?.storage.dtype();
    Ok((dense(op, inputs, i, len, dtype)?, kind(op, dtype)?))
}

fn input<'v, 'a>(op: &'static str, inputs: &'v [View<'a>], i: usize) -> Result<&'v View<'a>> {
    inputs
        .get(i)
        .ok_or_else(|| Error::invalid(op, format!("missing input {i}")))
}

fn output<'s>(op: &'static str, outputs: &[&'s Storage], i: usize) -> Result<&'s Storage> {
    outputs
        .get(i)
        .copied()
        .ok_or_else(|| Error::invalid(op, format!("missing output {i}")))
}

/// Address of output `i`, which must hold `len` elements of `dtype`.
fn out(op: &'static str, outputs: &[&Storage], i: usize, len: usize, dtype: DType) -> Result<u64> {
    let s = output(op, outputs, i)?;
    if s.dtype() != dtype {
        return Err(Error::invalid(
            op,
            format!(
                "output dtype {} differs from the input's {dtype}",
                s.dtype()
            ),
        ));
    }
    check_len(op, s, len)?;
    ptr(s)
}

/// Address and kind of output `i`: `len` elements of any float dtype (statistics, losses).
fn out_stat(op: &'static str, outputs: &[&Storage], i: usize, len: usize) -> Result<(u64, i32)> {
    let s = output(op, outputs, i)?;
    let k = kind(op, s.dtype())?;
    check_len(op, s, len)?;
    Ok((ptr(s)?, k))
}

fn check_len(op: &'static str, s: &Storage, len: usize) -> Result<()> {
    if s.len() != len {
        return Err(Error::shape(
            op,
            format!("output holds {} elements, the op writes {len}", s.len()),
        ));
    }
    Ok(())
}

fn expect(op: &'static str, inputs: &[View], count: usize) -> Result<()> {
    if inputs.len() != count {
        return Err(Error::invalid(
            op,
            format!("expected {count} inputs, got {}", inputs.len()),
        ));
    }
    Ok(())
}

/// (rows, cols): a layout read as rows of its last dim (a 0-dim tensor is one row of one).
fn rows_cols(l: &Layout) -> (usize, usize) {
    match l.shape().split_last() {
        Some((&n, lead)) => (lead.iter().product(), n),
        None => (1, 1),
    }
}

/// A device temporary from this device's allocator, counted as `temporary`.
fn temp(d: &CudaDevice, bytes: usize, origin: &'static str) -> Result<Allocation> {
    crate::memory::allocator(Device::Cuda(d.ordinal()))?.malloc(
        bytes.max(8),
        Category::Temporary,
        origin,
    )
}

/// Uploads host i64s into a fresh temporary.
fn upload_i64s(d: &CudaDevice, values: &[i64], origin: &'static str) -> Result<Allocation> {
    let t = temp(d, values.len() * 8, origin)?;
    d.copy_to_device(t.addr(), bytemuck::cast_slice(values))?;
    Ok(t)
}

/// The I64 values of a view (any layout), in row-major order, read back to the host.
fn host_i64s(d: &CudaDevice, op: &'static str, v: &View) -> Result<Vec<i64>> {
    if v.storage.dtype() != DType::I64 {
        return Err(Error::UnsupportedDType {
            op,
            dtype: v.storage.dtype(),
            hint: "indices must be int64 (DType::I64)",
        });
    }
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
    if lo < 0 || hi as usize >= v.storage.len() {
        return Err(Error::invalid(
            op,
            "the indices' view reaches outside its storage",
        ));
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

// ---- softmax ----------------------------------------------------------------------------------

fn softmax(d: &CudaDevice, log: bool, inputs: &[View], outputs: &[&Storage]) -> Result<()> {
    const OP: &str = "softmax";
    expect(OP, inputs, 1)?;
    let dtype = inputs[0].storage.dtype();
    let s = suffix(OP, dtype)?;
    let (rows, n) = rows_cols(inputs[0].layout);
    let x = dense(OP, inputs, 0, rows * n, dtype)?;
    let y = out(OP, outputs, 0, rows * n, dtype)?;
    if rows * n == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(y),
        i64_of(rows),
        i64_of(n),
        Arg::I32(log as i32),
    ];
    launch(d, &format!("softmax_fwd_{s}"), rows_cfg(rows), &args)
}

fn softmax_backward(
    d: &CudaDevice,
    log: bool,
    inputs: &[View],
    outputs: &[&Storage],
) -> Result<()> {
    const OP: &str = "softmax_backward";
    expect(OP, inputs, 2)?;
    let dtype = inputs[0].storage.dtype();
    let s = suffix(OP, dtype)?;
    let (rows, n) = rows_cols(inputs[0].layout);
    let y = dense(OP, inputs, 0, rows * n, dtype)?;
    let gy = dense(OP, inputs, 1, rows * n, dtype)?;
    let gx = out(OP, outputs, 0, rows * n, dtype)?;
    if rows * n == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(y),
        Arg::Ptr(gy),
        Arg::Ptr(gx),
        i64_of(rows),
        i64_of(n),
        Arg::I32(log as i32),
    ];
    launch(d, &format!("softmax_bwd_{s}"), rows_cfg(rows), &args)
}

// ---- layer norm -------------------------------------------------------------------------------

fn layer_norm(
    d: &CudaDevice,
    eps: f64,
    weight: bool,
    bias: bool,
    inputs: &[View],
    outputs: &[&Storage],
) -> Result<()> {
    const OP: &str = "layer_norm";
    expect(OP, inputs, 1 + weight as usize + bias as usize)?;
    let dtype = inputs[0].storage.dtype();
    let s = suffix(OP, dtype)?;
    let (rows, n) = rows_cols(inputs[0].layout);
    let x = dense(OP, inputs, 0, rows * n, dtype)?;
    let w = if weight {
        dense(OP, inputs, 1, n, dtype)?
    } else {
        0
    };
    let b = if bias {
        dense(OP, inputs, 1 + weight as usize, n, dtype)?
    } else {
        0
    };
    let y = out(OP, outputs, 0, rows * n, dtype)?;
    let (mean, sk) = out_stat(OP, outputs, 1, rows)?;
    let (rstd, rk) = out_stat(OP, outputs, 2, rows)?;
    if rk != sk {
        return Err(Error::invalid(OP, "mean and rstd must share one dtype"));
    }
    if rows == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(w),
        Arg::Ptr(b),
        Arg::Ptr(y),
        Arg::Ptr(mean),
        Arg::Ptr(rstd),
        Arg::I32(sk),
        i64_of(rows),
        i64_of(n),
        Arg::F64(eps),
    ];
    launch(d, &format!("layer_norm_fwd_{s}"), rows_cfg(rows), &args)
}

fn layer_norm_backward(
    d: &CudaDevice,
    weight: bool,
    bias: bool,
    inputs: &[View],
    outputs: &[&Storage],
) -> Result<()> {
    const OP: &str = "layer_norm_backward";
    let k = weight as usize;
    expect(OP, inputs, 4 + k)?;
    let dtype = inputs[0].storage.dtype();
    let s = suffix(OP, dtype)?;
    let (rows, n) = rows_cols(inputs[0].layout);
    let x = dense(OP, inputs, 0, rows * n, dtype)?;
    let w = if weight {
        dense(OP, inputs, 1, n, dtype)?
    } else {
        0
    };
    let (mean, sk) = dense_stat(OP, inputs, 1 + k, rows)?;
    let (rstd, rk) = dense_stat(OP, inputs, 2 + k, rows)?;
    if rk != sk {
        return Err(Error::invalid(OP, "mean and rstd must share one dtype"));
    }
    let gy = dense(OP, inputs, 3 + k, rows * n, dtype)?;
    let gx = out(OP, outputs, 0, rows * n, dtype)?;
    let gw = if weight {
        out(OP, outputs, 1, n, dtype)?
    } else {
        0
    };
    let gb = if bias {
        out(OP, outputs, 1 + k, n, dtype)?
    } else {
        0
    };
    if rows == 0 {
        // No rows: gx is empty and the parameter gradients stay the caller's zeros.
        return Ok(());
    }
    let stats = [Arg::Ptr(mean), Arg::Ptr(rstd), Arg::I32(sk)];
    let args = [
        &[Arg::Ptr(x), Arg::Ptr(w)][..],
        &stats,
        &[Arg::Ptr(gy), Arg::Ptr(gx), i64_of(rows), i64_of(n)],
    ]
    .concat();
    launch(d, &format!("layer_norm_bwd_{s}"), rows_cfg(rows), &args)?;
    if (weight || bias) && n > 0 {
        let grads = ParamGrads {
            x,
            gy,
            gw,
            gb,
            kind: kind(OP, dtype)?,
        };
        layer_norm_param_grads(d, s, &grads, &stats, rows, n)?;
    }
    Ok(())
}

/// Inputs and outputs of the weight/bias gradient reduction (addresses; 0 = absent output).
struct ParamGrads {
    x: u64,
    gy: u64,
    gw: u64,
    gb: u64,
    kind: i32,
}

/// (rows per chunk, chunks) of the column sums: enough (chunk, column) threads to fill the
/// GPU, at most 512 chunks. Depends on the shape alone, so the sums are reproducible.
fn param_chunks(rows: usize, n: usize) -> (usize, usize) {
    let want = ((1usize << 18) / n.max(1)).clamp(1, 512).min(rows.max(1));
    let per = rows.div_ceil(want).max(1);
    (per, rows.div_ceil(per).max(1))
}

/// gweight = Σ_r gy x̂ and gbias = Σ_r gy per column, in two deterministic stages: each chunk
/// of rows sums its columns in row order, then each column adds its chunks in chunk order.
fn layer_norm_param_grads(
    d: &CudaDevice,
    s: &str,
    p: &ParamGrads,
    stats: &[Arg],
    rows: usize,
    n: usize,
) -> Result<()> {
    let (per, chunks) = param_chunks(rows, n);
    let part = temp(d, 2 * chunks * n * 8, "layer_norm_backward")?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK as usize) as u32, chunks as u32, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let args = [
        &[Arg::Ptr(p.x), Arg::Ptr(p.gy)][..],
        stats,
        &[
            Arg::Ptr(part.addr()),
            i64_of(rows),
            i64_of(n),
            i64_of(per),
            i64_of(chunks),
        ],
    ]
    .concat();
    launch(d, &format!("layer_norm_params_{s}"), cfg, &args)?;
    let args = [
        Arg::Ptr(part.addr()),
        i64_of(chunks),
        i64_of(n),
        Arg::Ptr(p.gw),
        Arg::Ptr(p.gb),
        Arg::I32(p.kind),
    ];
    launch(d, "layer_norm_params_finish", CudaDevice::grid_1d(n), &args)
}

// ---- cross-entropy ----------------------------------------------------------------------------

/// Every target is a class in [0, C) or the ignored index (the first that is not is named);
/// returns how many are not ignored.
fn check_targets(targets: &[i64], classes: usize, ignore_index: i64) -> Result<usize> {
    let bad = targets
        .iter()
        .enumerate()
        .find(|&(_, &t)| t != ignore_index && (t < 0 || t as u64 >= classes as u64));
    if let Some((i, &t)) = bad {
        return Err(Error::Index {
            op: "cross_entropy",
            detail: format!(
                "target {t} at position {i} is not a class index: targets must be in [0, {classes}) or equal ignore_index ({ignore_index})"
            ),
        });
    }
    Ok(targets.iter().filter(|&&t| t != ignore_index).count())
}

/// The targets (input 1, R contiguous I64) checked on the host: (address, non-ignored count).
fn targets(
    d: &CudaDevice,
    op: &'static str,
    inputs: &[View],
    rows: usize,
    classes: usize,
    ignore_index: i64,
) -> Result<(u64, usize)> {
    let t = input(op, inputs, 1)?;
    let addr = dense(op, inputs, 1, rows, DType::I64)?;
    let count = check_targets(&host_i64s(d, op, t)?, classes, ignore_index)?;
    Ok((addr, count))
}

fn cross_entropy(
    d: &CudaDevice,
    ignore_index: i64,
    inputs: &[View],
    outputs: &[&Storage],
) -> Result<()> {
    const OP: &str = "cross_entropy";
    expect(OP, inputs, 2)?;
    let dtype = inputs[0].storage.dtype();
    let s = suffix(OP, dtype)?;
    let (rows, c) = rows_cols(inputs[0].layout);
    let x = dense(OP, inputs, 0, rows * c, dtype)?;
    let (loss, lk) = out_stat(OP, outputs, 0, 1)?;
    let (lse, sk) = out_stat(OP, outputs, 1, rows)?;
    let (t, count) = targets(d, OP, inputs, rows, c, ignore_index)?;
    // Per-row -log p(target), then their sum over the non-ignored count (0 / 0 = NaN when all
    // are ignored, as PyTorch's mean).
    let nll = temp(d, rows * 8, "cross_entropy")?;
    if rows > 0 {
        let args = [
            Arg::Ptr(x),
            Arg::Ptr(t),
            i64_of(rows),
            i64_of(c),
            Arg::I64(ignore_index),
            Arg::Ptr(lse),
            Arg::I32(sk),
            Arg::Ptr(nll.addr()),
        ];
        launch(d, &format!("cross_entropy_fwd_{s}"), rows_cfg(rows), &args)?;
    }
    sum_to_scalar(d, nll.addr(), rows, count as f64, loss, lk)
}

/// out[0] (kind `k`) = Σ part[..count] / divisor, in one block.
fn sum_to_scalar(
    d: &CudaDevice,
    part: u64,
    count: usize,
    divisor: f64,
    out: u64,
    k: i32,
) -> Result<()> {
    let args = [
        Arg::Ptr(part),
        i64_of(count),
        Arg::F64(divisor),
        Arg::Ptr(out),
        Arg::I32(k),
    ];
    launch(d, "sum_to_scalar", rows_cfg(1), &args)
}

fn cross_entropy_backward(
    d: &CudaDevice,
    ignore_index: i64,
    inputs: &[View],
    outputs: &[&Storage],
) -> Result<()> {
    const OP: &str = "cross_entropy_backward";
    expect(OP, inputs, 4)?;
    let dtype = inputs[0].storage.dtype();
    let s = suffix(OP, dtype)?;
    let (rows, c) = rows_cols(inputs[0].layout);
    let x = dense(OP, inputs, 0, rows * c, dtype)?;
    let (lse, lk) = dense_stat(OP, inputs, 2, rows)?;
    let (gloss, gk) = dense_stat(OP, inputs, 3, 1)?;
    let gx = out(OP, outputs, 0, rows * c, dtype)?;
    let (t, count) = targets(d, OP, inputs, rows, c, ignore_index)?;
    if rows * c == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(t),
        Arg::Ptr(lse),
        Arg::I32(lk),
        Arg::Ptr(gloss),
        Arg::I32(gk),
        Arg::F64(count as f64),
        Arg::Ptr(gx),
        i64_of(rows),
        i64_of(c),
        Arg::I64(ignore_index),
    ];
    launch(d, &format!("cross_entropy_bwd_{s}"), rows_cfg(rows), &args)
}

// ---- index select / index add -----------------------------------------------------------------

/// A strided (rows, cols) view: (rows, cols, row stride, col stride).
fn matrix(op: &'static str, l: &Layout) -> Result<(usize, usize, i64, i64)> {
    match (l.shape(), l.strides()) {
        (&[rows, cols], &[rs, cs]) => Ok((rows, cols, rs as i64, cs as i64)),
        _ => Err(Error::shape(
            op,
            format!(
                "expected a 2-D (rows, cols) input, got shape {:?}",
                l.shape()
            ),
        )),
    }
}

/// The ids (input 1) read back and checked against `rows`, in row-major order.
fn row_ids(d: &CudaDevice, op: &'static str, inputs: &[View], rows: usize) -> Result<Vec<i64>> {
    let ids = host_i64s(d, op, input(op, inputs, 1)?)?;
    let bad = ids
        .iter()
        .enumerate()
        .find(|&(_, &id)| id < 0 || id as u64 >= rows as u64);
    if let Some((pos, &id)) = bad {
        return Err(Error::Index {
            op,
            detail: format!(
                "index {id} (at position {pos} of the ids) is out of range for {rows} rows; valid indices are 0..{rows}"
            ),
        });
    }
    Ok(ids)
}

/// Kernel suffix of an element size (the gather and `where` move bits, whatever the type).
fn size_suffix(dtype: DType) -> &'static str {
    match dtype.size_in_bytes() {
        1 => "1",
        2 => "2",
        4 => "4",
        _ => "8",
    }
}

fn same_dtype(op: &'static str, expected: DType, got: DType) -> Result<()> {
    if expected != got {
        return Err(Error::DType { op, expected, got });
    }
    Ok(())
}

/// out[p, :] = weight[ids[p], :]
fn index_select(d: &CudaDevice, inputs: &[View], outputs: &[&Storage]) -> Result<()> {
    const OP: &str = "index_select";
    expect(OP, inputs, 2)?;
    let w = &inputs[0];
    let (rows, cols, rs, cs) = matrix(OP, w.layout)?;
    let ids = row_ids(d, OP, inputs, rows)?;
    let dtype = w.storage.dtype();
    suffix(OP, dtype)?;
    let o = output(OP, outputs, 0)?;
    same_dtype(OP, dtype, o.dtype())?;
    check_len(OP, o, ids.len() * cols)?;
    if ids.is_empty() || cols == 0 {
        return Ok(());
    }
    // Contiguous ids are read in place; others go up as the row-major copy just checked.
    let id_view = &inputs[1];
    let staged;
    let id_addr = if id_view.layout.is_contiguous() {
        addr(id_view)?
    } else {
        staged = upload_i64s(d, &ids, "index_select")?;
        staged.addr()
    };
    let args = [
        Arg::Ptr(addr(w)?),
        Arg::I64(rs),
        Arg::I64(cs),
        Arg::Ptr(id_addr),
        Arg::Ptr(ptr(o)?),
        i64_of(ids.len()),
        i64_of(cols),
    ];
    let name = format!("index_select_{}", size_suffix(dtype));
    launch(d, &name, CudaDevice::grid_1d(ids.len() * cols), &args)
}

/// Positions grouped by destination row (a stable counting sort), flattened for the kernel:
/// [dest rows (U), group starts (U + 1), positions (N)], only rows that receive something.
fn groups(ids: &[i64]) -> (Vec<i64>, usize) {
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&p| ids[p]); // stable: positions of one row stay in id order
    let mut dest = Vec::new();
    let mut start = Vec::new();
    for (k, &p) in order.iter().enumerate() {
        if dest.last() != Some(&ids[p]) {
            dest.push(ids[p]);
            start.push(k as i64);
        }
    }
    start.push(ids.len() as i64);
    let count = dest.len();
    let flat = dest
        .into_iter()
        .chain(start)
        .chain(order.into_iter().map(|p| p as i64))
        .collect();
    (flat, count)
}

/// gweight[ids[p], :] += g[p, :] for p in order, one block per destination row.
fn index_add(d: &CudaDevice, inputs: &[View], outputs: &[&Storage]) -> Result<()> {
    const OP: &str = "index_add";
    expect(OP, inputs, 2)?;
    let g = &inputs[0];
    let (n, cols, rs, cs) = matrix(OP, g.layout)?;
    let dtype = g.storage.dtype();
    let s = suffix(OP, dtype)?;
    let o = output(OP, outputs, 0)?;
    same_dtype(OP, dtype, o.dtype())?;
    if cols == 0 {
        // Zero-width rows: nothing to add (and no row count to check the ids against).
        return Ok(());
    }
    if !o.len().is_multiple_of(cols) {
        return Err(Error::shape(
            OP,
            format!(
                "output of {} elements is not a whole number of {cols}-wide rows",
                o.len()
            ),
        ));
    }
    let ids = row_ids(d, OP, inputs, o.len() / cols)?;
    if ids.len() != n {
        return Err(Error::shape(
            OP,
            format!("{} ids for {n} gradient rows", ids.len()),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    let (flat, count) = groups(&ids);
    let table = upload_i64s(d, &flat, "index_add")?;
    let at = |i: usize| table.addr() + (i * 8) as u64;
    let args = [
        Arg::Ptr(addr(g)?),
        Arg::I64(rs),
        Arg::I64(cs),
        Arg::Ptr(at(0)),
        Arg::Ptr(at(count)),
        Arg::Ptr(at(2 * count + 1)),
        i64_of(count),
        Arg::Ptr(ptr(o)?),
        i64_of(cols),
    ];
    // Threads walk the columns: no more than the row is wide (in whole warps).
    let threads = cols.next_multiple_of(32).min(BLOCK as usize) as u32;
    let cfg = LaunchConfig {
        grid_dim: (count.clamp(1, MAX_ROW_BLOCKS) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(d, &format!("index_add_{s}"), cfg, &args)
}

// ---- where ------------------------------------------------------------------------------------

/// Merges dims so that a strided walk of `shape` steps through each operand with fewer dims:
/// size-1 dims go, and neighbours merge where every operand's outer stride spans the inner
/// dim. Returns (shape, per-operand strides), outermost first.
fn merge_dims(shape: &[usize], strides: [&[isize]; 3]) -> (Vec<usize>, [Vec<isize>; 3]) {
    let mut sh: Vec<usize> = Vec::new();
    let mut st: [Vec<isize>; 3] = Default::default();
    for (i, &n) in shape.iter().enumerate() {
        if n == 1 {
            continue;
        }
        let mergeable = sh
            .last()
            .is_some_and(|_| (0..3).all(|k| st[k].last() == Some(&(strides[k][i] * n as isize))));
        if mergeable {
            if let Some(last) = sh.last_mut() {
                *last *= n;
            }
            for k in 0..3 {
                if let Some(s) = st[k].last_mut() {
                    *s = strides[k][i];
                }
            }
        } else {
            sh.push(n);
            for k in 0..3 {
                st[k].push(strides[k][i]);
            }
        }
    }
    (sh, st)
}

/// out = cond != 0 ? a : b; all three broadcast to one shape, out contiguous.
fn select_where(d: &CudaDevice, inputs: &[View], outputs: &[&Storage]) -> Result<()> {
    const OP: &str = "where";
    expect(OP, inputs, 3)?;
    let (c, a, b) = (&inputs[0], &inputs[1], &inputs[2]);
    let shape = c.layout.shape();
    if a.layout.shape() != shape || b.layout.shape() != shape {
        return Err(Error::shape(
            OP,
            format!(
                "cond {:?}, a {:?} and b {:?} must be broadcast to one shape first",
                shape,
                a.layout.shape(),
                b.layout.shape()
            ),
        ));
    }
    if c.storage.dtype() != DType::U8 {
        return Err(Error::UnsupportedDType {
            op: OP,
            dtype: c.storage.dtype(),
            hint: "the condition must be a U8 mask (0 = false, non-zero = true)",
        });
    }
    let o = output(OP, outputs, 0)?;
    same_dtype(OP, o.dtype(), a.storage.dtype())?;
    same_dtype(OP, o.dtype(), b.storage.dtype())?;
    let numel = c.layout.numel();
    check_len(OP, o, numel)?;
    if numel == 0 {
        return Ok(());
    }
    let strides = [c.layout.strides(), a.layout.strides(), b.layout.strides()];
    let (sh, st) = merge_dims(shape, strides);
    if sh.len() > WHERE_MAX_DIMS {
        return Err(Error::invalid(
            OP,
            format!(
                "the operands step through {} separate dims (at most {WHERE_MAX_DIMS} are supported); make them contiguous first",
                sh.len()
            ),
        ));
    }
    let mut w = WhereArgs {
        rank: sh.len() as i32,
        ..Default::default()
    };
    for (i, &n) in sh.iter().enumerate() {
        w.shape[i] = n as i64;
        w.sc[i] = st[0][i] as i64;
        w.sa[i] = st[1][i] as i64;
        w.sb[i] = st[2][i] as i64;
    }
    let args = [
        Arg::Ptr(addr(c)?),
        Arg::Ptr(addr(a)?),
        Arg::Ptr(addr(b)?),
        Arg::Ptr(ptr(o)?),
        i64_of(numel),
        Arg::Where(&w),
    ];
    let name = format!("where_{}", size_suffix(o.dtype()));
    launch(d, &name, CudaDevice::grid_1d(numel), &args)
}

// ---- MSE ----------------------------------------------------------------------------------------

fn mse(d: &CudaDevice, inputs: &[View], outputs: &[&Storage]) -> Result<()> {
    const OP: &str = "mse_loss";
    expect(OP, inputs, 2)?;
    let dtype = inputs[0].storage.dtype();
    let s = suffix(OP, dtype)?;
    let n = inputs[0].layout.numel();
    let x = dense(OP, inputs, 0, n, dtype)?;
    let y = dense(OP, inputs, 1, n, dtype)?;
    let loss = out(OP, outputs, 0, 1, dtype)?;
    // Partials from a block count fixed by n, then added in order: reproducible.
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_PARTIALS);
    let part = temp(d, blocks * 8, "mse_loss")?;
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let args = [Arg::Ptr(x), Arg::Ptr(y), i64_of(n), Arg::Ptr(part.addr())];
    launch(d, &format!("mse_partial_{s}"), cfg, &args)?;
    let k = kind(OP, dtype)?;
    sum_to_scalar(d, part.addr(), blocks, n.max(1) as f64, loss, k)
}

fn mse_backward(d: &CudaDevice, inputs: &[View], outputs: &[&Storage]) -> Result<()> {
    const OP: &str = "mse_loss";
    expect(OP, inputs, 3)?;
    let dtype = inputs[0].storage.dtype();
    let s = suffix(OP, dtype)?;
    let n = inputs[0].layout.numel();
    let x = dense(OP, inputs, 0, n, dtype)?;
    let y = dense(OP, inputs, 1, n, dtype)?;
    let (g, gk) = dense_stat(OP, inputs, 2, 1)?;
    let gx = out(OP, outputs, 0, n, dtype)?;
    if n == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(y),
        Arg::Ptr(g),
        Arg::I32(gk),
        Arg::Ptr(gx),
        i64_of(n),
        Arg::F64(n as f64),
    ];
    launch(d, &format!("mse_bwd_{s}"), CudaDevice::grid_1d(n), &args)
}

// ---- SGD ----------------------------------------------------------------------------------------

/// One SGD step in place. `h` = [lr, weight_decay, momentum, 1 - dampening]; the momentum
/// buffer is output 1 when present.
fn sgd(
    d: &CudaDevice,
    h: [f64; 4],
    nesterov: bool,
    first: bool,
    inputs: &[View],
    outputs: &[&Storage],
) -> Result<()> {
    const OP: &str = "sgd";
    expect(OP, inputs, 1)?;
    let param = output(OP, outputs, 0)?;
    let dtype = param.dtype();
    let s = suffix(OP, dtype)?;
    let n = param.len();
    let g = dense(OP, inputs, 0, n, dtype)?;
    let p = ptr(param)?;
    let buf = match outputs.get(1) {
        Some(_) => out(OP, outputs, 1, n, dtype)?,
        None => 0,
    };
    if n == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(g),
        Arg::Ptr(p),
        Arg::Ptr(buf),
        i64_of(n),
        Arg::F64(h[0]),
        Arg::F64(h[1]),
        Arg::F64(h[2]),
        Arg::F64(h[3]),
        Arg::I32(nesterov as i32),
        Arg::I32(first as i32),
    ];
    launch(d, &format!("sgd_step_{s}"), CudaDevice::grid_1d(n), &args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_keep_id_order_within_a_row() {
        // ids: row 3 at positions 0 and 2, row 1 at 1 and 3.
        let (flat, count) = groups(&[3, 1, 3, 1, 0]);
        assert_eq!(count, 3);
        assert_eq!(&flat[..3], &[0, 1, 3]); // destination rows
        assert_eq!(&flat[3..7], &[0, 1, 3, 5]); // group starts
        assert_eq!(&flat[7..], &[4, 1, 3, 0, 2]); // positions
    }

    #[test]
    fn merge_dims_collapses_contiguous_and_keeps_broadcast() {
        let (sh, st) = merge_dims(&[2, 3, 4], [&[12, 4, 1], &[12, 4, 1], &[0, 0, 0]]);
        assert_eq!(sh, vec![24]);
        assert_eq!(st, [vec![1], vec![1], vec![0]]);
        // A broadcast middle dim splits the walk.
        let (sh, st) = merge_dims(&[2, 3, 4], [&[12, 4, 1], &[4, 0, 1], &[12, 4, 1]]);
        assert_eq!(sh, vec![2, 3, 4]);
        assert_eq!(st[1], vec![4, 0, 1]);
        // Size-1 dims vanish.
        let (sh, _) = merge_dims(&[1, 5, 1], [&[5, 1, 1], &[5, 1, 1], &[0, 1, 0]]);
        assert_eq!(sh, vec![5]);
    }

    #[test]
    fn param_chunks_cover_all_rows() {
        for (rows, n) in [(1, 1), (7, 3), (1000, 768), (65536, 64), (3, 100_000)] {
            let (per, chunks) = param_chunks(rows, n);
            assert!(
                per * chunks >= rows && per * (chunks - 1) < rows,
                "{rows} {n}"
            );
            assert!(chunks <= 512);
        }
    }
}
