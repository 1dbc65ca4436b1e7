//! Optimizer updates as single fused passes over contiguous buffers: one read of the
//! gradient, one read-modify-write of the parameter and of each state buffer. SGD computes in
//! the element type; Adam in its compute type (f32 for f32/f16/bf16, f64 for f64), rounding
//! once per store, as the CUDA kernel (kernels/optim.cu) does term by term.

use half::{bf16, f16};
use num_traits::Float;
use rayon::prelude::*;

use super::data::{CpuData, Elem, per_float_variant};
use super::{read, write};
use crate::backend::ops::AdamScalars;
use crate::backend::{FusedOp, Storage, View};
use crate::base::{Error, Result};

const CHUNK: usize = 1 << 14;

pub(crate) fn run(op: &FusedOp, inputs: &[View], outputs: &[&Storage]) -> Result<()> {
    match op {
        FusedOp::SgdStep { .. } => sgd(op, inputs, outputs),
        FusedOp::AdamStep { .. } => adam(op, inputs, outputs),
        _ => Err(Error::invalid(
            "fused_optim",
            format!("{op:?} is not an optimizer op"),
        )),
    }
}

fn sgd(op: &FusedOp, inputs: &[View], outputs: &[&Storage]) -> Result<()> {
    let FusedOp::SgdStep {
        lr,
        momentum,
        dampening,
        weight_decay,
        nesterov,
        first_step,
    } = *op
    else {
        return Err(Error::invalid("sgd", "not an SGD op"));
    };
    let h = Sgd {
        lr,
        momentum,
        dampening,
        weight_decay,
        nesterov,
        first_step,
    };
    let (grad, param) = match (inputs, outputs) {
        ([g], [p, ..]) if g.layout.is_contiguous() => (g, *p),
        _ => {
            return Err(Error::invalid(
                "sgd",
                "expects one contiguous gradient and the parameter",
            ));
        }
    };
    let g = read(grad.storage)?;
    let off = grad.layout.offset();
    write(param, |p| match outputs.get(1) {
        Some(buf) => write(buf, |b| h.dispatch(&g, off, p, Some(b))),
        None => h.dispatch(&g, off, p, None),
    })
}

#[derive(Clone, Copy)]
struct Sgd {
    lr: f64,
    momentum: f64,
    dampening: f64,
    weight_decay: f64,
    nesterov: bool,
    first_step: bool,
}

impl Sgd {
    fn dispatch(
        &self,
        g: &CpuData,
        off: usize,
        p: &mut CpuData,
        buf: Option<&mut CpuData>,
    ) -> Result<()> {
        macro_rules! go {
            ($v:ident) => {
                match (g, p, buf) {
                    (CpuData::$v(g), CpuData::$v(p), None) => {
                        Ok(self.apply(&g[off..off + p.len()], p, None))
                    }
                    (CpuData::$v(g), CpuData::$v(p), Some(CpuData::$v(b))) => {
                        Ok(self.apply(&g[off..off + p.len()], p, Some(b)))
                    }
                    _ => Err(Error::invalid(
                        "sgd",
                        "parameter, gradient and momentum buffer must share a dtype",
                    )),
                }
            };
        }
        per_float_variant!(g, "sgd", "parameters must be floating point", go)
    }

    fn apply<T: Elem>(&self, g: &[T], p: &mut [T], buf: Option<&mut Vec<T>>) {
        let (lr, wd, mu) = (
            T::from_f64(self.lr),
            T::from_f64(self.weight_decay),
            T::from_f64(self.momentum),
        );
        let damp = T::from_f64(1.0 - self.dampening);
        let (first, nesterov) = (self.first_step, self.nesterov);
        match buf {
            None => p
                .par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .for_each(|(p, g)| {
                    for (p, &g) in p.iter_mut().zip(g) {
                        *p = *p - lr * (g + wd * *p);
                    }
                }),
            Some(b) => p
                .par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .zip(b.par_chunks_mut(CHUNK))
                .for_each(|((p, g), b)| {
                    for ((p, &g), b) in p.iter_mut().zip(g).zip(b.iter_mut()) {
                        let d = g + wd * *p;
                        *b = if first { d } else { mu * *b + damp * d };
                        let step = if nesterov { d + mu * *b } else { *b };
                        *p = *p - lr * step;
                    }
                }),
        }
    }
}

// ---- Adam --------------------------------------------------------------------------------------

/// Parameter i's update reads inputs[i] and rewrites outputs[3i..3i+3] = (param, exp_avg,
/// exp_avg_sq), one parameter after another.
fn adam(op: &FusedOp, inputs: &[View], outputs: &[&Storage]) -> Result<()> {
    let k = AdamScalars::of(op).ok_or_else(|| Error::invalid("adam", "not an Adam op"))?;
    if outputs.len() != 3 * inputs.len() {
        return Err(Error::invalid(
            "adam",
            format!(
                "{} gradients need {} outputs (param, exp_avg, exp_avg_sq each), got {}",
                inputs.len(),
                3 * inputs.len(),
                outputs.len()
            ),
        ));
    }
    for (grad, trio) in inputs.iter().zip(outputs.chunks_exact(3)) {
        let [p, m, v] = [trio[0], trio[1], trio[2]];
        check_adam_operands(grad, p, m, v)?;
        let g = read(grad.storage)?;
        let off = grad.layout.offset();
        write(p, |p| {
            write(m, |m| write(v, |v| adam_dispatch(&k, &g, off, p, m, v)))
        })?;
    }
    Ok(())
}

