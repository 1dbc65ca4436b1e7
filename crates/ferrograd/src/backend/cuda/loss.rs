//! CUDA launchers of the loss family (backend/loss.rs; kernels in kernels/loss.cu):
//! cross-entropy with one block per row (its loss and gradient in one pass for half-precision
//! rows) and the two-stage MSE. Arguments arrive validated.
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
    if vector_rows(s, ld, addrs) {
        format!("{stem}_vec_{s}")
    } else {
        format!("{stem}_{s}")
    }
}

/// Whether rows `ld` apart of dtype suffix `s` from `addrs` are whole 16-byte vectors of
/// f16/bf16 from aligned addresses.
fn vector_rows(s: &str, ld: usize, addrs: &[u64]) -> bool {
    let half = s == "f16" || s == "bf16";
    half && ld.is_multiple_of(8) && addrs.iter().all(|a| a.is_multiple_of(16))
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

/// The logits' rows and their targets as every cross-entropy kernel takes them (the targets
/// checked on the host; `count` of them not ignored).
struct Rows<'a> {
    s: &'a str,
    x: u64,
    ld: usize,
    t: u64,
    rows: usize,
    c: usize,
    ignore: i64,
    count: usize,
}

impl<'a> Rows<'a> {
    fn new(
        d: &CudaDevice,
        op: &'static str,
        logits: &View,
        targets: &View,
        ignore: i64,
    ) -> Result<Self> {
        let s = suffix(op, logits.storage.dtype())?;
        let (rows, c) = rows_cols(logits.layout);
        let (t, count) = self::targets(d, targets, c, ignore)?;
        Ok(Self {
            s,
            x: addr(logits)?,
            ld: row_stride(logits)?,
            t,
            rows,
            c,
            ignore,
            count,
        })
    }

    /// The arguments the forward kernels begin with: x, ld, t, rows, c, ignore.
    fn leading_args(&self) -> [Arg<'static>; 6] {
        [
            Arg::Ptr(self.x),
            i64_of(self.ld),
            Arg::Ptr(self.t),
            i64_of(self.rows),
            i64_of(self.c),
            Arg::I64(self.ignore),
        ]
    }

    /// cross_entropy_fwd: lse (kind lk) and -log p(target) per row into nll.
    fn forward(&self, d: &CudaDevice, lse: u64, lk: i32, nll: u64) -> Result<()> {
        let args = [
            self.leading_args().as_slice(),
            &[Arg::Ptr(lse), Arg::I32(lk), Arg::Ptr(nll)],
        ]
        .concat();
        let kernel = ce_kernel("cross_entropy_fwd", self.s, self.ld, &[self.x]);
        launch(d, &KERNELS, &kernel, rows_cfg(self.rows), &args)
    }

    /// cross_entropy_bwd: the gradient for loss gradient `gloss` (kind gk) into gx.
    fn backward(&self, d: &CudaDevice, lse: (u64, i32), gloss: (u64, i32), gx: u64) -> Result<()> {
        let args = [
            Arg::Ptr(self.x),
            i64_of(self.ld),
            Arg::Ptr(self.t),
            Arg::Ptr(lse.0),
            Arg::I32(lse.1),
            Arg::Ptr(gloss.0),
            Arg::I32(gloss.1),
            Arg::F64(self.count as f64),
            Arg::Ptr(gx),
            i64_of(self.rows),
            i64_of(self.c),
            Arg::I64(self.ignore),
        ];
        let kernel = ce_kernel("cross_entropy_bwd", self.s, self.ld, &[self.x, gx]);
        launch(d, &KERNELS, &kernel, rows_cfg(self.rows), &args)
    }

    /// The one-pass kernel and its dynamic shared memory, when the rows are whole 16-byte
    /// vectors of f16/bf16: on Hopper, the row staged in shared memory where its vectors fit
    /// two blocks per SM (GPT-2's 50257 logits, 100.5 KB), else read twice (the second time
    /// from L2).
    fn one_pass_kernel(&self, d: &CudaDevice) -> Option<(String, u32)> {
        if !vector_rows(self.s, self.ld, &[self.x]) {
            return None;
        }
        let staged = (self.c / 8) * 16;
        Some(if staged <= CE_STAGE_MAX && d.arch() == "sm_90a" {
            (
                format!("cross_entropy_grad_staged_{}", self.s),
                staged as u32,
            )
        } else {
            (format!("cross_entropy_grad_vec_{}", self.s), 0)
        })
    }

