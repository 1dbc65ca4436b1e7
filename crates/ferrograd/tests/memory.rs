//! Memory behaviour to the byte, on the CPU (whose allocator counts exact bytes and caches
//! nothing, so reserved == allocated): what a small MLP holds before and after backward and
//! in which categories, no_grad, retain_graph, set_to_none vs zeroing, saved tensors released
//! node by node during backward, peaks, the statistics keys, the summary, and out-of-memory
//! errors on a limited (meta) device.
//!
//! The allocators are process-wide and tests run on parallel threads, so every test here
//! takes `LOCK` first and measures from a baseline taken after it.

use std::sync::{Arc, Mutex, MutexGuard};

use ferrograd::memory::{self, CategoryBytes, HostPolicy};
use ferrograd::{BackwardOptions, Category, DType, Device, Error, Generator, Tensor, no_grad};

const CPU: Device = Device::Cpu;
const F32: usize = 4;

static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    // A failed test must not fail every later one.
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Allocated bytes, per category, at a point in time.
#[derive(Clone, Copy)]
struct Snap {
    total: u64,
    cats: CategoryBytes,
}

fn snap() -> Snap {
    snap_on(CPU)
}

fn snap_on(device: Device) -> Snap {
    Snap {
        total: memory::memory_allocated(device).unwrap(),
        cats: memory::memory_by_category(device).unwrap(),
    }
}

impl Snap {
    /// Bytes allocated since `base`: the total, then each category in `Category::ALL` order.
    fn since(&self, base: Snap) -> Vec<i64> {
        let d = |a: u64, b: u64| a as i64 - b as i64;
        let cats = Category::ALL.map(|c| d(self.cats.get(c), base.cats.get(c)));
        [vec![d(self.total, base.total)], cats.to_vec()].concat()
    }
}

/// Asserts the bytes allocated since `base`, in total and per category (unlisted: 0), and
/// the invariants: categories sum to memory_allocated, reserved == allocated on the host.
#[track_caller]
fn assert_usage(what: &str, base: Snap, total: usize, cats: &[(Category, usize)]) {
    let now = snap();
    assert_eq!(
        now.cats.total(),
        now.total,
        "{what}: categories must sum to memory_allocated"
    );
    assert_eq!(
        memory::memory_reserved(CPU).unwrap(),
        now.total,
        "{what}: host reserved == allocated"
    );
    let delta = |a: u64, b: u64| a as i64 - b as i64;
    assert_eq!(
        delta(now.total, base.total),
        total as i64,
        "{what}: memory_allocated delta"
    );
    for c in Category::ALL {
        let want = cats
            .iter()
            .find(|(k, _)| *k == c)
            .map_or(0, |(_, b)| *b as i64);
        assert_eq!(
            delta(now.cats.get(c), base.cats.get(c)),
            want,
            "{what}: {c} delta"
        );
    }
}

fn param(shape: &[usize]) -> Tensor {
    param_on(shape, CPU)
}

fn param_on(shape: &[usize], device: Device) -> Tensor {
    let t = Tensor::randn(shape, DType::F32, device).unwrap();
    t.set_category(Category::Parameter);
    t.requires_grad_(true).unwrap()
}

/// Linear(d, d) → ReLU → Linear(d, d).
struct Mlp {
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
}

impl Mlp {
    fn new(d: usize) -> Mlp {
        Mlp::new_on(d, CPU)
    }
    fn new_on(d: usize, device: Device) -> Mlp {
        Mlp {
            w1: param_on(&[d, d], device),
            b1: param_on(&[d], device),
            w2: param_on(&[d, d], device),
            b2: param_on(&[d], device),
        }
    }
    fn forward(&self, x: &Tensor) -> Tensor {
        x.linear(&self.w1, Some(&self.b1))
            .unwrap()
            .relu()
            .unwrap()
            .linear(&self.w2, Some(&self.b2))
            .unwrap()
    }
    fn params(&self) -> [&Tensor; 4] {
        [&self.w1, &self.b1, &self.w2, &self.b2]
    }
}

