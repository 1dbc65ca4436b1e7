//! Every memory strategy against PyTorch on one fixture: a float64 MLP
//! Linear(6, 12)-ReLU-Linear(12, 4) with an MSE loss and SGD(lr 0.1, momentum 0.9), trained
//! three steps per strategy by the `Trainer` (or the strategy functions) and compared with
//! what tools/make_strategy_fixtures.py recorded from PyTorch: baseline, zero_grad without
//! freeing, gradient accumulation, norm clipping, freezing, activation recomputation,
//! evaluation under no_grad and the optimizer step in backward. Where the bytes are exact
//! (gradients kept or freed, frozen parameters' missing gradients, nothing saved under
//! no_grad) they are asserted to the byte.
//!
//! The CPU allocator is process-wide and tests run on parallel threads, so every test takes
//! `LOCK` first.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use ferrograd::autograd::{Segment, checkpoint_activations};
use ferrograd::nn::{Linear, Module, Relu, Sequential, load_named};
use ferrograd::optim::{Optimizer, Sgd, SgdConfig, clip_grad_norm};
use ferrograd::train::{
    MicroBatch, StepInBackward, StepReport, Trainer, TrainerConfig, accumulate_gradients, freeze,
};
use ferrograd::{Category, DType, Device, Generator, Result, Tensor, memory, no_grad};
#[path = "common/fixture_file.rs"]
mod fixture_file;

const CPU: Device = Device::Cpu;
const HINT: &str = "regenerate with tools/make_strategy_fixtures.py (see tools/README.md)";
/// float64 on both sides: only summation order differs.
const TOL: f64 = 1e-10;
const STEPS: usize = 3;
const ROWS: usize = 8;
const NAMES: [&str; 4] = ["0.weight", "0.bias", "2.weight", "2.bias"];
const F64: u64 = 8;
/// Parameters of the MLP: (12, 6) + (12,) + (4, 12) + (4,).
const PARAM_COUNT: u64 = 12 * 6 + 12 + 4 * 12 + 4;
/// Parameters of the second Linear only, the trainable ones when the first is frozen.
const SECOND_COUNT: u64 = 4 * 12 + 4;

static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    // A failed test must not fail every later one.
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

// ---- fixture -----------------------------------------------------------------------------------

/// Every fixture tensor by key, as f64 CPU tensors.
struct Fixture(HashMap<String, Tensor>);

impl Fixture {
    fn load() -> Fixture {
        let file = fixture_file::open(
            "strategies.safetensors",
            "ferrograd-strategy-fixtures",
            "make_strategy_fixtures.py",
        );
        let tensors = file
            .names()
            .into_iter()
            .map(|name| {
                let t = file.get(name);
                assert_eq!(t.dtype(), DType::F64, "{name}: {HINT}");
                (name.to_string(), t)
            })
            .collect();
        Fixture(tensors)
    }

    fn get(&self, key: &str) -> &Tensor {
        self.0
            .get(key)
            .unwrap_or_else(|| panic!("no fixture tensor '{key}'; {HINT}"))
    }

    fn x(&self) -> Tensor {
        self.get("data.x").clone()
    }

    fn y(&self) -> Tensor {
        self.get("data.y").clone()
    }

    fn values(&self, key: &str) -> Vec<f64> {
        self.get(key).to_vec::<f64>().unwrap()
    }

    /// The MLP with PyTorch's initial parameters (`init.0.weight` ... loaded by name).
    fn mlp(&self) -> Sequential {
        let mut g = Generator::new(0);
        let mut linear =
            |i, o| Linear::new_with_dtype(i, o, true, DType::F64, CPU, &mut g).unwrap();
        let model = Sequential::new()
            .push(linear(6, 12))
            .push(Relu)
            .push(linear(12, 4));
        let init: HashMap<String, Tensor> = NAMES
            .iter()
            .map(|n| (n.to_string(), self.get(&format!("init.{n}")).clone()))
            .collect();
        load_named(&model, &init).unwrap();
        model
    }
}

