//! `ferrograd train`: flags → `job::TrainJob`, a progress bar over the steps, and the end
//! report (losses, speed, peak memory by category, a text sample) or one JSON object.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use anyhow::bail;
use clap::{Parser, ValueEnum};
use ferrograd::dist::{LaunchEnv, NcclGroup, RENDEZVOUS_TIMEOUT};
use ferrograd::job::{self, Event, JobSummary, MemoryTraceSettings, OptimizerChoice, TrainJob};
use ferrograd::memory::format_size;
use ferrograd::nn::Recompute;
use ferrograd::train::{StepReport, TrainerConfig};
use ferrograd::{DType, Device};
use indicatif::{ProgressBar, ProgressStyle};

/// Trains a character-level GPT on the shipped Shakespeare corpus (or --text FILE).
#[derive(Parser, Debug)]
pub struct TrainArgs {
    /// cpu, cuda, cuda:N
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Data-parallel ranks on the CPU: N threads, each with its own batches and a replica of
    /// the model, gradients averaged by DDP (logs and saved state from rank 0).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=256))]
    ranks: u64,
    /// ZeRO stage: 0 (DDP: every rank keeps all of AdamW's state) or 1 (each rank keeps the
    /// moments of its 1/N shard; gradients reduce-scattered, parameters all-gathered).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    zero: u8,
    /// Total optimizer steps (the learning-rate schedule's length).
    #[arg(long, default_value_t = 800)]
    max_steps: u64,
    /// Stop after this many steps of this invocation (resume later with --resume).
    #[arg(long)]
    stop_after: Option<u64>,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Context length T.
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    #[arg(long, default_value_t = 4)]
    n_layer: usize,
    #[arg(long, default_value_t = 4)]
    n_head: usize,
    /// Width C (a multiple of --n-head).
    #[arg(long, default_value_t = 128)]
    n_embd: usize,
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// adamw, or sgd (with momentum; its --step-in-backward makes no weight gradients).
    #[arg(long, default_value = "adamw")]
    optimizer: OptimizerChoice,
    /// Peak learning rate, reached after --warmup steps, then cosine to --min-lr.
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    #[arg(long, default_value_t = 2e-4)]
    min_lr: f64,
    #[arg(long, default_value_t = 30)]
    warmup: u64,
    /// Weight decay (default: 0.1 for adamw, 0 for sgd, whose step in backward needs none).
    #[arg(long)]
    weight_decay: Option<f64>,
    /// SGD's momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    /// Mixed precision: bf16, f16 (with a GradScaler) or off.
    #[arg(long, default_value = "off", value_parser = parse_amp)]
    amp: Amp,
    /// The dtype the model's parameters and activations are kept in: f32, or bf16 (weights,
    /// gradients and activations at half the bytes, no autocast casts), with AdamW keeping an
    /// f32 master copy and f32 moments of each parameter, saved with --save. Needs --optimizer
    /// adamw; not with --amp, which autocasts an f32 model (bf16 weights already compute in
    /// bf16), nor with --zero 1.
    #[arg(long, default_value = "f32", value_parser = parse_weights)]
    weights: Weights,
    /// Activation recomputation: auto (gelu on a GPU, off on the CPU), off, gelu (each MLP's
    /// GELU output, one elementwise pass per block), every:K (every K-th transformer block) or
    /// selective:K (as every:K, each recomputed block keeping its attention's output and
    /// log-sum-exp, so backward skips the attention's forward).
    #[arg(long, default_value = "auto", value_parser = parse_recompute)]
    recompute: RecomputeArg,
    /// Attention: fused (one kernel that keeps a log-sum-exp per query, where the device has
    /// it) or composed (matmul, softmax, matmul; keeps the (B, H, T, T) probabilities).
    #[arg(long, default_value = "fused")]
    attention: AttentionPath,
    /// On a GPU, capture one training step as a CUDA graph after a warm-up step and replay
    /// it (on), or run every step op by op (off). Runs that a graph cannot replay (SGD, data
    /// parallel, step in backward) run op by op, and the log says why.
    /// With dropout, replays draw their masks from the captured keys and a per-step seed:
    /// reproducible, but not the masks of a run with graphs off.
    #[arg(long, default_value = "on")]
    cuda_graphs: Switch,
    /// Micro-batches per step (gradient accumulation).
    #[arg(long, default_value_t = 1)]
    accum: usize,
    /// Clip the global gradient norm to this value.
    #[arg(long)]
    clip: Option<f64>,
    /// Freeze the parameters whose names match (repeatable; * is a wildcard), e.g.
    /// 'transformer.h.0.*'.
    #[arg(long)]
    freeze: Vec<String>,
    /// Update each parameter inside backward and free its gradient at once.
    #[arg(long)]
    step_in_backward: bool,
    /// zero_grad zeroes gradients in place instead of freeing them.
    #[arg(long)]
    zero_grad_in_place: bool,
    /// Evaluate every N steps (also at the start and the end).
    #[arg(long, default_value_t = 200)]
    eval_every: u64,
    /// Batches per evaluation (at least 1).
    #[arg(long, default_value_t = 8)]
    eval_batches: usize,
    /// Print the step log (loss, lr, tokens/s, memory) every N steps; 0: progress bar only.
    #[arg(long, default_value_t = 0)]
    log_every: u64,
    /// Characters of text to sample at the end.
    #[arg(long, default_value_t = 300)]
    sample_chars: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Save the training state here (safetensors) at the end, every --save-every steps, and when
    /// interrupted (SIGINT, SIGTERM). Checked before training: its folder must exist and be
    /// writable, and the file be absent or a regular file.
    #[arg(long)]
    save: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    save_every: u64,
    /// Continue from a saved training state.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Train on this UTF-8 text file instead of the shipped corpus (a regular file of at most
    /// 256 MiB).
    #[arg(long)]
    text: Option<PathBuf>,
    /// Record the first --memory-trace-steps steps and write memory_snapshot.pickle
    /// (pytorch.org/memory_viz), memory_trace.json (Perfetto, chrome://tracing) and
    /// memory_report.html into DIR. Checked before training: DIR must be a writable folder, or
    /// not exist yet inside one.
    #[arg(long, value_name = "DIR")]
    pub(crate) memory_trace: Option<PathBuf>,
    /// Steps recorded by --memory-trace, from the run's first.
    #[arg(long, default_value_t = 2, value_name = "N")]
    memory_trace_steps: u64,
    /// Events the recorder keeps (a ring: older ones are dropped, and the summary says how many).
    #[arg(long, default_value_t = ferrograd::memory::recorder::DEFAULT_CAPACITY, value_name = "N")]
    memory_trace_events: usize,
    /// Watch memory at every step boundary and report what grows after warm-up, who holds
    /// it and the fix (graphs kept alive, retained graphs, a .grad carrying a graph, tensors
    /// kept outside any graph, a growing cache).
    #[arg(long)]
    detect_leaks: bool,
    /// The model's vocabulary: 0 uses the text's characters; a larger value pads it (GPT-2's
    /// 50257, say, to plan or train a GPT-2-sized output layer on the shipped text).
    #[arg(long, default_value_t = 0)]
    vocab_size: usize,
    /// Choose the micro-batch, accumulation and recomputation that fit this much memory
    /// (e.g. 24GiB), print the plan, and train with it (see `ferrograd plan --budget`).
    #[arg(long, value_name = "SIZE", value_parser = crate::plan::parse_size)]
    pub(crate) fit_budget: Option<u64>,
    /// End with one JSON object (initial_loss, final_loss, steps, tokens_per_s, peak_bytes,
    /// by_category_at_peak, ...) instead of the report.
    #[arg(long)]
    pub(crate) json: bool,
}

