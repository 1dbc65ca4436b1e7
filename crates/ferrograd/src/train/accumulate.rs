//! Gradient accumulation: N micro-batches, each loss scaled by 1/N before its backward, so
//! `.grad` ends up as the gradient of the mean loss over the whole batch — the same update as
//! one large batch — while only one micro-batch's activations are alive at a time.
//!
//! `accumulate` is the strategy the `Trainer` runs (with autocast around each forward and a
//! `GradScaler` on each scaled loss); `accumulate_gradients` is its plain form.

use super::GradScaler;
use crate::amp::try_autocast;
use crate::autograd::no_grad;
use crate::base::{Error, Result};
use crate::memory::recorder::{self, Phase};
use crate::tensor::{DType, Readout, Tensor};

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
#[derive(Clone, Debug)]
pub struct Accumulated {
    /// The mean of the micro-batch losses (unscaled), still on the loss's device: reading it
    /// waits for the step, so only logs read it.
    pub mean_loss: Readout,
    pub tokens: usize,
}

/// Runs `forward(i)` for micro-batches `i = 0..N` (under autocast when asked) and
/// backpropagates (loss / N)·scale after each; gradients accumulate in `.grad`. The losses
/// are summed on their device: nothing here waits for it.
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
    let (mut total, mut tokens): (Option<Tensor>, usize) = (None, 0);
    for i in 0..n {
        let micro = {
            let _phase = recorder::phase_scope(Phase::Forward);
            // The autocast region ends with the forward: backward runs in the forward's dtypes.
            let _amp = how.amp.map(try_autocast).transpose()?;
            forward(i)?
        };
        check_scalar(&micro.loss)?;
        total = Some(add_detached(total, &micro.loss)?);
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
    let mean = match total {
        Some(t) if n > 1 => {
            let _g = no_grad();
            t.mul_scalar(1.0 / n as f64)?
        }
        Some(t) => t,
        None => return Err(Error::autograd("accumulate ran no micro-batch")),
    };
    Ok(Accumulated {
        mean_loss: Readout::pending(mean),
        tokens,
    })
}

/// `total + loss`, outside the graph (the first loss is kept as it is, detached).
fn add_detached(total: Option<Tensor>, loss: &Tensor) -> Result<Tensor> {
    let _g = no_grad();
    let loss = loss.detach();
    match total {
        Some(t) => t.add(&loss),
        None => Ok(loss),
    }
}

/// `accumulate` without autocast or scaler: `loss_of(i)` returns micro-batch i's loss.
/// Returns the mean loss (read back from its device).
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
    done.mean_loss.value()
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
