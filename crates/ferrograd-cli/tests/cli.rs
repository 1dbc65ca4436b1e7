//! The `ferrograd` command end to end: `train --json` prints the promised keys, `--optimizer
//! sgd` learns and its step in backward says it is gradient-free, and every bad spelling or
//! impossible combination (an unknown optimizer, resuming another optimizer's state) exits
//! non-zero with a message that says what to do.

use std::process::{Command, Output};

fn ferrograd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrograd"))
        .args(args)
        .output()
        .expect("the ferrograd binary runs")
}

/// A model small enough for a debug build to train three steps in a moment.
const SMALL: &[&str] = &[
    "train",
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "16",
    "--block-size",
    "16",
    "--batch-size",
    "2",
    "--max-steps",
    "3",
    "--warmup",
    "1",
    "--eval-batches",
    "1",
    "--sample-chars",
    "5",
];

fn stderr_of(args: &[&str]) -> String {
    let out = ferrograd(args);
    assert!(!out.status.success(), "{args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn train_json_reports_the_promised_fields() {
    let args = [
        SMALL,
        &["--json", "--amp", "bf16", "--recompute", "every:1"],
    ]
    .concat();
    let out = ferrograd(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in [
        "initial_loss",
        "final_loss",
        "steps",
        "tokens_per_s",
        "peak_bytes",
        "by_category_at_peak",
    ] {
        assert!(v.get(key).is_some(), "missing {key} in {v}");
    }
    assert_eq!(v["steps"], 3);
    let by_cat = v["by_category_at_peak"].as_object().unwrap();
    let total: u64 = by_cat.values().map(|b| b.as_u64().unwrap()).sum();
    assert_eq!(total, v["peak_bytes"].as_u64().unwrap());
}

#[test]
fn the_step_log_shows_loss_speed_and_memory() {
    let args = [SMALL, &["--log-every", "1", "--clip", "1.0"]].concat();
    let out = ferrograd(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let steps: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("step ") && l.contains("tok/s"))
        .collect();
    assert_eq!(steps.len(), 3, "{text}");
    for l in steps {
        assert!(
            l.contains("loss") && l.contains("MiB") && l.contains("norm"),
            "{l}"
        );
    }
}

#[test]
fn unknown_strategy_spellings_are_refused() {
    let err = stderr_of(&[SMALL, &["--recompute", "sometimes"]].concat());
    assert!(err.contains("every:K"), "{err}");
    let err = stderr_of(&[SMALL, &["--amp", "fp8"]].concat());
    assert!(err.contains("bf16, f16 or off"), "{err}");
    let err = stderr_of(&[SMALL, &["--freeze", "transformer.nothing.*"]].concat());
    assert!(err.contains("matches no parameter"), "{err}");
    let err = stderr_of(&[SMALL, &["--device", "tpu"]].concat());
    assert!(err.contains("cuda"), "{err}");
}

#[test]
fn impossible_combinations_say_why() {
    let err = stderr_of(&[SMALL, &["--step-in-backward", "--accum", "2"]].concat());
    assert!(
        err.contains("step-in-backward") && err.contains("accum"),
        "{err}"
    );
    let err = stderr_of(&[SMALL, &["--step-in-backward", "--amp", "f16"]].concat());
    assert!(err.contains("GradScaler"), "{err}");
    let err = stderr_of(&["train", "--n-head", "3", "--max-steps", "1"]);
    assert!(err.contains("multiple of n_head"), "{err}");
}

#[test]
fn a_batch_that_cannot_fit_is_an_error_not_a_crash() {
    let err = stderr_of(&[SMALL, &["--batch-size", "100000000000"]].concat());
    assert!(err.starts_with("error:"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_missing_state_file_is_an_error() {
    let err = stderr_of(&[SMALL, &["--resume", "no-such-state.safetensors"]].concat());
    assert!(err.contains("no-such-state.safetensors"), "{err}");
}

/// stdout and stderr of a run that must succeed.
fn output_of(args: &[&str]) -> String {
    let out = ferrograd(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// SMALL with the values of some of its flags replaced.
fn small_with(changes: &[(&str, &'static str)]) -> Vec<&'static str> {
    let mut args = SMALL.to_vec();
    for (flag, value) in changes {
        let at = args
            .iter()
            .position(|a| a == flag)
            .expect("a flag of SMALL");
        args[at + 1] = value;
    }
    args
}

/// SGD at a rate it learns with, over a few more steps than SMALL.
const SGD: &[&str] = &["--optimizer", "sgd", "--lr", "0.3", "--min-lr", "0.03"];

#[test]
fn sgd_trains_and_learns() {
    let small = small_with(&[("--max-steps", "8"), ("--eval-batches", "4")]);
    let out = ferrograd(&[&small, SGD, &["--json"]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["optimizer"], "SGD");
    assert_eq!(v["steps"], 8);
    let (before, after) = (
        v["initial_eval"]["train_loss"].as_f64().unwrap(),
        v["final_eval"]["train_loss"].as_f64().unwrap(),
    );
    assert!(after < before, "SGD did not learn: {before} -> {after}");
    // The default stays AdamW.
    let v: serde_json::Value =
        serde_json::from_slice(&ferrograd(&[SMALL, &["--json"]].concat()).stdout).unwrap();
    assert_eq!(v["optimizer"], "AdamW");
    assert!(v.get("step_in_backward").is_none(), "{v}");
}

#[test]
fn an_unknown_optimizer_is_refused() {
    let err = stderr_of(&[SMALL, &["--optimizer", "bogus"]].concat());
    assert!(
        err.contains("bogus") && err.contains("adamw") && err.contains("sgd"),
        "{err}"
    );
}

#[test]
fn step_in_backward_says_which_path_ran() {
    let text = output_of(&[SMALL, &["--step-in-backward", "--optimizer", "sgd"]].concat());
    assert!(
        text.contains("step in backward: fused into the weight-gradient GEMMs (SGD momentum)"),
        "{text}"
    );
    let text = output_of(&[SMALL, &["--step-in-backward"]].concat());
    assert!(
        text.contains("step in backward: per-parameter hooks (AdamW)"),
        "{text}"
    );
    // SGD with weight decay is not linear in the gradient: hooks, and the output says so.
    let args = [
        "--step-in-backward",
        "--optimizer",
        "sgd",
        "--weight-decay",
        "0.01",
    ];
    let text = output_of(&[SMALL, &args].concat());
    assert!(
        text.contains("step in backward: per-parameter hooks (SGD)"),
        "{text}"
    );
    let text = output_of(SMALL);
    assert!(!text.contains("step in backward"), "{text}");
}

#[test]
fn resuming_with_another_optimizer_is_refused() {
    let dir = std::env::temp_dir().join(format!("ferrograd-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("sgd.safetensors");
    let state = state.to_str().unwrap();
    output_of(&[SMALL, &["--optimizer", "sgd", "--save", state]].concat());
    let err = stderr_of(&[SMALL, &["--resume", state]].concat());
    assert!(
        err.contains("--optimizer sgd") && err.contains("--optimizer adamw"),
        "{err}"
    );
    // The same optimizer resumes (the run is over, so no step remains).
    output_of(&[SMALL, &["--optimizer", "sgd", "--resume", state]].concat());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fresh, empty folder for one test, removed when dropped.
struct TestDir(std::path::PathBuf);

impl TestDir {
    fn new(name: &str) -> TestDir {
        let dir = std::env::temp_dir().join(format!("ferrograd-cli-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TestDir(dir)
    }
    fn path(&self, file: &str) -> String {
        self.0.join(file).to_str().unwrap().to_string()
    }
    fn files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A long run (it would take minutes) refused at once: the check comes before any work, and
/// nothing is left behind.
fn refused_at_once(args: &[&str]) -> String {
    let long = small_with(&[("--max-steps", "100000")]);
    let started = std::time::Instant::now();
    let err = stderr_of(&[&long, args].concat());
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "refused only after {:?}: {err}",
        started.elapsed()
    );
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn unwritable_save_paths_are_refused_before_training() {
    let err = refused_at_once(&["--save", "/proc/x"]);
    assert!(
        err.contains("cannot save to /proc/x") && err.contains("folder you can write to"),
        "{err}"
    );
    let dir = TestDir::new("save-paths");
    let folder = dir.path("");
    let err = refused_at_once(&["--save", &folder]);
    assert!(
        err.contains("it is a folder; name a file inside it"),
        "{err}"
    );
    let missing = dir.path("no/such/state.safetensors");
    let err = refused_at_once(&["--save", &missing]);
    assert!(
        err.contains("does not exist; create it first (mkdir -p"),
        "{err}"
    );
    assert!(dir.files().is_empty(), "{:?}", dir.files());
}

#[test]
fn saving_over_a_device_is_refused() {
    let err = refused_at_once(&["--save", "/dev/null"]);
    assert!(
        err.contains("cannot save to /dev/null: it is not a regular file"),
        "{err}"
    );
    let meta = std::fs::metadata("/dev/null").unwrap();
    assert!(!meta.is_file(), "/dev/null was replaced by a regular file");
}
