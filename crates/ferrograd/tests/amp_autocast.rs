//! Autocast on the CPU: three op chains against PyTorch's CUDA autocast policy (fixtures from
//! tools/make_amp_fixtures.py) for bf16 and f16 with the dtype of every intermediate and f32
//! master gradients; the bytes a Linear saves in a region and the weight-cast cache (one cast
//! per weight per region, reused across micro-batches, refreshed by in-place updates, freed
//! when the outermost region ends), to the byte; nesting and disabled regions; float type
//! promotion of binary ops; and a tiny GPT trained one step under bf16.
//!
//! The allocators are process-wide and tests run on parallel threads, so every test takes
//! `LOCK` first (the byte counts of one test must not see another's tensors).

mod amp_chains;
mod common;

use std::sync::{Arc, Mutex, MutexGuard};

use amp_chains::{
    CHAINS, assert_steps_agree, case_name, chains_match_pytorch, gpt_step, leaves, token_batch,
};
use common::assert_same_bits;
use ferrograd::amp::{
    AmpDType, autocast, autocast_disabled, autocast_dtype, is_autocast_enabled, set_autocast,
    try_autocast,
};
use ferrograd::autograd::{BackwardOptions, CustomFunction, FunctionCtx, apply_custom};
use ferrograd::memory::recorder::{self, Action, RecorderConfig};
use ferrograd::memory::{self, CategoryBytes};
use ferrograd::nn::{Gpt, GptConfig, IGNORE_INDEX, LayerNorm, Module, Recompute, causal_mask};
use ferrograd::ops::{GeluApprox, cast_parameters_ahead};
use ferrograd::{Category, DType, Device, Error, Generator, Result, Tensor, no_grad};

const CPU: Device = Device::Cpu;

static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    // A failed test must not fail every later one.
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn assert_close(name: &str, got: &Tensor, want: &Tensor, atol: f64, rtol: f64) {
    amp_chains::assert_close(name, got, want, (atol, rtol));
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn_with(shape, DType::F32, CPU, &mut Generator::new(seed)).unwrap()
}

fn param(shape: &[usize], seed: u64) -> Tensor {
    let t = randn(shape, seed);
    t.set_category(Category::Parameter);
    t.requires_grad_(true).unwrap()
}

// ---- the chains against PyTorch ---------------------------------------------------------

#[test]
fn chains_match_pytorch_bf16() {
    let _l = lock();
    chains_match_pytorch(AmpDType::BF16, CPU);
}

#[test]
fn chains_match_pytorch_f16() {
    let _l = lock();
    chains_match_pytorch(AmpDType::F16, CPU);
}

#[test]
fn without_autocast_the_chains_stay_f32() {
    let _l = lock();
    for (chain, f) in CHAINS {
        let inputs = leaves(&case_name(chain, DType::BF16), CPU);
        for (name, t) in f(&inputs).unwrap() {
            assert_eq!(t.dtype(), DType::F32, "{chain}.{name}");
        }
        // Inside a region, a disabled one turns the policy off again.
        let _amp = autocast(AmpDType::BF16);
        let _off = autocast_disabled();
        for (name, t) in f(&inputs).unwrap() {
            assert_eq!(t.dtype(), DType::F32, "{chain}.{name} in a disabled region");
        }
    }
}

// ---- op policy details ---------------------------------------------------------------------

#[test]
fn policy_per_op() {
    let _l = lock();
    let x = randn(&[3, 4], 1);
    let half = x.to_dtype(DType::BF16).unwrap();
    let _amp = autocast(AmpDType::BF16);
    // Float32 list: half inputs are computed in f32.
    let f32_ops: [(&str, Tensor); 8] = [
        ("sum", half.sum(&[1], false).unwrap()),
        ("sum_all", half.sum_all().unwrap()),
        ("exp", half.exp().unwrap()),
        (
            "log",
            half.exp()
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap()
                .log()
                .unwrap(),
        ),
        ("pow_scalar", half.pow_scalar(2.0).unwrap()),
        ("pow", half.pow(&half).unwrap()),
        ("log_softmax", half.log_softmax(0).unwrap()),
        ("mse_loss", half.mse_loss(&half).unwrap()),
    ];
    for (name, t) in f32_ops {
        assert_eq!(t.dtype(), DType::F32, "{name}");
    }
    // Not listed: the input's dtype (mean and max are not in PyTorch's list either).
    let own: [(&str, Tensor); 5] = [
        ("mean", half.mean(&[1], false).unwrap()),
        ("max", half.max_dim(1, false).unwrap().0),
        ("gelu", half.gelu(GeluApprox::None).unwrap()),
        ("relu", half.relu().unwrap()),
        ("add", half.add(&half).unwrap()),
    ];
    for (name, t) in own {
        assert_eq!(t.dtype(), DType::BF16, "{name}");
    }
    // Lower precision: matmul of f32 operands gives bf16; f64 operands are never cast.
    assert_eq!(x.matmul(&x.t().unwrap()).unwrap().dtype(), DType::BF16);
    let x64 = x.to_dtype(DType::F64).unwrap();
    assert_eq!(x64.matmul(&x64.t().unwrap()).unwrap().dtype(), DType::F64);
    assert_eq!(x64.softmax(1).unwrap().dtype(), DType::F64);
    // Integer targets stay integers; the policy still computes the loss in f32.
    let t = Tensor::from_vec(vec![0i64, 3, 1], &[3], CPU).unwrap();
    let loss = half.cross_entropy(&t, -100).unwrap();
    assert_eq!(loss.dtype(), DType::F32);
    // A mismatch the policy does not fix is still an error.
    assert!(matches!(
        x64.matmul(&x.t().unwrap()),
        Err(Error::DType { .. })
    ));
}

#[test]
fn values_under_the_policy_equal_explicit_casts() {
    let _l = lock();
    let (x, w) = (randn(&[5, 7], 2), randn(&[3, 7], 3));
    let b = randn(&[3], 4);
    let explicit = {
        let c = |t: &Tensor| t.to_dtype(DType::F16).unwrap();
        let logits = c(&x).linear(&c(&w), Some(&c(&b))).unwrap();
        logits.to_dtype(DType::F32).unwrap().softmax(1).unwrap()
    };
    let policy = {
        let _amp = autocast(AmpDType::F16);
        x.linear(&w, Some(&b)).unwrap().softmax(1).unwrap()
    };
    assert_eq!(policy.dtype(), DType::F32);
    assert_eq!(
        policy.to_vec::<f32>().unwrap(),
        explicit.to_vec::<f32>().unwrap(),
        "autocast must compute exactly the explicit casts (softmax of f16 in f32)"
    );
}

// ---- state: nesting, disabled regions, dtype errors, threads -----------------------------

