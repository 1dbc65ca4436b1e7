//! The matmul family: batched GEMMs, plain, accumulating into their output, or with a bias
//! row added (linear's `x @ wᵀ + b`). Here: the shape spec, the `MatmulKernels` trait that
//! every backend implements, and the entry functions; `matmul_acc` with beta != 0 writes a
//! live buffer in place and bumps its version. `matmul`, `matmul_acc` and `matmul_row_sums`
//! also take f16 or bf16 operands into an f32 output (accumulated and stored in f32: a
//! parameter's gradient under autocast, written in the parameter's dtype directly); the
//! epilogue entries want one dtype throughout. Not here: the kernels
//! (backend/cpu/matmul.rs, backend/cuda/matmul.rs with cuBLAS, cuda/gemm_lt.rs with cuBLASLt).

use super::{Storage, View, backend, check};
use crate::base::{DType, Error, Result};

/// Shapes of a batched GEMM: `batch` matrices of (m, k) @ (k, n).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulSpec {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// Batched `out = a @ b + beta·out` where a: (..., m, k), b: (..., k, n) with equal batch
/// dims and out (batch, m, n) contiguous. beta = 0 does not read `out` (a NaN there does not
/// survive); beta != 0 accumulates into a live buffer (the fused SGD step writes a weight
/// gradient straight into the momentum buffer).
pub struct Matmul<'a> {
    pub spec: MatmulSpec,
    pub a: View<'a>,
    pub b: View<'a>,
    pub out: &'a Storage,
    pub beta: f64,
}

/// The matmul kernels of one device.
pub trait MatmulKernels {
    fn matmul(&self, m: &Matmul) -> Result<()>;
    /// Elements a wide GEMM dim should be padded to a multiple of, for `dtype`: 1 where any
    /// width is as fast (the CPU). cuBLAS runs an unaligned N or K (GPT-2's 50257-wide
    /// logits) on slow kernels, so CUDA asks for 128-byte rows (ops/aligned_gemm.rs pads).
    fn out_row_align(&self, _dtype: DType) -> usize {
        1
    }
    /// Whether `matmul_bias_gelu` and `matmul_dgelu` run as GEMM epilogues here (CUDA) rather
    /// than as a product and an elementwise pass (the defaults below).
    fn fuses_gelu_epilogues(&self) -> bool {
        false
    }
    /// `out = a @ b + bias` with `bias` (n) added to every output row (m has beta 0). By
    /// default the product, then the bias added in place by the elementwise family; CUDA adds
    /// it in the GEMM's epilogue instead (one pass over the output, not three).
    fn matmul_bias(&self, m: &Matmul, bias: View) -> Result<()> {
        self.matmul(m)?;
        add_bias_rows(m, bias)
    }
    /// `out = a @ b` (one product, beta 0) and `sums = Σ_k a[:, k]` (m elements of the
    /// output's dtype) from the same pass: a linear layer's weight and bias gradients
    /// (a = gᵀ). Ok(false) where the backend does not fuse them: nothing was written, and the
    /// caller runs the product and a reduction instead.
    fn matmul_row_sums(&self, _m: &Matmul, _sums: &Storage) -> Result<bool> {
        Ok(false)
    }
    /// Whether linear layers take their bias gradient from `matmul_row_sums` here: callers
    /// that get false take the plain path without allocating the fused call's outputs (on a
    /// GPU the fused call works either way; `bias_grad_epilogue` decides).
    fn fuses_row_sums(&self) -> bool {
        false
    }
    /// `pre = a @ b + bias` and `out = gelu_tanh(pre)` (the first layer of a GPT MLP, its
    /// pre-activation kept for backward). By default the biased product into `pre`, then the
    /// elementwise GELU; CUDA computes both in the GEMM's epilogue.
    fn matmul_bias_gelu(&self, m: &Matmul, bias: View, pre: &Storage) -> Result<()> {
        bias_gelu_composed(self, m, bias, pre)
    }
    /// `out = (a @ b) ∘ gelu_tanh'(pre)`: the GELU's input gradient straight from the GEMM
    /// that computes its output gradient. By default the product, then the elementwise GELU
    /// backward in place; CUDA applies it in the GEMM's epilogue.
    fn matmul_dgelu(&self, m: &Matmul, pre: View) -> Result<()> {
        dgelu_composed(self, m, pre)
    }
}

/// Whether `device`'s GEMMs apply GELU and its gradient in their epilogues (see
/// `MatmulKernels::fuses_gelu_epilogues`); while a plan runs on the meta device, its target's.
pub fn gelu_epilogues_fused(device: crate::base::Device) -> bool {
    backend(device).is_ok_and(|b| b.fuses_gelu_epilogues())
}

/// `matmul_bias_gelu` as a biased product and an elementwise GELU.
pub(crate) fn bias_gelu_composed<K: MatmulKernels + ?Sized>(
    k: &K,
    m: &Matmul,
    bias: View,
    pre: &Storage,
) -> Result<()> {
    let into_pre = Matmul { out: pre, ..*m };
    k.matmul_bias(&into_pre, bias)?;
    let lp = crate::base::Layout::contiguous(&[pre.len()]);
    super::elementwise::unary(
        super::UnaryOp::GeluTanh,
        View {
            storage: pre,
            layout: &lp,
        },
        m.out,
    )
}

