//! Benchmark: one training step of a model under each memory strategy — its median step time,
//! the peak bytes allocated and the peak bytes reserved over the measured steps. The PyTorch
//! twin is benches/pytorch/strategies.py (same flags, same JSON line); scripts/gpu_strategies.sh
//! runs both for every model and strategy and prints the comparison table.
//!
//! Models:
//! - `mlp`: Linear(d, d) → ReLU → Linear(d, d), MSE loss to a random target, SGD momentum 0.9,
//!   lr 1e-3 (as benches/mlp_step.rs).
//! - `gpt2`: GPT-2 124M (`GptConfig::gpt2_124m()`, dropout 0), AdamW (PyTorch's defaults,
//!   lr 6e-4), random token ids and random targets. `tiny-gpt`: `GptConfig::tiny()`, the same
//!   otherwise (for quick checks on a CPU). `gpt-10m`: the 10.8M-parameter character GPT (6
//!   layers, 6 heads, width 384, context 256, vocabulary 65), batch 64 by default.
//!
//! Strategies:
//! - `baseline`: forward, loss, backward, step, zero_grad (set_to_none).
//! - `bf16`: forward and loss inside `autocast(BF16)`; backward outside; f32 master weights.
//! - `f16`: `autocast(F16)` and a `GradScaler` (scale the loss, step through the scaler, update).
//! - `recompute`: MLP: the whole forward runs under `checkpoint_activations`, which keeps only
//!   x; backward recomputes both Linears and the ReLU. GPT: every block is recomputed
//!   (`Recompute::Every(1)`), keeping only each block's input.
//! - `recompute-bf16`: `recompute`'s recomputation under `bf16`'s autocast: the forward and
//!   loss inside `autocast(BF16)`, and backward replays the recomputed segments under that same
//!   autocast state (so they cast as the forward did), f32 master weights. Measures what
//!   recomputation costs on top of the usual mixed-precision step.
//! - `bf16-weights` (GPT only): the model's parameters and activations in bf16, no autocast
//!   (so no per-step casts), AdamW keeping f32 master copies (`with_master_weights`), as
//!   llm.c trains. PyTorch has no twin of it here.
//! - `accum4`: four micro-batches of B/4 through `accumulate_gradients`, then one step.
//! - `freeze`: MLP: the first Linear (`0.*`) is frozen; GPT: the embeddings and the first half
//!   of the blocks (blocks 0-5 of GPT-2). The optimizer gets only the trainable parameters.
//! - `step-in-backward`: `StepInBackward::install(opt)`, then only `loss.backward()`.
//! - `step-in-backward-fused` (MLP only): `StepInBackward::install_fused(opt)`: each weight
//!   gradient's GEMM writes into the SGD momentum buffer, so no weight gradient ever exists.
//!   PyTorch has no twin of it. GPT (AdamW) is an error: Adam's step is not linear in g.
//!
//! Usage: cargo bench -p ferrograd --bench strategies -- --model mlp|gpt2|tiny-gpt
//!   --strategy baseline|bf16|bf16-weights|f16|recompute|recompute-bf16|accum4|freeze|step-in-backward|step-in-backward-fused
//!   [--device cpu|cuda]
//!   [--steps 10] [--warmup 3] [--dim 10000] [--batch B] [--seq T] [--vocab V]
//!   [--recompute-gelu] (GPT: each MLP's GELU output recomputed in backward)
//!   [--keep-attention] (GPT, recompute strategies: blocks keep their attention's output)
//!   [--dropout P] (GPT: dropout on embeddings, probabilities and residual branches; default 0)
//!   [--cuda-graphs] (the measured steps replay one captured step)
//! `--cuda-graphs` (GPU, strategies that step a plain optimizer): after the warm-up, one step
//! is captured as a CUDA graph (`backend::capture`) and every measured step replays it: the
//! optimizer stages its rate and step count on the device, then one graph launch.
//!
//! Prints a human line on stderr and one JSON line on stdout.

use std::sync::Arc;
use std::time::Instant;

use ferrograd::amp::{AmpDType, autocast};
use ferrograd::autograd::{Segment, checkpoint_activations};
use ferrograd::backend::capture::{Graph, capture};
use ferrograd::nn::{Gpt, GptConfig, Linear, Module, Recompute, Relu, Sequential};
use ferrograd::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};
use ferrograd::train::GradScaler;
use ferrograd::train::{StepInBackward, accumulate_gradients, freeze};
use ferrograd::{DType, Device, Generator, Tensor, memory};

