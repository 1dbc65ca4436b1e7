//! Neural-network building blocks: the `Module` trait and layers made of tensor ops.

mod activation;
mod linear;
mod module;
mod sequential;

pub use activation::{Gelu, Relu};
pub use linear::Linear;
pub use module::Module;
pub use sequential::Sequential;

use crate::error::Result;
use crate::tensor::Tensor;

/// Mean squared error (`torch.nn.functional.mse_loss`, reduction mean).
pub fn mse_loss(input: &Tensor, target: &Tensor) -> Result<Tensor> {
    input.mse_loss(target)
}
