//! The optimizer family: in-place updates fused into single passes — the SGD step, the
//! multi-tensor Adam / AdamW step with the step count it may keep on the device, and the
//! mixed-precision unscale with its inf/NaN check and the loss scale's update.
//! Here: the typed arguments, their one validator, the `OptimKernels` trait that every
//! backend implements, and the entry functions, which validate once, dispatch, and record
//! the in-place writes (storage versions) so that callers cannot forget them. Not here: the
//! kernels (backend/cpu/optim.rs, backend/cuda/optim.rs + kernels/optim.cu).

use super::{Storage, View, backend, check};
use crate::base::DType;
use crate::base::{Error, Result};

/// One SGD update in a single pass, in place on `param` (and `momentum_buf`):
///   d ← g + wd·p;  buf ← d if `first_step` else μ·buf + (1 − dampening)·d
///   p ← p − lr·(nesterov ? d + μ·buf : buf)      (without a buffer: p ← p − lr·d)
/// grad contiguous with the parameter's numel and dtype (float).
pub struct SgdStep<'a> {
    pub grad: View<'a>,
    pub param: &'a Storage,
    pub momentum_buf: Option<&'a Storage>,
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
    pub first_step: bool,
    /// Where the device holds the rate (one F64 element), read there instead of `lr`: a
    /// replayed graph's rate follows the schedule, a kernel argument would not. None: `lr`.
    pub lr_at: Option<View<'a>>,
    /// A one-element F32 flag (a `GradScaler`'s found_inf): when it is nonzero the step
    /// changes nothing. None: the step always runs.
    pub skip_if: Option<View<'a>>,
    /// Where the device keeps how many steps the momentum buffer has taken (one F64 element,
    /// advanced by `count_step`): the step is the first (buf ← d) when it holds 0, instead
    /// of `first_step`. None: `first_step`.
    pub count_at: Option<View<'a>>,
}

impl<'a> SgdStep<'a> {
    /// Plain descent, p ← p − lr·grad: no momentum, no weight decay, nothing on the device
    /// but the rate where `lr_at` holds it.
    pub fn plain(grad: View<'a>, param: &'a Storage, lr: f64, lr_at: Option<View<'a>>) -> Self {
        SgdStep {
            grad,
            param,
            momentum_buf: None,
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            first_step: false,
            lr_at,
            skip_if: None,
            count_at: None,
        }
    }
}

/// One parameter of an Adam step: its gradient (contiguous, the parameter's numel and dtype)
/// and three distinct storages updated in place. With `master` (an f16/bf16 parameter's f32
/// copy), the step reads and writes the master and the f32 moments, then stores the master
/// rounded into the parameter: the update is exactly an f32 parameter's, fed the gradient
/// widened to f32.
#[derive(Clone, Copy)]
pub struct AdamParam<'a> {
    pub grad: View<'a>,
    pub param: &'a Storage,
    pub exp_avg: &'a Storage,
    pub exp_avg_sq: &'a Storage,
    pub master: Option<&'a Storage>,
}

