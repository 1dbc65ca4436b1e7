//! Training strategies, one small file each, composed in one readable step.

mod accumulate;
mod freeze;
mod recompute;
mod step_in_backward;
mod trainer;

pub use accumulate::accumulate_gradients;
pub use freeze::{freeze, name_matches};
pub use recompute::{Segment, checkpoint_activations};
pub use step_in_backward::StepInBackward;
pub use trainer::{MicroBatch, StepReport, Trainer, TrainerConfig};
