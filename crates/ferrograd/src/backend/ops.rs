//! Op kinds passed to backends as data. One enum per family; adding an op means a variant
//! here, its CPU kernel, and (later) its device kernel.

/// Elementwise ops of one input. Scalar parameters travel inside the variant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryOp {
    Neg,
    Exp,
    Log,
    Sqrt,
    Tanh,
    Sigmoid,
    Relu,
    GeluTanh,
    GeluErf,
    Abs,
    /// x + c
    AddScalar(f64),
    /// x * c
    MulScalar(f64),
    /// x ^ c
    PowScalar(f64),
    /// 1 if x > 0 else 0, in x's dtype
    Step,
    /// min(max(x, lo), hi), NaN kept (torch.clamp); lo and hi rounded to x's dtype first
    Clamp {
        lo: f64,
        hi: f64,
    },
}

/// Elementwise ops of two inputs (same dtype, already broadcast).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Maximum,
    /// a + alpha * b (used by in-place accumulation and optimizer updates)
    AddScaled(f64),
    /// copy b into a (in-place only)
    Assign,
    /// grad * (y > 0): ReLU backward from the saved output
    ReluBackward,
    /// grad * (1 - y^2): tanh backward from the saved output
    TanhBackward,
    /// grad * y * (1 - y): sigmoid backward from the saved output
    SigmoidBackward,
    /// grad * gelu'(x), tanh approximation, from the saved input
    GeluTanhBackward,
    /// grad * gelu'(x), exact erf form, from the saved input
    GeluErfBackward,
    /// 1.0 where a == b else 0.0 (used by max backward)
    Eq,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
    /// Index of the (first) maximum along the single reduced dim, as I64.
    ArgMax,
}

