//! Adam and AdamW: PyTorch's algorithm (torch/optim/adam.py, single-tensor form), t = the
//! parameter's step count after this step:
//!
//!   p ← p·(1 − lr·wd)                  (AdamW, decoupled weight decay)
//!   g ← grad + wd·p                    (Adam, L2 weight decay)
//!   m ← β1·m + (1 − β1)·g               (as torch's lerp)
//!   v ← β2·v + (1 − β2)·g²
//!   p ← p − lr/(1 − β1^t) · m / (√v / √(1 − β2^t) + eps)
//!
//! exp_avg (m) and exp_avg_sq (v) are created, zeroed, at a parameter's first step and count
//! as optimizer state.
//!
//! Master weights (`with_master_weights`), for a model kept in f16/bf16 (no autocast, so no
//! per-step weight casts): each half-precision parameter gets an f32 copy and f32 moments,
//! all optimizer state. The step updates the copy exactly as it would an f32 parameter fed
//! the gradient widened to f32, then stores it rounded into the parameter, so small updates
//! accumulate instead of being rounded away. A whole step is one fused backend call per (device, step count) group
//! of parameters: one kernel launch on a GPU, however many parameters there are.
//!
//! A step that the device may skip (`step_unless_found_inf`, a GradScaler's inf/NaN check)
//! keeps its step count on the device: the kernels take their bias corrections from it, and
//! one more kernel counts the step unless the flag is raised. The host never waits for the
//! flag; it learns the counts when it asks (`settle_counts`), which waits for the device.

use super::device_count::DeviceCount;
use super::{Optimizer, check_lr};
use crate::autograd::no_grad;
use crate::backend::capture;
use crate::backend::optim::{self, AdamParam, AdamStep};
use crate::base::{Error, Result};
use crate::memory::Category;
use crate::tensor::{DType, Device, Tensor};

#[derive(Clone, Debug)]
pub struct AdamConfig {
    pub lr: f64,
    /// (β1, β2)
    pub betas: (f64, f64),
    pub eps: f64,
    /// L2 penalty for `Adam::new`, decoupled decay for `Adam::adamw`.
    pub weight_decay: f64,
}

impl Default for AdamConfig {
    /// torch.optim.Adam's defaults (AdamW's weight decay default is 0.01: see `adamw_default`).
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

impl AdamConfig {
    /// torch.optim.AdamW's defaults: Adam's with weight_decay = 0.01.
    pub fn adamw_default() -> Self {
        AdamConfig {
            weight_decay: 1e-2,
            ..AdamConfig::default()
        }
    }
}

/// The state of one parameter: its moments, how many steps it has taken, and with master
/// weights its f32 copy (then the moments are f32 too).
#[derive(Clone, Debug)]
pub struct AdamState {
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
    pub step: u64,
    pub master: Option<Tensor>,
}

pub struct Adam {
    params: Vec<Tensor>,
    cfg: AdamConfig,
    decoupled: bool,
    state: Vec<Option<AdamState>>,
    steps: u64,
    /// f16/bf16 parameters keep an f32 master copy.
    master_weights: bool,
    /// For CUDA graphs: the device memory the replayed step reads its scalars from, and the
    /// bookkeeping of the captured step.
    graph: GraphStep,
    /// While steps are skipped or not on the device: the count it keeps. Every member's
    /// host count, and the optimizer's, stay as they were when the host last read it.
    device_count: Option<DeviceCount>,
}

/// The optimizer's step count and each parameter's (None: no state yet), to restore.
type Counts = (u64, Vec<Option<u64>>);

/// What a graph-replayed Adam step keeps between steps.
#[derive(Default)]
struct GraphStep {
    /// `ADAM_SCALAR_BYTES` on the parameters' device, staged before each capture or replay.
    slot: Option<Tensor>,
    /// The parameters the captured step updated (their step counts advance per replay), and
    /// whether it was a whole step (which the optimizer's own count counts) or steps of
    /// single parameters (a step in backward).
    members: Vec<usize>,
    whole: bool,
    /// Set before a capture or replay: the next captured update starts a new member list.
    fresh: bool,
    /// The step counts before the capture, to undo (with the device's steps issued).
    before: Option<(Counts, u64)>,
}

impl GraphStep {
    /// Records that a captured update (whole or of one parameter) steps `indices`.
    fn record(&mut self, indices: impl Iterator<Item = usize>, whole: bool) {
        if std::mem::take(&mut self.fresh) {
            self.members.clear();
        }
        self.whole = whole;
        for i in indices {
            if !self.members.contains(&i) {
                self.members.push(i);
            }
        }
    }
}

/// One parameter to update this step.
struct Work {
    index: usize,
    grad: Tensor,
}

impl Adam {
    /// Adam; `weight_decay` is an L2 penalty added to the gradient.
    pub fn new(params: Vec<Tensor>, cfg: AdamConfig) -> Result<Adam> {
        Adam::build(params, cfg, false)
    }

