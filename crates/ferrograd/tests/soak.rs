//! The soak test: the main job's model (a GPT) trained by the `Trainer` for 200 steps with
//! every strategy combination it supports, memory allocated after each step flat to the byte
//! once warm-up is over, the step's peak too, and the leak check, watching throughout,
//! reporting nothing.
//!
//! The model is tiny (2 layers, width 16, context 8) so each combination takes well under
//! a second. The allocators are process-wide, so the combinations run one at a time.

use std::sync::{Mutex, MutexGuard};

use ferrograd::autograd::LeakCheck;
use ferrograd::nn::{Gpt, GptConfig, Recompute};
use ferrograd::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig, WarmupCosine};
use ferrograd::train::{MicroBatch, Trainer, TrainerConfig};
use ferrograd::{DType, Device, Generator, Tensor, memory};

const CPU: Device = Device::Cpu;
const STEPS: usize = 200;
/// Steps after which memory must not move: step 1 creates the optimizer state (and the
/// GradScaler's), everything after is the same step again.
const WARMUP: usize = 2;
const BATCH: usize = 4;
const CONTEXT: usize = 8;
const VOCAB: usize = 32;

static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn tiny_gpt() -> Gpt {
    let cfg = GptConfig {
        vocab_size: VOCAB,
        block_size: CONTEXT,
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        dropout: 0.1,
        bias: true,
        seed: 7,
    };
    Gpt::new(cfg, CPU).unwrap()
}

/// Four (inputs, targets) batches of one shape, cycled through.
fn batches() -> Vec<(Tensor, Tensor)> {
    let mut g = Generator::new(3);
    (0..4)
        .map(|_| {
            let ids: Vec<i64> = g
                .uniform(BATCH * (CONTEXT + 1), 0.0, VOCAB as f64)
                .iter()
                .map(|&v| (v as i64).min(VOCAB as i64 - 1))
                .collect();
            let t = Tensor::from_vec(ids, &[BATCH, CONTEXT + 1], CPU).unwrap();
            (
                t.narrow(1, 0, CONTEXT).unwrap().contiguous().unwrap(),
                t.narrow(1, 1, CONTEXT).unwrap().contiguous().unwrap(),
            )
        })
        .collect()
}

enum Opt {
    AdamW,
    SgdMomentum,
}

/// Trains `STEPS` steps with `config`; asserts flat memory after warm-up and a clean leak
/// report. Returns memory after the last step (for the message of a failing combination).
fn soak(name: &str, config: TrainerConfig, opt: Opt) {
    let _l = lock();
    let mut gpt = tiny_gpt();
    let data = batches();
    let mut check = LeakCheck::new(CPU).unwrap();
    let after_steps = match opt {
        Opt::AdamW => {
            let make = |ps| {
                Adam::adamw(
                    ps,
                    AdamConfig {
                        lr: 1e-3,
                        ..AdamConfig::adamw_default()
                    },
                )
            };
            run(&mut gpt, &data, config, make, &mut check)
        }
        Opt::SgdMomentum => {
            let make = |ps| {
                Sgd::new(
                    ps,
                    SgdConfig {
                        lr: 0.05,
                        momentum: 0.9,
                        ..Default::default()
                    },
                )
            };
            run(&mut gpt, &data, config, make, &mut check)
        }
    };
    let settled = &after_steps[WARMUP..];
    for (i, (alloc, peak)) in settled.iter().enumerate() {
        assert_eq!(
            (*alloc, *peak),
            settled[0],
            "{name}: step {} (allocated, peak) differs from step {}",
            WARMUP + i + 1,
            WARMUP + 1
        );
    }
    let report = check.report();
    assert_eq!(report.steps, STEPS);
    assert!(report.is_clean(), "{name}: {report}");
}

