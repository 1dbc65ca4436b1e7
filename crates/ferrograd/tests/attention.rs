//! Fused causal attention on the CPU: `Tensor::causal_attention` against PyTorch's
//! `scaled_dot_product_attention(is_causal=True)` (tests/fixtures/attention.safetensors,
//! written by tools/make_attention_fixtures.py), against finite differences in f64, against
//! the composed matmul–softmax–matmul path inside the GPT model, the memory it keeps for
//! backward (to the byte: qkv, the output and one log-sum-exp per query, never the scores),
//! and the errors a user can run into.
//!
//! The allocators are process-wide and tests run on parallel threads, so every test here
//! takes `LOCK` first.

mod common;

use std::sync::{Mutex, MutexGuard};

use common::fixture_file::{self, FixtureFile};
use common::{assert_close, gradcheck, randn64};
use ferrograd::memory::{self, Category};
use ferrograd::nn::{Gpt, GptConfig, Module};
use ferrograd::ops::causal_attention_supported;
use ferrograd::{DType, Device, Tensor};

const CPU: Device = Device::Cpu;

static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn fixtures() -> &'static FixtureFile {
    fixture_file::open(
        "attention.safetensors",
        "ferrograd-attention-fixtures",
        "make_attention_fixtures.py",
    )
}

fn n_head(case: &str) -> usize {
    let meta: serde_json::Value = serde_json::from_str(fixtures().meta(case)).unwrap();
    meta["n_head"].as_u64().unwrap() as usize
}

/// Forward and backward of one fixture case, compared value by value.
fn check_case(case: &str, atol: f64, rtol: f64) {
    let f = fixtures();
    let qkv = f.get(&format!("{case}.qkv")).requires_grad_(true).unwrap();
    let gout = f.get(&format!("{case}.gout"));
    let out = qkv.causal_attention(n_head(case)).unwrap();
    assert_close(
        &format!("{case} out"),
        &out,
        &f.get(&format!("{case}.out")),
        atol,
        rtol,
    );
    out.mul(&gout)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_close(
        &format!("{case} gqkv"),
        &qkv.grad().expect("qkv has a gradient"),
        &f.get(&format!("{case}.gqkv")),
        atol,
        rtol,
    );
}

#[test]
fn matches_pytorch_within_one_key_tile() {
    let _l = lock();
    check_case("small_f64", 1e-12, 1e-10);
}

#[test]
fn matches_pytorch_over_several_key_tiles() {
    let _l = lock();
    check_case("tiles_f64", 1e-12, 1e-10);
    check_case("one_head_f64", 1e-12, 1e-10);
}

#[test]
fn matches_pytorch_in_f32_at_gpt_head_width() {
    let _l = lock();
    check_case("gpt_f32", 2e-5, 1e-4);
}

#[test]
fn gradients_match_finite_differences() {
    let _l = lock();
    // B 2, T 5, 2 heads of 3: qkv (2, 5, 18).
    gradcheck(
        "causal_attention",
        |x| x[0].causal_attention(2),
        &[randn64(&[2, 5, 18], 11)],
    );
    // T past one key tile (64), one head of 2.
    gradcheck(
        "causal_attention tiles",
        |x| x[0].causal_attention(1),
        &[randn64(&[1, 70, 6], 12)],
    );
}

#[test]
fn a_strided_input_is_read_as_its_values() {
    let _l = lock();
    // (T, B, 3C) transposed to (B, T, 3C): not contiguous.
    let x = randn64(&[6, 2, 12], 3).transpose(0, 1).unwrap();
    let got = x.causal_attention(2).unwrap();
    let want = x.contiguous().unwrap().causal_attention(2).unwrap();
    assert_close("strided", &got, &want, 0.0, 0.0);
}

#[test]
fn half_precision_heads_compute_in_f32() {
    let _l = lock();
    let x = randn64(&[2, 40, 24], 5);
    let want = x.causal_attention(2).unwrap();
    for dtype in [DType::F16, DType::BF16] {
        let got = x
            .to_dtype(dtype)
            .unwrap()
            .causal_attention(2)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        // The inputs' rounding dominates: 2⁻⁸ relative for bf16.
        assert_close(&format!("{dtype}"), &got, &want, 2e-2, 2e-2);
    }
}

/// A model small enough for the test, with T past one key tile.
fn config() -> GptConfig {
    GptConfig {
        vocab_size: 31,
        block_size: 80,
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        dropout: 0.0,
        bias: true,
        seed: 3,
    }
}

fn batch() -> (Tensor, Tensor) {
    let ids: Vec<i64> = (0..2 * 80).map(|i| (i * 7 + 3) % 31).collect();
    let targets: Vec<i64> = ids.iter().map(|&i| (i * 5 + 1) % 31).collect();
    (
        Tensor::from_vec(ids, &[2, 80], CPU).unwrap(),
        Tensor::from_vec(targets, &[2, 80], CPU).unwrap(),
    )
}

