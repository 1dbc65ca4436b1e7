//! A layer norm on a residual stream: its backward adds the gradient the stream already has
//! from later blocks as it writes x's gradient (the engine lends the pending sum to the
//! norm's backward), and the result is bit for bit what a separate add gives — in place when
//! nothing else holds that gradient, into a fresh buffer when something does.

use std::sync::{Mutex, MutexGuard};

use ferrograd::{DType, Device, Generator, Result, Tensor};

const CPU: Device = Device::Cpu;
const N: usize = 7;

/// The allocator is process-wide: every test here runs alone, so the memory test sees only
/// its own bytes.
static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn randn(shape: &[usize], dtype: DType, g: &mut Generator) -> Tensor {
    Tensor::randn_with(shape, dtype, CPU, g).unwrap()
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .to_vec::<f64>()
        .unwrap()
        .into_iter()
        .map(f64::to_bits)
        .collect()
}

/// The inputs of one case: x (5, N), the norm's weight and bias, the weights that turn the
/// norm's output and the other path into a scalar.
struct Case {
    x: Tensor,
    w: Tensor,
    b: Tensor,
    a: Tensor,
    c: Tensor,
}

impl Case {
    fn new(dtype: DType, seed: u64) -> Case {
        let mut g = Generator::new(seed);
        Case {
            x: randn(&[5, N], dtype, &mut g),
            w: randn(&[N], dtype, &mut g),
            b: randn(&[N], dtype, &mut g),
            a: randn(&[5, N], dtype, &mut g),
            c: randn(&[5, N], dtype, &mut g),
        }
    }

    fn leaf(&self) -> Tensor {
        self.x.detach().requires_grad_(true).unwrap()
    }

    /// (norm(x) · a).sum(), the norm's share of the loss.
    fn norm_part(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(&[N], Some(&self.w), Some(&self.b), 1e-5)?
            .mul(&self.a)?
            .sum_all()
    }
}

/// x.grad of `other(x) + norm_part(x)` against the add of the two gradients taken apart:
/// the other path is created after the norm, so its backward runs first and its gradient is
/// pending when the norm's backward runs.
fn check(dtype: DType, other: impl Fn(&Case, &Tensor) -> Result<Tensor>) {
    let case = Case::new(dtype, 7);
    let x = case.leaf();
    let norm = case.norm_part(&x).unwrap();
    let rest = other(&case, &x).unwrap();
    norm.add(&rest).unwrap().backward().unwrap();
    let fused = x.grad().expect("x.grad");

    let (x1, x2) = (case.leaf(), case.leaf());
    other(&case, &x1).unwrap().backward().unwrap();
    case.norm_part(&x2).unwrap().backward().unwrap();
    let separate = x1.grad().unwrap().add(&x2.grad().unwrap()).unwrap();
    assert_eq!(bits(&fused), bits(&separate), "{dtype:?}");
}

#[test]
fn the_norm_adds_an_exclusive_pending_gradient_in_place() {
    let _one_at_a_time = lock();
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        // mul's backward makes a fresh gradient that nothing else holds.
        check(dtype, |case, x| x.mul(&case.c)?.sum_all());
    }
}

#[test]
fn a_shared_pending_gradient_is_read_not_overwritten() {
    let _one_at_a_time = lock();
    for dtype in [DType::F32, DType::BF16] {
        let case = Case::new(dtype, 11);
        // add's backward hands one gradient buffer to both x and d: x's pending sum is shared
        // with d's, which must keep its own value.
        let other = |d: &Tensor, x: &Tensor| x.add(d)?.mul(&case.a)?.sum_all();
        let fresh_d = || case.c.detach().requires_grad_(true);
        check(dtype, |_, x| other(&fresh_d()?, x));
        let d = case.c.detach().requires_grad_(true).unwrap();
        let x = case.leaf();
        let norm = case.norm_part(&x).unwrap();
        norm.add(&other(&d, &x).unwrap())
            .unwrap()
            .backward()
            .unwrap();
        assert_eq!(bits(&d.grad().expect("d.grad")), bits(&case.a), "{dtype:?}");
    }
}

