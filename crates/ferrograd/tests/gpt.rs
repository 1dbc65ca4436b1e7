//! The GPT model against PyTorch: logits, loss and every parameter's gradient of a tiny model
//! (fixtures written by tools/make_gpt_fixtures.py), plus parameter counting, causal masking,
//! weight tying, dropout in train and eval mode, initialisation statistics and the errors a
//! user can run into (bad config, too long input, bad weights).

mod common;

use std::collections::HashMap;

use common::assert_close;
use common::fixture_file::FixtureFile;
use ferrograd::nn::{Dropout, Gpt, GptConfig, IGNORE_INDEX, Module, causal_mask, load_named};
use ferrograd::{DType, Device, Tensor, no_grad};

/// float32 against PyTorch's float64 reference.
const ATOL: f64 = 1e-5;
const RTOL: f64 = 1e-4;

fn fixtures() -> &'static FixtureFile {
    common::fixture_file::open(
        "gpt.safetensors",
        "ferrograd-gpt-fixtures",
        "make_gpt_fixtures.py",
    )
}

fn load(key: &str) -> Tensor {
    fixtures().get(key)
}

/// Every fixture tensor `CASE.KIND.name`, keyed by name.
fn named(case: &str, kind: &str) -> HashMap<String, Tensor> {
    fixtures()
        .named(&format!("{case}.{kind}"))
        .into_iter()
        .collect()
}

/// The fixtures' model: vocab 11, context 8, 2 layers, 2 heads, width 8.
fn tiny_config(bias: bool, dropout: f64) -> GptConfig {
    GptConfig {
        vocab_size: 11,
        block_size: 8,
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        dropout,
        bias,
        seed: 7,
    }
}

/// A tiny model holding the fixture case's parameters.
fn fixture_model(case: &str, bias: bool) -> Gpt {
    let model = Gpt::new(tiny_config(bias, 0.0), Device::Cpu).unwrap();
    load_named(&model, &named(case, "param")).unwrap();
    model
}

fn check_against_pytorch(case: &str, bias: bool) {
    let model = fixture_model(case, bias);
    let params = model.named_parameters();
    let mut names: Vec<_> = params.iter().map(|(n, _)| n.clone()).collect();
    let mut want_names: Vec<_> = named(case, "param").into_keys().collect();
    names.sort();
    want_names.sort();
    assert_eq!(names, want_names, "parameter names differ from PyTorch's");

    let (ids, targets) = (
        load(&format!("{case}.ids")),
        load(&format!("{case}.targets")),
    );
    let (logits, loss) = model.forward_loss(&ids, Some(&targets)).unwrap();
    let loss = loss.unwrap();
    assert_close(
        &format!("{case} logits"),
        &logits,
        &load(&format!("{case}.logits")),
        ATOL,
        RTOL,
    );
    assert_close(
        &format!("{case} loss"),
        &loss,
        &load(&format!("{case}.loss")),
        ATOL,
        RTOL,
    );

    loss.backward().unwrap();
    let grads = named(case, "grad");
    for (name, p) in &params {
        let got = p
            .grad()
            .unwrap_or_else(|| panic!("{name} received no gradient"));
        assert_close(
            &format!("{case} grad {name}"),
            &got,
            &grads[name],
            ATOL,
            RTOL,
        );
    }
}

#[test]
fn matches_pytorch_with_bias() {
    check_against_pytorch("tiny", true);
}

#[test]
fn matches_pytorch_without_bias() {
    check_against_pytorch("tiny_nobias", false);
}

fn numel_of_parameters(model: &Gpt) -> usize {
    model.parameters().iter().map(Tensor::numel).sum()
}

#[test]
fn parameter_count() {
    assert_eq!(GptConfig::gpt2_124m().num_params(), 124_439_808);
    // The formula agrees with the tensors actually built, tied head counted once.
    for cfg in [
        tiny_config(true, 0.0),
        tiny_config(false, 0.0),
        GptConfig::tiny(),
    ] {
        let model = Gpt::new(cfg.clone(), Device::Cpu).unwrap();
        assert_eq!(numel_of_parameters(&model), cfg.num_params(), "{cfg:?}");
    }
}

