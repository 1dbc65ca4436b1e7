//! The backward engine: iterative (no recursion, so a 100,000-node chain is fine) and
//! deterministic (nodes run in reverse creation order; leaves accumulate as soon as all their
//! incoming gradients are summed, as PyTorch's AccumulateGrad does). Each backward has an
//! id, so a gradient sink can tell the first contribution of a backward from later ones.
//!
//! With `create_graph` the backward runs in grad mode, so the gradients it computes are
//! themselves recorded (a gradient penalty can be backpropagated). Only nodes whose backward
//! is written with differentiable ops can run then; any other is a clear error naming it.
//! `autograd::grad` (in `functional`) runs the same engine but returns the gradients of
//! chosen inputs instead of accumulating into `.grad`, running only the nodes that lead to
//! them.

use std::cell::{Cell, RefCell};
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::edge_of;
use super::functional::Capture;
use super::grad_mode::{enable_grad, no_grad};
use crate::base::{Error, Result};
use crate::memory::Category;
use crate::tensor::{
    AutogradMeta, Edge, InputMeta, Node, RunningNode, SinksOff, Tensor, broadcast_shape, run_hooks,
};

/// Options of `Tensor::backward_with`.
#[derive(Clone, Debug, Default)]
pub struct BackwardOptions {
    /// The gradient of the root; required unless the root has one element.
    pub gradient: Option<Tensor>,
    /// Keep saved tensors so the graph can be walked again.
    pub retain_graph: bool,
    /// Record the backward itself, so the gradients (and `.grad`) carry a graph that can be
    /// differentiated again. Implies `retain_graph` (PyTorch's default when create_graph is
    /// set). The `.grad` it leaves refers to the graph and the graph to the parameter: call
    /// `zero_grad` (or `set_grad(None)`) to free both.
    pub create_graph: bool,
}

/// The ops whose backward is written with differentiable tensor ops (and unpacks what it
/// saved with its history), so it can run under `create_graph`. Any other op's backward uses
/// a fused kernel that is not differentiable.
const DIFFERENTIABLE_BACKWARD: &[&str] = &[
    "add",
    "sub",
    "mul",
    "div",
    "pow",
    "add_scalar",
    "mul_scalar",
    "pow_scalar",
    "neg",
    "exp",
    "log",
    "sqrt",
    "tanh",
    "sigmoid",
    "relu",
    "gelu",
    "gelu_derivative",
    "linear",
    "mlp_gelu",
    "matmul",
    "sum",
    "mse_loss",
    "reshape",
    "view",
    "permute",
    "expand",
    "contiguous",
    "to_dtype",
    "to_device",
    "where",
    "masked_fill",
];

/// How one backward pass runs.
pub(crate) struct Pass {
    pub(crate) retain_graph: bool,
    pub(crate) create_graph: bool,
    /// For `autograd::grad`: gradients are returned for these edges, not accumulated.
    pub(crate) capture: Option<Capture>,
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
        // What this pass left for its later functions goes with it, finished or failed.
        super::handoff::end_of_pass(backward_id());
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
        let pass = Pass {
            retain_graph: opts.retain_graph || opts.create_graph,
            create_graph: opts.create_graph,
            capture: None,
        };
        run(vec![(root, grad)], pass).map(drop)
    }
}

/// Runs a backward pass from `roots` (each with its gradient) in the grad mode the pass asks
/// for; returns the pass (with what it captured).
pub(crate) fn run(roots: Vec<(Edge, Tensor)>, mut pass: Pass) -> Result<Pass> {
    let _guard = if pass.create_graph {
        enable_grad()
    } else {
        no_grad()
    };
    // Backward ops run in the dtypes the forward chose, even when called in a region.
    let _amp = crate::amp::autocast_disabled();
    let _id = BackwardId::start();
    let _sinks = (pass.create_graph || pass.capture.is_some()).then(SinksOff::start);
    walk(roots, &mut pass)?;
    Ok(pass)
}

