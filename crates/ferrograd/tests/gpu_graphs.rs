//! CUDA graphs of whole training steps (`Trainer::step_graphed`, `--cuda-graphs`): a replayed
//! step trains as the eager one does (same losses, same parameters), with a scheduled rate,
//! clipping, accumulation and bf16 autocast; the graph's blocks stay in its private pool and
//! the accounting by category still sums to `memory_allocated`; with dropout every replay
//! draws new masks, and without it replays of one batch are bit for bit the same; f16 loss
//! scaling replays with its skips decided on the device, as the eager run skips, and waits
//! for nothing; SGD with momentum replays with its rate read from device memory, with f16
//! loss scaling too; an optimizer that cannot skip on the device runs f16 steps eagerly and
//! says why; the step in backward replays on both of its paths; an out-of-range id in a replayed batch is the eager error; new
//! shapes capture again. Needs a CUDA device: without one every test fails.
#![cfg(feature = "gpu-tests")]

mod common;

use std::sync::Mutex;

use ferrograd::job::{self, Event, TrainJob};
use ferrograd::nn::{Gpt, GptConfig, Module};
use ferrograd::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig, WarmupCosine};
use ferrograd::train::{
    GradScaler, GradScalerConfig, GraphStatus, HostInput, HostInputs, LossScaling, MicroBatch,
    StepGraph, Trainer, TrainerConfig,
};
use ferrograd::{DType, Device, Error, Tensor, memory};

const GPU: Device = Device::Cuda(0);
static LOCK: Mutex<()> = Mutex::new(());

fn config() -> GptConfig {
    GptConfig {
        vocab_size: 65,
        block_size: 32,
        n_layer: 2,
        n_head: 2,
        n_embd: 64,
        dropout: 0.0,
        bias: true,
        seed: 0,
    }
}

fn trainer_config(accum: usize) -> TrainerConfig {
    TrainerConfig {
        accum,
        clip: Some(1.0),
        amp: Some(DType::BF16),
        schedule: Some(WarmupCosine {
            max_lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 2,
            total_steps: 8,
        }),
        ..TrainerConfig::default()
    }
}

/// Deterministic batches: (ids, targets) of micro-batch `i` of step `step`.
fn inputs(step: usize, accum: usize, b: usize, t: usize) -> HostInputs {
    (0..accum)
        .map(|i| {
            let ids: Vec<i64> = (0..b * t)
                .map(|k| ((k * 7 + step * 13 + i * 5) % 65) as i64)
                .collect();
            let targets: Vec<i64> = (0..b * t)
                .map(|k| ((k * 11 + step * 3 + i) % 65) as i64)
                .collect();
            vec![
                HostInput::new(ids, &[b, t]),
                HostInput::new(targets, &[b, t]),
            ]
        })
        .collect()
}

fn gpt() -> Gpt {
    Gpt::new(config(), GPU)
        .unwrap_or_else(|e| panic!("these tests need a CUDA device (cuda:0): {e}"))
}

fn adamw(model: &Gpt) -> Adam {
    Adam::adamw(model.parameters(), AdamConfig::adamw_default()).unwrap()
}

fn forward(model: &Gpt) -> impl FnMut(usize, &[Tensor]) -> ferrograd::Result<MicroBatch> + '_ {
    move |_, t| {
        Ok(MicroBatch {
            loss: model.loss(&t[0], &t[1])?,
            tokens: t[0].numel(),
        })
    }
}

/// Losses of `steps` steps and the parameters after them, graphs on or off.
fn train(graphs: bool, steps: usize, accum: usize) -> (Vec<f64>, Vec<Vec<f32>>, GraphStatus) {
    train_with(graphs, steps, trainer_config(accum))
}

fn train_with(
    graphs: bool,
    steps: usize,
    config: TrainerConfig,
) -> (Vec<f64>, Vec<Vec<f32>>, GraphStatus) {
    train_with_optimizer(graphs, steps, config, adamw)
}