#[test]
fn nested_and_disabled_regions_restore_the_state() {
    let _l = lock();
    assert_eq!(autocast_dtype(), None);
    assert!(!is_autocast_enabled());
    {
        let _outer = autocast(AmpDType::BF16);
        assert_eq!(autocast_dtype(), Some(DType::BF16));
        {
            let _inner = autocast(AmpDType::F16);
            assert_eq!(autocast_dtype(), Some(DType::F16));
            {
                let _off = autocast_disabled();
                assert_eq!(autocast_dtype(), None);
                let _again = set_autocast(Some(DType::BF16)).unwrap();
                assert_eq!(autocast_dtype(), Some(DType::BF16));
            }
            assert_eq!(autocast_dtype(), Some(DType::F16));
        }
        assert_eq!(autocast_dtype(), Some(DType::BF16));
        let saved = autocast_dtype();
        {
            let _off = set_autocast(None).unwrap();
            assert_eq!(autocast_dtype(), None);
            let _back = set_autocast(saved).unwrap();
            assert_eq!(autocast_dtype(), Some(DType::BF16));
        }
        // The state is per thread: another thread runs without autocast.
        let other = std::thread::spawn(autocast_dtype).join().unwrap();
        assert_eq!(other, None);
    }
    assert_eq!(autocast_dtype(), None);
}

#[test]
fn only_half_dtypes_make_a_region() {
    let _l = lock();
    for d in [DType::F32, DType::F64, DType::I64, DType::U8] {
        let err = try_autocast(d)
            .err()
            .expect("a non-half dtype must be refused");
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
        assert!(err.to_string().contains("f16 or bf16"), "{err}");
        assert!(AmpDType::try_from(d).is_err());
        assert!(set_autocast(Some(d)).is_err());
        assert_eq!(autocast_dtype(), None, "a refused region changes nothing");
    }
    for (d, a) in [(DType::F16, AmpDType::F16), (DType::BF16, AmpDType::BF16)] {
        assert_eq!(AmpDType::try_from(d).unwrap(), a);
        assert_eq!(DType::from(a), d);
        let _g = try_autocast(d).unwrap();
        assert_eq!(autocast_dtype(), Some(d));
    }
}

// ---- bytes: what a Linear saves, and the weight-cast cache ------------------------------

#[derive(Clone, Copy)]
struct Snap {
    total: u64,
    cats: CategoryBytes,
}

fn snap() -> Snap {
    Snap {
        total: memory::memory_allocated(CPU).unwrap(),
        cats: memory::memory_by_category(CPU).unwrap(),
    }
}

/// Asserts the bytes allocated since `base`, in total and per category (unlisted: 0).
#[track_caller]
fn assert_usage(what: &str, base: Snap, cats: &[(Category, usize)]) {
    let now = snap();
    assert_eq!(now.cats.total(), now.total, "{what}: categories sum");
    let delta = |a: u64, b: u64| a as i64 - b as i64;
    let total: usize = cats.iter().map(|(_, b)| b).sum();
    for c in Category::ALL {
        let want = cats.iter().find(|(k, _)| *k == c).map_or(0, |(_, b)| *b);
        assert_eq!(
            delta(now.cats.get(c), base.cats.get(c)),
            want as i64,
            "{what}: {c} bytes"
        );
    }
    assert_eq!(delta(now.total, base.total), total as i64, "{what}: total");
}

const BF16: usize = 2;
const F32: usize = 4;

#[test]
fn linear_saves_half_copies_of_its_input_and_weight() {
    let _l = lock();
    let (n, i, o) = (4, 8, 6);
    let x_leaf = randn(&[n, i], 5).requires_grad_(true).unwrap();
    let (w, b) = (param(&[o, i], 6), param(&[o], 7));
    let base = snap();
    let amp = autocast(AmpDType::BF16);
    // An f32 activation (not a leaf, so its cast is not cached).
    let x = x_leaf.mul_scalar(1.0).unwrap();
    let y = x.linear(&w, Some(&b)).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    assert_usage(
        "after the forward",
        base,
        &[
            // The bf16 copies of x and W that the backward reads.
            (Category::SavedActivation, n * i * BF16 + o * i * BF16),
            // x (f32), the output, and the cached bf16 bias.
            (Category::Temporary, n * i * F32 + n * o * BF16 + o * BF16),
        ],
    );
    y.sum_all().unwrap().backward().unwrap();
    for (name, p) in [("x", &x_leaf), ("w", &w), ("b", &b)] {
        assert_eq!(p.grad().unwrap().dtype(), DType::F32, "{name}.grad");
    }
    let grads = (n * i + o * i + o) * F32;
    drop((x, y));
    assert_usage(
        "graph dropped, region alive",
        base,
        &[
            (Category::Gradient, grads),
            // The cache keeps one bf16 copy per parameter until the region ends.
            (Category::Temporary, o * i * BF16 + o * BF16),
        ],
    );
    drop(amp);
    assert_usage("region ended", base, &[(Category::Gradient, grads)]);
}

#[test]
fn a_weight_used_twice_is_cast_once() {
    let _l = lock();
    let (o, i) = (6, 8);
    let w = param(&[o, i], 8);
    let (x1, x2) = (randn(&[4, i], 9), randn(&[3, i], 10));
    let base = snap();
    let amp = autocast(AmpDType::BF16);
    let y1 = x1.linear(&w, None).unwrap();
    let y2 = x2.linear(&w, None).unwrap();
    assert_usage(
        "two linears with one weight",
        base,
        &[
            (Category::SavedActivation, (4 + 3) * i * BF16),
            // One bf16 weight, not two.
            (Category::Temporary, o * i * BF16 + (4 + 3) * o * BF16),
        ],
    );
    // The gradient sums both uses, as without autocast.
    y1.sum_all()
        .unwrap()
        .add(&y2.sum_all().unwrap())
        .unwrap()
        .backward()
        .unwrap();
    // Each use's gradient is an f32 product of bf16 operands: the f32 layers on the inputs
    // rounded to bf16 give it (the output gradients, ones, are exact in bf16).
    let want = {
        let _off = autocast_disabled();
        let r = |t: &Tensor| {
            t.to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
        };
        let wl = w.detach().requires_grad_(true).unwrap();
        let (a, b) = (
            r(&x1).linear(&wl, None).unwrap(),
            r(&x2).linear(&wl, None).unwrap(),
        );
        a.sum_all()
            .unwrap()
            .add(&b.sum_all().unwrap())
            .unwrap()
            .backward()
            .unwrap();
        wl.grad().unwrap()
    };
    assert_close("w.grad", &w.grad().unwrap(), &want, 1e-6, 1e-6);
    drop((y1, y2, want));
    drop(amp);
    assert_usage("region ended", base, &[(Category::Gradient, o * i * F32)]);
}

