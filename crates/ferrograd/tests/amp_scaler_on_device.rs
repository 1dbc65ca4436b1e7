//! The GradScaler with its decision kept on the device (`stage_on`, `step_on_device`,
//! `update_on_device`), as a GPU step runs it without reading anything back, against the
//! host path that reads the inf/NaN check before stepping: the same skips, scales, step
//! counts and parameters, bit for bit, through the Trainer and by hand; Adam's step count
//! kept on the device (a skipped step leaving no trace, the counts read only when settled,
//! the parameters that step together changing); the unscale reading 1/scale from device
//! memory; the scale's update there; and the errors. On the CPU backend, which implements
//! the same kernels' contract (gpu_amp_scaler.rs runs the GPU's).

mod common;

use std::sync::Mutex;

use ferrograd::backend::View;
use ferrograd::backend::optim::{UnscaleCheck, next_scale, unscale_check};
use ferrograd::nn::{Linear, Module, Relu, Sequential};
use ferrograd::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};
use ferrograd::train::{
    GradScaler, GradScalerConfig, LossScaling, MicroBatch, StepReport, Trainer, TrainerConfig,
};
use ferrograd::{DType, Device, Generator, Tensor};

const CPU: Device = Device::Cpu;
static LOCK: Mutex<()> = Mutex::new(());

fn mlp(seed: u64) -> Sequential {
    let mut g = Generator::new(seed);
    Sequential::new()
        .push(Linear::new(8, 16, true, CPU, &mut g).unwrap())
        .push(Relu)
        .push(Linear::new(16, 4, true, CPU, &mut g).unwrap())
}

fn data() -> (Tensor, Tensor) {
    let mut g = Generator::new(99);
    (
        Tensor::randn_with(&[8, 8], DType::F32, CPU, &mut g).unwrap(),
        Tensor::randn_with(&[8, 4], DType::F32, CPU, &mut g).unwrap(),
    )
}

fn adamw(params: Vec<Tensor>) -> Adam {
    let cfg = AdamConfig {
        lr: 1e-2,
        ..AdamConfig::adamw_default()
    };
    Adam::adamw(params, cfg).unwrap()
}

fn bits(params: &[Tensor]) -> Vec<Vec<u32>> {
    params
        .iter()
        .map(|p| {
            p.to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        })
        .collect()
}

/// Steps poisoned with inf·loss (every gradient inf or NaN, as an f16 overflow makes them).
const POISONED: [usize; 4] = [0, 3, 4, 8];

/// (stepped, scale) of each of 11 f16 trainer steps with clipping, the parameters' bits and
/// the optimizer's counts after them (`counts`); `staged`: the scaler keeps its decision on
/// the device, and nothing is read back until the steps are done.
type Outcome = (Vec<(bool, Option<f64>)>, Vec<Vec<u32>>, Vec<u64>);

fn train<O: Optimizer + Send + 'static>(
    staged: bool,
    optimizer: fn(Vec<Tensor>) -> O,
    counts: fn(&O) -> Vec<u64>,
) -> Outcome {
    let model = mlp(1);
    let config = TrainerConfig {
        amp: Some(DType::F16),
        clip: Some(0.5),
        ..TrainerConfig::default()
    };
    let mut trainer = Trainer::new(optimizer(model.parameters()), config, CPU).unwrap();
    let scaler = trainer.scaler_mut().unwrap();
    *scaler = GradScaler::with_config(GradScalerConfig {
        init_scale: 1024.0,
        growth_interval: 2,
        ..GradScalerConfig::default()
    })
    .unwrap();
    if staged {
        scaler.stage_on(CPU).unwrap();
    }
    let (x, y) = data();
    let mut reports = Vec::new();
    for k in 0..11 {
        let report = trainer
            .step(|_| {
                let loss = model.forward(&x)?.mse_loss(&y)?;
                let loss = if POISONED.contains(&k) {
                    loss.mul_scalar(f64::INFINITY)?
                } else {
                    loss
                };
                Ok(MicroBatch { loss, tokens: 8 })
            })
            .unwrap();
        reports.push(report);
    }
    // Read after the last step: each report kept its own step's verdict and scale.
    let pending = |r: &StepReport| !r.loss_scale.as_ref().unwrap().is_read();
    assert_eq!(reports.iter().all(pending), staged);
    let reports = reports
        .iter()
        .map(|r| (r.stepped().unwrap(), r.scale().unwrap()))
        .collect();
    let counts = trainer.with_optimizer(|o| counts(o)).unwrap();
    (reports, bits(&model.parameters()), counts)
}

