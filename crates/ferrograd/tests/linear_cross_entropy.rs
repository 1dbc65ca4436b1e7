//! `linear_cross_entropy`: the head and its loss in row chunks, never holding all logits.
//! One chunk is the composition `x.linear(w, None)?.cross_entropy(t, -100)` bit for bit
//! (loss, dx, dw; f32, bf16, f64, bf16 autocast); several chunks equal it to rounding, with
//! a chunk whose targets are all ignored; the loss gradient scales both gradients; the
//! forward's peak holds one chunk's logits, not all; bad arguments are typed errors.

use std::sync::{Mutex, MutexGuard};

use ferrograd::amp::{AmpDType, autocast};
use ferrograd::memory::{max_memory_allocated, memory_allocated, reset_peak_memory_stats};
use ferrograd::{DType, Device, Generator, Tensor};

const CPU: Device = Device::Cpu;
const N: usize = 12;
const C: usize = 8;
const V: usize = 37;

/// The allocator is process-wide: each test runs alone so the memory test sees its own bytes.
static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn leaf(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    Tensor::randn_with(shape, DType::F32, CPU, &mut Generator::new(seed))
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .requires_grad_(true)
        .unwrap()
}

/// Targets (3, 4) with two ignored: rows 1 and 2 (both in the first chunk of four rows).
fn targets() -> Tensor {
    let t: Vec<i64> = (0..N as i64)
        .map(|i| {
            if i == 1 || i == 2 {
                -100
            } else {
                i * 5 % V as i64
            }
        })
        .collect();
    Tensor::from_vec(t, &[3, 4], CPU).unwrap()
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

/// (loss, dx, dw) of one way of computing the loss, after `loss · scale` is backpropagated.
fn run(dtype: DType, w_dtype: DType, chunk_bytes: Option<usize>, scale: f64) -> [Vec<f64>; 3] {
    let x = leaf(&[3, 4, C], dtype, 1);
    let w = leaf(&[V, C], w_dtype, 2);
    let t = targets();
    let loss = match chunk_bytes {
        Some(b) => x.linear_cross_entropy_in_chunks(&w, &t, -100, b).unwrap(),
        None => x.linear(&w, None).unwrap().cross_entropy(&t, -100).unwrap(),
    };
    loss.mul_scalar(scale).unwrap().backward().unwrap();
    [
        f64s(&loss),
        f64s(&x.grad().unwrap()),
        f64s(&w.grad().unwrap()),
    ]
}

const ONE_CHUNK: Option<usize> = Some(1 << 30);

#[test]
fn one_chunk_is_the_composition_bit_for_bit() {
    let _alone = lock();
    for dtype in [DType::F32, DType::BF16, DType::F64] {
        let want = run(dtype, dtype, None, 1.0);
        let got = run(dtype, dtype, ONE_CHUNK, 1.0);
        for (i, name) in ["loss", "dx", "dw"].iter().enumerate() {
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got[i]), bits(&want[i]), "{dtype:?} {name}");
        }
    }
    // Under bf16 autocast: f32 weight cast as linear casts it, the loss in f32. The linear
    // writes the f32 weight's gradient in f32; the fused op keeps its dw in bf16 (it holds dw
    // from the forward on), so its dw is the composition's rounded to bf16.
    let region = |chunks| {
        let _amp = autocast(AmpDType::BF16);
        run(DType::BF16, DType::F32, chunks, 1.0)
    };
    let (got, want) = (region(ONE_CHUNK), region(None));
    assert_eq!(got[..2], want[..2], "loss and dx");
    // The values are f32s: rounded from f32, as the GEMM rounds.
    let to_bf16 = |v: &[f64]| {
        v.iter()
            .map(|&x| half::bf16::from_f32(x as f32).to_f64())
            .collect::<Vec<_>>()
    };
    assert_eq!(got[2], to_bf16(&want[2]), "dw");
    assert_ne!(
        got[2], want[2],
        "the composition's dw is not rounded to bf16"
    );
}

#[track_caller]
fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

#[test]
fn several_chunks_equal_the_composition_to_rounding() {
    let _alone = lock();
    let want = run(DType::F32, DType::F32, None, 1.0);
    // Chunks of 1, 2 and 4 rows (a chunk of 4 rows is 4·37·4 bytes of logits); rows 1-2 are
    // ignored, so one chunk of one row has no counted target, and with one-row chunks two do.
    for rows in [1, 2, 4] {
        let got = run(DType::F32, DType::F32, Some(rows * V * 4), 1.0);
        for (i, name) in ["loss", "dx", "dw"].iter().enumerate() {
            assert_close(
                &got[i],
                &want[i],
                1e-6,
                &format!("{rows}-row chunks: {name}"),
            );
        }
    }
}

