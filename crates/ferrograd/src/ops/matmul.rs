//! Matrix products. `matmul` follows `torch.matmul`: 1-D operands are promoted, batch dims
//! broadcast. Transposed operands are strided views handed to the GEMM, never copies.
//! Backward: dA = dC @ Bᵀ, dB = Aᵀ @ dC, each summed over broadcast batch dims (recorded
//! `matmul`s on the saved operands with their history under create_graph).

use crate::autograd::{SavedTensor, is_grad_enabled, record};
use crate::backend::View;
use crate::backend::matmul::{self, MatmulSpec};
use crate::base::{DType, Error, Result};
use crate::tensor::{Tensor, broadcast_shape};

/// `a @ b` for rank ≥ 2 operands with broadcast batch dims, no autograd.
/// a: (..., m, k), b: (..., k, n) → (..., m, n)
pub(crate) fn matmul_forward(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    matmul_forward_as(a, b, a.dtype())
}

/// `matmul_forward` written as `dtype`: the operands' dtype, or f32 for f16/bf16 operands
/// (their f32 sums unrounded: a parameter's gradient in the parameter's dtype).
pub(crate) fn matmul_forward_as(a: &Tensor, b: &Tensor, dtype: DType) -> Result<Tensor> {
    super::check_pair("matmul", a, b)?;
    super::check_float("matmul", a)?;
    let (ra, rb) = (a.dims(), b.dims());
    let (m, k, k2, n) = (
        a.shape()[ra - 2],
        a.shape()[ra - 1],
        b.shape()[rb - 2],
        b.shape()[rb - 1],
    );
    if k != k2 {
        return Err(Error::shape(
            "matmul",
            format!(
                "{:?} @ {:?}: inner dims {k} and {k2} differ",
                a.shape(),
                b.shape()
            ),
        ));
    }
    let batch = broadcast_shape("matmul", &a.shape()[..ra - 2], &b.shape()[..rb - 2])?;
    let with = |x: usize, y: usize| [batch.as_slice(), &[x, y]].concat();
    let (la, lb) = (
        a.broadcast_layout(&with(m, k))?,
        b.broadcast_layout(&with(k, n))?,
    );
    // With k = 0 the product is all zeros, which only a zero-filled output gives.
    let out = if k > 0 {
        Tensor::output_uninit(&with(m, n), dtype, a.device(), "matmul")?
    } else {
        Tensor::output(&with(m, n), dtype, a.device(), "matmul")?
    };
    let spec = MatmulSpec {
        batch: batch.iter().product(),
        m,
        n,
        k,
    };
    matmul::matmul(
        &spec,
        View {
            storage: a.storage(),
            layout: &la,
        },
        View {
            storage: b.storage(),
            layout: &lb,
        },
        out.storage(),
    )?;
    Ok(out)
}

/// `x @ wᵀ + bias` for x: (rows, k), w: (n, k), bias: (n), no autograd: one GEMM whose
/// epilogue adds the bias where the backend can (linear's forward).
pub(crate) fn linear_bias_forward(x: &Tensor, w: &Tensor, bias: &Tensor) -> Result<Tensor> {
    super::check_pair("linear", x, w)?;
    super::check_float("linear", x)?;
    let (rows, k, n) = (x.shape()[0], x.shape()[1], w.shape()[0]);
    // With k = 0 the product is all zeros, which only a zero-filled output gives.
    let out = if k > 0 {
        Tensor::output_uninit(&[rows, n], x.dtype(), x.device(), "linear")?
    } else {
        Tensor::output(&[rows, n], x.dtype(), x.device(), "linear")?
    };
    let spec = MatmulSpec {
        batch: 1,
        m: rows,
        n,
        k,
    };
    let wt = w.layout().permute(&[1, 0])?;
    matmul::matmul_bias(
        &spec,
        x.view(),
        View {
            storage: w.storage(),
            layout: &wt,
        },
        bias.view(),
        out.storage(),
    )?;
    Ok(out)
}

/// The width a wide, unaligned output dim is padded to on `device` (n itself elsewhere).
pub(crate) fn padded_width(
    device: crate::base::Device,
    dtype: crate::base::DType,
    n: usize,
) -> Result<usize> {
    matmul::padded_gemm_width(device, dtype, n)
}

