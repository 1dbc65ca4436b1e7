//! The meta backend: shapes and allocator accounting only. Its kernels write nothing: the
//! families' entry functions still validate every operand (shapes, dtypes, lengths) and bump
//! versions, so a training step can run on it to predict memory — and fail where a real
//! device would reject its arguments — without touching any data. Reading values is an error,
//! except while a plan runs (`plan_as`): then every read is zeros, so the host-side code of a
//! step (a loss logged, a gradient norm, a scaler's inf check) runs through, and the kernels
//! allocate what the target device's kernels would allocate for themselves (the host's
//! widened bf16 matmul operands; cuBLAS's workspace and the operand copies it needs), so the
//! plan counts every byte the real step takes.

use super::attention::{Attention, AttentionBackward, AttentionKernels};
use super::capture::{Capture, GraphExec};
use super::elementwise::ElementwiseKernels;
use super::index::{IndexAdd, IndexKernels, IndexSelect, Where};
use super::loss::{
    CrossEntropy, CrossEntropyBackward, CrossEntropyWithGrad, LossKernels, MseLoss, MseLossBackward,
};
use super::matmul::{Matmul, MatmulKernels};
use super::optim::{AdamStep, CountStep, OptimKernels, SgdStep, UnscaleCheck, UpdateScale};
use super::reduce::ReduceKernels;
use super::rows::{LayerNorm, LayerNormBackward, RowKernels, Softmax, SoftmaxBackward};
use super::{Backend, BackendData, BinaryOp, HostValues, ReduceOp, Storage, UnaryOp, View};
use crate::base::{Category, DType, Device};
use crate::base::{Error, Result};
use crate::memory::Allocation;
use std::sync::{Mutex, MutexGuard};

pub struct MetaBackend;

/// The device a step on the meta device stands in for while a plan runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetaTarget {
    /// The CPU backend: exact bytes, host kernels' scratch.
    Host,
    /// A CUDA GPU: cuBLAS's workspace and operand copies, the GPU's fused-kernel coverage.
    Cuda,
}

struct Planning {
    target: MetaTarget,
    /// cuBLAS's workspace, taken at the first GEMM as the real device does, kept to the end.
    cublas_workspace: Option<Allocation>,
}

static PLANNING: Mutex<Option<Planning>> = Mutex::new(None);

fn planning() -> MutexGuard<'static, Option<Planning>> {
    PLANNING.lock().unwrap_or_else(|e| e.into_inner())
}

fn planning_target() -> Option<MetaTarget> {
    planning().as_ref().map(|p| p.target)
}

/// While alive, the meta device plans for `target` (see the module comment); dropping it ends
/// the plan and frees what the plan's kernels kept.
pub struct PlanningScope(());

/// Starts planning for `target`; an error while another plan runs.
pub fn plan_as(target: MetaTarget) -> Result<PlanningScope> {
    let mut p = planning();
    if p.is_some() {
        return Err(Error::invalid(
            "plan",
            "another plan is running on the meta device; plan one configuration at a time",
        ));
    }
    *p = Some(Planning {
        target,
        cublas_workspace: None,
    });
    Ok(PlanningScope(()))
}

impl Drop for PlanningScope {
    fn drop(&mut self) {
        let ended = planning().take();
        drop(ended);
    }
}

/// A block of the meta allocator that a real kernel would take for itself.
fn kernel_block(bytes: usize, category: Category, origin: &'static str) -> Result<Allocation> {
    crate::memory::allocator(Device::Meta)?.malloc(bytes, category, origin)
}

/// What the host's matmul takes: bf16 products run in f32 on widened copies of both operand
/// storages and the output, and f16 or bf16 products into an f32 output on widened copies of
/// the operands alone (backend/cpu/matmul.rs), unless k = 0 with beta = 0 only fills.
fn host_matmul_scratch(m: &Matmul) -> Result<Vec<Allocation>> {
    let operands = m.a.storage.dtype();
    let widened = super::matmul::widens_to(operands, m.out.dtype());
    let skip = (operands != DType::BF16 && !widened) || (m.spec.k == 0 && m.beta == 0.0);
    if skip {
        return Ok(Vec::new());
    }
    let mut lens = vec![m.a.storage.len(), m.b.storage.len()];
    if !widened {
        lens.push(m.out.len());
    }
    lens.into_iter()
        .map(|n| kernel_block(n * 4, Category::Workspace, "matmul_bf16_widen"))
        .collect()
}

