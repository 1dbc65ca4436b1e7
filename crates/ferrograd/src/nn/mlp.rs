//! The transformer's feed-forward block, as in GPT-2: Linear(C, 4C) → GELU (tanh
//! approximation) → Linear(4C, C) → dropout. With both biases, on a device whose GEMMs carry
//! the GELU in their epilogues (the GPU), the three run as one op (`Tensor::mlp_gelu`: the
//! same values and saved bytes); elsewhere as three. With `recompute_gelu` the (B, T, 4C) GELU
//! output is recomputed in backward instead of kept: on the GPU by the same fused op
//! (`Tensor::mlp_gelu_recomputed`, one elementwise pass in backward); elsewhere the GELU and
//! the second Linear run as one op that saves the GELU's input only (`Tensor::gelu_linear`).

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
        let (w_fc, w_proj) = (&self.c_fc.weight, &self.c_proj.weight);
        let out = match (&self.c_fc.bias, &self.c_proj.bias) {
            // One op whose GEMMs carry the biases and the GELU in their epilogues.
            (Some(b_fc), Some(b_proj)) if mlp_gelu_fused(x.device()) => {
                if self.recompute_gelu {
                    x.mlp_gelu_recomputed(w_fc, b_fc, w_proj, b_proj)?
                } else {
                    x.mlp_gelu(w_fc, b_fc, w_proj, b_proj)?
                }
            }
            _ if self.recompute_gelu => {
                let pre = self.c_fc.forward(x)?;
                pre.gelu_linear(GeluApprox::Tanh, w_proj, self.c_proj.bias.as_ref())?
            }
            _ => self
                .c_proj
                .forward(&self.c_fc.forward(x)?.gelu(GeluApprox::Tanh)?)?,
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
