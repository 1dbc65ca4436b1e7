//! `--memory-trace DIR`: the first N training steps recorded by the memory recorder and
//! written as PyTorch's snapshot pickle, a Chrome/Perfetto trace and an HTML report. The
//! folder is checked before any work; the recording is stopped even when the run fails.

use std::path::PathBuf;

use crate::base::{Device, Error, Result};
use crate::io::memory_trace::{check_trace_dir, write_memory_trace};
use crate::memory::recorder::{self, RecorderConfig};

/// What to record and where to write it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryTraceSettings {
    pub dir: PathBuf,
    /// Training steps recorded, from the run's first.
    pub steps: u64,
    /// The recorder's ring capacity in events.
    pub capacity: usize,
}

impl MemoryTraceSettings {
    /// Refuses settings that record nothing and folders that cannot be written.
    pub fn check(&self) -> Result<()> {
        if self.steps == 0 {
            return Err(Error::invalid(
                "memory trace",
                "--memory-trace-steps 0 records nothing; give at least 1",
            ));
        }
        if self.capacity == 0 {
            return Err(Error::invalid(
                "memory trace",
                "a recorder capacity of 0 events keeps nothing; give at least 1",
            ));
        }
        check_trace_dir(&self.dir)
    }
}

/// A running recording; dropping it unfinished stops the recorder and writes nothing.
pub struct TraceRun {
    settings: MemoryTraceSettings,
    /// The step index at which the recording ends.
    pub until: u64,
    finished: bool,
}

/// What a finished trace wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceWritten {
    pub files: Vec<PathBuf>,
    /// The recorder's summary line (events kept, whether the ring wrapped).
    pub summary: String,
}

impl TraceRun {
    pub fn start(settings: &MemoryTraceSettings, first_step: u64) -> Result<TraceRun> {
        recorder::start(RecorderConfig {
            capacity: settings.capacity,
        })?;
        Ok(TraceRun {
            settings: settings.clone(),
            until: first_step + settings.steps,
            finished: false,
        })
    }

    /// Stops the recorder and writes the three files for `device`.
    pub fn finish(mut self, device: Device) -> Result<TraceWritten> {
        self.finished = true;
        let rec = recorder::stop()?;
        let files = write_memory_trace(&self.settings.dir, &rec, device)?;
        Ok(TraceWritten {
            files,
            summary: rec.summary(),
        })
    }
}

impl Drop for TraceRun {
    fn drop(&mut self) {
        if !self.finished {
            let _ = recorder::stop();
        }
    }
}
