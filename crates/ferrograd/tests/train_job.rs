//! The main job (`ferrograd train` without the command line): a resumed run continues exactly
//! as if it had never stopped, with every strategy that keeps state (AdamW moments and, with
//! bf16 weights, f32 master copies; the loss scaler; dropout and batch streams); bad state
//! files are refused with nothing overwritten.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ferrograd::io::load_state;
use ferrograd::job::{self, Event, OptimizerChoice, TrainJob};
use ferrograd::nn::{GptConfig, Recompute};
use ferrograd::train::TrainerConfig;
use ferrograd::{DType, Error, Tensor};

/// Jobs share the process-wide default generator and CPU statistics: one at a time.
static LOCK: Mutex<()> = Mutex::new(());

struct TestDir(PathBuf);

impl TestDir {
    fn new(name: &str) -> TestDir {
        let dir = std::env::temp_dir().join(format!("ferrograd-job-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TestDir(dir)
    }
    fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A model small enough for a few steps in well under a second, with dropout on so the
/// random streams matter.
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
            dropout: 0.1,
            bias: true,
            seed: 0,
        },
        batch_size: 4,
        max_steps: 6,
        warmup_steps: 2,
        eval_every: 0,
        eval_batches: 1,
        sample_chars: 8,
        trainer,
        ..TrainJob::default()
    }
}

/// Runs `job` and returns the loss of every step it ran.
fn run(job: &TrainJob) -> ferrograd::Result<Vec<f64>> {
    let mut losses = Vec::new();
    job::run(job, &mut |e| {
        if let Event::Step(r) = e {
            losses.push(r.loss.value().unwrap());
        }
    })?;
    Ok(losses)
}

fn tensors(path: &Path) -> HashMap<String, Vec<f64>> {
    let (t, _) = load_state(path).unwrap();
    t.into_iter()
        .map(|(k, v): (String, Tensor)| (k, v.to_dtype(DType::F64).unwrap().to_vec().unwrap()))
        .collect()
}

/// Six steps straight, versus three steps, save, and three more from the saved state: the
/// same losses and bit-identical final state.
fn resume_matches_an_uninterrupted_run(trainer: TrainerConfig, name: &str) {
    resume_matches(&small_job(trainer), name);
}

/// `resume_matches_an_uninterrupted_run` for any job (another optimizer, say).
fn resume_matches(base: &TrainJob, name: &str) {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TestDir::new(name);
    let straight = TrainJob {
        save: Some(dir.path("straight.safetensors")),
        ..base.clone()
    };
    let all = run(&straight).unwrap();
    assert_eq!(all.len(), 6);

    let first = TrainJob {
        save: Some(dir.path("half.safetensors")),
        stop_after: Some(3),
        ..base.clone()
    };
    let head = run(&first).unwrap();
    let second = TrainJob {
        resume: Some(dir.path("half.safetensors")),
        save: Some(dir.path("resumed.safetensors")),
        ..base.clone()
    };
    let tail = run(&second).unwrap();
    assert_eq!([head, tail].concat(), all, "per-step losses");
    let (a, b) = (
        tensors(&dir.path("straight.safetensors")),
        tensors(&dir.path("resumed.safetensors")),
    );
    assert_eq!(a.len(), b.len());
    assert!(a.keys().any(|k| k.starts_with("optim.")));
    for (k, v) in &a {
        assert_eq!(Some(v), b.get(k), "{k}");
    }
}

/// The job with SGD (momentum 0.9) at a rate SGD learns with.
fn sgd_job(trainer: TrainerConfig) -> TrainJob {
    TrainJob {
        optimizer: OptimizerChoice::Sgd,
        lr: 0.1,
        min_lr: 0.01,
        ..small_job(trainer)
    }
}

