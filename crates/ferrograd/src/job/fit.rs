//! Will the run fit? A prediction of one training step's peak from the model's sizes, made
//! before anything is allocated, so an impossible batch is refused with the predicted need and
//! what to change instead of failing half-way (or aborting in a host allocation).
//!
//! The estimate (f32 bytes, N = batch_size · block_size tokens per micro-batch):
//!   4P                 weights, gradients and AdamW's two moments
//! + N · L_saved · (16C + 3·n_head·T) · 4   saved activations of the blocks that save theirs
//! + N · L_recomputed · C · 4               the inputs kept by recomputed blocks
//! + N · V · 4 · 3                          logits, their log-softmax and gradient
//!
//! It errs high by about a fifth on the default model (predicted 60 MB, measured 50 MB): it
//! is for refusing what cannot fit, not for packing a device to the last byte.

use super::TrainJob;
use crate::base::{Error, Result};

/// The predicted peak bytes of one step of `job` with a vocabulary of `vocab` tokens.
pub fn predicted_peak_bytes(job: &TrainJob, vocab: usize) -> u64 {
    let m = &job.model;
    let (c, t, h, l) = (
        m.n_embd as u128,
        m.block_size as u128,
        m.n_head as u128,
        m.n_layer as u128,
    );
    let mut cfg = m.clone();
    cfg.vocab_size = vocab;
    let params = cfg.num_params() as u128;
    let tokens = job.batch_size as u128 * t;
    let recomputed = (0..m.n_layer)
        .filter(|&i| job.recompute.applies_to(i))
        .count() as u128;
    let per_token_layer = (16 * c + 3 * h * t) * 4;
    let blocks = tokens
        * ((l - recomputed) * per_token_layer + recomputed * (c * 4 + per_token_layer / l.max(1)));
    let head = tokens * vocab as u128 * 12;
    let total = 16 * params + blocks + head;
    u64::try_from(total).unwrap_or(u64::MAX)
}

/// Refuses a run whose predicted peak exceeds what `job.device` can give.
pub fn check_fits(job: &TrainJob, vocab: usize) -> Result<()> {
    let needed = predicted_peak_bytes(job, vocab);
    let available = crate::backend::available_memory(job.device)?;
    if needed <= available {
        return Ok(());
    }
    Err(Error::DoesNotFit {
        what: format!(
            "training with --batch-size {} --block-size {} ({} layers of width {})",
            job.batch_size, job.model.block_size, job.model.n_layer, job.model.n_embd
        ),
        device: job.device,
        needed,
        available,
        hint: "use a smaller --batch-size (with --accum N to keep the effective batch), --recompute every:1, --amp bf16, or a smaller model".into(),
    })
}
