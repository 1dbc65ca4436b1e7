//! Tests of the row ops — softmax, log_softmax, cross_entropy, layer_norm: golden cases
//! against PyTorch (tests/fixtures/ops.safetensors, written by tools/make_fixtures.py), f64
//! finite-difference checks of every gradient, edge cases PyTorch defines (all targets
//! ignored, any softmax dim, half precision), and the errors a user can cause.

mod common;

use common::{ATOL, RTOL, assert_same_bits, check_case_on};
use ferrograd::{DType, Device, Error, Generator, Tensor, no_grad};

const CPU: Device = Device::Cpu;

// ---- fixtures -------------------------------------------------------------------------------

per_device!(golden_softmax, |d| check_case_on(
    d,
    "softmax",
    ATOL,
    RTOL,
    |x| x[0].softmax(-1)
));
per_device!(golden_softmax_dim1, |d| check_case_on(
    d,
    "softmax_dim1",
    ATOL,
    RTOL,
    |x| x[0].softmax(1)
));
per_device!(golden_log_softmax, |d| check_case_on(
    d,
    "log_softmax",
    ATOL,
    RTOL,
    |x| x[0].log_softmax(-1)
));
per_device!(golden_cross_entropy, |d| check_case_on(
    d,
    "cross_entropy",
    ATOL,
    RTOL,
    |x| { x[0].cross_entropy(&x[1], -100) }
));
per_device!(golden_layer_norm, |d| check_case_on(
    d,
    "layer_norm",
    ATOL,
    RTOL,
    |x| { x[0].layer_norm(&[8], Some(&x[1]), Some(&x[2]), 1e-5) }
));

/// |got - want| <= tol (1 + |want|) elementwise.
fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    common::assert_close(what, got, want, tol, tol);
}

// ---- finite differences in f64 --------------------------------------------------------------

fn randn(seed: u64, n: usize) -> Vec<f64> {
    Generator::new(seed).normal(n, 0.0, 1.0)
}

fn f64_tensor(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, CPU).unwrap()
}

/// Compares the autograd gradient of the scalar `f(inputs)` with central differences
/// (step 1e-6) for every element of every input.
fn grad_check(inputs: &[(Vec<f64>, Vec<usize>)], f: impl Fn(&[Tensor]) -> Tensor) {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|(v, s)| f64_tensor(v, s).requires_grad_(true).unwrap())
        .collect();
    f(&leaves).backward().unwrap();
    let eps = 1e-6;
    for (i, (values, _)) in inputs.iter().enumerate() {
        let grad = leaves[i]
            .grad()
            .expect("a gradient for every input")
            .to_vec::<f64>()
            .unwrap();
        for k in 0..values.len() {
            let at = |delta: f64| {
                let _g = no_grad();
                let ts: Vec<Tensor> = inputs
                    .iter()
                    .enumerate()
                    .map(|(j, (v, s))| {
                        let mut v = v.clone();
                        if j == i {
                            v[k] += delta;
                        }
                        f64_tensor(&v, s)
                    })
                    .collect();
                f(&ts).item().unwrap()
            };
            let numeric = (at(eps) - at(-eps)) / (2.0 * eps);
            let diff = (numeric - grad[k]).abs();
            assert!(
                diff <= 1e-6 * (1.0 + numeric.abs()),
                "input {i}[{k}]: autograd {}, numeric {numeric}",
                grad[k]
            );
        }
    }
}

/// Σ out · w for a fixed random w: a scalar that depends on every output element.
fn weighted_sum(out: &Tensor, seed: u64) -> Tensor {
    let w = f64_tensor(&randn(seed, out.numel()), out.shape());
    out.mul(&w).unwrap().sum_all().unwrap()
}

#[test]
fn grad_check_softmax() {
    let x = (randn(1, 24), vec![2, 3, 4]);
    grad_check(std::slice::from_ref(&x), |t| {
        weighted_sum(&t[0].softmax(-1).unwrap(), 11)
    });
    // A dim that is not last goes through the permuted path.
    grad_check(&[x], |t| weighted_sum(&t[0].softmax(0).unwrap(), 12));
}

