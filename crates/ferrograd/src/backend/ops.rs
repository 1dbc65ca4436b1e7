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
    /// inputs [x (R, N)]; outputs [y (R, N)] — softmax over the last dim
    Softmax { log: bool },
    /// inputs [y (R, N), gy (R, N)]; outputs [gx (R, N)] — from the saved output
    SoftmaxBackward { log: bool },
    /// inputs [x (R, N), weight (N)?, bias (N)?]; outputs [y (R, N), mean (R), rstd (R)]
    LayerNorm { eps: f64, affine: bool },
    /// inputs [x, weight?, mean, rstd, gy]; outputs [gx, gweight?, gbias?]
    LayerNormBackward { affine: bool },
    /// inputs [logits (R, C), targets I64 (R)]; outputs [loss () f32-like, lse (R)]
    /// mean over targets != ignore_index
    CrossEntropy { ignore_index: i64 },
    /// inputs [logits (R, C), targets (R), lse (R), gloss ()]; outputs [glogits (R, C)]
    CrossEntropyBackward { ignore_index: i64 },
    /// inputs [weight (V, D), ids I64 (N)]; outputs [rows (N, D)]
    IndexSelect,
    /// inputs [grad_rows (N, D), ids I64 (N)]; outputs [gweight (V, D)] (zero-initialised
    /// by the caller), rows added in order
    IndexAdd,
    /// inputs [cond U8, a, b] all broadcast to the output shape (strided allowed);
    /// outputs [out]
    Where,
}
