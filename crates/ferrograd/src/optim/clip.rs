//! Gradient clipping, as torch.nn.utils.clip_grad_norm_ / clip_grad_value_.
//!
//! `clip_grad_norm`: one norm over all gradients (the norm of the per-gradient norms),
//! computed on each gradient's device and read back once per device; every gradient is then
//! scaled in place by clamp(max_norm / (norm + 1e-6), max = 1). Returns the norm before
//! clipping. f16/bf16 gradients are widened to f32 for the norm (their squares overflow).
//! `clip_grad_norm_queued` does the same without reading the norm back (the Trainer's path).

use crate::autograd::no_grad;
use crate::backend::{BinaryOp, ReduceOp, UnaryOp, elementwise};
use crate::base::{Error, Result};
use crate::tensor::{DType, Device, Readout, Tensor};

/// Added to the norm before dividing, as PyTorch does.
const NORM_EPS: f64 = 1e-6;

/// Scales all gradients of `params` so that their total `norm_type`-norm is at most
/// `max_norm`; returns the total norm before clipping (0 when no parameter has a gradient).
/// `norm_type` is any p > 0 or `f64::INFINITY` (max |g|). With `error_if_nonfinite`, a NaN
/// or infinite norm is an error and no gradient is changed; without it, the gradients are
/// scaled by the non-finite coefficient, as in PyTorch.
pub fn clip_grad_norm(
    params: &[Tensor],
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: bool,
) -> Result<f64> {
    if norm_type.is_nan() || norm_type <= 0.0 {
        return Err(bad_norm_type(norm_type));
    }
    let _g = no_grad();
    let pairs: Vec<(&Tensor, Tensor)> = params
        .iter()
        .filter_map(|p| p.grad().map(|g| (p, g)))
        .collect();
    if pairs.is_empty() {
        return Ok(0.0);
    }
    let grads: Vec<Tensor> = pairs.iter().map(|(_, g)| g.clone()).collect();
    let total = total_norm(&grads, norm_type)?;
    if error_if_nonfinite && !total.is_finite() {
        return Err(Error::invalid(
            "clip_grad_norm",
            format!(
                "the total norm of order {norm_type} of the gradients is non-finite ({total}), so it cannot be clipped; pass error_if_nonfinite = false to scale the gradients by the non-finite norm anyway"
            ),
        ));
    }
    let coef = max_norm / (total + NORM_EPS);
    // clamp(max = 1) that keeps NaN, as torch.clamp does (f64::min would drop it).
    let coef = if coef > 1.0 { 1.0 } else { coef };
    scale_all(&pairs, &Tensor::scalar(coef, DType::F64, Device::Cpu)?)?;
    Ok(total)
}

/// `clip_grad_norm` without waiting for the device, as torch's `clip_grad_norm_` (which
/// returns the norm as a tensor): the partials, the norm, the coefficient and the scaling are
/// all queued on the gradients' device, and the norm comes back as a `Readout` that waits only
/// when read. Gradients on several devices, or the ∞-norm, take `clip_grad_norm`'s path (its
/// norm already read). There is no `error_if_nonfinite` here: checking needs the host.
pub fn clip_grad_norm_queued(params: &[Tensor], max_norm: f64, norm_type: f64) -> Result<Readout> {
    let (norm, coef) = clip_coefficient_queued(params, max_norm, norm_type)?;
    if let Some(coef) = coef {
        scale_grads(params, &coef)?;
    }
    Ok(norm)
}