/// What cuBLAS takes: its workspace at the first GEMM (kept), and a contiguous copy of each
/// operand it cannot read by strides (backend/cuda/matmul.rs asks the same question).
fn cuda_matmul_scratch(m: &Matmul) -> Result<Vec<Allocation>> {
    let s = m.spec;
    if s.batch * s.m * s.n == 0 || s.k == 0 {
        return Ok(Vec::new());
    }
    {
        let mut p = planning();
        if let Some(p) = p.as_mut()
            && p.cublas_workspace.is_none()
        {
            p.cublas_workspace = Some(crate::memory::allocator(Device::Meta)?.malloc_shared(
                super::cuda::CUBLAS_WORKSPACE_BYTES,
                Category::Workspace,
                "cublas workspace",
            )?);
        }
    }
    let mut copies = Vec::new();
    for v in [&m.a, &m.b] {
        if let Some(shape) = super::cuda::operand_copy_shape(v.layout) {
            let bytes = shape.iter().product::<usize>() * v.storage.dtype().size_in_bytes();
            copies.push(kernel_block(
                bytes,
                Category::Temporary,
                "matmul operand copy",
            )?);
        }
    }
    Ok(copies)
}

/// A CUDA kernel's temporary of `bytes`, as `launch::temp` takes it.
fn cuda_temp(bytes: usize, origin: &'static str) -> Result<Allocation> {
    kernel_block(super::cuda::temp_bytes(bytes), Category::Temporary, origin)
}

/// Zeros shaped as `src` reads, for the host code of a planned step.
fn zeros_like(src: &View) -> HostValues {
    let n = src.layout.numel();
    match src.storage.dtype() {
        DType::I64 | DType::U8 => HostValues::I64(vec![0; n]),
        DType::F32 => HostValues::F32(vec![0.0; n]),
        _ => HostValues::F64(vec![0.0; n]),
    }
}

/// Whether a plan for a CUDA device runs: then the meta device captures as the GPU would
/// (the allocator's private pool, deferred frees), and its graphs replay nothing.
pub(crate) fn plans_for_cuda() -> bool {
    planning_target() == Some(MetaTarget::Cuda)
}

/// A planned graph: the kernels wrote nothing, so a replay has nothing to run.
struct PlannedGraph;

impl GraphExec for PlannedGraph {
    fn launch(&self) -> Result<()> {
        Ok(())
    }
}

/// Outside a plan for a GPU, the meta device has nothing to capture.
impl Capture for MetaBackend {
    fn begin_capture(&self) -> Result<()> {
        if plans_for_cuda() {
            Ok(())
        } else {
            Err(Error::invalid(
                "graph capture",
                "the meta device captures only while planning for a CUDA device",
            ))
        }
    }
    fn end_capture(&self) -> Result<Box<dyn GraphExec>> {
        Ok(Box::new(PlannedGraph))
    }
}

