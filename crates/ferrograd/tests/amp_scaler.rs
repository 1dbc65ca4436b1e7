//! GradScaler against torch.amp.GradScaler: a small SGD model over 14 iterations with inf/NaN
//! gradients at chosen ones (fixtures from tools/make_scaler_fixtures.py: the scale, tracker
//! and skip of every iteration and the parameters after it); unscale_ before clipping;
//! growth and backoff rules; the fused unscale-and-check op on every float dtype; errors
//! (unscale or step twice, f16 gradients, bad configurations, bad saved state).

use ferrograd::backend::Storage;
use ferrograd::backend::optim::{UnscaleCheck, unscale_check};
use ferrograd::optim::{Optimizer, Sgd, SgdConfig, clip_grad_norm};
use ferrograd::train::{GradScaler, GradScalerConfig};
use ferrograd::{DType, Device, Error, Tensor};

const CPU: Device = Device::Cpu;
const PARAMS: [&str; 4] = ["W1", "b1", "W2", "b2"];

// ---- fixtures -----------------------------------------------------------------------------------

#[path = "common/fixture_file.rs"]
mod fixture_file;
use fixture_file::FixtureFile;

fn fixtures() -> &'static FixtureFile {
    fixture_file::open(
        "scaler.safetensors",
        "ferrograd-scaler-fixtures",
        "make_scaler_fixtures.py",
    )
}

fn stored(f: &FixtureFile, key: &str, dtype: DType) -> Tensor {
    let t = f.get(key);
    assert_eq!(t.dtype(), dtype, "{key}");
    t
}

fn f32s(f: &FixtureFile, key: &str) -> (Vec<f32>, Vec<usize>) {
    let t = stored(f, key, DType::F32);
    (t.to_vec::<f32>().unwrap(), t.shape().to_vec())
}

fn i64s(f: &FixtureFile, key: &str) -> Vec<i64> {
    stored(f, key, DType::I64).to_vec::<i64>().unwrap()
}

fn tensor(f: &FixtureFile, key: &str) -> Tensor {
    stored(f, key, DType::F32)
}

/// The case's configuration from the fixture's metadata.
fn case_config(f: &FixtureFile, name: &str) -> serde_json::Value {
    serde_json::from_str(f.meta(name)).expect("case metadata")
}