type BoxError = Box<dyn std::error::Error>;
type Res<T> = std::result::Result<T, BoxError>;

/// The loss of micro-batch `i` of `n` (`n = 1`: the whole batch).
type LossFn = Box<dyn Fn(usize, usize) -> ferrograd::Result<Tensor>>;

/// In the order of `Strategy`'s variants (`Strategy::name` indexes it by discriminant).
const STRATEGIES: [&str; 10] = [
    "baseline",
    "bf16",
    "bf16-weights",
    "f16",
    "recompute",
    "recompute-bf16",
    "accum4",
    "freeze",
    "step-in-backward",
    "step-in-backward-fused",
];
const MODELS: [&str; 4] = ["mlp", "gpt2", "gpt-10m", "tiny-gpt"];
/// Micro-batches of the `accum4` strategy.
const MICRO_BATCHES: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strategy {
    Baseline,
    Bf16,
    Bf16Weights,
    F16,
    Recompute,
    RecomputeBf16,
    Accum4,
    Freeze,
    StepInBackward,
    StepInBackwardFused,
}

impl Strategy {
    fn parse(s: &str) -> Res<Strategy> {
        let all = [
            Strategy::Baseline,
            Strategy::Bf16,
            Strategy::Bf16Weights,
            Strategy::F16,
            Strategy::Recompute,
            Strategy::RecomputeBf16,
            Strategy::Accum4,
            Strategy::Freeze,
            Strategy::StepInBackward,
            Strategy::StepInBackwardFused,
        ];
        STRATEGIES
            .iter()
            .position(|&name| name == s)
            .map(|i| all[i])
            .ok_or_else(|| {
                format!(
                    "unknown strategy '{s}': use one of {}",
                    STRATEGIES.join(", ")
                )
                .into()
            })
    }

    /// Whether the forward is recomputed in backward (`recompute`, `recompute-bf16`).
    fn recomputes(self) -> bool {
        matches!(self, Strategy::Recompute | Strategy::RecomputeBf16)
    }

