//! `autograd::grad`: the gradients of outputs with respect to chosen inputs, returned instead
//! of accumulated into `.grad` (PyTorch's `torch.autograd.grad`). Only the nodes that lead to
//! the inputs run, and no `.grad` is touched. With `create_graph` the returned gradients
//! carry a graph, which is how a gradient penalty is written:
//!
//! ```text
//! let [gx] = grad(&[&d_out], &[&x], GradOptions { create_graph: true, ..Default::default() })?;
//! let penalty = gx.pow_scalar(2.0)?.sum_all()?;   // differentiable w.r.t. the weights
//! ```

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::edge_of;
use super::engine::{Pass, run};
use crate::base::{Error, Result};
use crate::tensor::{Edge, Node, Tensor};

/// Options of `grad`.
#[derive(Clone, Debug, Default)]
pub struct GradOptions {
    /// The gradient of each output; empty means ones for every output (each must then hold
    /// a single element).
    pub grad_outputs: Vec<Tensor>,
    /// Keep saved tensors so the graph can be walked again (implied by `create_graph`).
    pub retain_graph: bool,
    /// Record the gradient computation, so the results can be differentiated again.
    pub create_graph: bool,
    /// Return None for an input the outputs do not depend on, instead of an error.
    pub allow_unused: bool,
}

/// d(outputs)/d(inputs), one entry per input (None only for an unused input under
/// `allow_unused`).
pub fn grad(
    outputs: &[&Tensor],
    inputs: &[&Tensor],
    opts: GradOptions,
) -> Result<Vec<Option<Tensor>>> {
    let roots = root_gradients(outputs, &opts.grad_outputs)?;
    let edges = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            edge_of(t).ok_or_else(|| {
                Error::autograd(format!(
                    "grad: input {i} does not require grad and has no grad_fn, so nothing flows to it; call requires_grad_(true) on it before the forward"
                ))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let pass = Pass {
        retain_graph: opts.retain_graph || opts.create_graph,
        create_graph: opts.create_graph,
        capture: Some(Capture::new(&edges)),
    };
    let grads = run(roots, pass)?
        .capture
        .map(|c| c.grads)
        .unwrap_or_default();
    if !opts.allow_unused
        && let Some(i) = grads.iter().position(Option::is_none)
    {
        return Err(Error::autograd(format!(
            "grad: input {i} was not used to compute the outputs; set allow_unused if that is expected"
        )));
    }
    Ok(grads)
}

/// Each output's graph edge with its starting gradient (ones for one-element outputs).
fn root_gradients(
    outputs: &[&Tensor],
    grad_outputs: &[Tensor],
) -> Result<Vec<(crate::tensor::Edge, Tensor)>> {
    if !grad_outputs.is_empty() && grad_outputs.len() != outputs.len() {
        return Err(Error::autograd(format!(
            "grad: {} grad_outputs for {} outputs; pass one per output, or none for scalar outputs",
            grad_outputs.len(),
            outputs.len()
        )));
    }
    outputs
        .iter()
        .enumerate()
        .map(|(i, out)| {
            let edge = edge_of(out).ok_or_else(|| {
                Error::autograd(format!(
                    "grad: output {i} does not require grad and has no grad_fn: nothing to differentiate"
                ))
            })?;
            let g = match grad_outputs.get(i) {
                Some(g) if g.shape() == out.shape() => {
                    crate::tensor::check_pair("grad", out, g)?;
                    g.clone()
                }
                Some(g) => {
                    return Err(Error::shape(
                        "grad",
                        format!(
                            "grad_outputs[{i}] has shape {:?} but output {i} has {:?}",
                            g.shape(),
                            out.shape()
                        ),
                    ));
                }
                None if out.numel() == 1 => Tensor::ones(out.shape(), out.dtype(), out.device())?,
                None => {
                    return Err(Error::autograd(format!(
                        "grad: output {i} has shape {:?}; pass its gradient in grad_outputs or reduce it first (e.g. .sum())",
                        out.shape()
                    )));
                }
            };
            Ok((edge, g))
        })
        .collect()
}

/// The inputs of an `autograd::grad` call and what the pass collected for them.
pub(crate) struct Capture {
    /// Edge key → index in `grads`.
    slots: HashMap<usize, usize>,
    /// Nodes and leaves from which a captured edge can be reached: only these run.
    needed: HashSet<usize>,
    pub(crate) grads: Vec<Option<Tensor>>,
}

impl Capture {
    pub(crate) fn new(edges: &[Edge]) -> Capture {
        Capture {
            slots: edges
                .iter()
                .enumerate()
                .map(|(i, e)| (e.key(), i))
                .collect(),
            needed: HashSet::new(),
            grads: vec![None; edges.len()],
        }
    }

    pub(super) fn keep(&mut self, key: usize, grad: &Tensor) -> Result<()> {
        if let Some(&i) = self.slots.get(&key) {
            self.grads[i] = Some(match self.grads[i].take() {
                Some(prev) => prev.add(grad)?,
                None => grad.clone(),
            });
        }
        Ok(())
    }

    /// Marks every reachable node that leads to a captured edge. A node's inputs were made
    /// before it, so in creation order each node's inputs are decided before the node.
    pub(super) fn mark_needed(&mut self, nodes: &[Arc<Node>]) {
        let mut order: Vec<&Arc<Node>> = nodes.iter().collect();
        order.sort_by_key(|n| n.seq);
        self.needed = self.slots.keys().copied().collect();
        for n in order {
            let key = Arc::as_ptr(n) as usize;
            if n.edges
                .iter()
                .flatten()
                .any(|e| self.needed.contains(&e.key()))
            {
                self.needed.insert(key);
            }
        }
    }

    pub(super) fn needs(&self, e: &Edge) -> bool {
        self.needed.contains(&e.key())
    }
}
