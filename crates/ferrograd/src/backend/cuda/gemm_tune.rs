//! Choosing cuBLASLt's algorithm for a problem by timing the heuristic's candidates, once per
//! problem per process. The heuristic's first answer is a model's guess; PyTorch's TunableOp
//! times the alternatives for the same reason.
//!
//! `FERROGRAD_GEMM_TUNE`: `0` (the default) takes the heuristic's first answer; `1` times up
//! to `MAX_CANDIDATES` of its answers and keeps the fastest; `report` does so and also prints
//! one line per problem to stderr: the heuristic's first time, the fastest, and the fastest
//! without the epilogue (what a separate epilogue kernel would have to beat).
//!
//! Candidates run on the call's own operands: the epilogue GEMMs write their outputs and never
//! read them (beta 0), so the real call that follows overwrites everything a candidate wrote.
//! Nothing is timed while the stream is being captured into a CUDA graph (a capture records
//! launches without running them): a problem first met there takes the heuristic's answer.

use std::ffi::c_void;
use std::sync::OnceLock;

use cudarc::cublaslt::sys::{self as lt_sys, cublasLtMatmulAlgo_t, cublasStatus_t};
use cudarc::driver::sys::CUevent_flags;

use super::CudaDevice;
use crate::base::Result;

/// How many of the heuristic's answers are asked for and timed.
pub(super) const MAX_CANDIDATES: usize = 16;
/// Timed runs per candidate, after one untimed run that warms its kernel.
const RUNS: usize = 5;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Mode {
    Off,
    On,
    Report,
}

/// The mode from `FERROGRAD_GEMM_TUNE`, read once.
pub(super) fn mode() -> Mode {
    static MODE: OnceLock<Mode> = OnceLock::new();
    *MODE.get_or_init(|| mode_from(std::env::var("FERROGRAD_GEMM_TUNE").ok().as_deref()))
}

fn mode_from(setting: Option<&str>) -> Mode {
    match setting {
        Some("1" | "on" | "true") => Mode::On,
        Some("report") => Mode::Report,
        _ => Mode::Off,
    }
}

/// The heuristic's answers for the described problem, best guess first: those that succeed
/// and fit the workspace (empty when it has none).
///
/// # Safety
/// Every descriptor must be live.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn candidates(
    handle: lt_sys::cublasLtHandle_t,
    desc: lt_sys::cublasLtMatmulDesc_t,
    layouts: [lt_sys::cublasLtMatrixLayout_t; 3],
    pref: lt_sys::cublasLtMatmulPreference_t,
    wanted: usize,
    workspace: usize,
) -> Vec<cublasLtMatmulAlgo_t> {
    // SAFETY: a plain C struct of integers and an enum whose zero is a valid status.
    let mut found: Vec<lt_sys::cublasLtMatmulHeuristicResult_t> =
        vec![unsafe { std::mem::zeroed() }; wanted];
    let mut count = 0i32;
    let [la, lb, lc] = layouts;
    // SAFETY: the caller's descriptors are live; `found` holds `wanted` results.
    let status = unsafe {
        lt_sys::cublasLtMatmulAlgoGetHeuristic(
            handle,
            desc,
            la,
            lb,
            lc,
            lc,
            pref,
            wanted as i32,
            found.as_mut_ptr(),
            &mut count,
        )
    };
    if status != cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Vec::new();
    }
    found.truncate(count.max(0) as usize);
    found
        .into_iter()
        .filter(|r| r.state == cublasStatus_t::CUBLAS_STATUS_SUCCESS)
        .filter(|r| r.workspaceSize <= workspace)
        .map(|r| r.algo)
        .collect()
}

/// Each candidate's mean time in milliseconds over `RUNS` runs of `launch` (None where its
/// launch was refused). Waits for the device: call it outside a capture.
pub(super) fn time_each(
    d: &CudaDevice,
    algos: &[cublasLtMatmulAlgo_t],
    launch: impl Fn(&cublasLtMatmulAlgo_t) -> Result<()>,
) -> Result<Vec<Option<f32>>> {
    let event = || {
        d.stream()
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| d.err("cuEventRecord", e))
    };
    let mut times = Vec::with_capacity(algos.len());
    for algo in algos {
        if launch(algo).is_err() {
            times.push(None);
            continue;
        }
        let start = event()?;
        for _ in 0..RUNS {
            launch(algo)?;
        }
        let end = event()?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| d.err("cuEventElapsedTime", e))?;
        times.push(Some(ms / RUNS as f32));
    }
    Ok(times)
}

/// The index of the fastest time (the first on ties; 0 when none ran).
pub(super) fn fastest(times: &[Option<f32>]) -> usize {
    let mut best: Option<(usize, f32)> = None;
    for (i, t) in times.iter().enumerate() {
        if let Some(t) = *t
            && best.is_none_or(|(_, b)| t < b)
        {
            best = Some((i, t));
        }
    }
    best.map_or(0, |(i, _)| i)
}

/// The report's line for one problem: times in microseconds.
pub(super) fn report_line(
    name: &str,
    times: &[Option<f32>],
    chosen: usize,
    plain: Option<f32>,
) -> String {
    let us = |t: Option<f32>| t.map_or("-".to_string(), |t| format!("{:.1} µs", t * 1e3));
    let plain = plain.map_or(String::new(), |t| {
        format!("; without the epilogue {}", us(Some(t)))
    });
    format!(
        "gemm tune: {name}: heuristic's first {}, fastest {} (candidate {} of {}){plain}",
        us(times.first().copied().flatten()),
        us(times.get(chosen).copied().flatten()),
        chosen + 1,
        times.len()
    )
}

/// A raw pointer to a value for cuBLASLt's attribute setters.
pub(super) fn ptr<T>(v: &T) -> *const c_void {
    v as *const T as *const c_void
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setting_names_the_mode() {
        assert_eq!(mode_from(None), Mode::Off);
        assert_eq!(mode_from(Some("0")), Mode::Off);
        assert_eq!(mode_from(Some("1")), Mode::On);
        assert_eq!(mode_from(Some("report")), Mode::Report);
        assert_eq!(mode_from(Some("yes please")), Mode::Off);
    }

    #[test]
    fn the_fastest_candidate_that_ran_is_chosen_and_ties_keep_the_first() {
        assert_eq!(fastest(&[Some(2.0), None, Some(1.5), Some(1.5)]), 2);
        assert_eq!(fastest(&[None, Some(3.0)]), 1);
        assert_eq!(fastest(&[None, None]), 0);
        assert_eq!(fastest(&[]), 0);
    }

    #[test]
    fn the_report_line_gives_both_times_in_microseconds() {
        let line = report_line("gemm+bias 8x8x8", &[Some(0.08), Some(0.06)], 1, Some(0.05));
        assert_eq!(
            line,
            "gemm tune: gemm+bias 8x8x8: heuristic's first 80.0 µs, fastest 60.0 µs \
             (candidate 2 of 2); without the epilogue 50.0 µs"
        );
    }
}
