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
    /// Returns a 0-dim tensor in the logits' dtype.
    #[track_caller]
    pub fn cross_entropy(&self, targets: &Tensor, ignore_index: i64) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if let Some([x]) = super::autocast::cast_f32([self])? {
            return x.cross_entropy(targets, ignore_index);
        }
        let rows = check_args(self, targets)?;
        let x = self.detached_contiguous()?;
        let t = targets.detached_contiguous()?;
        let loss = Tensor::output_uninit(&[], self.dtype(), self.device(), "cross_entropy")?;
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
            let (x, t, lse) = (
                SavedTensor::new(&x),
                SavedTensor::new(&t),
                SavedTensor::new(&lse),
            );
            move |g: &Tensor, _: &[bool]| {
                let g = g.detached_contiguous()?;
                let (x, t, lse) = (x.get(), t.get(), lse.get());
                let gx = Tensor::output_uninit(
                    x.shape(),
                    x.dtype(),
                    x.device(),
                    "cross_entropy_backward",
                )?;
                loss::cross_entropy_backward(&CrossEntropyBackward {
                    logits: x.view(),
                    targets: t.view(),
                    lse: lse.view(),
                    gloss: g.view(),
                    glogits: gx.storage(),
                    ignore_index,
                })?;
                Ok(vec![Some(gx)])
            }
        }))
    }
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
