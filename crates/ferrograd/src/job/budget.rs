//! What else would fit: each memory strategy applied to a job and planned (`alternatives`),
//! the largest batch of each strategy set under a memory budget (`fit_budget`), and the
//! configuration `train --fit-budget` runs (`choose_for_budget`).
//!
//! Every figure is a plan of the real step on the meta device (job/fit.rs), never a formula.

use serde::Serialize;

use super::fit::plan_job;
use super::{OptimizerChoice, TrainJob};
use crate::base::{DType, Error, Result, format_size};
use crate::nn::Recompute;
use crate::plan::{Plan, PlanOptions, Target};

/// One strategy change against the job as given, planned.
#[derive(Clone, Debug, Serialize)]
pub struct Alternative {
    /// The flags that make it (`--amp bf16`), empty for the job as given.
    pub flags: String,
    pub batch_size: usize,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    /// The change of the peak allocated against the job as given, in percent.
    pub change_percent: f64,
    /// Whether it fits the device planned for.
    pub fits: bool,
}

/// A strategy set with the largest micro-batch that fits a budget.
#[derive(Clone, Debug, Serialize)]
pub struct Fitted {
    pub flags: String,
    /// The largest fitting micro-batch (None: not even batch 1 fits).
    pub batch_size: Option<usize>,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
}

/// How `fit_budget` steps the batch size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum BatchSteps {
    /// 1, 2, 4, 8, ...
    PowersOfTwo,
    /// Any integer (found by bisection).
    Any,
}

/// A named change to a job.
struct Change {
    flags: String,
    apply: Box<dyn Fn(&mut TrainJob)>,
}

fn change(flags: &str, apply: impl Fn(&mut TrainJob) + 'static) -> Change {
    Change {
        flags: flags.to_string(),
        apply: Box::new(apply),
    }
}

/// The single-strategy changes worth showing for `job` (those it does not already use, and
/// that the Trainer accepts with the rest of its settings).
fn single_changes(job: &TrainJob) -> Vec<Change> {
    let mut out = Vec::new();
    let t = &job.trainer;
    // Autocast is for f32 weights; bf16 weights already compute in bf16.
    let f32_weights = job.weights == DType::F32;
    if t.amp != Some(DType::BF16) && f32_weights {
        out.push(change("--amp bf16", |j| j.trainer.amp = Some(DType::BF16)));
    }
    if t.amp != Some(DType::F16) && f32_weights {
        out.push(change("--amp f16", |j| j.trainer.amp = Some(DType::F16)));
    }
    if f32_weights && t.amp.is_none() && job.optimizer == OptimizerChoice::AdamW && !job.zero {
        out.push(change("--weights bf16", |j| j.weights = DType::BF16));
    }
    // Whichever of the two the run does not take (a GPU run recomputes the GELU by default).
    if t.recompute != Recompute::Off {
        out.push(change("--recompute off", |j| {
            j.trainer.recompute = Recompute::Off
        }));
    }
    if t.recompute != Recompute::Gelu {
        out.push(change("--recompute gelu", |j| {
            j.trainer.recompute = Recompute::Gelu
        }));
    }
    for k in [1, 2] {
        if t.recompute != Recompute::Every(k) && k <= job.model.n_layer {
            out.push(change(&format!("--recompute every:{k}"), move |j| {
                j.trainer.recompute = Recompute::Every(k)
            }));
        }
    }
    // Every block recomputed but for its attention, which keeps its output instead.
    if t.recompute != Recompute::Selective(1) && job.fused_attention {
        out.push(change("--recompute selective:1", |j| {
            j.trainer.recompute = Recompute::Selective(1)
        }));
    }
    for n in [2, 4] {
        if job.batch_size.is_multiple_of(n) && job.batch_size >= n {
            out.push(change(
                &format!(
                    "--accum {} --batch-size {}",
                    t.accum * n,
                    job.batch_size / n
                ),
                move |j| {
                    j.trainer.accum *= n;
                    j.batch_size /= n;
                },
            ));
        }
    }
    if t.freeze.is_empty() && job.model.n_layer > 1 {
        out.push(change("--freeze 'transformer.h.0.*'", |j| {
            j.trainer.freeze = vec!["transformer.h.0.*".into()]
        }));
    }
    if !t.step_in_backward {
        out.push(change("--step-in-backward", |j| {
            j.trainer.step_in_backward = true
        }));
    }
    if job.fused_attention {
        out.push(change("--attention composed", |j| {
            j.fused_attention = false
        }));
    } else {
        out.push(change("--attention fused", |j| j.fused_attention = true));
    }
    out.retain(|c| {
        let mut j = job.clone();
        (c.apply)(&mut j);
        j.trainer.validate().is_ok()
    });
    out
}

