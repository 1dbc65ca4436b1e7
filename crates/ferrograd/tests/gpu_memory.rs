//! GPU memory behaviour on a real device: the demo's byte counts under the caching
//! allocator's 512-byte rounding, categories that add up, out-of-memory as an error value
//! that leaves the process and its tensors usable, empty_cache. Needs a CUDA device.
#![cfg(feature = "gpu-tests")]

use std::sync::Mutex;

use ferrograd::nn::{Linear, Module, Relu, Sequential};
use ferrograd::{Category, DType, Device, Error, Generator, Tensor, memory};

const GPU: Device = Device::Cuda(0);
static LOCK: Mutex<()> = Mutex::new(());

fn r512(bytes: usize) -> u64 {
    bytes.div_ceil(512) as u64 * 512
}

fn allocated_without_workspace() -> u64 {
    let by = memory::memory_by_category(GPU).unwrap();
    memory::memory_allocated(GPU).unwrap() - by.get(Category::Workspace)
}

#[test]
fn demo_bytes_match_the_rounded_formula() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (d, b) = (1000usize, 100usize);
    let base = allocated_without_workspace();
    let mut g = Generator::new(0);
    let model = Sequential::new()
        .push(Linear::new(d, d, true, GPU, &mut g).unwrap())
        .push(Relu)
        .push(Linear::new(d, d, true, GPU, &mut g).unwrap());
    let x = Tensor::randn_with(&[b, d], DType::F32, GPU, &mut g).unwrap();
    let out = model.forward(&x).unwrap();
    let p = 2 * (r512(d * d * 4) + r512(d * 4));
    let a = r512(b * d * 4);
    assert_eq!(
        allocated_without_workspace() - base,
        p + 3 * a,
        "before backward = P + 3A"
    );
    let by = memory::memory_by_category(GPU).unwrap();
    assert!(by.get(Category::SavedActivation) >= a);
    out.sum_all().unwrap().backward().unwrap();
    assert_eq!(
        allocated_without_workspace() - base,
        2 * p + 2 * a,
        "after backward = 2P + 2A"
    );
    let by = memory::memory_by_category(GPU).unwrap();
    assert_eq!(
        by.total(),
        memory::memory_allocated(GPU).unwrap(),
        "categories add up"
    );
    assert_eq!(by.get(Category::SavedActivation), 0);
    assert!(memory::memory_reserved(GPU).unwrap() >= memory::memory_allocated(GPU).unwrap());
}

#[test]
fn out_of_memory_is_an_error_and_training_goes_on() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let keep = Tensor::ones(&[1024], DType::F32, GPU).unwrap();
    let total = memory::allocator(GPU).unwrap().mem_info().total;
    let too_many = (total / 4) as usize * 2; // 2x the device, in f32 elements
    let err = Tensor::zeros(&[too_many], DType::F32, GPU).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    let msg = err.to_string();
    println!("{msg}"); // the report a user sees (shown with --nocapture)
    for needle in [
        "out of memory on cuda:0",
        "allocated by category",
        "what to try",
    ] {
        assert!(msg.contains(needle), "missing '{needle}' in: {msg}");
    }
    let stats = memory::memory_stats(GPU).unwrap();
    assert!(stats["num_ooms"] >= 1);
    // Everything still works: the old tensor reads back and a smaller step runs.
    assert_eq!(keep.to_vec::<f32>().unwrap(), vec![1.0; 1024]);
    let w = Tensor::randn(&[256, 256], DType::F32, GPU)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let x = Tensor::randn(&[64, 256], DType::F32, GPU).unwrap();
    x.linear(&w, None)
        .unwrap()
        .relu()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(w.grad().unwrap().shape(), &[256, 256]);
}

#[test]
fn freed_blocks_stay_reserved_until_empty_cache() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    memory::empty_cache(GPU).unwrap();
    let reserved0 = memory::memory_reserved(GPU).unwrap();
    let t = Tensor::zeros(&[64 << 20], DType::U8, GPU).unwrap(); // 64 MiB: its own segment
    let reserved1 = memory::memory_reserved(GPU).unwrap();
    assert_eq!(reserved1 - reserved0, 64 << 20);
    drop(t);
    assert_eq!(
        memory::memory_reserved(GPU).unwrap(),
        reserved1,
        "cached after free"
    );
    memory::empty_cache(GPU).unwrap();
    assert_eq!(
        memory::memory_reserved(GPU).unwrap(),
        reserved0,
        "returned by empty_cache"
    );
}

