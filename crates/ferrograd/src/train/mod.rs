//! Training strategies, one small file each, composed in one readable step.

mod freeze;
mod recompute;

pub use freeze::{freeze, name_matches};
pub use recompute::{Segment, checkpoint_activations};
