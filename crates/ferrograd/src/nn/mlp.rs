//! The transformer's feed-forward block, as in GPT-2: Linear(C, 4C) → GELU (tanh
//! approximation) → Linear(4C, C) → dropout.

use super::state::prefixed;
use super::{Dropout, Linear, Module};
use crate::base::Result;
use crate::ops::GeluApprox;
use crate::tensor::Tensor;

#[derive(Clone)]
pub struct Mlp {
    /// C → 4C
    pub c_fc: Linear,
    /// 4C → C
    pub c_proj: Linear,
    pub dropout: Dropout,
}

impl Module for Mlp {
    /// x: (B, T, C) → (B, T, C)
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.c_fc.forward(x)?.gelu(GeluApprox::Tanh)?;
        self.dropout.forward(&self.c_proj.forward(&h)?)
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