// ---- comparisons -------------------------------------------------------------------------------

fn max_diff(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.shape(), want.shape());
    let (g, w) = (got.to_vec::<f64>().unwrap(), want.to_vec::<f64>().unwrap());
    g.iter()
        .zip(&w)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    let d = max_diff(got, want);
    assert!(d <= tol, "{what}: max diff {d:.3e} > {tol:.0e}");
}

/// Every parameter of `model` against `{prefix}.{name}` (e.g. `clip.step2.0.weight`).
fn check_params(model: &dyn Module, f: &Fixture, prefix: &str, tol: f64) {
    for (name, p) in model.named_parameters() {
        let key = format!("{prefix}.{name}");
        assert_close(&key, &p, f.get(&key), tol);
    }
}

/// The gradients of `model` against `{case}.grad1.*`; parameters without a fixture gradient
/// (frozen in PyTorch) must have none here either.
fn check_grads(model: &dyn Module, f: &Fixture, case: &str) {
    for (name, p) in model.named_parameters() {
        let key = format!("{case}.grad1.{name}");
        match (p.grad(), f.0.get(&key)) {
            (Some(g), Some(want)) => assert_close(&key, &g, want, TOL),
            (None, None) => {}
            (got, want) => panic!(
                "{key}: gradient present here {}, in PyTorch {}",
                got.is_some(),
                want.is_some()
            ),
        }
    }
}

fn check_losses(case: &str, reports: &[StepReport], f: &Fixture) {
    let want = f.values(&format!("{case}.losses"));
    for (k, (r, w)) in reports.iter().zip(&want).enumerate() {
        let loss = r.loss.value().unwrap();
        assert!(
            (loss - w).abs() <= TOL,
            "{case} step {}: loss {loss} vs PyTorch {w}",
            k + 1,
        );
    }
    assert_eq!(reports.len(), want.len());
}

fn sgd(params: Vec<Tensor>) -> Sgd {
    let cfg = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        ..Default::default()
    };
    Sgd::new(params, cfg).unwrap()
}

/// Frees every gradient (after a check outside the trainer, before training).
fn clear_grads(model: &dyn Module) {
    for p in model.parameters() {
        p.set_grad(None).unwrap();
    }
}

fn gradient_bytes() -> u64 {
    memory::memory_by_category(CPU)
        .unwrap()
        .get(Category::Gradient)
}

// ---- training ----------------------------------------------------------------------------------

/// Rows [i·rows, (i+1)·rows) of x and y: micro-batch i of `accum`.
fn micro(f: &Fixture, i: usize, accum: usize) -> Result<(Tensor, Tensor)> {
    let rows = ROWS / accum;
    Ok((
        f.x().narrow(0, i * rows, rows)?,
        f.y().narrow(0, i * rows, rows)?,
    ))
}

/// Three trainer steps of `forward` (micro-batch i → model output, target), comparing the
/// parameters after each step with `{case}.step{k}`.
fn train(
    f: &Fixture,
    model: &dyn Module,
    opt: Sgd,
    config: TrainerConfig,
    case: &str,
    forward: impl Fn(usize) -> Result<(Tensor, Tensor)>,
) -> Vec<StepReport> {
    let mut trainer = Trainer::new(opt, config, CPU).unwrap();
    let mut reports = Vec::new();
    for k in 1..=STEPS {
        let r = trainer
            .step(|i| {
                let (out, y) = forward(i)?;
                Ok(MicroBatch {
                    loss: out.mse_loss(&y)?,
                    tokens: y.shape()[0],
                })
            })
            .unwrap();
        reports.push(r);
        check_params(model, f, &format!("{case}.step{k}"), TOL);
    }
    check_losses(case, &reports, f);
    reports
}

/// The plain full-batch forward of `model`.
fn full<'a>(
    f: &'a Fixture,
    model: &'a dyn Module,
) -> impl Fn(usize) -> Result<(Tensor, Tensor)> + 'a {
    move |_| Ok((model.forward(&f.x())?, f.y()))
}

