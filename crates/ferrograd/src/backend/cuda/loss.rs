//! CUDA launchers of the loss family (backend/loss.rs; kernels in kernels/loss.cu):
//! cross-entropy with one block per row and the two-stage MSE. Arguments arrive validated.
//! Class targets are copied to the host and checked there before any kernel runs, so a bad
//! one is an `Error::Index` naming it and nothing is written, as on the CPU (one
//! synchronisation per such op). Sums across rows or blocks add fixed partitions in a fixed
//! order: results do not depend on scheduling.

use cudarc::driver::LaunchConfig;

use super::launch::{
    Arg, BLOCK, Module, addr, float_code, host_i64s, i64_of, launch, rows_cfg, suffix, temp,
};
use super::{CudaDevice, ptr};
use crate::backend::capture::{self, IdCheck};
use crate::backend::loss::check_class_targets;
use crate::backend::loss::{
    CrossEntropy, CrossEntropyBackward, CrossEntropyWithGrad, LossKernels, MseLoss, MseLossBackward,
};
use crate::backend::{View, rows_cols};
use crate::base::{DType, Error, Result};

pub(super) static KERNELS: Module = Module::new("loss", include_str!("kernels/loss.cu"));
/// Most partial sums of the two-stage MSE reduction (fixed by n alone: deterministic).
const MAX_PARTIALS: usize = 1024;

impl LossKernels for CudaDevice {
    fn cross_entropy(&self, a: &CrossEntropy) -> Result<()> {
        cross_entropy(self, a)
    }
    fn cross_entropy_backward(&self, a: &CrossEntropyBackward) -> Result<()> {
        cross_entropy_backward(self, a)
    }
    fn cross_entropy_with_grad(&self, a: &CrossEntropyWithGrad) -> Result<()> {
        cross_entropy_with_grad(self, a)
    }
    fn mse_loss(&self, a: &MseLoss) -> Result<()> {
        mse(self, a)
    }
    fn mse_loss_backward(&self, a: &MseLossBackward) -> Result<()> {
        mse_backward(self, a)
    }
}

// ---- cross-entropy ----------------------------------------------------------------------------

/// The targets (R contiguous I64) checked on the host: (address, non-ignored count).
/// A capture notes the check, to run it again on the values of each replay.
fn targets(d: &CudaDevice, t: &View, classes: usize, ignore_index: i64) -> Result<(u64, usize)> {
    let counted = check_class_targets(&host_i64s(d, t)?, classes, ignore_index)?;
    let check = IdCheck::Targets {
        classes,
        ignore_index,
        counted,
    };
    capture::note_ids(ptr(t.storage)?, t.layout, check);
    Ok((addr(t)?, counted))
}

/// Elements between the logits' rows (validated by the family).
fn row_stride(v: &View) -> Result<usize> {
    v.layout
        .row_stride()
        .ok_or_else(|| Error::invalid("cross_entropy", "the logits' rows are not evenly spaced"))
}

/// The kernel name: `{stem}_vec_{s}` for half-precision rows that are whole 16-byte vectors
/// from aligned addresses (loss.cu's vector kernels), `{stem}_{s}` otherwise.
fn ce_kernel(stem: &str, s: &str, ld: usize, addrs: &[u64]) -> String {
    let half = s == "f16" || s == "bf16";
    if half && ld.is_multiple_of(8) && addrs.iter().all(|a| a.is_multiple_of(16)) {
        format!("{stem}_vec_{s}")
    } else {
        format!("{stem}_{s}")
    }
}

/// The per-row losses the cross entropy sums (the planner counts the same block).
pub(crate) fn nll_scratch_bytes(rows: usize) -> usize {
    rows * 8
}

/// The scratch of `cross_entropy_with_grad`: the per-row losses, then room for an f64
/// log-sum-exp per row (used where the rows take the two-kernel path; the planner counts the
/// same block either way).
pub(crate) fn nll_lse_scratch_bytes(rows: usize) -> usize {
    rows * 16
}

