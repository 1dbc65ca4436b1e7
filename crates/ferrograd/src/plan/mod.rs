//! The planner: a step's memory known before it runs. `plan` runs real code — a training step
//! of any model — on the meta device, where kernels compute nothing, with the target device's
//! allocation policy installed: the host's exact bytes, or the CUDA caching allocator's
//! rounding, pools, segments and splitting (the same `CachingPolicy` the real allocator runs,
//! over a simulated device of the target's capacity). The meta backend adds the bytes the
//! target's kernels take for themselves (backend/meta.rs). Because our allocations are
//! deterministic, the plan's peak is the run's peak: to the byte on the host.
//!
//! The output is a `Plan`: peak allocated and reserved, the categories at the peak, the peak
//! of each phase, the op and module whose allocation reached the peak, and the recorder's
//! `Recording` of the whole planned run (its exports in `io::memory_trace` work on it).

mod peaks;

use std::sync::Mutex;

pub use peaks::{PeakSite, PhasePeak};

use crate::backend::{MetaTarget, plan_as};
use crate::base::{CategoryBytes, Device, Error, Result, format_size};
use crate::memory::recorder::{self, RecorderConfig, Recording};
use crate::memory::{self, CachingPolicy, HostPolicy, Policy, SimulatedDevice};

/// The device a plan is made for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The host: exact bytes, no cache.
    Cpu,
    /// A CUDA GPU of `capacity` bytes (its caching allocator simulated).
    Cuda { capacity: u64 },
}

impl Target {
    /// What the target can hold (unbounded for the host, whose limit is checked by the caller).
    pub fn capacity(self) -> Option<u64> {
        match self {
            Target::Cpu => None,
            Target::Cuda { capacity } => Some(capacity),
        }
    }

    fn meta_target(self) -> MetaTarget {
        match self {
            Target::Cpu => MetaTarget::Host,
            Target::Cuda { .. } => MetaTarget::Cuda,
        }
    }

    /// The allocator policy the meta device runs for this target; `capacity` bounds a GPU.
    fn policy(self, capacity: u64) -> Box<dyn Policy> {
        match self {
            Target::Cpu => Box::new(HostPolicy::new(u64::MAX)),
            Target::Cuda { .. } => Box::new(CachingPolicy::new(SimulatedDevice::new(capacity))),
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Cpu => f.write_str("cpu"),
            Target::Cuda { capacity } => write!(f, "cuda ({})", format_size(*capacity)),
        }
    }
}

/// What a planned run needs.
#[derive(Clone, Debug)]
pub struct Plan {
    pub target: Target,
    /// The highest `memory_allocated` of the run.
    pub peak_allocated: u64,
    /// The highest `memory_reserved` (equal to allocated on the host, which caches nothing).
    pub peak_reserved: u64,
    /// Bytes per category at the peak (they sum to `peak_allocated`).
    pub by_category_at_peak: CategoryBytes,
    /// The peak of each stretch of one phase of one step, in run order (recorded plans only).
    pub phases: Vec<PhasePeak>,
    /// The allocation that reached the peak (recorded plans only).
    pub at_peak: Option<PeakSite>,
    /// False when the run's reserve did not fit the target's capacity (the figures are then
    /// what it would need on an unbounded device).
    pub fits: bool,
    /// Every allocator event of the planned run (recorded plans only).
    pub recording: Option<Recording>,
}

/// A plan's figures without its recording, for `--json`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PlanSummary {
    pub target: String,
    pub fits: bool,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    pub by_category_at_peak: std::collections::BTreeMap<String, u64>,
    pub at_peak: Option<PeakSite>,
    pub phases: Vec<PhasePeak>,
}

impl Plan {
    pub fn summary(&self) -> PlanSummary {
        PlanSummary {
            target: self.target.to_string(),
            fits: self.fits,
            peak_allocated: self.peak_allocated,
            peak_reserved: self.peak_reserved,
            by_category_at_peak: self.by_category_at_peak.to_map(),
            at_peak: self.at_peak.clone(),
            phases: self.phases.clone(),
        }
    }

    /// Refuses the plan when it does not fit what `device` can give now: the host's available
    /// memory, or the GPU capacity the plan simulated. `what` names the run, `hint` what to
    /// change.
    pub fn check_fits(&self, device: Device, what: String, hint: &str) -> Result<()> {
        let (needed, available) = self.need_and_room(device)?;
        if self.fits && needed <= available {
            return Ok(());
        }
        Err(Error::DoesNotFit {
            what,
            device,
            needed,
            available,
            hint: hint.to_string(),
        })
    }

