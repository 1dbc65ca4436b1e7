//! Per-kernel GPU time, for finding where a step's time goes: with the environment variable
//! `FERROGRAD_KERNEL_TIMES=1`, every kernel launch and cuBLAS call synchronises the stream
//! before and after itself and adds the time between to its kernel's row. The synchronisation
//! makes the whole run slower (each call also pays its launch latency), so the rows rank the
//! kernels; they are not the step time. Off (the default), it costs one flag test per launch.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use super::CudaDevice;
use crate::base::Result;

/// One kernel's calls and their summed time.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    pub name: String,
    pub calls: u64,
    pub seconds: f64,
}

static TIMES: Mutex<Option<HashMap<String, (u64, f64)>>> = Mutex::new(None);

/// Host waits on the device (stream synchronisations, including those of copies to the host):
/// how many, and their nanoseconds. Always counted (an atomic add per wait), so a step's time
/// can be split into the host's own work and its waits.
static WAITS: AtomicU64 = AtomicU64::new(0);
static WAIT_NS: AtomicU64 = AtomicU64::new(0);

/// Adds one host wait of `ns` nanoseconds.
pub(crate) fn count_wait(ns: u64) {
    WAITS.fetch_add(1, Ordering::Relaxed);
    WAIT_NS.fetch_add(ns, Ordering::Relaxed);
}

/// (host waits on the device, seconds waited) since the last call, and resets both.
pub fn take_host_waits() -> (u64, f64) {
    let n = WAITS.swap(0, Ordering::Relaxed);
    let ns = WAIT_NS.swap(0, Ordering::Relaxed);
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
    if !enabled() {
        return f();
    }
    d.synchronize()?;
    let t0 = Instant::now();
    let r = f()?;
    d.synchronize()?;
    let dt = t0.elapsed().as_secs_f64();
    let mut times = TIMES.lock().unwrap_or_else(|e| e.into_inner());
    let row = times
        .get_or_insert_with(HashMap::new)
        .entry(name())
        .or_insert((0, 0.0));
    row.0 += 1;
    row.1 += dt;
    Ok(r)
}

/// The rows so far, the most time first, and clears them (empty when timing is off).
pub fn take_kernel_times() -> Vec<KernelTime> {
    let mut times = TIMES.lock().unwrap_or_else(|e| e.into_inner());
    let mut rows: Vec<KernelTime> = times
        .take()
        .unwrap_or_default()
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