#[test]
fn grad_check_log_softmax() {
    let x = (randn(2, 24), vec![2, 3, 4]);
    grad_check(std::slice::from_ref(&x), |t| {
        weighted_sum(&t[0].log_softmax(-1).unwrap(), 13)
    });
    grad_check(&[x], |t| weighted_sum(&t[0].log_softmax(1).unwrap(), 14));
}

#[test]
fn grad_check_cross_entropy() {
    let targets = Tensor::from_vec(vec![2i64, -100, 0, 4, 1], &[5], CPU).unwrap();
    let x = (randn(3, 25), vec![5, 5]);
    grad_check(&[x], |t| {
        t[0].cross_entropy(&targets, -100)
            .unwrap()
            .mul_scalar(1.7)
            .unwrap()
    });
}

#[test]
fn grad_check_layer_norm() {
    let x = (
        randn(4, 24).iter().map(|v| 3.0 * v + 1.0).collect(),
        vec![3, 2, 4],
    );
    let w = (randn(5, 8), vec![2, 4]);
    let b = (randn(6, 8), vec![2, 4]);
    // Two trailing dims normalised together, weight and bias.
    grad_check(&[x.clone(), w.clone(), b], |t| {
        weighted_sum(
            &t[0]
                .layer_norm(&[2, 4], Some(&t[1]), Some(&t[2]), 1e-5)
                .unwrap(),
            15,
        )
    });
    // Weight only, then no affine parameters at all.
    grad_check(&[x.clone(), (w.0[..4].to_vec(), vec![4])], |t| {
        weighted_sum(&t[0].layer_norm(&[4], Some(&t[1]), None, 1e-5).unwrap(), 16)
    });
    grad_check(&[x], |t| {
        weighted_sum(&t[0].layer_norm(&[4], None, None, 1e-5).unwrap(), 17)
    });
}

// ---- behaviour --------------------------------------------------------------------------

fn f32_tensor(v: Vec<f32>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(v, shape, CPU).unwrap()
}

#[test]
fn cross_entropy_all_ignored_is_nan_with_zero_gradient() {
    let x = f32_tensor(vec![0.5, -1.0, 2.0, 0.1, 0.2, 0.3], &[2, 3])
        .requires_grad_(true)
        .unwrap();
    let t = Tensor::from_vec(vec![-100i64, -100], &[2], CPU).unwrap();
    let loss = x.cross_entropy(&t, -100).unwrap();
    assert!(loss.item().unwrap().is_nan());
    loss.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![0.0; 6]);
}

#[test]
fn cross_entropy_of_btc_matches_flattened() {
    let v: Vec<f32> = randn(7, 2 * 3 * 4).into_iter().map(|x| x as f32).collect();
    let ids = vec![0i64, 3, 1, 2, 7, 3];
    let x3 = f32_tensor(v.clone(), &[2, 3, 4])
        .requires_grad_(true)
        .unwrap();
    let x2 = f32_tensor(v, &[6, 4]).requires_grad_(true).unwrap();
    let t3 = Tensor::from_vec(ids.clone(), &[2, 3], CPU).unwrap();
    let t2 = Tensor::from_vec(ids, &[6], CPU).unwrap();
    let (l3, l2) = (
        x3.cross_entropy(&t3, 7).unwrap(),
        x2.cross_entropy(&t2, 7).unwrap(),
    );
    assert_eq!(l3.shape(), &[] as &[usize]);
    assert_eq!(l3.item().unwrap(), l2.item().unwrap());
    l3.backward().unwrap();
    l2.backward().unwrap();
    assert_eq!(x3.grad().unwrap().shape(), &[2, 3, 4]);
    assert_eq!(
        x3.grad().unwrap().to_vec::<f32>().unwrap(),
        x2.grad().unwrap().to_vec::<f32>().unwrap()
    );
}

#[test]
fn cross_entropy_matches_log_softmax_pick() {
    // -mean log_softmax(x)[target] over the kept rows, from the separate ops.
    let v = randn(8, 12);
    let x = f64_tensor(&v, &[3, 4]);
    let loss = x
        .cross_entropy(&Tensor::from_vec(vec![1i64, 3, -1], &[3], CPU).unwrap(), -1)
        .unwrap();
    let ls = x.log_softmax(-1).unwrap().to_vec::<f64>().unwrap();
    let want = -(ls[1] + ls[4 + 3]) / 2.0;
    assert!((loss.item().unwrap() - want).abs() < 1e-12);
}

