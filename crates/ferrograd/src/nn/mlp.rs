//! The transformer's feed-forward block, as in GPT-2: Linear(C, 4C) → GELU (tanh
//! approximation) → Linear(4C, C) → dropout. With both biases, on a device whose GEMMs carry
//! the GELU in their epilogues (the GPU), the three run as one op (`Tensor::mlp_gelu`: the
//! same values and saved bytes); elsewhere as three. With `recompute_gelu` the GELU and the
//! second Linear run as one op that saves the GELU's input only (`Tensor::gelu_linear`): the
//! same values, and the (B, T, 4C) GELU output is recomputed in backward instead of kept.

use super::state::prefixed;
use super::{Dropout, Linear, Module};
use crate::base::Result;
use crate::ops::{GeluApprox, mlp_gelu_fused};
use crate::tensor::Tensor;

#[derive(Clone)]
pub struct Mlp {
    /// C → 4C
    pub c_fc: Linear,
    /// 4C → C
    pub c_proj: Linear,
    pub dropout: Dropout,
    /// Recompute the GELU's output in backward instead of saving it.
    pub recompute_gelu: bool,
}

impl Module for Mlp {
    /// x: (B, T, C) → (B, T, C)
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let out = if self.recompute_gelu {
            let pre = self.c_fc.forward(x)?;
            let (w, b) = (&self.c_proj.weight, self.c_proj.bias.as_ref());
            pre.gelu_linear(GeluApprox::Tanh, w, b)?
        } else {
            match (&self.c_fc.bias, &self.c_proj.bias) {
                // One op whose GEMMs carry the biases and the GELU in their epilogues.
                (Some(b_fc), Some(b_proj)) if mlp_gelu_fused(x.device()) => {
                    x.mlp_gelu(&self.c_fc.weight, b_fc, &self.c_proj.weight, b_proj)?
                }
                _ => self
                    .c_proj
                    .forward(&self.c_fc.forward(x)?.gelu(GeluApprox::Tanh)?)?,
            }
        };
        self.dropout.forward(&out)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = prefixed("c_fc", &self.c_fc);
        v.extend(prefixed("c_proj", &self.c_proj));
        v
    }

    fn train(&mut self, mode: bool) {
        self.dropout.train(mode);
    }
}
