//! The GPU's fused causal attention (FlashAttention-2: on tensor cores in f16 and bf16, in
//! three TF32 products per product in f32) against an f64 reference of the same rounded inputs on the CPU, across every head dim it covers and
//! sequence lengths inside, at and past its 64-row tiles; against PyTorch's
//! `scaled_dot_product_attention` fixture; against the composed attention inside the GPT
//! model under autocast; dropout on the probabilities against the composed path's dropout
//! with the same generator state (the same mask); the memory it keeps (to the byte); a
//! bit-identical backward from run to run; and unaligned operands. Needs a CUDA device:
//! without one every test fails.
#![cfg(feature = "gpu-tests")]

mod common;

use std::sync::{Mutex, MutexGuard};

use common::fixture_file::{self, FixtureFile};
use ferrograd::amp::{AmpDType, autocast};
use ferrograd::memory;
use ferrograd::nn::{Gpt, GptConfig, Module, causal_mask};
use ferrograd::ops::{causal_attention_dropout_supported, causal_attention_supported};
use ferrograd::{DType, Device, Generator, Tensor};

const GPU: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;

static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn_with(shape, DType::F64, CPU, &mut Generator::new(seed)).unwrap()
}

/// `randn` rounded to bf16 on the GPU.
fn randn_gpu_bf16(shape: &[usize], seed: u64) -> Tensor {
    randn(shape, seed)
        .to_dtype(DType::BF16)
        .unwrap()
        .to_device(GPU)
        .unwrap()
}

/// max |got − want| / max |want|: half-precision kernels round the probabilities and the
/// score gradients to 16 bits before their products, so errors scale with the largest value.
fn relative_error(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.shape(), want.shape());
    let g = got.to_device(CPU).unwrap().to_vec::<f64>().unwrap();
    let w = want.to_vec::<f64>().unwrap();
    let scale = w.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    let worst = g
        .iter()
        .zip(&w)
        .map(|(a, b)| {
            if a.is_finite() {
                (a - b).abs()
            } else {
                f64::INFINITY
            }
        })
        .fold(0f64, f64::max);
    worst / scale
}

/// (out, d sum(out · gout) / d qkv) of `qkv` on `device` in its dtype.
fn attention_and_grad(qkv: &Tensor, gout: &Tensor, n_head: usize) -> (Tensor, Tensor) {
    let x = qkv.detach().requires_grad_(true).unwrap();
    let out = x.causal_attention(n_head).unwrap();
    out.mul(
        &gout
            .to_dtype(out.dtype())
            .unwrap()
            .to_device(out.device())
            .unwrap(),
    )
    .unwrap()
    .sum_all()
    .unwrap()
    .backward()
    .unwrap();
    (out, x.grad().expect("qkv has a gradient"))
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2.5e-2,
        DType::F16 => 4e-3,
        _ => 1e-5,
    }
}

#[test]
fn matches_an_f64_reference_at_every_head_dim_and_length() {
    let _l = lock();
    // (B, T, H, D): T of 1, inside one tile, exactly one, past one and several.
    let cases = [
        (2, 1, 2, 16),
        (1, 17, 3, 32),
        (2, 64, 2, 64),
        (1, 100, 2, 48),
        (1, 130, 2, 80),
        (1, 65, 1, 96),
        (1, 70, 1, 112),
        (2, 257, 1, 128),
        (1, 300, 2, 64),
    ];
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (i, &(b, t, h, d)) in cases.iter().enumerate() {
            assert!(causal_attention_supported(GPU, dtype, d));
            let c = h * d;
            // Rounded to the dtype first: the reference sees the kernel's exact inputs.
            let qkv = randn(&[b, t, 3 * c], 40 + i as u64)
                .to_dtype(dtype)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap();
            let gout = randn(&[b, t, c], 80 + i as u64)
                .to_dtype(dtype)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap();
            let (want_out, want_grad) = attention_and_grad(&qkv, &gout, h);
            let on_gpu = qkv.to_dtype(dtype).unwrap().to_device(GPU).unwrap();
            let (out, grad) = attention_and_grad(&on_gpu, &gout, h);
            assert_eq!((out.device(), out.dtype()), (GPU, dtype));
            let what = format!("{dtype} B{b} T{t} H{h} D{d}");
            let (eo, eg) = (
                relative_error(&out.to_dtype(DType::F64).unwrap(), &want_out),
                relative_error(&grad.to_dtype(DType::F64).unwrap(), &want_grad),
            );
            assert!(eo <= tolerance(dtype), "{what}: out error {eo:.2e}");
            assert!(
                eg <= 2.0 * tolerance(dtype),
                "{what}: gradient error {eg:.2e}"
            );
        }
    }
}