/// The autocast dtype chosen by --amp (None: f32 throughout).
#[derive(Clone, Copy, Debug)]
struct Amp(Option<DType>);

/// The policy chosen by --recompute; `auto` (None) takes the device's
/// (`Recompute::default_for`).
#[derive(Clone, Copy, Debug)]
struct RecomputeArg(Option<Recompute>);

/// The dtype of the model's parameters chosen by --weights.
#[derive(Clone, Copy, Debug)]
struct Weights(DType);

/// An on/off option.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Switch {
    On,
    Off,
}

/// Which attention path the model runs (`--attention`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum AttentionPath {
    Fused,
    Composed,
}

fn parse_amp(s: &str) -> Result<Amp, String> {
    match s {
        "off" | "none" | "f32" => Ok(Amp(None)),
        "bf16" => Ok(Amp(Some(DType::BF16))),
        "f16" | "fp16" => Ok(Amp(Some(DType::F16))),
        _ => Err(format!(
            "'{s}' is not a mixed-precision mode: use bf16, f16 or off"
        )),
    }
}

fn parse_recompute(s: &str) -> Result<RecomputeArg, String> {
    match s {
        "auto" => Ok(RecomputeArg(None)),
        _ => s
            .parse::<Recompute>()
            .map(|r| RecomputeArg(Some(r)))
            .map_err(|e| format!("{e} (or 'auto': gelu on a GPU, off on the CPU)")),
    }
}

