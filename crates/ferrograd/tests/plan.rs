//! The planner on the host: a planned run's peak equals the measured peak to the byte, and so
//! does every category at the peak, for every strategy the Trainer composes, for the demo MLP
//! and for a custom module with a custom function; bad configurations are typed errors.

use std::sync::Mutex;

use ferrograd::autograd::{CustomFunction, FunctionCtx, apply_custom};
use ferrograd::demo::{self, DemoConfig};
use ferrograd::job::{self, OptimizerChoice, TrainJob};
use ferrograd::memory::{self, Category};
use ferrograd::nn::{GptConfig, Linear, Module, Recompute};
use ferrograd::optim::{Adam, AdamConfig, Optimizer};
use ferrograd::plan::{self, PlanOptions, Target};
use ferrograd::train::TrainerConfig;
use ferrograd::{DType, Device, Generator, Tensor};

/// Runs share the CPU allocator's statistics: one at a time.
static LOCK: Mutex<()> = Mutex::new(());

fn small_job(trainer: TrainerConfig) -> TrainJob {
    let text: String = ferrograd::data::default_corpus()
        .chars()
        .take(20_000)
        .collect();
    TrainJob {
        text,
        model: GptConfig {
            vocab_size: 0,
            block_size: 16,
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            dropout: 0.0,
            bias: true,
            seed: 0,
        },
        batch_size: 4,
        max_steps: 3,
        warmup_steps: 1,
        eval_every: 0,
        eval_batches: 1,
        sample_chars: 0,
        trainer,
        ..TrainJob::default()
    }
}

/// A peak: its bytes, then the non-zero categories at that moment.
type Peak = (u64, Vec<(String, u64)>);

/// The planned and the measured peak.
fn planned_and_measured(job: &TrainJob) -> (Peak, Peak) {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let plan = job::plan_job(job, Target::Cpu, PlanOptions::default()).unwrap();
    let s = job::run(job, &mut |_| {}).unwrap();
    let planned_cats = plan
        .by_category_at_peak
        .to_map()
        .into_iter()
        .filter(|(_, v)| *v > 0)
        .collect();
    let measured_cats = s
        .by_category_at_peak
        .into_iter()
        .filter(|(_, v)| *v > 0)
        .collect();
    assert_eq!(
        s.predicted_peak_bytes, plan.peak_allocated,
        "the run's own plan"
    );
    (
        (plan.peak_allocated, planned_cats),
        (s.peak_bytes, measured_cats),
    )
}

#[test]
fn the_default_strategy_is_planned_to_the_byte() {
    let job = small_job(TrainerConfig::default());
    let (planned, measured) = planned_and_measured(&job);
    assert_eq!(planned, measured);
}

#[test]
fn bf16_recompute_accumulation_and_clipping_are_planned_to_the_byte() {
    let job = small_job(TrainerConfig {
        amp: Some(DType::BF16),
        recompute: Recompute::Every(1),
        accum: 2,
        clip: Some(1.0),
        ..TrainerConfig::default()
    });
    let (planned, measured) = planned_and_measured(&job);
    assert_eq!(planned, measured);
}