/// Replays one fixture case: same data, same events, same calls as the generator.
fn check_case(name: &str) {
    let st = fixtures();
    let cfg = case_config(st, name);
    let num = |k: &str| cfg[k].as_f64().unwrap();
    let mut scaler = GradScaler::with_config(GradScalerConfig {
        init_scale: num("init_scale"),
        growth_factor: num("growth_factor"),
        backoff_factor: num("backoff_factor"),
        growth_interval: cfg["growth_interval"].as_u64().unwrap(),
    })
    .unwrap();
    let clip = cfg["clip"].as_f64();
    let target_scale = cfg["target_scale"].as_f64().unwrap_or(1.0);
    let params: Vec<Tensor> = PARAMS
        .iter()
        .map(|p| {
            tensor(st, &format!("init.{p}"))
                .requires_grad_(true)
                .unwrap()
        })
        .collect();
    let sgd = SgdConfig {
        lr: num("lr"),
        momentum: num("momentum"),
        ..SgdConfig::default()
    };
    let mut opt = Sgd::new(params.clone(), sgd).unwrap();
    let events = i64s(st, "events");
    let (want_scale, _) = f32s(st, &format!("{name}.scale"));
    let want_tracker = i64s(st, &format!("{name}.tracker"));
    let want_skipped = i64s(st, &format!("{name}.skipped"));
    for (i, &event) in events.iter().enumerate() {
        let k = i + 1;
        let (mut x, xs) = f32s(st, &format!("data.x{k}"));
        if event == 1 {
            x[0] = f32::INFINITY;
        }
        let x = Tensor::from_vec(x, &xs, CPU).unwrap();
        let target = tensor(st, &format!("data.t{k}"))
            .mul_scalar(target_scale)
            .unwrap();
        opt.zero_grad().unwrap();
        let h = x
            .linear(&params[0], Some(&params[1]))
            .unwrap()
            .tanh()
            .unwrap();
        let y = h.linear(&params[2], Some(&params[3])).unwrap();
        let mut loss = y.mse_loss(&target).unwrap();
        if event == 3 {
            loss = loss.mul_scalar(f64::INFINITY).unwrap();
        }
        scaler.scale(&loss).unwrap().backward().unwrap();
        if event == 2 {
            let g = params[2].grad().unwrap();
            let mut v = g.to_vec::<f32>().unwrap();
            v[5 + 2] = f32::NAN; // W2[1, 2] of a (2, 5) gradient
            params[2]
                .set_grad(Some(Tensor::from_vec(v, g.shape(), CPU).unwrap()))
                .unwrap();
        }
        if let Some(max_norm) = clip {
            scaler.unscale_(&opt).unwrap();
            clip_grad_norm(opt.params(), max_norm, 2.0, false).unwrap();
        }
        let stepped = scaler.step(&mut opt).unwrap();
        scaler.update().unwrap();
        assert_eq!(
            stepped,
            want_skipped[i] == 0,
            "{name} iteration {k}: stepped"
        );
        assert_eq!(
            scaler.get_scale().unwrap(),
            want_scale[i] as f64,
            "{name} iteration {k}: scale"
        );
        assert_eq!(
            scaler.growth_tracker().unwrap() as i64,
            want_tracker[i],
            "{name} iteration {k}: growth tracker"
        );
        for (p, pname) in params.iter().zip(PARAMS) {
            let want = f32s(st, &format!("{name}.step{k}.{pname}")).0;
            let got = p.to_vec::<f32>().unwrap();
            let diff = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                diff <= 1e-6,
                "{name} iteration {k}: {pname} max diff {diff}"
            );
        }
    }
}

#[test]
fn matches_pytorch_default_factors() {
    check_case("defaults_g3");
}

#[test]
fn matches_pytorch_odd_factors_in_f32_arithmetic() {
    check_case("odd_factors");
}

#[test]
fn matches_pytorch_unscale_then_clip() {
    check_case("unscale_clip");
}

#[test]
fn matches_pytorch_no_growth_past_f32_max() {
    check_case("near_max");
}

#[test]
fn matches_pytorch_natural_overflow() {
    check_case("overflow");
}

// ---- helpers ------------------------------------------------------------------------------------

fn param(values: Vec<f32>) -> Tensor {
    let n = values.len();
    Tensor::from_vec(values, &[n], CPU)
        .unwrap()
        .requires_grad_(true)
        .unwrap()
}

fn set_grad(p: &Tensor, values: Vec<f32>) {
    let n = values.len();
    p.set_grad(Some(Tensor::from_vec(values, &[n], CPU).unwrap()))
        .unwrap();
}

fn grad(p: &Tensor) -> Vec<f32> {
    p.grad().unwrap().to_vec::<f32>().unwrap()
}

fn sgd(params: Vec<Tensor>) -> Sgd {
    Sgd::new(
        params,
        SgdConfig {
            lr: 0.5,
            ..SgdConfig::default()
        },
    )
    .unwrap()
}

fn scaler(init_scale: f64, growth_interval: u64) -> GradScaler {
    GradScaler::with_config(GradScalerConfig {
        init_scale,
        growth_interval,
        ..GradScalerConfig::default()
    })
    .unwrap()
}

fn invalid_message(e: Error) -> String {
    match e {
        Error::InvalidArgument { detail, .. } => detail,
        other => panic!("expected an invalid-argument error, got {other:?}"),
    }
}

// ---- unscale and clip ---------------------------------------------------------------------------

