//! SGD with momentum, dampening, Nesterov and weight decay: PyTorch's algorithm.
//!
//!   g ← grad + wd·p
//!   buf ← g                          (first step)
//!   buf ← μ·buf + (1 − dampening)·g  (later steps)
//!   g ← g + μ·buf (nesterov) or buf
//!   p ← p − lr·g
//!
//! Momentum buffers are created at the first step and count as optimizer state (beside the
//! parameters, outside any graph's pool). A captured step (CUDA graphs) reads its rate from
//! device memory that the host rewrites before each replay; a parameter's first step, which
//! makes its buffer, runs eagerly before the capture.
//!
//! A step that the device may skip (`step_unless_found_inf`, a GradScaler's inf/NaN flag)
//! never waits for the flag: with momentum, whether a buffer has taken its first step is a
//! count the device keeps (`DeviceCount`), and buffers made for a first step that the device
//! skipped are dropped when the host reads it.
//!
//! With plain momentum (no dampening, Nesterov or weight decay) the step is linear in the
//! gradient, so a weight gradient offered as a product (a linear layer's gᵀ·x) can be written
//! by its GEMM straight into the momentum buffer (`accumulate_product`, reached through the
//! `Optimizer` trait by `StepInBackward::install_fused`).

use super::device_count::DeviceCount;
use super::{Optimizer, check_lr};
use crate::autograd::{GradProduct, no_grad};
use crate::backend::optim::{self, SgdStep};
use crate::backend::{View, capture};
use crate::base::{Error, Result};
use crate::memory::{self, Category};
use crate::tensor::{DType, Device, Tensor};

#[derive(Clone, Debug)]
pub struct SgdConfig {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

pub struct Sgd {
    params: Vec<Tensor>,
    cfg: SgdConfig,
    momentum_buffers: Vec<Option<Tensor>>,
    /// For CUDA graphs: the rate in device memory (one F64), staged before each replay, and
    /// the device count's steps issued before the capture (to undo).
    graph_lr: Option<Tensor>,
    graph_issued: u64,
    /// While steps with momentum are skipped or not on the device: how many steps the
    /// members' buffers have taken (0: their first is still to come), as far as it matters.
    device_count: Option<DeviceCount>,
}

/// What a step reads on the device beside the gradient: the skip flag and the count that
/// says whether the buffer's first step has run.
#[derive(Clone, Copy, Default)]
struct OnDevice<'a> {
    skip_if: Option<&'a Tensor>,
    count_at: Option<&'a Tensor>,
}

impl Sgd {
    pub fn new(params: Vec<Tensor>, cfg: SgdConfig) -> Result<Sgd> {
        check_lr("SGD", cfg.lr)?;
        if cfg.momentum < 0.0 || cfg.weight_decay < 0.0 {
            return Err(Error::invalid(
                "SGD",
                "momentum and weight_decay must be non-negative",
            ));
        }
        if cfg.nesterov && (cfg.momentum <= 0.0 || cfg.dampening != 0.0) {
            return Err(Error::invalid(
                "SGD",
                "Nesterov momentum requires a momentum > 0 and zero dampening",
            ));
        }
        let n = params.len();
        Ok(Sgd {
            params,
            cfg,
            momentum_buffers: vec![None; n],
            graph_lr: None,
            graph_issued: 0,
            device_count: None,
        })
    }

    pub fn config(&self) -> &SgdConfig {
        &self.cfg
    }

    /// The momentum buffer of parameter `i`, once its first step has run. While the device
    /// counts skippable steps, as of the last `settle_counts`: a buffer made for a first step
    /// that has not run (yet, or ever) is not shown.
    pub fn momentum_buffer(&self, i: usize) -> Option<&Tensor> {
        let unwritten = self
            .device_count
            .as_ref()
            .is_some_and(|c| c.known() == 0 && c.members().contains(&i));
        if unwritten {
            return None;
        }
        self.momentum_buffers.get(i).and_then(Option::as_ref)
    }

    /// Restores the momentum buffer of parameter `i` (saved training state): copied onto the
    /// parameter's device and dtype, counted as optimizer state.
    pub fn set_momentum_buffer(&mut self, i: usize, buf: &Tensor) -> Result<()> {
        self.leave_device_count()?;
        let p = self.params.get(i).ok_or_else(|| {
            Error::invalid(
                "SGD",
                format!("no parameter {i} to restore a momentum buffer for"),
            )
        })?;
        if buf.shape() != p.shape() {
            return Err(Error::shape(
                "SGD",
                format!(
                    "momentum buffer {:?} does not match parameter {i} {:?}",
                    buf.shape(),
                    p.shape()
                ),
            ));
        }
        let _g = no_grad();
        let b = momentum_buffer_like(p)?;
        b.copy_(&buf.to_dtype(p.dtype())?.to_device(p.device())?)?;
        self.momentum_buffers[i] = Some(b);
        Ok(())
    }

