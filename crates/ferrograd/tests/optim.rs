//! Optimizers against PyTorch: parameters (and Adam's moments) after each step, the
//! warmup-cosine schedule driving Adam, and gradient clipping by norm and by value, from
//! fixtures written by tools/make_optim_fixtures.py; plus zero_grad semantics, optimizer state
//! bookkeeping and argument errors.

use ferrograd::optim::{
    Adam, AdamConfig, AdamState, Optimizer, Sgd, SgdConfig, WarmupCosine, clip_coefficient_queued,
    clip_grad_norm, clip_grad_norm_queued, clip_grad_value,
};
use ferrograd::{Category, DType, Device, Tensor};
use safetensors::SafeTensors;

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/fixtures/optim.safetensors"
);

fn load(st: &SafeTensors, key: &str) -> Tensor {
    let v = st
        .tensor(key)
        .unwrap_or_else(|_| panic!("missing {key}: regenerate with tools/make_optim_fixtures.py"));
    let data: Vec<f32> = v
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Tensor::from_vec(data, v.shape(), Device::Cpu).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    let (x, y) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    x.iter()
        .zip(&y)
        .map(|(p, q)| (p - q).abs())
        .fold(0.0, f32::max)
}

fn check_sgd(name: &str, cfg: SgdConfig) {
    let bytes = std::fs::read(FIXTURES).expect("optim fixtures");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let p = load(&st, &format!("{name}.p0"))
        .requires_grad_(true)
        .unwrap();
    let mut opt = Sgd::new(vec![p.clone()], cfg).unwrap();
    for k in 1..=3 {
        p.set_grad(Some(load(&st, &format!("{name}.g{k}"))))
            .unwrap();
        opt.step().unwrap();
        let want = load(&st, &format!("{name}.p{k}"));
        let d = max_diff(&p, &want);
        assert!(d < 1e-6, "{name} step {k}: max diff {d}");
    }
}

fn sgd(lr: f64, momentum: f64, dampening: f64, weight_decay: f64, nesterov: bool) -> SgdConfig {
    SgdConfig {
        lr,
        momentum,
        dampening,
        weight_decay,
        nesterov,
    }
}

#[test]
fn sgd_plain_matches_pytorch() {
    check_sgd("sgd_plain", sgd(0.1, 0.0, 0.0, 0.0, false));
}

#[test]
fn sgd_momentum_matches_pytorch() {
    check_sgd("sgd_momentum", sgd(0.1, 0.9, 0.0, 0.0, false));
}

#[test]
fn sgd_nesterov_matches_pytorch() {
    check_sgd("sgd_nesterov", sgd(0.1, 0.9, 0.0, 0.0, true));
}

#[test]
fn sgd_dampening_and_weight_decay_match_pytorch() {
    check_sgd("sgd_damp_wd", sgd(0.1, 0.9, 0.1, 0.01, false));
}

#[test]
fn nesterov_without_momentum_is_an_error() {
    let p = Tensor::zeros(&[2], ferrograd::DType::F32, Device::Cpu)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    assert!(Sgd::new(vec![p], sgd(0.1, 0.0, 0.0, 0.0, true)).is_err());
}