fn train_with_optimizer<O: Optimizer + Send + 'static>(
    graphs: bool,
    steps: usize,
    config: TrainerConfig,
    optimizer: fn(&Gpt) -> O,
) -> (Vec<f64>, Vec<Vec<f32>>, GraphStatus) {
    let accum = config.accum;
    let model = gpt();
    let mut trainer = Trainer::new(optimizer(&model), config, GPU).unwrap();
    let mut graph = StepGraph::new(graphs, 1);
    let mut losses = Vec::new();
    for s in 0..steps {
        let r = trainer
            .step_graphed(&mut graph, &inputs(s, accum, 4, 32), forward(&model))
            .unwrap();
        losses.push(r.loss.value().unwrap());
    }
    let params = model
        .parameters()
        .iter()
        .map(|p| p.to_vec::<f32>().unwrap())
        .collect();
    (losses, params, graph.status())
}

/// The largest difference between two runs' parameters, element by element.
fn largest_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// A trainer of `model` and its graph after `steps` steps of batch (4, 32): from step 2 on,
/// replaying the step captured at step 1.
fn replaying(model: &Gpt, steps: usize) -> (Trainer<Adam>, StepGraph) {
    let mut trainer = Trainer::new(adamw(model), trainer_config(1), GPU).unwrap();
    let mut graph = StepGraph::new(true, 1);
    for s in 0..steps {
        let r = trainer
            .step_graphed(&mut graph, &inputs(s, 1, 4, 32), forward(model))
            .unwrap();
        drop(r);
    }
    (trainer, graph)
}

#[test]
fn a_replayed_step_trains_as_the_eager_one() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    for accum in [1, 2] {
        let (eager_losses, eager_params, off) = train(false, 6, accum);
        assert!(matches!(off, GraphStatus::Off(_)), "{off}");
        let (losses, params, status) = train(true, 6, accum);
        assert!(
            matches!(status, GraphStatus::Replaying { step: 1, .. }),
            "accum {accum}: {status}"
        );
        println!("accum {accum}: eager {eager_losses:?}\n          graph {losses:?}");
        for (s, (g, e)) in losses.iter().zip(&eager_losses).enumerate() {
            assert!(
                (g - e).abs() <= 1e-5 * e.abs(),
                "accum {accum}, step {s}: loss {g} replayed, {e} eager"
            );
        }
        let worst = largest_difference(&params, &eager_params);
        println!("accum {accum}: largest parameter difference {worst:e}");
        assert!(worst <= 1e-5, "accum {accum}: parameters differ by {worst}");
    }
}

/// Each per-step value on its own: the scheduled rate without clipping, clipping at a
/// constant rate, and neither.
#[test]
fn a_replay_follows_the_schedule_and_the_clipping_each_alone() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let base = trainer_config(1);
    let variants = [
        (
            "schedule, no clipping",
            TrainerConfig {
                clip: None,
                ..base.clone()
            },
        ),
        (
            "clipping, constant rate",
            TrainerConfig {
                schedule: None,
                ..base.clone()
            },
        ),
        (
            "neither",
            TrainerConfig {
                clip: None,
                schedule: None,
                ..base
            },
        ),
    ];
    let mut wrong = Vec::new();
    for (what, config) in variants {
        let (eager, _, _) = train_with(false, 6, config.clone());
        let (graph, _, status) = train_with(true, 6, config);
        println!("{what} ({status}): eager {eager:?}\n  graph {graph:?}");
        if eager
            .iter()
            .zip(&graph)
            .any(|(e, g)| (g - e).abs() > 1e-5 * e.abs())
        {
            wrong.push(what);
        }
    }
    assert!(
        wrong.is_empty(),
        "replays differ from eager steps with: {wrong:?}"
    );
}