fn cross_entropy(d: &CudaDevice, a: &CrossEntropy) -> Result<()> {
    const OP: &str = "cross_entropy";
    let ignore_index = a.ignore_index;
    let s = suffix(OP, a.logits.storage.dtype())?;
    let (rows, c) = rows_cols(a.logits.layout);
    let ld = row_stride(&a.logits)?;
    let x = addr(&a.logits)?;
    let (loss, lk) = (ptr(a.loss)?, float_code(OP, a.loss.dtype())?);
    let (lse, sk) = (ptr(a.lse)?, float_code(OP, a.lse.dtype())?);
    let (t, count) = targets(d, &a.targets, c, ignore_index)?;
    // Per-row -log p(target), then their sum over the non-ignored count (0 / 0 = NaN when all
    // are ignored, as PyTorch's mean).
    let nll = temp(d, nll_scratch_bytes(rows), "cross_entropy")?;
    if rows > 0 {
        let args = [
            Arg::Ptr(x),
            i64_of(ld),
            Arg::Ptr(t),
            i64_of(rows),
            i64_of(c),
            Arg::I64(ignore_index),
            Arg::Ptr(lse),
            Arg::I32(sk),
            Arg::Ptr(nll.addr()),
        ];
        let kernel = ce_kernel("cross_entropy_fwd", s, ld, &[x]);
        launch(d, &KERNELS, &kernel, rows_cfg(rows), &args)?;
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
    launch(d, &KERNELS, "sum_to_scalar", rows_cfg(1), &args)
}

fn cross_entropy_backward(d: &CudaDevice, a: &CrossEntropyBackward) -> Result<()> {
    const OP: &str = "cross_entropy_backward";
    let ignore_index = a.ignore_index;
    let s = suffix(OP, a.logits.storage.dtype())?;
    let (rows, c) = rows_cols(a.logits.layout);
    let ld = row_stride(&a.logits)?;
    let x = addr(&a.logits)?;
    let (lse, lk) = (addr(&a.lse)?, float_code(OP, a.lse.storage.dtype())?);
    let (gloss, gk) = (addr(&a.gloss)?, float_code(OP, a.gloss.storage.dtype())?);
    let gx = addr(&a.glogits)?;
    let (t, count) = targets(d, &a.targets, c, ignore_index)?;
    if rows * c == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(x),
        i64_of(ld),
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
    let kernel = ce_kernel("cross_entropy_bwd", s, ld, &[x, gx]);
    launch(d, &KERNELS, &kernel, rows_cfg(rows), &args)
}

/// The loss into `a.loss`, and the logits overwritten by their gradient: one kernel over
/// half-precision rows of whole 16-byte vectors (loss.cu's `cross_entropy_grad_vec`), else the
/// forward and backward kernels with the log-sum-exp in scratch.
fn cross_entropy_with_grad(d: &CudaDevice, a: &CrossEntropyWithGrad) -> Result<()> {
    const OP: &str = "cross_entropy";
    let ignore_index = a.ignore_index;
    let s = suffix(OP, a.logits.storage.dtype())?;
    let (rows, c) = rows_cols(a.logits.layout);
    let ld = row_stride(&a.logits)?;
    let x = addr(&a.logits)?;
    let (loss, lk) = (ptr(a.loss)?, float_code(OP, a.loss.dtype())?);
    let (gloss, gk) = (addr(&a.gloss)?, float_code(OP, a.gloss.storage.dtype())?);
    let (t, count) = targets(d, &a.targets, c, ignore_index)?;
    let scratch = temp(d, nll_lse_scratch_bytes(rows), OP)?;
    let (nll, lse) = (
        scratch.addr(),
        scratch.addr() + nll_scratch_bytes(rows) as u64,
    );
    if rows * c > 0 {
        let (ld_, rows_, c_) = (i64_of(ld), i64_of(rows), i64_of(c));
        let (ignore, count_) = (Arg::I64(ignore_index), Arg::F64(count as f64));
        let kernel = ce_kernel("cross_entropy_grad", s, ld, &[x]);
        if kernel.contains("_vec_") {
            let args = [
                Arg::Ptr(x),
                ld_,
                Arg::Ptr(t),
                rows_,
                c_,
                ignore,
                Arg::Ptr(gloss),
                Arg::I32(gk),
                count_,
                Arg::Ptr(nll),
            ];
            launch(d, &KERNELS, &kernel, grad_rows_cfg(rows), &args)?;
        } else {
            // The log-sum-exp at the forward's statistics dtype (f32 below f64), as the
            // backward would read it saved.
            let stats = match a.logits.storage.dtype() {
                DType::F64 => DType::F64,
                _ => DType::F32,
            };
            let stats_code = float_code(OP, stats)?;
            let fwd = [
                Arg::Ptr(x),
                ld_,
                Arg::Ptr(t),
                rows_,
                c_,
                ignore,
                Arg::Ptr(lse),
                Arg::I32(stats_code),
                Arg::Ptr(nll),
            ];
            launch(
                d,
                &KERNELS,
                &format!("cross_entropy_fwd_{s}"),
                rows_cfg(rows),
                &fwd,
            )?;
            let bwd = [
                Arg::Ptr(x),
                ld_,
                Arg::Ptr(t),
                Arg::Ptr(lse),
                Arg::I32(stats_code),
                Arg::Ptr(gloss),
                Arg::I32(gk),
                count_,
                Arg::Ptr(x),
                rows_,
                c_,
                ignore,
            ];
            launch(
                d,
                &KERNELS,
                &format!("cross_entropy_bwd_{s}"),
                rows_cfg(rows),
                &bwd,
            )?;
        }
    }
    sum_to_scalar(d, nll, rows, count as f64, loss, lk)
}

/// One block of CE_GRAD_BLOCK (loss.cu) threads per row.
fn grad_rows_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        block_dim: (1024, 1, 1),
        ..rows_cfg(rows)
    }
}

// ---- MSE ----------------------------------------------------------------------------------------

fn mse(d: &CudaDevice, a: &MseLoss) -> Result<()> {
    const OP: &str = "mse_loss";
    let dtype = a.x.storage.dtype();
    let s = suffix(OP, dtype)?;
    let n = a.x.layout.numel();
    let (x, y, loss) = (addr(&a.x)?, addr(&a.y)?, ptr(a.loss)?);
    // Partials from a block count fixed by n, then added in order: reproducible.
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_PARTIALS);
    let part = temp(d, blocks * 8, "mse_loss")?;
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let args = [Arg::Ptr(x), Arg::Ptr(y), i64_of(n), Arg::Ptr(part.addr())];
    launch(d, &KERNELS, &format!("mse_partial_{s}"), cfg, &args)?;
    let k = float_code(OP, dtype)?;
    // No elements: 0 / 0 = NaN, as PyTorch's mean reduction gives (and the CPU backend).
    sum_to_scalar(d, part.addr(), blocks, n as f64, loss, k)
}

fn mse_backward(d: &CudaDevice, a: &MseLossBackward) -> Result<()> {
    const OP: &str = "mse_loss";
    let s = suffix(OP, a.x.storage.dtype())?;
    let n = a.x.layout.numel();
    let (x, y, gx) = (addr(&a.x)?, addr(&a.y)?, ptr(a.gx)?);
    let (g, gk) = (addr(&a.gloss)?, float_code(OP, a.gloss.storage.dtype())?);
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
    launch(
        d,
        &KERNELS,
        &format!("mse_bwd_{s}"),
        CudaDevice::grid_1d(n),
        &args,
    )
}
