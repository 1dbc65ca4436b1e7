//! Autograd: dynamic graphs recorded as ops run, PyTorch semantics.
//!
//! - An op whose inputs require grad records a `Node` holding a backward closure and what it
//!   saved; the output tensor owns the node (`grad_fn`).
//! - `backward` walks the graph from the root in reverse creation order (`engine`), releasing
//!   each node's saved tensors right after its backward unless `retain_graph` is set.
//! - Leaves that require grad accumulate into `.grad`: assigned on the first backward, added
//!   in place after.
//! - `create_graph` records the backward itself (higher-order gradients); `grad` returns the
//!   gradients of chosen inputs instead of accumulating them.
//! - `LeakCheck` watches memory across training steps and names what keeps growing: the
//!   graphs, saved tensors and `.grad`s it owns, with the fix.

mod engine;
mod function;
mod functional;
mod grad_mode;
pub(crate) mod handoff;
mod leak_check;
mod recompute;

pub use crate::tensor::{
    AutogradMeta, BackwardFn, Edge, GradProduct, GradSink, Node, PostAccumulateHook, ProductForm,
    SavedTensor, TensorHook,
};
pub use engine::BackwardOptions;
pub(crate) use engine::{
    backward_id, saved_values_released_after_this_backward, take_pending_grad,
};
pub use function::{CustomFunction, FunctionCtx, apply_custom};
pub use functional::{GradOptions, grad};
pub use grad_mode::{GradModeGuard, enable_grad, is_grad_enabled, no_grad};
pub use leak_check::{
    GradGraphHolder, GraphHolder, GraphKind, Holder, Leak, LeakCheck, LeakCheckConfig, LeakReport,
};
pub(crate) use recompute::kept_across_recompute;
pub use recompute::{Segment, checkpoint_activations, checkpoint_activations_keeping};

use std::sync::Arc;

use crate::base::Result;
use crate::tensor::{InputMeta, Tensor, take_pending_saves};

/// Where the gradient for `t` should flow, if anywhere.
pub(crate) fn edge_of(t: &Tensor) -> Option<Edge> {
    let meta = t.meta();
    if let Some(n) = &meta.grad_fn {
        Some(Edge::Node(Arc::clone(n)))
    } else if meta.requires_grad() {
        Some(Edge::Leaf(Arc::clone(meta)))
    } else {
        None
    }
}

/// Whether an op on `inputs` should record a node now.
pub(crate) fn should_record(inputs: &[&Tensor]) -> bool {
    is_grad_enabled() && inputs.iter().any(|t| t.requires_grad())
}

/// Attaches a backward to an op's output when recording; otherwise returns `out` unchanged.
///
/// `make(out, needs)` builds the backward closure: `needs[i]` says whether input `i` needs a
/// gradient, so the op saves only what those gradients use (a frozen weight's layer does not
/// keep its input for a weight gradient nobody wants).
pub fn record<F>(
    name: &'static str,
    inputs: &[&Tensor],
    out: Tensor,
    make: impl FnOnce(&Tensor, &[bool]) -> F,
) -> Tensor
where
    F: FnMut(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + 'static,
{
    if !should_record(inputs) {
        return out;
    }
    record_node(name, inputs, out, make)
}

/// Like `record`, but records whenever grad mode is on, even if no input requires grad: for
/// ops whose backward reaches parameters the closure captured (activation recomputation).
pub fn record_always<F>(
    name: &'static str,
    inputs: &[&Tensor],
    out: Tensor,
    make: impl FnOnce(&Tensor, &[bool]) -> F,
) -> Tensor
where
    F: FnMut(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + 'static,
{
    if !is_grad_enabled() {
        return out;
    }
    record_node(name, inputs, out, make)
}

fn record_node<F>(
    name: &'static str,
    inputs: &[&Tensor],
    out: Tensor,
    make: impl FnOnce(&Tensor, &[bool]) -> F,
) -> Tensor
where
    F: FnMut(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + 'static,
{
    let edges: Vec<Option<Edge>> = inputs.iter().map(|t| edge_of(t)).collect();
    let needs: Vec<bool> = edges.iter().map(Option::is_some).collect();
    let metas = inputs
        .iter()
        .map(|t| InputMeta {
            shape: t.shape().to_vec(),
            dtype: t.dtype(),
        })
        .collect();
    let backward = make(&out, &needs);
    let saved = take_pending_saves();
    let node = Arc::new(Node::new(name, edges, metas, Box::new(backward), saved));
    crate::tensor::track(&node);
    out.with_grad_fn(node)
}
