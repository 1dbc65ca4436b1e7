//! CUDA optimizer kernels against the CPU reference: the multi-tensor Adam / AdamW step (one
//! launch over many parameters of mixed sizes, chunk boundaries, empty and 0-dim ones, f32 and
//! bf16, f32 and f64 in one optimizer) after 3 steps, Adam inside a small training loop, and
//! gradient clipping by norm (p = 2, 1, ∞) and by value. Needs a CUDA device: without one
//! every test fails.
#![cfg(feature = "gpu-tests")]

mod common;

use common::{assert_close, on, regression_steps};
use ferrograd::optim::{
    Adam, AdamConfig, Optimizer, clip_grad_norm, clip_grad_norm_queued, clip_grad_value,
};
use ferrograd::{Category, DType, Device, Generator, Tensor};

const GPU: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;

fn randn(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    Tensor::randn_with(shape, DType::F32, CPU, &mut Generator::new(seed))
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// Parameter shapes: several chunks (4096 elements each in the kernel), exactly one chunk, a
/// single element, an empty tensor, a 0-dim tensor, and many small ones for the table search.
fn shapes() -> Vec<Vec<usize>> {
    let mut s = vec![
        vec![64, 100],
        vec![4096],
        vec![1],
        vec![0],
        vec![3, 5],
        vec![10_000],
        vec![],
    ];
    s.extend((0..30).map(|i| vec![7 + i % 3]));
    s
}

/// Runs 3 steps of `make` on `device` over parameters of `dtypes` (cycled over `shapes()`),
/// feeding fixed gradients; returns each parameter, exp_avg and exp_avg_sq on the CPU.
fn adam_run(device: Device, dtypes: &[DType], decoupled: bool, cfg: &AdamConfig) -> Vec<Tensor> {
    let shapes = shapes();
    let dtype_of = |i: usize| dtypes[i % dtypes.len()];
    let params: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            on(&randn(s, dtype_of(i), 100 + i as u64), device)
                .requires_grad_(true)
                .unwrap()
        })
        .collect();
    let mut opt = if decoupled {
        Adam::adamw(params.clone(), cfg.clone())
    } else {
        Adam::new(params.clone(), cfg.clone())
    }
    .unwrap();
    for step in 0..3u64 {
        for (i, (p, s)) in params.iter().zip(&shapes).enumerate() {
            let g = randn(s, dtype_of(i), 1000 * (step + 1) + i as u64);
            p.set_grad(Some(on(&g, device))).unwrap();
        }
        opt.step().unwrap();
    }
    let mut out = Vec::new();
    for (i, p) in params.iter().enumerate() {
        let st = opt.state(i).expect("state after three steps");
        assert_eq!(st.step, 3);
        assert_eq!(st.exp_avg.device(), device);
        assert_eq!(st.exp_avg_sq.category(), Some(Category::OptimizerState));
        out.extend([&p.detach(), &st.exp_avg, &st.exp_avg_sq].map(|t| on(t, CPU)));
    }
    out
}

/// Same kernels' arithmetic on both sides (compute type, rounding once per store, no FMA):
/// f32 results should be identical; the tolerance only keeps a failure readable.
fn compare_adam(name: &str, dtypes: &[DType], decoupled: bool, cfg: AdamConfig, tol: f64) {
    let want = adam_run(CPU, dtypes, decoupled, &cfg);
    let got = adam_run(GPU, dtypes, decoupled, &cfg);
    assert_eq!(want.len(), got.len());
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        let what = ["param", "exp_avg", "exp_avg_sq"][k % 3];
        let label = format!("{name}: {what} of parameter {}", k / 3);
        assert_close(&label, g, w, tol, tol);
    }
}

fn cfg(lr: f64, betas: (f64, f64), weight_decay: f64) -> AdamConfig {
    AdamConfig {
        lr,
        betas,
        eps: 1e-8,
        weight_decay,
    }
}

#[test]
fn adam_many_parameters_match_cpu() {
    compare_adam(
        "adam",
        &[DType::F32],
        false,
        cfg(0.01, (0.9, 0.999), 0.0),
        1e-6,
    );
}

#[test]
fn adam_l2_matches_cpu() {
    compare_adam(
        "adam l2",
        &[DType::F32],
        false,
        cfg(0.01, (0.9, 0.999), 0.1),
        1e-6,
    );
}

#[test]
fn adamw_matches_cpu() {
    compare_adam(
        "adamw",
        &[DType::F32],
        true,
        cfg(0.01, (0.9, 0.999), 0.1),
        1e-6,
    );
    // beta1 below one half: the other lerp formula.
    compare_adam(
        "adamw beta1 0.3",
        &[DType::F32],
        true,
        cfg(0.02, (0.3, 0.9), 0.05),
        1e-6,
    );
}

#[test]
fn adam_mixed_dtypes_launch_per_dtype_and_match_cpu() {
    compare_adam(
        "adamw f32+f64",
        &[DType::F32, DType::F64],
        true,
        cfg(0.01, (0.9, 0.999), 0.1),
        1e-6,
    );
}