/// `clip_grad_norm_queued` without the scaling: the norm, and the 0-dim f64 coefficient
/// min(1, max_norm / (norm + 1e-6)) on the gradients' device, for an optimizer that
/// multiplies by it as it reads each gradient (`Optimizer::step_with_grad_scale`). The
/// coefficient is None where the host path ran instead (∞-norm, several devices, no
/// gradient elements): the gradients are then clipped already.
pub fn clip_coefficient_queued(
    params: &[Tensor],
    max_norm: f64,
    norm_type: f64,
) -> Result<(Readout, Option<Tensor>)> {
    if norm_type.is_nan() || norm_type <= 0.0 {
        return Err(bad_norm_type(norm_type));
    }
    let grads: Vec<Tensor> = params.iter().filter_map(Tensor::grad).collect();
    let one_device = grads.windows(2).all(|w| w[0].device() == w[1].device());
    if norm_type.is_infinite() || !one_device || grads.iter().all(|g| g.numel() == 0) {
        let norm = clip_grad_norm(params, max_norm, norm_type, false)?;
        return Ok((Readout::ready(vec![norm]), None));
    }
    let _g = no_grad();
    let mut parts = Vec::with_capacity(grads.len());
    for g in grads.iter().filter(|g| g.numel() > 0) {
        parts.extend(partials(g, norm_type)?);
    }
    // (1,) f64: Σ|g|^p, then its p-th root.
    let sum = Tensor::cat(&parts, 0)?.sum_all()?.reshape(&[1])?;
    let norm = if norm_type == 2.0 {
        sum.sqrt()?
    } else {
        sum.pow_scalar(1.0 / norm_type)?
    };
    // clamp(max_norm / (norm + eps), max = 1), NaN kept, as on the host path.
    let coef = norm
        .add_scalar(NORM_EPS)?
        .pow_scalar(-1.0)?
        .mul_scalar(max_norm)?;
    let coef = unary(
        UnaryOp::Clamp {
            lo: f64::NEG_INFINITY,
            hi: 1.0,
        },
        &coef,
        "clip_grad_norm",
    )?
    // 0-dim, so that it broadcasts to every gradient, a 0-dim one too.
    .reshape(&[])?;
    Ok((Readout::pending(norm), Some(coef)))
}

/// Every gradient of `params` ← g · coef (a 0-dim tensor, rounded once to each gradient's
/// dtype on its device).
pub(crate) fn scale_grads(params: &[Tensor], coef: &Tensor) -> Result<()> {
    let _g = no_grad();
    let pairs: Vec<(&Tensor, Tensor)> = params
        .iter()
        .filter_map(|p| p.grad().map(|g| (p, g)))
        .collect();
    scale_all(&pairs, coef)
}

fn bad_norm_type(norm_type: f64) -> Error {
    Error::invalid(
        "clip_grad_norm",
        format!("norm_type must be a positive number or infinity, got {norm_type}"),
    )
}

/// Clamps every gradient of `params` in place to [-clip_value, clip_value].
pub fn clip_grad_value(params: &[Tensor], clip_value: f64) -> Result<()> {
    if clip_value.is_nan() || clip_value < 0.0 {
        return Err(Error::invalid(
            "clip_grad_value",
            format!("clip_value must be non-negative, got {clip_value}"),
        ));
    }
    let _g = no_grad();
    let op = UnaryOp::Clamp {
        lo: -clip_value,
        hi: clip_value,
    };
    for p in params {
        if let Some(g) = p.grad() {
            let clamped = unary(op, &g, "clip_grad_value")?;
            assign(p, &g, clamped)?;
        }
    }
    Ok(())
}

/// The norm of all gradients: per-gradient partials on their devices (Σ|g|^p, or max |g| and
/// a NaN flag for p = ∞), gathered into one f64 vector per device and read back once.
fn total_norm(grads: &[Tensor], p: f64) -> Result<f64> {
    let mut per_device: Vec<(Device, Vec<Tensor>)> = Vec::new();
    for g in grads.iter().filter(|g| g.numel() > 0) {
        let parts = partials(g, p)?;
        match per_device.iter_mut().find(|(d, _)| *d == g.device()) {
            Some((_, v)) => v.extend(parts),
            None => per_device.push((g.device(), parts)),
        }
    }
    let mut values = Vec::new();
    for (_, parts) in per_device {
        values.extend(Tensor::cat(&parts, 0)?.to_vec::<f64>()?);
    }
    if p.is_infinite() {
        // values alternate (max |g|, 1 if g holds no NaN else 0).
        let nan = values.chunks(2).any(|c| c.get(1) == Some(&0.0));
        let max = values.chunks(2).map(|c| c[0]).fold(0.0, f64::max);
        return Ok(if nan { f64::NAN } else { max });
    }
    let sum: f64 = values.iter().sum();
    Ok(if p == 2.0 {
        sum.sqrt()
    } else {
        sum.powf(1.0 / p)
    })
}

