//! CUDA graphs for whole training steps: after a warm-up step runs eagerly (kernels compiled,
//! optimizer state made), one step — forward, backward, clipping, optimizer — is captured,
//! then every later step is one graph launch, with no host work per kernel.
//!
//!   each step:   check the batch on the host as the eager kernels check ids  →  remake what
//!                the step derived from its ids on the host (the embedding backward's grouping)
//!                →  write both into the captured step's buffers  →  schedule's rate  →
//!                optimizer stages the step's scalars on the device  →  replay  →  optimizer
//!                counts the step (every write is stream-ordered: the host never waits)
//!
//! f16 loss scaling is captured too, and waits for nothing: the GradScaler keeps its scale in
//! device memory (`GradScaler::stage_on`), the unscale reads it there, the optimizer skips
//! its update on the device when the inf/NaN check fires and counts its steps there, and
//! the scale's update is a kernel of the step (`GradScaler::update_on_device`). Each replay
//! hands out a copy of its verdict and new scale, read when the log shows them.
//!
//! The step's blocks live in the graph's private pool (backend/capture.rs): the accounting by
//! category is the captured step's, and a replay allocates nothing. Work between steps (an
//! evaluation) runs in that pool too (`run_between_steps`), so it reserves nothing beside
//! it. What cannot be replayed runs eagerly, and `GraphStatus` says why: a CPU device, f16
//! loss scaling with an optimizer that cannot skip its update on the device, data-parallel
//! reduction, an optimizer whose rate is a kernel argument (`Optimizer::graph_support`), or a
//! capture that failed. The step in backward is captured with the backward that runs it. New input shapes, or a batch whose target count differs from the
//! captured one, capture again.
//!
//! Dropout: the captured step's masks are drawn with the keys the host drew at the capture,
//! each XORed on the device with a seed that every replay rewrites (`replay_seed` of the step
//! index), so each step gets new masks and a recomputed segment replays its own. They are
//! not the masks an eager run would draw (its keys come from the generator at every step),
//! so a run with dropout is reproducible with graphs on or off, not across the two.

use std::time::Instant;

use super::accumulate::{Accumulation, MicroBatch};
use super::trainer::{StepReport, Trainer};
use crate::backend::capture::{self, Graph, InputCheck, Pool};
use crate::backend::{HostValues, backend};
use crate::base::{Device, Error, Result};
use crate::memory;
use crate::optim::Optimizer;
use crate::tensor::{DType, Readout, Tensor};

/// One integer input of a micro-batch (its token ids, its targets): values in row-major order
/// and the shape.
#[derive(Clone, Debug, PartialEq)]
pub struct HostInput {
    pub values: Vec<i64>,
    pub shape: Vec<usize>,
}

impl HostInput {
    pub fn new(values: Vec<i64>, shape: &[usize]) -> HostInput {
        HostInput {
            values,
            shape: shape.to_vec(),
        }
    }
}

/// One step's inputs per micro-batch, in the order the micro-batch's forward reads them.
pub type HostInputs = Vec<Vec<HostInput>>;

/// Whether steps replay a graph, and why not when they don't.
#[derive(Clone, Debug, PartialEq)]
pub enum GraphStatus {
    /// Eager steps until the warm-up is done.
    WarmingUp,
    /// Steps replay the graph captured at `step`; its private pool reserves `pool_bytes`.
    Replaying { step: u64, pool_bytes: u64 },
    /// Every step runs eagerly, for this reason.
    Off(String),
}

impl std::fmt::Display for GraphStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GraphStatus::WarmingUp => write!(f, "CUDA graphs: warming up"),
            GraphStatus::Replaying { step, pool_bytes } => write!(
                f,
                "CUDA graphs: on, the step captured at step {step} replays ({} in its private pool)",
                memory::format_size(*pool_bytes)
            ),
            GraphStatus::Off(why) => write!(f, "CUDA graphs: off, {why}"),
        }
    }
}

/// A captured step and what its replays read and write.
/// Fields drop in order: the tensors go back to the pool before the graph releases it.
struct Captured {
    /// The step's input buffers per micro-batch, rewritten before each replay.
    inputs: Vec<Vec<Tensor>>,
    /// The mean loss and the gradient norm, rewritten by each replay.
    loss: Tensor,
    grad_norm: Option<Tensor>,
    /// With f16 loss scaling: [inf/NaN found (the update skipped), the new scale], which
    /// each replay rewrites (`StepReport::loss_scale`).
    loss_scale: Option<Tensor>,
    tokens: usize,
    step: u64,
    graph: Graph,
}