const D: usize = 8;
const N: usize = 4;
/// Parameter bytes: two (D, D) weights and two (D) biases.
const P: usize = (2 * D * D + 2 * D) * F32;
/// Bytes of one (N, D) activation.
const X: usize = N * D * F32;

fn input() -> Tensor {
    Tensor::randn(&[N, D], DType::F32, CPU).unwrap()
}

#[test]
fn mlp_before_and_after_backward() {
    let _l = lock();
    let base = snap();
    let mlp = Mlp::new(D);
    let x = input();
    assert_usage(
        "params + input",
        base,
        P + X,
        &[(Category::Parameter, P), (Category::Input, X)],
    );

    // The first layer's output dies inside the expression; ReLU keeps its output for backward.
    let out = mlp.forward(&x);
    use Category::*;
    let before = [
        (Parameter, P),
        (Input, X),
        (SavedActivation, X),
        (Temporary, X),
    ];
    assert_usage("before backward", base, P + 3 * X, &before);

    out.sum_all().unwrap().backward().unwrap();
    let after = [(Parameter, P), (Gradient, P), (Input, X), (Temporary, X)];
    assert_usage("after backward", base, 2 * P + 2 * X, &after);
    for p in mlp.params() {
        assert_eq!(p.grad().unwrap().category(), Some(Gradient));
    }

    // A second iteration accumulates into the same gradient bytes.
    drop(out);
    let grads: Vec<Tensor> = mlp.params().iter().map(|p| p.grad().unwrap()).collect();
    let out = mlp.forward(&x);
    let second = [
        (Parameter, P),
        (Gradient, P),
        (Input, X),
        (SavedActivation, X),
        (Temporary, X),
    ];
    assert_usage("second forward", base, 2 * P + 3 * X, &second);
    out.sum_all().unwrap().backward().unwrap();
    assert_usage("after second backward", base, 2 * P + 2 * X, &after);
    for (p, g) in mlp.params().iter().zip(&grads) {
        assert!(p.grad().unwrap().shares_storage(g));
    }
    drop((out, x, grads, mlp));
    assert_usage("all dropped", base, 0, &[]);
}

#[test]
fn meta_device_accounts_like_the_cpu() {
    // The planner predicts memory by running the step on the meta device: its counts must
    // be the CPU's, byte for byte and category by category, at every stage.
    let _l = lock();
    let stages = |device: Device| {
        let base = snap_on(device);
        let mlp = Mlp::new_on(D, device);
        let x = Tensor::randn(&[N, D], DType::F32, device).unwrap();
        let out = mlp.forward(&x);
        let before = snap_on(device).since(base);
        out.sum_all().unwrap().backward().unwrap();
        let after = snap_on(device).since(base);
        drop(out);
        for p in mlp.params() {
            p.set_grad(None).unwrap();
        }
        let cleared = snap_on(device).since(base);
        [before, after, cleared]
    };
    let cpu = stages(CPU);
    assert_eq!(
        cpu[0][0],
        (P + 3 * X) as i64,
        "the CPU run is the known MLP step"
    );
    assert_eq!(stages(Device::Meta), cpu);
}

#[test]
fn saved_output_is_relabelled_while_the_graph_holds_it() {
    let _l = lock();
    let base = snap();
    let x = param(&[N, D]);
    let r = x.relu().unwrap();
    assert_eq!(r.category(), Some(Category::SavedActivation));
    assert_usage(
        "relu saved",
        base,
        2 * X,
        &[(Category::Parameter, X), (Category::SavedActivation, X)],
    );
    r.sum_all().unwrap().backward().unwrap();
    assert_eq!(
        r.category(),
        Some(Category::Temporary),
        "released by backward, still held by the user"
    );
    assert_usage(
        "after backward",
        base,
        3 * X,
        &[
            (Category::Parameter, X),
            (Category::Temporary, X),
            (Category::Gradient, X),
        ],
    );
}