#[test]
fn resume_continues_exactly_with_sgd_momentum() {
    resume_matches(&sgd_job(TrainerConfig::default()), "sgd");
    // The gradient-free step in backward keeps the same buffers and resumes the same way.
    let fused = sgd_job(TrainerConfig {
        step_in_backward: true,
        ..TrainerConfig::default()
    });
    resume_matches(&fused, "sgd-fused");
}

#[test]
fn sgd_state_holds_momentum_buffers_and_the_optimizer_name() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TestDir::new("sgd-keys");
    let saved = dir.path("sgd.safetensors");
    run(&TrainJob {
        save: Some(saved.clone()),
        stop_after: Some(1),
        ..sgd_job(TrainerConfig::default())
    })
    .unwrap();
    let (t, meta) = load_state(&saved).unwrap();
    assert_eq!(meta.get("optimizer").map(String::as_str), Some("sgd"));
    assert!(
        t.keys().any(|k| k.ends_with(".momentum_buffer")),
        "{:?}",
        t.keys()
    );
    assert!(!t.keys().any(|k| k.contains("exp_avg")));
}

#[test]
fn resuming_with_another_optimizer_is_a_typed_error() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TestDir::new("mismatch");
    let saved = state_after_one_step(&dir);
    let before = std::fs::read(&saved).unwrap();
    let err = run(&TrainJob {
        resume: Some(saved.clone()),
        save: Some(saved.clone()),
        ..sgd_job(TrainerConfig::default())
    })
    .unwrap_err();
    match &err {
        Error::OptimizerMismatch {
            saved, requested, ..
        } => assert_eq!((saved.as_str(), requested.as_str()), ("adamw", "sgd")),
        other => panic!("expected OptimizerMismatch, got {other:?}"),
    }
    assert!(err.to_string().contains("--optimizer adamw"), "{err}");
    assert_eq!(
        std::fs::read(&saved).unwrap(),
        before,
        "nothing overwritten"
    );
}

#[test]
fn resume_continues_exactly_f32() {
    resume_matches_an_uninterrupted_run(TrainerConfig::default(), "f32");
}

#[test]
fn resume_continues_exactly_with_accumulation_clipping_and_f16_scaler() {
    let trainer = TrainerConfig {
        accum: 2,
        clip: Some(1.0),
        amp: Some(DType::F16),
        ..TrainerConfig::default()
    };
    resume_matches_an_uninterrupted_run(trainer, "f16");
}

#[test]
fn resume_continues_exactly_with_step_in_backward_and_recompute() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TestDir::new("sib");
    let trainer = TrainerConfig {
        step_in_backward: true,
        recompute: Recompute::Every(1),
        ..TrainerConfig::default()
    };
    let job = |save: &str, stop: Option<u64>, resume: Option<&str>| TrainJob {
        save: Some(dir.path(save)),
        stop_after: stop,
        resume: resume.map(|r| dir.path(r)),
        ..small_job(trainer.clone())
    };
    let all = run(&job("a", None, None)).unwrap();
    let head = run(&job("b", Some(2), None)).unwrap();
    let tail = run(&job("c", None, Some("b"))).unwrap();
    assert_eq!([head, tail].concat(), all);
    assert_eq!(tensors(&dir.path("a")), tensors(&dir.path("c")));
}

/// The state file of a small run stopped after one step.
fn state_after_one_step(dir: &TestDir) -> PathBuf {
    let saved = dir.path("state.safetensors");
    run(&TrainJob {
        save: Some(saved.clone()),
        stop_after: Some(1),
        ..small_job(TrainerConfig::default())
    })
    .unwrap();
    saved
}

#[test]
fn a_truncated_state_is_refused_and_the_save_target_left_alone() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TestDir::new("bad");
    let saved = state_after_one_step(&dir);
    let bytes = std::fs::read(&saved).unwrap();
    let cut = dir.path("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = run(&TrainJob {
        resume: Some(cut.clone()),
        save: Some(saved.clone()),
        ..small_job(TrainerConfig::default())
    })
    .unwrap_err();
    assert!(matches!(err, Error::BadFile { .. }), "{err}");
    assert!(err.to_string().contains("truncated"), "{err}");
    assert_eq!(
        std::fs::read(&saved).unwrap(),
        bytes,
        "the save target is unchanged"
    );
}

