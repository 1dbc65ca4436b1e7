//! CPU kernels of the attention family (backend/attention.rs): fused scaled-dot-product
//! attention, one (batch, head) pair per task (rayon), scores kept one query row at a time
//! and never stored. Forward saves only the per-row log-sum-exp; backward recomputes each
//! probability from it: p = exp(s · scale - lse). Sums run in f64 whatever the element type.
//!
//! Shapes: q, k, v, out, gout (B, H, T, D) read by strides; lse, delta (B, H, T).

use std::any::Any;

use half::{bf16, f16};
use rayon::prelude::*;

use super::CpuBackend;
use super::data::{CpuData, Elem};
use super::rows::{Inputs, dispatch, store_f64, typed_mut};
use super::write;
use crate::backend::Storage;
use crate::backend::attention::{Attention, AttentionBackward, AttentionKernels};
use crate::base::{DType, Layout};
use crate::base::{Error, Result};

impl AttentionKernels for CpuBackend {
    fn supports_attention(&self, dtype: DType, head_dim: usize) -> bool {
        dtype.is_float() && head_dim > 0
    }
    fn attention(&self, a: &Attention) -> Result<()> {
        dispatch!(a.qkv.storage.dtype(), "attention", forward(a))
    }
    fn attention_backward(&self, a: &AttentionBackward) -> Result<()> {
        dispatch!(a.qkv.storage.dtype(), "attention_backward", backward(a))
    }
}

/// The geometry shared by every (batch, head) task.
#[derive(Clone, Copy)]
struct Geometry {
    heads: usize,
    t: usize,
    d: usize,
    scale: f64,
    causal: bool,
}

impl Geometry {
    fn of(q: &Layout, scale: f64, causal: bool) -> Geometry {
        let s = q.shape();
        Geometry {
            heads: s[1],
            t: s[2],
            d: s[3],
            scale,
            causal,
        }
    }
    /// Keys query `i` may attend to: 0..keys(i).
    fn keys(&self, i: usize) -> usize {
        if self.causal { i + 1 } else { self.t }
    }
}

/// The element offset of row (b, h, t) of a (B, H, T, D) view.
fn row(l: &Layout, b: usize, h: usize, t: usize) -> usize {
    let s = l.strides();
    let off = l.offset() as isize + b as isize * s[0] + h as isize * s[1] + t as isize * s[2];
    off as usize
}

/// One (B, H, T, D) operand read as rows of D values.
struct Rows<'a, T> {
    data: &'a [T],
    layout: &'a Layout,
    b: usize,
    h: usize,
    d: usize,
}

impl<T: Elem> Rows<'_, T> {
    fn get(&self, t: usize) -> &[T] {
        let at = row(self.layout, self.b, self.h, t);
        &self.data[at..at + self.d]
    }
}

fn dot<T: Elem>(a: &[T], b: &[T]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| Elem::to_f64(*x) * Elem::to_f64(*y))
        .sum()
}

/// A whole storage as a slice of `T`.
fn typed<'d, T: Elem>(op: &'static str, d: &'d CpuData) -> Result<&'d [T]> {
    let any: &dyn Any = match d {
        CpuData::F32(v) => v,
        CpuData::F64(v) => v,
        CpuData::F16(v) => v,
        CpuData::BF16(v) => v,
        other => {
            return Err(Error::invalid(
                op,
                format!("a {} buffer is not a float operand", other.dtype()),
            ));
        }
    };
    any.downcast_ref::<Vec<T>>()
        .map(|v| v.as_slice())
        .ok_or_else(|| Error::invalid(op, "the operands must share one dtype"))
}

// ---- forward --------------------------------------------------------------------------------

/// One (b, h) pair's output rows (T, D) and log-sum-exps (T).
fn head_forward<T: Elem>(x: &[T], a: &Attention, g: Geometry, b: usize, h: usize) -> Head {
    let rows = |layout| Rows {
        data: x,
        layout,
        b,
        h,
        d: g.d,
    };
    let (q, k, v) = (rows(a.qkv.q), rows(a.qkv.k), rows(a.qkv.v));
    let mut out = vec![0.0; g.t * g.d];
    let mut lse = vec![0.0; g.t];
    let mut s = vec![0.0; g.t];
    for i in 0..g.t {
        let keys = g.keys(i);
        let qi = q.get(i);
        for (j, sj) in s[..keys].iter_mut().enumerate() {
            *sj = dot(qi, k.get(j)) * g.scale;
        }
        let m = s[..keys].iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut sum = 0.0;
        for sj in &mut s[..keys] {
            *sj = (*sj - m).exp();
            sum += *sj;
        }
        lse[i] = m + sum.ln();
        let oi = &mut out[i * g.d..(i + 1) * g.d];
        for (j, &p) in s[..keys].iter().enumerate() {
            for (o, vj) in oi.iter_mut().zip(v.get(j)) {
                *o += p / sum * Elem::to_f64(*vj);
            }
        }
    }
    Head {
        rows: vec![out],
        stats: lse,
    }
}

