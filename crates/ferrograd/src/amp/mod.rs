//! Mixed precision: `autocast` regions run matmul-like ops in f16/bf16 and precision-sensitive
//! ops in f32 (PyTorch's op policy), with f32 master weights; `GradScaler` scales the loss so
//! f16 gradients do not underflow, unscales before clipping and skips steps with inf/NaN.

mod autocast;
mod scaler;

pub use autocast::*;
pub use scaler::*;
