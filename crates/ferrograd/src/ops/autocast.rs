//! Autocast's op policy, applied at the top of the public ops: inside a region (see `amp`),
//! matmul-like ops take their float inputs in the region's f16/bf16 and precision-sensitive
//! ops take half inputs in f32. Parameters cast to half precision come from the region's
//! weight-cast cache. The region state and the cache itself live in `amp`.
//!
//! A linear-like op (linear, gelu_linear, mlp_gelu) whose parameter comes from the cache
//! records its graph node on the f32 parameter itself (`ParamIn`), not on the cast: its GEMMs
//! read the cached half copy and write the parameter's gradient in f32 from the half operands
//! (f32 sums, no rounding to half), so no half gradient is made and no cast's backward runs
//! for it. The fused classifier (linear_cross_entropy) holds its weight gradient from the
//! forward to backward, where f32 would double those bytes at a step's peak: it keeps the
//! cast's node and its half gradient.

use crate::amp::{self, autocast_dtype};
use crate::autograd::is_grad_enabled;
use crate::base::Result;
use crate::tensor::{DType, Tensor};

/// Whether autocast converts `t` to `to`: floats other than F64 not already in `to`.
fn eligible(t: &Tensor, to: DType) -> bool {
    eligible_dtype(t.dtype(), to)
}

fn eligible_dtype(d: DType, to: DType) -> bool {
    d.is_float() && d != DType::F64 && d != to
}

/// `t` in `to`; parameters cast to half precision come from the cache.
fn cast(t: &Tensor, to: DType) -> Result<Tensor> {
    if cacheable(t, to) {
        cached_cast(t, to)
    } else {
        t.to_dtype(to)
    }
}

/// Casts now, in one launch per dtype pair on the GPU, every tensor of `params` that a
/// matmul-like op of the active region would take from the weight-cast cache (f32 leaves that
/// require grad, not cached since their last change), and caches the casts: the ops then find
/// them there instead of casting one at a time. Does nothing outside a region. A model calls
/// it at the start of its forward with the weights and biases its matmuls read (GPT-2 has 97:
/// one launch instead of 97, each too small to fill the GPU).
pub fn cast_parameters_ahead(params: &[&Tensor]) -> Result<()> {
    let Some(to) = autocast_dtype() else {
        return Ok(());
    };
    let recorded = is_grad_enabled();
    let mut todo: Vec<Tensor> = Vec::with_capacity(params.len());
    for &t in params {
        let fresh =
            eligible(t, to) && cacheable(t, to) && amp::cached_cast(t, to, recorded).is_none();
        if fresh && !todo.iter().any(|d| std::sync::Arc::ptr_eq(&d.0, &t.0)) {
            todo.push(t.clone());
        }
    }
    // Weights that a GEMM reads at a padded width are cast into zero-padded blocks, one at a
    // time; the rest in one launch.
    let mut plain = Vec::with_capacity(todo.len());
    for t in todo {
        match padded_rows(&t, to)? {
            Some(rows) => {
                let cast = t.to_dtype_zero_padded(to, rows)?;
                amp::cache_cast(&t, to, recorded, &cast, Some(rows));
            }
            None => plain.push(t),
        }
    }
    let casts = Tensor::to_dtype_many(&plain, to)?;
    for (t, cast) in plain.iter().zip(&casts) {
        amp::cache_cast(t, to, recorded, cast, None);
    }
    Ok(())
}

/// The rows of the zero-padded block a cast of `t` to `to` is made in: the padded width at
/// which a GEMM on this device reads a (n, k) weight of that dtype (GPT-2's 50257-row
/// classifier: 50304), or None where it reads n rows. The cast then is the GEMM's padded
/// weight itself (ops/aligned_gemm.rs), not copied each step.
fn padded_rows(t: &Tensor, to: DType) -> Result<Option<usize>> {
    if t.dims() != 2 || t.numel() == 0 {
        return Ok(None);
    }
    let n = t.shape()[0];
    let rows = super::matmul::padded_width(t.device(), to, n)?;
    Ok((rows != n).then_some(rows))
}