    /// cross_entropy_grad_vec or _staged: nll as `forward` writes it, the logits overwritten by
    /// `backward`'s gradient.
    fn forward_and_grad(
        &self,
        d: &CudaDevice,
        (kernel, stage_bytes): &(String, u32),
        gloss: (u64, i32),
        nll: u64,
    ) -> Result<()> {
        let tail = [
            Arg::Ptr(gloss.0),
            Arg::I32(gloss.1),
            Arg::F64(self.count as f64),
            Arg::Ptr(nll),
        ];
        let args = [self.leading_args().as_slice(), &tail].concat();
        // One block of CE_GRAD_BLOCK (loss.cu) threads per row.
        let cfg = LaunchConfig {
            block_dim: (1024, 1, 1),
            shared_mem_bytes: *stage_bytes,
            ..rows_cfg(self.rows)
        };
        launch(d, &KERNELS, kernel, cfg, &args)
    }

    /// The loss (kind lk) into `loss`: Σ nll over the non-ignored count (0 / 0 = NaN when all
    /// are ignored, as PyTorch's mean).
    fn mean(&self, d: &CudaDevice, nll: u64, loss: u64, lk: i32) -> Result<()> {
        sum_to_scalar(d, nll, self.rows, self.count as f64, loss, lk)
    }
}

/// The most bytes of a row the one-pass kernel stages in shared memory: two blocks per SM
/// (their 2 × 1 KiB reserved and the reductions' 128 bytes included) within Hopper's 228 KiB.
const CE_STAGE_MAX: usize = 112 << 10;
// Two blocks' rows, their reserved 1 KiB each and their 32 reduction floats, in 228 KiB.
const _: () = assert!(2 * (CE_STAGE_MAX + 1024 + 32 * 4) <= 228 << 10);

fn cross_entropy(d: &CudaDevice, a: &CrossEntropy) -> Result<()> {
    const OP: &str = "cross_entropy";
    let r = Rows::new(d, OP, &a.logits, &a.targets, a.ignore_index)?;
    let (loss, lk) = (ptr(a.loss)?, float_code(OP, a.loss.dtype())?);
    let (lse, sk) = (ptr(a.lse)?, float_code(OP, a.lse.dtype())?);
    let nll = temp(d, nll_scratch_bytes(r.rows), OP)?;
    if r.rows > 0 {
        r.forward(d, lse, sk, nll.addr())?;
    }
    r.mean(d, nll.addr(), loss, lk)
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
    let r = Rows::new(d, OP, &a.logits, &a.targets, a.ignore_index)?;
    let lse = (addr(&a.lse)?, float_code(OP, a.lse.storage.dtype())?);
    let gloss = (addr(&a.gloss)?, float_code(OP, a.gloss.storage.dtype())?);
    if r.rows * r.c == 0 {
        return Ok(());
    }
    r.backward(d, lse, gloss, addr(&a.glogits)?)
}

/// The loss into `a.loss`, and the logits overwritten by their gradient: one kernel over
/// half-precision rows of whole 16-byte vectors (loss.cu's `cross_entropy_grad_vec`), else the
/// forward and backward kernels with the log-sum-exp in scratch.
fn cross_entropy_with_grad(d: &CudaDevice, a: &CrossEntropyWithGrad) -> Result<()> {
    const OP: &str = "cross_entropy";
    let r = Rows::new(d, OP, &a.logits, &a.targets, a.ignore_index)?;
    let (loss, lk) = (ptr(a.loss)?, float_code(OP, a.loss.dtype())?);
    let gloss = (addr(&a.gloss)?, float_code(OP, a.gloss.storage.dtype())?);
    let scratch = temp(d, nll_lse_scratch_bytes(r.rows), OP)?;
    let nll = scratch.addr();
    if r.rows * r.c > 0 {
        match r.one_pass_kernel(d) {
            Some(kernel) => r.forward_and_grad(d, &kernel, gloss, nll)?,
            None => {
                // The log-sum-exp at the forward's statistics dtype (f32 below f64), as the
                // backward would read it saved.
                let stats = match a.logits.storage.dtype() {
                    DType::F64 => DType::F64,
                    _ => DType::F32,
                };
                let lse = (
                    nll + nll_scratch_bytes(r.rows) as u64,
                    float_code(OP, stats)?,
                );
                r.forward(d, lse.0, lse.1, nll)?;
                r.backward(d, lse, gloss, r.x)?;
            }
        }
    }
    r.mean(d, nll, loss, lk)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The staged loss kernel holds at most CE_STAGE_MAX bytes of a row (checked against
    /// Hopper's 228 KiB beside the constant), so two of its 1024-thread blocks fit one SM,
    /// which its launch bounds promise; GPT-2's 50257 logits are staged.
    #[test]
    fn two_staged_rows_fit_one_hopper_sm() {
        let src = KERNELS.body();
        assert!(src.contains("#define CE_GRAD_BLOCK 1024\n"));
        assert!(src.contains("__launch_bounds__(CE_GRAD_BLOCK, 2) cross_entropy_grad_staged_"));
        let gpt2_row = (50257 / 8) * 16;
        assert!(gpt2_row <= CE_STAGE_MAX, "{gpt2_row}");
    }
}
