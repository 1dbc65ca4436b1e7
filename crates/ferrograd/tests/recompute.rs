//! Activation recomputation: the same gradients as the plain graph, fewer saved bytes, and
//! dropout that repeats exactly in the recomputed forward.

use std::sync::{Arc, Mutex};

use ferrograd::autograd::{Segment, checkpoint_activations};
use ferrograd::{Category, DType, Device, Tensor, manual_seed, memory};

const CPU: Device = Device::Cpu;
static LOCK: Mutex<()> = Mutex::new(());

fn param(shape: &[usize], seed: u64) -> Tensor {
    let t =
        Tensor::randn_with(shape, DType::F64, CPU, &mut ferrograd::Generator::new(seed)).unwrap();
    t.set_category(Category::Parameter);
    t.requires_grad_(true).unwrap()
}

/// relu(x W1ᵀ) W2ᵀ with dropout in between, as one segment.
fn mlp(w1: &Tensor, w2: &Tensor, p: f64) -> Segment {
    let (w1, w2) = (w1.clone(), w2.clone());
    Arc::new(move |x: &[Tensor]| {
        x[0].linear(&w1, None)?
            .relu()?
            .dropout_default(p, true)?
            .linear(&w2, None)
    })
}

fn grads(ps: &[&Tensor]) -> Vec<Vec<f64>> {
    ps.iter()
        .map(|p| p.grad().unwrap().to_vec::<f64>().unwrap())
        .collect()
}

fn run(recompute: bool, x_requires_grad: bool, p: f64) -> (Vec<Vec<f64>>, Option<Vec<f64>>) {
    let (w1, w2) = (param(&[16, 8], 1), param(&[8, 16], 2));
    let x =
        Tensor::randn_with(&[4, 8], DType::F64, CPU, &mut ferrograd::Generator::new(3)).unwrap();
    let x = if x_requires_grad {
        x.requires_grad_(true).unwrap()
    } else {
        x
    };
    manual_seed(7);
    let f = mlp(&w1, &w2, p);
    let out = if recompute {
        checkpoint_activations(f, std::slice::from_ref(&x)).unwrap()
    } else {
        f(std::slice::from_ref(&x)).unwrap()
    };
    out.tanh().unwrap().sum_all().unwrap().backward().unwrap();
    (
        grads(&[&w1, &w2]),
        x.grad().map(|g| g.to_vec::<f64>().unwrap()),
    )
}

#[test]
fn same_gradients_as_the_plain_graph() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    assert_eq!(run(true, true, 0.0), run(false, true, 0.0));
}

#[test]
fn parameters_get_gradients_when_the_input_needs_none() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (with, x_grad) = run(true, false, 0.0);
    assert_eq!(with, run(false, false, 0.0).0);
    assert!(x_grad.is_none());
}

#[test]
fn dropout_repeats_exactly_in_the_recomputed_forward() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    assert_eq!(run(true, true, 0.5), run(false, true, 0.5));
}

#[test]
fn inner_activations_are_not_kept_between_forward_and_backward() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (w1, w2) = (param(&[256, 64], 1), param(&[64, 256], 2));
    let x = Tensor::randn(&[32, 64], DType::F64, CPU).unwrap();
    let saved = |recompute: bool| {
        let before = memory::memory_by_category(CPU)
            .unwrap()
            .get(Category::SavedActivation);
        let f = mlp(&w1, &w2, 0.0);
        let out = if recompute {
            checkpoint_activations(f, std::slice::from_ref(&x)).unwrap()
        } else {
            f(std::slice::from_ref(&x)).unwrap()
        };
        let held = memory::memory_by_category(CPU)
            .unwrap()
            .get(Category::SavedActivation)
            - before;
        drop(out);
        held
    };
    // Plain: the (32, 256) hidden layer is saved (relu output, read by relu and by the second
    // linear). Recomputed: nothing inside the segment is saved; x is an input, not an activation.
    assert_eq!(saved(false), 32 * 256 * 8);
    assert_eq!(saved(true), 0);
}

// ---- freezing ---------------------------------------------------------------------------