#[test]
fn a_state_of_another_model_shape_is_refused() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TestDir::new("shape");
    let saved = state_after_one_step(&dir);
    let mut other = small_job(TrainerConfig::default());
    other.model.n_layer = 3;
    other.resume = Some(saved.clone());
    let err = run(&other).unwrap_err().to_string();
    assert!(
        err.contains("another model shape") && err.contains("\"n_layer\":3"),
        "{err}"
    );

    let mut frozen = small_job(TrainerConfig::default());
    frozen.trainer.freeze = vec!["transformer.wpe.*".into()];
    frozen.resume = Some(saved.clone());
    let err = run(&frozen).unwrap_err().to_string();
    assert!(err.contains("--freeze"), "{err}");

    // Not a training state at all: a plain safetensors file of weights.
    let plain = dir.path("plain.safetensors");
    let w = Tensor::zeros(&[2], DType::F32, ferrograd::Device::Cpu).unwrap();
    ferrograd::io::save_state(&plain, &[("w".into(), w)], Default::default()).unwrap();
    let mut job = small_job(TrainerConfig::default());
    job.resume = Some(plain);
    let err = run(&job).unwrap_err().to_string();
    assert!(err.contains("not a training state"), "{err}");
}

#[test]
fn the_default_run_learns_in_a_few_dozen_steps() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    // The default model and data, shortened: the loss must fall clearly from ln(65) ≈ 4.17.
    let job = TrainJob {
        max_steps: 30,
        warmup_steps: 5,
        eval_every: 0,
        eval_batches: 2,
        sample_chars: 20,
        ..TrainJob::default()
    };
    let mut summary = None;
    let s = job::run(&job, &mut |_| {}).unwrap();
    summary.get_or_insert(s);
    let s = summary.unwrap();
    assert_eq!(s.steps, 30);
    assert!(s.initial_loss > 4.0, "{}", s.initial_loss);
    assert!(
        s.final_eval.val_loss < 3.3,
        "val loss {}",
        s.final_eval.val_loss
    );
    assert_eq!(s.sample.chars().count(), 20);
    // The peak's categories add up to the peak.
    assert_eq!(s.by_category_at_peak.values().sum::<u64>(), s.peak_bytes);
    assert!(s.by_category_at_peak["optimizer_state"] > 0);
    // The planner's peak, made before the run, is the measured peak.
    assert_eq!(s.predicted_peak_bytes, s.peak_bytes);
    // CUDA graphs are a GPU's: the CPU's summary does not speak of them.
    assert_eq!(s.cuda_graphs, None);
}

#[test]
fn a_batch_that_cannot_fit_is_refused_before_allocating() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let job = TrainJob {
        batch_size: 1 << 40,
        ..small_job(TrainerConfig::default())
    };
    let before = ferrograd::memory::memory_allocated(ferrograd::Device::Cpu).unwrap();
    let err = run(&job).unwrap_err();
    assert!(matches!(err, Error::DoesNotFit { .. }), "{err}");
    assert!(err.to_string().contains("--accum"), "{err}");
    assert_eq!(
        ferrograd::memory::memory_allocated(ferrograd::Device::Cpu).unwrap(),
        before
    );
}

/// `saved` rewritten by `change` (with fresh checksums, as a tool that edits files would), and
/// the error a run resuming it gives.
fn resume_altered(
    dir: &TestDir,
    saved: &Path,
    trainer: TrainerConfig,
    change: impl FnOnce(&mut HashMap<String, Tensor>, &mut std::collections::BTreeMap<String, String>),
) -> String {
    let (mut tensors, mut meta) = load_state(saved).unwrap();
    change(&mut tensors, &mut meta);
    let altered = dir.path("altered.safetensors");
    let pairs: Vec<(String, Tensor)> = tensors.into_iter().collect();
    ferrograd::io::save_state(&altered, &pairs, meta).unwrap();
    let err = run(&TrainJob {
        resume: Some(altered),
        ..small_job(trainer)
    })
    .unwrap_err();
    assert!(matches!(err, Error::BadFile { .. }), "{err}");
    err.to_string()
}