    /// AdamW; `weight_decay` shrinks the parameter by (1 − lr·wd) before the Adam update.
    pub fn adamw(params: Vec<Tensor>, cfg: AdamConfig) -> Result<Adam> {
        Adam::build(params, cfg, true)
    }

    fn build(params: Vec<Tensor>, cfg: AdamConfig, decoupled: bool) -> Result<Adam> {
        let op = if decoupled { "AdamW" } else { "Adam" };
        check_lr(op, cfg.lr)?;
        let (b1, b2) = cfg.betas;
        if !(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2) {
            return Err(Error::invalid(
                op,
                format!("betas must lie in [0, 1), got ({b1}, {b2})"),
            ));
        }
        if cfg.eps.is_nan() || cfg.eps < 0.0 || cfg.weight_decay.is_nan() || cfg.weight_decay < 0.0
        {
            return Err(Error::invalid(
                op,
                format!(
                    "eps and weight_decay must be non-negative, got eps {} and weight_decay {}",
                    cfg.eps, cfg.weight_decay
                ),
            ));
        }
        for (i, p) in params.iter().enumerate() {
            if !p.dtype().is_float() {
                return Err(Error::UnsupportedDType {
                    op: "Adam",
                    dtype: p.dtype(),
                    hint: "only floating-point parameters can be optimized",
                });
            }
            if !owns_storage(p) {
                return Err(Error::invalid(
                    "Adam",
                    format!(
                        "parameter {i} is a view; parameters must own their whole contiguous storage"
                    ),
                ));
            }
        }
        check_distinct(&params)?;
        let n = params.len();
        Ok(Adam {
            params,
            cfg,
            decoupled,
            state: vec![None; n],
            steps: 0,
            master_weights: false,
            graph: GraphStep::default(),
            device_count: None,
        })
    }

    /// Keeps an f32 master copy (and f32 moments) of every f16/bf16 parameter, made from the
    /// parameter at its first step; f32 and f64 parameters step as before. Set it before the
    /// first step.
    pub fn with_master_weights(mut self) -> Result<Adam> {
        if self.state.iter().any(Option::is_some) {
            return Err(Error::invalid(
                "Adam",
                "master weights must be chosen before the first step (the moments would change dtype)",
            ));
        }
        self.master_weights = true;
        Ok(self)
    }

    /// Whether f16/bf16 parameters step through f32 master copies.
    pub fn has_master_weights(&self) -> bool {
        self.master_weights
    }

    /// Whether parameter `p` gets a master copy.
    fn keeps_master(&self, p: &Tensor) -> bool {
        self.master_weights && matches!(p.dtype(), DType::F16 | DType::BF16)
    }

    pub fn config(&self) -> &AdamConfig {
        &self.cfg
    }

    /// True for AdamW.
    pub fn is_decoupled(&self) -> bool {
        self.decoupled
    }

    /// How many times `step` has run. Steps whose count the device keeps
    /// (`step_unless_found_inf`) are included once `settle_counts` has read it.
    pub fn step_count(&self) -> u64 {
        self.steps
    }