/// A reference softmax in f64 over rows of `n`.
fn softmax_reference(v: &[f64], n: usize) -> Vec<f64> {
    v.chunks(n)
        .flat_map(|r| {
            let m = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = r.iter().map(|x| (x - m).exp()).sum();
            r.iter().map(move |x| (x - m).exp() / s).collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn softmax_large_rows_run_in_parallel_and_match_reference() {
    // 64 rows of 1024: above the parallel threshold. Large values test max-subtraction.
    let v: Vec<f64> = randn(9, 64 * 1024).into_iter().map(|x| 50.0 * x).collect();
    let y = f64_tensor(&v, &[64, 1024])
        .softmax(-1)
        .unwrap()
        .to_vec::<f64>()
        .unwrap();
    let want = softmax_reference(&v, 1024);
    for (a, b) in y.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-12, "{a} vs {b}");
    }
}

#[test]
fn softmax_of_extreme_values_is_finite() {
    let x = f32_tensor(vec![1000.0, 0.0, -1000.0, 88.0, 89.0, 90.0], &[2, 3]);
    let y = x.softmax(-1).unwrap().to_vec::<f32>().unwrap();
    assert!(y.iter().all(|v| v.is_finite()));
    assert_eq!(&y[..3], &[1.0, 0.0, 0.0]);
    let ls = x.log_softmax(-1).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(ls[2], -2000.0);
}

#[test]
fn softmax_along_dim0_and_scalar() {
    let v = randn(10, 12);
    let x = f64_tensor(&v, &[3, 4]);
    let y = x.softmax(0).unwrap();
    assert_eq!(y.shape(), &[3, 4]);
    let yt = x
        .t()
        .unwrap()
        .contiguous()
        .unwrap()
        .softmax(-1)
        .unwrap()
        .t()
        .unwrap();
    assert_eq!(y.to_vec::<f64>().unwrap(), yt.to_vec::<f64>().unwrap());
    let s = Tensor::scalar(3.0, DType::F32, CPU).unwrap();
    assert_eq!(s.softmax(-1).unwrap().item().unwrap(), 1.0);
    assert_eq!(s.log_softmax(0).unwrap().item().unwrap(), 0.0);
}

#[test]
fn half_precision_matches_f32() {
    let v: Vec<f32> = randn(11, 40).into_iter().map(|x| x as f32).collect();
    let x = f32_tensor(v, &[5, 8]);
    let want_sm = x.softmax(-1).unwrap();
    let want_ln = x.layer_norm(&[8], None, None, 1e-5).unwrap();
    for dtype in [DType::F16, DType::BF16] {
        let h = x.to_dtype(dtype).unwrap().requires_grad_(true).unwrap();
        let sm = h.softmax(-1).unwrap();
        assert_eq!(sm.dtype(), dtype);
        assert_close(&format!("softmax {dtype}"), &sm, &want_sm, 1e-2);
        assert_close(
            &format!("layer_norm {dtype}"),
            &h.layer_norm(&[8], None, None, 1e-5).unwrap(),
            &want_ln,
            4e-2,
        );
        let t = Tensor::from_vec(vec![0i64, 1, 2, 3, 4], &[5], CPU).unwrap();
        let loss = h.cross_entropy(&t, -100).unwrap();
        assert_eq!(loss.dtype(), dtype);
        loss.backward().unwrap();
        assert_eq!(h.grad().unwrap().dtype(), dtype);
    }
}

#[test]
fn layer_norm_normalises_with_biased_variance() {
    let x = f64_tensor(&[1.0, 2.0, 3.0, 4.0, -2.0, 0.0, 2.0, 4.0], &[2, 4]);
    let y = x
        .layer_norm(&[4], None, None, 0.0)
        .unwrap()
        .to_vec::<f64>()
        .unwrap();
    // Row 0: mean 2.5, biased variance 1.25.
    let s = 1.25f64.sqrt();
    let want = [-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s];
    for (a, b) in y[..4].iter().zip(want) {
        assert!((a - b).abs() < 1e-12);
    }
}

/// Gradients of `f` for each of `inputs` (f64 leaves), after backward of `weighted_sum`.
fn grads_of(inputs: &[(&[f64], &[usize])], f: impl Fn(&[Tensor]) -> Tensor) -> Vec<Vec<f64>> {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|(v, s)| f64_tensor(v, s).requires_grad_(true).unwrap())
        .collect();
    weighted_sum(&f(&leaves), 21).backward().unwrap();
    leaves
        .iter()
        .map(|t| t.grad().unwrap().to_vec::<f64>().unwrap())
        .collect()
}