    /// Whether the step is plain momentum (momentum > 0; no dampening, Nesterov or weight
    /// decay): linear in the gradient, so weight gradients can be fused into the buffer.
    pub fn fusable(&self) -> bool {
        let c = &self.cfg;
        c.momentum > 0.0 && c.dampening == 0.0 && !c.nesterov && c.weight_decay == 0.0
    }

    /// buf_i ← beta·buf_i + the product, for parameter i, in one GEMM: `first` (the step's
    /// first contribution) uses beta = μ, or writes a fresh buffer (PyTorch's buf = clone(g));
    /// later contributions of the same step add (beta = 1). False, touching nothing, when the
    /// product does not fit the parameter or the step cannot fuse.
    pub(crate) fn accumulate_product(
        &mut self,
        i: usize,
        product: &GradProduct<'_>,
        first: bool,
    ) -> Result<bool> {
        let Some(p) = self.params.get(i) else {
            return Ok(false);
        };
        // Factors in the parameter's dtype, or half factors of an f32 parameter (autocast):
        // the GEMM sums their product in f32 into the f32 buffer.
        let dtype = product.a.dtype();
        let fits = self.fusable()
            && product.shape().is_some_and(|s| p.shape() == s)
            && product.b.dtype() == dtype
            && (dtype == p.dtype() || crate::backend::matmul::widens_to(dtype, p.dtype()))
            && [product.a, product.b]
                .iter()
                .all(|t| t.device() == p.device());
        if !fits {
            return Ok(false);
        }
        let _g = no_grad();
        let (buf, beta) = match (&self.momentum_buffers[i], first) {
            (Some(b), true) => (b.clone(), self.cfg.momentum),
            (Some(b), false) => (b.clone(), 1.0),
            (None, true) => {
                let device = p.device();
                if capture::capturing_on(device) {
                    return Err(Error::invalid(
                        "SGD",
                        format!(
                            "parameter {i} takes its first step (which makes its momentum buffer) in a captured step; run one eager step with the same parameters first"
                        ),
                    ));
                }
                let b =
                    memory::allocator(device)?.outside_private_pool(|| momentum_buffer_like(p))?;
                self.momentum_buffers[i] = Some(b.clone());
                (b, 0.0)
            }
            (None, false) => {
                return Err(Error::invalid(
                    "SGD",
                    "a later gradient contribution arrived without the step's momentum buffer",
                ));
            }
        };
        let (lhs, rhs) = product.operands()?;
        crate::ops::matmul_acc_into(&lhs, &rhs, &buf, beta)?;
        Ok(true)
    }