// ---- 1. baseline -------------------------------------------------------------------------------

#[test]
fn baseline_matches_pytorch_and_frees_gradients() {
    let _l = lock();
    let f = Fixture::load();
    let model = f.mlp();
    // First-step gradients, outside the trainer (which frees them after the step).
    model
        .forward(&f.x())
        .unwrap()
        .mse_loss(&f.y())
        .unwrap()
        .backward()
        .unwrap();
    check_grads(&model, &f, "baseline");
    clear_grads(&model);

    let opt = sgd(model.parameters());
    train(
        &f,
        &model,
        opt,
        TrainerConfig::default(),
        "baseline",
        full(&f, &model),
    );
    // zero_grad(set_to_none=True): no gradient is left, not a byte.
    assert!(model.parameters().iter().all(|p| p.grad().is_none()));
    assert_eq!(gradient_bytes(), 0);
}

// ---- 2. zero_grad(set_to_none=False) -----------------------------------------------------------

#[test]
fn zero_grad_in_place_matches_pytorch_and_keeps_every_gradient_zeroed() {
    let _l = lock();
    let f = Fixture::load();
    let model = f.mlp();
    let config = TrainerConfig {
        set_to_none: false,
        ..Default::default()
    };
    let opt = sgd(model.parameters());
    train(&f, &model, opt, config, "zero_grad_false", full(&f, &model));
    // The update does not depend on how gradients were cleared.
    check_params(&model, &f, "baseline.step3", TOL);
    for (name, p) in model.named_parameters() {
        let g = p
            .grad()
            .unwrap_or_else(|| panic!("{name}: gradient was freed"));
        assert!(
            g.to_vec::<f64>().unwrap().iter().all(|v| *v == 0.0),
            "{name}"
        );
        assert_close(
            name.as_str(),
            &g,
            f.get(&format!("zero_grad_false.grad_end.{name}")),
            0.0,
        );
    }
    // One zeroed f64 gradient per parameter element, held between steps.
    assert_eq!(model.parameter_bytes() as u64, PARAM_COUNT * F64);
    assert_eq!(gradient_bytes(), PARAM_COUNT * F64);
}

// ---- 3. gradient accumulation ------------------------------------------------------------------

#[test]
fn accumulation_over_four_micro_batches_matches_pytorch_and_the_full_batch() {
    let _l = lock();
    let f = Fixture::load();
    let model = f.mlp();
    // The strategy function: the first step's accumulated gradients and mean loss.
    let mean = accumulate_gradients(4, |i| {
        let (x, y) = micro(&f, i, 4)?;
        model.forward(&x)?.mse_loss(&y)
    })
    .unwrap();
    check_grads(&model, &f, "accum4");
    let want = f.values("accum4.losses")[0];
    assert!((mean - want).abs() <= TOL, "mean loss {mean} vs {want}");
    clear_grads(&model);

    let config = TrainerConfig {
        accum: 4,
        ..Default::default()
    };
    let opt = sgd(model.parameters());
    let forward = |i| {
        let (x, y) = micro(&f, i, 4)?;
        Ok((model.forward(&x)?, y))
    };
    let reports = train(&f, &model, opt, config, "accum4", forward);
    assert!(reports.iter().all(|r| r.tokens == ROWS));
    // Equal micro-batches of a mean loss: the large batch's update, up to rounding.
    for k in 1..=STEPS {
        for name in NAMES {
            let (a, b) = (
                f.get(&format!("accum4.step{k}.{name}")),
                f.get(&format!("baseline.step{k}.{name}")),
            );
            assert_close(
                &format!("PyTorch accum vs full, step {k} {name}"),
                a,
                b,
                1e-12,
            );
        }
    }
    check_params(&model, &f, "baseline.step3", 1e-12);
}

// ---- 4. clipping -------------------------------------------------------------------------------