/// f16 is parsed so that the run can say why it is not offered (see `job::TrainJob::weights`).
fn parse_weights(s: &str) -> Result<Weights, String> {
    match s {
        "f32" | "fp32" => Ok(Weights(DType::F32)),
        "bf16" => Ok(Weights(DType::BF16)),
        "f16" | "fp16" => Ok(Weights(DType::F16)),
        _ => Err(format!("'{s}' is not a weight precision: use f32 or bf16")),
    }
}

impl TrainArgs {
    /// The run's defaults (what `ferrograd` with no arguments does).
    pub fn defaults() -> TrainArgs {
        TrainArgs::parse_from(["train"])
    }

    pub(crate) fn to_job(&self) -> anyhow::Result<TrainJob> {
        let base = TrainJob::default();
        let device = self.device.parse::<Device>()?;
        if let Some(path) = &self.save {
            ferrograd::io::check_output_path(path)?;
        }
        let memory_trace = self.memory_trace.as_ref().map(|dir| MemoryTraceSettings {
            dir: dir.clone(),
            steps: self.memory_trace_steps,
            capacity: self.memory_trace_events,
        });
        if let Some(t) = &memory_trace {
            t.check()?;
        }
        let text = match &self.text {
            Some(p) => ferrograd::data::load_text(p)?,
            None => base.text.clone(),
        };
        Ok(TrainJob {
            text,
            model: ferrograd::nn::GptConfig {
                block_size: self.block_size,
                n_layer: self.n_layer,
                n_head: self.n_head,
                n_embd: self.n_embd,
                dropout: self.dropout,
                vocab_size: self.vocab_size,
                ..base.model.clone()
            },
            batch_size: self.batch_size,
            max_steps: self.max_steps,
            stop_after: self.stop_after,
            lr: self.lr,
            min_lr: self.min_lr,
            warmup_steps: self.warmup,
            optimizer: self.optimizer,
            weight_decay: self.weight_decay,
            momentum: self.momentum,
            trainer: TrainerConfig {
                accum: self.accum,
                clip: self.clip,
                amp: self.amp.0,
                step_in_backward: self.step_in_backward,
                set_to_none: !self.zero_grad_in_place,
                schedule: None,
                recompute: self
                    .recompute
                    .0
                    .unwrap_or_else(|| Recompute::default_for(device)),
                freeze: self.freeze.clone(),
            },
            weights: self.weights.0,
            device,
            eval_every: self.eval_every,
            eval_batches: self.eval_batches,
            sample_chars: self.sample_chars,
            seed: self.seed,
            save: self.save.clone(),
            save_every: self.save_every,
            resume: self.resume.clone(),
            detect_leaks: self.detect_leaks,
            fused_attention: self.attention == AttentionPath::Fused,
            interrupt: Some(signals()?.stop.clone()),
            memory_trace,
            ranks: self.ranks as usize,
            zero: self.zero == 1,
            cuda_graphs: self.cuda_graphs == Switch::On,
        })
    }
}