/// The job as given, then each single strategy change, planned for `target`.
pub fn alternatives(job: &TrainJob, target: Target, base: &Plan) -> Result<Vec<Alternative>> {
    let row = |flags: String, j: &TrainJob, p: &Plan| -> Result<Alternative> {
        Ok(Alternative {
            flags,
            batch_size: j.batch_size,
            peak_allocated: p.peak_allocated,
            peak_reserved: p.peak_reserved,
            change_percent: percent(p.peak_allocated, base.peak_allocated),
            fits: p.fits_on(job.device)?,
        })
    };
    let mut out = vec![row(String::new(), job, base)?];
    for c in single_changes(job) {
        let mut j = job.clone();
        (c.apply)(&mut j);
        let p = plan_job(&j, target, PlanOptions::default())?;
        out.push(row(c.flags, &j, &p)?);
    }
    Ok(out)
}

fn percent(x: u64, of: u64) -> f64 {
    (x as f64 / of.max(1) as f64 - 1.0) * 100.0
}

/// The strategy sets a budget is searched with: the job's own, then bf16, recomputation and
/// both (the combinations that lower the peak most).
fn budget_sets(job: &TrainJob) -> Vec<Change> {
    let mut sets = vec![change("", |_| {})];
    let bf16 = job.trainer.amp != Some(DType::BF16) && job.weights == DType::F32;
    if bf16 {
        sets.push(change("--amp bf16", |j| j.trainer.amp = Some(DType::BF16)));
    }
    if job.trainer.recompute != Recompute::Every(1) {
        sets.push(change("--recompute every:1", |j| {
            j.trainer.recompute = Recompute::Every(1)
        }));
        if bf16 {
            sets.push(change("--amp bf16 --recompute every:1", |j| {
                j.trainer.amp = Some(DType::BF16);
                j.trainer.recompute = Recompute::Every(1);
            }));
        }
    }
    sets
}

/// For each strategy set, the largest micro-batch whose plan fits `budget` bytes (peak
/// reserved, which is what a device must hold). An error when no set fits even one sequence,
/// saying what the leanest would need.
pub fn fit_budget(
    job: &TrainJob,
    target: Target,
    budget: u64,
    steps: BatchSteps,
) -> Result<Vec<Fitted>> {
    let mut out = Vec::new();
    let mut leanest: Option<Plan> = None;
    for set in budget_sets(job) {
        let mut j = job.clone();
        (set.apply)(&mut j);
        let row = match largest_batch(&j, target, budget, steps)? {
            Ok((batch, p)) => Fitted {
                flags: set.flags,
                batch_size: Some(batch),
                peak_allocated: p.peak_allocated,
                peak_reserved: p.peak_reserved,
            },
            Err(at_one) => {
                let row = Fitted {
                    flags: set.flags,
                    batch_size: None,
                    peak_allocated: at_one.peak_allocated,
                    peak_reserved: at_one.peak_reserved,
                };
                if leanest.as_ref().is_none_or(|l| at_one.need() < l.need()) {
                    leanest = Some(at_one);
                }
                row
            }
        };
        out.push(row);
    }
    if out.iter().all(|f| f.batch_size.is_none()) {
        return Err(too_small(budget, leanest));
    }
    Ok(out)
}

