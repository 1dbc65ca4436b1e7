//! Multi-head causal self-attention, as in GPT-2: one projection to q, k, v (c_attn), scaled
//! dot-product attention per head with future positions masked out, and an output projection
//! (c_proj). Two paths with the same results: the fused kernel (`Tensor::causal_attention`,
//! which never stores the (B, nh, T, T) probabilities) wherever the device has it — with
//! dropout on the probabilities where its kernels apply it (the GPU's: the same mask as the
//! composed path draws) — else the composition of matmul, masked fill, softmax, dropout and
//! matmul, which runs on every device. In both, the heads are views of the c_attn output,
//! never copies.

use super::state::prefixed;
use super::{Dropout, Linear, Module};
use crate::base::{Error, Result};
use crate::ops::{causal_attention_dropout_supported, causal_attention_supported};
use crate::tensor::{Device, Tensor};

#[derive(Clone)]
pub struct CausalSelfAttention {
    /// C → 3C: q, k, v side by side.
    pub c_attn: Linear,
    /// C → C
    pub c_proj: Linear,
    pub n_head: usize,
    /// On the attention weights (B, nh, T, T).
    pub attn_dropout: Dropout,
    /// On the output (B, T, C).
    pub resid_dropout: Dropout,
    /// Use the fused kernel where it runs (on by default; off forces the composed path).
    pub fused: bool,
}

/// (T, T) U8, 1 strictly above the diagonal: the positions a query may not look at.
pub fn causal_mask(t: usize, device: Device) -> Result<Tensor> {
    let mask: Vec<u8> = (0..t * t).map(|i| u8::from(i % t > i / t)).collect();
    Tensor::from_vec(mask, &[t, t], device)
}

impl CausalSelfAttention {
    /// Whether a forward on `device` in `dtype` runs the fused kernel (else the composed path).
    pub fn runs_fused(&self, device: Device, dtype: crate::base::DType) -> bool {
        let c = self.c_attn.weight.shape().first().copied().unwrap_or(0) / 3;
        if !self.fused || self.n_head == 0 || !c.is_multiple_of(self.n_head) {
            return false;
        }
        let d = c / self.n_head;
        if self.attn_dropout.acts() {
            self.attn_dropout.p < 1.0 && causal_attention_dropout_supported(device, dtype, d)
        } else {
            causal_attention_supported(device, dtype, d)
        }
    }

    /// x: (B, T, C) → (B, T, C), with `mask` (T', T') for some T' ≥ T: the causal mask (1
    /// strictly above the diagonal, from `causal_mask`). Only its top-left (T, T) corner is
    /// read, and only by the composed path: the fused kernel applies causality itself.
    pub fn forward_masked(&self, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let &[b, t, c] = x.shape() else {
            return Err(Error::shape(
                "CausalSelfAttention",
                format!("the input must be (B, T, C), got {:?}", x.shape()),
            ));
        };
        let nh = self.n_head;
        if nh == 0 || !c.is_multiple_of(nh) {
            return Err(Error::invalid(
                "CausalSelfAttention",
                format!("the width C = {c} must be a positive multiple of n_head = {nh}"),
            ));
        }
        let hs = c / nh;
        let qkv = self.c_attn.forward(x)?;
        if self.runs_fused(qkv.device(), qkv.dtype()) {
            let y = if self.attn_dropout.acts() {
                let p = self.attn_dropout.p;
                self.attn_dropout
                    .with_generator(|rng| qkv.causal_attention_dropout(nh, p, rng))?
            } else {
                qkv.causal_attention(nh)?
            };
            return self.resid_dropout.forward(&self.c_proj.forward(&y)?);
        }
        // (B, T, 3C) → (B, T, 3, nh, hs) → (3, B, nh, T, hs): views.
        let qkv = qkv.reshape(&[b, t, 3, nh, hs])?.permute(&[2, 0, 3, 1, 4])?;
        let head = |i: usize| qkv.narrow(0, i, 1)?.squeeze(0);
        let (q, k, v) = (head(0)?, head(1)?, head(2)?);
        // (B, nh, T, hs) @ (B, nh, hs, T) → (B, nh, T, T)
        let att = q
            .matmul(&k.transpose(-2, -1)?)?
            .mul_scalar(1.0 / (hs as f64).sqrt())?;
        let att = att.masked_fill(&mask_corner(mask, t)?, f64::NEG_INFINITY)?;
        let att = self.attn_dropout.forward(&att.softmax(-1)?)?;
        // (B, nh, T, hs) → (B, T, nh, hs) → (B, T, C)
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape(&[b, t, c])?;
        self.resid_dropout.forward(&self.c_proj.forward(&y)?)
    }
}

/// The (T, T) top-left corner of a square mask (a view).
fn mask_corner(mask: &Tensor, t: usize) -> Result<Tensor> {
    match mask.shape() {
        &[r, c] if r >= t && c >= t => mask.narrow(0, 0, t)?.narrow(1, 0, t),
        s => Err(Error::shape(
            "CausalSelfAttention",
            format!("the causal mask {s:?} must be at least ({t}, {t}) for a sequence of {t}"),
        )),
    }
}

impl Module for CausalSelfAttention {
    /// x: (B, T, C) → (B, T, C); builds the (T, T) mask on each call.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let t = x.shape().get(1).copied().unwrap_or(0);
        self.forward_masked(x, &causal_mask(t, x.device())?)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = prefixed("c_attn", &self.c_attn);
        v.extend(prefixed("c_proj", &self.c_proj));
        v
    }

    fn train(&mut self, mode: bool) {
        self.attn_dropout.train(mode);
        self.resid_dropout.train(mode);
    }
}