/// A parameter input of a linear-like op: `value`, the tensor its GEMMs read, and `node`, the
/// tensor its graph node records and whose dtype its gradient takes. The same tensor, except
/// for an f32 parameter read through the weight-cast cache in a recorded forward: then the
/// value is the cached half cast and the node is the parameter.
#[derive(Clone, Copy)]
pub(crate) struct ParamIn<'a> {
    pub(crate) value: &'a Tensor,
    pub(crate) node: &'a Tensor,
}

impl<'a> ParamIn<'a> {
    /// A parameter read as it is.
    pub(crate) fn plain(t: &'a Tensor) -> ParamIn<'a> {
        ParamIn { value: t, node: t }
    }

    /// `value`, the region's cast of `orig`: `orig` is the node when the cast came from the
    /// cache with a graph node (an f32 leaf that requires grad, grad mode on); else the cast
    /// is, and the gradient flows back through it as any cast's.
    pub(crate) fn cast(value: &'a Tensor, orig: &'a Tensor) -> ParamIn<'a> {
        let direct = autocast_dtype().is_some_and(|d| {
            value.dtype() == d && eligible(orig, d) && cacheable(orig, d) && is_grad_enabled()
        });
        ParamIn {
            value,
            node: if direct { orig } else { value },
        }
    }
}

fn cacheable(t: &Tensor, to: DType) -> bool {
    to != DType::F32 && t.dtype() == DType::F32 && t.is_leaf() && t.requires_grad()
}

fn cached_cast(t: &Tensor, to: DType) -> Result<Tensor> {
    let recorded = is_grad_enabled();
    if let Some(hit) = amp::cached_cast(t, to, recorded) {
        return Ok(hit);
    }
    let rows = padded_rows(t, to)?;
    let cast = match rows {
        Some(rows) => t.to_dtype_zero_padded(to, rows)?,
        None => t.to_dtype(to)?,
    };
    amp::cache_cast(t, to, recorded, &cast, rows);
    Ok(cast)
}

