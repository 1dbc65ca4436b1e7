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
use ferrograd::Device;
use ferrograd::amp::AmpDType;

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