#[test]
fn adam_bf16_matches_cpu() {
    compare_adam(
        "adam bf16",
        &[DType::BF16],
        false,
        cfg(0.01, (0.9, 0.999), 0.0),
        1e-2,
    );
}

/// Three Adam steps of a small regression on `device`; final parameters on the CPU.
fn train(device: Device) -> Vec<Tensor> {
    let params: Vec<Tensor> = [randn(&[8, 16], DType::F32, 60), randn(&[8], DType::F32, 61)]
        .iter()
        .map(|t| on(t, device).requires_grad_(true).unwrap())
        .collect();
    let (x, y) = (
        on(&randn(&[32, 16], DType::F32, 62), device),
        on(&randn(&[32, 8], DType::F32, 63), device),
    );
    let mut opt = Adam::adamw(params.clone(), AdamConfig::adamw_default()).unwrap();
    regression_steps(&params, &x, &y, &mut opt);
    params.iter().map(|p| on(p, CPU)).collect()
}

#[test]
fn adamw_training_steps_match_cpu() {
    // Gradients differ in the last bits (GEMM order); Adam's normalised step keeps it small.
    for (i, (g, w)) in train(GPU).iter().zip(&train(CPU)).enumerate() {
        assert_close(&format!("trained param {i}"), g, w, 1e-5, 1e-5);
    }
}

// ---- clipping ------------------------------------------------------------------------------------

/// Zero parameters on `device` with gradients `grads` (copied there).
fn with_grads(grads: &[Tensor], device: Device) -> Vec<Tensor> {
    grads
        .iter()
        .map(|g| {
            let p = Tensor::zeros(g.shape(), g.dtype(), device)
                .unwrap()
                .requires_grad_(true)
                .unwrap();
            p.set_grad(Some(on(g, device))).unwrap();
            p
        })
        .collect()
}

fn clip_grads() -> Vec<Tensor> {
    [vec![300, 70], vec![5], vec![], vec![0], vec![2, 3, 4]]
        .iter()
        .enumerate()
        .map(|(i, s)| {
            randn(s, DType::F32, 200 + i as u64)
                .mul_scalar(3.0)
                .unwrap()
        })
        .collect()
}

/// `clip` on the GPU (returning the norm before clipping) against `clip_grad_norm` on the CPU,
/// for each (norm type, max norm): the norm and every clipped gradient.
fn check_clip_against_cpu(cases: &[(f64, f64)], clip: impl Fn(&[Tensor], f64, f64) -> f64) {
    let grads = clip_grads();
    for &(p, max_norm) in cases {
        let (cpu, gpu) = (with_grads(&grads, CPU), with_grads(&grads, GPU));
        let want = clip_grad_norm(&cpu, max_norm, p, true).unwrap();
        let got = clip(&gpu, max_norm, p);
        // Per-gradient sums in another order on the GPU.
        assert!(
            (got - want).abs() <= 1e-6 * want,
            "p = {p}: norm {got} on the GPU, {want} on the CPU"
        );
        for (i, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
            let (g, c) = (on(&g.grad().unwrap(), CPU), c.grad().unwrap());
            assert_close(&format!("p = {p}: grad {i}"), &g, &c, 1e-6, 1e-5);
        }
    }
}

#[test]
fn clip_grad_norm_matches_cpu() {
    let cases = [(2.0, 1.0), (1.0, 5.0), (f64::INFINITY, 0.5), (2.0, 1e6)];
    check_clip_against_cpu(&cases, |params, max_norm, p| {
        clip_grad_norm(params, max_norm, p, true).unwrap()
    });
}

#[test]
fn clip_grad_norm_queued_matches_cpu_without_reading_back() {
    let cases = [(2.0, 1.0), (1.0, 5.0), (3.0, 0.5), (2.0, 1e6)];
    check_clip_against_cpu(&cases, |params, max_norm, p| {
        let readout = clip_grad_norm_queued(params, max_norm, p).unwrap();
        assert!(
            !readout.is_read(),
            "p = {p}: the norm was read before it was asked for"
        );
        readout.value().unwrap()
    });
}

#[test]
fn clip_grad_norm_of_nan_gradients_matches_cpu() {
    let mut grads = clip_grads();
    let mut v = grads[1].to_vec::<f32>().unwrap();
    v[2] = f32::NAN;
    grads[1] = Tensor::from_vec(v, &[5], CPU).unwrap();
    for p in [2.0, f64::INFINITY] {
        let gpu = with_grads(&grads, GPU);
        assert!(clip_grad_norm(&gpu, 1.0, p, true).is_err(), "p = {p}");
        assert!(
            clip_grad_norm(&gpu, 1.0, p, false).unwrap().is_nan(),
            "p = {p}"
        );
        let g = gpu[0].grad().unwrap().to_vec::<f32>().unwrap();
        assert!(g.iter().all(|x| x.is_nan()), "p = {p}: scaled by NaN");
    }
}

