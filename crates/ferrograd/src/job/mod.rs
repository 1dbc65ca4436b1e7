//! The main job, `ferrograd train`: a character-level GPT trained on a text (the shipped
//! corpus by default) through the `Trainer`, with every memory strategy behind a switch,
//! evaluation under no_grad, a text sample at the end, and training state saved and resumed.
//!
//! The loop reports through `Event`s, so the command line can draw a progress bar and tests
//! can watch every step.

mod budget;
mod data_parallel;
mod fit;
mod optimizer;
mod sample;
mod state;
mod trace;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use serde::Serialize;

pub use budget::{
    Alternative, BatchSteps, FIT_RULE, Fitted, alternatives, choose_for_budget, fit_budget,
};
pub use data_parallel::{RankPeak, run_launched};
pub use fit::{check_fits, plan_job, target_of};
pub use optimizer::{JobOptimizer, OptimizerChoice, OptimizerSettings};
pub use sample::sample_text;
pub use state::{STATE_FORMAT, load_training_state, save_training_state};
pub use trace::{MemoryTraceSettings, TraceRun, TraceWritten};

use crate::autograd::{LeakCheck, LeakReport, no_grad};
use crate::base::{DType, Error, Result};
use crate::data::{Split, TextDataset};
use crate::dist::{DdpConfig, Reducer};
use crate::memory;
use crate::nn::{Gpt, GptConfig, Module};
use crate::optim::{Optimizer, WarmupCosine};
use crate::tensor::{Device, Generator, Readout, Tensor};
use crate::train::{
    GradScaler, GraphStatus, HostInput, HostInputs, InBackwardPath, LossScaling, MicroBatch,
    StepGraph, StepReport, Trainer, TrainerConfig,
};

/// Everything a run needs; `Default` is the CPU run the README shows.
#[derive(Clone, Debug)]
pub struct TrainJob {
    /// The text to learn; the tokenizer is its set of characters.
    pub text: String,
    /// The model's shape; `vocab_size` is replaced by the tokenizer's.
    pub model: GptConfig,
    /// Sequences per micro-batch.
    pub batch_size: usize,
    /// Total optimizer steps of the run (the schedule's length).
    pub max_steps: u64,
    /// Stop this invocation after this many steps (the run can be resumed later).
    pub stop_after: Option<u64>,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub optimizer: OptimizerChoice,
    /// None: the optimizer's default (`OptimizerChoice::default_weight_decay`).
    pub weight_decay: Option<f64>,
    /// SGD's momentum.
    pub momentum: f64,
    /// Every memory strategy: accumulation, clipping, autocast, step in backward, zero_grad
    /// mode, recomputation and freezing; the `Trainer` composes them.
    pub trainer: TrainerConfig,
    /// The dtype the model's parameters (and so its activations and gradients) are kept in:
    /// F32, or BF16 with AdamW keeping an f32 master copy and f32 moments of each parameter
    /// (`--weights bf16`; no autocast, so `trainer.amp` must be None).
    pub weights: DType,
    pub device: Device,
    /// Evaluate every this many steps (and at the start and end); 0: only start and end.
    pub eval_every: u64,
    /// Batches per evaluation.
    pub eval_batches: usize,
    /// Characters sampled at the end.
    pub sample_chars: usize,
    /// Seeds the weights, the batches, dropout and sampling.
    pub seed: u64,
    /// Save training state here at the end (and every `save_every` steps).
    pub save: Option<PathBuf>,
    pub save_every: u64,
    /// Continue from this saved state.
    pub resume: Option<PathBuf>,
    /// Watch memory across steps with a `LeakCheck` and report what grows (`--detect-leaks`).
    pub detect_leaks: bool,
    /// Attention through the fused kernel where the device has one (true, the default), or
    /// always through matmul, softmax and matmul (`--attention composed`).
    pub fused_attention: bool,
    /// When this flag is raised (by a signal handler, say), the run stops at the next step
    /// boundary, saves its state to `save` if given, and returns `Error::Interrupted`.
    pub interrupt: Option<Arc<AtomicBool>>,
    /// Record the first steps with the memory recorder and write the trace files.
    pub memory_trace: Option<MemoryTraceSettings>,
    /// Data-parallel ranks (threads on the CPU, gradients averaged by DDP); 1: one process.
    pub ranks: usize,
    /// Shard AdamW's moments over the ranks (ZeRO-1) instead of averaging by DDP.
    pub zero: bool,
    /// Capture one training step as a CUDA graph and replay it (true, the default), where
    /// the run allows it (`GraphStatus` says why not); false: every step eager.
    pub cuda_graphs: bool,
}

