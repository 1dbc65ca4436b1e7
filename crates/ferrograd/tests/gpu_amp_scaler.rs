//! CUDA gradient unscaling against the CPU reference: the fused unscale-and-check op
//! (`backend::optim::unscale_check`, one launch per dtype) over f32 gradients of several sizes (one
//! element, exactly one chunk, several chunks, empty) with and without a non-finite element
//! in the last one, mixed dtypes sharing one flag, a GradScaler training loop with SGD on
//! the GPU (scales, skips and parameters equal to the CPU run), and the scaler's decision kept
//! on the GPU with AdamW skipping its update there (f32 parameters and bf16 ones on master
//! copies), with nothing read back, and the scale's update kernel against the host's rule.
//! Needs a CUDA device: without one every test fails.
#![cfg(feature = "gpu-tests")]

mod common;

use common::{assert_close, on};
use ferrograd::backend::Storage;
use ferrograd::backend::optim::{UnscaleCheck, unscale_check};
use ferrograd::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};
use ferrograd::train::{GradScaler, GradScalerConfig};
use ferrograd::{DType, Device, Generator, Tensor};

const GPU: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;

fn randn(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    Tensor::randn_with(shape, DType::F32, CPU, &mut Generator::new(seed))
        .unwrap()
        .mul_scalar(1000.0)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// Gradient sizes: one element, exactly one 4096-element chunk, one past it, several chunks
/// (more than one block), an empty one, and small ones for the table search.
fn sizes() -> Vec<usize> {
    let mut s = vec![1, 4096, 4097, 70_000, 0, 15];
    s.extend((0..20).map(|i| 5 + i % 4));
    s.push(33_333);
    s
}

/// Runs the fused op on copies of `grads` on `device`; (flag, unscaled grads on the CPU).
fn fused(grads: &[Tensor], inv_scale: f32, device: Device) -> (f32, Vec<Tensor>) {
    // Fresh copies: on the CPU `to_device` returns the same storage, which the op would
    // then unscale for the GPU run too.
    let grads: Vec<Tensor> = grads
        .iter()
        .map(|g| {
            let copy = Tensor::zeros(g.shape(), g.dtype(), device).unwrap();
            copy.copy_(&on(g, device)).unwrap();
            copy
        })
        .collect();
    let flag = on(&Tensor::zeros(&[1], DType::F32, CPU).unwrap(), device);
    let outs: Vec<&Storage> = grads.iter().map(|g| g.storage().as_ref()).collect();
    unscale_check(&UnscaleCheck {
        found_inf: flag.storage(),
        grads: &outs,
        inv_scale,
        inv_scale_at: None,
    })
    .unwrap();
    let flag = flag.to_vec::<f32>().unwrap()[0];
    (flag, grads.iter().map(|g| on(g, CPU)).collect())
}

fn compare(name: &str, grads: &[Tensor], inv_scale: f32, want_flag: f32) {
    let (cpu_flag, want) = fused(grads, inv_scale, CPU);
    let (gpu_flag, got) = fused(grads, inv_scale, GPU);
    assert_eq!(cpu_flag, want_flag, "{name}: CPU flag");
    assert_eq!(gpu_flag, want_flag, "{name}: GPU flag");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_same(&format!("{name}: gradient {i}"), g, w);
    }
}

/// One multiply rounded once on both sides: identical values (inf equal, NaN matching NaN).
fn assert_same(name: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{name}: shape");
    let (g, w) = (got.to_vec::<f64>().unwrap(), want.to_vec::<f64>().unwrap());
    let bad = g
        .iter()
        .zip(&w)
        .position(|(a, b)| !(a == b || (a.is_nan() && b.is_nan())));
    if let Some(i) = bad {
        panic!(
            "{name}: element {i} of {}: got {:e}, want {:e}",
            g.len(),
            g[i],
            w[i]
        );
    }
}

fn f32_grads(seed: u64) -> Vec<Tensor> {
    sizes()
        .iter()
        .enumerate()
        .map(|(i, &n)| randn(&[n], DType::F32, seed + i as u64))
        .collect()
}