/// Adam's step count, then each parameter's.
fn adam_counts(o: &Adam) -> Vec<u64> {
    let mut c = vec![o.step_count()];
    c.extend((0..o.params().len()).map(|i| o.state(i).map_or(0, |s| s.step)));
    c
}

fn sgd_momentum(params: Vec<Tensor>) -> Sgd {
    let cfg = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.1,
        weight_decay: 1e-3,
        nesterov: false,
    };
    Sgd::new(params, cfg).unwrap()
}

/// 1 for each parameter whose momentum buffer has taken its first step.
fn sgd_buffers(o: &Sgd) -> Vec<u64> {
    (0..o.params().len())
        .map(|i| o.momentum_buffer(i).is_some() as u64)
        .collect()
}

#[test]
fn a_trainer_whose_scaler_decides_on_the_device_trains_bit_for_bit_as_the_host_path() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let host = train(false, adamw, adam_counts);
    let device = train(true, adamw, adam_counts);
    // The host path itself: poisoned steps skipped with the scale halved, growth after two
    // clean steps in a row.
    let stepped: Vec<bool> = host.0.iter().map(|r| r.0).collect();
    let want: Vec<bool> = (0..11).map(|k| !POISONED.contains(&k)).collect();
    assert_eq!(stepped, want);
    let scales: Vec<f64> = host.0.iter().map(|r| r.1.unwrap()).collect();
    assert_eq!(
        scales,
        [
            512.0, 512.0, 1024.0, 512.0, 256.0, 256.0, 512.0, 512.0, 256.0, 256.0, 512.0
        ]
    );
    // Adam counted the seven steps that ran, nothing else.
    assert!(host.2.iter().all(|&c| c == 7), "{:?}", host.2);
    assert_eq!(device.0, host.0, "stepped and scale per step");
    assert_eq!(device.2, host.2, "Adam's step counts");
    assert_eq!(device.1, host.1, "parameters");
}

/// SGD with momentum and dampening through the Trainer, its skips decided on the device:
/// the first step is poisoned (its buffers are made, then dropped when read), and every
/// step, the scales and the buffers match the host path's.
#[test]
fn sgd_through_the_trainer_skips_on_the_device_as_the_host_path_does() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let host = train(false, sgd_momentum, sgd_buffers);
    let device = train(true, sgd_momentum, sgd_buffers);
    let stepped: Vec<bool> = host.0.iter().map(|r| r.0).collect();
    let want: Vec<bool> = (0..11).map(|k| !POISONED.contains(&k)).collect();
    assert_eq!(stepped, want);
    assert_eq!(host.2, vec![1; 4], "every buffer stepped");
    assert_eq!(device.0, host.0, "stepped and scale per step");
    assert_eq!(device.2, host.2, "buffers");
    assert_eq!(device.1, host.1, "parameters");
}

fn flag(v: f32) -> Tensor {
    Tensor::from_vec(vec![v], &[1], CPU).unwrap()
}

/// Two parameters and an AdamW over them; `grads` sets their gradients (None: no gradient).
fn two_params() -> (Vec<Tensor>, Adam) {
    let p = vec![
        Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3], CPU).unwrap(),
        Tensor::from_vec(vec![-1.0f32, 0.5], &[2], CPU).unwrap(),
    ];
    let p: Vec<Tensor> = p
        .into_iter()
        .map(|t| t.requires_grad_(true).unwrap())
        .collect();
    let opt = adamw(p.clone());
    (p, opt)
}

