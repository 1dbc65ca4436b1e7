//! Optimizers against PyTorch: parameters after each step, from fixtures written by
//! tools/make_optim_fixtures.py; plus zero_grad semantics.

use ferrograd::optim::{Optimizer, Sgd, SgdConfig};
use ferrograd::{Device, Tensor};
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
