//! Who holds memory that grows: the holder kinds the leak check names, each with its fix in
//! one sentence, and how they are found among the live graph nodes at a step boundary.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::base::format_size;
use crate::tensor::{Edge, Node, live_nodes};

/// Who keeps growing memory alive.
#[derive(Clone, Debug, PartialEq)]
pub enum Holder {
    /// A graph from earlier steps, kept alive by a tensor.
    Graph(GraphHolder),
    /// The `.grad` of parameters carries the graph of a create_graph backward, which refers
    /// back to the parameters: a reference cycle.
    GradGraph(GradGraphHolder),
    /// Live blocks no graph holds, made by `origin`, grew by `bytes` over `steps` steps.
    UserTensor {
        origin: &'static str,
        bytes: u64,
        steps: u64,
    },
    /// Reserved memory grew by `reserved_growth` while allocated memory stayed at `allocated`.
    Fragmentation {
        reserved_growth: u64,
        allocated: u64,
    },
}

/// Why a graph from earlier steps is still alive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphKind {
    /// No backward ever ran through it: a tensor computed from the loss keeps it (typically
    /// `total_loss = total_loss + loss`).
    NeverBackward,
    /// A backward ran with retain_graph, and a tensor of the graph was kept afterwards.
    Retained,
    /// This step's graph still reaches into earlier steps' graphs through a tensor carried
    /// over (an RNN's hidden state).
    LinkedToCurrentStep,
}

#[derive(Clone, Debug, PartialEq)]
pub struct GraphHolder {
    pub kind: GraphKind,
    /// The op that made the tensor holding the graph (the graph's root).
    pub root_op: &'static str,
    /// The step that tensor was made in.
    pub root_step: u64,
    /// The earliest step with a node still alive in this graph.
    pub first_step: u64,
    pub nodes: usize,
    /// Bytes of the distinct buffers its nodes saved.
    pub saved_bytes: u64,
    /// The line of user code that called the root op (`file:line`), when the op captured it.
    pub call_site: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct GradGraphHolder {
    /// Parameters whose `.grad` carries a graph, and the shape of the first.
    pub params: usize,
    pub first_shape: Vec<usize>,
    /// Nodes reachable from those gradients, and the distinct bytes they saved.
    pub nodes: usize,
    pub saved_bytes: u64,
    pub grad_bytes: u64,
    /// Steps the held graph spans.
    pub steps: u64,
}

impl Holder {
    /// The fix, in one sentence.
    pub fn fix(&self) -> &'static str {
        match self {
            Holder::Graph(g) => match g.kind {
                GraphKind::NeverBackward => {
                    "detach or .item() the loss before accumulating it (total += loss.item()), so each step's graph is freed"
                }
                GraphKind::Retained => {
                    "drop the graph after a retain_graph backward (let the tensors made in it go), or do not pass retain_graph"
                }
                GraphKind::LinkedToCurrentStep => {
                    "detach the hidden state between steps (h = h.detach()), so a step's graph does not reach into the previous ones"
                }
            },
            Holder::GradGraph(_) => {
                "call zero_grad() (or set .grad to None) after a create_graph backward: the .grad and its graph refer to each other and are never freed otherwise"
            }
            Holder::UserTensor { .. } => {
                "drop the tensors user code keeps between steps (a list, a cache, a field), keep .item() or a detached copy instead, and don't keep saved tensors on a custom function's struct (use ctx.save_for_backward)"
            }
            Holder::Fragmentation { .. } => {
                "call empty_cache() between phases, or use the same batch shape every step so cached blocks can be reused"
            }
        }
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Holder::Graph(g) => {
                let why = match g.kind {
                    GraphKind::NeverBackward => "never run backward",
                    GraphKind::Retained => "run backward with retain_graph and kept",
                    GraphKind::LinkedToCurrentStep => "still reached by this step's graph",
                };
                write!(
                    f,
                    "a graph of {} nodes from steps {}..={} ({} saved), {why}, kept alive by a tensor made by `{}` in step {}",
                    g.nodes,
                    g.first_step,
                    g.root_step,
                    format_size(g.saved_bytes),
                    g.root_op,
                    g.root_step
                )?;
                if let Some(site) = &g.call_site {
                    write!(f, " at {site}")?;
                }
                Ok(())
            }
            Holder::GradGraph(g) => write!(
                f,
                "the .grad of {} parameter(s) (the first of shape {:?}) carries the graph of a create_graph backward: {} nodes, {} saved, {} of gradients",
                g.params,
                g.first_shape,
                g.nodes,
                format_size(g.saved_bytes),
                format_size(g.grad_bytes)
            ),
            Holder::UserTensor {
                origin,
                bytes,
                steps,
            } => write!(
                f,
                "{} more over {steps} steps in tensors made by `{origin}` that no graph holds: user code keeps them",
                format_size(*bytes)
            ),
            Holder::Fragmentation {
                reserved_growth,
                allocated,
            } => write!(
                f,
                "the allocator's cache grew by {} while allocated memory stayed at {}: cached blocks are not reused",
                format_size(*reserved_growth),
                format_size(*allocated)
            ),
        }
    }
}