impl Default for TrainJob {
    fn default() -> Self {
        TrainJob {
            text: crate::data::default_corpus().to_string(),
            model: GptConfig {
                vocab_size: 0,
                block_size: 64,
                n_layer: 4,
                n_head: 4,
                n_embd: 128,
                dropout: 0.0,
                bias: true,
                seed: 0,
            },
            batch_size: 16,
            max_steps: 800,
            stop_after: None,
            lr: 2e-3,
            min_lr: 2e-4,
            warmup_steps: 30,
            optimizer: OptimizerChoice::AdamW,
            weight_decay: None,
            momentum: 0.9,
            trainer: TrainerConfig::default(),
            weights: DType::F32,
            device: Device::Cpu,
            eval_every: 200,
            eval_batches: 8,
            sample_chars: 300,
            seed: 0,
            save: None,
            save_every: 0,
            resume: None,
            detect_leaks: false,
            fused_attention: true,
            interrupt: None,
            memory_trace: None,
            ranks: 1,
            zero: false,
            cuda_graphs: true,
        }
    }
}

/// What the loop reports as it goes.
#[derive(Clone, Debug)]
pub enum Event {
    /// The model is built: its parameter count and the step it starts from.
    Started {
        params: usize,
        start_step: u64,
        /// The step's peak as predicted from the sizes before anything was allocated.
        predicted_peak: u64,
        /// Which step in backward runs (None: the optimizer steps after backward).
        in_backward: Option<InBackwardPath>,
        /// With f16 loss scaling, where its decisions are made.
        loss_scaling: Option<LossScaling>,
        /// Whether attention runs the fused kernel (else matmul, softmax and matmul, which
        /// keep the (B, H, T, T) probabilities for backward).
        fused_attention: bool,
    },
    Step(StepReport),
    Eval(EvalReport),
    Saved {
        step: u64,
        path: PathBuf,
    },
    /// The memory trace of the first steps is written.
    MemoryTraced(TraceWritten),
    /// The leak check's verdict after the last step (with `detect_leaks`).
    Leaks(LeakReport),
    /// Whether steps replay a CUDA graph, each time that changes (on, or off and why).
    Graphs(GraphStatus),
}

#[derive(Clone, Debug, Serialize)]
pub struct EvalReport {
    pub step: u64,
    pub train_loss: f64,
    pub val_loss: f64,
}