#[test]
fn clipping_matches_pytorch_norms_and_parameters() {
    let _l = lock();
    let f = Fixture::load();
    let max_norm = 0.05;
    let norms = f.values("clip.norms");
    let model = f.mlp();
    model
        .forward(&f.x())
        .unwrap()
        .mse_loss(&f.y())
        .unwrap()
        .backward()
        .unwrap();
    let norm = clip_grad_norm(&model.parameters(), max_norm, 2.0, false).unwrap();
    assert!(
        (norm - norms[0]).abs() <= TOL,
        "norm {norm} vs {}",
        norms[0]
    );
    check_grads(&model, &f, "clip");
    clear_grads(&model);

    let config = TrainerConfig {
        clip: Some(max_norm),
        ..Default::default()
    };
    let opt = sgd(model.parameters());
    let reports = train(&f, &model, opt, config, "clip", full(&f, &model));
    for (k, (r, want)) in reports.iter().zip(&norms).enumerate() {
        let got = r
            .grad_norm
            .as_ref()
            .expect("a clipping step reports the norm")
            .value()
            .unwrap();
        assert!(*want > max_norm, "step {}: the fixture must clip", k + 1);
        assert!(
            (got - want).abs() <= TOL,
            "step {}: norm {got} vs {want}",
            k + 1
        );
    }
}

// ---- 5. freezing -------------------------------------------------------------------------------

#[test]
fn freezing_the_first_layer_matches_pytorch_and_holds_only_trainable_gradients() {
    let _l = lock();
    let f = Fixture::load();
    let model = f.mlp();
    assert_eq!(freeze(&model, "0.*").unwrap(), ["0.weight", "0.bias"]);
    let trainable: Vec<Tensor> = model
        .parameters()
        .into_iter()
        .filter(Tensor::requires_grad)
        .collect();
    assert_eq!(trainable.len(), 2);
    let mut opt = sgd(trainable);
    let want_losses = f.values("freeze.losses");
    for k in 1..=STEPS {
        let (loss, saved) = saved_by(|| model.forward(&f.x()).unwrap().mse_loss(&f.y()).unwrap());
        // Nothing for the frozen layer (its input is the batch itself, and no gradient flows
        // into it): the hidden (8, 12) that 2.weight's gradient needs and the output (8, 4)
        // the loss keeps.
        assert_eq!(saved, (8 * 12 + 8 * 4) * F64, "step {k}");
        let l = loss.item().unwrap();
        assert!((l - want_losses[k - 1]).abs() <= TOL, "step {k}: loss {l}");
        loss.backward().unwrap();
        // Gradients exist for the second Linear only: (4, 12) + (4,) f64, to the byte.
        assert_eq!(gradient_bytes(), SECOND_COUNT * F64, "step {k}");
        if k == 1 {
            check_grads(&model, &f, "freeze");
        }
        opt.step().unwrap();
        opt.zero_grad().unwrap();
        assert_eq!(gradient_bytes(), 0);
        check_params(&model, &f, &format!("freeze.step{k}"), TOL);
    }
    // Frozen parameters are exactly where they started, in PyTorch and here.
    for (name, p) in model
        .named_parameters()
        .iter()
        .filter(|(n, _)| n.starts_with("0."))
    {
        let init = f.get(&format!("init.{name}"));
        assert_close(name, f.get(&format!("freeze.step3.{name}")), init, 0.0);
        assert_close(name, p, init, 0.0);
        assert!(!p.requires_grad() && p.grad().is_none(), "{name}");
    }
}

// ---- 6. recomputation --------------------------------------------------------------------------

/// The whole MLP as one recomputed segment (the model behind a Mutex: segments must be Sync).
fn segment(model: Sequential) -> (Segment, Vec<(String, Tensor)>) {
    let params = model.named_parameters();
    let model = Mutex::new(model);
    let seg: Segment = Arc::new(move |xs: &[Tensor]| {
        let m = model.lock().unwrap_or_else(|e| e.into_inner());
        m.forward(&xs[0])
    });
    (seg, params)
}

/// Parameters as a module, to compare them after the model moved into a segment.
struct Params(Vec<(String, Tensor)>);

impl Module for Params {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.clone())
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.0.clone()
    }
}