#[test]
fn the_loss_gradient_scales_both_gradients() {
    let _alone = lock();
    let want = run(DType::F32, DType::F32, None, 3.0);
    let got = run(DType::F32, DType::F32, Some(4 * V * 4), 3.0);
    assert_close(&got[1], &want[1], 1e-6, "dx");
    assert_close(&got[2], &want[2], 1e-6, "dw");
}

#[test]
fn all_ignored_is_nan_and_no_gradient_moves() {
    let _alone = lock();
    let x = leaf(&[N, C], DType::F32, 1);
    let w = leaf(&[V, C], DType::F32, 2);
    let t = Tensor::from_vec(vec![-100i64; N], &[N], CPU).unwrap();
    let loss = x
        .linear_cross_entropy_in_chunks(&w, &t, -100, 4 * V * 4)
        .unwrap();
    assert!(loss.item().unwrap().is_nan());
    loss.backward().unwrap();
    assert!(f64s(&x.grad().unwrap()).iter().all(|&g| g == 0.0));
}

#[test]
fn the_forward_holds_one_chunk_of_logits_not_all() {
    let _alone = lock();
    let (rows, v) = (256, 1000);
    let x = leaf(&[rows, C], DType::F32, 1);
    let w = leaf(&[v, C], DType::F32, 2);
    let t = Tensor::from_vec((0..rows as i64).collect(), &[rows], CPU).unwrap();
    let logits_bytes = (rows * v * 4) as u64;
    let peak_of = |f: &dyn Fn() -> Tensor| {
        let base = memory_allocated(CPU).unwrap();
        reset_peak_memory_stats(CPU).unwrap();
        let loss = f();
        let peak = max_memory_allocated(CPU).unwrap() - base;
        drop(loss);
        peak
    };
    let whole = peak_of(&|| x.linear(&w, None).unwrap().cross_entropy(&t, -100).unwrap());
    let chunked = peak_of(&|| {
        x.linear_cross_entropy_in_chunks(&w, &t, -100, logits_bytes as usize / 8)
            .unwrap()
    });
    assert!(
        whole >= logits_bytes,
        "the composition holds all logits: {whole}"
    );
    // One eighth of the logits at a time, plus dx and dw (kept for backward) and scalars.
    let kept = ((rows + v) * C * 4) as u64;
    assert!(
        chunked <= logits_bytes / 8 + kept + 4096,
        "chunked peak {chunked} B; logits {logits_bytes} B, dx + dw {kept} B"
    );
}

#[test]
fn bad_arguments_are_typed_errors() {
    let _alone = lock();
    let x = leaf(&[N, C], DType::F32, 1);
    let w = leaf(&[V, C], DType::F32, 2);
    let t = Tensor::from_vec(vec![0i64; N], &[N], CPU).unwrap();
    let short = Tensor::from_vec(vec![0i64; N - 1], &[N - 1], CPU).unwrap();
    assert!(x.linear_cross_entropy(&w, &short, -100).is_err());
    let wide = leaf(&[V, C + 1], DType::F32, 3);
    assert!(x.linear_cross_entropy(&wide, &t, -100).is_err());
    let f = t.to_dtype(DType::F32).unwrap();
    assert!(x.linear_cross_entropy(&w, &f, -100).is_err());
    let out_of_range = Tensor::from_vec(vec![V as i64; N], &[N], CPU).unwrap();
    assert!(x.linear_cross_entropy(&w, &out_of_range, -100).is_err());
}

#[test]
fn the_gpt_training_loss_is_forward_loss_bit_for_bit() {
    use ferrograd::nn::{Gpt, GptConfig, Module};
    let _alone = lock();
    let ids: Vec<i64> = (0..2 * 16).map(|i| (i * 7 % 65) as i64).collect();
    let tg: Vec<i64> = (0..2 * 16).map(|i| (i * 11 % 65) as i64).collect();
    let ids = Tensor::from_vec(ids, &[2, 16], CPU).unwrap();
    let tg = Tensor::from_vec(tg, &[2, 16], CPU).unwrap();
    let step = |chunked: bool| {
        let gpt = Gpt::new(GptConfig::tiny(), CPU).unwrap();
        let loss = if chunked {
            gpt.loss(&ids, &tg).unwrap()
        } else {
            gpt.forward_loss(&ids, Some(&tg)).unwrap().1.unwrap()
        };
        loss.backward().unwrap();
        let grads: Vec<Vec<f64>> = gpt
            .parameters()
            .iter()
            .map(|p| f64s(&p.grad().unwrap()))
            .collect();
        (f64s(&loss), grads)
    };
    assert_eq!(step(true), step(false));
}

