//! Autograd semantics, as PyTorch users know them: leaves and grad_fn, `.grad` assignment and
//! in-place accumulation, retain_grad, explicit gradients, backward-twice errors and
//! retain_graph, detach and no_grad, custom functions, hooks, very deep graphs, determinism,
//! and the errors a user gets for mismatched shapes, dtypes and devices.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use ferrograd::autograd::{CustomFunction, FunctionCtx, apply_custom};
use ferrograd::backend::Storage;
use ferrograd::{
    BackwardOptions, DType, Device, Error, Result, Tensor, enable_grad, is_grad_enabled, no_grad,
};

const CPU: Device = Device::Cpu;

fn t(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, CPU).unwrap()
}

fn leaf(v: &[f32], shape: &[usize]) -> Tensor {
    t(v, shape).requires_grad_(true).unwrap()
}

fn vals(x: &Tensor) -> Vec<f32> {
    x.to_vec::<f32>().unwrap()
}

fn grad_of(x: &Tensor) -> Vec<f32> {
    vals(&x.grad().expect("a .grad"))
}

fn msg(e: Error) -> String {
    e.to_string()
}

// ---- leaves, grad_fn, .grad ---------------------------------------------------------------

#[test]
fn leaf_and_non_leaf() {
    let plain = t(&[1.0, 2.0], &[2]);
    assert!(plain.is_leaf() && !plain.requires_grad() && plain.grad_fn().is_none());

    let x = leaf(&[1.0, 2.0], &[2]);
    assert!(x.is_leaf() && x.requires_grad() && x.grad_fn().is_none());

    let y = x.mul_scalar(2.0).unwrap();
    assert!(!y.is_leaf() && y.requires_grad());
    assert_eq!(y.grad_fn().unwrap().name(), "mul_scalar");

    // An op on tensors that do not require grad records nothing.
    let z = plain.mul_scalar(2.0).unwrap();
    assert!(z.is_leaf() && !z.requires_grad());
}