#[test]
fn an_incomplete_state_is_refused_naming_the_first_difference() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TestDir::new("manifest");
    let saved = state_after_one_step(&dir);
    let cfg = TrainerConfig::default;
    let err = resume_altered(&dir, &saved, cfg(), |t, _| {
        t.retain(|k, _| !k.starts_with("optim."))
    });
    assert!(err.contains("lacks the tensor 'optim.0.exp_avg'"), "{err}");
    let err = resume_altered(&dir, &saved, cfg(), |t, _| {
        t.remove("optim.3.exp_avg_sq");
    });
    assert!(
        err.contains("lacks the tensor 'optim.3.exp_avg_sq'"),
        "{err}"
    );
    // All optimizer state gone, and the manifest edited to match: AdamW after a step has state.
    let err = resume_altered(&dir, &saved, cfg(), |t, m| {
        t.retain(|k, _| !k.starts_with("optim."));
        m.insert("optimizer_state".into(), "none".into());
    });
    assert!(err.contains("records step 1 but no AdamW state"), "{err}");
    let err = resume_altered(&dir, &saved, cfg(), |t, _| {
        let w = t.remove("model.transformer.wte.weight").unwrap();
        t.insert("model.transformer.wte.weights".into(), w);
    });
    assert!(
        err.contains("lacks the tensor 'model.transformer.wte.weight'"),
        "{err}"
    );
    let err = resume_altered(&dir, &saved, cfg(), |t, _| {
        let w = t.remove("model.transformer.wte.weight").unwrap();
        t.insert(
            "model.transformer.wte.weight".into(),
            w.to_dtype(DType::U8).unwrap(),
        );
    });
    assert!(
        err.contains("'model.transformer.wte.weight' is u8") && err.contains("this run needs f32"),
        "{err}"
    );
    let err = resume_altered(&dir, &saved, cfg(), |t, _| {
        let extra = Tensor::zeros(&[1], DType::F32, ferrograd::Device::Cpu).unwrap();
        t.insert("optim.0.extra".into(), extra);
    });
    assert!(err.contains("holds a tensor 'optim.0.extra'"), "{err}");
}

#[test]
fn impossible_values_and_old_formats_are_refused() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TestDir::new("values");
    let saved = state_after_one_step(&dir);
    let cfg = TrainerConfig::default;
    let set_first = |t: &mut HashMap<String, Tensor>, name: &str, value: f32| {
        let old = &t[name];
        let mut v = old.to_vec::<f32>().unwrap();
        v[0] = value;
        let new = Tensor::from_vec(v, old.shape(), ferrograd::Device::Cpu).unwrap();
        t.insert(name.into(), new);
    };
    let err = resume_altered(&dir, &saved, cfg(), |t, _| {
        set_first(t, "optim.0.exp_avg_sq", -1.0)
    });
    assert!(
        err.contains("'optim.0.exp_avg_sq' holds negative, NaN or infinite values"),
        "{err}"
    );
    let err = resume_altered(&dir, &saved, cfg(), |t, _| {
        set_first(t, "model.transformer.wte.weight", f32::NAN)
    });
    assert!(
        err.contains("'model.transformer.wte.weight' holds NaN or infinite values"),
        "{err}"
    );
    let err = resume_altered(&dir, &saved, cfg(), |_, m| {
        m.insert("step".into(), u64::MAX.to_string());
    });
    assert!(err.contains("more than any run takes"), "{err}");
    let err = resume_altered(&dir, &saved, cfg(), |t, _| {
        let s = Tensor::from_vec(vec![7i64], &[], ferrograd::Device::Cpu).unwrap();
        t.insert("optim.2.step".into(), s);
    });
    assert!(err.contains("'optim.2.step' is 7, outside 1..=1"), "{err}");
    let err = resume_altered(&dir, &saved, cfg(), |_, m| {
        m.insert("format".into(), "ferrograd-train-state-1".into());
    });
    assert!(
        err.contains("another format version, 'ferrograd-train-state-1'")
            && err.contains("reads 'ferrograd-train-state-2' only"),
        "{err}"
    );
}