/// Gradients of step k for the parameters that have one this step (`with`).
fn set_grads(p: &[Tensor], k: usize, with: [bool; 2]) {
    for (i, t) in p.iter().enumerate() {
        let n = t.numel();
        let g: Vec<f32> = (0..n)
            .map(|j| ((k * 7 + i * 3 + j) % 5) as f32 - 1.5)
            .collect();
        let g = with[i].then(|| Tensor::from_vec(g, &[n], CPU).unwrap());
        t.set_grad(g).unwrap();
    }
}

#[test]
fn a_skipped_first_adam_step_leaves_no_trace() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (p, mut opt) = two_params();
    let before = bits(&p);
    set_grads(&p, 0, [true, true]);
    opt.step_unless_found_inf(&flag(1.0)).unwrap();
    assert_eq!(bits(&p), before, "the raised flag skipped the update");
    opt.settle_counts().unwrap();
    assert_eq!(opt.step_count(), 0);
    assert!((0..2).all(|i| opt.state(i).unwrap().step == 0));
    let zeros = |t: &Tensor| t.to_vec::<f32>().unwrap().iter().all(|&v| v == 0.0);
    assert!((0..2).all(|i| zeros(&opt.state(i).unwrap().exp_avg)));

    // The next, clean step is an untouched Adam's first step.
    opt.step_unless_found_inf(&flag(0.0)).unwrap();
    let (fresh, mut plain) = two_params();
    set_grads(&fresh, 0, [true, true]);
    plain.step().unwrap();
    assert_eq!(bits(&p), bits(&fresh));
    opt.settle_counts().unwrap();
    assert_eq!(opt.step_count(), 1);
    assert!((0..2).all(|i| opt.state(i).unwrap().step == 1));
}

/// Steps `opt` through `plan` (flag, which parameters have a gradient) with
/// `step_unless_found_inf`, and `host`, over twins of the same parameters, with `step()`
/// exactly when the flag is clear: the parameters' bits match after every step. `after(k,
/// opt)` runs after step k.
fn against_the_host<O: Optimizer>(
    plan: &[(f32, [bool; 2])],
    (p, opt): (&[Tensor], &mut O),
    (q, host): (&[Tensor], &mut O),
    mut after: impl FnMut(usize, &mut O),
) {
    for (k, &(f, with)) in plan.iter().enumerate() {
        set_grads(p, k, with);
        set_grads(q, k, with);
        opt.step_unless_found_inf(&flag(f)).unwrap();
        if f == 0.0 {
            host.step().unwrap();
        }
        assert_eq!(bits(p), bits(q), "step {k}");
        after(k, opt);
    }
}

/// Steps that the device may skip keep their count there: the host's counts move only when
/// settled, the bias corrections follow the steps that ran, and when the parameters with
/// gradients change the count is read and made again (or, at different counts, the host's
/// counts step and read the flag). Every step matches an Adam stepped on the host, which
/// steps exactly when the flag is clear.
#[test]
fn adams_step_count_stays_on_the_device_until_settled() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (p, mut opt) = two_params();
    let (q, mut host) = two_params();
    // (flag, which parameters have a gradient)
    let plan: [(f32, [bool; 2]); 9] = [
        (0.0, [true, true]),
        (1.0, [true, true]),
        (0.0, [true, true]),
        (0.0, [true, true]),
        // p1 without a gradient: the count is read and made again for p0 alone.
        (0.0, [true, false]),
        (1.0, [true, false]),
        // Both again, at counts 4 and 3: the host's counts, reading the flag.
        (0.0, [true, true]),
        (1.0, [true, true]),
        (0.0, [true, true]),
    ];
    against_the_host(&plan, (&p, &mut opt), (&q, &mut host), |k, opt| {
        if k == 3 {
            // Three steps ran; the host has not read the device's count yet.
            assert_eq!(opt.step_count(), 0);
            opt.settle_counts().unwrap();
            assert_eq!(opt.step_count(), 3);
            assert!((0..2).all(|i| opt.state(i).unwrap().step == 3));
        }
    });
    opt.settle_counts().unwrap();
    let counts = |o: &Adam| (o.step_count(), [0, 1].map(|i| o.state(i).unwrap().step));
    assert_eq!(counts(&host), (6, [6, 5]));
    assert_eq!(counts(&opt), counts(&host));
    // A plain step after them reads the count first and goes on from it.
    set_grads(&p, 9, [true, true]);
    set_grads(&q, 9, [true, true]);
    opt.step().unwrap();
    host.step().unwrap();
    assert_eq!(bits(&p), bits(&q));
    assert_eq!(counts(&opt), (7, [7, 6]));
}

