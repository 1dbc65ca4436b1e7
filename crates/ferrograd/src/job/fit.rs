//! Will the run fit? A prediction of one training step's peak from the model's sizes, made
//! before anything is allocated, so an impossible batch is refused with the predicted need and
//! what to change instead of failing half-way (or aborting in a host allocation).
//!
//! The estimate, in f32 bytes, with P parameters, L blocks of width C, n_head heads, context
//! T, vocabulary V and N = batch_size · T tokens per micro-batch:
//! ```text
//!   16·P                                weights, gradients and two optimizer-state tensors
//!                                       (AdamW's moments; SGD keeps one)
//! + N·L_saved·(16C + 3·n_head·T)·4      activations saved by the blocks that save theirs
//! + N·L_recomputed·C·4                  the inputs kept by recomputed blocks
//! + N·(L_recomputed/L)·(16C + 3·n_head·T)·4
//!                                       one block's activations, rebuilt during backward
//! + N·V·4·3                             logits, their log-softmax and gradient
//! ```
//!
//! It leaves out what lowers the need (frozen parameters, step in backward, autocast's narrower
//! activations, SGD's single buffer) and the short-lived temporaries of single ops, so it is a
//! bound for refusing what cannot fit, not a figure for packing a device to the last byte; the
//! run's summary reports it next to the measured peak.

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
        .filter(|&i| job.trainer.recompute.applies_to(i))
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