/// The run's outcome; `--json` prints it.
#[derive(Clone, Debug, Serialize)]
pub struct JobSummary {
    /// The first step's training loss (of this invocation).
    pub initial_loss: f64,
    /// The last step's training loss.
    pub final_loss: f64,
    /// Evaluation at the start and at the end (mean over `eval_batches`, under no_grad).
    pub initial_eval: EvalReport,
    pub final_eval: EvalReport,
    /// Steps run by this invocation, and the index reached.
    pub steps: u64,
    pub step_reached: u64,
    pub tokens_per_s: f64,
    pub seconds: f64,
    pub params: usize,
    /// The optimizer's name ("AdamW", "SGD").
    pub optimizer: String,
    /// The dtype of the model's parameters and activations ("f32", "bf16").
    pub weights: String,
    /// Whether AdamW keeps f32 master copies of the parameters (with bf16 weights).
    pub master_weights: bool,
    /// The recomputation policy the run took ("off", "gelu", "every:2", ...).
    pub recompute: String,
    /// How the step in backward ran, in words (absent without it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_in_backward: Option<String>,
    /// max_memory_allocated over the run and the categories at that moment.
    pub peak_bytes: u64,
    /// The planner's peak allocated for the run, made before anything was allocated.
    pub predicted_peak_bytes: u64,
    /// The planner's peak reserved (the caching allocator's on a GPU).
    pub predicted_peak_reserved_bytes: u64,
    pub by_category_at_peak: std::collections::BTreeMap<String, u64>,
    pub peak_reserved_bytes: u64,
    /// What the leak check found (absent without `detect_leaks`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leak_check: Option<LeakSummary>,
    pub device: String,
    /// On a GPU: how the steps ran at the end (`GraphStatus` in words: replaying a captured
    /// step, or eager and why).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda_graphs: Option<String>,
    pub sample: String,
    /// Each rank's peak by category (data-parallel runs only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankPeak>,
}

/// The leak check's verdict in the summary: each leak as its category, rate, holder and fix.
#[derive(Clone, Debug, Serialize)]
pub struct LeakSummary {
    pub steps: usize,
    pub clean: bool,
    pub leaks: Vec<LeakLine>,
}

#[derive(Clone, Debug, Serialize)]
pub struct LeakLine {
    /// The growing category ("reserved" for the allocator's cache).
    pub category: String,
    pub bytes_per_step: u64,
    pub holder: String,
    pub fix: String,
}

impl From<&LeakReport> for LeakSummary {
    fn from(r: &LeakReport) -> LeakSummary {
        LeakSummary {
            steps: r.steps,
            clean: r.is_clean(),
            leaks: r
                .leaks
                .iter()
                .map(|l| LeakLine {
                    category: l.category.map_or("reserved".into(), |c| c.to_string()),
                    bytes_per_step: l.bytes_per_step,
                    holder: l.holder.to_string(),
                    fix: l.fix().to_string(),
                })
                .collect(),
        }
    }
}

/// Builds the model, runs the steps and returns the summary (rank 0's, on several ranks).
pub fn run(job: &TrainJob, on_event: &mut dyn FnMut(&Event)) -> Result<JobSummary> {
    check_settings(job)?;
    if job.ranks > 1 || job.zero {
        return data_parallel::run_ranks(job, on_event);
    }
    run_replica(job, None, on_event)
}

