//! Freezing: `requires_grad_(false)` on the parameters whose names match a pattern. A frozen
//! parameter gets no gradient, and since ops save only what the remaining gradients need, its
//! layer stops saving inputs that were kept only for the weight's gradient.

use crate::base::{Error, Result};
use crate::nn::Module;

/// Matches `name` against `pattern`, where `*` stands for any run of characters
/// (`transformer.h.0.*`, `*.bias`, `0.weight`).
pub fn name_matches(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || name.len() < first.len() + last.len() || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

/// Freezes every parameter whose name matches `pattern`; returns the names frozen. A pattern
/// that matches nothing is an error (a misspelt name would otherwise train everything).
pub fn freeze(module: &dyn Module, pattern: &str) -> Result<Vec<String>> {
    let mut frozen = Vec::new();
    for (name, p) in module.named_parameters() {
        if name_matches(pattern, &name) {
            p.requires_grad_(false)?;
            frozen.push(name);
        }
    }
    if frozen.is_empty() {
        let names: Vec<String> = module
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .take(8)
            .collect();
        return Err(Error::invalid(
            "freeze",
            format!(
                "pattern '{pattern}' matches no parameter; names look like {names:?} (use * as a wildcard)"
            ),
        ));
    }
    Ok(frozen)
}

#[cfg(test)]
mod tests {
    use super::name_matches;

    #[test]
    fn glob_patterns() {
        assert!(name_matches("0.weight", "0.weight"));
        assert!(!name_matches("0.weight", "0.weight2"));
        assert!(name_matches("*.bias", "2.bias"));
        assert!(name_matches(
            "transformer.h.*.attn.*",
            "transformer.h.11.attn.c_attn.weight"
        ));
        assert!(!name_matches(
            "transformer.h.*.mlp.*",
            "transformer.h.11.attn.c_attn.weight"
        ));
        assert!(name_matches("*", "anything"));
    }
}