#[test]
fn a_mixed_precision_state_resumes_only_in_its_mode() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TestDir::new("amp-mode");
    let f16 = TrainerConfig {
        amp: Some(DType::F16),
        ..TrainerConfig::default()
    };
    let saved = dir.path("f16.safetensors");
    run(&TrainJob {
        save: Some(saved.clone()),
        stop_after: Some(1),
        ..small_job(f16.clone())
    })
    .unwrap();
    let err = run(&TrainJob {
        resume: Some(saved.clone()),
        ..small_job(TrainerConfig::default())
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("saved with --amp f16 and this run uses --amp off: resume with --amp f16"),
        "{err}"
    );
    // The scaler's state is part of the manifest.
    let err = resume_altered(&dir, &saved, f16.clone(), |t, _| {
        t.retain(|k, _| !k.starts_with("scaler."))
    });
    assert!(err.contains("lacks the tensor 'scaler."), "{err}");
    run(&TrainJob {
        resume: Some(saved),
        ..small_job(f16)
    })
    .unwrap();
}

/// `job` with the model kept in bf16 and AdamW stepping f32 master copies (`--weights bf16`).
fn bf16_weights(job: TrainJob) -> TrainJob {
    TrainJob {
        weights: DType::BF16,
        ..job
    }
}

#[test]
fn resume_continues_exactly_with_bf16_weights_and_master_copies() {
    resume_matches(
        &bf16_weights(small_job(TrainerConfig::default())),
        "bf16-weights",
    );
    // Accumulation and clipping (a scale AdamW reads in its step) resume the same way.
    let trainer = TrainerConfig {
        accum: 2,
        clip: Some(0.5),
        ..TrainerConfig::default()
    };
    resume_matches(&bf16_weights(small_job(trainer)), "bf16-weights-clip");
}

/// `x` rounded to the nearest bf16 (ties to even), from its bits: the reference the check
/// below holds the stored weights to.
fn round_to_bf16(x: f32) -> f64 {
    let b = x.to_bits();
    let r = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000;
    f32::from_bits(r) as f64
}

#[test]
fn a_bf16_weights_state_holds_f32_master_copies_that_round_to_the_weights() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TestDir::new("bf16-keys");
    let saved = dir.path("bf16.safetensors");
    run(&TrainJob {
        save: Some(saved.clone()),
        stop_after: Some(2),
        ..bf16_weights(small_job(TrainerConfig::default()))
    })
    .unwrap();
    let (t, meta) = load_state(&saved).unwrap();
    assert_eq!(meta.get("weights").map(String::as_str), Some("bf16"));
    let weights: Vec<&Tensor> = t
        .iter()
        .filter(|(k, _)| k.starts_with("model."))
        .map(|(_, w)| w)
        .collect();
    let masters: Vec<(&String, &Tensor)> =
        t.iter().filter(|(k, _)| k.ends_with(".master")).collect();
    assert_eq!(masters.len(), weights.len(), "one master copy per weight");
    assert!(weights.iter().all(|w| w.dtype() == DType::BF16));
    for (k, v) in t
        .iter()
        .filter(|(k, _)| k.starts_with("optim.") && !k.ends_with(".step"))
    {
        assert_eq!(v.dtype(), DType::F32, "{k}");
    }
    // Each weight is its master copy rounded to the nearest bf16 (the step stores it so).
    let values = |w: &Tensor| w.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
    for (name, m) in masters {
        let rounded: Vec<f64> = m
            .to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(round_to_bf16)
            .collect();
        assert!(
            weights
                .iter()
                .any(|w| w.shape() == m.shape() && values(w) == rounded),
            "{name} rounds to no weight"
        );
    }
}

