//! The row family: kernels that read a tensor as independent rows (R, N) of its last dim —
//! softmax and log-softmax, layer norm, and their backwards. Here: the typed arguments, their
//! one validator, the `RowKernels` trait that every backend implements, and the entry
//! functions (validate once, then dispatch to the device's backend). Not here: the kernels
//! (backend/cpu/rows.rs, backend/cuda/rows.rs + kernels/rows.cu) and cross-entropy (loss.rs).

use super::check::{self, rows_cols};
use super::{Storage, View, backend};
use crate::base::{DType, Error, Layout, Result};

/// y (R, N) = softmax (or log-softmax) of x (R, N) over the last dim. Any shape is read as
/// rows of its last dim; x contiguous, y of x's dtype and numel.
pub struct Softmax<'a> {
    pub x: View<'a>,
    pub y: &'a Storage,
    pub log: bool,
}

/// From the saved output: softmax gx = y (gy - Σ gy·y); log-softmax gx = gy - exp(y) Σ gy.
/// y, gy (R, N) contiguous; gx (R, N).
pub struct SoftmaxBackward<'a> {
    pub y: View<'a>,
    pub gy: View<'a>,
    pub gx: &'a Storage,
    pub log: bool,
}

/// y (R, N) = (x - mean) · rstd · weight + bias per row, with the biased variance and
/// rstd = 1/√(var + eps). weight, bias (N); mean, rstd (R) of one float dtype (callers use
/// F32, or F64 for F64 inputs), which may differ from x's. y has x's dtype, or f16/bf16 for
/// an f32 x: each value is then rounded to f32 as x's own output would be, then to y's dtype
/// (what a cast of the f32 output stores, without the f32 buffer).
///
/// With `residual`, the rows normalised are s = x + h, written to `sum` (x's dtype, R × N)
/// on the way: a residual add and the norm after it in one pass. h (R, N) has y's dtype (x's,
/// or the half output's beside f32 rows), and each s is rounded as the add op rounds it.
pub struct LayerNorm<'a> {
    pub x: View<'a>,
    pub residual: Option<Residual<'a>>,
    pub weight: Option<View<'a>>,
    pub bias: Option<View<'a>>,
    pub y: &'a Storage,
    pub mean: &'a Storage,
    pub rstd: &'a Storage,
    pub eps: f64,
}

/// The branch added to a layer norm's rows, and where the sum goes.
#[derive(Clone, Copy)]
pub struct Residual<'a> {
    pub h: View<'a>,
    pub sum: &'a Storage,
}

/// gx (R, N) from x (R, N), weight (N), the saved mean and rstd (R) and gy (R, N); gweight
/// and gbias (N) when wanted. gweight needs the weight. gy has x's dtype, or f16/bf16 for an
/// f32 x (the gradient of a half output, read widened to f32 exactly); gx, gweight and gbias
/// have x's dtype. With `prior` (R, N) of x's dtype, gx = prior + the norm's gradient, each
/// element rounded as a separate add would round it: a backward that folds the gradient its
/// input already has from other paths (a residual stream's) into the one write of gx. prior
/// may be gx's own storage; the sum is then written in place. With `gx_half` (R, N) of gy's
/// half dtype beside f32 rows, gx is also written there rounded as a cast rounds it (the
/// gradient of the half branch whose f32 sum these rows are), in the same pass where the
/// device can (`RowKernels::layer_norm_backward_writes_half`), else converted after it.
/// With `gx_half_sums` (N) of x's dtype beside `gx_half`, the column sums Σ_R gx_half are
/// written there (the half branch's Linear's bias gradient): in the same pass where the device
/// can (`RowKernels::layer_norm_backward_sums_half`), else by a reduction of gx_half after it.
pub struct LayerNormBackward<'a> {
    pub x: View<'a>,
    pub weight: Option<View<'a>>,
    pub mean: View<'a>,
    pub rstd: View<'a>,
    pub gy: View<'a>,
    pub prior: Option<View<'a>>,
    pub gx: &'a Storage,
    pub gweight: Option<&'a Storage>,
    pub gbias: Option<&'a Storage>,
    pub gx_half: Option<&'a Storage>,
    pub gx_half_sums: Option<&'a Storage>,
}

/// The row kernels of one device. Arguments arrive validated (entry functions below).
pub trait RowKernels {
    fn softmax(&self, a: &Softmax) -> Result<()>;
    fn softmax_backward(&self, a: &SoftmaxBackward) -> Result<()>;
    fn layer_norm(&self, a: &LayerNorm) -> Result<()>;
    fn layer_norm_backward(&self, a: &LayerNormBackward) -> Result<()>;
    /// Whether `layer_norm_backward` writes `gx_half` itself for these arguments; where it
    /// does not, the entry function converts gx into it afterwards.
    fn layer_norm_backward_writes_half(&self, _a: &LayerNormBackward) -> bool {
        false
    }
    /// Whether `layer_norm_backward` writes `gx_half_sums` itself for these arguments; where
    /// it does not, the entry function reduces gx_half into it afterwards.
    fn layer_norm_backward_sums_half(&self, _a: &LayerNormBackward) -> bool {
        false
    }
}

pub fn softmax(a: &Softmax) -> Result<()> {
    const OP: &str = "softmax";
    let dtype = a.x.storage.dtype();
    check::float(OP, dtype)?;
    check::on_device(OP, a.y.device(), [a.x.storage])?;
    let len = a.x.layout.numel();
    check::dense(OP, "input 0", &a.x, len, dtype)?;
    check::out(OP, a.y, len, dtype)?;
    backend(a.y.device())?.softmax(a)
}

