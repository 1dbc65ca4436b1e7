//! The main job on several in-process ranks (`ferrograd train --ranks N`, CPU): N threads,
//! each a replica of the model with its own batches, gradients averaged by DDP over the
//! in-process group (or, with `--zero 1`, reduce-scattered by ZeRO-1's sharded AdamW). Rank 0 reports, evaluates, samples and saves; every rank's peak memory
//! by category is measured in its own memory scope. Not here: the single-process loop itself
//! (`run_replica` in mod.rs runs as each rank).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;

use super::{Event, JobSummary, TrainJob};
use crate::base::{Error, Result};
use crate::dist::{DEFAULT_TIMEOUT, InProcessGroup, ProcessGroup, ReduceOp};
use crate::memory;
use crate::tensor::{DType, Device, Tensor};
use crate::train::StepReport;

/// One rank's peak, for the summary.
#[derive(Clone, Debug, Serialize)]
pub struct RankPeak {
    pub rank: usize,
    pub peak_bytes: u64,
    pub by_category_at_peak: BTreeMap<String, u64>,
}

/// Runs `job` on `job.ranks` threads; returns rank 0's summary.
pub(super) fn run_ranks(job: &TrainJob, on_event: &mut dyn FnMut(&Event)) -> Result<JobSummary> {
    check_ranks(job)?;
    let mut out = InProcessGroup::run_with_leader(
        job.ranks,
        DEFAULT_TIMEOUT,
        |g| super::run_replica(job, Some(g), on_event),
        |g| super::run_replica(job, Some(g), &mut |_| {}),
    )?;
    Ok(out.swap_remove(0))
}

/// What data-parallel runs cannot do (yet), refused before any work.
fn check_ranks(job: &TrainJob) -> Result<()> {
    let refuse = |detail: &str| Err(Error::invalid("train", detail));
    if job.device != Device::Cpu {
        return refuse(
            "--ranks runs in-process ranks on the CPU; data parallelism on GPUs needs NCCL, which this build does not have yet: leave out --ranks, or use --device cpu",
        );
    }
    if job.trainer.step_in_backward {
        return refuse(
            "--step-in-backward cannot run with --ranks: each parameter would step on its own rank's gradient before the ranks average them",
        );
    }
    if job.memory_trace.is_some() {
        return refuse(
            "--memory-trace records the process's allocator, which the ranks share; trace a run without --ranks",
        );
    }
    if job.zero && (job.save.is_some() || job.resume.is_some()) {
        return refuse(
            "--zero 1 spreads AdamW's state over the ranks, and saving or resuming sharded state is not supported yet; leave out --save/--resume, or train without --zero",
        );
    }
    if u16::try_from(job.ranks).is_err() {
        return refuse("--ranks is limited to 65535 in-process ranks");
    }
    Ok(())
}

/// The seed of a rank's training batches: rank 0 draws what a single process would, the
/// others draw different batches from the same seed.
pub(super) fn data_seed(seed: u64, rank: usize) -> u64 {
    seed ^ 0xDA7A ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// A rank other than 0 resuming: its batch stream restarts from the seed and the step
/// reached (the saved state holds rank 0's stream only).
pub(super) fn resumed_data_seed(seed: u64, rank: usize, step: u64) -> u64 {
    data_seed(seed, rank) ^ step.rotate_left(29)
}

/// The step as the whole group saw it: the loss averaged over ranks, the tokens of all.
pub(super) fn group_report(report: &mut StepReport, group: &dyn ProcessGroup) -> Result<()> {
    let loss = Tensor::from_vec_as(vec![report.loss], &[1], DType::F64, Device::Cpu)?;
    group.all_reduce(&loss, ReduceOp::Avg)?;
    report.loss = loss.item()?;
    report.tokens *= group.world_size();
    Ok(())
}

/// Every rank's peak and its categories, from the ranks' memory scopes.
pub(super) fn rank_peaks(device: Device, world: usize) -> Result<Vec<RankPeak>> {
    (0..world)
        .map(|rank| {
            let id = u16::try_from(rank)
                .map_err(|_| Error::invalid("train", "too many ranks to report"))?;
            let m = memory::scope_memory(device, id)?;
            Ok(RankPeak {
                rank,
                peak_bytes: m.peak,
                by_category_at_peak: m.by_category_at_peak.to_map(),
            })
        })
        .collect()
}

/// A rank's handle on its group, shared by the loop's helpers.
pub(super) type Group = Arc<dyn ProcessGroup>;