/// One Adam / AdamW step over every parameter in `params` in a single call (one launch per
/// dtype on a GPU). `step` is the 1-based step count after this update, shared by all.
/// PyTorch's single-tensor formula in the compute type (f32 for f32/f16/bf16, f64 for f64),
/// rounded once per store:
///   p ← p·(1 − lr·wd) if decoupled (AdamW), else g ← g + wd·p (L2), when wd != 0
///   m ← lerp(m, g, 1 − β1);  v ← β2·v + (1 − β2)·g·g
///   p ← p − (lr / (1 − β1^t))·m / (√v / √(1 − β2^t) + eps)
pub struct AdamStep<'a> {
    pub params: &'a [AdamParam<'a>],
    /// A one-element f64 tensor on the parameters' device (a clipping coefficient), read on
    /// the device: every gradient element is multiplied by it, in the compute type, as Adam
    /// reads it. None: the gradients as they are.
    pub grad_scale: Option<View<'a>>,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub decoupled: bool,
    pub step: u64,
    /// Where the kernels read this step's scalars from, for a step that a graph replays:
    /// device memory of at least `ADAM_SCALAR_BYTES` that `stage_adam_scalars` filled before
    /// the capture and fills again before every replay (a kernel argument would replay the
    /// captured step's rate and bias corrections). None: the backend passes them itself.
    pub staged_scalars: Option<&'a Storage>,
    /// A one-element F32 flag on the parameters' device (a `GradScaler`'s found_inf), read on
    /// the device: when it is nonzero the step changes nothing. None: the step always runs.
    pub skip_if: Option<View<'a>>,
    /// Where the device keeps the step count reached before this step (one F64 element,
    /// advanced by `count_step` once the step has run): the bias corrections take
    /// t = count + 1 from there instead of `step`, so that a step the device skipped is not
    /// counted by the next one although the host never learnt of it. None: `step`.
    pub count_at: Option<View<'a>>,
}

/// Counts one more step in `count` (one F64 element) unless `skip_if` (one F32 element) is
/// nonzero: the device's own count of the Adam steps that ran (`AdamStep::count_at`).
pub struct CountStep<'a> {
    pub count: &'a Storage,
    pub skip_if: Option<View<'a>>,
}

/// A GradScaler's update on the device, torch's `_amp_update_scale_`: with `found_inf`
/// raised, scale ← scale·backoff_factor and the tracker restarts; else the tracker counts
/// one more clean step, and at growth_interval the scale grows by growth_factor (unless that
/// would be inf) and the tracker restarts (`next_scale`). Then 1/scale is written beside it.
/// state: F32 [scale, 1/scale, growth tracker]; report (if any): F32 [1 if found else 0,
/// the new scale], what the step's report reads later.
pub struct UpdateScale<'a> {
    pub found_inf: View<'a>,
    pub state: &'a Storage,
    pub report: Option<&'a Storage>,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    /// At most `MAX_DEVICE_GROWTH_INTERVAL` (the tracker is an f32 there).
    pub growth_interval: u64,
}

/// The largest growth interval a scale updated on the device can count to: its tracker is an
/// f32, exact up to 2^24.
pub const MAX_DEVICE_GROWTH_INTERVAL: u64 = 1 << 24;

/// The scale and growth tracker after one iteration (torch's `_amp_update_scale_`): the f32
/// scale times an f64 factor, rounded to f32; growth that would reach inf is skipped.
pub fn next_scale(
    (scale, tracker): (f32, u64),
    found_inf: bool,
    (growth_factor, backoff_factor, growth_interval): (f64, f64, u64),
) -> (f32, u64) {
    if found_inf {
        return ((scale as f64 * backoff_factor) as f32, 0);
    }
    let successful = tracker + 1;
    if successful < growth_interval {
        return (scale, successful);
    }
    let grown = (scale as f64 * growth_factor) as f32;
    (if grown.is_finite() { grown } else { scale }, 0)
}

/// 1/scale as PyTorch takes it: in f64, rounded to f32.
pub fn inv_scale_of(scale: f32) -> f32 {
    (1.0 / scale as f64) as f32
}

/// Bytes of device memory that hold one Adam step's scalars (`AdamStep::staged_scalars`).
pub const ADAM_SCALAR_BYTES: usize = 128;

/// Gradient unscaling with an inf/NaN check over every gradient in one call (one launch per
/// dtype on a GPU), in place: torch's `_amp_foreach_non_finite_check_and_unscale_`. Per
/// element: found_inf ← 1 when the value *before* scaling is inf or NaN (never cleared: the
/// caller zeroes it); g ← g·inv_scale in the compute type, rounded once (g kept when
/// inv_scale == 1). found_inf: one F32 element; grads: distinct whole float storages.
pub struct UnscaleCheck<'a> {
    pub found_inf: &'a Storage,
    pub grads: &'a [&'a Storage],
    pub inv_scale: f32,
    /// Where the device holds 1/scale (one F32 element), read there instead of `inv_scale`:
    /// a replayed graph's scale changes from step to step, a kernel argument would not.
    pub inv_scale_at: Option<View<'a>>,
}

