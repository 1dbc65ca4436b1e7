//! Shared by the autocast tests (CPU and GPU): the fixture file written by
//! tools/make_amp_fixtures.py (PyTorch's CUDA autocast policy, reproduced with explicit
//! casts), the three op chains it covers, the tolerances for half precision, and the test
//! bodies both devices run (the chains against PyTorch, a tiny GPT step). Not a test by
//! itself.
#![allow(dead_code)]

use std::collections::BTreeMap;

use ferrograd::amp::{AmpDType, autocast};
use ferrograd::nn::{Gpt, GptConfig, Module};
use ferrograd::ops::GeluApprox;
use ferrograd::{DType, Device, Generator, Result, Tensor};

/// Tolerances (atol, rtol) against PyTorch, per region dtype. Both libraries accumulate
/// products in f32 but in another order, and PyTorch adds a linear's bias before its one
/// rounding where ferrograd rounds the product, then the sum; so a half value can land one
/// ulp away (bf16: 2^-7 = 7.8e-3 at magnitude 1-2; f16: 2^-10), and the ops after it carry
/// that on. Measured worst cases on these O(1) chains: bf16 7.8e-3 (one ulp) in values and
/// 2.2e-3 in gradients; f16 3.9e-3 (two ulps at magnitude ~2) and 1.5e-3. The bounds leave
/// 2-3x margin: bf16 2e-2 absolute + 2e-2 relative, f16 3e-3 + 3e-3.
pub fn tol(d: DType) -> (f64, f64) {
    match d {
        DType::BF16 => (2e-2, 2e-2),
        DType::F16 => (3e-3, 3e-3),
        other => panic!("no autocast tolerance for {other}"),
    }
}

use crate::common::fixture_file;

fn fixtures() -> &'static fixture_file::FixtureFile {
    fixture_file::open(
        "amp.safetensors",
        "ferrograd-amp-fixtures",
        "make_amp_fixtures.py",
    )
}

/// One fixture tensor on the CPU, in its stored dtype (f32, bf16, f16 or i64).
pub fn load(key: &str) -> Tensor {
    fixtures().get(key)
}

/// Every fixture tensor `CASE.KIND.name`, by name.
pub fn named(case: &str, kind: &str) -> BTreeMap<String, Tensor> {
    fixtures().named(&format!("{case}.{kind}"))
}

/// The case's inputs on `device`: float ones as fresh leaves requiring grad, others as they
/// are (targets).
pub fn leaves(case: &str, device: Device) -> BTreeMap<String, Tensor> {
    let grads = named(case, "grad");
    named(case, "in")
        .into_iter()
        .map(|(k, t)| {
            let t = t
                .to_device(device)
                .unwrap_or_else(|e| panic!("cannot move '{k}' to {device}: {e}"))
                .detach();
            let t = if grads.contains_key(&k) {
                t.requires_grad_(true).unwrap()
            } else {
                t
            };
            (k, t)
        })
        .collect()
}