/// Every combination of precision, recomputation, accumulation, clipping, freezing, step in
/// backward and zero_grad mode (those the Trainer accepts), with the optimizer, dropout and
/// the attention path rotating through the cases: planned = measured, to the byte, in total
/// and per category.
#[test]
fn every_strategy_combination_is_planned_to_the_byte() {
    let mut cases = 0;
    for amp in [None, Some(DType::BF16), Some(DType::F16)] {
        for recompute in [Recompute::Off, Recompute::Every(1), Recompute::Every(2)] {
            for accum in [1, 2] {
                for clip in [None, Some(0.5)] {
                    for freeze in [vec![], vec!["transformer.h.0.*".to_string()]] {
                        for step_in_backward in [false, true] {
                            for set_to_none in [true, false] {
                                let trainer = TrainerConfig {
                                    amp,
                                    recompute,
                                    accum,
                                    clip,
                                    freeze: freeze.clone(),
                                    step_in_backward,
                                    set_to_none,
                                    ..TrainerConfig::default()
                                };
                                if trainer.validate().is_err() {
                                    continue;
                                }
                                let mut job = small_job(trainer);
                                job.optimizer =
                                    [OptimizerChoice::AdamW, OptimizerChoice::Sgd][cases % 2];
                                job.model.dropout = [0.0, 0.1, 0.0][cases % 3];
                                job.fused_attention = cases % 5 != 0;
                                job.eval_every = [0, 1][cases % 2];
                                let (planned, measured) = planned_and_measured(&job);
                                assert_eq!(planned, measured, "case {cases}: {:?}", job.trainer);
                                cases += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(cases > 150, "{cases} combinations checked");
}

#[test]
fn the_demo_mlp_is_planned_to_the_byte() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let cfg = DemoConfig {
        dim: 96,
        batch: 40,
        ..DemoConfig::default()
    };
    let plan = demo::plan(&cfg).unwrap();
    let report = demo::run(&cfg).unwrap();
    assert_eq!(plan.peak_allocated, report.peak_bytes);
    assert_eq!(plan.peak_allocated, report.expected_peak());
    assert_eq!(report.planned_peak_bytes, report.peak_bytes);
    // The host caches nothing: reserved is allocated.
    assert_eq!(plan.peak_reserved, plan.peak_allocated);
}

/// y = x·σ(x) (SiLU) as a custom function that saves its input and σ(x) for backward.
struct Silu;

impl CustomFunction for Silu {
    fn name(&self) -> &'static str {
        "silu"
    }
    fn forward(&mut self, ctx: &mut FunctionCtx, inputs: &[Tensor]) -> ferrograd::Result<Tensor> {
        let x = &inputs[0];
        let s = x.sigmoid()?;
        ctx.save_for_backward(&[x, &s]);
        x.mul(&s)
    }
    fn backward(
        &mut self,
        ctx: &FunctionCtx,
        g: &Tensor,
    ) -> ferrograd::Result<Vec<Option<Tensor>>> {
        let saved = ctx.saved_tensors();
        let (x, s) = (&saved[0], &saved[1]);
        // σ + x·σ·(1 − σ)
        let one_minus = s.neg()?.add_scalar(1.0)?;
        let d = s.add(&x.mul(s)?.mul(&one_minus)?)?;
        Ok(vec![Some(g.mul(&d)?)])
    }
}

/// Linear → custom SiLU → Linear.
struct SiluMlp {
    up: Linear,
    down: Linear,
}

impl Module for SiluMlp {
    fn forward(&self, x: &Tensor) -> ferrograd::Result<Tensor> {
        let h = self.up.forward(x)?;
        let h = apply_custom(Silu, &[h])?;
        self.down.forward(&h)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut p = self.up.named_parameters();
        p.extend(self.down.named_parameters());
        p
    }
}

/// Two AdamW steps of the custom module on `device`, everything dropped at the end.
fn custom_steps(device: Device) -> ferrograd::Result<()> {
    let mut g = Generator::new(3);
    let model = SiluMlp {
        up: Linear::new(24, 64, true, device, &mut g)?,
        down: Linear::new(64, 8, true, device, &mut g)?,
    };
    let mut opt = Adam::adamw(model.parameters(), AdamConfig::default())?;
    for _ in 0..2 {
        let x = Tensor::randn_with(&[16, 24], DType::F32, device, &mut g)?;
        let y = Tensor::randn_with(&[16, 8], DType::F32, device, &mut g)?;
        model.forward(&x)?.mse_loss(&y)?.backward()?;
        opt.step()?;
        opt.zero_grad_with(true)?;
    }
    Ok(())
}

#[test]
fn a_custom_module_with_a_custom_function_is_planned_to_the_byte() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let plan = plan::plan(Target::Cpu, PlanOptions::default(), custom_steps).unwrap();
    let cpu = memory::allocator(Device::Cpu).unwrap();
    let base = cpu.memory_allocated();
    let base_cats = cpu.by_category();
    cpu.reset_peak_memory_stats();
    custom_steps(Device::Cpu).unwrap();
    assert_eq!(plan.peak_allocated, cpu.max_memory_allocated() - base);
    let at_peak = cpu.by_category_at_peak();
    for c in Category::ALL {
        assert_eq!(
            plan.by_category_at_peak.get(c),
            at_peak.get(c) - base_cats.get(c),
            "{c}"
        );
    }
    assert!(plan.by_category_at_peak.get(Category::OptimizerState) > 0);
}

/// A tiny tensor and one (64, 64) product, everything dropped at the end.
fn one_product(device: Device) -> ferrograd::Result<()> {
    let small = Tensor::zeros(&[3], DType::F32, device)?;
    let x = Tensor::zeros(&[64, 64], DType::F32, device)?;
    let y = x.matmul(&x)?;
    drop((small, x, y));
    Ok(())
}

#[test]
fn a_gpu_plan_has_the_caching_allocators_rounding_and_cublas_workspace() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let gpu = Target::Cuda { capacity: 80 << 30 };
    let plan = plan::plan(gpu, PlanOptions::default(), one_product).unwrap();
    // 12 bytes round up to 512; cuBLAS takes its 32 MiB workspace at the first product.
    assert_eq!(plan.by_category_at_peak.get(Category::Workspace), 32 << 20);
    assert_eq!(plan.peak_allocated, 512 + 2 * 16384 + (32 << 20));
    // Small blocks come from a 2 MiB segment; the workspace gets a segment of its own.
    assert_eq!(plan.peak_reserved, (2 << 20) + (32 << 20));
    assert!(plan.fits);
    // The host: exact bytes, no workspace.
    let host = plan::plan(Target::Cpu, PlanOptions::default(), one_product).unwrap();
    assert_eq!(host.peak_allocated, 12 + 2 * 16384);
    assert_eq!(host.by_category_at_peak.get(Category::Workspace), 0);
}

/// Row strides of the logits `wide_head` made, in order.
static ROW_STRIDES: Mutex<Vec<isize>> = Mutex::new(Vec::new());

/// GPT-2's head in bf16: (16, 768) @ (50257, 768)ᵀ without a bias.
fn wide_head(device: Device) -> ferrograd::Result<()> {
    let x = Tensor::zeros(&[16, 768], DType::BF16, device)?;
    let w = Tensor::zeros(&[50257, 768], DType::BF16, device)?;
    let logits = x.linear(&w, None)?;
    assert_eq!(logits.shape(), &[16, 50257]);
    ROW_STRIDES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(logits.strides()[0]);
    Ok(())
}

#[test]
fn a_wide_unaligned_gemm_output_gets_aligned_rows_on_a_gpu_only() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    ROW_STRIDES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clear();
    let gpu = Target::Cuda { capacity: 80 << 30 };
    let gpu = plan::plan(gpu, PlanOptions::default(), wide_head).unwrap();
    let host = plan::plan(Target::Cpu, PlanOptions::default(), wide_head).unwrap();
    // On a GPU the product runs 50304 wide (128-byte rows, as nanoGPT pads its vocabulary),
    // so cuBLAS runs its aligned kernels; the host keeps contiguous rows.
    assert_eq!(*ROW_STRIDES.lock().unwrap(), [50304, 50257]);
    let (x, w): (u64, u64) = (16 * 768 * 2, 50257 * 768 * 2);
    // The caching allocator rounds blocks over 10 MiB to 2 MiB, the rest to 512 bytes. The
    // product runs at the padded width on w with zero rows appended, a temporary.
    let w_block = w.next_multiple_of(2 << 20);
    let padded_w_block = (50304 * 768 * 2u64).next_multiple_of(2 << 20);
    assert_eq!(
        gpu.peak_allocated,
        x + w_block + padded_w_block + 16 * 50304 * 2 + (32 << 20)
    );
    // The host's bf16 product runs on f32 widenings of all three blocks.
    assert_eq!(host.peak_allocated, 3 * (x + w + 16 * 50257 * 2));
}

/// GPT-2's head in a bf16 region on an f32 weight: autocast's cast of it is made in the
/// zero-padded block the padded product reads.
fn wide_head_under_autocast(device: Device) -> ferrograd::Result<()> {
    let x = Tensor::zeros(&[16, 768], DType::BF16, device)?;
    let w = Tensor::zeros(&[50257, 768], DType::F32, device)?.requires_grad_(true)?;
    let _amp = ferrograd::amp::autocast(ferrograd::amp::AmpDType::BF16);
    let logits = x.linear(&w, None)?;
    assert_eq!(logits.shape(), &[16, 50257]);
    Ok(())
}

#[test]
fn an_autocast_cast_of_a_wide_head_is_its_padded_weight() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let gpu = Target::Cuda { capacity: 80 << 30 };
    let plan = plan::plan(gpu, PlanOptions::default(), wide_head_under_autocast).unwrap();
    let (x, w): (u64, u64) = (16 * 768 * 2, 50257 * 768 * 4);
    // x, the f32 weight, its bf16 cast in a (50304, 768) block, the logits, the workspace:
    // no padded copy of the cast beside it.
    let cast_block = (50304 * 768 * 2u64).next_multiple_of(2 << 20);
    assert_eq!(
        plan.peak_allocated,
        x + w.next_multiple_of(2 << 20) + cast_block + 16 * 50304 * 2 + (32 << 20)
    );
}

/// A linear layer's weight gradient in a bf16 region on an f32 weight: (32, 16) f32 from
/// bf16 g (64, 32) and x (64, 16).
fn f32_weight_grad(device: Device) -> ferrograd::Result<()> {
    let x = Tensor::zeros(&[64, 16], DType::BF16, device)?;
    let g = Tensor::zeros(&[64, 32], DType::BF16, device)?;
    let w = Tensor::zeros(&[32, 16], DType::F32, device)?.requires_grad_(true)?;
    let _amp = ferrograd::amp::autocast(ferrograd::amp::AmpDType::BF16);
    let y = x.linear(&w, None)?;
    y.backward_with(ferrograd::autograd::BackwardOptions {
        gradient: Some(g),
        ..Default::default()
    })?;
    assert_eq!(w.grad().map(|g| g.dtype()), Some(DType::F32));
    Ok(())
}

#[test]
fn an_f32_weight_gradient_of_bf16_operands_is_planned_to_the_byte() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let host = plan::plan(Target::Cpu, PlanOptions::default(), f32_weight_grad).unwrap();
    memory::reset_peak_memory_stats(Device::Cpu).unwrap();
    let before = memory::memory_allocated(Device::Cpu).unwrap();
    f32_weight_grad(Device::Cpu).unwrap();
    let measured = memory::max_memory_allocated(Device::Cpu).unwrap() - before;
    assert_eq!(host.peak_allocated, measured);
    let (x, g, w) = (64 * 16 * 2, 64 * 32 * 2, 32 * 16 * 4);
    // At the weight gradient's GEMM: the inputs, the bf16 weight cast and output (x needs no
    // gradient), the f32 gradient, and f32 widenings of g and x only (not of the output,
    // which is f32 already).
    let gemm = x + g + w + 32 * 16 * 2 + 64 * 32 * 2 + w + 2 * (x + g);
    assert_eq!(host.peak_allocated, gemm as u64);
}