#[test]
fn grad_is_assigned_then_accumulated_in_place() {
    let x = leaf(&[1.0, 2.0, 3.0], &[3]);
    assert!(x.grad().is_none());
    x.mul(&x).unwrap().sum_all().unwrap().backward().unwrap();
    let first = x.grad().unwrap();
    assert_eq!(vals(&first), [2.0, 4.0, 6.0]);

    // A new graph: the second backward adds into the same tensor and storage.
    x.mul_scalar(10.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let second = x.grad().unwrap();
    assert!(
        second.shares_storage(&first),
        "the second backward must add in place"
    );
    assert_eq!(vals(&second), [12.0, 14.0, 16.0]);
    assert_eq!(vals(&first), [12.0, 14.0, 16.0]);
    assert!(!second.requires_grad() && second.is_leaf());
}

#[test]
fn grad_has_the_leaf_shape_and_is_contiguous() {
    // The incoming gradient of a broadcast sum is a stride-0 view; .grad must own its data.
    let x = leaf(&[1.0, 2.0, 3.0], &[3, 1]);
    x.expand(&[3, 4])
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g = x.grad().unwrap();
    assert_eq!(g.shape(), [3, 1]);
    assert!(g.is_contiguous());
    assert_eq!(vals(&g), [4.0, 4.0, 4.0]);
}

#[test]
fn non_leaf_grad_only_with_retain_grad() {
    let x = leaf(&[1.0, 2.0], &[2]);
    let y = x.mul_scalar(3.0).unwrap();
    let z = x.mul_scalar(3.0).unwrap();
    z.retain_grad().unwrap();
    let loss = y.mul(&z).unwrap().sum_all().unwrap(); // sum(9 x²)
    loss.backward().unwrap();
    assert!(
        y.grad().is_none(),
        "a non-leaf without retain_grad has no .grad"
    );
    assert_eq!(grad_of(&z), vals(&y)); // d loss / dz = y
    assert_eq!(grad_of(&x), [18.0, 36.0]);
}

#[test]
fn retain_grad_accumulates_over_backwards() {
    let x = leaf(&[1.0, 2.0], &[2]);
    let y = x.mul(&x).unwrap();
    y.retain_grad().unwrap();
    let loss = y.mul_scalar(2.0).unwrap().sum_all().unwrap();
    let keep = BackwardOptions {
        retain_graph: true,
        ..Default::default()
    };
    loss.backward_with(keep.clone()).unwrap();
    assert_eq!(grad_of(&y), [2.0, 2.0]);
    loss.backward_with(keep).unwrap();
    assert_eq!(grad_of(&y), [4.0, 4.0]);
}

#[test]
fn only_inputs_that_require_grad_get_one() {
    let a = leaf(&[1.0, 2.0], &[2]);
    let b = t(&[3.0, 4.0], &[2]);
    a.mul(&b).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(grad_of(&a), [3.0, 4.0]);
    assert!(b.grad().is_none());
}

#[test]
fn ops_save_only_what_requested_gradients_read() {
    // a * b with only `a` requiring grad keeps `b` (for da) and not `a`.
    let a = leaf(&[1.0, 2.0], &[2]);
    let b = t(&[3.0, 4.0], &[2]);
    let y = a.mul(&b).unwrap();
    assert_eq!(
        Arc::strong_count(a.storage()),
        1,
        "a is not needed by any gradient"
    );
    assert_eq!(Arc::strong_count(b.storage()), 2, "b is saved for da");
    drop(y);
    assert_eq!(
        Arc::strong_count(b.storage()),
        1,
        "dropping the graph releases b"
    );

    // A frozen linear layer keeps its weight (for dx) but not its input.
    let x = leaf(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let w = t(&[1.0, 0.0, 0.0, 1.0], &[2, 2]);
    let out = x.linear(&w, None).unwrap();
    assert_eq!(Arc::strong_count(x.storage()), 1);
    assert_eq!(Arc::strong_count(w.storage()), 2);
    out.sum_all().unwrap().backward().unwrap();
    assert_eq!(
        Arc::strong_count(w.storage()),
        1,
        "backward released the saved weight"
    );
    assert_eq!(grad_of(&x), [1.0, 1.0, 1.0, 1.0]);
}

// ---- backward entry points ----------------------------------------------------------------

#[test]
fn backward_on_scalar_and_zero_dim() {
    let x = leaf(&[2.0], &[1]);
    x.mul(&x).unwrap().backward().unwrap(); // one element, shape (1)
    assert_eq!(grad_of(&x), [4.0]);

    let y = Tensor::scalar(3.0, DType::F32, CPU)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    y.mul(&y).unwrap().backward().unwrap(); // shape ()
    assert_eq!(grad_of(&y), [6.0]);
    assert_eq!(y.grad().unwrap().shape(), &[] as &[usize]);
}

#[test]
fn backward_on_a_leaf_itself() {
    let x = leaf(&[5.0], &[1]);
    x.backward().unwrap();
    assert_eq!(grad_of(&x), [1.0]);
}

#[test]
fn backward_with_explicit_gradient() {
    let x = leaf(&[1.0, 2.0, 3.0], &[3]);
    let y = x.mul(&x).unwrap();
    let g = t(&[1.0, 0.5, -1.0], &[3]);
    y.backward_with(BackwardOptions {
        gradient: Some(g.clone()),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(grad_of(&x), [2.0, 2.0, -6.0]);
    // The caller's gradient tensor is not taken over as .grad of a leaf.
    let x2 = leaf(&[1.0, 1.0, 1.0], &[3]);
    x2.backward_with(BackwardOptions {
        gradient: Some(g.clone()),
        ..Default::default()
    })
    .unwrap();
    assert!(!x2.grad().unwrap().shares_storage(&g));
    assert_eq!(vals(&g), [1.0, 0.5, -1.0]);
}

#[test]
fn non_scalar_backward_needs_a_gradient() {
    let x = leaf(&[1.0, 2.0], &[2]);
    let err = x.mul_scalar(2.0).unwrap().backward().unwrap_err();
    assert!(matches!(err, Error::Autograd(_)), "{err:?}");
    assert!(msg(err).contains("gradient"));

    let y = x.mul_scalar(2.0).unwrap();
    let wrong = t(&[1.0, 2.0, 3.0], &[3]);
    let err = y
        .backward_with(BackwardOptions {
            gradient: Some(wrong),
            ..Default::default()
        })
        .unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err:?}");
}

#[test]
fn gradients_must_match_dtype_and_device() {
    let x = leaf(&[1.0, 2.0], &[2]);
    let g64 = Tensor::ones(&[2], DType::F64, CPU).unwrap();
    let explicit = |g: &Tensor| BackwardOptions {
        gradient: Some(g.clone()),
        ..Default::default()
    };
    let err = x
        .mul_scalar(2.0)
        .unwrap()
        .backward_with(explicit(&g64))
        .unwrap_err();
    assert!(matches!(err, Error::DType { .. }), "{err:?}");
    assert!(matches!(
        x.backward_with(explicit(&g64)),
        Err(Error::DType { .. })
    ));
    let meta = Tensor::ones(&[2], DType::F32, Device::Meta).unwrap();
    assert!(matches!(
        x.backward_with(explicit(&meta)),
        Err(Error::DeviceMismatch { .. })
    ));
    assert!(
        x.grad().is_none(),
        "a rejected gradient must not become .grad"
    );

    assert!(matches!(x.set_grad(Some(g64)), Err(Error::DType { .. })));
    assert!(matches!(
        x.set_grad(Some(meta)),
        Err(Error::DeviceMismatch { .. })
    ));
    assert!(x.grad().is_none());
}

#[test]
fn backward_without_requires_grad_is_an_error() {
    let x = t(&[1.0, 2.0], &[2]);
    let err = x.sum_all().unwrap().backward().unwrap_err();
    assert!(matches!(err, Error::Autograd(_)), "{err:?}");
    assert!(msg(err).contains("requires_grad"));
}

#[test]
fn second_backward_needs_retain_graph() {
    let x = leaf(&[1.0, 2.0], &[2]);
    let y = x.exp().unwrap();
    let loss = y.sum_all().unwrap();
    loss.backward().unwrap();
    assert!(
        y.grad_fn().unwrap().is_released(),
        "exp saved its output and released it"
    );
    let err = loss.backward().unwrap_err();
    assert!(matches!(err, Error::Autograd(_)), "{err:?}");
    assert!(msg(err).contains("retain_graph"));
}

#[test]
fn retain_graph_allows_a_second_backward() {
    let x = leaf(&[0.0, 1.0], &[2]);
    let loss = x.exp().unwrap().sum_all().unwrap();
    let keep = BackwardOptions {
        retain_graph: true,
        ..Default::default()
    };
    loss.backward_with(keep.clone()).unwrap();
    assert!(!loss.grad_fn().unwrap().is_released());
    let once = grad_of(&x);
    loss.backward_with(keep).unwrap();
    let twice = grad_of(&x);
    assert_eq!(twice, once.iter().map(|g| 2.0 * g).collect::<Vec<_>>());
    // A final backward without retain_graph still works, then the graph is gone.
    loss.backward().unwrap();
    assert!(loss.backward().is_err());
}

// ---- detach, no_grad, requires_grad_ --------------------------------------------------------

#[test]
fn detach_stops_gradients_and_shares_data() {
    let x = leaf(&[1.0, 2.0], &[2]);
    let d = x.detach();
    assert!(d.is_leaf() && !d.requires_grad());
    assert!(d.shares_storage(&x));
    assert!(!d.mul_scalar(2.0).unwrap().requires_grad());
    // y = x * detach(x): only the first factor is differentiated.
    x.mul(&x.detach())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(grad_of(&x), [1.0, 2.0]);
}

#[test]
fn no_grad_guard_records_nothing_and_restores() {
    let x = leaf(&[1.0, 2.0], &[2]);
    assert!(is_grad_enabled());
    {
        let _g = no_grad();
        assert!(!is_grad_enabled());
        let y = x.mul_scalar(2.0).unwrap();
        assert!(!y.requires_grad() && y.grad_fn().is_none());
        {
            let _e = enable_grad();
            assert!(x.mul_scalar(2.0).unwrap().requires_grad());
        }
        assert!(!is_grad_enabled(), "the inner guard restores no_grad");
        assert!(y.sum_all().unwrap().backward().is_err());
    }
    assert!(is_grad_enabled());
    assert!(x.mul_scalar(2.0).unwrap().requires_grad());
}

#[test]
fn grad_mode_is_per_thread() {
    let _g = no_grad();
    let other = std::thread::spawn(is_grad_enabled).join().unwrap();
    assert!(
        other,
        "no_grad on one thread must not turn recording off on another"
    );
}

#[test]
fn requires_grad_only_on_float_leaves() {
    let x = leaf(&[1.0], &[1]);
    let y = x.mul_scalar(2.0).unwrap();
    let err = y.requires_grad_(false).unwrap_err();
    assert!(matches!(err, Error::Autograd(_)), "{err:?}");
    assert!(msg(err).contains("leaf"));

    let idx = Tensor::from_vec(vec![1i64, 2], &[2], CPU).unwrap();
    assert!(matches!(
        idx.requires_grad_(true),
        Err(Error::UnsupportedDType { .. })
    ));

    // Freezing a leaf keeps later ops out of the graph.
    let w = leaf(&[1.0], &[1]).requires_grad_(false).unwrap();
    assert!(!w.mul_scalar(2.0).unwrap().requires_grad());
}

#[test]
fn in_place_update_of_a_leaf_needs_no_grad() {
    let w = leaf(&[1.0, 2.0], &[2]);
    let err = w.mul_scalar_(2.0).unwrap_err();
    assert!(matches!(err, Error::Autograd(_)), "{err:?}");
    assert!(msg(err).contains("no_grad"));
    {
        let _g = no_grad();
        w.mul_scalar_(2.0).unwrap();
    }
    assert_eq!(vals(&w), [2.0, 4.0]);
}

// ---- custom functions -----------------------------------------------------------------------

/// y = x³, with x and x² saved for backward; `probe` watches x²'s storage.
struct Cube {
    probe: Arc<Mutex<Weak<Storage>>>,
}

impl CustomFunction for Cube {
    fn name(&self) -> &'static str {
        "cube"
    }
    fn forward(&mut self, ctx: &mut FunctionCtx, inputs: &[Tensor]) -> Result<Tensor> {
        let x = &inputs[0];
        let x2 = x.mul(x)?;
        assert!(!x2.requires_grad(), "custom forwards run without recording");
        *self.probe.lock().unwrap() = Arc::downgrade(x2.storage());
        ctx.save_for_backward(&[x, &x2]);
        x2.mul(x)
    }
    fn backward(&mut self, ctx: &FunctionCtx, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let saved = ctx.saved_tensors();
        Ok(vec![Some(g.mul(&saved[1].mul_scalar(3.0)?)?)])
    }
}

#[test]
fn custom_function_gradient_and_release() {
    let probe = Arc::new(Mutex::new(Weak::new()));
    let x = leaf(&[1.0, -2.0, 0.5], &[3]);
    let y = apply_custom(
        Cube {
            probe: Arc::clone(&probe),
        },
        std::slice::from_ref(&x),
    )
    .unwrap();
    assert_eq!(vals(&y), [1.0, -8.0, 0.125]);
    assert_eq!(y.grad_fn().unwrap().name(), "cube");
    assert!(
        probe.lock().unwrap().upgrade().is_some(),
        "x² is held for backward"
    );
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(grad_of(&x), [3.0, 12.0, 0.75]);
    assert!(
        probe.lock().unwrap().upgrade().is_none(),
        "backward released the saved x²"
    );
}

#[test]
fn custom_function_saved_tensors_released_with_the_graph() {
    let probe = Arc::new(Mutex::new(Weak::new()));
    let x = leaf(&[1.0, 2.0], &[2]);
    let y = apply_custom(
        Cube {
            probe: Arc::clone(&probe),
        },
        std::slice::from_ref(&x),
    )
    .unwrap();
    assert!(probe.lock().unwrap().upgrade().is_some());
    drop(y);
    assert!(
        probe.lock().unwrap().upgrade().is_none(),
        "dropping the graph frees what it saved"
    );
}

/// out = a * b; records which inputs backward was asked for.
struct Product {
    seen: Arc<Mutex<Vec<bool>>>,
}

impl CustomFunction for Product {
    fn forward(&mut self, ctx: &mut FunctionCtx, inputs: &[Tensor]) -> Result<Tensor> {
        ctx.save_for_backward(&[&inputs[0], &inputs[1]]);
        inputs[0].mul(&inputs[1])
    }
    fn backward(&mut self, ctx: &FunctionCtx, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let needs = ctx.needs_input_grad().to_vec();
        *self.seen.lock().unwrap() = needs.clone();
        let s = ctx.saved_tensors();
        Ok(vec![
            needs[0].then(|| g.mul(&s[1])).transpose()?,
            needs[1].then(|| g.mul(&s[0])).transpose()?,
        ])
    }
}

#[test]
fn custom_function_needs_input_grad() {
    let seen = Arc::new(Mutex::new(vec![]));
    let a = leaf(&[2.0], &[1]);
    let b = t(&[5.0], &[1]);
    let y = apply_custom(
        Product {
            seen: Arc::clone(&seen),
        },
        &[a.clone(), b.clone()],
    )
    .unwrap();
    y.backward().unwrap();
    assert_eq!(*seen.lock().unwrap(), [true, false]);
    assert_eq!(grad_of(&a), [5.0]);
    assert!(b.grad().is_none());

    // No input requires grad: nothing is recorded.
    let z = apply_custom(Product { seen }, &[b.clone(), b]).unwrap();
    assert!(!z.requires_grad());
}

/// y = x; backward returns whatever `grad` makes of the incoming gradient.
struct Identity<G: Fn(&Tensor) -> Result<Tensor> + Send + 'static> {
    grad: G,
}

impl<G: Fn(&Tensor) -> Result<Tensor> + Send + 'static> CustomFunction for Identity<G> {
    fn forward(&mut self, _: &mut FunctionCtx, inputs: &[Tensor]) -> Result<Tensor> {
        inputs[0].mul_scalar(1.0)
    }
    fn backward(&mut self, _: &FunctionCtx, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some((self.grad)(g)?)])
    }
}

