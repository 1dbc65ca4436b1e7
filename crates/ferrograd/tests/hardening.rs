//! The library as a hostile user meets it: sizes that cannot fit, indices that overflow,
//! inputs PyTorch refuses, edge values where PyTorch's answer is the contract (empty means,
//! NaN in max, f16 accumulation), zero-size tensors, and the bytes kernels take beyond what
//! the allocator counts. Each case is one line against the behaviour it checks.

use ferrograd::{DType, Device, Error, Tensor};
use half::f16;

const CPU: Device = Device::Cpu;
const HUGE: usize = 1_000_000_000_000_000; // 1e15 elements

fn f32s(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, CPU).unwrap()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_vec::<f64>().unwrap()
}

fn is_oom<T>(r: ferrograd::Result<T>) -> bool {
    matches!(r, Err(e) if e.is_out_of_memory())
}

fn is_shape<T>(r: ferrograd::Result<T>) -> bool {
    matches!(r, Err(Error::Shape { .. }))
}

fn is_invalid<T>(r: ferrograd::Result<T>) -> bool {
    matches!(r, Err(Error::InvalidArgument { .. }))
}

// ---- sizes that cannot fit: typed errors, never an abort ----------------------------------------

#[test]
fn random_and_range_tensors_too_large_are_out_of_memory_errors() {
    assert!(is_oom(Tensor::zeros(&[HUGE], DType::F32, CPU)));
    assert!(is_oom(Tensor::rand(&[HUGE], DType::F32, CPU)));
    assert!(is_oom(Tensor::randn(&[HUGE], DType::F32, CPU)));
    assert!(is_oom(Tensor::randn(&[HUGE], DType::F16, CPU)));
    assert!(is_oom(Tensor::arange(0.0, 1e15, 1.0, DType::F32, CPU)));
    // More elements than an address can index: a shape error, not a wrapped product.
    assert!(is_shape(Tensor::rand(&[1 << 40, 1 << 40], DType::F32, CPU)));
    assert!(is_shape(Tensor::zeros(&[usize::MAX, 2], DType::U8, CPU)));
}

#[test]
fn reductions_of_huge_expanded_views_need_no_memory() {
    let x = f32s(&[0.5], &[1]);
    let big = x.expand(&[HUGE]).unwrap();
    // A broadcast repeats one element: its sum is a count times it, with no scratch at all.
    assert_eq!(values(&big.sum_all().unwrap()), [5e14f32 as f64]);
    assert_eq!(values(&big.max_dim(0, false).unwrap().0), [0.5]);
    // Anything that needs the elements themselves is an out-of-memory error.
    assert!(is_oom(big.exp()));
    assert!(is_oom(big.contiguous()));
    assert!(big.to_vec::<f32>().is_err());
    // A broadcast whose element count overflows is refused when it is made.
    assert!(is_shape(x.expand(&[usize::MAX, 2])));
}

// ---- indices and sizes that overflow: errors, never a panic ---------------------------------------

#[test]
fn ranges_that_never_end_are_refused() {
    let arange = |s, e, st| Tensor::arange(s, e, st, DType::F32, CPU);
    assert!(is_invalid(arange(0.0, f64::INFINITY, 1.0)));
    assert!(is_invalid(arange(f64::NEG_INFINITY, 0.0, 1.0)));
    assert!(is_invalid(arange(0.0, f64::NAN, 1.0)));
    assert!(is_invalid(arange(0.0, 1.0, f64::NAN)));
    assert!(is_invalid(arange(0.0, 1.0, f64::INFINITY)));
    assert!(is_invalid(arange(0.0, 1.0, 0.0)));
    assert!(is_invalid(arange(0.0, 1.0, -1.0)));
    assert!(is_shape(arange(0.0, 1.0, 1e-300)));
    assert_eq!(
        values(&arange(0.0, 1.0, 0.25).unwrap()),
        [0.0, 0.25, 0.5, 0.75]
    );
    assert_eq!(values(&arange(3.0, 0.0, -1.5).unwrap()), [3.0, 1.5]);
    let ints = Tensor::arange(0.0, 2.0, 0.5, DType::I64, CPU).unwrap();
    assert_eq!(ints.to_vec::<i64>().unwrap(), [0, 0, 1, 1]);
}