#[test]
fn a_plan_larger_than_the_gpu_says_so_with_what_it_would_need() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let small_gpu = Target::Cuda { capacity: 16 << 20 };
    let plan = plan::plan(small_gpu, PlanOptions::default(), one_product).unwrap();
    assert!(!plan.fits);
    assert_eq!(plan.peak_allocated, 512 + 2 * 16384 + (32 << 20));
    let err = plan
        .check_fits(Device::Cuda(0), "one product".into(), "use a larger GPU")
        .unwrap_err();
    assert!(matches!(err, ferrograd::Error::DoesNotFit { .. }), "{err}");
}

#[test]
fn a_recorded_plan_names_the_allocation_at_its_peak_and_each_phase() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let job = small_job(TrainerConfig::default());
    let plan = job::plan_job(&job, Target::Cpu, PlanOptions { record: true }).unwrap();
    let at = plan
        .at_peak
        .as_ref()
        .expect("the recorded plan knows its peak");
    assert!(!at.op.is_empty() && at.bytes > 0, "{at:?}");
    let phases: Vec<(u64, &str)> = plan
        .phases
        .iter()
        .map(|p| (p.step, p.phase.as_str()))
        .collect();
    for want in [
        (0, "evaluation"),
        (0, "forward"),
        (0, "backward"),
        (1, "optimizer"),
    ] {
        assert!(phases.contains(&want), "{want:?} missing in {phases:?}");
    }
    let highest = plan.phases.iter().map(|p| p.peak).max().unwrap();
    assert_eq!(highest, plan.peak_allocated);
    assert!(
        plan.recording
            .as_ref()
            .is_some_and(|r| !r.events.is_empty())
    );
}