/// This process is one rank of several (started by torchrun or `ferrograd launch`): ranks in
/// separate processes reduce gradients over NCCL, so they need CUDA devices.
fn check_multi_process(args: &TrainArgs, env: &LaunchEnv) -> anyhow::Result<()> {
    let (rank, world) = (env.rank, env.world_size);
    let device = args.device.parse::<Device>()?;
    if !matches!(device, Device::Cuda(_)) {
        bail!(
            "this process is rank {rank} of {world} (RANK and WORLD_SIZE are set, as torchrun and `ferrograd launch` do) but --device is {device}: ranks in separate processes talk over NCCL, which needs CUDA devices (--device cuda; each rank takes cuda:LOCAL_RANK). For data-parallel training on the CPU, run one process with --ranks N (ranks as threads)"
        );
    }
    if args.ranks > 1 {
        bail!(
            "--ranks {} runs ranks as threads of one process, but this process is already rank {rank} of {world} of a multi-process run: drop --ranks",
            args.ranks
        );
    }
    Ok(())
}

/// Flags raised by SIGINT and SIGTERM. The first signal asks the run to stop at the next step
/// boundary (saving its state if --save is given); a second one exits at once.
struct Signals {
    stop: Arc<AtomicBool>,
    int: Arc<AtomicBool>,
    term: Arc<AtomicBool>,
}

static SIGNALS: OnceLock<Signals> = OnceLock::new();

fn signals() -> anyhow::Result<&'static Signals> {
    if let Some(s) = SIGNALS.get() {
        return Ok(s);
    }
    use signal_hook::consts::{SIGINT, SIGTERM};
    use signal_hook::flag;
    let s = Signals {
        stop: Arc::new(AtomicBool::new(false)),
        int: Arc::new(AtomicBool::new(false)),
        term: Arc::new(AtomicBool::new(false)),
    };
    for (signal, code, own) in [(SIGINT, 130, &s.int), (SIGTERM, 143, &s.term)] {
        // Registered first, so it sees the flag as the previous signal left it.
        flag::register_conditional_shutdown(signal, code, s.stop.clone())?;
        flag::register(signal, s.stop.clone())?;
        flag::register(signal, own.clone())?;
    }
    Ok(SIGNALS.get_or_init(|| s))
}

/// The conventional exit status of a run stopped by a signal: 128 + its number.
pub fn interrupted_exit_code() -> Option<u8> {
    let s = SIGNALS.get()?;
    if s.term.load(Ordering::SeqCst) {
        Some(143)
    } else if s.int.load(Ordering::SeqCst) {
        Some(130)
    } else {
        None
    }
}

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let launched = LaunchEnv::from_env()?;
    if let Some(env) = &launched {
        check_multi_process(&args, env)?;
    }
    let mut job = args.to_job()?;
    if let Some(env) = &launched {
        // One GPU per process, as torchrun's convention: the rank's LOCAL_RANK.
        job.device = Device::Cuda(env.local_rank);
    }
    if let Some(budget) = args.fit_budget {
        job = crate::plan::fit_to_budget(job, budget, args.json)?;
    }
    match train(&args, &job, launched.as_ref()) {
        Err(e) => match e.downcast_ref::<ferrograd::Error>() {
            // Not a failure: the run the state belongs to is complete.
            Some(done @ ferrograd::Error::AlreadyFinished { step, .. }) => {
                if args.json {
                    let v = serde_json::json!({
                        "already_finished": true,
                        "step_reached": step,
                        "max_steps": job.max_steps,
                    });
                    println!("{v}");
                } else {
                    println!("{done}");
                }
                Ok(())
            }
            _ => Err(e),
        },
        ok => ok,
    }
}