#[test]
fn unscale_then_clip_equals_clipping_the_true_gradients() {
    let true_grads = [vec![3.0f32, -4.0, 0.5, 2.25], vec![-1.5f32, 6.0, 0.125]];
    // 1000.3 is not a power of two: unscaling rounds, so compare closely, not exactly.
    for init_scale in [1024.0, 1000.3] {
        let scaled: Vec<Tensor> = true_grads
            .iter()
            .map(|g| param(vec![0.0; g.len()]))
            .collect();
        let plain: Vec<Tensor> = true_grads
            .iter()
            .map(|g| param(vec![0.0; g.len()]))
            .collect();
        let mut s = scaler(init_scale, 2000);
        let scale = s.get_scale().unwrap() as f32;
        for ((a, b), g) in scaled.iter().zip(&plain).zip(&true_grads) {
            set_grad(a, g.iter().map(|v| v * scale).collect());
            set_grad(b, g.clone());
        }
        let opt = sgd(scaled.clone());
        s.unscale_(&opt).unwrap();
        let n1 = clip_grad_norm(&scaled, 1.0, 2.0, false).unwrap();
        let n2 = clip_grad_norm(&plain, 1.0, 2.0, false).unwrap();
        assert!((n1 - n2).abs() <= 1e-6 * n2, "norms {n1} vs {n2}");
        for (a, b) in scaled.iter().zip(&plain) {
            for (x, y) in grad(a).iter().zip(grad(b)) {
                if init_scale == 1024.0 {
                    assert_eq!(*x, y, "power-of-two scale unscales exactly");
                } else {
                    assert!((x - y).abs() <= 1e-6, "{x} vs {y}");
                }
            }
        }
    }
}

#[test]
fn unscale_multiplies_by_the_f32_reciprocal_and_skips_missing_grads() {
    let (p, q) = (param(vec![0.0; 3]), param(vec![0.0; 2]));
    set_grad(&p, vec![3.0, -7.5, 1e-3]);
    let mut s = scaler(3.0, 2000);
    let opt = sgd(vec![p.clone(), q.clone()]);
    s.unscale_(&opt).unwrap();
    let inv = (1.0f64 / 3.0) as f32;
    assert_eq!(grad(&p), vec![3.0 * inv, -7.5 * inv, 1e-3 * inv]);
    assert!(q.grad().is_none());
}

#[test]
fn unscale_replaces_a_gradient_view_with_an_owned_copy() {
    let p = param(vec![0.0; 3]);
    let base = Tensor::from_vec(vec![8.0f32, 2.0, 4.0, 6.0], &[4], CPU).unwrap();
    p.set_grad(Some(base.narrow(0, 1, 3).unwrap())).unwrap();
    let mut s = scaler(2.0, 2000);
    s.unscale_(&sgd(vec![p.clone()])).unwrap();
    assert_eq!(grad(&p), vec![1.0, 2.0, 3.0]);
    assert_eq!(base.to_vec::<f32>().unwrap(), vec![8.0, 2.0, 4.0, 6.0]);
}

// ---- step, update, growth and backoff -----------------------------------------------------------

#[test]
fn default_scale_is_65536() {
    assert_eq!(GradScaler::new().get_scale().unwrap(), 65536.0);
    assert_eq!(GradScaler::new().growth_tracker().unwrap(), 0);
    let d = GradScalerConfig::default();
    assert_eq!(
        (
            d.init_scale,
            d.growth_factor,
            d.backoff_factor,
            d.growth_interval
        ),
        (65536.0, 2.0, 0.5, 2000)
    );
}

/// One iteration with the given gradient: (stepped, scale, tracker).
fn iterate(s: &mut GradScaler, p: &Tensor, opt: &mut Sgd, g: f32) -> (bool, f64, u64) {
    set_grad(p, vec![g * s.get_scale().unwrap() as f32]);
    let stepped = s.step(opt).unwrap();
    s.update().unwrap();
    (stepped, s.get_scale().unwrap(), s.growth_tracker().unwrap())
}

