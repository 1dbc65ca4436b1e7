//! The `Trainer`'s one readable step, strategy by strategy: zero_grad's two modes in exact
//! bytes, evaluation under no_grad saving nothing, the GradScaler skipping an overflowing step,
//! clipping after unscaling, step-in-backward giving the ordinary result (gradient-free with
//! SGD momentum, per-parameter hooks with AdamW, and saying which), accumulation giving the
//! large batch's update, freezing and recomputation composed on the model, and the
//! combinations it refuses.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ferrograd::nn::{Gpt, GptConfig, Linear, Module, Recompute, Relu, Sequential};
use ferrograd::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig, clip_grad_norm};
use ferrograd::train::{InBackwardPath, MicroBatch, Trainer, TrainerConfig};
use ferrograd::{Category, DType, Device, Generator, Tensor, memory, no_grad};

const CPU: Device = Device::Cpu;
static LOCK: Mutex<()> = Mutex::new(());

fn mlp(seed: u64) -> Sequential {
    let mut g = Generator::new(seed);
    Sequential::new()
        .push(Linear::new(8, 16, true, CPU, &mut g).unwrap())
        .push(Relu)
        .push(Linear::new(16, 4, true, CPU, &mut g).unwrap())
}

fn data(rows: usize) -> (Tensor, Tensor) {
    let mut g = Generator::new(99);
    (
        Tensor::randn_with(&[rows, 8], DType::F32, CPU, &mut g).unwrap(),
        Tensor::randn_with(&[rows, 4], DType::F32, CPU, &mut g).unwrap(),
    )
}

fn sgd(model: &Sequential) -> Sgd {
    let cfg = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        ..Default::default()
    };
    Sgd::new(model.parameters(), cfg).unwrap()
}

fn values(model: &Sequential) -> Vec<Vec<f32>> {
    model
        .parameters()
        .iter()
        .map(|p| p.to_vec::<f32>().unwrap())
        .collect()
}

/// Runs `steps` trainer steps of the MLP on rows [i·rows/accum ..) per micro-batch.
fn train(config: TrainerConfig, steps: usize) -> Vec<Vec<f32>> {
    let model = mlp(1);
    let mut trainer = Trainer::new(sgd(&model), config.clone(), CPU).unwrap();
    let (x, y) = data(8);
    let rows = 8 / config.accum;
    for _ in 0..steps {
        trainer
            .step(|i| {
                let xs = x.narrow(0, i * rows, rows)?;
                let ys = y.narrow(0, i * rows, rows)?;
                Ok(MicroBatch {
                    loss: model.forward(&xs)?.mse_loss(&ys)?,
                    tokens: rows,
                })
            })
            .unwrap();
    }
    values(&model)
}

#[test]
fn zero_grad_frees_gradients_or_keeps_them_zeroed_in_exact_bytes() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    for set_to_none in [true, false] {
        let model = mlp(1);
        let config = TrainerConfig {
            set_to_none,
            ..Default::default()
        };
        let mut trainer = Trainer::new(sgd(&model), config, CPU).unwrap();
        let (x, y) = data(8);
        trainer
            .step(|_| {
                Ok(MicroBatch {
                    loss: model.forward(&x)?.mse_loss(&y)?,
                    tokens: 8,
                })
            })
            .unwrap();
        let grads = memory::memory_by_category(CPU)
            .unwrap()
            .get(Category::Gradient);
        let param_bytes = model.parameter_bytes() as u64;
        if set_to_none {
            assert_eq!(grads, 0);
            assert!(model.parameters().iter().all(|p| p.grad().is_none()));
        } else {
            // (8·16 + 16 + 16·4 + 4) f32 gradients, all zero.
            assert_eq!(grads, param_bytes);
            assert_eq!(param_bytes, (8 * 16 + 16 + 16 * 4 + 4) * 4);
            for p in model.parameters() {
                assert!(
                    p.grad()
                        .unwrap()
                        .to_vec::<f32>()
                        .unwrap()
                        .iter()
                        .all(|v| *v == 0.0)
                );
            }
        }
    }
}