/// `cast_parameters_ahead` casts each eligible parameter once, in the cache: the linear then
/// casts only its input, and every value and gradient equals the lazily cast run's.
#[test]
fn parameters_cast_ahead_are_the_casts_the_linear_reads() {
    let _l = lock();
    let (n, i, o) = (4, 8, 6);
    let x = randn(&[n, i], 14);
    let run = |ahead: bool| {
        let (w, b) = (param(&[o, i], 11), param(&[o], 12));
        // Neither a parameter (no grad) nor f32: not cast ahead.
        let frozen = randn(&[o, i], 13);
        let half = randn(&[o], 15).to_dtype(DType::BF16).unwrap();
        let base = snap();
        let amp = autocast(AmpDType::BF16);
        if ahead {
            cast_parameters_ahead(&[&w, &b, &w, &frozen, &half]).unwrap();
            // w once though listed twice, b; nothing for the others.
            let cast = (o * i + o) * BF16;
            assert_usage("cast ahead", base, &[(Category::Temporary, cast)]);
        }
        let y = x.linear(&w, Some(&b)).unwrap();
        assert_usage(
            "after the linear",
            base,
            &[
                // x's cast, which the weight's gradient reads (x needs none: W is not saved).
                (Category::SavedActivation, n * i * BF16),
                // The cached W and b, held by the cache alone, and the output.
                (Category::Temporary, (o * i + o) * BF16 + n * o * BF16),
            ],
        );
        y.to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        drop(amp);
        (y, w.grad().unwrap(), b.grad().unwrap())
    };
    let (ahead, lazy) = (run(true), run(false));
    assert_same_bits("y", &ahead.0, &lazy.0);
    assert_same_bits("w.grad", &ahead.1, &lazy.1);
    assert_same_bits("b.grad", &ahead.2, &lazy.2);
    // Outside a region it does nothing.
    let w = param(&[o, i], 11);
    let base = snap();
    cast_parameters_ahead(&[&w]).unwrap();
    assert_usage("no region", base, &[]);
}

/// `to_dtype_many` gives each tensor's `to_dtype`, bit for bit, strided views and tensors
/// already in the dtype included, each result its own graph node.
#[test]
fn to_dtype_many_equals_one_cast_each() {
    let _l = lock();
    let leaves = [param(&[3, 5], 21), param(&[7], 22), param(&[4, 6], 23)];
    let inputs = [
        leaves[0].clone(),
        leaves[1].clone(),
        leaves[2].transpose(0, 1).unwrap(),
        randn(&[2, 2], 24).to_dtype(DType::BF16).unwrap(),
    ];
    let many = Tensor::to_dtype_many(&inputs, DType::BF16).unwrap();
    assert_eq!(many.len(), inputs.len());
    for (k, (m, t)) in many.iter().zip(&inputs).enumerate() {
        assert_same_bits(&format!("tensor {k}"), m, &t.to_dtype(DType::BF16).unwrap());
    }
    // Already bf16: the same tensor back.
    assert!(many[3].shares_storage(&inputs[3]));
    let total = many[..3]
        .iter()
        .map(|m| {
            m.to_dtype(DType::F32)
                .unwrap()
                .mul_scalar(2.0)
                .unwrap()
                .sum_all()
                .unwrap()
        })
        .reduce(|a, b| a.add(&b).unwrap())
        .unwrap();
    total.backward().unwrap();
    for (k, l) in leaves.iter().enumerate() {
        let g = l.grad().unwrap();
        assert_eq!(g.dtype(), DType::F32, "leaf {k}");
        assert!(
            g.to_vec::<f32>().unwrap().iter().all(|&v| v == 2.0),
            "leaf {k}"
        );
    }
    assert!(Tensor::to_dtype_many(&[], DType::F16).unwrap().is_empty());
}

#[test]
fn the_cached_cast_serves_several_micro_batches() {
    let _l = lock();
    let (o, i) = (5, 8);
    let w = param(&[o, i], 11);
    let xs = [randn(&[4, i], 12), randn(&[4, i], 13)];
    // Each micro-batch's gradient alone, each in its own region (fresh casts).
    let alone: Vec<Tensor> = xs
        .iter()
        .map(|x| {
            let wl = w.detach().requires_grad_(true).unwrap();
            let _amp = autocast(AmpDType::BF16);
            x.linear(&wl, None)
                .unwrap()
                .gelu(GeluApprox::Tanh)
                .unwrap()
                .mse_loss(&Tensor::zeros(&[4, o], DType::F32, CPU).unwrap())
                .unwrap()
                .backward()
                .unwrap();
            wl.grad().unwrap()
        })
        .collect();
    let loss = |x: &Tensor| {
        x.linear(&w, None)
            .unwrap()
            .gelu(GeluApprox::Tanh)
            .unwrap()
            .mse_loss(&Tensor::zeros(&[4, o], DType::F32, CPU).unwrap())
            .unwrap()
    };
    let base = snap();
    let _amp = autocast(AmpDType::BF16);
    // Both graphs alive at once, sharing the one cached cast node; two backwards.
    let l0 = loss(&xs[0]);
    let first = memory::memory_allocated(CPU).unwrap() - base.total;
    let l1 = loss(&xs[1]);
    let second = memory::memory_allocated(CPU).unwrap() - base.total - first;
    assert_eq!(
        first - second,
        (o * i * BF16) as u64,
        "the second micro-batch allocates all the first did but the weight cast"
    );
    l0.backward().unwrap();
    assert_close(
        "after micro-batch 0",
        &w.grad().unwrap(),
        &alone[0],
        0.0,
        0.0,
    );
    l1.backward().unwrap();
    let sum = alone[0].add(&alone[1]).unwrap();
    assert_close("after micro-batch 1", &w.grad().unwrap(), &sum, 0.0, 0.0);
    // A third micro-batch after both backwards reuses the cast again.
    let l2 = loss(&xs[0]);
    l2.backward().unwrap();
    let sum = sum.add(&alone[0]).unwrap();
    assert_close("after micro-batch 2", &w.grad().unwrap(), &sum, 0.0, 0.0);
}

#[test]
fn an_in_place_update_makes_a_new_cast() {
    let _l = lock();
    let w = param(&[2, 3], 14);
    let x = Tensor::ones(&[1, 3], DType::F32, CPU).unwrap();
    let base = snap();
    let amp = autocast(AmpDType::BF16);
    let before = x.linear(&w, None).unwrap().to_vec::<f32>().unwrap();
    {
        // An optimizer step inside the region: w += 1 (its storage version changes).
        let _g = no_grad();
        w.add_(&Tensor::ones(&[2, 3], DType::F32, CPU).unwrap())
            .unwrap();
    }
    let after = x.linear(&w, None).unwrap().to_vec::<f32>().unwrap();
    for (a, b) in after.iter().zip(&before) {
        // Each output gained 3 · 1 (bf16 rounding of values of a few units: 2^-6 ulp).
        assert!(
            (a - b - 3.0).abs() < 0.1,
            "stale cast: {before:?} → {after:?}"
        );
    }
    // The stale cast was replaced, not kept next to the new one.
    assert_usage(
        "one cast after the update",
        base,
        &[(Category::Temporary, 2 * 3 * BF16)],
    );
    drop(amp);
    assert_usage("region ended", base, &[]);
}