/// SGD's skippable steps by hand: a momentum buffer's first step is whatever step first ran,
/// as the device counts it; a buffer made for a skipped first step is not shown once settled;
/// a parameter that gains a gradient while the others have stepped takes the host's path
/// (reading the flag). Every step matches an SGD stepped on the host exactly when the flag
/// is clear.
#[test]
fn sgds_first_momentum_step_is_decided_on_the_device() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (p, _) = two_params();
    let (q, _) = two_params();
    let mut opt = sgd_momentum(p.clone());
    let mut host = sgd_momentum(q.clone());
    // (flag, which parameters have a gradient)
    let plan: [(f32, [bool; 2]); 9] = [
        (1.0, [true, false]),
        (1.0, [true, false]),
        (0.0, [true, false]),
        // p1 arrives beside a p0 that has stepped: the host's path, reading the flag.
        (1.0, [true, true]),
        (0.0, [true, true]),
        (1.0, [true, true]),
        (0.0, [true, true]),
        (0.0, [false, true]),
        (0.0, [true, true]),
    ];
    against_the_host(&plan, (&p, &mut opt), (&q, &mut host), |k, opt| {
        if k == 1 {
            // Two skipped first steps: p0's buffer exists on the device, unwritten.
            opt.settle_counts().unwrap();
            assert!(opt.momentum_buffer(0).is_none());
        }
    });
    // A step with no gradient at all changes nothing and counts nothing.
    set_grads(&p, 9, [false, false]);
    let before = bits(&p);
    opt.step_unless_found_inf(&flag(0.0)).unwrap();
    assert_eq!(bits(&p), before);
    opt.settle_counts().unwrap();
    for i in 0..2 {
        let (got, want) = (opt.momentum_buffer(i), host.momentum_buffer(i));
        assert_eq!(
            got.map(|b| bits(std::slice::from_ref(b))),
            want.map(|b| bits(std::slice::from_ref(b)))
        );
    }
}

#[test]
fn the_unscale_reads_one_over_the_scale_from_device_memory() {
    let g = Tensor::from_vec(vec![4.0f32, -8.0, 2.0], &[3], CPU).unwrap();
    let flag = Tensor::zeros(&[1], DType::F32, CPU).unwrap();
    let inv = Tensor::from_vec(vec![0.25f32], &[1], CPU).unwrap();
    unscale_check(&UnscaleCheck {
        found_inf: flag.storage(),
        grads: &[g.storage()],
        // The argument a replayed graph would repeat: ignored for the value in memory.
        inv_scale: 1.0,
        inv_scale_at: Some(View {
            storage: inv.storage(),
            layout: inv.layout(),
        }),
    })
    .unwrap();
    assert_eq!(g.to_vec::<f32>().unwrap(), vec![1.0, -2.0, 0.5]);
    assert_eq!(flag.to_vec::<f32>().unwrap(), vec![0.0]);

    let wrong = Tensor::from_vec(vec![0.25f64], &[1], CPU).unwrap();
    let e = unscale_check(&UnscaleCheck {
        found_inf: flag.storage(),
        grads: &[g.storage()],
        inv_scale: 1.0,
        inv_scale_at: Some(View {
            storage: wrong.storage(),
            layout: wrong.layout(),
        }),
    })
    .unwrap_err();
    assert!(
        e.to_string().contains("F32") || e.to_string().contains("f32"),
        "{e}"
    );
}

