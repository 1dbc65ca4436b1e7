//! Tensor ops: one file per family, each op's forward and backward side by side. Forwards
//! allocate outputs through the device allocator and call the backend; `autograd::record`
//! attaches the backward closure with what it saved.

mod aligned_gemm;
mod attention;
pub(crate) mod autocast;
mod binary;
mod column_sums;
mod cross_entropy;
mod dropout;
mod embedding;
mod gelu_linear;
mod inplace;
mod linear;
mod linear_cross_entropy;
mod loss;
mod matmul;
mod mlp;
mod movement;
mod norm;
mod reduce;
mod select;
mod softmax;
mod unary;

pub use attention::{causal_attention_dropout_supported, causal_attention_supported};
pub use autocast::cast_parameters_ahead;
pub(crate) use binary::promoted_dtype;
pub(crate) use matmul::matmul_acc_into;
pub use mlp::mlp_gelu_fused;
pub use unary::GeluApprox;

use crate::autograd::{SavedTensor, is_grad_enabled};
use crate::backend;
use crate::base::Result;
use crate::tensor::{DType, Layout, Tensor};

/// A saved tensor as a backward reads it: with its history when the backward is itself
/// recorded (`create_graph` runs backward in grad mode), else the plain saved value.
pub(crate) fn unpack(s: &SavedTensor) -> Tensor {
    if is_grad_enabled() {
        s.unpack()
    } else {
        s.get().clone()
    }
}

pub(crate) use crate::tensor::{check_float, check_pair, check_same_device};

/// Whether an op computes its output's value or only records its graph node. A recomputed
/// forward is run for its graph alone (backward walks it from a gradient it is handed), so
/// the ops whose values nothing in that graph reads — a block's last product and residual
/// add — can skip their kernels (see `nn::Block::forward_graph_only`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OutputValue {
    Computed,
    /// The output is a stand-in of the right shape, dtype and device (`skipped_output`).
    Skipped,
}

impl OutputValue {
    /// `compute()` when the value is computed, else the stand-in of its `shape`, `dtype`
    /// and `device`.
    pub(crate) fn output(
        self,
        (shape, dtype, device): (&[usize], DType, crate::base::Device),
        compute: impl FnOnce() -> Result<Tensor>,
    ) -> Result<Tensor> {
        match self {
            OutputValue::Computed => compute(),
            OutputValue::Skipped => skipped_output(shape, dtype, device),
        }
    }
}

/// The stand-in output of an op whose value is skipped: a single zero viewed as `shape`
/// (stride 0), so it costs no pass over the data and one element of memory.
pub(crate) fn skipped_output(
    shape: &[usize],
    dtype: DType,
    device: crate::base::Device,
) -> Result<Tensor> {
    Tensor::output(&[], dtype, device, "skipped")?.expand(shape)
}

/// The dtype of per-row statistics a fused op keeps for its backward (mean, rstd,
/// log-sum-exp): F64 for F64 tensors, else F32, as half-precision statistics would cost
/// gradient accuracy (PyTorch keeps them in the accumulate type too).
pub(crate) fn stats_dtype(d: DType) -> DType {
    if d == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

impl Tensor {
    /// The same data without history, contiguous: a view of itself when already contiguous
    /// (no copy), else a fresh copy. The form fused kernels take their inputs in.
    pub(crate) fn detached_contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            Ok(self.detach())
        } else {
            self.contiguous_copy()
        }
    }

    /// A fresh contiguous copy with no autograd history (counted as temporary).
    pub(crate) fn contiguous_copy(&self) -> Result<Tensor> {
        self.copy_as(self.dtype(), "contiguous")
    }

    /// A fresh contiguous copy in `dtype`, no autograd history.
    pub(crate) fn copy_as(&self, dtype: DType, origin: &'static str) -> Result<Tensor> {
        let out = Tensor::output_uninit(self.shape(), dtype, self.device(), origin)?;
        backend::elementwise::copy(self.view(), out.view())?;
        Ok(out)
    }

    /// True when nothing else can observe this tensor's buffer: the engine may then keep it
    /// as `.grad` instead of copying.
    pub(crate) fn is_exclusive(&self) -> bool {
        std::sync::Arc::strong_count(&self.0) == 1
            && std::sync::Arc::strong_count(self.storage()) == 1
            && self.is_contiguous()
            && self.layout().offset() == 0
            && self.numel() == self.storage().len()
    }

    /// Sums a broadcast gradient back to `shape` (the inverse of broadcasting). Recorded
    /// like `sum` when grad mode is on, so a backward under create_graph stays differentiable.
    pub(crate) fn sum_to(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let lead = self.dims() - shape.len();
        let dims: Vec<isize> = (0..self.dims())
            .filter(|&d| d < lead || (shape[d - lead] == 1 && self.shape()[d] != 1))
            .map(|d| d as isize)
            .collect();
        self.sum_own_dtype(&dims, true)?.reshape(shape)
    }

    /// Layout of this tensor broadcast to `shape`.
    pub(crate) fn broadcast_layout(&self, shape: &[usize]) -> Result<Layout> {
        self.layout().broadcast_to(shape)
    }
}