#[test]
fn the_cache_lives_until_the_outermost_region_ends() {
    let _l = lock();
    let w = param(&[4, 4], 15);
    let x = randn(&[2, 4], 16);
    let base = snap();
    let cast = 4 * 4 * BF16;
    let outer = autocast(AmpDType::BF16);
    {
        let _inner = autocast(AmpDType::BF16);
        drop(x.linear(&w, None).unwrap());
        assert_usage("inner region", base, &[(Category::Temporary, cast)]);
    }
    assert_usage("inner ended", base, &[(Category::Temporary, cast)]);
    {
        // A disabled region inside neither casts nor frees.
        let _off = autocast_disabled();
        assert_eq!(x.linear(&w, None).unwrap().dtype(), DType::F32);
    }
    assert_usage("disabled ended", base, &[(Category::Temporary, cast)]);
    // Under no_grad the cast records no graph node, so it is cached separately.
    {
        let _g = no_grad();
        drop(x.linear(&w, None).unwrap());
    }
    assert_usage("no_grad cast", base, &[(Category::Temporary, 2 * cast)]);
    drop(outer);
    assert_usage("outermost ended", base, &[]);
}

/// What the probe's backward saw: the autocast state, and the dtype of an f32 matmul.
type Seen = Arc<Mutex<Option<(Option<DType>, DType)>>>;

/// Identity whose backward reports what it sees.
struct Probe(Seen);

impl CustomFunction for Probe {
    fn forward(&mut self, _: &mut FunctionCtx, inputs: &[Tensor]) -> Result<Tensor> {
        inputs[0].mul_scalar(1.0)
    }
    fn backward(&mut self, _: &FunctionCtx, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let product = g.matmul(&g.t()?)?;
        *self.0.lock().unwrap() = Some((autocast_dtype(), product.dtype()));
        Ok(vec![Some(g.clone())])
    }
}

#[test]
fn backward_inside_the_region_runs_in_the_forward_dtypes() {
    let _l = lock();
    let x = randn(&[3, 4], 17).to_dtype(DType::BF16).unwrap();
    let x = x.requires_grad_(true).unwrap();
    let w = param(&[2, 4], 18);
    let seen: Seen = Arc::new(Mutex::new(None));
    let _amp = autocast(AmpDType::BF16);
    let y = x.pow_scalar(3.0).unwrap();
    assert_eq!(y.dtype(), DType::F32, "pow_scalar runs in f32");
    let y = apply_custom(Probe(Arc::clone(&seen)), &[y]).unwrap();
    let loss = y.linear(&w, None).unwrap().sum_all().unwrap();
    assert_eq!(loss.dtype(), DType::F32);
    loss.backward().unwrap();
    // The probe's f32 gradient was multiplied in f32: the engine turned autocast off.
    assert_eq!(*seen.lock().unwrap(), Some((None, DType::F32)));
    assert_eq!(
        autocast_dtype(),
        Some(DType::BF16),
        "backward restores the region"
    );
    assert_eq!(x.grad().unwrap().dtype(), DType::BF16);
    assert_eq!(w.grad().unwrap().dtype(), DType::F32);
    // d/dx Σ_j w_j · x³ = 3 x² Σ_j w_j (bf16 precision).
    let colsum = w.detach().sum(&[0], false).unwrap();
    let x32 = x.detach().to_dtype(DType::F32).unwrap();
    let want = x32
        .mul(&x32)
        .unwrap()
        .mul_scalar(3.0)
        .unwrap()
        .mul(&colsum)
        .unwrap();
    assert_close("x.grad", &x.grad().unwrap(), &want, 5e-2, 2e-2);
}

// ---- parameter gradients in f32, straight from the GEMMs ---------------------------------

/// (op, requested bytes) of every host allocation while `f` runs, from the memory recorder.
fn allocations_during(f: impl FnOnce()) -> Vec<(&'static str, u64)> {
    recorder::start(RecorderConfig { capacity: 1 << 14 }).unwrap();
    f();
    let rec = recorder::stop().unwrap();
    assert_eq!(rec.dropped, 0, "the recording kept every event");
    rec.events
        .iter()
        .filter(|e| e.device == CPU && e.action == Action::Alloc)
        .map(|e| (e.origin.op, e.requested))
        .collect()
}

