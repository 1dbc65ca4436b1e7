//! The main job on several in-process ranks (`ferrograd train --ranks N`, CPU): N threads,
//! each a replica of the model with its own batches, gradients averaged by DDP over the
//! in-process group (or, with `--zero 1`, reduce-scattered by ZeRO-1's sharded AdamW). Rank 0 reports, evaluates, samples and saves; every rank's peak memory
//! by category is measured in its own memory scope. Not here: the single-process loop itself
//! (`run_replica` in mod.rs runs as each rank).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;

use super::{Event, JobSummary, TrainJob};
use crate::base::CategoryBytes;
use crate::base::{Error, Result};
use crate::dist::{DEFAULT_TIMEOUT, InProcessGroup, ProcessGroup, ReduceOp};
use crate::memory;
use crate::tensor::{DType, Device, Readout, Tensor};
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

/// What in-process ranks cannot do, refused before any work.
fn check_ranks(job: &TrainJob) -> Result<()> {
    if job.device != Device::Cpu {
        return Err(Error::invalid(
            "train",
            "--ranks runs in-process ranks on the CPU; on GPUs, data parallelism runs over NCCL with one process per GPU: ferrograd launch --nproc-per-node N -- ferrograd train --device cuda ...",
        ));
    }
    if u16::try_from(job.ranks).is_err() {
        return Err(Error::invalid(
            "train",
            "--ranks is limited to 65535 in-process ranks",
        ));
    }
    check_shared(job)
}

/// What data-parallel runs cannot do (yet), in-process or launched.
fn check_shared(job: &TrainJob) -> Result<()> {
    let refuse = |detail: &str| Err(Error::invalid("train", detail));
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

/// The step as the whole group saw it: the loss averaged over ranks, the tokens of all,
/// each rank's peak so far (every rank calls it: the peaks are gathered). Both collectives
/// are queued on the device; nothing waits until a log reads them.
pub(super) fn group_report(
    report: &mut StepReport,
    group: &dyn ProcessGroup,
    device: Device,
) -> Result<()> {
    if let Some(loss) = report.loss.tensor() {
        let mean = loss.contiguous_copy()?;
        group.all_reduce(&mean, ReduceOp::Avg)?;
        report.loss = Readout::pending(mean);
    }
    report.tokens *= group.world_size();
    let (peak, _) = own_peak(device, group)?;
    report.rank_peaks = Readout::pending(gather_rows(vec![peak as f64], device, group)?);
    Ok(())
}

/// This rank's peak so far and its categories at that moment. In-process ranks share an
/// allocator, so each reads its own memory scope; a launched rank is a process of its own,
/// whose allocator holds its bytes alone.
fn own_peak(device: Device, group: &dyn ProcessGroup) -> Result<(u64, CategoryBytes)> {
    if group.ranks_share_process() {
        let id = u16::try_from(group.rank())
            .map_err(|_| Error::invalid("train", "too many ranks to report"))?;
        let m = memory::scope_memory(device, id)?;
        return Ok((m.peak, m.by_category_at_peak));
    }
    let a = memory::allocator(device)?;
    Ok((a.max_memory_allocated(), a.by_category_at_peak()))
}

/// Every rank's `row` (the same length on each), gathered on the device in rank order.
fn gather_rows(row: Vec<f64>, device: Device, group: &dyn ProcessGroup) -> Result<Tensor> {
    let width = row.len();
    let mine = Tensor::from_vec_as(row, &[width], DType::F64, device)?;
    // Unfilled: the all-gather writes every element.
    let all = Tensor::output_uninit(
        &[group.world_size() * width],
        DType::F64,
        device,
        "rank_rows",
    )?;
    group.all_gather(&mine, &all)?;
    Ok(all)
}

/// Every rank's peak and its categories, gathered over the group (called by every rank).
pub(super) fn rank_peaks(device: Device, group: &dyn ProcessGroup) -> Result<Vec<RankPeak>> {
    let (peak, at_peak) = own_peak(device, group)?;
    // One row per rank: the peak, then the categories; bytes are exact in f64 below 2^53.
    let row: Vec<f64> = std::iter::once(peak)
        .chain(at_peak.0)
        .map(|b| b as f64)
        .collect();
    let width = row.len();
    let all = gather_rows(row, device, group)?;
    let values = all.to_vec::<f64>()?;
    Ok(values
        .chunks(width)
        .enumerate()
        .map(|(rank, r)| {
            let mut cats = CategoryBytes::default();
            for (c, v) in cats.0.iter_mut().zip(&r[1..]) {
                *c = *v as u64;
            }
            RankPeak {
                rank,
                peak_bytes: r[0] as u64,
                by_category_at_peak: cats.to_map(),
            }
        })
        .collect())
}

/// The main job as one rank of a group of processes (launched by `ferrograd launch` or
/// torchrun, one GPU each); returns this rank's summary (rank 0's is the full one).
pub fn run_launched(
    job: &TrainJob,
    group: Arc<dyn ProcessGroup>,
    on_event: &mut dyn FnMut(&Event),
) -> Result<JobSummary> {
    super::check_settings(job)?;
    check_shared(job)?;
    super::run_replica(job, Some(group), on_event)
}

/// A rank's handle on its group, shared by the loop's helpers.
pub(super) type Group = Arc<dyn ProcessGroup>;
