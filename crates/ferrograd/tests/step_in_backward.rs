//! Strategies that change when gradients exist: the optimizer step in backward (the same
//! parameters as backward + step + zero_grad, with gradients freed as they are used, so the
//! backward peak drops by one layer's gradients) and gradient accumulation (the same
//! gradients as one large batch with one micro-batch of activations at the peak).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

mod fused_nets;
use fused_nets::{Net, data_as, loss_of, momentum_cfg};

use ferrograd::amp::{AmpDType, autocast};
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
    let (x, y) = data_as(b, d, DType::F32, CPU);
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
    let (x, y) = data_as(b, d, DType::F32, CPU);
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
    let (x, y) = data_as(b, d, DType::F32, CPU);
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

// ---- the fused SGD step (linear weight gradients written into the momentum buffers) -------

/// Two linear layers' parameters [w1, b1, w2, b2] in `dtype`.
fn layers(d: usize, dtype: DType, device: Device) -> Vec<Tensor> {
    let mut g = Generator::new(0);
    let mut ps = Vec::new();
    for _ in 0..2 {
        let l = Linear::new_with_dtype(d, d, true, dtype, device, &mut g).unwrap();
        ps.extend(l.parameters());
    }
    ps
}

fn values_f64(ps: &[Tensor]) -> Vec<Vec<f64>> {
    ps.iter().map(|p| p.to_vec::<f64>().unwrap()).collect()
}

fn max_rel_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
        .fold(0.0, f64::max)
}

/// Three ordinary steps (backward; step; zero_grad); the parameters and momentum buffers.
fn ordinary_steps(net: Net, cfg: SgdConfig, d: usize, b: usize) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let ps = layers(d, DType::F64, CPU);
    let (x, y) = data_as(b, d, DType::F64, CPU);
    let mut opt = Sgd::new(ps.clone(), cfg).unwrap();
    for _ in 0..3 {
        loss_of(net, &ps, &x, &y).backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad().unwrap();
    }
    let bufs = (0..ps.len())
        .map(|i| opt.momentum_buffer(i).unwrap().to_vec::<f64>().unwrap())
        .collect();
    (values_f64(&ps), bufs)
}

/// A counter of the ordinary gradient accumulations of the weights (layers 0 and 2) of `ps`.
fn count_weight_grads(ps: &[Tensor]) -> Arc<AtomicUsize> {
    let accumulated = Arc::new(AtomicUsize::new(0));
    for w in [&ps[0], &ps[2]] {
        let n = Arc::clone(&accumulated);
        w.register_post_accumulate_grad_hook(move |_| {
            n.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
        .unwrap();
    }
    accumulated
}

/// Three steps with `install_fused`; also counts the weights' ordinary gradient accumulations.
fn fused_steps(
    net: Net,
    cfg: SgdConfig,
    d: usize,
    b: usize,
) -> (Vec<Vec<f64>>, Vec<Vec<f64>>, usize) {
    let ps = layers(d, DType::F64, CPU);
    let (x, y) = data_as(b, d, DType::F64, CPU);
    let accumulated = count_weight_grads(&ps);
    let sib = StepInBackward::install_fused(Sgd::new(ps.clone(), cfg).unwrap()).unwrap();
    for _ in 0..3 {
        loss_of(net, &ps, &x, &y).backward().unwrap();
        assert!(
            ps.iter().all(|p| p.grad().is_none()),
            "{net:?}: no .grad left"
        );
        let grads = memory::memory_by_category(CPU).unwrap();
        assert_eq!(grads.get(ferrograd::Category::Gradient), 0, "{net:?}");
    }
    let bufs = sib
        .with_optimizer(|o| {
            (0..ps.len())
                .map(|i| o.momentum_buffer(i).unwrap().to_vec::<f64>().unwrap())
                .collect()
        })
        .unwrap();
    let n = accumulated.load(Ordering::Relaxed);
    (values_f64(&ps), bufs, n)
}

#[test]
fn fused_sgd_matches_the_ordinary_step_in_f64() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (d, b) = (48, 8);
    for net in [Net::Mlp, Net::SharedWeight, Net::MixedUse] {
        let (want, want_bufs) = ordinary_steps(net, momentum_cfg(), d, b);
        let (got, got_bufs, accumulated) = fused_steps(net, momentum_cfg(), d, b);
        let (dp, db) = (
            max_rel_diff(&got, &want),
            max_rel_diff(&got_bufs, &want_bufs),
        );
        assert!(dp < 1e-12, "{net:?}: parameters differ by {dp}");
        assert!(db < 1e-12, "{net:?}: momentum buffers differ by {db}");
        // The weights' linear gradients never became a .grad: with the L2 term, w2 gets one
        // ordinary gradient per step (its L2 part), and w1 none.
        let want_acc = match net {
            Net::MixedUse => 3,
            _ => 0,
        };
        assert_eq!(accumulated, want_acc, "{net:?}");
        // And the parameters did move: the fused path is not a no-op.
        let (init, _) = ordinary_steps(
            net,
            SgdConfig {
                lr: 0.0,
                ..momentum_cfg()
            },
            d,
            b,
        );
        assert!(max_rel_diff(&got, &init) > 1e-6, "{net:?}");
    }
}

/// Three steps of `net` on f32 layers with each forward in a bf16 autocast region, the
/// ordinary way or fused; the parameters and how many ordinary gradients the weights took.
fn autocast_steps(net: Net, fused: bool, d: usize, b: usize) -> (Vec<Vec<f64>>, usize) {
    let ps = layers(d, DType::F32, CPU);
    let (x, y) = data_as(b, d, DType::F32, CPU);
    let accumulated = count_weight_grads(&ps);
    let sgd = Sgd::new(ps.clone(), momentum_cfg()).unwrap();
    let (mut ordinary, _sib) = match fused {
        true => (None, Some(StepInBackward::install_fused(sgd).unwrap())),
        false => (Some(sgd), None),
    };
    for _ in 0..3 {
        let loss = {
            let _amp = autocast(AmpDType::BF16);
            loss_of(net, &ps, &x, &y)
        };
        loss.backward().unwrap();
        if let Some(opt) = ordinary.as_mut() {
            opt.step().unwrap();
            opt.zero_grad().unwrap();
        }
    }
    (values_f64(&ps), accumulated.load(Ordering::Relaxed))
}

/// Under autocast a weight's gradient is offered as the product of two bf16 factors for an
/// f32 parameter: the fused step sums it in f32 into the f32 momentum buffer (the weights
/// take no ordinary gradient), and the parameters follow the ordinary steps, whose f32
/// weight gradients come from the same f32-output GEMM.
#[test]
fn fused_sgd_takes_the_bf16_factors_of_f32_weights_under_autocast() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (d, b) = (32, 8);
    for net in [Net::Mlp, Net::SharedWeight] {
        let (want, ordinary_grads) = autocast_steps(net, false, d, b);
        // Ordinary: w1 and w2 each take their gradient once per backward.
        assert_eq!(ordinary_grads, 6, "{net:?}");
        let (got, fused_grads) = autocast_steps(net, true, d, b);
        assert_eq!(
            fused_grads, 0,
            "{net:?}: a weight took an ordinary gradient"
        );
        let diff = max_rel_diff(&got, &want);
        assert!(diff < 1e-6, "{net:?}: parameters differ by {diff}");
    }
}