/// Whether a cast's backward (`to_dtype` of a gradient) allocated among `events`.
fn cast_backward_ran(events: &[(&'static str, u64)]) -> bool {
    events.iter().any(|(op, _)| *op == "to_dtype")
}

/// Backward from `g` (the root's gradient), returning what it allocated.
fn backward_from(y: &Tensor, g: &Tensor) -> Vec<(&'static str, u64)> {
    allocations_during(|| {
        y.backward_with(BackwardOptions {
            gradient: Some(g.clone()),
            ..Default::default()
        })
        .unwrap()
    })
}

fn bf16(t: &Tensor) -> Tensor {
    t.to_dtype(DType::BF16).unwrap()
}

fn f32(t: &Tensor) -> Tensor {
    t.to_dtype(DType::F32).unwrap()
}

/// Asserts `got` (f32) is an f32 sum whose bf16 rounding is `old` (the gradient the cast
/// path gave: the same sum rounded to bf16, then widened), and that the rounding changed
/// some element (so the f32 gradient is not a bf16 value widened).
#[track_caller]
fn assert_unrounded_form_of(what: &str, got: &Tensor, old: &Tensor) {
    assert_eq!(got.dtype(), DType::F32, "{what}");
    assert_same_bits(what, &f32(&bf16(got)), old);
    let (g, o) = (got.to_vec::<f32>().unwrap(), old.to_vec::<f32>().unwrap());
    assert!(
        g.iter().zip(&o).any(|(a, b)| a != b),
        "{what}: every element is a bf16 value"
    );
}

/// A linear layer in a bf16 region on an f32 weight and bias: the GEMM writes dW (and the
/// reduction db) in f32 from the bf16 operands, no cast's backward runs and no bf16 dW or
/// db is allocated; a second backward adds into the f32 `.grad`. The same layer on a weight
/// that is not a leaf (its cast is not cached) still goes through the cast's backward.
#[test]
fn a_linear_writes_f32_parameter_gradients_without_a_cast_backward() {
    let _l = lock();
    let (n, i, o) = (6, 8, 5);
    // Already bf16: the input needs no cast of its own.
    let x = bf16(&randn(&[n, i], 31));
    let g = bf16(&randn(&[n, o], 34));
    let (w, b) = (param(&[o, i], 32), param(&[o], 33));
    // The f32 products and sums of the bf16 operands, and what the cast path gave: the same
    // products rounded to bf16.
    let want_w = f32(&g).t().unwrap().matmul(&f32(&x)).unwrap();
    let want_b = f32(&g).sum(&[0], false).unwrap();
    let old_w = f32(&bf16(&g).t().unwrap().matmul(&x).unwrap());
    let base = snap();
    let amp = autocast(AmpDType::BF16);
    let y = x.linear(&w, Some(&b)).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    let events = backward_from(&y, &g);
    assert!(!cast_backward_ran(&events), "{events:?}");
    for half in [o * i * BF16, o * BF16] {
        assert!(
            !events.iter().any(|&(_, r)| r == half as u64),
            "a bf16 parameter gradient of {half} bytes: {events:?}"
        );
    }
    assert!(events.contains(&("matmul", (o * i * F32) as u64)));
    let (gw, gb) = (w.grad().unwrap(), b.grad().unwrap());
    assert_close("w.grad", &gw, &want_w, 1e-6, 1e-6);
    assert_close("b.grad", &gb, &want_b, 1e-6, 1e-6);
    assert_unrounded_form_of("w.grad", &gw, &old_w);
    // Accumulation into the existing f32 gradients.
    let y2 = x.linear(&w, Some(&b)).unwrap();
    backward_from(&y2, &g);
    let twice = |t: &Tensor| t.mul_scalar(2.0).unwrap();
    assert_close(
        "w.grad, twice",
        &w.grad().unwrap(),
        &twice(&want_w),
        1e-6,
        1e-6,
    );
    assert_close(
        "b.grad, twice",
        &b.grad().unwrap(),
        &twice(&want_b),
        1e-6,
        1e-6,
    );
    drop((y, y2, gw, gb));
    let now = snap();
    assert_eq!(now.cats.total(), now.total, "categories sum");
    drop(amp);
    assert_usage(
        "region ended",
        base,
        &[(Category::Gradient, (o * i + o) * F32)],
    );
    // A weight that is not a leaf is cast each time, and its gradient comes back through the
    // cast's backward: what the observation above would have seen.
    let (w_leaf, b_leaf) = (param(&[o, i], 32), param(&[o], 33));
    let w_copy = w_leaf.mul_scalar(1.0).unwrap();
    let _amp = autocast(AmpDType::BF16);
    let y = x.linear(&w_copy, Some(&b_leaf)).unwrap();
    let events = backward_from(&y, &g);
    assert!(cast_backward_ran(&events), "{events:?}");
    assert_same_bits("w.grad through the cast", &w_leaf.grad().unwrap(), &old_w);
    assert_eq!(b_leaf.grad().unwrap().dtype(), DType::F32);
}

/// The paths that keep their gradients' dtypes: a frozen f32 weight (no gradient, no cached
/// cast), a bf16 parameter (its gradient bf16), f64 (never cast) and the same layer outside
/// a region (f32 throughout).
#[test]
fn frozen_half_f64_and_unregioned_parameters_keep_their_paths() {
    let _l = lock();
    let (n, i, o) = (4, 6, 3);
    let x = bf16(&randn(&[n, i], 41));
    let g = bf16(&randn(&[n, o], 42));
    let frozen = randn(&[o, i], 43);
    let b = param(&[o], 44);
    let half = bf16(&randn(&[o, i], 45)).requires_grad_(true).unwrap();
    {
        let _amp = autocast(AmpDType::BF16);
        backward_from(&x.linear(&frozen, Some(&b)).unwrap(), &g);
        backward_from(&x.linear(&half, None).unwrap(), &g);
    }
    assert!(frozen.grad().is_none());
    let want_b = f32(&g).sum(&[0], false).unwrap();
    assert_close("b.grad", &b.grad().unwrap(), &want_b, 1e-6, 1e-6);
    assert_eq!(half.grad().unwrap().dtype(), DType::BF16);
    let w64 = randn(&[o, i], 46)
        .to_dtype(DType::F64)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let x64 = x.to_dtype(DType::F64).unwrap();
    let w32 = param(&[o, i], 47);
    {
        let _amp = autocast(AmpDType::BF16);
        let y = x64.linear(&w64, None).unwrap();
        assert_eq!(y.dtype(), DType::F64);
        backward_from(&y, &g.to_dtype(DType::F64).unwrap());
    }
    assert_eq!(w64.grad().unwrap().dtype(), DType::F64);
    let y = f32(&x).linear(&w32, None).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    backward_from(&y, &f32(&g));
    let want = f32(&g).t().unwrap().matmul(&f32(&x)).unwrap();
    assert_same_bits("f32 w.grad", &w32.grad().unwrap(), &want);
}

/// Under create_graph the f32 parameter's gradients are recorded f32 ops with history: the
/// same values as a plain backward, and differentiable again (d Σ dW / dx = Σ_out g).
#[test]
fn create_graph_parameter_gradients_are_recorded_in_f32() {
    let _l = lock();
    let (n, i, o) = (5, 4, 3);
    let x = bf16(&randn(&[n, i], 51)).requires_grad_(true).unwrap();
    let g = bf16(&randn(&[n, o], 52));
    let (w, b) = (param(&[o, i], 53), param(&[o], 54));
    let (w_plain, b_plain) = (param(&[o, i], 53), param(&[o], 54));
    // The f32 product of the bf16 operands (outside the region: an f32 matmul).
    let want_w = f32(&g).t().unwrap().matmul(&f32(&x)).unwrap();
    let _amp = autocast(AmpDType::BF16);
    backward_from(&x.linear(&w_plain, Some(&b_plain)).unwrap(), &g);
    let y = x.linear(&w, Some(&b)).unwrap();
    allocations_during(|| {
        y.backward_with(BackwardOptions {
            gradient: Some(g.clone()),
            create_graph: true,
            ..Default::default()
        })
        .unwrap()
    });
    let (gw, gb) = (w.grad().unwrap(), b.grad().unwrap());
    assert_eq!((gw.dtype(), gb.dtype()), (DType::F32, DType::F32));
    // dW = gᵀ·x depends on x; db depends on g alone, which has no history here.
    assert!(gw.requires_grad() && !gw.is_leaf(), "w.grad has no history");
    assert_close("w.grad", &gw, &w_plain.grad().unwrap(), 1e-6, 1e-6);
    assert_close("w.grad, unrounded", &gw, &want_w, 1e-6, 1e-6);
    assert_close("b.grad", &gb, &b_plain.grad().unwrap(), 1e-6, 1e-6);
    x.set_grad(None).unwrap();
    gw.sum_all().unwrap().backward().unwrap();
    let want = f32(&g).sum(&[1], true).unwrap().expand(&[n, i]).unwrap();
    assert_close(
        "d sum(dW) / dx",
        &f32(&x.grad().unwrap()),
        &want,
        1e-2,
        1e-2,
    );
}

/// The fused MLP on f32 parameters in a bf16 region: every parameter gradient is f32, no
/// cast's backward runs, and each is the unrounded form of what the cast path gave.
#[test]
fn the_fused_mlp_writes_f32_parameter_gradients() {
    let _l = lock();
    let (n, c, h) = (6, 8, 16);
    let x = bf16(&randn(&[n, c], 61));
    let g = bf16(&randn(&[n, c], 62));
    let shapes: [&[usize]; 4] = [&[h, c], &[h], &[c, h], &[c]];
    let params: Vec<Tensor> = (0..4).map(|k| param(shapes[k], 63 + k as u64)).collect();
    let leaves: Vec<Tensor> = (0..4).map(|k| param(shapes[k], 63 + k as u64)).collect();
    let _amp = autocast(AmpDType::BF16);
    let p = &params;
    let y = x.mlp_gelu(&p[0], &p[1], &p[2], &p[3]).unwrap();
    let events = backward_from(&y, &g);
    assert!(!cast_backward_ran(&events), "{events:?}");
    // The cast path: explicit (uncached) casts carry the nodes.
    let c16: Vec<Tensor> = leaves.iter().map(bf16).collect();
    let y_old = x.mlp_gelu(&c16[0], &c16[1], &c16[2], &c16[3]).unwrap();
    assert_same_bits("output", &y, &y_old);
    let events = backward_from(&y_old, &g);
    assert!(cast_backward_ran(&events));
    let names = ["w_fc", "b_fc", "w_proj", "b_proj"];
    for k in [0, 2] {
        let (got, old) = (p[k].grad().unwrap(), leaves[k].grad().unwrap());
        assert_unrounded_form_of(names[k], &got, &old);
    }
    for k in [1, 3] {
        let (got, old) = (p[k].grad().unwrap(), leaves[k].grad().unwrap());
        assert_eq!(got.dtype(), DType::F32, "{}", names[k]);
        assert_close(names[k], &got, &old, 1e-2, 1e-2);
    }
}

/// GPT-2's tie: the embedding's gradient arrives in f32 with no cast, while the fused
/// classifier keeps its dw in bf16 and casts it back once. It makes dw in the forward and holds
/// it until backward (the logits never exist whole), so an f32 dw would add V·C·2 bytes at
/// the step's peak (GPT-2: 74 MiB); the one cast is the price of not holding them. The two
/// contributions still sum in the one f32 leaf as they do on separate leaves.
#[test]
fn the_tied_classifier_weight_sums_an_f32_embedding_gradient_and_one_cast_dw() {
    let _l = lock();
    let (v, c, rows) = (11, 8, 6);
    let ids = Tensor::from_vec(vec![1i64, 4, 7, 10, 0, 3], &[rows], CPU).unwrap();
    let targets = Tensor::from_vec(vec![2i64, 5, -100, 9, 1, 6], &[rows], CPU).unwrap();
    let run = |emb: &Tensor, head: &Tensor| {
        let _amp = autocast(AmpDType::BF16);
        let h = emb.embedding(&ids).unwrap().mul_scalar(0.5).unwrap();
        let loss = h.linear_cross_entropy(head, &targets, -100).unwrap();
        assert_eq!(loss.dtype(), DType::F32);
        allocations_during(|| loss.backward().unwrap())
    };
    let tied = param(&[v, c], 71);
    let events = run(&tied, &tied);
    let weight_casts = |bytes: usize| {
        events
            .iter()
            .filter(|e| **e == ("to_dtype", bytes as u64))
            .count()
    };
    assert_eq!(
        weight_casts(v * c * F32),
        1,
        "one cast of dw to f32: {events:?}"
    );
    assert_eq!(weight_casts(v * c * BF16), 0, "no cast to bf16: {events:?}");
    let (emb, head) = (param(&[v, c], 71), param(&[v, c], 71));
    run(&emb, &head);
    let (emb_grad, head_grad) = (emb.grad().unwrap(), head.grad().unwrap());
    assert_eq!(
        (emb_grad.dtype(), head_grad.dtype()),
        (DType::F32, DType::F32)
    );
    assert_same_bits(
        "head.grad, bf16 values",
        &f32(&bf16(&head_grad)),
        &head_grad,
    );
    let want = emb_grad.add(&head_grad).unwrap();
    assert_same_bits("tied.grad", &tied.grad().unwrap(), &want);
}

// ---- type promotion (with or without autocast) -------------------------------------------

#[test]
fn binary_ops_promote_float_dtypes() {
    let _l = lock();
    let a = randn(&[2, 3], 19).requires_grad_(true).unwrap();
    let b = randn(&[2, 3], 20)
        .to_dtype(DType::BF16)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let y = a.mul(&b).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    y.sum_all().unwrap().backward().unwrap();
    // Each gradient comes back in its operand's dtype: d(a·b)/da = b, d/db = a.
    assert_eq!(a.grad().unwrap().dtype(), DType::F32);
    assert_eq!(b.grad().unwrap().dtype(), DType::BF16);
    assert_close("a.grad", &a.grad().unwrap(), &b.detach(), 0.0, 0.0);
    assert_close("b.grad", &b.grad().unwrap(), &a.detach(), 1e-2, 1e-2);

    let f = |d: DType| Tensor::ones(&[2], d, CPU).unwrap();
    let scalar = |d: DType| Tensor::scalar(2.0, d, CPU).unwrap();
    let cases = [
        ("f16 + bf16", f(DType::F16).add(&f(DType::BF16)), DType::F32),
        ("bf16 - f32", f(DType::BF16).sub(&f(DType::F32)), DType::F32),
        ("f32 / f64", f(DType::F32).div(&f(DType::F64)), DType::F64),
        ("f16 ^ f32", f(DType::F16).pow(&f(DType::F32)), DType::F32),
        // A 0-dim operand does not widen a dimensioned one.
        (
            "bf16 * f32 0-dim",
            f(DType::BF16).mul(&scalar(DType::F32)),
            DType::BF16,
        ),
        (
            "f32 0-dim * f16",
            scalar(DType::F32).mul(&f(DType::F16)),
            DType::F16,
        ),
        (
            "0-dim f64 + 0-dim f32",
            scalar(DType::F64).add(&scalar(DType::F32)),
            DType::F64,
        ),
        (
            "where(f32, bf16)",
            Tensor::where_(
                &Tensor::from_vec(vec![1u8, 0], &[2], CPU).unwrap(),
                &f(DType::F32),
                &f(DType::BF16),
            ),
            DType::F32,
        ),
    ];
    for (name, out, want) in cases {
        assert_eq!(out.unwrap().dtype(), want, "{name}");
    }
    // Integer/float mixes and devices are still errors.
    let ids = Tensor::from_vec(vec![1i64, 2], &[2], CPU).unwrap();
    assert!(matches!(f(DType::F32).add(&ids), Err(Error::DType { .. })));
    let meta = Tensor::ones(&[2], DType::F64, Device::Meta).unwrap();
    assert!(matches!(
        f(DType::F32).add(&meta),
        Err(Error::DeviceMismatch { .. })
    ));
}

/// `f(a, b)` and the gradients of a and b (fresh leaves) after a backward from a random
/// f32 gradient.
fn binary_and_grads(
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
) -> (Tensor, Tensor, Tensor) {
    let leaf = |t: &Tensor| t.detach().requires_grad_(true).unwrap();
    let (a, b) = (leaf(a), leaf(b));
    let y = f(&a, &b).unwrap();
    let gy = Tensor::randn_with(y.shape(), DType::F32, CPU, &mut Generator::new(9)).unwrap();
    let opts = BackwardOptions {
        gradient: Some(gy),
        ..Default::default()
    };
    y.backward_with(opts).unwrap();
    (y.detach(), a.grad().unwrap(), b.grad().unwrap())
}

#[test]
fn f32_and_half_add_and_sub_equal_promotion_bit_for_bit() {
    let _l = lock();
    type Op = fn(&Tensor, &Tensor) -> Result<Tensor>;
    let ops: [(&str, Op); 2] = [("add", |a, b| a.add(b)), ("sub", |a, b| a.sub(b))];
    // Same shape (the residual add), broadcasts either way, and a transposed half operand.
    let shapes: [(&[usize], &[usize]); 4] = [
        (&[4, 5, 24], &[4, 5, 24]),
        (&[4, 5, 24], &[24]),
        (&[24], &[4, 5, 24]),
        (&[3, 1, 7], &[5, 1]),
    ];
    for half in [DType::BF16, DType::F16] {
        for (i, (sa, sb)) in shapes.iter().enumerate() {
            let x = randn(sa, 30 + i as u64);
            let h = randn(sb, 40 + i as u64).to_dtype(half).unwrap();
            let transposed = randn(&[24, 20], 50).to_dtype(half).unwrap().t().unwrap();
            let pairs = [
                (x.clone(), h.clone()),
                (h.clone(), x.clone()),
                (randn(&[20, 24], 51), transposed),
            ];
            for (a, b) in pairs {
                for (name, op) in ops {
                    let what = format!(
                        "{} {name} {} {:?} {:?}",
                        a.dtype(),
                        b.dtype(),
                        a.shape(),
                        b.shape()
                    );
                    let (y, ga, gb) = binary_and_grads(&a, &b, op);
                    let promoted = |a: &Tensor, b: &Tensor| {
                        op(&a.to_dtype(DType::F32)?, &b.to_dtype(DType::F32)?)
                    };
                    let (want, wa, wb) = binary_and_grads(&a, &b, promoted);
                    assert_same_bits(&format!("{what}: output"), &y, &want);
                    assert_same_bits(&format!("{what}: a.grad"), &ga, &wa);
                    assert_same_bits(&format!("{what}: b.grad"), &gb, &wb);
                }
            }
        }
    }
}

#[test]
fn an_f32_and_half_add_allocates_only_its_output() {
    let _l = lock();
    let (x, h) = (
        randn(&[64, 32], 60),
        randn(&[64, 32], 61).to_dtype(DType::BF16).unwrap(),
    );
    let base = memory::memory_allocated(CPU).unwrap();
    memory::reset_peak_memory_stats(CPU).unwrap();
    let y = x.add(&h).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    // No f32 copy of the bf16 operand, not even for a moment.
    let peak = memory::max_memory_allocated(CPU).unwrap() - base;
    assert_eq!(peak as usize, 64 * 32 * F32);
}

// ---- a tiny GPT ------------------------------------------------------------------------------

#[test]
fn tiny_gpt_trains_under_bf16() {
    let _l = lock();
    // The loss (~ln 65 = 4.2) through bf16 matmuls stays within 0.2 % of the f32 loss
    // (measured 6e-6 relative: at GPT-2's init the logits are small, and their bf16 rounding
    // too); gradients: cosine >= 0.99998, sizes within 0.15 % measured.
    let f32_step = gpt_step(None, CPU);
    let bf16_step = gpt_step(Some(AmpDType::BF16), CPU);
    assert_steps_agree(&bf16_step, &f32_step);
}

/// The loss of `model` on (ids, targets) as the GPT forward composed its ops before the norms
/// wrote half outputs and the residual adds read half branches: each norm in f32, its output
/// cast by the Linear after it; each branch output cast to f32, then added.
fn gpt_loss_by_explicit_casts(model: &Gpt, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let t = ids.shape()[1];
    let pos = Tensor::arange(0.0, t as f64, 1.0, DType::I64, CPU)?;
    let x = model.wte.forward(ids)?.add(&model.wpe.forward(&pos)?)?;
    let mut x = model.drop.forward(&x)?;
    let mask = causal_mask(model.config.block_size, CPU)?;
    for b in &model.blocks {
        let h = b.ln_1.forward(&x)?;
        x = x.add(&b.attn.forward_masked(&h, &mask)?.to_dtype(DType::F32)?)?;
        let h = b.ln_2.forward(&x)?;
        x = x.add(&b.mlp.forward(&h)?.to_dtype(DType::F32)?)?;
    }
    let x = model.ln_f.forward(&x)?;
    x.linear(&model.wte.weight, None)?
        .cross_entropy(targets, IGNORE_INDEX)
}

/// (loss, gradients by name) of one backward of `loss` over `model`'s fresh parameters.
fn loss_and_grads(
    model: &Gpt,
    loss: impl FnOnce() -> Result<Tensor>,
) -> (Tensor, Vec<(String, Tensor)>) {
    let loss = loss().unwrap();
    loss.backward().unwrap();
    let grads = model
        .named_parameters()
        .into_iter()
        .map(|(n, p)| {
            let g = p.grad().unwrap_or_else(|| panic!("{n}: no gradient"));
            (n, g)
        })
        .collect();
    (loss.detach(), grads)
}

#[test]
fn gpt_under_autocast_equals_the_explicit_cast_composition_bit_for_bit() {
    let _l = lock();
    let cases = [
        (AmpDType::BF16, true, Recompute::Off),
        (AmpDType::F16, false, Recompute::Off),
        (AmpDType::BF16, true, Recompute::Every(1)),
    ];
    for (amp, bias, recompute) in cases {
        let what = format!("{:?} bias {bias} {recompute:?}", amp.dtype());
        let config = GptConfig {
            bias,
            ..GptConfig::tiny()
        };
        let (ids, targets) = token_batch(3, CPU);
        // Two models with the same seed: the same weights, separate gradients.
        let mut model = Gpt::new(config.clone(), CPU).unwrap();
        model.set_recompute(recompute);
        let reference = Gpt::new(config, CPU).unwrap();
        let (loss, grads) = loss_and_grads(&model, || {
            let _amp = autocast(amp);
            Ok(model.forward_loss(&ids, Some(&targets))?.1.unwrap())
        });
        let (want, want_grads) = loss_and_grads(&reference, || {
            let _amp = autocast(amp);
            gpt_loss_by_explicit_casts(&reference, &ids, &targets)
        });
        assert_same_bits(&format!("{what}: loss"), &loss, &want);
        for ((name, g), (_, w)) in grads.iter().zip(&want_grads) {
            assert_same_bits(&format!("{what}: {name}.grad"), g, w);
        }
    }
}

#[test]
fn a_norm_before_a_linear_writes_the_dtype_the_linear_reads() {
    let _l = lock();
    let ln = LayerNorm::new(16, true, CPU).unwrap();
    let x = randn(&[3, 16], 70);
    // Outside a region: the plain norm.
    assert_eq!(ln.forward_for_linear(&x).unwrap().dtype(), DType::F32);
    for amp in [AmpDType::BF16, AmpDType::F16] {
        let _amp = autocast(amp);
        let d = amp.dtype();
        assert_eq!(ln.forward_for_linear(&x).unwrap().dtype(), d, "f32 input");
        let half = x.to_dtype(d).unwrap();
        assert_eq!(
            ln.forward_for_linear(&half).unwrap().dtype(),
            d,
            "{d} input"
        );
        // f64 is outside autocast's policy: neither the norm nor the Linear casts it.
        let ln64 = LayerNorm::new_with_dtype(16, true, DType::F64, CPU).unwrap();
        let wide = x.to_dtype(DType::F64).unwrap();
        assert_eq!(ln64.forward_for_linear(&wide).unwrap().dtype(), DType::F64);
    }
}

#[test]
fn a_half_layer_norm_output_allocates_no_f32_copy() {
    let _l = lock();
    let (r, n) = (64, 32);
    let ln = LayerNorm::new(n, true, CPU).unwrap();
    let x = randn(&[r, n], 71);
    let base = memory::memory_allocated(CPU).unwrap();
    memory::reset_peak_memory_stats(CPU).unwrap();
    let y = {
        let _g = no_grad();
        ln.forward_to(&x, DType::BF16).unwrap()
    };
    assert_eq!(y.dtype(), DType::BF16);
    // The bf16 output and the row statistics (mean, rstd: f32 each); no f32 output.
    let peak = memory::max_memory_allocated(CPU).unwrap() - base;
    assert_eq!(peak as usize, r * n * BF16 + 2 * r * F32);
}

// ---- the fused classifier: half logits read in place, their gradient written into them ---

/// (logits leaf bf16 (n, c), targets with one ignored row) for the classifier tests.
fn classifier_case(n: usize, c: usize) -> (Tensor, Tensor) {
    let z = randn(&[n, c], 21)
        .mul_scalar(3.0)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let mut t: Vec<i64> = (0..n as i64).map(|i| (i * 7) % c as i64).collect();
    t[1] = -100;
    (z, Tensor::from_vec(t, &[n], CPU).unwrap())
}

/// What PyTorch's autocast computes: an f32 copy of the logits, its cross-entropy, and the
/// f32 gradient cast back to bf16. Returns (loss f32, gradient bf16).
fn classifier_by_explicit_casts(z: &Tensor, t: &Tensor) -> (Vec<f32>, Vec<half::bf16>) {
    let z = z.detach().requires_grad_(true).unwrap();
    let loss = z
        .to_dtype(DType::F32)
        .unwrap()
        .cross_entropy(t, -100)
        .unwrap();
    loss.backward().unwrap();
    (
        loss.to_vec::<f32>().unwrap(),
        z.grad().unwrap().to_vec::<half::bf16>().unwrap(),
    )
}

#[test]
fn cross_entropy_of_half_logits_makes_no_f32_copy_and_overwrites_them_with_their_gradient() {
    let _l = lock();
    let (n, c) = (64, 100);
    let (z, t) = classifier_case(n, c);
    let (want_loss, want_grad) = classifier_by_explicit_casts(&z, &t);
    let amp = autocast(AmpDType::BF16);
    // An op output that only the graph will hold once the caller drops it (as a model's
    // logits are dropped after the loss).
    let base = snap();
    let logits = z.mul_scalar(1.0).unwrap();
    let loss = logits.cross_entropy(&t, -100).unwrap();
    assert_eq!(loss.dtype(), DType::F32);
    // The logits (now saved), one log-sum-exp per row and the loss: no (n, c) f32 copy.
    assert_usage(
        "after the loss",
        base,
        &[
            (Category::SavedActivation, n * c * BF16 + n * F32),
            (Category::Temporary, F32),
        ],
    );
    drop(logits);
    loss.backward().unwrap();
    drop(amp);
    assert_eq!(loss.to_vec::<f32>().unwrap(), want_loss);
    assert_eq!(
        z.grad().unwrap().to_vec::<half::bf16>().unwrap(),
        want_grad,
        "the gradient must equal the f32 gradient rounded to bf16"
    );
}

#[test]
fn the_logits_gradient_takes_the_logits_buffer_when_nothing_else_reads_them() {
    let _l = lock();
    let (n, k, c) = (64, 4, 100);
    let x = param(&[n, k], 22);
    let w_leaf = param(&[c, k], 23);
    let t = classifier_case(n, c).1;
    // f16: the CPU's bf16 GEMM widens its operands to f32, which would hide what is measured.
    // A weight that is not a leaf for the same reason: a parameter's gradient is an
    // f32-output GEMM, which the CPU runs on f32 copies of the (n, c) logits' gradient.
    let w = w_leaf.mul_scalar(1.0).unwrap();
    let _amp = autocast(AmpDType::F16);
    // A head GEMM's logits, dropped by the caller after the loss as a training step does.
    let logits = x.linear(&w, None).unwrap();
    let loss = logits.cross_entropy(&t, -100).unwrap();
    drop(logits);
    memory::reset_peak_memory_stats(CPU).unwrap();
    let before = memory::memory_allocated(CPU).unwrap();
    loss.backward().unwrap();
    // The backward's own blocks are dx, dW and their bf16 forms (a few (n, k) and (c, k)
    // blocks): a fresh (n, c) block for the logits' gradient would exceed that bound.
    let grew = memory::max_memory_allocated(CPU).unwrap() - before;
    let logits_block = (n * c * 2) as u64;
    assert!(
        grew < logits_block / 2,
        "the backward's peak grew by {grew} bytes: the gradient did not reuse the logits ({logits_block} bytes)"
    );
    assert!(x.grad().is_some() && w_leaf.grad().is_some());
}

#[test]
fn logits_that_the_caller_keeps_or_a_retained_graph_needs_are_not_overwritten() {
    let _l = lock();
    let (z, t) = classifier_case(16, 9);
    let (_, want_grad) = classifier_by_explicit_casts(&z, &t);
    let _amp = autocast(AmpDType::BF16);
    let logits = z.mul_scalar(1.0).unwrap();
    let values = logits.to_vec::<half::bf16>().unwrap();
    let loss = logits.cross_entropy(&t, -100).unwrap();
    let keep = BackwardOptions {
        retain_graph: true,
        ..Default::default()
    };
    loss.backward_with(keep).unwrap();
    assert_eq!(
        logits.to_vec::<half::bf16>().unwrap(),
        values,
        "kept logits"
    );
    assert_eq!(z.grad().unwrap().to_vec::<half::bf16>().unwrap(), want_grad);
    // The retained graph runs again on intact logits (the caller's handle dropped now).
    drop(logits);
    z.set_grad(None).unwrap();
    loss.backward().unwrap();
    assert_eq!(z.grad().unwrap().to_vec::<half::bf16>().unwrap(), want_grad);
}

#[test]
fn logits_with_padded_rows_are_read_in_place_and_give_the_contiguous_results() {
    let _l = lock();
    let (n, c, ld) = (12, 10, 16);
    let t = classifier_case(n, c).1;
    // Rows 16 apart, the layout of a GPU head GEMM's padded output.
    let block = randn(&[n, ld], 24).requires_grad_(true).unwrap();
    let padded = block.narrow(1, 0, c).unwrap();
    assert_eq!(padded.strides(), &[ld as isize, 1]);
    let dense = padded
        .detach()
        .contiguous()
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let a = padded.cross_entropy(&t, -100).unwrap();
    let b = dense.cross_entropy(&t, -100).unwrap();
    assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    a.backward().unwrap();
    b.backward().unwrap();
    let got = block.grad().unwrap().to_vec::<f32>().unwrap();
    let want = dense.grad().unwrap().to_vec::<f32>().unwrap();
    for r in 0..n {
        assert_eq!(
            &got[r * ld..r * ld + c],
            &want[r * c..(r + 1) * c],
            "row {r}"
        );
        assert!(
            got[r * ld + c..(r + 1) * ld].iter().all(|&v| v == 0.0),
            "padding of row {r}"
        );
    }
}
