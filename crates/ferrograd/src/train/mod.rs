//! Training strategies, one small file each, composed in one readable step.

mod accumulate;
mod freeze;
mod grad_scaler;
mod step_in_backward;
mod trainer;

pub use accumulate::accumulate_gradients;
pub use freeze::{freeze, name_matches};
pub use grad_scaler::{GradScaler, GradScalerConfig};
pub use step_in_backward::{InBackwardPath, StepInBackward};
pub use trainer::{MicroBatch, StepReport, Trainer, TrainerConfig};