#[test]
fn evaluation_under_no_grad_saves_no_activations() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let gpt = Gpt::new(GptConfig::tiny(), CPU).unwrap();
    let ids = Tensor::from_vec(vec![1i64; 2 * 32], &[2, 32], CPU).unwrap();
    let saved = |f: &dyn Fn() -> Tensor| {
        let before = memory::memory_by_category(CPU).unwrap();
        let out = f();
        let after = memory::memory_by_category(CPU).unwrap();
        let d = after.get(Category::SavedActivation) - before.get(Category::SavedActivation);
        drop(out);
        d
    };
    let with_grad = saved(&|| gpt.forward(&ids).unwrap());
    let without = saved(&|| {
        let _g = no_grad();
        gpt.forward(&ids).unwrap()
    });
    assert!(with_grad > 0);
    assert_eq!(without, 0);
}

#[test]
fn the_scaler_skips_an_overflowing_step_and_halves_the_scale() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let model = mlp(1);
    let config = TrainerConfig {
        amp: Some(DType::F16),
        ..Default::default()
    };
    let mut trainer = Trainer::new(sgd(&model), config, CPU).unwrap();
    let (x, y) = data(8);
    let mut run = |poison: bool| {
        trainer
            .step(|_| {
                let loss = model.forward(&x)?.mse_loss(&y)?;
                // inf·loss makes every gradient inf or NaN, as an f16 overflow would.
                let loss = if poison {
                    loss.mul_scalar(f64::INFINITY)?
                } else {
                    loss
                };
                Ok(MicroBatch { loss, tokens: 8 })
            })
            .unwrap()
    };
    let first = run(false);
    assert!(first.stepped().unwrap());
    assert_eq!(first.scale().unwrap(), Some(65536.0));
    let before = values(&model);
    let bad = run(true);
    assert!(!bad.stepped().unwrap());
    assert_eq!(bad.scale().unwrap(), Some(32768.0));
    assert_eq!(
        values(&model),
        before,
        "a skipped step leaves the weights alone"
    );
    assert!(model.parameters().iter().all(|p| p.grad().is_none()));
    assert!(run(false).stepped().unwrap());
}

#[test]
fn clipping_reports_the_unscaled_norm() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    // The norm an f32 run sees before clipping.
    let model = mlp(1);
    let (x, y) = data(8);
    model
        .forward(&x)
        .unwrap()
        .mse_loss(&y)
        .unwrap()
        .backward()
        .unwrap();
    let want = clip_grad_norm(&model.parameters(), f64::INFINITY, 2.0, false).unwrap();
    for amp in [None, Some(DType::F16)] {
        let model = mlp(1);
        let config = TrainerConfig {
            clip: Some(0.01),
            amp,
            ..Default::default()
        };
        let mut trainer = Trainer::new(sgd(&model), config, CPU).unwrap();
        let r = trainer
            .step(|_| {
                Ok(MicroBatch {
                    loss: model.forward(&x)?.mse_loss(&y)?,
                    tokens: 8,
                })
            })
            .unwrap();
        let norm = r.grad_norm.as_ref().unwrap().value().unwrap();
        // f16 autocast changes the forward's rounding, so only the f32 run is exact.
        let tol = if amp.is_none() { 1e-6 } else { 1e-2 };
        assert!(
            (norm - want).abs() <= tol * want,
            "{amp:?}: {norm} vs {want}"
        );
    }
}

#[test]
fn step_in_backward_through_the_trainer_matches_the_ordinary_step() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let plain = train(TrainerConfig::default(), 3);
    let hooked = train(
        TrainerConfig {
            step_in_backward: true,
            ..Default::default()
        },
        3,
    );
    assert_eq!(plain, hooked);
}

#[test]
fn accumulation_matches_one_large_batch() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let large = train(TrainerConfig::default(), 2);
    let micro = train(
        TrainerConfig {
            accum: 4,
            ..Default::default()
        },
        2,
    );
    for (a, b) in large.iter().flatten().zip(micro.iter().flatten()) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
}

