//! CPU kernels of the attention family (backend/attention.rs): each (batch, head) pair is one
//! rayon task that copies its q, k, v into contiguous per-head buffers and runs the tiled
//! online-softmax kernels of `flash.rs` on them. Forward keeps only each query's log-sum-exp;
//! backward recomputes the probabilities from it. f16 and bf16 heads compute in f32, f64
//! heads in f64.
//!
//! Shapes: q, k, v, out, gout and the gradients (B, H, T, D) read and written by strides;
//! lse (B, H, T) dense. The `delta` scratch of the backward is not used here: each task
//! computes its rows' rowsum(gout · out) on the fly.

use half::{bf16, f16};
use rayon::prelude::*;

use super::CpuBackend;
use super::data::{CpuData, Elem};
use super::flash::{self, Head, HeadDims, HeadGrads, Saved};
use super::rows::{Inputs, store_f64, typed_mut};
use super::write;
use crate::backend::Storage;
use crate::backend::attention::{Attention, AttentionBackward, AttentionKernels};
use crate::base::{DType, Layout};
use crate::base::{Error, Result};

impl AttentionKernels for CpuBackend {
    fn supports_attention(&self, dtype: DType, head_dim: usize) -> bool {
        dtype.is_float() && head_dim > 0
    }
    fn supports_attention_dropout(&self) -> bool {
        false
    }
    fn attention(&self, a: &Attention) -> Result<()> {
        no_dropout("attention", a.dropout.is_some())?;
        by_dtype!(a.qkv.storage.dtype(), "attention", forward(a))
    }
    fn attention_backward(&self, a: &AttentionBackward) -> Result<()> {
        no_dropout("attention_backward", a.dropout.is_some())?;
        by_dtype!(a.qkv.storage.dtype(), "attention_backward", backward(a))
    }
}

/// The CPU kernels have no dropout on the probabilities (the model composes the attention
/// when dropout acts there).
fn no_dropout(op: &'static str, dropout: bool) -> Result<()> {
    if dropout {
        return Err(Error::invalid(
            op,
            "the CPU's fused attention has no dropout on the probabilities; compose matmul, \
             softmax, dropout and matmul instead",
        ));
    }
    Ok(())
}

/// Calls `f::<T, A>` with the storage type T and the computing type A (f64 for f64, else f32).
macro_rules! by_dtype {
    ($dtype:expr, $op:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F32 => $f::<f32, f32>($($arg),*),
            DType::F64 => $f::<f64, f64>($($arg),*),
            DType::F16 => $f::<f16, f32>($($arg),*),
            DType::BF16 => $f::<bf16, f32>($($arg),*),
            dtype => Err(Error::UnsupportedDType {
                op: $op,
                dtype,
                hint: "attention needs a floating-point tensor; convert with .to_dtype(DType::F32)",
            }),
        }
    };
}
use by_dtype;

/// The per-head problem and where each (b, h) pair's rows lie.
#[derive(Clone, Copy)]
struct Geometry {
    heads: usize,
    dims: HeadDims,
}

impl Geometry {
    fn of(q: &Layout, scale: f64, causal: bool) -> Geometry {
        let s = q.shape();
        Geometry {
            heads: s[1],
            dims: HeadDims {
                t: s[2],
                d: s[3],
                scale,
                causal,
            },
        }
    }
    fn pairs(&self, q: &Layout) -> usize {
        q.shape()[0] * self.heads
    }
    /// The element offset of row t of pair bh in a (B, H, T, D) layout.
    fn row(&self, l: &Layout, bh: usize, t: usize) -> usize {
        let (b, h) = (bh / self.heads, bh % self.heads);
        let s = l.strides();
        let off = l.offset() as isize + b as isize * s[0] + h as isize * s[1] + t as isize * s[2];
        off as usize
    }
}