    /// The autocast dtype the forward and loss run under, if any.
    fn autocast(self) -> Option<AmpDType> {
        match self {
            Strategy::Bf16 | Strategy::RecomputeBf16 => Some(AmpDType::BF16),
            Strategy::F16 => Some(AmpDType::F16),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        let i = self as usize;
        STRATEGIES[i]
    }
}

struct Args {
    model: String,
    strategy: Strategy,
    device: Device,
    steps: usize,
    warmup: usize,
    dim: usize,
    batch: usize,
    seq: usize,
    /// The GPT's vocabulary, when not the model's own (GPT-2's 50257 padded to 50304, as
    /// nanoGPT and llm.c pad it, gives the head's GEMMs 16-byte-aligned rows).
    vocab: Option<usize>,
    /// GPT: recompute each MLP's GELU output in backward (`Recompute::Gelu`) on top of the
    /// strategy (any that does not already recompute whole blocks).
    recompute_gelu: bool,
    /// GPT, recomputing strategies: each recomputed block keeps its attention's output and
    /// log-sum-exp (`Recompute::Selective(1)` instead of `Every(1)`).
    keep_attention: bool,
    /// Replay a captured step (CUDA graphs) in the measured steps.
    cuda_graphs: bool,
    /// GPT: the dropout probability of every dropout layer.
    dropout: f64,
}

/// The value after flag `flag`, parsed.
fn value<T: std::str::FromStr>(flag: &str, v: Option<&String>) -> Res<T> {
    let v = v.ok_or_else(|| format!("{flag} needs a value"))?;
    v.parse()
        .map_err(|_| format!("{flag}: cannot parse '{v}'").into())
}

fn parse_args() -> Res<Args> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let (mut model, mut strategy, mut device) = (None, None, Device::Cpu);
    let (mut steps, mut warmup) = (10, 3);
    let (mut dim, mut batch, mut seq, mut vocab) = (10000, None, None, None);
    let (mut recompute_gelu, mut cuda_graphs, mut dropout) = (false, false, 0.0);
    let mut keep_attention = false;
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            // cargo bench passes --bench to harness = false targets.
            "--bench" => {}
            "--model" => model = Some(value::<String>(flag, it.next())?),
            "--strategy" => strategy = Some(Strategy::parse(&value::<String>(flag, it.next())?)?),
            "--device" => device = value::<String>(flag, it.next())?.parse()?,
            "--steps" => steps = value(flag, it.next())?,
            "--warmup" => warmup = value(flag, it.next())?,
            "--dim" => dim = value(flag, it.next())?,
            "--batch" => batch = Some(value(flag, it.next())?),
            "--seq" => seq = Some(value(flag, it.next())?),
            "--vocab" => vocab = Some(value(flag, it.next())?),
            "--recompute-gelu" => recompute_gelu = true,
            "--keep-attention" => keep_attention = true,
            "--cuda-graphs" => cuda_graphs = true,
            "--dropout" => dropout = value(flag, it.next())?,
            other => {
                return Err(format!(
                    "unknown flag '{other}': use --model, --strategy, --device, --steps, --warmup, --dim, --batch, --seq, --vocab, --recompute-gelu, --keep-attention, --cuda-graphs, --dropout"
                )
                .into());
            }
        }
    }
    let model =
        model.ok_or_else(|| format!("--model is required: one of {}", MODELS.join(", ")))?;
    if !MODELS.contains(&model.as_str()) {
        return Err(format!("unknown model '{model}': use one of {}", MODELS.join(", ")).into());
    }
    let strategy = strategy
        .ok_or_else(|| format!("--strategy is required: one of {}", STRATEGIES.join(", ")))?;
    if steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    let (default_batch, default_seq): (usize, usize) = match model.as_str() {
        "mlp" => (1000, 0),
        "gpt2" => (8, 1024),
        "gpt-10m" => (64, 256),
        _ => (4, 64),
    };
    let batch = batch.unwrap_or(default_batch);
    if dropout != 0.0 && model == "mlp" {
        return Err("--dropout is for the GPT models (the MLP has no dropout layers)".into());
    }
    if strategy == Strategy::Accum4 && !batch.is_multiple_of(MICRO_BATCHES) {
        return Err(format!(
            "accum4 splits the batch in {MICRO_BATCHES}: --batch {batch} is not a multiple"
        )
        .into());
    }
    Ok(Args {
        model,
        strategy,
        device,
        steps,
        warmup,
        dim,
        batch,
        seq: seq.unwrap_or(default_seq),
        vocab,
        recompute_gelu,
        keep_attention,
        cuda_graphs,
        dropout,
    })
}

/// Rows `i·B/n .. (i+1)·B/n` of `t` (a view).
fn micro(t: &Tensor, i: usize, n: usize) -> ferrograd::Result<Tensor> {
    if n == 1 {
        return Ok(t.clone());
    }
    let rows = t.shape()[0] / n;
    t.narrow(0, i * rows, rows)
}

/// The parameters the optimizer gets: those that still require grad.
fn trainable(module: &dyn Module) -> Vec<Tensor> {
    module
        .parameters()
        .into_iter()
        .filter(Tensor::requires_grad)
        .collect()
}

/// The MLP, its loss function and its SGD optimizer.
fn mlp(a: &Args) -> Res<(LossFn, Sgd)> {
    let (d, b, dev) = (a.dim, a.batch, a.device);
    let mut g = Generator::new(0);
    let l1 = Linear::new(d, d, true, dev, &mut g)?;
    let l2 = Linear::new(d, d, true, dev, &mut g)?;
    let model = Sequential::new()
        .push(l1.clone())
        .push(Relu)
        .push(l2.clone());
    if a.strategy == Strategy::Freeze {
        freeze(&model, "0.*")?;
    }
    let cfg = SgdConfig {
        lr: 1e-3,
        momentum: 0.9,
        ..Default::default()
    };
    let opt = Sgd::new(trainable(&model), cfg)?;
    let x = Tensor::randn_with(&[b, d], DType::F32, dev, &mut g)?;
    let y = Tensor::randn_with(&[b, d], DType::F32, dev, &mut g)?;
    let loss: LossFn = if a.strategy.recomputes() {
        // The clones share the parameters; the segment keeps only x alive.
        let segment: Segment =
            Arc::new(move |xs: &[Tensor]| l2.forward(&l1.forward(&xs[0])?.relu()?));
        Box::new(move |i, n| {
            checkpoint_activations(segment.clone(), &[micro(&x, i, n)?])?
                .mse_loss(&micro(&y, i, n)?)
        })
    } else {
        Box::new(move |i, n| {
            model
                .forward(&micro(&x, i, n)?)?
                .mse_loss(&micro(&y, i, n)?)
        })
    };
    Ok((loss, opt))
}

