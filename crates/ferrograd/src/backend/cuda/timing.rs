//! Per-kernel GPU time, for finding where a step's time goes: with the environment variable
//! `FERROGRAD_KERNEL_TIMES=1`, every kernel launch and cuBLAS call is bracketed by two timing
//! events on its stream. Nothing waits: the events are read when the rows are taken, so the
//! step runs as it would untimed (plus two event records per call), and the rows add up to
//! the device's busy time. Off (the default), it costs one flag test per launch.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::CudaEvent;
use cudarc::driver::sys::CUevent_flags;

use super::CudaDevice;
use crate::base::Result;

/// One kernel's calls and their summed time.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    pub name: String,
    pub calls: u64,
    pub seconds: f64,
}

/// Timed calls whose events have not been read yet: (name, start, end).
static PENDING: Mutex<Vec<(String, CudaEvent, CudaEvent)>> = Mutex::new(Vec::new());

thread_local! {
    /// This thread's host waits on the device (stream synchronisations, including those of
    /// copies to the host): how many, and their nanoseconds. Always counted, so a step's time
    /// can be split into the host's own work and its waits; per thread, because a wait blocks
    /// the thread that asked, and another thread's steps are not this one's.
    static WAITS: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// Adds one host wait of `ns` nanoseconds to the calling thread's count.
pub(crate) fn count_wait(ns: u64) {
    WAITS.with(|w| {
        let (n, t) = w.get();
        w.set((n + 1, t + ns));
    });
}

/// The calling thread's (host waits on the device, seconds waited) since its last call, and
/// resets both.
pub fn take_host_waits() -> (u64, f64) {
    let (n, ns) = WAITS.with(|w| w.replace((0, 0)));
    (n, ns as f64 * 1e-9)
}

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERROGRAD_KERNEL_TIMES").is_ok_and(|v| v == "1"))
}

/// Runs `f` (which queues one kernel or library call, named by `name()`), timed when enabled.
pub(crate) fn timed<R>(
    d: &CudaDevice,
    name: impl FnOnce() -> String,
    f: impl FnOnce() -> Result<R>,
) -> Result<R> {
    // Events recorded into a capture would be replayed, not read.
    if !enabled() || d.is_capturing() {
        return f();
    }
    let event = || {
        d.stream()
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| d.err("cuEventRecord", e))
    };
    let start = event()?;
    let r = f()?;
    let end = event()?;
    PENDING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((name(), start, end));
    Ok(r)
}

/// The rows so far, the most time first, and clears them (empty when timing is off). Waits
/// for the timed calls to finish; a pair whose time cannot be read is left out.
pub fn take_kernel_times() -> Vec<KernelTime> {
    let pending = std::mem::take(&mut *PENDING.lock().unwrap_or_else(|e| e.into_inner()));
    let mut times: HashMap<String, (u64, f64)> = HashMap::new();
    for (name, start, end) in pending {
        let Ok(ms) = start.elapsed_ms(&end) else {
            continue;
        };
        let row = times.entry(name).or_insert((0, 0.0));
        row.0 += 1;
        row.1 += f64::from(ms) * 1e-3;
    }
    let mut rows: Vec<KernelTime> = times
        .into_iter()
        .map(|(name, (calls, seconds))| KernelTime {
            name,
            calls,
            seconds,
        })
        .collect();
    rows.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    rows
}
