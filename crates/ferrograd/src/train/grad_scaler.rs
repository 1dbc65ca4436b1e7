//! Gradient scaling for mixed precision: `GradScaler`, with torch.amp.GradScaler's semantics.
//!
//! f16 gradients underflow where f32 ones would not, so the loss is multiplied by a large
//! scale before backward and the gradients divided by it before the optimizer step:
//!
//! ```text
//! opt.zero_grad()?;
//! scaler.scale(&loss)?.backward()?;
//! scaler.unscale_(&opt)?;              // optional: only to clip or inspect true gradients
//! clip_grad_norm(opt.params(), 1.0, 2.0, false)?;
//! scaler.step(&mut opt)?;              // skips the step when a gradient is inf or NaN
//! scaler.update()?;                    // backs off on overflow, grows after clean steps
//! ```
//!
//! The scale is kept as an f32, like PyTorch's scale tensor: 1/scale is taken in f64 and
//! rounded to f32; backoff and growth multiply in f64 and round to f32; growth that would
//! reach inf is skipped. Unscaling is one fused backend call per device
//! (`backend::optim::unscale_check`: one kernel launch per dtype on a GPU), and the found_inf flags
//! are read back once per iteration, when `step` (or `update`) first needs them.
//!
//! A step that must not wait for the device (any GPU step: a captured CUDA graph, replayed
//! with no host work between its kernels, or an eager one that queues the next step while
//! the GPU runs this one) keeps the whole decision there instead (`stage_on`): the scale,
//! 1/scale and the growth tracker live in device memory, the optimizer skips its update on
//! the device when the flag is raised (`step_on_device`), and the device updates the scale
//! (`update_on_device`, torch's `_amp_update_scale_`). Nothing is read back; the step's
//! verdict and new scale arrive as a `Readout`, read when a log line shows them:
//!
//! ```text
//! scaler.stage_on(device)?;                        // once
//! scaler.scale(&loss)?.backward()?;                // loss · the staged scale
//! scaler.unscale_(&opt)?;                          // gradients · the staged 1/scale
//! let flag = scaler.step_on_device(&mut opt)?;     // the update, skipped on the device on inf
//! let report = scaler.update_on_device(&flag)?;    // [found inf, new scale], read later
//! ```
//!
//! `get_scale`, `growth_tracker` and `state_tensors` then read the device (waiting for it),
//! as PyTorch's `get_scale` does; the optimizer's step counts stay on the device until
//! `Optimizer::settle_counts`.

use std::sync::Arc;

use crate::autograd::no_grad;
use crate::backend::Storage;
use crate::backend::optim::{self, MAX_DEVICE_GROWTH_INTERVAL, UnscaleCheck, UpdateScale};
use crate::base::{Error, Result};
use crate::memory::Category;
use crate::optim::Optimizer;
use crate::tensor::{DType, Device, Layout, Readout, Tensor};

const OP: &str = "GradScaler";
/// Names of the state tensors (see `GradScaler::state_tensors`).
const SCALE_KEY: &str = "scaler.scale";
const TRACKER_KEY: &str = "scaler.growth_tracker";
const LOAD: &str = "GradScaler::load_state_tensors";

/// The factors of a `GradScaler`; `Default` is torch.amp.GradScaler's.
#[derive(Clone, Debug, PartialEq)]
pub struct GradScalerConfig {
    /// The first scale (rounded to f32). Default 2^16.
    pub init_scale: f64,
    /// Multiplies the scale after `growth_interval` clean steps in a row. Default 2.
    pub growth_factor: f64,
    /// Multiplies the scale after a step with inf/NaN gradients. Default 0.5.
    pub backoff_factor: f64,
    /// Clean steps in a row before the scale grows. Default 2000.
    pub growth_interval: u64,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// Where one optimizer is in the current iteration (PyTorch's OptState; "ready" = no record).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Unscaled,
    Stepped,
}

/// One optimizer's record for the current iteration.
struct OptRecord {
    /// The optimizer's identity: the addresses of its parameters' storages.
    key: Vec<usize>,
    stage: Stage,
    /// One found_inf flag per device that held gradients (empty: there were none).
    flags: Vec<Tensor>,
    /// The flags read back (once).
    found: Option<bool>,
}

