//! The matmul family: batched GEMMs, plain or accumulating into their output. Here: the
//! shape spec, the `MatmulKernels` trait that every backend implements, and the entry
//! functions; `matmul_acc` with beta != 0 writes a live buffer in place and bumps its
//! version. Not here: the kernels (backend/cpu/matmul.rs, backend/cuda/matmul.rs, cuBLAS).

use super::{Storage, View, backend};
use crate::error::{Error, Result};

/// Shapes of a batched GEMM: `batch` matrices of (m, k) @ (k, n).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatmulSpec {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// The matmul kernels of one device.
pub trait MatmulKernels {
    /// Batched `out = a @ b` where a: (..., m, k), b: (..., k, n) with equal batch dims.
    fn matmul(&self, spec: &MatmulSpec, a: View, b: View, out: &Storage) -> Result<()>;
    /// Batched `out = a @ b + beta·out`: a GEMM that accumulates into its output (the fused
    /// SGD step writes a weight gradient straight into the momentum buffer). With beta = 0
    /// the output is not read. Backends without it answer beta = 0 only.
    fn matmul_acc(
        &self,
        spec: &MatmulSpec,
        a: View,
        b: View,
        out: &Storage,
        beta: f64,
    ) -> Result<()> {
        if beta == 0.0 {
            return self.matmul(spec, a, b, out);
        }
        Err(Error::NotSupportedOnDevice {
            op: "matmul_acc",
            device: out.device(),
        })
    }
}

pub fn matmul(spec: &MatmulSpec, a: View, b: View, out: &Storage) -> Result<()> {
    backend(out.device())?.matmul(spec, a, b, out)
}

/// `out = a @ b + beta·out` into an existing buffer; bumps `out`'s version (the caller's
/// buffer is live: a momentum buffer, or a gradient being accumulated).
pub fn matmul_acc(spec: &MatmulSpec, a: View, b: View, out: &Storage, beta: f64) -> Result<()> {
    backend(out.device())?.matmul_acc(spec, a, b, out, beta)?;
    out.bump_version();
    Ok(())
}
