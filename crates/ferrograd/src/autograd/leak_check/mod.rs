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

mod holders;

pub use holders::{GradGraphHolder, GraphHolder, GraphKind, Holder};

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use crate::base::{Category, CategoryBytes, Device, Result, format_size};
use crate::memory::{self, Allocator};
use crate::tensor::{set_tracking_step, start_tracking, stop_tracking};
use holders::find_holders;

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
            // Graphs are a leak only while what they save keeps growing (one kept graph that
            // stays the same size is not).
            if grows(&|s| s.by_category.get(Category::SavedActivation)) {
                report.leaks.extend(self.graph_leaks());
            }
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