/// `g` with element `at` replaced by `v`.
fn with_value(g: &Tensor, at: usize, v: f32) -> Tensor {
    let mut x = g.to_vec::<f32>().unwrap();
    x[at] = v;
    Tensor::from_vec(x, g.shape(), CPU).unwrap()
}

#[test]
fn unscale_check_finite_matches_cpu() {
    let grads = f32_grads(10);
    compare("finite, 1/1024", &grads, 1.0 / 1024.0, 0.0);
    compare("finite, 1/3", &grads, (1.0f64 / 3.0) as f32, 0.0);
    compare("finite, identity", &grads, 1.0, 0.0);
}

#[test]
fn unscale_check_flags_a_non_finite_element_in_the_last_gradient() {
    for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
        let mut grads = f32_grads(20);
        let last = grads.len() - 1;
        let n = grads[last].numel();
        grads[last] = with_value(&grads[last], n - 1, bad);
        compare(&format!("{bad} at the very end"), &grads, 0.5, 1.0);
        // And in the middle of a multi-chunk gradient.
        let mut grads = f32_grads(30);
        grads[3] = with_value(&grads[3], 50_000, bad);
        compare(&format!("{bad} in chunk 12"), &grads, 0.5, 1.0);
    }
}

#[test]
fn unscale_check_mixed_dtypes_share_one_flag() {
    let mut grads = vec![
        randn(&[5000], DType::F32, 1),
        randn(&[300], DType::F64, 2),
        randn(&[9000], DType::BF16, 3),
        randn(&[64], DType::F16, 4),
    ];
    compare("mixed, finite", &grads, 0.125, 0.0);
    // Only the f64 gradient holds a NaN: the flag is still raised.
    let mut v = grads[1].to_vec::<f64>().unwrap();
    v[299] = f64::NAN;
    grads[1] = Tensor::from_vec(v, &[300], CPU).unwrap();
    compare("mixed, NaN in f64", &grads, 0.125, 1.0);
}

/// A GradScaler loop on `device`: 8 iterations of SGD on a 2-layer model, an inf gradient at
/// iteration 3; returns (scale after each update, stepped flags, final parameters on CPU).
fn scaler_run(device: Device) -> (Vec<f64>, Vec<bool>, Vec<Tensor>) {
    let shapes: [&[usize]; 4] = [&[64, 32], &[64], &[8, 64], &[8]];
    let params: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            on(
                &randn(s, DType::F32, 500 + i as u64)
                    .mul_scalar(1e-4)
                    .unwrap(),
                device,
            )
            .requires_grad_(true)
            .unwrap()
        })
        .collect();
    let cfg = SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        ..SgdConfig::default()
    };
    let mut opt = Sgd::new(params.clone(), cfg).unwrap();
    let mut scaler = GradScaler::with_config(GradScalerConfig {
        init_scale: 1000.3,
        growth_interval: 2,
        ..GradScalerConfig::default()
    })
    .unwrap();
    let (mut scales, mut stepped) = (Vec::new(), Vec::new());
    for k in 0..8u64 {
        let mut x = randn(&[16, 32], DType::F32, 900 + k)
            .mul_scalar(1e-3)
            .unwrap();
        if k == 3 {
            x = with_value(&x, 7, f32::INFINITY);
        }
        let t = randn(&[16, 8], DType::F32, 950 + k)
            .mul_scalar(1e-3)
            .unwrap();
        let (x, t) = (on(&x, device), on(&t, device));
        opt.zero_grad().unwrap();
        let h = x
            .linear(&params[0], Some(&params[1]))
            .unwrap()
            .tanh()
            .unwrap();
        let y = h.linear(&params[2], Some(&params[3])).unwrap();
        let loss = y.mse_loss(&t).unwrap();
        scaler.scale(&loss).unwrap().backward().unwrap();
        stepped.push(scaler.step(&mut opt).unwrap());
        scaler.update().unwrap();
        scales.push(scaler.get_scale().unwrap());
    }
    (scales, stepped, params.iter().map(|p| on(p, CPU)).collect())
}

#[test]
fn grad_scaler_loop_on_gpu_matches_cpu() {
    let (want_scales, want_steps, want) = scaler_run(CPU);
    let (got_scales, got_steps, got) = scaler_run(GPU);
    assert_eq!(got_steps, want_steps);
    assert!(!want_steps[3], "the inf iteration is skipped");
    assert_eq!(got_scales, want_scales);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_close(&format!("parameter {i}"), g, w, 1e-6, 1e-5);
    }
}

