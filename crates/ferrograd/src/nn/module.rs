//! The `Module` trait: a forward pass, named parameters, train/eval mode and freezing.

use crate::base::Result;
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

    /// Bytes held by the parameters.
    fn parameter_bytes(&self) -> usize {
        self.parameters().iter().map(Tensor::nbytes).sum()
    }
}