/// The intermediates of a chain, by the fixtures' names, the loss last ("loss").
pub type Outs = Vec<(&'static str, Tensor)>;

/// linear(8 → 16) → GELU (tanh) → linear(16 → 6) → mse_loss.
pub fn mlp(i: &BTreeMap<String, Tensor>) -> Result<Outs> {
    let h = i["x"].linear(&i["w1"], Some(&i["b1"]))?;
    let a = h.gelu(GeluApprox::Tanh)?;
    let o = a.linear(&i["w2"], Some(&i["b2"]))?;
    let loss = o.mse_loss(&i["y"])?;
    Ok(vec![("h", h), ("a", a), ("o", o), ("loss", loss)])
}

/// (q @ kᵀ) / √8 → softmax → @ v, loss = sum(o · w).
pub fn attn(i: &BTreeMap<String, Tensor>) -> Result<Outs> {
    let s = i["q"]
        .matmul(&i["k"].transpose(-1, -2)?)?
        .mul_scalar(1.0 / 8f64.sqrt())?;
    let p = s.softmax(-1)?;
    let o = p.matmul(&i["v"])?;
    let loss = o.mul(&i["w"])?.sum_all()?;
    Ok(vec![("s", s), ("p", p), ("o", o), ("loss", loss)])
}

/// layer_norm(8) → linear(8 → 5) → cross_entropy (one target ignored).
pub fn lnce(i: &BTreeMap<String, Tensor>) -> Result<Outs> {
    let n = i["x"].layer_norm(&[8], Some(&i["ln_w"]), Some(&i["ln_b"]), 1e-5)?;
    let logits = n.linear(&i["w"], Some(&i["b"]))?;
    let loss = logits.cross_entropy(&i["targets"], -100)?;
    Ok(vec![("n", n), ("logits", logits), ("loss", loss)])
}

pub type Chain = fn(&BTreeMap<String, Tensor>) -> Result<Outs>;

/// (fixture case prefix, chain) for every case.
pub const CHAINS: [(&str, Chain); 3] = [("mlp", mlp), ("attn", attn), ("lnce", lnce)];

/// The fixture case name of a chain under `dtype`: mlp_bf16, lnce_f16, ...
pub fn case_name(chain: &str, dtype: DType) -> String {
    format!("{chain}_{dtype}")
}

#[track_caller]
pub fn assert_close(name: &str, got: &Tensor, want: &Tensor, (atol, rtol): (f64, f64)) {
    assert_eq!(got.shape(), want.shape(), "{name}: shape");
    let (g, w) = (got.to_vec::<f64>().unwrap(), want.to_vec::<f64>().unwrap());
    let worst = g
        .iter()
        .zip(&w)
        .enumerate()
        .map(|(i, (a, b))| (i, (a - b).abs(), atol + rtol * b.abs()))
        .filter(|(_, d, bound)| d.is_nan() || d > bound)
        .max_by(|x, y| x.1.total_cmp(&y.1));
    if let Some((i, d, bound)) = worst {
        panic!(
            "{name}: got {} want {} at [{i}] (diff {d:.3e} > {bound:.3e}); first values got {:?} want {:?}",
            g[i],
            w[i],
            &g[..g.len().min(4)],
            &w[..w.len().min(4)]
        );
    }
}

fn on_cpu(t: &Tensor) -> Tensor {
    t.to_device(Device::Cpu).unwrap()
}

/// Runs one chain's case on `device` under `amp`: its intermediates and the gradients of its
/// float inputs, brought to the CPU. Checks that everything stayed on `device`, the loss is
/// f32 and every gradient is an f32 master gradient.
pub fn run_chain(
    chain: Chain,
    case: &str,
    amp: AmpDType,
    device: Device,
) -> (Outs, BTreeMap<String, Tensor>) {
    let inputs = leaves(case, device);
    let outs = {
        let _amp = autocast(amp);
        chain(&inputs).unwrap_or_else(|e| panic!("{case} on {device}: forward failed: {e}"))
    };
    let (_, loss) = outs.last().unwrap();
    assert_eq!(loss.dtype(), DType::F32, "{case}: the loss is f32");
    loss.backward()
        .unwrap_or_else(|e| panic!("{case} on {device}: backward failed: {e}"));
    let grads = inputs
        .iter()
        .filter_map(|(k, t)| t.grad().map(|g| (k.clone(), g)))
        .collect::<BTreeMap<_, _>>();
    for (name, t) in &outs {
        assert_eq!(t.device(), device, "{case}.{name} left {device}");
    }
    for (name, g) in &grads {
        assert_eq!(g.device(), device, "{case}.grad.{name} left {device}");
        assert_eq!(g.dtype(), DType::F32, "{case}.grad.{name}: master dtype");
    }
    let outs = outs.into_iter().map(|(n, t)| (n, on_cpu(&t))).collect();
    let grads = grads.into_iter().map(|(n, g)| (n, on_cpu(&g))).collect();
    (outs, grads)
}

/// Every chain on `device` under `amp` against PyTorch: each intermediate has the fixture's
/// dtype (half after matmul/linear/GELU, f32 after softmax/layer_norm/losses) and values, and
/// every input's gradient is f32 and matches.
pub fn chains_match_pytorch(amp: AmpDType, device: Device) {
    let t = tol(amp.dtype());
    for (chain, f) in CHAINS {
        let case = case_name(chain, amp.dtype());
        let (outs, grads) = run_chain(f, &case, amp, device);
        let want = named(&case, "out");
        assert_eq!(outs.len(), want.len(), "{case}: intermediates");
        for (name, got) in &outs {
            let w = &want[*name];
            assert_eq!(got.dtype(), w.dtype(), "{case}.{name}: dtype");
            assert_close(&format!("{case}.{name} on {device}"), got, w, t);
        }
        let want = named(&case, "grad");
        assert_eq!(grads.len(), want.len(), "{case}: gradients");
        for (name, w) in &want {
            let g = grads
                .get(name)
                .unwrap_or_else(|| panic!("{case}: {name} got no gradient"));
            assert_close(&format!("{case}.grad.{name} on {device}"), g, w, t);
        }
    }
}

/// (ids, targets) of the tiny GPT: two (2, 32) batches of its 65 token ids, drawn from `seed`.
pub fn token_batch(seed: u64, device: Device) -> (Tensor, Tensor) {
    let mut g = Generator::new(seed);
    let mut draw = || -> Tensor {
        let v: Vec<i64> = g
            .uniform(2 * 32, 0.0, 65.0)
            .iter()
            .map(|x| *x as i64)
            .collect();
        Tensor::from_vec(v, &[2, 32], device).unwrap()
    };
    (draw(), draw())
}

/// Loss and gradients (on the CPU) of the tiny GPT on a fixed batch on `device`, under `amp`
/// or in plain f32. The logits come from the tied head linear, so they have the region's
/// dtype; the loss and the master gradients are f32.
pub fn gpt_step(amp: Option<AmpDType>, device: Device) -> (f64, Vec<(String, Tensor)>) {
    let model = Gpt::new(GptConfig::tiny(), device).unwrap();
    let (ids, targets) = token_batch(21, device);
    let loss = {
        let _amp = amp.map(autocast);
        let (logits, loss) = model.forward_loss(&ids, Some(&targets)).unwrap();
        let want = amp.map_or(DType::F32, AmpDType::dtype);
        assert_eq!(logits.dtype(), want, "logits come from the (tied) head");
        loss.unwrap()
    };
    assert_eq!(loss.dtype(), DType::F32);
    loss.backward().unwrap();
    let grads = model
        .named_parameters()
        .into_iter()
        .map(|(n, p)| {
            let g = p.grad().unwrap_or_else(|| panic!("{n}: no gradient"));
            assert_eq!(g.dtype(), DType::F32, "{n}: master gradient dtype");
            (n, on_cpu(&g))
        })
        .collect();
    (loss.item().unwrap(), grads)
}

/// Two GPT steps agree as far as half precision allows: the loss within 0.2 % and each
/// parameter's gradient in direction (cosine > 0.999) and size (1 %). Elementwise bounds
/// would not fit: bf16 keeps 8 significant bits, and two runs round at other places or sum
/// in another order.
pub fn assert_steps_agree(
    (loss, grads): &(f64, Vec<(String, Tensor)>),
    (want_loss, want_grads): &(f64, Vec<(String, Tensor)>),
) {
    assert!(
        loss.is_finite() && (loss - want_loss).abs() < 2e-3 * want_loss,
        "loss {loss} vs {want_loss}"
    );
    assert_eq!(grads.len(), want_grads.len(), "parameters");
    for ((name, g), (_, want)) in grads.iter().zip(want_grads) {
        let (g, want) = (g.to_vec::<f64>().unwrap(), want.to_vec::<f64>().unwrap());
        assert!(
            g.iter().all(|v| v.is_finite()),
            "{name}: non-finite gradient"
        );
        let dot: f64 = g.iter().zip(&want).map(|(a, b)| a * b).sum();
        let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
        let (ng, nw) = (norm(&g), norm(&want));
        if nw == 0.0 {
            assert_eq!(ng, 0.0, "{name}");
            continue;
        }
        assert!(
            dot / (ng * nw) > 0.999,
            "{name}: cosine {}",
            dot / (ng * nw)
        );
        assert!((ng / nw - 1.0).abs() < 0.01, "{name}: norm {ng} vs {nw}");
    }
}
