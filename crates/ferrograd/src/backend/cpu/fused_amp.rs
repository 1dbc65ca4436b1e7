//! Mixed-precision gradient unscaling on the CPU (`FusedOp::UnscaleCheck`): every gradient is
//! multiplied in place by 1/scale and a single found_inf flag is raised when any value was
//! inf or NaN, as torch's `_amp_foreach_non_finite_check_and_unscale_` does. The check looks
//! at the scaled value (before the multiply); the product is computed in the compute type
//! (f32 for f32/f16/bf16, f64 for f64) and rounded once, as the CUDA kernel (kernels/amp.cu)
//! does, so both agree bit for bit.

use half::{bf16, f16};
use rayon::prelude::*;

use super::data::CpuData;
use super::write;
use crate::backend::{Storage, View};
use crate::base::DType;
use crate::base::{Error, Result};

const OP: &str = "unscale_check";
const CHUNK: usize = 1 << 14;

/// inputs []; outputs [found_inf (1) F32, grad_0, .., grad_{n-1}].
pub(crate) fn unscale_check(inv_scale: f32, inputs: &[View], outputs: &[&Storage]) -> Result<()> {
    let (flag, grads) = operands(inputs, outputs)?;
    let mut found = false;
    for g in grads {
        found |= write(g, |d| unscale(d, inv_scale))?;
    }
    if found {
        write(flag, |f| match f {
            CpuData::F32(v) => {
                v[0] = 1.0;
                Ok(())
            }
            other => Err(Error::DType {
                op: OP,
                expected: DType::F32,
                got: other.dtype(),
            }),
        })?;
    }
    Ok(())
}

/// A one-element F32 flag; float gradients; all storages distinct (a storage listed twice
/// would be unscaled twice).
/// The flag and the gradients of an `UnscaleCheck`, checked (shared with the CUDA launcher):
/// no inputs; outputs [found_inf (1) F32, grad_0, ..].
pub(crate) fn operands<'a>(
    inputs: &[View],
    outputs: &'a [&'a Storage],
) -> Result<(&'a Storage, &'a [&'a Storage])> {
    if !inputs.is_empty() {
        return Err(Error::invalid(
            OP,
            "takes no inputs: the gradients are outputs, updated in place",
        ));
    }
    let (flag, grads) = outputs
        .split_first()
        .ok_or_else(|| Error::invalid(OP, "expects the found_inf flag as the first output"))?;
    check_operands(flag, grads)?;
    Ok((flag, grads))
}

fn check_operands(flag: &Storage, grads: &[&Storage]) -> Result<()> {
    if flag.dtype() != DType::F32 || flag.len() != 1 {
        return Err(Error::invalid(
            OP,
            format!(
                "found_inf must be a one-element F32 tensor, got {} elements of {}",
                flag.len(),
                flag.dtype()
            ),
        ));
    }
    for g in grads {
        if !g.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype: g.dtype(),
                hint: "gradients must be floating point",
            });
        }
    }
    let mut seen: Vec<*const Storage> = Vec::with_capacity(grads.len() + 1);
    seen.push(flag);
    for g in grads {
        let p: *const Storage = *g;
        if seen.contains(&p) {
            return Err(Error::invalid(
                OP,
                "the flag and the gradients must be distinct storages; pass each gradient once",
            ));
        }
        seen.push(p);
    }
    Ok(())
}

/// Unscales one buffer in place; whether it held an inf or NaN.
fn unscale(d: &mut CpuData, inv: f32) -> Result<bool> {
    Ok(match d {
        CpuData::F32(v) => apply(v, inv, |x| x, |c| c),
        CpuData::F64(v) => apply(v, inv as f64, |x| x, |c| c),
        CpuData::F16(v) => apply(v, inv, f16::to_f32, f16::from_f32),
        CpuData::BF16(v) => apply(v, inv, bf16::to_f32, bf16::from_f32),
        other => {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype: other.dtype(),
                hint: "gradients must be floating point",
            });
        }
    })
}

/// Every element is unscaled, even after a non-finite one (PyTorch leaves no element
/// behind either); chunks run in parallel and OR their flags.
fn apply<T, C>(v: &mut [T], inv: C, up: fn(T) -> C, down: fn(C) -> T) -> bool
where
    T: Copy + Send + Sync,
    C: num_traits::Float + Send + Sync,
{
    let identity = inv == C::one();
    v.par_chunks_mut(CHUNK)
        .map(|chunk| {
            let mut bad = false;
            for x in chunk.iter_mut() {
                let c = up(*x);
                bad |= !c.is_finite();
                if !identity {
                    *x = down(c * inv);
                }
            }
            bad
        })
        .reduce(|| false, |a, b| a || b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_before_scaling_and_widens_for_f64() {
        // 1e38 · 10 overflows after scaling but was finite before: not flagged (as PyTorch).
        let mut v = vec![1e38f32, 2.0];
        assert!(!apply(&mut v, 10.0f32, |x| x, |c| c));
        assert_eq!(v, vec![f32::INFINITY, 20.0]);
        let mut v = vec![1.0f32, f32::NAN, 3.0];
        assert!(apply(&mut v, 0.5f32, |x| x, |c| c));
        assert_eq!((v[0], v[2]), (0.5, 1.5));
        // f64 gradients multiply by the f32 inverse widened to f64.
        let inv = 0.1f32;
        let mut d = CpuData::F64(vec![0.1]);
        assert!(!unscale(&mut d, inv).unwrap());
        match d {
            CpuData::F64(v) => assert_eq!(v[0], 0.1 * inv as f64),
            _ => unreachable!(),
        }
    }
}