#[test]
fn impossible_combinations_are_refused_with_the_reason() {
    let model = mlp(1);
    let refuse = |config: TrainerConfig, word: &str| {
        let err = Trainer::new(sgd(&model), config, CPU)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains(word), "{err}");
    };
    let sib = TrainerConfig {
        step_in_backward: true,
        ..Default::default()
    };
    refuse(
        TrainerConfig {
            accum: 2,
            ..sib.clone()
        },
        "accumulation",
    );
    refuse(
        TrainerConfig {
            clip: Some(1.0),
            ..sib.clone()
        },
        "clipping",
    );
    refuse(
        TrainerConfig {
            amp: Some(DType::F16),
            ..sib
        },
        "GradScaler",
    );
    refuse(
        TrainerConfig {
            accum: 0,
            ..Default::default()
        },
        "accum",
    );
    refuse(
        TrainerConfig {
            amp: Some(DType::F64),
            ..Default::default()
        },
        "f16 or bf16",
    );
    // Adam is accepted with step-in-backward and bf16.
    let adam = Adam::adamw(model.parameters(), AdamConfig::adamw_default()).unwrap();
    let ok = TrainerConfig {
        step_in_backward: true,
        amp: Some(DType::BF16),
        ..Default::default()
    };
    assert!(Trainer::new(adam, ok, CPU).is_ok());
}

// ---- step in backward: which path the Trainer takes -------------------------------------------

/// Two bias-free linear layers in f64: every weight gradient is a product, so the
/// gradient-free path leaves nothing to an ordinary `.grad`.
fn product_net() -> Vec<Tensor> {
    let mut g = Generator::new(5);
    [[16, 8], [4, 16]]
        .iter()
        .map(|shape| {
            Tensor::randn_with(shape, DType::F64, CPU, &mut g)
                .unwrap()
                .mul_scalar(0.3)
                .unwrap()
                .requires_grad_(true)
                .unwrap()
        })
        .collect()
}

/// What three steps of the product net through a Trainer did.
struct PathRun {
    values: Vec<Vec<f64>>,
    path: Option<InBackwardPath>,
    /// `.grad` accumulations into any parameter, over all steps.
    grads_made: usize,
    /// The most Gradient bytes seen: at each step's peak and after it.
    max_gradient_bytes: u64,
}

fn run_path<O: Optimizer + Send + 'static>(
    optimizer: impl FnOnce(Vec<Tensor>) -> O,
    step_in_backward: bool,
) -> PathRun {
    let ps = product_net();
    let made = Arc::new(AtomicUsize::new(0));
    for p in &ps {
        let n = Arc::clone(&made);
        p.register_post_accumulate_grad_hook(move |_| {
            n.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
        .unwrap();
    }
    let config = TrainerConfig {
        step_in_backward,
        ..Default::default()
    };
    let mut trainer = Trainer::new(optimizer(ps.clone()), config, CPU).unwrap();
    let mut g = Generator::new(6);
    let x = Tensor::randn_with(&[8, 8], DType::F64, CPU, &mut g).unwrap();
    let y = Tensor::randn_with(&[8, 4], DType::F64, CPU, &mut g).unwrap();
    let (mut path, mut max_gradient_bytes) = (None, 0);
    for _ in 0..3 {
        memory::reset_peak_memory_stats(CPU).unwrap();
        let r = trainer
            .step(|_| {
                let h = x.linear(&ps[0], None)?.relu()?;
                Ok(MicroBatch {
                    loss: h.linear(&ps[1], None)?.mse_loss(&y)?,
                    tokens: 8,
                })
            })
            .unwrap();
        let at_peak = trainer.by_category_at_peak().unwrap();
        let after = memory::memory_by_category(CPU).unwrap();
        max_gradient_bytes = max_gradient_bytes
            .max(at_peak.get(Category::Gradient))
            .max(after.get(Category::Gradient));
        assert_eq!(r.in_backward.as_ref(), trainer.in_backward_path());
        path = r.in_backward;
    }
    PathRun {
        values: ps.iter().map(|p| p.to_vec::<f64>().unwrap()).collect(),
        path,
        grads_made: made.load(Ordering::Relaxed),
        max_gradient_bytes,
    }
}

fn max_abs_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

fn sgd_momentum(ps: Vec<Tensor>) -> Sgd {
    let cfg = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        ..Default::default()
    };
    Sgd::new(ps, cfg).unwrap()
}

#[test]
fn step_in_backward_with_sgd_momentum_makes_no_gradient() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let ordinary = run_path(sgd_momentum, false);
    let fused = run_path(sgd_momentum, true);
    assert_eq!(ordinary.path, None);
    assert!(ordinary.grads_made > 0 && ordinary.max_gradient_bytes > 0);
    let path = fused
        .path
        .expect("a step-in-backward trainer reports its path");
    assert!(path.is_fused(), "{path}");
    assert_eq!(
        path.to_string(),
        "fused into the weight-gradient GEMMs (SGD momentum)"
    );
    assert_eq!(fused.grads_made, 0, "no .grad was ever made");
    assert_eq!(
        fused.max_gradient_bytes, 0,
        "no gradient bytes ever existed"
    );
    let d = max_abs_diff(&fused.values, &ordinary.values);
    assert!(d < 1e-12, "fused vs ordinary SGD: {d}");
    // The parameters moved: the comparison is not between two no-ops.
    assert!(max_abs_diff(&fused.values, &values_of(product_net())) > 1e-3);
}

