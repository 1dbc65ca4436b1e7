//! The bottom layer: plain data every other module needs and that needs nothing above it —
//! devices, dtypes, layouts (shape, strides, offset), memory categories, the error type and
//! the out-of-memory report it carries. No allocation, no kernels, no autograd here.

mod category;
mod device;
mod dtype;
pub mod error;
mod format;
mod layout;
mod oom;
mod round;

pub use category::{Category, CategoryBytes};
pub use device::Device;
pub use dtype::DType;
pub use error::{Error, Result};
pub use format::format_size;
pub use layout::{Layout, broadcast_shape, checked_numel, contiguous_strides, resolve_dim};
pub use oom::{LiveBlockInfo, OomReport};
pub use round::{bf16_of, f16_of};
