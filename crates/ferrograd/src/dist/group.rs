//! The `ProcessGroup` contract: the collectives data-parallel training needs (all-reduce,
//! broadcast, reduce-scatter, all-gather, barrier) on flat float tensors, whatever moves the
//! bytes. Here only the contract and the checks every implementation shares; the in-process
//! group (ranks as threads) is in `in_process.rs`. An NCCL group fits the same calls: its
//! collectives return once enqueued on its communication stream, which the compute stream
//! waits for through events, so "returned" means "ordered before any later kernel" there.

use crate::base::{Error, Result};
use crate::tensor::Tensor;

/// How a reduction combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the world size (NCCL's ncclAvg).
    Avg,
}

/// A group of `world_size` ranks that run the same collectives in the same order. Every
/// tensor is a contiguous float tensor (f16, bf16, f32, f64); its elements are written in
/// place. A rank that fails makes the others' collectives fail rather than wait forever.
pub trait ProcessGroup: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// What carries the bytes, for reports ("in-process", "nccl").
    fn backend_name(&self) -> &'static str;

    /// Whether the ranks are threads of this process, sharing its allocators (each rank's
    /// bytes are then its memory scope's), rather than processes of their own.
    fn ranks_share_process(&self) -> bool {
        false
    }

    /// x: (n,) on every rank → the reduction over ranks, on every rank.
    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<()>;

    /// `all_reduce`, but later kernels are ordered after it only once `wait_launched` is
    /// called: the communication overlaps whatever the caller queues meanwhile (DDP's
    /// buckets against the rest of backward). Nothing may read or write x until then.
    /// Groups whose collectives finish before returning need not override it.
    fn all_reduce_launch(&self, x: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce(x, op)
    }

    /// Every collective launched by `all_reduce_launch` is ordered before any later kernel.
    fn wait_launched(&self) -> Result<()> {
        Ok(())
    }

    /// x: (n,) → root's x on every rank.
    fn broadcast(&self, x: &Tensor, root: usize) -> Result<()>;

    /// input: (world·n,), output: (n,) → output = chunk `rank` of the reduction of inputs.
    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()>;

    /// input: (n,), output: (world·n,) → chunk r of output = rank r's input.
    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()>;

    /// Returns when every rank has called it.
    fn barrier(&self) -> Result<()>;
}

/// A collective's buffer must be a contiguous float tensor (its elements are the message).
pub(crate) fn check_buffer(op: &'static str, what: &str, t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op,
            dtype: t.dtype(),
            hint: "collectives carry floating-point tensors",
        });
    }
    if !t.is_contiguous() {
        return Err(Error::invalid(
            op,
            format!("the {what} must be contiguous; call .contiguous_owned() first"),
        ));
    }
    Ok(())
}

/// reduce_scatter / all_gather: the large side holds world_size times the small side, in one
/// dtype.
pub(crate) fn check_split(
    op: &'static str,
    large: &Tensor,
    small: &Tensor,
    world: usize,
) -> Result<()> {
    check_buffer(op, "input", large)?;
    check_buffer(op, "output", small)?;
    if large.dtype() != small.dtype() {
        return Err(Error::invalid(
            op,
            format!(
                "the two buffers differ in dtype ({} and {})",
                large.dtype(),
                small.dtype()
            ),
        ));
    }
    if large.numel() != world * small.numel() {
        return Err(Error::shape(
            op,
            format!(
                "the whole buffer must hold world_size ({world}) × {} elements, it holds {}",
                small.numel(),
                large.numel()
            ),
        ));
    }
    Ok(())
}

/// A root must be a rank of the group.
pub(crate) fn check_root(op: &'static str, root: usize, world: usize) -> Result<()> {
    if root >= world {
        return Err(Error::invalid(
            op,
            format!("root rank {root} is not in a group of {world} ranks"),
        ));
    }
    Ok(())
}