#[test]
fn zero_grad_sets_to_none_by_default_and_can_zero_in_place() {
    let p = Tensor::ones(&[3], ferrograd::DType::F32, Device::Cpu)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let mut opt = Sgd::new(vec![p.clone()], SgdConfig::default()).unwrap();
    p.mul_scalar(2.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g = p.grad().unwrap();
    opt.zero_grad_with(false).unwrap();
    let kept = p.grad().unwrap();
    assert!(
        kept.shares_storage(&g),
        "zeroing in place keeps the same buffer"
    );
    assert_eq!(kept.to_vec::<f32>().unwrap(), vec![0.0; 3]);
    opt.zero_grad().unwrap();
    assert!(p.grad().is_none());
}

// ---- Adam / AdamW ------------------------------------------------------------------------------

/// Adam's fixture parameters: (3, 4) and (5,).
const ADAM_PARAMS: usize = 2;
/// f32 against PyTorch's f32: the same formula, but PyTorch's CPU kernels may fuse
/// multiply-adds (lerp, addcmul) and we do not.
const ADAM_TOL: f32 = 1e-6;

fn fixtures() -> Vec<u8> {
    std::fs::read(FIXTURES).expect("optim fixtures")
}

fn adam_cfg(lr: f64, betas: (f64, f64), eps: f64, weight_decay: f64) -> AdamConfig {
    AdamConfig {
        lr,
        betas,
        eps,
        weight_decay,
    }
}

/// Runs `steps` steps of the fixture case `name` (two parameters, the learning rate of step k
/// from `lr_of(k)` when given) and compares parameters after every step and the moments after
/// the last one.
fn check_adam(
    name: &str,
    make: fn(Vec<Tensor>, AdamConfig) -> ferrograd::Result<Adam>,
    cfg: AdamConfig,
    steps: usize,
    lr_of: Option<&dyn Fn(u64) -> f64>,
) {
    let bytes = fixtures();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let params: Vec<Tensor> = (0..ADAM_PARAMS)
        .map(|j| {
            load(&st, &format!("{name}.{j}.p0"))
                .requires_grad_(true)
                .unwrap()
        })
        .collect();
    let mut opt = make(params.clone(), cfg).unwrap();
    for k in 1..=steps {
        if let Some(f) = lr_of {
            opt.set_lr(f(k as u64 - 1)).unwrap();
        }
        for (j, p) in params.iter().enumerate() {
            p.set_grad(Some(load(&st, &format!("{name}.{j}.g{k}"))))
                .unwrap();
        }
        opt.step().unwrap();
        for (j, p) in params.iter().enumerate() {
            let d = max_diff(p, &load(&st, &format!("{name}.{j}.p{k}")));
            assert!(d < ADAM_TOL, "{name} param {j} step {k}: max diff {d}");
        }
    }
    assert_eq!(opt.step_count(), steps as u64);
    for j in 0..ADAM_PARAMS {
        let s = opt.state(j).expect("state after a step");
        assert_eq!(s.step, steps as u64);
        for (key, t) in [("exp_avg", &s.exp_avg), ("exp_avg_sq", &s.exp_avg_sq)] {
            let d = max_diff(t, &load(&st, &format!("{name}.{j}.{key}")));
            assert!(d < ADAM_TOL, "{name} param {j} {key}: max diff {d}");
        }
    }
}

#[test]
fn adam_matches_pytorch() {
    check_adam(
        "adam",
        Adam::new,
        adam_cfg(0.01, (0.9, 0.999), 1e-8, 0.0),
        3,
        None,
    );
}

#[test]
fn adam_betas_and_eps_match_pytorch() {
    check_adam(
        "adam_betas_eps",
        Adam::new,
        adam_cfg(0.05, (0.8, 0.99), 1e-6, 0.0),
        3,
        None,
    );
}

#[test]
fn adam_l2_weight_decay_matches_pytorch() {
    check_adam(
        "adam_l2",
        Adam::new,
        adam_cfg(0.01, (0.9, 0.999), 1e-8, 0.1),
        3,
        None,
    );
}

#[test]
fn adamw_matches_pytorch() {
    check_adam(
        "adamw",
        Adam::adamw,
        adam_cfg(0.01, (0.9, 0.999), 1e-8, 0.1),
        3,
        None,
    );
}

#[test]
fn adamw_with_a_large_lerp_weight_matches_pytorch() {
    check_adam(
        "adamw_low_beta1",
        Adam::adamw,
        adam_cfg(0.02, (0.3, 0.9), 1e-8, 0.05),
        3,
        None,
    );
}

#[test]
fn warmup_cosine_schedule_drives_adam_as_in_pytorch() {
    let sched = WarmupCosine::new(0.02, 0.002, 2, 5).unwrap();
    let bytes = fixtures();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let want = load(&st, "adam_sched.lrs").to_vec::<f32>().unwrap();
    assert_eq!(want.len(), 7);
    for (k, w) in want.iter().enumerate() {
        let got = sched.lr_at(k as u64);
        assert!(
            (got as f32 - w).abs() <= 1e-6 * w,
            "lr at step {k}: {got} vs {w}"
        );
    }
    let lr_of = |k: u64| sched.lr_at(k);
    check_adam(
        "adam_sched",
        Adam::new,
        adam_cfg(0.02, (0.9, 0.999), 1e-8, 0.0),
        7,
        Some(&lr_of),
    );
}

fn param(values: Vec<f32>) -> Tensor {
    let n = values.len();
    Tensor::from_vec(values, &[n], Device::Cpu)
        .unwrap()
        .requires_grad_(true)
        .unwrap()
}

fn grad_of(values: Vec<f32>) -> Option<Tensor> {
    let n = values.len();
    Some(Tensor::from_vec(values, &[n], Device::Cpu).unwrap())
}

#[test]
fn adam_state_is_created_at_the_first_step_as_optimizer_state() {
    let (a, b) = (param(vec![1.0, 2.0]), param(vec![3.0]));
    let mut opt = Adam::new(vec![a.clone(), b.clone()], AdamConfig::default()).unwrap();
    assert!(opt.state(0).is_none() && opt.state_tensors().is_empty());
    // Only `a` has a gradient: only `a` gets state, and `b` does not move.
    a.set_grad(grad_of(vec![0.5, -0.5])).unwrap();
    opt.step().unwrap();
    assert!(opt.state(1).is_none());
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![3.0]);
    let s = opt.state(0).unwrap();
    assert_eq!(s.step, 1);
    assert_eq!(s.exp_avg.category(), Some(Category::OptimizerState));
    assert_eq!(s.exp_avg_sq.category(), Some(Category::OptimizerState));
    // m = 0.1 g; v = 0.001 g²; first step moves each element by lr·sign(g) (eps aside).
    let m = s.exp_avg.to_vec::<f32>().unwrap();
    assert!((m[0] - 0.05).abs() < 1e-7 && (m[1] + 0.05).abs() < 1e-7);
    let pa = a.to_vec::<f32>().unwrap();
    assert!(
        (pa[0] - 0.999).abs() < 1e-6 && (pa[1] - 2.001).abs() < 1e-6,
        "{pa:?}"
    );
    let names: Vec<String> = opt.state_tensors().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, vec!["0.exp_avg", "0.exp_avg_sq"]);
    // Steps count per parameter: `b` starts at 1 when it first gets a gradient.
    a.set_grad(grad_of(vec![0.5, -0.5])).unwrap();
    b.set_grad(grad_of(vec![1.0])).unwrap();
    opt.step().unwrap();
    assert_eq!(opt.state(0).unwrap().step, 2);
    assert_eq!(opt.state(1).unwrap().step, 1);
    assert_eq!(opt.step_count(), 2);
    // b's first step: p − lr·sign(g).
    assert!((b.to_vec::<f32>().unwrap()[0] - 2.999).abs() < 1e-6);
}

