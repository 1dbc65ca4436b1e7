//! The attention family: fused scaled-dot-product attention, forward and backward, with the
//! scores never stored. Forward keeps only the per-row log-sum-exp of the scaled scores
//! (B, H, T); backward recomputes the scores from it (FlashAttention-2's algorithm). Here:
//! the typed arguments, their one validator, the `AttentionKernels` trait that every backend
//! implements, and the entry functions. Not here: the kernels (backend/cpu/attention.rs,
//! backend/cuda/attention.rs + kernels/attention.cu) and the op (ops/attention.rs).
//!
//! Heads are read and written by strides: q, k and v are three (B, H, T, D) layouts into ONE
//! storage (typically the QKV projection's output (B, T, 3, H, D)), and so are their
//! gradients, so neither the head split nor the merge is ever a copy.

use super::check;
use super::{Storage, View, backend};
use crate::base::{DType, Layout};
use crate::base::{Error, Result};

/// q, k and v: three (B, H, T, D) layouts, the last dim of unit stride, into one storage.
#[derive(Clone, Copy)]
pub struct Heads<'a> {
    pub storage: &'a Storage,
    pub q: &'a Layout,
    pub k: &'a Layout,
    pub v: &'a Layout,
}

impl<'a> Heads<'a> {
    pub fn views(&self) -> [View<'a>; 3] {
        [self.q, self.k, self.v].map(|layout| View {
            storage: self.storage,
            layout,
        })
    }
}

/// out (B, H, T, D) = softmax(q kᵀ · scale, future keys masked when `causal`) v, and
/// lse (B, H, T) = log Σ_keys exp(q kᵀ · scale) per query row. `out` is a strided view
/// (the op passes a (B, T, H, D)-contiguous buffer, which is the (B, T, C) the output
/// projection reads).
pub struct Attention<'a> {
    pub qkv: Heads<'a>,
    pub out: View<'a>,
    pub lse: &'a Storage,
    pub scale: f64,
    pub causal: bool,
    /// Dropout on the probabilities (before they multiply v); lse stays that of the
    /// undropped scores.
    pub dropout: Option<AttentionDropout>,
}

/// Inverted dropout on the attention probabilities, drawn as the dropout op draws a mask over
/// the (B, H, T, T) probabilities: probability (b, h, i, j), element n = ((b·H + h)·T + i)·T + j,
/// is kept where the uniform draw of element n under `key` (backend/philox.rs) is below `keep`,
/// and scaled by 1/keep. Backward replays the same mask from the key: nothing is stored.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDropout {
    pub key: u64,
    /// 1 - p, in (0, 1].
    pub keep: f64,
}

/// gq, gk, gv (three (B, H, T, D) layouts into one storage, fully overwritten) from the
/// forward's q, k, v, out, lse and the output's gradient gout (B, H, T, D, strided).
/// `delta` (B, H, T) is scratch the kernels may use for rowsum(gout · out).
pub struct AttentionBackward<'a> {
    pub qkv: Heads<'a>,
    pub out: View<'a>,
    pub gout: View<'a>,
    pub lse: View<'a>,
    pub delta: &'a Storage,
    pub grads: Heads<'a>,
    pub scale: f64,
    pub causal: bool,
    /// The forward's dropout, replayed.
    pub dropout: Option<AttentionDropout>,
}

/// The attention kernels of one device. Arguments arrive validated (entry functions below).
pub trait AttentionKernels {
    /// Whether the fused kernels cover this dtype and head dim (callers fall back to the
    /// unfused composition of matmul, softmax and matmul when they don't).
    fn supports_attention(&self, dtype: DType, head_dim: usize) -> bool;
    /// Whether the fused kernels also apply dropout to the probabilities (where they do not,
    /// attention with dropout composes matmul, softmax, dropout and matmul).
    fn supports_attention_dropout(&self) -> bool;
    fn attention(&self, a: &Attention) -> Result<()>;
    fn attention_backward(&self, a: &AttentionBackward) -> Result<()>;
}

const FORWARD: &str = "attention";
const BACKWARD: &str = "attention_backward";

pub fn attention(a: &Attention) -> Result<()> {
    let (dtype, shape) = heads(FORWARD, &a.qkv)?;
    check::on_device(FORWARD, a.lse.device(), [a.qkv.storage, a.out.storage])?;
    head_view(FORWARD, "out", &a.out, &shape, dtype)?;
    stats(FORWARD, a.lse, &shape, dtype)?;
    dropout(FORWARD, a.dropout)?;
    check::distinct(
        FORWARD,
        &[a.qkv.storage, a.out.storage, a.lse],
        "q/k/v, out and lse must be three distinct buffers",
    )?;
    backend(a.lse.device())?.attention(a)
}

