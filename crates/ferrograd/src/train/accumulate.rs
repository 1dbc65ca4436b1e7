//! Gradient accumulation: N micro-batches, each loss scaled by 1/N before its backward, so
//! `.grad` ends up as the gradient of the mean loss over the whole batch — the same update as
//! one large batch — while only one micro-batch's activations are alive at a time.

use crate::base::{Error, Result};
use crate::tensor::Tensor;

/// Runs `loss_of(i)` for micro-batches `i = 0..n` and backpropagates `loss / n` after each;
/// gradients accumulate in `.grad`. Returns the mean loss (a host number; one sync per
/// micro-batch, as logging it would need anyway).
pub fn accumulate_gradients(
    n: usize,
    mut loss_of: impl FnMut(usize) -> Result<Tensor>,
) -> Result<f64> {
    if n == 0 {
        return Err(Error::invalid(
            "accumulate",
            "the number of micro-batches must be at least 1",
        ));
    }
    let mut total = 0.0;
    for i in 0..n {
        let loss = loss_of(i)?;
        if loss.numel() != 1 {
            return Err(Error::shape(
                "accumulate",
                format!("the loss must be a scalar, got shape {:?}", loss.shape()),
            ));
        }
        total += loss.item()?;
        // The graph of micro-batch i (and its activations) is freed by this backward.
        loss.mul_scalar(1.0 / n as f64)?.backward()?;
    }
    Ok(total / n as f64)
}