#[test]
fn recomputing_the_whole_model_matches_pytorch_checkpoint() {
    let _l = lock();
    let f = Fixture::load();
    let (seg, params) = segment(f.mlp());
    let params = Params(params);
    let x = f.x();
    let (loss, saved) = saved_by(|| {
        checkpoint_activations(seg.clone(), std::slice::from_ref(&x))
            .unwrap()
            .mse_loss(&f.y())
            .unwrap()
    });
    // Only the model's output (8, 4), kept by the loss: the hidden (8, 12) is not saved (the
    // segment keeps its input x, the batch itself). The plain graph saves both.
    assert_eq!(saved, 8 * 4 * F64);
    let (plain, plain_saved) = saved_by(|| {
        seg(std::slice::from_ref(&x))
            .unwrap()
            .mse_loss(&f.y())
            .unwrap()
    });
    assert_eq!(plain_saved, (8 * 12 + 8 * 4) * F64);
    drop(plain);
    loss.backward().unwrap();
    check_grads(&params, &f, "recompute");
    clear_grads(&params);

    let opt = sgd(params.parameters());
    let forward = |_| {
        Ok((
            checkpoint_activations(seg.clone(), std::slice::from_ref(&x))?,
            f.y(),
        ))
    };
    train(
        &f,
        &params,
        opt,
        TrainerConfig::default(),
        "recompute",
        forward,
    );
    check_params(&params, &f, "baseline.step3", TOL);
}

// ---- 7. evaluation under no_grad ---------------------------------------------------------------

/// The output of `forward` and the saved_activation bytes it added while it is held.
fn saved_by(forward: impl Fn() -> Tensor) -> (Tensor, u64) {
    let before = memory::memory_by_category(CPU).unwrap();
    let out = forward();
    let after = memory::memory_by_category(CPU).unwrap();
    let saved = after.get(Category::SavedActivation) - before.get(Category::SavedActivation);
    (out, saved)
}

#[test]
fn evaluation_under_no_grad_matches_pytorch_and_saves_nothing() {
    let _l = lock();
    let f = Fixture::load();
    let model = f.mlp();
    let x = f.x();
    let (out, saved) = saved_by(|| {
        let _g = no_grad();
        model.forward(&x).unwrap()
    });
    assert_close("eval.out", &out, f.get("eval.out"), TOL);
    assert!(!out.requires_grad());
    assert_eq!(saved, 0);
    drop(out);
    // The same forward with grad on saves activations for backward: the check above can fail.
    let (out, saved) = saved_by(|| model.forward(&x).unwrap());
    assert_close("eval.out with grad", &out, f.get("eval.out"), TOL);
    assert!(saved > 0);
}

// ---- 8. step in backward -----------------------------------------------------------------------

#[test]
fn step_in_backward_matches_pytorch_hooks() {
    let _l = lock();
    let f = Fixture::load();
    let model = f.mlp();
    let config = TrainerConfig {
        step_in_backward: true,
        ..Default::default()
    };
    let opt = sgd(model.parameters());
    train(
        &f,
        &model,
        opt,
        config,
        "step_in_backward",
        full(&f, &model),
    );
    // Each gradient was freed by its hook, as PyTorch's hook does with zero_grad().
    assert!(model.parameters().iter().all(|p| p.grad().is_none()));
    assert_eq!(gradient_bytes(), 0);
    check_params(&model, &f, "baseline.step3", TOL);
}

#[test]
fn fused_step_in_backward_matches_pytorch_hooks() {
    let _l = lock();
    let f = Fixture::load();
    let model = f.mlp();
    let installed = StepInBackward::install_fused(sgd(model.parameters())).unwrap();
    for k in 1..=STEPS {
        model
            .forward(&f.x())
            .unwrap()
            .mse_loss(&f.y())
            .unwrap()
            .backward()
            .unwrap();
        assert_eq!(gradient_bytes(), 0, "step {k}");
        check_params(&model, &f, &format!("step_in_backward.step{k}"), TOL);
    }
    drop(installed);
}