    /// buf_i += grad: a contribution of the current step that came as an ordinary gradient.
    pub(crate) fn accumulate_grad(&mut self, i: usize, grad: &Tensor) -> Result<()> {
        let buf = self
            .momentum_buffers
            .get(i)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::invalid("SGD", "no momentum buffer to add the gradient into"))?;
        let _g = no_grad();
        buf.add_(grad)
    }

    /// p_i ← p_i − lr·buf_i: the rest of a fused step, once buf_i holds all of its gradient.
    pub(crate) fn apply_buffer(&mut self, i: usize) -> Result<()> {
        let (Some(p), Some(Some(buf))) = (self.params.get(i), self.momentum_buffers.get(i)) else {
            return Err(Error::invalid("SGD", "no momentum buffer to step with"));
        };
        // The kernel without a buffer is p ← p − lr·(g + wd·p): here g = buf and wd = 0.
        let lr_at = self.staged_lr(capture::capturing_on(p.device()))?;
        optim::sgd_step(&SgdStep::plain(buf.view(), p.storage(), self.cfg.lr, lr_at))
    }

    /// One fused pass per parameter: reads the gradient once, updates buffer and parameter.
    fn update(&mut self, i: usize, grad: Tensor, on_device: OnDevice<'_>) -> Result<()> {
        let p = &self.params[i];
        if grad.shape() != p.shape() || grad.dtype() != p.dtype() {
            return Err(Error::shape(
                "SGD",
                format!(
                    "gradient {:?} does not match parameter {:?}",
                    grad.shape(),
                    p.shape()
                ),
            ));
        }
        let grad = if grad.is_contiguous() {
            grad
        } else {
            grad.contiguous_copy()?
        };
        let captured = capture::capturing_on(p.device());
        let first_step = self.first_step_of(i, captured, on_device)?;
        let lr_at = self.staged_lr(captured)?;
        let c = &self.cfg;
        let p = &self.params[i];
        optim::sgd_step(&SgdStep {
            grad: grad.view(),
            param: p.storage(),
            momentum_buf: self.momentum_buffers[i].as_ref().map(|b| &**b.storage()),
            lr: c.lr,
            momentum: c.momentum,
            dampening: c.dampening,
            weight_decay: c.weight_decay,
            nesterov: c.nesterov,
            first_step,
            lr_at,
            skip_if: on_device.skip_if.map(Tensor::view),
            count_at: on_device.count_at.map(Tensor::view),
        })
    }

    /// Whether parameter `i` takes its first momentum step now, as the host knows it; its
    /// buffer made if so (beside the parameters). Not inside a capture (the replays would
    /// repeat a first step), nor for a step whose count the device keeps (it made them).
    fn first_step_of(&mut self, i: usize, captured: bool, on_device: OnDevice) -> Result<bool> {
        let first = self.cfg.momentum != 0.0 && self.momentum_buffers[i].is_none();
        if !first {
            return Ok(false);
        }
        if on_device.count_at.is_some() {
            return Err(Error::invalid(
                "SGD",
                "a step counted on the device needs its buffers made first",
            ));
        }
        if captured {
            return Err(Error::invalid(
                "SGD",
                format!(
                    "parameter {i} takes its first step (which makes its momentum buffer) in a captured step; run one eager step with the same parameters first"
                ),
            ));
        }
        let p = &self.params[i];
        let b = memory::allocator(p.device())?.outside_private_pool(|| momentum_buffer_like(p))?;
        self.momentum_buffers[i] = Some(b);
        Ok(true)
    }

    /// Where a captured step reads its rate (`prepare_graph_step` staged it); None eagerly.
    fn staged_lr(&self, captured: bool) -> Result<Option<View<'_>>> {
        match (&self.graph_lr, captured) {
            (_, false) => Ok(None),
            (Some(lr), true) => Ok(Some(lr.view())),
            (None, true) => Err(Error::invalid(
                "SGD",
                "a captured step needs its rate staged first (prepare_graph_step)",
            )),
        }
    }

    /// The parameters with a gradient: (index, gradient).
    fn work(&self) -> Vec<(usize, Tensor)> {
        let with_grad = self.params.iter().enumerate();
        with_grad
            .filter_map(|(i, p)| p.grad().map(|g| (i, g)))
            .collect()
    }

    /// A step the device skips when `found_inf` is raised. Without momentum there is nothing
    /// to count. With it, the device counts the members' steps, made (buffers included) when
    /// the parameters with gradients change; members of which some have stepped and some not
    /// step with the host's knowledge instead, which then waits for the flag.
    fn step_counted_on_device(&mut self, found_inf: &Tensor) -> Result<()> {
        let _g = no_grad();
        let work = self.work();
        if work.is_empty() {
            return Ok(());
        }
        let skip = OnDevice {
            skip_if: Some(found_inf),
            count_at: None,
        };
        if self.cfg.momentum == 0.0 {
            for (i, g) in work {
                self.update(i, g, skip)?;
            }
            return Ok(());
        }
        let members: Vec<usize> = work.iter().map(|(i, _)| *i).collect();
        let device = found_inf.device();
        let current = self
            .device_count
            .as_ref()
            .is_some_and(|c| c.covers(&members, device));
        if !current && !self.start_device_count(&work, members, device)? {
            return self.step_waiting_for_flag(work, found_inf);
        }
        let Some(count) = self.device_count.as_ref().map(|c| c.tensor().clone()) else {
            return Ok(());
        };
        let counted = OnDevice {
            count_at: Some(&count),
            ..skip
        };
        for (i, g) in work {
            self.update(i, g, counted)?;
        }
        match self.device_count.as_mut() {
            Some(c) => c.advance(found_inf),
            None => Ok(()),
        }
    }

    /// The device's count for `members`, once the host knows which buffers stepped: all of
    /// them (count 1) or none (count 0, their buffers made now). False, making nothing, when
    /// some have and some have not, or they are not all on `device`.
    fn start_device_count(
        &mut self,
        work: &[(usize, Tensor)],
        members: Vec<usize>,
        device: Device,
    ) -> Result<bool> {
        self.leave_device_count()?;
        let stepped = |i: &usize| self.momentum_buffers[*i].is_some();
        let all = members.iter().all(stepped);
        let none = !members.iter().any(stepped);
        if !(all || none) || work.iter().any(|(_, g)| g.device() != device) {
            return Ok(false);
        }
        let count = DeviceCount::start("SGD", device, members, all as u64)?;
        for &i in count.members() {
            if self.momentum_buffers[i].is_none() {
                let p = &self.params[i];
                let b =
                    memory::allocator(device)?.outside_private_pool(|| momentum_buffer_like(p))?;
                self.momentum_buffers[i] = Some(b);
            }
        }
        self.device_count = Some(count);
        Ok(true)
    }

    /// The skippable step with the host's knowledge: it reads the flag (waiting for the
    /// step) and drops the buffers its first steps made when the device skipped them.
    fn step_waiting_for_flag(
        &mut self,
        work: Vec<(usize, Tensor)>,
        found_inf: &Tensor,
    ) -> Result<()> {
        let fresh: Vec<usize> = work
            .iter()
            .map(|(i, _)| *i)
            .filter(|&i| self.momentum_buffers[i].is_none())
            .collect();
        let skip = OnDevice {
            skip_if: Some(found_inf),
            count_at: None,
        };
        for (i, g) in work {
            self.update(i, g, skip)?;
        }
        if found_inf.item()? != 0.0 {
            fresh.iter().for_each(|&i| self.momentum_buffers[i] = None);
        }
        Ok(())
    }

    /// Reads the device's count (waiting for it) and stops keeping it: the buffers made for a
    /// first step that never ran are dropped.
    fn leave_device_count(&mut self) -> Result<()> {
        let Some(mut c) = self.device_count.take() else {
            return Ok(());
        };
        c.settle("SGD")?;
        if c.known() == 0 {
            c.members()
                .iter()
                .for_each(|&i| self.momentum_buffers[i] = None);
        }
        Ok(())
    }
}