/// The run of this process: alone, or as one rank of a launched run over NCCL (only rank 0
/// shows progress and the report; the others print nothing unless they fail).
fn train(args: &TrainArgs, job: &TrainJob, launched: Option<&LaunchEnv>) -> anyhow::Result<()> {
    let Some(env) = launched else {
        return report(args, job, |on_event| job::run(job, on_event));
    };
    let group = Arc::new(NcclGroup::join(env, RENDEZVOUS_TIMEOUT)?);
    if env.rank != 0 {
        job::run_launched(job, group, &mut |_| {})?;
        return Ok(());
    }
    report(args, job, |on_event| {
        job::run_launched(job, group, on_event)
    })
}

/// Runs `run` with a progress bar fed by its events, then prints the end report or JSON.
fn report(
    args: &TrainArgs,
    job: &TrainJob,
    run: impl FnOnce(&mut dyn FnMut(&Event)) -> ferrograd::Result<JobSummary>,
) -> anyhow::Result<()> {
    let bar = ProgressBar::new(job.max_steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed} < {eta}]")?
            .progress_chars("=> "),
    );
    let mut log = Vec::new();
    let mut window = Window::new();
    let summary = run(&mut |e| match e {
        Event::Started {
            params,
            start_step,
            predicted_peak,
            in_backward,
            loss_scaling,
            fused_attention,
        } => {
            bar.set_position(*start_step);
            log.push(format!(
                "model: {params} parameters, device {}, starting at step {start_step}; planned peak {}",
                job.device,
                format_size(*predicted_peak)
            ));
            log.push(weights_line(job.weights));
            log.push(recompute_line(args, job));
            if let Some(path) = in_backward {
                log.push(format!("step in backward: {path}"));
            }
            if let Some(scaling) = loss_scaling {
                log.push(format!("f16 loss scaling: {scaling}"));
            }
            log.push(if *fused_attention {
                "attention: fused kernel (saves one log-sum-exp per query, not the scores)".into()
            } else {
                "attention: matmul, softmax, matmul (saves the (B, H, T, T) probabilities)".into()
            });
        }
        Event::Step(r) => {
            bar.set_position(r.step + 1);
            window.add(r.tokens);
            let logged = args.log_every > 0 && (r.step + 1) % args.log_every == 0;
            // Reading the loss waits for the device, so it is read only when shown.
            let shown = !bar.is_hidden() && (r.step + 1) % BAR_EVERY == 0;
            if !(logged || shown) {
                return;
            }
            let r = window.close(r);
            if logged {
                say(&bar, &r.to_string());
            }
            bar.set_message(format!(
                "loss {:.3} | {:.0} tok/s | mem {} (peak {})",
                r.loss.value().unwrap_or(f64::NAN),
                r.tokens_per_s(),
                format_size(r.memory_allocated),
                format_size(r.max_memory_allocated)
            ));
        }
        Event::Eval(e) => {
            let line = format!(
                "step {:>5}: train loss {:.4}, val loss {:.4}",
                e.step, e.train_loss, e.val_loss
            );
            say(&bar, &line);
            log.push(line);
        }
        Event::MemoryTraced(t) => {
            let files: Vec<String> = t.files.iter().map(|f| f.display().to_string()).collect();
            let line = format!("memory trace: {} ({})", files.join(", "), t.summary);
            say(&bar, &line);
            log.push(line);
        }
        Event::Saved { step, path } => {
            let line = format!("step {step:>5}: saved {}", path.display());
            say(&bar, &line);
            log.push(line);
        }
        Event::Leaks(report) => log.push(report.to_string()),
        Event::Graphs(status) => {
            let line = status.to_string();
            say(&bar, &line);
            log.push(line);
        }
    })?;
    bar.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        print!("{}", render(&summary, &log));
    }
    Ok(())
}

/// The weight precision in words, for the report.
fn weights_line(weights: DType) -> String {
    if weights == DType::F32 {
        return "weights: f32".into();
    }
    format!("weights: {weights}, with f32 master copies and f32 moments in AdamW")
}

