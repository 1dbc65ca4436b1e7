//! The op families' entry functions validate once for every device: operands that one
//! device refuses, every device refuses with the same typed error (checked on the CPU and on
//! the shape-only meta device, whose kernels do nothing), and in-place entry points bump the
//! version of what they write. The one dtype mix of the GEMMs: half operands into f32.

use ferrograd::backend::matmul::{matmul, matmul_acc, matmul_bias, matmul_row_sums};
use ferrograd::backend::reduce::reduce;
use ferrograd::backend::rows::{LayerNorm, layer_norm};
use ferrograd::backend::{MatmulSpec, ReduceOp, View};
use ferrograd::{DType, Device, Error, Tensor};

const DEVICES: [Device; 2] = [Device::Cpu, Device::Meta];

fn view(t: &Tensor) -> View<'_> {
    View {
        storage: t.storage(),
        layout: t.layout(),
    }
}

fn zeros(shape: &[usize], dtype: DType, device: Device) -> Tensor {
    Tensor::zeros(shape, dtype, device).unwrap()
}

#[test]
fn reduce_refuses_bad_dims_and_outputs_on_every_device() {
    for dev in DEVICES {
        let x = zeros(&[2, 3, 4], DType::F32, dev);
        let out = zeros(&[2, 1, 1], DType::F32, dev);
        let unsorted = reduce(ReduceOp::Sum, view(&x), &[2, 1], out.storage());
        assert!(
            matches!(unsorted, Err(Error::InvalidArgument { .. })),
            "{dev}: {unsorted:?}"
        );
        let beyond = reduce(ReduceOp::Sum, view(&x), &[3], out.storage());
        assert!(
            matches!(beyond, Err(Error::InvalidArgument { .. })),
            "{dev}"
        );
        let two = reduce(ReduceOp::ArgMax, view(&x), &[1, 2], out.storage());
        assert!(matches!(two, Err(Error::InvalidArgument { .. })), "{dev}");
        let float_indices = reduce(ReduceOp::ArgMax, view(&x), &[2], out.storage());
        assert!(
            matches!(float_indices, Err(Error::DType { .. })),
            "{dev}: argmax writes i64"
        );
        let short = zeros(&[3], DType::F32, dev);
        let wrong_len = reduce(ReduceOp::Sum, view(&x), &[1, 2], short.storage());
        assert!(matches!(wrong_len, Err(Error::Shape { .. })), "{dev}");
        reduce(ReduceOp::Sum, view(&x), &[1, 2], out.storage()).unwrap();
    }
}

#[test]
fn matmul_refuses_mismatched_operands_on_every_device() {
    let spec = MatmulSpec {
        batch: 1,
        m: 2,
        n: 4,
        k: 3,
    };
    for dev in DEVICES {
        let a = zeros(&[2, 3], DType::F32, dev);
        let b = zeros(&[3, 4], DType::F32, dev);
        let out = zeros(&[2, 4], DType::F32, dev);
        let b64 = zeros(&[3, 4], DType::F64, dev);
        let dtype = matmul(&spec, view(&a), view(&b64), out.storage());
        assert!(
            matches!(dtype, Err(Error::DType { .. })),
            "{dev}: {dtype:?}"
        );
        let wrong_k = zeros(&[4, 4], DType::F32, dev);
        let shape = matmul(&spec, view(&a), view(&wrong_k), out.storage());
        assert!(
            matches!(shape, Err(Error::Shape { .. })),
            "{dev}: {shape:?}"
        );
        let v = out.storage().version();
        matmul_acc(&spec, view(&a), view(&b), out.storage(), 1.0).unwrap();
        assert_eq!(out.storage().version(), v + 1, "{dev}: matmul_acc bumps");
    }
}