#[test]
fn narrow_checks_its_range_without_overflow() {
    let x = Tensor::zeros(&[2, 3], DType::F32, CPU).unwrap();
    assert!(matches!(
        x.narrow(1, usize::MAX, 2),
        Err(Error::Index { .. })
    ));
    assert!(matches!(
        x.narrow(1, 2, usize::MAX),
        Err(Error::Index { .. })
    ));
    assert!(matches!(x.narrow(1, 3, 1), Err(Error::Index { .. })));
    assert_eq!(x.narrow(1, 3, 0).unwrap().shape(), [2, 0]);
    assert_eq!(x.narrow(1, 1, 2).unwrap().shape(), [2, 2]);
}

#[test]
fn split_and_chunk_sizes_cannot_overflow() {
    let x = Tensor::zeros(&[4], DType::F32, CPU).unwrap();
    assert!(is_shape(x.split(&[usize::MAX, 5], 0)));
    let empty = Tensor::zeros(&[0], DType::F32, CPU).unwrap();
    assert_eq!(empty.chunk(3, 0).unwrap().len(), 3); // as torch.chunk
    assert!(is_invalid(empty.chunk(usize::MAX, 0)));
}

// ---- inputs PyTorch refuses ----------------------------------------------------------------------

#[test]
fn bad_shapes_and_dims_are_refused() {
    let x = Tensor::zeros(&[2, 3], DType::F32, CPU).unwrap();
    assert!(is_shape(x.reshape_infer(&[-2, 3])));
    assert!(is_shape(x.reshape_infer(&[-1, -1])));
    assert!(is_shape(x.reshape_infer(&[-1, 4])));
    assert!(is_shape(x.reshape_infer(&[-1, 0])));
    assert_eq!(x.reshape_infer(&[-1, 2]).unwrap().shape(), [3, 2]);
    assert!(is_shape(x.reshape(&[usize::MAX, 2])));
    assert!(is_shape(x.sum(&[0, -2], false)));
    assert!(is_shape(x.mean(&[1, 1], false)));
    assert_eq!(values(&x.sum(&[0, -1], false).unwrap()), [0.0]);
}

// ---- PyTorch's values -----------------------------------------------------------------------------

#[test]
fn means_of_nothing_are_nan() {
    let empty = Tensor::zeros(&[0], DType::F32, CPU).unwrap();
    assert!(values(&empty.mean_all().unwrap())[0].is_nan());
    assert!(values(&empty.mse_loss(&empty).unwrap())[0].is_nan());
    let rows = Tensor::zeros(&[2, 0], DType::F32, CPU).unwrap();
    let m = values(&rows.mean(&[1], false).unwrap());
    assert!(m.len() == 2 && m.iter().all(|v| v.is_nan()), "{m:?}");
    assert_eq!(values(&empty.sum_all().unwrap()), [0.0]);
}

#[test]
fn max_propagates_nan_and_argmax_points_at_the_first() {
    let x = f32s(&[1.0, f32::NAN, 3.0, f32::NAN], &[4]);
    let (v, i) = x.max_dim(0, false).unwrap();
    assert!(values(&v)[0].is_nan());
    assert_eq!(i.to_vec::<i64>().unwrap(), [1]);
    let rows = f32s(&[1.0, 5.0, f32::NAN, 2.0, 7.0, 3.0], &[2, 3]);
    let (v, i) = rows.max_dim(1, false).unwrap();
    let v = values(&v);
    assert!(v[0].is_nan() && v[1] == 7.0, "{v:?}");
    assert_eq!(i.to_vec::<i64>().unwrap(), [2, 1]);
    let (v, i) = rows.min_dim(1, true).unwrap();
    let v = values(&v);
    assert!(v[0].is_nan() && v[1] == 2.0, "{v:?}");
    assert_eq!(i.to_vec::<i64>().unwrap(), [2, 0]);
    let empty = Tensor::zeros(&[2, 0], DType::F32, CPU).unwrap();
    assert!(is_shape(empty.min_dim(1, false)));
}

#[test]
fn min_dim_backward_routes_the_gradient_to_the_first_minimum() {
    let x = f32s(&[3.0, 1.0, 1.0, 2.0], &[2, 2])
        .requires_grad_(true)
        .unwrap();
    let (v, _) = x.min_dim(1, false).unwrap();
    assert_eq!(values(&v), [1.0, 1.0]);
    v.sum_all().unwrap().backward().unwrap();
    assert_eq!(values(&x.grad().unwrap()), [0.0, 1.0, 1.0, 0.0]);
}