/// Logits (B, T, V) as nested rows: [b][t] → V values.
fn rows(logits: &Tensor) -> Vec<Vec<Vec<f32>>> {
    let (b, t, v) = (logits.shape()[0], logits.shape()[1], logits.shape()[2]);
    let flat = logits.to_vec::<f32>().unwrap();
    (0..b)
        .map(|i| {
            (0..t)
                .map(|j| flat[(i * t + j) * v..(i * t + j + 1) * v].to_vec())
                .collect()
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn future_tokens_do_not_change_earlier_logits() {
    let model = fixture_model("tiny", true);
    let ids = load("tiny.ids");
    let mut changed = ids.to_vec::<i64>().unwrap();
    let pos = 5;
    changed[pos] = (changed[pos] + 1) % 11; // batch 0, position 5
    let changed = Tensor::from_vec(changed, &[2, 8], Device::Cpu).unwrap();
    let _g = no_grad();
    let (a, _) = model.forward_loss(&ids, None).unwrap();
    let (b, _) = model.forward_loss(&changed, None).unwrap();
    let (a, b) = (rows(&a), rows(&b));
    for t in 0..8 {
        let d = max_diff(&a[0][t], &b[0][t]);
        if t < pos {
            assert!(d <= 1e-6, "position {t} saw the future token: diff {d}");
        } else {
            assert!(d > 1e-3, "position {t} ignores token {pos}: diff {d}");
        }
        assert_eq!(a[1][t], b[1][t], "batch row 1 changed at {t}");
    }
}

#[test]
fn head_is_tied_to_the_token_embedding() {
    let model = fixture_model("tiny", true);
    assert!(model.lm_head().shares_storage(&model.wte.weight));
    let sharing: Vec<_> = model
        .named_parameters()
        .into_iter()
        .filter(|(_, p)| p.shares_storage(&model.wte.weight))
        .map(|(n, _)| n)
        .collect();
    assert_eq!(sharing, ["transformer.wte.weight"]);
    // Changing the embedding changes the head: logits follow wte.
    let ids = load("tiny.ids");
    let (before, _) = model.forward_loss(&ids, None).unwrap();
    {
        let _g = no_grad();
        model.wte.weight.mul_scalar_(2.0).unwrap();
    }
    let (after, _) = model.forward_loss(&ids, None).unwrap();
    assert!(
        max_diff(
            &before.to_vec::<f32>().unwrap(),
            &after.to_vec::<f32>().unwrap()
        ) > 1e-2
    );
}

/// The model's forward written out from its public parts, with the token embedding detached
/// in the lookup (`detach_lookup`) or in the head.
fn loss_with_one_use(model: &Gpt, ids: &Tensor, targets: &Tensor, detach_lookup: bool) -> Tensor {
    let w = &model.wte.weight;
    let (lookup_w, head_w) = if detach_lookup {
        (w.detach(), w.clone())
    } else {
        (w.clone(), w.detach())
    };
    let t = ids.shape()[1];
    let pos = Tensor::arange(0.0, t as f64, 1.0, DType::I64, Device::Cpu).unwrap();
    let mut x = lookup_w
        .embedding(ids)
        .unwrap()
        .add(&model.wpe.forward(&pos).unwrap())
        .unwrap();
    let mask = causal_mask(t, Device::Cpu).unwrap();
    for block in &model.blocks {
        x = block.forward_masked(&x, &mask).unwrap();
    }
    let logits = model
        .ln_f
        .forward(&x)
        .unwrap()
        .linear(&head_w, None)
        .unwrap();
    logits.cross_entropy(targets, IGNORE_INDEX).unwrap()
}

fn wte_grad(model: &Gpt) -> Vec<f32> {
    let g = model.wte.weight.grad().unwrap().to_vec::<f32>().unwrap();
    for p in model.parameters() {
        p.set_grad(None).unwrap();
    }
    g
}

#[test]
fn tied_gradient_sums_lookup_and_head() {
    let model = fixture_model("tiny", true);
    // Batch row 0 only, so some tokens never appear: their embedding rows get the head's
    // gradient alone.
    let ids = load("tiny.ids")
        .narrow(0, 0, 1)
        .unwrap()
        .contiguous()
        .unwrap();
    let targets = load("tiny.targets")
        .narrow(0, 0, 1)
        .unwrap()
        .contiguous()
        .unwrap();
    let (_, loss) = model.forward_loss(&ids, Some(&targets)).unwrap();
    loss.unwrap().backward().unwrap();
    let both = wte_grad(&model);
    loss_with_one_use(&model, &ids, &targets, true)
        .backward()
        .unwrap();
    let head = wte_grad(&model);
    loss_with_one_use(&model, &ids, &targets, false)
        .backward()
        .unwrap();
    let lookup = wte_grad(&model);

    let sum: Vec<f32> = head.iter().zip(&lookup).map(|(a, b)| a + b).collect();
    assert!(max_diff(&both, &sum) < 1e-6, "tied grad != head + lookup");
    let c = 8;
    let used: Vec<usize> = ids
        .to_vec::<i64>()
        .unwrap()
        .into_iter()
        .map(|i| i as usize)
        .collect();
    let unused: Vec<usize> = (0..11).filter(|r| !used.contains(r)).collect();
    assert!(
        !unused.is_empty(),
        "the test needs a token absent from the input"
    );
    let row_norm = |g: &[f32], r: usize| g[r * c..(r + 1) * c].iter().map(|x| x.abs()).sum::<f32>();
    for &r in &used {
        assert!(
            row_norm(&lookup, r) > 0.0,
            "no lookup gradient for used token {r}"
        );
    }
    for &r in &unused {
        assert_eq!(
            row_norm(&lookup, r),
            0.0,
            "lookup gradient for unused token {r}"
        );
        assert!(row_norm(&both, r) > 0.0, "no head gradient for token {r}");
    }
}

#[test]
fn dropout_module_train_and_eval() {
    let x = Tensor::ones(&[4000], DType::F32, Device::Cpu)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let mut d = Dropout::new(0.5, 3).unwrap();
    let y = d.forward(&x).unwrap();
    let v = y.to_vec::<f32>().unwrap();
    assert!(
        v.iter().all(|&e| e == 0.0 || e == 2.0),
        "kept values scale by 1/(1-p)"
    );
    let zeros = v.iter().filter(|&&e| e == 0.0).count() as f64 / v.len() as f64;
    assert!((0.45..0.55).contains(&zeros), "dropped fraction {zeros}");
    // Backward routes the gradient through the same mask.
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), v);
    // The next call draws a new mask; the same seed repeats the sequence.
    let y2 = d.forward(&x).unwrap().to_vec::<f32>().unwrap();
    assert_ne!(y2, v);
    let again = Dropout::new(0.5, 3).unwrap();
    assert_eq!(again.forward(&x).unwrap().to_vec::<f32>().unwrap(), v);
    d.eval();
    assert_eq!(
        d.forward(&x).unwrap().to_vec::<f32>().unwrap(),
        vec![1.0; 4000]
    );
    assert!(Dropout::new(1.0, 0).is_err());
}

#[test]
fn gpt_dropout_only_in_training() {
    let ids = load("tiny.ids");
    let plain = Gpt::new(tiny_config(true, 0.0), Device::Cpu).unwrap();
    let mut dropped = Gpt::new(tiny_config(true, 0.3), Device::Cpu).unwrap();
    // Dropout does not change the initial weights.
    for ((n, a), (_, b)) in plain
        .named_parameters()
        .iter()
        .zip(dropped.named_parameters())
    {
        assert_eq!(
            a.to_vec::<f32>().unwrap(),
            b.to_vec::<f32>().unwrap(),
            "{n}"
        );
    }
    let logits = |m: &Gpt| {
        m.forward_loss(&ids, None)
            .unwrap()
            .0
            .to_vec::<f32>()
            .unwrap()
    };
    let reference = logits(&plain);
    let (t1, t2) = (logits(&dropped), logits(&dropped));
    assert!(
        max_diff(&t1, &reference) > 1e-4,
        "training mode applied no dropout"
    );
    assert!(
        max_diff(&t1, &t2) > 1e-4,
        "two training steps drew the same masks"
    );
    dropped.eval();
    assert_eq!(logits(&dropped), reference, "eval mode must not drop");
    dropped.train(true);
    assert!(max_diff(&logits(&dropped), &reference) > 1e-4);
    // The same seed gives the same masks.
    let twin = Gpt::new(tiny_config(true, 0.3), Device::Cpu).unwrap();
    assert_eq!(logits(&twin), t1);
}

fn std_of(t: &Tensor) -> f64 {
    let v = t.to_vec::<f64>().unwrap();
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    (v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / v.len() as f64).sqrt()
}

#[test]
fn gpt2_initialisation() {
    let cfg = GptConfig {
        vocab_size: 500,
        block_size: 64,
        n_layer: 8,
        n_head: 4,
        n_embd: 128,
        dropout: 0.0,
        bias: true,
        seed: 1,
    };
    let model = Gpt::new(cfg, Device::Cpu).unwrap();
    let proj_std = 0.02 / 16f64.sqrt();
    for (name, p) in model.named_parameters() {
        assert_eq!(p.category(), Some(ferrograd::Category::Parameter), "{name}");
        assert!(p.requires_grad(), "{name}");
        let v = p.to_vec::<f32>().unwrap();
        if name.ends_with(".bias") {
            assert!(v.iter().all(|&x| x == 0.0), "{name} must start at 0");
        } else if name.contains("ln_") {
            assert!(v.iter().all(|&x| x == 1.0), "{name} must start at 1");
        } else {
            let want = if name.ends_with("c_proj.weight") {
                proj_std
            } else {
                0.02
            };
            let got = std_of(&p);
            assert!(
                (got / want - 1.0).abs() < 0.05,
                "{name}: std {got}, want {want}"
            );
        }
    }
    // The seed decides the weights.
    let again = Gpt::new(model.config.clone(), Device::Cpu).unwrap();
    assert_eq!(
        again.wte.weight.to_vec::<f32>().unwrap(),
        model.wte.weight.to_vec::<f32>().unwrap()
    );
}

fn err_text<T>(r: ferrograd::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_configs_and_inputs_are_errors() {
    let mut cfg = tiny_config(true, 0.0);
    cfg.n_head = 3;
    assert!(err_text(Gpt::new(cfg, Device::Cpu)).contains("multiple of n_head"));
    let mut cfg = tiny_config(true, 0.0);
    cfg.dropout = 1.0;
    assert!(err_text(Gpt::new(cfg, Device::Cpu)).contains("dropout"));

    let model = fixture_model("tiny", true);
    let long = Tensor::from_vec(vec![0i64; 9], &[1, 9], Device::Cpu).unwrap();
    assert!(err_text(model.forward_loss(&long, None)).contains("block_size"));
    let flat = Tensor::from_vec(vec![0i64; 4], &[4], Device::Cpu).unwrap();
    assert!(err_text(model.forward_loss(&flat, None)).contains("(B, T)"));
    let out_of_vocab = Tensor::from_vec(vec![11i64; 4], &[1, 4], Device::Cpu).unwrap();
    assert!(model.forward_loss(&out_of_vocab, None).is_err());
}

#[test]
fn shorter_sequences_use_the_mask_corner() {
    // T < block_size: the same prefix gives the same logits as in the full sequence.
    let model = fixture_model("tiny", true);
    let ids = load("tiny.ids");
    let short = ids.narrow(1, 0, 5).unwrap().contiguous().unwrap();
    let _g = no_grad();
    let full = rows(&model.forward_loss(&ids, None).unwrap().0);
    let part = rows(&model.forward_loss(&short, None).unwrap().0);
    for b in 0..2 {
        for t in 0..5 {
            assert!(max_diff(&full[b][t], &part[b][t]) <= 1e-6, "[{b}][{t}]");
        }
    }
}

#[test]
fn load_named_reports_missing_and_mismatched_keys() {
    let model = Gpt::new(tiny_config(true, 0.0), Device::Cpu).unwrap();
    let before = model.wpe.weight.to_vec::<f32>().unwrap();
    let mut tensors = named("tiny", "param");
    tensors.remove("transformer.ln_f.bias");
    tensors.insert(
        "transformer.h.0.attn.c_proj.weight".into(),
        Tensor::zeros(&[8, 9], DType::F32, Device::Cpu).unwrap(),
    );
    let msg = err_text(load_named(&model, &tensors));
    assert!(msg.contains("transformer.ln_f.bias"), "{msg}");
    assert!(msg.contains("transformer.h.0.attn.c_proj.weight"), "{msg}");
    // Nothing was written.
    assert_eq!(model.wpe.weight.to_vec::<f32>().unwrap(), before);
    // A float64 source is converted into the float32 parameter.
    let mut tensors = named("tiny", "param");
    let wpe64 = tensors["transformer.wpe.weight"]
        .to_dtype(DType::F64)
        .unwrap();
    tensors.insert("transformer.wpe.weight".into(), wpe64.clone());
    load_named(&model, &tensors).unwrap();
    assert_eq!(model.wpe.weight.dtype(), DType::F32);
    assert_eq!(
        model.wpe.weight.to_vec::<f64>().unwrap(),
        wpe64.to_vec::<f64>().unwrap()
    );
    assert!(model.wpe.weight.requires_grad());
}

/// The same model on a CUDA device (built with `--features gpu-tests`; fails without a GPU).
#[cfg(feature = "gpu-tests")]
mod gpu {
    use super::*;

    const GPU: Device = Device::Cuda(0);

    #[test]
    fn matches_pytorch_on_gpu() {
        for (case, bias) in [("tiny", true), ("tiny_nobias", false)] {
            let model = Gpt::new(tiny_config(bias, 0.0), GPU).unwrap();
            load_named(&model, &named(case, "param")).unwrap();
            let ids = load(&format!("{case}.ids")).to_device(GPU).unwrap();
            let targets = load(&format!("{case}.targets")).to_device(GPU).unwrap();
            let (logits, loss) = model.forward_loss(&ids, Some(&targets)).unwrap();
            let loss = loss.unwrap();
            let want = load(&format!("{case}.logits"));
            assert_close(&format!("{case} gpu logits"), &logits, &want, ATOL, RTOL);
            let want = load(&format!("{case}.loss"));
            assert_close(&format!("{case} gpu loss"), &loss, &want, ATOL, RTOL);
            loss.backward().unwrap();
            let grads = named(case, "grad");
            for (name, p) in model.named_parameters() {
                assert_eq!(p.device(), GPU);
                let got = p.grad().unwrap();
                assert_close(
                    &format!("{case} gpu grad {name}"),
                    &got,
                    &grads[&name],
                    ATOL,
                    RTOL,
                );
            }
        }
    }

    #[test]
    fn gpt2_124m_step_on_gpu() {
        let cfg = GptConfig::gpt2_124m();
        let (vocab, t) = (cfg.vocab_size, cfg.block_size);
        let model = Gpt::new(cfg, GPU).unwrap();
        let mut g = ferrograd::Generator::new(5);
        let draw = |g: &mut ferrograd::Generator| -> Tensor {
            let v: Vec<i64> = g
                .uniform(2 * t, 0.0, vocab as f64)
                .into_iter()
                .map(|x| x as i64)
                .collect();
            Tensor::from_vec(v, &[2, t], GPU).unwrap()
        };
        let (ids, targets) = (draw(&mut g), draw(&mut g));
        let (logits, loss) = model.forward_loss(&ids, Some(&targets)).unwrap();
        assert_eq!(logits.shape(), [2, t, vocab]);
        let loss = loss.unwrap();
        // At GPT-2's init the prediction is near uniform: loss ≈ ln(V) ≈ 10.82.
        let l = loss.item().unwrap();
        assert!((l - (vocab as f64).ln()).abs() < 0.3, "initial loss {l}");
        loss.backward().unwrap();
        for (name, p) in model.named_parameters() {
            let grad = p.grad().unwrap().to_vec::<f32>().unwrap();
            assert!(grad.iter().all(|x| x.is_finite()), "{name}");
            assert!(grad.iter().any(|&x| x != 0.0), "{name} has a zero gradient");
        }
    }
}