#[test]
fn a_frozen_first_layer_saves_nothing_and_gets_no_gradient() {
    use ferrograd::nn::{Linear, Module, Relu, Sequential};
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let mut g = ferrograd::Generator::new(0);
    let (d, b) = (64usize, 16usize);
    let model = Sequential::new()
        .push(Linear::new(d, d, true, CPU, &mut g).unwrap())
        .push(Relu)
        .push(Linear::new(d, d, true, CPU, &mut g).unwrap());
    let frozen = ferrograd::train::freeze(&model, "0.*").unwrap();
    assert_eq!(frozen, vec!["0.weight", "0.bias"]);
    assert!(
        ferrograd::train::freeze(&model, "9.*").is_err(),
        "a pattern that matches nothing is an error"
    );
    let x = Tensor::randn(&[b, d], DType::F32, CPU).unwrap();
    let before = memory::memory_by_category(CPU)
        .unwrap()
        .get(Category::SavedActivation);
    let out = model.forward(&x).unwrap();
    // Only the ReLU output is saved (for ReLU and the second layer's weight gradient); the
    // frozen layer keeps neither x (its weight needs no gradient) nor its weight.
    let saved = memory::memory_by_category(CPU)
        .unwrap()
        .get(Category::SavedActivation)
        - before;
    assert_eq!(saved, (b * d * 4) as u64);
    out.sum_all().unwrap().backward().unwrap();
    let params = model.named_parameters();
    assert!(params[0].1.grad().is_none() && params[1].1.grad().is_none());
    assert!(params[2].1.grad().is_some() && params[3].1.grad().is_some());
}

mod gpt_policy {
    //! The model-level policy: `Gpt::set_recompute(Recompute::Every(k))`.
    use super::{CPU, LOCK};
    use ferrograd::nn::{Gpt, GptConfig, Module, Recompute};
    use ferrograd::{DType, Tensor, memory};

    fn config(dropout: f64) -> GptConfig {
        GptConfig {
            n_layer: 4,
            dropout,
            ..GptConfig::tiny()
        }
    }

    fn batch(b: usize, t: usize) -> (Tensor, Tensor) {
        let ids: Vec<i64> = (0..b * t).map(|i| (i * 7 % 65) as i64).collect();
        let tg: Vec<i64> = (0..b * t).map(|i| (i * 11 % 65) as i64).collect();
        (
            Tensor::from_vec(ids, &[b, t], CPU).unwrap(),
            Tensor::from_vec(tg, &[b, t], CPU).unwrap(),
        )
    }

    /// The loss and every gradient after one backward, and the bytes alive between forward
    /// and backward.
    fn step(policy: Recompute, dropout: f64) -> (f32, Vec<Vec<f32>>, u64) {
        let mut gpt = Gpt::new(config(dropout), CPU).unwrap();
        gpt.set_recompute(policy);
        let (ids, tg) = batch(2, 32);
        let base = memory::memory_allocated(CPU).unwrap();
        let (_, loss) = gpt.forward_loss(&ids, Some(&tg)).unwrap();
        let loss = loss.unwrap();
        let held = memory::memory_allocated(CPU).unwrap() - base;
        loss.backward().unwrap();
        let grads = gpt
            .parameters()
            .iter()
            .map(|p| p.grad().unwrap().to_vec::<f32>().unwrap())
            .collect();
        (loss.item().unwrap() as f32, grads, held)
    }

    #[test]
    fn policy_parses_and_prints() {
        assert_eq!("off".parse::<Recompute>().unwrap(), Recompute::Off);
        assert_eq!("every:1".parse::<Recompute>().unwrap(), Recompute::Every(1));
        assert_eq!(Recompute::Every(3).to_string(), "every:3");
        for bad in ["every:0", "every", "all", "every:x", "sometimes:2"] {
            let e = bad.parse::<Recompute>().unwrap_err().to_string();
            assert!(e.contains("every:K"), "{bad}: {e}");
        }
        assert!(Recompute::Every(2).applies_to(0) && !Recompute::Every(2).applies_to(1));
        assert!(!Recompute::Off.applies_to(0));
        assert_eq!("gelu".parse::<Recompute>().unwrap(), Recompute::Gelu);
        assert_eq!(Recompute::Gelu.to_string(), "gelu");
        assert!(
            !Recompute::Gelu.applies_to(0),
            "gelu recomputes no whole block"
        );
        assert_eq!(
            "selective:2".parse::<Recompute>().unwrap(),
            Recompute::Selective(2)
        );
        assert_eq!(Recompute::Selective(1).to_string(), "selective:1");
        assert!(Recompute::Selective(2).applies_to(2) && !Recompute::Selective(2).applies_to(1));
        assert!(
            Recompute::Selective(1).keeps_attention() && !Recompute::Every(1).keeps_attention()
        );
        let e = "selective:0".parse::<Recompute>().unwrap_err().to_string();
        assert!(e.contains("selective:K"), "{e}");
    }

