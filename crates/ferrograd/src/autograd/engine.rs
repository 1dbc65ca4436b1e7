//! The backward engine: iterative (no recursion, so a 100,000-node chain is fine) and
//! deterministic (nodes run in reverse creation order; leaves accumulate as soon as all their
//! incoming gradients are summed, as PyTorch's AccumulateGrad does). Each backward has an
//! id, so a gradient sink can tell the first contribution of a backward from later ones.

use std::cell::Cell;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::edge_of;
use super::grad_mode::no_grad;
use crate::base::{Error, Result};
use crate::memory::Category;
use crate::tensor::{AutogradMeta, Edge, InputMeta, Node, Tensor, broadcast_shape, run_hooks};

/// Options of `Tensor::backward_with`.
#[derive(Clone, Debug, Default)]
pub struct BackwardOptions {
    /// The gradient of the root; required unless the root has one element.
    pub gradient: Option<Tensor>,
    /// Keep saved tensors so the graph can be walked again.
    pub retain_graph: bool,
}

/// Backward passes started in the process (ids are unique across threads).
static BACKWARDS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The id of the backward running on this thread (0: none yet).
    static CURRENT: Cell<u64> = const { Cell::new(0) };
}

/// The id of the backward pass running on this thread (or of the last one it ran).
pub(crate) fn backward_id() -> u64 {
    CURRENT.with(Cell::get)
}

/// Gives this thread a fresh backward id until dropped (then restores the outer one, for a
/// backward started inside another's hook).
struct BackwardId(u64);

impl BackwardId {
    fn start() -> BackwardId {
        let id = BACKWARDS.fetch_add(1, Ordering::Relaxed) + 1;
        BackwardId(CURRENT.with(|c| c.replace(id)))
    }
}

impl Drop for BackwardId {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.0));
    }
}

const RELEASED: &str = "Trying to backward through the graph a second time (or to use saved tensors after they were freed): saved tensors are released during backward. Pass retain_graph=true to the first backward if you need to backward through the graph again.";

impl Tensor {
    /// `loss.backward()`: the root must hold a single element.
    #[track_caller]
    pub fn backward(&self) -> Result<()> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.backward_with(BackwardOptions::default())
    }

    #[track_caller]
    pub fn backward_with(&self, opts: BackwardOptions) -> Result<()> {
        let _site = crate::memory::recorder::CallSite::enter();
        let root = edge_of(self).ok_or_else(|| {
            Error::autograd(
                "this tensor does not require grad and has no grad_fn: nothing to differentiate. Did you create it under no_grad, or forget requires_grad_(true) on a parameter?",
            )
        })?;
        let grad = match opts.gradient {
            Some(g) => {
                if g.shape() != self.shape() {
                    return Err(Error::shape(
                        "backward",
                        format!(
                            "gradient shape {:?} differs from the tensor's {:?}",
                            g.shape(),
                            self.shape()
                        ),
                    ));
                }
                // A gradient of another dtype or device would end up as a leaf's .grad.
                crate::tensor::check_pair("backward", self, &g)?;
                g
            }
            None if self.numel() == 1 => Tensor::ones(self.shape(), self.dtype(), self.device())?,
            None => {
                return Err(Error::autograd(format!(
                    "grad can be implicitly created only for scalar outputs; this tensor has shape {:?}: pass a gradient (BackwardOptions::gradient) or reduce it first (e.g. .sum())",
                    self.shape()
                )));
            }
        };
        let _guard = no_grad();
        // Backward ops run in the dtypes the forward chose, even when called in a region.
        let _amp = crate::amp::autocast_disabled();
        let _id = BackwardId::start();
        run(root, grad, opts.retain_graph)
    }
}

/// Number of incoming edges of every node reachable from `root`.
fn dependencies(root: &Edge) -> HashMap<usize, usize> {
    let mut deps: HashMap<usize, usize> = HashMap::new();
    let mut stack = vec![root.clone()];
    let mut seen = std::collections::HashSet::new();
    seen.insert(root.key());
    while let Some(e) = stack.pop() {
        if let Edge::Node(n) = e {
            for next in n.edges.iter().flatten() {
                *deps.entry(next.key()).or_insert(0) += 1;
                if seen.insert(next.key()) {
                    stack.push(next.clone());
                }
            }
        }
    }
    deps
}

/// Ready work, highest priority first: leaves, then later-created nodes.
struct Ready {
    priority: u64,
    edge: Edge,
}
impl PartialEq for Ready {
    fn eq(&self, o: &Self) -> bool {
        self.priority == o.priority && self.edge.key() == o.edge.key()
    }
}
impl Eq for Ready {}
impl PartialOrd for Ready {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Ready {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.priority, self.edge.key()).cmp(&(o.priority, o.edge.key()))
    }
}

fn priority(e: &Edge) -> u64 {
    match e {
        Edge::Leaf(_) => u64::MAX,
        Edge::Node(n) => n.seq,
    }
}

