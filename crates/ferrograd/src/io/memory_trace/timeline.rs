//! Memory over time, replayed from a `Recording`: bytes per category and reserved bytes after
//! every event, the phases as spans, and the peak with the blocks alive at that moment.
//!
//! The replay starts from the end: the recording's final segments are the state after the
//! last event, and undoing the events one by one gives the state before the first kept one.
//! That is exact even when the ring wrapped and the oldest events are gone.

use std::collections::HashMap;

use crate::base::{Category, CategoryBytes, Device};
use crate::memory::recorder::{Action, Event, Origin, Phase, Recording};

/// A live block during the replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveBlock {
    pub addr: u64,
    pub size: u64,
    pub requested: u64,
    pub category: Category,
    pub origin: Origin,
}

/// Memory after one event (or at the start).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    pub time_ns: u64,
    pub by_category: CategoryBytes,
    pub reserved: u64,
}

impl Sample {
    pub fn allocated(&self) -> u64 {
        self.by_category.total()
    }
}

/// A stretch of one phase of one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PhaseSpan {
    pub phase: Phase,
    pub step: u64,
    pub start_ns: u64,
    pub end_ns: u64,
}

/// The highest allocated memory of the recording and what made it up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peak {
    pub sample: Sample,
    /// The largest blocks alive at the peak, largest first (at most `PEAK_BLOCKS`).
    pub largest: Vec<LiveBlock>,
}

/// How many of the peak's blocks are listed.
pub const PEAK_BLOCKS: usize = 10;

pub struct Timeline {
    pub device: Device,
    /// The state before the first kept event, then one sample per event that moves bytes.
    pub samples: Vec<Sample>,
    pub phases: Vec<PhaseSpan>,
    pub peak: Peak,
    pub duration_ns: u64,
}

#[derive(Clone, Default)]
struct State {
    live: HashMap<u64, LiveBlock>,
    reserved: u64,
}

impl State {
    fn by_category(&self) -> CategoryBytes {
        let mut c = CategoryBytes::default();
        for b in self.live.values() {
            c.add(b.category, b.size);
        }
        c
    }

    fn apply(&mut self, e: &Event) {
        match e.action {
            Action::Alloc => {
                self.live.insert(e.addr, block_of(e));
            }
            Action::Free => {
                self.live.remove(&e.addr);
            }
            Action::Relabel { .. } => {
                if let Some(b) = self.live.get_mut(&e.addr) {
                    b.category = e.category;
                }
            }
            Action::SegmentAlloc => self.reserved += e.size,
            Action::SegmentFree => self.reserved = self.reserved.saturating_sub(e.size),
            Action::Oom { .. } | Action::Phase(_) => {}
        }
    }

    fn undo(&mut self, e: &Event) {
        match e.action {
            Action::Alloc => {
                self.live.remove(&e.addr);
            }
            Action::Free => {
                self.live.insert(e.addr, block_of(e));
            }
            Action::Relabel { from } => {
                if let Some(b) = self.live.get_mut(&e.addr) {
                    b.category = from;
                }
            }
            Action::SegmentAlloc => self.reserved = self.reserved.saturating_sub(e.size),
            Action::SegmentFree => self.reserved += e.size,
            Action::Oom { .. } | Action::Phase(_) => {}
        }
    }
}

fn block_of(e: &Event) -> LiveBlock {
    LiveBlock {
        addr: e.addr,
        size: e.size,
        requested: e.requested,
        category: e.category,
        origin: e.origin,
    }
}

fn moves_bytes(e: &Event) -> bool {
    !matches!(e.action, Action::Oom { .. } | Action::Phase(_))
}

/// The state of `device` when the recording stopped.
fn final_state(rec: &Recording, device: Device) -> State {
    let mut st = State::default();
    for seg in rec.segments_of(device) {
        st.reserved += seg.size;
        for b in &seg.blocks {
            if let Some((category, origin)) = b.owner {
                st.live.insert(
                    b.addr,
                    LiveBlock {
                        addr: b.addr,
                        size: b.size,
                        requested: b.requested,
                        category,
                        origin,
                    },
                );
            }
        }
    }
    st
}

/// Replays `device`'s part of `rec`.
pub fn timeline(rec: &Recording, device: Device) -> Timeline {
    let events: Vec<&Event> = rec.events_of(device).collect();
    let mut st = final_state(rec, device);
    for e in events.iter().rev() {
        st.undo(e);
    }
    let start = st.clone();
    let sample = |st: &State, time_ns| Sample {
        time_ns,
        by_category: st.by_category(),
        reserved: st.reserved,
    };
    let mut samples = vec![sample(&st, events.first().map_or(0, |e| e.time_ns))];
    // (allocated bytes, events applied) at the highest sample so far.
    let mut best = (samples[0].allocated(), 0);
    for (i, e) in events.iter().enumerate() {
        if !moves_bytes(e) {
            continue;
        }
        st.apply(e);
        let s = sample(&st, e.time_ns);
        if s.allocated() > best.0 {
            best = (s.allocated(), i + 1);
        }
        samples.push(s);
    }
    let peak = peak_of(start, &events[..best.1]);
    Timeline {
        device,
        phases: phase_spans(&events, rec.duration_ns),
        samples,
        peak,
        duration_ns: rec.duration_ns,
    }
}

/// The state after the first `events`, with its largest blocks.
fn peak_of(mut st: State, events: &[&Event]) -> Peak {
    for e in events {
        st.apply(e);
    }
    let mut largest: Vec<LiveBlock> = st.live.values().copied().collect();
    largest.sort_by_key(|b| (std::cmp::Reverse(b.size), b.addr));
    largest.truncate(PEAK_BLOCKS);
    Peak {
        sample: Sample {
            time_ns: events.last().map_or(0, |e| e.time_ns),
            by_category: st.by_category(),
            reserved: st.reserved,
        },
        largest,
    }
}

/// Phase spans from the phase marks; before the first mark, the first event's phase.
fn phase_spans(events: &[&Event], end_ns: u64) -> Vec<PhaseSpan> {
    let mut marks: Vec<(Phase, u64, u64)> = Vec::new();
    if let Some(first) = events.first()
        && !matches!(first.action, Action::Phase(_))
    {
        marks.push((first.phase, first.step, first.time_ns));
    }
    for e in events {
        if let Action::Phase(p) = e.action {
            marks.push((p, e.step, e.time_ns));
        }
    }
    let mut spans = Vec::new();
    for (i, &(phase, step, start_ns)) in marks.iter().enumerate() {
        let end_ns = marks.get(i + 1).map_or(end_ns, |m| m.2).max(start_ns);
        if end_ns > start_ns || i + 1 == marks.len() {
            spans.push(PhaseSpan {
                phase,
                step,
                start_ns,
                end_ns,
            });
        }
    }
    spans
}