#[test]
fn a_norm_with_nothing_pending_writes_its_own_gradient() {
    let _one_at_a_time = lock();
    let case = Case::new(DType::F32, 3);
    let x = case.leaf();
    case.norm_part(&x).unwrap().backward().unwrap();
    let alone = x.grad().unwrap();
    let x2 = case.leaf();
    let zero = x2.mul_scalar(0.0).unwrap().sum_all().unwrap();
    case.norm_part(&x2)
        .unwrap()
        .add(&zero)
        .unwrap()
        .backward()
        .unwrap();
    // A zero gradient folded in leaves the norm's own bits (x + 0 == x, and -0 + 0 == 0
    // compares equal but differs in sign bit, so compare values).
    let (a, b) = (
        alone.to_vec::<f32>().unwrap(),
        x2.grad().unwrap().to_vec::<f32>().unwrap(),
    );
    assert_eq!(a, b);
}

#[test]
fn folding_in_place_saves_the_gradient_and_the_sum_buffers() {
    use ferrograd::memory::{max_memory_allocated, memory_allocated, reset_peak_memory_stats};
    let _one_at_a_time = lock();
    const R: usize = 64;
    let row_bytes = (R * N * 4) as u64;
    let mut g = Generator::new(5);
    let x = randn(&[R, N], DType::F32, &mut g)
        .requires_grad_(true)
        .unwrap();
    let (a, c) = (
        randn(&[R, N], DType::F32, &mut g),
        randn(&[R, N], DType::F32, &mut g),
    );
    let norm = x
        .layer_norm(&[N], None, None, 1e-5)
        .unwrap()
        .mul(&a)
        .unwrap()
        .sum_all();
    let loss = norm
        .unwrap()
        .add(&x.mul(&c).unwrap().sum_all().unwrap())
        .unwrap();
    let base = memory_allocated(CPU).unwrap();
    reset_peak_memory_stats(CPU).unwrap();
    loss.backward().unwrap();
    let peak = max_memory_allocated(CPU).unwrap() - base;
    // Held at the norm's backward: x's pending gradient (c) and the norm's output gradient
    // (a), plus scalars. A separate add would also hold the norm's own x gradient and the
    // sum: two more (R, N) buffers.
    assert!(
        (2 * row_bytes..2 * row_bytes + row_bytes / 2).contains(&peak),
        "peak during backward {peak} B; (R, N) buffers are {row_bytes} B"
    );
    drop(loss);
}

/// Gradients of x, branch, weight and bias, then s and y, for one way of taking the step.
type Step = fn(&Tensor, &Tensor, &Tensor, &Tensor, DType) -> Result<(Tensor, Tensor)>;

fn fused(x: &Tensor, h: &Tensor, w: &Tensor, b: &Tensor, dt: DType) -> Result<(Tensor, Tensor)> {
    x.add_layer_norm_to(h, &[N], Some(w), Some(b), 1e-5, dt)
}

fn composed(x: &Tensor, h: &Tensor, w: &Tensor, b: &Tensor, dt: DType) -> Result<(Tensor, Tensor)> {
    let s = x.add(h)?;
    let y = s.layer_norm_to(&[N], Some(w), Some(b), 1e-5, dt)?;
    Ok((s, y))
}

fn run_step(step: Step, xd: DType, hd: DType, out: DType, h_shape: &[usize]) -> Vec<Vec<u64>> {
    let mut g = Generator::new(21);
    let mut leaf = |shape: &[usize], dt: DType| {
        randn(shape, DType::F32, &mut g)
            .to_dtype(dt)
            .unwrap()
            .requires_grad_(true)
            .unwrap()
    };
    let (x, h) = (leaf(&[4, 3, N], xd), leaf(h_shape, hd));
    let (w, b) = (leaf(&[N], xd), leaf(&[N], xd));
    let a = randn(&[4, 3, N], DType::F32, &mut g).to_dtype(out).unwrap();
    let c = randn(&[4, 3, N], DType::F32, &mut g).to_dtype(xd).unwrap();
    let (s, y) = step(&x, &h, &w, &b, out).unwrap();
    // y's share, then a use of s created after it (the next block's residual add).
    let loss = y
        .mul(&a)
        .unwrap()
        .sum_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    let rest = s
        .mul(&c)
        .unwrap()
        .sum_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    loss.add(&rest).unwrap().backward().unwrap();
    let mut all = vec![bits(&s), bits(&y)];
    all.extend([&x, &h, &w, &b].map(|t| bits(&t.grad().expect("a gradient"))));
    all
}