/// The loss and every parameter's gradient with the fused kernel on or off.
fn loss_and_grads(fused: bool) -> (f64, Vec<(String, Tensor)>) {
    let mut model = Gpt::new(config(), CPU).unwrap();
    model.set_fused_attention(fused);
    assert_eq!(model.attention_fused(DType::F32), fused);
    let (ids, targets) = batch();
    let (_, loss) = model.forward_loss(&ids, Some(&targets)).unwrap();
    let loss = loss.unwrap();
    loss.backward().unwrap();
    let grads = model
        .named_parameters()
        .into_iter()
        .map(|(n, p)| (n, p.grad().expect("every parameter has a gradient")))
        .collect();
    (loss.item().unwrap(), grads)
}

#[test]
fn the_model_learns_the_same_with_the_fused_and_the_composed_attention() {
    let _l = lock();
    let (fused_loss, fused) = loss_and_grads(true);
    let (composed_loss, composed) = loss_and_grads(false);
    assert!(
        (fused_loss - composed_loss).abs() < 1e-6,
        "{fused_loss} vs {composed_loss}"
    );
    for ((name, a), (_, b)) in fused.iter().zip(&composed) {
        assert_close(name, a, b, 1e-6, 1e-4);
    }
}

#[test]
fn backward_keeps_the_output_and_one_log_sum_exp_per_query_not_the_scores() {
    let _l = lock();
    let (b, t, h, d) = (2, 128, 4, 8);
    let c = h * d;
    let qkv = Tensor::randn(&[b, t, 3 * c], DType::F32, CPU)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let before = memory::memory_allocated(CPU).unwrap();
    let saved_before = memory::allocator(CPU)
        .unwrap()
        .by_category()
        .get(Category::SavedActivation);
    let out = qkv.causal_attention(h).unwrap();
    let grown = memory::memory_allocated(CPU).unwrap() - before;
    // The output (B, T, C) and lse (B, H, T) in f32; qkv is saved as itself (no copy).
    let expected = (b * t * c * 4 + b * h * t * 4) as u64;
    assert_eq!(grown, expected);
    let saved = memory::allocator(CPU)
        .unwrap()
        .by_category()
        .get(Category::SavedActivation)
        - saved_before;
    // Composed attention would keep the (B, H, T, T) probabilities: 524,288 bytes here.
    assert!(saved <= expected, "saved {saved} bytes");
    assert!((b * h * t * t * 4) as u64 > 10 * expected);
    drop(out);
    assert_eq!(memory::memory_allocated(CPU).unwrap(), before);
}

#[test]
fn bad_shapes_are_errors_that_say_what_to_pass() {
    let _l = lock();
    let x = Tensor::zeros(&[2, 3, 12], DType::F32, CPU).unwrap();
    let msg = x.causal_attention(5).unwrap_err().to_string();
    assert!(msg.contains("multiple of 3 · n_head"), "{msg}");
    let msg = x.causal_attention(0).unwrap_err().to_string();
    assert!(msg.contains("multiple of 3 · n_head"), "{msg}");
    let msg = Tensor::zeros(&[6, 12], DType::F32, CPU)
        .unwrap()
        .causal_attention(2)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("(B, T, 3C)"), "{msg}");
    let ints = Tensor::zeros(&[2, 3, 12], DType::I64, CPU).unwrap();
    assert!(ints.causal_attention(2).is_err());
    assert!(causal_attention_supported(CPU, DType::F32, 64));
    assert!(!causal_attention_supported(CPU, DType::I64, 64));
}

#[test]
fn an_empty_sequence_gives_an_empty_output() {
    let _l = lock();
    let x = Tensor::zeros(&[2, 0, 12], DType::F32, CPU).unwrap();
    let out = x.causal_attention(2).unwrap();
    assert_eq!(out.shape(), &[2, 0, 4]);
}

#[test]
fn the_module_reports_which_path_runs() {
    let _l = lock();
    let mut model = Gpt::new(config(), CPU).unwrap();
    assert!(model.attention_fused(DType::F32));
    assert!(model.attention_fused(DType::F64));
    model.set_fused_attention(false);
    assert!(!model.attention_fused(DType::F32));
    let mut dropped = config();
    dropped.dropout = 0.1;
    let mut model = Gpt::new(dropped, CPU).unwrap();
    model.train(true);
    // Attention dropout needs the probabilities: the composed path runs.
    assert!(!model.attention_fused(DType::F32));
    model.train(false);
    assert!(model.attention_fused(DType::F32));
}
