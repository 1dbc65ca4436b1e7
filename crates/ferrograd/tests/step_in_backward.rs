//! Strategies that change when gradients exist: the optimizer step in backward (the same
//! parameters as backward + step + zero_grad, with gradients freed as they are used, so the
//! backward peak drops by one layer's gradients) and gradient accumulation (the same
//! gradients as one large batch with one micro-batch of activations at the peak).

use std::sync::Mutex;

use ferrograd::nn::{Linear, Module, Relu, Sequential};
use ferrograd::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};
use ferrograd::train::StepInBackward;
use ferrograd::{DType, Device, Generator, Tensor, memory};

const CPU: Device = Device::Cpu;
static LOCK: Mutex<()> = Mutex::new(());

fn model(d: usize) -> Sequential {
    let mut g = Generator::new(0);
    Sequential::new()
        .push(Linear::new(d, d, true, CPU, &mut g).unwrap())
        .push(Relu)
        .push(Linear::new(d, d, true, CPU, &mut g).unwrap())
}

fn data(b: usize, d: usize) -> (Tensor, Tensor) {
    let mut g = Generator::new(1);
    (
        Tensor::randn_with(&[b, d], DType::F32, CPU, &mut g).unwrap(),
        Tensor::randn_with(&[b, d], DType::F32, CPU, &mut g).unwrap(),
    )
}

fn values(m: &Sequential) -> Vec<Vec<f32>> {
    m.parameters()
        .iter()
        .map(|p| p.to_vec::<f32>().unwrap())
        .collect()
}

/// Three steps the ordinary way; returns the parameters and the last backward's peak.
fn ordinary(
    mut opt: impl Optimizer,
    m: &Sequential,
    x: &Tensor,
    y: &Tensor,
) -> (Vec<Vec<f32>>, u64) {
    let mut peak = 0;
    for _ in 0..3 {
        let loss = m.forward(x).unwrap().mse_loss(y).unwrap();
        memory::reset_peak_memory_stats(CPU).unwrap();
        loss.backward().unwrap();
        peak = memory::max_memory_allocated(CPU).unwrap();
        opt.step().unwrap();
        opt.zero_grad().unwrap();
    }
    (values(m), peak)
}

fn in_backward<O: Optimizer + Send + 'static>(
    opt: O,
    m: &Sequential,
    x: &Tensor,
    y: &Tensor,
) -> (Vec<Vec<f32>>, u64) {
    let _sib = StepInBackward::install(opt).unwrap();
    let mut peak = 0;
    for _ in 0..3 {
        let loss = m.forward(x).unwrap().mse_loss(y).unwrap();
        memory::reset_peak_memory_stats(CPU).unwrap();
        loss.backward().unwrap();
        peak = memory::max_memory_allocated(CPU).unwrap();
        assert!(
            m.parameters().iter().all(|p| p.grad().is_none()),
            "gradients are freed as they are used"
        );
    }
    (values(m), peak)
}

#[test]
fn sgd_momentum_matches_the_ordinary_step_and_lowers_the_peak() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (d, b) = (128, 16);
    let (x, y) = data(b, d);
    let cfg = SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        ..Default::default()
    };
    let (m1, m2) = (model(d), model(d));
    let (want, peak_ordinary) =
        ordinary(Sgd::new(m1.parameters(), cfg.clone()).unwrap(), &m1, &x, &y);
    let (got, peak_sib) = in_backward(Sgd::new(m2.parameters(), cfg).unwrap(), &m2, &x, &y);
    assert_eq!(got, want, "bit-identical parameters after 3 steps");
    // Ordinary: the peak comes at the end of backward, with both layers' gradients alive.
    // In backward: the second layer's gradients are freed before the first layer's exist; the
    // peak moves to the second layer's backward, where two (B, d) activation gradients are
    // alive instead. So it drops by one layer's gradients minus those two activations.
    let (layer_grads, act) = (((d * d + d) * 4) as u64, (b * d * 4) as u64);
    assert!(
        peak_sib + layer_grads - 2 * act <= peak_ordinary,
        "peak in backward {peak_sib} vs ordinary {peak_ordinary}"
    );
}

#[test]
fn adamw_matches_the_ordinary_step() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (d, b) = (64, 8);
    let (x, y) = data(b, d);
    let cfg = AdamConfig::adamw_default();
    let (m1, m2) = (model(d), model(d));
    let (want, _) = ordinary(
        Adam::adamw(m1.parameters(), cfg.clone()).unwrap(),
        &m1,
        &x,
        &y,
    );
    let (got, _) = in_backward(Adam::adamw(m2.parameters(), cfg).unwrap(), &m2, &x, &y);
    assert_eq!(got, want);
}

// ---- gradient accumulation ----------------------------------------------------------------

#[test]
fn accumulation_matches_one_large_batch_with_a_smaller_peak() {
    use ferrograd::train::accumulate_gradients;
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (d, b, n) = (32, 256, 4);
    let (x, y) = data(b, d);
    let grads = |m: &Sequential| -> Vec<Vec<f32>> {
        m.parameters()
            .iter()
            .map(|p| p.grad().unwrap().to_vec::<f32>().unwrap())
            .collect()
    };
    // One batch of 32.
    let m1 = model(d);
    memory::reset_peak_memory_stats(CPU).unwrap();
    let base = memory::memory_allocated(CPU).unwrap();
    m1.forward(&x)
        .unwrap()
        .mse_loss(&y)
        .unwrap()
        .backward()
        .unwrap();
    let peak_full = memory::max_memory_allocated(CPU).unwrap() - base;
    let want = grads(&m1);
    drop(m1);
    // Four micro-batches of 8, each loss scaled by 1/4.
    let m2 = model(d);
    let mb = b / n;
    memory::reset_peak_memory_stats(CPU).unwrap();
    let base = memory::memory_allocated(CPU).unwrap();
    accumulate_gradients(n, |i| {
        let (xi, yi) = (
            x.narrow(0, i * mb, mb)?.contiguous()?,
            y.narrow(0, i * mb, mb)?.contiguous()?,
        );
        m2.forward(&xi)?.mse_loss(&yi)
    })
    .unwrap();
    let peak_accum = memory::max_memory_allocated(CPU).unwrap() - base;
    for (g, w) in grads(&m2).iter().zip(&want) {
        let diff = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(diff < 1e-6, "accumulated gradient differs by {diff}");
    }
    // Activations: three (B, d) tensors at the full batch's peak, three (B/n, d) with
    // accumulation. Accumulating costs one in-flight copy of the gradients (the new one is
    // made before it is added into .grad), which matters only when weights outweigh
    // activations.
    let act = |rows: usize| (3 * rows * d * 4) as u64;
    let grad_bytes = (2 * (d * d + d) * 4) as u64;
    assert!(
        peak_accum + act(b) - act(mb) <= peak_full + grad_bytes,
        "{peak_accum} vs {peak_full}"
    );
    assert!(peak_accum < peak_full, "{peak_accum} vs {peak_full}");
}