/// The run on one process, or as one rank of `group` (only rank 0 evaluates, samples and
/// saves; the caller gives the others a callback that ignores their events).
fn run_replica(
    job: &TrainJob,
    group: Option<data_parallel::Group>,
    on_event: &mut dyn FnMut(&Event),
) -> Result<JobSummary> {
    let rank = group.as_ref().map_or(0, |g| g.rank());
    let leader = rank == 0;
    // Only rank 0 writes the state: the others must not race it probing the folder.
    if let Some(path) = &job.save
        && leader
    {
        crate::io::check_output_path(path)?;
    }
    if let Some(t) = &job.memory_trace {
        t.check()?;
    }
    let data = TextDataset::new(&job.text)?;
    check_text_length(&data, job.model.block_size)?;
    let plan = check_fits(job, &data)?;
    let zero = group.as_ref().filter(|_| job.zero);
    let (mut model, mut trainer) = build(job, &data, job.device, zero)?;
    let mut data_rng = Generator::new(data_parallel::data_seed(job.seed, rank));
    if let Some(path) = &job.resume {
        load_training_state(path, &model, &mut trainer, &mut data_rng, data.tokenizer())?;
        if !leader {
            let seed = data_parallel::resumed_data_seed(job.seed, rank, trainer.step_index());
            data_rng = Generator::new(seed);
        }
        if trainer.step_index() >= job.max_steps {
            return Err(Error::AlreadyFinished {
                path: path.display().to_string(),
                step: trainer.step_index(),
                max_steps: job.max_steps,
            });
        }
    }
    // ZeRO-1 reduces the gradients in its own step; otherwise DDP averages them in backward.
    let reducer = group
        .as_ref()
        .filter(|_| !job.zero)
        .map(|g| Reducer::new(&model, Arc::clone(g), DdpConfig::default()))
        .transpose()?;
    if let Some(r) = &reducer {
        trainer = trainer.with_grad_sync(r.grad_sync())?;
    }
    let start_step = trainer.step_index();
    let params = model.config.num_params();
    let predicted_peak = plan.peak_allocated;
    let in_backward = trainer.in_backward_path().cloned();
    let compute_dtype = job.trainer.amp.unwrap_or(job.weights);
    model.train(true);
    on_event(&Event::Started {
        params,
        start_step,
        predicted_peak,
        in_backward: in_backward.clone(),
        loss_scaling: trainer.scaler().map(GradScaler::decided),
        fused_attention: model.attention_fused(compute_dtype),
    });
    memory::reset_peak_memory_stats(job.device)?;
    if let Some(g) = &group {
        // No rank may reset the shared peaks once another has started.
        g.barrier()?;
    }
    // One eager step first: it compiles the kernels and makes the optimizer's state. Only a
    // GPU run says how its steps run (elsewhere every op runs as it is called).
    let on_gpu = matches!(job.device, Device::Cuda(_));
    let mut step_graph = StepGraph::new(job.cuda_graphs && on_gpu, 1);
    trainer.prepare_graph(&mut step_graph)?;
    // In the pool the first steps will take: what the evaluation frees there serves them.
    let initial_eval = step_graph.run_between_steps(job.device, || {
        evaluate_on(leader, &mut model, &data, job, start_step)
    })?;
    on_event(&Event::Eval(initial_eval.clone()));
    let end = job
        .stop_after
        .map_or(job.max_steps, |n| (start_step + n).min(job.max_steps));
    let mut leak_check = (job.detect_leaks && leader)
        .then(|| LeakCheck::new(job.device))
        .transpose()?;
    let mut graph_status = step_graph.status();
    if on_gpu {
        on_event(&Event::Graphs(graph_status.clone()));
    }
    let started = Instant::now();
    let (mut losses, mut tokens) = (Losses::default(), 0usize);
    let mut tracing = job
        .memory_trace
        .as_ref()
        .map(|t| TraceRun::start(t, start_step))
        .transpose()?;
    while trainer.step_index() < end {
        if job
            .interrupt
            .as_ref()
            .is_some_and(|f| f.load(Ordering::SeqCst))
        {
            let step = trainer.step_index();
            let detail = match &job.save {
                // ZeRO-1's state is gathered from every rank at a step they all reach; an
                // interrupt may find the ranks at different points.
                Some(_) if job.zero => {
                    "nothing was saved: with --zero 1 the state is saved at --save-every steps and at the end".to_string()
                }
                Some(path) if leader => {
                    save_training_state(path, &model, &mut trainer, &data_rng, data.tokenizer())?;
                    on_event(&Event::Saved {
                        step,
                        path: path.clone(),
                    });
                    format!(
                        "the state is saved in {}; continue with --resume {}",
                        path.display(),
                        path.display()
                    )
                }
                Some(_) => "rank 0 saves the state".to_string(),
                None => "nothing was saved (no --save was given)".to_string(),
            };
            return Err(Error::Interrupted { step, detail });
        }
        let mut report = train_step(
            &mut trainer,
            &mut model,
            reducer.as_ref(),
            (&data, &mut data_rng),
            job,
            Some(&mut step_graph),
        )?;
        let status = step_graph.status();
        if on_gpu && status != graph_status {
            on_event(&Event::Graphs(status.clone()));
            graph_status = status;
        }
        if let Some(g) = &group {
            data_parallel::group_report(&mut report, &**g, job.device)?;
        }
        if let Some(check) = &mut leak_check {
            check.mark_step();
        }
        tokens += report.tokens;
        losses.see(&report);
        on_event(&Event::Step(report));
        let step = trainer.step_index();
        if tracing.as_ref().is_some_and(|t| step >= t.until)
            && let Some(t) = tracing.take()
        {
            on_event(&Event::MemoryTraced(t.finish(job.device)?));
        }
        if job.eval_every > 0 && step % job.eval_every == 0 && step < end {
            // In the captured step's pool: its scratch is free between replays.
            let e = step_graph.run_between_steps(job.device, || {
                evaluate_on(leader, &mut model, &data, job, step)
            })?;
            on_event(&Event::Eval(e));
        }
        if let Some(path) = &job.save
            && job.save_every > 0
            && step % job.save_every == 0
            && step < end
        {
            if leader {
                save_training_state(path, &model, &mut trainer, &data_rng, data.tokenizer())?;
                on_event(&Event::Saved {
                    step,
                    path: path.clone(),
                });
            } else {
                state::gather_for_save(&mut trainer)?;
            }
        }
    }
    if let Some(g) = &group {
        // Every rank's steps are done: its peak is final.
        g.barrier()?;
    }
    // The steps were queued, not waited for: the time ends when the device is done.
    crate::backend::synchronize(job.device)?;
    let seconds = started.elapsed().as_secs_f64();
    if let Some(t) = tracing.take() {
        on_event(&Event::MemoryTraced(t.finish(job.device)?));
    }
    let leak_report = leak_check.map(|c| c.report());
    if let Some(r) = &leak_report {
        on_event(&Event::Leaks(r.clone()));
    }
    let alloc = memory::allocator(job.device)?;
    let (peak_bytes, at_peak) = (alloc.max_memory_allocated(), alloc.by_category_at_peak());
    let peak_reserved_bytes = alloc.max_memory_reserved();
    let ranks = match &group {
        Some(g) => data_parallel::rank_peaks(job.device, &**g)?,
        None => Vec::new(),
    };
    // In the captured step's pool, like the evaluations between steps: beside a pool that
    // holds most of the device, a final evaluation outside it would not fit.
    let last_step = trainer.step_index();
    let final_eval = step_graph.run_between_steps(job.device, || {
        evaluate_on(leader, &mut model, &data, job, last_step)
    })?;
    on_event(&Event::Eval(final_eval.clone()));
    if !leader {
        if job.save.is_some() {
            state::gather_for_save(&mut trainer)?;
        }
        return Ok(follower_summary(final_eval));
    }
    if let Some(path) = &job.save {
        save_training_state(path, &model, &mut trainer, &data_rng, data.tokenizer())?;
        on_event(&Event::Saved {
            step: trainer.step_index(),
            path: path.clone(),
        });
    }
    let sample = step_graph.run_between_steps(job.device, || {
        sample_text(
            &mut model,
            data.tokenizer(),
            job.sample_chars,
            job.seed,
            job.device,
        )
    })?;
    Ok(JobSummary {
        initial_loss: losses.first()?,
        final_loss: losses.last()?,
        initial_eval,
        final_eval,
        steps: trainer.step_index() - start_step,
        step_reached: trainer.step_index(),
        tokens_per_s: tokens as f64 / seconds.max(1e-9),
        seconds,
        params,
        optimizer: trainer.with_optimizer(|o| o.name())?.to_string(),
        weights: job.weights.to_string(),
        master_weights: trainer.with_optimizer(|o| o.master_weights())?,
        recompute: job.trainer.recompute.to_string(),
        step_in_backward: in_backward.map(|p| p.to_string()),
        peak_bytes,
        predicted_peak_bytes: plan.peak_allocated,
        predicted_peak_reserved_bytes: plan.peak_reserved,
        by_category_at_peak: at_peak.to_map(),
        peak_reserved_bytes,
        leak_check: leak_report.as_ref().map(LeakSummary::from),
        device: job.device.to_string(),
        cuda_graphs: on_gpu.then(|| step_graph.status().to_string()),
        sample,
        ranks,
    })
}