#[test]
fn custom_backward_gradients_are_validated() {
    let run = |grad: fn(&Tensor) -> Result<Tensor>| {
        let x = leaf(&[1.0, 2.0, 3.0], &[3]);
        let y = apply_custom(Identity { grad }, std::slice::from_ref(&x)).unwrap();
        y.sum_all().unwrap().backward().map(|_| x.grad().unwrap())
    };
    // A wrong shape is an error that names the function and both shapes.
    let err = run(|g| g.narrow(0, 0, 1)).unwrap_err();
    assert!(matches!(err, Error::Autograd(_)), "{err:?}");
    let text = msg(err);
    assert!(
        text.contains("custom_function") && text.contains("[1]") && text.contains("[3]"),
        "{text}"
    );
    // A broadcast gradient is summed back to the input's shape (PyTorch's validate_outputs).
    let g = run(|g| g.unsqueeze(0)?.expand(&[2, 3])?.contiguous()).unwrap();
    assert_eq!(
        (g.shape().to_vec(), vals(&g)),
        (vec![3], vec![2.0, 2.0, 2.0])
    );
    // Another dtype is converted to the input's.
    let g = run(|g| g.to_dtype(DType::F64)).unwrap();
    assert_eq!(g.dtype(), DType::F32);
}

// ---- hooks ----------------------------------------------------------------------------------

