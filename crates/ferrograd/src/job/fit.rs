//! Will the run fit? The job's own model, trainer and steps run on the meta device through the
//! planner (`plan`), for the device the job trains on, before anything is allocated there: an
//! impossible batch is refused with the planned need and what to change, and the run's summary
//! reports the planned peak next to the measured one.
//!
//! The planned run is what the real run does up to its peak: the evaluation before training,
//! the first three steps, and an evaluation after them when the run evaluates between steps.
//! The second step is the first with optimizer state from the start; the third is the first
//! that runs while two earlier losses wait unread on the device (the first step's and the
//! last one's, for the summary); every later step repeats it byte for byte.

use super::{Losses, TrainJob, build, evaluate, train_step};
use crate::base::{DType, Device, Error, Result};
use crate::data::TextDataset;
use crate::nn::Module;
use crate::plan::{self, Plan, PlanOptions, Target};
use crate::tensor::Generator;
use crate::train::StepGraph;

/// The planner's target for a job's device: the host, or a GPU with its free memory.
pub fn target_of(device: Device) -> Result<Target> {
    match device {
        Device::Cpu => Ok(Target::Cpu),
        Device::Cuda(_) => Ok(Target::Cuda {
            capacity: crate::backend::available_memory(device)?,
        }),
        Device::Meta => Err(Error::invalid(
            "plan",
            "the meta device is where plans run, not one to plan for; give --device cpu or cuda",
        )),
    }
}

/// Plans `job` for `target` (see the module comment for what is run).
pub fn plan_job(job: &TrainJob, target: Target, options: PlanOptions) -> Result<Plan> {
    let data = TextDataset::new(&job.text)?;
    super::check_text_length(&data, job.model.block_size)?;
    plan_with_data(job, &data, target, options)
}

fn plan_with_data(
    job: &TrainJob,
    data: &TextDataset,
    target: Target,
    options: PlanOptions,
) -> Result<Plan> {
    let to_run = job
        .stop_after
        .map_or(job.max_steps, |n| n.min(job.max_steps));
    let steps = to_run.min(3);
    let evaluates_between = job.eval_every > 0 && job.eval_every < to_run;
    // One batch per split: every evaluation batch takes the same bytes.
    let eval_job = TrainJob {
        eval_batches: 1,
        ..job.clone()
    };
    plan::plan(target, options, |device| {
        let (mut model, mut trainer) = build(job, data, device, None)?;
        model.train(true);
        let mut rng = Generator::new(job.seed);
        // A GPU run captures its second step as a CUDA graph: so does its plan (the meta
        // device then takes the graph's memory as the GPU would), and its evaluations run in
        // the graph's pool as the run's do.
        let graphs = job.cuda_graphs && matches!(job.device, Device::Cuda(_));
        let mut graph = StepGraph::new(graphs, 1);
        trainer.prepare_graph(&mut graph)?;
        graph.run_between_steps(device, || evaluate(&mut model, data, &eval_job, 0, device))?;
        let mut losses = Losses::default();
        for _ in 0..steps {
            let report = train_step(
                &mut trainer,
                &mut model,
                None,
                (data, &mut rng),
                job,
                graphs.then_some(&mut graph),
            )?;
            losses.see(&report);
        }
        if evaluates_between {
            graph.run_between_steps(device, || {
                evaluate(&mut model, data, &eval_job, steps, device)
            })?;
        }
        Ok(())
    })
}

/// Plans the job for its device and refuses it when the plan does not fit what the device
/// can give; returns the plan.
pub fn check_fits(job: &TrainJob, data: &TextDataset) -> Result<Plan> {
    let plan = plan_with_data(job, data, target_of(job.device)?, PlanOptions::default())?;
    plan.check_fits(
        job.device,
        format!(
            "training with --batch-size {} --block-size {} ({} layers of width {})",
            job.batch_size, job.model.block_size, job.model.n_layer, job.model.n_embd
        ),
        &format!(
            "use a smaller --batch-size (with --accum N to keep the effective batch), --recompute every:1, {}or a smaller model; `ferrograd plan` lists what fits",
            // bf16 weights already compute in bf16, and refuse autocast.
            if job.weights == DType::F32 { "--amp bf16, " } else { "" }
        ),
    )?;
    Ok(plan)
}