/// A (b, h) pair's results: one or more (T, D) row blocks and a (T) statistic.
struct Head {
    rows: Vec<Vec<f64>>,
    stats: Vec<f64>,
}

fn forward<T: Elem>(a: &Attention) -> Result<()> {
    const OP: &str = "attention";
    let g = Geometry::of(a.qkv.q, a.scale, a.causal);
    let [bs, heads, ..] = batch_heads(a.qkv.q);
    let guard = super::read(a.qkv.storage)?;
    let x = typed::<T>(OP, &guard)?;
    let results: Vec<Head> = (0..bs * heads)
        .into_par_iter()
        .map(|bh| head_forward(x, a, g, bh / heads, bh % heads))
        .collect();
    scatter::<T>(OP, a.out.storage, &[a.out.layout], &results, g)?;
    store_stats(OP, a.lse, &results)
}

// ---- backward -------------------------------------------------------------------------------

/// One (b, h) pair's gq, gk, gv rows (T, D) each and delta (T).
fn head_backward<T: Elem>(
    ins: &Inputs,
    a: &AttentionBackward,
    g: Geometry,
    bh: usize,
) -> Result<Head> {
    const OP: &str = "attention_backward";
    let (b, h) = (bh / g.heads, bh % g.heads);
    let rows = |i: usize, layout| -> Result<Rows<T>> {
        Ok(Rows {
            data: typed::<T>(OP, ins.data(i))?,
            layout,
            b,
            h,
            d: g.d,
        })
    };
    let (q, k, v) = (rows(0, a.qkv.q)?, rows(0, a.qkv.k)?, rows(0, a.qkv.v)?);
    let (out, gout) = (rows(1, a.out.layout)?, rows(2, a.gout.layout)?);
    let lse = ins.data(3);
    let lse_base = a.lse.layout.offset() + bh * g.t;
    let mut gq = vec![0.0; g.t * g.d];
    let mut gk = vec![0.0; g.t * g.d];
    let mut gv = vec![0.0; g.t * g.d];
    let mut delta = vec![0.0; g.t];
    for i in 0..g.t {
        let (qi, goi) = (q.get(i), gout.get(i));
        delta[i] = dot(goi, out.get(i));
        let lse_i = lse.get_f64(lse_base + i);
        for j in 0..g.keys(i) {
            let (kj, vj) = (k.get(j), v.get(j));
            let p = (dot(qi, kj) * g.scale - lse_i).exp();
            let ds = p * (dot(goi, vj) - delta[i]) * g.scale;
            for c in 0..g.d {
                gv[j * g.d + c] += p * Elem::to_f64(goi[c]);
                gq[i * g.d + c] += ds * Elem::to_f64(kj[c]);
                gk[j * g.d + c] += ds * Elem::to_f64(qi[c]);
            }
        }
    }
    Ok(Head {
        rows: vec![gq, gk, gv],
        stats: delta,
    })
}

fn backward<T: Elem>(a: &AttentionBackward) -> Result<()> {
    const OP: &str = "attention_backward";
    let g = Geometry::of(a.qkv.q, a.scale, a.causal);
    let [bs, heads, ..] = batch_heads(a.qkv.q);
    let [q, ..] = a.qkv.views();
    let views = [q, a.out, a.gout, a.lse];
    let ins = Inputs::read(&views)?;
    let results = (0..bs * heads)
        .into_par_iter()
        .map(|bh| head_backward::<T>(&ins, a, g, bh))
        .collect::<Result<Vec<Head>>>()?;
    let layouts = [a.grads.q, a.grads.k, a.grads.v];
    scatter::<T>(OP, a.grads.storage, &layouts, &results, g)?;
    store_stats(OP, a.delta, &results)
}

// ---- results --------------------------------------------------------------------------------

fn batch_heads(l: &Layout) -> [usize; 2] {
    [l.shape()[0], l.shape()[1]]
}

/// Writes each head's row blocks into the (B, H, T, D) layouts of one storage.
fn scatter<T: Elem>(
    op: &'static str,
    storage: &Storage,
    layouts: &[&Layout],
    results: &[Head],
    g: Geometry,
) -> Result<()> {
    write(storage, |data| {
        let len = data.len();
        let out = typed_mut::<T>(op, data, len)?;
        for (bh, head) in results.iter().enumerate() {
            let (b, h) = (bh / g.heads, bh % g.heads);
            for (layout, block) in layouts.iter().zip(&head.rows) {
                for t in 0..g.t {
                    let at = row(layout, b, h, t);
                    let src = &block[t * g.d..(t + 1) * g.d];
                    for (o, &x) in out[at..at + g.d].iter_mut().zip(src) {
                        *o = T::from_f64(x);
                    }
                }
            }
        }
        Ok(())
    })
}

/// Writes each head's statistic into the (B, H, T) buffer `s`.
fn store_stats(op: &'static str, s: &Storage, results: &[Head]) -> Result<()> {
    let values: Vec<f64> = results
        .iter()
        .flat_map(|h| h.stats.iter().copied())
        .collect();
    store_f64(op, s, &values)
}