#[test]
fn tensor_hook_replaces_the_gradient() {
    let x = leaf(&[1.0, 2.0], &[2]);
    x.register_hook(|g| Ok(Some(g.mul_scalar(2.0)?)));
    x.mul_scalar(3.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(grad_of(&x), [6.0, 6.0]);

    // On a non-leaf the replaced gradient flows on to the inputs.
    let w = leaf(&[1.0, 2.0], &[2]);
    let y = w.mul_scalar(3.0).unwrap();
    y.register_hook(|g| Ok(Some(g.mul_scalar(2.0)?)));
    let seen = Arc::new(Mutex::new(vec![]));
    let s = Arc::clone(&seen);
    y.register_hook(move |g| {
        *s.lock().unwrap() = g.to_vec::<f32>()?;
        Ok(None)
    });
    y.mul_scalar(5.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        [10.0, 10.0],
        "hooks run in registration order"
    );
    assert_eq!(grad_of(&w), [30.0, 30.0]);
}

#[test]
fn hook_on_a_non_leaf_outlives_its_handle() {
    // A module registers a hook on an intermediate and returns only its output.
    let x = leaf(&[1.0, 2.0], &[2]);
    let out = {
        let h = x.mul_scalar(3.0).unwrap();
        h.register_hook(|g| Ok(Some(g.mul_scalar(100.0)?)));
        h.mul_scalar(1.0).unwrap()
    };
    out.sum_all().unwrap().backward().unwrap();
    assert_eq!(grad_of(&x), [300.0, 300.0]);
}

#[test]
fn post_accumulate_grad_hook_runs_once_per_backward() {
    let x = leaf(&[1.0, 2.0], &[2]);
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(vec![]));
    let (c, s) = (Arc::clone(&calls), Arc::clone(&seen));
    x.register_post_accumulate_grad_hook(move |p| {
        c.fetch_add(1, Ordering::SeqCst);
        assert!(p.is_leaf() && p.requires_grad());
        s.lock().unwrap().push(
            p.grad()
                .expect(".grad is set when the hook runs")
                .to_vec::<f32>()?,
        );
        Ok(())
    })
    .unwrap();
    // x is used three times; the hook still runs once, after the summed gradient landed.
    let loss = || x.mul(&x).unwrap().add(&x).unwrap().sum_all().unwrap();
    loss().backward().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    loss().backward().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(*seen.lock().unwrap(), [vec![3.0, 5.0], vec![6.0, 10.0]]);

    let y = x.mul_scalar(1.0).unwrap();
    assert!(matches!(
        y.register_post_accumulate_grad_hook(|_| Ok(())),
        Err(Error::Autograd(_))
    ));
}