#[test]
fn a_run_that_keeps_meta_tensors_alive_is_refused() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    static KEPT: Mutex<Vec<Tensor>> = Mutex::new(Vec::new());
    let err = plan::plan(Target::Cpu, PlanOptions::default(), |d| {
        KEPT.lock()
            .unwrap()
            .push(Tensor::zeros(&[4], DType::F32, d)?);
        Ok(())
    })
    .unwrap_err();
    assert!(err.to_string().contains("left 1 blocks alive"), "{err}");
    KEPT.lock().unwrap().clear();
    // The meta device is usable again.
    plan::plan(Target::Cpu, PlanOptions::default(), one_product).unwrap();
}

/// The model in bf16 with AdamW's f32 master copies (`--weights bf16`), alone and with the
/// strategies that change what a step holds: planned = measured, to the byte.
#[test]
fn bf16_weights_with_master_copies_are_planned_to_the_byte() {
    let trainers = [
        TrainerConfig::default(),
        TrainerConfig {
            recompute: Recompute::Every(1),
            accum: 2,
            clip: Some(1.0),
            ..TrainerConfig::default()
        },
        TrainerConfig {
            step_in_backward: true,
            ..TrainerConfig::default()
        },
        TrainerConfig {
            freeze: vec!["transformer.h.0.*".to_string()],
            set_to_none: false,
            ..TrainerConfig::default()
        },
    ];
    for (i, trainer) in trainers.into_iter().enumerate() {
        let mut job = small_job(trainer);
        job.weights = DType::BF16;
        job.eval_every = [0, 1][i % 2];
        job.model.dropout = [0.0, 0.1][i % 2];
        let (planned, measured) = planned_and_measured(&job);
        assert_eq!(planned, measured, "case {i}: {:?}", job.trainer);
        if i == 0 {
            // Every parameter trains: AdamW's f32 moments and master copy are 12 bytes per
            // 2-byte bf16 weight.
            let of = |name: &str| {
                measured
                    .1
                    .iter()
                    .find(|(n, _)| n == name)
                    .map_or(0, |(_, b)| *b)
            };
            assert_eq!(of("optimizer_state"), 6 * of("parameter"), "{measured:?}");
        }
    }
}