/// The first and the latest step's loss of a run, kept on the device until the summary
/// reads them (reading a loss waits for its step). The planner holds them as the loop does:
/// they are bytes of the run.
#[derive(Default)]
pub(super) struct Losses {
    first: Option<Readout>,
    last: Option<Readout>,
}

impl Losses {
    pub(super) fn see(&mut self, report: &StepReport) {
        self.first.get_or_insert_with(|| report.loss.clone());
        self.last = Some(report.loss.clone());
    }

    /// The first step's loss (NaN when no step ran).
    fn first(&self) -> Result<f64> {
        self.first.as_ref().map_or(Ok(f64::NAN), Readout::value)
    }

    fn last(&self) -> Result<f64> {
        self.last.as_ref().map_or(Ok(f64::NAN), Readout::value)
    }
}

/// Evaluation by the leader; the other ranks' parameters are the same, so they skip it.
fn evaluate_on(
    leader: bool,
    model: &mut Gpt,
    data: &TextDataset,
    job: &TrainJob,
    step: u64,
) -> Result<EvalReport> {
    if leader {
        return evaluate(model, data, job, step, job.device);
    }
    Ok(EvalReport {
        step,
        train_loss: f64::NAN,
        val_loss: f64::NAN,
    })
}

/// What a rank other than 0 returns (its caller keeps rank 0's summary only).
fn follower_summary(eval: EvalReport) -> JobSummary {
    JobSummary {
        initial_loss: f64::NAN,
        final_loss: f64::NAN,
        initial_eval: eval.clone(),
        final_eval: eval,
        steps: 0,
        step_reached: 0,
        tokens_per_s: 0.0,
        seconds: 0.0,
        params: 0,
        optimizer: String::new(),
        weights: String::new(),
        master_weights: false,
        recompute: String::new(),
        step_in_backward: None,
        peak_bytes: 0,
        predicted_peak_bytes: 0,
        predicted_peak_reserved_bytes: 0,
        by_category_at_peak: Default::default(),
        peak_reserved_bytes: 0,
        leak_check: None,
        device: String::new(),
        cuda_graphs: None,
        sample: String::new(),
        ranks: Vec::new(),
    }
}

