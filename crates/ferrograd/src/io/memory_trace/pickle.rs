//! PyTorch's memory-snapshot pickle (`torch.cuda.memory._dump_snapshot`), the file that
//! pytorch.org/memory_viz and `python -m torch.cuda._memory_viz` open: `segments` with their
//! blocks as the recording ended, and `device_traces` with one entry per event.
//!
//! Written by `serde-pickle` in protocol 2, whose opcodes are all within the subset the
//! viewer's own unpickler reads. Each entry carries one frame naming the op, the module path,
//! the phase and step, at the op's call site, and a `category` so the page colours by it.
//! The page throws when categories are present but none is `unknown` (a typo in its code,
//! `snapshot.categores`), so the trace opens with a `snapshot` entry of category `unknown`.
//! Integers are written as i64: serde-pickle writes a u64 of 2^31 or more as a 9-byte LONG1,
//! which the viewer's unpickler refuses ("bigger than 8 bytes"); an i64 takes 8.

use std::collections::HashMap;

use serde::Serialize;

use crate::base::{Category, Device, Error, Result};
use crate::memory::Pool;
use crate::memory::recorder::{Action, Event, Origin, Recording, SnapshotBlock};

#[derive(Serialize)]
struct Snapshot {
    segments: Vec<Segment>,
    device_traces: Vec<Vec<TraceEntry>>,
}

#[derive(Serialize)]
struct Segment {
    device: i64,
    address: i64,
    total_size: i64,
    allocated_size: i64,
    active_size: i64,
    requested_size: i64,
    stream: i64,
    segment_type: &'static str,
    segment_pool_id: (i64, i64),
    is_expandable: bool,
    frames: Vec<Frame>,
    blocks: Vec<Block>,
}

#[derive(Serialize)]
struct Block {
    address: i64,
    size: i64,
    requested_size: i64,
    state: &'static str,
    frames: Vec<Frame>,
}

#[derive(Serialize)]
struct Frame {
    filename: String,
    line: u32,
    name: String,
}

#[derive(Serialize)]
struct TraceEntry {
    action: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    addr: Option<i64>,
    /// The CUDA free bytes of an `oom` entry (which has no `addr`).
    #[serde(skip_serializing_if = "Option::is_none")]
    device_free: Option<i64>,
    size: i64,
    stream: i64,
    time_us: i64,
    frames: Vec<Frame>,
    category: &'static str,
}

/// The device index PyTorch would give `device` (the host is shown as device 0).
fn device_index(device: Device) -> i64 {
    match device {
        Device::Cuda(i) => int(i as u64),
        Device::Cpu | Device::Meta => 0,
    }
}

/// A byte count or address as the pickle's integer (no real one reaches 2^63).
fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The pickle of `device`'s part of `rec` (a valid snapshot with no segments and an empty
/// trace when nothing was recorded).
pub fn snapshot_pickle(rec: &Recording, device: Device) -> Result<Vec<u8>> {
    let index = device_index(device);
    let snapshot = Snapshot {
        segments: segments(rec, device, index),
        device_traces: {
            let mut traces: Vec<Vec<TraceEntry>> = (0..index).map(|_| Vec::new()).collect();
            traces.push(trace(rec, device));
            traces
        },
    };
    serde_pickle::to_vec(&snapshot, serde_pickle::SerOptions::new().proto_v2()).map_err(|e| {
        Error::invalid(
            "memory snapshot",
            format!("cannot encode the snapshot: {e}"),
        )
    })
}

fn frame(rec: &Recording, origin: &Origin, label: &str) -> Vec<Frame> {
    if origin.op.is_empty() {
        return Vec::new();
    }
    let module = rec.module_name(origin.module);
    let mut name = origin.op.to_string();
    if !module.is_empty() {
        name += &format!(" in {module}");
    }
    if !label.is_empty() {
        name += &format!(" ({label})");
    }
    let (filename, line) = origin.site.map_or(("ferrograd".to_string(), 0), |l| {
        (l.file().to_string(), l.line())
    });
    vec![Frame {
        filename,
        line,
        name,
    }]
}

