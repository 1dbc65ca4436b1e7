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
    /// inputs [cond U8, a, b] all broadcast to the output shape (strided allowed);
    /// outputs [out] = cond != 0 ? a : b. a, b and out share one dtype (any).
    Where,
}