    /// Selective recomputation keeps each block's attention output (B, T, C) and log-sum-exp
    /// (B, H, T) from the forward, exactly those bytes more than every:1, and the recomputed
    /// forward reuses them: the same loss and gradients bit for bit.
    #[test]
    fn selective_recomputation_keeps_the_attention_output_and_changes_no_bit() {
        let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let cfg = config(0.0);
        let (b, t, c, h) = (2, 32, cfg.n_embd, cfg.n_head);
        let (loss, grads, every1) = step(Recompute::Every(1), 0.0);
        let (l, g, selective) = step(Recompute::Selective(1), 0.0);
        assert_eq!(l, loss);
        assert_eq!(g, grads);
        // f32 output and f32 log-sum-exp per block.
        let per_block = (b * t * c * 4 + b * h * t * 4) as u64;
        assert_eq!(selective - every1, cfg.n_layer as u64 * per_block);
        let (_, _, selective2) = step(Recompute::Selective(2), 0.0);
        let (_, _, every2) = step(Recompute::Every(2), 0.0);
        assert_eq!(
            selective2 - every2,
            2 * per_block,
            "blocks 0 and 2 keep theirs"
        );
    }

    /// The attention outputs that backward allocates: every:1 runs each block's attention
    /// forward again, selective:1 runs none of them.
    #[test]
    fn selective_recomputation_runs_no_attention_forward_in_backward() {
        use ferrograd::memory::recorder::{self, Action, RecorderConfig};
        let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let cfg = config(0.0);
        let out_bytes = (2 * 32 * cfg.n_embd * 4) as u64;
        let forwards_in_backward = |policy: Recompute| {
            let mut gpt = Gpt::new(cfg.clone(), CPU).unwrap();
            gpt.set_recompute(policy);
            let (ids, tg) = batch(2, 32);
            let (_, loss) = gpt.forward_loss(&ids, Some(&tg)).unwrap();
            recorder::start(RecorderConfig { capacity: 1 << 16 }).unwrap();
            loss.unwrap().backward().unwrap();
            let rec = recorder::stop().unwrap();
            rec.events
                .iter()
                .filter(|e| {
                    e.action == Action::Alloc
                        && e.origin.op == "causal_attention"
                        && e.requested == out_bytes
                })
                .count()
        };
        assert_eq!(forwards_in_backward(Recompute::Every(1)), cfg.n_layer);
        assert_eq!(forwards_in_backward(Recompute::Selective(1)), 0);
        assert_eq!(forwards_in_backward(Recompute::Every(2)), cfg.n_layer / 2);
        assert_eq!(forwards_in_backward(Recompute::Selective(2)), 0);
    }

    /// The recomputed forward is run for its graph alone: each block's MLP output product
    /// and last residual add record their nodes on one-element stand-ins instead of
    /// computing (B, T, C) values nothing reads; the gradients are unchanged (the tests
    /// above compare them bit for bit).
    #[test]
    fn the_recomputed_forward_skips_each_blocks_unread_product_and_add() {
        use ferrograd::memory::recorder::{self, Action, RecorderConfig};
        let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let cfg = config(0.0);
        let stream_bytes = (2 * 32 * cfg.n_embd * 4) as u64;
        let mut gpt = Gpt::new(cfg.clone(), CPU).unwrap();
        gpt.set_recompute(Recompute::Every(1));
        let (ids, tg) = batch(2, 32);
        let (_, loss) = gpt.forward_loss(&ids, Some(&tg)).unwrap();
        recorder::start(RecorderConfig { capacity: 1 << 16 }).unwrap();
        loss.unwrap().backward().unwrap();
        let rec = recorder::stop().unwrap();
        let allocs = |op: &str, module: Option<&str>, bytes: Option<u64>| {
            rec.events
                .iter()
                .filter(|e| e.action == Action::Alloc && e.origin.op == op)
                .filter(|e| module.is_none_or(|m| rec.module_name(e.origin.module) == m))
                .filter(|e| bytes.is_none_or(|b| e.requested == b))
                .count()
        };
        // Each recomputed block: its attention's projection runs, its MLP's does not.
        assert_eq!(
            allocs("linear", Some("attn"), Some(stream_bytes)),
            cfg.n_layer
        );
        assert_eq!(allocs("linear", Some("mlp"), Some(stream_bytes)), 0);
        // The only add left is the one the second norm reads.
        assert_eq!(allocs("add", None, None), cfg.n_layer);
        assert_eq!(allocs("add", Some("ln_2"), Some(stream_bytes)), cfg.n_layer);
        assert_eq!(allocs("skipped", None, Some(4)), 2 * cfg.n_layer);
    }