fn fixtures() -> &'static FixtureFile {
    fixture_file::open(
        "attention.safetensors",
        "ferrograd-attention-fixtures",
        "make_attention_fixtures.py",
    )
}

#[test]
fn matches_pytorch_in_f32_bf16_and_f16() {
    let _l = lock();
    let f = fixtures();
    // gpt_f32: B 2, T 96, 2 heads of 64; tiles_f64: T 150, 2 heads of 16.
    for (case, h) in [("gpt_f32", 2), ("tiles_f64", 2)] {
        let qkv = f.get(&format!("{case}.qkv"));
        let gout = f.get(&format!("{case}.gout"));
        let want_out = f.get(&format!("{case}.out")).to_dtype(DType::F64).unwrap();
        let want_grad = f.get(&format!("{case}.gqkv")).to_dtype(DType::F64).unwrap();
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let x = qkv.to_dtype(dtype).unwrap().to_device(GPU).unwrap();
            let (out, grad) = attention_and_grad(&x, &gout, h);
            // The inputs' own rounding counts here too: 2⁻⁸ relative in bf16.
            let eo = relative_error(&out.to_dtype(DType::F64).unwrap(), &want_out);
            let eg = relative_error(&grad.to_dtype(DType::F64).unwrap(), &want_grad);
            let tol = 2.0 * tolerance(dtype);
            assert!(eo <= tol, "{case} {dtype}: out error {eo:.2e}");
            assert!(eg <= 2.0 * tol, "{case} {dtype}: gradient error {eg:.2e}");
        }
    }
}

#[test]
fn backward_is_bit_identical_from_run_to_run() {
    let _l = lock();
    let qkv = randn_gpu_bf16(&[2, 200, 3 * 128], 7);
    let gout = randn(&[2, 200, 128], 8);
    let (_, a) = attention_and_grad(&qkv, &gout, 2);
    let (_, b) = attention_and_grad(&qkv, &gout, 2);
    let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    // The f32 kernels too.
    let qkv = randn(&[2, 200, 3 * 128], 7)
        .to_dtype(DType::F32)
        .unwrap()
        .to_device(GPU)
        .unwrap();
    let (_, a) = attention_and_grad(&qkv, &gout, 2);
    let (_, b) = attention_and_grad(&qkv, &gout, 2);
    let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
}

#[test]
fn unaligned_operands_give_the_same_bits_as_aligned_ones() {
    let _l = lock();
    let (b, t, c) = (1, 90, 128);
    let n = b * t * 3 * c;
    let flat = randn_gpu_bf16(&[n + 1], 9);
    // One element in: every row starts 2 bytes off a 16-byte boundary.
    let shifted = flat
        .narrow(0, 1, n)
        .unwrap()
        .reshape(&[b, t, 3 * c])
        .unwrap();
    let aligned = shifted.contiguous_copy();
    let gout = randn(&[b, t, c], 10);
    let (out_s, grad_s) = attention_and_grad(&shifted, &gout, 2);
    let (out_a, grad_a) = attention_and_grad(&aligned, &gout, 2);
    for (x, y) in [(out_s, out_a), (grad_s, grad_a)] {
        let (x, y) = (x.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap());
        assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()));
    }
}

trait CopyOut {
    fn contiguous_copy(&self) -> Tensor;
}

impl CopyOut for Tensor {
    /// A fresh buffer with the same values (offset 0, so 16-byte-aligned rows).
    fn contiguous_copy(&self) -> Tensor {
        self.to_device(CPU).unwrap().to_device(GPU).unwrap()
    }
}

