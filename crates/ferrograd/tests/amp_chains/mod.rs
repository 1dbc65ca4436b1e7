//! Shared by the autocast tests (CPU and GPU): the fixture file written by
//! tools/make_amp_fixtures.py (PyTorch's CUDA autocast policy, reproduced with explicit
//! casts), the three op chains it covers, and the tolerances for half precision. Not a test
//! by itself.
#![allow(dead_code)]

use std::collections::BTreeMap;

use ferrograd::ops::GeluApprox;
use ferrograd::{DType, Device, Result, Tensor};

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

#[path = "../common/fixture_file.rs"]
mod fixture_file;

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
