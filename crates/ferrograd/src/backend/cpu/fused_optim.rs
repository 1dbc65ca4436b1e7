//! Optimizer updates as single fused passes over contiguous buffers: one read of the
//! gradient, one read-modify-write of the parameter and of each state buffer.

use rayon::prelude::*;

use super::data::{CpuData, Elem};
use super::{read, write};
use crate::backend::{FusedOp, Storage, View};
use crate::error::{Error, Result};

const CHUNK: usize = 1 << 14;

pub(crate) fn run(op: &FusedOp, inputs: &[View], outputs: &[&Storage]) -> Result<()> {
    match op {
        FusedOp::SgdStep { .. } => sgd(op, inputs, outputs),
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
        match g {
            CpuData::F32(_) => go!(F32),
            CpuData::F64(_) => go!(F64),
            CpuData::F16(_) => go!(F16),
            CpuData::BF16(_) => go!(BF16),
            other => Err(Error::UnsupportedDType {
                op: "sgd",
                dtype: other.dtype(),
                hint: "parameters must be floating point",
            }),
        }
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
