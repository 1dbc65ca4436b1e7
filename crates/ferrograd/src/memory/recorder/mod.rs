//! The memory recorder: a bounded history of every allocator action, for looking at memory
//! over time (the exports in `io::memory_trace` turn a `Recording` into PyTorch's
//! memory-snapshot pickle, a Chrome/Perfetto trace and an HTML report).
//!
//! Off by default. While off, the allocation path pays one relaxed atomic load
//! (`is_recording`). While on, each allocation, free, segment reserve/release, OOM and
//! category change appends an `Event` to a ring buffer of `RecorderConfig::capacity` events
//! (default `DEFAULT_CAPACITY`: 2^18 events of 120 bytes, 30 MiB); when it is full the oldest
//! events are overwritten and counted, and the `Recording` says how many were dropped.
//!
//! Events carry the context the layers above push down (`set_step`, `phase_scope`,
//! `module_scope`, `CallSite::enter`): this layer imports nothing above `base`.

mod context;
mod event;
mod ring;

pub use context::{
    CallSite, ModuleScope, PhaseScope, current_site, module_scope, module_scope_indexed,
    phase_scope, set_step, unwatch_sites, watch_sites,
};
pub use event::{Action, Event, Origin, Phase};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::stats::Pool;
use crate::base::{Category, Device, Error, Result};
use ring::Ring;

/// Events kept by default: 2^18, each `size_of::<Event>()` (120) bytes: 30 MiB when full.
pub const DEFAULT_CAPACITY: usize = 1 << 18;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecorderConfig {
    /// Most events kept; older ones are overwritten.
    pub capacity: usize,
}

impl Default for RecorderConfig {
    fn default() -> Self {
        RecorderConfig {
            capacity: DEFAULT_CAPACITY,
        }
    }
}

static RECORDING: AtomicBool = AtomicBool::new(false);

struct State {
    ring: Ring<Event>,
    started: Instant,
    started_unix_us: u64,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn state() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether a recording is running: the one check on the allocation path.
#[inline]
pub fn is_recording() -> bool {
    RECORDING.load(Ordering::Relaxed)
}

/// Starts recording (an error if one is already running).
pub fn start(config: RecorderConfig) -> Result<()> {
    if config.capacity == 0 {
        return Err(Error::invalid(
            "memory recorder",
            "a capacity of 0 events keeps nothing; give at least 1",
        ));
    }
    let mut st = state();
    if st.is_some() {
        return Err(Error::invalid(
            "memory recorder",
            "a recording is already running; stop it first",
        ));
    }
    let started_unix_us = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    *st = Some(State {
        ring: Ring::new(config.capacity),
        started: Instant::now(),
        started_unix_us,
    });
    drop(st);
    RECORDING.store(true, Ordering::Relaxed);
    mark_phase(context::phase());
    Ok(())
}

/// Stops recording and returns what was kept, with every device's segments as they are now
/// (the state after the last event). An error if no recording runs.
pub fn stop() -> Result<Recording> {
    RECORDING.store(false, Ordering::Relaxed);
    let Some(st) = state().take() else {
        return Err(Error::invalid(
            "memory recorder",
            "no recording is running; start one first",
        ));
    };
    let duration_ns = st.started.elapsed().as_nanos() as u64;
    let (capacity, dropped) = (st.ring.capacity(), st.ring.dropped());
    Ok(Recording {
        capacity,
        dropped,
        started_unix_us: st.started_unix_us,
        duration_ns,
        events: st.ring.into_vec(),
        segments: super::all_segments(),
        modules: context::module_names(),
    })
}

/// The origin of a block allocated now by `op`.
pub(super) fn current_origin(op: &'static str) -> Origin {
    Origin {
        op,
        module: context::module(),
        site: context::site(),
    }
}

/// What the allocator passes for one event; time, phase and step are added here.
pub(super) struct Record {
    pub action: Action,
    pub device: Device,
    pub addr: u64,
    pub size: u64,
    pub requested: u64,
    pub stream: u64,
    pub category: Category,
    pub origin: Origin,
}

pub(super) fn record(r: Record) {
    let mut st = state();
    let Some(st) = st.as_mut() else {
        return;
    };
    st.ring.push(Event {
        action: r.action,
        device: r.device,
        time_ns: st.started.elapsed().as_nanos() as u64,
        addr: r.addr,
        size: r.size,
        requested: r.requested,
        stream: r.stream,
        category: r.category,
        origin: r.origin,
        phase: context::phase(),
        step: context::step(),
    });
}

fn mark_phase(phase: Phase) {
    record(Record {
        action: Action::Phase(phase),
        device: Device::Cpu,
        addr: 0,
        size: 0,
        requested: 0,
        stream: 0,
        category: Category::Temporary,
        origin: Origin::NONE,
    });
}

/// A block of a segment, as the allocator holds it when the recording stops.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotBlock {
    pub addr: u64,
    pub size: u64,
    /// The caller's size (0 for a free block).
    pub requested: u64,
    /// Category and origin of an allocated block; None for a free (cached) one.
    pub owner: Option<(Category, Origin)>,
}

/// A reserved segment and the blocks that tile it, in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotSegment {
    pub device: Device,
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    pub pool: Pool,
    pub blocks: Vec<SnapshotBlock>,
}

/// What a recording kept.
#[derive(Clone, Debug, Default)]
pub struct Recording {
    /// The ring's capacity in events.
    pub capacity: usize,
    /// Events overwritten because the ring was full (the oldest ones).
    pub dropped: u64,
    /// When the recording started, in microseconds since the Unix epoch.
    pub started_unix_us: u64,
    pub duration_ns: u64,
    /// The kept events, oldest first.
    pub events: Vec<Event>,
    /// Every device's segments when the recording stopped.
    pub segments: Vec<SnapshotSegment>,
    /// Module paths by the ids in `Origin::module`.
    pub modules: Vec<String>,
}

impl Recording {
    /// Whether the ring filled up and lost its oldest events.
    pub fn wrapped(&self) -> bool {
        self.dropped > 0
    }

    /// The module path of an `Origin::module` id ("" for none or an unknown id).
    pub fn module_name(&self, id: u32) -> &str {
        self.modules.get(id as usize).map_or("", String::as_str)
    }

    /// One line: how many events were kept, and whether (and how much) the ring wrapped.
    pub fn summary(&self) -> String {
        let kept = format!(
            "{} events kept (capacity {})",
            self.events.len(),
            self.capacity
        );
        if self.wrapped() {
            format!(
                "{kept}; the ring wrapped and dropped the {} oldest events: record fewer steps or raise the capacity",
                self.dropped
            )
        } else {
            format!("{kept}; nothing was dropped")
        }
    }

    /// The events of `device`, with the phase marks (which belong to every device).
    pub fn events_of(&self, device: Device) -> impl Iterator<Item = &Event> + '_ {
        self.events
            .iter()
            .filter(move |e| e.device == device || matches!(e.action, Action::Phase(_)))
    }

    /// The segments of `device`.
    pub fn segments_of(&self, device: Device) -> impl Iterator<Item = &SnapshotSegment> + '_ {
        self.segments.iter().filter(move |s| s.device == device)
    }
}