// ---- deep graphs ----------------------------------------------------------------------------

const DEPTH: usize = 100_000;

/// Runs `f` on a thread with a small stack: recursion over the graph would overflow it.
fn on_small_stack(f: impl FnOnce() + Send + 'static) {
    std::thread::Builder::new()
        .stack_size(1 << 20)
        .spawn(f)
        .unwrap()
        .join()
        .unwrap();
}

#[test]
fn backward_through_a_100k_node_chain() {
    on_small_stack(|| {
        let x = leaf(&[1.0], &[1]);
        let mut y = x.clone();
        for _ in 0..DEPTH {
            y = y.add_scalar(1.0).unwrap();
        }
        assert_eq!(vals(&y), [DEPTH as f32 + 1.0]);
        y.backward().unwrap();
        assert_eq!(grad_of(&x), [1.0]);
        drop(y);
    });
}

#[test]
fn dropping_a_100k_node_graph_without_backward() {
    on_small_stack(|| {
        let x = leaf(&[0.5], &[1]);
        let mut y = x.clone();
        for i in 0..DEPTH {
            // Alternate an op that saves its output with one that saves nothing.
            y = if i % 2 == 0 {
                y.tanh().unwrap()
            } else {
                y.mul_scalar(1.0).unwrap()
            };
        }
        drop(y);
        assert!(x.grad().is_none());
    });
}