#[test]
fn forward_keeps_the_output_and_one_log_sum_exp_per_query() {
    let _l = lock();
    let (b, t, h, d) = (2, 128, 4, 16);
    let c = h * d;
    let qkv = randn_gpu_bf16(&[b, t, 3 * c], 11)
        .requires_grad_(true)
        .unwrap();
    let before = memory::memory_allocated(GPU).unwrap();
    let out = qkv.causal_attention(h).unwrap();
    let grown = memory::memory_allocated(GPU).unwrap() - before;
    // out (B, T, C) bf16 = 32,768 bytes and lse (B, H, T) f32 = 4,096 bytes, both whole
    // 512-byte blocks; composed attention would keep (B, H, T, T) probabilities (512 KiB+).
    assert_eq!(grown, (b * t * c * 2 + b * h * t * 4) as u64);
    drop(out);
}

#[test]
fn other_dtypes_and_head_dims_are_left_to_the_composed_path() {
    assert!(causal_attention_supported(GPU, DType::F32, 64));
    assert!(!causal_attention_supported(GPU, DType::F64, 64));
    assert!(!causal_attention_supported(GPU, DType::F32, 72));
    assert!(!causal_attention_supported(GPU, DType::BF16, 8));
    assert!(!causal_attention_supported(GPU, DType::BF16, 72));
    assert!(!causal_attention_supported(GPU, DType::F16, 256));
    let _l = lock();
    let x = randn(&[1, 4, 3 * 16], 12).to_device(GPU).unwrap();
    let err = x.causal_attention(2).unwrap_err().to_string();
    assert!(err.contains("compose"), "{err}");
}

/// softmax(q kᵀ / √D, causal).dropout(p, rng) v spelled out with ops (the model's composed
/// path), on qkv's device and dtype: (B, T, 3C) → (B, T, C).
fn composed_with_dropout(qkv: &Tensor, h: usize, p: f64, rng: &mut Generator) -> Tensor {
    let &[b, t, c3] = qkv.shape() else {
        panic!("qkv is (B, T, 3C)")
    };
    let (c, d) = (c3 / 3, c3 / 3 / h);
    let x = qkv
        .reshape(&[b, t, 3, h, d])
        .unwrap()
        .permute(&[2, 0, 3, 1, 4])
        .unwrap();
    let head = |i: usize| x.narrow(0, i, 1).unwrap().squeeze(0).unwrap();
    let (q, k, v) = (head(0), head(1), head(2));
    let att = q
        .matmul(&k.transpose(-2, -1).unwrap())
        .unwrap()
        .mul_scalar(1.0 / (d as f64).sqrt())
        .unwrap()
        .masked_fill(&causal_mask(t, qkv.device()).unwrap(), f64::NEG_INFINITY)
        .unwrap()
        .softmax(-1)
        .unwrap()
        .dropout(p, true, rng)
        .unwrap();
    att.matmul(&v)
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .reshape(&[b, t, c])
        .unwrap()
}

#[test]
fn dropout_on_the_probabilities_draws_the_composed_paths_mask() {
    let _l = lock();
    // Lengths that are multiples of 4 take the kernels' shared draws (one Philox call per
    // group of four keys, passed between lanes); the others draw per element.
    check_dropout_against_composed(&[
        (DType::BF16, 2, 70, 2, 64, 0.2),
        (DType::BF16, 1, 129, 3, 32, 0.5),
        (DType::BF16, 1, 33, 1, 128, 0.1),
        (DType::BF16, 2, 72, 2, 64, 0.2),
        (DType::BF16, 1, 128, 3, 32, 0.5),
        (DType::BF16, 1, 36, 1, 128, 0.1),
        (DType::F16, 1, 200, 2, 64, 0.3),
    ]);
}

/// The same in f32 (its own kernels, slower to compile).
#[test]
fn dropout_on_the_probabilities_draws_the_composed_paths_mask_in_f32() {
    let _l = lock();
    check_dropout_against_composed(&[
        (DType::F32, 2, 70, 2, 64, 0.2),
        (DType::F32, 1, 129, 3, 32, 0.5),
        (DType::F32, 1, 33, 1, 128, 0.1),
    ]);
}

