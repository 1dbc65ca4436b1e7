//! Fused causal self-attention straight from the QKV projection's output, forward and
//! backward side by side. The heads are strided views of qkv (B, T, 3, H, D); the output is
//! written as (B, T, H, D) = (B, T, C), the layout the output projection reads; the gradient
//! is written as (B, T, 3C), the layout of the projection's output. So no head split or
//! merge is ever a copy, and the (B, H, T, T) scores and probabilities are never stored:
//! backward keeps qkv, the output and the per-row log-sum-exp (B, H, T), and recomputes the
//! probabilities from them.

use super::stats_dtype;
use crate::autograd::{SavedTensor, kept_across_recompute, record};
use crate::backend::View;
use crate::backend::attention::{self, Attention, AttentionBackward, AttentionDropout, Heads};
use crate::base::{Error, Layout, Result};
use crate::tensor::{Generator, Tensor};

const OP: &str = "causal_attention";

/// The (B, H, T, D) layouts of one attention call: where q, k and v lie in a contiguous
/// (B, T, 3C) buffer, and the (B, T, C) output read as heads.
#[derive(Clone, Copy)]
struct Geometry {
    b: usize,
    t: usize,
    h: usize,
    d: usize,
}

impl Geometry {
    /// q, k, v of a contiguous (B, T, 3C) tensor (its offset included).
    fn heads(&self, qkv: &Tensor) -> Result<[Layout; 3]> {
        let c = self.h * self.d;
        let strides = vec![
            isize_of(self.t * 3 * c)?,
            isize_of(self.d)?,
            isize_of(3 * c)?,
            1,
        ];
        let base = qkv.layout().offset();
        Ok([0, c, 2 * c].map(|at| Layout::new(self.shape(), strides.clone(), base + at)))
    }

    /// A contiguous (B, T, C) tensor read as (B, H, T, D).
    fn merged(&self, x: &Tensor) -> Result<Layout> {
        let c = self.h * self.d;
        let strides = vec![isize_of(self.t * c)?, isize_of(self.d)?, isize_of(c)?, 1];
        Ok(Layout::new(self.shape(), strides, x.layout().offset()))
    }

    fn shape(&self) -> Vec<usize> {
        vec![self.b, self.h, self.t, self.d]
    }
}

fn isize_of(n: usize) -> Result<isize> {
    isize::try_from(n).map_err(|_| Error::shape(OP, format!("{n} elements are too many to index")))
}

impl Tensor {
    /// Causal multi-head self-attention of a QKV projection's output: `self` (B, T, 3C) holds
    /// q, k and v side by side, each (B, T, C) split into `n_head` heads of C / n_head; returns
    /// softmax(q kᵀ / √D, future keys masked) v with the heads merged back: (B, T, C).
    ///
    /// One fused kernel each way: memory for backward is O(B·H·T), not O(B·H·T²). Under
    /// autocast the inputs run in the region's dtype, like matmul. Devices or head dims the
    /// kernel does not cover are an error here: check `causal_attention_supported` first and
    /// compose matmul, softmax and matmul otherwise (`nn::CausalSelfAttention` does).
    pub fn causal_attention(&self, n_head: usize) -> Result<Tensor> {
        self.fused_attention(n_head, None)
    }