// ---- determinism ----------------------------------------------------------------------------

#[test]
fn same_graph_gives_bitwise_same_results() {
    // Large enough for the parallel kernels (elementwise, reduction, GEMM) to split the work.
    let run = || {
        let mut g = ferrograd::Generator::new(7);
        let x = Tensor::randn_with(&[256, 512], DType::F32, CPU, &mut g)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let w = Tensor::randn_with(&[384, 512], DType::F32, CPU, &mut g)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let big = Tensor::randn_with(&[1 << 20], DType::F64, CPU, &mut g)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let h = x.linear(&w, None).unwrap().tanh().unwrap();
        let loss = h.mul(&h).unwrap().sum_all().unwrap();
        let total = big.mul(&big).unwrap().sum_all().unwrap();
        loss.backward().unwrap();
        total.backward().unwrap();
        let bits = |t: &Tensor| {
            t.to_vec::<f64>()
                .unwrap()
                .into_iter()
                .map(f64::to_bits)
                .collect::<Vec<_>>()
        };
        (
            bits(&loss),
            bits(&total),
            bits(&x.grad().unwrap()),
            bits(&w.grad().unwrap()),
        )
    };
    let first = run();
    for _ in 0..4 {
        assert!(
            run() == first,
            "a rerun of the same graph changed some bits"
        );
    }
}