pub fn softmax_backward(a: &SoftmaxBackward) -> Result<()> {
    const OP: &str = "softmax_backward";
    let dtype = a.y.storage.dtype();
    check::float(OP, dtype)?;
    check::on_device(OP, a.gx.device(), [a.y.storage, a.gy.storage])?;
    let len = a.y.layout.numel();
    check::dense(OP, "input 0", &a.y, len, dtype)?;
    check::dense(OP, "input 1", &a.gy, len, dtype)?;
    check::out(OP, a.gx, len, dtype)?;
    backend(a.gx.device())?.softmax_backward(a)
}

pub fn layer_norm(a: &LayerNorm) -> Result<()> {
    const OP: &str = "layer_norm";
    let dtype = a.x.storage.dtype();
    check::float(OP, dtype)?;
    let params = a.weight.iter().chain(&a.bias);
    check::on_device(
        OP,
        a.y.device(),
        [a.x.storage, a.mean, a.rstd]
            .into_iter()
            .chain(params.clone().map(|v| v.storage)),
    )?;
    let (rows, n) = rows_cols(a.x.layout);
    check::dense(OP, "x", &a.x, rows * n, dtype)?;
    for p in params {
        check::dense(OP, "a parameter", p, n, dtype)?;
    }
    check::mixed(OP, "the output", dtype, a.y.dtype())?;
    check::out(OP, a.y, rows * n, a.y.dtype())?;
    if let Some(r) = &a.residual {
        check::on_device(OP, a.y.device(), [r.h.storage, r.sum])?;
        check::dense(OP, "the residual branch", &r.h, rows * n, a.y.dtype())?;
        check::out(OP, r.sum, rows * n, dtype)?;
    }
    stats(OP, a.mean, a.rstd, rows)?;
    backend(a.y.device())?.layer_norm(a)
}

pub fn layer_norm_backward(a: &LayerNormBackward) -> Result<()> {
    const OP: &str = "layer_norm_backward";
    let dtype = a.x.storage.dtype();
    check::float(OP, dtype)?;
    if a.gweight.is_some() && a.weight.is_none() {
        return Err(Error::invalid(OP, "a weight gradient needs the weight"));
    }
    let device = a.gx.device();
    let outs = [Some(a.gx), a.gweight, a.gbias].into_iter().flatten();
    let ins = [
        Some(a.x),
        a.weight,
        Some(a.mean),
        Some(a.rstd),
        Some(a.gy),
        a.prior,
    ];
    check::on_device(
        OP,
        device,
        ins.iter().flatten().map(|v| v.storage).chain(outs),
    )?;
    let (rows, n) = rows_cols(a.x.layout);
    check::dense(OP, "x", &a.x, rows * n, dtype)?;
    if let Some(w) = &a.weight {
        check::dense(OP, "the weight", w, n, dtype)?;
    }
    check::dense_float(OP, "mean", &a.mean, rows)?;
    check::dense_float(OP, "rstd", &a.rstd, rows)?;
    check::same_dtype(OP, a.mean.storage.dtype(), a.rstd.storage.dtype())?;
    let gy_dtype = a.gy.storage.dtype();
    check::mixed(OP, "gy", dtype, gy_dtype)?;
    check::dense(OP, "gy", &a.gy, rows * n, gy_dtype)?;
    if let Some(p) = &a.prior {
        check::dense(OP, "prior", p, rows * n, dtype)?;
        if std::ptr::eq(p.storage, a.gx) && p.layout.offset() != 0 {
            return Err(Error::invalid(
                OP,
                "a prior in gx's storage must be gx itself",
            ));
        }
    }
    check::out(OP, a.gx, rows * n, dtype)?;
    for g in [a.gweight, a.gbias].into_iter().flatten() {
        check::out(OP, g, n, dtype)?;
    }
    if let Some(h) = a.gx_half {
        if dtype != DType::F32 || h.dtype() != gy_dtype {
            return Err(Error::invalid(
                OP,
                "gx_half is for f32 rows and has the dtype of their f16/bf16 gradient gy",
            ));
        }
        check::on_device(OP, device, [h])?;
        check::out(OP, h, rows * n, gy_dtype)?;
    }
    if let Some(sums) = a.gx_half_sums {
        if a.gx_half.is_none() {
            return Err(Error::invalid(
                OP,
                "gx_half_sums are the sums of gx_half: pass both",
            ));
        }
        check::on_device(OP, device, [sums])?;
        check::out(OP, sums, n, dtype)?;
    }
    let kernels = backend(device)?;
    kernels.layer_norm_backward(a)?;
    let Some(h) = a.gx_half else {
        return Ok(());
    };
    if !kernels.layer_norm_backward_writes_half(a) {
        let all = Layout::contiguous(&[rows * n]);
        let view = |storage| View {
            storage,
            layout: &all,
        };
        super::elementwise::copy(view(a.gx), view(h))?;
    }
    match a.gx_half_sums {
        Some(sums) if !kernels.layer_norm_backward_sums_half(a) => {
            let matrix = Layout::contiguous(&[rows, n]);
            let half = View {
                storage: h,
                layout: &matrix,
            };
            super::reduce::reduce(super::ReduceOp::Sum, half, &[0], sums)
        }
        _ => Ok(()),
    }
}

/// mean and rstd: `rows` elements each of one float dtype.
fn stats(op: &'static str, mean: &Storage, rstd: &Storage, rows: usize) -> Result<()> {
    check::out_float(op, mean, rows)?;
    check::out_float(op, rstd, rows)?;
    if mean.dtype() != rstd.dtype() {
        return Err(Error::invalid(op, "mean and rstd must share one dtype"));
    }
    Ok(())
}