fn assert_all_close(what: &str, got: &[Vec<f64>], want: &[Vec<f64>], tol: f64) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len());
        for (k, (a, b)) in g.iter().zip(w).enumerate() {
            assert!(
                (a - b).abs() <= tol * (1.0 + b.abs()),
                "{what} input {i}[{k}]: {a} vs {b}"
            );
        }
    }
}

#[test]
fn layer_norm_large_matches_composite_ops() {
    // 2000 rows of 64: rows and the weight-gradient blocks both run in parallel.
    let (x, w, b) = (randn(30, 2000 * 64), randn(31, 64), randn(32, 64));
    let inputs: [(&[f64], &[usize]); 3] = [(&x, &[2000, 64]), (&w, &[64]), (&b, &[64])];
    let fused = grads_of(&inputs, |t| {
        t[0].layer_norm(&[64], Some(&t[1]), Some(&t[2]), 1e-5)
            .unwrap()
    });
    let composite = grads_of(&inputs, |t| {
        let d = t[0].sub(&t[0].mean(&[-1], true).unwrap()).unwrap();
        let var = d.mul(&d).unwrap().mean(&[-1], true).unwrap();
        let y = d
            .div(&var.add_scalar(1e-5).unwrap().sqrt().unwrap())
            .unwrap();
        y.mul(&t[1]).unwrap().add(&t[2]).unwrap()
    });
    assert_all_close("layer_norm", &fused, &composite, 1e-9);
}

#[test]
fn cross_entropy_large_matches_composite_ops() {
    // 300 rows of 500 classes: the parallel path; every 7th target ignored.
    let (rows, classes) = (300, 500);
    let x = randn(33, rows * classes);
    let ids: Vec<i64> = (0..rows as i64)
        .map(|r| {
            if r % 7 == 0 {
                -100
            } else {
                (r * 37) % classes as i64
            }
        })
        .collect();
    let kept = ids.iter().filter(|&&t| t >= 0).count() as f64;
    let mut hot = vec![0.0; rows * classes];
    for (r, &t) in ids.iter().enumerate().filter(|(_, t)| **t >= 0) {
        hot[r * classes + t as usize] = -1.0 / kept;
    }
    let targets = Tensor::from_vec(ids, &[rows], CPU).unwrap();
    let inputs: [(&[f64], &[usize]); 1] = [(&x, &[rows, classes])];
    let fused = grads_of(&inputs, |t| t[0].cross_entropy(&targets, -100).unwrap());
    let hot = f64_tensor(&hot, &[rows, classes]);
    let composite = grads_of(&inputs, |t| {
        t[0].log_softmax(-1)
            .unwrap()
            .mul(&hot)
            .unwrap()
            .sum_all()
            .unwrap()
    });
    assert_all_close("cross_entropy", &fused, &composite, 1e-12);
}

// ---- errors ---------------------------------------------------------------------------------

fn logits() -> Tensor {
    f32_tensor(vec![0.0; 15], &[3, 5])
}

#[test]
fn cross_entropy_rejects_float_targets() {
    let t = f32_tensor(vec![0.0, 1.0, 2.0], &[3]);
    assert!(matches!(
        logits().cross_entropy(&t, -100),
        Err(Error::DType { .. })
    ));
}

