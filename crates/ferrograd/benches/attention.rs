//! Benchmark: fused causal attention alone, forward and forward + backward, from a (B, T, 3C)
//! QKV projection output, in milliseconds per call and TFLOP/s (the causal half of the
//! 4·B·H·T²·D forward FLOPs; backward counted as 2.5 forwards, as FlashAttention-2 counts
//! it). The PyTorch twin is benches/pytorch/attention.py (scaled_dot_product_attention).
//!
//! Usage: cargo bench -p ferrograd --bench attention -- [--batch 8] [--heads 12] [--seq 1024]
//!   [--head-dim 64] [--dtype bf16|f16|f32] [--iters 50] [--device cuda|cpu] [--dropout 0]
//! `--dropout P`: dropout on the probabilities, inside the kernels (a new mask every call).
//! Each is timed two ways: the median of single calls the host waits for (`*_ms`), and calls
//! queued back to back (`*_queued_ms`: the device's own time per call, host overhead hidden).
//! Prints one JSON line.

use std::time::Instant;

use ferrograd::backend::synchronize;
use ferrograd::{BackwardOptions, DType, Device, Generator, Tensor};

mod common;
use common::{arg, queued_s, warm_up};

/// Median of `iters` timings of `f`, in milliseconds, after three warm-up calls.
fn median_ms(
    dev: Device,
    iters: usize,
    f: &dyn Fn() -> ferrograd::Result<()>,
) -> ferrograd::Result<f64> {
    warm_up(f)?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        synchronize(dev)?;
        let t0 = Instant::now();
        f()?;
        synchronize(dev)?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn main() -> ferrograd::Result<()> {
    let (b, h, t, d) = (
        arg("--batch", 8usize),
        arg("--heads", 12usize),
        arg("--seq", 1024usize),
        arg("--head-dim", 64usize),
    );
    let iters = arg("--iters", 50usize);
    let dtype: DType = match arg("--dtype", "bf16".to_string()).as_str() {
        "f16" => DType::F16,
        "f32" => DType::F32,
        _ => DType::BF16,
    };
    let dev: Device = arg("--device", "cuda".to_string()).parse()?;
    let dropout = arg("--dropout", 0.0f64);
    let rng = std::cell::RefCell::new(Generator::new(0));
    let c = h * d;
    let qkv = Tensor::randn(&[b, t, 3 * c], dtype, dev)?.requires_grad_(true)?;
    let gout = Tensor::randn(&[b, t, c], dtype, dev)?;
    let attention = || qkv.causal_attention_dropout(h, dropout, &mut rng.borrow_mut());
    let forward = || attention().map(|_| ());
    let both = || {
        let out = attention()?;
        out.backward_with(BackwardOptions {
            gradient: Some(gout.clone()),
            ..Default::default()
        })?;
        qkv.set_grad(None)
    };
    let fwd_ms = median_ms(dev, iters, &forward)?;
    let both_ms = median_ms(dev, iters, &both)?;
    let fwd_queued_ms = queued_s(dev, iters, &forward)? * 1e3;
    let both_queued_ms = queued_s(dev, iters, &both)? * 1e3;
    let flops = 4.0 * (b * h * t * t * d) as f64 / 2.0;
    println!(
        "{{\"impl\":\"ferrograd\",\"batch\":{b},\"heads\":{h},\"seq\":{t},\"head_dim\":{d},\"dtype\":\"{dtype}\",\"dropout\":{dropout},\"fwd_ms\":{fwd_ms:.4},\"fwd_bwd_ms\":{both_ms:.4},\"fwd_queued_ms\":{fwd_queued_ms:.4},\"fwd_bwd_queued_ms\":{both_queued_ms:.4},\"fwd_tflops\":{:.1},\"fwd_bwd_tflops\":{:.1}}}",
        flops / fwd_ms / 1e9,
        3.5 * flops / both_ms / 1e9
    );
    Ok(())
}
