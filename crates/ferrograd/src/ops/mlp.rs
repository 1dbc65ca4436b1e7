//! GPT-2's feed-forward block as one op: `gelu_tanh(x @ w_fcᵀ + b_fc) @ w_projᵀ + b_proj`.
//! Values and saved bytes are those of linear → gelu → linear (it saves x, the pre-activation
//! and the GELU's output), but the GEMMs carry the elementwise work in their epilogues where
//! the backend can (cuBLASLt on the GPU):
//! - forward: the first GEMM adds b_fc and applies GELU, writing the pre-activation beside
//!   its output; the second adds b_proj;
//! - backward: the GEMM that computes the GELU's output gradient (g @ w_proj) multiplies it
//!   by gelu'(pre) before storing it; the weight-gradient GEMMs sum the bias gradients.
//!
//! Shapes: x (..., C), w_fc (H, C), b_fc (H), w_proj (O, H), b_proj (O) → (..., O).
//! `mlp_gelu_recomputed` is the same op saving the pre-activation only: the (N, H) GELU output
//! — a GPT block's largest activation — lives through the forward alone, and backward rebuilds
//! it with one elementwise GELU pass for w_proj's gradient (the trade torch.compile's
//! partitioner makes for pointwise ops). Where the first GEMM's epilogue computes GELU before
//! rounding the pre-activation (cuBLASLt), the rebuilt output can differ from the forward's by
//! one rounding in a few elements; on the CPU both come from the same kernel, bit for bit.
//! Under create_graph the backward is the composed ops' (recorded, on the saved values with
//! their history), so higher-order gradients see the same graph as the unfused layers.
//! Under autocast, f32 parameters read through the weight-cast cache get the node (see
//! `autocast::ParamIn`), and their gradients are written in f32 by the GEMMs.

use super::OutputValue;
use super::autocast::ParamIn;
use super::binary::unary_forward;
use super::linear::{GradDTypes, kernel_grads};
use super::matmul::{linear_bias_forward, matmul_forward};
use super::unary::GeluApprox;
use crate::autograd::{SavedTensor, is_grad_enabled, record};
use crate::backend::matmul::{self, MatmulSpec};
use crate::backend::{UnaryOp, View};
use crate::base::{Error, Result};
use crate::tensor::Tensor;

impl Tensor {
    /// gelu_tanh(x @ w_fcᵀ + b_fc) @ w_projᵀ + b_proj. x: (..., C) → (..., O).
    #[track_caller]
    pub fn mlp_gelu(
        &self,
        w_fc: &Tensor,
        b_fc: &Tensor,
        w_proj: &Tensor,
        b_proj: &Tensor,
    ) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.mlp_gelu_value([w_fc, b_fc, w_proj, b_proj], false, OutputValue::Computed)
    }

    /// `mlp_gelu` saving x and the pre-activation only: backward recomputes the GELU's
    /// (..., H) output (one elementwise pass) instead of keeping it from the forward.
    #[track_caller]
    pub fn mlp_gelu_recomputed(
        &self,
        w_fc: &Tensor,
        b_fc: &Tensor,
        w_proj: &Tensor,
        b_proj: &Tensor,
    ) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.mlp_gelu_value([w_fc, b_fc, w_proj, b_proj], true, OutputValue::Computed)
    }

    /// Either op on params [w_fc, b_fc, w_proj, b_proj] (`mlp_gelu_recomputed` when
    /// `recompute_gelu`), through the autocast policy. With `OutputValue::Skipped` the second
    /// product is not computed (the output is a stand-in; backward is the same).
    pub(crate) fn mlp_gelu_value(
        &self,
        params: [&Tensor; 4],
        recompute_gelu: bool,
        value: OutputValue,
    ) -> Result<Tensor> {
        let keep = if recompute_gelu {
            GeluOutput::Recomputed
        } else {
            GeluOutput::Saved
        };
        let [w_fc, b_fc, w_proj, b_proj] = params;
        if let Some([x, wf, bf, wp, bp]) =
            super::autocast::cast_lower([self, w_fc, b_fc, w_proj, b_proj])?
        {
            let values = [&wf, &bf, &wp, &bp];
            let p: [ParamIn; 4] = std::array::from_fn(|i| ParamIn::cast(values[i], params[i]));
            return x.mlp_gelu_params(p, keep, value);
        }
        self.mlp_gelu_params(params.map(ParamIn::plain), keep, value)
    }

    /// `mlp_gelu` on [w_fc, b_fc, w_proj, b_proj] whose graph nodes may be other tensors
    /// than the values the GEMMs read (see `ParamIn`), past the autocast policy.
    fn mlp_gelu_params(
        &self,
        p: [ParamIn; 4],
        keep: GeluOutput,
        value: OutputValue,
    ) -> Result<Tensor> {
        let [w_fc, b_fc, w_proj, b_proj] = p.map(|p| p.value);
        let (c, hidden, c_out) = check_shapes(self, w_fc, b_fc, w_proj, b_proj)?;
        for t in [w_fc, b_fc, w_proj, b_proj] {
            super::check_pair("mlp", self, t)?;
        }
        let rows = self.numel() / c.max(1);
        let x_in = self.contiguous()?;
        let x2 = x_in.detach().reshape(&[rows, c])?;
        let (pre, h) = first_layer(&x2, w_fc, b_fc)?;
        let mut shape = self.shape().to_vec();
        let last = shape.len() - 1;
        shape[last] = c_out;
        let y = value.output((&shape, h.dtype(), h.device()), || {
            linear_bias_forward(&h, w_proj, b_proj)?.reshape(&shape)
        })?;
        let x_shape = self.shape().to_vec();
        let inputs = [self, p[0].node, p[1].node, p[2].node, p[3].node];
        Ok(record("mlp_gelu", &inputs, y, |_, needs| {
            let saved = Saved {
                x: SavedTensor::new(&x_in),
                w_fc: SavedTensor::new(w_fc),
                b_fc: SavedTensor::new(b_fc),
                w_proj: SavedTensor::new(w_proj),
                pre: SavedTensor::new(&pre),
                h: (keep == GeluOutput::Saved).then(|| SavedTensor::new(&h)),
                // The parameters themselves, for their gradient sinks (no values read).
                leaf_fc: (needs[1] && p[0].node.is_leaf()).then(|| p[0].node.clone()),
                leaf_proj: (needs[3] && p[2].node.is_leaf()).then(|| p[2].node.clone()),
                dtypes_fc: GradDTypes::of(p[0], Some(p[1])),
                dtypes_proj: GradDTypes::of(p[2], Some(p[3])),
                dims: (rows, c, hidden, c_out),
                x_shape,
            };
            move |g: &Tensor, n: &[bool]| saved.backward(g, n)
        }))
    }
}