#[test]
fn small_requests_share_a_2_mib_segment() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    memory::empty_cache(GPU).unwrap();
    let before = memory::memory_stats(GPU).unwrap();
    let ts: Vec<Tensor> = (0..8)
        .map(|_| Tensor::zeros(&[1000], DType::F32, GPU).unwrap())
        .collect();
    let after = memory::memory_stats(GPU).unwrap();
    let seg = |m: &std::collections::BTreeMap<String, i64>| m["segment.small_pool.current"];
    assert!(
        seg(&after) - seg(&before) <= 1,
        "8 × 4000 B fit in one small segment"
    );
    assert_eq!(
        after["allocated_bytes.small_pool.current"] - before["allocated_bytes.small_pool.current"],
        8 * 4096,
        "each 4000 B request rounds to 4096"
    );
    drop(ts);
}

#[test]
fn device_errors_are_typed() {
    let cpu = Tensor::ones(&[2], DType::F32, Device::Cpu).unwrap();
    let gpu = Tensor::ones(&[2], DType::F32, GPU).unwrap();
    assert!(matches!(cpu.add(&gpu), Err(Error::DeviceMismatch { .. })));
    assert!(matches!(
        Tensor::ones(&[2], DType::F32, Device::Cuda(99)),
        Err(Error::DeviceUnavailable { .. })
    ));
}

// ---- GEMM epilogues write only their outputs -----------------------------------------------

/// A tensor of `n` elements of `dtype` on the GPU holding `v` everywhere.
fn filled(n: usize, dtype: DType, v: f64) -> Tensor {
    Tensor::full(&[n], v, dtype, GPU).unwrap()
}

/// Whether `t` starts right where `before`'s block ends: a write past `before` lands in `t`.
fn directly_after(before: &Tensor, t: &Tensor) -> bool {
    let (a, b) = (before.storage().allocation(), t.storage().allocation());
    a.addr() + a.size() as u64 == b.addr()
}

/// The largest |got - want| (got anywhere, any dtype; want on the CPU, same element count).
fn max_diff(got: &Tensor, want: &Tensor) -> f64 {
    let values = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
    let (g, w) = (values(got), values(want));
    assert_eq!(g.len(), w.len());
    g.iter()
        .zip(&w)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
}

/// The backend's view of a tensor.
fn view(t: &Tensor) -> ferrograd::backend::View<'_> {
    ferrograd::backend::View {
        storage: t.storage(),
        layout: t.layout(),
    }
}

/// The sentinel's elements that are no longer `v`.
fn disturbed(sentinel: &Tensor, v: f64) -> usize {
    let vals = sentinel
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec::<f64>()
        .unwrap();
    vals.iter().filter(|&&x| x != v).count()
}

/// The epilogue tests' operands in `dtype`, drawn from `seed` in this order: x (rows, k),
/// w (n, k), b (n) and an output gradient (rows, gy_cols); on the CPU, then copied to the GPU.
fn epilogue_operands(
    dtype: DType,
    seed: u64,
    (rows, k, n): (usize, usize, usize),
    gy_cols: usize,
) -> ([Tensor; 4], [Tensor; 4]) {
    let mut g = Generator::new(seed);
    let shapes: [&[usize]; 4] = [&[rows, k], &[n, k], &[n], &[rows, gy_cols]];
    let cpu = shapes.map(|s| {
        Tensor::randn_with(s, DType::F32, Device::Cpu, &mut g)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    });
    let gpu = cpu.clone().map(|t| t.to_device(GPU).unwrap());
    (cpu, gpu)
}

/// cuBLASLt's bias and bias-gradient epilogues on a product with an odd row count (21): the
/// output, the bias gradient and the blocks right after them are checked. Each output is
/// sized to a whole number of 512-byte blocks, so any write past its end lands in a sentinel
/// the allocator placed right after it.
#[test]
fn gemm_epilogues_write_nothing_past_their_outputs() {
    use ferrograd::backend::matmul::{matmul_bias, matmul_row_sums};
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    const MARK: f64 = 3.0;
    let (rows, k, n) = (21usize, 32usize, 256usize);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let ([x, w, b, gy], [xg, wg, bg, gyg]) = epilogue_operands(dtype, 5, (rows, k, n), n);

        // Forward: out (21, 256) = x @ wᵀ + b, then a sentinel.
        let out = filled(rows * n, dtype, 0.0);
        let s1 = filled(4096, dtype, MARK);
        assert!(
            directly_after(&out, &s1),
            "{dtype}: the sentinel is not adjacent"
        );
        let wt = wg.t().unwrap();
        let spec = spec_t(rows, n, k);
        matmul_bias(&spec, view(&xg), view(&wt), view(&bg), out.storage()).unwrap();
        assert_eq!(
            disturbed(&s1, MARK),
            0,
            "{dtype}: the biased product wrote past its output"
        );
        let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let want = f32s(&x).linear(&f32s(&w), Some(&f32s(&b))).unwrap();
        let diff = max_diff(&out, &want);
        assert!(diff < 0.25, "{dtype}: biased product off by {diff}");

        // Backward: dW (256, 32) = gyᵀ x and db (256) = Σ_rows gy, each followed by a sentinel.
        let dw = filled(n * k, dtype, 0.0);
        let s2 = filled(4096, dtype, MARK);
        let db = filled(n, dtype, 0.0);
        let s3 = filled(4096, dtype, MARK);
        assert!(
            directly_after(&dw, &s2) && directly_after(&db, &s3),
            "{dtype}: not adjacent"
        );
        let gyt = gyg.t().unwrap();
        let fused = matmul_row_sums(
            &spec_t(n, k, rows),
            view(&gyt),
            view(&xg),
            dw.storage(),
            db.storage(),
        )
        .unwrap();
        assert!(fused, "{dtype}: the GPU sums the bias gradient in the GEMM");
        assert_eq!(
            disturbed(&s2, MARK),
            0,
            "{dtype}: the weight gradient wrote past its end"
        );
        assert_eq!(
            disturbed(&s3, MARK),
            0,
            "{dtype}: the bias gradient wrote past its end"
        );
        let diff = max_diff(&db, &f32s(&gy).sum(&[0], false).unwrap());
        assert!(diff < 0.25, "{dtype}: bias gradient off by {diff}");
    }
}

