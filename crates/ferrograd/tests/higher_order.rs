//! Higher-order gradients: `create_graph` and `autograd::grad` against PyTorch on a
//! gradient-penalty MLP step (tests/fixtures/gradgrad.safetensors, written by
//! tools/make_gradgrad_fixtures.py), second derivatives of single ops against finite
//! differences of their first derivatives, clear errors for ops whose backward cannot be
//! recorded, and the `.grad` ↔ graph cycle that `zero_grad` must break (to the byte).
//!
//! The allocators are process-wide and tests run on parallel threads, so every test here
//! takes `LOCK` first (the memory tests measure from a baseline taken after it).

mod common;

use std::sync::{Mutex, MutexGuard};

use common::fixture_file::{self, FixtureFile};
use common::{assert_close, away64, pos64, randn64};
use ferrograd::autograd::{GradOptions, grad};
use ferrograd::memory::memory_allocated;
use ferrograd::ops::GeluApprox;
use ferrograd::optim::{Optimizer, Sgd, SgdConfig};
use ferrograd::{BackwardOptions, Device, Result, Tensor, no_grad};

static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn fixtures() -> &'static FixtureFile {
    fixture_file::open(
        "gradgrad.safetensors",
        "ferrograd-gradgrad-fixtures",
        "make_gradgrad_fixtures.py",
    )
}

const CREATE: GradOptions = GradOptions {
    grad_outputs: Vec::new(),
    retain_graph: false,
    create_graph: true,
    allow_unused: false,
};

fn leaf(t: Tensor) -> Tensor {
    t.requires_grad_(true).unwrap()
}

// ---- the gradient-penalty MLP step against PyTorch ---------------------------------------------

fn act(name: &str, x: &Tensor) -> Result<Tensor> {
    match name {
        "tanh" => x.tanh(),
        "gelu" => x.gelu(GeluApprox::None),
        "gelu_tanh" => x.gelu(GeluApprox::Tanh),
        "relu" => x.relu(),
        "sigmoid" => x.sigmoid(),
        other => panic!("unknown activation {other}"),
    }
}

/// One SGD step of fit + 10 · mean((‖d(Σ out)/dx‖ - 1)²), checked value by value.
fn gp_case(name: &str, act1: &str, act2: &str, softplus_fit: bool) {
    let _l = lock();
    let f = fixtures();
    let get = |k: &str| f.get(&format!("{name}.{k}"));
    let keys = ["w1", "b1", "w2", "b2", "w3", "b3"];
    let p: Vec<Tensor> = keys.iter().map(|k| leaf(get(k))).collect();
    let x = leaf(get("x"));
    let h = act(act1, &x.linear(&p[0], Some(&p[1])).unwrap()).unwrap();
    let h = act(act2, &h.linear(&p[2], Some(&p[3])).unwrap()).unwrap();
    let out = h.linear(&p[4], Some(&p[5])).unwrap();
    let gx = grad(&[&out.sum_all().unwrap()], &[&x], CREATE).unwrap()[0]
        .clone()
        .unwrap();
    let norm = gx.pow_scalar(2.0).unwrap().sum(&[1], false).unwrap();
    let norm = norm.add_scalar(1e-12).unwrap().sqrt().unwrap();
    let penalty = norm.sub_scalar(1.0).unwrap().pow_scalar(2.0).unwrap();
    let penalty = penalty.mean_all().unwrap();
    let fit = if softplus_fit {
        let sp = out.exp().unwrap().add_scalar(1.0).unwrap().log().unwrap();
        let two = Tensor::scalar(2.0, sp.dtype(), Device::Cpu).unwrap();
        sp.div(&two).unwrap().mean_all().unwrap()
    } else {
        out.mse_loss(&get("target")).unwrap()
    };
    let loss = fit.add(&penalty.mul_scalar(10.0).unwrap()).unwrap();
    for (what, got) in [
        ("gx", &gx),
        ("penalty", &penalty),
        ("fit", &fit),
        ("loss", &loss),
    ] {
        assert_close(&format!("{name}.{what}"), got, &get(what), 1e-10, 1e-9);
    }
    assert!(
        x.grad().is_none(),
        "{name}: autograd::grad must not fill x.grad"
    );
    loss.backward().unwrap();
    for (k, t) in keys.iter().zip(&p) {
        let g = t
            .grad()
            .unwrap_or_else(|| panic!("{name}: {k} got no gradient"));
        assert!(
            g.grad_fn().is_none(),
            "{name}: a plain backward's .grad has no graph"
        );
        assert_close(
            &format!("{name}.grad.{k}"),
            &g,
            &get(&format!("grad.{k}")),
            1e-10,
            1e-8,
        );
    }
    let cfg = SgdConfig {
        lr: 0.1,
        ..Default::default()
    };
    let mut opt = Sgd::new(p.clone(), cfg).unwrap();
    opt.step().unwrap();
    for (k, t) in keys.iter().zip(&p) {
        assert_close(
            &format!("{name}.step.{k}"),
            t,
            &get(&format!("step.{k}")),
            1e-10,
            1e-8,
        );
    }
}

