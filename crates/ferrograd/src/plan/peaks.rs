//! Reading a plan's recording: the allocated bytes replayed event by event, giving the peak of
//! each phase of each step and the allocation that reached the run's peak.

use serde::Serialize;

use crate::base::Device;
use crate::memory::recorder::{Action, Phase, Recording};

/// The highest `memory_allocated` during one stretch of a phase.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PhasePeak {
    pub step: u64,
    pub phase: String,
    pub peak: u64,
}

/// The allocation that brought `memory_allocated` to the run's peak.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PeakSite {
    /// The op that asked for the block.
    pub op: String,
    /// The module whose forward (or backward) was running ("" outside any module).
    pub module: String,
    pub phase: String,
    pub step: u64,
    pub category: String,
    /// The block's bytes (rounded as the allocator counts them).
    pub bytes: u64,
    /// The line of code that called the op, when known.
    pub site: Option<String>,
}

/// Replays the meta device's allocations and frees. `peak` is the allocator's own maximum;
/// the site is the first allocation whose total reaches it.
pub(super) fn analyse(rec: &Recording, peak: u64) -> (Vec<PhasePeak>, Option<PeakSite>) {
    let mut phases: Vec<PhasePeak> = Vec::new();
    let mut at_peak = None;
    let mut live: u64 = 0;
    for e in rec.events_of(Device::Meta) {
        match e.action {
            Action::Alloc => live += e.size,
            Action::Free => live = live.saturating_sub(e.size),
            _ => continue,
        }
        // "other" is the glue between phases (a loss scaled, a graph torn down): it belongs to
        // the phase it follows.
        let phase = match (e.phase, phases.last()) {
            (Phase::Other, Some(p)) if p.step == e.step => p.phase.clone(),
            // Before any phase: the model, its optimizer and the inputs being built.
            (Phase::Other, None) => "setup".to_string(),
            _ => e.phase.name().to_string(),
        };
        match phases.last_mut() {
            Some(p) if p.step == e.step && p.phase == phase => p.peak = p.peak.max(live),
            _ => phases.push(PhasePeak {
                step: e.step,
                phase: phase.clone(),
                peak: live,
            }),
        }
        if at_peak.is_none() && e.action == Action::Alloc && live >= peak {
            at_peak = Some(PeakSite {
                op: e.origin.op.to_string(),
                module: rec.module_name(e.origin.module).to_string(),
                phase,
                step: e.step,
                category: e.category.to_string(),
                bytes: e.size,
                site: e.origin.site.map(|s| format!("{}:{}", s.file(), s.line())),
            });
        }
    }
    (phases, at_peak)
}