impl OptRecord {
    /// Whether any gradient was inf or NaN; reads the flags back the first time.
    fn found_inf(&mut self) -> Result<bool> {
        if let Some(f) = self.found {
            return Ok(f);
        }
        let mut any = false;
        for flag in &self.flags {
            any |= flag.to_vec::<f32>()?.iter().any(|&v| v != 0.0);
        }
        self.found = Some(any);
        Ok(any)
    }
}

/// Where a run's loss-scaling decisions are made, for logs: `Display` says it in words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossScaling {
    /// The skip, the optimizer's step count and the scale's update stay on the device.
    OnDevice,
    /// The host reads the inf/NaN check before every step.
    OnHost,
}

impl std::fmt::Display for LossScaling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LossScaling::OnDevice => f.write_str(
                "decided on the device (the skip, the step count and the scale's update stay there; nothing is read back)",
            ),
            LossScaling::OnHost => {
                f.write_str("decided on the host (the inf/NaN check is read before every step)")
            }
        }
    }
}

/// Dynamic loss scaling (torch.amp.GradScaler). Several optimizers may share one scaler:
/// each is unscaled and stepped once per iteration, and `update` combines their checks.
pub struct GradScaler {
    cfg: GradScalerConfig,
    /// The scale and tracker as the host last knew them: behind the device's while
    /// `device_ahead` (updates on the device since the last read).
    scale: f32,
    growth_tracker: u64,
    device_ahead: bool,
    records: Vec<OptRecord>,
    staged: Option<Staged>,
}

/// The scaler's state in device memory: what a step that does not wait for the device reads
/// instead of kernel arguments, and what the device's update rewrites.
struct Staged {
    /// F32 [scale, 1/scale, growth tracker (exact to 2^24)].
    state: Tensor,
}

impl Staged {
    fn new(device: Device) -> Result<Staged> {
        let state = Tensor::alloc(
            &[3],
            DType::F32,
            device,
            Category::OptimizerState,
            "grad_scaler_state",
        )?;
        Ok(Staged { state })
    }

    fn device(&self) -> Device {
        self.state.device()
    }

    /// Element `i` of the state as a 0-dim view.
    fn element(&self, i: usize) -> Tensor {
        self.state
            .with_layout(Layout::new(Vec::new(), Vec::new(), i))
    }

    /// The scale (a 0-dim view).
    fn scale(&self) -> Tensor {
        self.element(0)
    }

    /// 1/scale (a 0-dim view).
    fn inv_scale(&self) -> Tensor {
        self.element(1)
    }

    /// Writes the host's scale and tracker (in stream order with the device's kernels).
    fn write(&self, scale: f32, tracker: u64) -> Result<()> {
        let _g = no_grad();
        let values = vec![scale, inv_of(scale), tracker as f32];
        self.state
            .copy_(&Tensor::from_vec(values, &[3], self.device())?)
    }

    /// The scale and tracker the device holds (waits for it).
    fn read(&self) -> Result<(f32, u64)> {
        let v = self.state.to_vec::<f32>()?;
        Ok((v[0], v[2] as u64))
    }
}

/// 1/scale as PyTorch takes it: in f64, rounded to f32.
fn inv_of(scale: f32) -> f32 {
    optim::inv_scale_of(scale)
}

impl Default for GradScaler {
    fn default() -> Self {
        GradScaler::new()
    }
}

impl GradScaler {
    /// A scaler with PyTorch's defaults (scale 65536, growth 2, backoff 0.5, interval 2000).
    pub fn new() -> GradScaler {
        let cfg = GradScalerConfig::default();
        GradScaler {
            scale: cfg.init_scale as f32,
            growth_tracker: 0,
            device_ahead: false,
            cfg,
            records: Vec::new(),
            staged: None,
        }
    }

