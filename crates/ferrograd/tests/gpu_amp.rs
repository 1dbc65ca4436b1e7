//! Autocast on cuda:0 against the CPU and PyTorch: the three op chains of the autocast
//! fixtures (linear → GELU → linear → MSE; matmul → softmax → matmul; LayerNorm → linear →
//! cross-entropy) under bf16 and f16, with the dtype of every intermediate, f32 master
//! gradients that stay on the GPU, and a tiny GPT step under bf16. Needs a CUDA device:
//! without one every test fails.
#![cfg(feature = "gpu-tests")]

mod amp_chains;
mod common;

use amp_chains::{
    CHAINS, assert_close, assert_steps_agree, case_name, chains_match_pytorch, gpt_step, run_chain,
    tol,
};
use common::assert_same_bits;
use ferrograd::amp::AmpDType;
use ferrograd::{DType, Device, Generator, Tensor};

const GPU: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;

#[test]
fn chains_match_pytorch_bf16() {
    chains_match_pytorch(AmpDType::BF16, GPU);
}

#[test]
fn chains_match_pytorch_f16() {
    chains_match_pytorch(AmpDType::F16, GPU);
}

/// Every chain on the GPU against the same chain on the CPU (same policy, same dtypes).
fn chains_match_the_cpu(amp: AmpDType) {
    let t = tol(amp.dtype());
    for (chain, f) in CHAINS {
        let case = case_name(chain, amp.dtype());
        let (gpu_outs, gpu_grads) = run_chain(f, &case, amp, GPU);
        let (cpu_outs, cpu_grads) = run_chain(f, &case, amp, CPU);
        for ((name, g), (_, c)) in gpu_outs.iter().zip(&cpu_outs) {
            assert_eq!(g.dtype(), c.dtype(), "{case}.{name}: dtype on the CPU");
            assert_close(&format!("{case}.{name} GPU vs CPU"), g, c, t);
        }
        assert_eq!(gpu_grads.len(), cpu_grads.len(), "{case}: gradients");
        for (name, g) in &gpu_grads {
            let c = &cpu_grads[name];
            assert_close(&format!("{case}.grad.{name} GPU vs CPU"), g, c, t);
        }
    }
}

/// The multi-tensor cast (one launch per dtype pair) gives the CPU's casts bit for bit: sizes
/// around its 4096-element chunks, a strided view (cast one at a time), f16 and bf16.
#[test]
fn to_dtype_many_equals_the_cpus_casts() {
    for dt in [DType::BF16, DType::F16] {
        let mut rng = Generator::new(31);
        let shapes: [&[usize]; 7] = [
            &[1],
            &[4095],
            &[4096],
            &[4097],
            &[3 * 4096 + 5],
            &[10_000],
            &[33, 65],
        ];
        let cpu: Vec<Tensor> = shapes
            .iter()
            .map(|s| Tensor::randn_with(s, DType::F32, CPU, &mut rng).unwrap())
            .collect();
        let mut gpu: Vec<Tensor> = cpu.iter().map(|t| t.to_device(GPU).unwrap()).collect();
        let last = gpu.len() - 1;
        gpu[last] = gpu[last].transpose(0, 1).unwrap();
        let want: Vec<Tensor> = cpu
            .iter()
            .enumerate()
            .map(|(k, t)| match k == last {
                true => t.transpose(0, 1).unwrap().to_dtype(dt).unwrap(),
                false => t.to_dtype(dt).unwrap(),
            })
            .collect();
        let got = Tensor::to_dtype_many(&gpu, dt).unwrap();
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.device(), GPU);
            assert_same_bits(&format!("{dt} tensor {k}"), &g.to_device(CPU).unwrap(), w);
        }
    }
}

#[test]
fn chains_match_the_cpu_bf16() {
    chains_match_the_cpu(AmpDType::BF16);
}

#[test]
fn chains_match_the_cpu_f16() {
    chains_match_the_cpu(AmpDType::F16);
}

#[test]
fn tiny_gpt_bf16_step_matches_the_cpu() {
    // Both devices round to bf16 at the same places, in another summation order.
    let gpu = gpt_step(Some(AmpDType::BF16), GPU);
    let cpu = gpt_step(Some(AmpDType::BF16), CPU);
    assert_steps_agree(&gpu, &cpu);
}