/// A plan for a GPU runs CUDA graphs as the GPU would (the meta device captures into a
/// private pool and replays nothing): warm-up, capture, replays that allocate nothing, the
/// accounting by category still summing to `memory_allocated`, the pool given back when the
/// graph goes, and new shapes captured again.
#[test]
fn a_gpu_plan_captures_and_replays_steps_as_the_gpu_would() {
    use ferrograd::nn::Gpt;
    use ferrograd::train::{GraphStatus, HostInput, MicroBatch, StepGraph, Trainer};
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let batch = |b: usize, t: usize| {
        let ids: Vec<i64> = (0..b * t).map(|k| (k % 65) as i64).collect();
        vec![vec![
            HostInput::new(ids.clone(), &[b, t]),
            HostInput::new(ids, &[b, t]),
        ]]
    };
    let gpu = Target::Cuda { capacity: 80 << 30 };
    // f16 too: its GradScaler keeps the scale on the device and AdamW skips there.
    for amp in [DType::BF16, DType::F16] {
        plan::plan(gpu, PlanOptions::default(), |device| {
            let gpt = Gpt::new(GptConfig::tiny(), device)?;
            let opt = Adam::adamw(gpt.parameters(), AdamConfig::adamw_default())?;
            let config = TrainerConfig {
                clip: Some(1.0),
                amp: Some(amp),
                ..TrainerConfig::default()
            };
            let mut trainer = Trainer::new(opt, config, device)?;
            let mut graph = StepGraph::new(true, 1);
            let step = |trainer: &mut Trainer<Adam>, graph: &mut StepGraph, b: usize, t: usize| {
                trainer
                    .step_graphed(graph, &batch(b, t), |_, x| {
                        Ok(MicroBatch {
                            loss: gpt.loss(&x[0], &x[1])?,
                            tokens: x[0].numel(),
                        })
                    })
                    .map(drop)
            };
            step(&mut trainer, &mut graph, 4, 32)?;
            assert_eq!(graph.status(), GraphStatus::WarmingUp);
            step(&mut trainer, &mut graph, 4, 32)?;
            let GraphStatus::Replaying {
                step: 1,
                pool_bytes,
            } = graph.status()
            else {
                panic!("{amp}: no capture: {}", graph.status());
            };
            assert_eq!(
                trainer.scaler().and_then(|s| s.staged_device()),
                (amp == DType::F16).then_some(device)
            );
            assert!(pool_bytes > 0);
            let alloc = memory::allocator(device)?;
            let (allocated, reserved) = (alloc.memory_allocated(), alloc.memory_reserved());
            for _ in 0..3 {
                step(&mut trainer, &mut graph, 4, 32)?;
                assert_eq!(alloc.memory_allocated(), allocated, "a replay allocated");
                assert_eq!(alloc.memory_reserved(), reserved, "a replay reserved");
                assert_eq!(alloc.by_category().total(), alloc.memory_allocated());
            }
            // Every replay advanced every parameter's count (the bias corrections of the next
            // replay are staged from it): warm-up, capture, three replays.
            trainer.with_optimizer(|o| {
                assert_eq!(o.step_count(), 5);
                let counts: Vec<u64> = (0..o.params().len())
                    .map(|i| o.state(i).map_or(0, |s| s.step))
                    .collect();
                assert!(counts.iter().all(|&c| c == 5), "step counts {counts:?}");
            })?;
            // Other shapes: a new capture (the old graph and its pool go).
            step(&mut trainer, &mut graph, 2, 16)?;
            assert!(
                matches!(graph.status(), GraphStatus::Replaying { step: 5, .. }),
                "{}",
                graph.status()
            );
            assert_eq!(alloc.by_category().total(), alloc.memory_allocated());
            drop(graph);
            alloc.empty_cache();
            assert!(alloc.memory_reserved() < reserved, "the pool was kept");
            Ok(())
        })
        .unwrap();
    }
}