/// Seeded random token ids in 0..vocab, (B, T) int64.
fn token_ids(b: usize, t: usize, vocab: usize, dev: Device, g: &mut Generator) -> Res<Tensor> {
    let ids: Vec<i64> = g
        .uniform(b * t, 0.0, vocab as f64)
        .into_iter()
        .map(|u| (u as i64).min(vocab as i64 - 1))
        .collect();
    Ok(Tensor::from_vec(ids, &[b, t], dev)?)
}

/// The GPT, its loss function and its AdamW optimizer.
fn gpt(a: &Args) -> Res<(LossFn, Adam)> {
    let cfg = match a.model.as_str() {
        "gpt2" => GptConfig::gpt2_124m(),
        "gpt-10m" => GptConfig {
            block_size: 256,
            n_layer: 6,
            n_head: 6,
            n_embd: 384,
            ..GptConfig::tiny()
        },
        _ => GptConfig::tiny(),
    };
    let cfg = GptConfig {
        dropout: a.dropout,
        vocab_size: a.vocab.unwrap_or(cfg.vocab_size),
        ..cfg
    };
    let (vocab, n_layer) = (cfg.vocab_size, cfg.n_layer);
    let bf16_weights = a.strategy == Strategy::Bf16Weights;
    let dtype = if bf16_weights {
        DType::BF16
    } else {
        DType::F32
    };
    let mut model = Gpt::new_with_dtype(cfg, dtype, a.device)?;
    if a.recompute_gelu {
        if a.strategy.recomputes() {
            return Err("--recompute-gelu: this strategy already recomputes whole blocks".into());
        }
        model.set_recompute(Recompute::Gelu);
    }
    match a.strategy {
        Strategy::Recompute | Strategy::RecomputeBf16 => model.set_recompute(if a.keep_attention {
            Recompute::Selective(1)
        } else {
            Recompute::Every(1)
        }),
        Strategy::Freeze => {
            freeze(&model, "transformer.wte.*")?;
            freeze(&model, "transformer.wpe.*")?;
            for i in 0..n_layer / 2 {
                freeze(&model, &format!("transformer.h.{i}.*"))?;
            }
        }
        _ => {}
    }
    let cfg = AdamConfig {
        lr: 6e-4,
        ..AdamConfig::adamw_default()
    };
    let opt = Adam::adamw(trainable(&model), cfg)?;
    let opt = if bf16_weights {
        opt.with_master_weights()?
    } else {
        opt
    };
    let mut g = Generator::new(1);
    let ids = token_ids(a.batch, a.seq, vocab, a.device, &mut g)?;
    let targets = token_ids(a.batch, a.seq, vocab, a.device, &mut g)?;
    // The training loss: the head and the loss in row chunks, no (B, T, V) logits.
    let loss: LossFn =
        Box::new(move |i, n| model.loss(&micro(&ids, i, n)?, &micro(&targets, i, n)?));
    Ok((loss, opt))
}

/// How the optimizer is driven.
enum Driver<O: Optimizer + Send + 'static> {
    Plain(O),
    Scaled(O, GradScaler),
    /// Owns the optimizer; the hooks stop when it is dropped, so it lives as long as the loop.
    InBackward {
        _handle: StepInBackward<O>,
    },
}

