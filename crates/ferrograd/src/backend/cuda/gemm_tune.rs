//! Choosing cuBLASLt's algorithm for a problem by timing the heuristic's candidates, once per
//! problem per process. The heuristic's first answer is a model's guess; PyTorch's TunableOp
//! times the alternatives for the same reason.
//!
//! `FERROGRAD_GEMM_TUNE`: `1` (the default) times up to `MAX_CANDIDATES` of its answers and
//! keeps the fastest, where it beats the first by `MARGIN`; `0` takes the heuristic's first
//! answer; `report` tunes afresh (stored choices aside) and prints one line per problem to
//! stderr: the heuristic's first time, the fastest, and the fastest without the epilogue (what
//! a separate epilogue kernel would have to beat).
//!
//! Choices are kept for the next run (as TunableOp keeps its results file): one text file per
//! GPU model and cuBLASLt version in the kernel cache's folder (with the cache off, each
//! process times afresh), a line per problem naming the chosen candidate's place in the
//! heuristic's list (the heuristic answers alike for the same problem, GPU and library). A run
//! that finds its problems there times nothing, so runs after the first multiply with the same
//! algorithms, and their results match bit for bit. The margin keeps near-ties on the first
//! answer, so timing noise rarely decides a choice at all.
//!
//! Candidates run on the call's own operands: the epilogue GEMMs write their outputs and never
//! read them (beta 0), so the real call that follows overwrites everything a candidate wrote.
//! A product that accumulates into its output (beta != 0) is never timed: it takes the choice
//! of the same product with beta 0.
//! Nothing is timed while the stream is being captured into a CUDA graph (a capture records
//! launches without running them): a problem first met there takes the heuristic's answer.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use cudarc::cublaslt::sys::{self as lt_sys, cublasLtMatmulAlgo_t, cublasStatus_t};
use cudarc::driver::sys::CUevent_flags;

use super::CudaDevice;
use crate::base::Result;

/// How many of the heuristic's answers are asked for and timed.
pub(super) const MAX_CANDIDATES: usize = 16;
/// Timed runs per candidate, after one untimed run that warms its kernel.
const RUNS: usize = 5;
/// How much faster than the heuristic's first answer another candidate must be to be chosen.
const MARGIN: f32 = 0.03;

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
        Some("0" | "off" | "false") => Mode::Off,
        Some("report") => Mode::Report,
        _ => Mode::On,
    }
}

/// The heuristic's answers for the described problem, best guess first: those that succeed
/// and fit the workspace (empty when it has none).
///
/// # Safety
/// Every descriptor must be live.
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

/// The candidate to keep: the fastest where it beats the heuristic's first answer by MARGIN,
/// else the first (also when the first was refused and none other ran).
pub(super) fn choice(times: &[Option<f32>]) -> usize {
    let best = fastest(times);
    match (
        times.first().copied().flatten(),
        times.get(best).copied().flatten(),
    ) {
        (Some(first), Some(t)) if t > first * (1.0 - MARGIN) => 0,
        _ => best,
    }
}

/// Choices by problem, read from and written to one file per GPU model and library version.
static STORED: Mutex<Option<HashMap<PathBuf, HashMap<String, usize>>>> = Mutex::new(None);

/// The file of choices for a GPU named `gpu` under cuBLASLt `version`, in `dir`.
fn file_for(dir: &Path, gpu: &str, version: usize) -> PathBuf {
    let gpu: String = gpu
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    dir.join(format!("gemm-choices-{gpu}-cublaslt{version}.txt"))
}

/// This device's file of choices; None when the kernel cache is off or has no home.
fn this_file(d: &CudaDevice) -> Option<PathBuf> {
    // SAFETY: takes no arguments; answers the loaded library's version.
    let version = unsafe { lt_sys::cublasLtGetVersion() };
    super::kernel_cache::default_dir().map(|dir| file_for(&dir, &d.name(), version))
}

/// How many numbers name a problem in the file (cuda/gemm_lt.rs's `Key::problem`).
pub(super) const PROBLEM_FIELDS: usize = 17;

/// `problem candidate` lines; a line that does not parse (cut short, or foreign) is skipped.
fn parse(text: &str) -> HashMap<String, usize> {
    text.lines()
        .filter_map(|line| {
            let (problem, index) = line.trim().rsplit_once(' ')?;
            let fields: Vec<&str> = problem.split(' ').collect();
            let numbers = fields.iter().all(|f| f.parse::<i64>().is_ok());
            (numbers && fields.len() == PROBLEM_FIELDS).then_some(())?;
            Some((problem.to_string(), index.parse().ok()?))
        })
        .collect()
}

/// The lines of `choices`, sorted, so the file reads the same whoever wrote it.
fn render(choices: &HashMap<String, usize>) -> String {
    let mut lines: Vec<String> = choices.iter().map(|(p, i)| format!("{p} {i}\n")).collect();
    lines.sort();
    lines.concat()
}

/// How many choices the files in `dir` hold, over every GPU model and library version.
pub(super) fn stored_in(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with("gemm-choices-") && name.ends_with(".txt")
        })
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .map(|text| parse(&text).len())
        .sum()
}