/// A whole storage as a slice of `T`.
fn typed<'d, T: Elem>(op: &'static str, d: &'d CpuData) -> Result<&'d [T]> {
    let any: &dyn std::any::Any = match d {
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

/// One (T, D) operand of pair bh, copied out contiguous in the computing type.
fn gather<T: Elem, A: Elem>(x: &[T], l: &Layout, g: Geometry, bh: usize) -> Vec<A> {
    let (t, d) = (g.dims.t, g.dims.d);
    let mut out = Vec::with_capacity(t * d);
    for i in 0..t {
        let at = g.row(l, bh, i);
        out.extend(x[at..at + d].iter().map(|&v| A::from_f64(Elem::to_f64(v))));
    }
    out
}

/// Pair bh's q, k, v as `flash::Head`.
fn load_head<T: Elem, A: Elem>(x: &[T], qkv: [&Layout; 3], g: Geometry, bh: usize) -> Head<A> {
    let [q, k, v] = qkv.map(|l| gather::<T, A>(x, l, g, bh));
    Head::new(g.dims, q, k, v)
}

// ---- forward --------------------------------------------------------------------------------

/// Each pair's output (T, D) and log-sum-exp (T).
type Forward<A> = (Vec<A>, Vec<A>);

fn forward<T: Elem, A: Elem>(a: &Attention) -> Result<()> {
    const OP: &str = "attention";
    let g = Geometry::of(a.qkv.q, a.scale, a.causal);
    let layouts = [a.qkv.q, a.qkv.k, a.qkv.v];
    let guard = super::read(a.qkv.storage)?;
    let x = typed::<T>(OP, &guard)?;
    let (t, d) = (g.dims.t, g.dims.d);
    let results: Vec<Forward<A>> = (0..g.pairs(a.qkv.q))
        .into_par_iter()
        .map(|bh| {
            let head = load_head::<T, A>(x, layouts, g, bh);
            let (mut o, mut lse) = (vec![A::zero(); t * d], vec![A::zero(); t]);
            flash::forward(&head, g.dims, &mut o, &mut lse);
            (o, lse)
        })
        .collect();
    drop(guard);
    let blocks: Vec<[&[A]; 1]> = results.iter().map(|(o, _)| [o.as_slice()]).collect();
    scatter::<T, A, _>(OP, a.out.storage, &[a.out.layout], &blocks, g)?;
    let lse: Vec<f64> = results
        .iter()
        .flat_map(|(_, l)| l.iter().map(|&v| Elem::to_f64(v)))
        .collect();
    store_f64(OP, a.lse, &lse)
}

// ---- backward -------------------------------------------------------------------------------

/// Each pair's dq, dk, dv (T, D).
type Backward<A> = [Vec<A>; 3];

fn backward<T: Elem, A: Elem>(a: &AttentionBackward) -> Result<()> {
    const OP: &str = "attention_backward";
    let g = Geometry::of(a.qkv.q, a.scale, a.causal);
    let [q, ..] = a.qkv.views();
    let views = [q, a.out, a.gout, a.lse];
    let ins = Inputs::read(&views)?;
    let (x, out, gout) = (
        typed::<T>(OP, ins.data(0))?,
        typed::<T>(OP, ins.data(1))?,
        typed::<T>(OP, ins.data(2))?,
    );
    let lse = ins.data(3);
    let layouts = [a.qkv.q, a.qkv.k, a.qkv.v];
    let (t, d) = (g.dims.t, g.dims.d);
    let results: Vec<Backward<A>> = (0..g.pairs(a.qkv.q))
        .into_par_iter()
        .map(|bh| {
            let head = load_head::<T, A>(x, layouts, g, bh);
            let base = a.lse.layout.offset() + bh * t;
            let saved = Saved {
                o: gather::<T, A>(out, a.out.layout, g, bh),
                go: gather::<T, A>(gout, a.gout.layout, g, bh),
                lse: (0..t).map(|i| A::from_f64(lse.get_f64(base + i))).collect(),
            };
            let [mut dq, mut dk, mut dv] = [0, 1, 2].map(|_| vec![A::zero(); t * d]);
            let grads = HeadGrads {
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
            };
            flash::backward(&head, g.dims, saved, grads);
            [dq, dk, dv]
        })
        .collect();
    drop(ins);
    let blocks: Vec<[&[A]; 3]> = results
        .iter()
        .map(|[q, k, v]| [q.as_slice(), k.as_slice(), v.as_slice()])
        .collect();
    let layouts = [a.grads.q, a.grads.k, a.grads.v];
    scatter::<T, A, _>(OP, a.grads.storage, &layouts, &blocks, g)
}

// ---- results --------------------------------------------------------------------------------

/// Writes each pair's (T, D) blocks into the (B, H, T, D) layouts of one storage: one batch
/// per task where the batches' rows lie in disjoint ranges of the storage (always, for the
/// outputs and gradients the attention op makes), else on this thread.
fn scatter<T: Elem, A: Elem, const N: usize>(
    op: &'static str,
    storage: &Storage,
    layouts: &[&Layout; N],
    blocks: &[[&[A]; N]],
    g: Geometry,
) -> Result<()> {
    write(storage, |data| {
        let len = data.len();
        let out = typed_mut::<T>(op, data, len)?;
        let heads = g.heads;
        let batch = |b: usize, chunk: &mut [T], base: usize| {
            let pairs = blocks.iter().enumerate().skip(b * heads).take(heads);
            for (bh, pair) in pairs {
                write_pair(chunk, base, layouts, pair, g, bh);
            }
        };
        match batch_span(layouts, g) {
            Some(span) => out
                .par_chunks_mut(span)
                .take(blocks.len() / heads)
                .enumerate()
                .for_each(|(b, chunk)| batch(b, chunk, b * span)),
            None => (0..blocks.len() / heads).for_each(|b| batch(b, out, 0)),
        }
        Ok(())
    })
}

/// Pair bh's blocks into `out`, which starts at element `base` of the storage.
fn write_pair<T: Elem, A: Elem, const N: usize>(
    out: &mut [T],
    base: usize,
    layouts: &[&Layout; N],
    pair: &[&[A]; N],
    g: Geometry,
    bh: usize,
) {
    let d = g.dims.d;
    for (layout, block) in layouts.iter().zip(pair) {
        for (t, src) in block.chunks_exact(d).enumerate() {
            let at = g.row(layout, bh, t) - base;
            for (o, &v) in out[at..at + d].iter_mut().zip(src) {
                *o = T::from_f64(Elem::to_f64(v));
            }
        }
    }
}

/// The batch stride S when every layout keeps batch b's rows inside [b·S, (b+1)·S).
fn batch_span<const N: usize>(layouts: &[&Layout; N], g: Geometry) -> Option<usize> {
    let span = usize::try_from(layouts[0].strides()[0]).ok()?;
    let (t, d) = (g.dims.t, g.dims.d);
    let fits = |l: &&Layout| {
        let s = l.strides();
        let (sh, st) = (usize::try_from(s[1]).ok(), usize::try_from(s[2]).ok());
        let end = match (sh, st) {
            (Some(sh), Some(st)) if t > 0 && g.heads > 0 => {
                l.offset() + (g.heads - 1) * sh + (t - 1) * st + d
            }
            _ => return false,
        };
        usize::try_from(s[0]) == Ok(span) && end <= span
    };
    (span > 0 && layouts.iter().all(fits)).then_some(span)
}