#[test]
fn restored_adam_state_continues_identically() {
    let p0 = vec![0.3f32, -1.2, 2.0];
    let grads = [vec![0.1f32, -0.4, 0.9], vec![-0.2, 0.3, 0.05]];
    let cfg = adam_cfg(0.01, (0.9, 0.999), 1e-8, 0.1);
    let a = param(p0.clone());
    let mut opt = Adam::adamw(vec![a.clone()], cfg.clone()).unwrap();
    a.set_grad(grad_of(grads[0].clone())).unwrap();
    opt.step().unwrap();
    // A fresh optimizer over a copy of the parameter, given copies of the state.
    let b = param(a.to_vec::<f32>().unwrap());
    let mut restored = Adam::adamw(vec![b.clone()], cfg).unwrap();
    let s = opt.state(0).unwrap();
    let copy = |t: &Tensor| Tensor::from_vec(t.to_vec::<f32>().unwrap(), t.shape(), Device::Cpu);
    restored
        .set_state(
            0,
            AdamState {
                exp_avg: copy(&s.exp_avg).unwrap(),
                exp_avg_sq: copy(&s.exp_avg_sq).unwrap(),
                step: s.step,
                master: None,
            },
        )
        .unwrap();
    assert_eq!(restored.step_count(), 1);
    assert_eq!(
        restored.state(0).unwrap().exp_avg.category(),
        Some(Category::OptimizerState)
    );
    for (p, o) in [(&a, &mut opt), (&b, &mut restored)] {
        p.set_grad(grad_of(grads[1].clone())).unwrap();
        o.step().unwrap();
    }
    assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    // A state of the wrong shape is refused.
    let bad = AdamState {
        exp_avg: Tensor::zeros(&[2], DType::F32, Device::Cpu).unwrap(),
        exp_avg_sq: Tensor::zeros(&[2], DType::F32, Device::Cpu).unwrap(),
        step: 1,
        master: None,
    };
    assert!(restored.set_state(0, bad).is_err());
}