    /// The state of parameter `i`, once its first step has created it (its `step` as
    /// `step_count`'s: settled by `settle_counts`).
    pub fn state(&self, i: usize) -> Option<&AdamState> {
        self.state.get(i).and_then(Option::as_ref)
    }

    /// Every state tensor, named `{i}.exp_avg`, `{i}.exp_avg_sq` (and `{i}.master` with
    /// master weights) by parameter index (for checkpoints). Parameters that have not
    /// stepped yet have none.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (i, s) in self.state.iter().enumerate() {
            if let Some(s) = s {
                out.push((format!("{i}.exp_avg"), s.exp_avg.clone()));
                out.push((format!("{i}.exp_avg_sq"), s.exp_avg_sq.clone()));
                if let Some(w) = &s.master {
                    out.push((format!("{i}.master"), w.clone()));
                }
            }
        }
        out
    }

    /// Restores parameter `i`'s state (from a checkpoint). The moments must match the
    /// parameter's shape, dtype and device and own their storage; they become optimizer
    /// state. Also sets the optimizer's step count to at least `state.step`.
    pub fn set_state(&mut self, i: usize, state: AdamState) -> Result<()> {
        self.leave_device_count()?;
        let p = self.params.get(i).ok_or_else(|| {
            Error::invalid(
                "Adam",
                format!("no parameter {i} (the optimizer has {})", self.params.len()),
            )
        })?;
        let keeps_master = self.keeps_master(p);
        if state.master.is_some() != keeps_master {
            return Err(Error::invalid(
                "Adam",
                format!(
                    "parameter {i} {} a master copy in this optimizer; the state given {} one",
                    if keeps_master { "has" } else { "has no" },
                    if state.master.is_some() {
                        "has"
                    } else {
                        "lacks"
                    }
                ),
            ));
        }
        let dtype = if keeps_master { DType::F32 } else { p.dtype() };
        let named = [
            ("exp_avg", &state.exp_avg),
            ("exp_avg_sq", &state.exp_avg_sq),
        ];
        for (name, t) in named
            .into_iter()
            .chain(state.master.iter().map(|w| ("master", w)))
        {
            let fits = t.shape() == p.shape() && t.dtype() == dtype && t.device() == p.device();
            if !fits || !owns_storage(t) {
                return Err(Error::invalid(
                    "Adam",
                    format!(
                        "{name} of parameter {i} must be a contiguous {dtype} {:?} tensor on {} owning its storage",
                        p.shape(),
                        p.device()
                    ),
                ));
            }
        }
        let (m, v) = (&state.exp_avg, &state.exp_avg_sq);
        if m.shares_storage(v) || m.shares_storage(p) || v.shares_storage(p) {
            return Err(Error::invalid(
                "Adam",
                "exp_avg, exp_avg_sq and the parameter must be separate tensors",
            ));
        }
        if let Some(w) = &state.master
            && (w.shares_storage(p) || w.shares_storage(m) || w.shares_storage(v))
        {
            return Err(Error::invalid(
                "Adam",
                "the master copy must be a separate tensor",
            ));
        }
        for t in [m, v].into_iter().chain(&state.master) {
            t.set_category(Category::OptimizerState);
        }
        self.steps = self.steps.max(state.step);
        self.state[i] = Some(state);
        Ok(())
    }

    /// The parameters with a gradient, each checked against its parameter.
    fn collect_work(&self) -> Result<Vec<Work>> {
        let mut work = Vec::new();
        for (index, p) in self.params.iter().enumerate() {
            let Some(grad) = p.grad() else { continue };
            if grad.shape() != p.shape() || grad.dtype() != p.dtype() || grad.device() != p.device()
            {
                return Err(Error::invalid(
                    "Adam",
                    format!(
                        "the gradient of parameter {index} ({} {:?} on {}) does not match it ({} {:?} on {})",
                        grad.dtype(),
                        grad.shape(),
                        grad.device(),
                        p.dtype(),
                        p.shape(),
                        p.device()
                    ),
                ));
            }
            let grad = if grad.is_contiguous() {
                grad
            } else {
                grad.contiguous_copy()?
            };
            work.push(Work { index, grad });
        }
        Ok(work)
    }

    /// Creates the zeroed moments of parameters stepping for the first time.
    fn ensure_state(&mut self, work: &[Work]) -> Result<()> {
        self.ensure_state_of(work.iter().map(|w| w.index))
    }

    /// Creates the zeroed moments (and master copies) of the parameters `indices` that have
    /// none yet.
    fn ensure_state_of(&mut self, indices: impl Iterator<Item = usize>) -> Result<()> {
        for index in indices {
            if self.state[index].is_some() {
                continue;
            }
            let p = &self.params[index];
            let master = self.keeps_master(p);
            let dtype = if master { DType::F32 } else { p.dtype() };
            let alloc = |origin| {
                Tensor::alloc(
                    p.shape(),
                    dtype,
                    p.device(),
                    Category::OptimizerState,
                    origin,
                )
            };
            let master = if master {
                let copy = p.detach().to_dtype(DType::F32)?.contiguous_owned()?;
                copy.set_category(Category::OptimizerState);
                Some(copy)
            } else {
                None
            };
            self.state[index] = Some(AdamState {
                exp_avg: alloc("adam_exp_avg")?,
                exp_avg_sq: alloc("adam_exp_avg_sq")?,
                step: 0,
                master,
            });
        }
        Ok(())
    }

    /// The step's arguments for `params` at step count `step` (nothing staged).
    fn step_scalars<'a>(
        &self,
        params: &'a [AdamParam<'a>],
        grad_scale: Option<&'a Tensor>,
        step: u64,
    ) -> AdamStep<'a> {
        let (beta1, beta2) = self.cfg.betas;
        AdamStep {
            params,
            grad_scale: grad_scale.map(Tensor::view),
            lr: self.cfg.lr,
            beta1,
            beta2,
            eps: self.cfg.eps,
            weight_decay: self.cfg.weight_decay,
            decoupled: self.decoupled,
            step,
            staged_scalars: None,
            skip_if: None,
            count_at: None,
        }
    }

    /// The one step count every parameter with state has reached (a replayed step updates
    /// them all alike), or why there is none.
    fn common_step_count(&self) -> Result<u64> {
        let mut counts = self.state.iter().flatten().map(|s| s.step);
        let first = counts.next().ok_or_else(|| {
            Error::invalid(
                "Adam",
                "a step must run before one is captured (it creates the moments)",
            )
        })?;
        if counts.any(|c| c != first) {
            return Err(Error::invalid(
                "Adam",
                "parameters at different step counts cannot share a captured step",
            ));
        }
        Ok(first)
    }

    /// One fused call for the parameters `members` (indices into `work`), all on one device
    /// and at step `step` after this update.
    fn run_group(
        &mut self,
        work: &[Work],
        members: &[usize],
        step: u64,
        extra: Extra<'_>,
    ) -> Result<()> {
        let mut params: Vec<AdamParam> = Vec::with_capacity(members.len());
        for &k in members {
            let w = &work[k];
            let s = self.state[w.index]
                .as_ref()
                .ok_or_else(|| Error::invalid("Adam", "state missing after allocation"))?;
            params.push(AdamParam {
                grad: w.grad.view(),
                param: self.params[w.index].storage(),
                exp_avg: s.exp_avg.storage(),
                exp_avg_sq: s.exp_avg_sq.storage(),
                master: s.master.as_ref().map(Tensor::storage).map(|s| &**s),
            });
        }
        // The scale as one f64 on this group's device.
        let scale = match extra.grad_scale {
            Some(c) => {
                let device = work[members[0]].grad.device();
                Some(c.to_device(device)?.to_dtype(DType::F64)?.contiguous()?)
            }
            None => None,
        };
        // A captured step reads the scalars staged for it (`prepare_graph_step`).
        let device = work[members[0]].grad.device();
        let staged = if capture::capturing_on(device) {
            let slot = self.graph.slot.as_ref().ok_or_else(|| {
                Error::invalid(
                    "Adam",
                    "a captured step needs its scalars staged first (prepare_graph_step)",
                )
            })?;
            Some(&**slot.storage())
        } else {
            None
        };
        // The entry function bumps every parameter's and state buffer's version.
        optim::adam_step(&AdamStep {
            staged_scalars: staged,
            skip_if: extra.skip_if.map(Tensor::view),
            count_at: extra.count_at.map(Tensor::view),
            ..self.step_scalars(&params, scale.as_ref(), step)
        })?;
        if extra.count_at.is_some() {
            // The device counts (`DeviceCount`).
            return Ok(());
        }
        for &k in members {
            if let Some(s) = self.state[work[k].index].as_mut() {
                s.step = step;
            }
        }
        Ok(())
    }
}