/// A GPT wide enough that its MLP's hidden activations (2 MiB at B 8, T 64) are large
/// blocks, which outside a graph's pool need segments of their own; its AdamW trainer; one
/// step's inputs; and the batch as a tensor, for an evaluation.
struct WideGpt {
    gpt: ferrograd::nn::Gpt,
    trainer: ferrograd::train::Trainer<Adam>,
    inputs: ferrograd::train::HostInputs,
    x: Tensor,
}

impl WideGpt {
    fn new(device: Device) -> ferrograd::Result<WideGpt> {
        use ferrograd::train::{HostInput, Trainer};
        let (b, t) = (8, 64);
        let ids: Vec<i64> = (0..b * t).map(|k| (k % 65) as i64).collect();
        let config = GptConfig {
            n_embd: 256,
            ..GptConfig::tiny()
        };
        let gpt = ferrograd::nn::Gpt::new(config, device)?;
        let opt = Adam::adamw(gpt.parameters(), AdamConfig::adamw_default())?;
        Ok(WideGpt {
            trainer: Trainer::new(opt, TrainerConfig::default(), device)?,
            inputs: vec![vec![
                HostInput::new(ids.clone(), &[b, t]),
                HostInput::new(ids.clone(), &[b, t]),
            ]],
            x: Tensor::from_vec(ids, &[b, t], device)?,
            gpt,
        })
    }

    /// One training step through `graph`.
    fn step(&mut self, graph: &mut ferrograd::train::StepGraph) -> ferrograd::Result<()> {
        let gpt = &self.gpt;
        self.trainer
            .step_graphed(graph, &self.inputs, |_, x| {
                Ok(ferrograd::train::MicroBatch {
                    loss: gpt.loss(&x[0], &x[1])?,
                    tokens: x[0].numel(),
                })
            })
            .map(drop)
    }

    /// The loss of the batch under no_grad, dropped.
    fn evaluate(&self) -> ferrograd::Result<()> {
        let _g = ferrograd::autograd::no_grad();
        self.gpt.loss(&self.x, &self.x).map(drop)
    }
}

/// Work between replays (an evaluation) runs in the captured step's pool: it reserves nothing
/// beside it and the replays go on; work that leaves a block in the pool drops the capture,
/// and the next step captures again.
#[test]
fn work_between_replays_takes_the_graphs_pool_and_a_block_left_there_recaptures() {
    use ferrograd::train::{GraphStatus, StepGraph};
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let gpu = Target::Cuda { capacity: 80 << 30 };
    plan::plan(gpu, PlanOptions::default(), |device| {
        let mut m = WideGpt::new(device)?;
        let mut graph = StepGraph::new(true, 1);
        m.step(&mut graph)?;
        m.step(&mut graph)?;
        let alloc = memory::allocator(device)?;
        // No free shared segments left to serve the evaluation from.
        alloc.empty_cache();
        let (allocated, reserved) = (alloc.memory_allocated(), alloc.memory_reserved());
        // Outside the pool the forward reserves segments of its own; in it, none.
        graph.run_between_steps(device, || m.evaluate())?;
        assert_eq!(alloc.memory_reserved(), reserved, "the evaluation reserved");
        assert_eq!(alloc.memory_allocated(), allocated);
        assert!(matches!(
            graph.status(),
            GraphStatus::Replaying { step: 1, .. }
        ));
        m.step(&mut graph)?;
        assert!(matches!(
            graph.status(),
            GraphStatus::Replaying { step: 1, .. }
        ));
        m.evaluate()?;
        assert!(
            alloc.memory_reserved() > reserved,
            "the check above could not fail"
        );
        // A block kept from the work between steps: the capture goes, the next step
        // captures again (step 3: the warm-up, the capture and one replay before it).
        let kept =
            graph.run_between_steps(device, || Tensor::zeros(&[1024], DType::F32, device))?;
        assert_eq!(graph.status(), GraphStatus::WarmingUp);
        m.step(&mut graph)?;
        assert!(
            matches!(graph.status(), GraphStatus::Replaying { step: 3, .. }),
            "{}",
            graph.status()
        );
        drop(kept);
        assert_eq!(alloc.by_category().total(), alloc.memory_allocated());
        Ok(())
    })
    .unwrap();
}

