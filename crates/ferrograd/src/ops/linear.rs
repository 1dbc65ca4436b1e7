//! `linear(x, w, b) = x @ wᵀ + b` as one op, like PyTorch's addmm: the bias is added by the
//! GEMM (cuBLASLt's epilogue on the GPU, in place after the product on the CPU), so the
//! forward allocates one (N, out) tensor, not two.
//! Backward: dx = g @ w, dw = gᵀ @ x, db = Σ_rows g (summed by the dw GEMM's epilogue where
//! the backend fuses it, a reduction otherwise). A leaf weight with a gradient sink
//! (the fused SGD step) is offered dw as the product gᵀ·x instead, and then gets no dw at all.
//! Under create_graph the same three products are recorded ops on the saved values with their
//! history (`recorded_grads`), and no sink is offered anything.
//! Under autocast, an f32 parameter read through the weight-cast cache gets its node here
//! (`autocast::ParamIn`): dw and db are written in f32 by GEMMs on the half operands.

use super::OutputValue;
use super::aligned_gemm;
use super::autocast::ParamIn;
use super::matmul::{linear_bias_forward, matmul_forward, matmul_forward_as};
use crate::autograd::{GradProduct, ProductForm, SavedTensor, is_grad_enabled, record};
use crate::backend::ReduceOp;
use crate::backend::matmul::{self, MatmulSpec};
use crate::base::{DType, Error, Result};
use crate::tensor::Tensor;

impl Tensor {
    /// x: (..., in), weight: (out, in), bias: (out) → (..., out)
    #[track_caller]
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.linear_value(weight, bias, OutputValue::Computed)
    }

    /// `linear`, or with `OutputValue::Skipped` its graph node alone (no product is computed;
    /// backward is the same).
    pub(crate) fn linear_value(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        value: OutputValue,
    ) -> Result<Tensor> {
        if let Some([Some(x), Some(w), b]) =
            super::autocast::cast_lower_opt([Some(self), Some(weight), bias])?
        {
            let b = b.as_ref().zip(bias).map(|(v, orig)| ParamIn::cast(v, orig));
            return x.linear_params(ParamIn::cast(&w, weight), b, value);
        }
        self.linear_params(ParamIn::plain(weight), bias.map(ParamIn::plain), value)
    }

    /// `linear_value` on parameters whose graph node may be another tensor than the value
    /// the GEMMs read (see `ParamIn`); x, the values and the nodes are past the autocast
    /// policy.
    fn linear_params(
        &self,
        w_in: ParamIn,
        b_in: Option<ParamIn>,
        value: OutputValue,
    ) -> Result<Tensor> {
        let (weight, bias) = (w_in.value, b_in.map(|b| b.value));
        let (rank, inner) = (self.dims(), weight.dims());
        if rank < 1 || inner != 2 || self.shape()[rank - 1] != weight.shape()[1] {
            return Err(Error::shape(
                "linear",
                format!(
                    "input {:?} does not match weight {:?}: the input's last dim must equal the weight's second dim (in_features)",
                    self.shape(),
                    weight.shape()
                ),
            ));
        }
        if let Some(b) = bias
            && b.shape() != [weight.shape()[0]]
        {
            return Err(Error::shape(
                "linear",
                format!(
                    "bias {:?} must have shape [{}]",
                    b.shape(),
                    weight.shape()[0]
                ),
            ));
        }
        let k = weight.shape()[1];
        let rows = self.numel() / k.max(1);
        // A copy only when strided; recorded then, so the saved input keeps its history.
        let x_in = self.contiguous()?;
        let x2 = x_in.detach().reshape(&[rows, k])?;
        if let Some(b) = bias {
            super::check_pair("linear", self, b)?;
        }
        let mut shape = self.shape().to_vec();
        shape[rank - 1] = weight.shape()[0];
        let out = value.output((&shape, x2.dtype(), x2.device()), || {
            product(&x2, weight, bias, &shape)
        })?;
        let inputs: Vec<&Tensor> = match b_in {
            Some(b) => vec![self, w_in.node, b.node],
            None => vec![self, w_in.node],
        };
        let x_shape = self.shape().to_vec();
        let dtypes = GradDTypes::of(w_in, b_in);
        Ok(record("linear", &inputs, out, |_, needs| {
            let x = needs[1].then(|| SavedTensor::new(&x_in));
            let w = needs[0].then(|| SavedTensor::new(weight));
            // The parameter itself (not saved: the sink reads no values of it here).
            let leaf = (needs[1] && w_in.node.is_leaf()).then(|| w_in.node.clone());
            move |g: &Tensor, n: &[bool]| {
                let n_out = g.shape()[g.dims() - 1];
                let g2 = g.reshape(&[rows, n_out])?;
                if is_grad_enabled() {
                    let x = x
                        .as_ref()
                        .map(|x| x.unpack().reshape(&[rows, k]))
                        .transpose()?;
                    let w = w.as_ref().map(SavedTensor::unpack);
                    let mut grads = recorded_grads(&g2, x.as_ref(), w.as_ref(), n, dtypes)?;
                    if let Some(gx) = grads[0].take() {
                        grads[0] = Some(gx.reshape(&x_shape)?);
                    }
                    return Ok(grads);
                }
                let w = w.as_ref().map(SavedTensor::get);
                let x2 = x
                    .as_ref()
                    .filter(|_| n[1])
                    .map(|x| x.get().reshape(&[rows, k]))
                    .transpose()?;
                let mut grads = kernel_grads(&g2, x2.as_ref(), w, leaf.as_ref(), n, dtypes)?;
                if let Some(gx) = grads[0].take() {
                    grads[0] = Some(gx.reshape(&x_shape)?);
                }
                Ok(grads)
            }
        }))
    }

    /// Transposed 2-D view without autograd (internal).
    pub(crate) fn t_view(&self) -> Result<Tensor> {
        Ok(self.with_layout(self.layout().permute(&[1, 0])?))
    }
}

