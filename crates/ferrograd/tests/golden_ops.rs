//! Golden tests of the core ops against PyTorch: each case runs the op on the fixture's
//! inputs, compares the output, backprops `(out * gout).sum()` and compares every input
//! gradient (fixtures from tools/make_fixtures.py; helpers in common/).

mod common;

use common::{ATOL, RTOL, check_case_on};
use ferrograd::ops::GeluApprox;

// ---- elementwise, with broadcasting ------------------------------------------------------

per_device!(add_bcast, |d| check_case_on(
    d,
    "add_bcast",
    ATOL,
    RTOL,
    |x| x[0].add(&x[1])
)); // (2, 3, 4) + (4)

per_device!(add_bcast2, |d| check_case_on(
    d,
    "add_bcast2",
    ATOL,
    RTOL,
    |x| x[0].add(&x[1])
)); // (2, 1, 4) + (3, 1)

per_device!(sub_bcast, |d| check_case_on(
    d,
    "sub_bcast",
    ATOL,
    RTOL,
    |x| x[0].sub(&x[1])
));

per_device!(mul_bcast, |d| check_case_on(
    d,
    "mul_bcast",
    ATOL,
    RTOL,
    |x| x[0].mul(&x[1])
)); // (2, 3, 4) * (3, 1)

per_device!(div_bcast, |d| check_case_on(
    d,
    "div_bcast",
    ATOL,
    RTOL,
    |x| x[0].div(&x[1])
));

per_device!(neg, |d| check_case_on(d, "neg", ATOL, RTOL, |x| x[0].neg()));

per_device!(add_scalar, |d| check_case_on(
    d,
    "add_scalar",
    ATOL,
    RTOL,
    |x| x[0].add_scalar(2.5)
));

per_device!(mul_scalar, |d| check_case_on(
    d,
    "mul_scalar",
    ATOL,
    RTOL,
    |x| x[0].mul_scalar(-1.5)
));

per_device!(pow_scalar, |d| check_case_on(
    d,
    "pow_scalar",
    ATOL,
    RTOL,
    |x| x[0].pow_scalar(3.0)
));

per_device!(pow_tensor, |d| check_case_on(
    d,
    "pow_tensor",
    ATOL,
    RTOL,
    |x| x[0].pow(&x[1])
));

per_device!(exp, |d| check_case_on(d, "exp", ATOL, RTOL, |x| x[0].exp()));

per_device!(log, |d| check_case_on(d, "log", ATOL, RTOL, |x| x[0].log()));

per_device!(sqrt, |d| check_case_on(d, "sqrt", ATOL, RTOL, |x| x[0]
    .sqrt()));

per_device!(tanh, |d| check_case_on(d, "tanh", ATOL, RTOL, |x| x[0]
    .tanh()));

per_device!(sigmoid, |d| check_case_on(d, "sigmoid", ATOL, RTOL, |x| x
    [0]
.sigmoid()));

per_device!(relu, |d| check_case_on(d, "relu", ATOL, RTOL, |x| x[0]
    .relu()));

per_device!(gelu_tanh, |d| check_case_on(
    d,
    "gelu_tanh",
    ATOL,
    RTOL,
    |x| x[0].gelu(GeluApprox::Tanh)
));

per_device!(gelu_erf, |d| check_case_on(
    d,
    "gelu_erf",
    ATOL,
    RTOL,
    |x| x[0].gelu(GeluApprox::None)
));

// ---- matmul -------------------------------------------------------------------------------

per_device!(matmul_2d, |d| check_case_on(
    d,
    "matmul_2d",
    ATOL,
    RTOL,
    |x| x[0].matmul(&x[1])
));

per_device!(matmul_batched, |d| check_case_on(
    d,
    "matmul_batched",
    ATOL,
    RTOL,
    |x| x[0].matmul(&x[1])
)); // (2, 3, 4) @ (2, 4, 5)

per_device!(matmul_bcast, |d| check_case_on(
    d,
    "matmul_bcast",
    ATOL,
    RTOL,
    |x| x[0].matmul(&x[1])
)); // (2, 3, 4) @ (4, 5)

per_device!(matmul_transposed, |d| check_case_on(
    d,
    "matmul_transposed",
    ATOL,
    RTOL,
    |x| x[0].matmul(&x[1].t()?)
)); // (3, 4) @ (5, 4)ᵀ, a view

per_device!(linear, |d| check_case_on(d, "linear", ATOL, RTOL, |x| x[0]
    .linear(&x[1], Some(&x[2]))));

// ---- reductions ---------------------------------------------------------------------------

per_device!(sum_all, |d| check_case_on(d, "sum_all", ATOL, RTOL, |x| x
    [0]
.sum_all()));

per_device!(sum_dim, |d| check_case_on(d, "sum_dim", ATOL, RTOL, |x| x
    [0]
.sum(&[1], false)));

per_device!(sum_dim_keep, |d| check_case_on(
    d,
    "sum_dim_keep",
    ATOL,
    RTOL,
    |x| x[0].sum(&[2], true)
));