#[test]
fn no_grad_forward_saves_nothing() {
    let _l = lock();
    let base = snap();
    let mlp = Mlp::new(D);
    let x = input();
    let out = {
        let _g = no_grad();
        mlp.forward(&x)
    };
    assert!(!out.requires_grad());
    assert_usage(
        "no_grad forward",
        base,
        P + 2 * X,
        &[
            (Category::Parameter, P),
            (Category::Input, X),
            (Category::Temporary, X),
        ],
    );
}

#[test]
fn frozen_layer_keeps_no_input() {
    let _l = lock();
    use Category::*;
    for frozen in [false, true] {
        let base = snap();
        let mlp = Mlp::new(D);
        if frozen {
            mlp.w2.clone().requires_grad_(false).unwrap();
            mlp.b2.clone().requires_grad_(false).unwrap();
        }
        let x = input();
        // mul_scalar saves nothing: only layer 2 could keep its input, for dW2.
        let h = x
            .linear(&mlp.w1, Some(&mlp.b1))
            .unwrap()
            .mul_scalar(2.0)
            .unwrap();
        let out = h.linear(&mlp.w2, Some(&mlp.b2)).unwrap();
        drop(h);
        let saved = if frozen { 0 } else { X };
        let what = if frozen {
            "frozen layer 2"
        } else {
            "trainable layer 2"
        };
        assert_usage(
            what,
            base,
            P + 2 * X + saved,
            &[
                (Parameter, P),
                (Input, X),
                (SavedActivation, saved),
                (Temporary, X),
            ],
        );
        out.sum_all().unwrap().backward().unwrap();
        let grads = if frozen { (D * D + D) * F32 } else { P };
        assert_usage(
            what,
            base,
            P + grads + 2 * X,
            &[
                (Parameter, P),
                (Gradient, grads),
                (Input, X),
                (Temporary, X),
            ],
        );
        assert_eq!(mlp.w2.grad().is_none(), frozen);
    }
}

#[test]
fn retain_graph_keeps_saved_tensors_until_the_graph_is_dropped() {
    let _l = lock();
    let base = snap();
    let mlp = Mlp::new(D);
    let x = input();
    let out = mlp.forward(&x);
    out.sum_all()
        .unwrap()
        .backward_with(BackwardOptions {
            retain_graph: true,
            ..Default::default()
        })
        .unwrap();
    use Category::*;
    assert_usage(
        "retained",
        base,
        2 * P + 3 * X,
        &[
            (Parameter, P),
            (Gradient, P),
            (Input, X),
            (SavedActivation, X),
            (Temporary, X),
        ],
    );
    drop(out);
    assert_usage(
        "graph dropped",
        base,
        2 * P + X,
        &[(Parameter, P), (Gradient, P), (Input, X)],
    );
}

#[test]
fn set_to_none_frees_grads_and_zeroing_keeps_them() {
    let _l = lock();
    let base = snap();
    let mlp = Mlp::new(D);
    let x = input();
    mlp.forward(&x).sum_all().unwrap().backward().unwrap();
    use Category::*;
    assert_usage(
        "after backward",
        base,
        2 * P + X,
        &[(Parameter, P), (Gradient, P), (Input, X)],
    );

    // zero_grad(set_to_none=False): same bytes, zero values.
    for p in mlp.params() {
        p.grad().unwrap().zero_().unwrap();
        assert!(
            p.grad()
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .all(|&v| v == 0.0)
        );
    }
    assert_usage(
        "zeroed in place",
        base,
        2 * P + X,
        &[(Parameter, P), (Gradient, P), (Input, X)],
    );

    // zero_grad(set_to_none=True): every gradient byte goes back.
    mlp.w1.set_grad(None).unwrap();
    let rest = P - D * D * F32;
    assert_usage(
        "w1 grad freed",
        base,
        P + rest + X,
        &[(Parameter, P), (Gradient, rest), (Input, X)],
    );
    for p in mlp.params() {
        p.set_grad(None).unwrap();
    }
    assert_usage(
        "all grads freed",
        base,
        P + X,
        &[(Parameter, P), (Input, X)],
    );

    // The next backward assigns fresh gradients again.
    mlp.forward(&x).sum_all().unwrap().backward().unwrap();
    assert_usage(
        "backward after set_to_none",
        base,
        2 * P + X,
        &[(Parameter, P), (Gradient, P), (Input, X)],
    );
}