/// GPT-2's tied head planned for a GPU (whose head GEMMs pad the vocabulary to 50304): the
/// backward scales dw over its whole padded block in place and hands on the first 50257 rows,
/// so no slice temporary of dw's size is allocated; the one (V, C) f32 buffer the cast back to
/// the parameter makes is there.
#[test]
fn the_padded_weight_gradient_is_scaled_in_place() {
    use ferrograd::memory::recorder::Action;
    use ferrograd::plan::{PlanOptions, Target, plan};
    let _g = lock();
    let (v, c) = (50257, 768);
    let mut backward_allocs = Vec::new();
    let p = plan(
        Target::Cuda { capacity: 80 << 30 },
        PlanOptions { record: true },
        |dev| {
            let wte = Tensor::zeros(&[v, c], DType::F32, dev)?.requires_grad_(true)?;
            let ids = Tensor::zeros(&[8, 1024], DType::I64, dev)?;
            let loss = {
                let _amp = autocast(AmpDType::BF16);
                wte.embedding(&ids)?
                    .linear_cross_entropy(&wte, &ids, -100)?
            };
            loss.backward()
        },
    )
    .unwrap();
    let events = p.recording.unwrap().events;
    // The backward's allocations: those after the last of the forward's dw GEMM outputs.
    let start = events
        .iter()
        .rposition(|e| e.action == Action::Alloc && e.origin.op == "cross_entropy")
        .unwrap();
    for e in &events[start..] {
        if e.action == Action::Alloc {
            backward_allocs.push((e.origin.op, e.requested));
        }
    }
    let dw_bf16 = (v * c * 2) as u64;
    assert!(
        !backward_allocs.iter().any(|&(_, b)| b == dw_bf16),
        "a bf16 temporary of dw's size: {backward_allocs:?}"
    );
    assert!(
        backward_allocs.contains(&("to_dtype", (v * c * 4) as u64)),
        "{backward_allocs:?}"
    );
}

/// A weight used both as an embedding and as the head (GPT's tied weights): its gradient is
/// the sum of both uses' gradients, as two untied copies of it get them.
#[test]
fn a_tied_weight_gets_both_uses_gradients() {
    let _alone = lock();
    let ids = Tensor::from_vec(
        (0..N as i64).map(|i| i * 3 % V as i64).collect(),
        &[3, 4],
        CPU,
    )
    .unwrap();
    let loss_of = |emb: &Tensor, head: &Tensor| {
        let x = emb.embedding(&ids).unwrap().tanh().unwrap();
        let loss = x.linear_cross_entropy(head, &targets(), -100).unwrap();
        loss.backward().unwrap();
    };
    let tied = leaf(&[V, C], DType::F32, 2);
    loss_of(&tied, &tied);
    let (emb, head) = (leaf(&[V, C], DType::F32, 2), leaf(&[V, C], DType::F32, 2));
    loss_of(&emb, &head);
    let both: Vec<f64> = f64s(&emb.grad().unwrap())
        .iter()
        .zip(f64s(&head.grad().unwrap()))
        .map(|(a, b)| a + b)
        .collect();
    assert_close(&f64s(&tied.grad().unwrap()), &both, 1e-6, "tied dw");
}

/// The lookup's backward adds its rows into the head's pending (V, C) gradient in place: the
/// step allocates two blocks of the weight's size, the weight and its one gradient (no second
/// gradient for the lookup, nor the sum of two).
#[test]
fn a_tied_embedding_adds_its_gradient_into_the_heads() {
    use ferrograd::memory::recorder::Action;
    use ferrograd::plan::{PlanOptions, Target, plan};
    let _g = lock();
    let (v, c) = (4096, 64);
    let p = plan(Target::Cpu, PlanOptions { record: true }, |dev| {
        let w = Tensor::zeros(&[v, c], DType::F32, dev)?.requires_grad_(true)?;
        let ids = Tensor::zeros(&[2, 8], DType::I64, dev)?;
        let loss = w.embedding(&ids)?.linear_cross_entropy(&w, &ids, -100)?;
        loss.backward()
    })
    .unwrap();
    let weight_sized: Vec<_> = p
        .recording
        .unwrap()
        .events
        .iter()
        .filter(|e| e.action == Action::Alloc && e.requested == (v * c * 4) as u64)
        .map(|e| e.origin.op)
        .collect();
    assert_eq!(weight_sized.len(), 2, "(V, C) blocks: {weight_sized:?}");
}
