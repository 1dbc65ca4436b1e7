//! CUDA elementwise, copy, fill and reduction kernels against the CPU reference: every op
//! through the public tensor API on cuda:0 and on the CPU, compared element by element
//! (f32 to ~1e-5, f64 to ~1e-12, f16/bf16 to ~1e-2), including broadcasting, strided views,
//! in-place updates that read their own storage, every dtype conversion, reductions of
//! each kernel shape and autograd through small chains. Needs a CUDA device: without one
//! every test fails.
#![cfg(feature = "gpu-tests")]

use ferrograd::ops::GeluApprox;
use ferrograd::{DType, Device, Generator, Result, Tensor};

const GPU: Device = Device::Cuda(0);
const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
const ALL: [DType; 6] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::U8,
];

/// The same values on cuda:0, as a fresh leaf (no history back to the CPU tensor).
fn gpu(t: &Tensor) -> Tensor {
    t.to_device(GPU)
        .unwrap_or_else(|e| panic!("these tests need a CUDA device (cuda:0): {e}"))
        .detach()
}

/// (rtol, atol) for results computed in `dt`.
fn tol(dt: DType) -> (f64, f64) {
    match dt {
        DType::F64 => (1e-12, 1e-12),
        DType::F32 => (1e-5, 1e-6),
        DType::F16 | DType::BF16 => (1e-2, 1e-3),
        DType::I64 | DType::U8 => (0.0, 0.0),
    }
}

/// Asserts a cuda:0 result equals the CPU one within `tol` of its dtype.
fn check(what: &str, got: &Tensor, want: &Tensor) {
    let (rtol, atol) = tol(want.dtype());
    check_tol(what, got, want, rtol, atol);
}

