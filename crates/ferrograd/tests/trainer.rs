//! The `Trainer`'s one readable step, strategy by strategy: zero_grad's two modes in exact
//! bytes, evaluation under no_grad saving nothing, the GradScaler skipping an overflowing step,
//! clipping after unscaling, step-in-backward giving the ordinary result, accumulation giving
//! the large batch's update, and the combinations it refuses.

use std::sync::Mutex;

use ferrograd::nn::{Gpt, GptConfig, Linear, Module, Relu, Sequential};
use ferrograd::optim::{Adam, AdamConfig, Sgd, SgdConfig, clip_grad_norm};
use ferrograd::train::{MicroBatch, Trainer, TrainerConfig};
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
    assert!(first.stepped);
    assert_eq!(first.scale, Some(65536.0));
    let before = values(&model);
    let bad = run(true);
    assert!(!bad.stepped);
    assert_eq!(bad.scale, Some(32768.0));
    assert_eq!(
        values(&model),
        before,
        "a skipped step leaves the weights alone"
    );
    assert!(model.parameters().iter().all(|p| p.grad().is_none()));
    assert!(run(false).stepped);
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
        let norm = r.grad_norm.unwrap();
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