#[test]
fn half_precision_means_and_sums_accumulate_in_f32() {
    for dtype in [DType::F16, DType::BF16] {
        let x = Tensor::full(&[1000], 100.0, dtype, CPU).unwrap();
        let mean = x.mean_all().unwrap();
        assert_eq!(mean.dtype(), dtype);
        assert_eq!(values(&mean), [100.0], "{dtype}");
        let rows = Tensor::full(&[2, 1000], 100.0, dtype, CPU).unwrap();
        assert_eq!(values(&rows.mean(&[1], true).unwrap()), [100.0, 100.0]);
    }
    // 3000 ones: an f16 running sum would stop at 2048; f32 accumulation reaches 3000.
    let ones = Tensor::ones(&[3000], DType::F16, CPU).unwrap();
    assert_eq!(values(&ones.sum_all().unwrap()), [3000.0]);
    // Over f16's range the sum itself is inf, as in PyTorch.
    let x = Tensor::full(&[1000], 100.0, DType::F16, CPU).unwrap();
    assert_eq!(values(&x.sum_all().unwrap()), [f64::INFINITY]);
}

#[test]
fn half_precision_mean_backward_is_the_spread_gradient() {
    let x = Tensor::full(&[4, 2], 1.0, DType::F16, CPU)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    x.mean_all().unwrap().backward().unwrap();
    let g = x.grad().unwrap();
    assert_eq!(g.dtype(), DType::F16);
    assert_eq!(values(&g), [0.125; 8]);
}

#[test]
fn small_k_half_matmuls_accumulate_in_f32() {
    let h = |v: &[f32], shape: &[usize]| {
        Tensor::from_vec(v.iter().map(|&x| f16::from_f32(x)).collect(), shape, CPU).unwrap()
    };
    let a = h(&[300.0, -300.0], &[1, 2]);
    let b = h(&[300.0, 300.0], &[2, 1]);
    assert_eq!(values(&a.matmul(&b).unwrap()), [0.0]);
    // k = 1 and k = 2 over a batch and a transposed operand.
    let a = h(&[300.0, -300.0, 2.0, 3.0], &[2, 1, 2]);
    let b = h(&[300.0, 300.0, 1.0, 1.0], &[2, 1, 2])
        .transpose(-1, -2)
        .unwrap();
    assert_eq!(values(&a.matmul(&b).unwrap()), [0.0, 5.0]);
    let a = h(&[2.0, 3.0], &[2, 1]);
    let b = h(&[4.0, 5.0], &[1, 2]);
    assert_eq!(values(&a.matmul(&b).unwrap()), [8.0, 10.0, 12.0, 15.0]);
    // Longer k takes the gemm crate's packed path, which accumulates in f32 too.
    let a = h(&[300.0, -300.0, 1.0], &[1, 3]);
    let b = h(&[300.0, 300.0, 1.0], &[3, 1]);
    assert_eq!(values(&a.matmul(&b).unwrap()), [1.0]);
    let a = h(&[300.0, -300.0, 1.0, 300.0, -300.0, 1.0], &[2, 3]);
    let b = h(&[300.0, 300.0, 300.0, 300.0, 1.0, 1.0], &[3, 2]);
    assert_eq!(values(&a.matmul(&b).unwrap()), [1.0; 4]);
}

// ---- zero-size tensors -------------------------------------------------------------------------------

#[test]
fn zero_size_tensors_are_contiguous_and_every_row_op_takes_them() {
    let x = Tensor::zeros(&[4, 0], DType::F32, CPU).unwrap();
    assert!(x.is_contiguous());
    assert_eq!(x.softmax(-1).unwrap().shape(), [4, 0]);
    assert_eq!(x.log_softmax(-1).unwrap().shape(), [4, 0]);
    assert_eq!(x.softmax(0).unwrap().shape(), [4, 0]);
    assert_eq!(
        x.layer_norm(&[0], None, None, 1e-5).unwrap().shape(),
        [4, 0]
    );
    let rows = Tensor::zeros(&[0, 5], DType::F32, CPU).unwrap();
    assert_eq!(rows.softmax(-1).unwrap().shape(), [0, 5]);
    let w = Tensor::ones(&[5], DType::F32, CPU).unwrap();
    let ln = rows.layer_norm(&[5], Some(&w), Some(&w), 1e-5).unwrap();
    assert_eq!(ln.shape(), [0, 5]);
    // Cross-entropy over no rows is the mean of nothing: NaN, as in PyTorch.
    let none = Tensor::from_vec(Vec::<i64>::new(), &[0], CPU).unwrap();
    assert!(values(&rows.cross_entropy(&none, -100).unwrap())[0].is_nan());
    // Views of zero-size tensors stay usable.
    let t = Tensor::zeros(&[3, 0, 2], DType::F32, CPU).unwrap();
    assert!(t.transpose(0, 2).unwrap().is_contiguous());
    assert_eq!(t.reshape(&[0, 6]).unwrap().shape(), [0, 6]);
}