#[test]
fn adam_rejects_bad_settings_and_repeated_parameters() {
    let p = param(vec![1.0]);
    let bad = [
        adam_cfg(-0.1, (0.9, 0.999), 1e-8, 0.0),
        adam_cfg(0.1, (1.0, 0.999), 1e-8, 0.0),
        adam_cfg(0.1, (0.9, -0.1), 1e-8, 0.0),
        adam_cfg(0.1, (0.9, 0.999), -1e-8, 0.0),
        adam_cfg(0.1, (0.9, 0.999), 1e-8, -0.1),
    ];
    for cfg in bad {
        assert!(Adam::new(vec![p.clone()], cfg.clone()).is_err(), "{cfg:?}");
    }
    let err = Adam::new(vec![p.clone(), p.clone()], AdamConfig::default());
    assert!(err.is_err(), "the same parameter twice must be refused");
    let mut opt = Adam::new(vec![p.clone()], AdamConfig::default()).unwrap();
    p.set_grad(grad_of(vec![1.0])).unwrap();
    let view = Tensor::zeros(&[2], DType::F32, Device::Cpu).unwrap();
    let view = view.narrow(0, 1, 1).unwrap().requires_grad_(true).unwrap();
    assert!(Adam::new(vec![view], AdamConfig::default()).is_err());
    opt.step().unwrap();
}

#[test]
fn learning_rates_can_be_read_and_set() {
    let p = param(vec![1.0]);
    let mut sgd = Sgd::new(vec![p.clone()], sgd(0.1, 0.0, 0.0, 0.0, false)).unwrap();
    let mut adam = Adam::new(vec![p.clone()], AdamConfig::default()).unwrap();
    let opts: [&mut dyn Optimizer; 2] = [&mut sgd, &mut adam];
    for o in opts {
        o.set_lr(0.25).unwrap();
        assert_eq!(o.lr(), 0.25);
        assert!(o.set_lr(-1.0).is_err() && o.set_lr(f64::NAN).is_err());
        assert_eq!(o.lr(), 0.25);
    }
    // SGD steps with the new rate: p − 0.25·g.
    p.set_grad(grad_of(vec![2.0])).unwrap();
    sgd.step().unwrap();
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![0.5]);
}

// ---- gradient clipping -------------------------------------------------------------------------

const CLIP_GRADS: usize = 3;

/// Zero parameters holding the fixture gradients `{case}.g{j}`.
fn clip_params(st: &SafeTensors, case: &str) -> Vec<Tensor> {
    (0..CLIP_GRADS)
        .map(|j| {
            let g = load(st, &format!("{case}.g{j}"));
            let p = Tensor::zeros(g.shape(), DType::F32, Device::Cpu)
                .unwrap()
                .requires_grad_(true)
                .unwrap();
            p.set_grad(Some(g)).unwrap();
            p
        })
        .collect()
}

fn check_clipped(st: &SafeTensors, case: &str, params: &[Tensor]) {
    for (j, p) in params.iter().enumerate() {
        let d = max_diff(&p.grad().unwrap(), &load(st, &format!("{case}.c{j}")));
        assert!(d < 1e-6, "{case} grad {j}: max diff {d}");
    }
}

/// `clip` (returning the norm before clipping) against PyTorch's fixture `case`: the norm,
/// the clipped gradients, and that they were clipped in place.
fn check_clip_norm_by(case: &str, clip: impl FnOnce(&[Tensor]) -> f64) {
    let bytes = fixtures();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let params = clip_params(&st, case);
    let before: Vec<Tensor> = params.iter().map(|p| p.grad().unwrap()).collect();
    let norm = clip(&params);
    let want = load(&st, &format!("{case}.norm")).to_vec::<f32>().unwrap()[0] as f64;
    assert!(
        (norm - want).abs() <= 1e-6 * want,
        "{case}: norm {norm} vs {want}"
    );
    check_clipped(&st, case, &params);
    for (p, g) in params.iter().zip(&before) {
        assert!(p.grad().unwrap().shares_storage(g), "{case}: not in place");
    }
}