/// The inputs converted to `to` where eligible, or None when none is (the op then runs on
/// its inputs as they are; the re-called op therefore never casts twice).
fn cast_all<const N: usize>(inputs: [&Tensor; N], to: DType) -> Result<Option<[Tensor; N]>> {
    if !inputs.iter().any(|t| eligible(t, to)) {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(N);
    for t in inputs {
        out.push(if eligible(t, to) {
            cast(t, to)?
        } else {
            t.clone()
        });
    }
    Ok(out.try_into().ok())
}

/// `cast_all` with optional inputs (a bias, a LayerNorm weight).
fn cast_all_opt<const N: usize>(
    inputs: [Option<&Tensor>; N],
    to: DType,
) -> Result<Option<[Option<Tensor>; N]>> {
    if !inputs.iter().flatten().any(|t| eligible(t, to)) {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(N);
    for t in inputs {
        out.push(
            t.map(|t| {
                if eligible(t, to) {
                    cast(t, to)
                } else {
                    Ok(t.clone())
                }
            })
            .transpose()?,
        );
    }
    Ok(out.try_into().ok())
}

/// Lower-precision policy (matmul, linear): inside a region, the float inputs in the
/// region's dtype. None when autocast is off or nothing needs a cast.
pub(crate) fn cast_lower<const N: usize>(inputs: [&Tensor; N]) -> Result<Option<[Tensor; N]>> {
    match autocast_dtype() {
        Some(d) => cast_all(inputs, d),
        None => Ok(None),
    }
}

/// `cast_lower` with optional inputs.
pub(crate) fn cast_lower_opt<const N: usize>(
    inputs: [Option<&Tensor>; N],
) -> Result<Option<[Option<Tensor>; N]>> {
    match autocast_dtype() {
        Some(d) => cast_all_opt(inputs, d),
        None => Ok(None),
    }
}

/// Float32 policy (softmax, norms, losses, sum, exp, log, pow): inside a region, half inputs
/// in f32. None when autocast is off or nothing needs a cast.
pub(crate) fn cast_f32<const N: usize>(inputs: [&Tensor; N]) -> Result<Option<[Tensor; N]>> {
    match autocast_dtype() {
        Some(_) => cast_all(inputs, DType::F32),
        None => Ok(None),
    }
}

/// `cast_f32` with optional inputs.
pub(crate) fn cast_f32_opt<const N: usize>(
    inputs: [Option<&Tensor>; N],
) -> Result<Option<[Option<Tensor>; N]>> {
    match autocast_dtype() {
        Some(_) => cast_all_opt(inputs, DType::F32),
        None => Ok(None),
    }
}

/// Whether `cast_f32_opt` would cast any of `inputs` (an op may then take its unfused path,
/// which casts them itself).
pub(crate) fn casts_to_f32(inputs: &[Option<&Tensor>]) -> bool {
    autocast_dtype().is_some() && inputs.iter().flatten().any(|t| eligible(t, DType::F32))
}

/// The dtype an f32-policy op (a norm, softmax) writes for float inputs of `dtype` in the
/// current region: f32 for f32/f16/bf16 inputs inside a region, `dtype` otherwise.
pub(crate) fn f32_policy_out(dtype: DType) -> DType {
    match autocast_dtype() {
        Some(_) if dtype.is_float() && dtype != DType::F64 => DType::F32,
        _ => dtype,
    }
}

/// The dtype a lower-precision op (linear, matmul) of the current region casts an input of
/// `dtype` to; None where it reads the input as it is (no region, f64, already the region's
/// dtype). A producer that knows its consumer is such an op may write this dtype directly.
pub(crate) fn lower_cast_target(dtype: DType) -> Option<DType> {
    autocast_dtype().filter(|&d| eligible_dtype(dtype, d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::{Device, Layout};

    /// A cast made in a zero-padded block: the cast's values, zeros past its rows, and the
    /// cache hands the block to a padded GEMM only for that very view.
    #[test]
    fn a_zero_padded_cast_is_found_with_its_zero_rows() {
        let _amp = amp::autocast(amp::AmpDType::BF16);
        let w = Tensor::from_vec(
            vec![1.5f32, -2.0, 3.25, 0.5, 7.0, -1.0],
            &[3, 2],
            Device::Cpu,
        )
        .unwrap()
        .requires_grad_(true)
        .unwrap();
        let cast = w.to_dtype_zero_padded(DType::BF16, 5).unwrap();
        assert_eq!(
            (cast.shape(), cast.dtype()),
            (&[3usize, 2][..], DType::BF16)
        );
        assert_eq!(cast.storage().len(), 10);
        assert!(amp::zero_padded(&cast, 5).is_none(), "not cached yet");
        amp::cache_cast(&w, DType::BF16, true, &cast, Some(5));
        let block = amp::zero_padded(&cast, 5).expect("the cached cast's block");
        assert_eq!(block.shape(), &[5, 2]);
        let values: Vec<f32> = block.to_dtype(DType::F32).unwrap().to_vec().unwrap();
        assert_eq!(
            values,
            [1.5, -2.0, 3.25, 0.5, 7.0, -1.0, 0.0, 0.0, 0.0, 0.0]
        );
        // Another width, or another view of the same storage, is not that block.
        assert!(amp::zero_padded(&cast, 4).is_none());
        let rows = cast.with_layout(Layout::contiguous(&[2, 2]));
        assert!(amp::zero_padded(&rows, 5).is_none());
        // The cast is a graph node of w: the gradient comes back in f32.
        cast.to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g: Vec<f32> = w.grad().unwrap().to_vec().unwrap();
        assert_eq!(g, [1.0; 6]);
    }
}