/// What a step reads beside the gradients: a factor for every gradient (a clipping
/// coefficient), a flag that makes the device skip the update (a GradScaler's found_inf) and
/// the step count the device keeps (`DeviceCount`).
#[derive(Clone, Copy, Default)]
struct Extra<'a> {
    grad_scale: Option<&'a Tensor>,
    skip_if: Option<&'a Tensor>,
    count_at: Option<&'a Tensor>,
}

/// Whether `t` is all of its storage, contiguous (what an in-place update writes).
fn owns_storage(t: &Tensor) -> bool {
    t.is_contiguous() && t.layout().offset() == 0 && t.numel() == t.storage().len()
}

/// Each parameter once: two entries sharing a storage would be updated twice (and raced on
/// a GPU, where one launch updates them all).
fn check_distinct(params: &[Tensor]) -> Result<()> {
    let mut seen = std::collections::HashMap::new();
    for (i, p) in params.iter().enumerate() {
        let key = std::sync::Arc::as_ptr(p.storage());
        if let Some(j) = seen.insert(key, i) {
            return Err(Error::invalid(
                "Adam",
                format!("parameters {j} and {i} share one storage; pass each parameter once"),
            ));
        }
    }
    Ok(())
}

/// Groups `work` by (device, next step count), in first-seen order: one fused call each.
fn groups(work: &[Work], state: &[Option<AdamState>]) -> Vec<((Device, u64), Vec<usize>)> {
    let mut out: Vec<((Device, u64), Vec<usize>)> = Vec::new();
    for (k, w) in work.iter().enumerate() {
        let step = state[w.index].as_ref().map_or(0, |s| s.step) + 1;
        let key = (w.grad.device(), step);
        match out.iter_mut().find(|(g, _)| *g == key) {
            Some((_, members)) => members.push(k),
            None => out.push((key, vec![k])),
        }
    }
    out
}