fn run(root: Edge, grad: Tensor, retain_graph: bool) -> Result<()> {
    let mut deps = dependencies(&root);
    let mut buffers: HashMap<usize, Tensor> = HashMap::new();
    buffers.insert(root.key(), grad);
    let mut heap = BinaryHeap::new();
    heap.push(Ready {
        priority: priority(&root),
        edge: root,
    });
    while let Some(Ready { edge, .. }) = heap.pop() {
        let grad = buffers.remove(&edge.key());
        match &edge {
            Edge::Leaf(meta) => {
                if let Some(g) = grad {
                    accumulate(meta, g)?;
                }
                finish_sink(meta)?;
            }
            Edge::Node(node) => {
                let grads = match grad {
                    Some(g) => run_node(node, g, retain_graph)?,
                    None => vec![None; node.edges.len()],
                };
                for (next, g) in node.edges.iter().zip(grads) {
                    let Some(next) = next else { continue };
                    if let Some(g) = g {
                        add_to_buffer(&mut buffers, next.key(), g)?;
                    }
                    let d = deps.get_mut(&next.key()).map(|d| {
                        *d -= 1;
                        *d
                    });
                    if d == Some(0) {
                        heap.push(Ready {
                            priority: priority(next),
                            edge: next.clone(),
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

fn add_to_buffer(buffers: &mut HashMap<usize, Tensor>, key: usize, g: Tensor) -> Result<()> {
    match buffers.remove(&key) {
        None => buffers.insert(key, g),
        Some(prev) => buffers.insert(key, prev.add(&g)?),
    };
    Ok(())
}

/// Runs one node: its output's hooks and retain_grad, then its backward. Without
/// retain_graph the closure (and with it every saved tensor) is dropped right after.
fn run_node(node: &Arc<Node>, grad: Tensor, retain_graph: bool) -> Result<Vec<Option<Tensor>>> {
    let grad = run_hooks(&node.hooks, grad)?;
    let out_meta = node.output.lock().ok().and_then(|w| w.upgrade());
    if let Some(m) = &out_meta
        && m.retains_grad.load(Ordering::Relaxed)
    {
        let mut slot = m.grad_slot();
        *slot = Some(match slot.take() {
            Some(prev) => prev.add(&grad)?,
            None => grad.contiguous_copy()?,
        });
    }
    let needs: Vec<bool> = node.edges.iter().map(Option::is_some).collect();
    node.check_saved_versions()?;
    let mut slot = node.backward.lock().unwrap_or_else(|e| e.into_inner());
    // A node that saved nothing keeps its closure: running it again needs no freed state.
    let grads = if retain_graph || !node.saves_tensors() {
        let f = slot.as_mut().ok_or_else(|| Error::autograd(RELEASED))?;
        f(&grad, &needs)?
    } else {
        let mut f = slot.take().ok_or_else(|| Error::autograd(RELEASED))?;
        drop(slot);
        let grads = f(&grad, &needs)?;
        drop(f);
        grads
    };
    if grads.len() != node.edges.len() {
        return Err(Error::autograd(format!(
            "backward of {} returned {} gradients for {} inputs",
            node.name,
            grads.len(),
            node.edges.len()
        )));
    }
    grads
        .into_iter()
        .zip(&node.inputs)
        .enumerate()
        .map(|(i, (g, meta))| g.map(|g| conform(node.name, i, g, meta)).transpose())
        .collect()
}

/// Checks a gradient against its input, as PyTorch's validate_outputs does: a broadcast
/// gradient is summed back to the input's shape, another dtype is converted, any other
/// shape is an error (a custom backward's bug would otherwise land in `.grad`).
fn conform(name: &str, i: usize, g: Tensor, meta: &InputMeta) -> Result<Tensor> {
    let g = if g.shape() == meta.shape.as_slice() {
        g
    } else if broadcast_shape("backward", &meta.shape, g.shape()).is_ok_and(|s| s == g.shape()) {
        g.sum_to(&meta.shape)?
    } else {
        return Err(Error::autograd(format!(
            "backward of {name} returned a gradient of shape {:?} for input {i} of shape {:?}",
            g.shape(),
            meta.shape
        )));
    };
    if g.dtype() == meta.dtype {
        Ok(g)
    } else {
        g.to_dtype(meta.dtype)
    }
}

/// Tells a leaf's gradient sink that the leaf has all its contributions of this backward.
fn finish_sink(meta: &Arc<AutogradMeta>) -> Result<()> {
    if let Some(sink) = meta.grad_sink()
        && let Some(leaf) = meta.owner()
    {
        sink.finish(&leaf)?;
    }
    Ok(())
}

/// AccumulateGrad: the first gradient is stored (stolen when nothing else holds it), later
/// ones are added in place. Then the leaf's post-accumulate hooks run.
fn accumulate(meta: &Arc<AutogradMeta>, grad: Tensor) -> Result<()> {
    let grad = meta.run_hooks(grad)?;
    {
        let mut slot = meta.grad_slot();
        match slot.as_ref() {
            Some(existing) => existing.add_(&grad)?,
            None => {
                let owned = if grad.is_exclusive() {
                    grad
                } else {
                    grad.contiguous_copy()?
                };
                owned.set_category(Category::Gradient);
                *slot = Some(owned);
            }
        }
    }
    let mut hooks = meta
        .post_accumulate_hooks
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if !hooks.is_empty()
        && let Some(leaf) = meta.owner()
    {
        for h in hooks.iter_mut() {
            h(&leaf)?;
        }
    }
    Ok(())
}
