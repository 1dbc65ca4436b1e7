//! CPU kernels of the optimizer family (backend/optim.rs), single fused passes over
//! contiguous buffers: one read of the gradient, one read-modify-write of the parameter and of
//! each state buffer. SGD computes in the element type; Adam in its compute type (f32 for
//! f32/f16/bf16, f64 for f64), rounding once per store, as the CUDA kernel
//! (kernels/optim.cu) does term by term. The unscale multiplies every gradient by 1/scale and
//! raises one found_inf flag when any value was inf or NaN; the check looks at the scaled
//! value (before the multiply) and the product is rounded once, as on the GPU, so both agree
//! bit for bit. Arguments arrive validated; versions are bumped by the entry functions.

use half::{bf16, f16};
use num_traits::Float;
use rayon::prelude::*;

use super::CpuBackend;
use super::data::{CpuData, Elem, per_float_variant};
use super::{read, write};
use crate::backend::Storage;
use crate::backend::optim::{
    self, AdamScalars, AdamStep, CountStep, OptimKernels, SgdStep, UnscaleCheck, UpdateScale,
};
use crate::base::DType;
use crate::base::{Error, Result};

const CHUNK: usize = 1 << 14;

impl OptimKernels for CpuBackend {
    fn sgd_step(&self, a: &SgdStep) -> Result<()> {
        sgd(a)
    }
    fn adam_step(&self, a: &AdamStep) -> Result<()> {
        adam(a)
    }
    fn unscale_check(&self, a: &UnscaleCheck) -> Result<()> {
        let inv_scale = match &a.inv_scale_at {
            Some(at) => read_f32(OP, at)?,
            None => a.inv_scale,
        };
        unscale_check(inv_scale, a.found_inf, a.grads)
    }
    fn count_step(&self, a: &CountStep) -> Result<()> {
        if let Some(flag) = &a.skip_if
            && read_f32("count_step", flag)? != 0.0
        {
            return Ok(());
        }
        write(a.count, |c| match c {
            CpuData::F64(c) => {
                c[0] += 1.0;
                Ok(())
            }
            d => Err(Error::DType {
                op: "count_step",
                expected: DType::F64,
                got: d.dtype(),
            }),
        })
    }
    fn update_scale(&self, a: &UpdateScale) -> Result<()> {
        const OP: &str = "update_scale";
        let found = read_f32(OP, &a.found_inf)? != 0.0;
        let factors = (a.growth_factor, a.backoff_factor, a.growth_interval);
        let scale = write(a.state, |s| match s {
            CpuData::F32(s) => {
                let (scale, tracker) = optim::next_scale((s[0], s[2] as u64), found, factors);
                s.copy_from_slice(&[scale, optim::inv_scale_of(scale), tracker as f32]);
                Ok(scale)
            }
            d => Err(Error::DType {
                op: OP,
                expected: DType::F32,
                got: d.dtype(),
            }),
        })?;
        match a.report {
            Some(r) => write(r, |r| match r {
                CpuData::F32(r) => {
                    r.copy_from_slice(&[found as u8 as f32, scale]);
                    Ok(())
                }
                d => Err(Error::DType {
                    op: OP,
                    expected: DType::F32,
                    got: d.dtype(),
                }),
            }),
            None => Ok(()),
        }
    }
}

