//! LayerNorm over the last dim: (x - mean) / √(var + eps) · weight + bias, weight 1 and
//! bias 0 at init, as PyTorch's `nn.LayerNorm(n)`. The bias is optional (GPT-2 style models
//! may leave it out).

use super::Module;
use crate::base::Result;
use crate::memory::Category;
use crate::tensor::{DType, Device, Tensor};

#[derive(Clone)]
pub struct LayerNorm {
    /// (N)
    pub weight: Tensor,
    /// (N), when the layer has a bias.
    pub bias: Option<Tensor>,
    pub eps: f64,
}

impl LayerNorm {
    /// Normalises a last dim of size `n` with eps 1e-5.
    pub fn new(n: usize, bias: bool, device: Device) -> Result<LayerNorm> {
        LayerNorm::new_with_dtype(n, bias, DType::F32, device)
    }

    pub fn new_with_dtype(n: usize, bias: bool, dtype: DType, device: Device) -> Result<LayerNorm> {
        let param = |t: Tensor| -> Result<Tensor> {
            t.set_category(Category::Parameter);
            t.requires_grad_(true)
        };
        let weight = param(Tensor::ones(&[n], dtype, device)?)?;
        let bias = if bias {
            Some(param(Tensor::zeros(&[n], dtype, device)?)?)
        } else {
            None
        };
        Ok(LayerNorm {
            weight,
            bias,
            eps: 1e-5,
        })
    }
}

impl Module for LayerNorm {
    /// x: (..., N) → (..., N)
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(
            self.weight.shape(),
            Some(&self.weight),
            self.bias.as_ref(),
            self.eps,
        )
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![("weight".to_string(), self.weight.clone())];
        if let Some(b) = &self.bias {
            v.push(("bias".to_string(), b.clone()));
        }
        v
    }
}
