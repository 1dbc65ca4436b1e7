//! The leak detector: `LeakCheck` samples a device's memory at each step boundary
//! (`mark_step`) and, when memory grows step over step, names who holds it and the fix.
//!
//! What it sees, because the library owns the graph: every node recorded while a check is
//! active (with the step it was recorded in and whether a backward ran through it with
//! retain_graph), what each node saved, every leaf's `.grad`, and every live block's
//! category and allocating op. At each boundary it groups the nodes still alive from earlier
//! steps into holders:
//!
//! - a `.grad` that carries a graph (the create_graph cycle) → zero_grad;
//! - a graph never run backward, kept by a tensor (`total_loss += loss`) → detach or `.item()`;
//! - a graph that ran backward with retain_graph and was kept → drop it;
//! - an earlier step's graph still reached by this step's (an RNN hidden state) → detach it;
//!
//! and, for growth no graph explains, the ops whose live blocks grow (a tensor user code keeps
//! outside any graph), and reserved memory growing while allocated memory does not
//! (fragmentation of the cache).
//!
//! Warm-up is not a leak. The first `warmup_steps` boundaries (default 2) only set the
//! baseline: optimizer state appears on the first step, a GradScaler's state and the
//! allocator's cache fill during the first ones. After that a series (each category,
//! allocated, reserved) leaks only if it rises again and again: at `min_growing_steps` or more
//! boundaries (default 3), at least half of them, and ends above the baseline. A one-time rise
//! (state created late, a cache that fills and plateaus) rises once and stays flat, so it is
//! never reported; a leak rises every step.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::base::{Category, CategoryBytes, Device, Result, format_size};
use crate::memory::{self, Allocator};
use crate::tensor::{Edge, Node, live_nodes, set_tracking_step, start_tracking, stop_tracking};

/// How the check tells warm-up from a leak (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeakCheckConfig {
    /// Boundaries that only set the baseline.
    pub warmup_steps: usize,
    /// Rises after warm-up needed before a series counts as growing.
    pub min_growing_steps: usize,
}

impl Default for LeakCheckConfig {
    fn default() -> Self {
        LeakCheckConfig {
            warmup_steps: 2,
            min_growing_steps: 3,
        }
    }
}

/// Watches one device's memory across training steps. Tracking of graph nodes is on while
/// it lives (it costs one relaxed atomic load per recorded node when no check is active).
pub struct LeakCheck {
    allocator: Arc<Allocator>,
    config: LeakCheckConfig,
    samples: Vec<Sample>,
    /// Holders found at the last boundary.
    holders: Vec<Holder>,
    step: u64,
}

/// Memory at one boundary.
struct Sample {
    allocated: u64,
    reserved: u64,
    by_category: CategoryBytes,
    by_origin: HashMap<(Category, &'static str), u64>,
}

impl LeakCheck {
    /// Starts watching `device` with the default warm-up rule; call `mark_step` after each
    /// training step (after zero_grad).
    pub fn new(device: Device) -> Result<LeakCheck> {
        Self::with_config(memory::allocator(device)?, LeakCheckConfig::default())
    }

    /// Watches `allocator` with an explicit warm-up rule.
    pub fn with_config(allocator: Arc<Allocator>, config: LeakCheckConfig) -> Result<LeakCheck> {
        start_tracking();
        set_tracking_step(1);
        Ok(LeakCheck {
            allocator,
            config,
            samples: Vec::new(),
            holders: Vec::new(),
            step: 1,
        })
    }

    /// The step being recorded (1 for the first).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// A step boundary: samples memory, finds who holds graphs from earlier steps, and starts
    /// counting the next step.
    pub fn mark_step(&mut self) {
        self.samples.push(self.sample());
        self.holders = find_holders(self.step);
        self.step += 1;
        set_tracking_step(self.step);
    }

    fn sample(&self) -> Sample {
        let mut by_origin = HashMap::new();
        for b in self.allocator.live_block_infos() {
            *by_origin.entry((b.category, b.origin)).or_insert(0) += b.bytes;
        }
        Sample {
            allocated: self.allocator.memory_allocated(),
            reserved: self.allocator.memory_reserved(),
            by_category: self.allocator.by_category(),
            by_origin,
        }
    }

    /// What grew step over step after warm-up, with its holder and fix. Empty when nothing
    /// did (or too few steps were marked to tell: see `LeakReport::steps_needed`).
    pub fn report(&self) -> LeakReport {
        let needed = self.config.warmup_steps + self.config.min_growing_steps;
        let mut report = LeakReport {
            steps: self.samples.len(),
            steps_needed: needed,
            leaks: Vec::new(),
        };
        if self.samples.len() < needed.max(1) {
            return report;
        }
        let window = &self.samples[self.config.warmup_steps.saturating_sub(1)..];
        let grows = |f: &dyn Fn(&Sample) -> u64| growing(window, f, self.config.min_growing_steps);
        let steps = (window.len() - 1) as u64;
        if grows(&|s| s.allocated) {
            report.leaks.extend(self.graph_leaks());
            let explained: HashSet<Category> =
                report.leaks.iter().filter_map(|l| l.category).collect();
            // The tensors that hold the graphs are the graph holders' roots, not other leaks.
            let roots: HashSet<&'static str> = report
                .leaks
                .iter()
                .filter_map(|l| match &l.holder {
                    Holder::Graph(g) => Some(g.root_op),
                    _ => None,
                })
                .collect();
            for c in Category::ALL {
                if !explained.contains(&c) && grows(&|s| s.by_category.get(c)) {
                    let leaks = user_tensor_leaks(window, c, steps);
                    report.leaks.extend(leaks.into_iter().filter(|l| {
                        !matches!(l.holder, Holder::UserTensor { origin, .. } if roots.contains(origin))
                    }));
                }
            }
        } else if grows(&|s| s.reserved) {
            let (first, last) = (&window[0], &window[window.len() - 1]);
            report.leaks.push(Leak {
                category: None,
                bytes_per_step: (last.reserved - first.reserved) / steps,
                holder: Holder::Fragmentation {
                    reserved_growth: last.reserved - first.reserved,
                    allocated: last.allocated,
                },
            });
        }
        report
    }