#[test]
fn clip_grad_value_matches_cpu() {
    let mut grads = clip_grads();
    let mut v = grads[1].to_vec::<f32>().unwrap();
    v[0] = f32::NAN;
    grads[1] = Tensor::from_vec(v, &[5], CPU).unwrap();
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        let grads: Vec<Tensor> = grads.iter().map(|g| g.to_dtype(dtype).unwrap()).collect();
        let (cpu, gpu) = (with_grads(&grads, CPU), with_grads(&grads, GPU));
        clip_grad_value(&cpu, 0.7).unwrap();
        clip_grad_value(&gpu, 0.7).unwrap();
        for (i, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
            let (g, c) = (on(&g.grad().unwrap(), CPU), c.grad().unwrap());
            // A clamp only selects values: identical on both sides, NaN kept.
            assert_close(&format!("{dtype}: grad {i}"), &g, &c, 0.0, 0.0);
        }
        let g = gpu[1].grad().unwrap().to_vec::<f32>().unwrap();
        assert!(g[0].is_nan(), "{dtype}: NaN kept");
    }
}

/// Shapes of the master-weight runs: several chunks, a tail, a few elements.
const MASTER_SHAPES: [&[usize]; 3] = [&[64, 100], &[4099], &[33]];

/// Three AdamW steps with master weights on `device` over parameters of `dtypes` (shapes
/// `MASTER_SHAPES`, seeds from `seed`), each step through `step`; returns the parameters and
/// the optimizer.
fn master_run(
    device: Device,
    dtypes: [DType; 3],
    seed: u64,
    step: impl Fn(&mut Adam),
) -> (Vec<Tensor>, Adam) {
    let params: Vec<Tensor> = MASTER_SHAPES
        .iter()
        .zip(dtypes)
        .enumerate()
        .map(|(i, (s, dt))| {
            on(&randn(s, dt, seed + i as u64), device)
                .requires_grad_(true)
                .unwrap()
        })
        .collect();
    let mut opt = Adam::adamw(params.clone(), cfg(1e-3, (0.9, 0.95), 0.1))
        .unwrap()
        .with_master_weights()
        .unwrap();
    for k in 0..3u64 {
        for (i, (p, (s, dt))) in params
            .iter()
            .zip(MASTER_SHAPES.iter().zip(dtypes))
            .enumerate()
        {
            let g = randn(s, dt, 10 * seed * (k + 1) + i as u64);
            p.set_grad(Some(on(&g, device))).unwrap();
        }
        step(&mut opt);
    }
    (params, opt)
}

/// Asserts two lists of CPU tensors are equal, bit for bit.
fn same_bits(what: &str, got: &[Tensor], want: &[Tensor]) {
    assert_eq!(want.len(), got.len());
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert_close(&format!("{what}, tensor {k}"), g, w, 0.0, 0.0);
    }
}

/// Master weights on the GPU: bf16 and f16 parameters step through f32 copies with the CPU's
/// arithmetic (bit for bit: copies, moments and the rounded parameters); an f32 parameter in
/// the same optimizer steps as before.
#[test]
fn adamw_master_weights_match_cpu() {
    let run = |device: Device| {
        let dtypes = [DType::BF16, DType::F16, DType::F32];
        let (params, opt) = master_run(device, dtypes, 300, |o| o.step().unwrap());
        let mut out = Vec::new();
        for (i, p) in params.iter().enumerate() {
            let st = opt.state(i).unwrap();
            assert_eq!(
                st.master.is_some(),
                i < 2,
                "master copies for the half parameters only"
            );
            out.extend(
                [&p.detach(), &st.exp_avg, &st.exp_avg_sq]
                    .into_iter()
                    .chain(&st.master)
                    .map(|t| on(t, CPU)),
            );
        }
        out
    };
    same_bits("master weights", &run(GPU), &run(CPU));
}

/// The gradient scale read inside the fused step on the GPU (plain and master-weight
/// kernels) gives the CPU's step bit for bit, and leaves `.grad` as it was.
#[test]
fn adamw_gradient_scale_inside_the_step_matches_cpu() {
    let run = |device: Device| {
        let dtypes = [DType::F32, DType::BF16, DType::F64];
        let scale = Tensor::scalar(0.37, DType::F64, device).unwrap();
        let (params, _) = master_run(device, dtypes, 500, |o| {
            o.step_with_grad_scale(&scale).unwrap()
        });
        let last = randn(MASTER_SHAPES[0], dtypes[0], 10 * 500 * 3);
        let grad = on(&params[0].grad().unwrap(), CPU);
        assert_close("grad left as it was", &grad, &last, 0.0, 0.0);
        params
            .iter()
            .map(|p| on(&p.detach(), CPU))
            .collect::<Vec<_>>()
    };
    same_bits("scaled step", &run(GPU), &run(CPU));
}
