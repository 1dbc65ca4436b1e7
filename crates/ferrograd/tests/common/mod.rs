//! Shared helpers of the op tests: golden fixtures written by `tools/make_fixtures.py` from
//! PyTorch, llm.c-style closeness checks that print the first values and the largest
//! difference, one-line fixture cases (`check_case`), and a float64 finite-difference
//! gradient check (`gradcheck`). Not a test by itself.
#![allow(dead_code)]

use ferrograd::optim::Optimizer;
use ferrograd::{DType, Device, Generator, Result, Tensor, no_grad};

pub mod fixture_file;
pub mod host_only;
pub mod scale_update;

use fixture_file::FixtureFile;

const FILE: &str = "ops.safetensors";
const FORMAT: &str = "ferrograd-fixtures";
const TOOL: &str = "make_fixtures.py";
const HINT: &str = "regenerate with tools/make_fixtures.py (see tools/README.md)";

/// Default tolerances of the golden cases (float32 against PyTorch's float32).
pub const ATOL: f64 = 1e-5;
pub const RTOL: f64 = 1e-5;

fn fixtures() -> &'static FixtureFile {
    fixture_file::open(FILE, FORMAT, TOOL)
}

/// The metadata must name our format and version, or every comparison would be meaningless.
pub fn check_header(bytes: &[u8]) {
    fixture_file::check_header(bytes, FILE, FORMAT, HINT);
}

/// Whether the fixture file holds `name`.
pub fn has_fixture(name: &str) -> bool {
    fixtures().try_get(name).is_some()
}

/// One fixture tensor on the CPU, in its stored dtype.
pub fn load_fixture(name: &str) -> Tensor {
    fixtures().get(name)
}

/// Compares two tensors elementwise: |got - want| <= atol + rtol |want|. On failure prints
/// the first values of both and the largest difference, then panics.
pub fn assert_close(name: &str, got: &Tensor, want: &Tensor, atol: f64, rtol: f64) {
    assert_eq!(got.shape(), want.shape(), "{name}: shape");
    let (g, w) = (got.to_vec::<f64>().unwrap(), want.to_vec::<f64>().unwrap());
    let mut worst: Option<(usize, f64)> = None;
    let mut bad = 0usize;
    for (i, (&a, &b)) in g.iter().zip(&w).enumerate() {
        let diff = (a - b).abs();
        let ok = diff <= atol + rtol * b.abs() || (a.is_nan() && b.is_nan());
        if !ok {
            bad += 1;
        }
        let d = if diff.is_nan() { f64::INFINITY } else { diff };
        if worst.is_none_or(|(_, m)| d > m) {
            worst = Some((i, d));
        }
    }
    if bad > 0 {
        let (i, maxdiff) = worst.unwrap();
        let mut msg = format!(
            "{name}: NOT OK ({bad} of {} values out of tolerance)\n",
            g.len()
        );
        for j in 0..g.len().min(5) {
            msg += &format!("  [{j}] got {:+.8e}  want {:+.8e}\n", g[j], w[j]);
        }
        msg += &format!(
            "  maxdiff {maxdiff:.3e} at [{i}]: got {:+.8e} want {:+.8e}",
            g[i], w[i]
        );
        panic!("{msg}");
    }
}

/// The inputs NAME.in0, NAME.in1, ... in order, on `device`; float ones require grad.
fn case_inputs(name: &str, device: Device) -> Vec<Tensor> {
    let inputs: Vec<Tensor> = (0..)
        .map(|i| format!("{name}.in{i}"))
        .take_while(|k| has_fixture(k))
        .map(|k| {
            let t = load_fixture(&k).to_device(device).unwrap();
            if t.dtype().is_float() {
                t.requires_grad_(true).unwrap()
            } else {
                t
            }
        })
        .collect();
    assert!(!inputs.is_empty(), "no inputs for case '{name}'; {HINT}");
    inputs
}

/// One golden case: forward `f` on NAME.in*, compare with NAME.out, backprop
/// `(out * gout).sum()` and compare every input's `.grad` with NAME.grad*.
pub fn check_case(name: &str, f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    check_case_tol(name, ATOL, RTOL, f)
}

pub fn check_case_tol(name: &str, atol: f64, rtol: f64, f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    check_case_on(Device::Cpu, name, atol, rtol, f)
}

/// The same golden case with inputs on `device` (one test body for every device).
pub fn check_case_on(
    device: Device,
    name: &str,
    atol: f64,
    rtol: f64,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let inputs = case_inputs(name, device);
    assert!(
        inputs.iter().all(|t| t.device() == device),
        "{name}: inputs not on {device}"
    );
    let out = f(&inputs).unwrap_or_else(|e| panic!("{name}: forward failed: {e}"));
    assert_close(
        &format!("{name}.out"),
        &out,
        &load_fixture(&format!("{name}.out")),
        atol,
        rtol,
    );
    assert_eq!(out.device(), device, "{name}: output left the device");
    let gout = load_fixture(&format!("{name}.gout"))
        .to_device(device)
        .unwrap();
    let loss = out.mul(&gout).and_then(|t| t.sum_all()).unwrap();
    loss.backward()
        .unwrap_or_else(|e| panic!("{name}: backward failed: {e}"));
    let mut checked = 0;
    for (i, x) in inputs.iter().enumerate() {
        let key = format!("{name}.grad{i}");
        if !has_fixture(&key) {
            continue;
        }
        let want = load_fixture(&key);
        // PyTorch's None gradient is stored as zeros.
        let got = x.grad().unwrap_or_else(|| want.zeros_like().unwrap());
        assert_close(&key, &got, &want, atol, rtol);
        checked += 1;
    }
    assert!(
        checked > 0,
        "{name}: the fixture has no gradients to compare; {HINT}"
    );
}