/// Number of incoming edges of every node reachable from `roots`, and those nodes.
fn dependencies(roots: &[Edge]) -> (HashMap<usize, usize>, Vec<Arc<Node>>) {
    let mut deps: HashMap<usize, usize> = HashMap::new();
    let mut nodes = Vec::new();
    let mut stack = roots.to_vec();
    let mut seen: HashSet<usize> = roots.iter().map(Edge::key).collect();
    while let Some(e) = stack.pop() {
        if let Edge::Node(n) = e {
            nodes.push(Arc::clone(&n));
            for next in n.edges.iter().flatten() {
                *deps.entry(next.key()).or_insert(0) += 1;
                if seen.insert(next.key()) {
                    stack.push(next.clone());
                }
            }
        }
    }
    (deps, nodes)
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

fn walk(roots: Vec<(Edge, Tensor)>, pass: &mut Pass) -> Result<()> {
    let edges: Vec<Edge> = roots.iter().map(|(e, _)| e.clone()).collect();
    let (mut deps, nodes) = dependencies(&edges);
    if let Some(c) = &mut pass.capture {
        c.mark_needed(&nodes);
    }
    drop(nodes);
    let mut buffers: HashMap<usize, Tensor> = HashMap::new();
    let mut heap = BinaryHeap::new();
    for (edge, grad) in roots {
        add_to_buffer(&mut buffers, edge.key(), grad)?;
        // A root reachable from another root waits for the gradients flowing into it.
        if !deps.contains_key(&edge.key())
            && !heap.iter().any(|r: &Ready| r.edge.key() == edge.key())
        {
            heap.push(Ready {
                priority: priority(&edge),
                edge,
            });
        }
    }
    while let Some(Ready { edge, .. }) = heap.pop() {
        let grad = buffers.remove(&edge.key());
        if let (Some(c), Some(g)) = (&mut pass.capture, &grad) {
            c.keep(edge.key(), g)?;
        }
        match &edge {
            // autograd::grad leaves every .grad alone.
            Edge::Leaf(_) if pass.capture.is_some() => {}
            Edge::Leaf(meta) => {
                if let Some(g) = grad {
                    accumulate(meta, g, pass.create_graph)?;
                }
                finish_sink(meta)?;
            }
            Edge::Node(_) if pass.capture.as_ref().is_some_and(|c| !c.needs(&edge)) => {}
            Edge::Node(node) => {
                let needs: Vec<bool> = node
                    .edges
                    .iter()
                    .map(|e| {
                        e.as_ref()
                            .is_some_and(|e| pass.capture.as_ref().is_none_or(|c| c.needs(e)))
                    })
                    .collect();
                let grads = match grad {
                    Some(g) => {
                        let loan = PendingLoan::lend(&mut buffers, node, &needs, pass);
                        let grads = run_node(node, g, &needs, pass)?;
                        loan.settle(&mut buffers);
                        grads
                    }
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

thread_local! {
    /// The running node's pending input gradients (`PendingLoan`), by input index.
    static PENDING: RefCell<Vec<Option<(usize, Tensor)>>> = const { RefCell::new(Vec::new()) };
}

/// The gradients other paths have already summed for a node's inputs, lent to its backward
/// while it runs: a backward whose kernel can add as it writes (`take_pending_grad`) folds
/// one in and saves the engine's separate add — a residual stream's gradient meets a layer
/// norm's this way. What the backward does not take goes back to the buffers unchanged.
/// Nothing is lent under create_graph (the sum must be recorded).
struct PendingLoan {
    /// The thread's loan before this one (a backward started from inside a hook), put back
    /// when this one ends, on every path.
    outer: Option<Vec<Option<(usize, Tensor)>>>,
}

impl PendingLoan {
    fn lend(
        buffers: &mut HashMap<usize, Tensor>,
        node: &Node,
        needs: &[bool],
        pass: &Pass,
    ) -> PendingLoan {
        let mut lent = Vec::with_capacity(node.edges.len());
        for (edge, &need) in node.edges.iter().zip(needs) {
            let key = edge
                .as_ref()
                .filter(|_| need && !pass.create_graph)
                .map(Edge::key);
            // An input that appears twice is lent at its first index only.
            lent.push(key.and_then(|k| buffers.remove(&k).map(|g| (k, g))));
        }
        PendingLoan {
            outer: Some(PENDING.with(|p| p.replace(lent))),
        }
    }

    /// Returns what the backward left to the buffers.
    fn settle(mut self, buffers: &mut HashMap<usize, Tensor>) {
        for (key, g) in self.end().into_iter().flatten() {
            buffers.insert(key, g);
        }
    }

    /// Ends the loan: the outer one is current again; returns what is left of this one.
    fn end(&mut self) -> Vec<Option<(usize, Tensor)>> {
        match self.outer.take() {
            Some(outer) => PENDING.with(|p| p.replace(outer)),
            None => Vec::new(),
        }
    }
}

impl Drop for PendingLoan {
    fn drop(&mut self) {
        self.end();
    }
}

/// Inside a backward: the gradient that other paths have already summed for input `i`,
/// taken when `fits` accepts it. The backward then owes the engine that gradient plus its
/// own contribution as input `i`'s gradient (the engine no longer holds the prior one).
/// None outside the engine, under create_graph, or when nothing is pending.
pub(crate) fn take_pending_grad(i: usize, fits: impl FnOnce(&Tensor) -> bool) -> Option<Tensor> {
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        let slot = p.get_mut(i)?;
        if slot.as_ref().is_some_and(|(_, g)| fits(g)) {
            slot.take().map(|(_, g)| g)
        } else {
            None
        }
    })
}

fn add_to_buffer(buffers: &mut HashMap<usize, Tensor>, key: usize, g: Tensor) -> Result<()> {
    match buffers.remove(&key) {
        None => buffers.insert(key, g),
        Some(prev) => buffers.insert(key, prev.add(&g)?),
    };
    Ok(())
}

thread_local! {
    /// Set while a backward runs for the last time: its saved values are freed right after.
    static LAST_RUN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the running backward as its node's last until dropped.
struct LastRun(bool);

impl LastRun {
    fn enter(last: bool) -> LastRun {
        LastRun(LAST_RUN.with(|l| l.replace(last)))
    }
}

impl Drop for LastRun {
    fn drop(&mut self) {
        LAST_RUN.with(|l| l.set(self.0));
    }
}

/// True inside a backward whose saved values are freed as soon as it returns (no
/// retain_graph): it may overwrite a saved buffer that nothing else shares.
pub(crate) fn saved_values_released_after_this_backward() -> bool {
    LAST_RUN.with(|l| l.get())
}

/// Runs one node: its output's hooks and retain_grad, then its backward. Without
/// retain_graph the closure (and with it every saved tensor) is dropped right after.
fn run_node(
    node: &Arc<Node>,
    grad: Tensor,
    needs: &[bool],
    pass: &Pass,
) -> Result<Vec<Option<Tensor>>> {
    if pass.create_graph && !DIFFERENTIABLE_BACKWARD.contains(&node.name) {
        return Err(Error::autograd(format!(
            "create_graph: the backward of {} is a fused kernel that is not differentiable, so its gradient cannot be recorded for a second derivative; write that part with differentiable ops (ops whose backward supports create_graph: {})",
            node.name,
            DIFFERENTIABLE_BACKWARD.join(", ")
        )));
    }
    let _running = pass.create_graph.then(|| RunningNode::enter(node));
    let grad = run_hooks(&node.hooks, grad)?;
    let out_meta = node.output.lock().ok().and_then(|w| w.upgrade());
    if let Some(m) = &out_meta
        && m.retains_grad.load(Ordering::Relaxed)
    {
        let mut slot = m.grad_slot();
        *slot = Some(match slot.take() {
            Some(prev) => prev.add(&grad)?,
            // Under create_graph the retained gradient keeps its graph (nothing writes it).
            None if pass.create_graph => grad.clone(),
            None => grad.contiguous_copy()?,
        });
    }
    node.check_saved_versions()?;
    let mut slot = node.backward.lock().unwrap_or_else(|e| e.into_inner());
    // A node that saved nothing keeps its closure: running it again needs no freed state.
    let grads = if pass.retain_graph || !node.saves_tensors() {
        if pass.retain_graph {
            node.retained.store(true, Ordering::Relaxed);
        }
        let f = slot.as_mut().ok_or_else(|| Error::autograd(RELEASED))?;
        let _last = LastRun::enter(false);
        f(&grad, needs)?
    } else {
        let mut f = slot.take().ok_or_else(|| Error::autograd(RELEASED))?;
        drop(slot);
        let grads = {
            let _last = LastRun::enter(true);
            f(&grad, needs)?
        };
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
/// ones are added in place. Under create_graph (or onto a `.grad` that carries a graph) both
/// are recorded out of place instead, so `.grad` keeps the history of every contribution.
/// Then the leaf's post-accumulate hooks run.
fn accumulate(meta: &Arc<AutogradMeta>, grad: Tensor, create_graph: bool) -> Result<()> {
    let grad = meta.run_hooks(grad)?;
    {
        let mut slot = meta.grad_slot();
        let recorded = create_graph || slot.as_ref().is_some_and(|g| g.grad_fn().is_some());
        if let Some(existing) = slot.as_ref()
            && !recorded
        {
            existing.add_(&grad)?;
            drop(slot);
            return post_accumulate(meta);
        }
        let new = match slot.as_ref() {
            Some(existing) => existing.add(&grad)?,
            None if grad.is_exclusive() => grad,
            None if create_graph => grad.copy_recorded()?,
            None => grad.contiguous_copy()?,
        };
        new.set_category(Category::Gradient);
        *slot = Some(new);
    }
    post_accumulate(meta)
}

/// Runs a leaf's post-accumulate hooks.
fn post_accumulate(meta: &Arc<AutogradMeta>) -> Result<()> {
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