#[test]
fn a_replay_allocates_nothing_and_the_accounting_holds() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let model = gpt();
    let (mut trainer, mut graph) = replaying(&model, 2);
    let GraphStatus::Replaying { pool_bytes, .. } = graph.status() else {
        panic!("{}", graph.status());
    };
    assert!(pool_bytes > 0);
    ferrograd::backend::synchronize(GPU).unwrap();
    let alloc = memory::allocator(GPU).unwrap();
    let (allocated, reserved) = (alloc.memory_allocated(), alloc.memory_reserved());
    assert_eq!(alloc.by_category().total(), allocated);
    for s in 2..5 {
        // The report's copies of the loss and norm are the only allocations of a replay.
        let r = trainer
            .step_graphed(&mut graph, &inputs(s, 1, 4, 32), forward(&model))
            .unwrap();
        drop(r);
        assert_eq!(alloc.memory_allocated(), allocated, "step {s}");
        assert_eq!(alloc.memory_reserved(), reserved, "step {s}");
        assert_eq!(alloc.by_category().total(), alloc.memory_allocated());
    }
    drop(graph);
    // The pool's segments go back once the graph is gone.
    alloc.empty_cache();
    println!(
        "after the graph: allocated {} by category {:?}",
        alloc.memory_allocated(),
        alloc.by_category()
    );
    assert!(
        alloc.memory_reserved() + pool_bytes <= reserved,
        "the private pool ({pool_bytes} bytes) was kept: {} of {reserved} reserved",
        alloc.memory_reserved()
    );
}

#[test]
fn an_out_of_range_id_in_a_replayed_batch_is_the_eager_error() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let model = gpt();
    let (mut trainer, mut graph) = replaying(&model, 3);
    let mut bad = inputs(3, 1, 4, 32);
    bad[0][0].values[17] = 65;
    let err = trainer
        .step_graphed(&mut graph, &bad, forward(&model))
        .unwrap_err();
    assert!(matches!(err, Error::Index { .. }), "{err}");
    let mut bad = inputs(3, 1, 4, 32);
    bad[0][1].values[3] = -1;
    let err = trainer
        .step_graphed(&mut graph, &bad, forward(&model))
        .unwrap_err();
    assert!(matches!(err, Error::Index { .. }), "{err}");
    // Nothing was replayed: the next good batch still trains.
    let r = trainer
        .step_graphed(&mut graph, &inputs(3, 1, 4, 32), forward(&model))
        .unwrap();
    assert!(r.loss.value().unwrap().is_finite());
}

#[test]
fn new_shapes_capture_again() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let model = gpt();
    let (mut trainer, mut graph) = replaying(&model, 3);
    assert!(matches!(
        graph.status(),
        GraphStatus::Replaying { step: 1, .. }
    ));
    for s in 3..5 {
        trainer
            .step_graphed(&mut graph, &inputs(s, 1, 2, 16), forward(&model))
            .unwrap();
    }
    assert!(
        matches!(graph.status(), GraphStatus::Replaying { step: 3, .. }),
        "{}",
        graph.status()
    );
}

/// The losses of 6 steps on one batch at rate 0 (the parameters never change), graphs on;
/// `amp`: bf16 runs the fused attention (its dropout inside the kernels), f32 the composed
/// one (the dropout op).
fn frozen_losses(dropout: f64, amp: Option<DType>) -> (Vec<f64>, GraphStatus) {
    let model = Gpt::new(
        GptConfig {
            dropout,
            ..config()
        },
        GPU,
    )
    .unwrap();
    let still = AdamConfig {
        lr: 0.0,
        ..AdamConfig::adamw_default()
    };
    let opt = Adam::adamw(model.parameters(), still).unwrap();
    let config = TrainerConfig {
        amp,
        ..TrainerConfig::default()
    };
    let mut trainer = Trainer::new(opt, config, GPU).unwrap();
    let mut graph = StepGraph::new(true, 1);
    let losses = (0..6)
        .map(|_| {
            let r = trainer
                .step_graphed(&mut graph, &inputs(0, 1, 4, 32), forward(&model))
                .unwrap();
            r.loss.value().unwrap()
        })
        .collect();
    (losses, graph.status())
}

