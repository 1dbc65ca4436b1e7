//! Softmax and log-softmax along any dim, one fused kernel each way. The kernel works on rows
//! of the last dim, so another dim is first moved last (a permuted contiguous copy) and the
//! result is handed back as the inverse permutation of the kernel's output (a view).
//! Backward saves the OUTPUT, like PyTorch: softmax gx = y (g - Σ g·y), log-softmax
//! gx = g - exp(y) Σ g, both along the dim.

use crate::autograd::{SavedTensor, record};
use crate::backend::rows::{self, Softmax, SoftmaxBackward};
use crate::base::Result;
use crate::tensor::{Tensor, resolve_dim};

impl Tensor {
    /// exp(x) / Σ exp(x) along `dim` (negative counts from the end).
    #[track_caller]
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        softmax_along(self, dim, false)
    }

    /// x - log Σ exp(x) along `dim`: the log of `softmax`, computed without its underflow.
    #[track_caller]
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        softmax_along(self, dim, true)
    }
}

fn softmax_along(x: &Tensor, dim: isize, log: bool) -> Result<Tensor> {
    if let Some([x]) = super::autocast::cast_f32([x])? {
        return softmax_along(&x, dim, log);
    }
    let name = if log { "log_softmax" } else { "softmax" };
    super::check_float(name, x)?;
    // A 0-dim tensor is one row of one element (dim 0 or -1), as in PyTorch.
    let d = resolve_dim(name, dim, x.dims().max(1))?;
    let perm = dim_last(x.dims(), d);
    let y = run_rows(log, &moved(&x.detach(), perm.as_deref())?, None, name)?;
    let out = moved_back(&y, perm.as_deref())?;
    Ok(record(name, &[x], out, |_, _| {
        let y = SavedTensor::new(&y);
        move |g: &Tensor, _: &[bool]| {
            let gy = moved(g, perm.as_deref())?;
            let gx = run_rows(log, y.get(), Some(&gy), name)?;
            Ok(vec![Some(moved_back(&gx, perm.as_deref())?)])
        }
    }))
}

/// Softmax of `a` (x), or its backward when `gy` is given (`a` = the saved y): the
/// (contiguous) output, shaped like `a`.
fn run_rows(log: bool, a: &Tensor, gy: Option<&Tensor>, name: &'static str) -> Result<Tensor> {
    let a = a.detached_contiguous()?;
    let out = Tensor::output_uninit(a.shape(), a.dtype(), a.device(), name)?;
    match gy {
        None => rows::softmax(&Softmax {
            x: a.view(),
            y: out.storage(),
            log,
        })?,
        Some(gy) => rows::softmax_backward(&SoftmaxBackward {
            y: a.view(),
            gy: gy.detached_contiguous()?.view(),
            gx: out.storage(),
            log,
        })?,
    }
    Ok(out)
}

/// The permutation that moves `dim` last, or None when it already is.
fn dim_last(rank: usize, dim: usize) -> Option<Vec<usize>> {
    (rank > 1 && dim != rank - 1).then(|| (0..rank).filter(|&i| i != dim).chain([dim]).collect())
}

/// `t` with the softmax dim moved last (a view; the kernel call makes it contiguous).
fn moved(t: &Tensor, perm: Option<&[usize]>) -> Result<Tensor> {
    match perm {
        Some(p) => Ok(t.with_layout(t.layout().permute(p)?)),
        None => Ok(t.clone()),
    }
}

/// The inverse of `moved`: the dim put back where it was (a view).
fn moved_back(t: &Tensor, perm: Option<&[usize]>) -> Result<Tensor> {
    let Some(p) = perm else { return Ok(t.clone()) };
    let mut inverse = vec![0; p.len()];
    for (i, &d) in p.iter().enumerate() {
        inverse[d] = i;
    }
    Ok(t.with_layout(t.layout().permute(&inverse)?))
}