/// `out ← a @ b + beta·out` for 2-D a (m, k), b (k, n) and a contiguous out (m, n), no
/// autograd; beta = 0 does not read out. Bumps out's version (it is written in place). An
/// f32 out may take f16/bf16 operands.
pub(crate) fn matmul_acc_into(a: &Tensor, b: &Tensor, out: &Tensor, beta: f64) -> Result<()> {
    super::check_pair("matmul", a, b)?;
    super::check_same_device("matmul", a, out)?;
    if !matmul::widens_to(a.dtype(), out.dtype()) {
        super::check_pair("matmul", a, out)?;
    }
    super::check_float("matmul", a)?;
    let two = a.dims() == 2 && b.dims() == 2;
    let (m, k, n) = if two {
        (a.shape()[0], a.shape()[1], b.shape()[1])
    } else {
        (0, 0, 0)
    };
    let ok = two
        && b.shape()[0] == k
        && out.shape() == [m, n]
        && out.is_contiguous()
        && out.numel() == out.storage().len();
    if !ok {
        return Err(Error::shape(
            "matmul",
            format!(
                "{:?} @ {:?} cannot accumulate into {:?}: need (m, k) @ (k, n) into a whole contiguous (m, n)",
                a.shape(),
                b.shape(),
                out.shape()
            ),
        ));
    }
    let spec = MatmulSpec { batch: 1, m, n, k };
    matmul::matmul_acc(&spec, a.view(), b.view(), out.storage(), beta)?;
    Ok(())
}

impl Tensor {
    /// Matrix product with PyTorch's rules for 1-D and batched operands.
    #[track_caller]
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if let Some([a, b]) = super::autocast::cast_lower([self, other])? {
            return a.matmul(&b);
        }
        match (self.dims(), other.dims()) {
            (0, _) | (_, 0) => Err(Error::shape(
                "matmul",
                "both operands need at least one dim",
            )),
            // Dot product: (k) @ (k) → ().
            (1, 1) => self
                .unsqueeze(0)?
                .matmul(&other.unsqueeze(1)?)?
                .reshape(&[]),
            (1, _) => self.unsqueeze(0)?.matmul(other)?.squeeze(-2),
            (_, 1) => self.matmul(&other.unsqueeze(1)?)?.squeeze(-1),
            (ra, 2) if ra > 2 && self.is_contiguous() => {
                // (B, T, k) @ (k, n): one GEMM over B*T rows, and a weight gradient without a
                // batch of temporaries.
                let k = self.shape()[ra - 1];
                let rows = self.numel() / k.max(1);
                let out = self.reshape(&[rows, k])?.matmul(other)?;
                let mut shape = self.shape().to_vec();
                shape[ra - 1] = other.shape()[1];
                out.reshape(&shape)
            }
            _ => self.matmul_nd(other),
        }
    }

    fn matmul_nd(&self, other: &Tensor) -> Result<Tensor> {
        let out = matmul_forward(self, other)?;
        let (sa, sb) = (self.shape().to_vec(), other.shape().to_vec());
        Ok(record("matmul", &[self, other], out, |_, needs| {
            // dA needs B, dB needs A: save only those.
            let a = needs[1].then(|| SavedTensor::new(self));
            let b = needs[0].then(|| SavedTensor::new(other));
            move |g: &Tensor, n: &[bool]| {
                let mm = |x: &Tensor, y: &Tensor| {
                    if is_grad_enabled() {
                        x.matmul(y)
                    } else {
                        matmul_forward(x, y)
                    }
                };
                let ga = match (&b, n[0]) {
                    (Some(b), true) => {
                        let bt = super::unpack(b).transpose(-1, -2)?;
                        Some(mm(g, &bt)?.sum_to(&sa)?)
                    }
                    _ => None,
                };
                let gb = match (&a, n[1]) {
                    (Some(a), true) => {
                        let at = super::unpack(a).transpose(-1, -2)?;
                        Some(mm(&at, g)?.sum_to(&sb)?)
                    }
                    _ => None,
                };
                Ok(vec![ga, gb])
            }
        }))
    }
}
