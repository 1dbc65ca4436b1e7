//! The `Module` trait: a forward pass, named parameters, train/eval mode, freezing, and the
//! recomputation policy of models that have one.

use super::recompute::Recompute;
use crate::base::{Error, Result};
use crate::tensor::Tensor;

pub trait Module: Send {
    /// x: (..., in) → (..., out) for most layers.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// Parameters with dotted names (`0.weight`), in a fixed order.
    fn named_parameters(&self) -> Vec<(String, Tensor)>;

    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters()
            .into_iter()
            .map(|(_, p)| p)
            .collect()
    }

    /// Switches training behaviour (dropout); containers forward it to children.
    fn train(&mut self, _mode: bool) {}

    fn eval(&mut self) {
        self.train(false);
    }

    /// Freezes (false) or unfreezes (true) every parameter.
    fn requires_grad_(&self, requires: bool) -> Result<()> {
        for p in self.parameters() {
            p.requires_grad_(requires)?;
        }
        Ok(())
    }

    /// Chooses which blocks recompute their activations in backward. Modules without blocks
    /// accept only `Recompute::Off`: any other policy is an error rather than a silent no-op.
    fn set_recompute_policy(&mut self, policy: Recompute) -> Result<()> {
        if policy == Recompute::Off {
            return Ok(());
        }
        Err(Error::invalid(
            "recompute",
            format!(
                "this module has no recomputation policy, so '{policy}' cannot apply; recompute a segment with checkpoint_activations instead"
            ),
        ))
    }

    /// Bytes held by the parameters.
    fn parameter_bytes(&self) -> usize {
        self.parameters().iter().map(Tensor::nbytes).sum()
    }
}