impl Adam {
    /// Every parameter with a gradient, in one fused call per (device, step count) group.
    fn step_all(&mut self, extra: Extra<'_>) -> Result<()> {
        let _g = no_grad();
        self.leave_device_count()?;
        let work = self.collect_work()?;
        self.ensure_state(&work)?;
        // A captured step records the parameters it updates: each replay advances their
        // counts (`graph_step_replayed`).
        if work
            .first()
            .is_some_and(|w| capture::capturing_on(w.grad.device()))
        {
            self.graph.record(work.iter().map(|w| w.index), true);
        }
        for ((_, step), members) in groups(&work, &self.state) {
            self.run_group(&work, &members, step, extra)?;
        }
        self.steps += 1;
        Ok(())
    }

    /// A step the device skips when `found_inf` is raised, counted there (`DeviceCount`):
    /// the count is made (or made again, after the host reads the old one) when the
    /// parameters with gradients change. Parameters at different step counts, or on several
    /// devices, step with the host's counts instead, which then waits for the flag.
    fn step_counted_on_device(&mut self, found_inf: &Tensor) -> Result<()> {
        let _g = no_grad();
        let work = self.collect_work()?;
        if work.is_empty() {
            return Ok(());
        }
        self.ensure_state(&work)?;
        let members: Vec<usize> = work.iter().map(|w| w.index).collect();
        let device = found_inf.device();
        let current = self
            .device_count
            .as_ref()
            .is_some_and(|c| c.covers(&members, device));
        if !current && !self.start_device_count(&work, members, device)? {
            return self.step_waiting_for_flag(found_inf);
        }
        let Some(count) = self.device_count.as_ref().map(|c| c.tensor().clone()) else {
            return Err(Error::invalid("Adam", "the device's step count is missing"));
        };
        let extra = Extra {
            grad_scale: None,
            skip_if: Some(found_inf),
            count_at: Some(&count),
        };
        // One group: every member is at the same count on one device.
        for ((_, step), group) in groups(&work, &self.state) {
            self.run_group(&work, &group, step, extra)?;
        }
        match self.device_count.as_mut() {
            Some(c) => c.advance(found_inf),
            None => Ok(()),
        }
    }