/// f16 and bf16 operands may write an f32 output in the plain, accumulating and row-sum
/// entries (the f32 sums, equal on the CPU to the f32 product of the widened operands bit
/// for bit); no other mix, and not in the epilogue entries.
#[test]
fn half_operands_write_f32_outputs_only_in_the_plain_entries_on_every_device() {
    let spec = MatmulSpec {
        batch: 1,
        m: 3,
        n: 5,
        k: 7,
    };
    for dev in DEVICES {
        for half in [DType::BF16, DType::F16] {
            let draw = |shape: &[usize], seed| {
                let mut g = ferrograd::Generator::new(seed);
                Tensor::randn_with(shape, half, Device::Cpu, &mut g)
                    .unwrap()
                    .to_device(dev)
                    .unwrap()
            };
            let (a, b) = (draw(&[3, 7], 1), draw(&[7, 5], 2));
            let out = zeros(&[3, 5], DType::F32, dev);
            matmul(&spec, view(&a), view(&b), out.storage()).unwrap();
            let v = out.storage().version();
            matmul_acc(&spec, view(&a), view(&b), out.storage(), 1.0).unwrap();
            assert_eq!(out.storage().version(), v + 1, "{dev}: matmul_acc bumps");
            let sums = zeros(&[3], DType::F32, dev);
            matmul_row_sums(&spec, view(&a), view(&b), out.storage(), sums.storage()).unwrap();
            if dev == Device::Cpu {
                // out = 2·(a @ b) after the accumulation (the row sums do not fuse here).
                let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
                let want = f(&a).matmul(&f(&b)).unwrap().mul_scalar(2.0).unwrap();
                assert_eq!(
                    out.to_vec::<f32>().unwrap(),
                    want.to_vec::<f32>().unwrap(),
                    "{half}"
                );
            }
            let other = if half == DType::BF16 {
                DType::F16
            } else {
                DType::BF16
            };
            for wrong in [other, DType::F64] {
                let out = zeros(&[3, 5], wrong, dev);
                let r = matmul(&spec, view(&a), view(&b), out.storage());
                assert!(
                    matches!(r, Err(Error::DType { .. })),
                    "{dev}: {half} -> {wrong}"
                );
            }
            let bias = zeros(&[5], DType::F32, dev);
            let r = matmul_bias(&spec, view(&a), view(&b), view(&bias), out.storage());
            assert!(matches!(r, Err(Error::DType { .. })), "{dev}: {r:?}");
        }
        // f32 operands never write f64.
        let (a, b) = (
            zeros(&[3, 7], DType::F32, dev),
            zeros(&[7, 5], DType::F32, dev),
        );
        let out = zeros(&[3, 5], DType::F64, dev);
        let r = matmul(&spec, view(&a), view(&b), out.storage());
        assert!(matches!(r, Err(Error::DType { .. })), "{dev}: {r:?}");
    }
}

/// Layer norm of rows x into y without weight or bias; `stat` takes both row statistics.
fn plain_layer_norm(x: &Tensor, y: &Tensor, stat: &Tensor) -> ferrograd::Result<()> {
    layer_norm(&LayerNorm {
        x: view(x),
        residual: None,
        weight: None,
        bias: None,
        y: y.storage(),
        mean: stat.storage(),
        rstd: stat.storage(),
        eps: 1e-5,
    })
}

#[test]
fn layer_norm_refuses_integer_rows_on_every_device() {
    for dev in DEVICES {
        let x = zeros(&[2, 3], DType::I64, dev);
        let y = zeros(&[2, 3], DType::I64, dev);
        let stat = zeros(&[2], DType::F32, dev);
        let r = plain_layer_norm(&x, &y, &stat);
        assert!(
            matches!(r, Err(Error::UnsupportedDType { .. })),
            "{dev}: {r:?}"
        );
    }
}

#[test]
fn a_device_mismatch_is_refused_before_any_kernel() {
    let spec = MatmulSpec {
        batch: 1,
        m: 1,
        n: 1,
        k: 1,
    };
    let a = zeros(&[1, 1], DType::F32, Device::Cpu);
    let b = zeros(&[1, 1], DType::F32, Device::Meta);
    let out = zeros(&[1, 1], DType::F32, Device::Cpu);
    let r = matmul(&spec, view(&a), view(&b), out.storage());
    assert!(matches!(r, Err(Error::DeviceMismatch { .. })), "{r:?}");
}