#[test]
fn gradient_penalty_tanh_gelu_matches_pytorch() {
    gp_case("gp_tanh_gelu", "tanh", "gelu", false);
}

#[test]
fn gradient_penalty_relu_sigmoid_softplus_matches_pytorch() {
    gp_case("gp_relu_sigmoid", "relu", "sigmoid", true);
}

#[test]
fn gradient_penalty_gelu_tanh_approximation_matches_pytorch() {
    gp_case("gp_gelu_tanh_approx", "gelu_tanh", "tanh", false);
}

/// backward(create_graph) leaves a `.grad` with a graph; a penalty on it backpropagates and
/// accumulates onto it, as in PyTorch.
#[test]
fn penalty_on_dot_grad_matches_pytorch() {
    let _l = lock();
    let f = fixtures();
    let get = |k: &str| f.get(&format!("grad_penalty.{k}"));
    let keys = ["w1", "b1", "w2", "b2"];
    let p: Vec<Tensor> = keys.iter().map(|k| leaf(get(k))).collect();
    let h = get("x").linear(&p[0], Some(&p[1])).unwrap().tanh().unwrap();
    let loss = h
        .linear(&p[2], Some(&p[3]))
        .unwrap()
        .mse_loss(&get("target"))
        .unwrap();
    loss.backward_with(BackwardOptions {
        create_graph: true,
        ..Default::default()
    })
    .unwrap();
    let mut penalty = Tensor::scalar(0.0, p[0].dtype(), Device::Cpu).unwrap();
    for (k, t) in keys.iter().zip(&p) {
        let g = t.grad().unwrap();
        assert!(
            g.grad_fn().is_some(),
            "{k}.grad must carry a graph under create_graph"
        );
        assert_close(
            &format!("grad1.{k}"),
            &g,
            &get(&format!("grad1.{k}")),
            1e-12,
            1e-10,
        );
        penalty = penalty
            .add(&g.pow_scalar(2.0).unwrap().sum_all().unwrap())
            .unwrap();
    }
    penalty.backward().unwrap();
    for (k, t) in keys.iter().zip(&p) {
        let g = t.grad().unwrap();
        assert_close(
            &format!("grad2.{k}"),
            &g,
            &get(&format!("grad2.{k}")),
            1e-12,
            1e-9,
        );
    }
}

// ---- second derivatives against finite differences -------------------------------------------

const EPS: f64 = 1e-6;

/// d/dx of s(x) = Σ (∂/∂x Σ f(x)·w) · v, taken by autograd through a create_graph backward,
/// against central differences of s computed with first-order gradients only.
/// The caller holds `LOCK` (its inputs are allocated too).
fn gradgradcheck(name: &str, f: impl Fn(&Tensor) -> Result<Tensor>, x0: &Tensor) {
    let w = {
        let _g = no_grad();
        let shape = f(x0).unwrap().shape().to_vec();
        randn64(&shape, 777)
    };
    let v = randn64(x0.shape(), 778);
    let s = |x: &Tensor, create_graph: bool| -> Tensor {
        let obj = f(x)
            .and_then(|o| o.mul(&w))
            .and_then(|o| o.sum_all())
            .unwrap();
        let opts = GradOptions {
            create_graph,
            ..Default::default()
        };
        let gx = grad(&[&obj], &[x], opts).unwrap_or_else(|e| panic!("{name}: {e}"))[0]
            .clone()
            .unwrap();
        gx.mul(&v).unwrap().sum_all().unwrap()
    };
    let x = leaf(x0.detach());
    let analytic = grad(&[&s(&x, true)], &[&x], GradOptions::default()).unwrap()[0]
        .clone()
        .unwrap();
    let base = x0.to_vec::<f64>().unwrap();
    let numeric: Vec<f64> = (0..base.len())
        .map(|j| {
            let at = |d: f64| {
                let mut b = base.clone();
                b[j] += d;
                let xj = leaf(Tensor::from_vec(b, x0.shape(), Device::Cpu).unwrap());
                s(&xj, false).item().unwrap()
            };
            (at(EPS) - at(-EPS)) / (2.0 * EPS)
        })
        .collect();
    let numeric = Tensor::from_vec(numeric, x0.shape(), Device::Cpu).unwrap();
    assert_close(
        &format!("{name}: second derivative"),
        &analytic,
        &numeric,
        1e-6,
        1e-5,
    );
}