/// (allocated after the step, the step's peak) for each step.
fn run<O: Optimizer + Send + 'static>(
    gpt: &mut Gpt,
    data: &[(Tensor, Tensor)],
    config: TrainerConfig,
    make: impl FnOnce(Vec<Tensor>) -> ferrograd::Result<O>,
    check: &mut LeakCheck,
) -> Vec<(u64, u64)> {
    let accum = config.accum;
    let mut trainer = Trainer::for_model(gpt, config, CPU, make).unwrap();
    let rows = BATCH / accum;
    let mut out = Vec::with_capacity(STEPS);
    for step in 0..STEPS {
        memory::reset_peak_memory_stats(CPU).unwrap();
        let (x, y) = &data[step % data.len()];
        trainer
            .step(|i| {
                let (xs, ys) = (x.narrow(0, i * rows, rows)?, y.narrow(0, i * rows, rows)?);
                let (_, loss) = gpt.forward_loss(&xs, Some(&ys))?;
                Ok(MicroBatch {
                    loss: loss.expect("targets give a loss"),
                    tokens: rows * CONTEXT,
                })
            })
            .unwrap();
        check.mark_step();
        out.push((
            memory::memory_allocated(CPU).unwrap(),
            memory::max_memory_allocated(CPU).unwrap(),
        ));
    }
    out
}

fn cfg(f: impl FnOnce(&mut TrainerConfig)) -> TrainerConfig {
    let mut c = TrainerConfig::default();
    f(&mut c);
    c
}

#[test]
fn plain_adamw_and_sgd() {
    soak("adamw", TrainerConfig::default(), Opt::AdamW);
    soak("sgd momentum", TrainerConfig::default(), Opt::SgdMomentum);
}

#[test]
fn zeroing_gradients_in_place() {
    soak(
        "set_to_none=false",
        cfg(|c| c.set_to_none = false),
        Opt::AdamW,
    );
}

#[test]
fn accumulation_and_clipping_with_a_schedule() {
    soak("accum 2", cfg(|c| c.accum = 2), Opt::AdamW);
    soak("clip 1.0", cfg(|c| c.clip = Some(1.0)), Opt::AdamW);
    let schedule = WarmupCosine {
        max_lr: 1e-3,
        min_lr: 1e-4,
        warmup_steps: 10,
        total_steps: STEPS as u64,
    };
    soak("schedule", cfg(|c| c.schedule = Some(schedule)), Opt::AdamW);
}

#[test]
fn mixed_precision() {
    soak("amp bf16", cfg(|c| c.amp = Some(DType::BF16)), Opt::AdamW);
    soak(
        "amp f16 + GradScaler",
        cfg(|c| c.amp = Some(DType::F16)),
        Opt::AdamW,
    );
}

#[test]
fn freezing_and_recomputation() {
    let freeze = || vec!["transformer.h.0.*".to_string()];
    soak("freeze", cfg(|c| c.freeze = freeze()), Opt::AdamW);
    soak(
        "recompute",
        cfg(|c| c.recompute = Recompute::Every(1)),
        Opt::AdamW,
    );
}

#[test]
fn step_in_backward() {
    // Gradient-free with SGD momentum, per-parameter hooks with AdamW.
    soak(
        "step in backward, sgd",
        cfg(|c| c.step_in_backward = true),
        Opt::SgdMomentum,
    );
    soak(
        "step in backward, adamw",
        cfg(|c| c.step_in_backward = true),
        Opt::AdamW,
    );
    let all = cfg(|c| {
        c.step_in_backward = true;
        c.amp = Some(DType::BF16);
        c.recompute = Recompute::Every(1);
        c.freeze = vec!["transformer.h.0.*".to_string()];
    });
    soak(
        "step in backward + bf16 + recompute + freeze",
        all,
        Opt::SgdMomentum,
    );
}

#[test]
fn everything_after_backward_at_once() {
    let all = cfg(|c| {
        c.accum = 2;
        c.clip = Some(1.0);
        c.amp = Some(DType::F16);
        c.set_to_none = false;
        c.recompute = Recompute::Every(1);
        c.freeze = vec!["transformer.h.0.*".to_string()];
    });
    soak(
        "accum + clip + f16 + zeroing + recompute + freeze",
        all,
        Opt::AdamW,
    );
}