#[test]
fn elementwise_refuses_mismatched_operands_on_every_device() {
    use ferrograd::backend::elementwise::{binary, binary_inplace, copy, fill, unary};
    use ferrograd::backend::{BinaryOp, UnaryOp};
    for dev in DEVICES {
        let a = zeros(&[2, 3], DType::F32, dev);
        let b = zeros(&[3, 2], DType::F32, dev);
        let c = zeros(&[2, 3], DType::F64, dev);
        let out = zeros(&[2, 3], DType::F32, dev);
        let shape = binary(BinaryOp::Add, view(&a), view(&b), out.storage());
        assert!(
            matches!(shape, Err(Error::Shape { .. })),
            "{dev}: {shape:?}"
        );
        let dtype = binary(BinaryOp::Add, view(&a), view(&c), out.storage());
        assert!(
            matches!(dtype, Err(Error::DType { .. })),
            "{dev}: {dtype:?}"
        );
        let unary_dtype = unary(UnaryOp::Exp, view(&c), out.storage());
        assert!(matches!(unary_dtype, Err(Error::DType { .. })), "{dev}");
        let small = zeros(&[4], DType::F32, dev);
        let count = copy(view(&a), view(&small));
        assert!(
            matches!(count, Err(Error::Shape { .. })),
            "{dev}: {count:?}"
        );
        let cover = binary_inplace(BinaryOp::Add, small.storage(), view(&a));
        assert!(matches!(cover, Err(Error::Shape { .. })), "{dev}");

        // In-place writes bump the version autograd checks saved tensors against.
        let v = out.storage().version();
        binary_inplace(BinaryOp::Add, out.storage(), view(&a)).unwrap();
        fill(out.storage(), 1.0).unwrap();
        copy(view(&a), view(&out)).unwrap();
        assert_eq!(out.storage().version(), v + 3, "{dev}");
    }
}

/// One operand (or a layer norm's output and its gradient) may be f16/bf16 beside f32, read
/// or written in the same kernel; any other mix is refused on every device.
#[test]
fn half_beside_f32_is_the_only_mix_allowed_on_every_device() {
    use ferrograd::backend::BinaryOp;
    use ferrograd::backend::elementwise::binary;
    use ferrograd::backend::rows::{LayerNormBackward, layer_norm_backward};
    for dev in DEVICES {
        let f32s = zeros(&[2, 3], DType::F32, dev);
        let (bf16, f16) = (
            zeros(&[2, 3], DType::BF16, dev),
            zeros(&[2, 3], DType::F16, dev),
        );
        let out = zeros(&[2, 3], DType::F32, dev);
        for (a, b) in [(&f32s, &bf16), (&f16, &f32s)] {
            let ok = binary(BinaryOp::Add, view(a), view(b), out.storage());
            assert!(ok.is_ok(), "{dev}: {ok:?}");
        }
        // Both operands half (f16 + bf16), or an f32 operand of a half output.
        let both = binary(BinaryOp::Add, view(&f16), view(&bf16), out.storage());
        assert!(matches!(both, Err(Error::DType { .. })), "{dev}: {both:?}");
        let wide = binary(BinaryOp::Add, view(&bf16), view(&f32s), bf16.storage());
        assert!(matches!(wide, Err(Error::DType { .. })), "{dev}: {wide:?}");

        let stat = zeros(&[2], DType::F32, dev);
        let norm = |x: &Tensor, y: &Tensor| plain_layer_norm(x, y, &stat);
        assert!(norm(&f32s, &bf16).is_ok(), "{dev}: f32 rows, bf16 output");
        let up = norm(&bf16, &f32s);
        assert!(
            matches!(up, Err(Error::InvalidArgument { .. })),
            "{dev}: {up:?}"
        );
        // gx_half, when given, is gx's half copy: it has gy's half dtype, beside f32 rows only.
        let with_half = |x: &Tensor, gy: &Tensor, gx: &Tensor, half: Option<&Tensor>| {
            layer_norm_backward(&LayerNormBackward {
                x: view(x),
                weight: None,
                mean: view(&stat),
                rstd: view(&stat),
                gy: view(gy),
                prior: None,
                gx: gx.storage(),
                gweight: None,
                gbias: None,
                gx_half: half.map(|h| &**h.storage()),
                gx_half_sums: None,
            })
        };
        let backward = |x: &Tensor, gy: &Tensor, gx: &Tensor| with_half(x, gy, gx, None);
        assert!(
            backward(&f32s, &f16, &out).is_ok(),
            "{dev}: f16 gy, f32 rows"
        );
        assert!(
            with_half(&f32s, &f16, &out, Some(&f16)).is_ok(),
            "{dev}: f16 copy"
        );
        let wrong = with_half(&f32s, &f16, &out, Some(&bf16));
        assert!(
            matches!(wrong, Err(Error::InvalidArgument { .. })),
            "{dev}: a bf16 copy of an f16 gradient: {wrong:?}"
        );
        let half_gx = backward(&f32s, &f16, &f16);
        assert!(half_gx.is_err(), "{dev}: gx must have x's dtype");
        let half_rows = backward(&f16, &f32s, &f16);
        assert!(half_rows.is_err(), "{dev}: an f32 gy of half rows");
    }
}