#[test]
fn set_grad_relabels_as_gradient() {
    let _l = lock();
    let base = snap();
    let w = param(&[D]);
    w.set_grad(Some(Tensor::ones(&[D], DType::F32, CPU).unwrap()))
        .unwrap();
    assert_usage(
        "manual grad",
        base,
        2 * D * F32,
        &[
            (Category::Parameter, D * F32),
            (Category::Gradient, D * F32),
        ],
    );
    assert!(matches!(
        w.set_grad(Some(Tensor::ones(&[D + 1], DType::F32, CPU).unwrap())),
        Err(Error::Shape { .. })
    ));
}

#[test]
fn backward_releases_saved_tensors_node_by_node() {
    let _l = lock();
    const K: usize = 1024;
    let bytes = K * F32;
    let base = snap();
    // x → a = exp(x) → b = exp(a) → c = sum(b); each exp saves its output.
    let x = param(&[K]);
    let a = x.exp().unwrap();
    let c = a.exp().unwrap().sum_all().unwrap(); // b is held only by its node
    use Category::*;
    assert_usage(
        "forward",
        base,
        3 * bytes + F32,
        &[
            (Parameter, bytes),
            (SavedActivation, 2 * bytes),
            (Temporary, F32),
        ],
    );

    // When a's gradient arrives, b's node has run: b is gone, a is still saved. Live: x, a,
    // a's incoming gradient, c.
    let in_hook: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
    let seen = Arc::clone(&in_hook);
    a.register_hook(move |_| {
        let s = snap();
        seen.lock().unwrap().push((
            s.total - base.total,
            s.cats.get(SavedActivation) - base.cats.get(SavedActivation),
        ));
        Ok(None)
    });
    // When x's gradient has landed, a's node has run too: nothing is saved any more. Live:
    // x, a (held here), x.grad, c.
    let after_leaf: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
    let seen = Arc::clone(&after_leaf);
    x.register_post_accumulate_grad_hook(move |_| {
        let s = snap();
        seen.lock().unwrap().push((
            s.total - base.total,
            s.cats.get(SavedActivation) - base.cats.get(SavedActivation),
        ));
        Ok(())
    })
    .unwrap();

    c.backward().unwrap();
    let (b, f) = (bytes as u64, F32 as u64);
    assert_eq!(
        *in_hook.lock().unwrap(),
        [(3 * b + f, b)],
        "(total, saved) when a's gradient arrives"
    );
    assert_eq!(
        *after_leaf.lock().unwrap(),
        [(3 * b + f, 0)],
        "(total, saved) after x.grad landed"
    );
    assert_usage(
        "after backward",
        base,
        3 * bytes + F32,
        &[
            (Parameter, bytes),
            (Gradient, bytes),
            (Temporary, bytes + F32),
        ],
    );
}

#[test]
fn peak_tracking() {
    let _l = lock();
    memory::reset_peak_memory_stats(CPU).unwrap();
    let base = memory::memory_allocated(CPU).unwrap();
    assert_eq!(
        memory::max_memory_allocated(CPU).unwrap(),
        base,
        "reset: peak = current"
    );
    let a = Tensor::zeros(&[250], DType::F32, CPU).unwrap(); // 1000 bytes
    let b = Tensor::zeros(&[250], DType::F64, CPU).unwrap(); // 2000 bytes
    drop(a);
    let c = Tensor::zeros(&[125], DType::F32, CPU).unwrap(); // 500 bytes
    assert_eq!(memory::max_memory_allocated(CPU).unwrap(), base + 3000);
    assert_eq!(memory::max_memory_reserved(CPU).unwrap(), base + 3000);
    let stats = memory::memory_stats(CPU).unwrap();
    assert_eq!(stats["allocated_bytes.all.peak"], (base + 3000) as i64);
    memory::reset_peak_memory_stats(CPU).unwrap();
    assert_eq!(memory::max_memory_allocated(CPU).unwrap(), base + 2500);
    drop((b, c));
    assert_eq!(
        memory::max_memory_allocated(CPU).unwrap(),
        base + 2500,
        "frees do not lower the peak"
    );
}