/// What the MLP op keeps of its GELU's output for backward.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum GeluOutput {
    /// Saved from the forward.
    Saved,
    /// Dropped after the forward; backward recomputes it from the pre-activation.
    Recomputed,
}

/// Whether `mlp_gelu` pays on `device`: where its GEMMs carry the GELU in their epilogues
/// (the GPU). Elsewhere it runs the same product and elementwise passes as the separate
/// layers, and as one graph node it keeps its output gradient alive until every input's
/// gradient exists (768 KiB more at the main job's peak on the CPU), so a model composes
/// the layers there.
pub fn mlp_gelu_fused(device: crate::base::Device) -> bool {
    matmul::gelu_epilogues_fused(device)
}

/// (H) and (O) for x (..., C): the layers must chain C → H → O.
fn check_shapes(
    x: &Tensor,
    w_fc: &Tensor,
    b_fc: &Tensor,
    w_proj: &Tensor,
    b_proj: &Tensor,
) -> Result<(usize, usize, usize)> {
    let ok = x.dims() >= 1
        && w_fc.dims() == 2
        && w_proj.dims() == 2
        && x.shape()[x.dims() - 1] == w_fc.shape()[1]
        && w_proj.shape()[1] == w_fc.shape()[0]
        && b_fc.shape() == [w_fc.shape()[0]]
        && b_proj.shape() == [w_proj.shape()[0]];
    if !ok {
        return Err(Error::shape(
            "mlp",
            format!(
                "x {:?}, w_fc {:?}, b_fc {:?}, w_proj {:?}, b_proj {:?} do not chain: expected x (..., C), w_fc (H, C), b_fc (H), w_proj (O, H), b_proj (O)",
                x.shape(),
                w_fc.shape(),
                b_fc.shape(),
                w_proj.shape(),
                b_proj.shape()
            ),
        ));
    }
    Ok((w_fc.shape()[1], w_fc.shape()[0], w_proj.shape()[0]))
}

/// (pre, h) = (x @ wᵀ + b, gelu_tanh(pre)) for x (N, C), w (H, C): (N, H) each.
fn first_layer(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    let (rows, c, hidden) = (x.shape()[0], x.shape()[1], w.shape()[0]);
    let alloc = |name| {
        // With C = 0 the product is all zeros, which only a zero-filled output gives.
        if c > 0 {
            Tensor::output_uninit(&[rows, hidden], x.dtype(), x.device(), name)
        } else {
            Tensor::output(&[rows, hidden], x.dtype(), x.device(), name)
        }
    };
    let (pre, h) = (alloc("mlp")?, alloc("mlp")?);
    let spec = MatmulSpec {
        batch: 1,
        m: rows,
        n: hidden,
        k: c,
    };
    let wt = w.layout().permute(&[1, 0])?;
    matmul::matmul_bias_gelu(
        &spec,
        x.view(),
        View {
            storage: w.storage(),
            layout: &wt,
        },
        b.view(),
        pre.storage(),
        h.storage(),
    )?;
    Ok((pre, h))
}

