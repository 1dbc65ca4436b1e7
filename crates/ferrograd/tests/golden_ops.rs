//! Golden tests of the core ops against PyTorch: each case runs the op on the fixture's
//! inputs, compares the output, backprops `(out * gout).sum()` and compares every input
//! gradient (fixtures from tools/make_fixtures.py; helpers in common/).

mod common;

use common::check_case;
use ferrograd::ops::GeluApprox;

// ---- elementwise, with broadcasting ------------------------------------------------------

#[test]
fn add_bcast() {
    check_case("add_bcast", |x| x[0].add(&x[1])); // (2, 3, 4) + (4)
}

#[test]
fn add_bcast2() {
    check_case("add_bcast2", |x| x[0].add(&x[1])); // (2, 1, 4) + (3, 1)
}

#[test]
fn sub_bcast() {
    check_case("sub_bcast", |x| x[0].sub(&x[1]));
}

#[test]
fn mul_bcast() {
    check_case("mul_bcast", |x| x[0].mul(&x[1])); // (2, 3, 4) * (3, 1)
}

#[test]
fn div_bcast() {
    check_case("div_bcast", |x| x[0].div(&x[1]));
}

#[test]
fn neg() {
    check_case("neg", |x| x[0].neg());
}

#[test]
fn add_scalar() {
    check_case("add_scalar", |x| x[0].add_scalar(2.5));
}

#[test]
fn mul_scalar() {
    check_case("mul_scalar", |x| x[0].mul_scalar(-1.5));
}

#[test]
fn pow_scalar() {
    check_case("pow_scalar", |x| x[0].pow_scalar(3.0));
}

#[test]
fn pow_tensor() {
    check_case("pow_tensor", |x| x[0].pow(&x[1]));
}

#[test]
fn exp() {
    check_case("exp", |x| x[0].exp());
}

#[test]
fn log() {
    check_case("log", |x| x[0].log());
}

#[test]
fn sqrt() {
    check_case("sqrt", |x| x[0].sqrt());
}

#[test]
fn tanh() {
    check_case("tanh", |x| x[0].tanh());
}

#[test]
fn sigmoid() {
    check_case("sigmoid", |x| x[0].sigmoid());
}

#[test]
fn relu() {
    check_case("relu", |x| x[0].relu());
}

#[test]
fn gelu_tanh() {
    check_case("gelu_tanh", |x| x[0].gelu(GeluApprox::Tanh));
}

#[test]
fn gelu_erf() {
    check_case("gelu_erf", |x| x[0].gelu(GeluApprox::None));
}

// ---- matmul -------------------------------------------------------------------------------

#[test]
fn matmul_2d() {
    check_case("matmul_2d", |x| x[0].matmul(&x[1]));
}

#[test]
fn matmul_batched() {
    check_case("matmul_batched", |x| x[0].matmul(&x[1])); // (2, 3, 4) @ (2, 4, 5)
}

#[test]
fn matmul_bcast() {
    check_case("matmul_bcast", |x| x[0].matmul(&x[1])); // (2, 3, 4) @ (4, 5)
}

#[test]
fn matmul_transposed() {
    check_case("matmul_transposed", |x| x[0].matmul(&x[1].t()?)); // (3, 4) @ (5, 4)ᵀ, a view
}

#[test]
fn linear() {
    check_case("linear", |x| x[0].linear(&x[1], Some(&x[2])));
}

// ---- reductions ---------------------------------------------------------------------------

#[test]
fn sum_all() {
    check_case("sum_all", |x| x[0].sum_all());
}

#[test]
fn sum_dim() {
    check_case("sum_dim", |x| x[0].sum(&[1], false));
}

#[test]
fn sum_dim_keep() {
    check_case("sum_dim_keep", |x| x[0].sum(&[2], true));
}

#[test]
fn mean_dim() {
    check_case("mean_dim", |x| x[0].mean(&[0], false));
}

#[test]
fn mean_all() {
    check_case("mean_all", |x| x[0].mean_all());
}

#[test]
fn max_dim() {
    check_case("max_dim", |x| Ok(x[0].max_dim(1, false)?.0));
}

#[test]
fn mse_loss() {
    check_case("mse_loss", |x| x[0].mse_loss(&x[1]));
}

// ---- movement -----------------------------------------------------------------------------

#[test]
fn transpose_contig() {
    check_case("transpose_contig", |x| x[0].transpose(0, 2)?.contiguous());
}

#[test]
fn permute() {
    check_case("permute", |x| x[0].permute(&[1, 2, 0]));
}

#[test]
fn narrow() {
    check_case("narrow", |x| x[0].narrow(1, 2, 3));
}

#[test]
fn expand() {
    check_case("expand", |x| x[0].expand(&[3, 4]));
}

#[test]
fn reshape() {
    check_case("reshape", |x| x[0].reshape(&[3, 4]));
}

// ---- composite ----------------------------------------------------------------------------

#[test]
fn sigmoid_chain() {
    check_case("sigmoid_chain", |x| {
        x[0].sigmoid()?.mul(&x[1])?.tanh()?.sum(&[0], false)
    });
}

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