    /// Makes the device's count for `members` (the parameters of `work`), once the host's
    /// counts are exact: false, making nothing, when they are not all at one count on
    /// `device`.
    fn start_device_count(
        &mut self,
        work: &[Work],
        members: Vec<usize>,
        device: Device,
    ) -> Result<bool> {
        self.leave_device_count()?;
        let mut counts = members
            .iter()
            .map(|&i| self.state[i].as_ref().map_or(0, |s| s.step));
        let first = counts.next().unwrap_or(0);
        if counts.any(|c| c != first) || work.iter().any(|w| w.grad.device() != device) {
            return Ok(false);
        }
        self.device_count = Some(DeviceCount::start("Adam", device, members, first)?);
        Ok(true)
    }

    /// The skippable step with the host's counts: it reads the flag (waiting for the step)
    /// and takes the count back when the device skipped the update.
    fn step_waiting_for_flag(&mut self, found_inf: &Tensor) -> Result<()> {
        let before = self.counts();
        self.step_all(Extra {
            skip_if: Some(found_inf),
            ..Extra::default()
        })?;
        if found_inf.item()? != 0.0 {
            self.restore(before);
        }
        Ok(())
    }

    /// Reads the device's count into the host's (waiting for the device) and stops keeping
    /// it there.
    fn leave_device_count(&mut self) -> Result<()> {
        self.settle_counts()?;
        self.device_count = None;
        Ok(())
    }

    /// The step counts now (the optimizer's, then each parameter's).
    fn counts(&self) -> Counts {
        let each = self.state.iter().map(|s| s.as_ref().map(|s| s.step));
        (self.steps, each.collect())
    }

    /// Puts back step counts taken by `counts`.
    fn restore(&mut self, (steps, counts): Counts) {
        self.steps = steps;
        for (s, c) in self.state.iter_mut().zip(counts) {
            // State made by the undone step keeps its zeroed moments, at step 0.
            if let Some(s) = s.as_mut() {
                s.step = c.unwrap_or(0);
            }
        }
    }
}

impl Optimizer for Adam {
    fn step(&mut self) -> Result<()> {
        self.step_all(Extra::default())
    }

    /// The fused step multiplies each gradient element by `scale` as it reads it (in the
    /// compute type; the gradient is not rounded to its dtype in between), so a clipped step
    /// makes no pass over the gradients of its own and leaves `.grad` unclipped.
    fn step_with_grad_scale(&mut self, scale: &Tensor) -> Result<()> {
        if scale.numel() != 1 {
            return Err(Error::invalid(
                "Adam",
                format!(
                    "the gradient scale must hold one value, got shape {:?}",
                    scale.shape()
                ),
            ));
        }
        self.step_all(Extra {
            grad_scale: Some(scale),
            ..Extra::default()
        })
    }