/// Seeded f64 normal samples for gradcheck inputs.
pub fn randn64(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn_with(shape, DType::F64, Device::Cpu, &mut Generator::new(seed)).unwrap()
}

/// Seeded f64 samples in [0.5, 1.5]: a safe domain for log, sqrt, pow and division.
pub fn pos64(shape: &[usize], seed: u64) -> Tensor {
    Tensor::uniform_with(
        shape,
        0.5,
        1.5,
        DType::F64,
        Device::Cpu,
        &mut Generator::new(seed),
    )
    .unwrap()
}

/// Seeded f64 samples with |x| in [0.2, 1.2], random sign: away from kinks (relu at 0).
pub fn away64(shape: &[usize], seed: u64) -> Tensor {
    let mut g = Generator::new(seed);
    let n: usize = shape.iter().product();
    let mags = g.uniform(n, 0.2, 1.2);
    let signs = g.uniform(n, -1.0, 1.0);
    let v: Vec<f64> = mags
        .iter()
        .zip(&signs)
        .map(|(m, s)| m * s.signum())
        .collect();
    Tensor::from_vec(v, shape, Device::Cpu).unwrap()
}

const EPS: f64 = 1e-6;
const GC_ATOL: f64 = 1e-6;
const GC_RTOL: f64 = 1e-5;

/// Checks autograd against central finite differences (eps 1e-6) in f64. The scalar checked
/// is `sum(f(inputs) * w)` for a fixed random `w`, so every output element counts. Float
/// inputs all require grad; others pass through unchanged.
pub fn gradcheck(name: &str, f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor]) {
    for x in inputs.iter().filter(|x| x.dtype().is_float()) {
        assert_eq!(x.dtype(), DType::F64, "{name}: gradcheck needs f64 inputs");
    }
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|x| {
            if x.dtype().is_float() {
                x.detach().requires_grad_(true).unwrap()
            } else {
                x.clone()
            }
        })
        .collect();
    let out = f(&leaves).unwrap_or_else(|e| panic!("{name}: forward failed: {e}"));
    let w = randn64(out.shape(), 12345);
    out.mul(&w)
        .and_then(|t| t.sum_all())
        .and_then(|l| l.backward())
        .unwrap_or_else(|e| panic!("{name}: backward: {e}"));
    let objective = |xs: &[Tensor]| -> f64 {
        let _g = no_grad();
        f(xs)
            .and_then(|o| o.mul(&w))
            .and_then(|t| t.sum_all())
            .and_then(|t| t.item())
            .unwrap()
    };
    for (i, leaf) in leaves
        .iter()
        .enumerate()
        .filter(|(_, x)| x.dtype().is_float())
    {
        let analytic = leaf
            .grad()
            .unwrap_or_else(|| panic!("{name}: input {i} got no gradient"));
        let base = inputs[i].to_vec::<f64>().unwrap();
        let mut numeric = vec![0.0; base.len()];
        for (j, slot) in numeric.iter_mut().enumerate() {
            let eval = |delta: f64| {
                let mut v = base.clone();
                v[j] += delta;
                let mut xs: Vec<Tensor> = inputs.iter().map(Tensor::detach).collect();
                xs[i] = Tensor::from_vec(v, inputs[i].shape(), Device::Cpu).unwrap();
                objective(&xs)
            };
            *slot = (eval(EPS) - eval(-EPS)) / (2.0 * EPS);
        }
        let numeric = Tensor::from_vec(numeric, inputs[i].shape(), Device::Cpu).unwrap();
        assert_close(
            &format!("{name}: d/d input{i}"),
            &analytic,
            &numeric,
            GC_ATOL,
            GC_RTOL,
        );
    }
}

/// Defines `mod $name { fn cpu(); fn cuda() }` running `$body(device)` on each device; the
/// CUDA variant exists with the `gpu-tests` feature (and fails without a GPU).
#[macro_export]
macro_rules! per_device {
    ($name:ident, $body:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            #[test]
            fn cpu() {
                ($body)(ferrograd::Device::Cpu)
            }
            #[cfg(feature = "gpu-tests")]
            #[test]
            fn cuda() {
                ($body)(ferrograd::Device::Cuda(0))
            }
        }
    };
}

/// `t` on `device`, without history. A GPU test that cannot reach its device says so.
pub fn on(t: &Tensor, device: Device) -> Tensor {
    t.to_device(device)
        .unwrap_or_else(|e| panic!("cannot move a tensor to {device} (GPU tests need cuda:0): {e}"))
        .detach()
}

/// Three optimizer steps of a small linear regression, `mse(x @ wᵀ + b, y)` with params
/// [w, b], on whatever device they live on (the optimizer tests run it on each device).
pub fn regression_steps(params: &[Tensor], x: &Tensor, y: &Tensor, opt: &mut impl Optimizer) {
    for _ in 0..3 {
        opt.zero_grad().unwrap();
        let loss = x
            .linear(&params[0], Some(&params[1]))
            .unwrap()
            .mse_loss(y)
            .unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
    }
}

/// Asserts `got` and `want` have one dtype, one shape and the same bits.
#[track_caller]
pub fn assert_same_bits(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    // f64 holds every f32/f16/bf16 value exactly: equal f64 bits are equal element bits.
    let bits = |t: &Tensor| -> Vec<u64> {
        let v = t.to_vec::<f64>().unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    };
    let (g, w) = (bits(got), bits(want));
    let diff = g.iter().zip(&w).position(|(a, b)| a != b);
    assert!(diff.is_none(), "{what}: element {diff:?} differs");
}
