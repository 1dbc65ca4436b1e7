//! The context events are labelled with, pushed down by the layers above memory (which this
//! layer may not import): the training step and phase (process-wide, set by the trainer), the
//! module path (per thread, a scope per `forward`) and the call site of the user-facing op
//! (per thread, captured by `#[track_caller]` at the op's entry).
//!
//! Every setter first checks whether a recording is running and does nothing otherwise, so
//! the layers above can call them unconditionally.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::panic::Location;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use super::event::Phase;
use super::{is_recording, mark_phase};

static STEP: AtomicU64 = AtomicU64::new(0);
static PHASE: AtomicU8 = AtomicU8::new(Phase::Other as u8);
/// Watchers other than a recording that want call sites (the leak check names the line that
/// built a leaked graph).
static SITE_WATCHERS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Segments of the current module path (`transformer`, `h.3`, `attn`).
    static PATH: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
    /// Interned id of the joined path (0: none).
    static MODULE: Cell<u32> = const { Cell::new(0) };
    static SITE: Cell<Option<&'static Location<'static>>> = const { Cell::new(None) };
}

/// Module paths by id; id 0 is the empty path.
struct Modules {
    names: Vec<String>,
    ids: HashMap<String, u32>,
}

fn modules() -> &'static Mutex<Modules> {
    static M: OnceLock<Mutex<Modules>> = OnceLock::new();
    M.get_or_init(|| {
        Mutex::new(Modules {
            names: vec![String::new()],
            ids: HashMap::new(),
        })
    })
}

fn intern(path: &str) -> u32 {
    let mut m = modules().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&id) = m.ids.get(path) {
        return id;
    }
    let id = m.names.len() as u32;
    m.names.push(path.to_string());
    m.ids.insert(path.to_string(), id);
    id
}

/// Every interned module path, indexed by id.
pub(super) fn module_names() -> Vec<String> {
    modules()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .names
        .clone()
}

/// Sets the training step that following events belong to.
pub fn set_step(step: u64) {
    STEP.store(step, Ordering::Relaxed);
}

pub(super) fn step() -> u64 {
    STEP.load(Ordering::Relaxed)
}

pub(super) fn phase() -> Phase {
    Phase::from_u8(PHASE.load(Ordering::Relaxed))
}

pub(super) fn module() -> u32 {
    MODULE.with(Cell::get)
}

pub(super) fn site() -> Option<&'static Location<'static>> {
    SITE.with(Cell::get)
}

/// The line of user code whose op is running, while a recording or a site watcher is on.
pub fn current_site() -> Option<&'static Location<'static>> {
    SITE.with(Cell::get)
}

/// Captures call sites even when no recording runs, until `unwatch_sites` (nested calls count).
pub fn watch_sites() {
    SITE_WATCHERS.fetch_add(1, Ordering::Relaxed);
}

/// Ends one `watch_sites`.
pub fn unwatch_sites() {
    SITE_WATCHERS.fetch_sub(1, Ordering::Relaxed);
}

fn sites_wanted() -> bool {
    is_recording() || SITE_WATCHERS.load(Ordering::Relaxed) > 0
}

/// The phase until the guard drops, then the one before it. Kept even when no recording
/// runs, so a recording started mid-phase knows where it is.
#[must_use = "the phase ends when the guard drops"]
pub struct PhaseScope {
    previous: Phase,
}

/// Enters `phase` until the returned guard drops.
pub fn phase_scope(phase: Phase) -> PhaseScope {
    let previous = Phase::from_u8(PHASE.swap(phase as u8, Ordering::Relaxed));
    if previous != phase && is_recording() {
        mark_phase(phase);
    }
    PhaseScope { previous }
}

impl Drop for PhaseScope {
    fn drop(&mut self) {
        let current = Phase::from_u8(PHASE.swap(self.previous as u8, Ordering::Relaxed));
        if current != self.previous && is_recording() {
            mark_phase(self.previous);
        }
    }
}

/// A module's forward: its name is appended to the thread's module path until the guard
/// drops. Nothing happens (not even formatting the name) while no recording runs.
#[must_use = "the module scope ends when the guard drops"]
pub struct ModuleScope {
    pushed: Option<u32>,
}

/// Enters the child module `name` (a path segment such as `attn` or `transformer.wte`).
pub fn module_scope(name: &str) -> ModuleScope {
    if !is_recording() {
        return ModuleScope { pushed: None };
    }
    push_module(name)
}

/// Enters the child `prefix.index` (`transformer.h.3`; just the index for an empty prefix,
/// as a `Sequential`'s children are named), formatting it only while recording.
pub fn module_scope_indexed(prefix: &str, index: usize) -> ModuleScope {
    if !is_recording() {
        return ModuleScope { pushed: None };
    }
    if prefix.is_empty() {
        push_module(&index.to_string())
    } else {
        push_module(&format!("{prefix}.{index}"))
    }
}

fn push_module(name: &str) -> ModuleScope {
    let id = PATH.with(|p| {
        let mut p = p.borrow_mut();
        p.push(name.to_string());
        intern(&p.join("."))
    });
    let previous = MODULE.with(|m| m.replace(id));
    ModuleScope {
        pushed: Some(previous),
    }
}

impl Drop for ModuleScope {
    fn drop(&mut self) {
        if let Some(previous) = self.pushed {
            PATH.with(|p| p.borrow_mut().pop());
            MODULE.with(|m| m.set(previous));
        }
    }
}

/// The line of user code that called a public op. The outermost op wins: an op built from
/// other ops (linear from matmul) reports its own caller, not its inner calls.
#[must_use = "the call site is cleared when the guard drops"]
pub struct CallSite {
    set: bool,
}

impl CallSite {
    /// Captures the caller of the `#[track_caller]` op this is called from.
    #[track_caller]
    #[inline]
    pub fn enter() -> CallSite {
        if !sites_wanted() {
            return CallSite { set: false };
        }
        let caller = Location::caller();
        let set = SITE.with(|s| {
            if s.get().is_some() {
                return false;
            }
            s.set(Some(caller));
            true
        });
        CallSite { set }
    }
}

impl Drop for CallSite {
    fn drop(&mut self) {
        if self.set {
            SITE.with(|s| s.set(None));
        }
    }
}