/// `matmul_dgelu` as a product and the elementwise GELU backward in place.
pub(crate) fn dgelu_composed<K: MatmulKernels + ?Sized>(
    k: &K,
    m: &Matmul,
    pre: View,
) -> Result<()> {
    k.matmul(m)?;
    super::elementwise::binary_inplace(super::BinaryOp::GeluTanhBackward, m.out, pre)
}

/// out (batch·m, n) += bias (n) broadcast over the rows, as the elementwise family adds.
pub(crate) fn add_bias_rows(m: &Matmul, bias: View) -> Result<()> {
    let rows = m.spec.batch * m.spec.m;
    let lb = bias.layout.broadcast_to(&[rows, m.spec.n])?;
    super::elementwise::binary_inplace(
        super::BinaryOp::Add,
        m.out,
        View {
            storage: bias.storage,
            layout: &lb,
        },
    )
}

/// Which output dtypes an entry takes for its operands' dtype.
#[derive(Clone, Copy, PartialEq, Eq)]
enum OutDType {
    /// The operands' dtype only (the epilogue entries).
    Same,
    /// The operands' dtype, or f32 for f16/bf16 operands.
    SameOrF32,
}

/// Whether a GEMM of `operands` may write `out`: f16 and bf16 products accumulate in f32
/// anyway, so storing that f32 sum costs no extra pass.
pub fn widens_to(operands: DType, out: DType) -> bool {
    out == DType::F32 && matches!(operands, DType::F16 | DType::BF16)
}

/// The product's arguments, validated.
fn checked<'a>(
    spec: &MatmulSpec,
    a: View<'a>,
    b: View<'a>,
    out: &'a Storage,
    beta: f64,
    out_dtype: OutDType,
) -> Result<Matmul<'a>> {
    let m = Matmul {
        spec: *spec,
        a,
        b,
        out,
        beta,
    };
    validate(&m, out_dtype)?;
    Ok(m)
}

/// `out = a @ b` into a fresh output.
/// An f32 `out` for f16/bf16 operands holds the f32 sums unrounded.
pub fn matmul(spec: &MatmulSpec, a: View, b: View, out: &Storage) -> Result<()> {
    let m = checked(spec, a, b, out, 0.0, OutDType::SameOrF32)?;
    backend(out.device())?.matmul(&m)
}

/// `out = a @ b + bias`, bias (n) added to every row of the fresh output.
pub fn matmul_bias(spec: &MatmulSpec, a: View, b: View, bias: View, out: &Storage) -> Result<()> {
    let m = checked(spec, a, b, out, 0.0, OutDType::Same)?;
    check_bias("linear", spec, out, &bias)?;
    backend(out.device())?.matmul_bias(&m, bias)
}

/// Whether a GPU takes a linear layer's bias gradient from its weight-gradient GEMM's
/// epilogue (cuBLASLt's BGRADB) or from a plain GEMM and a column sum of g (the default):
/// `FERROGRAD_BIAS_GRAD_EPILOGUE=1` turns the epilogue on, for the device and its plans
/// alike. On an H100 the epilogue slowed GPT-2's four weight-gradient GEMMs of a layer from
/// 180 to 253 µs, about what the column sums take: the B8 step's mean over five A/B pairs was
/// 19.66 ms with it and 19.57 without (four pairs of five faster without), B32 67.81 / 67.74.
pub(crate) fn bias_grad_epilogue() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERROGRAD_BIAS_GRAD_EPILOGUE").is_ok_and(|v| v == "1"))
}

/// Whether `device`'s backend sums a linear layer's bias gradient inside the GEMM.
pub fn fuses_row_sums(device: crate::base::Device) -> Result<bool> {
    Ok(backend(device)?.fuses_row_sums())
}

/// `out = a @ b` and `sums = Σ_k a[:, k]` (m) in one pass where the backend fuses them;
/// Ok(false) (nothing written) where it does not. An f32 `out` for f16/bf16 operands takes
/// f32 sums.
pub fn matmul_row_sums(
    spec: &MatmulSpec,
    a: View,
    b: View,
    out: &Storage,
    sums: &Storage,
) -> Result<bool> {
    let m = checked(spec, a, b, out, 0.0, OutDType::SameOrF32)?;
    check::on_device("linear_backward", out.device(), [sums])?;
    check::same_dtype("linear_backward", out.dtype(), sums.dtype())?;
    if spec.batch != 1 || sums.len() != spec.m {
        return Err(Error::shape(
            "linear_backward",
            format!(
                "row sums of {} elements for a product of {} x {}x{}: one product, m sums",
                sums.len(),
                spec.batch,
                spec.m,
                spec.k
            ),
        ));
    }
    backend(out.device())?.matmul_row_sums(&m, sums)
}