impl Backend for MetaBackend {
    fn zeros(&self, _: DType, _: usize, _: u64) -> Result<BackendData> {
        Ok(BackendData::Meta)
    }
    fn upload(&self, _: DType, _: HostValues, _: u64) -> Result<BackendData> {
        Ok(BackendData::Meta)
    }
    fn to_host(&self, src: View) -> Result<HostValues> {
        if planning_target().is_some() {
            return Ok(zeros_like(&src));
        }
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
    fn dropout_apply(&self, _: View, _: &Storage, _: f64, _: u64) -> Result<()> {
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
    fn reduce(&self, op: ReduceOp, x: View, dims: &[usize], _: &Storage) -> Result<()> {
        if planning_target() == Some(MetaTarget::Cuda)
            && let Some(bytes) = super::cuda::reduce_scratch_bytes(op, x, dims)?
        {
            let _partials = cuda_temp(bytes, "cuda temp")?;
        }
        Ok(())
    }
}

impl MatmulKernels for MetaBackend {
    fn matmul(&self, m: &Matmul) -> Result<()> {
        // The scratch lives while the "kernel" runs, as the real kernel's does.
        let _scratch = match planning_target() {
            Some(MetaTarget::Host) => host_matmul_scratch(m)?,
            Some(MetaTarget::Cuda) => cuda_matmul_scratch(m)?,
            None => Vec::new(),
        };
        Ok(())
    }
    /// A GPU can fuse the bias gradient into the weight-gradient GEMM (cuBLASLt's epilogue):
    /// a plan for one allocates what that GEMM does and no reduction scratch. Whether linear
    /// layers ask for it is the GPU's setting (`bias_grad_epilogue`), mirrored here.
    fn matmul_row_sums(&self, m: &Matmul, _sums: &Storage) -> Result<bool> {
        if planning_target() != Some(MetaTarget::Cuda) {
            return Ok(false);
        }
        self.matmul(m)?;
        Ok(true)
    }
    fn fuses_row_sums(&self) -> bool {
        planning_target() == Some(MetaTarget::Cuda) && crate::backend::matmul::bias_grad_epilogue()
    }
    /// The target's row alignment, so a plan for a GPU pads the same outputs.
    /// While a plan runs, the target's; else the GPU's (as the attention's coverage).
    fn fuses_gelu_epilogues(&self) -> bool {
        !matches!(planning_target(), Some(MetaTarget::Host))
    }
    fn out_row_align(&self, dtype: DType) -> usize {
        match planning_target() {
            Some(MetaTarget::Cuda) => super::cuda::out_row_align(dtype),
            _ => 1,
        }
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
    fn layer_norm_backward(&self, a: &LayerNormBackward) -> Result<()> {
        let bytes = match planning_target() {
            Some(MetaTarget::Cuda) => super::cuda::layer_norm_param_scratch_bytes(a),
            _ => None,
        };
        let _partials = bytes
            .map(|b| cuda_temp(b, "layer_norm_backward"))
            .transpose()?;
        Ok(())
    }
    /// A GPU's warp kernels sum the half gradient's columns in their pass (no reduction and
    /// its scratch afterwards); mirrored while a plan for one runs.
    fn layer_norm_backward_sums_half(&self, a: &LayerNormBackward) -> bool {
        planning_target() == Some(MetaTarget::Cuda) && super::cuda::layer_norm_sums_half(a)
    }
}

impl AttentionKernels for MetaBackend {
    /// While a plan runs, what the target device's kernels cover; else the fused path.
    fn supports_attention(&self, dtype: DType, head_dim: usize) -> bool {
        match planning_target() {
            Some(MetaTarget::Host) => super::cpu::CpuBackend.supports_attention(dtype, head_dim),
            Some(MetaTarget::Cuda) => super::cuda::supports_attention(dtype, head_dim),
            None => true,
        }
    }
    fn supports_attention_dropout(&self) -> bool {
        !matches!(planning_target(), Some(MetaTarget::Host))
    }
    fn attention(&self, _: &Attention) -> Result<()> {
        Ok(())
    }
    fn attention_backward(&self, _: &AttentionBackward) -> Result<()> {
        Ok(())
    }
}

impl LossKernels for MetaBackend {
    fn cross_entropy(&self, a: &CrossEntropy) -> Result<()> {
        if planning_target() == Some(MetaTarget::Cuda) {
            let (rows, _) = super::rows_cols(a.logits.layout);
            let _nll = cuda_temp(super::cuda::nll_scratch_bytes(rows), "cross_entropy")?;
        }
        Ok(())
    }
    fn cross_entropy_backward(&self, _: &CrossEntropyBackward) -> Result<()> {
        Ok(())
    }
    fn cross_entropy_with_grad(&self, a: &CrossEntropyWithGrad) -> Result<()> {
        if planning_target() == Some(MetaTarget::Cuda) {
            let (rows, _) = super::rows_cols(a.logits.layout);
            let bytes = super::cuda::nll_lse_scratch_bytes(rows);
            let _scratch = cuda_temp(bytes, "cross_entropy")?;
        }
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
    fn count_step(&self, _: &CountStep) -> Result<()> {
        Ok(())
    }
    fn update_scale(&self, _: &UpdateScale) -> Result<()> {
        Ok(())
    }
}