/// The optimizer kernels of one device. Arguments arrive validated (entry functions below);
/// the kernels do not bump versions (the entry functions do).
pub trait OptimKernels {
    fn sgd_step(&self, a: &SgdStep) -> Result<()>;
    fn adam_step(&self, a: &AdamStep) -> Result<()>;
    fn unscale_check(&self, a: &UnscaleCheck) -> Result<()>;
    fn count_step(&self, a: &CountStep) -> Result<()>;
    fn update_scale(&self, a: &UpdateScale) -> Result<()>;
    /// Writes the scalars of step `a` into `slot` (stream-ordered with the kernels) for
    /// kernels that read them from there. Backends that read them on the host ignore it.
    fn stage_adam_scalars(&self, _a: &AdamStep, _slot: &Storage) -> Result<()> {
        Ok(())
    }
}

/// Fills `slot` with the scalars of step `a` (lr, bias corrections...), for a later
/// `adam_step` with `staged_scalars: Some(slot)`, which then reads them on the device.
pub fn stage_adam_scalars(a: &AdamStep, slot: &Storage) -> Result<()> {
    if slot.len() * slot.dtype().size_in_bytes() < ADAM_SCALAR_BYTES {
        return Err(Error::invalid(
            "adam",
            format!("the scalars of a step need {ADAM_SCALAR_BYTES} bytes of device memory"),
        ));
    }
    backend(slot.device())?.stage_adam_scalars(a, slot)?;
    slot.bump_version();
    Ok(())
}

/// Bumps the versions of the parameter and the momentum buffer.
pub fn sgd_step(a: &SgdStep) -> Result<()> {
    const OP: &str = "sgd";
    let device = a.param.device();
    // [grad, param, buf?]: no allocation per step.
    let trio = [a.grad.storage, a.param, a.momentum_buf.unwrap_or(a.param)];
    let all = &trio[..2 + a.momentum_buf.is_some() as usize];
    check::on_device(OP, device, all.iter().copied())?;
    check::distinct(
        OP,
        all,
        "gradient, parameter and momentum buffer must be distinct storages",
    )?;
    let dtype = a.param.dtype();
    if !dtype.is_float() {
        return Err(Error::UnsupportedDType {
            op: OP,
            dtype,
            hint: "parameters must be floating point",
        });
    }
    let n = a.param.len();
    check::dense(OP, "the gradient", &a.grad, n, dtype)?;
    if let Some(b) = a.momentum_buf {
        check::out(OP, b, n, dtype)?;
    }
    if let Some(lr) = &a.lr_at {
        check::on_device(OP, device, [lr.storage])?;
        check::dense(OP, "the rate", lr, 1, DType::F64)?;
    }
    if let Some(flag) = &a.skip_if {
        check::on_device(OP, device, [flag.storage])?;
        check::dense(OP, "the skip flag", flag, 1, DType::F32)?;
    }
    if let Some(count) = &a.count_at {
        check::on_device(OP, device, [count.storage])?;
        check::dense(OP, "the step count", count, 1, DType::F64)?;
    }
    backend(device)?.sgd_step(a)?;
    all[1..].iter().for_each(|s| s.bump_version());
    Ok(())
}

