//! Autocast on cuda:0 against the CPU and PyTorch: the three op chains of the autocast
//! fixtures (linear → GELU → linear → MSE; matmul → softmax → matmul; LayerNorm → linear →
//! cross-entropy) under bf16 and f16, with the dtype of every intermediate, f32 master
//! gradients that stay on the GPU, and a tiny GPT step under bf16. Needs a CUDA device:
//! without one every test fails.
#![cfg(feature = "gpu-tests")]

mod amp_chains;

use std::collections::BTreeMap;

use amp_chains::{CHAINS, case_name, leaves, named, tol};
use ferrograd::amp::{AmpDType, autocast};
use ferrograd::nn::{Gpt, GptConfig, Module};
use ferrograd::{DType, Device, Generator, Tensor};

const GPU: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;

#[track_caller]
fn assert_close(name: &str, got: &Tensor, want: &Tensor, (atol, rtol): (f64, f64)) {
    assert_eq!(got.shape(), want.shape(), "{name}: shape");
    let (g, w) = (got.to_vec::<f64>().unwrap(), want.to_vec::<f64>().unwrap());
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= atol + rtol * b.abs(),
            "{name}: got {a} want {b} at [{i}]; first values got {:?} want {:?}",
            &g[..g.len().min(4)],
            &w[..w.len().min(4)]
        );
    }
}

fn on_cpu(t: &Tensor) -> Tensor {
    t.to_device(CPU).unwrap()
}

/// Runs one chain's case on `device` under `amp`: its intermediates and the gradients of its
/// float inputs (brought to the CPU), checking that everything stayed on `device`.
fn run(
    chain: amp_chains::Chain,
    case: &str,
    amp: AmpDType,
    device: Device,
) -> (amp_chains::Outs, BTreeMap<String, Tensor>) {
    let inputs = leaves(case, device);
    let outs = {
        let _amp = autocast(amp);
        chain(&inputs).unwrap_or_else(|e| panic!("{case} on {device}: forward failed: {e}"))
    };
    let (_, loss) = outs.last().unwrap();
    loss.backward()
        .unwrap_or_else(|e| panic!("{case} on {device}: backward failed: {e}"));
    let grads = inputs
        .iter()
        .filter_map(|(k, t)| t.grad().map(|g| (k.clone(), g)))
        .collect::<BTreeMap<_, _>>();
    for (name, t) in &outs {
        assert_eq!(t.device(), device, "{case}.{name} left {device}");
    }
    for (name, g) in &grads {
        assert_eq!(g.device(), device, "{case}.grad.{name} left {device}");
        assert_eq!(g.dtype(), DType::F32, "{case}.grad.{name}: master dtype");
    }
    let outs = outs.into_iter().map(|(n, t)| (n, on_cpu(&t))).collect();
    let grads = grads.into_iter().map(|(n, g)| (n, on_cpu(&g))).collect();
    (outs, grads)
}

/// Every chain on the GPU against the CPU (same policy, same dtypes) and against PyTorch.
fn chains_on_gpu(amp: AmpDType) {
    let t = tol(amp.dtype());
    for (chain, f) in CHAINS {
        let case = case_name(chain, amp.dtype());
        let (gpu_outs, gpu_grads) = run(f, &case, amp, GPU);
        let (cpu_outs, cpu_grads) = run(f, &case, amp, CPU);
        let want = named(&case, "out");
        for ((name, g), (_, c)) in gpu_outs.iter().zip(&cpu_outs) {
            assert_eq!(g.dtype(), want[*name].dtype(), "{case}.{name}: dtype");
            assert_eq!(g.dtype(), c.dtype(), "{case}.{name}: dtype on the CPU");
            assert_close(&format!("{case}.{name} GPU vs CPU"), g, c, t);
            assert_close(&format!("{case}.{name} GPU vs PyTorch"), g, &want[*name], t);
        }
        let want = named(&case, "grad");
        assert_eq!(gpu_grads.len(), want.len(), "{case}: gradients");
        for (name, g) in &gpu_grads {
            assert_close(
                &format!("{case}.grad.{name} GPU vs CPU"),
                g,
                &cpu_grads[name],
                t,
            );
            assert_close(
                &format!("{case}.grad.{name} GPU vs PyTorch"),
                g,
                &want[name],
                t,
            );
        }
    }
}

#[test]
fn chains_bf16() {
    chains_on_gpu(AmpDType::BF16);
}

#[test]
fn chains_f16() {
    chains_on_gpu(AmpDType::F16);
}

/// The tiny GPT's loss and gradients (on the CPU) after one bf16 step on `device`.
fn gpt_step(device: Device) -> (f64, Vec<(String, Tensor)>) {
    let model = Gpt::new(GptConfig::tiny(), device).unwrap();
    let mut g = Generator::new(21);
    let mut draw = || -> Tensor {
        let v: Vec<i64> = g
            .uniform(2 * 32, 0.0, 65.0)
            .iter()
            .map(|x| *x as i64)
            .collect();
        Tensor::from_vec(v, &[2, 32], device).unwrap()
    };
    let (ids, targets) = (draw(), draw());
    let loss = {
        let _amp = autocast(AmpDType::BF16);
        let (logits, loss) = model.forward_loss(&ids, Some(&targets)).unwrap();
        assert_eq!(logits.dtype(), DType::BF16);
        loss.unwrap()
    };
    assert_eq!(loss.dtype(), DType::F32);
    loss.backward().unwrap();
    let grads = model
        .named_parameters()
        .into_iter()
        .map(|(n, p)| {
            let g = p.grad().unwrap_or_else(|| panic!("{n}: no gradient"));
            assert_eq!(g.dtype(), DType::F32, "{n}: master gradient dtype");
            (n, on_cpu(&g))
        })
        .collect();
    (loss.item().unwrap(), grads)
}

#[test]
fn tiny_gpt_bf16_step_matches_the_cpu() {
    let (gpu_loss, gpu_grads) = gpt_step(GPU);
    let (cpu_loss, cpu_grads) = gpt_step(CPU);
    assert!(
        gpu_loss.is_finite() && (gpu_loss - cpu_loss).abs() < 2e-3 * cpu_loss,
        "GPU loss {gpu_loss} vs CPU {cpu_loss}"
    );
    for ((name, g), (_, c)) in gpu_grads.iter().zip(&cpu_grads) {
        let (g, c) = (g.to_vec::<f64>().unwrap(), c.to_vec::<f64>().unwrap());
        assert!(
            g.iter().all(|v| v.is_finite()),
            "{name}: non-finite gradient"
        );
        // Both devices round to bf16 at the same places, in another summation order: the
        // gradients agree in direction (cosine > 0.999) and size (1 %), not bit for bit.
        let dot: f64 = g.iter().zip(&c).map(|(a, b)| a * b).sum();
        let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
        let (ng, nc) = (norm(&g), norm(&c));
        if nc == 0.0 {
            assert_eq!(ng, 0.0, "{name}");
            continue;
        }
        assert!(
            dot / (ng * nc) > 0.999,
            "{name}: cosine {}",
            dot / (ng * nc)
        );
        assert!((ng / nc - 1.0).abs() < 0.01, "{name}: norm {ng} vs {nc}");
    }
}