/// `pre = a @ b + bias`, `out = gelu_tanh(pre)` for one product, both fresh (m, n) outputs.
pub fn matmul_bias_gelu(
    spec: &MatmulSpec,
    a: View,
    b: View,
    bias: View,
    pre: &Storage,
    out: &Storage,
) -> Result<()> {
    let m = checked(spec, a, b, out, 0.0, OutDType::Same)?;
    check_bias("mlp", spec, out, &bias)?;
    same_output("mlp", out, pre)?;
    backend(out.device())?.matmul_bias_gelu(&m, bias, pre)
}

/// `out = (a @ b) ∘ gelu_tanh'(pre)` for one product; pre holds the (m, n) pre-activation.
pub fn matmul_dgelu(spec: &MatmulSpec, a: View, b: View, pre: View, out: &Storage) -> Result<()> {
    let m = checked(spec, a, b, out, 0.0, OutDType::Same)?;
    check::on_device("mlp_backward", out.device(), [pre.storage])?;
    check::same_dtype("mlp_backward", out.dtype(), pre.storage.dtype())?;
    if spec.batch != 1 || pre.layout.shape() != [spec.m, spec.n] {
        return Err(Error::shape(
            "mlp_backward",
            format!(
                "pre-activation {:?} for a product of {} x {}x{}: one product, (m, n)",
                pre.layout.shape(),
                spec.batch,
                spec.m,
                spec.n
            ),
        ));
    }
    backend(out.device())?.matmul_dgelu(&m, pre)
}

/// A bias of one value per output column, on the output's device and in its dtype.
fn check_bias(op: &'static str, spec: &MatmulSpec, out: &Storage, bias: &View) -> Result<()> {
    check::on_device(op, out.device(), [bias.storage])?;
    check::same_dtype(op, out.dtype(), bias.storage.dtype())?;
    if bias.layout.shape() != [spec.n] {
        return Err(Error::shape(
            op,
            format!(
                "bias {:?} must have shape [{}] (one value per output column)",
                bias.layout.shape(),
                spec.n
            ),
        ));
    }
    Ok(())
}

/// A second output of the same length, device and dtype as `out`.
fn same_output(op: &'static str, out: &Storage, other: &Storage) -> Result<()> {
    check::on_device(op, out.device(), [other])?;
    check::same_dtype(op, out.dtype(), other.dtype())?;
    if other.len() != out.len() {
        return Err(Error::shape(
            op,
            format!("{} elements for an output of {}", other.len(), out.len()),
        ));
    }
    Ok(())
}

/// The width a GEMM dim of n is padded to on `device`: n, or n rounded up to the backend's
/// alignment when n is wide enough (≥ 1024) for the padding to be negligible.
pub fn padded_gemm_width(device: crate::base::Device, dtype: DType, n: usize) -> Result<usize> {
    let align = backend(device)?.out_row_align(dtype);
    Ok(if align > 1 && n >= 1024 {
        n.next_multiple_of(align)
    } else {
        n
    })
}

/// `out = a @ b + beta·out` into an existing buffer; bumps `out`'s version (the caller's
/// buffer is live: a momentum buffer, or a gradient being accumulated). An f32 `out` may
/// take f16/bf16 operands (an f32 buffer accumulates their products in f32).
pub fn matmul_acc(spec: &MatmulSpec, a: View, b: View, out: &Storage, beta: f64) -> Result<()> {
    let m = checked(spec, a, b, out, beta, OutDType::SameOrF32)?;
    backend(out.device())?.matmul(&m)?;
    out.bump_version();
    Ok(())
}

/// The one check of a GEMM's operands: one device, one operand dtype (and the output's, or
/// f32 where `out_dtype` allows it), a (..., m, k) and b (..., k, n) with one batch shape of
/// `batch` matrices, out holding batch·m·n elements.
fn validate(g: &Matmul, out_dtype: OutDType) -> Result<()> {
    const OP: &str = "matmul";
    let (s, la, lb) = (&g.spec, g.a.layout, g.b.layout);
    check::on_device(OP, g.out.device(), [g.a.storage, g.b.storage])?;
    let dtype = g.a.storage.dtype();
    check::same_dtype(OP, dtype, g.b.storage.dtype())?;
    let widened = out_dtype == OutDType::SameOrF32 && widens_to(dtype, g.out.dtype());
    if !widened {
        check::same_dtype(OP, dtype, g.out.dtype())?;
    }
    let (ra, rb) = (la.rank(), lb.rank());
    let ok = ra >= 2
        && ra == rb
        && la.shape()[ra - 2..] == [s.m, s.k]
        && lb.shape()[rb - 2..] == [s.k, s.n]
        && la.shape()[..ra - 2] == lb.shape()[..rb - 2]
        && la.shape()[..ra - 2].iter().product::<usize>() == s.batch
        && g.out.len() == s.batch * s.m * s.n;
    if !ok {
        return Err(Error::shape(
            OP,
            format!(
                "operands {:?} @ {:?} into {} elements do not match ({} x {}x{} @ {}x{})",
                la.shape(),
                lb.shape(),
                g.out.len(),
                s.batch,
                s.m,
                s.k,
                s.k,
                s.n
            ),
        ));
    }
    Ok(())
}