/// One training step; returns the loss when it is already on the host (accum4), else the loss
/// tensor to read after the timer stops.
fn step<O: Optimizer + Send + 'static>(
    s: Strategy,
    loss_of: &LossFn,
    driver: &mut Driver<O>,
) -> ferrograd::Result<Result<f64, Tensor>> {
    if s == Strategy::Accum4 {
        let loss = accumulate_gradients(MICRO_BATCHES, |i| loss_of(i, MICRO_BATCHES))?;
        if let Driver::Plain(opt) = driver {
            opt.step()?;
            opt.zero_grad()?;
        }
        return Ok(Ok(loss));
    }
    // Autocast covers the forward and loss only; backward runs outside it (recomputed
    // segments restore the forward's autocast state themselves).
    let loss = match s.autocast() {
        Some(dtype) => {
            let _a = autocast(dtype);
            loss_of(0, 1)?
        }
        None => loss_of(0, 1)?,
    };
    match driver {
        Driver::Plain(opt) => {
            loss.backward()?;
            opt.step()?;
            opt.zero_grad()?;
        }
        Driver::Scaled(opt, scaler) => {
            scaler.scale(&loss)?.backward()?;
            scaler.step(opt)?;
            scaler.update()?;
            opt.zero_grad()?;
        }
        // The hooks step each parameter and free its gradient during backward.
        Driver::InBackward { .. } => loss.backward()?,
    }
    Ok(Err(loss))
}

/// Captures one step of a plain-driven strategy (the capture runs nothing; the graph and
/// the step's loss tensor are returned).
fn capture_step<O: Optimizer + Send + 'static>(
    a: &Args,
    loss_of: &LossFn,
    driver: &mut Driver<O>,
) -> Res<(Graph, Tensor)> {
    let Driver::Plain(opt) = driver else {
        return Err("--cuda-graphs: this strategy's step cannot be captured".into());
    };
    if a.strategy == Strategy::Accum4 {
        return Err("--cuda-graphs: accum4 reads its loss on the host".into());
    }
    opt.graph_support()?;
    opt.prepare_graph_step()?;
    let (graph, loss) = capture(a.device, || step(a.strategy, loss_of, driver))?;
    let loss = loss
        .err()
        .ok_or("--cuda-graphs: the captured step's loss is on the host")?;
    Ok((graph, loss))
}

/// One replay of a captured step: the optimizer stages this step's scalars, the graph runs.
fn replay<O: Optimizer + Send + 'static>(
    graph: &Graph,
    loss: &Tensor,
    driver: &mut Driver<O>,
) -> ferrograd::Result<Result<f64, Tensor>> {
    if let Driver::Plain(opt) = driver {
        opt.prepare_graph_step()?;
        graph.replay()?;
        opt.graph_step_replayed();
    }
    Ok(Err(loss.clone()))
}

struct Measured {
    step_ms: f64,
    /// How long the host took to queue a step (up to its last synchronisation): near
    /// `step_ms`, the step is bound by the host, not the GPU.
    host_ms: f64,
    /// Host waits on the GPU per step, and their milliseconds: host_ms less these is the
    /// host's own work.
    waits_per_step: f64,
    wait_ms: f64,
    peak_bytes: u64,
    reserved_bytes: u64,
    loss: f64,
}

/// The driver of `s` for any optimizer (the fused step is built by `run`: SGD only).
fn driver<O: Optimizer + Send + 'static>(s: Strategy, opt: O) -> Res<Driver<O>> {
    Ok(match s {
        Strategy::F16 => Driver::Scaled(opt, GradScaler::new()),
        Strategy::StepInBackward => Driver::InBackward {
            _handle: StepInBackward::install(opt)?,
        },
        _ => Driver::Plain(opt),
    })
}

fn measure<O: Optimizer + Send + 'static>(
    a: &Args,
    loss_of: LossFn,
    mut driver: Driver<O>,
) -> Res<Measured> {
    let dev = a.device;
    let mut times = Vec::with_capacity(a.steps);
    let mut host = Vec::with_capacity(a.steps);
    let (mut waits, mut waited) = (0u64, 0f64);
    let mut last = f64::NAN;
    let mut captured = None;
    for i in 0..a.warmup + a.steps {
        if i == a.warmup {
            memory::reset_peak_memory_stats(dev)?;
            // Kernel times (FERROGRAD_KERNEL_TIMES=1) of the measured steps only.
            ferrograd::backend::cuda::take_kernel_times();
        }
        if a.cuda_graphs && i == a.warmup {
            captured = Some(capture_step(a, &loss_of, &mut driver)?);
        }
        ferrograd::backend::synchronize(dev)?;
        ferrograd::backend::cuda::take_host_waits();
        let t0 = Instant::now();
        let loss = match &captured {
            Some((graph, loss)) => replay(graph, loss, &mut driver)?,
            None => step(a.strategy, &loss_of, &mut driver)?,
        };
        let queued = t0.elapsed().as_secs_f64() * 1e3;
        let (n, secs) = ferrograd::backend::cuda::take_host_waits();
        ferrograd::backend::synchronize(dev)?;
        if i >= a.warmup {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
            host.push(queued);
            waits += n;
            waited += secs * 1e3;
        }
        last = match loss {
            Ok(v) => v,
            Err(t) => t.item()?,
        };
    }
    times.sort_by(f64::total_cmp);
    host.sort_by(f64::total_cmp);
    Ok(Measured {
        step_ms: times[times.len() / 2],
        host_ms: host[host.len() / 2],
        waits_per_step: waits as f64 / a.steps as f64,
        wait_ms: waited / a.steps as f64,
        peak_bytes: memory::max_memory_allocated(dev)?,
        reserved_bytes: memory::max_memory_reserved(dev)?,
        loss: last,
    })
}

