//! Activation recomputation (`checkpoint_activations`, PyTorch's `torch.utils.checkpoint`):
//! the forward runs without recording a graph and keeps only the inputs (and the default
//! generator's state, so dropout draws the same masks again); backward re-runs the function
//! with grad enabled and backpropagates through that fresh graph. Memory: the activations
//! inside `f` exist only during its own backward, for the price of a second forward.
//! The recomputation also runs under the forward's autocast state, so it casts as the forward
//! did (backward itself runs with autocast off).
//!
//! ("checkpoint" names saved training state in this project, hence the longer name.)
//!
//! Selective recomputation (`checkpoint_activations_keeping`, PyTorch's selective activation
//! checkpointing): the ops that ask (`kept_across_recompute`; the fused attention does) keep
//! their results from the first pass, and the recomputation takes them back instead of running
//! those ops again. A segment pays their bytes between forward and its backward, and saves
//! their time in backward.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use crate::amp::{autocast_dtype, set_autocast};
use crate::autograd::{BackwardOptions, SavedTensor, enable_grad, no_grad, record_always};
use crate::base::{Error, Result};
use crate::tensor::{Tensor, get_rng_state, set_rng_state};

/// The function a recomputed segment runs: inputs → one output.
pub type Segment = Arc<dyn Fn(&[Tensor]) -> Result<Tensor> + Send + Sync>;

/// `f(inputs)` whose inner activations are recomputed in backward instead of saved.
pub fn checkpoint_activations(f: Segment, inputs: &[Tensor]) -> Result<Tensor> {
    checkpoint(f, inputs, false)
}

/// `checkpoint_activations`, except that the ops inside `f` that keep their results across a
/// recomputation (the fused attention: its output and log-sum-exp) keep them from the forward,
/// and backward does not run those ops again.
pub fn checkpoint_activations_keeping(f: Segment, inputs: &[Tensor]) -> Result<Tensor> {
    checkpoint(f, inputs, true)
}

fn checkpoint(f: Segment, inputs: &[Tensor], keep: bool) -> Result<Tensor> {
    let rng = get_rng_state();
    let amp = autocast_dtype();
    let kept = keep.then(|| Arc::new(Kept::default()));
    let out = {
        let _g = no_grad();
        in_pass(kept.clone().map(Pass::First), || f(inputs))?
    };
    let refs: Vec<&Tensor> = inputs.iter().collect();
    // Recorded even when no input requires grad: the parameters inside `f` still need theirs.
    Ok(record_always(
        "checkpoint_activations",
        &refs,
        out,
        move |_, _| {
            let saved: Vec<SavedTensor> = inputs.iter().map(SavedTensor::new).collect();
            move |g: &Tensor, needs: &[bool]| {
                let pass = kept.clone().map(Pass::Again);
                in_pass(pass, || {
                    recompute_backward(&f, &saved, (&rng, amp), g, needs)
                })
            }
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

/// The results a segment's first pass kept, in the order the ops ran.
#[derive(Default)]
struct Kept(Mutex<VecDeque<KeptResult>>);

/// One op's kept result: its name and tag (what must match for the result to be reused).
struct KeptResult {
    op: &'static str,
    tag: Vec<u64>,
    tensors: Vec<Tensor>,
}

/// The pass of a keeping segment that runs on this thread now.
#[derive(Clone)]
enum Pass {
    First(Arc<Kept>),
    Again(Arc<Kept>),
}

thread_local! {
    static PASS: RefCell<Option<Pass>> = const { RefCell::new(None) };
}

/// Runs `f` inside `pass` (None: outside any keeping segment), then restores the pass around
/// it, so a segment inside another keeps its own results.
fn in_pass<R>(pass: Option<Pass>, f: impl FnOnce() -> R) -> R {
    let outer = PASS.with(|p| p.replace(pass));
    let out = f();
    PASS.with(|p| *p.borrow_mut() = outer);
    out
}

/// For an op whose results are dear to compute again and cheap to hold: inside the first pass
/// of a keeping segment, runs `compute` and keeps what it returns; inside that segment's
/// recomputation, returns the kept results instead when the next kept op has the same name and
/// `tag` (its inputs' shapes, its random key: else computes again); elsewhere just runs `compute`.
pub(crate) fn kept_across_recompute(
    op: &'static str,
    tag: &[u64],
    compute: impl FnOnce() -> Result<Vec<Tensor>>,
) -> Result<Vec<Tensor>> {
    match PASS.with(|p| p.borrow().clone()) {
        None => compute(),
        Some(Pass::First(kept)) => {
            let tensors = compute()?;
            let mut queue = kept.0.lock().unwrap_or_else(|e| e.into_inner());
            queue.push_back(KeptResult {
                op,
                tag: tag.to_vec(),
                tensors: tensors.iter().map(Tensor::detach).collect(),
            });
            Ok(tensors)
        }
        Some(Pass::Again(kept)) => {
            let next = kept.0.lock().unwrap_or_else(|e| e.into_inner()).pop_front();
            match next {
                Some(r) if r.op == op && r.tag == tag => Ok(r.tensors),
                _ => compute(),
            }
        }
    }
}
