//! GELU then a Linear, `pre.gelu(approx).linear(w, b)`, as one op that saves only the GELU's
//! input. The GELU's output — the Linear's input, 4C wide in a transformer's MLP — lives
//! only through the forward and is recomputed in backward (one elementwise pass) for the
//! weight gradient. A GPT block's largest saved activation goes away; torch.compile's
//! partitioner makes the same trade for cheap pointwise ops.
//!
//! Forward and backward run the two ops' kernels in the same order on the same values, so the
//! output and every gradient are theirs bit for bit. Not differentiable twice: create_graph
//! through it is the engine's usual error for a fused backward.

use super::autocast::ParamIn;
use super::binary::unary_forward;
use super::linear::{GradDTypes, kernel_grads};
use super::unary::{backward_into_grad, gelu_kernels};
use super::{GeluApprox, autocast};
use crate::autograd::{SavedTensor, no_grad, record};
use crate::base::Result;
use crate::tensor::Tensor;

impl Tensor {
    /// pre: (..., in) → `linear(gelu(pre), weight, bias)`: (..., out), weight (out, in), bias
    /// (out). Saves pre (and the weight), not gelu(pre).
    #[track_caller]
    pub fn gelu_linear(
        &self,
        approx: GeluApprox,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        // Autocast would cast the GELU's output for the Linear: the composition does that.
        if autocast::lower_cast_target(self.dtype()).is_some() {
            return self.gelu(approx)?.linear(weight, bias);
        }
        if let Some([_, Some(w), b]) = autocast::cast_lower_opt([Some(self), Some(weight), bias])? {
            let b = b.as_ref().zip(bias).map(|(v, orig)| ParamIn::cast(v, orig));
            return self.gelu_linear_params(approx, ParamIn::cast(&w, weight), b);
        }
        self.gelu_linear_params(approx, ParamIn::plain(weight), bias.map(ParamIn::plain))
    }

    /// `gelu_linear` on parameters whose graph nodes may be other tensors than the values
    /// the GEMMs read (see `ParamIn`), past the autocast policy.
    fn gelu_linear_params(
        &self,
        approx: GeluApprox,
        w_in: ParamIn,
        b_in: Option<ParamIn>,
    ) -> Result<Tensor> {
        let (weight, bias) = (w_in.value, b_in.map(|b| b.value));
        let (op, back) = gelu_kernels(approx);
        let out = {
            let h = unary_forward(op, self, "gelu")?;
            let _plain = no_grad();
            h.linear(weight, bias)?
        };
        let inputs: Vec<&Tensor> = [Some(self), Some(w_in.node), b_in.map(|b| b.node)]
            .into_iter()
            .flatten()
            .collect();
        let dtypes = GradDTypes::of(w_in, b_in);
        let pre_shape = self.shape().to_vec();
        let k = pre_shape.last().copied().unwrap_or(1);
        let rows = self.numel() / k.max(1);
        Ok(record("gelu_linear", &inputs, out, |_, needs| {
            // pre gives the GELU's gradient (with the weight) and, through gelu(pre), the
            // weight's; the bias needs neither.
            let pre = (needs[0] || needs[1]).then(|| SavedTensor::new(self));
            let w = needs[0].then(|| SavedTensor::new(weight));
            let leaf = (needs[1] && w_in.node.is_leaf()).then(|| w_in.node.clone());
            move |g: &Tensor, n: &[bool]| {
                let g2 = g.reshape(&[rows, g.shape()[g.dims() - 1]])?;
                let pre = pre
                    .as_ref()
                    .map(|p| p.get().reshape(&[rows, k]))
                    .transpose()?;
                // The Linear's input again, only for its weight gradient.
                let h = match (&pre, n[1]) {
                    (Some(p), true) => Some(unary_forward(op, p, "gelu_recompute")?),
                    _ => None,
                };
                let w = w.as_ref().map(SavedTensor::get);
                let mut grads = kernel_grads(&g2, h.as_ref(), w, leaf.as_ref(), n, dtypes)?;
                drop(h);
                if let (Some(gh), Some(p)) = (grads[0].take(), &pre) {
                    let gpre = backward_into_grad(back, &gh, p, "gelu_backward")?;
                    grads[0] = Some(gpre.reshape(&pre_shape)?);
                }
                Ok(grads)
            }
        }))
    }
}
