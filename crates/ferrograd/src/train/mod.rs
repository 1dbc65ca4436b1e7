//! Memory strategies of training, one small file each, and the `Trainer` that composes them
//! in one readable step:
//!
//! - `accumulate` — gradient accumulation over micro-batches (with autocast and loss scaling);
//! - `freeze` — `requires_grad_(false)` by parameter-name pattern;
//! - `grad_scaler` — the `GradScaler` of f16 mixed precision;
//! - `graph` — CUDA graphs: a whole step captured once and replayed (`Trainer::step_graphed`);
//! - `step_in_backward` — the optimizer step inside backward: per-parameter hooks, or
//!   gradient-free (products into the optimizer's state) where the optimizer allows it;
//! - `trainer` — `Trainer` and `TrainerConfig`: sets the recomputation policy on the model,
//!   freezes, builds the optimizer over what trains, installs the step in backward, then runs
//!   accumulate → unscale → clip → step → zero_grad.
//!
//! Activation recomputation itself is an autograd facility (`autograd::checkpoint_activations`);
//! the per-block policy (`nn::Recompute`) belongs to the model, and the Trainer applies it.

mod accumulate;
mod freeze;
mod grad_scaler;
mod graph;
mod step_in_backward;
mod trainer;

pub use accumulate::{Accumulated, Accumulation, MicroBatch, accumulate, accumulate_gradients};
pub use freeze::{freeze, name_matches};
pub use grad_scaler::{GradScaler, GradScalerConfig, LossScaling};
pub use graph::{GraphStatus, HostInput, HostInputs, StepGraph};
pub use step_in_backward::{InBackwardPath, StepInBackward};
pub use trainer::{StepReport, Trainer, TrainerConfig};