/// Work before the first step (the evaluation before training) runs in the pool the warm-up
/// and the capture then take: the peak reserved through the capture is what it is with no
/// such work, where the work's segments used to stay cached beside the pool.
#[test]
fn work_before_the_first_step_leaves_its_segments_to_the_capture() {
    use ferrograd::train::StepGraph;
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    // The peak reserved bytes through the warm-up and the capture.
    let reserved_after_capture = |work_first: bool, in_pool: bool| {
        let mut reserved = 0;
        let gpu = Target::Cuda { capacity: 80 << 30 };
        plan::plan(gpu, PlanOptions::default(), |device| {
            let mut m = WideGpt::new(device)?;
            let mut graph = StepGraph::new(true, 1);
            m.trainer.prepare_graph(&mut graph)?;
            if work_first && in_pool {
                graph.run_between_steps(device, || m.evaluate())?;
            } else if work_first {
                m.evaluate()?;
            }
            m.step(&mut graph)?;
            m.step(&mut graph)?;
            reserved = memory::allocator(device)?.max_memory_reserved();
            Ok(())
        })
        .unwrap();
        reserved
    };
    let none = reserved_after_capture(false, false);
    assert_eq!(reserved_after_capture(true, true), none);
    // Outside the pool the same work leaves segments the capture cannot use.
    assert!(reserved_after_capture(true, false) > none);
}

/// A GPU job that evaluates between replayed steps plans no more reserved bytes than one that
/// does not: the evaluation runs in the graph's pool (here the pool's scratch holds it).
#[test]
fn a_gpu_jobs_evaluation_between_steps_reserves_nothing_beside_the_graph() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let plan_of = |eval_every: u64| {
        let small = small_job(TrainerConfig::default());
        let job = TrainJob {
            device: Device::Cuda(0),
            cuda_graphs: true,
            eval_every,
            max_steps: 4,
            // Wide enough that an evaluation's MLP activations (2 MiB) are large blocks.
            model: GptConfig {
                block_size: 64,
                n_embd: 256,
                ..small.model.clone()
            },
            batch_size: 8,
            ..small
        };
        job::plan_job(
            &job,
            Target::Cuda { capacity: 80 << 30 },
            PlanOptions::default(),
        )
        .unwrap()
    };
    let (between, without) = (plan_of(2), plan_of(0));
    println!(
        "reserved: {} with an evaluation between steps, {} without",
        between.peak_reserved, without.peak_reserved
    );
    assert_eq!(between.peak_reserved, without.peak_reserved);
    assert_eq!(between.peak_allocated, without.peak_allocated);
}

/// The job's plan for a GPU captures its second step as the run will: the same allocated
/// peak as with graphs off, and the reserved bytes the graph's pool adds.
#[test]
fn a_gpu_jobs_plan_counts_its_cuda_graph() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let plan_of = |cuda_graphs: bool| {
        let job = TrainJob {
            device: Device::Cuda(0),
            cuda_graphs,
            eval_every: 0,
            ..small_job(TrainerConfig::default())
        };
        job::plan_job(
            &job,
            Target::Cuda { capacity: 80 << 30 },
            PlanOptions::default(),
        )
        .unwrap()
    };
    let (on, off) = (plan_of(true), plan_of(false));
    println!(
        "graphs on: {} / {} bytes; off: {} / {}",
        on.peak_allocated, on.peak_reserved, off.peak_allocated, off.peak_reserved
    );
    assert!(on.peak_allocated >= off.peak_allocated);
    assert!(on.peak_reserved > off.peak_reserved);
}

/// One step's inputs for a tiny GPT on a planned GPU: ids and targets of a (4, 32) batch.
fn tiny_batch() -> ferrograd::train::HostInputs {
    use ferrograd::train::HostInput;
    let (b, t) = (4, 32);
    let ids: Vec<i64> = (0..b * t).map(|k| (k % 65) as i64).collect();
    vec![vec![
        HostInput::new(ids.clone(), &[b, t]),
        HostInput::new(ids, &[b, t]),
    ]]
}

