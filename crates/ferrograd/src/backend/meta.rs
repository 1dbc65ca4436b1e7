//! The meta backend: shapes and allocator accounting only. Its kernels write nothing: the
//! families' entry functions still validate every operand (shapes, dtypes, lengths) and bump
//! versions, so a training step can run on it to predict memory — and fail where a real
//! device would reject its arguments — without touching any data. Reading values is an error.

use super::attention::{Attention, AttentionBackward, AttentionKernels};
use super::elementwise::ElementwiseKernels;
use super::index::{IndexAdd, IndexKernels, IndexSelect, Where};
use super::loss::{CrossEntropy, CrossEntropyBackward, LossKernels, MseLoss, MseLossBackward};
use super::matmul::{Matmul, MatmulKernels};
use super::optim::{AdamStep, OptimKernels, SgdStep, UnscaleCheck};
use super::reduce::ReduceKernels;
use super::rows::{LayerNorm, LayerNormBackward, RowKernels, Softmax, SoftmaxBackward};
use super::{Backend, BackendData, BinaryOp, HostValues, ReduceOp, Storage, UnaryOp, View};
use crate::base::{DType, Device};
use crate::base::{Error, Result};

pub struct MetaBackend;

impl Backend for MetaBackend {
    fn zeros(&self, _: DType, _: usize, _: u64) -> Result<BackendData> {
        Ok(BackendData::Meta)
    }
    fn upload(&self, _: DType, _: HostValues, _: u64) -> Result<BackendData> {
        Ok(BackendData::Meta)
    }
    fn to_host(&self, _: View) -> Result<HostValues> {
        Err(Error::NotSupportedOnDevice {
            op: "reading values (meta tensors have shapes but no data)",
            device: Device::Meta,
        })
    }
}

impl ElementwiseKernels for MetaBackend {
    fn copy(&self, _: View, _: View) -> Result<()> {
        Ok(())
    }
    fn fill(&self, _: &Storage, _: f64) -> Result<()> {
        Ok(())
    }
    fn unary(&self, _: UnaryOp, _: View, _: &Storage) -> Result<()> {
        Ok(())
    }
    fn binary(&self, _: BinaryOp, _: View, _: View, _: &Storage) -> Result<()> {
        Ok(())
    }
    fn binary_inplace(&self, _: BinaryOp, _: &Storage, _: View) -> Result<()> {
        Ok(())
    }
}

impl ReduceKernels for MetaBackend {
    fn reduce(&self, _: ReduceOp, _: View, _: &[usize], _: &Storage) -> Result<()> {
        Ok(())
    }
}

impl MatmulKernels for MetaBackend {
    fn matmul(&self, _: &Matmul) -> Result<()> {
        Ok(())
    }
}

impl RowKernels for MetaBackend {
    fn softmax(&self, _: &Softmax) -> Result<()> {
        Ok(())
    }
    fn softmax_backward(&self, _: &SoftmaxBackward) -> Result<()> {
        Ok(())
    }
    fn layer_norm(&self, _: &LayerNorm) -> Result<()> {
        Ok(())
    }
    fn layer_norm_backward(&self, _: &LayerNormBackward) -> Result<()> {
        Ok(())
    }
}

impl AttentionKernels for MetaBackend {
    /// The meta device plans the fused path wherever a real device would run it; the
    /// planner asks the target device, not this one.
    fn supports_attention(&self, _: DType, _: usize) -> bool {
        true
    }
    fn attention(&self, _: &Attention) -> Result<()> {
        Ok(())
    }
    fn attention_backward(&self, _: &AttentionBackward) -> Result<()> {
        Ok(())
    }
}

impl LossKernels for MetaBackend {
    fn cross_entropy(&self, _: &CrossEntropy) -> Result<()> {
        Ok(())
    }
    fn cross_entropy_backward(&self, _: &CrossEntropyBackward) -> Result<()> {
        Ok(())
    }
    fn mse_loss(&self, _: &MseLoss) -> Result<()> {
        Ok(())
    }
    fn mse_loss_backward(&self, _: &MseLossBackward) -> Result<()> {
        Ok(())
    }
}

impl IndexKernels for MetaBackend {
    fn index_select(&self, _: &IndexSelect) -> Result<()> {
        Ok(())
    }
    fn index_add(&self, _: &IndexAdd) -> Result<()> {
        Ok(())
    }
    fn select_where(&self, _: &Where) -> Result<()> {
        Ok(())
    }
}

impl OptimKernels for MetaBackend {
    fn sgd_step(&self, _: &SgdStep) -> Result<()> {
        Ok(())
    }
    fn adam_step(&self, _: &AdamStep) -> Result<()> {
        Ok(())
    }
    fn unscale_check(&self, _: &UnscaleCheck) -> Result<()> {
        Ok(())
    }
}