/// One contiguous gradient of the parameter's numel; four distinct storages (a shared one
/// would deadlock on its lock and is a caller bug anyway).
fn check_adam_operands(grad: &View, p: &Storage, m: &Storage, v: &Storage) -> Result<()> {
    let n = p.len();
    let l = grad.layout;
    if !l.is_contiguous() || l.numel() != n || l.offset() + n > grad.storage.len() {
        return Err(Error::invalid(
            "adam",
            format!(
                "each gradient must be contiguous with its parameter's {n} elements, got shape {:?}",
                l.shape()
            ),
        ));
    }
    if m.len() != n || v.len() != n {
        return Err(Error::shape(
            "adam",
            format!(
                "state of {} and {} elements for a parameter of {n}",
                m.len(),
                v.len()
            ),
        ));
    }
    let all = [grad.storage, p, m, v];
    for (i, a) in all.iter().enumerate() {
        if all[i + 1..].iter().any(|b| std::ptr::eq(*a, *b)) {
            return Err(Error::invalid(
                "adam",
                "gradient, parameter and state buffers must be distinct storages",
            ));
        }
    }
    Ok(())
}

fn adam_dispatch(
    k: &AdamScalars,
    g: &CpuData,
    off: usize,
    p: &mut CpuData,
    m: &mut CpuData,
    v: &mut CpuData,
) -> Result<()> {
    macro_rules! go {
        ($v:ident) => {
            match (g, p, m, v) {
                (CpuData::$v(g), CpuData::$v(p), CpuData::$v(m), CpuData::$v(v)) => {
                    adam_apply(k, &g[off..off + p.len()], p, m, v);
                    Ok(())
                }
                _ => Err(Error::invalid(
                    "adam",
                    "parameter, gradient and state buffers must share a dtype",
                )),
            }
        };
    }
    per_float_variant!(g, "adam", "parameters must be floating point", go)
}

/// An element type with its compute ("opmath") type: f32 for f32/f16/bf16, f64 for f64.
trait Opmath: Elem {
    type C: Float + Send + Sync;
    fn up(self) -> Self::C;
    fn down(c: Self::C) -> Self;
    fn c(v: f64) -> Self::C;
}

macro_rules! opmath {
    ($t:ty, $c:ty, $up:expr, $down:expr) => {
        impl Opmath for $t {
            type C = $c;
            #[inline(always)]
            fn up(self) -> $c {
                $up(self)
            }
            #[inline(always)]
            fn down(c: $c) -> $t {
                $down(c)
            }
            #[inline(always)]
            fn c(v: f64) -> $c {
                v as $c
            }
        }
    };
}
opmath!(f32, f32, |x| x, |c| c);
opmath!(f64, f64, |x| x, |c| c);
opmath!(f16, f32, f16::to_f32, f16::from_f32);
opmath!(bf16, f32, bf16::to_f32, bf16::from_f32);

/// The scalars of one step in the compute type.
#[derive(Clone, Copy)]
struct AdamC<C> {
    l2: Option<C>,
    decay: C,
    w1: C,
    w1_small: bool,
    beta2: C,
    w2: C,
    bc2_sqrt: C,
    neg_step_size: C,
    eps: C,
}

impl<C: Float> AdamC<C> {
    fn new(k: &AdamScalars, c: impl Fn(f64) -> C) -> AdamC<C> {
        let w1 = c(k.w1);
        AdamC {
            // PyTorch adds wd·p only when wd != 0 (0·inf would be NaN).
            l2: (k.l2 != 0.0).then(|| c(k.l2)),
            decay: c(k.decay),
            w1,
            // torch's lerp switches formula at |weight| = 0.5, tested in the compute type.
            w1_small: w1.abs() < c(0.5),
            beta2: c(k.beta2),
            w2: c(k.w2),
            bc2_sqrt: c(k.bc2_sqrt),
            neg_step_size: c(k.neg_step_size),
            eps: c(k.eps),
        }
    }

    /// One element: (param, exp_avg, exp_avg_sq) after the step.
    #[inline(always)]
    fn update(&self, g: C, p: C, m: C, v: C) -> (C, C, C) {
        let p = p * self.decay;
        let g = match self.l2 {
            Some(l2) => g + l2 * p,
            None => g,
        };
        let m = if self.w1_small {
            m + self.w1 * (g - m)
        } else {
            g - (g - m) * (C::one() - self.w1)
        };
        let v = v * self.beta2 + self.w2 * g * g;
        let denom = v.sqrt() / self.bc2_sqrt + self.eps;
        (p + self.neg_step_size * m / denom, m, v)
    }
}

fn adam_apply<T: Opmath>(k: &AdamScalars, g: &[T], p: &mut [T], m: &mut [T], v: &mut [T]) {
    let h = AdamC::new(k, T::c);
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
        .for_each(|((p, g), (m, v))| {
            for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                let (np, nm, nv) = h.update(g.up(), p.up(), m.up(), v.up());
                *p = T::down(np);
                *m = T::down(nm);
                *v = T::down(nv);
            }
        });
}