#[test]
fn cross_entropy_rejects_out_of_range_targets() {
    for bad in [5i64, -1, 100] {
        let t = Tensor::from_vec(vec![0, bad, 2], &[3], CPU).unwrap();
        let err = logits().cross_entropy(&t, -100).unwrap_err();
        assert!(matches!(err, Error::Index { .. }), "{err}");
        assert!(err.to_string().contains(&format!("target {bad} ")), "{err}");
    }
}

#[test]
fn cross_entropy_rejects_shape_mismatch() {
    let t = Tensor::from_vec(vec![0i64, 1], &[2], CPU).unwrap();
    assert!(matches!(
        logits().cross_entropy(&t, -100),
        Err(Error::Shape { .. })
    ));
    let t = Tensor::from_vec(vec![0i64, 1, 2], &[3], CPU).unwrap();
    let flat = f32_tensor(vec![0.0; 3], &[3]);
    assert!(matches!(
        flat.cross_entropy(&t, -100),
        Err(Error::Shape { .. })
    ));
}

#[test]
fn layer_norm_rejects_bad_shapes() {
    let x = f32_tensor(vec![0.0; 12], &[3, 4]);
    assert!(matches!(
        x.layer_norm(&[3], None, None, 1e-5),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        x.layer_norm(&[], None, None, 1e-5),
        Err(Error::Shape { .. })
    ));
    let w = f32_tensor(vec![1.0; 3], &[3]);
    assert!(matches!(
        x.layer_norm(&[4], Some(&w), None, 1e-5),
        Err(Error::Shape { .. })
    ));
    let w64 = Tensor::ones(&[4], DType::F64, CPU).unwrap();
    assert!(matches!(
        x.layer_norm(&[4], Some(&w64), None, 1e-5),
        Err(Error::DType { .. })
    ));
}

#[test]
fn softmax_rejects_bad_dim_and_integer_input() {
    let x = f32_tensor(vec![0.0; 6], &[2, 3]);
    assert!(matches!(x.softmax(2), Err(Error::Index { .. })));
    assert!(matches!(x.log_softmax(-3), Err(Error::Index { .. })));
    let ids = Tensor::from_vec(vec![1i64, 2], &[2], CPU).unwrap();
    assert!(matches!(
        ids.softmax(-1),
        Err(Error::UnsupportedDType { .. })
    ));
}

// ---- layer_norm_to: the norm and the cast of its output in one op ---------------------------

/// The output of `f` on fresh leaves copied from `inputs`, and each leaf's gradient after a
/// backward from `gy` (in the output's dtype).
fn output_and_grads(
    inputs: &[Tensor],
    gy: &Tensor,
    f: impl Fn(&[Tensor]) -> ferrograd::Result<Tensor>,
) -> (Tensor, Vec<Tensor>) {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.detach().requires_grad_(true).unwrap())
        .collect();
    let y = f(&leaves).unwrap();
    let opts = ferrograd::autograd::BackwardOptions {
        gradient: Some(gy.clone()),
        ..Default::default()
    };
    y.backward_with(opts).unwrap();
    let grads = leaves.iter().map(|t| t.grad().unwrap()).collect();
    (y.detach(), grads)
}

/// x (shape, f32, mean offset by 3 so the two-pass variance matters), weight and bias over
/// the trailing `normalized` dims.
fn ln_case(shape: &[usize], normalized: &[usize], seed: u64) -> [Tensor; 3] {
    let mut g = Generator::new(seed);
    let mut draw = |s: &[usize]| Tensor::randn_with(s, DType::F32, CPU, &mut g).unwrap();
    let x = draw(shape).add_scalar(3.0).unwrap();
    [x, draw(normalized), draw(normalized)]
}