#[test]
fn step_in_backward_with_adamw_uses_hooks_and_matches_adamw() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let adamw = |ps| Adam::adamw(ps, AdamConfig::adamw_default()).unwrap();
    let ordinary = run_path(adamw, false);
    let hooked = run_path(adamw, true);
    let path = hooked
        .path
        .expect("a step-in-backward trainer reports its path");
    assert!(!path.is_fused());
    assert_eq!(path.to_string(), "per-parameter hooks (AdamW)");
    // Each hook steps from a .grad and frees it: one per parameter per step.
    assert_eq!(hooked.grads_made, 2 * 3);
    let d = max_abs_diff(&hooked.values, &ordinary.values);
    assert!(d < 1e-12, "hooked vs ordinary AdamW: {d}");
    // SGD whose step is not linear in the gradient (Nesterov) falls back to hooks too.
    let nesterov = |ps| {
        let cfg = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            nesterov: true,
            ..Default::default()
        };
        Sgd::new(ps, cfg).unwrap()
    };
    let path = run_path(nesterov, true).path.unwrap();
    assert_eq!(path.to_string(), "per-parameter hooks (SGD)");
}

fn values_of(ps: Vec<Tensor>) -> Vec<Vec<f64>> {
    ps.iter().map(|p| p.to_vec::<f64>().unwrap()).collect()
}

#[test]
fn freeze_and_recompute_are_composed_by_the_trainer() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let mut model = mlp(1);
    let config = TrainerConfig {
        freeze: vec!["0.*".into()],
        ..Default::default()
    };
    // Trainer::new has no model to freeze: it refuses rather than ignore the patterns.
    let err = Trainer::new(sgd(&model), config.clone(), CPU)
        .err()
        .unwrap();
    assert!(err.to_string().contains("for_model"), "{err}");
    let mut count = 0;
    let trainer = Trainer::for_model(&mut model, config, CPU, |ps| {
        count = ps.len();
        Sgd::new(ps, SgdConfig::default())
    })
    .unwrap();
    assert_eq!(count, 2, "the optimizer gets only what still trains");
    let frozen: Vec<bool> = model
        .parameters()
        .iter()
        .map(|p| p.requires_grad())
        .collect();
    assert_eq!(frozen, [false, false, true, true]);
    drop(trainer);
    // A model without blocks refuses a recomputation policy instead of ignoring it.
    let config = TrainerConfig {
        recompute: Recompute::Every(1),
        ..Default::default()
    };
    let err = Trainer::for_model(&mut mlp(1), config.clone(), CPU, |ps| {
        Sgd::new(ps, SgdConfig::default())
    })
    .err()
    .unwrap();
    assert!(err.to_string().contains("no recomputation policy"), "{err}");
    let mut gpt = Gpt::new(
        GptConfig {
            vocab_size: 8,
            block_size: 4,
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            dropout: 0.0,
            bias: true,
            seed: 0,
        },
        CPU,
    )
    .unwrap();
    Trainer::for_model(&mut gpt, config, CPU, |ps| {
        Sgd::new(ps, SgdConfig::default())
    })
    .unwrap();
    assert_eq!(gpt.recompute(), Recompute::Every(1));
}

/// Ids and targets of micro-batch i of a step, on the host.
fn host_batch(step: usize, i: usize) -> Vec<ferrograd::train::HostInput> {
    use ferrograd::train::HostInput;
    let ids = (0..2 * 16).map(|k| ((k * 7 + step * 3 + i) % 65) as i64);
    let targets = (0..2 * 16).map(|k| ((k * 5 + step + 2 * i) % 65) as i64);
    vec![
        HostInput::new(ids.collect(), &[2, 16]),
        HostInput::new(targets.collect(), &[2, 16]),
    ]
}

