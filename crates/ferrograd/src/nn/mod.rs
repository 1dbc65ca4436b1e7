//! Neural-network building blocks: the `Module` trait and layers made of tensor ops.

mod activation;
mod attention;
mod dropout;
mod embedding;
mod gpt;
mod layer_norm;
mod linear;
mod mlp;
mod module;
mod recompute;
mod sequential;
mod state;

pub use activation::{Gelu, Relu};
pub use attention::{CausalSelfAttention, causal_mask};
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use gpt::{Block, Gpt, GptConfig, IGNORE_INDEX};
pub use layer_norm::LayerNorm;
pub use linear::Linear;
pub use mlp::Mlp;
pub use module::Module;
pub use recompute::Recompute;
pub use sequential::Sequential;
pub use state::load_named;

use crate::base::Result;
use crate::tensor::Tensor;

/// Mean squared error (`torch.nn.functional.mse_loss`, reduction mean).
pub fn mse_loss(input: &Tensor, target: &Tensor) -> Result<Tensor> {
    input.mse_loss(target)
}