#[test]
fn peak_of_a_training_step_is_reached_in_backward() {
    let _l = lock();
    let base = snap();
    let mlp = Mlp::new(D);
    let x = input();
    memory::reset_peak_memory_stats(CPU).unwrap();
    let out = mlp.forward(&x);
    let forward_peak = memory::max_memory_allocated(CPU).unwrap() - base.total;
    assert!(forward_peak >= (P + 3 * X) as u64);
    out.sum_all().unwrap().backward().unwrap();
    let step_peak = memory::max_memory_allocated(CPU).unwrap() - base.total;
    // Gradients appear while activations are still held: the step peaks above both the
    // forward and the steady state after backward.
    assert!(step_peak > forward_peak, "{step_peak} vs {forward_peak}");
    assert!(step_peak > (2 * P + 2 * X) as u64);
}

#[test]
fn memory_stats_keys_follow_pytorch() {
    let _l = lock();
    let s0 = memory::memory_stats(CPU).unwrap();
    let small = Tensor::zeros(&[250], DType::F32, CPU).unwrap(); // 1000 bytes: small pool
    let large = Tensor::zeros(&[1 << 19], DType::F32, CPU).unwrap(); // 2 MiB: large pool
    let s1 = memory::memory_stats(CPU).unwrap();
    let d = |k: &str| s1[k] - s0[k];
    let now = memory::memory_allocated(CPU).unwrap() as i64;
    assert_eq!(s1["allocated_bytes.all.current"], now);
    assert_eq!(s1["reserved_bytes.all.current"], now);
    assert_eq!(s1["active_bytes.all.current"], now);
    assert_eq!(s1["requested_bytes.all.current"], now);
    assert_eq!(d("allocated_bytes.small_pool.current"), 1000);
    assert_eq!(d("allocated_bytes.large_pool.current"), 2 << 20);
    assert_eq!(d("allocation.all.current"), 2);
    assert_eq!(d("allocation.small_pool.current"), 1);
    assert_eq!(d("allocation.large_pool.current"), 1);
    assert_eq!(d("segment.all.current"), 2);
    assert_eq!(d("num_device_alloc"), 2);
    assert_eq!(d("inactive_split_bytes.all.current"), 0);
    drop((small, large));
    let s2 = memory::memory_stats(CPU).unwrap();
    assert_eq!(s2["num_device_free"] - s1["num_device_free"], 2);
    assert_eq!(
        s2["allocated_bytes.all.freed"] - s1["allocated_bytes.all.freed"],
        1000 + (2 << 20)
    );
    assert_eq!(
        s2["allocated_bytes.all.current"],
        s0["allocated_bytes.all.current"]
    );
    for key in [
        "num_ooms",
        "num_alloc_retries",
        "inactive_split.all.current",
        "segment.large_pool.peak",
    ] {
        assert!(s2.contains_key(key), "missing {key}");
    }
    assert_eq!(
        s2.len(),
        9 * 3 * 4 + 4,
        "nine stat arrays × three pools × four fields, plus counters"
    );
}

#[test]
fn memory_summary_shows_categories() {
    let _l = lock();
    let w = param(&[D, D]);
    let s = memory::memory_summary(CPU).unwrap();
    for needle in [
        "Allocated memory",
        "Reserved memory",
        "device cpu",
        "Category",
    ] {
        assert!(s.contains(needle), "summary lacks {needle}:\n{s}");
    }
    for c in Category::ALL {
        assert!(
            s.lines()
                .any(|l| l.starts_with(&format!("| {:<21} |", c.name()))),
            "summary lacks {c}:\n{s}"
        );
    }
    drop(w);
}

// ---- out of memory --------------------------------------------------------------------------

/// Runs `f` with a `limit`-byte host policy on the meta device, then restores an unlimited one.
fn with_meta_limit(limit: u64, f: impl FnOnce()) {
    let _l = lock();
    memory::install_policy(Device::Meta, Box::new(HostPolicy::new(limit))).unwrap();
    f();
    memory::install_policy(Device::Meta, Box::new(HostPolicy::new(u64::MAX))).unwrap();
}