#[test]
fn replays_draw_new_dropout_masks_and_are_otherwise_the_same() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    for amp in [None, Some(DType::BF16)] {
        let (plain, status) = frozen_losses(0.0, amp);
        assert!(matches!(status, GraphStatus::Replaying { .. }), "{status}");
        println!("{amp:?}, no dropout: {plain:?}");
        assert!(
            plain.iter().all(|l| l.to_bits() == plain[0].to_bits()),
            "{plain:?}"
        );
        let (dropped, status) = frozen_losses(0.2, amp);
        assert!(matches!(status, GraphStatus::Replaying { .. }), "{status}");
        println!("{amp:?}, dropout 0.2: {dropped:?}");
        // Step 0 eager, step 1 the capture (seed 0), steps 2.. replays with their own seeds.
        for (i, a) in dropped.iter().enumerate() {
            assert!(a.is_finite());
            for b in &dropped[i + 1..] {
                assert_ne!(
                    a.to_bits(),
                    b.to_bits(),
                    "two steps drew one mask: {dropped:?}"
                );
            }
        }
    }
}

/// (stepped, scale, loss) of 8 f16 steps whose first scale overflows the f16 backward, the
/// parameters after them, Adam's step count, the graph's status and the host's waits on the
/// device during the last six steps (their reports are read after the last).
type ScaledRun = (
    Vec<(bool, Option<f64>, f64)>,
    Vec<Vec<f32>>,
    u64,
    GraphStatus,
    u64,
);

fn f16_scaled(graphs: bool, staged: bool) -> ScaledRun {
    let model = gpt();
    let config = TrainerConfig {
        amp: Some(DType::F16),
        ..trainer_config(1)
    };
    let mut trainer = Trainer::new(adamw(&model), config, GPU).unwrap();
    // A trainer built for a GPU decides on the device.
    let built = trainer.scaler().map(GradScaler::decided);
    assert_eq!(built, Some(LossScaling::OnDevice));
    // 2^60 backs off by 2^-12 per overflow: the warm-up, the capture and the first replays
    // skip, then the scale fits and grows every third clean step. Set after the trainer was
    // built, this scaler is not staged: with graphs off it decides on the host (reading the
    // flag every step); graphs stage it before the warm-up.
    *trainer.scaler_mut().unwrap() = GradScaler::with_config(GradScalerConfig {
        init_scale: 2f64.powi(60),
        backoff_factor: 2f64.powi(-12),
        growth_interval: 3,
        ..GradScalerConfig::default()
    })
    .unwrap();
    if staged {
        trainer.scaler_mut().unwrap().stage_on(GPU).unwrap();
    }
    let mut graph = StepGraph::new(graphs, 1);
    let mut reports = Vec::new();
    for s in 0..8 {
        if s == 2 {
            ferrograd::backend::cuda::take_host_waits();
        }
        let r = trainer
            .step_graphed(&mut graph, &inputs(s, 1, 4, 32), forward(&model))
            .unwrap();
        reports.push(r);
    }
    let (waits, _) = ferrograd::backend::cuda::take_host_waits();
    let steps = reports
        .iter()
        .map(|r| {
            (
                r.stepped().unwrap(),
                r.scale().unwrap(),
                r.loss.value().unwrap(),
            )
        })
        .collect();
    let params = model
        .parameters()
        .iter()
        .map(|p| p.to_vec::<f32>().unwrap())
        .collect();
    let count = trainer.with_optimizer(|o| o.step_count()).unwrap();
    (steps, params, count, graph.status(), waits)
}

/// f16 loss scaling replays with nothing read back: the scale is read from device memory and
/// updated there, the optimizer's update is skipped on the device when the inf/NaN check
/// fires, and its step count is kept there. The skips, the scales, the losses and the
/// parameters are the eager run's (whose scaler reads the check on the host).
#[test]
fn f16_loss_scaling_replays_with_its_skips_decided_on_the_device() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (eager, eager_params, eager_count, off, eager_waits) = f16_scaled(false, false);
    assert!(matches!(off, GraphStatus::Off(_)), "{off}");
    let (graphed, params, count, status, waits) = f16_scaled(true, false);
    assert!(
        matches!(status, GraphStatus::Replaying { step: 1, .. }),
        "{status}"
    );
    println!("host waits in six steps: {waits} replayed, {eager_waits} eager on the host path");
    assert_eq!(waits, 0, "six replays read nothing back");
    assert!(eager_waits >= 6, "the host path reads its flag every step");
    println!("eager {eager:?}\ngraph {graphed:?}");
    let skipped = eager.iter().filter(|s| !s.0).count();
    assert!(
        (3..8).contains(&skipped),
        "the warm-up, the capture and a replay should overflow: {eager:?}"
    );
    assert_eq!(count, eager_count);
    assert_eq!(eager_count, (8 - skipped) as u64);
    for (s, (g, e)) in graphed.iter().zip(&eager).enumerate() {
        assert_eq!((g.0, g.1), (e.0, e.1), "step {s}: stepped and scale");
        assert!(
            (g.2 - e.2).abs() <= 1e-5 * e.2.abs(),
            "step {s}: loss {} replayed, {} eager",
            g.2,
            e.2
        );
    }
    let worst = largest_difference(&params, &eager_params);
    println!("largest parameter difference {worst:e}");
    assert!(worst <= 1e-5, "parameters differ by {worst}");
}