#[test]
fn parallel_sums_are_bitwise_reproducible() {
    // Above the parallel threshold the reduction is split across threads; the split must not
    // change the rounding from one run to the next.
    let mut g = ferrograd::Generator::new(3);
    let x = Tensor::randn_with(&[1 << 22], DType::F64, CPU, &mut g).unwrap();
    let cols = x.reshape(&[1 << 16, 64]).unwrap();
    let all = x.sum_all().unwrap().item().unwrap().to_bits();
    let per_col: Vec<u64> = cols
        .sum(&[0], false)
        .unwrap()
        .to_vec::<f64>()
        .unwrap()
        .into_iter()
        .map(f64::to_bits)
        .collect();
    for _ in 0..30 {
        assert_eq!(x.sum_all().unwrap().item().unwrap().to_bits(), all);
        let again: Vec<u64> = cols
            .sum(&[0], false)
            .unwrap()
            .to_vec::<f64>()
            .unwrap()
            .into_iter()
            .map(f64::to_bits)
            .collect();
        assert_eq!(again, per_col);
    }
}

// ---- mismatch errors ------------------------------------------------------------------------

#[test]
fn shape_dtype_device_mismatches_are_errors() {
    let a = Tensor::zeros(&[2, 3], DType::F32, CPU).unwrap();
    let b = Tensor::zeros(&[4], DType::F32, CPU).unwrap();
    assert!(matches!(a.add(&b), Err(Error::Shape { .. })));
    assert!(matches!(a.mul(&b), Err(Error::Shape { .. })));

    let c = Tensor::zeros(&[2, 3], DType::F64, CPU).unwrap();
    // Float dtypes type-promote in elementwise ops (as PyTorch); integer/float mixes do not.
    assert_eq!(a.add(&c).unwrap().dtype(), DType::F64);
    let i = Tensor::zeros(&[2, 3], DType::I64, CPU).unwrap();
    assert!(matches!(a.add(&i), Err(Error::DType { .. })));
    assert!(matches!(
        a.matmul(&c.t().unwrap()),
        Err(Error::DType { .. })
    ));

    let m = Tensor::zeros(&[2, 3], DType::F32, Device::Meta).unwrap();
    let err = a.add(&m).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { .. }), "{err:?}");
    assert!(msg(err).contains("to_device"));

    let k = Tensor::zeros(&[5, 6], DType::F32, CPU).unwrap();
    assert!(matches!(a.matmul(&k), Err(Error::Shape { .. })));
    assert!(matches!(a.linear(&k, None), Err(Error::Shape { .. })));
    assert!(matches!(a.reshape(&[4, 2]), Err(Error::Shape { .. })));
    assert!(matches!(a.expand(&[3, 3]), Err(Error::Shape { .. })));
    assert!(matches!(a.narrow(1, 2, 2), Err(Error::Index { .. })));
    assert!(matches!(a.sum(&[2], false), Err(Error::Index { .. })));
    assert!(matches!(a.mse_loss(&b), Err(Error::Shape { .. })));

    let idx = Tensor::from_vec(vec![1i64, 2], &[2], CPU).unwrap();
    assert!(matches!(idx.exp(), Err(Error::UnsupportedDType { .. })));
}

// ---- PyTorch details: re-running nodes that saved nothing, version counters, pow at 0 ----

#[test]
fn backward_twice_through_nodes_that_saved_nothing_works() {
    // SumBackward saves only sizes in PyTorch, so a second backward is allowed and adds.
    let x = Tensor::ones(&[3], DType::F32, Device::Cpu)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let y = x.sum_all().unwrap();
    y.backward().unwrap();
    y.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![2.0; 3]);
}