#[test]
fn the_fused_residual_step_is_the_composition_bit_for_bit() {
    let _one_at_a_time = lock();
    let cases = [
        // (x, branch, output): the fused kernel's cases
        (DType::F32, DType::F32, DType::F32),
        (DType::F32, DType::BF16, DType::BF16),
        (DType::F32, DType::F16, DType::F16),
        (DType::BF16, DType::BF16, DType::BF16),
        (DType::F64, DType::F64, DType::F64),
        // ... and two the composition takes: a branch in the stream's dtype with a half
        // output, and a half branch with an f32 output.
        (DType::F32, DType::F32, DType::BF16),
        (DType::F32, DType::BF16, DType::F32),
    ];
    for (xd, hd, out) in cases {
        let want = run_step(composed, xd, hd, out, &[4, 3, N]);
        let got = run_step(fused, xd, hd, out, &[4, 3, N]);
        let names = [
            "s",
            "y",
            "x.grad",
            "branch.grad",
            "weight.grad",
            "bias.grad",
        ];
        for ((w, g), name) in want.iter().zip(&got).zip(names) {
            assert_eq!(w, g, "{xd:?} + {hd:?} -> {out:?}: {name}");
        }
    }
    // A broadcast branch (N) is the composition too.
    let want = run_step(composed, DType::F32, DType::F32, DType::F32, &[N]);
    assert_eq!(
        run_step(fused, DType::F32, DType::F32, DType::F32, &[N]),
        want
    );
}

#[test]
fn the_fused_residual_step_checks_its_arguments() {
    let _one_at_a_time = lock();
    let x = Tensor::zeros(&[2, N], DType::F32, CPU).unwrap();
    let h = Tensor::zeros(&[2, N], DType::F32, CPU).unwrap();
    let w = Tensor::ones(&[N + 1], DType::F32, CPU).unwrap();
    let err = x
        .add_layer_norm_to(&h, &[N], Some(&w), None, 1e-5, DType::F32)
        .unwrap_err();
    assert!(err.to_string().contains("normalized_shape"), "{err}");
    let short = Tensor::zeros(&[3, N], DType::F32, CPU).unwrap();
    assert!(
        x.add_layer_norm_to(&short, &[N], None, None, 1e-5, DType::F32)
            .is_err()
    );
}

/// The residual step's ops that allocate during `f`: (op, bytes requested) on the CPU.
fn ops_allocating(f: impl FnOnce()) -> Vec<(&'static str, u64)> {
    use ferrograd::memory::recorder::{self, Action, RecorderConfig};
    recorder::start(RecorderConfig { capacity: 1 << 12 }).unwrap();
    f();
    let rec = recorder::stop().unwrap();
    rec.events
        .iter()
        .filter(|e| e.device == CPU && e.action == Action::Alloc)
        .map(|e| (e.origin.op, e.requested))
        .collect()
}

/// An f32 stream with a bf16 branch: the norm's backward writes the stream's gradient and its
/// bf16 rounding together, and the branch's gradient is that rounding (x.grad rounded, bit
/// for bit) with no cast of its own in the backward.
#[test]
fn the_norm_backward_writes_the_half_branch_gradient() {
    let _one_at_a_time = lock();
    let mut g = Generator::new(31);
    let mut leaf = |dt: DType| {
        randn(&[4, 3, N], DType::F32, &mut g)
            .to_dtype(dt)
            .unwrap()
            .requires_grad_(true)
            .unwrap()
    };
    let (x, h) = (leaf(DType::F32), leaf(DType::BF16));
    let c = randn(&[4, 3, N], DType::F32, &mut g);
    let (s, y) = x
        .add_layer_norm_to(&h, &[N], None, None, 1e-5, DType::BF16)
        .unwrap();
    let loss = y
        .sum_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .add(&s.mul(&c).unwrap().sum_all().unwrap())
        .unwrap();
    let events = ops_allocating(|| loss.backward().unwrap());
    let half_bytes = (4 * 3 * N * 2) as u64;
    assert!(
        !events.contains(&("to_dtype", half_bytes)),
        "a cast of the branch's gradient: {events:?}"
    );
    assert!(
        events.contains(&("layer_norm_backward", half_bytes)),
        "the norm's half gradient: {events:?}"
    );
    let want = x.grad().unwrap().to_dtype(DType::BF16).unwrap();
    assert_eq!(bits(&h.grad().unwrap()), bits(&want));
}

