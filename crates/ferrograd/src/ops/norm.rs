//! Layer normalisation over the trailing dims, as one fused op each way. The input is read
//! as rows (R, N) with N the product of `normalized_shape`; the variance is the biased one,
//! like PyTorch's. The forward saves a reference to x, the weight, and two floats per row
//! (mean and 1/std), never the normalised x̂: backward recomputes it.
//!
//! `layer_norm_to` also rounds the output to another dtype in the same kernel: an f32 norm
//! feeding a half-precision matmul (autocast's residual stream) writes f16/bf16 directly, and
//! its backward reads the half gradient, with no cast kernel either way.

use super::binary::record_add_sub;
use super::{check_pair, stats_dtype};
use crate::autograd::{SavedTensor, record, take_pending_grad};
use crate::backend::mixes_with;
use crate::backend::rows::{self, LayerNorm, LayerNormBackward, Residual};
use crate::base::{Error, Result};
use crate::tensor::{DType, Tensor};

impl Tensor {
    /// (x - mean) / √(var + eps) · weight + bias over the trailing dims `normalized_shape`
    /// (x: (..., *normalized_shape); weight, bias: normalized_shape, each optional).
    /// Gradients flow to x, weight and bias.
    #[track_caller]
    pub fn layer_norm(
        &self,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if let Some([Some(x), w, b]) = super::autocast::cast_f32_opt([Some(self), weight, bias])? {
            return x.layer_norm(normalized_shape, w.as_ref(), b.as_ref(), eps);
        }
        Ok(self
            .layer_norm_into(None, normalized_shape, weight, bias, eps, self.dtype())?
            .1)
    }