    /// The holders of the last boundary, one leak each.
    fn graph_leaks(&self) -> Vec<Leak> {
        self.holders
            .iter()
            .map(|h| {
                let (bytes, spanned, category) = match h {
                    Holder::Graph(g) => (
                        g.saved_bytes,
                        g.root_step.saturating_sub(g.first_step) + 1,
                        Category::SavedActivation,
                    ),
                    Holder::GradGraph(g) => (
                        g.saved_bytes + g.grad_bytes,
                        g.steps.max(1),
                        Category::SavedActivation,
                    ),
                    _ => (0, 1, Category::Temporary),
                };
                Leak {
                    category: Some(category),
                    bytes_per_step: bytes / spanned,
                    holder: h.clone(),
                }
            })
            .collect()
    }
}

impl Drop for LeakCheck {
    fn drop(&mut self) {
        stop_tracking();
    }
}

/// Whether `value` rises at `min` or more of the window's boundaries, at least half of them,
/// and ends above where the window started.
fn growing(window: &[Sample], value: &dyn Fn(&Sample) -> u64, min: usize) -> bool {
    let v: Vec<u64> = window.iter().map(value).collect();
    let rises = v.windows(2).filter(|w| w[1] > w[0]).count();
    let intervals = v.len().saturating_sub(1);
    rises >= min.max(1) && rises * 2 >= intervals && v.last() > v.first()
}

/// The ops whose live blocks of category `c` grew over the window, largest first (at most 3).
fn user_tensor_leaks(window: &[Sample], c: Category, steps: u64) -> Vec<Leak> {
    let (first, last) = (&window[0], &window[window.len() - 1]);
    let mut grown: Vec<(&'static str, u64)> = last
        .by_origin
        .iter()
        .filter(|((cat, _), _)| *cat == c)
        .filter_map(|(&(_, origin), &now)| {
            let before = first.by_origin.get(&(c, origin)).copied().unwrap_or(0);
            (now > before).then_some((origin, now - before))
        })
        .collect();
    grown.sort_by_key(|&(o, g)| (std::cmp::Reverse(g), o));
    grown.truncate(3);
    grown
        .into_iter()
        .map(|(origin, growth)| Leak {
            category: Some(c),
            bytes_per_step: growth / steps.max(1),
            holder: Holder::UserTensor {
                origin,
                bytes: growth,
                steps,
            },
        })
        .collect()
}

// ---- holders --------------------------------------------------------------------------------

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
    /// The user's call site of the root op, when a recorder captured one (None otherwise).
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

/// One growing thing: its category (None: reserved memory), rate, holder and fix.
#[derive(Clone, Debug, PartialEq)]
pub struct Leak {
    pub category: Option<Category>,
    pub bytes_per_step: u64,
    pub holder: Holder,
}

impl Leak {
    pub fn fix(&self) -> &'static str {
        self.holder.fix()
    }
}

impl fmt::Display for Leak {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = self
            .category
            .map_or("reserved".to_string(), |c| c.to_string());
        write!(
            f,
            "{what} grows {}/step: {}.\n  fix: {}",
            format_size(self.bytes_per_step),
            self.holder,
            self.fix()
        )
    }
}

/// What `LeakCheck::report` found.
#[derive(Clone, Debug, PartialEq)]
pub struct LeakReport {
    /// Step boundaries marked.
    pub steps: usize,
    /// Boundaries needed before anything can be called a leak (warm-up + growing steps).
    pub steps_needed: usize,
    pub leaks: Vec<Leak>,
}

impl LeakReport {
    pub fn is_clean(&self) -> bool {
        self.leaks.is_empty()
    }
}

impl fmt::Display for LeakReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.steps < self.steps_needed {
            return write!(
                f,
                "leak check: {} steps marked, {} needed to tell a leak from warm-up",
                self.steps, self.steps_needed
            );
        }
        if self.leaks.is_empty() {
            return write!(
                f,
                "leak check: no memory grows after warm-up ({} steps)",
                self.steps
            );
        }
        writeln!(
            f,
            "leak check: memory grows step over step ({} steps):",
            self.steps
        )?;
        for (i, l) in self.leaks.iter().enumerate() {
            writeln!(f, "{}. {l}", i + 1)?;
        }
        Ok(())
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
fn find_holders(step: u64) -> Vec<Holder> {
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
            call_site: None,
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
