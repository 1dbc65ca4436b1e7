//! Mixed precision's region state: `autocast` regions (per thread, nesting) and the
//! weight-cast cache that lives as long as the outermost region. The op policy that reads
//! this state sits with the ops (`ops/autocast.rs`); the `GradScaler`, which drives an
//! optimizer, sits with the training strategies (`train/grad_scaler.rs`).

mod autocast;

pub use autocast::*;