/// The dtypes a linear layer's weight and bias gradients are written in: their graph
/// nodes' (f32 for a parameter under autocast whose node is the f32 parameter), which the
/// GEMM writes directly from operands of the output gradient's dtype.
#[derive(Clone, Copy)]
pub(super) struct GradDTypes {
    pub(super) weight: DType,
    pub(super) bias: DType,
}

impl GradDTypes {
    pub(super) fn of(w: ParamIn, b: Option<ParamIn>) -> GradDTypes {
        let weight = w.node.dtype();
        GradDTypes {
            weight,
            bias: b.map_or(weight, |b| b.node.dtype()),
        }
    }
}

/// x2 (N, in) @ weightᵀ (+ bias), viewed as `shape` (..., out). A bias is added by the GEMM's
/// epilogue where the backend can (one pass over the output); without one a wide unaligned
/// output is computed at an aligned width (ops/aligned_gemm.rs).
fn product(x2: &Tensor, weight: &Tensor, bias: Option<&Tensor>, shape: &[usize]) -> Result<Tensor> {
    let out = match bias {
        Some(b) => linear_bias_forward(x2, weight, b)?,
        None => match aligned_gemm::forward(x2, weight)? {
            Some(out) => out,
            None => matmul_forward(x2, &weight.t_view()?)?,
        },
    };
    let layout = out.layout().reshape_view(shape).ok_or_else(|| {
        Error::shape(
            "linear",
            "the (rows, out) product does not view as (..., out)",
        )
    })?;
    Ok(out.with_layout(layout))
}

/// A linear layer's gradients outside create_graph, in its inputs' order [dx, dw, db (when
/// `n` has a third entry)], each only where `n` asks: dx (rows, in) = g2 @ w from g2 (rows,
/// out) and w (out, in); dw = g2ᵀ·x2 from x2 (rows, in), offered first to `leaf`'s gradient
/// sink; db = Σ_rows g2, as the op that wrote g2 summed it (`column_sums`), else from dw's
/// GEMM where the backend fuses it, else a reduction. dw and db in `dtypes`.
/// dx is computed before dw.
pub(super) fn kernel_grads(
    g2: &Tensor,
    x2: Option<&Tensor>,
    w: Option<&Tensor>,
    leaf: Option<&Tensor>,
    n: &[bool],
    dtypes: GradDTypes,
) -> Result<Vec<Option<Tensor>>> {
    let gx = match (w, n[0]) {
        (Some(w), true) => Some(aligned_gemm::input_grad(g2, w)?),
        _ => None,
    };
    let wants_bias = n.len() == 3 && n[2];
    // Summed already by the op that wrote g2 (a layer norm's backward), or dropped here.
    let offered = super::column_sums::take(g2, dtypes.bias).filter(|_| wants_bias);
    let sum_here = wants_bias && offered.is_none();
    let (gw, gb) = match (x2, n[1]) {
        (Some(x2), true) => weight_and_bias_grads(leaf, g2, x2, sum_here, dtypes)?,
        _ => (None, None),
    };
    let gb = match (offered.or(gb), sum_here) {
        (Some(gb), _) => Some(gb),
        (None, true) => {
            // Summed straight into the bias gradient's dtype (the kernels accumulate wide).
            let n_out = g2.shape()[1];
            Some(
                g2.reduce_dims_into(ReduceOp::Sum, &[0], "linear_backward", dtypes.bias)?
                    .reshape(&[n_out])?,
            )
        }
        (None, false) => None,
    };
    let mut grads = vec![gx, gw];
    if n.len() == 3 {
        grads.push(gb);
    }
    Ok(grads)
}