/// The vocabulary the model is built with: the tokenizer's, or a larger one the job asks for
/// (padded, as GPT-2's 50257 is often padded to 50304; the extra rows are never targets).
fn model_vocab(job: &TrainJob, data: &TextDataset) -> Result<usize> {
    let (asked, needed) = (job.model.vocab_size, data.vocab_size());
    match asked {
        0 => Ok(needed),
        v if v >= needed => Ok(v),
        v => Err(Error::invalid(
            "train",
            format!(
                "--vocab-size {v} is smaller than the text's {needed} characters; give at least {needed}, or leave it out to use the text's"
            ),
        )),
    }
}

/// The model and trainer of `job` on `device`, built as every run builds them (the planner
/// builds them on the meta device).
/// With `zero`, the optimizer is AdamW sharded over that group (ZeRO-1).
fn build(
    job: &TrainJob,
    data: &TextDataset,
    device: Device,
    zero: Option<&data_parallel::Group>,
) -> Result<(Gpt, Trainer<JobOptimizer>)> {
    check_weights(job)?;
    let mut cfg = job.model.clone();
    cfg.vocab_size = model_vocab(job, data)?;
    cfg.seed = job.seed;
    let mut model = Gpt::new_with_dtype(cfg, job.weights, device)?;
    model.set_fused_attention(job.fused_attention);
    let settings = optimizer_settings(job);
    let named = model.named_parameters();
    let trainer = Trainer::for_model(&mut model, trainer_config(job)?, device, |p| match zero {
        None => JobOptimizer::new(p, &settings),
        Some(g) => JobOptimizer::zero1(with_names(&named, p), &settings, Arc::clone(g)),
    })?;
    if !model.parameters().iter().any(|p| p.requires_grad()) {
        return Err(Error::invalid(
            "train",
            format!(
                "the --freeze patterns {:?} match every parameter: nothing is left to train; freeze fewer parameters",
                job.trainer.freeze
            ),
        ));
    }
    Ok((model, trainer))
}