/// A linear layer's (dW, db) for output gradient g2: (N, out): dW = g2ᵀ·x when x (N, in) is
/// given, db = Σ_N g2 when `bias` (from dW's GEMM where the backend fuses it), in `dtypes`.
fn param_grads(
    leaf: Option<&Tensor>,
    g2: &Tensor,
    x: Option<&Tensor>,
    bias: bool,
    dtypes: GradDTypes,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let n = [false, x.is_some(), bias];
    let mut grads = kernel_grads(g2, x, None, leaf, &n, dtypes)?;
    Ok((grads[1].take(), grads[2].take()))
}

/// What the backward reads. Saving a parameter or an activation is a reference, not a copy.
struct Saved {
    x: SavedTensor,
    w_fc: SavedTensor,
    b_fc: SavedTensor,
    w_proj: SavedTensor,
    pre: SavedTensor,
    /// The GELU's output, unless backward recomputes it.
    h: Option<SavedTensor>,
    leaf_fc: Option<Tensor>,
    leaf_proj: Option<Tensor>,
    /// The layers' parameter gradient dtypes (their nodes').
    dtypes_fc: GradDTypes,
    dtypes_proj: GradDTypes,
    /// (N, C, H, O)
    dims: (usize, usize, usize, usize),
    x_shape: Vec<usize>,
}

impl Saved {
    /// [dx, dw_fc, db_fc, dw_proj, db_proj], each only when needed.
    fn backward(&self, g: &Tensor, n: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let (rows, _, hidden, c_out) = self.dims;
        let g2 = g.reshape(&[rows, c_out])?;
        if is_grad_enabled() {
            return self.recorded(&g2, n);
        }
        let h = n[3].then(|| self.gelu_output()).transpose()?;
        let leaf_proj = self.leaf_proj.as_ref();
        let (gw_proj, gb_proj) = param_grads(leaf_proj, &g2, h.as_ref(), n[4], self.dtypes_proj)?;
        // A recomputed output goes before the next (N, H) block is made.
        drop(h);
        let (mut gx, mut gw_fc, mut gb_fc) = (None, None, None);
        if n[0] || n[1] || n[2] {
            // dpre = (g @ w_proj) ∘ gelu'(pre): (N, O) @ (O, H) → (N, H).
            let w_proj = self.w_proj.get();
            let gpre = Tensor::output_uninit(&[rows, hidden], g.dtype(), g.device(), "mlp")?;
            let spec = MatmulSpec {
                batch: 1,
                m: rows,
                n: hidden,
                k: c_out,
            };
            let g2c = g2.contiguous()?;
            matmul::matmul_dgelu(
                &spec,
                g2c.view(),
                w_proj.view(),
                self.pre.get().view(),
                gpre.storage(),
            )?;
            if n[0] {
                gx = Some(matmul_forward(&gpre, self.w_fc.get())?.reshape(&self.x_shape)?);
            }
            let x = n[1]
                .then(|| self.x.get().reshape(&[rows, self.dims.1]))
                .transpose()?;
            let leaf_fc = self.leaf_fc.as_ref();
            (gw_fc, gb_fc) = param_grads(leaf_fc, &gpre, x.as_ref(), n[2], self.dtypes_fc)?;
        }
        Ok(vec![gx, gw_fc, gb_fc, gw_proj, gb_proj])
    }

    /// The GELU's (N, H) output: the saved one, or gelu_tanh(pre) again.
    fn gelu_output(&self) -> Result<Tensor> {
        match &self.h {
            Some(h) => Ok(h.get().clone()),
            None => unary_forward(UnaryOp::GeluTanh, self.pre.get(), "gelu_recompute"),
        }
    }

    /// The composed layers' gradients as recorded ops (create_graph): the pre-activation
    /// and GELU output rebuilt from the saved x with its history.
    fn recorded(&self, g2: &Tensor, n: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let (rows, c, _, _) = self.dims;
        let x = self.x.unpack().reshape(&[rows, c])?;
        let (w_fc, b_fc, w_proj) = (self.w_fc.unpack(), self.b_fc.unpack(), self.w_proj.unpack());
        let pre = x.linear(&w_fc, Some(&b_fc))?;
        let h = pre.gelu(GeluApprox::Tanh)?;
        let gpre = g2
            .matmul(&w_proj)?
            .mul(&pre.gelu_derivative(GeluApprox::Tanh)?)?;
        let want = |i: usize, f: &dyn Fn() -> Result<Tensor>| n[i].then(f).transpose();
        Ok(vec![
            want(0, &|| gpre.matmul(&w_fc)?.reshape(&self.x_shape))?,
            want(1, &|| gpre.t()?.matmul(&x))?,
            want(2, &|| gpre.sum(&[0], false))?,
            want(3, &|| g2.t()?.matmul(&h))?,
            want(4, &|| g2.sum(&[0], false))?,
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::Device;

    /// The CPU composes the layers; the meta device outside a plan stands for the GPU, whose
    /// GEMMs carry the GELU (a plan for the host asks the CPU: tests/plan.rs checks the main
    /// job's plan against its run to the byte).
    #[test]
    fn only_devices_with_gelu_epilogues_fuse_the_mlp() {
        assert!(!mlp_gelu_fused(Device::Cpu));
        assert!(mlp_gelu_fused(Device::Meta));
    }
}