/// (dx, dw, db) as recorded ops for a create_graph backward. g: (N, out), x: (N, in),
/// w: (out, in); `n` says which are wanted (a third entry when there is a bias). dw and db
/// are products and sums in `dtypes` (recorded casts of g and x to f32 for a half layer
/// whose parameters are f32: the values the kernels' f32-output GEMMs give).
fn recorded_grads(
    g: &Tensor,
    x: Option<&Tensor>,
    w: Option<&Tensor>,
    n: &[bool],
    dtypes: GradDTypes,
) -> Result<Vec<Option<Tensor>>> {
    let gx = match w {
        Some(w) if n[0] => Some(g.matmul(w)?),
        _ => None,
    };
    let gw = match x {
        Some(x) if n[1] => {
            let d = dtypes.weight;
            Some(g.to_dtype(d)?.t()?.matmul(&x.to_dtype(d)?)?)
        }
        _ => None,
    };
    let mut grads = vec![gx, gw];
    if n.len() == 3 {
        grads.push(if n[2] {
            Some(g.to_dtype(dtypes.bias)?.sum(&[0], false)?)
        } else {
            None
        });
    }
    Ok(grads)
}

/// dW = gᵀ·x (g: (N, out), x: (N, in)) in `dtypes.weight`, unless the weight's gradient
/// sink consumes it (offered the half factors of an f32 parameter's gradient too: the sink
/// takes them only where it can write an f32 product of them), and with `bias` db = Σ_N g
/// from the same GEMM where the backend fuses it and both share a dtype (else db is None and
/// the caller reduces g).
fn weight_and_bias_grads(
    leaf: Option<&Tensor>,
    g2: &Tensor,
    x: &Tensor,
    bias: bool,
    dtypes: GradDTypes,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let product = GradProduct {
        a: g2,
        b: x,
        form: ProductForm::TransposeLeft,
    };
    if let Some(w) = leaf
        && let Some(sink) = w.usable_grad_sink()
        && sink.consume_product(w, &product)?
    {
        return Ok((None, None));
    }
    let gt = g2.t_view()?;
    let fusable = bias && dtypes.bias == dtypes.weight;
    if fusable && let Some((gw, gb)) = weight_grad_with_row_sums(&gt, x, dtypes.weight)? {
        return Ok((Some(gw), Some(gb)));
    }
    Ok((Some(matmul_forward_as(&gt, x, dtypes.weight)?), None))
}

/// gᵀ·x and Σ_N g in one GEMM (gt: (out, N), x: (N, in)), both written as `dtype`, or None
/// where the backend does not fuse them (nothing computed).
fn weight_grad_with_row_sums(
    gt: &Tensor,
    x: &Tensor,
    dtype: DType,
) -> Result<Option<(Tensor, Tensor)>> {
    let (n_out, rows, k) = (gt.shape()[0], gt.shape()[1], x.shape()[1]);
    let empty = rows == 0 || n_out == 0 || k == 0;
    if empty || gt.dtype() != x.dtype() || !matmul::fuses_row_sums(x.device())? {
        return Ok(None);
    }
    let gw = Tensor::output_uninit(&[n_out, k], dtype, x.device(), "linear_backward")?;
    let gb = Tensor::output_uninit(&[n_out], dtype, x.device(), "linear_backward")?;
    let spec = MatmulSpec {
        batch: 1,
        m: n_out,
        n: k,
        k: rows,
    };
    let fused = matmul::matmul_row_sums(&spec, gt.view(), x.view(), gw.storage(), gb.storage())?;
    Ok(fused.then_some((gw, gb)))
}
