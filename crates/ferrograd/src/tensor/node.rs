//! Graph nodes. A non-leaf tensor owns the node that made it (`grad_fn`); a node owns its
//! backward closure (with the saved tensors) and edges to the nodes or leaves of its inputs.
//! The graph is therefore the tensors themselves: dropping the last output frees it.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::meta::{AutogradMeta, TensorHook};
use super::{DType, Tensor};
use crate::base::Result;

/// A node's backward: given the gradient of its output and which inputs need a gradient,
/// returns one optional gradient per input.
pub type BackwardFn = Box<dyn FnMut(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send>;

/// Where an input's gradient goes.
#[derive(Clone)]
pub enum Edge {
    Node(Arc<Node>),
    /// A leaf that requires grad: its gradient accumulates into `.grad`.
    Leaf(Arc<AutogradMeta>),
}

impl Edge {
    /// Identity for the engine's tables.
    pub(crate) fn key(&self) -> usize {
        match self {
            Edge::Node(n) => Arc::as_ptr(n) as usize,
            Edge::Leaf(m) => Arc::as_ptr(m) as usize,
        }
    }
}

/// Shape and dtype of an input, to check the gradients a backward returns for it.
pub(crate) struct InputMeta {
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
}

pub struct Node {
    /// Creation order; the engine runs later nodes first (as PyTorch's sequence_nr).
    pub(crate) seq: u64,
    pub(crate) name: &'static str,
    pub(crate) backward: Mutex<Option<BackwardFn>>,
    pub(crate) edges: Vec<Option<Edge>>,
    pub(crate) inputs: Vec<InputMeta>,
    /// The output tensor's meta, for retain_grad.
    pub(crate) output: Mutex<Weak<AutogradMeta>>,
    /// Hooks registered on the output tensor. They live here, not on the tensor, so they
    /// still run after the tensor itself was dropped (as PyTorch keeps them on grad_fn).
    pub(crate) hooks: Mutex<Vec<TensorHook>>,
    /// Buffers the backward reads, with their versions when saved.
    pub(crate) saved: Vec<super::saved::SavedVersion>,
    /// The training step it was recorded in, while a leak check counts steps (else 0).
    pub(crate) step: u64,
    /// Set when a backward ran through it with retain_graph (its saved tensors stay).
    pub(crate) retained: AtomicBool,
    /// The line of user code that called the op, while a leak check tracks nodes.
    pub(crate) site: Option<&'static std::panic::Location<'static>>,
}

static NEXT_SEQ: AtomicU64 = AtomicU64::new(1);

/// Live-node tracking for the leak check. Off unless a check is active: then one relaxed
/// load per recorded node decides, and nothing else is paid.
static TRACKERS: AtomicUsize = AtomicUsize::new(0);
/// The step being recorded, as the active leak check counts them.
static STEP: AtomicU64 = AtomicU64::new(0);
static LIVE: Mutex<Vec<Weak<Node>>> = Mutex::new(Vec::new());

/// Starts (or, nested, keeps) tracking the nodes recorded from now on.
pub(crate) fn start_tracking() {
    TRACKERS.fetch_add(1, Ordering::Relaxed);
    crate::memory::recorder::watch_sites();
}

/// Stops tracking when the last check ends, forgetting the tracked nodes.
pub(crate) fn stop_tracking() {
    crate::memory::recorder::unwatch_sites();
    if TRACKERS.fetch_sub(1, Ordering::Relaxed) == 1 {
        LIVE.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// Sets the step that nodes recorded from now on belong to.
pub(crate) fn set_tracking_step(step: u64) {
    STEP.store(step, Ordering::Relaxed);
}

/// Registers a newly recorded node when tracking is on.
pub(crate) fn track(node: &Arc<Node>) {
    if TRACKERS.load(Ordering::Relaxed) > 0 {
        LIVE.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::downgrade(node));
    }
}

/// The tracked nodes still alive (dead entries are dropped from the table).
pub(crate) fn live_nodes() -> Vec<Arc<Node>> {
    let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    live.retain(|w| w.strong_count() > 0);
    live.iter().filter_map(Weak::upgrade).collect()
}

pub(crate) fn next_seq() -> u64 {
    NEXT_SEQ.fetch_add(1, Ordering::Relaxed)
}

impl Node {
    pub(crate) fn new(
        name: &'static str,
        edges: Vec<Option<Edge>>,
        inputs: Vec<InputMeta>,
        backward: BackwardFn,
        saved: Vec<super::saved::SavedVersion>,
    ) -> Node {
        let tracking = TRACKERS.load(Ordering::Relaxed) > 0;
        Node {
            seq: next_seq(),
            name,
            backward: Mutex::new(Some(backward)),
            edges,
            inputs,
            output: Mutex::new(Weak::new()),
            saved,
            hooks: Mutex::new(Vec::new()),
            step: if tracking {
                STEP.load(Ordering::Relaxed)
            } else {
                0
            },
            retained: AtomicBool::new(false),
            site: if tracking {
                crate::memory::recorder::current_site()
            } else {
                None
            },
        }
    }

    /// Bytes of the distinct buffers it saved that are still alive.
    pub(crate) fn saved_storages(&self) -> impl Iterator<Item = Arc<crate::backend::Storage>> + '_ {
        self.saved.iter().filter_map(|(s, _)| s.upgrade())
    }

    /// Whether its backward never ran (its closure and saved tensors are all still there)
    /// or ran with retain_graph.
    pub(crate) fn holds_saved(&self) -> bool {
        self.saves_tensors() && !self.is_released()
    }

    /// A node that saved nothing can run again without retain_graph (as in PyTorch).
    pub(crate) fn saves_tensors(&self) -> bool {
        !self.saved.is_empty()
    }

    /// Fails if a buffer this node saved was modified in place since.
    pub(crate) fn check_saved_versions(&self) -> crate::base::Result<()> {
        for (storage, version) in &self.saved {
            if let Some(s) = storage.upgrade()
                && s.version() != *version
            {
                return Err(crate::base::Error::autograd(format!(
                    "one of the tensors needed for the gradient of {} was modified by an in-place operation (its version is {}, it was saved at version {}); avoid in-place updates of tensors that backward needs, or update a .detach()ed copy made with contiguous_copy()",
                    self.name,
                    s.version(),
                    version
                )));
            }
        }
        Ok(())
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    /// How many inputs the op was recorded with (those without a gradient included).
    pub(crate) fn input_count(&self) -> usize {
        self.edges.len()
    }

    /// Whether the saved state was already released by a backward without retain_graph.
    pub fn is_released(&self) -> bool {
        self.backward.lock().map(|b| b.is_none()).unwrap_or(true)
    }
}

impl Drop for Node {
    /// Drops a chain of nodes iteratively: a 100,000-node graph must not overflow the stack.
    fn drop(&mut self) {
        let mut stack: Vec<Arc<Node>> = std::mem::take(&mut self.edges)
            .into_iter()
            .filter_map(|e| match e {
                Some(Edge::Node(n)) => Some(n),
                _ => None,
            })
            .collect();
        while let Some(n) = stack.pop() {
            if let Ok(mut node) = Arc::try_unwrap(n) {
                // Its saved tensors may own tensors whose grad_fn ends in further nodes.
                let f = node.backward.get_mut().ok().and_then(|b| b.take());
                drop(f);
                stack.extend(
                    std::mem::take(&mut node.edges)
                        .into_iter()
                        .filter_map(|e| match e {
                            Some(Edge::Node(n)) => Some(n),
                            _ => None,
                        }),
                );
            }
        }
    }
}
