//! Files: training state (parameters, optimizer state, counters) saved and restored in the
//! safetensors format, written atomically so a crash mid-save never costs the last good file.

mod state;

pub use state::{load_state, save_state};
