//! The fused SGD step in backward on CUDA (`StepInBackward::install_fused`: linear weight
//! gradients written by cuBLAS straight into the momentum buffers, beta = μ then 1) against
//! the ordinary CPU step, f32, over 3 steps: an MLP, a weight used twice in one forward and a
//! weight with an extra non-linear use. Also the backward peak on the device: lower than the
//! plain step in backward by at least the weight gradient. Under a bf16 autocast region, the
//! bf16 factors of the f32 weights' gradients go into the f32 momentum buffers the same way.
//! Needs a CUDA device.
#![cfg(feature = "gpu-tests")]

use std::sync::Mutex;

mod fused_nets;
use fused_nets::{Net, data_as, loss_of, momentum_cfg};

use ferrograd::nn::{Linear, Module};
use ferrograd::optim::{Optimizer, Sgd};
use ferrograd::train::StepInBackward;
use ferrograd::{DType, Device, Generator, Tensor, memory};

const GPU: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;
static LOCK: Mutex<()> = Mutex::new(());

/// [w1, b1, w2, b2] of two (d, d) linear layers, made on the CPU and moved to `device`.
fn layers(d: usize, device: Device) -> Vec<Tensor> {
    let mut g = Generator::new(0);
    let mut ps = Vec::new();
    for _ in 0..2 {
        let l = Linear::new(d, d, true, CPU, &mut g).unwrap();
        ps.extend(l.parameters());
    }
    ps.iter()
        .map(|p| {
            p.to_device(device)
                .unwrap_or_else(|e| panic!("these tests need a CUDA device (cuda:0): {e}"))
                .detach()
                .requires_grad_(true)
                .unwrap()
        })
        .collect()
}

fn host(ps: &[Tensor]) -> Vec<Vec<f32>> {
    ps.iter().map(|p| p.to_vec::<f32>().unwrap()).collect()
}

#[test]
fn fused_sgd_on_cuda_matches_the_ordinary_cpu_step() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (d, b) = (96, 24);
    for net in [Net::Mlp, Net::SharedWeight, Net::MixedUse] {
        let ps = layers(d, CPU);
        let (x, y) = data_as(b, d, DType::F32, CPU);
        let mut opt = Sgd::new(ps.clone(), momentum_cfg()).unwrap();
        for _ in 0..3 {
            loss_of(net, &ps, &x, &y).backward().unwrap();
            opt.step().unwrap();
            opt.zero_grad().unwrap();
        }
        let qs = layers(d, GPU);
        let (gx, gy) = data_as(b, d, DType::F32, GPU);
        let sib =
            StepInBackward::install_fused(Sgd::new(qs.clone(), momentum_cfg()).unwrap()).unwrap();
        for _ in 0..3 {
            loss_of(net, &qs, &gx, &gy).backward().unwrap();
            assert!(qs.iter().all(|p| p.grad().is_none()), "{net:?}");
        }
        let bufs: Vec<Vec<f32>> = sib
            .with_optimizer(|o| {
                (0..qs.len())
                    .map(|i| o.momentum_buffer(i).unwrap().to_vec::<f32>().unwrap())
                    .collect()
            })
            .unwrap();
        let want_bufs: Vec<Vec<f32>> = (0..ps.len())
            .map(|i| opt.momentum_buffer(i).unwrap().to_vec::<f32>().unwrap())
            .collect();
        for (what, got, want) in [
            ("parameters", host(&qs), host(&ps)),
            ("momentum", bufs, want_bufs),
        ] {
            for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
                assert!(
                    (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                    "{net:?} {what}: cuda {g} vs cpu {w}"
                );
            }
        }
    }
}

/// Under autocast the f32 weights' gradients are offered as products of bf16 factors: cuBLAS
/// sums them in f32 into the f32 momentum buffers (no weight takes an ordinary gradient), and
/// three fused steps on the GPU follow three ordinary steps on the CPU to bf16's precision
/// (each device rounds the activations to bf16).
#[test]
fn fused_sgd_on_cuda_takes_bf16_factors_under_autocast() {
    use ferrograd::amp::{AmpDType, autocast};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (d, b) = (96, 24);
    for net in [Net::Mlp, Net::SharedWeight] {
        let ps = layers(d, CPU);
        let (x, y) = data_as(b, d, DType::F32, CPU);
        let mut opt = Sgd::new(ps.clone(), momentum_cfg()).unwrap();
        for _ in 0..3 {
            let loss = {
                let _amp = autocast(AmpDType::BF16);
                loss_of(net, &ps, &x, &y)
            };
            loss.backward().unwrap();
            opt.step().unwrap();
            opt.zero_grad().unwrap();
        }
        let qs = layers(d, GPU);
        let (gx, gy) = data_as(b, d, DType::F32, GPU);
        let accumulated = Arc::new(AtomicUsize::new(0));
        for w in [&qs[0], &qs[2]] {
            let n = Arc::clone(&accumulated);
            w.register_post_accumulate_grad_hook(move |_| {
                n.fetch_add(1, Ordering::Relaxed);
                Ok(())
            })
            .unwrap();
        }
        let _sib =
            StepInBackward::install_fused(Sgd::new(qs.clone(), momentum_cfg()).unwrap()).unwrap();
        for _ in 0..3 {
            let loss = {
                let _amp = autocast(AmpDType::BF16);
                loss_of(net, &qs, &gx, &gy)
            };
            loss.backward().unwrap();
            assert!(qs.iter().all(|p| p.grad().is_none()), "{net:?}");
        }
        assert_eq!(accumulated.load(Ordering::Relaxed), 0, "{net:?}");
        for (g, w) in host(&qs).iter().flatten().zip(host(&ps).iter().flatten()) {
            assert!(
                (g - w).abs() <= 1e-3 * w.abs().max(1.0),
                "{net:?} parameters: cuda {g} vs cpu {w}"
            );
        }
    }
}

/// The backward peak of the 3rd step under `install` or `install_fused`, on the GPU.
fn gpu_peak(fused: bool, d: usize, b: usize) -> u64 {
    let ps = layers(d, GPU);
    let (x, y) = data_as(b, d, DType::F32, GPU);
    let opt = Sgd::new(ps.clone(), momentum_cfg()).unwrap();
    let _sib = if fused {
        StepInBackward::install_fused(opt).unwrap()
    } else {
        StepInBackward::install(opt).unwrap()
    };
    let mut peak = 0;
    for _ in 0..3 {
        let loss = loss_of(Net::Mlp, &ps, &x, &y);
        memory::reset_peak_memory_stats(GPU).unwrap();
        loss.backward().unwrap();
        peak = memory::max_memory_allocated(GPU).unwrap();
    }
    peak
}

#[test]
fn fused_sgd_on_cuda_holds_no_weight_gradient_at_the_peak() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (d, b) = (512, 64);
    let plain = gpu_peak(false, d, b);
    let fused = gpu_peak(true, d, b);
    let weight_grad = (d * d * 4) as u64;
    assert!(
        fused + weight_grad <= plain,
        "fused peak {fused} vs plain step in backward {plain} (weight gradient {weight_grad})"
    );
}