#[test]
fn a_staged_scale_multiplies_losses_of_every_dtype_as_the_host_scale_does() {
    let host = GradScaler::new();
    let mut staged = GradScaler::new();
    staged.stage_on(CPU).unwrap();
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for shape in [&[][..], &[3][..]] {
            let n = shape.iter().product::<usize>();
            let values = [0.5f32, 1.5, -2.0][..n].to_vec();
            let loss = Tensor::from_vec(values, shape, CPU)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let (want, got) = (host.scale(&loss).unwrap(), staged.scale(&loss).unwrap());
            assert_eq!(got.dtype(), want.dtype(), "{dtype} {shape:?}");
            assert_eq!(
                got.to_vec::<f64>().unwrap(),
                want.to_vec::<f64>().unwrap(),
                "{dtype} {shape:?}"
            );
        }
    }
    // As PyTorch's f32 scale tensor: an f16 loss keeps its dtype, the product taken in f32
    // (65536 itself is inf in f16, 0.5 · 65536 is not).
    let loss = Tensor::from_vec(vec![0.5f32, 1.5], &[2], CPU)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    let scaled = host.scale(&loss).unwrap();
    assert_eq!(scaled.dtype(), DType::F16);
    assert_eq!(
        scaled.to_vec::<f64>().unwrap(),
        vec![32768.0, f64::INFINITY]
    );
}

#[test]
fn the_staged_scale_follows_every_update_and_a_loaded_state() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let p = Tensor::from_vec(vec![1.0f32], &[1], CPU)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let mut opt = adamw(vec![p.clone()]);
    let mut s = GradScaler::with_config(GradScalerConfig {
        init_scale: 8.0,
        growth_interval: 1,
        ..GradScalerConfig::default()
    })
    .unwrap();
    assert_eq!(s.decided(), LossScaling::OnHost);
    s.stage_on(CPU).unwrap();
    assert_eq!(s.staged_device(), Some(CPU));
    assert_eq!(s.decided(), LossScaling::OnDevice);
    // scale() reads the staged value: the loss times 8, with autograd.
    let loss = p.mul_scalar(3.0).unwrap().sum_all().unwrap();
    let scaled = s.scale(&loss).unwrap();
    assert_eq!(scaled.item().unwrap(), 24.0);
    scaled.backward().unwrap();
    assert_eq!(p.grad().unwrap().to_vec::<f32>().unwrap(), vec![24.0]);
    let found = s.step_on_device(&mut opt).unwrap();
    assert_eq!(found.item().unwrap(), 0.0);
    // Unscaled by the staged 1/8 before Adam read it.
    assert_eq!(p.grad().unwrap().to_vec::<f32>().unwrap(), vec![3.0]);
    let report = s.update_on_device(&found).unwrap();
    // Grown on the device (an interval of 1): the report, get_scale and scale() read it.
    assert_eq!(report.values().unwrap(), vec![0.0, 16.0]);
    assert_eq!(s.get_scale().unwrap(), 16.0);
    assert_eq!(s.growth_tracker().unwrap(), 0);
    let loss = p.sum_all().unwrap();
    assert_eq!(
        s.scale(&loss).unwrap().item().unwrap(),
        16.0 * loss.item().unwrap()
    );
    // A loaded state is staged too.
    let state = vec![
        (
            "scaler.scale".to_string(),
            Tensor::from_vec(vec![2.0f32], &[], CPU).unwrap(),
        ),
        (
            "scaler.growth_tracker".to_string(),
            Tensor::from_vec(vec![0i64], &[], CPU).unwrap(),
        ),
    ];
    s.load_state_tensors(&state).unwrap();
    assert_eq!(
        s.scale(&loss).unwrap().item().unwrap(),
        2.0 * loss.item().unwrap()
    );
    // A found inf backs off on the device, and the host's update goes on from there.
    let report = s.update_on_device(&flag(1.0)).unwrap();
    assert_eq!(report.values().unwrap(), vec![1.0, 1.0]);
    assert_eq!(
        s.scale(&loss).unwrap().item().unwrap(),
        1.0 * loss.item().unwrap()
    );
    let saved = s.state_tensors().unwrap();
    assert_eq!(saved[0].1.item().unwrap(), 1.0);
    p.set_grad(Some(Tensor::from_vec(vec![1.0f32], &[1], CPU).unwrap()))
        .unwrap();
    s.step(&mut opt).unwrap();
    s.update().unwrap();
    assert_eq!(s.get_scale().unwrap(), 2.0, "grown from the device's 1.0");
}