#[test]
fn oom_is_an_error_that_explains_itself() {
    with_meta_limit(1 << 20, || {
        let meta = Device::Meta;
        let keep = Tensor::zeros(&[1000], DType::F32, meta).unwrap(); // 4000 bytes
        keep.set_category(Category::Parameter);
        let err = Tensor::zeros(&[1 << 20], DType::F32, meta).unwrap_err(); // 4 MiB
        assert!(err.is_out_of_memory());
        let Error::OutOfMemory(report) = &err else {
            panic!("{err:?}")
        };
        assert_eq!(report.requested, 4 << 20);
        assert_eq!(report.allocated, 4000);
        assert_eq!(report.by_category.get(Category::Parameter), 4000);
        let msg = err.to_string();
        for needle in [
            "out of memory on meta",
            "4.00 MiB",
            "allocated by category",
            "parameter",
            "what to try",
            "smaller batch",
        ] {
            assert!(msg.contains(needle), "OOM message lacks '{needle}':\n{msg}");
        }
        assert_eq!(memory::memory_stats(meta).unwrap()["num_ooms"], 1);

        // Nothing was half-allocated, existing tensors are intact, smaller requests succeed.
        assert_eq!(memory::memory_allocated(meta).unwrap(), 4000);
        assert_eq!(keep.shape(), [1000]);
        assert_eq!(keep.category(), Some(Category::Parameter));
        let small = Tensor::zeros(&[1000], DType::F32, meta).unwrap();
        assert_eq!(memory::memory_allocated(meta).unwrap(), 8000);
        drop((keep, small));
        assert_eq!(memory::memory_allocated(meta).unwrap(), 0);
    });
}

#[test]
fn oom_inside_an_op_leaks_nothing() {
    with_meta_limit(2 << 20, || {
        let meta = Device::Meta;
        let x = Tensor::zeros(&[512, 64], DType::F32, meta)
            .unwrap()
            .requires_grad_(true)
            .unwrap(); // 128 KiB
        let w = Tensor::zeros(&[2048, 64], DType::F32, meta)
            .unwrap()
            .requires_grad_(true)
            .unwrap(); // 512 KiB
        let before = memory::memory_allocated(meta).unwrap();
        let err = x.linear(&w, None).unwrap_err(); // (512, 2048) = 4 MiB
        assert!(err.is_out_of_memory(), "{err:?}");
        assert!(
            err.to_string().contains("linear") || err.to_string().contains("matmul"),
            "{err}"
        );
        assert_eq!(memory::memory_allocated(meta).unwrap(), before);
        // A smaller op on the same tensors still works and is accounted for.
        let y = x.narrow(0, 0, 64).unwrap().linear(&w, None).unwrap(); // (64, 2048) = 512 KiB
        assert_eq!(
            memory::memory_allocated(meta).unwrap(),
            before + (512 << 10)
        );
        drop(y);
    });
}

/// A dropout in a graph holds no mask: the forward allocates its output alone, and the
/// backward draws the mask again from the saved key.
#[test]
fn dropout_saves_no_mask() {
    let _l = lock();
    let x = Tensor::randn_with(&[64, 32], DType::F32, CPU, &mut Generator::new(3))
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let base = snap();
    let out = x.dropout(0.5, true, &mut Generator::new(4)).unwrap();
    assert_eq!(
        snap().since(base)[0],
        64 * 32 * 4,
        "the output's bytes only"
    );
    out.sum_all().unwrap().backward().unwrap();
    // The gradient is the mask itself (the upstream gradient is ones): 0 or 2.
    let g = x.grad().unwrap().to_vec::<f32>().unwrap();
    let kept: Vec<f32> = out.to_vec::<f32>().unwrap();
    let xs = x.to_vec::<f32>().unwrap();
    for ((g, o), x) in g.iter().zip(&kept).zip(&xs) {
        assert!(*g == 0.0 || *g == 2.0, "gradient {g}");
        assert_eq!(*o, x * g, "output = x · mask");
    }
}