/// The graph of a run's steps (`Trainer::step_graphed`).
pub struct StepGraph {
    warmup: usize,
    /// Whether the optimizer's state was made before the first step (`make_state`).
    state_made: bool,
    /// The pool the warm-up steps run in and the capture then takes.
    pool: Option<Pool>,
    captured: Option<Captured>,
    off: Option<String>,
}

impl StepGraph {
    /// Graphs on: `warmup` eager steps, then a capture. Off: every step eager (`why`).
    pub fn new(enabled: bool, warmup: usize) -> StepGraph {
        StepGraph {
            warmup,
            state_made: false,
            pool: None,
            captured: None,
            off: (!enabled).then(|| "as asked (--cuda-graphs off)".to_string()),
        }
    }

    pub fn status(&self) -> GraphStatus {
        if let Some(why) = &self.off {
            return GraphStatus::Off(why.clone());
        }
        match &self.captured {
            Some(c) => GraphStatus::Replaying {
                step: c.step,
                pool_bytes: c.graph.pool_bytes().map_or(0, |(reserved, _)| reserved),
            },
            None => GraphStatus::WarmingUp,
        }
    }

    /// Runs `f`, work between two steps such as an evaluation, with its allocations served
    /// from the graph's private pool, so that it reserves no segments beside the pool (they
    /// would stay cached in the shared pools, where the step cannot use them). Once a step is
    /// captured, the pool's free blocks are its scratch, unused between replays: `f` runs
    /// there, and takes new segments in the pool only if it needs more than is free. Should
    /// `f` leave a block allocated in the pool (a buffer made lazily and kept), the next
    /// replay would write over it: the capture is dropped instead, and the next step captures
    /// again around that block. Before the capture (the evaluation before training) `f` runs
    /// in the pool the warm-up steps and the capture then take, and what it frees serves
    /// them. With graphs off, or on a device that does not capture, `f` runs as it is.
    pub fn run_between_steps<R>(
        &mut self,
        device: Device,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        if self.off.is_some() || !capture::can_capture(device) {
            return f();
        }
        let Some(c) = &self.captured else {
            return self.run_in_warmup_pool(device, f);
        };
        let (_, before) = c.graph.pool_bytes()?;
        let r = c.graph.run_in_pool(f);
        let (_, after) = c.graph.pool_bytes()?;
        if after != before {
            self.captured = None;
        }
        r
    }

    /// The pool of the warm-up steps and the capture: the one made before, or a new one.
    fn take_pool(&mut self, device: Device) -> Result<Pool> {
        match self.pool.take() {
            Some(p) => Ok(p),
            None => Pool::new(device),
        }
    }

    /// Runs `f` (nothing captured) in the pool the capture will take, which is kept for it.
    fn run_in_warmup_pool<R>(
        &mut self,
        device: Device,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let pool = self.take_pool(device)?;
        let r = pool.run(f);
        self.pool = Some(pool);
        r
    }

    /// Turns graphs off for the rest of the run, dropping any capture.
    fn turn_off(&mut self, why: String) {
        self.captured = None;
        self.pool = None;
        self.off = Some(why);
    }
}

/// The tensors of one micro-batch's inputs on `device`.
fn upload(inputs: &[HostInput], device: Device) -> Result<Vec<Tensor>> {
    inputs
        .iter()
        .map(|i| Tensor::from_vec(i.values.clone(), &i.shape, device))
        .collect()
}

/// A device copy of a step output, so a report keeps its own step's value after the next
/// replay rewrites the output.
fn keep(t: &Tensor) -> Result<Readout> {
    Ok(Readout::pending(t.contiguous_copy()?))
}

/// Writes `values` into input buffer `t` (in stream order, before the replay that reads it).
fn overwrite(t: &Tensor, values: &[i64]) -> Result<()> {
    if t.dtype() != DType::I64 || values.len() != t.storage().len() {
        return Err(Error::invalid(
            "graph replay",
            "an input buffer takes as many I64 values as it holds",
        ));
    }
    let addr = t.storage().allocation().addr();
    backend(t.device())?.upload(DType::I64, HostValues::I64(values.to_vec()), addr)?;
    t.storage().bump_version();
    Ok(())
}