#[test]
fn a_state_resumes_only_with_the_weight_precision_it_was_saved_with() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TestDir::new("weights-mode");
    let half = dir.path("bf16.safetensors");
    run(&TrainJob {
        save: Some(half.clone()),
        stop_after: Some(1),
        ..bf16_weights(small_job(TrainerConfig::default()))
    })
    .unwrap();
    let before = std::fs::read(&half).unwrap();
    let err = run(&TrainJob {
        resume: Some(half.clone()),
        save: Some(half.clone()),
        ..small_job(TrainerConfig::default())
    })
    .unwrap_err();
    match &err {
        Error::WeightsMismatch {
            saved, requested, ..
        } => assert_eq!((saved.as_str(), requested.as_str()), ("bf16", "f32")),
        other => panic!("expected WeightsMismatch, got {other:?}"),
    }
    assert!(
        err.to_string().contains("resume with --weights bf16"),
        "{err}"
    );
    assert_eq!(std::fs::read(&half).unwrap(), before, "nothing overwritten");

    let full = state_after_one_step(&dir);
    let err = run(&TrainJob {
        resume: Some(full.clone()),
        ..bf16_weights(small_job(TrainerConfig::default()))
    })
    .unwrap_err();
    match &err {
        Error::WeightsMismatch {
            saved, requested, ..
        } => assert_eq!((saved.as_str(), requested.as_str()), ("f32", "bf16")),
        other => panic!("expected WeightsMismatch, got {other:?}"),
    }

    // The master copies are part of the manifest.
    let (mut tensors, meta) = load_state(&half).unwrap();
    tensors.remove("optim.0.master");
    let altered = dir.path("no-master.safetensors");
    let pairs: Vec<(String, Tensor)> = tensors.into_iter().collect();
    ferrograd::io::save_state(&altered, &pairs, meta).unwrap();
    let err = run(&TrainJob {
        resume: Some(altered),
        ..bf16_weights(small_job(TrainerConfig::default()))
    })
    .unwrap_err();
    assert!(matches!(err, Error::BadFile { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("lacks the tensor 'optim.0.master'"),
        "{err}"
    );

    // A state from before the precision was recorded is f32's.
    let (tensors, mut meta) = load_state(&full).unwrap();
    meta.remove("weights");
    let old = dir.path("old.safetensors");
    let pairs: Vec<(String, Tensor)> = tensors.into_iter().collect();
    ferrograd::io::save_state(&old, &pairs, meta).unwrap();
    run(&TrainJob {
        resume: Some(old),
        ..small_job(TrainerConfig::default())
    })
    .unwrap();
}

#[test]
fn bf16_weights_refuse_what_they_cannot_run_with() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let base = || bf16_weights(small_job(TrainerConfig::default()));
    let refused = |job: TrainJob, words: &str| {
        let err = run(&job).unwrap_err().to_string();
        assert!(err.contains(words), "{err}");
        // The planner refuses it with the same words, before anything is planned.
        let plan = job::plan_job(&job, ferrograd::plan::Target::Cpu, Default::default());
        let err = plan.unwrap_err().to_string();
        assert!(err.contains(words), "{err}");
    };
    let mut amp = base();
    amp.trainer.amp = Some(DType::BF16);
    refused(amp, "drop --amp, or use --weights f32 --amp bf16");
    let mut sgd = base();
    sgd.optimizer = OptimizerChoice::Sgd;
    refused(sgd, "SGD has none");
    let mut f16 = base();
    f16.weights = DType::F16;
    refused(f16, "use --weights bf16");
    let err = run(&TrainJob {
        zero: true,
        ..base()
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("--zero 1 shards AdamW's moments but not master weights"),
        "{err}"
    );
}
