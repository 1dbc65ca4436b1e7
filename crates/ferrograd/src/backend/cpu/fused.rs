//! Dispatch of the fused ops to their CPU kernels: normalisation-style row kernels
//! (softmax, layer norm, cross-entropy), index kernels (index select/add, where), pointwise
//! losses (MSE), optimizer updates and gradient unscaling (mixed precision).

use super::{fused_amp, fused_index, fused_loss, fused_optim, fused_rows};
use crate::backend::{FusedOp, Storage, View};
use crate::base::Result;

pub(crate) fn run(op: &FusedOp, inputs: &[View], outputs: &[&Storage]) -> Result<()> {
    match op {
        FusedOp::Softmax { .. }
        | FusedOp::SoftmaxBackward { .. }
        | FusedOp::LayerNorm { .. }
        | FusedOp::LayerNormBackward { .. }
        | FusedOp::CrossEntropy { .. }
        | FusedOp::CrossEntropyBackward { .. } => fused_rows::run(op, inputs, outputs),
        FusedOp::IndexSelect | FusedOp::IndexAdd | FusedOp::Where => {
            fused_index::run(op, inputs, outputs)
        }
        FusedOp::SgdStep { .. } | FusedOp::AdamStep { .. } => fused_optim::run(op, inputs, outputs),
        FusedOp::MseLoss | FusedOp::MseLossBackward => fused_loss::run(op, inputs, outputs),
        FusedOp::UnscaleCheck { inv_scale } => {
            fused_amp::unscale_check(*inv_scale, inputs, outputs)
        }
    }
}