/// `layer_norm_to(.., dtype)` against `layer_norm(..)?.to_dtype(dtype)` on `inputs`
/// ([x, weight, bias]) with each affine parameter present or absent: output and every
/// gradient bit for bit.
fn check_layer_norm_to(what: &str, inputs: &[Tensor; 3], normalized: &[usize], dtype: DType) {
    for (weight, bias) in [(true, true), (true, false), (false, true), (false, false)] {
        let what = format!("{what} -> {dtype}, weight {weight}, bias {bias}");
        // [x, weight?, bias?] as leaves; the closures find the parameters by position.
        let mut used = vec![inputs[0].clone()];
        used.extend(weight.then(|| inputs[1].clone()));
        used.extend(bias.then(|| inputs[2].clone()));
        let params = |t: &[Tensor]| {
            let w = weight.then(|| t[1].clone());
            let b = bias.then(|| t[1 + weight as usize].clone());
            (w, b)
        };
        let x = &inputs[0];
        let gy = Tensor::randn_with(x.shape(), DType::F32, CPU, &mut Generator::new(77))
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let (fused, fused_grads) = output_and_grads(&used, &gy, |t| {
            let (w, b) = params(t);
            t[0].layer_norm_to(normalized, w.as_ref(), b.as_ref(), 1e-5, dtype)
        });
        let (composed, composed_grads) = output_and_grads(&used, &gy, |t| {
            let (w, b) = params(t);
            t[0].layer_norm(normalized, w.as_ref(), b.as_ref(), 1e-5)?
                .to_dtype(dtype)
        });
        assert_same_bits(&format!("{what}: output"), &fused, &composed);
        for (i, (g, want)) in fused_grads.iter().zip(&composed_grads).enumerate() {
            assert_same_bits(&format!("{what}: gradient {i}"), g, want);
        }
    }
}

#[test]
fn layer_norm_to_equals_layer_norm_then_cast_bit_for_bit() {
    for dtype in [DType::BF16, DType::F16] {
        check_layer_norm_to("(3, 5, 40)", &ln_case(&[3, 5, 40], &[40], 40), &[40], dtype);
        // Two normalised dims, and enough rows (2000 of 64) for the parallel row and
        // weight-gradient paths.
        let two = ln_case(&[4, 3, 7], &[3, 7], 41);
        check_layer_norm_to("(4, 3, 7) over (3, 7)", &two, &[3, 7], dtype);
        let tall = ln_case(&[2000, 64], &[64], 42);
        check_layer_norm_to("(2000, 64)", &tall, &[64], dtype);
    }
}

#[test]
fn layer_norm_to_other_dtype_pairs_are_the_composition() {
    // Same dtype: the plain norm. f64 rows, or half rows to f32: the norm, then the cast.
    let [x, w, b] = ln_case(&[6, 24], &[24], 43);
    check_layer_norm_to("f32", &[x.clone(), w.clone(), b.clone()], &[24], DType::F32);
    let f64s = [&x, &w, &b].map(|t| t.to_dtype(DType::F64).unwrap());
    check_layer_norm_to("f64", &f64s, &[24], DType::F32);
    check_layer_norm_to("f64", &f64s, &[24], DType::BF16);
    let halves = [&x, &w, &b].map(|t| t.to_dtype(DType::BF16).unwrap());
    check_layer_norm_to("bf16", &halves, &[24], DType::F32);
    check_layer_norm_to("bf16", &halves, &[24], DType::F16);
}

#[test]
fn layer_norm_to_under_autocast_equals_the_autocast_norm_then_cast() {
    // In a region the norm runs in f32 whatever its input: bf16 inputs are cast first.
    let _amp = ferrograd::amp::autocast(ferrograd::amp::AmpDType::BF16);
    let [x, w, b] = ln_case(&[5, 48], &[48], 44);
    check_layer_norm_to(
        "f32 in a region",
        &[x.clone(), w.clone(), b.clone()],
        &[48],
        DType::BF16,
    );
    let x = x.to_dtype(DType::BF16).unwrap();
    check_layer_norm_to("bf16 in a region", &[x, w, b], &[48], DType::BF16);
}

#[test]
fn layer_norm_to_rejects_what_layer_norm_rejects() {
    let [x, w, _] = ln_case(&[2, 8], &[8], 45);
    let bad = x.layer_norm_to(&[4], Some(&w), None, 1e-5, DType::BF16);
    assert!(matches!(bad, Err(Error::Shape { .. })), "{bad:?}");
    let ids = Tensor::from_vec(vec![1i64, 2], &[2], CPU).unwrap();
    let bad = ids.layer_norm_to(&[2], None, None, 1e-5, DType::I64);
    assert!(bad.is_err());
}