    /// Under autocast a recomputed block casts its eight weights and biases together as each
    /// pass starts (one launch on the GPU), in the block's scope, not one by one inside its
    /// attention and MLP as their ops reach them.
    #[test]
    fn a_recomputed_block_casts_its_weights_ahead_in_each_pass() {
        use ferrograd::amp::{AmpDType, autocast};
        use ferrograd::memory::recorder::{self, Action, RecorderConfig, Recording};
        let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let cfg = config(0.0);
        let mut gpt = Gpt::new(cfg.clone(), CPU).unwrap();
        gpt.set_recompute(Recompute::Every(1));
        let (ids, tg) = batch(2, 32);
        let casts_in = |rec: &Recording, module: &str| {
            rec.events
                .iter()
                .filter(|e| e.action == Action::Alloc && e.origin.op == "to_dtype")
                .filter(|e| rec.module_name(e.origin.module) == module)
                .count()
        };
        recorder::start(RecorderConfig { capacity: 1 << 16 }).unwrap();
        let loss = {
            let _a = autocast(AmpDType::BF16);
            gpt.forward_loss(&ids, Some(&tg)).unwrap().1.unwrap()
        };
        let forward = recorder::stop().unwrap();
        recorder::start(RecorderConfig { capacity: 1 << 16 }).unwrap();
        loss.backward().unwrap();
        let backward = recorder::stop().unwrap();
        for i in 0..cfg.n_layer {
            assert_eq!(casts_in(&forward, &format!("transformer.h.{i}")), 8);
        }
        for rec in [&forward, &backward] {
            assert_eq!(casts_in(rec, "attn") + casts_in(rec, "mlp"), 0);
        }
    }

    #[test]
    fn gelu_recomputation_frees_each_mlps_gelu_output_and_changes_no_bit() {
        let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let (b, t, cfg) = (2, 32, config(0.1));
        let (loss, grads, off) = step(Recompute::Off, 0.1);
        let (l, g, gelu) = step(Recompute::Gelu, 0.1);
        assert_eq!(l, loss);
        assert_eq!(g, grads);
        // Each block's (B, T, 4C) f32 GELU output is no longer held until backward.
        let gelu_out = (b * t * 4 * cfg.n_embd * 4) as u64;
        assert_eq!(off - gelu, cfg.n_layer as u64 * gelu_out);
    }

    #[test]
    fn same_loss_and_gradients_with_dropout_as_without_recomputation() {
        let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let (loss, grads, _) = step(Recompute::Off, 0.1);
        for policy in [Recompute::Every(1), Recompute::Every(2)] {
            let (l, g, _) = step(policy, 0.1);
            // Identical ops on identical data in the same order: bit-identical.
            assert_eq!(l, loss, "{policy}");
            assert_eq!(g, grads, "{policy}");
        }
    }

    #[test]
    fn each_recomputed_block_keeps_only_its_input() {
        let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let (b, t, c) = (2, 32, config(0.0).n_embd);
        let (_, _, off) = step(Recompute::Off, 0.0);
        let (_, _, every1) = step(Recompute::Every(1), 0.0);
        let (_, _, every2) = step(Recompute::Every(2), 0.0);
        // What one block holds for backward when it is not recomputed: measure it alone.
        let gpt = Gpt::new(config(0.0), CPU).unwrap();
        let x = Tensor::randn(&[b, t, c], DType::F32, CPU).unwrap();
        let mask = ferrograd::nn::causal_mask(t, CPU).unwrap();
        let base = memory::memory_allocated(CPU).unwrap();
        let y = gpt.blocks[0].forward_masked(&x, &mask).unwrap();
        let block_saved = memory::memory_allocated(CPU).unwrap() - base - y.nbytes() as u64;
        // A recomputed block's output is a fresh tensor like the plain one; what differs is
        // that it saves only its input (already counted as the previous block's output).
        assert!(block_saved > 0);
        assert_eq!(
            off - every1,
            4 * block_saved,
            "every:1 frees all four blocks' saves"
        );
        assert_eq!(
            off - every2,
            2 * block_saved,
            "every:2 frees blocks 0 and 2"
        );
    }
}