#[test]
fn grows_after_exactly_growth_interval_clean_steps() {
    let p = param(vec![1.0]);
    let mut opt = sgd(vec![p.clone()]);
    let mut s = scaler(8.0, 3);
    assert_eq!(iterate(&mut s, &p, &mut opt, 1.0), (true, 8.0, 1));
    assert_eq!(iterate(&mut s, &p, &mut opt, 1.0), (true, 8.0, 2));
    assert_eq!(iterate(&mut s, &p, &mut opt, 1.0), (true, 16.0, 0));
    assert_eq!(iterate(&mut s, &p, &mut opt, 1.0), (true, 16.0, 1));
    // Three steps of lr 0.5 · grad 1 (the fourth too): the unscaled gradient was applied.
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![-1.0]);
}

#[test]
fn backoff_on_overflow_skips_the_step_and_resets_the_tracker() {
    let p = param(vec![1.0]);
    let mut opt = sgd(vec![p.clone()]);
    let mut s = scaler(8.0, 3);
    iterate(&mut s, &p, &mut opt, 1.0);
    iterate(&mut s, &p, &mut opt, 1.0);
    assert_eq!(s.growth_tracker().unwrap(), 2);
    assert_eq!(
        iterate(&mut s, &p, &mut opt, f32::INFINITY),
        (false, 4.0, 0)
    );
    assert_eq!(iterate(&mut s, &p, &mut opt, f32::NAN), (false, 2.0, 0));
    assert_eq!(
        p.to_vec::<f32>().unwrap(),
        vec![0.0],
        "skipped steps leave p"
    );
    // The tracker starts again from zero: growth needs three more clean steps.
    assert_eq!(iterate(&mut s, &p, &mut opt, 1.0), (true, 2.0, 1));
    assert_eq!(iterate(&mut s, &p, &mut opt, 1.0), (true, 2.0, 2));
    assert_eq!(iterate(&mut s, &p, &mut opt, 1.0), (true, 4.0, 0));
}

#[test]
fn growth_interval_one_grows_every_clean_step() {
    let p = param(vec![1.0]);
    let mut opt = sgd(vec![p.clone()]);
    let mut s = scaler(1.0, 1);
    assert_eq!(iterate(&mut s, &p, &mut opt, 0.5), (true, 2.0, 0));
    assert_eq!(iterate(&mut s, &p, &mut opt, 0.5), (true, 4.0, 0));
}

#[test]
fn an_overflow_in_one_optimizer_backs_off_but_skips_only_its_step() {
    let (a, b) = (param(vec![1.0]), param(vec![1.0]));
    let (mut oa, mut ob) = (sgd(vec![a.clone()]), sgd(vec![b.clone()]));
    let mut s = scaler(4.0, 2000);
    set_grad(&a, vec![4.0]);
    set_grad(&b, vec![f32::INFINITY]);
    assert!(s.step(&mut oa).unwrap());
    assert!(!s.step(&mut ob).unwrap());
    s.update().unwrap();
    assert_eq!(s.get_scale().unwrap(), 2.0);
    assert_eq!(a.to_vec::<f32>().unwrap(), vec![0.5]);
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![1.0]);
}

#[test]
fn scale_multiplies_the_loss_and_its_gradients() {
    let s = scaler(1024.0, 2000);
    let w = param(vec![2.0, -3.0]);
    let x = Tensor::from_vec(vec![0.5f32, 0.25], &[2], CPU).unwrap();
    let loss = w.mul(&x).unwrap().sum_all().unwrap();
    let scaled = s.scale(&loss).unwrap();
    assert_eq!(scaled.item().unwrap(), (1.0 - 0.75) * 1024.0);
    scaled.backward().unwrap();
    assert_eq!(grad(&w), vec![512.0, 256.0]);
    // A 0-dim half loss is widened to f32 (as PyTorch's promotion with its f32 scale).
    let half = Tensor::scalar(100.0, DType::F16, CPU).unwrap();
    let big = GradScaler::new().scale(&half).unwrap();
    assert_eq!(big.dtype(), DType::F32);
    assert_eq!(big.item().unwrap(), 6_553_600.0);
}

