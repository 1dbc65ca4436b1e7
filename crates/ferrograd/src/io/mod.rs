//! Files: training state (parameters, optimizer state, counters) saved and restored in the
//! safetensors format, written atomically so a crash mid-save never costs the last good file,
//! output paths checked before a run starts, and memory recordings exported for PyTorch's
//! memory_viz, Chrome/Perfetto and the browser.

pub mod memory_trace;
mod path;
mod state;

pub use path::check_output_path;
pub use state::{CHECKSUM_KEY, load_state, save_state};
