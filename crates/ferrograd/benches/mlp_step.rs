//! Benchmark: one training step of Linear(d,d)-ReLU-Linear(d,d) (forward, MSE loss, backward,
//! SGD-momentum step, zero_grad) at batch B, f32. Prints the median step time over N steps
//! after warm-up, and the peak bytes of a step. The PyTorch twin is benches/pytorch/mlp_step.py;
//! scripts/bench_mlp_step.sh runs both side by side.
//!
//! Usage: cargo bench --bench mlp_step -- [--dim 2048] [--batch 256] [--steps 20] [--device cuda]

use std::time::Instant;

use ferrograd::nn::{Linear, Module, Relu, Sequential};
use ferrograd::optim::{Optimizer, Sgd, SgdConfig};
use ferrograd::{DType, Device, Generator, Tensor, memory};

mod common;
use common::arg;

fn main() -> ferrograd::Result<()> {
    let (d, b, steps) = (arg("--dim", 2048), arg("--batch", 256), arg("--steps", 20));
    let args: Vec<String> = std::env::args().collect();
    let dev: Device = match args.iter().position(|a| a == "--device") {
        Some(i) => args
            .get(i + 1)
            .map(String::as_str)
            .unwrap_or("cpu")
            .parse()?,
        None => Device::Cpu,
    };
    let mut g = Generator::new(0);
    let model = Sequential::new()
        .push(Linear::new(d, d, true, dev, &mut g)?)
        .push(Relu)
        .push(Linear::new(d, d, true, dev, &mut g)?);
    let cfg = SgdConfig {
        lr: 1e-3,
        momentum: 0.9,
        ..Default::default()
    };
    let mut opt = Sgd::new(model.parameters(), cfg)?;
    let x = Tensor::randn_with(&[b, d], DType::F32, dev, &mut g)?;
    let y = Tensor::randn_with(&[b, d], DType::F32, dev, &mut g)?;
    let mut times = Vec::with_capacity(steps);
    for i in 0..steps + 3 {
        if i == 3 {
            memory::reset_peak_memory_stats(dev)?;
        }
        ferrograd::backend::synchronize(dev)?;
        let t0 = Instant::now();
        let loss = model.forward(&x)?.mse_loss(&y)?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad()?;
        ferrograd::backend::synchronize(dev)?;
        if i >= 3 {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    println!(
        "ferrograd mlp_step d={d} B={b} device={dev} threads={} median_ms={median:.2} min_ms={:.2} peak_bytes={}",
        rayon::current_num_threads(),
        times[0],
        memory::max_memory_allocated(dev)?
    );
    Ok(())
}