/// The scaler's decision kept on the device (`stage_on`, `step_on_device`,
/// `update_on_device`), as a GPU step runs it: AdamW over `weights` parameters (bf16: on f32
/// master copies, the other fused kernel), inf gradients at iterations 0, 3 and 4. Returns
/// (scale after each update, stepped flags, final parameters as f32 on the CPU, Adam's step
/// count, the host's waits on the device during the 8 steps).
fn staged_run(device: Device, weights: DType) -> (Vec<f64>, Vec<bool>, Vec<Tensor>, u64, u64) {
    let shapes: [&[usize]; 3] = [&[70_000], &[64], &[4097]];
    let params: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let p = randn(s, weights, 700 + i as u64).mul_scalar(1e-3).unwrap();
            on(&p, device).requires_grad_(true).unwrap()
        })
        .collect();
    let mut opt = Adam::adamw(params.clone(), AdamConfig::adamw_default()).unwrap();
    if weights != DType::F32 {
        opt = opt.with_master_weights().unwrap();
    }
    let mut scaler = GradScaler::with_config(GradScalerConfig {
        init_scale: 1024.0,
        growth_interval: 2,
        ..GradScalerConfig::default()
    })
    .unwrap();
    scaler.stage_on(device).unwrap();
    let grads: Vec<Vec<Tensor>> = (0..8u64)
        .map(|k| {
            (0..params.len())
                .map(|i| {
                    let mut g = randn(params[i].shape(), DType::F32, 800 + 10 * k + i as u64)
                        .mul_scalar(1.024)
                        .unwrap();
                    if [0, 3, 4].contains(&k) && i == 2 {
                        g = with_value(&g, 4096, f32::INFINITY);
                    }
                    g.to_dtype(weights).unwrap()
                })
                .collect()
        })
        .collect();
    ferrograd::backend::cuda::take_host_waits();
    let mut reports = Vec::new();
    for step in &grads {
        for (p, g) in params.iter().zip(step) {
            p.set_grad(Some(on(g, device))).unwrap();
        }
        let flag = scaler.step_on_device(&mut opt).unwrap();
        reports.push(scaler.update_on_device(&flag).unwrap());
    }
    let (waits, _) = ferrograd::backend::cuda::take_host_waits();
    let read: Vec<Vec<f64>> = reports.iter().map(|r| r.values().unwrap()).collect();
    let scales = read.iter().map(|r| r[1]).collect();
    let stepped = read.iter().map(|r| r[0] == 0.0).collect();
    opt.settle_counts().unwrap();
    let params = params
        .iter()
        .map(|p| on(&p.to_dtype(DType::F32).unwrap(), CPU))
        .collect();
    (scales, stepped, params, opt.step_count(), waits)
}

#[test]
fn a_scaler_staged_on_the_gpu_skips_adams_update_there_as_the_cpu_does() {
    for weights in [DType::F32, DType::BF16] {
        let (want_scales, want_steps, want, want_count, _) = staged_run(CPU, weights);
        let (got_scales, got_steps, got, got_count, waits) = staged_run(GPU, weights);
        assert_eq!(
            want_steps,
            [false, true, true, false, false, true, true, true],
            "{weights}"
        );
        assert_eq!(
            want_scales,
            [512.0, 512.0, 1024.0, 512.0, 256.0, 256.0, 512.0, 512.0],
            "{weights}"
        );
        assert_eq!(got_steps, want_steps, "{weights}");
        assert_eq!(got_scales, want_scales, "{weights}");
        assert_eq!((got_count, want_count), (5, 5), "{weights}");
        assert_eq!(
            waits, 0,
            "{weights}: eight steps decided on the GPU read nothing back"
        );
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_close(&format!("{weights} parameter {i}"), g, w, 1e-6, 1e-5);
        }
    }
}

/// The scale's update kernel against the host's rule (`next_scale`) over every branch.
#[test]
fn the_gpu_updates_the_scale_as_the_host_rule_does() {
    common::scale_update::check_scale_update(GPU);
}