    /// A scaler with the given factors: init_scale must be positive and finite in f32,
    /// growth_factor finite and > 1, backoff_factor in (0, 1), growth_interval ≥ 1.
    pub fn with_config(cfg: GradScalerConfig) -> Result<GradScaler> {
        let scale = cfg.init_scale as f32;
        if !(scale > 0.0 && scale.is_finite()) {
            return Err(Error::invalid(
                OP,
                format!(
                    "init_scale must be a positive number that is finite as an f32 (at most {:e}), got {}",
                    f32::MAX,
                    cfg.init_scale
                ),
            ));
        }
        if !(cfg.growth_factor > 1.0 && cfg.growth_factor.is_finite()) {
            return Err(Error::invalid(
                OP,
                format!(
                    "growth_factor must be a finite number > 1, got {}",
                    cfg.growth_factor
                ),
            ));
        }
        if !(cfg.backoff_factor > 0.0 && cfg.backoff_factor < 1.0) {
            return Err(Error::invalid(
                OP,
                format!(
                    "backoff_factor must lie strictly between 0 and 1, got {}",
                    cfg.backoff_factor
                ),
            ));
        }
        if cfg.growth_interval == 0 {
            return Err(Error::invalid(
                OP,
                "growth_interval must be at least 1 (clean steps before the scale grows)",
            ));
        }
        Ok(GradScaler {
            scale,
            growth_tracker: 0,
            device_ahead: false,
            cfg,
            records: Vec::new(),
            staged: None,
        })
    }

    pub fn config(&self) -> &GradScalerConfig {
        &self.cfg
    }

    /// The current scale (an f32 value); reads the device (waiting for it) after updates
    /// made there (`update_on_device`).
    pub fn get_scale(&self) -> Result<f64> {
        Ok(self.current()?.0 as f64)
    }

    /// Clean steps in a row since the scale last changed (or backed off); reads the device
    /// as `get_scale` does.
    pub fn growth_tracker(&self) -> Result<u64> {
        Ok(self.current()?.1)
    }

    /// The scale and tracker now: the host's, or the device's when it is ahead (a planned
    /// device holds no values: the host's stand for them).
    fn current(&self) -> Result<(f32, u64)> {
        match &self.staged {
            Some(s) if self.device_ahead && s.device() != Device::Meta => s.read(),
            _ => Ok((self.scale, self.growth_tracker)),
        }
    }

    /// Brings the host's scale and tracker up to the device's (waiting for it, if it is
    /// ahead), before the host computes with them.
    fn catch_up(&mut self) -> Result<()> {
        (self.scale, self.growth_tracker) = self.current()?;
        self.device_ahead = false;
        Ok(())
    }

    /// Keeps the scale in memory on `device` from now on (see the module doc): `scale` and
    /// `unscale_` read it there, and updates are made there (`update_on_device`) or written
    /// there. Moves it if it was staged on another device. The growth interval must be at
    /// most 2^24 (the device counts clean steps in an f32).
    pub fn stage_on(&mut self, device: Device) -> Result<()> {
        if self.staged_on(device).is_some() {
            return Ok(());
        }
        if self.cfg.growth_interval > MAX_DEVICE_GROWTH_INTERVAL {
            return Err(Error::invalid(
                "GradScaler::stage_on",
                format!(
                    "a scale kept on the device grows after at most {MAX_DEVICE_GROWTH_INTERVAL} clean steps, this scaler's growth_interval is {}; keep it on the host",
                    self.cfg.growth_interval
                ),
            ));
        }
        self.catch_up()?;
        self.staged = Some(Staged::new(device)?);
        self.restage()
    }

    /// The device whose memory holds the scale, once `stage_on` was called.
    pub fn staged_device(&self) -> Option<Device> {
        self.staged.as_ref().map(Staged::device)
    }

    /// Where this scaler's decisions are made (`stage_on` moves them to the device).
    pub fn decided(&self) -> LossScaling {
        match self.staged {
            Some(_) => LossScaling::OnDevice,
            None => LossScaling::OnHost,
        }
    }

    fn staged_on(&self, device: Device) -> Option<&Staged> {
        self.staged.as_ref().filter(|s| s.device() == device)
    }

    /// Rewrites the staged state after a change made on the host.
    fn restage(&self) -> Result<()> {
        match &self.staged {
            Some(s) => s.write(self.scale, self.growth_tracker),
            None => Ok(()),
        }
    }

