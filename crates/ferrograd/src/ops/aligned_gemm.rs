//! GEMMs of a linear layer whose output dim is wide and unaligned (GPT-2's 50257-wide
//! vocabulary head). cuBLAS runs such an N (forward) or K (input gradient) on slow kernels,
//! so on a device that asks for aligned rows (`MatmulKernels::out_row_align`) the product is
//! computed at the padded width `vp`, as nanoGPT and llm.c pad their vocabulary, but without
//! changing the parameter:
//! - forward: out (rows, vp) = x (rows, k) @ wpᵀ, where wp (vp, k) is w with zero rows
//!   appended (a temporary, unless w is autocast's cast of a parameter, which is made in such
//!   a zero-padded block: `amp::zero_padded`); the result is the (rows, n) view of it, rows
//!   vp apart, and its padding columns hold exact zeros;
//! - input gradient: dx = g (rows, vp) @ wp with g's padding columns set to zero first (they
//!   lie outside every view of the gradient), so the padding adds exact zeros;
//! - weight gradient: dw = gᵀ @ x at the true width n (that GEMM's M is n); the chunked
//!   classifier, which sums its chunks' products into one dw, computes it over the whole
//!   zeroed block (M = vp) and keeps the first n rows (`PaddedWeight::weight_grad_rows`).
//!
//! Elsewhere (the CPU) nothing is padded.

use super::matmul::{matmul_forward, padded_width};
use crate::backend::{View, elementwise};
use crate::base::{Layout, Result};
use crate::tensor::Tensor;

/// `x2 @ wᵀ` for x2 (rows, k), w (n, k) at the padded width when the device wants it: a
/// (rows, n) view with rows `vp` apart. None when no padding applies.
pub(crate) fn forward(x2: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    let (rows, k, n) = (x2.shape()[0], x2.shape()[1], w.shape()[0]);
    let vp = padded_width(w.device(), w.dtype(), n)?;
    if vp == n || k == 0 || rows == 0 {
        return Ok(None);
    }
    let wp = zero_padded_rows(w, vp)?;
    let out = matmul_forward(x2, &wp.t_view()?)?;
    Ok(Some(out.with_layout(Layout::new(
        vec![rows, n],
        vec![vp as isize, 1],
        0,
    ))))
}

/// dx = g2 @ w for g2 (rows, n), w (n, k): at the padded width when g2 is the padded layout
/// `forward` makes (rows vp apart over a whole (rows, vp) block), else at the true width.
pub(crate) fn input_grad(g2: &Tensor, w: &Tensor) -> Result<Tensor> {
    let vp = padded_width(w.device(), w.dtype(), g2.shape()[1])?;
    if !is_padded_block(g2, vp, w) {
        return matmul_forward(g2, w);
    }
    padded_input_grad(g2, vp, &zero_padded_rows(w, vp)?)
}

/// Whether g2 (rows, n) is `forward`'s padded layout at width vp over a whole block.
fn is_padded_block(g2: &Tensor, vp: usize, w: &Tensor) -> bool {
    let (rows, n) = (g2.shape()[0], g2.shape()[1]);
    let l = g2.layout();
    vp != n
        && rows > 0
        && l.offset() == 0
        && l.strides() == [vp as isize, 1]
        && g2.storage().len() == rows * vp
        && g2.dtype() == w.dtype()
}

/// `input_grad` on a padded block, with the padded weight wp (vp, k).
fn padded_input_grad(g2: &Tensor, vp: usize, wp: &Tensor) -> Result<Tensor> {
    zero_padding_columns(g2, vp)?;
    let full = g2.with_layout(Layout::contiguous(&[g2.shape()[0], vp]));
    matmul_forward(&full, wp)
}

/// A head weight (n, k) ready for several products at the padded width (the chunked
/// classifier's): zero-padded once, then `forward` and `input_grad` as the functions above.
pub(crate) struct PaddedWeight {
    w: Tensor,
    /// The zero-padded copy (vp, k), when the device pads this width.
    padded: Option<Tensor>,
    vp: usize,
}