/// Shapes of a batched GEMM: `batch` matrices of (m, k) @ (k, n).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatmulSpec {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// Ops with dedicated kernels. Inputs and outputs are listed per variant; all outputs are
/// contiguous, and inputs are contiguous unless noted.
#[derive(Clone, Debug, PartialEq)]
pub enum FusedOp {
    /// inputs [x (R, N)]; outputs [y (R, N)] — softmax (or log-softmax) over the last dim.
    /// Any shape is read as rows of its last dim.
    Softmax { log: bool },
    /// inputs [y (R, N), gy (R, N)]; outputs [gx (R, N)] — from the saved output:
    /// softmax gx = y (gy - Σ gy·y); log-softmax gx = gy - exp(y) Σ gy
    SoftmaxBackward { log: bool },
    /// inputs [x (R, N), weight (N) if `weight`, bias (N) if `bias`];
    /// outputs [y (R, N), mean (R), rstd (R)]. Biased variance, rstd = 1/√(var + eps).
    /// mean and rstd may have any float dtype (callers use F32, or F64 for F64 inputs).
    LayerNorm { eps: f64, weight: bool, bias: bool },
    /// inputs [x (R, N), weight (N) if `weight`, mean (R), rstd (R), gy (R, N)];
    /// outputs [gx (R, N), gweight (N) if `weight`, gbias (N) if `bias`]
    LayerNormBackward { weight: bool, bias: bool },
    /// inputs [logits (R, C), targets I64 (R)]; outputs [loss () in the logits' dtype,
    /// lse (R) any float dtype]. Mean over targets != ignore_index (NaN when all are
    /// ignored); a target outside [0, C) that is not ignore_index is an error.
    CrossEntropy { ignore_index: i64 },
    /// inputs [logits (R, C), targets I64 (R), lse (R), gloss ()]; outputs [glogits (R, C)]
    /// = (softmax - onehot) · gloss / count, zero rows where the target is ignored
    CrossEntropyBackward { ignore_index: i64 },
    /// inputs [weight (V, D) strided allowed, ids I64 of any layout with N elements (read in
    /// row-major order)]; outputs [rows (N, D)]. An id outside 0..V is an `Error::Index`
    /// naming it, raised before anything is written.
    IndexSelect,
    /// inputs [grad_rows (N, D) strided allowed (stride 0 too), ids I64 as in IndexSelect];
    /// outputs [gweight (V, D)], added into (the caller zero-initialises it). Rows are added
    /// in id order, summed in f64 and rounded once: deterministic. Ids checked as above.
    IndexAdd,
    /// inputs [x, y] (same shape, contiguous); outputs [loss ()]: mean((x - y)²) in one pass
    MseLoss,
    /// inputs [x, y, gloss ()] (contiguous); outputs [gx]: 2 (x - y) · gloss / N in one pass
    MseLossBackward,
    /// One SGD update in a single pass, in place. inputs [grad]; outputs [param, buf?]
    /// (buf present iff momentum != 0; `first_step` initialises it from the gradient).
    SgdStep {
        lr: f64,
        momentum: f64,
        dampening: f64,
        weight_decay: f64,
        nesterov: bool,
        first_step: bool,
    },
    /// One Adam / AdamW step over n parameters in a single call (one launch on a GPU), in
    /// place. inputs [grad_0, .., grad_{n-1}] (contiguous); outputs [param_0, exp_avg_0,
    /// exp_avg_sq_0, param_1, ..] (3n, each trio of one dtype and numel). `step` is the
    /// 1-based step count after this update, shared by all n. PyTorch's single-tensor formula
    /// in the compute type (f32 for f32/f16/bf16, f64 for f64), rounded once per store:
    ///   p ← p·(1 − lr·wd) if decoupled (AdamW), else g ← g + wd·p (L2), when wd != 0
    ///   m ← lerp(m, g, 1 − β1);  v ← β2·v + (1 − β2)·g·g
    ///   p ← p − (lr / (1 − β1^t))·m / (√v / √(1 − β2^t) + eps)
    AdamStep {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        decoupled: bool,
        step: u64,
    },
    /// inputs [cond U8, a, b] all broadcast to the output shape (strided allowed);
    /// outputs [out] = cond != 0 ? a : b. a, b and out share one dtype (any).
    Where,
    /// Gradient unscaling with an inf/NaN check over n gradients in one call (one launch per
    /// dtype on a GPU), in place: torch's `_amp_foreach_non_finite_check_and_unscale_`.
    /// inputs []; outputs [found_inf (1) F32, grad_0, .., grad_{n-1}] (distinct whole
    /// storages, any float dtypes). Per element: found_inf ← 1 when the value *before*
    /// scaling is inf or NaN (never cleared: the caller zeroes it); g ← g·inv_scale in the
    /// compute type (f32 for f32/f16/bf16, f64 for f64), rounded once (g kept when
    /// inv_scale == 1).
    UnscaleCheck { inv_scale: f32 },
}

/// The scalars of one `FusedOp::AdamStep`, derived on the host in f64 once so that every
/// backend rounds the same values to its compute type.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AdamScalars {
    /// g ← g + l2·p (0 unless coupled weight decay)
    pub l2: f64,
    /// p ← p·decay first (1 unless decoupled weight decay)
    pub decay: f64,
    /// lerp weight of the first moment, 1 − β1
    pub w1: f64,
    pub beta2: f64,
    /// 1 − β2
    pub w2: f64,
    /// √(1 − β2^t)
    pub bc2_sqrt: f64,
    /// −lr / (1 − β1^t)
    pub neg_step_size: f64,
    pub eps: f64,
}

impl AdamScalars {
    /// None unless `op` is an `AdamStep`. The bias corrections use `powf` of the step as a
    /// float, as torch/optim/adam.py does (`beta1 ** step`).
    pub(crate) fn of(op: &FusedOp) -> Option<AdamScalars> {
        let FusedOp::AdamStep {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay: wd,
            decoupled,
            step,
        } = *op
        else {
            return None;
        };
        let t = step as f64;
        let bc1 = 1.0 - beta1.powf(t);
        let bc2 = 1.0 - beta2.powf(t);
        Some(AdamScalars {
            l2: if decoupled { 0.0 } else { wd },
            decay: if decoupled { 1.0 - lr * wd } else { 1.0 },
            w1: 1.0 - beta1,
            beta2,
            w2: 1.0 - beta2,
            bc2_sqrt: bc2.sqrt(),
            neg_step_size: -(lr / bc1),
            eps,
        })
    }
}