pub fn attention_backward(a: &AttentionBackward) -> Result<()> {
    let (dtype, shape) = heads(BACKWARD, &a.qkv)?;
    let (gdtype, gshape) = heads(BACKWARD, &a.grads)?;
    check::same_dtype(BACKWARD, dtype, gdtype)?;
    if gshape != shape {
        return Err(Error::shape(
            BACKWARD,
            format!("the gradients are {gshape:?}, the heads {shape:?}"),
        ));
    }
    check::on_device(
        BACKWARD,
        a.delta.device(),
        [
            a.qkv.storage,
            a.out.storage,
            a.gout.storage,
            a.lse.storage,
            a.grads.storage,
        ],
    )?;
    head_view(BACKWARD, "out", &a.out, &shape, dtype)?;
    head_view(BACKWARD, "gout", &a.gout, &shape, dtype)?;
    let rows = shape[0] * shape[1] * shape[2];
    check::dense(BACKWARD, "lse", &a.lse, rows, stats_dtype(dtype))?;
    stats(BACKWARD, a.delta, &shape, dtype)?;
    dropout(BACKWARD, a.dropout)?;
    check::distinct(
        BACKWARD,
        &[
            a.qkv.storage,
            a.out.storage,
            a.gout.storage,
            a.lse.storage,
            a.delta,
            a.grads.storage,
        ],
        "q/k/v, out, gout, lse, delta and the gradients must be six distinct buffers",
    )?;
    backend(a.delta.device())?.attention_backward(a)
}

/// Checks the three head layouts and returns their dtype and (B, H, T, D) shape.
fn heads(op: &'static str, h: &Heads) -> Result<(DType, [usize; 4])> {
    let dtype = h.storage.dtype();
    check::float(op, dtype)?;
    let shape: [usize; 4] =
        h.q.shape().try_into().map_err(|_| {
            Error::shape(op, format!("q must be (B, H, T, D), got {:?}", h.q.shape()))
        })?;
    for (what, l) in [("q", h.q), ("k", h.k), ("v", h.v)] {
        head_view(
            op,
            what,
            &View {
                storage: h.storage,
                layout: l,
            },
            &shape,
            dtype,
        )?;
    }
    if shape[3] == 0 {
        return Err(Error::shape(op, "the head dim D must be at least 1"));
    }
    Ok((dtype, shape))
}

/// One (B, H, T, D) operand: the expected shape and dtype, unit stride along D, every
/// element inside its storage.
fn head_view(
    op: &'static str,
    what: &str,
    v: &View,
    shape: &[usize; 4],
    dtype: DType,
) -> Result<()> {
    if v.layout.shape() != shape {
        return Err(Error::shape(
            op,
            format!(
                "{what} is {:?}, expected (B, H, T, D) = {shape:?}",
                v.layout.shape()
            ),
        ));
    }
    if shape[3] > 1 && v.layout.strides()[3] != 1 {
        return Err(Error::invalid(
            op,
            format!("{what} must have unit stride along the head dim D"),
        ));
    }
    check::same_dtype(op, dtype, v.storage.dtype())?;
    check::within(op, v)
}

/// A dropout's keep probability must be in (0, 1] (p = 1 drops everything: no softmax to take).
fn dropout(op: &'static str, d: Option<AttentionDropout>) -> Result<()> {
    match d {
        Some(d) if !(d.keep > 0.0 && d.keep <= 1.0) => Err(Error::invalid(
            op,
            format!(
                "the dropout's keep probability 1 - p must be in (0, 1], got {}",
                d.keep
            ),
        )),
        _ => Ok(()),
    }
}

/// lse or delta: (B, H, T) of the statistics' dtype.
fn stats(op: &'static str, s: &Storage, shape: &[usize; 4], dtype: DType) -> Result<()> {
    check::out(op, s, shape[0] * shape[1] * shape[2], stats_dtype(dtype))
}

/// The dtype of lse and delta: F64 for F64 heads, else F32.
pub fn stats_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Whether `device`'s backend has fused attention for this dtype and head dim.
pub fn supported(device: crate::base::Device, dtype: DType, head_dim: usize) -> bool {
    backend(device).is_ok_and(|b| b.supports_attention(dtype, head_dim))
}

/// Whether it also applies dropout to the probabilities there.
pub fn supported_with_dropout(device: crate::base::Device, dtype: DType, head_dim: usize) -> bool {
    backend(device)
        .is_ok_and(|b| b.supports_attention(dtype, head_dim) && b.supports_attention_dropout())
}