#[test]
fn a_graphed_step_on_the_cpu_is_the_eager_step_and_says_why() {
    use ferrograd::train::{GraphStatus, StepGraph};
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let config = TrainerConfig {
        accum: 2,
        clip: Some(1.0),
        ..TrainerConfig::default()
    };
    let run = |graphed: bool| {
        let gpt = Gpt::new(GptConfig::tiny(), CPU).unwrap();
        let opt = Adam::adamw(gpt.parameters(), AdamConfig::adamw_default()).unwrap();
        let mut trainer = Trainer::new(opt, config.clone(), CPU).unwrap();
        let mut graph = StepGraph::new(true, 1);
        let mut losses = Vec::new();
        for s in 0..3 {
            let batches: Vec<_> = (0..2).map(|i| host_batch(s, i)).collect();
            let r = if graphed {
                trainer.step_graphed(&mut graph, &batches, |_, t| {
                    Ok(MicroBatch {
                        loss: gpt.loss(&t[0], &t[1])?,
                        tokens: t[0].numel(),
                    })
                })
            } else {
                trainer.step(|i| {
                    let [x, y] = &batches[i][..] else {
                        unreachable!()
                    };
                    let x = Tensor::from_vec(x.values.clone(), &x.shape, CPU)?;
                    let y = Tensor::from_vec(y.values.clone(), &y.shape, CPU)?;
                    Ok(MicroBatch {
                        loss: gpt.loss(&x, &y)?,
                        tokens: x.numel(),
                    })
                })
            };
            losses.push(r.unwrap().loss.value().unwrap());
        }
        let params: Vec<Vec<f32>> = gpt
            .parameters()
            .iter()
            .map(|p| p.to_vec::<f32>().unwrap())
            .collect();
        (losses, params, graph.status())
    };
    let (graphed, graphed_params, status) = run(true);
    let (eager, eager_params, _) = run(false);
    assert_eq!(graphed, eager);
    assert_eq!(graphed_params, eager_params);
    let GraphStatus::Off(why) = status else {
        panic!("the CPU replayed a graph: {status}");
    };
    assert!(why.contains("cpu"), "{why}");
    // One set of inputs per micro-batch.
    let gpt = Gpt::new(GptConfig::tiny(), CPU).unwrap();
    let opt = Adam::adamw(gpt.parameters(), AdamConfig::adamw_default()).unwrap();
    let mut trainer = Trainer::new(opt, config, CPU).unwrap();
    let err = trainer
        .step_graphed(
            &mut StepGraph::new(true, 1),
            &[host_batch(0, 0)].to_vec(),
            |_, _| unreachable!(),
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("one set of inputs per micro-batch"),
        "{err}"
    );
}

#[test]
fn only_a_cuda_device_captures() {
    let Err(err) = ferrograd::backend::capture::capture(CPU, || Ok(())) else {
        panic!("the CPU captured a graph");
    };
    assert!(
        matches!(err, ferrograd::Error::NotSupportedOnDevice { .. }),
        "{err}"
    );
}

/// A step that reads values back cannot be captured as a CUDA graph (each read waits for the
/// device): a full step (GPT, bf16 autocast, accumulation, clipping, AdamW) reads none, and
/// neither does its report until the loss is looked at.
#[test]
fn a_training_step_reads_nothing_back_to_the_host() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let gpt = Gpt::new(GptConfig::tiny(), CPU).unwrap();
    let opt = Adam::adamw(gpt.parameters(), AdamConfig::adamw_default()).unwrap();
    let config = TrainerConfig {
        accum: 2,
        clip: Some(1.0),
        amp: Some(DType::BF16),
        ..TrainerConfig::default()
    };
    let mut trainer = Trainer::new(opt, config, CPU).unwrap();
    let batches: Vec<_> = (0..2).map(|i| host_batch(0, i)).collect();
    let mut graph = ferrograd::train::StepGraph::new(false, 0);
    for _ in 0..2 {
        let before = ferrograd::tensor::host_reads();
        let report = trainer
            .step_graphed(&mut graph, &batches, |_, t| {
                Ok(MicroBatch {
                    loss: gpt.loss(&t[0], &t[1])?,
                    tokens: t[0].numel(),
                })
            })
            .unwrap();
        assert_eq!(
            ferrograd::tensor::host_reads(),
            before,
            "the step read values back"
        );
        assert!(report.loss.value().unwrap().is_finite());
        assert_eq!(ferrograd::tensor::host_reads(), before + 1);
    }
}