#[test]
fn second_derivatives_of_unary_ops() {
    let _l = lock();
    let x = away64(&[3, 4], 1);
    gradgradcheck("tanh", |x| x.tanh(), &x);
    gradgradcheck("sigmoid", |x| x.sigmoid(), &x);
    gradgradcheck("exp", |x| x.exp(), &x);
    gradgradcheck("gelu", |x| x.gelu(GeluApprox::None), &x);
    gradgradcheck("gelu tanh", |x| x.gelu(GeluApprox::Tanh), &x);
    gradgradcheck("relu·x", |x| x.relu()?.mul(x), &x);
    let p = pos64(&[3, 4], 2);
    gradgradcheck("log", |x| x.log(), &p);
    gradgradcheck("sqrt", |x| x.sqrt(), &p);
    gradgradcheck("pow_scalar 3", |x| x.pow_scalar(3.0), &x);
    gradgradcheck("pow_scalar -1.5", |x| x.pow_scalar(-1.5), &p);
}

#[test]
fn second_derivatives_of_the_fused_mlp() {
    let _l = lock();
    let x = randn64(&[3, 4], 3);
    let (wf, bf, wp, bp) = (
        randn64(&[6, 4], 4),
        randn64(&[6], 5),
        randn64(&[2, 6], 6),
        randn64(&[2], 7),
    );
    gradgradcheck("mlp_gelu", |x| x.mlp_gelu(&wf, &bf, &wp, &bp), &x);
}

#[test]
fn second_derivatives_of_binary_and_reduction_ops() {
    let _l = lock();
    let x = randn64(&[3, 4], 3);
    let b = pos64(&[4], 4);
    gradgradcheck("x*x broadcast mul", |x| x.mul(x)?.mul(&b), &x);
    gradgradcheck("b / x²", |x| b.div(&x.mul(x)?.add_scalar(1.0)?), &x);
    gradgradcheck("x^x", |x| x.pow(x), &pos64(&[2, 3], 5));
    gradgradcheck(
        "sum(x², dim 1)²",
        |x| x.mul(x)?.sum(&[1], true)?.pow_scalar(2.0),
        &x,
    );
    gradgradcheck("mean(x³)", |x| x.pow_scalar(3.0)?.mean_all(), &x);
    let t = randn64(&[3, 4], 6);
    gradgradcheck("mse_loss(x², t)", |x| x.mul(x)?.mse_loss(&t), &x);
}

#[test]
fn second_derivatives_through_linear_and_matmul() {
    let _l = lock();
    let x = randn64(&[5, 3], 7);
    let w = randn64(&[4, 3], 8);
    let bias = randn64(&[4], 9);
    gradgradcheck("tanh(linear(x))", |x| x.linear(&w, Some(&bias))?.tanh(), &x);
    let xw = x.clone();
    gradgradcheck("w ↦ tanh(linear(x; w))", |w| xw.linear(w, None)?.tanh(), &w);
    let m = randn64(&[2, 3, 4], 10);
    gradgradcheck(
        "sigmoid(x @ m)",
        |x| x.matmul(&m)?.sigmoid(),
        &randn64(&[2, 5, 3], 11),
    );
    gradgradcheck(
        "strided input: tanh(linear(xᵀ))",
        |x| x.t()?.linear(&w, None)?.tanh(),
        &randn64(&[3, 5], 12),
    );
}

// ---- errors --------------------------------------------------------------------------------

#[test]
fn create_graph_through_a_fused_backward_names_the_op() {
    let _l = lock();
    let x = leaf(randn64(&[2, 3], 13));
    let loss = x
        .softmax(-1)
        .unwrap()
        .pow_scalar(2.0)
        .unwrap()
        .sum_all()
        .unwrap();
    let err = grad(&[&loss], &[&x], CREATE).unwrap_err().to_string();
    assert!(
        err.contains("softmax") && err.contains("create_graph"),
        "{err}"
    );
}

