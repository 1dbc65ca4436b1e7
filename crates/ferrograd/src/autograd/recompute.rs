//! Activation recomputation (`checkpoint_activations`, PyTorch's `torch.utils.checkpoint`):
//! the forward runs without recording a graph and keeps only the inputs (and the default
//! generator's state, so dropout draws the same masks again); backward re-runs the function
//! with grad enabled and backpropagates through that fresh graph. Memory: the activations
//! inside `f` exist only during its own backward, for the price of a second forward.
//! The recomputation also runs under the forward's autocast state, so it casts as the forward
//! did (backward itself runs with autocast off).
//!
//! ("checkpoint" names saved training state in this project, hence the longer name.)

use std::sync::Arc;

use crate::amp::{autocast_dtype, set_autocast};
use crate::autograd::{BackwardOptions, SavedTensor, enable_grad, no_grad, record_always};
use crate::base::{Error, Result};
use crate::tensor::{Tensor, get_rng_state, set_rng_state};

/// The function a recomputed segment runs: inputs → one output.
pub type Segment = Arc<dyn Fn(&[Tensor]) -> Result<Tensor> + Send + Sync>;

/// `f(inputs)` whose inner activations are recomputed in backward instead of saved.
pub fn checkpoint_activations(f: Segment, inputs: &[Tensor]) -> Result<Tensor> {
    let rng = get_rng_state();
    let amp = autocast_dtype();
    let out = {
        let _g = no_grad();
        f(inputs)?
    };
    let refs: Vec<&Tensor> = inputs.iter().collect();
    // Recorded even when no input requires grad: the parameters inside `f` still need theirs.
    Ok(record_always(
        "checkpoint_activations",
        &refs,
        out,
        move |_, _| {
            let saved: Vec<SavedTensor> = inputs.iter().map(SavedTensor::new).collect();
            move |g: &Tensor, needs: &[bool]| recompute_backward(&f, &saved, (&rng, amp), g, needs)
        },
    ))
}

/// Re-runs `f` from the saved inputs under the forward's RNG state, then backpropagates `g`
/// through it: parameter gradients accumulate as usual; input gradients are returned.
fn recompute_backward(
    f: &Segment,
    saved: &[SavedTensor],
    (rng, amp): (&crate::tensor::Generator, Option<crate::tensor::DType>),
    g: &Tensor,
    needs: &[bool],
) -> Result<Vec<Option<Tensor>>> {
    let _g = enable_grad();
    let leaves: Vec<Tensor> = saved
        .iter()
        .zip(needs)
        .map(|(s, &need)| {
            let t = s.get().detach();
            if need { t.requires_grad_(true) } else { Ok(t) }
        })
        .collect::<Result<_>>()?;
    let outer_rng = get_rng_state();
    set_rng_state(rng.clone());
    let out = {
        let _amp = set_autocast(amp)?;
        f(&leaves)
    };
    set_rng_state(outer_rng);
    let out = out?;
    if out.shape() != g.shape() {
        return Err(Error::autograd(format!(
            "checkpoint_activations: the recomputed output has shape {:?} but the forward gave {:?}; the function must be deterministic",
            out.shape(),
            g.shape()
        )));
    }
    if out.requires_grad() {
        out.backward_with(BackwardOptions {
            gradient: Some(g.clone()),
            ..Default::default()
        })?;
    }
    Ok(leaves
        .iter()
        .zip(needs)
        .map(|(l, &need)| if need { l.grad() } else { None })
        .collect())
}