    /// What a device must hold for this plan: its peak reserved (equal to the peak allocated
    /// on the host, which caches nothing).
    pub fn need(&self) -> u64 {
        self.peak_reserved.max(self.peak_allocated)
    }

    /// Whether the plan fits what `device` can give now (see `check_fits`).
    pub fn fits_on(&self, device: Device) -> Result<bool> {
        let (needed, available) = self.need_and_room(device)?;
        Ok(self.fits && needed <= available)
    }

    /// What the device must hold for this plan, and what it has: the host's available memory
    /// against the peak allocated, or the simulated GPU's capacity against the peak reserved.
    fn need_and_room(&self, device: Device) -> Result<(u64, u64)> {
        Ok(match self.target {
            Target::Cpu => (
                self.peak_allocated,
                crate::backend::available_memory(device)?,
            ),
            Target::Cuda { capacity } => (self.need(), capacity),
        })
    }
}

/// How a plan is made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanOptions {
    /// Record the planned run with the memory recorder (process-wide, so only where no other
    /// recording runs): the plan then has its phases, the allocation at the peak, and the
    /// recording for the exports.
    pub record: bool,
}

/// One plan at a time: the meta device's allocator and the recorder are process-wide.
static PLANNING: Mutex<()> = Mutex::new(());

/// Plans `run` for `target`: runs it on `Device::Meta` (it receives the device to build its
/// tensors on) and returns what it needed. Everything `run` allocates must be dropped by the
/// time it returns. On a GPU target whose capacity the run exceeds, the plan is made again on
/// an unbounded device so that it can say what would be needed (`fits` is false).
pub fn plan(
    target: Target,
    options: PlanOptions,
    mut run: impl FnMut(Device) -> Result<()>,
) -> Result<Plan> {
    let _one = PLANNING.lock().unwrap_or_else(|e| e.into_inner());
    let bounded = target.capacity().unwrap_or(u64::MAX);
    match plan_once(target, bounded, options, &mut run) {
        Err(Error::OutOfMemory(_)) if target.capacity().is_some() => {
            let mut p = plan_once(target, UNBOUNDED, options, &mut run)?;
            p.fits = false;
            Ok(p)
        }
        other => other,
    }
}

/// A simulated GPU this large never runs out (2^50 bytes, a petabyte).
const UNBOUNDED: u64 = 1 << 50;

fn plan_once(
    target: Target,
    capacity: u64,
    options: PlanOptions,
    run: &mut dyn FnMut(Device) -> Result<()>,
) -> Result<Plan> {
    memory::install_policy(Device::Meta, target.policy(capacity))?;
    let recording = options.record.then(RecordingGuard::start).transpose()?;
    let outcome = {
        let _scope = plan_as(target.meta_target())?;
        memory::reset_peak_memory_stats(Device::Meta)?;
        // A planned run starts at step 0, whatever step the last run left the recorder at.
        memory::recorder::set_step(0);
        run(Device::Meta)
    };
    let alloc = memory::allocator(Device::Meta)?;
    let (peak_allocated, peak_reserved) =
        (alloc.max_memory_allocated(), alloc.max_memory_reserved());
    let by_category_at_peak = alloc.by_category_at_peak();
    let recording = recording.map(RecordingGuard::stop).transpose()?;
    outcome?;
    if alloc.live_blocks() > 0 {
        return Err(Error::invalid(
            "plan",
            format!(
                "the planned run left {} blocks alive on the meta device; drop its tensors before it returns",
                alloc.live_blocks()
            ),
        ));
    }
    // Later users of the meta device get its default policy back.
    memory::install_policy(Device::Meta, Box::new(HostPolicy::new(u64::MAX)))?;
    let (phases, at_peak) = recording
        .as_ref()
        .map_or((Vec::new(), None), |r| peaks::analyse(r, peak_allocated));
    Ok(Plan {
        target,
        peak_allocated,
        peak_reserved,
        by_category_at_peak,
        phases,
        at_peak,
        fits: true,
        recording,
    })
}

/// The recorder for one plan; stopped on every exit (an error or a panic in the run).
struct RecordingGuard {
    running: bool,
}

impl RecordingGuard {
    fn start() -> Result<RecordingGuard> {
        recorder::start(RecorderConfig::default()).map_err(|_| {
            Error::invalid(
                "plan",
                "the memory recorder is already running; stop it (or finish the --memory-trace) before planning",
            )
        })?;
        Ok(RecordingGuard { running: true })
    }

    fn stop(mut self) -> Result<Recording> {
        self.running = false;
        recorder::stop()
    }
}

impl Drop for RecordingGuard {
    fn drop(&mut self) {
        if self.running {
            let _ = recorder::stop();
        }
    }
}