fn segments(rec: &Recording, device: Device, index: i64) -> Vec<Segment> {
    rec.segments_of(device)
        .map(|s| {
            let allocated = || s.blocks.iter().filter(|b| b.owner.is_some());
            let allocated_size = int(allocated().map(|b| b.size).sum());
            Segment {
                device: index,
                address: int(s.addr),
                total_size: int(s.size),
                allocated_size,
                active_size: allocated_size,
                requested_size: int(allocated().map(|b| b.requested).sum()),
                stream: int(s.stream),
                segment_type: match s.pool {
                    Pool::Small => "small",
                    Pool::Large => "large",
                },
                segment_pool_id: (0, 0),
                is_expandable: false,
                frames: Vec::new(),
                blocks: s.blocks.iter().map(|b| block(rec, b)).collect(),
            }
        })
        .collect()
}

fn block(rec: &Recording, b: &SnapshotBlock) -> Block {
    Block {
        address: int(b.addr),
        size: int(b.size),
        requested_size: int(b.requested),
        state: if b.owner.is_some() {
            "active_allocated"
        } else {
            "inactive"
        },
        frames: b
            .owner
            .map(|(c, o)| frame(rec, &o, c.name()))
            .unwrap_or_default(),
    }
}

/// The role each block played, by the index of its `Alloc` event: its last category other
/// than temporary (an activation the graph saved counts as a saved activation for its whole
/// life, although backward hands it back as a temporary before it is freed), else temporary.
fn block_roles(rec: &Recording, events: &[&Event], device: Device) -> HashMap<usize, Category> {
    let role = |c: Category| (c != Category::Temporary).then_some(c);
    let mut by_addr: HashMap<u64, Option<Category>> = rec
        .segments_of(device)
        .flat_map(|s| s.blocks.iter())
        .filter_map(|b| b.owner.map(|(c, _)| (b.addr, role(c))))
        .collect();
    let mut out = HashMap::new();
    for (i, e) in events.iter().enumerate().rev() {
        match e.action {
            Action::Free => {
                by_addr.insert(e.addr, role(e.category));
            }
            Action::Relabel { from } => {
                let r = by_addr.entry(e.addr).or_insert(None);
                *r = r.or(role(e.category)).or(role(from));
            }
            Action::Alloc => {
                let r = by_addr.remove(&e.addr).flatten();
                out.insert(i, r.or(role(e.category)).unwrap_or(e.category));
            }
            _ => {}
        }
    }
    out
}

fn trace(rec: &Recording, device: Device) -> Vec<TraceEntry> {
    let events: Vec<&Event> = rec.events_of(device).collect();
    if events.iter().all(|e| matches!(e.action, Action::Phase(_))) {
        return Vec::new();
    }
    let categories = block_roles(rec, &events, device);
    let time_us = |e: &Event| int(rec.started_unix_us + e.time_ns / 1000);
    let mut out = vec![TraceEntry {
        action: "snapshot",
        addr: Some(0),
        device_free: None,
        size: 0,
        stream: 0,
        time_us: int(rec.started_unix_us),
        frames: Vec::new(),
        category: "unknown",
    }];
    for (i, e) in events.iter().enumerate() {
        let segment = matches!(e.action, Action::SegmentAlloc | Action::SegmentFree);
        let category = categories.get(&i).copied().unwrap_or(e.category);
        let when = format!("{} step {}", e.phase, e.step);
        let (label, category) = if segment {
            // A segment has no category of its own; its frame names the block it was for.
            (when, "unknown")
        } else {
            (format!("{}, {when}", category.name()), category.name())
        };
        let entry = |action, size: u64| TraceEntry {
            action,
            addr: Some(int(e.addr)),
            device_free: None,
            size: int(size),
            stream: int(e.stream),
            time_us: time_us(e),
            frames: frame(rec, &e.origin, &label),
            category,
        };
        match e.action {
            Action::Alloc => out.push(entry("alloc", e.requested)),
            Action::Free => {
                out.push(entry("free_requested", e.requested));
                out.push(entry("free_completed", e.requested));
            }
            Action::SegmentAlloc => out.push(entry("segment_alloc", e.size)),
            Action::SegmentFree => out.push(entry("segment_free", e.size)),
            Action::Oom { device_free } => out.push(TraceEntry {
                addr: None,
                device_free: Some(int(device_free)),
                ..entry("oom", e.size)
            }),
            Action::Relabel { .. } | Action::Phase(_) => {}
        }
    }
    out
}