fn check_clip_norm(case: &str, norm_type: f64, max_norm: f64) {
    check_clip_norm_by(case, |params| {
        clip_grad_norm(params, max_norm, norm_type, true).unwrap()
    });
}

/// The queued clip against PyTorch's fixture: the norm read afterwards.
fn check_clip_norm_queued(case: &str, norm_type: f64, max_norm: f64) {
    check_clip_norm_by(case, |params| {
        let readout = clip_grad_norm_queued(params, max_norm, norm_type).unwrap();
        // The ∞-norm takes the host path, whose norm is already read.
        assert_eq!(readout.is_read(), norm_type.is_infinite(), "{case}");
        readout.value().unwrap()
    });
}

#[test]
fn clip_grad_norm_queued_matches_pytorch() {
    check_clip_norm_queued("clip_norm2", 2.0, 1.0);
    check_clip_norm_queued("clip_norm1", 1.0, 2.0);
    check_clip_norm_queued("clip_norm2_unclipped", 2.0, 1000.0);
    check_clip_norm_queued("clip_norm_inf", f64::INFINITY, 0.5);
}

#[test]
fn clip_grad_norm_queued_scales_a_0_dim_gradient() {
    let scalar = |v: f64| Tensor::scalar(v, DType::F32, Device::Cpu).unwrap();
    let a = scalar(0.0).requires_grad_(true).unwrap();
    a.set_grad(Some(scalar(3.0))).unwrap();
    let b = param(vec![0.0]);
    b.set_grad(grad_of(vec![4.0])).unwrap();
    let norm = clip_grad_norm_queued(&[a.clone(), b.clone()], 1.0, 2.0).unwrap();
    assert!((norm.value().unwrap() - 5.0).abs() < 1e-12);
    let (ga, gb) = (a.grad().unwrap(), b.grad().unwrap());
    assert_eq!(ga.shape(), &[] as &[usize]);
    assert!(
        (ga.item().unwrap() - 0.6).abs() < 1e-6,
        "{}",
        ga.item().unwrap()
    );
    assert!(
        (gb.item().unwrap() - 0.8).abs() < 1e-6,
        "{}",
        gb.item().unwrap()
    );
}

#[test]
fn clip_grad_norm_queued_keeps_nan_and_refuses_bad_norm_types() {
    let p = param(vec![0.0; 3]);
    p.set_grad(grad_of(vec![f32::NAN, -3.0, 0.25])).unwrap();
    let norm = clip_grad_norm_queued(std::slice::from_ref(&p), 1.0, 2.0).unwrap();
    assert!(norm.value().unwrap().is_nan());
    // Scaled by the NaN coefficient, as PyTorch does without error_if_nonfinite.
    let g = p.grad().unwrap().to_vec::<f32>().unwrap();
    assert!(g.iter().all(|v| v.is_nan()), "{g:?}");
    for bad in [0.0, -1.0, f64::NAN] {
        let err = clip_grad_norm_queued(std::slice::from_ref(&p), 1.0, bad).unwrap_err();
        assert!(err.to_string().contains("norm_type"), "{err}");
    }
}

#[test]
fn clip_grad_norm_matches_pytorch() {
    check_clip_norm("clip_norm2", 2.0, 1.0);
}

#[test]
fn clip_grad_norm_inf_matches_pytorch() {
    check_clip_norm("clip_norm_inf", f64::INFINITY, 0.5);
}

#[test]
fn clip_grad_norm_1_matches_pytorch() {
    check_clip_norm("clip_norm1", 1.0, 2.0);
}

#[test]
fn clip_grad_norm_below_the_limit_leaves_gradients() {
    check_clip_norm("clip_norm2_unclipped", 2.0, 1000.0);
}

#[test]
fn clip_grad_value_matches_pytorch() {
    let bytes = fixtures();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let params = clip_params(&st, "clip_value");
    clip_grad_value(&params, 0.5).unwrap();
    check_clipped(&st, "clip_value", &params);
    let v = params[0].grad().unwrap().to_vec::<f32>().unwrap();
    assert!(v.iter().any(|x| x.abs() == 0.5) && v.iter().all(|x| x.abs() <= 0.5));
}