/// Warm-up, capture and three replays of `trainer`'s step of `gpt` on a planned GPU: the
/// capture is at step 1, replays allocate and reserve nothing, the categories sum to the
/// total, and the graph's pool goes back when the graph does.
fn replays_in_a_pool_that_goes_back<O: Optimizer + Send + 'static>(
    trainer: &mut ferrograd::train::Trainer<O>,
    gpt: &ferrograd::nn::Gpt,
    device: Device,
) -> ferrograd::Result<()> {
    use ferrograd::train::{GraphStatus, MicroBatch, StepGraph};
    let inputs = tiny_batch();
    let mut graph = StepGraph::new(true, 1);
    let step = |trainer: &mut ferrograd::train::Trainer<O>, graph: &mut StepGraph| {
        trainer
            .step_graphed(graph, &inputs, |_, x| {
                Ok(MicroBatch {
                    loss: gpt.loss(&x[0], &x[1])?,
                    tokens: x[0].numel(),
                })
            })
            .map(drop)
    };
    step(trainer, &mut graph)?;
    step(trainer, &mut graph)?;
    assert!(
        matches!(graph.status(), GraphStatus::Replaying { step: 1, .. }),
        "{}",
        graph.status()
    );
    let alloc = memory::allocator(device)?;
    let (allocated, reserved) = (alloc.memory_allocated(), alloc.memory_reserved());
    for _ in 0..3 {
        step(trainer, &mut graph)?;
        assert_eq!(alloc.memory_allocated(), allocated, "a replay allocated");
        assert_eq!(alloc.memory_reserved(), reserved, "a replay reserved");
    }
    assert_eq!(alloc.by_category().total(), alloc.memory_allocated());
    drop(graph);
    alloc.empty_cache();
    assert!(alloc.memory_reserved() < reserved, "the pool was kept");
    Ok(())
}

/// SGD at rate 0.1 with momentum 0.9.
fn sgd_with_momentum() -> ferrograd::optim::SgdConfig {
    ferrograd::optim::SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        ..Default::default()
    }
}

/// SGD with momentum replays on a planned GPU too: the warm-up step makes the momentum
/// buffers beside the parameters (not in the graph's pool), the capture stages the rate in
/// device memory, the replays allocate nothing, and the pool goes back with the graph.
#[test]
fn a_gpu_plan_replays_sgd_with_momentum() {
    use ferrograd::nn::Gpt;
    use ferrograd::optim::Sgd;
    use ferrograd::train::Trainer;
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let gpu = Target::Cuda { capacity: 80 << 30 };
    plan::plan(gpu, PlanOptions::default(), |device| {
        let gpt = Gpt::new(GptConfig::tiny(), device)?;
        let opt = Sgd::new(gpt.parameters(), sgd_with_momentum())?;
        let mut trainer = Trainer::new(opt, TrainerConfig::default(), device)?;
        replays_in_a_pool_that_goes_back(&mut trainer, &gpt, device)?;
        // Every parameter's momentum buffer, and the staged rate, are optimizer state.
        let alloc = memory::allocator(device)?;
        let params: u64 = gpt.parameters().iter().map(|p| p.numel() as u64 * 4).sum();
        assert!(alloc.by_category().get(Category::OptimizerState) >= params);
        Ok(())
    })
    .unwrap();
}

/// The step in backward replays on a planned GPU too, on both of its paths: AdamW's
/// per-parameter hooks (each replay advances every parameter's count, not the optimizer's
/// whole-step count, as eager steps in backward do) and SGD's gradient-free one (the weight
/// gradients' GEMMs write into the momentum buffers). Replays allocate nothing and the pool
/// goes back with the graph.
#[test]
fn a_gpu_plan_replays_the_step_in_backward() {
    use ferrograd::nn::Gpt;
    use ferrograd::optim::Sgd;
    use ferrograd::train::Trainer;
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let config = TrainerConfig {
        step_in_backward: true,
        ..TrainerConfig::default()
    };
    let gpu = Target::Cuda { capacity: 80 << 30 };
    plan::plan(gpu, PlanOptions::default(), |device| {
        let gpt = Gpt::new(GptConfig::tiny(), device)?;
        let opt = Adam::adamw(gpt.parameters(), AdamConfig::adamw_default())?;
        let mut trainer = Trainer::new(opt, config.clone(), device)?;
        replays_in_a_pool_that_goes_back(&mut trainer, &gpt, device)?;
        trainer.with_optimizer(|o| {
            let counts: Vec<u64> = (0..o.params().len())
                .map(|i| o.state(i).map_or(0, |s| s.step))
                .collect();
            assert!(counts.iter().all(|&c| c == 5), "step counts {counts:?}");
            assert_eq!(o.step_count(), 0, "steps in backward are not whole steps");
        })?;
        Ok(())
    })
    .unwrap();
    plan::plan(gpu, PlanOptions::default(), |device| {
        let gpt = Gpt::new(GptConfig::tiny(), device)?;
        let opt = Sgd::new(gpt.parameters(), sgd_with_momentum())?;
        let mut trainer = Trainer::new(opt, config.clone(), device)?;
        assert!(trainer.in_backward_path().is_some_and(|p| p.is_fused()));
        replays_in_a_pool_that_goes_back(&mut trainer, &gpt, device)?;
        Ok(())
    })
    .unwrap();
}