    /// loss · scale, with autograd (backward of the result gives scaled gradients), as
    /// PyTorch multiplies by its f32 scale tensor: a 0-dim f16/bf16 loss is widened to f32
    /// (type promotion; scaled half losses overflow easily), a larger half loss keeps its
    /// dtype with the product taken in f32 (the scale itself may not fit it: 65536 is inf in
    /// f16), f32 and f64 losses multiply in their own dtype. With the scale staged on the
    /// loss's device, the product reads it there.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        let dtype = loss.dtype();
        if !dtype.is_float() {
            return Err(Error::UnsupportedDType {
                op: "GradScaler::scale",
                dtype,
                hint: "the loss must be floating point",
            });
        }
        let times_scale = |l: &Tensor| match self.staged_on(l.device()) {
            // A 0-dim view of the staged value: the product broadcasts it over the loss.
            Some(s) => {
                let scale = s.scale();
                match l.dtype() {
                    DType::F32 => l.mul(&scale),
                    other => l.mul(&scale.to_dtype(other)?),
                }
            }
            None => l.mul_scalar(self.current()?.0 as f64),
        };
        match dtype {
            DType::F16 | DType::BF16 if loss.dims() == 0 => {
                times_scale(&loss.to_dtype(DType::F32)?)
            }
            DType::F16 | DType::BF16 => times_scale(&loss.to_dtype(DType::F32)?)?.to_dtype(dtype),
            _ => times_scale(loss),
        }
    }

    /// Divides the gradients of `opt`'s parameters by the scale, in place, and records
    /// whether any was inf or NaN (checked on the scaled values). Parameters without a
    /// gradient are skipped. F16 gradients are an error (keep f32 master weights: autocast
    /// computes in f16, parameters and their gradients stay f32). Calling it twice for one
    /// optimizer before `update`, or after `step`, is an error.
    pub fn unscale_<O: Optimizer + ?Sized>(&mut self, opt: &O) -> Result<()> {
        let key = key_of(opt.params());
        match self.record(&key).map(|r| r.stage) {
            Some(Stage::Unscaled) => {
                return Err(Error::invalid(
                    "GradScaler::unscale_",
                    "unscale_() has already been called on this optimizer since the last update(); call it at most once per iteration",
                ));
            }
            Some(Stage::Stepped) => {
                return Err(Error::invalid(
                    "GradScaler::unscale_",
                    "unscale_() is being called after step(); unscale before stepping, and call update() to start the next iteration",
                ));
            }
            None => {}
        }
        let flags = self.unscale_grads(opt.params())?;
        self.records.push(OptRecord {
            key,
            stage: Stage::Unscaled,
            flags,
            found: None,
        });
        Ok(())
    }

    /// Unscales (unless `unscale_` already did this iteration), then runs `opt.step()` only
    /// if no gradient was inf or NaN. Returns whether the optimizer stepped. Calling it twice
    /// before `update` is an error, as is stepping an optimizer none of whose parameters has
    /// a gradient (PyTorch: "No inf checks were recorded for this optimizer").
    pub fn step<O: Optimizer + ?Sized>(&mut self, opt: &mut O) -> Result<bool> {
        let i = self.record_to_step(
            opt,
            "GradScaler::step",
            "step() has already been called since the last update(); call update() once per iteration, after step()",
        )?;
        let found = self.records[i].found_inf()?;
        if !found {
            opt.step()?;
        }
        self.records[i].stage = Stage::Stepped;
        Ok(!found)
    }

    /// Ends the iteration: if any optimizer's gradients held inf/NaN, scale ← scale ·
    /// backoff_factor and the tracker restarts; otherwise the tracker counts one more clean
    /// step, and at growth_interval the scale grows by growth_factor (unless that would be
    /// inf) and the tracker restarts. An error when no gradient was checked since the last
    /// update (call `step` or `unscale_` first).
    pub fn update(&mut self) -> Result<()> {
        if self.records.iter().all(|r| r.flags.is_empty()) {
            return Err(Error::invalid(
                "GradScaler::update",
                "no inf checks were recorded prior to update(): call step(opt) (or unscale_(opt)) after backward() on the scaled loss",
            ));
        }
        let mut found = false;
        for r in &mut self.records {
            found |= r.found_inf()?;
        }
        self.catch_up()?;
        self.update_scale(found);
        self.records.clear();
        self.restage()
    }

    /// `step` for a scaler staged on the optimizer's device, without reading anything back:
    /// unscales (unless `unscale_` already did this iteration), then hands the check's flag
    /// to the optimizer, whose update the device skips when the flag is raised. Returns the
    /// flag (one F32 element, nonzero: inf or NaN found), for `update_on_device`, which ends
    /// the iteration. The gradients must all be on the staged device.
    pub fn step_on_device<O: Optimizer + ?Sized>(&mut self, opt: &mut O) -> Result<Tensor> {
        const STEP: &str = "GradScaler::step_on_device";
        if !opt.skips_on_device() {
            return Err(Error::invalid(
                STEP,
                format!(
                    "{} cannot skip its update on the device; use GradScaler::step",
                    opt.name()
                ),
            ));
        }
        let Some(device) = self.staged_device() else {
            return Err(Error::invalid(
                STEP,
                "the scale is not staged on a device: call stage_on(device) first, or use GradScaler::step",
            ));
        };
        let i = self.record_to_step(
            opt,
            STEP,
            "the optimizer has already stepped since the last update; end each iteration with update_on_device(flag)",
        )?;
        let record = &mut self.records[i];
        let flag = match record.flags.as_slice() {
            [flag] if flag.device() == device => flag.clone(),
            _ => {
                return Err(Error::invalid(
                    STEP,
                    "a step decided on the device needs every gradient on the device the scale is staged on (stage_on)",
                ));
            }
        };
        record.stage = Stage::Stepped;
        opt.step_unless_found_inf(&flag)?;
        Ok(flag)
    }

    /// Ends the iteration on the device after `step_on_device`: the scale, 1/scale and the
    /// tracker are updated there from `found_inf` (the flag it returned), as `update` would
    /// on the host, without reading anything back. Returns the iteration's report: [1 if
    /// inf/NaN was found (the step was skipped) else 0, the new scale], read when looked at.
    pub fn update_on_device(&mut self, found_inf: &Tensor) -> Result<Readout> {
        const OP: &str = "GradScaler::update_on_device";
        let Some(staged) = self.staged_on(found_inf.device()) else {
            return Err(Error::invalid(
                OP,
                "the scale is not staged on the flag's device: call stage_on(device) before the step, or use update()",
            ));
        };
        if self.records.len() > 1 {
            return Err(Error::invalid(
                OP,
                "several optimizers were checked this iteration and the device reads one flag; end it with update()",
            ));
        }
        let report = Tensor::alloc(
            &[2],
            DType::F32,
            found_inf.device(),
            Category::Temporary,
            "grad_scaler_report",
        )?;
        optim::update_scale(&UpdateScale {
            found_inf: found_inf.view(),
            state: staged.state.storage(),
            report: Some(report.storage()),
            growth_factor: self.cfg.growth_factor,
            backoff_factor: self.cfg.backoff_factor,
            growth_interval: self.cfg.growth_interval,
        })?;
        self.device_ahead = true;
        self.records.clear();
        Ok(Readout::pending(report))
    }

    /// Forgets this iteration's unscale and step records, changing no scale (a captured
    /// step that failed: nothing it recorded ran).
    pub fn discard_iteration(&mut self) {
        self.records.clear();
    }

    /// torch's `_amp_update_scale_` on the host's values (`optim::next_scale`).
    fn update_scale(&mut self, found_inf: bool) {
        let c = &self.cfg;
        let factors = (c.growth_factor, c.backoff_factor, c.growth_interval);
        (self.scale, self.growth_tracker) =
            optim::next_scale((self.scale, self.growth_tracker), found_inf, factors);
    }

    /// The scaler's state for a checkpoint: `scaler.scale` (F32, 0-dim) and
    /// `scaler.growth_tracker` (I64, 0-dim), on the CPU. The factors are configuration and
    /// are not included.
    pub fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let (scale, tracker) = self.current()?;
        let tracker = i64::try_from(tracker).map_err(|_| {
            Error::invalid(OP, "the growth tracker does not fit in an i64 state tensor")
        })?;
        Ok(vec![
            (
                SCALE_KEY.to_string(),
                Tensor::from_vec(vec![scale], &[], Device::Cpu)?,
            ),
            (
                TRACKER_KEY.to_string(),
                Tensor::from_vec(vec![tracker], &[], Device::Cpu)?,
            ),
        ])
    }

    /// Restores `scaler.scale` and `scaler.growth_tracker` from named tensors (other names
    /// are ignored, so a whole checkpoint can be passed). Both must be present, 0-dim, of
    /// dtype F32 and I64; the scale positive and finite, the tracker in 0..growth_interval.
    /// Nothing changes on error.
    pub fn load_state_tensors(&mut self, tensors: &[(String, Tensor)]) -> Result<()> {
        let scale = state_tensor(tensors, SCALE_KEY, DType::F32)?.to_vec::<f32>()?[0];
        let tracker = state_tensor(tensors, TRACKER_KEY, DType::I64)?.to_vec::<i64>()?[0];
        if !(scale > 0.0 && scale.is_finite()) {
            return Err(Error::invalid(
                LOAD,
                format!("{SCALE_KEY} must be positive and finite, got {scale}"),
            ));
        }
        let interval = self.cfg.growth_interval;
        let tracker = u64::try_from(tracker)
            .ok()
            .filter(|&t| t < interval)
            .ok_or_else(|| {
                Error::invalid(
                    LOAD,
                    format!(
                        "{TRACKER_KEY} must lie in 0..{interval} (this scaler's growth_interval), got {tracker}"
                    ),
                )
            })?;
        self.scale = scale;
        self.growth_tracker = tracker;
        self.device_ahead = false;
        self.restage()
    }

    /// The index of `opt`'s record for a step this iteration: unscaled first unless
    /// `unscale_` already did it; an error (`twice`) if it already stepped, or when none of
    /// its parameters had a gradient to check.
    fn record_to_step<O: Optimizer + ?Sized>(
        &mut self,
        opt: &O,
        op: &'static str,
        twice: &'static str,
    ) -> Result<usize> {
        let key = key_of(opt.params());
        match self.record(&key).map(|r| r.stage) {
            Some(Stage::Stepped) => return Err(Error::invalid(op, twice)),
            Some(Stage::Unscaled) => {}
            None => self.unscale_(opt)?,
        }
        let i = self
            .records
            .iter()
            .position(|r| r.key == key)
            .ok_or_else(|| Error::invalid(op, "the unscale record is missing"))?;
        if self.records[i].flags.is_empty() {
            return Err(Error::invalid(
                op,
                "no inf checks were recorded for this optimizer: none of its parameters has a gradient; call backward() on the scaled loss first",
            ));
        }
        Ok(i)
    }

    fn record(&self, key: &[usize]) -> Option<&OptRecord> {
        self.records.iter().find(|r| r.key == key)
    }

    /// Unscales every gradient of `params`, one fused call per device; the found_inf flags.
    /// All gradients are checked before any is touched.
    fn unscale_grads(&self, params: &[Tensor]) -> Result<Vec<Tensor>> {
        let _g = no_grad();
        let mut pairs: Vec<(&Tensor, Tensor)> = Vec::new();
        for (i, p) in params.iter().enumerate() {
            let Some(g) = p.grad() else { continue };
            check_grad_dtype(i, &g)?;
            pairs.push((p, g));
        }
        let mut per_device: Vec<(Device, Vec<Tensor>)> = Vec::new();
        let covered = covered_storages(&pairs);
        for (p, g) in pairs {
            let g = match covered.iter().find(|c| c.shares_storage(&g)) {
                Some(whole) => whole.clone(),
                None => owned_grad(p, g)?,
            };
            match per_device.iter_mut().find(|(d, _)| *d == g.device()) {
                Some((_, v)) => v.push(g),
                None => per_device.push((g.device(), vec![g])),
            }
        }
        let mut flags = Vec::with_capacity(per_device.len());
        for (device, grads) in per_device {
            let staged = self.staged_on(device).map(Staged::inv_scale);
            // Where the scale is not staged, 1/scale as the host knows it (or reads it).
            let inv_scale = match staged {
                Some(_) => 1.0,
                None => inv_of(self.current()?.0),
            };
            flags.push(unscale_on(device, &grads, inv_scale, staged.as_ref())?);
        }
        Ok(flags)
    }
}

