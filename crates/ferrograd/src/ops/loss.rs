//! Mean squared error. Fused like PyTorch's: the forward keeps no (x - y) temporary alive and
//! saves only references to its inputs; backward recomputes 2 (x - y) / N.

use crate::autograd::{SavedTensor, no_grad, record};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

impl Tensor {
    /// mean((self - target)²), a 0-dim tensor. Both sides may require grad.
    pub fn mse_loss(&self, target: &Tensor) -> Result<Tensor> {
        if self.shape() != target.shape() {
            return Err(Error::shape(
                "mse_loss",
                format!(
                    "input {:?} and target {:?} must have the same shape",
                    self.shape(),
                    target.shape()
                ),
            ));
        }
        let loss = {
            let _g = no_grad();
            let diff = self.sub(target)?;
            diff.mul(&diff)?.mean_all()?
        };
        let n = self.numel().max(1) as f64;
        Ok(record("mse_loss", &[self, target], loss, |_, _| {
            let (x, y) = (SavedTensor::new(self), SavedTensor::new(target));
            move |g: &Tensor, needs: &[bool]| {
                // d/dx = 2 (x - y) / N · g ; d/dy = -d/dx
                let gx = x.get().sub(y.get())?.mul(&g.mul_scalar(2.0 / n)?)?;
                let gy = if needs[1] { Some(gx.neg()?) } else { None };
                Ok(vec![needs[0].then_some(gx), gy])
            }
        }))
    }
}
