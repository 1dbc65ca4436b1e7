//! `autograd::grad`: the gradients of outputs with respect to chosen inputs, returned instead
//! of accumulated into `.grad` (PyTorch's `torch.autograd.grad`). Only the nodes that lead to
//! the inputs run, and no `.grad` is touched. With `create_graph` the returned gradients
//! carry a graph, which is how a gradient penalty is written:
//!
//! ```text
//! let [gx] = grad(&[&d_out], &[&x], GradOptions { create_graph: true, ..Default::default() })?;
//! let penalty = gx.pow_scalar(2.0)?.sum_all()?;   // differentiable w.r.t. the weights
//! ```

use super::edge_of;
use super::engine::{Capture, Pass, run};
use crate::base::{Error, Result};
use crate::tensor::Tensor;

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
