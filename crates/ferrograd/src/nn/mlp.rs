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
use crate::ops::{GeluApprox, OutputValue, mlp_gelu_fused};
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

impl Mlp {
    /// x: (B, T, C) → (B, T, C); with `OutputValue::Skipped` only the graph of the second
    /// Linear is recorded, its product not computed (for a recomputation that backpropagates
    /// through the block without reading its output). The CPU's GELU-recompute op computes
    /// its value either way.
    pub(crate) fn forward_value(&self, x: &Tensor, value: OutputValue) -> Result<Tensor> {
        let (w_fc, w_proj) = (&self.c_fc.weight, &self.c_proj.weight);
        let b_proj = self.c_proj.bias.as_ref();
        let out = match (&self.c_fc.bias, b_proj) {
            // One op whose GEMMs carry the biases and the GELU in their epilogues.
            (Some(b_fc), Some(b_proj)) if mlp_gelu_fused(x.device()) => {
                x.mlp_gelu_value([w_fc, b_fc, w_proj, b_proj], self.recompute_gelu, value)?
            }
            _ if self.recompute_gelu => {
                let pre = self.c_fc.forward(x)?;
                pre.gelu_linear(GeluApprox::Tanh, w_proj, b_proj)?
            }
            _ => {
                let h = self.c_fc.forward(x)?.gelu(GeluApprox::Tanh)?;
                h.linear_value(w_proj, b_proj, value)?
            }
        };
        self.dropout.forward(&out)
    }
}

impl Module for Mlp {
    /// x: (B, T, C) → (B, T, C)
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_value(x, OutputValue::Computed)
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