/// A bf16 branch that needs no gradient (frozen): the norm's backward writes no half copy.
#[test]
fn a_frozen_half_branch_gets_no_half_gradient_written() {
    let _one_at_a_time = lock();
    let mut g = Generator::new(32);
    let x = randn(&[4, 3, N], DType::F32, &mut g)
        .requires_grad_(true)
        .unwrap();
    let h = randn(&[4, 3, N], DType::F32, &mut g)
        .to_dtype(DType::BF16)
        .unwrap();
    let (_, y) = x
        .add_layer_norm_to(&h, &[N], None, None, 1e-5, DType::BF16)
        .unwrap();
    let loss = y.sum_all().unwrap();
    let events = ops_allocating(|| loss.backward().unwrap());
    let half_bytes = (4 * 3 * N * 2) as u64;
    assert!(
        !events.contains(&("layer_norm_backward", half_bytes)),
        "a half copy nothing reads: {events:?}"
    );
    assert_eq!(x.grad().unwrap().shape(), &[4, 3, N]);
}

/// Under autocast, a branch that ends in a Linear (f32 parameters, a bf16 output) gets its
/// bias gradient from the norm's backward: the column sums of the half gradient the norm
/// writes, handed to the Linear, which then sums nothing itself. Every gradient is the
/// composition's, bit for bit. A Linear without a bias gets no sums.
#[test]
fn a_linear_branch_takes_its_bias_gradient_from_the_norm() {
    use ferrograd::amp::{AmpDType, autocast};
    let _one_at_a_time = lock();
    const K: usize = 6;
    let run = |step: Step, biased: bool| {
        let mut g = Generator::new(41);
        let mut leaf = |shape: &[usize]| {
            randn(shape, DType::F32, &mut g)
                .requires_grad_(true)
                .unwrap()
        };
        let (x, z) = (leaf(&[4, 3, N]), leaf(&[4, 3, K]));
        let (wl, bl) = (leaf(&[N, K]), leaf(&[N]));
        let (w, b) = (leaf(&[N]), leaf(&[N]));
        let c = randn(&[4, 3, N], DType::F32, &mut g);
        let loss = {
            let _amp = autocast(AmpDType::BF16);
            let h = z.linear(&wl, biased.then_some(&bl)).unwrap();
            assert_eq!(h.dtype(), DType::BF16);
            let (s, y) = step(&x, &h, &w, &b, DType::BF16).unwrap();
            let y = y.to_dtype(DType::F32).unwrap().sum_all().unwrap();
            y.add(&s.mul(&c).unwrap().sum_all().unwrap()).unwrap()
        };
        let events = ops_allocating(|| loss.backward().unwrap());
        let mut grads = vec![];
        for t in [&x, &z, &wl, &w, &b]
            .into_iter()
            .chain(biased.then_some(&bl))
        {
            grads.push(bits(&t.grad().expect("a gradient")));
        }
        // Vectors of N f32: the norm's weight and bias gradients, its column sums, the
        // Linear's own bias sum.
        let vector = (N * 4) as u64;
        let count = |op| events.iter().filter(|&&e| e == (op, vector)).count();
        (
            grads,
            count("layer_norm_backward"),
            count("linear_backward"),
        )
    };
    let (want, composed_norm, composed_linear) = run(composed, true);
    let (got, fused_norm, fused_linear) = run(fused, true);
    for (i, name) in ["x", "z", "wl", "w", "b", "bl"].iter().enumerate() {
        assert_eq!(want[i], got[i], "{name}.grad");
    }
    assert_eq!((composed_norm, composed_linear), (2, 1), "the composition");
    assert_eq!(
        (fused_norm, fused_linear),
        (3, 0),
        "the norm sums, the Linear takes them"
    );
    let (want, _, _) = run(composed, false);
    let (got, unbiased_norm, _) = run(fused, false);
    assert_eq!(want, got, "without a bias");
    assert_eq!(unbiased_norm, 2, "no sums for a Linear without a bias");
}