/// Eager f16 steps with the scaler staged on the GPU (as a Trainer built for a GPU stages
/// it) read nothing back either, and train as the host path does.
#[test]
fn eager_f16_steps_decided_on_the_gpu_wait_for_nothing() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (host, host_params, host_count, _, host_waits) = f16_scaled(false, false);
    let (device, params, count, status, waits) = f16_scaled(false, true);
    assert!(matches!(status, GraphStatus::Off(_)), "{status}");
    println!("host waits in six steps: {waits} staged, {host_waits} on the host path");
    assert_eq!(waits, 0, "six eager steps read nothing back");
    assert_eq!(count, host_count);
    for (s, (d, h)) in device.iter().zip(&host).enumerate() {
        assert_eq!((d.0, d.1), (h.0, h.1), "step {s}: stepped and scale");
        assert!(
            (d.2 - h.2).abs() <= 1e-5 * h.2.abs(),
            "step {s}: loss {} staged, {} on the host path",
            d.2,
            h.2
        );
    }
    let worst = largest_difference(&params, &host_params);
    assert!(worst <= 1e-5, "parameters differ by {worst}");
}

#[test]
fn what_a_graph_cannot_replay_runs_eagerly_and_says_why() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    // f16 loss scaling with an optimizer that cannot skip on the device: refused before any
    // capture.
    let model = gpt();
    let f16 = TrainerConfig {
        amp: Some(DType::F16),
        ..trainer_config(1)
    };
    let sgd =
        common::host_only::HostOnly(Sgd::new(model.parameters(), SgdConfig::default()).unwrap());
    let mut trainer = Trainer::new(sgd, f16, GPU).unwrap();
    let mut graph = StepGraph::new(true, 1);
    for s in 0..2 {
        trainer
            .step_graphed(&mut graph, &inputs(s, 1, 4, 32), forward(&model))
            .unwrap();
    }
    assert!(graph.status().to_string().contains("loss scaling"));
    assert_eq!(trainer.with_optimizer(|o| o.name()).unwrap(), "HostOnly");
}

/// SGD with momentum, dampening, weight decay, clipping and a schedule replays as its eager
/// steps do, under bf16 autocast and under f16 with loss scaling (its skips decided on the
/// device): each replay reads the scheduled rate from device memory, and the warm-up step
/// made the momentum buffers.
#[test]
fn sgd_with_momentum_replays_as_its_eager_steps() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let sgd = |m: &Gpt| {
        let cfg = SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 1e-4,
            nesterov: false,
        };
        Sgd::new(m.parameters(), cfg).unwrap()
    };
    for amp in [DType::BF16, DType::F16] {
        let config = TrainerConfig {
            amp: Some(amp),
            ..trainer_config(1)
        };
        let (eager, eager_params, off) = train_with_optimizer(false, 6, config.clone(), sgd);
        assert!(matches!(off, GraphStatus::Off(_)), "{off}");
        let (graphed, params, status) = train_with_optimizer(true, 6, config, sgd);
        assert!(
            matches!(status, GraphStatus::Replaying { step: 1, .. }),
            "{amp}: {status}"
        );
        for (s, (g, e)) in graphed.iter().zip(&eager).enumerate() {
            assert!(
                (g - e).abs() <= 1e-5 * e.abs(),
                "{amp} step {s}: {g} replayed, {e} eager"
            );
        }
        let worst = largest_difference(&params, &eager_params);
        println!("SGD {amp}: largest parameter difference {worst:e}");
        assert!(worst <= 1e-5, "{amp}: parameters differ by {worst}");
    }
}

