//! Gradient accumulation: N micro-batches, each loss scaled by 1/N before its backward, so
//! `.grad` ends up as the gradient of the mean loss over the whole batch — the same update as
//! one large batch — while only one micro-batch's activations are alive at a time.
//!
//! `accumulate` is the strategy the `Trainer` runs (with autocast around each forward and a
//! `GradScaler` on each scaled loss); `accumulate_gradients` is its plain form.

use super::GradScaler;
use crate::amp::try_autocast;
use crate::base::{Error, Result};
use crate::memory::recorder::{self, Phase};
use crate::tensor::{DType, Tensor};

/// The loss of one micro-batch and how many tokens (or samples) it covered.
pub struct MicroBatch {
    pub loss: Tensor,
    pub tokens: usize,
}

/// How the micro-batches of one step are run.
#[derive(Clone, Copy, Default)]
pub struct Accumulation<'a> {
    /// Micro-batches per step (at least 1).
    pub micro_batches: usize,
    /// Run each forward under `autocast(dtype)`.
    pub amp: Option<DType>,
    /// Multiply each (1/N-scaled) loss by the scaler's scale before its backward.
    pub scaler: Option<&'a GradScaler>,
}

/// What the micro-batches of one step added up to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Accumulated {
    /// The mean of the micro-batch losses (unscaled; a host number).
    pub mean_loss: f64,
    pub tokens: usize,
}

/// Runs `forward(i)` for micro-batches `i = 0..N` (under autocast when asked) and
/// backpropagates (loss / N)·scale after each; gradients accumulate in `.grad`. One sync per
/// micro-batch reads its loss, as logging it would need anyway.
pub fn accumulate(
    how: &Accumulation<'_>,
    mut forward: impl FnMut(usize) -> Result<MicroBatch>,
) -> Result<Accumulated> {
    let n = how.micro_batches;
    if n == 0 {
        return Err(Error::invalid(
            "accumulate",
            "the number of micro-batches must be at least 1",
        ));
    }
    let (mut total, mut tokens) = (0.0, 0usize);
    for i in 0..n {
        let micro = {
            let _phase = recorder::phase_scope(Phase::Forward);
            // The autocast region ends with the forward: backward runs in the forward's dtypes.
            let _amp = how.amp.map(try_autocast).transpose()?;
            forward(i)?
        };
        check_scalar(&micro.loss)?;
        total += micro.loss.item()?;
        tokens += micro.tokens;
        let loss = micro.loss.mul_scalar(1.0 / n as f64)?;
        let loss = match how.scaler {
            Some(s) => s.scale(&loss)?,
            None => loss,
        };
        // Frees micro-batch i's graph and activations before micro-batch i+1 runs.
        let _phase = recorder::phase_scope(Phase::Backward);
        loss.backward()?;
    }
    Ok(Accumulated {
        mean_loss: total / n as f64,
        tokens,
    })
}

/// `accumulate` without autocast or scaler: `loss_of(i)` returns micro-batch i's loss.
/// Returns the mean loss.
pub fn accumulate_gradients(
    n: usize,
    mut loss_of: impl FnMut(usize) -> Result<Tensor>,
) -> Result<f64> {
    let how = Accumulation {
        micro_batches: n,
        ..Default::default()
    };
    let done = accumulate(&how, |i| {
        Ok(MicroBatch {
            loss: loss_of(i)?,
            tokens: 0,
        })
    })?;
    Ok(done.mean_loss)
}

fn check_scalar(loss: &Tensor) -> Result<()> {
    if loss.numel() != 1 {
        return Err(Error::shape(
            "accumulate",
            format!(
                "the micro-batch loss must be a scalar, got shape {:?}",
                loss.shape()
            ),
        ));
    }
    Ok(())
}
