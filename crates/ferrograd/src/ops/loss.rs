//! Mean squared error, fused like PyTorch's: the forward reduces (x - y)² in one pass without
//! a difference temporary and saves only references to its inputs; backward writes
//! 2 (x - y) · g / N in one pass (as recorded tensor ops under create_graph).

use crate::autograd::{SavedTensor, is_grad_enabled, record};
use crate::backend::loss::{self, MseLoss, MseLossBackward};
use crate::base::{Error, Result};
use crate::tensor::Tensor;

impl Tensor {
    /// mean((self - target)²), a 0-dim tensor. Both sides may require grad.
    #[track_caller]
    pub fn mse_loss(&self, target: &Tensor) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if let Some([x, y]) = super::autocast::cast_f32([self, target])? {
            return x.mse_loss(&y);
        }
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
        super::check_pair("mse_loss", self, target)?;
        super::check_float("mse_loss", self)?;
        // Copies only when strided; recorded then, so the saved inputs keep their history.
        let (x, y) = (self.contiguous()?, target.contiguous()?);
        let loss = Tensor::output(&[], self.dtype(), self.device(), "mse_loss")?;
        loss::mse_loss(&MseLoss {
            x: x.view(),
            y: y.view(),
            loss: loss.storage(),
        })?;
        Ok(record("mse_loss", &[self, target], loss, |_, _| {
            let (x, y) = (SavedTensor::new(&x), SavedTensor::new(&y));
            move |g: &Tensor, needs: &[bool]| {
                // d/dx = 2 (x - y) / N · g ; d/dy = -d/dx
                if is_grad_enabled() {
                    let scale = 2.0 / x.get().numel().max(1) as f64;
                    let gx = x.unpack().sub(&y.unpack())?.mul(g)?.mul_scalar(scale)?;
                    let gy = needs[1].then(|| gx.neg()).transpose()?;
                    return Ok(vec![needs[0].then_some(gx), gy]);
                }
                let (x, y) = (x.get(), y.get());
                let gx = Tensor::output(x.shape(), x.dtype(), x.device(), "mse_loss_backward")?;
                loss::mse_loss_backward(&MseLossBackward {
                    x: x.view(),
                    y: y.view(),
                    gloss: g.view(),
                    gx: gx.storage(),
                })?;
                let gy = if needs[1] { Some(gx.neg()?) } else { None };
                Ok(vec![needs[0].then_some(gx), gy])
            }
        }))
    }
}