impl PaddedWeight {
    pub(crate) fn new(w: &Tensor) -> Result<PaddedWeight> {
        let (n, k) = (w.shape()[0], w.shape()[1]);
        let vp = padded_width(w.device(), w.dtype(), n)?;
        let padded = (vp != n && k > 0)
            .then(|| zero_padded_rows(w, vp))
            .transpose()?;
        Ok(PaddedWeight {
            w: w.detach(),
            padded,
            vp,
        })
    }

    /// The width the products are computed at (n when nothing is padded).
    pub(crate) fn padded_width(&self) -> usize {
        self.vp
    }

    /// x2 @ wᵀ (rows, n), rows vp apart when padded.
    pub(crate) fn forward(&self, x2: &Tensor) -> Result<Tensor> {
        let (rows, n) = (x2.shape()[0], self.w.shape()[0]);
        match &self.padded {
            Some(wp) if rows > 0 => {
                let out = matmul_forward(x2, &wp.t_view()?)?;
                let vp = self.vp as isize;
                Ok(out.with_layout(Layout::new(vec![rows, n], vec![vp, 1], 0)))
            }
            _ => matmul_forward(x2, &self.w.t_view()?),
        }
    }

    /// g2 @ w (rows, k) for a gradient with `forward`'s layout (its padding is zeroed).
    pub(crate) fn input_grad(&self, g2: &Tensor) -> Result<Tensor> {
        match &self.padded {
            Some(wp) if is_padded_block(g2, self.vp, &self.w) => padded_input_grad(g2, self.vp, wp),
            _ => matmul_forward(g2, &self.w),
        }
    }

    /// g2ᵀ for the weight gradient g2ᵀ @ x2: (vp, rows) over g2's whole padded block, once
    /// `input_grad` has zeroed its padding columns (so the padding rows of the product are
    /// exact zeros), else (n, rows). cuBLAS runs the bf16 product with M = 50304 on faster
    /// kernels than with GPT-2's M = 50257. `first_rows` takes the product back to n rows.
    pub(crate) fn weight_grad_rows(&self, g2: &Tensor) -> Result<Tensor> {
        if self.padded.is_some() && is_padded_block(g2, self.vp, &self.w) {
            let full = g2.with_layout(Layout::contiguous(&[g2.shape()[0], self.vp]));
            return full.t_view();
        }
        g2.t_view()
    }
}

/// The first n rows (the weight's) of a weight gradient made from `weight_grad_rows`: a view
/// of the padded block, which is best scaled in place before (an in-place op on a slice of a
/// storage goes through a temporary).
pub(crate) fn first_rows(dw: Tensor, n: usize) -> Result<Tensor> {
    if dw.shape()[0] == n {
        return Ok(dw);
    }
    dw.narrow(0, 0, n)
}

/// w (n, k) with vp - n zero rows appended: the block behind an autocast weight cast made
/// zero-padded (no copy), else a fresh (vp, k) temporary.
fn zero_padded_rows(w: &Tensor, vp: usize) -> Result<Tensor> {
    if let Some(block) = crate::amp::zero_padded(w, vp) {
        return Ok(block);
    }
    let (n, k) = (w.shape()[0], w.shape()[1]);
    let wp = Tensor::output(&[vp, k], w.dtype(), w.device(), "linear_padded_weight")?;
    let rows = Layout::contiguous(&[n, k]);
    elementwise::copy(
        w.view(),
        View {
            storage: wp.storage(),
            layout: &rows,
        },
    )?;
    Ok(wp)
}

/// Zeroes columns n..vp of every row of g2's (rows, vp) block.
fn zero_padding_columns(g2: &Tensor, vp: usize) -> Result<()> {
    let (rows, n) = (g2.shape()[0], g2.shape()[1]);
    let zero = Tensor::output(&[1], g2.dtype(), g2.device(), "linear_padding_zero")?;
    let src = zero.layout().broadcast_to(&[rows, vp - n])?;
    let pad = Layout::new(vec![rows, vp - n], vec![vp as isize, 1], n);
    elementwise::copy(
        View {
            storage: zero.storage(),
            layout: &src,
        },
        View {
            storage: g2.storage(),
            layout: &pad,
        },
    )
}