    fn step_param(&mut self, index: usize) -> Result<()> {
        let _g = no_grad();
        self.leave_device_count()?;
        let work: Vec<Work> = self
            .collect_work()?
            .into_iter()
            .filter(|w| w.index == index)
            .collect();
        self.ensure_state(&work)?;
        // A captured step in backward: each replay advances this parameter's count.
        if work
            .first()
            .is_some_and(|w| capture::capturing_on(w.grad.device()))
        {
            self.graph.record(std::iter::once(index), false);
        }
        for ((_, step), members) in groups(&work, &self.state) {
            self.run_group(&work, &members, step, Extra::default())?;
        }
        Ok(())
    }

    fn params(&self) -> &[Tensor] {
        &self.params
    }

    fn name(&self) -> &'static str {
        if self.decoupled { "AdamW" } else { "Adam" }
    }

    fn lr(&self) -> f64 {
        self.cfg.lr
    }

    fn set_lr(&mut self, lr: f64) -> Result<()> {
        check_lr(if self.decoupled { "AdamW" } else { "Adam" }, lr)?;
        self.cfg.lr = lr;
        Ok(())
    }

    fn graph_support(&self) -> std::result::Result<(), String> {
        Ok(())
    }

    /// Every parameter's moments (and master copy) now, zeroed as its first step would make
    /// them.
    fn make_state(&mut self) -> Result<()> {
        let _g = no_grad();
        self.ensure_state_of(0..self.params.len())
    }

    /// Stages the coming step's scalars (rate, bias corrections) in the slot the captured
    /// kernels read, and remembers the counts to undo a failed capture.
    fn prepare_graph_step(&mut self) -> Result<()> {
        let next = self.common_step_count()? + 1;
        let Some(device) = self.params.first().map(Tensor::device) else {
            return Ok(());
        };
        if self.graph.slot.is_none() {
            self.graph.slot = Some(Tensor::alloc(
                &[optim::ADAM_SCALAR_BYTES],
                DType::U8,
                device,
                Category::OptimizerState,
                "adam_graph_scalars",
            )?);
        }
        if let Some(slot) = &self.graph.slot {
            optim::stage_adam_scalars(&self.step_scalars(&[], None, next), slot.storage())?;
        }
        let issued = self.device_count.as_ref().map_or(0, DeviceCount::issued);
        self.graph.before = Some((self.counts(), issued));
        self.graph.fresh = true;
        Ok(())
    }

    fn graph_step_replayed(&mut self) {
        // A captured step that the device may skip counts itself there.
        if let Some(c) = self.device_count.as_mut() {
            c.replayed();
            return;
        }
        // Steps in backward (of single parameters) are not the optimizer's whole steps.
        self.steps += self.graph.whole as u64;
        for &i in &self.graph.members {
            if let Some(s) = self.state[i].as_mut() {
                s.step += 1;
            }
        }
    }

    fn graph_step_abandoned(&mut self) {
        if let Some((before, issued)) = self.graph.before.take() {
            self.restore(before);
            if let Some(c) = self.device_count.as_mut() {
                c.set_issued(issued);
            }
        }
        self.graph.members.clear();
    }

    fn skips_on_device(&self) -> bool {
        true
    }

    /// The fused kernels read the flag first and return at once when it is raised; the step
    /// count stays on the device (`DeviceCount`).
    fn step_unless_found_inf(&mut self, found_inf: &Tensor) -> Result<()> {
        self.step_counted_on_device(found_inf)
    }

    /// Reads the count the device keeps (waiting for it): the steps it ran since the last
    /// read are added to the optimizer's count and its members'.
    fn settle_counts(&mut self) -> Result<()> {
        let Some(c) = self.device_count.as_mut() else {
            return Ok(());
        };
        let ran = c.settle("Adam")?;
        self.steps += ran;
        let now = c.known();
        for &i in c.members() {
            if let Some(s) = self.state[i].as_mut() {
                s.step = now;
            }
        }
        Ok(())
    }
}
