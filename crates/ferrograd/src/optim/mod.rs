//! Optimizers. `step` updates parameters in place from their `.grad` under no_grad;
//! `zero_grad` frees gradients by default (set_to_none, as PyTorch ≥ 2.0).

mod sgd;

pub use sgd::{Sgd, SgdConfig};

use crate::error::Result;
use crate::tensor::Tensor;

pub trait Optimizer {
    fn step(&mut self) -> Result<()>;
    fn params(&self) -> &[Tensor];

    /// set_to_none = true frees the gradient bytes; false zeroes them in place.
    fn zero_grad_with(&mut self, set_to_none: bool) -> Result<()> {
        for p in self.params() {
            if set_to_none {
                p.set_grad(None)?;
            } else if let Some(g) = p.grad() {
                g.zero_()?;
            }
        }
        Ok(())
    }

    /// `zero_grad()` with PyTorch's default, set_to_none = true.
    fn zero_grad(&mut self) -> Result<()> {
        self.zero_grad_with(true)
    }
}