per_device!(mean_dim, |d| check_case_on(
    d,
    "mean_dim",
    ATOL,
    RTOL,
    |x| x[0].mean(&[0], false)
));

per_device!(mean_all, |d| check_case_on(
    d,
    "mean_all",
    ATOL,
    RTOL,
    |x| x[0].mean_all()
));

per_device!(max_dim, |d| check_case_on(
    d,
    "max_dim",
    ATOL,
    RTOL,
    |x| Ok(x[0].max_dim(1, false)?.0)
));

per_device!(mse_loss, |d| check_case_on(
    d,
    "mse_loss",
    ATOL,
    RTOL,
    |x| x[0].mse_loss(&x[1])
));

// ---- movement -----------------------------------------------------------------------------

per_device!(transpose_contig, |d| check_case_on(
    d,
    "transpose_contig",
    ATOL,
    RTOL,
    |x| x[0].transpose(0, 2)?.contiguous()
));

per_device!(permute, |d| check_case_on(d, "permute", ATOL, RTOL, |x| x
    [0]
.permute(&[1, 2, 0])));

per_device!(narrow, |d| check_case_on(d, "narrow", ATOL, RTOL, |x| x[0]
    .narrow(1, 2, 3)));

per_device!(expand, |d| check_case_on(d, "expand", ATOL, RTOL, |x| x[0]
    .expand(&[3, 4])));

per_device!(reshape, |d| check_case_on(d, "reshape", ATOL, RTOL, |x| x
    [0]
.reshape(&[3, 4])));

// ---- composite ----------------------------------------------------------------------------

per_device!(sigmoid_chain, |d| check_case_on(
    d,
    "sigmoid_chain",
    ATOL,
    RTOL,
    |x| { x[0].sigmoid()?.mul(&x[1])?.tanh()?.sum(&[0], false) }
));

// ---- edge cases PyTorch defines (values by hand) ----------------------------------------

fn vec_f32(v: &[f32], shape: &[usize]) -> ferrograd::Tensor {
    ferrograd::Tensor::from_vec(v.to_vec(), shape, ferrograd::Device::Cpu).unwrap()
}

#[test]
fn dot_product_of_vectors() {
    let a = vec_f32(&[1.0, 2.0, 3.0], &[3]);
    let out = a.matmul(&vec_f32(&[4.0, 5.0, 6.0], &[3])).unwrap();
    assert_eq!(out.shape(), &[] as &[usize]);
    assert_eq!(out.item().unwrap(), 32.0);
}

#[test]
fn zero_dim_tensors() {
    let s = vec_f32(&[2.5], &[]);
    let same = |t: ferrograd::Result<ferrograd::Tensor>| {
        let t = t.unwrap();
        assert_eq!((t.shape().len(), t.item().unwrap()), (0, 2.5));
    };
    same(s.sum(&[0], false));
    same(s.sum(&[-1], true));
    same(s.mean(&[0], false));
    same(s.transpose(0, -1));
    same(s.squeeze(0));
    let (v, i) = s.max_dim(-1, true).unwrap();
    same(Ok(v));
    assert_eq!((i.shape().len(), i.to_vec::<i64>().unwrap()), (0, vec![0]));
    assert!(s.sum(&[1], false).is_err());
}

#[test]
fn sum_of_nothing_is_positive_zero() {
    let empty =
        ferrograd::Tensor::zeros(&[0, 3], ferrograd::DType::F32, ferrograd::Device::Cpu).unwrap();
    let s = empty.sum(&[0], false).unwrap().to_vec::<f32>().unwrap();
    assert!(s.iter().all(|v| v.to_bits() == 0), "{s:?}");
}

// ---- the fixture file itself --------------------------------------------------------------

/// A file from another generator or version is refused with the regeneration hint.
#[test]
fn stale_fixture_header_is_refused() {
    let file = |format: &str, version: &str| {
        let meta =
            [("format", format), ("version", version)].map(|(k, v)| (k.to_string(), v.to_string()));
        let data = [0u8; 4];
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], &data).unwrap();
        safetensors::serialize([("x.in0", view)], Some(meta.into_iter().collect())).unwrap()
    };
    common::check_header(&file("ferrograd-fixtures", "1"));
    for (format, version) in [("ferrograd-fixtures", "0"), ("something-else", "1")] {
        let err =
            std::panic::catch_unwind(|| common::check_header(&file(format, version))).unwrap_err();
        let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(
            msg.contains("regenerate with tools/make_fixtures.py"),
            "{msg}"
        );
    }
}

#[test]
fn reducing_an_empty_dim_gives_the_identity() {
    let t =
        ferrograd::Tensor::zeros(&[3, 0], ferrograd::DType::F32, ferrograd::Device::Cpu).unwrap();
    assert_eq!(
        t.sum(&[1], false).unwrap().to_vec::<f32>().unwrap(),
        vec![0.0; 3]
    );
}