/// The recomputation policy in words, for the report: what --recompute auto chose, and why.
fn recompute_line(args: &TrainArgs, job: &TrainJob) -> String {
    let policy = job.trainer.recompute;
    if args.fit_budget.is_some() {
        return format!("recompute: {policy} (chosen by --fit-budget)");
    }
    match (args.recompute.0, policy) {
        (Some(_), _) => format!("recompute: {policy}"),
        (None, Recompute::Gelu) => format!(
            "recompute: gelu (auto on {}: each MLP's GELU output rebuilt in backward, one elementwise pass per block; --recompute off keeps it)",
            job.device
        ),
        (None, _) => format!("recompute: {policy} (auto on {})", job.device),
    }
}

/// Steps between two updates of the progress bar's loss (each read waits for the device).
const BAR_EVERY: u64 = 10;

/// The steps since the last shown one: steps are queued on the device, not waited for, so a
/// step's own time is the host's; the rate shown is the window's tokens over the wall time
/// from the last shown step to this one's loss having been read.
struct Window {
    since: Instant,
    tokens: usize,
}

impl Window {
    fn new() -> Window {
        Window {
            since: Instant::now(),
            tokens: 0,
        }
    }

    fn add(&mut self, tokens: usize) {
        self.tokens += tokens;
    }

    /// `r` with the window's tokens and time (after waiting for its loss); starts a new window.
    fn close(&mut self, r: &StepReport) -> StepReport {
        let _ = r.loss.value();
        let mut shown = r.clone();
        shown.tokens = std::mem::take(&mut self.tokens);
        shown.seconds = self.since.elapsed().as_secs_f64();
        self.since = Instant::now();
        shown
    }
}

/// A line above the progress bar, or on stderr when there is no bar (not a terminal), so
/// logs survive redirection and never mix into `--json` output.
fn say(bar: &ProgressBar, line: &str) {
    if bar.is_hidden() {
        eprintln!("{line}");
    } else {
        bar.println(line);
    }
}

/// Each rank's peak by category, side by side (data-parallel runs).
fn render_ranks(s: &JobSummary) -> String {
    if s.ranks.is_empty() {
        return String::new();
    }
    let mut out = format!("\n{:<18}", "peak per rank");
    for r in &s.ranks {
        out += &format!("{:>12}", format!("rank {}", r.rank));
    }
    out += &format!("\n{:<18}", "total");
    for r in &s.ranks {
        out += &format!("{:>12}", format_size(r.peak_bytes));
    }
    let names = s.ranks[0].by_category_at_peak.keys();
    for name in names {
        if s.ranks
            .iter()
            .all(|r| r.by_category_at_peak.get(name) == Some(&0))
        {
            continue;
        }
        out += &format!("\n  {name:<16}");
        for r in &s.ranks {
            let b = r.by_category_at_peak.get(name).copied().unwrap_or(0);
            out += &format!("{:>12}", format_size(b));
        }
    }
    out
}

fn render(s: &JobSummary, log: &[String]) -> String {
    let mut out = String::new();
    for line in log {
        out += &format!("{line}\n");
    }
    out += &format!(
        "trained {} steps in {:.1} s, {:.0} tokens/s on {}\n",
        s.steps, s.seconds, s.tokens_per_s, s.device
    );
    out += &format!(
        "loss {:.4} -> {:.4} (val {:.4} -> {:.4})\n",
        s.initial_loss, s.final_loss, s.initial_eval.val_loss, s.final_eval.val_loss
    );
    out += &format!(
        "peak memory {} allocated (planned {}{}), {} reserved (planned {}):",
        format_size(s.peak_bytes),
        format_size(s.predicted_peak_bytes),
        if !s.ranks.is_empty() {
            // The plan is one process's run; the ranks' peaks are below.
            " for one process without data parallelism"
        } else if s.peak_bytes == s.predicted_peak_bytes {
            ", exact"
        } else {
            ""
        },
        format_size(s.peak_reserved_bytes),
        format_size(s.predicted_peak_reserved_bytes),
    );
    for (name, bytes) in s.by_category_at_peak.iter().filter(|(_, b)| **b > 0) {
        out += &format!(" {name} {}", format_size(*bytes));
    }
    out += &render_ranks(s);
    out += &format!("\n\nsample:\n{}\n", s.sample);
    out
}