    /// `layer_norm` with its output in `dtype`: equal, bit for bit, to
    /// `x.layer_norm(normalized_shape, weight, bias, eps)?.to_dtype(dtype)`, forward and
    /// backward (the gradient arrives in `dtype`; x, weight and bias get theirs in their own
    /// dtype). An f32 norm (autocast's, for any input in a region) with an f16/bf16 output is
    /// one kernel each way; any other pair runs the norm and then the cast.
    #[track_caller]
    pub fn layer_norm_to(
        &self,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
        dtype: DType,
    ) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if let Some([Some(x), w, b]) = super::autocast::cast_f32_opt([Some(self), weight, bias])? {
            return x.layer_norm_to(normalized_shape, w.as_ref(), b.as_ref(), eps, dtype);
        }
        if !mixes_with(self.dtype(), dtype) {
            // No kernel writes this pair: the composition.
            return self
                .layer_norm(normalized_shape, weight, bias, eps)?
                .to_dtype(dtype);
        }
        Ok(self
            .layer_norm_into(None, normalized_shape, weight, bias, eps, dtype)?
            .1)
    }

    /// A pre-norm block's residual step: `(s, y)` with s = self + branch and y = s's layer
    /// norm in `dtype` — equal, bit for bit, forward and backward, to
    /// `let s = self.add(branch)?; let y = s.layer_norm_to(normalized_shape, weight, bias, eps, dtype)?;`.
    /// One kernel writes both when branch has self's shape and `dtype` (an f32 stream with a
    /// half-precision branch feeding a half-precision Linear, or all of one dtype) and no
    /// autocast cast is due; anything else runs that composition.
    #[track_caller]
    #[allow(clippy::too_many_arguments)]
    pub fn add_layer_norm_to(
        &self,
        branch: &Tensor,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
        dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        let _site = crate::memory::recorder::CallSite::enter();
        let fusable = branch.shape() == self.shape()
            && branch.dtype() == dtype
            && self.dtype().is_float()
            && mixes_with(self.dtype(), dtype)
            && branch.device() == self.device()
            && !super::autocast::casts_to_f32(&[Some(self), weight, bias]);
        if !fusable {
            let s = self.add(branch)?;
            let y = s.layer_norm_to(normalized_shape, weight, bias, eps, dtype)?;
            return Ok((s, y));
        }
        self.layer_norm_into(Some(branch), normalized_shape, weight, bias, eps, dtype)
    }

    /// The fused op, its output in `out` (x's dtype, or a half dtype for f32 x), on
    /// self + branch when there is a branch (of `out`'s dtype and self's shape). Returns the
    /// rows normalised (self, or the recorded sum) and the output.
    fn layer_norm_into(
        &self,
        branch: Option<&Tensor>,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
        out: DType,
    ) -> Result<(Tensor, Tensor)> {
        let rows = check_args(self, normalized_shape, weight, bias)?;
        let n: usize = normalized_shape.iter().product();
        // The kernel reads rows of the last dim: flatten to (R, N) and the parameters to (N).
        let x = self.detached_contiguous()?.reshape(&[rows, n])?;
        let flat = |p: &Tensor| p.detached_contiguous()?.reshape(&[n]);
        let (w, b) = (weight.map(flat).transpose()?, bias.map(flat).transpose()?);
        // The branch as (R, N) and the buffer its sum with x goes to.
        let added = branch
            .map(|h| {
                let sum = Tensor::output_uninit(&[rows, n], self.dtype(), self.device(), "add")?;
                Ok::<_, Error>((h, h.detached_contiguous()?.reshape(&[rows, n])?, sum))
            })
            .transpose()?;
        let y = Tensor::output_uninit(self.shape(), out, self.device(), "layer_norm")?;
        let stats = stats_dtype(self.dtype());
        let mean = Tensor::output_uninit(&[rows], stats, self.device(), "layer_norm")?;
        let rstd = Tensor::output_uninit(&[rows], stats, self.device(), "layer_norm")?;
        let residual = added.as_ref().map(|(_, h, sum)| Residual {
            h: h.view(),
            sum: sum.storage(),
        });
        rows::layer_norm(&LayerNorm {
            x: x.view(),
            residual,
            weight: w.as_ref().map(Tensor::view),
            bias: b.as_ref().map(Tensor::view),
            y: y.storage(),
            mean: mean.storage(),
            rstd: rstd.storage(),
            eps,
        })?;
        // The rows normalised: self, or the sum recorded as the add it is.
        let (input, x, half_branch) = match added {
            Some((branch, _, sum)) => {
                let s = sum.reshape(self.shape())?;
                let mixed = branch.dtype() != self.dtype();
                let input = if mixed {
                    half_grad::record_residual_add(self, branch, s)
                } else {
                    record_add_sub(self, branch, s, false, "add")
                };
                // The norm's backward writes the branch's half gradient only if it has one,
                // and its column sums where a Linear's bias gradient will want them.
                let half =
                    (mixed && crate::autograd::should_record(&[branch])).then(|| HalfBranch {
                        dtype: branch.dtype(),
                        sums: ends_in_biased_linear(branch),
                    });
                (input, sum, half)
            }
            None => (self.clone(), x, None),
        };
        let recorded: Vec<&Tensor> = [Some(&input), weight, bias].into_iter().flatten().collect();
        let y = record("layer_norm", &recorded, y, |_, _| {
            let saved = Saved {
                x: SavedTensor::new(&x),
                weight: w.as_ref().map(SavedTensor::new),
                mean: SavedTensor::new(&mean),
                rstd: SavedTensor::new(&rstd),
                bias: b.is_some(),
                x_shape: self.shape().to_vec(),
                param_shape: normalized_shape.to_vec(),
                half_branch,
            };
            move |g: &Tensor, needs: &[bool]| saved.backward(g, needs)
        });
        Ok((input, y))
    }
}

/// What layer norm's backward reads: x as (R, N), the weight as (N), the row statistics.
struct Saved {
    x: SavedTensor,
    weight: Option<SavedTensor>,
    mean: SavedTensor,
    rstd: SavedTensor,
    /// The bias needs no values, only a gradient.
    bias: bool,
    x_shape: Vec<usize>,
    param_shape: Vec<usize>,
    /// The half branch whose f32 sum x is (`add_layer_norm_to`'s fused add): gx is also
    /// written in its dtype, for that add's backward (`half_grad`).
    half_branch: Option<HalfBranch>,
}

