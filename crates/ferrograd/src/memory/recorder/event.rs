//! What the recorder remembers: one `Event` per allocator action (allocation, free, segment
//! reserve/release, out-of-memory, a block changing category) and one per phase change, each
//! with the context that was current when it happened.

use std::panic::Location;

use crate::base::{Category, Device};

/// The part of a training step that was running.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    Forward,
    Backward,
    Optimizer,
    Evaluation,
    Other,
}

impl Phase {
    pub const ALL: [Phase; 5] = [
        Phase::Forward,
        Phase::Backward,
        Phase::Optimizer,
        Phase::Evaluation,
        Phase::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
            Phase::Evaluation => "evaluation",
            Phase::Other => "other",
        }
    }

    pub(super) fn from_u8(v: u8) -> Phase {
        Phase::ALL.get(v as usize).copied().unwrap_or(Phase::Other)
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// A block was handed out (PyTorch's `alloc`).
    Alloc,
    /// A block was returned (PyTorch's `free_requested` + `free_completed`: one stream, so
    /// both happen at once).
    Free,
    /// The allocator reserved a segment from the device (`segment_alloc`).
    SegmentAlloc,
    /// The allocator gave a segment back to the device (`segment_free`).
    SegmentFree,
    /// A request failed; `size` is the requested size, `device_free` what the device had free.
    Oom { device_free: u64 },
    /// A live block changed category (e.g. a temporary saved by the graph); `category` is
    /// the new one.
    Relabel { from: Category },
    /// The phase changed to this one (no bytes move).
    Phase(Phase),
}

impl Action {
    /// The name PyTorch's snapshot uses, where it has one.
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::Free => "free",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::Oom { .. } => "oom",
            Action::Relabel { .. } => "relabel",
            Action::Phase(_) => "phase",
        }
    }
}

/// Where a block came from: the op that asked for it, the module whose forward was running,
/// and the line of user code that called the op. A free carries its block's origin (as
/// PyTorch's free entries carry the allocation's stack).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Origin {
    pub op: &'static str,
    /// Interned module path (`Recording::module_name`); 0 is "no module".
    pub module: u32,
    pub site: Option<&'static Location<'static>>,
}

impl Origin {
    pub const NONE: Origin = Origin {
        op: "",
        module: 0,
        site: None,
    };
}

/// One recorded event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub action: Action,
    pub device: Device,
    /// Nanoseconds since recording started.
    pub time_ns: u64,
    /// Block or segment address (0 for phase marks and OOMs).
    pub addr: u64,
    /// Rounded block size, segment size, or (OOM) the requested size.
    pub size: u64,
    /// The caller's unrounded size (blocks only).
    pub requested: u64,
    pub stream: u64,
    pub category: Category,
    pub origin: Origin,
    pub phase: Phase,
    pub step: u64,
}