/// The weight precisions a run can train in, and what they cannot be combined with (checked
/// where the model is built, so a plan refuses what a run refuses). SGD's refusal is the
/// optimizer's own (`JobOptimizer::new`).
fn check_weights(job: &TrainJob) -> Result<()> {
    let refuse = |detail: &str| Err(Error::invalid("train", detail));
    match job.weights {
        DType::F32 => return Ok(()),
        DType::BF16 => {}
        DType::F16 => {
            return refuse(
                "--weights f16 is not offered: f16 gradients underflow without a loss scaler, which a model kept in f16 does not get here; use --weights bf16 (f32's range), or --amp f16 (f32 weights, f16 autocast with a GradScaler)",
            );
        }
        other => {
            return refuse(&format!(
                "--weights {other} is not a weight precision: use f32 or bf16"
            ));
        }
    }
    if let Some(amp) = job.trainer.amp {
        return refuse(&format!(
            "--weights {} already keeps the model's parameters and activations in {}, and --amp {amp} autocasts an f32 model: drop --amp, or use --weights f32 --amp {amp}",
            job.weights, job.weights
        ));
    }
    if job.zero {
        return refuse(optimizer::ZERO_MASTER_WEIGHTS);
    }
    Ok(())
}

/// The trainable parameters `params` with their names in `named`.
fn with_names(
    named: &[(String, crate::tensor::Tensor)],
    params: Vec<crate::tensor::Tensor>,
) -> Vec<(String, crate::tensor::Tensor)> {
    params
        .into_iter()
        .map(|p| {
            let name = named
                .iter()
                .find(|(_, q)| q.shares_storage(&p))
                .map_or_else(String::new, |(n, _)| n.clone());
            (name, p)
        })
        .collect()
}

/// One training step on batches drawn from `rng`, one per micro-batch (each forward prepared
/// by the DDP reducer when data-parallel). With a `StepGraph` the batches are drawn before
/// the step, so that a replayed graph reads them from its own buffers; without one (a plan
/// on the meta device) each micro-batch draws its own as its forward starts.
fn train_step(
    trainer: &mut Trainer<JobOptimizer>,
    model: &mut Gpt,
    reducer: Option<&Reducer>,
    (data, rng): (&TextDataset, &mut Generator),
    job: &TrainJob,
    graph: Option<&mut StepGraph>,
) -> Result<StepReport> {
    let shape = vec![job.batch_size, model.config.block_size];
    let forward = |model: &mut Gpt, x: &Tensor, y: &Tensor| {
        if let Some(r) = reducer {
            r.prepare_forward()?;
        }
        Ok(MicroBatch {
            loss: model.loss(x, y)?,
            tokens: x.numel(),
        })
    };
    let Some(graph) = graph else {
        let device = trainer.device();
        return trainer.step(|_| {
            let (x, y) = data.batch(Split::Train, shape[0], shape[1], rng, device)?;
            forward(model, &x, &y)
        });
    };
    let mut inputs: HostInputs = Vec::with_capacity(trainer.config().accum);
    for _ in 0..trainer.config().accum {
        let (x, y) = data.host_batch(Split::Train, shape[0], shape[1], rng)?;
        inputs.push(vec![HostInput::new(x, &shape), HostInput::new(y, &shape)]);
    }
    trainer.step_graphed(graph, &inputs, |_, tensors| match tensors {
        [x, y] => forward(model, x, y),
        _ => Err(Error::invalid(
            "train",
            "a micro-batch takes ids and targets",
        )),
    })
}