/// The choice an earlier run stored for `problem` on this device, if any.
pub(super) fn stored(d: &CudaDevice, problem: &str) -> Option<usize> {
    stored_at(&this_file(d)?, problem)
}

/// Keeps `index` as the choice for `problem` on this device, for this process and the next.
pub(super) fn store(d: &CudaDevice, problem: &str, index: usize) {
    if let Some(file) = this_file(d) {
        store_at(&file, problem, index);
    }
}

/// `file`'s choices as this process knows them, read from the file the first time.
fn known<'a>(
    all: &'a mut Option<HashMap<PathBuf, HashMap<String, usize>>>,
    file: &Path,
) -> &'a mut HashMap<String, usize> {
    all.get_or_insert_with(HashMap::new)
        .entry(file.to_path_buf())
        .or_insert_with(|| {
            std::fs::read_to_string(file).map_or_else(|_| HashMap::new(), |t| parse(&t))
        })
}

/// The choice `file` holds for `problem`; the file is read once per process.
fn stored_at(file: &Path, problem: &str) -> Option<usize> {
    let mut all = STORED.lock().unwrap_or_else(|e| e.into_inner());
    known(&mut all, file).get(problem).copied()
}

/// Adds `problem`'s choice to `file`. The file is read again first, so the choices another
/// process stored since are kept too; a file that cannot be written only costs the next run
/// its timing.
fn store_at(file: &Path, problem: &str, index: usize) {
    let mut all = STORED.lock().unwrap_or_else(|e| e.into_inner());
    let choices = known(&mut all, file);
    if let Ok(text) = std::fs::read_to_string(file) {
        for (p, i) in parse(&text) {
            choices.entry(p).or_insert(i);
        }
    }
    choices.insert(problem.to_string(), index);
    let _ = super::kernel_cache::write(file, render(choices).as_bytes());
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
        assert_eq!(mode_from(None), Mode::On);
        assert_eq!(mode_from(Some("1")), Mode::On);
        assert_eq!(mode_from(Some("0")), Mode::Off);
        assert_eq!(mode_from(Some("off")), Mode::Off);
        assert_eq!(mode_from(Some("report")), Mode::Report);
    }

    #[test]
    fn the_fastest_candidate_that_ran_is_chosen_and_ties_keep_the_first() {
        assert_eq!(fastest(&[Some(2.0), None, Some(1.5), Some(1.5)]), 2);
        assert_eq!(fastest(&[None, Some(3.0)]), 1);
        assert_eq!(fastest(&[None, None]), 0);
        assert_eq!(fastest(&[]), 0);
    }

    #[test]
    fn another_candidate_is_kept_only_when_it_beats_the_first_by_the_margin() {
        // 2% faster: a near-tie stays on the heuristic's first answer.
        assert_eq!(choice(&[Some(1.0), Some(0.98)]), 0);
        // 7% faster (the GELU epilogue's candidate on an H100): kept.
        assert_eq!(choice(&[Some(82.5), Some(80.0), Some(76.4)]), 2);
        // The first refused: the fastest that ran.
        assert_eq!(choice(&[None, Some(2.0), Some(1.9)]), 2);
        assert_eq!(choice(&[None, None]), 0);
    }

    #[test]
    fn stored_choices_read_back_as_written() {
        let mut choices = HashMap::new();
        choices.insert(
            "3 14 14 68 8192 3072 768 0 1 768 768 256 256 256 256 256 256".into(),
            4,
        );
        choices.insert(
            "1 14 14 68 8192 768 768 0 1 768 768 256 256 256 256 256 0".into(),
            0,
        );
        let text = render(&choices);
        assert!(
            text.starts_with("1 14 14 68 8192 768 768"),
            "sorted: {text}"
        );
        assert_eq!(parse(&text), choices);
        // A torn or foreign line is skipped, not an error.
        let mut torn = text.clone();
        torn.push_str("7 14 14 68 819\nnot a choice\n");
        assert_eq!(parse(&torn), choices);
    }

    /// Two processes storing choices in turn: the second keeps the first's, and a third
    /// (a fresh process, nothing read yet) finds both.
    #[test]
    fn choices_stored_by_two_processes_are_both_read_by_the_next() {
        let dir =
            std::env::temp_dir().join(format!("ferrograd-gemm-choices-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let file = file_for(&dir, "GPU", 1);
        let forget = || {
            if let Some(all) = STORED.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
                all.remove(&file);
            }
        };
        let (a, b) = (
            "1 14 14 68 8192 768 768 0 1 768 768 256 256 256 256 256 0",
            "4 14 14 68 8192 2304 768 0 1 768 768 256 256 256 256 256 0",
        );
        assert_eq!(stored_at(&file, a), None);
        store_at(&file, a, 3);
        forget();
        store_at(&file, b, 0);
        forget();
        assert_eq!(stored_at(&file, a), Some(3));
        assert_eq!(stored_at(&file, b), Some(0));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_file_is_named_by_the_gpu_and_the_library_version() {
        let f = file_for(Path::new("/c"), "NVIDIA H100 80GB HBM3", 130200);
        assert_eq!(
            f,
            Path::new("/c/gemm-choices-NVIDIA_H100_80GB_HBM3-cublaslt130200.txt")
        );
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
