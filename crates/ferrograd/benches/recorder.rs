//! Benchmark: what the memory recorder costs. Two measurements, each alternating off and on
//! so that a busy machine slows both alike, and each reporting the fastest repetition (the
//! one least disturbed):
//! - `alloc`: one allocation and free of a 64-byte host tensor (the allocation path itself),
//!   recorder off vs on, in ns per allocate+free pair;
//! - `step`: one training step of the main job at its defaults (4 layers, width 128, batch
//!   16 × 64 tokens, AdamW) on the CPU, recorder off vs on (recording every step), in ms,
//!   with the events one step records.
//!
//! Usage: cargo bench -p ferrograd --bench recorder [-- --reps 5 --steps 8]

use std::time::Instant;

use ferrograd::job::{self, Event, MemoryTraceSettings, TrainJob};
use ferrograd::memory::recorder::{self, RecorderConfig};
use ferrograd::{DType, Device, Tensor};

mod common;
use common::arg;

/// ns per allocate+free of a (16,) f32 host tensor, best of `reps` rounds of 200k.
fn alloc_pair_ns(recording: bool, reps: usize) -> f64 {
    const N: usize = 200_000;
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        if recording {
            recorder::start(RecorderConfig::default()).unwrap();
        }
        let t = Instant::now();
        for _ in 0..N {
            let x = Tensor::zeros(&[16], DType::F32, Device::Cpu).unwrap();
            drop(x);
        }
        best = best.min(t.elapsed().as_nanos() as f64 / N as f64);
        if recording {
            recorder::stop().unwrap();
        }
    }
    best
}

/// Fastest step of a `steps`-step run of the main job, and (when recording) its directory.
fn fastest_step_ms(trace: Option<&std::path::Path>, steps: u64) -> f64 {
    let job = TrainJob {
        max_steps: steps,
        eval_every: 0,
        eval_batches: 1,
        sample_chars: 1,
        memory_trace: trace.map(|dir| MemoryTraceSettings {
            dir: dir.to_path_buf(),
            steps,
            capacity: recorder::DEFAULT_CAPACITY,
        }),
        ..TrainJob::default()
    };
    let mut best = f64::INFINITY;
    job::run(&job, &mut |e| {
        if let Event::Step(r) = e
            && r.step > 0
        {
            best = best.min(r.seconds * 1e3);
        }
    })
    .unwrap();
    best
}

/// Events one step records: a recording of one step of the job, counted.
fn events_per_step() -> usize {
    let job = TrainJob {
        max_steps: 2,
        eval_every: 0,
        eval_batches: 1,
        sample_chars: 1,
        ..TrainJob::default()
    };
    // Record only the second step (the first one creates the optimizer state).
    let mut count = 0;
    let mut started = false;
    job::run(&job, &mut |e| {
        if let Event::Step(r) = e {
            if r.step == 0 {
                recorder::start(RecorderConfig::default()).unwrap();
                started = true;
            } else if started {
                count = recorder::stop().unwrap().events.len();
                started = false;
            }
        }
    })
    .unwrap();
    count
}

fn main() {
    let reps = arg("--reps", 5);
    let steps = arg("--steps", 8) as u64;
    let (mut off, mut on) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..reps {
        off = off.min(alloc_pair_ns(false, 1));
        on = on.min(alloc_pair_ns(true, 1));
    }
    println!(
        "alloc: {off:.1} ns off, {on:.1} ns on per allocate+free pair ({:+.1} ns)",
        on - off
    );
    let dir = std::env::temp_dir().join(format!("ferrograd-recorder-bench-{}", std::process::id()));
    let (mut off, mut on) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..reps {
        off = off.min(fastest_step_ms(None, steps));
        let _ = std::fs::remove_dir_all(&dir);
        on = on.min(fastest_step_ms(Some(&dir), steps));
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "step: {off:.2} ms off, {on:.2} ms on ({:+.2}%), fastest of {reps} runs x {} steps",
        100.0 * (on - off) / off,
        steps - 1
    );
    println!("events recorded by one step: {}", events_per_step());
}