fn check_tol(what: &str, got: &Tensor, want: &Tensor, rtol: f64, atol: f64) {
    assert_eq!(got.device(), GPU, "{what}: result left the GPU");
    assert_eq!(
        want.device(),
        Device::Cpu,
        "{what}: reference not on the CPU"
    );
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let g = got.to_vec::<f64>().unwrap();
    let w = want.to_vec::<f64>().unwrap();
    assert_eq!(g.len(), w.len(), "{what}: element count");
    for (i, (&x, &y)) in g.iter().zip(&w).enumerate() {
        let ok = (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= atol + rtol * y.abs();
        assert!(ok, "{what}: element {i} is {x} on the GPU, {y} on the CPU");
    }
}

fn randn(shape: &[usize], dt: DType, seed: u64) -> Tensor {
    let mut g = Generator::new(seed);
    Tensor::randn_with(shape, dt, Device::Cpu, &mut g).unwrap()
}

fn uniform(shape: &[usize], lo: f64, hi: f64, dt: DType, seed: u64) -> Tensor {
    let mut g = Generator::new(seed);
    Tensor::uniform_with(shape, lo, hi, dt, Device::Cpu, &mut g).unwrap()
}

type Unary = fn(&Tensor) -> Result<Tensor>;
type Binary = fn(&Tensor, &Tensor) -> Result<Tensor>;

/// The CPU reference of `f` on `inputs`. f16/bf16 kernels compute in f32 and round once
/// (as PyTorch does), while the CPU rounds after every step, which is far off where a
/// formula cancels (1 + tanh u near -1 in GELU); so for them the reference is the f32 CPU
/// result rounded to the dtype.
fn reference(inputs: &[&Tensor], f: impl Fn(&[Tensor]) -> Result<Tensor>) -> Tensor {
    let dt = inputs[0].dtype();
    if matches!(dt, DType::F16 | DType::BF16) {
        let wide: Vec<Tensor> = inputs
            .iter()
            .map(|t| t.to_dtype(DType::F32).unwrap())
            .collect();
        f(&wide).unwrap().to_dtype(dt).unwrap()
    } else {
        f(&inputs.iter().map(|&t| t.clone()).collect::<Vec<_>>()).unwrap()
    }
}

/// Runs `f` on the CPU tensor and on its GPU copy and compares.
fn same_unary(what: &str, x: &Tensor, f: Unary) {
    let want = reference(&[x], |t| f(&t[0]));
    let got = f(&gpu(x)).unwrap();
    check(what, &got, &want);
}

fn same_binary(what: &str, a: &Tensor, b: &Tensor, f: Binary) {
    let want = reference(&[a, b], |t| f(&t[0], &t[1]));
    let got = f(&gpu(a), &gpu(b)).unwrap();
    check(what, &got, &want);
}

#[test]
fn unary_ops_match_cpu_in_every_float_dtype() {
    let ops: [(&str, Unary, bool); 14] = [
        ("neg", |x| x.neg(), false),
        ("exp", |x| x.exp(), false),
        ("log", |x| x.log(), true),
        ("sqrt", |x| x.sqrt(), true),
        ("tanh", |x| x.tanh(), false),
        ("sigmoid", |x| x.sigmoid(), false),
        ("relu", |x| x.relu(), false),
        ("gelu", |x| x.gelu(GeluApprox::None), false),
        ("gelu_tanh", |x| x.gelu(GeluApprox::Tanh), false),
        ("add_scalar", |x| x.add_scalar(0.3), false),
        ("sub_scalar", |x| x.sub_scalar(1.25), false),
        ("mul_scalar", |x| x.mul_scalar(-1.7), false),
        ("div_scalar", |x| x.div_scalar(3.0), false),
        ("pow_scalar", |x| x.pow_scalar(2.5), true),
    ];
    for dt in FLOATS {
        let x = randn(&[5, 37], dt, 1);
        let pos = uniform(&[5, 37], 0.1, 4.0, dt, 2);
        for (name, f, positive) in ops {
            let input = if positive { &pos } else { &x };
            same_unary(&format!("{name} {dt}"), input, f);
        }
    }
}

#[test]
fn unary_ops_handle_special_values() {
    let x = Tensor::from_vec(
        vec![
            0.0f32,
            -0.0,
            1e30,
            -1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e-30,
        ],
        &[8],
        Device::Cpu,
    )
    .unwrap();
    let ops: [(&str, Unary); 7] = [
        ("exp", |x| x.exp()),
        ("log", |x| x.log()),
        ("sqrt", |x| x.sqrt()),
        ("tanh", |x| x.tanh()),
        ("sigmoid", |x| x.sigmoid()),
        ("relu", |x| x.relu()),
        ("gelu", |x| x.gelu(GeluApprox::None)),
    ];
    for (name, f) in ops {
        same_unary(&format!("{name} of special values"), &x, f);
    }
}

#[test]
fn binary_ops_match_cpu_in_every_float_dtype() {
    let ops: [(&str, Binary, bool); 5] = [
        ("add", |a, b| a.add(b), false),
        ("sub", |a, b| a.sub(b), false),
        ("mul", |a, b| a.mul(b), false),
        ("div", |a, b| a.div(b), false),
        ("pow", |a, b| a.pow(b), true),
    ];
    for dt in FLOATS {
        let a = randn(&[6, 33], dt, 3);
        let b = randn(&[6, 33], dt, 4);
        let base = uniform(&[6, 33], 0.2, 3.0, dt, 5);
        for (name, f, positive) in ops {
            let lhs = if positive { &base } else { &a };
            same_binary(&format!("{name} {dt}"), lhs, &b, f);
        }
    }
}

#[test]
fn broadcasting_matches_cpu() {
    let a = randn(&[4, 1, 5], DType::F32, 6);
    let b = randn(&[3, 1], DType::F32, 7);
    let row = randn(&[5], DType::F32, 8);
    let s = Tensor::scalar(1.5, DType::F32, Device::Cpu).unwrap();
    same_binary("(4,1,5) + (3,1)", &a, &b, |a, b| a.add(b));
    same_binary("(3,1) - (4,1,5)", &b, &a, |a, b| a.sub(b));
    same_binary("(4,1,5) * (5,)", &a, &row, |a, b| a.mul(b));
    same_binary("(4,1,5) / scalar", &a, &s, |a, b| a.div(b));
    same_binary("scalar / (5,)", &s, &row, |a, b| a.div(b));
    let half = a.to_dtype(DType::BF16).unwrap();
    let halfb = b.to_dtype(DType::BF16).unwrap();
    same_binary("bf16 (4,1,5) * (3,1)", &half, &halfb, |a, b| a.mul(b));
}

#[test]
fn strided_inputs_match_cpu() {
    let m = randn(&[6, 9], DType::F32, 9);
    let n = randn(&[9, 6], DType::F32, 10);
    let cube = randn(&[3, 4, 5], DType::F32, 11);
    // transpose
    same_binary("m^T + n", &m, &n, |m, n| m.t()?.add(n));
    same_unary("tanh(m^T)", &m, |m| m.t()?.tanh());
    same_unary("contiguous(m^T)", &m, |m| m.t()?.contiguous());
    // narrow: a column block and a row block
    same_unary("exp(narrow cols)", &m, |m| m.narrow(1, 2, 4)?.exp());
    same_binary("narrow rows * narrow cols", &m, &n, |m, n| {
        m.narrow(0, 1, 4)?
            .mul(&n.narrow(1, 1, 4)?.t()?.narrow(1, 0, 9)?)
    });
    // expand and permute
    same_unary("expand(row) + 1", &m, |m| {
        m.narrow(0, 2, 1)?.expand(&[5, 9])?.add_scalar(1.0)
    });
    same_unary("permute(2,0,1) sigmoid", &cube, |c| {
        c.permute(&[2, 0, 1])?.sigmoid()
    });
    same_unary("permute + narrow + contiguous", &cube, |c| {
        c.permute(&[1, 2, 0])?.narrow(1, 1, 3)?.contiguous()
    });
    // a strided view read back directly (to_host gathers on the device)
    let g = gpu(&cube).permute(&[2, 1, 0]).unwrap();
    check(
        "to_vec of a permuted view",
        &g,
        &cube.permute(&[2, 1, 0]).unwrap(),
    );
}

#[test]
fn inplace_ops_match_cpu() {
    let run = |dev: Device| -> Vec<Tensor> {
        let to = |t: &Tensor| {
            if dev == GPU { gpu(t) } else { t.clone() }
        };
        let a = to(&randn(&[4, 6], DType::F32, 13))
            .contiguous_owned()
            .unwrap();
        let b = to(&randn(&[4, 6], DType::F32, 14));
        let row = to(&randn(&[6], DType::F32, 15));
        a.add_(&b).unwrap();
        a.add_scaled_(&row, -0.25).unwrap();
        a.mul_(&b).unwrap();
        a.mul_scalar_(3.0).unwrap();
        let c = to(&Tensor::zeros(&[4, 6], DType::F32, Device::Cpu).unwrap())
            .contiguous_owned()
            .unwrap();
        c.copy_(&row).unwrap();
        let z = to(&randn(&[3, 3], DType::F64, 16))
            .contiguous_owned()
            .unwrap();
        z.fill_(2.5).unwrap();
        let w = to(&randn(&[5], DType::BF16, 17))
            .contiguous_owned()
            .unwrap();
        w.zero_().unwrap();
        vec![a, c, z, w]
    };
    let (cpu, cuda) = (run(Device::Cpu), run(GPU));
    for (i, (g, c)) in cuda.iter().zip(&cpu).enumerate() {
        check(&format!("in-place result {i}"), g, c);
    }
}

/// In-place products and sums by a 0-dim tensor on the device, which the kernel reads as
/// one broadcast value: a product by exactly one is skipped on the device (the fused loss
/// scales its saved gradients by a loss gradient of one every step), so it must leave every
/// bit as it was, while any other value, and a sum with one, still runs; in every float dtype,
/// on 16-byte-aligned storage and on a misaligned view.
#[test]
fn inplace_ops_by_a_device_scalar_of_one_match_cpu() {
    for dt in FLOATS {
        let run = |dev: Device| -> Vec<Tensor> {
            let to = |t: &Tensor| if dev == GPU { gpu(t) } else { t.clone() };
            let scalar = |v: f64| to(&Tensor::full(&[], v, dt, Device::Cpu).unwrap());
            let x = to(&randn(&[9, 8], dt, 40)).contiguous_owned().unwrap();
            let before = x.to_vec::<f64>().unwrap();
            x.mul_(&scalar(1.0)).unwrap();
            assert_eq!(
                x.to_vec::<f64>().unwrap(),
                before,
                "{dt}: a product by one changed values on {dev}"
            );
            let y = to(&randn(&[9, 8], dt, 41)).contiguous_owned().unwrap();
            y.mul_(&scalar(-2.5)).unwrap();
            let z = to(&randn(&[9, 8], dt, 42)).contiguous_owned().unwrap();
            z.add_(&scalar(1.0)).unwrap();
            // Elements 1.. of a run: a contiguous view whose start is not 16-byte aligned.
            let v = to(&randn(&[73], dt, 43)).contiguous_owned().unwrap();
            let tail = v.narrow(0, 1, 72).unwrap();
            tail.mul_(&scalar(1.0)).unwrap();
            tail.mul_(&scalar(3.0)).unwrap();
            vec![x, y, z, v]
        };
        let (cpu, cuda) = (run(Device::Cpu), run(GPU));
        for (i, (g, c)) in cuda.iter().zip(&cpu).enumerate() {
            check(
                &format!("{dt}: in-place by a device scalar, result {i}"),
                g,
                c,
            );
        }
    }
}

#[test]
fn inplace_reading_its_own_storage_matches_cpu() {
    // src is dst itself (exact alias), a broadcast of dst's first row, and dst transposed:
    // the last two read elements other threads overwrite, so they need a private copy.
    let run = |dev: Device| -> Vec<Tensor> {
        let x = randn(&[5, 5], DType::F32, 18);
        let x = if dev == GPU { gpu(&x) } else { x };
        let a = x.contiguous_owned().unwrap().mul_scalar(1.0).unwrap();
        a.add_(&a).unwrap();
        let b = x.mul_scalar(1.0).unwrap();
        b.add_(&b.narrow(0, 0, 1).unwrap()).unwrap();
        let c = x.mul_scalar(1.0).unwrap();
        c.add_scaled_(&c.t().unwrap(), 2.0).unwrap();
        let d = x.mul_scalar(1.0).unwrap();
        d.copy_(&d.narrow(1, 4, 1).unwrap()).unwrap();
        vec![a, b, c, d]
    };
    let (cpu, cuda) = (run(Device::Cpu), run(GPU));
    for (i, (g, c)) in cuda.iter().zip(&cpu).enumerate() {
        check(&format!("self-reading in-place {i}"), g, c);
    }
}

#[test]
fn fill_and_full_match_cpu_in_every_dtype() {
    for dt in ALL {
        for v in [0.0, 2.5, -3.75, 1e5, 70000.0] {
            let want = Tensor::full(&[3, 7], v, dt, Device::Cpu).unwrap();
            let got = Tensor::full(&[3, 7], v, dt, GPU).unwrap();
            check_tol(&format!("full({v}) {dt}"), &got, &want, 0.0, 0.0);
        }
        let z = Tensor::zeros(&[9], dt, GPU).unwrap();
        check_tol(
            &format!("zeros {dt}"),
            &z,
            &Tensor::zeros(&[9], dt, Device::Cpu).unwrap(),
            0.0,
            0.0,
        );
    }
}

/// Values of `dt` covering signs, fractions, large magnitudes and (for floats) inf and NaN.
fn conversion_source(dt: DType) -> Tensor {
    let values: Vec<f64> = match dt {
        DType::U8 => vec![0.0, 1.0, 1.0, 0.0, 1.0, 0.0],
        DType::I64 => vec![-7.0, 0.0, 1.0, 255.0, 65504.0, -123456789.0],
        _ => vec![
            -3.7,
            -1.0,
            -0.0,
            0.1,
            0.5,
            1.0,
            2.5,
            100.25,
            65504.0,
            1e-3,
            f64::INFINITY,
            f64::NAN,
        ],
    };
    let n = values.len();
    Tensor::from_vec_as(values, &[2, n / 2], dt, Device::Cpu).unwrap()
}

#[test]
fn dtype_conversions_match_cpu_for_every_pair() {
    for src in ALL {
        let x = conversion_source(src);
        for dst in ALL {
            let want = x.to_dtype(dst).unwrap();
            let got = gpu(&x).to_dtype(dst).unwrap();
            check_tol(&format!("{src} -> {dst}"), &got, &want, 0.0, 0.0);
            // a strided source goes through the same kernel
            let want_t = x.t().unwrap().to_dtype(dst).unwrap();
            let got_t = gpu(&x).t().unwrap().to_dtype(dst).unwrap();
            check_tol(&format!("{src}^T -> {dst}"), &got_t, &want_t, 0.0, 0.0);
        }
    }
}

#[test]
fn f16_and_bf16_round_to_nearest_even() {
    // ties and near-ties around 1.0, subnormals, overflow to inf
    let values = vec![
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        1.0 + 1.1 / 2048.0,
        6.0e-8,
        3.0e-8,
        2.9e-8,
        1.0e-5,
        65519.0,
        65520.0,
        -70000.0,
        3.0e38,
        3.4e38,
    ];
    let n = values.len();
    let x = Tensor::from_vec(values, &[n], Device::Cpu).unwrap();
    for from in [DType::F32, DType::F64] {
        let xs = x.to_dtype(from).unwrap();
        for to in [DType::F16, DType::BF16] {
            let want = xs.to_dtype(to).unwrap();
            let got = gpu(&xs).to_dtype(to).unwrap();
            check_tol(&format!("{from} -> {to} rounding"), &got, &want, 0.0, 0.0);
        }
    }
}

#[test]
fn cat_writes_strided_destinations() {
    let a = randn(&[3, 2, 4], DType::F32, 19);
    let b = randn(&[3, 5, 4], DType::F32, 20);
    let want = Tensor::cat(&[a.clone(), b.clone()], 1).unwrap();
    let got = Tensor::cat(&[gpu(&a), gpu(&b)], 1).unwrap();
    check("cat dim 1", &got, &want);
    // strided sources into strided destination regions
    let want = Tensor::cat(&[a.transpose(0, 2).unwrap(), b.transpose(0, 2).unwrap()], 1).unwrap();
    let (ga, gb) = (gpu(&a), gpu(&b));
    let got = Tensor::cat(
        &[ga.transpose(0, 2).unwrap(), gb.transpose(0, 2).unwrap()],
        1,
    )
    .unwrap();
    check("cat of transposed views", &got, &want);
}

#[test]
fn sums_over_any_dims_match_cpu() {
    let x = randn(&[4, 5, 6], DType::F32, 21);
    let cases: [(&[isize], bool); 7] = [
        (&[0], false),
        (&[1], true),
        (&[2], false),
        (&[0, 2], false),
        (&[-1, 0], true),
        (&[0, 1, 2], false),
        (&[], false),
    ];
    for dt in FLOATS {
        let xd = x.to_dtype(dt).unwrap();
        for (dims, keep) in cases {
            let want = xd.sum(dims, keep).unwrap();
            let got = gpu(&xd).sum(dims, keep).unwrap();
            check(&format!("sum {dims:?} keepdim={keep} {dt}"), &got, &want);
            let want = xd.mean(dims, keep).unwrap();
            let got = gpu(&xd).mean(dims, keep).unwrap();
            check(&format!("mean {dims:?} keepdim={keep} {dt}"), &got, &want);
        }
        check(
            &format!("sum_all {dt}"),
            &gpu(&xd).sum_all().unwrap(),
            &xd.sum_all().unwrap(),
        );
    }
}

#[test]
fn sums_of_strided_views_match_cpu() {
    let x = randn(&[6, 8, 5], DType::F32, 22);
    let views: [(&str, Unary); 4] = [
        ("permuted", |x| x.permute(&[2, 0, 1])),
        ("narrowed", |x| x.narrow(1, 3, 4)),
        ("transposed", |x| x.transpose(0, 2)),
        ("expanded", |x| x.narrow(0, 1, 1)?.expand(&[7, 8, 5])),
    ];
    for (name, view) in views {
        let dims_list: [&[isize]; 5] = [&[0], &[1], &[2], &[0, 2], &[1, 2]];
        for dims in dims_list {
            let want = view(&x).unwrap().sum(dims, false).unwrap();
            let got = view(&gpu(&x)).unwrap().sum(dims, false).unwrap();
            check(&format!("sum {dims:?} of {name}"), &got, &want);
        }
    }
}

#[test]
fn reductions_of_each_kernel_shape_match_cpu() {
    // thread per output (3 reduced), rows (block), columns (tiles + split), one long sum
    // (split + finish), rows with few outputs (block + split)
    let cases: [(&[usize], &[isize]); 6] = [
        (&[1000, 3], &[1]),
        (&[300, 700], &[1]),
        (&[4096, 96], &[0]),
        (&[1 << 20], &[0]),
        (&[3, 50_000], &[1]),
        (&[64, 33, 40], &[0, 2]),
    ];
    for (i, (shape, dims)) in cases.iter().enumerate() {
        let x = uniform(shape, -1.0, 1.0, DType::F32, 30 + i as u64);
        let want = x.sum(dims, false).unwrap();
        let got = gpu(&x).sum(dims, false).unwrap();
        // both accumulate in f64 and round once: equal up to the last f32 bit
        check_tol(
            &format!("sum {dims:?} of {shape:?}"),
            &got,
            &want,
            1e-6,
            1e-6,
        );
        if dims.len() == 1 {
            let d = dims[0];
            let (wv, wi) = x.max_dim(d, false).unwrap();
            let (gv, gi) = gpu(&x).max_dim(d, false).unwrap();
            check(&format!("max {d} of {shape:?}"), &gv, &wv);
            check(&format!("argmax {d} of {shape:?}"), &gi, &wi);
        }
    }
}

#[test]
fn sums_are_deterministic() {
    let x = gpu(&uniform(&[1 << 20], -1.0, 1.0, DType::F32, 40));
    let first = x.sum_all().unwrap().item().unwrap();
    for _ in 0..3 {
        assert_eq!(
            x.sum_all().unwrap().item().unwrap().to_bits(),
            first.to_bits()
        );
    }
}

#[test]
fn max_dim_picks_the_first_maximum_and_follows_cpu_on_nan() {
    let x = Tensor::from_vec(
        vec![
            1.0f32,
            3.0,
            3.0,
            2.0, // tie: first 3 wins
            -1.0,
            f32::NAN,
            5.0,
            f32::NAN, // NaN present: the CPU picks the last NaN
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
        ],
        &[3, 4],
        Device::Cpu,
    )
    .unwrap();
    for dt in FLOATS {
        let xd = x.to_dtype(dt).unwrap();
        for dim in [0isize, 1] {
            let (wv, wi) = xd.max_dim(dim, true).unwrap();
            let (gv, gi) = gpu(&xd).max_dim(dim, true).unwrap();
            check(&format!("max values dim {dim} {dt}"), &gv, &wv);
            check(&format!("max indices dim {dim} {dt}"), &gi, &wi);
            assert_eq!(gi.dtype(), DType::I64);
        }
    }
}

#[test]
fn reductions_over_empty_dims_give_identities() {
    // (the CPU reference cannot take this case yet, so the expected values are written out)
    let x = Tensor::zeros(&[3, 0], DType::F32, GPU).unwrap();
    let s = x.sum(&[1], false).unwrap();
    assert_eq!(s.shape(), &[3]);
    assert_eq!(s.to_vec::<f32>().unwrap(), vec![0.0; 3]);
}

/// Runs `f` on CPU leaves and on GPU leaves of the same values; compares the output and
/// every input's gradient after `backward` of the (scalar) output.
fn same_grads(what: &str, inputs: &[Tensor], f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let leaves = |dev: Device| -> Vec<Tensor> {
        inputs
            .iter()
            .map(|t| {
                let t = if dev == GPU { gpu(t) } else { t.clone() };
                t.detach().requires_grad_(true).unwrap()
            })
            .collect()
    };
    let (cl, gl) = (leaves(Device::Cpu), leaves(GPU));
    let (cy, gy) = (f(&cl).unwrap(), f(&gl).unwrap());
    check(&format!("{what}: forward"), &gy, &cy);
    cy.backward().unwrap();
    gy.backward().unwrap();
    for (i, (c, g)) in cl.iter().zip(&gl).enumerate() {
        let (cg, gg) = (c.grad().unwrap(), g.grad().unwrap());
        check(&format!("{what}: grad of input {i}"), &gg, &cg);
    }
}

#[test]
fn autograd_chains_match_cpu() {
    let x = randn(&[4, 6], DType::F32, 50);
    let w = randn(&[6], DType::F32, 51);
    let b = randn(&[4, 1], DType::F32, 52);
    let p = uniform(&[4, 6], 0.5, 2.0, DType::F32, 53);
    same_grads("gelu/mul/sigmoid/mean", &[x.clone(), w.clone()], |t| {
        t[0].gelu(GeluApprox::Tanh)?
            .mul(&t[1])?
            .sigmoid()?
            .mean_all()
    });
    same_grads("gelu erf / tanh / relu", &[x.clone(), b.clone()], |t| {
        t[0].gelu(GeluApprox::None)?
            .add(&t[1])?
            .tanh()?
            .relu()?
            .sum(&[0], false)?
            .sum_all()
    });
    same_grads("exp/log/sqrt/div/pow", &[p.clone(), w.clone()], |t| {
        let y = t[0].log()?.add_scalar(2.0)?.sqrt()?.div(&t[1].exp()?)?;
        y.pow_scalar(2.0)?
            .sub(&t[0].pow(&t[0].mul_scalar(0.0)?.detach().add_scalar(1.5)?)?)?
            .mean(&[1], false)?
            .sum_all()
    });
    same_grads(
        "views: transpose/narrow/expand",
        std::slice::from_ref(&x),
        |t| {
            let v = t[0].t()?.narrow(0, 1, 4)?; // (4, 4)
            let e = t[0].narrow(1, 0, 1)?.expand(&[4, 4])?;
            v.mul(&e)?.add(&v.t()?)?.sum_all()
        },
    );
    same_grads("max_dim", std::slice::from_ref(&x), |t| {
        let (m, _) = t[0].max_dim(1, false)?;
        m.mul_scalar(3.0)?.sum_all()
    });
    same_grads("f64 chain", &[x.to_dtype(DType::F64).unwrap()], |t| {
        t[0].sigmoid()?
            .mul(&t[0].tanh()?)?
            .sum(&[0], true)?
            .sum_all()
    });
}

/// Dropout masks are made on the device by Philox: the same generator state gives the same
/// mask, bit for bit, on cuda:0 and on the CPU, in every float dtype and at sizes that are not
/// a multiple of the four draws of one Philox call, through the kernel's vector path and its
/// per-element one (a view that starts one element in); backward is the mask.
#[test]
fn dropout_masks_made_on_the_gpu_equal_the_cpus() {
    for dt in FLOATS {
        for (n, p) in [(1usize, 0.5), (7, 0.2), (4099, 0.1), (1 << 20, 0.3)] {
            let x = Tensor::ones(&[n], dt, Device::Cpu).unwrap();
            let want = x.dropout(p, true, &mut Generator::new(11)).unwrap();
            let got = gpu(&x).dropout(p, true, &mut Generator::new(11)).unwrap();
            assert_eq!(got.device(), GPU);
            let (g, w) = (got.to_vec::<f64>().unwrap(), want.to_vec::<f64>().unwrap());
            assert_eq!(g, w, "{dt} n={n} p={p}");
            if n >= 4099 {
                let kept = g.iter().filter(|&&v| v != 0.0).count() as f64 / n as f64;
                assert!((kept - (1.0 - p)).abs() < 0.02, "{dt} n={n}: kept {kept}");
            }
            // A view one element in: groups of four no longer start on a vector's bytes, so
            // the kernel takes its per-element path, with the same mask.
            let whole = randn(&[n + 1], dt, n as u64);
            let x = whole.narrow(0, 1, n).unwrap();
            let want = x.dropout(p, true, &mut Generator::new(12)).unwrap();
            let got = gpu(&whole)
                .narrow(0, 1, n)
                .unwrap()
                .dropout(p, true, &mut Generator::new(12))
                .unwrap();
            assert_eq!(
                got.to_vec::<f64>().unwrap(),
                want.to_vec::<f64>().unwrap(),
                "{dt} n={n} p={p}, unaligned"
            );
        }
    }
    let x = gpu(&randn(&[3, 5], DType::F32, 2))
        .requires_grad_(true)
        .unwrap();
    let y = x.dropout(0.4, true, &mut Generator::new(5)).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    let mask = Tensor::ones(&[3, 5], DType::F32, Device::Cpu)
        .unwrap()
        .dropout(0.4, true, &mut Generator::new(5))
        .unwrap();
    assert_eq!(
        x.grad().unwrap().to_vec::<f64>().unwrap(),
        mask.to_vec::<f64>().unwrap()
    );
}

// ---- 16-byte vector paths ---------------------------------------------------------------

/// Contiguous, aligned operands take the kernels' 16-byte vector path, with a 0-dim operand
/// too; a view that starts one element in does not. Both must give the CPU's results, for lengths with and without a
/// tail after the last whole vector.
#[test]
fn vector_and_scalar_paths_match_the_cpu() {
    for dt in FLOATS {
        for n in [1usize, 7, 8, 9, 4099, 65_543] {
            let whole = randn(&[n + 1], dt, n as u64);
            let other = randn(&[n + 1], dt, n as u64 + 7);
            for (path, start) in [("vector", 0), ("unaligned", 1)] {
                let x = whole.narrow(0, start, n).unwrap();
                let y = other.narrow(0, start, n).unwrap();
                let (gx, gy) = (
                    gpu(&whole).narrow(0, start, n).unwrap(),
                    gpu(&other).narrow(0, start, n).unwrap(),
                );
                let what = |op: &str| format!("{op} {dt} n={n} {path}");
                // GELU in half precision is computed in f32 with f32 constants on the GPU;
                // the CPU rounds the constants to the element type first, which moves some
                // results by two steps of bf16. Both are checked against GELU in f64.
                let exact = |t: &Tensor, f: &dyn Fn(&Tensor) -> Tensor| {
                    f(&t.to_dtype(DType::F64).unwrap()).to_dtype(dt).unwrap()
                };
                check(
                    &what("gelu"),
                    &gx.gelu(GeluApprox::Tanh).unwrap(),
                    &exact(&x, &|t| t.gelu(GeluApprox::Tanh).unwrap()),
                );
                check(&what("add"), &gx.add(&gy).unwrap(), &x.add(&y).unwrap());
                // A fresh copy of the operand's whole buffer, then the same view of it.
                let copy = |t: &Tensor| t.mul_scalar(1.0).unwrap().narrow(0, start, n).unwrap();
                let (acc, gacc) = (copy(&whole), copy(&gpu(&whole)));
                acc.mul_(&y).unwrap();
                gacc.mul_(&gy).unwrap();
                check(&what("mul_"), &gacc, &acc);
                acc.add_(&y).unwrap();
                gacc.add_(&gy).unwrap();
                check(&what("add_"), &gacc, &acc);
                // A 0-dim operand broadcast to every element (a loss gradient, a clipping
                // coefficient): loaded once, the other operand on its own path.
                let s = Tensor::scalar(-1.75, dt, Device::Cpu).unwrap();
                let gs = gpu(&s);
                check(
                    &what("x * 0-dim"),
                    &gx.mul(&gs).unwrap(),
                    &x.mul(&s).unwrap(),
                );
                check(
                    &what("0-dim - x"),
                    &gs.sub(&gx).unwrap(),
                    &s.sub(&x).unwrap(),
                );
                acc.mul_(&s).unwrap();
                gacc.mul_(&gs).unwrap();
                check(&what("mul_ by 0-dim"), &gacc, &acc);
                // GELU's backward writes g · gelu'(x) into the incoming gradient in place.
                let grad_of = |x: &Tensor, g: &Tensor| {
                    let leaf = x.detach().requires_grad_(true).unwrap();
                    let y = leaf.gelu(GeluApprox::Tanh).unwrap();
                    y.mul(g).unwrap().sum_all().unwrap().backward().unwrap();
                    leaf.grad().unwrap()
                };
                let want = grad_of(
                    &x.to_dtype(DType::F64).unwrap(),
                    &y.to_dtype(DType::F64).unwrap(),
                );
                check(
                    &what("gelu backward"),
                    &grad_of(&gx, &gy),
                    &want.to_dtype(dt).unwrap(),
                );
                for to in [DType::F32, DType::BF16, DType::F16] {
                    check(
                        &what(&format!("cast to {to}")),
                        &gx.to_dtype(to).unwrap(),
                        &x.to_dtype(to).unwrap(),
                    );
                }
            }
        }
    }
}

/// An f32 operand plus or minus an f16/bf16 one runs one kernel that reads the half operand
/// directly: on the 16-byte vector path (with and without a tail), the unaligned path and
/// broadcasts, in either operand order. An f32 add rounds once the same way everywhere, so
/// the results equal the GPU's promotion (cast, then the f32 op) and the CPU bit for bit; the
/// gradients equal the promotion's bit for bit, and the CPU's where no broadcast sums them
/// (a sum over rows runs in another order on the GPU).
#[test]
fn f32_and_half_add_and_sub_match_promotion_bit_for_bit() {
    type Op = fn(&Tensor, &Tensor) -> Result<Tensor>;
    let ops: [(&str, Op); 2] = [("add", |a, b| a.add(b)), ("sub", |a, b| a.sub(b))];
    let exact = |what: &str, got: &Tensor, want: &Tensor| check_tol(what, got, want, 0.0, 0.0);
    for half in [DType::BF16, DType::F16] {
        let mut pairs = Vec::new();
        for n in [1usize, 7, 8, 9, 4099, 65_543] {
            let whole = randn(&[n + 1], DType::F32, n as u64);
            let other = randn(&[n + 1], half, n as u64 + 7);
            for start in [0, 1] {
                let x = whole.narrow(0, start, n).unwrap();
                let h = other.narrow(0, start, n).unwrap();
                pairs.push((format!("n={n} from {start}"), x.clone(), h.clone()));
                pairs.push((format!("n={n} from {start}, half first"), h, x));
            }
        }
        let wide = randn(&[4, 5, 24], DType::F32, 3);
        let row = randn(&[24], half, 4);
        pairs.push(("half row".into(), wide.clone(), row.clone()));
        let t = randn(&[24, 20], half, 5).t().unwrap();
        pairs.push(("f32 row, transposed".into(), randn(&[24], DType::F32, 6), t));
        for (name, a, b) in &pairs {
            for (op_name, op) in ops {
                let what = format!("{} {op_name} {} {name}", a.dtype(), b.dtype());
                let (ga, gb) = (gpu(a), gpu(b));
                let got = op(&ga, &gb).unwrap();
                let promoted = |a: &Tensor, b: &Tensor| {
                    op(
                        &a.to_dtype(DType::F32).unwrap(),
                        &b.to_dtype(DType::F32).unwrap(),
                    )
                    .unwrap()
                };
                let on_cpu = |t: &Tensor| t.to_device(Device::Cpu).unwrap();
                let gpu_promoted = promoted(&ga, &gb);
                assert_eq!(
                    on_cpu(&got).to_vec::<f32>().unwrap(),
                    on_cpu(&gpu_promoted).to_vec::<f32>().unwrap(),
                    "{what}: against the GPU's promotion"
                );
                exact(&what, &got, &op(a, b).unwrap());
                // Gradients: the f32 operand's in f32, the half one's rounded to its dtype.
                let leaves = |t: &[&Tensor]| -> Vec<Tensor> {
                    t.iter()
                        .map(|t| t.detach().requires_grad_(true).unwrap())
                        .collect()
                };
                let (cl, gl, pl) = (leaves(&[a, b]), leaves(&[&ga, &gb]), leaves(&[&ga, &gb]));
                let w = randn(got.shape(), DType::F32, 8);
                let backward = |y: Tensor, w: &Tensor| {
                    y.mul(w).unwrap().sum_all().unwrap().backward().unwrap();
                };
                backward(op(&cl[0], &cl[1]).unwrap(), &w);
                backward(op(&gl[0], &gl[1]).unwrap(), &gpu(&w));
                backward(promoted(&pl[0], &pl[1]), &gpu(&w));
                let broadcast = a.shape() != b.shape();
                for i in 0..2 {
                    let gg = gl[i].grad().unwrap();
                    let what = format!("{what}: grad {i}");
                    let (pg, cg) = (pl[i].grad().unwrap(), cl[i].grad().unwrap());
                    assert_eq!(gg.dtype(), pg.dtype(), "{what}: dtype");
                    assert_eq!(
                        on_cpu(&gg).to_vec::<f64>().unwrap(),
                        on_cpu(&pg).to_vec::<f64>().unwrap(),
                        "{what}: against the GPU's promotion"
                    );
                    if broadcast {
                        check(&what, &gg, &cg);
                    } else {
                        exact(&what, &gg, &cg);
                    }
                }
            }
        }
    }
}

/// A bias added in place over rows: 16-byte vectors along the row when the row length allows,
/// per element otherwise.
#[test]
fn a_bias_added_over_rows_matches_the_cpu() {
    for dt in FLOATS {
        for (rows, cols) in [(33, 3072), (5, 8), (17, 13), (3, 2)] {
            let x = randn(&[rows, cols], dt, cols as u64);
            let b = randn(&[cols], dt, cols as u64 + 1);
            let (gx, gb) = (gpu(&x), gpu(&b));
            x.add_(&b).unwrap();
            gx.add_(&gb).unwrap();
            check(&format!("bias add {dt} ({rows}, {cols})"), &gx, &x);
        }
    }
}

/// Sums over the rows of a matrix (a bias gradient): rows of whole 16-byte vectors take the
/// vector column kernel, split over row chunks or not; row lengths that are not whole vectors,
/// views that start mid-vector and padded rows take the general one. All match the CPU.
#[test]
fn column_sums_of_every_row_shape_match_the_cpu() {
    for dt in FLOATS {
        let cases: [(usize, usize, usize, usize); 7] = [
            (8192, 768, 768, 0),
            (4096, 3072, 3072, 0),
            (40, 256, 256, 0),
            (300, 24, 24, 0),
            (513, 13, 13, 0),
            (100, 64, 72, 8),
            (100, 64, 66, 1),
        ];
        for (rows, cols, ld, start) in cases {
            let x = uniform(&[rows, ld], -1.0, 1.0, dt, (rows * ld) as u64);
            let view = |t: &Tensor| t.narrow(1, start, cols).unwrap();
            let want = view(&x).sum(&[0], false).unwrap();
            let got = view(&gpu(&x)).sum(&[0], false).unwrap();
            check(
                &format!("sum over rows {dt} ({rows}, {cols}) ld {ld} from {start}"),
                &got,
                &want,
            );
        }
    }
}