// ---- finding holders in the live graph ---------------------------------------------------------

fn key(n: &Arc<Node>) -> usize {
    Arc::as_ptr(n) as usize
}

fn node_edges(n: &Node) -> impl Iterator<Item = &Arc<Node>> {
    n.edges.iter().flatten().filter_map(|e| match e {
        Edge::Node(m) => Some(m),
        Edge::Leaf(_) => None,
    })
}

/// The nodes reachable from `start` not yet in `seen` (which it extends).
fn reach(start: &Arc<Node>, seen: &mut HashSet<usize>) -> Vec<Arc<Node>> {
    let mut out = Vec::new();
    let mut stack = vec![Arc::clone(start)];
    while let Some(n) = stack.pop() {
        if !seen.insert(key(&n)) {
            continue;
        }
        stack.extend(node_edges(&n).cloned());
        out.push(n);
    }
    out
}

/// Distinct bytes saved by `nodes`.
fn saved_bytes(nodes: &[Arc<Node>]) -> u64 {
    let mut seen = HashSet::new();
    nodes
        .iter()
        .flat_map(|n| n.saved_storages().collect::<Vec<_>>())
        .filter(|s| seen.insert(Arc::as_ptr(s) as usize))
        .map(|s| s.allocation().size() as u64)
        .sum()
}

/// The holders of graphs from before `step` among the live nodes.
pub(super) fn find_holders(step: u64) -> Vec<Holder> {
    let nodes = live_nodes();
    let mut seen: HashSet<usize> = HashSet::new();
    let mut holders: Vec<Holder> = grad_graph(&nodes, &mut seen).into_iter().collect();
    let referenced: HashSet<usize> = nodes
        .iter()
        .flat_map(|n| node_edges(n).map(key).collect::<Vec<_>>())
        .collect();
    let mut roots: Vec<&Arc<Node>> = nodes
        .iter()
        .filter(|n| !referenced.contains(&key(n)))
        .collect();
    roots.sort_by_key(|n| std::cmp::Reverse(n.seq));
    for root in roots {
        let group = reach(root, &mut seen);
        let old: Vec<&Arc<Node>> = group.iter().filter(|n| n.step < step).collect();
        let bytes = saved_bytes(&group);
        if old.is_empty() || bytes == 0 {
            continue;
        }
        let never_run = old
            .iter()
            .any(|n| n.holds_saved() && !n.retained.load(Ordering::Relaxed));
        let kind = if never_run {
            GraphKind::NeverBackward
        } else if root.step >= step {
            GraphKind::LinkedToCurrentStep
        } else {
            GraphKind::Retained
        };
        holders.push(Holder::Graph(GraphHolder {
            kind,
            root_op: root.name,
            root_step: root.step,
            first_step: group.iter().map(|n| n.step).min().unwrap_or(root.step),
            nodes: group.len(),
            saved_bytes: bytes,
            call_site: root.site.map(|l| format!("{}:{}", l.file(), l.line())),
        }));
    }
    holders
}

/// Parameters whose `.grad` carries a graph, and that graph (marked in `seen`).
fn grad_graph(nodes: &[Arc<Node>], seen: &mut HashSet<usize>) -> Option<Holder> {
    let mut params = HashSet::new();
    let mut carrying = 0;
    let mut first_shape = None;
    let mut grad_bytes = 0;
    let mut held = Vec::new();
    for n in nodes {
        for e in n.edges.iter().flatten() {
            let Edge::Leaf(meta) = e else { continue };
            if !params.insert(Arc::as_ptr(meta) as usize) {
                continue;
            }
            let grad = meta.grad_slot().clone();
            if let Some(g) = grad
                && let Some(gf) = g.grad_fn()
            {
                carrying += 1;
                first_shape.get_or_insert_with(|| g.shape().to_vec());
                grad_bytes += g.storage().allocation().size() as u64;
                held.extend(reach(gf, seen));
            }
        }
    }
    let first_shape = first_shape?;
    let steps = held.iter().map(|n| n.step).max().unwrap_or(0)
        - held.iter().map(|n| n.step).min().unwrap_or(0)
        + 1;
    Some(Holder::GradGraph(GradGraphHolder {
        params: carrying,
        first_shape,
        nodes: held.len(),
        saved_bytes: saved_bytes(&held),
        grad_bytes,
        steps,
    }))
}