/// The update kernel against the host's rule (`next_scale`) over every branch, and the rule
/// itself at its edges.
#[test]
fn the_scale_update_on_the_device_follows_the_host_rule() {
    common::scale_update::check_scale_update(CPU);
    assert_eq!(
        next_scale((f32::MAX, 6), false, (2.0, 0.5, 7)),
        (f32::MAX, 0)
    );
    assert_eq!(next_scale((8.0, 6), false, (2.0, 0.5, 7)), (16.0, 0));
    assert_eq!(next_scale((8.0, 5), false, (2.0, 0.5, 7)), (8.0, 6));
    assert_eq!(next_scale((8.0, 5), true, (2.0, 0.5, 7)), (4.0, 0));
}

#[test]
fn a_step_on_the_device_says_what_it_needs() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let p = Tensor::from_vec(vec![1.0f32], &[1], CPU)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let grad = || {
        p.set_grad(Some(Tensor::from_vec(vec![1.0f32], &[1], CPU).unwrap()))
            .unwrap()
    };
    // Not staged.
    let mut s = GradScaler::new();
    let mut opt = adamw(vec![p.clone()]);
    grad();
    let e = s.step_on_device(&mut opt).unwrap_err().to_string();
    assert!(e.contains("stage_on"), "{e}");
    // An optimizer that cannot skip on the device.
    s.stage_on(CPU).unwrap();
    let mut plain =
        common::host_only::HostOnly(Sgd::new(vec![p.clone()], SgdConfig::default()).unwrap());
    let e = s.step_on_device(&mut plain).unwrap_err().to_string();
    assert!(e.contains("GradScaler::step"), "{e}");
    // Twice in one iteration.
    let found = s.step_on_device(&mut opt).unwrap();
    let e = s.step_on_device(&mut opt).unwrap_err().to_string();
    assert!(e.contains("update_on_device"), "{e}");
    s.update_on_device(&found).unwrap();
    // An update on the device of a scaler that is not staged there.
    let e = GradScaler::new()
        .update_on_device(&found)
        .unwrap_err()
        .to_string();
    assert!(e.contains("stage_on"), "{e}");
    // A growth interval the device's f32 tracker cannot count to.
    let mut long = GradScaler::with_config(GradScalerConfig {
        growth_interval: (1 << 24) + 1,
        ..GradScalerConfig::default()
    })
    .unwrap();
    let e = long.stage_on(CPU).unwrap_err().to_string();
    assert!(e.contains("growth_interval"), "{e}");
    // No gradient at all.
    opt.zero_grad().unwrap();
    let e = s.step_on_device(&mut opt).unwrap_err().to_string();
    assert!(e.contains("no inf checks"), "{e}");
    // A skip flag that is not one F32 element.
    grad();
    let two = Tensor::zeros(&[2], DType::F32, CPU).unwrap();
    let e = opt.step_unless_found_inf(&two).unwrap_err().to_string();
    assert!(e.contains("skip flag"), "{e}");
}
