//! Shared by the autocast tests (CPU and GPU): the fixture file written by
//! tools/make_amp_fixtures.py (PyTorch's CUDA autocast policy, reproduced with explicit
//! casts), the three op chains it covers, and the tolerances for half precision. Not a test
//! by itself.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::OnceLock;

use ferrograd::ops::GeluApprox;
use ferrograd::{DType, Device, Result, Tensor};
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/fixtures/amp.safetensors"
);
const HINT: &str = "regenerate with tools/make_amp_fixtures.py";

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

fn fixtures() -> &'static SafeTensors<'static> {
    static FILE: OnceLock<SafeTensors<'static>> = OnceLock::new();
    FILE.get_or_init(|| {
        let bytes = std::fs::read(FIXTURES)
            .unwrap_or_else(|e| panic!("cannot read {FIXTURES}: {e}; {HINT}"));
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        let (_, meta) = SafeTensors::read_metadata(bytes).unwrap();
        let md = meta.metadata().clone().unwrap_or_default();
        assert_eq!(
            md.get("format").map(String::as_str),
            Some("ferrograd-amp-fixtures"),
            "{HINT}"
        );
        assert_eq!(md.get("version").map(String::as_str), Some("1"), "{HINT}");
        SafeTensors::deserialize(bytes).unwrap()
    })
}

fn words<const N: usize>(data: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
    data.chunks_exact(N).map(|c| c.try_into().unwrap())
}

/// One fixture tensor on the CPU, in its stored dtype (f32, bf16, f16 or i64).
pub fn load(key: &str) -> Tensor {
    let v = fixtures()
        .tensor(key)
        .unwrap_or_else(|_| panic!("no fixture tensor '{key}'; {HINT}"));
    let (shape, data) = (v.shape().to_vec(), v.data());
    let cpu = Device::Cpu;
    let t = match v.dtype() {
        Dtype::F32 => Tensor::from_vec(words(data).map(f32::from_le_bytes).collect(), &shape, cpu),
        Dtype::BF16 => Tensor::from_vec(
            words(data)
                .map(|w| bf16::from_bits(u16::from_le_bytes(w)))
                .collect(),
            &shape,
            cpu,
        ),
        Dtype::F16 => Tensor::from_vec(
            words(data)
                .map(|w| f16::from_bits(u16::from_le_bytes(w)))
                .collect(),
            &shape,
            cpu,
        ),
        Dtype::I64 => Tensor::from_vec(words(data).map(i64::from_le_bytes).collect(), &shape, cpu),
        other => panic!("fixture '{key}' has unexpected dtype {other:?}; {HINT}"),
    };
    t.unwrap()
}

/// Every fixture tensor `CASE.KIND.name`, by name.
pub fn named(case: &str, kind: &str) -> BTreeMap<String, Tensor> {
    let prefix = format!("{case}.{kind}.");
    let map: BTreeMap<String, Tensor> = fixtures()
        .names()
        .into_iter()
        .filter_map(|k| k.strip_prefix(&prefix).map(|n| (n.to_string(), load(k))))
        .collect();
    assert!(!map.is_empty(), "no '{prefix}*' tensors; {HINT}");
    map
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
