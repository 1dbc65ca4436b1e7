//! A memory recording written for the tools people already use: PyTorch's snapshot pickle
//! (pytorch.org/memory_viz, `python -m torch.cuda._memory_viz`), a Chrome/Perfetto trace, and
//! a self-contained HTML report. `check_trace_dir` refuses an unusable folder before any work
//! starts; `write_memory_trace` writes all three files or none.

mod chrome;
mod html;
mod pickle;
mod timeline;

pub use chrome::chrome_trace;
pub use html::html_report;
pub use pickle::snapshot_pickle;
pub use timeline::{LiveBlock, PEAK_BLOCKS, Peak, PhaseSpan, Sample, Timeline, timeline};

use std::fs;
use std::path::{Path, PathBuf};

use super::check_output_path;
use crate::base::{Device, Error, Result};
use crate::memory::recorder::Recording;

/// The files a trace folder receives.
pub const SNAPSHOT_FILE: &str = "memory_snapshot.pickle";
pub const TRACE_FILE: &str = "memory_trace.json";
pub const REPORT_FILE: &str = "memory_report.html";
const FILES: [&str; 3] = [SNAPSHOT_FILE, TRACE_FILE, REPORT_FILE];

/// Refuses a folder the trace cannot be written to: it must be a writable folder (its files
/// absent or regular files), or not exist yet inside a writable folder.
pub fn check_trace_dir(dir: &Path) -> Result<()> {
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => FILES
            .iter()
            .try_for_each(|f| check_output_path(&dir.join(f))),
        Ok(_) => Err(Error::OutputPath {
            path: dir.display().to_string(),
            detail: "it is a file, not a folder; name a folder for the memory trace".into(),
        }),
        Err(_) => check_output_path(dir),
    }
}

/// The three files' contents for `device`'s part of `rec`.
pub fn render_memory_trace(rec: &Recording, device: Device) -> Result<[Vec<u8>; 3]> {
    let t = timeline(rec, device);
    let trace = serde_json::to_vec(&chrome_trace(&t))
        .map_err(|e| Error::invalid("memory trace", format!("cannot encode the trace: {e}")))?;
    Ok([
        snapshot_pickle(rec, device)?,
        trace,
        html_report(rec, &t).into_bytes(),
    ])
}

/// Writes `memory_snapshot.pickle`, `memory_trace.json` and `memory_report.html` into `dir`
/// (created if absent), each through a temporary file renamed into place; on failure nothing
/// new is left behind. Returns the paths written.
pub fn write_memory_trace(dir: &Path, rec: &Recording, device: Device) -> Result<Vec<PathBuf>> {
    check_trace_dir(dir)?;
    let contents = render_memory_trace(rec, device)?;
    let created = !dir.exists();
    let fail = |what: &Path, e: std::io::Error| Error::OutputPath {
        path: what.display().to_string(),
        detail: format!("cannot write the memory trace ({e}); choose a writable folder"),
    };
    if created {
        fs::create_dir(dir).map_err(|e| fail(dir, e))?;
    }
    let temps: Vec<PathBuf> = FILES
        .iter()
        .map(|f| dir.join(format!(".{f}.{}.tmp", std::process::id())))
        .collect();
    let written = temps
        .iter()
        .zip(&contents)
        .try_for_each(|(tmp, bytes)| fs::write(tmp, bytes).map_err(|e| fail(tmp, e)));
    let finals: Vec<PathBuf> = FILES.iter().map(|f| dir.join(f)).collect();
    let renamed = written.and_then(|()| {
        temps
            .iter()
            .zip(&finals)
            .try_for_each(|(tmp, path)| fs::rename(tmp, path).map_err(|e| fail(path, e)))
    });
    if let Err(e) = renamed {
        for tmp in &temps {
            let _ = fs::remove_file(tmp);
        }
        if created {
            let _ = fs::remove_dir(dir);
        }
        return Err(e);
    }
    Ok(finals)
}