#[test]
fn unscale_is_allowed_before_update_without_step() {
    let p = param(vec![1.0]);
    let opt = sgd(vec![p.clone()]);
    let mut s = scaler(4.0, 2000);
    set_grad(&p, vec![f32::NAN]);
    s.unscale_(&opt).unwrap();
    s.update().unwrap();
    assert_eq!(s.get_scale().unwrap(), 2.0);
}

// ---- the fused op on every float dtype ----------------------------------------------------------

fn run_fused(grads: &[Tensor], inv_scale: f32) -> f32 {
    let flag = Tensor::zeros(&[1], DType::F32, CPU).unwrap();
    let outs: Vec<&Storage> = grads.iter().map(|g| g.storage().as_ref()).collect();
    unscale_check(&UnscaleCheck {
        found_inf: flag.storage(),
        grads: &outs,
        inv_scale,
        inv_scale_at: None,
    })
    .unwrap();
    flag.to_vec::<f32>().unwrap()[0]
}

#[test]
fn fused_unscale_check_on_every_float_dtype() {
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let g = Tensor::from_vec_as(vec![4.0f64, -8.0, 2.0], &[3], dtype, CPU).unwrap();
        assert_eq!(run_fused(std::slice::from_ref(&g), 0.25), 0.0, "{dtype}");
        assert_eq!(g.to_vec::<f64>().unwrap(), vec![1.0, -2.0, 0.5], "{dtype}");
        let bad = Tensor::from_vec_as(vec![1.0f64, f64::NAN], &[2], dtype, CPU).unwrap();
        assert_eq!(run_fused(&[g.clone(), bad.clone()], 2.0), 1.0, "{dtype}");
        // Everything is unscaled even after the NaN.
        assert_eq!(g.to_vec::<f64>().unwrap(), vec![2.0, -4.0, 1.0], "{dtype}");
        assert_eq!(bad.to_vec::<f64>().unwrap()[0], 2.0, "{dtype}");
    }
    // f64 gradients multiply by the f32 inverse widened, not by the exact f64 inverse.
    let g = Tensor::from_vec(vec![1.0f64], &[1], CPU).unwrap();
    run_fused(std::slice::from_ref(&g), (1.0f64 / 3.0) as f32);
    assert_eq!(g.to_vec::<f64>().unwrap()[0], (1.0f64 / 3.0) as f32 as f64);
}

#[test]
fn fused_unscale_checks_the_scaled_value() {
    // 1e38 · 10 overflows after the multiply; PyTorch checks before it: no flag.
    let g = Tensor::from_vec(vec![1e38f32, 1.0], &[2], CPU).unwrap();
    assert_eq!(run_fused(std::slice::from_ref(&g), 10.0), 0.0);
    assert_eq!(g.to_vec::<f32>().unwrap(), vec![f32::INFINITY, 10.0]);
}

#[test]
fn bf16_and_f64_gradients_are_unscaled_by_the_scaler() {
    let p = Tensor::zeros(&[2], DType::BF16, CPU)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let q = Tensor::zeros(&[1], DType::F64, CPU)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    p.set_grad(Some(
        Tensor::from_vec_as(vec![64.0f64, -32.0], &[2], DType::BF16, CPU).unwrap(),
    ))
    .unwrap();
    q.set_grad(Some(Tensor::from_vec(vec![48.0f64], &[1], CPU).unwrap()))
        .unwrap();
    let mut s = scaler(16.0, 2000);
    assert!(s.step(&mut sgd(vec![p.clone(), q.clone()])).unwrap());
    assert_eq!(p.grad().unwrap().to_vec::<f64>().unwrap(), vec![4.0, -2.0]);
    assert_eq!(q.grad().unwrap().to_vec::<f64>().unwrap(), vec![3.0]);
}