/// Bumps the versions of every parameter and state buffer.
pub fn adam_step(a: &AdamStep) -> Result<()> {
    let Some(first) = a.params.first() else {
        return Ok(());
    };
    let device = first.param.device();
    if let Some(c) = &a.grad_scale {
        check::on_device("adam", device, [c.storage])?;
        check::dense("adam", "the gradient scale", c, 1, DType::F64)?;
    }
    if let Some(slot) = a.staged_scalars {
        check::on_device("adam", device, [slot])?;
    }
    if let Some(flag) = &a.skip_if {
        check::on_device("adam", device, [flag.storage])?;
        check::dense("adam", "the skip flag", flag, 1, DType::F32)?;
    }
    if let Some(count) = &a.count_at {
        check::on_device("adam", device, [count.storage])?;
        check::dense("adam", "the step count", count, 1, DType::F64)?;
    }
    for p in a.params {
        adam_param(p)?;
        let all = [p.grad.storage, p.param, p.exp_avg, p.exp_avg_sq];
        check::on_device("adam", device, all.into_iter().chain(p.master))?;
    }
    backend(device)?.adam_step(a)?;
    for p in a.params {
        [p.param, p.exp_avg, p.exp_avg_sq]
            .into_iter()
            .chain(p.master)
            .for_each(|s| s.bump_version());
    }
    Ok(())
}

/// One contiguous gradient of the parameter's numel; four distinct storages of one float
/// dtype (a shared one would be updated twice, or deadlock on its lock).
fn adam_param(p: &AdamParam) -> Result<()> {
    const OP: &str = "adam";
    let dtype = p.param.dtype();
    if !dtype.is_float() {
        return Err(Error::UnsupportedDType {
            op: OP,
            dtype,
            hint: "parameters must be floating point",
        });
    }
    check::same_dtype(OP, dtype, p.grad.storage.dtype())?;
    // The moments are f32 beside an f32 master, else in the parameter's dtype.
    let state_dtype = match p.master {
        Some(_) if matches!(dtype, DType::F16 | DType::BF16) => DType::F32,
        Some(_) => {
            return Err(Error::invalid(
                OP,
                format!("master weights are for f16/bf16 parameters, this one is {dtype}"),
            ));
        }
        None => dtype,
    };
    for s in [p.exp_avg, p.exp_avg_sq].into_iter().chain(p.master) {
        check::same_dtype(OP, state_dtype, s.dtype())?;
    }
    let n = p.param.len();
    let l = p.grad.layout;
    if !l.is_contiguous() || l.numel() != n || l.offset() + n > p.grad.storage.len() {
        return Err(Error::invalid(
            OP,
            format!(
                "each gradient must be contiguous with its parameter's {n} elements, got shape {:?}",
                l.shape()
            ),
        ));
    }
    let state = [p.exp_avg, p.exp_avg_sq].into_iter().chain(p.master);
    if let Some(s) = state.clone().find(|s| s.len() != n) {
        return Err(Error::shape(
            OP,
            format!(
                "a state buffer of {} elements for a parameter of {n}",
                s.len()
            ),
        ));
    }
    let all: Vec<&Storage> = [p.grad.storage, p.param].into_iter().chain(state).collect();
    check::distinct(
        OP,
        &all,
        "gradient, parameter and state buffers must be distinct storages",
    )
}

/// Bumps the versions of the gradients.
pub fn unscale_check(a: &UnscaleCheck) -> Result<()> {
    const OP: &str = "unscale_check";
    let (flag, device) = (a.found_inf, a.found_inf.device());
    if flag.dtype() != DType::F32 || flag.len() != 1 {
        return Err(Error::invalid(
            OP,
            format!(
                "found_inf must be a one-element F32 tensor, got {} elements of {}",
                flag.len(),
                flag.dtype()
            ),
        ));
    }
    for g in a.grads {
        if !g.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype: g.dtype(),
                hint: "gradients must be floating point",
            });
        }
    }
    check::on_device(OP, device, a.grads.iter().copied())?;
    if let Some(inv) = &a.inv_scale_at {
        check::on_device(OP, device, [inv.storage])?;
        check::dense(OP, "1/scale", inv, 1, DType::F32)?;
    }
    const SHARED: &str =
        "the flag and the gradients must be distinct storages; pass each gradient once";
    if a.grads.iter().any(|g| g.same(flag)) {
        return Err(Error::invalid(OP, SHARED));
    }
    check::distinct(OP, a.grads, SHARED)?;
    backend(device)?.unscale_check(a)?;
    a.grads.iter().for_each(|g| g.bump_version());
    Ok(())
}

