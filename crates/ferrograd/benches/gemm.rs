//! GEMM throughput through ferrograd's backend: n x n x n matmuls in f32 (TF32 off by
//! default), tf32 (switched on) and bf16, in TFLOP/s. The PyTorch twin is
//! benches/pytorch/gemm.py (cuBLAS's ceiling on the same GPU).
//!
//! Usage: cargo bench --bench gemm -- [--n 8192] [--iters 20] [--device cuda]

use std::time::Instant;

use ferrograd::backend::{cuda, synchronize};
use ferrograd::{DType, Device, Tensor};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn tflops(n: usize, dtype: DType, iters: usize, dev: Device) -> ferrograd::Result<f64> {
    let a = Tensor::randn(&[n, n], dtype, dev)?;
    let b = Tensor::randn(&[n, n], dtype, dev)?;
    for _ in 0..3 {
        a.matmul(&b)?;
    }
    synchronize(dev)?;
    let t0 = Instant::now();
    for _ in 0..iters {
        a.matmul(&b)?;
    }
    synchronize(dev)?;
    Ok(2.0 * (n as f64).powi(3) * iters as f64 / t0.elapsed().as_secs_f64() / 1e12)
}

fn main() -> ferrograd::Result<()> {
    let n = arg("--n").and_then(|v| v.parse().ok()).unwrap_or(8192);
    let iters = arg("--iters").and_then(|v| v.parse().ok()).unwrap_or(20);
    let dev: Device = arg("--device").unwrap_or_else(|| "cuda".into()).parse()?;
    for (name, dtype, tf32) in [
        ("f32", DType::F32, false),
        ("tf32", DType::F32, true),
        ("bf16", DType::BF16, false),
    ] {
        cuda::set_allow_tf32(tf32);
        println!(
            "ferrograd gemm n={n} {name} tflops={:.1}",
            tflops(n, dtype, iters, dev)?
        );
    }
    cuda::set_allow_tf32(false);
    Ok(())
}