#[derive(Clone, Copy)]
struct HalfBranch {
    dtype: DType,
    /// The branch ends in a biased Linear (or the MLP op), whose bias gradient is the column
    /// sums of the branch's gradient: the backward sums them as it writes that gradient
    /// (`column_sums`).
    sums: bool,
}

/// Whether `branch` is the output of a biased linear layer (attention's projection: x, w, b;
/// the MLP op, whose projection always has one), whose backward may take its bias gradient
/// from `column_sums`.
fn ends_in_biased_linear(branch: &Tensor) -> bool {
    branch.grad_fn().is_some_and(|node| match node.name() {
        "linear" => node.input_count() == 3,
        "mlp_gelu" => true,
        _ => false,
    })
}

impl Saved {
    /// [gx, gweight (if weight), gbias (if bias)], each only when needed. g (x's shape) comes
    /// in the output's dtype; the kernel reads it as it is when it can (x's dtype, or half
    /// beside f32 x), else after a cast to x's dtype — what the unfused composition does.
    fn backward(&self, g: &Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let (x, w) = (self.x.get(), self.weight.as_ref().map(SavedTensor::get));
        let g = if mixes_with(x.dtype(), g.dtype()) {
            g.clone()
        } else {
            g.to_dtype(x.dtype())?
        };
        let g = g.detached_contiguous()?.reshape(x.shape())?;
        let n = x.shape()[1];
        let grad = |shape: &[usize]| {
            Tensor::output_uninit(shape, x.dtype(), x.device(), "layer_norm_backward")
        };
        // x's gradient from its other uses (a residual stream's) is added as gx is written,
        // in place when nothing else sees that buffer.
        let prior = needs[0]
            .then(|| {
                take_pending_grad(0, |p| {
                    p.shape() == self.x_shape.as_slice() && p.dtype() == x.dtype()
                })
            })
            .flatten()
            .map(|p| p.detached_contiguous()?.reshape(x.shape()))
            .transpose()?;
        let gx = match &prior {
            Some(p) if p.is_exclusive() => p.clone(),
            _ => grad(x.shape())?,
        };
        let gw = w.map(|_| grad(&[n])).transpose()?;
        let gb = self.bias.then(|| grad(&[n])).transpose()?;
        // Under create_graph the add's backward casts a recorded gradient instead.
        let half = match self.half_branch {
            Some(b) if needs[0] && !crate::autograd::is_grad_enabled() => Some(
                Tensor::output_uninit(x.shape(), b.dtype, x.device(), "layer_norm_backward")?,
            ),
            _ => None,
        };
        let half_sums = match self.half_branch {
            Some(b) if b.sums && half.is_some() => Some(grad(&[n])?),
            _ => None,
        };
        rows::layer_norm_backward(&LayerNormBackward {
            x: x.view(),
            weight: w.map(Tensor::view),
            mean: self.mean.get().view(),
            rstd: self.rstd.get().view(),
            gy: g.view(),
            prior: prior.as_ref().map(Tensor::view),
            gx: gx.storage(),
            gweight: gw.as_ref().map(|t| &**t.storage()),
            gbias: gb.as_ref().map(|t| &**t.storage()),
            gx_half: half.as_ref().map(|t| &**t.storage()),
            gx_half_sums: half_sums.as_ref().map(|t| &**t.storage()),
        })?;
        let gx = gx.reshape(&self.x_shape)?;
        if let Some(half) = half {
            half_grad::offer(&gx, half.reshape(&self.x_shape)?, half_sums);
        }
        let params = [gw, gb]
            .into_iter()
            .flatten()
            .map(|t| t.reshape(&self.param_shape));
        let grads = std::iter::once(Ok(gx))
            .chain(params)
            .collect::<Result<Vec<_>>>()?;
        Ok(grads
            .into_iter()
            .zip(needs)
            .map(|(t, &need)| need.then_some(t))
            .collect())
    }
}

