//! A Chrome/Perfetto trace (the Trace Event Format's JSON): one counter track per category
//! plus allocated and reserved bytes, and the phases as slices on a thread of their own, so
//! memory lines up with forward, backward and optimizer in chrome://tracing or Perfetto.
//!
//! Perfetto makes one track per key of a counter event's `args` ("memory parameter", ...);
//! chrome://tracing stacks the keys of one counter, so the categories are one counter and the
//! totals another.

use serde_json::{Value, json};

use super::timeline::Timeline;
use crate::base::Category;

const PID: u32 = 1;
/// The thread the phase slices live on.
const PHASE_TID: u32 = 1;

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

/// The trace of one device's timeline.
pub fn chrome_trace(t: &Timeline) -> Value {
    let mut events = vec![
        json!({"name": "process_name", "ph": "M", "pid": PID,
               "args": {"name": format!("ferrograd {}", t.device)}}),
        json!({"name": "thread_name", "ph": "M", "pid": PID, "tid": PHASE_TID,
               "args": {"name": "phases"}}),
    ];
    for s in &t.samples {
        let by_category: serde_json::Map<String, Value> = Category::ALL
            .iter()
            .map(|&c| (c.name().to_string(), json!(s.by_category.get(c))))
            .collect();
        events.push(
            json!({"name": "memory", "ph": "C", "ts": us(s.time_ns), "pid": PID,
                           "args": by_category}),
        );
        events.push(
            json!({"name": "totals", "ph": "C", "ts": us(s.time_ns), "pid": PID,
                           "args": {"allocated": s.allocated(), "reserved": s.reserved}}),
        );
    }
    for p in &t.phases {
        events.push(json!({"name": p.phase.name(), "cat": "phase", "ph": "X",
                           "ts": us(p.start_ns), "dur": us(p.end_ns - p.start_ns),
                           "pid": PID, "tid": PHASE_TID, "args": {"step": p.step}}));
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms"})
}