impl<O: Optimizer + Send + 'static> Trainer<O> {
    /// Why this trainer's steps cannot be captured, if they cannot (checked before trying).
    fn graph_refusal(&mut self) -> Option<String> {
        let skips = self
            .with_optimizer_unsettled(|o| o.skips_on_device())
            .ok()?;
        let config = self.config();
        let why = if !capture::can_capture(self.device()) {
            Some(format!("{} runs each op as it is called", self.device()))
        } else if config.uses_scaler() && !skips {
            Some("f16 loss scaling needs an optimizer that skips its update on the device (AdamW and SGD do)".into())
        } else if self.has_grad_sync() {
            Some("data-parallel gradient reduction is not captured".into())
        } else {
            None
        };
        why.or_else(|| {
            self.with_optimizer_unsettled(|o| o.graph_support().err())
                .ok()?
        })
    }

    /// Readies `graph` for this trainer's steps: turns graphs off, with the reason, when the
    /// steps cannot be captured; else makes the optimizer's state, beside the parameters and
    /// not among the warm-up's activations (those segments then come back whole before the
    /// capture, which reserves its own). `step_graphed` does it before its first step; a job
    /// calls it before the evaluation that precedes training, so that the state takes shared
    /// segments while the evaluation runs in the graph's pool (`run_between_steps`).
    pub fn prepare_graph(&mut self, graph: &mut StepGraph) -> Result<()> {
        if graph.off.is_none()
            && graph.captured.is_none()
            && let Some(why) = self.graph_refusal()
        {
            graph.turn_off(why);
        }
        if graph.off.is_none() && !graph.state_made {
            self.with_optimizer_unsettled(|o| o.make_state())??;
            graph.state_made = true;
        }
        if graph.off.is_none() {
            let device = self.device();
            if let Some(s) = self.scaler_mut() {
                // Before the warm-up: its step makes the step count the optimizer then keeps
                // on the device, which the captured step reads and advances.
                s.stage_on(device)?;
            }
        }
        Ok(())
    }

    /// One optimizer step over `inputs`, one entry per micro-batch (see `StepGraph`): eager,
    /// captured or replayed. `loss_of(i, tensors)` runs micro-batch i's forward on its input
    /// tensors (in the order of `inputs[i]`) and returns its loss; it must read the batch
    /// from those tensors only.
    pub fn step_graphed(
        &mut self,
        graph: &mut StepGraph,
        inputs: &HostInputs,
        loss_of: impl FnMut(usize, &[Tensor]) -> Result<MicroBatch>,
    ) -> Result<StepReport> {
        if inputs.len() != self.config().accum {
            return Err(Error::invalid(
                "Trainer",
                format!(
                    "a step takes one set of inputs per micro-batch: {} for {} micro-batches",
                    inputs.len(),
                    self.config().accum
                ),
            ));
        }
        self.prepare_graph(graph)?;
        if graph.off.is_some() {
            return self.eager(inputs, loss_of);
        }
        if graph.warmup > 0 {
            // In the pool the capture will take: the warm-up's activations leave the shared
            // segments to what lives on, and the capture reuses their segments.
            graph.warmup -= 1;
            let device = self.device();
            return graph.run_in_warmup_pool(device, || self.eager(inputs, loss_of));
        }
        if let Some(c) = &graph.captured {
            match replay_check(c, inputs)? {
                InputCheck::Replayable => return self.replay(graph, inputs),
                InputCheck::Recapture(_) => graph.captured = None,
            }
        }
        self.capture_step(graph, inputs, loss_of)
    }

    /// An eager step, each micro-batch's inputs uploaded as its forward starts.
    fn eager(
        &mut self,
        inputs: &HostInputs,
        mut loss_of: impl FnMut(usize, &[Tensor]) -> Result<MicroBatch>,
    ) -> Result<StepReport> {
        let device = self.device();
        self.step(|i| loss_of(i, &upload(&inputs[i], device)?))
    }

    /// Captures this step and runs it (the capture itself runs nothing); on failure, runs
    /// it eagerly and turns graphs off with the reason.
    fn capture_step(
        &mut self,
        graph: &mut StepGraph,
        inputs: &HostInputs,
        mut loss_of: impl FnMut(usize, &[Tensor]) -> Result<MicroBatch>,
    ) -> Result<StepReport> {
        let start = Instant::now();
        let step = self.step_index();
        memory::recorder::set_step(step);
        let tensors = inputs
            .iter()
            .map(|m| upload(m, self.device()))
            .collect::<Result<Vec<_>>>()?;
        let lr = self.set_scheduled_lr()?;
        self.with_optimizer_unsettled(|o| o.prepare_graph_step())??;
        let device = self.device();
        let pool = graph.take_pool(device)?;
        let captured = capture::capture_in(pool, || {
            let how = Accumulation {
                micro_batches: self.config().accum,
                amp: self.config().amp,
                scaler: self.scaler(),
            };
            let done = self.accumulate_synced(&how, |i| loss_of(i, &tensors[i]))?;
            let (grad_norm, loss_scale) = self.finish_step()?;
            Ok((done, grad_norm, loss_scale))
        });
        let (g, (done, grad_norm, loss_scale)) = match captured {
            Ok(c) => c,
            Err(e) => {
                // Nothing ran: undo the step's host bookkeeping, drop gradients that were
                // never computed, and take the step eagerly.
                self.with_optimizer_unsettled(|o| {
                    o.graph_step_abandoned();
                    o.zero_grad_with(true)
                })??;
                if let Some(s) = self.scaler_mut() {
                    s.discard_iteration();
                }
                graph.turn_off(format!("the capture failed: {e}"));
                return self.step(|i| loss_of(i, &tensors[i]));
            }
        };
        g.replay()?;
        let loss = done.mean_loss.tensor().cloned().ok_or_else(|| {
            Error::invalid("graph capture", "the step's loss is not on the device")
        })?;
        let grad_norm = grad_norm.and_then(|n| n.tensor().cloned());
        let loss_scale = match loss_scale {
            Some(r) => Some(r.tensor().cloned().ok_or_else(|| {
                Error::invalid("graph capture", "the scaler's report is not on the device")
            })?),
            None => None,
        };
        graph.captured = Some(Captured {
            graph: g,
            inputs: tensors,
            loss,
            grad_norm,
            loss_scale,
            tokens: done.tokens,
            step,
        });
        let c = graph
            .captured
            .as_ref()
            .ok_or_else(|| Error::invalid("graph", "lost"))?;
        self.graph_report(c, lr, start)
    }

    /// One replay of the captured step on `inputs` (already checked).
    fn replay(&mut self, graph: &mut StepGraph, inputs: &HostInputs) -> Result<StepReport> {
        let start = Instant::now();
        memory::recorder::set_step(self.step_index());
        let c = graph
            .captured
            .as_ref()
            .ok_or_else(|| Error::invalid("graph replay", "nothing is captured"))?;
        for (t, input) in c.inputs.iter().flatten().zip(inputs.iter().flatten()) {
            // What the step derived from its ids on the host (an embedding backward's
            // grouping) is made again from these, then the ids themselves go up.
            c.graph
                .refresh_input(t.storage().allocation().addr(), &input.values)?;
            overwrite(t, &input.values)?;
        }
        let lr = self.set_scheduled_lr()?;
        self.with_optimizer_unsettled(|o| o.prepare_graph_step())??;
        c.graph.set_dropout_seed(replay_seed(self.step_index()))?;
        c.graph.replay()?;
        self.with_optimizer_unsettled(|o| o.graph_step_replayed())?;
        self.graph_report(c, lr, start)
    }

    /// The report of a captured or replayed step, its outputs copied so that it keeps them.
    fn graph_report(&mut self, c: &Captured, lr: f64, start: Instant) -> Result<StepReport> {
        let device = self.device();
        let report = StepReport {
            step: self.step_index(),
            loss: keep(&c.loss)?,
            lr,
            grad_norm: c.grad_norm.as_ref().map(keep).transpose()?,
            loss_scale: c.loss_scale.as_ref().map(keep).transpose()?,
            in_backward: None,
            tokens: c.tokens,
            seconds: start.elapsed().as_secs_f64(),
            memory_allocated: memory::memory_allocated(device)?,
            max_memory_allocated: memory::max_memory_allocated(device)?,
            memory_reserved: memory::memory_reserved(device)?,
            rank_peaks: Readout::ready(Vec::new()),
        };
        self.set_step_index(self.step_index() + 1);
        Ok(report)
    }
}

/// The dropout seed of a replayed step (its masks' keys are the captured keys ^ this): a
/// different one every step, the same for the same step of any run (splitmix64).
fn replay_seed(step: u64) -> u64 {
    let mut z = step.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Whether `inputs` fit the captured step: same shapes, and every host check the capture
/// relied on holds (an out-of-range id is the eager kernels' error).
fn replay_check(c: &Captured, inputs: &HostInputs) -> Result<InputCheck> {
    let same_counts = c.inputs.len() == inputs.len()
        && c.inputs.iter().zip(inputs).all(|(t, h)| t.len() == h.len());
    let (statics, host) = (c.inputs.iter().flatten(), inputs.iter().flatten());
    if !same_counts
        || statics
            .clone()
            .zip(host.clone())
            .any(|(t, i)| t.shape() != i.shape)
    {
        return Ok(InputCheck::Recapture("the inputs changed shape".into()));
    }
    let mut verdict = InputCheck::Replayable;
    for (t, input) in statics.zip(host) {
        let check = c
            .graph
            .check_input(t.storage().allocation().addr(), &input.values)?;
        if check != InputCheck::Replayable {
            verdict = check;
        }
    }
    Ok(verdict)
}
