//! The reduce family: sum, max, min and argmax over a set of dims. Here: the op kinds, the
//! `ReduceKernels` trait that every backend implements, and the entry function. Not here: the
//! kernels (backend/cpu/reduce.rs, backend/cuda/reduce.rs + kernels/reduce.cu).

use super::{Storage, View, backend};
use crate::base::Result;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
    /// Index of the (first) maximum along the single reduced dim, as I64.
    ArgMax,
}

/// The reduce kernels of one device.
pub trait ReduceKernels {
    /// Reduces `dims` (sorted, unique); the output is contiguous with those dims kept as 1.
    fn reduce(&self, op: ReduceOp, x: View, dims: &[usize], out: &Storage) -> Result<()>;
}

pub fn reduce(op: ReduceOp, x: View, dims: &[usize], out: &Storage) -> Result<()> {
    backend(out.device())?.reduce(op, x, dims, out)
}