/// One fused unscale over `grads` (all on `device`, each owning its storage) by `inv_scale`,
/// or by the value held in `staged` (one F32 element on `device`); the flag.
fn unscale_on(
    device: Device,
    grads: &[Tensor],
    inv_scale: f32,
    staged: Option<&Tensor>,
) -> Result<Tensor> {
    let flag = Tensor::alloc(
        &[1],
        DType::F32,
        device,
        Category::Temporary,
        "grad_scaler_found_inf",
    )?;
    let mut storages: Vec<&Storage> = Vec::with_capacity(grads.len());
    for g in grads {
        // Two parameters sharing one gradient storage must not be unscaled twice.
        if !storages.iter().any(|s| s.same(g.storage())) {
            storages.push(g.storage());
        }
    }
    // The entry function bumps every gradient's version.
    optim::unscale_check(&UnscaleCheck {
        found_inf: flag.storage(),
        grads: &storages,
        inv_scale,
        inv_scale_at: staged.map(Tensor::view),
    })?;
    Ok(flag)
}

/// PyTorch refuses to unscale f16 gradients (their unscaled values lose range and precision).
fn check_grad_dtype(index: usize, g: &Tensor) -> Result<()> {
    match g.dtype() {
        DType::F16 => Err(Error::invalid(
            "GradScaler::unscale_",
            format!(
                "attempting to unscale FP16 gradients (parameter {index}); keep the master weights in f32 (autocast computes in f16, the parameters and their gradients stay f32)"
            ),
        )),
        d if !d.is_float() => Err(Error::UnsupportedDType {
            op: "GradScaler::unscale_",
            dtype: d,
            hint: "gradients must be floating point",
        }),
        _ => Ok(()),
    }
}