/// Each case (dtype, B, T, H, D, p): the fused attention with dropout against the composed
/// path in f64 on the CPU with the same seed (outputs and gradients), no mask stored, and
/// another seed giving another output.
fn check_dropout_against_composed(cases: &[(DType, usize, usize, usize, usize, f64)]) {
    for (i, &(dtype, b, t, h, d, p)) in cases.iter().enumerate() {
        assert!(causal_attention_dropout_supported(GPU, dtype, d));
        let c = h * d;
        let qkv = randn(&[b, t, 3 * c], 60 + i as u64)
            .to_dtype(dtype)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        let gout = randn(&[b, t, c], 70 + i as u64);
        // The reference: the composed path in f64 on the CPU, the mask from the same seed.
        let x = qkv.detach().requires_grad_(true).unwrap();
        let want = composed_with_dropout(&x, h, p, &mut Generator::new(9 + i as u64));
        want.mul(&gout)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let want_grad = x.grad().expect("a gradient");

        let y = qkv
            .to_dtype(dtype)
            .unwrap()
            .to_device(GPU)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let before = memory::memory_allocated(GPU).unwrap();
        let out = y
            .causal_attention_dropout(h, p, &mut Generator::new(9 + i as u64))
            .unwrap();
        // Still only the output and one log-sum-exp per query: no mask is stored.
        let grown = memory::memory_allocated(GPU).unwrap() - before;
        let blocks = |bytes: usize| bytes.div_ceil(512) * 512;
        assert_eq!(
            grown,
            (blocks(b * t * c * dtype.size_in_bytes()) + blocks(b * h * t * 4)) as u64
        );
        let g = gout.to_dtype(dtype).unwrap().to_device(GPU).unwrap();
        out.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
        let what = format!("{dtype} B{b} T{t} H{h} D{d} p{p}");
        let eo = relative_error(&out.to_dtype(DType::F64).unwrap(), &want);
        let eg = relative_error(
            &y.grad().expect("a gradient").to_dtype(DType::F64).unwrap(),
            &want_grad,
        );
        assert!(eo <= 2.0 * tolerance(dtype), "{what}: out error {eo:.2e}");
        assert!(
            eg <= 4.0 * tolerance(dtype),
            "{what}: gradient error {eg:.2e}"
        );
        // Another seed is another mask: the comparison above could fail.
        let other = y
            .detach()
            .causal_attention_dropout(h, p, &mut Generator::new(1000))
            .unwrap();
        let eo = relative_error(&other.to_dtype(DType::F64).unwrap(), &want);
        assert!(
            eo > 0.1,
            "{what}: another seed gave the same output ({eo:.2e})"
        );
    }
}

#[test]
fn dropout_probabilities_outside_zero_to_one_are_errors() {
    let _l = lock();
    let x = randn_gpu_bf16(&[1, 4, 3 * 16], 13);
    for p in [1.0, -0.1, f64::NAN] {
        let err = x
            .causal_attention_dropout(1, p, &mut Generator::new(1))
            .unwrap_err();
        assert!(err.to_string().contains("[0, 1)"), "{p}: {err}");
    }
}

fn config() -> GptConfig {
    GptConfig {
        vocab_size: 61,
        block_size: 160,
        n_layer: 2,
        n_head: 2,
        n_embd: 128,
        dropout: 0.0,
        bias: true,
        seed: 5,
    }
}

/// Two sequences of `t` token ids for the model's 61-token vocabulary, and their targets.
fn token_batch(t: usize) -> (Tensor, Tensor) {
    let ids: Vec<i64> = (0..2 * t as i64).map(|i| (i * 13 + 5) % 61).collect();
    let targets: Vec<i64> = ids.iter().map(|&i| (i * 7 + 2) % 61).collect();
    (
        Tensor::from_vec(ids, &[2, t], GPU).unwrap(),
        Tensor::from_vec(targets, &[2, t], GPU).unwrap(),
    )
}