/// Bumps the count's version.
pub fn count_step(a: &CountStep) -> Result<()> {
    const OP: &str = "count_step";
    let device = a.count.device();
    check::out(OP, a.count, 1, DType::F64)?;
    if let Some(flag) = &a.skip_if {
        check::on_device(OP, device, [flag.storage])?;
        check::dense(OP, "the skip flag", flag, 1, DType::F32)?;
    }
    backend(device)?.count_step(a)?;
    a.count.bump_version();
    Ok(())
}

/// Bumps the versions of the state and the report.
pub fn update_scale(a: &UpdateScale) -> Result<()> {
    const OP: &str = "update_scale";
    let device = a.state.device();
    check::out(OP, a.state, 3, DType::F32)?;
    check::on_device(OP, device, [a.found_inf.storage])?;
    check::dense(OP, "found_inf", &a.found_inf, 1, DType::F32)?;
    if let Some(r) = a.report {
        check::out(OP, r, 2, DType::F32)?;
        check::on_device(OP, device, [r])?;
        check::distinct(
            OP,
            &[a.state, r],
            "the state and the report must be distinct storages",
        )?;
    }
    if !(1..=MAX_DEVICE_GROWTH_INTERVAL).contains(&a.growth_interval) {
        return Err(Error::invalid(
            OP,
            format!(
                "a scale updated on the device counts up to {MAX_DEVICE_GROWTH_INTERVAL} clean steps, got a growth_interval of {}; update it on the host (GradScaler without stage_on)",
                a.growth_interval
            ),
        ));
    }
    backend(device)?.update_scale(a)?;
    a.state.bump_version();
    a.report.iter().for_each(|r| r.bump_version());
    Ok(())
}

/// The scalars of one Adam step, derived on the host in f64 once so that every backend
/// rounds the same values to its compute type.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AdamScalars {
    /// g ← g + l2·p (0 unless coupled weight decay)
    pub l2: f64,
    /// p ← p·decay first (1 unless decoupled weight decay)
    pub decay: f64,
    /// lerp weight of the first moment, 1 − β1
    pub w1: f64,
    pub beta2: f64,
    /// 1 − β2
    pub w2: f64,
    /// √(1 − β2^t)
    pub bc2_sqrt: f64,
    /// −lr / (1 − β1^t)
    pub neg_step_size: f64,
    pub eps: f64,
    /// The gradient scale's value where the backend reads it on the host (the CPU's).
    pub grad_scale: Option<f64>,
}

impl AdamScalars {
    /// The bias corrections use `powf` of the step as a float, as torch/optim/adam.py does
    /// (`beta1 ** step`).
    pub(crate) fn of(a: &AdamStep) -> AdamScalars {
        AdamScalars::at(a, a.step as f64)
    }

    /// The scalars of step `a` with the bias corrections of step `t`.
    pub(crate) fn at(a: &AdamStep, t: f64) -> AdamScalars {
        let bc1 = 1.0 - a.beta1.powf(t);
        let bc2 = 1.0 - a.beta2.powf(t);
        let wd = a.weight_decay;
        AdamScalars {
            l2: if a.decoupled { 0.0 } else { wd },
            decay: if a.decoupled { 1.0 - a.lr * wd } else { 1.0 },
            w1: 1.0 - a.beta1,
            beta2: a.beta2,
            w2: 1.0 - a.beta2,
            bc2_sqrt: bc2.sqrt(),
            neg_step_size: -(a.lr / bc1),
            eps: a.eps,
            grad_scale: None,
        }
    }
}