fn run() -> Res<()> {
    let a = parse_args()?;
    let fused = a.strategy == Strategy::StepInBackwardFused;
    let m = if a.model == "mlp" {
        if a.recompute_gelu {
            return Err("--recompute-gelu is for the GPT models (the MLP has no GELU)".into());
        }
        if a.strategy == Strategy::Bf16Weights {
            return Err("bf16-weights keeps AdamW master copies: use it with a GPT model".into());
        }
        let (loss, opt) = mlp(&a)?;
        let d = if fused {
            Driver::InBackward {
                _handle: StepInBackward::install_fused(opt)?,
            }
        } else {
            driver(a.strategy, opt)?
        };
        measure(&a, loss, d)?
    } else {
        if fused {
            return Err(format!(
                "step-in-backward-fused needs SGD with plain momentum (its step is linear in the gradient); {} trains with AdamW, which cannot fuse: use step-in-backward",
                a.model
            )
            .into());
        }
        let (loss, opt) = gpt(&a)?;
        measure(&a, loss, driver(a.strategy, opt)?)?
    };
    let shape = if a.model == "mlp" {
        format!("d={} B={}", a.dim, a.batch)
    } else {
        format!("B={} T={}", a.batch, a.seq)
    };
    let gelu = match (a.recompute_gelu, a.keep_attention) {
        (true, _) => " +recompute-gelu",
        (_, true) => " +keep-attention",
        _ => "",
    };
    eprintln!(
        "ferrograd {} {}{gelu} {shape} device={} median_ms={:.2} peak_bytes={} reserved_bytes={} loss={:.4}",
        a.model,
        a.strategy.name(),
        a.device,
        m.step_ms,
        m.peak_bytes,
        m.reserved_bytes,
        m.loss
    );
    let line = serde_json::json!({
        "impl": "ferrograd",
        "model": a.model,
        "strategy": a.strategy.name(),
        "device": a.device.to_string(),
        "batch": a.batch,
        "dim": if a.model == "mlp" { Some(a.dim) } else { None },
        "seq": if a.model == "mlp" { None } else { Some(a.seq) },
        "steps": a.steps,
        "recompute_gelu": a.recompute_gelu,
        "keep_attention": a.keep_attention,
        "cuda_graphs": a.cuda_graphs,
        "dropout": a.dropout,
        "step_ms": m.step_ms,
        "host_ms": m.host_ms,
        "host_waits_per_step": m.waits_per_step,
        "host_wait_ms": m.wait_ms,
        "peak_bytes": m.peak_bytes,
        "reserved_bytes": m.reserved_bytes,
        "loss": m.loss,
    });
    println!("{line}");
    print_kernel_times();
    Ok(())
}

/// With FERROGRAD_KERNEL_TIMES=1 on a GPU: the kernels of the whole run, the most time first.
fn print_kernel_times() {
    let rows = ferrograd::backend::cuda::take_kernel_times();
    let total: f64 = rows.iter().map(|r| r.seconds).sum();
    if !rows.is_empty() {
        eprintln!("{:>9.3} ms device busy (all timed calls)", total * 1e3);
    }
    for r in rows.iter().take(60) {
        eprintln!(
            "{:>9.3} ms {:>5.1}% {:>7} calls  {}",
            r.seconds * 1e3,
            100.0 * r.seconds / total,
            r.calls,
            r.name
        );
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("strategies: {e}");
        std::process::exit(2);
    }
}