/// Storages that these gradients are contiguous, disjoint slices of and cover whole (the
/// buckets of data-parallel training, whose slices are the gradients): each is unscaled as
/// one tensor, so the gradients stay views instead of being copied out.
fn covered_storages(pairs: &[(&Tensor, Tensor)]) -> Vec<Tensor> {
    let mut groups: Vec<(Tensor, Vec<(usize, usize)>)> = Vec::new();
    for (_, g) in pairs {
        let owns = g.layout().offset() == 0 && g.numel() == g.storage().len();
        if owns || !g.is_contiguous() {
            continue;
        }
        let span = (g.layout().offset(), g.numel());
        match groups.iter_mut().find(|(t, _)| t.shares_storage(g)) {
            Some((_, spans)) => spans.push(span),
            None => groups.push((g.clone(), vec![span])),
        }
    }
    groups
        .into_iter()
        .filter_map(|(g, mut spans)| {
            spans.sort_unstable();
            let mut end = 0;
            for (start, n) in spans {
                if start != end {
                    return None;
                }
                end = start + n;
            }
            let len = g.storage().len();
            (end == len).then(|| g.with_layout(crate::tensor::Layout::contiguous(&[len])))
        })
        .collect()
}

/// The gradient as a tensor owning its whole storage (the fused op writes whole storages): a
/// view is replaced by an owned copy that becomes the parameter's `.grad`.
fn owned_grad(p: &Tensor, g: Tensor) -> Result<Tensor> {
    let owns = g.is_contiguous() && g.layout().offset() == 0 && g.numel() == g.storage().len();
    if owns {
        return Ok(g);
    }
    let copy = g.contiguous_owned()?;
    p.set_grad(Some(copy.clone()))?;
    Ok(copy)
}