/// cuBLASLt's GELU epilogues (forward: bias + GELU with the pre-activation beside the output;
/// backward: the product times gelu'(pre)) on a product with an odd row count (21): the
/// output, the pre-activation and the blocks right after each are checked, as for the bias
/// epilogues above.
#[test]
fn gelu_epilogues_write_nothing_past_their_outputs() {
    use ferrograd::backend::matmul::{matmul_bias_gelu, matmul_dgelu};
    use ferrograd::ops::GeluApprox;
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    const MARK: f64 = 3.0;
    let (rows, k, n) = (21usize, 32usize, 256usize);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let ([x, w, b, gy], [xg, wg, bg, gyg]) = epilogue_operands(dtype, 6, (rows, k, n), k);
        let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();

        // Forward: pre (21, 256) = x @ wᵀ + b and out = gelu(pre), each followed by a sentinel.
        let pre = filled(rows * n, dtype, 0.0);
        let s1 = filled(4096, dtype, MARK);
        let out = filled(rows * n, dtype, 0.0);
        let s2 = filled(4096, dtype, MARK);
        assert!(
            directly_after(&pre, &s1) && directly_after(&out, &s2),
            "{dtype}: the sentinels are not adjacent"
        );
        let wt = wg.t().unwrap();
        matmul_bias_gelu(
            &spec_t(rows, n, k),
            view(&xg),
            view(&wt),
            view(&bg),
            pre.storage(),
            out.storage(),
        )
        .unwrap();
        assert_eq!(
            disturbed(&s1, MARK),
            0,
            "{dtype}: wrote past the pre-activation"
        );
        assert_eq!(disturbed(&s2, MARK), 0, "{dtype}: wrote past the output");
        let want_pre = f32s(&x).linear(&f32s(&w), Some(&f32s(&b))).unwrap();
        let want = want_pre.gelu(GeluApprox::Tanh).unwrap();
        let diff = max_diff(&pre, &want_pre).max(max_diff(&out, &want));
        assert!(diff < 0.25, "{dtype}: bias + GELU off by {diff}");

        // Backward: dpre (21, 256) = (gy @ w') ∘ gelu'(pre) with gy (21, 32) and w' = w (256,
        // 32) read as (32, 256), then a sentinel.
        let dpre = filled(rows * n, dtype, 0.0);
        let s3 = filled(4096, dtype, MARK);
        assert!(directly_after(&dpre, &s3), "{dtype}: not adjacent");
        let w2 = wg.reshape(&[k, n]).unwrap();
        let pre2 = pre.reshape(&[rows, n]).unwrap();
        matmul_dgelu(
            &spec_t(rows, n, k),
            view(&gyg),
            view(&w2),
            view(&pre2),
            dpre.storage(),
        )
        .unwrap();
        assert_eq!(
            disturbed(&s3, MARK),
            0,
            "{dtype}: dGELU wrote past its output"
        );
        // The reference: GELU's backward on the CPU, by autograd.
        let up = f32s(&gy)
            .matmul(&f32s(&w).reshape(&[k, n]).unwrap())
            .unwrap();
        let leaf = want_pre.detach().requires_grad_(true).unwrap();
        leaf.gelu(GeluApprox::Tanh)
            .unwrap()
            .backward_with(ferrograd::BackwardOptions {
                gradient: Some(up),
                ..Default::default()
            })
            .unwrap();
        let want = leaf.grad().unwrap();
        let diff = max_diff(&dpre, &want);
        assert!(diff < 0.5, "{dtype}: dGELU off by {diff}");
    }
}

/// One (m, k) @ (k, n) product.
fn spec_t(m: usize, n: usize, k: usize) -> ferrograd::backend::matmul::MatmulSpec {
    ferrograd::backend::matmul::MatmulSpec { batch: 1, m, n, k }
}