// ---- errors -------------------------------------------------------------------------------------

#[test]
fn unscale_twice_is_an_error() {
    let p = param(vec![1.0]);
    set_grad(&p, vec![2.0]);
    let mut opt = sgd(vec![p.clone()]);
    let mut s = scaler(2.0, 2000);
    s.unscale_(&opt).unwrap();
    let msg = invalid_message(s.unscale_(&opt).unwrap_err());
    assert!(msg.contains("already been called"), "{msg}");
    assert_eq!(
        grad(&p),
        vec![1.0],
        "the second call must not unscale again"
    );
    // step after an explicit unscale_ does not unscale again either.
    assert!(s.step(&mut opt).unwrap());
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![0.5]);
    let msg = invalid_message(s.unscale_(&opt).unwrap_err());
    assert!(msg.contains("after step()"), "{msg}");
    // After update() a new iteration may unscale again.
    s.update().unwrap();
    s.unscale_(&opt).unwrap();
}

#[test]
fn step_twice_is_an_error() {
    let p = param(vec![1.0]);
    set_grad(&p, vec![2.0]);
    let mut opt = sgd(vec![p.clone()]);
    let mut s = scaler(2.0, 2000);
    s.step(&mut opt).unwrap();
    let msg = invalid_message(s.step(&mut opt).unwrap_err());
    assert!(msg.contains("already been called"), "{msg}");
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![0.5], "stepped once");
}

#[test]
fn update_without_inf_checks_is_an_error() {
    let mut s = GradScaler::new();
    let msg = invalid_message(s.update().unwrap_err());
    assert!(msg.contains("no inf checks"), "{msg}");
    // An optimizer without any gradient records no check: step fails, as in PyTorch.
    let mut opt = sgd(vec![param(vec![1.0])]);
    let msg = invalid_message(s.step(&mut opt).unwrap_err());
    assert!(msg.contains("no inf checks"), "{msg}");
}

#[test]
fn f16_gradients_are_an_error_and_nothing_is_unscaled() {
    let p = param(vec![1.0]);
    set_grad(&p, vec![8.0]);
    let h = Tensor::zeros(&[2], DType::F16, CPU)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    h.set_grad(Some(Tensor::ones(&[2], DType::F16, CPU).unwrap()))
        .unwrap();
    let mut opt = sgd(vec![p.clone(), h.clone()]);
    let mut s = scaler(2.0, 2000);
    let msg = invalid_message(s.step(&mut opt).unwrap_err());
    assert!(msg.contains("FP16") && msg.contains("f32"), "{msg}");
    assert_eq!(grad(&p), vec![8.0], "checked before anything is unscaled");
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![1.0]);
}

#[test]
fn bad_configurations_are_errors() {
    let base = GradScalerConfig::default();
    let bad = [
        GradScalerConfig {
            init_scale: 0.0,
            ..base.clone()
        },
        GradScalerConfig {
            init_scale: -1.0,
            ..base.clone()
        },
        GradScalerConfig {
            init_scale: f64::NAN,
            ..base.clone()
        },
        GradScalerConfig {
            init_scale: 1e39, // inf as an f32
            ..base.clone()
        },
        GradScalerConfig {
            growth_factor: 1.0,
            ..base.clone()
        },
        GradScalerConfig {
            growth_factor: f64::INFINITY,
            ..base.clone()
        },
        GradScalerConfig {
            backoff_factor: 1.0,
            ..base.clone()
        },
        GradScalerConfig {
            backoff_factor: 0.0,
            ..base.clone()
        },
        GradScalerConfig {
            backoff_factor: f64::NAN,
            ..base.clone()
        },
        GradScalerConfig {
            growth_interval: 0,
            ..base.clone()
        },
    ];
    for cfg in bad {
        assert!(
            GradScaler::with_config(cfg.clone()).is_err(),
            "{cfg:?} accepted"
        );
    }
    assert!(GradScaler::with_config(base).is_ok());
}

