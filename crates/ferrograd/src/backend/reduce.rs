//! The reduce family: sum, max, min and argmax over a set of dims. Here: the op kinds, the
//! `ReduceKernels` trait that every backend implements, and the entry function. Not here: the
//! kernels (backend/cpu/reduce.rs, backend/cuda/reduce.rs + kernels/reduce.cu).

use super::{Storage, View, backend, check};
use crate::base::{DType, Error, Result};

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

/// Validates once, then runs the device's kernel: dims sorted, unique and below the rank;
/// argmax over exactly one dim into I64; other reductions into a float output; `out` holds
/// the result (the kept dims' product).
pub fn reduce(op: ReduceOp, x: View, dims: &[usize], out: &Storage) -> Result<()> {
    validate(op, &x, dims, out)?;
    backend(out.device())?.reduce(op, x, dims, out)
}

fn validate(op: ReduceOp, x: &View, dims: &[usize], out: &Storage) -> Result<()> {
    const OP: &str = "reduce";
    check::on_device(OP, out.device(), [x.storage])?;
    let shape = x.layout.shape();
    let rank = shape.len();
    if dims.iter().any(|&d| d >= rank) || dims.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::invalid(
            OP,
            format!("dims {dims:?} must be sorted, unique and below the rank {rank}"),
        ));
    }
    if op == ReduceOp::ArgMax {
        if dims.len() != 1 {
            return Err(Error::invalid("argmax", "argmax reduces exactly one dim"));
        }
        check::same_dtype("argmax", DType::I64, out.dtype())?;
    } else if !out.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op: OP,
            dtype: out.dtype(),
            hint: "reductions write a float tensor (or i64 indices for argmax)",
        });
    }
    let kept: usize = (0..rank)
        .filter(|d| !dims.contains(d))
        .map(|d| shape[d])
        .product();
    check::len_of(OP, out, kept)
}