    /// `causal_attention` with inverted dropout of probability `p` on the attention
    /// probabilities (before they multiply v), the mask keyed by the next draw of `rng`: the
    /// same mask as `softmax(...).dropout(p, true, rng)` on the composed path's (B, H, T, T)
    /// probabilities, made inside the kernels and replayed by backward from its key, so no
    /// mask is ever stored. `p` in [0, 1); p = 0 is `causal_attention`. Devices whose kernels
    /// have no dropout are an error here: check `causal_attention_dropout_supported`.
    pub fn causal_attention_dropout(
        &self,
        n_head: usize,
        p: f64,
        rng: &mut Generator,
    ) -> Result<Tensor> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::invalid(
                OP,
                format!("the dropout probability must be in [0, 1), got {p}"),
            ));
        }
        if p == 0.0 {
            return self.causal_attention(n_head);
        }
        let d = geometry(self.shape(), n_head)?.d;
        if !attention::supported_with_dropout(self.device(), self.dtype(), d) {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} has no fused attention with dropout for {} with head dim {d}; compose \
                     matmul, softmax, dropout and matmul instead",
                    self.device(),
                    self.dtype()
                ),
            ));
        }
        let dropout = AttentionDropout {
            key: rng.next_u64(),
            keep: 1.0 - p,
        };
        self.fused_attention(n_head, Some(dropout))
    }

    fn fused_attention(&self, n_head: usize, dropout: Option<AttentionDropout>) -> Result<Tensor> {
        if let Some([x]) = super::autocast::cast_lower([self])? {
            return x.fused_attention(n_head, dropout);
        }
        super::check_float(OP, self)?;
        let g = geometry(self.shape(), n_head)?;
        let (b, t, h, d) = (g.b, g.t, g.h, g.d);
        if !attention::supported(self.device(), self.dtype(), d) {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} has no fused attention for {} with head dim {d}; compose matmul, \
                     softmax and matmul instead",
                    self.device(),
                    self.dtype()
                ),
            ));
        }
        let qkv = self.detached_contiguous()?;
        let scale = 1.0 / (d as f64).sqrt();
        // A keeping recomputation reuses the forward's output and lse (same geometry and
        // dropout key).
        let tag = [b, t, h, d].map(|n| n as u64);
        let tag = [&tag[..], &[dropout.map_or(0, |d| d.key)]].concat();
        let kept = kept_across_recompute(OP, &tag, || {
            let out = Tensor::output_uninit(&[b, t, h * d], qkv.dtype(), qkv.device(), OP)?;
            let lse =
                Tensor::output_uninit(&[b, h, t], stats_dtype(qkv.dtype()), qkv.device(), OP)?;
            let qkv_heads = g.heads(&qkv)?;
            attention::attention(&Attention {
                qkv: heads_of(&qkv, &qkv_heads),
                out: View {
                    storage: out.storage(),
                    layout: &g.merged(&out)?,
                },
                lse: lse.storage(),
                scale,
                causal: true,
                dropout,
            })?;
            Ok(vec![out, lse])
        })?;
        let [out, lse] = <[Tensor; 2]>::try_from(kept)
            .map_err(|_| Error::autograd("causal_attention: a kept result has two tensors"))?;
        let saved_out = out.detach();
        Ok(record(OP, &[self], out, move |_, _| {
            let saved = Saved {
                qkv: SavedTensor::new(&qkv),
                out: SavedTensor::new(&saved_out),
                lse: SavedTensor::new(&lse),
                geometry: g,
                scale,
                dropout,
            };
            move |g: &Tensor, _: &[bool]| Ok(vec![Some(saved.backward(g)?)])
        }))
    }
}

/// Whether `causal_attention_dropout` runs on this device for this dtype and head dim.
pub fn causal_attention_dropout_supported(
    device: crate::base::Device,
    dtype: crate::base::DType,
    head_dim: usize,
) -> bool {
    attention::supported_with_dropout(device, dtype, head_dim)
}

/// Whether `causal_attention` runs on this device for this dtype and head dim.
pub fn causal_attention_supported(
    device: crate::base::Device,
    dtype: crate::base::DType,
    head_dim: usize,
) -> bool {
    attention::supported(device, dtype, head_dim)
}

/// The heads' geometry from qkv's shape (B, T, 3C) and the head count.
fn geometry(shape: &[usize], n_head: usize) -> Result<Geometry> {
    let &[b, t, c3] = shape else {
        return Err(Error::shape(
            OP,
            format!("qkv must be (B, T, 3C), got {shape:?}"),
        ));
    };
    if n_head == 0 || !c3.is_multiple_of(3 * n_head) || c3 == 0 {
        return Err(Error::invalid(
            OP,
            format!(
                "the last dim 3C = {c3} must be a positive multiple of 3 · n_head = 3 · {n_head}"
            ),
        ));
    }
    Ok(Geometry {
        b,
        t,
        h: n_head,
        d: c3 / (3 * n_head),
    })
}

/// The q, k and v head layouts of `t` (qkv or its gradient) over its storage.
fn heads_of<'a>(t: &'a Tensor, [q, k, v]: &'a [Layout; 3]) -> Heads<'a> {
    Heads {
        storage: t.storage(),
        q,
        k,
        v,
    }
}

/// What backward needs: qkv (B, T, 3C), the output (B, T, C) and lse (B, H, T).
struct Saved {
    qkv: SavedTensor,
    out: SavedTensor,
    lse: SavedTensor,
    geometry: Geometry,
    scale: f64,
    dropout: Option<AttentionDropout>,
}

impl Saved {
    /// gout (B, T, C) → gqkv (B, T, 3C).
    fn backward(&self, gout: &Tensor) -> Result<Tensor> {
        let (qkv, out, lse) = (self.qkv.get(), self.out.get(), self.lse.get());
        let gout = gout.detached_contiguous()?;
        let grads = Tensor::output_uninit(qkv.shape(), qkv.dtype(), qkv.device(), OP)?;
        let delta = Tensor::output_uninit(lse.shape(), lse.dtype(), lse.device(), OP)?;
        let g = &self.geometry;
        let (qkv_heads, grad_heads) = (g.heads(qkv)?, g.heads(&grads)?);
        let (out_heads, gout_heads) = (g.merged(out)?, g.merged(&gout)?);
        attention::attention_backward(&AttentionBackward {
            qkv: heads_of(qkv, &qkv_heads),
            out: View {
                storage: out.storage(),
                layout: &out_heads,
            },
            gout: View {
                storage: gout.storage(),
                layout: &gout_heads,
            },
            lse: lse.view(),
            delta: delta.storage(),
            grads: heads_of(&grads, &grad_heads),
            scale: self.scale,
            causal: true,
            dropout: self.dropout,
        })?;
        Ok(grads)
    }
}
