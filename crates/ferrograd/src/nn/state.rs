//! Parameters by name: loading values into a module (`load_named`, like PyTorch's
//! `load_state_dict`) and the dotted-name prefixing that containers use.

use std::collections::HashMap;

use super::Module;
use crate::autograd::no_grad;
use crate::base::{Error, Result};
use crate::tensor::Tensor;

/// Copies `tensors[name]` into every parameter `name` of `module`, in place (the parameters
/// keep their storage, dtype, device and `requires_grad`; values are converted to the
/// parameter's dtype and device). Every parameter must be present with its exact shape; the
/// check covers all of them before anything is written, so an error leaves the module
/// unchanged. Extra entries in `tensors` are ignored (a file may hold more than weights).
pub fn load_named(module: &dyn Module, tensors: &HashMap<String, Tensor>) -> Result<()> {
    let params = module.named_parameters();
    let mut missing = Vec::new();
    let mut mismatched = Vec::new();
    for (name, p) in &params {
        match tensors.get(name) {
            None => missing.push(name.as_str()),
            Some(t) if t.shape() != p.shape() => mismatched.push(format!(
                "{name}: expected {:?}, got {:?}",
                p.shape(),
                t.shape()
            )),
            Some(_) => {}
        }
    }
    if !missing.is_empty() || !mismatched.is_empty() {
        return Err(Error::invalid(
            "load_named",
            load_error(&missing, &mismatched),
        ));
    }
    let _guard = no_grad();
    for (name, p) in &params {
        if let Some(t) = tensors.get(name) {
            p.copy_(&t.to_device(p.device())?.to_dtype(p.dtype())?)?;
        }
    }
    Ok(())
}

fn load_error(missing: &[&str], mismatched: &[String]) -> String {
    let mut parts = Vec::new();
    if !missing.is_empty() {
        parts.push(format!("missing keys: {}", missing.join(", ")));
    }
    if !mismatched.is_empty() {
        parts.push(format!("shape mismatches: {}", mismatched.join("; ")));
    }
    format!(
        "{}; the tensors must be named like the module's named_parameters()",
        parts.join("; ")
    )
}

/// A child's parameters under `prefix.` (`ln_1` + `weight` → `ln_1.weight`).
pub(crate) fn prefixed(prefix: &str, child: &dyn Module) -> Vec<(String, Tensor)> {
    child
        .named_parameters()
        .into_iter()
        .map(|(n, p)| (format!("{prefix}.{n}"), p))
        .collect()
}