#[test]
fn modifying_a_saved_tensor_in_place_is_an_error_at_backward() {
    let a = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let b = Tensor::from_vec(vec![3.0f32, 4.0], &[2], Device::Cpu).unwrap();
    let y = a.mul(&b).unwrap().sum_all().unwrap();
    b.add_(&Tensor::ones(&[2], DType::F32, Device::Cpu).unwrap())
        .unwrap();
    let err = y.backward().unwrap_err().to_string();
    assert!(err.contains("modified by an in-place operation"), "{err}");
    assert!(err.contains("mul"), "names the op: {err}");
}

#[test]
fn untouched_saved_tensors_pass_the_version_check() {
    let a = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let b = Tensor::from_vec(vec![3.0f32, 4.0], &[2], Device::Cpu).unwrap();
    let other = Tensor::zeros(&[2], DType::F32, Device::Cpu).unwrap();
    let y = a.mul(&b).unwrap().sum_all().unwrap();
    other.add_(&b).unwrap(); // an in-place op on an unrelated tensor
    y.backward().unwrap();
    assert_eq!(a.grad().unwrap().to_vec::<f32>().unwrap(), vec![3.0, 4.0]);
}

#[test]
fn pow_exponent_gradient_is_zero_where_the_base_is_zero() {
    let a = Tensor::from_vec(vec![0.0f64, 2.0], &[2], Device::Cpu).unwrap();
    let b = Tensor::from_vec(vec![2.0f64, 3.0], &[2], Device::Cpu)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    a.pow(&b).unwrap().sum_all().unwrap().backward().unwrap();
    let g = b.grad().unwrap().to_vec::<f64>().unwrap();
    assert_eq!(g[0], 0.0);
    assert!((g[1] - 8.0 * 2f64.ln()).abs() < 1e-12);
}

#[test]
fn retain_grad_on_a_tensor_without_grad_is_an_error() {
    let x = Tensor::ones(&[2], DType::F32, Device::Cpu).unwrap();
    assert!(x.exp().unwrap().retain_grad().is_err());
}

// ---- fused ops equal their compositions -------------------------------------------------------

/// Output and every gradient of the fused MLP and of linear → gelu → linear, on the CPU.
fn mlp_both_ways(dtype: ferrograd::DType) -> [Vec<Vec<f32>>; 2] {
    use ferrograd::ops::GeluApprox;
    let mut g = ferrograd::Generator::new(7);
    let mut leaf = |shape: &[usize]| {
        Tensor::randn_with(shape, ferrograd::DType::F32, Device::Cpu, &mut g)
            .and_then(|t| t.to_dtype(dtype))
            .and_then(|t| t.requires_grad_(true))
            .unwrap()
    };
    let inputs = [
        leaf(&[2, 5, 8]),
        leaf(&[16, 8]),
        leaf(&[16]),
        leaf(&[8, 16]),
        leaf(&[8]),
    ];
    let run = |fused: bool| -> Vec<Vec<f32>> {
        let [x, wf, bf, wp, bp] = &inputs;
        let y = if fused {
            x.mlp_gelu(wf, bf, wp, bp).unwrap()
        } else {
            let h = x
                .linear(wf, Some(bf))
                .unwrap()
                .gelu(GeluApprox::Tanh)
                .unwrap();
            h.linear(wp, Some(bp)).unwrap()
        };
        let w = Tensor::randn_with(
            y.shape(),
            dtype,
            Device::Cpu,
            &mut ferrograd::Generator::new(9),
        )
        .unwrap();
        y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        let as_f32 = |t: &Tensor| {
            t.to_dtype(ferrograd::DType::F32)
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
        };
        let mut out = vec![as_f32(&y)];
        for t in &inputs {
            out.push(as_f32(&t.grad().unwrap()));
            t.set_grad(None).unwrap();
        }
        out
    };
    [run(true), run(false)]
}

#[test]
fn fused_mlp_is_the_composition_bit_for_bit_on_the_cpu() {
    for dtype in [ferrograd::DType::F32, ferrograd::DType::BF16] {
        let [fused, composed] = mlp_both_ways(dtype);
        assert_eq!(fused.len(), 6);
        for (i, (a, b)) in fused.iter().zip(&composed).enumerate() {
            let bits = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(a), bits(b), "{dtype}: output/gradient {i} differs");
        }
    }
}
