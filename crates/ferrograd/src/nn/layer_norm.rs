//! LayerNorm over the last dim: (x - mean) / √(var + eps) · weight + bias, weight 1 and
//! bias 0 at init, as PyTorch's `nn.LayerNorm(n)`. The bias is optional (GPT-2 style models
//! may leave it out).
//!
//! `forward_for_linear` is the forward for a norm whose output feeds a Linear: inside an
//! autocast region that Linear casts the norm's f32 output to the region's dtype, so the norm
//! writes that dtype itself (one kernel, the same bits; backward likewise).

use super::Module;
use crate::base::Result;
use crate::memory::Category;
use crate::ops::autocast;
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

    /// x: (..., N) → (..., N) in `dtype`: `forward(x)?.to_dtype(dtype)`, bit for bit, in one
    /// kernel where the norm runs in f32 and `dtype` is f16/bf16.
    pub fn forward_to(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        x.layer_norm_to(
            self.weight.shape(),
            Some(&self.weight),
            self.bias.as_ref(),
            self.eps,
            dtype,
        )
    }

    /// x: (..., N) → (..., N), for an output read first by a Linear (or another op of
    /// autocast's lower-precision policy): in the dtype that op would cast it to, else as
    /// `forward`. The Linear's result is unchanged, bit for bit, and forward and backward
    /// each skip a cast kernel. Outside autocast this is `forward`.
    pub fn forward_for_linear(&self, x: &Tensor) -> Result<Tensor> {
        let out = autocast::f32_policy_out(x.dtype());
        match autocast::lower_cast_target(out) {
            Some(dtype) => self.forward_to(x, dtype),
            None => self.forward(x),
        }
    }
}

impl LayerNorm {
    /// The residual step before a Linear: (x + branch, `forward_for_linear(x + branch)`),
    /// bit for bit, with the add and the norm in one kernel where the dtypes allow
    /// (`Tensor::add_layer_norm_to`). x, branch: (..., N).
    pub fn add_forward_for_linear(&self, x: &Tensor, branch: &Tensor) -> Result<(Tensor, Tensor)> {
        // The dtype of x + branch decides what forward_for_linear would write.
        let sum = crate::ops::promoted_dtype(x, branch).unwrap_or(x.dtype());
        let out = autocast::f32_policy_out(sum);
        let dtype = autocast::lower_cast_target(out).unwrap_or(out);
        x.add_layer_norm_to(
            branch,
            self.weight.shape(),
            Some(&self.weight),
            self.bias.as_ref(),
            self.eps,
            dtype,
        )
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