/// Whether `job` at `batch` fits `budget`, with its plan.
fn try_batch(job: &TrainJob, batch: usize, target: Target, budget: u64) -> Result<(bool, Plan)> {
    let j = TrainJob {
        batch_size: batch,
        ..job.clone()
    };
    let p = plan_job(&j, target, PlanOptions::default())?;
    Ok((p.fits && p.need() <= budget, p))
}

/// The largest batch of `job` that fits with its plan, searching up from 1 by doubling (then
/// bisecting for `BatchSteps::Any`); the plan of batch 1 when not even that fits.
fn largest_batch(
    job: &TrainJob,
    target: Target,
    budget: u64,
    steps: BatchSteps,
) -> Result<std::result::Result<(usize, Plan), Plan>> {
    /// No search goes past 2^24 sequences per micro-batch.
    const MAX_BATCH: usize = 1 << 24;
    let (fits, p) = try_batch(job, 1, target, budget)?;
    if !fits {
        return Ok(Err(p));
    }
    let mut best = (1, p);
    let mut fail = None;
    while best.0 < MAX_BATCH {
        let next = best.0 * 2;
        match try_batch(job, next, target, budget)? {
            (true, p) => best = (next, p),
            (false, _) => {
                fail = Some(next);
                break;
            }
        }
    }
    if let (BatchSteps::Any, Some(mut hi)) = (steps, fail) {
        while hi - best.0 > 1 {
            let mid = best.0 + (hi - best.0) / 2;
            match try_batch(job, mid, target, budget)? {
                (true, p) => best = (mid, p),
                (false, _) => hi = mid,
            }
        }
    }
    Ok(Ok(best))
}

/// The rule `train --fit-budget` follows, in words.
pub const FIT_RULE: &str = "keep the precision and the effective batch (--batch-size × --accum) you asked for; take the fewest micro-batches, then the least recomputation (off, gelu, every:2, every:1)";

/// The configuration `train --fit-budget` runs: see `FIT_RULE`. Returns the job and its plan,
/// or an error naming what the smallest configuration needs.
pub fn choose_for_budget(job: &TrainJob, target: Target, budget: u64) -> Result<(TrainJob, Plan)> {
    let effective = job.batch_size * job.trainer.accum;
    let mut smallest: Option<Plan> = None;
    for accum in (1..=effective).filter(|a| effective.is_multiple_of(*a)) {
        for recompute in [
            Recompute::Off,
            Recompute::Gelu,
            Recompute::Every(2),
            Recompute::Every(1),
        ] {
            let mut j = job.clone();
            j.batch_size = effective / accum;
            j.trainer.accum = accum;
            j.trainer.recompute = recompute;
            if j.trainer.validate().is_err() {
                continue;
            }
            let (fits, p) = try_batch(&j, j.batch_size, target, budget)?;
            if fits {
                return Ok((j, p));
            }
            smallest = Some(p);
        }
    }
    Err(too_small(budget, smallest))
}

/// A budget that not even the leanest configuration fits: what it would need, and what the
/// parameters alone take.
fn too_small(budget: u64, leanest: Option<Plan>) -> Error {
    let detail = match leanest {
        Some(p) => {
            let params = p
                .by_category_at_peak
                .get(crate::memory::Category::Parameter);
            let beyond = if params > budget {
                "the parameters alone are more than the budget"
            } else {
                "the parameters fit, their gradients, optimizer state and one sequence's activations do not"
            };
            format!(
                "{beyond}: the leanest configuration tried (one sequence per micro-batch) needs {} at its peak, of which the parameters take {}; give a budget of at least {}, or a smaller model",
                format_size(p.need()),
                format_size(params),
                format_size(p.need()),
            )
        }
        None => "there is no configuration to try".into(),
    };
    Error::invalid(
        "memory budget",
        format!("nothing fits a budget of {}: {detail}", format_size(budget)),
    )
}