#[test]
fn clip_grad_value_keeps_nan() {
    let p = param(vec![0.0; 3]);
    p.set_grad(grad_of(vec![f32::NAN, -3.0, 0.25])).unwrap();
    clip_grad_value(std::slice::from_ref(&p), 1.0).unwrap();
    let g = p.grad().unwrap().to_vec::<f32>().unwrap();
    assert!(g[0].is_nan());
    assert_eq!(&g[1..], &[-1.0, 0.25]);
}

#[test]
fn non_finite_norms_error_or_spread_as_in_pytorch() {
    let (a, b) = (param(vec![0.0; 3]), param(vec![0.0; 2]));
    let set = |x: Vec<f32>, y: Vec<f32>| {
        a.set_grad(grad_of(x)).unwrap();
        b.set_grad(grad_of(y)).unwrap();
    };
    let ps = [a.clone(), b.clone()];
    // With the error: nothing changes.
    set(vec![1.0, f32::NAN, 5.0], vec![1.0, 2.0]);
    let err = clip_grad_norm(&ps, 1.0, 2.0, true).unwrap_err();
    assert!(err.to_string().contains("non-finite"), "{err}");
    assert_eq!(b.grad().unwrap().to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
    // Without: a NaN norm (also for p = ∞, whose max would skip it) makes every gradient NaN.
    for p in [2.0, f64::INFINITY] {
        set(vec![1.0, f32::NAN, 5.0], vec![1.0, 2.0]);
        assert!(clip_grad_norm(&ps, 1.0, p, false).unwrap().is_nan());
        assert!(
            b.grad()
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .all(|x| x.is_nan())
        );
    }
    // An infinite element: norm ∞, coefficient 0, so inf·0 = NaN there and 0 elsewhere.
    set(vec![1.0, f32::INFINITY, 5.0], vec![1.0, 2.0]);
    assert_eq!(clip_grad_norm(&ps, 1.0, 2.0, false).unwrap(), f64::INFINITY);
    let g = a.grad().unwrap().to_vec::<f32>().unwrap();
    assert!(g[0] == 0.0 && g[1].is_nan() && g[2] == 0.0);
    assert_eq!(b.grad().unwrap().to_vec::<f32>().unwrap(), vec![0.0, 0.0]);
}

#[test]
fn clipping_without_gradients_and_bad_arguments() {
    let p = param(vec![1.0]);
    assert_eq!(
        clip_grad_norm(std::slice::from_ref(&p), 1.0, 2.0, true).unwrap(),
        0.0
    );
    assert!(clip_grad_norm(std::slice::from_ref(&p), 1.0, 0.0, true).is_err());
    assert!(clip_grad_norm(std::slice::from_ref(&p), 1.0, f64::NAN, true).is_err());
    assert!(clip_grad_value(std::slice::from_ref(&p), -1.0).is_err());
}

/// Master weights: a bf16 parameter steps through an f32 copy exactly as an f32 parameter fed
/// the widened bf16 gradients would (bit for bit), holds that copy rounded, and keeps the
/// copy and f32 moments as optimizer state. An f32 parameter in the same optimizer gets none.
#[test]
fn master_weights_step_an_f32_copy_and_round_it_into_the_parameter() {
    let n = 300;
    let init: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let half = Tensor::from_vec(init, &[n], Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let full = half
        .detach()
        .to_dtype(DType::F32)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let other = param(vec![1.0, -2.0]);
    let cfg = AdamConfig {
        lr: 1e-3,
        ..AdamConfig::adamw_default()
    };
    let mut master = Adam::adamw(vec![half.clone(), other.clone()], cfg.clone())
        .unwrap()
        .with_master_weights()
        .unwrap();
    let mut plain = Adam::adamw(vec![full.clone()], cfg).unwrap();
    for step in 0..4 {
        let g: Vec<f32> = (0..n)
            .map(|i| ((i * 7 + step * 13) as f32 * 0.11).cos())
            .collect();
        let g = Tensor::from_vec(g, &[n], Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        half.set_grad(Some(g.clone())).unwrap();
        full.set_grad(Some(g.to_dtype(DType::F32).unwrap()))
            .unwrap();
        other.set_grad(grad_of(vec![0.5, 0.5])).unwrap();
        master.step().unwrap();
        plain.step().unwrap();
    }
    let (s, want) = (master.state(0).unwrap(), plain.state(0).unwrap());
    let copy = s
        .master
        .as_ref()
        .expect("a bf16 parameter has a master copy");
    let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(f32s(copy), f32s(&full), "the master is the f32 parameter");
    assert_eq!(f32s(&s.exp_avg), f32s(&want.exp_avg));
    assert_eq!(f32s(&s.exp_avg_sq), f32s(&want.exp_avg_sq));
    assert_eq!(f32s(&half), f32s(&full.to_dtype(DType::BF16).unwrap()));
    for t in [copy, &s.exp_avg, &s.exp_avg_sq] {
        assert_eq!(
            (t.dtype(), t.category()),
            (DType::F32, Some(Category::OptimizerState))
        );
    }
    assert!(
        master.state(1).unwrap().master.is_none(),
        "f32 parameters step as before"
    );
    let names: Vec<String> = master.state_tensors().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "0.exp_avg",
            "0.exp_avg_sq",
            "0.master",
            "1.exp_avg",
            "1.exp_avg_sq"
        ]
    );
    // Chosen after a step, the moments would change dtype: refused.
    assert!(plain.with_master_weights().is_err());
}

/// Adam multiplies by a gradient scale (the clipping coefficient) as it reads each gradient:
/// the same step, bit for bit in f32, as clipping `.grad` in place first, and `.grad` is left
/// as it was.
#[test]
fn adam_takes_the_clip_coefficient_inside_its_step() {
    let grads = [vec![4.0f32, -2.0, 1.0], vec![8.0]];
    let make = || (param(vec![0.5, -1.0, 2.0]), param(vec![3.0]));
    let ((a1, b1), (a2, b2)) = (make(), make());
    let cfg = AdamConfig::adamw_default();
    let mut fused = Adam::adamw(vec![a1.clone(), b1.clone()], cfg.clone()).unwrap();
    let mut plain = Adam::adamw(vec![a2.clone(), b2.clone()], cfg).unwrap();
    for _ in 0..3 {
        for (a, b) in [(&a1, &b1), (&a2, &b2)] {
            a.set_grad(grad_of(grads[0].clone())).unwrap();
            b.set_grad(grad_of(grads[1].clone())).unwrap();
        }
        let (_, coef) = clip_coefficient_queued(fused.params(), 1.0, 2.0).unwrap();
        let coef = coef.expect("a 2-norm on one device gives a coefficient");
        assert!(coef.item().unwrap() < 1.0, "the gradients are clipped");
        fused.step_with_grad_scale(&coef).unwrap();
        assert_eq!(a1.grad().unwrap().to_vec::<f32>().unwrap(), grads[0]);
        clip_grad_norm_queued(plain.params(), 1.0, 2.0).unwrap();
        plain.step().unwrap();
    }
    for (got, want) in [(&a1, &a2), (&b1, &b2)] {
        assert_eq!(got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
    }
    // A scale must be one value.
    let two = Tensor::from_vec(vec![1.0f64, 1.0], &[2], Device::Cpu).unwrap();
    assert!(fused.step_with_grad_scale(&two).is_err());
}

/// An SGD step reads its rate from device memory when given one (a replayed graph's), and
/// ignores the argument then.
#[test]
fn sgd_reads_its_rate_from_memory_when_staged() {
    use ferrograd::backend::View;
    use ferrograd::backend::optim::{SgdStep, sgd_step};
    let p = Tensor::from_vec(vec![1.0f32, -2.0], &[2], Device::Cpu).unwrap();
    let g = Tensor::from_vec(vec![0.5f32, 4.0], &[2], Device::Cpu).unwrap();
    let lr = Tensor::from_vec(vec![0.25f64], &[1], Device::Cpu).unwrap();
    let grad = View {
        storage: g.storage(),
        layout: g.layout(),
    };
    let step = |lr_at: Option<View>| sgd_step(&SgdStep::plain(grad, p.storage(), 100.0, lr_at));
    step(Some(View {
        storage: lr.storage(),
        layout: lr.layout(),
    }))
    .unwrap();
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![0.875, -3.0]);
    // A rate that is not an f64 is refused.
    let wrong = Tensor::from_vec(vec![0.25f32], &[1], Device::Cpu).unwrap();
    let e = step(Some(View {
        storage: wrong.storage(),
        layout: wrong.layout(),
    }))
    .unwrap_err()
    .to_string();
    assert!(e.contains("F64"), "{e}");
}