/// Checks dtypes, devices and shapes; returns the number of rows R.
fn check_args(
    x: &Tensor,
    normalized_shape: &[usize],
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
) -> Result<usize> {
    super::check_float("layer_norm", x)?;
    let shape = x.shape();
    if normalized_shape.is_empty() || !shape.ends_with(normalized_shape) {
        return Err(Error::shape(
            "layer_norm",
            format!(
                "normalized_shape {normalized_shape:?} must be non-empty and equal the input's trailing dims; the input has shape {shape:?}"
            ),
        ));
    }
    for (name, p) in [("weight", weight), ("bias", bias)] {
        let Some(p) = p else { continue };
        check_pair("layer_norm", x, p)?;
        if p.shape() != normalized_shape {
            return Err(Error::shape(
                "layer_norm",
                format!(
                    "{name} has shape {:?}; it must equal normalized_shape {normalized_shape:?}",
                    p.shape()
                ),
            ));
        }
    }
    Ok(shape[..shape.len() - normalized_shape.len()]
        .iter()
        .product())
}

/// The residual add of `add_layer_norm_to` with a half branch beside f32 rows, s = x + h:
/// its backward gives h the gradient of s rounded to h's dtype. The layer norm's backward,
/// which writes that gradient (gx: the norm's own term plus what s's other uses sent), writes
/// its rounding in the same pass and offers it here; the add's backward takes it instead of
/// launching a cast, when the gradient it receives is still that very buffer, unchanged (the
/// same storage at the same version), else it casts as any add does. One offer is held at a
/// time, on the thread that runs the backward; one that no add takes (a backward stopped by
/// an error between the two) is dropped by the next offer or take.
mod half_grad {
    use super::super::column_sums::{self, BufferId};
    use crate::autograd::record;
    use crate::base::Result;
    use crate::tensor::Tensor;
    use std::cell::RefCell;

    struct Offer {
        /// gx when offered.
        of: BufferId,
        half: Tensor,
        /// The half gradient's column sums, where the norm summed them.
        sums: Option<Tensor>,
    }

    thread_local! {
        static OFFER: RefCell<Option<Offer>> = const { RefCell::new(None) };
    }

    /// Offers `half`, gx rounded, for the add whose output's gradient is gx, with its column
    /// sums where they were summed (passed on to the branch's Linear by `column_sums`).
    pub(super) fn offer(gx: &Tensor, half: Tensor, sums: Option<Tensor>) {
        let offer = Offer {
            of: BufferId::of(gx),
            half,
            sums,
        };
        OFFER.with(|o| *o.borrow_mut() = Some(offer));
    }

    /// The offer (dropping it either way) when it is g's rounding to `dtype`.
    fn take(g: &Tensor, dtype: crate::tensor::DType) -> Option<Offer> {
        let offer = OFFER.with(|o| o.borrow_mut().take())?;
        let same = offer.of.is(g) && offer.half.shape() == g.shape() && offer.half.dtype() == dtype;
        same.then_some(offer)
    }

    /// s = x + h recorded as `add` (s already computed): backward (g, g rounded to h's dtype).
    pub(super) fn record_residual_add(x: &Tensor, h: &Tensor, s: Tensor) -> Tensor {
        let (x_dtype, h_dtype) = (x.dtype(), h.dtype());
        record("add", &[x, h], s, move |_, _| {
            move |g: &Tensor, n: &[bool]| -> Result<Vec<Option<Tensor>>> {
                let offered = take(g, h_dtype);
                let gh = match (n[1], offered) {
                    (false, _) => None,
                    (true, Some(Offer { half, sums, .. })) => {
                        if let Some(sums) = sums {
                            column_sums::offer(&half, sums);
                        }
                        Some(half)
                    }
                    (true, None) => Some(g.to_dtype(h_dtype)?),
                };
                let gx = n[0].then(|| g.to_dtype(x_dtype)).transpose()?;
                Ok(vec![gx, gh])
            }
        })
    }
}
