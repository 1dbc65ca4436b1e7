//! Benchmark: a GPT block's residual add and layer norm alone, forward and forward +
//! backward, as autocast runs them: an f32 residual stream x (rows, n), a half-precision
//! branch h, the sum s = x + h kept in f32 and the norm's output y in half precision, with a
//! weight and a bias; the backward takes gradients for both s and y (the stream's gradient
//! from later blocks and the next linear's), so the norm's backward folds the stream's
//! gradient in and sums the parameter gradients. GPT-2's (B·T, C) = (8192, 768) by default.
//!
//! Usage: cargo bench -p ferrograd --bench layer_norm -- [--rows 8192] [--n 768]
//!   [--half bf16|f16|f32] [--iters 100] [--device cuda|cpu]
//! Prints one JSON line: microseconds per call (calls queued back to back, the device
//! synchronised once around them) and the forward's bytes over its time. The kernels alone
//! are in `FERROGRAD_KERNEL_TIMES=1`'s table.

use ferrograd::autograd::{GradOptions, grad, no_grad};
use ferrograd::{DType, Device, Tensor};

mod common;
use common::{arg, queued_s};

fn main() -> ferrograd::Result<()> {
    let (rows, n, iters) = (
        arg("--rows", 8192usize),
        arg("--n", 768usize),
        arg("--iters", 100usize),
    );
    let half = match arg("--half", "bf16".to_string()).as_str() {
        "f16" => DType::F16,
        "f32" => DType::F32,
        _ => DType::BF16,
    };
    let dev: Device = arg("--device", "cuda".to_string()).parse()?;
    let leaf = |shape: &[usize], dtype| Tensor::randn(shape, dtype, dev)?.requires_grad_(true);
    let (x, h) = (leaf(&[rows, n], DType::F32)?, leaf(&[rows, n], half)?);
    let (w, b) = (leaf(&[n], DType::F32)?, leaf(&[n], DType::F32)?);
    let (gs, gy) = (
        Tensor::randn(&[rows, n], DType::F32, dev)?,
        Tensor::randn(&[rows, n], half, dev)?,
    );
    let norm = || x.add_layer_norm_to(&h, &[n], Some(&w), Some(&b), 1e-5, half);
    let forward = || {
        let _no_grad = no_grad();
        norm().map(|_| ())
    };
    let both = || {
        let (s, y) = norm()?;
        let opts = GradOptions {
            grad_outputs: vec![gs.clone(), gy.clone()],
            ..Default::default()
        };
        grad(&[&s, &y], &[&x, &h, &w, &b], opts).map(|_| ())
    };
    let fwd_us = queued_s(dev, iters, &forward)? * 1e6;
    let both_us = queued_s(dev, iters, &both)? * 1e6;
    // Forward: x and h read, s and y written (the statistics are a few bytes a row).
    let fwd_bytes = rows * n * (2 * DType::F32.size_in_bytes() + 2 * half.size_in_bytes());
    println!(
        "{{\"impl\":\"ferrograd\",\"rows\":{rows},\"n\":{n},\"half\":\"{half}\",\"device\":\"{dev}\",\"fwd_us\":{fwd_us:.1},\"fwd_bwd_us\":{both_us:.1},\"fwd_gb_per_s\":{:.0}}}",
        fwd_bytes as f64 / fwd_us / 1e3
    );
    Ok(())
}