/// Loss and gradients of the model under bf16 autocast on the GPU, fused or composed, for
/// sequences of `t` tokens.
fn model_loss_and_grads_with(
    config: GptConfig,
    fused: bool,
    t: usize,
) -> (f64, Vec<(String, Tensor)>) {
    let mut model = Gpt::new(config, GPU).unwrap();
    model.set_fused_attention(fused);
    assert_eq!(model.attention_fused(DType::BF16), fused);
    let (ids, targets) = token_batch(t);
    let loss = {
        let _a = autocast(AmpDType::BF16);
        model.forward_loss(&ids, Some(&targets)).unwrap().1.unwrap()
    };
    loss.backward().unwrap();
    let grads = model
        .named_parameters()
        .into_iter()
        .map(|(n, p)| {
            (
                n,
                p.grad().expect("a gradient").to_dtype(DType::F64).unwrap(),
            )
        })
        .collect();
    (loss.item().unwrap(), grads)
}

/// The model's loss and every gradient agree between the fused and the composed attention.
fn assert_fused_matches_composed(config: GptConfig, t: usize) {
    let (fused_loss, fused) = model_loss_and_grads_with(config.clone(), true, t);
    let (composed_loss, composed) = model_loss_and_grads_with(config, false, t);
    assert!(
        (fused_loss - composed_loss).abs() < 1e-2,
        "T{t}: {fused_loss} vs {composed_loss}"
    );
    for ((name, a), (_, b)) in fused.iter().zip(&composed) {
        let e = relative_error(a, &b.to_device(CPU).unwrap());
        assert!(e < 5e-2, "T{t} {name}: {e:.2e}");
    }
}

#[test]
fn the_model_computes_the_same_with_the_fused_and_the_composed_attention() {
    let _l = lock();
    assert_fused_matches_composed(config(), 150);
}

#[test]
fn the_model_with_dropout_computes_the_same_fused_and_composed() {
    let _l = lock();
    let config = GptConfig {
        dropout: 0.2,
        ..config()
    };
    // At 150 the kernels draw per element; at 148, a multiple of 4, they share the draws.
    for t in [150, 148] {
        assert_fused_matches_composed(config.clone(), t);
    }
}

/// Loss and gradient bits of the model (bf16 autocast, dropout 0.2 on the fused attention's
/// probabilities) under a recomputation policy.
fn loss_and_grad_bits(policy: ferrograd::nn::Recompute) -> (u64, Vec<Vec<u64>>) {
    let config = GptConfig {
        dropout: 0.2,
        ..config()
    };
    let mut model = Gpt::new(config, GPU).unwrap();
    model.set_recompute(policy);
    assert!(model.attention_fused(DType::BF16));
    let t = 148;
    let (ids, targets) = token_batch(t);
    let loss = {
        let _a = autocast(AmpDType::BF16);
        model.forward_loss(&ids, Some(&targets)).unwrap().1.unwrap()
    };
    loss.backward().unwrap();
    let bits = |t: &Tensor| {
        t.to_dtype(DType::F64)
            .unwrap()
            .to_device(CPU)
            .unwrap()
            .to_vec::<f64>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<u64>>()
    };
    let grads = model
        .parameters()
        .iter()
        .map(|p| bits(&p.grad().expect("a gradient")))
        .collect();
    (loss.item().unwrap().to_bits(), grads)
}

/// Selective recomputation reuses each block's kept attention output (the same dropout mask,
/// the same log-sum-exp): loss and gradients bit for bit those of every:1, which runs the
/// attention's forward again.
#[test]
fn selective_recomputation_with_dropout_changes_no_bit() {
    use ferrograd::nn::Recompute;
    let _l = lock();
    let every = loss_and_grad_bits(Recompute::Every(1));
    assert_eq!(loss_and_grad_bits(Recompute::Selective(1)), every);
}

/// Recomputing every block (whose recomputed forward skips the MLP's output product and the
/// last residual add: values nothing reads) gives the loss and gradients of the plain step
/// bit for bit, dropout included.
#[test]
fn every_block_recomputed_changes_no_bit() {
    use ferrograd::nn::Recompute;
    let _l = lock();
    let off = loss_and_grad_bits(Recompute::Off);
    assert_eq!(loss_and_grad_bits(Recompute::Every(1)), off);
}