/// Settings that leave nothing to do, or that the run cannot do, refused before any work.
fn check_settings(job: &TrainJob) -> Result<()> {
    let refuse = |detail: &str| Err(Error::invalid("train", detail));
    if job.max_steps == 0 {
        return refuse("--max-steps 0 leaves nothing to train; give at least 1");
    }
    if job.stop_after == Some(0) {
        return refuse(
            "--stop-after 0 leaves nothing to train; give at least 1, or leave it out to train to --max-steps",
        );
    }
    if job.eval_batches == 0 {
        return refuse("--eval-batches 0 cannot measure a loss; give at least 1");
    }
    if job.device == Device::Meta {
        return refuse(
            "the meta device holds shapes but no data, so it cannot train; use --device cpu or cuda",
        );
    }
    check_weights(job)
}

/// The shortest text whose train and validation splits both hold a window of one token plus
/// its target.
fn min_text_len() -> usize {
    (2..)
        .find(|&n: &usize| {
            let n_train = ((n as f64) * (1.0 - crate::data::VAL_FRACTION)).round() as usize;
            n_train >= 2 && n - n_train.min(n) >= 2
        })
        .unwrap_or(2)
}

/// Both splits must hold at least one window of `block_size` tokens plus a target.
fn check_text_length(data: &TextDataset, block_size: usize) -> Result<()> {
    let shortest = [Split::Train, Split::Val]
        .into_iter()
        .map(|s| (s, data.tokens(s).len()))
        .min_by_key(|&(_, n)| n);
    let Some((split, len)) = shortest else {
        return Ok(());
    };
    if len < 2 {
        return Err(Error::invalid(
            "train",
            format!(
                "the text is too short for any block size: its {split} split has {len} tokens; give a text of at least {} characters",
                min_text_len()
            ),
        ));
    }
    if len <= block_size {
        return Err(Error::invalid(
            "train",
            format!(
                "the text's {split} split has {len} tokens, too few for --block-size {block_size}; use --block-size {} or less, or a longer text",
                len - 1
            ),
        ));
    }
    Ok(())
}

fn optimizer_settings(job: &TrainJob) -> OptimizerSettings {
    OptimizerSettings {
        choice: job.optimizer,
        lr: job.lr,
        weight_decay: job
            .weight_decay
            .unwrap_or_else(|| job.optimizer.default_weight_decay()),
        momentum: job.momentum,
        master_weights: job.weights != DType::F32,
    }
}

fn trainer_config(job: &TrainJob) -> Result<TrainerConfig> {
    let warmup = job.warmup_steps.min(job.max_steps);
    Ok(TrainerConfig {
        schedule: Some(WarmupCosine::new(
            job.lr,
            job.min_lr,
            warmup,
            job.max_steps,
        )?),
        ..job.trainer.clone()
    })
}

/// Mean loss over `eval_batches` of each split, in eval mode and under no_grad. Batches come
/// from a generator seeded by the step, so evaluation never shifts the training batches.
fn evaluate(
    model: &mut Gpt,
    data: &TextDataset,
    job: &TrainJob,
    step: u64,
    device: Device,
) -> Result<EvalReport> {
    let _g = no_grad();
    let _phase = memory::recorder::phase_scope(memory::recorder::Phase::Evaluation);
    model.eval();
    let mut losses = [0.0; 2];
    for (split, mean) in [Split::Train, Split::Val].into_iter().zip(&mut losses) {
        let mut g = Generator::new(job.seed ^ 0xE7A1 ^ step.rotate_left(17));
        for _ in 0..job.eval_batches {
            let (x, y) = data.batch(
                split,
                job.batch_size,
                model.config.block_size,
                &mut g,
                device,
            )?;
            *mean += model.loss(&x, &y)?.item()? / job.eval_batches as f64;
        }
    }
    model.train(true);
    Ok(EvalReport {
        step,
        train_loss: losses[0],
        val_loss: losses[1],
    })
}
