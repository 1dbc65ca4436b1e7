//! Cross-entropy of logits against class indices, mean over the targets that are not
//! ignored, as one fused op. The forward keeps no softmax: it saves a reference to the logits
//! (no copy when they are contiguous) and one log-sum-exp per row, so the graph holds R extra
//! floats rather than another (R, C) tensor. Backward rebuilds the softmax row by row:
//! glogits = (softmax - onehot) · g / count, zero rows for ignored targets.

use super::{check_float, check_same_device, stats_dtype};
use crate::autograd::{SavedTensor, record};
use crate::backend::loss::{self, CrossEntropy, CrossEntropyBackward};
use crate::base::{Error, Result};
use crate::tensor::{DType, Tensor};

impl Tensor {
    /// Mean cross-entropy of logits `self` (N, C) against `targets` I64 (N), or of (B, T, C)
    /// against (B, T) (the class dim is LAST, as in language models, not PyTorch's
    /// (N, C, d1...)). Targets equal to `ignore_index` (PyTorch's default is -100) count
    /// neither in the sum nor in the mean; when all are ignored the loss is NaN, as PyTorch's.
    /// Returns a 0-dim tensor in the logits' dtype (f32 under autocast, which computes the
    /// loss in f32 as PyTorch's autocast does: f16/bf16 logits are read as they are, without
    /// an f32 copy, and their gradient is rounded once from f32).
    #[track_caller]
    pub fn cross_entropy(&self, targets: &Tensor, ignore_index: i64) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let low = matches!(self.dtype(), DType::F16 | DType::BF16);
        let loss_dtype = match crate::amp::autocast_dtype() {
            Some(_) if low => DType::F32,
            Some(_) => {
                if let Some([x]) = super::autocast::cast_f32([self])? {
                    return x.cross_entropy(targets, ignore_index);
                }
                self.dtype()
            }
            None => self.dtype(),
        };
        let rows = check_args(self, targets)?;
        // Evenly spaced rows (contiguous, or the head GEMM's padded rows) are read in place.
        let x = if self.layout().row_stride().is_some() {
            self.detach()
        } else {
            self.contiguous_copy()?
        };
        let t = targets.detached_contiguous()?;
        let loss = Tensor::output_uninit(&[], loss_dtype, self.device(), "cross_entropy")?;
        let lse = Tensor::output_uninit(
            &[rows],
            stats_dtype(self.dtype()),
            self.device(),
            "cross_entropy",
        )?;
        loss::cross_entropy(&CrossEntropy {
            logits: x.view(),
            targets: t.view(),
            loss: loss.storage(),
            lse: lse.storage(),
            ignore_index,
        })?;
        Ok(record("cross_entropy", &[self], loss, |_, _| {
            let (t, lse) = (SavedTensor::new(&t), SavedTensor::new(&lse));
            let mut x = Some(SavedTensor::new(&x));
            move |g: &Tensor, _: &[bool]| {
                let g = g.detached_contiguous()?;
                let saved = x.as_ref().ok_or_else(|| {
                    crate::base::Error::autograd("cross_entropy's saved logits were consumed")
                })?;
                let gx = logits_grad_buffer(saved.get())?;
                let (xt, t, lse) = (saved.get(), t.get(), lse.get());
                loss::cross_entropy_backward(&CrossEntropyBackward {
                    logits: xt.view(),
                    targets: t.view(),
                    lse: lse.view(),
                    gloss: g.view(),
                    glogits: gx.view(),
                    ignore_index,
                })?;
                if gx.storage().same(xt.storage()) {
                    // The logits became their gradient: nothing may read them as logits again.
                    xt.storage().bump_version();
                    x = None;
                }
                Ok(vec![Some(gx)])
            }
        }))
    }
}

/// Where the logits' gradient goes: into the logits themselves when nothing else can read
/// them (the graph frees them after this backward and no tensor shares their buffer: the
/// usual training step, which drops the logits after the loss), else a fresh buffer with
/// the logits' row layout. Reusing the buffer saves an (N, C) allocation at the step's
/// largest point, as llm.c's fused classifier does.
fn logits_grad_buffer(x: &Tensor) -> Result<Tensor> {
    if crate::autograd::saved_values_released_after_this_backward() && x.owns_its_storage_alone() {
        return Ok(x.clone());
    }
    // Whole rows, padding included: the head's input gradient zeroes the padding in place
    // and reads the block at its padded width (ops/aligned_gemm.rs).
    let l = x.layout();
    let ld = l.row_stride().unwrap_or(1);
    let rows = x.numel() / x.shape().last().copied().unwrap_or(1).max(1);
    let block = Tensor::output_uninit(
        &[rows * ld],
        x.dtype(),
        x.device(),
        "cross_entropy_backward",
    )?;
    Ok(block.with_layout(crate::tensor::Layout::new(
        l.shape().to_vec(),
        l.strides().to_vec(),
        0,
    )))
}

/// Checks dtypes, devices and shapes; returns the number of rows (targets).
fn check_args(logits: &Tensor, targets: &Tensor) -> Result<usize> {
    check_float("cross_entropy", logits)?;
    check_same_device("cross_entropy", logits, targets)?;
    if targets.dtype() != DType::I64 {
        return Err(Error::DType {
            op: "cross_entropy",
            expected: DType::I64,
            got: targets.dtype(),
        });
    }
    let shape = logits.shape();
    let Some((_, lead)) = shape.split_last().filter(|_| matches!(shape.len(), 2 | 3)) else {
        return Err(Error::shape(
            "cross_entropy",
            format!("logits must be (N, C) or (B, T, C), got {shape:?}"),
        ));
    };
    if targets.shape() != lead {
        return Err(Error::shape(
            "cross_entropy",
            format!(
                "targets {:?} must have the logits' shape without the class dim: logits {shape:?} need targets {lead:?}",
                targets.shape()
            ),
        ));
    }
    Ok(lead.iter().product())
}