#[test]
fn grad_leaves_dot_grad_alone_and_checks_its_inputs() {
    let _l = lock();
    let (x, y) = (leaf(randn64(&[3], 14)), leaf(randn64(&[3], 15)));
    let out = x.mul(&x).unwrap().sum_all().unwrap();
    let g = grad(&[&out], &[&x], GradOptions::default()).unwrap();
    assert_close(
        "d(x·x)/dx",
        g[0].as_ref().unwrap(),
        &x.mul_scalar(2.0).unwrap(),
        0.0,
        1e-15,
    );
    assert!(x.grad().is_none());
    let out = x.mul(&x).unwrap().sum_all().unwrap();
    let unused = grad(&[&out], &[&x, &y], GradOptions::default()).unwrap_err();
    assert!(unused.to_string().contains("allow_unused"), "{unused}");
    let out = x.mul(&x).unwrap().sum_all().unwrap();
    let allowed = GradOptions {
        allow_unused: true,
        ..Default::default()
    };
    let g = grad(&[&out], &[&x, &y], allowed).unwrap();
    assert!(g[0].is_some() && g[1].is_none());
    let plain = randn64(&[3], 16);
    let out = x.mul(&plain).unwrap().sum_all().unwrap();
    let err = grad(&[&out], &[&plain], GradOptions::default()).unwrap_err();
    assert!(err.to_string().contains("requires_grad_"), "{err}");
}

// ---- the .grad ↔ graph cycle -------------------------------------------------------------------

/// A two-layer MLP's parameters (F64) and one create_graph backward on them.
fn create_graph_step(p: &[Tensor]) {
    let x = randn64(&[16, 8], 20);
    let h = x.linear(&p[0], Some(&p[1])).unwrap().tanh().unwrap();
    let loss = h
        .linear(&p[2], None)
        .unwrap()
        .pow_scalar(2.0)
        .unwrap()
        .mean_all()
        .unwrap();
    loss.backward_with(BackwardOptions {
        create_graph: true,
        ..Default::default()
    })
    .unwrap();
}

fn mlp_params() -> Vec<Tensor> {
    [vec![32, 8], vec![32], vec![4, 32]]
        .iter()
        .enumerate()
        .map(|(i, s)| leaf(randn64(s, 30 + i as u64)))
        .collect()
}

#[test]
fn zero_grad_set_to_none_frees_the_create_graph_cycle() {
    let _l = lock();
    let p = mlp_params();
    let mut opt = Sgd::new(
        p.clone(),
        SgdConfig {
            lr: 0.1,
            ..Default::default()
        },
    )
    .unwrap();
    let base = memory_allocated(Device::Cpu).unwrap();
    create_graph_step(&p);
    let held = memory_allocated(Device::Cpu).unwrap();
    let grad_bytes: u64 = p.iter().map(|t| t.nbytes() as u64).sum();
    // The graph of the gradient computation is alive, held by .grad: more than the grads.
    assert!(held > base + grad_bytes, "held {held}, base {base}");
    opt.zero_grad().unwrap();
    assert_eq!(memory_allocated(Device::Cpu).unwrap(), base);
}

#[test]
fn zero_grad_in_place_detaches_so_only_the_gradients_stay() {
    let _l = lock();
    let p = mlp_params();
    let mut opt = Sgd::new(
        p.clone(),
        SgdConfig {
            lr: 0.1,
            ..Default::default()
        },
    )
    .unwrap();
    let base = memory_allocated(Device::Cpu).unwrap();
    create_graph_step(&p);
    opt.zero_grad_with(false).unwrap();
    let grad_bytes: u64 = p.iter().map(|t| t.nbytes() as u64).sum();
    assert_eq!(memory_allocated(Device::Cpu).unwrap(), base + grad_bytes);
    for t in &p {
        let g = t.grad().unwrap();
        assert!(g.grad_fn().is_none());
        assert!(g.to_vec::<f64>().unwrap().iter().all(|&v| v == 0.0));
    }
    opt.zero_grad().unwrap();
    assert_eq!(memory_allocated(Device::Cpu).unwrap(), base);
}

/// Without zero_grad the cycle keeps the graph alive even after every handle is dropped.
#[test]
fn without_zero_grad_the_cycle_outlives_the_parameters() {
    let _l = lock();
    let base = memory_allocated(Device::Cpu).unwrap();
    {
        let p = mlp_params();
        create_graph_step(&p);
        for t in &p {
            t.set_grad(None).unwrap();
        }
    }
    assert_eq!(
        memory_allocated(Device::Cpu).unwrap(),
        base,
        "set_grad(None) breaks it"
    );
    {
        let p = mlp_params();
        create_graph_step(&p);
    }
    let leaked = memory_allocated(Device::Cpu).unwrap() - base;
    let params: u64 = [32 * 8, 32, 4 * 32].iter().map(|n| n * 8).sum();
    assert!(
        leaked > params,
        "the parameters, their .grad and the graph leak: {leaked}"
    );
}