#[test]
fn fused_sgd_falls_back_to_the_plain_strategy_when_not_linear() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (d, b) = (32, 8);
    let cfgs = [
        SgdConfig {
            nesterov: true,
            ..momentum_cfg()
        },
        SgdConfig {
            weight_decay: 1e-2,
            ..momentum_cfg()
        },
        SgdConfig {
            dampening: 0.1,
            ..momentum_cfg()
        },
        SgdConfig {
            momentum: 0.0,
            ..momentum_cfg()
        },
    ];
    for cfg in cfgs {
        assert!(!Sgd::new(Vec::new(), cfg.clone()).unwrap().fusable());
        let (x, y) = data_as(b, d, DType::F32, CPU);
        let (m1, m2) = (model(d), model(d));
        let (want, _) = ordinary(Sgd::new(m1.parameters(), cfg.clone()).unwrap(), &m1, &x, &y);
        let _sib =
            StepInBackward::install_fused(Sgd::new(m2.parameters(), cfg.clone()).unwrap()).unwrap();
        for _ in 0..3 {
            m2.forward(&x)
                .unwrap()
                .mse_loss(&y)
                .unwrap()
                .backward()
                .unwrap();
            assert!(m2.parameters().iter().all(|p| p.grad().is_none()));
        }
        assert_eq!(
            values(&m2),
            want,
            "bit-identical to the ordinary step: {cfg:?}"
        );
    }
}

#[test]
fn fused_sgd_lowers_the_peak_by_the_weight_gradient() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (d, b) = (128, 16);
    let (x, y) = data_as(b, d, DType::F32, CPU);
    let (m1, m2) = (model(d), model(d));
    let (want, peak_sib) = in_backward(
        Sgd::new(m1.parameters(), momentum_cfg()).unwrap(),
        &m1,
        &x,
        &y,
    );
    let sib =
        StepInBackward::install_fused(Sgd::new(m2.parameters(), momentum_cfg()).unwrap()).unwrap();
    let mut peak = 0;
    for _ in 0..3 {
        let loss = m2.forward(&x).unwrap().mse_loss(&y).unwrap();
        memory::reset_peak_memory_stats(CPU).unwrap();
        loss.backward().unwrap();
        peak = memory::max_memory_allocated(CPU).unwrap();
        assert!(m2.parameters().iter().all(|p| p.grad().is_none()));
    }
    // Same parameters (f32: the GEMM adds into the buffer instead of after it).
    for (g, w) in values(&m2).iter().flatten().zip(want.iter().flatten()) {
        assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{g} vs {w}");
    }
    // The plain strategy's peak is the second layer's backward with its (d, d) weight
    // gradient alive; the fused one has the same tensors there but that gradient.
    let weight_grad = (d * d * 4) as u64;
    assert_eq!(
        peak,
        peak_sib - weight_grad,
        "fused {peak} vs plain {peak_sib}"
    );
    // Dropping the strategy removes the sinks: gradients are ordinary again.
    drop(sib);
    m2.forward(&x)
        .unwrap()
        .mse_loss(&y)
        .unwrap()
        .backward()
        .unwrap();
    assert!(m2.parameters().iter().all(|p| p.grad().is_some()));
}