/// An optimizer's identity across calls: its parameters' storages (alive while it is).
fn key_of(params: &[Tensor]) -> Vec<usize> {
    params
        .iter()
        .map(|p| Arc::as_ptr(p.storage()) as usize)
        .collect()
}

/// The 0-dim state tensor `name` of `dtype` (exactly one).
fn state_tensor<'a>(
    tensors: &'a [(String, Tensor)],
    name: &str,
    dtype: DType,
) -> Result<&'a Tensor> {
    let mut found = tensors.iter().filter(|(n, _)| n == name);
    let t = match (found.next(), found.next()) {
        (Some((_, t)), None) => t,
        (None, _) => {
            return Err(Error::invalid(
                LOAD,
                format!("the state has no '{name}' tensor; save it with GradScaler::state_tensors"),
            ));
        }
        (Some(_), Some(_)) => {
            return Err(Error::invalid(
                LOAD,
                format!("'{name}' appears more than once in the state"),
            ));
        }
    };
    if t.dtype() != dtype || !t.shape().is_empty() {
        return Err(Error::invalid(
            LOAD,
            format!(
                "'{name}' must be a 0-dim {dtype} tensor, got {} of shape {:?}",
                t.dtype(),
                t.shape()
            ),
        ));
    }
    Ok(t)
}