// ---- saved state --------------------------------------------------------------------------------

#[test]
fn state_tensors_round_trip() {
    let p = param(vec![1.0]);
    let mut opt = sgd(vec![p.clone()]);
    let mut s = scaler(1000.3, 5);
    iterate(&mut s, &p, &mut opt, 1.0);
    iterate(&mut s, &p, &mut opt, 1.0);
    iterate(&mut s, &p, &mut opt, f32::INFINITY);
    iterate(&mut s, &p, &mut opt, 1.0);
    let state = s.state_tensors().unwrap();
    let names: Vec<&str> = state.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, vec!["scaler.scale", "scaler.growth_tracker"]);
    assert_eq!(state[0].1.dtype(), DType::F32);
    assert_eq!(state[1].1.dtype(), DType::I64);
    assert!(state[0].1.shape().is_empty() && state[1].1.shape().is_empty());
    let mut fresh = scaler(1.0, 5);
    fresh.load_state_tensors(&state).unwrap();
    assert_eq!(fresh.get_scale().unwrap(), s.get_scale().unwrap());
    assert_eq!(
        fresh.get_scale().unwrap(),
        (1000.3f32 as f64 * 0.5) as f32 as f64
    );
    assert_eq!(fresh.growth_tracker().unwrap(), 1);
}

#[test]
fn loading_bad_state_is_an_error_and_changes_nothing() {
    let good = scaler(512.0, 10);
    let state = good.state_tensors().unwrap();
    let scale_t = state[0].clone();
    let tracker_t = state[1].clone();
    let named = |n: &str, t: Tensor| (n.to_string(), t);
    let cases: Vec<(Vec<(String, Tensor)>, &str)> = vec![
        (vec![tracker_t.clone()], "no 'scaler.scale'"),
        (vec![scale_t.clone()], "no 'scaler.growth_tracker'"),
        (
            vec![
                named(
                    "scaler.scale",
                    Tensor::scalar(4.0, DType::F64, CPU).unwrap(),
                ),
                tracker_t.clone(),
            ],
            "0-dim f32",
        ),
        (
            vec![
                named(
                    "scaler.scale",
                    Tensor::from_vec(vec![4.0f32], &[1], CPU).unwrap(),
                ),
                tracker_t.clone(),
            ],
            "0-dim f32",
        ),
        (
            vec![
                scale_t.clone(),
                named(
                    "scaler.growth_tracker",
                    Tensor::scalar(1.0, DType::F32, CPU).unwrap(),
                ),
            ],
            "0-dim i64",
        ),
        (
            vec![
                named(
                    "scaler.scale",
                    Tensor::scalar(f64::INFINITY, DType::F32, CPU).unwrap(),
                ),
                tracker_t.clone(),
            ],
            "positive and finite",
        ),
        (
            vec![
                scale_t.clone(),
                named(
                    "scaler.growth_tracker",
                    Tensor::from_vec(vec![7i64], &[], CPU).unwrap(),
                ),
            ],
            "0..5",
        ),
        (
            vec![scale_t.clone(), scale_t.clone(), tracker_t.clone()],
            "more than once",
        ),
    ];
    for (tensors, want) in cases {
        let mut s = scaler(2.0, 5);
        let msg = invalid_message(s.load_state_tensors(&tensors).unwrap_err());
        assert!(msg.contains(want), "expected '{want}' in: {msg}");
        assert_eq!(
            (s.get_scale().unwrap(), s.growth_tracker().unwrap()),
            (2.0, 0)
        );
    }
    // Other names in a whole checkpoint are ignored.
    let mut s = scaler(2.0, 5);
    let mut all = vec![named(
        "model.w",
        Tensor::zeros(&[3], DType::F32, CPU).unwrap(),
    )];
    all.extend(state);
    s.load_state_tensors(&all).unwrap();
    assert_eq!(s.get_scale().unwrap(), 512.0);
}