/// A fresh momentum buffer for parameter `p`, counted as optimizer state.
fn momentum_buffer_like(p: &Tensor) -> Result<Tensor> {
    Tensor::alloc(
        p.shape(),
        p.dtype(),
        p.device(),
        Category::OptimizerState,
        "sgd_momentum",
    )
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        let _g = no_grad();
        self.leave_device_count()?;
        for (i, g) in self.work() {
            self.update(i, g, OnDevice::default())?;
        }
        Ok(())
    }

    fn step_param(&mut self, index: usize) -> Result<()> {
        let _g = no_grad();
        self.leave_device_count()?;
        let grad = self.params.get(index).and_then(Tensor::grad);
        match grad {
            Some(g) => self.update(index, g, OnDevice::default()),
            None => Ok(()),
        }
    }

    fn params(&self) -> &[Tensor] {
        &self.params
    }

    fn name(&self) -> &'static str {
        "SGD"
    }

    fn gradient_free(&self) -> Option<&'static str> {
        self.fusable().then_some("SGD momentum")
    }

    fn accumulate_product(
        &mut self,
        index: usize,
        product: &GradProduct<'_>,
        first: bool,
    ) -> Result<bool> {
        Sgd::accumulate_product(self, index, product, first)
    }

    fn accumulate_gradient(&mut self, index: usize, grad: &Tensor) -> Result<()> {
        self.accumulate_grad(index, grad)
    }

    fn apply_accumulated(&mut self, index: usize) -> Result<()> {
        self.apply_buffer(index)
    }

    fn lr(&self) -> f64 {
        self.cfg.lr
    }

    fn set_lr(&mut self, lr: f64) -> Result<()> {
        check_lr("SGD", lr)?;
        self.cfg.lr = lr;
        Ok(())
    }

    fn graph_support(&self) -> std::result::Result<(), String> {
        Ok(())
    }

    /// Writes the coming step's rate where the captured kernels read it.
    fn prepare_graph_step(&mut self) -> Result<()> {
        let Some(device) = self.params.first().map(Tensor::device) else {
            return Ok(());
        };
        if self.graph_lr.is_none() {
            let slot = memory::allocator(device)?.outside_private_pool(|| {
                Tensor::alloc(
                    &[1],
                    DType::F64,
                    device,
                    Category::OptimizerState,
                    "sgd_graph_lr",
                )
            })?;
            self.graph_lr = Some(slot);
        }
        self.graph_issued = self.device_count.as_ref().map_or(0, DeviceCount::issued);
        match &self.graph_lr {
            Some(slot) => slot.fill_(self.cfg.lr),
            None => Ok(()),
        }
    }

    fn graph_step_replayed(&mut self) {
        if let Some(c) = self.device_count.as_mut() {
            c.replayed();
        }
    }

    fn graph_step_abandoned(&mut self) {
        let issued = self.graph_issued;
        if let Some(c) = self.device_count.as_mut() {
            c.set_issued(issued);
        }
    }

    fn skips_on_device(&self) -> bool {
        true
    }

    /// The kernel reads the flag first and returns at once when it is raised; with momentum,
    /// whether a buffer's first step has run is counted on the device.
    fn step_unless_found_inf(&mut self, found_inf: &Tensor) -> Result<()> {
        self.step_counted_on_device(found_inf)
    }

    /// Reads the device's count (waiting for it) and keeps counting there (a captured step
    /// may read it): `momentum_buffer` then shows exactly the buffers that have stepped.
    fn settle_counts(&mut self) -> Result<()> {
        match self.device_count.as_mut() {
            Some(c) => c.settle("SGD").map(drop),
            None => Ok(()),
        }
    }
}