/// Nothing when the skip flag is raised.
fn sgd(a: &SgdStep) -> Result<()> {
    if let Some(flag) = &a.skip_if
        && read_f32("sgd", flag)? != 0.0
    {
        return Ok(());
    }
    let lr = match &a.lr_at {
        Some(at) => read_f64(at)?,
        None => a.lr,
    };
    let first_step = match &a.count_at {
        Some(c) => read_f64(c)? == 0.0,
        None => a.first_step,
    };
    let h = Sgd {
        lr,
        momentum: a.momentum,
        dampening: a.dampening,
        weight_decay: a.weight_decay,
        nesterov: a.nesterov,
        first_step,
    };
    let g = read(a.grad.storage)?;
    let off = a.grad.layout.offset();
    write(a.param, |p| match a.momentum_buf {
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

/// The value of a one-element f64 tensor (a gradient scale, a step count, a rate).
fn read_f64(v: &crate::backend::View) -> Result<f64> {
    match &*read(v.storage)? {
        CpuData::F64(d) => Ok(d[v.layout.offset()]),
        d => Err(Error::DType {
            op: "adam",
            expected: DType::F64,
            got: d.dtype(),
        }),
    }
}

/// The value of a one-element f32 tensor (a flag, a staged scale).
fn read_f32(op: &'static str, v: &crate::backend::View) -> Result<f32> {
    match &*read(v.storage)? {
        CpuData::F32(d) => Ok(d[v.layout.offset()]),
        d => Err(Error::DType {
            op,
            expected: DType::F32,
            got: d.dtype(),
        }),
    }
}

/// One parameter after another: read the gradient, rewrite (param, exp_avg, exp_avg_sq).
/// Nothing when the skip flag is raised.
fn adam(a: &AdamStep) -> Result<()> {
    if let Some(flag) = &a.skip_if
        && read_f32("adam", flag)? != 0.0
    {
        return Ok(());
    }
    let k = match &a.count_at {
        Some(c) => AdamScalars::at(a, read_f64(c)? + 1.0),
        None => AdamScalars::of(a),
    };
    let k = match &a.grad_scale {
        Some(c) => AdamScalars {
            grad_scale: Some(read_f64(c)?),
            ..k
        },
        None => k,
    };
    for e in a.params {
        let g = read(e.grad.storage)?;
        let off = e.grad.layout.offset();
        write(e.param, |p| {
            write(e.exp_avg, |m| {
                write(e.exp_avg_sq, |v| match e.master {
                    Some(w) => write(w, |w| adam_master_dispatch(&k, &g, off, p, [m, v, w])),
                    None => adam_dispatch(&k, &g, off, p, m, v),
                })
            })
        })?;
    }
    Ok(())
}

/// A half-precision parameter with f32 (exp_avg, exp_avg_sq, master).
fn adam_master_dispatch(
    k: &AdamScalars,
    g: &CpuData,
    off: usize,
    p: &mut CpuData,
    state: [&mut CpuData; 3],
) -> Result<()> {
    let [CpuData::F32(m), CpuData::F32(v), CpuData::F32(w)] = state else {
        return Err(Error::invalid(
            "adam",
            "master weights and moments must be f32",
        ));
    };
    match (g, p) {
        (CpuData::BF16(g), CpuData::BF16(p)) => {
            adam_master_apply(k, &g[off..off + p.len()], p, m, v, w)
        }
        (CpuData::F16(g), CpuData::F16(p)) => {
            adam_master_apply(k, &g[off..off + p.len()], p, m, v, w)
        }
        _ => {
            return Err(Error::invalid(
                "adam",
                "master weights serve f16/bf16 parameters with gradients of the same dtype",
            ));
        }
    }
    Ok(())
}

/// The f32 update of the master copy, then the parameter = the master rounded once.
fn adam_master_apply<T: Opmath<C = f32>>(
    k: &AdamScalars,
    g: &[T],
    p: &mut [T],
    m: &mut [f32],
    v: &mut [f32],
    w: &mut [f32],
) {
    let h = AdamC::new(k, |x| x as f32);
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
        .zip(w.par_chunks_mut(CHUNK))
        .for_each(|(((p, g), (m, v)), w)| {
            for ((((p, &g), m), v), w) in p.iter_mut().zip(g).zip(m).zip(v).zip(w) {
                let (nw, nm, nv) = h.update(g.up(), *w, *m, *v);
                (*w, *m, *v) = (nw, nm, nv);
                *p = T::down(nw);
            }
        });
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
    grad_scale: Option<C>,
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
            grad_scale: k.grad_scale.map(&c),
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
        let g = match self.grad_scale {
            Some(c) => g * c,
            None => g,
        };
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

/// Matching chunks of (param, grad) and (exp_avg, exp_avg_sq).
type AdamChunk<'a, T> = ((&'a mut [T], &'a [T]), (&'a mut [T], &'a mut [T]));

fn adam_apply<T: Opmath>(k: &AdamScalars, g: &[T], p: &mut [T], m: &mut [T], v: &mut [T]) {
    let h = AdamC::new(k, T::c);
    let step = |((p, g), (m, v)): AdamChunk<T>| {
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            let (np, nm, nv) = h.update(g.up(), p.up(), m.up(), v.up());
            *p = T::down(np);
            *m = T::down(nm);
            *v = T::down(nv);
        }
    };
    // One chunk (a bias, a norm's weight): here, not handed to the pool and waited for.
    if p.len() <= CHUNK {
        return step(((p, g), (m, v)));
    }
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
        .for_each(step);
}

// ---- unscale with inf/NaN check --------------------------------------------------------------

const OP: &str = "unscale_check";

/// Unscales every gradient; raises `flag` when any held an inf or NaN.
fn unscale_check(inv_scale: f32, flag: &Storage, grads: &[&Storage]) -> Result<()> {
    let mut found = false;
    for g in grads {
        found |= write(g, |d| unscale(d, inv_scale))?;
    }
    if found {
        write(flag, |f| match f {
            CpuData::F32(v) => {
                v[0] = 1.0;
                Ok(())
            }
            other => Err(Error::DType {
                op: OP,
                expected: DType::F32,
                got: other.dtype(),
            }),
        })?;
    }
    Ok(())
}

/// Unscales one buffer in place; whether it held an inf or NaN.
fn unscale(d: &mut CpuData, inv: f32) -> Result<bool> {
    Ok(match d {
        CpuData::F32(v) => unscale_apply(v, inv, |x| x, |c| c),
        CpuData::F64(v) => unscale_apply(v, inv as f64, |x| x, |c| c),
        CpuData::F16(v) => unscale_apply(v, inv, f16::to_f32, f16::from_f32),
        CpuData::BF16(v) => unscale_apply(v, inv, bf16::to_f32, bf16::from_f32),
        other => {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype: other.dtype(),
                hint: "gradients must be floating point",
            });
        }
    })
}

/// Every element is unscaled, even after a non-finite one (PyTorch leaves no element
/// behind either); chunks run in parallel and OR their flags.
fn unscale_apply<T, C>(v: &mut [T], inv: C, up: fn(T) -> C, down: fn(C) -> T) -> bool
where
    T: Copy + Send + Sync,
    C: num_traits::Float + Send + Sync,
{
    let identity = inv == C::one();
    v.par_chunks_mut(CHUNK)
        .map(|chunk| {
            let mut bad = false;
            for x in chunk.iter_mut() {
                let c = up(*x);
                bad |= !c.is_finite();
                if !identity {
                    *x = down(c * inv);
                }
            }
            bad
        })
        .reduce(|| false, |a, b| a || b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_before_scaling_and_widens_for_f64() {
        // 1e38 · 10 overflows after scaling but was finite before: not flagged (as PyTorch).
        let mut v = vec![1e38f32, 2.0];
        assert!(!unscale_apply(&mut v, 10.0f32, |x| x, |c| c));
        assert_eq!(v, vec![f32::INFINITY, 20.0]);
        let mut v = vec![1.0f32, f32::NAN, 3.0];
        assert!(unscale_apply(&mut v, 0.5f32, |x| x, |c| c));
        assert_eq!((v[0], v[2]), (0.5, 1.5));
        // f64 gradients multiply by the f32 inverse widened to f64.
        let inv = 0.1f32;
        let mut d = CpuData::F64(vec![0.1]);
        assert!(!unscale(&mut d, inv).unwrap());
        match d {
            CpuData::F64(v) => assert_eq!(v[0], 0.1 * inv as f64),
            _ => unreachable!(),
        }
    }
}