/// One gradient's partials as (1,)-shaped f64 tensors on its device.
fn partials(g: &Tensor, p: f64) -> Result<Vec<Tensor>> {
    let g = match g.dtype() {
        DType::F16 | DType::BF16 => g.to_dtype(DType::F32)?,
        _ => g.clone(),
    };
    let all: Vec<usize> = (0..g.dims()).collect();
    let as_f64 = |t: Tensor| t.reshape(&[1])?.to_dtype(DType::F64);
    if p.is_infinite() {
        let abs = unary(UnaryOp::Abs, &g, "clip_grad_norm")?;
        let max = abs.reduce_dims(ReduceOp::Max, &all, "clip_grad_norm")?;
        // Max skips NaN; PyTorch's norm does not. min(g == g) is 0 iff g holds a NaN.
        let same = binary(BinaryOp::Eq, &g, &g, "clip_grad_norm")?;
        let no_nan = same.reduce_dims(ReduceOp::Min, &all, "clip_grad_norm")?;
        return Ok(vec![as_f64(max)?, as_f64(no_nan)?]);
    }
    let powered = if p == 2.0 {
        g.mul(&g)?
    } else if p == 1.0 {
        unary(UnaryOp::Abs, &g, "clip_grad_norm")?
    } else {
        unary(UnaryOp::Abs, &g, "clip_grad_norm")?.pow_scalar(p)?
    };
    Ok(vec![as_f64(powered.sum_all()?)?])
}

/// Every (parameter, gradient) pair's g ← g · coef, with `coef` a 0-dim tensor rounded once
/// to each gradient's dtype on its device; in place when the gradient is contiguous (the
/// usual case), else by replacing the parameter's gradient.
fn scale_all(pairs: &[(&Tensor, Tensor)], coef: &Tensor) -> Result<()> {
    let mut converted: Vec<((Device, DType), Tensor)> = Vec::new();
    for (p, g) in pairs {
        let key = (g.device(), g.dtype());
        let c = match converted.iter().find(|(k, _)| *k == key) {
            Some((_, c)) => c.clone(),
            None => {
                let c = coef.to_device(key.0)?.to_dtype(key.1)?;
                converted.push((key, c.clone()));
                c
            }
        };
        if owns_storage(g) {
            g.mul_(&c)?;
        } else {
            assign(p, g, g.mul(&c)?)?;
        }
    }
    Ok(())
}

/// Writes `value` into the gradient `g` of `p` (in place when it owns its storage).
fn assign(p: &Tensor, g: &Tensor, value: Tensor) -> Result<()> {
    if owns_storage(g) {
        g.copy_(&value)
    } else {
        p.set_grad(Some(value))
    }
}

/// Whether `t` can be written in place: contiguous, all of its storage or a slice of one
/// (a data-parallel gradient that is a view into its bucket stays one).
fn owns_storage(t: &Tensor) -> bool {
    t.is_contiguous()
}

/// `op(x)` as a fresh temporary, no autograd.
fn unary(op: UnaryOp, x: &Tensor, name: &'static str) -> Result<Tensor> {
    let out = Tensor::output(x.shape(), x.dtype(), x.device(), name)?;
    elementwise::unary(op, x.view(), out.storage())?;
    Ok(out)
}

/// `op(a, b)` for operands of one shape, as a fresh temporary, no autograd.
fn binary(op: BinaryOp, a: &Tensor, b: &Tensor, name: &'static str) -> Result<Tensor> {
    let out = Tensor::output(a.shape(), a.dtype(), a.device(), name)?;
    elementwise::binary(op, a.view(), b.view(), out.storage())?;
    Ok(out)
}