/// The step in backward replays as its eager steps do, on both paths: AdamW's per-parameter
/// hooks and SGD's gradient-free one (weight-gradient GEMMs into the momentum buffers), with
/// bf16 autocast and a schedule.
#[test]
fn the_step_in_backward_replays_as_its_eager_steps() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let config = TrainerConfig {
        step_in_backward: true,
        clip: None,
        ..trainer_config(1)
    };
    fn check(
        name: &str,
        eager: (Vec<f64>, Vec<Vec<f32>>, GraphStatus),
        graphed: (Vec<f64>, Vec<Vec<f32>>, GraphStatus),
    ) {
        assert!(
            matches!(eager.2, GraphStatus::Off(_)),
            "{name}: {}",
            eager.2
        );
        assert!(
            matches!(graphed.2, GraphStatus::Replaying { step: 1, .. }),
            "{name}: {}",
            graphed.2
        );
        for (s, (g, e)) in graphed.0.iter().zip(&eager.0).enumerate() {
            assert!(
                (g - e).abs() <= 1e-5 * e.abs(),
                "{name} step {s}: {g} replayed, {e} eager"
            );
        }
        let worst = largest_difference(&graphed.1, &eager.1);
        println!("{name}: largest parameter difference {worst:e}");
        assert!(worst <= 1e-5, "{name}: parameters differ by {worst}");
    }
    check(
        "AdamW hooks",
        train_with_optimizer(false, 6, config.clone(), adamw),
        train_with_optimizer(true, 6, config.clone(), adamw),
    );
    let sgd = |m: &Gpt| {
        let cfg = SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            ..SgdConfig::default()
        };
        Sgd::new(m.parameters(), cfg).unwrap()
    };
    check(
        "SGD gradient-free",
        train_with_optimizer(false, 6, config.clone(), sgd),
        train_with_optimizer(true, 6, config, sgd),
    );
}

#[test]
fn the_job_replays_its_steps_and_reports_it() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let text: String = ferrograd::data::default_corpus()
        .chars()
        .take(20_000)
        .collect();
    let run = |graphs: bool| {
        let job = TrainJob {
            text: text.clone(),
            model: GptConfig {
                vocab_size: 0,
                ..config()
            },
            batch_size: 8,
            max_steps: 12,
            eval_every: 6,
            eval_batches: 2,
            sample_chars: 0,
            device: GPU,
            trainer: trainer_config(1),
            cuda_graphs: graphs,
            ..TrainJob::default()
        };
        let mut statuses = Vec::new();
        let summary = job::run(&job, &mut |e| {
            if let Event::Graphs(s) = e {
                statuses.push(s.clone());
            }
        })
        .unwrap();
        (summary, statuses)
    };
    let (eager, off) = run(false);
    let (graphed, on) = run(true);
    println!("eager: {off:?}\ngraphs: {on:?}");
    assert!(matches!(off.as_slice(), [GraphStatus::Off(_)]), "{off:?}");
    assert!(
        on.iter()
            .any(|s| matches!(s, GraphStatus::Replaying { step: 1, .. })),
        "{on:?}"
    );
    let said = |s: &job::JobSummary| s.cuda_graphs.clone().unwrap_or_default();
    assert!(said(&eager).contains("off"), "{}", said(&eager));
    assert!(
        said(&graphed).starts_with("CUDA graphs: on"),
        "{}",
        said(&graphed)
    );
    for (what, g, e) in [
        ("final loss", graphed.final_loss, eager.final_loss),
        (
            "val loss",
            graphed.final_eval.val_loss,
            eager.final_eval.val_loss,
        ),
    ] {
        println!("{what}: graphs {g}, eager {e}");
        assert!((g - e).abs() <= 1e-5 * e.abs(), "{what}: {g} vs {e}");
    }
}
