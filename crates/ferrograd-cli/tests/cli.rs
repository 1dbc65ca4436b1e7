//! The `ferrograd` command end to end: `train --json` prints the promised keys (and the
//! leak check's verdict with `--detect-leaks`), `--optimizer sgd` learns and its step in
//! backward says it is gradient-free, and every bad spelling or impossible combination (an
//! unknown optimizer, resuming another optimizer's state) exits non-zero with a message that
//! says what to do. Bad files and settings that leave nothing to do (an unwritable --save, a
//! device as --save or --text, --max-steps 0, a text too short) are refused before any
//! training, and a signal stops a run with its state saved and exit 130/143.

use std::process::{Command, Output};

#[path = "../../ferrograd/tests/common/test_dir.rs"]
mod test_dir;

use test_dir::TestDir;

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
        "weights",
        "master_weights",
    ] {
        assert!(v.get(key).is_some(), "missing {key} in {v}");
    }
    assert_eq!(v["steps"], 3);
    // Autocast leaves the weights in f32, with no master copies.
    assert_eq!(
        (&v["weights"], &v["master_weights"]),
        (&"f32".into(), &false.into())
    );
    assert_eq!(v["recompute"], "every:1");
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
fn detect_leaks_watches_every_step_and_finds_nothing_in_the_main_job() {
    let small = small_with(&[("--max-steps", "12")]);
    let strategies = [
        "--detect-leaks",
        "--accum",
        "2",
        "--clip",
        "1.0",
        "--amp",
        "f16",
    ];
    let out = ferrograd(&[&small, &strategies[..], &["--json"]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["leak_check"]["steps"], 12, "{v}");
    assert_eq!(v["leak_check"]["clean"], true, "{v}");
    assert_eq!(v["leak_check"]["leaks"].as_array().map(Vec::len), Some(0));
    let text = output_of(&[&small, &["--detect-leaks"][..]].concat());
    assert!(
        text.contains("leak check: no memory grows after warm-up (12 steps)"),
        "{text}"
    );
    // Without the flag the summary has no leak_check.
    let v: serde_json::Value =
        serde_json::from_slice(&ferrograd(&[SMALL, &["--json"]].concat()).stdout).unwrap();
    assert!(v.get("leak_check").is_none(), "{v}");
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

/// An f16 run says where its loss-scaling decisions are made: on the CPU, by the host,
/// which reads the inf/NaN check before every step (a GPU run keeps them on the device).
#[test]
fn f16_loss_scaling_says_where_it_is_decided() {
    let text = output_of(&[SMALL, &["--amp", "f16"]].concat());
    assert!(
        text.contains(
            "f16 loss scaling: decided on the host (the inf/NaN check is read before every step)"
        ),
        "{text}"
    );
    let text = output_of(SMALL);
    assert!(!text.contains("loss scaling"), "{text}");
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

/// A long run (it would take minutes) refused at once: the check comes before any work.
/// `args` are flag-value pairs, replacing SMALL's values of the same flags.
fn refused_at_once(args: &[&str]) -> String {
    let mut long: Vec<String> = small_with(&[("--max-steps", "100000")])
        .iter()
        .map(|s| s.to_string())
        .collect();
    for pair in args.chunks(2) {
        match long.iter().position(|a| a == pair[0]) {
            Some(at) => long[at + 1] = pair[1].to_string(),
            None => long.extend(pair.iter().map(|s| s.to_string())),
        }
    }
    let long: Vec<&str> = long.iter().map(String::as_str).collect();
    let started = std::time::Instant::now();
    let err = stderr_of(&long);
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
    let dir = TestDir::new("cli-save-paths");
    let folder = dir.arg("");
    let err = refused_at_once(&["--save", &folder]);
    assert!(
        err.contains("it is a folder; name a file inside it"),
        "{err}"
    );
    let missing = dir.arg("no/such/state.safetensors");
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

#[test]
fn text_must_be_a_regular_file_of_bounded_size() {
    let err = refused_at_once(&["--text", "/dev/zero"]);
    assert!(
        err.contains("bad file /dev/zero: not a regular file"),
        "{err}"
    );
    let dir = TestDir::new("cli-big-text");
    let big = dir.arg("big.txt");
    std::fs::File::create(&big)
        .unwrap()
        .set_len((256 << 20) + 1)
        .unwrap();
    let err = refused_at_once(&["--text", &big]);
    assert!(
        err.contains("is larger than the 256.00 MiB a text may be"),
        "{err}"
    );
    let help = output_of(&["train", "--help"]);
    assert!(help.contains("at most 256 MiB"), "{help}");
}

#[test]
fn settings_that_leave_nothing_to_do_are_refused_up_front() {
    for (args, says) in [
        (
            &["--freeze", "*"][..],
            "match every parameter: nothing is left to train",
        ),
        (
            &["--device", "meta"],
            "the meta device holds shapes but no data, so it cannot train",
        ),
        (
            &["--eval-batches", "0"],
            "--eval-batches 0 cannot measure a loss",
        ),
        (
            &["--max-steps", "0"],
            "--max-steps 0 leaves nothing to train",
        ),
        (
            &["--stop-after", "0"],
            "--stop-after 0 leaves nothing to train",
        ),
    ] {
        let err = refused_at_once(args);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

#[test]
fn a_text_too_short_says_so() {
    let dir = TestDir::new("cli-short-text");
    let one = dir.arg("one.txt");
    std::fs::write(&one, "a").unwrap();
    let err = refused_at_once(&["--text", &one]);
    assert!(
        err.contains("the text is too short for any block size")
            && err.contains("at least 16 characters"),
        "{err}"
    );
    // Sixteen characters is enough for a block size of one, and the advice says that.
    let short = dir.arg("short.txt");
    std::fs::write(&short, "abcdefghijklmnop").unwrap();
    let err = refused_at_once(&["--text", &short]);
    assert!(err.contains("use --block-size 1 or less"), "{err}");
    output_of(
        &[
            &small_with(&[("--block-size", "1")]),
            &["--text", &short][..],
        ]
        .concat(),
    );
}

#[test]
fn resuming_a_finished_state_says_it_is_finished() {
    let dir = TestDir::new("cli-finished");
    let state = dir.arg("state.safetensors");
    output_of(&[SMALL, &["--save", &state]].concat());
    let out = output_of(&[SMALL, &["--resume", &state]].concat());
    assert!(
        out.contains("is already finished: it reached step 3 of --max-steps 3")
            && !out.contains("NaN"),
        "{out}"
    );
    let out = output_of(&[SMALL, &["--resume", &state, "--json"]].concat());
    assert!(out.contains("\"already_finished\":true"), "{out}");
}

/// Sends `signal` to a run once it has started training, and returns its exit status and
/// stderr.
fn interrupt(signal: &str, args: &[&str]) -> (Option<i32>, String) {
    use std::io::{BufRead, BufReader};
    let long = small_with(&[("--max-steps", "100000"), ("--eval-batches", "1")]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrograd"))
        .args([&long, args].concat())
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut err = String::new();
    // The first evaluation's line: training is under way.
    for line in lines.by_ref() {
        let line = line.unwrap();
        err += &line;
        err += "\n";
        if line.contains("train loss") {
            break;
        }
    }
    let status = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    for line in lines {
        err += &line.unwrap();
        err += "\n";
    }
    (child.wait().unwrap().code(), err)
}

#[test]
fn a_signal_stops_the_run_saves_and_exits_with_the_conventional_code() {
    let dir = TestDir::new("cli-signals");
    let state = dir.arg("state.safetensors");
    let (code, err) = interrupt("-INT", &["--save", &state]);
    assert_eq!(code, Some(130), "{err}");
    assert!(
        err.contains("error: interrupted at step")
            && err.contains(&format!("continue with --resume {state}")),
        "{err}"
    );
    assert_eq!(dir.files(), ["state.safetensors"]);
    let (code, err) = interrupt("-TERM", &[]);
    assert_eq!(code, Some(143), "{err}");
    assert!(
        err.contains("nothing was saved (no --save was given)"),
        "{err}"
    );
}

/// The three files a trace folder receives.
const TRACE_FILES: [&str; 3] = [
    "memory_report.html",
    "memory_snapshot.pickle",
    "memory_trace.json",
];

fn names_in(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn train_and_demo_write_a_memory_trace() {
    let dir = TestDir::new("cli-memory-trace");
    let train_dir = dir.arg("train");
    // Batch 8: activations, not the optimizer's first moments, make the recorded step's peak,
    // so the largest blocks there are saved activations of the blocks.
    let args = [
        small_with(&[("--batch-size", "8")]).as_slice(),
        &["--memory-trace", &train_dir, "--memory-trace-steps", "1"],
    ]
    .concat();
    let out = output_of(&args);
    assert!(
        out.contains("memory trace: ") && out.contains("nothing was dropped"),
        "{out}"
    );
    assert_eq!(names_in(&dir.path("train")), TRACE_FILES);
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path("train/memory_trace.json")).unwrap())
            .unwrap();
    let slices: Vec<&str> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .filter_map(|e| e["name"].as_str())
        .collect();
    // One step: forward, backward, optimizer, each once.
    for phase in ["forward", "backward", "optimizer"] {
        assert_eq!(
            slices.iter().filter(|s| **s == phase).count(),
            1,
            "{slices:?}"
        );
    }
    let html = std::fs::read_to_string(dir.path("train/memory_report.html")).unwrap();
    assert!(
        html.contains("transformer.h.0"),
        "the blocks name their module"
    );
    let demo_dir = dir.arg("demo");
    let out = output_of(&[
        "demo",
        "--dim",
        "32",
        "--batch",
        "4",
        "--json",
        "--memory-trace",
        &demo_dir,
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["memory_trace"].as_array().unwrap().len(), 4, "{v}");
    assert_eq!(names_in(&dir.path("demo")), TRACE_FILES);
}

#[test]
fn unusable_memory_trace_folders_are_refused_before_training() {
    let dir = TestDir::new("cli-memory-trace-bad");
    let missing = dir.arg("no/such/trace");
    let err = refused_at_once(&["--memory-trace", &missing]);
    assert!(err.contains("does not exist; create it first"), "{err}");
    std::fs::write(dir.path("file"), b"x").unwrap();
    let err = refused_at_once(&["--memory-trace", &dir.arg("file")]);
    assert!(err.contains("is a file, not a folder"), "{err}");
    let err = refused_at_once(&["--memory-trace", &dir.arg("t"), "--memory-trace-steps", "0"]);
    assert!(
        err.contains("--memory-trace-steps 0 records nothing"),
        "{err}"
    );
    let err = stderr_of(&["train", "--memory-trace-steps", "many"]);
    assert!(err.contains("invalid value 'many'"), "{err}");
    let err = stderr_of(&["demo", "--dim", "8", "--memory-trace", &missing]);
    assert!(err.contains("does not exist; create it first"), "{err}");
    assert_eq!(
        names_in(&dir.path("")),
        ["file"],
        "nothing half-written is left"
    );
}

#[test]
fn the_attention_path_is_chosen_by_flag_and_reported() {
    let text = output_of(SMALL);
    assert!(
        text.contains("attention: fused kernel (saves one log-sum-exp per query"),
        "{text}"
    );
    let text = output_of(&[SMALL, &["--attention", "composed"]].concat());
    assert!(
        text.contains("attention: matmul, softmax, matmul (saves the (B, H, T, T) probabilities)"),
        "{text}"
    );
    let err = stderr_of(&[SMALL, &["--attention", "flash"]].concat());
    assert!(err.contains("fused") && err.contains("composed"), "{err}");
}

/// A plan for an 80 GiB GPU on a machine that has none.
const GPU_80GIB: [&str; 4] = ["--device", "cuda", "--device-memory", "80GiB"];

/// SMALL as `plan` flags (the same flags as `train`), with two layers: with one, the peak
/// is the head's backward, which recomputing the only block cannot lower.
fn plan_args(extra: &[&'static str]) -> Vec<&'static str> {
    let mut args = small_with(&[("--n-layer", "2")]);
    args[0] = "plan";
    args.extend_from_slice(extra);
    args
}

#[test]
fn plan_predicts_the_peak_that_train_measures() {
    let out = ferrograd(&plan_args(&["--json"]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut train = plan_args(&["--json"]);
    train[0] = "train";
    let out = ferrograd(&train);
    let run: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(plan["plan"]["peak_allocated"], run["peak_bytes"]);
    assert_eq!(
        plan["plan"]["by_category_at_peak"],
        run["by_category_at_peak"]
    );
    assert_eq!(run["predicted_peak_bytes"], run["peak_bytes"]);
    let alternatives = plan["alternatives"].as_array().unwrap();
    assert!(alternatives.len() > 5, "{plan}");
    assert!(
        alternatives
            .iter()
            .any(|a| a["flags"] == "--recompute every:1"
                && a["peak_allocated"].as_u64() < plan["plan"]["peak_allocated"].as_u64()),
        "{plan}"
    );
    assert!(plan["plan"]["at_peak"]["op"].is_string(), "{plan}");
}

#[test]
fn plan_prints_the_breakdown_the_phases_and_the_alternatives() {
    let text = output_of(&plan_args(&["--amp", "bf16"]));
    for needle in [
        "plan for cpu",
        "bf16 autocast",
        "peak allocated",
        "the peak is reached in step",
        "saved_activation",
        "peak of each phase",
        "backward",
        "alternatives",
        "--recompute every:1",
    ] {
        assert!(text.contains(needle), "{needle} missing in\n{text}");
    }
}

#[test]
fn plan_for_a_gpu_needs_no_gpu_when_given_its_memory() {
    let text = output_of(&plan_args(&GPU_80GIB));
    assert!(text.contains("plan for cuda (80.00 GiB)"), "{text}");
    assert!(
        text.contains("workspace"),
        "cuBLAS's workspace is planned: {text}"
    );
    let err = stderr_of(&plan_args(&["--device-memory", "80GiB"]));
    assert!(err.contains("--device cuda"), "{err}");
    let err = stderr_of(&plan_args(&["--device", "cuda", "--device-memory", "lots"]));
    assert!(err.contains("80GiB"), "{err}");
}

/// `--recompute auto` (the default) rebuilds each MLP's GELU output on a GPU and recomputes
/// nothing on the CPU; the plan says which it took and offers the other, whose peak is higher.
#[test]
fn the_default_recomputation_is_the_gelu_on_a_gpu_and_nothing_on_the_cpu() {
    let gpu = |extra: &[&'static str]| {
        let mut args = [GPU_80GIB.as_slice(), &["--json"]].concat();
        args.extend_from_slice(extra);
        let out = ferrograd(&plan_args(&args));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let (auto, gelu, off) = (
        gpu(&[]),
        gpu(&["--recompute", "gelu"]),
        gpu(&["--recompute", "off"]),
    );
    let peak = |p: &serde_json::Value| p["plan"]["peak_allocated"].as_u64().unwrap();
    assert_eq!(peak(&auto), peak(&gelu), "auto is gelu on a GPU");
    assert!(
        peak(&auto) < peak(&off),
        "{} vs {}",
        peak(&auto),
        peak(&off)
    );
    let offered = |p: &serde_json::Value, flags: &str| {
        p["alternatives"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["flags"] == flags)
            .map(|a| a["peak_allocated"].as_u64().unwrap())
    };
    assert_eq!(offered(&auto, "--recompute off"), Some(peak(&off)));
    assert_eq!(offered(&auto, "--recompute gelu"), None);
    assert_eq!(offered(&off, "--recompute gelu"), Some(peak(&gelu)));
    let text = output_of(&plan_args(&GPU_80GIB));
    assert!(text.contains("recompute gelu"), "{text}");
    let text = output_of(&plan_args(&[]));
    assert!(
        text.contains("plan for cpu") && text.contains("recompute off"),
        "{text}"
    );
    let err = stderr_of(&plan_args(&["--recompute", "sometimes"]));
    assert!(err.contains("'auto'"), "{err}");
    // The run's log says what was chosen, and whether it was asked for.
    let text = output_of(SMALL);
    assert!(text.contains("recompute: off (auto on cpu)"), "{text}");
    let text = output_of(&[SMALL, &["--recompute", "gelu"]].concat());
    assert!(text.contains("recompute: gelu\n"), "{text}");
}

/// A GPU budget search whose trials run out of memory inside backward, between a layer norm's
/// backward and the Linear that takes its column sums (the main job's model with the GELU
/// recomputed, --recompute auto on a GPU): each failed trial must leave nothing alive for the
/// next one to find.
#[test]
fn a_gpu_budget_search_survives_trials_that_run_out_in_backward() {
    let text = output_of(&[
        "plan",
        "--device",
        "cuda",
        "--device-memory",
        "512MiB",
        "--budget",
        "512MiB",
        "--amp",
        "bf16",
        "--batch-steps",
        "any",
    ]);
    assert!(text.contains("recompute gelu"), "{text}");
    let largest = text
        .lines()
        .skip_while(|l| !l.starts_with("largest micro-batch"))
        .find(|l| l.trim_start().starts_with("(as given)"))
        .unwrap_or_else(|| panic!("no largest batch in\n{text}"));
    let batch: usize = largest.split_whitespace().nth(2).unwrap().parse().unwrap();
    assert!(batch > 16, "{largest}");
}

/// The reserved peaks GPT-2 124M runs (bf16 autocast, T 1024, three steps, CUDA graphs) made
/// on an NVIDIA H200 (driver 580, CUDA 13), read from `ferrograd train --json`
/// (`peak_reserved_bytes`): the plan must give the same bytes. With the GELU recomputed, a
/// plan whose simulated driver handed out increasing addresses reserved one (B·T, 4C)
/// segment less at B 64 than the run (the real driver's segments go downwards, and the
/// allocator breaks ties between free blocks by address).
#[test]
fn gpt2_plans_reserve_what_the_h200_runs_reserved() {
    for (batch, recompute, measured) in [
        ("8", "gelu", 4_452_253_696u64),
        ("64", "gelu", 20_480_786_432),
        ("64", "off", 25_111_298_048),
    ] {
        let out = ferrograd(&[
            "plan",
            "--device",
            "cuda",
            "--device-memory",
            "143771MiB",
            "--n-layer",
            "12",
            "--n-head",
            "12",
            "--n-embd",
            "768",
            "--block-size",
            "1024",
            "--vocab-size",
            "50257",
            "--amp",
            "bf16",
            "--max-steps",
            "3",
            "--warmup",
            "1",
            "--eval-every",
            "0",
            "--eval-batches",
            "1",
            "--json",
            "--batch-size",
            batch,
            "--recompute",
            recompute,
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            plan["plan"]["peak_reserved"].as_u64(),
            Some(measured),
            "B {batch}, --recompute {recompute}"
        );
    }
}

#[test]
fn plan_lists_what_fits_a_budget_and_says_what_a_tiny_one_needs() {
    let out = ferrograd(&plan_args(&["--budget", "2MiB", "--json"]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["budget"].as_array().unwrap();
    assert!(rows.len() >= 3, "{v}");
    for r in rows {
        if let Some(b) = r["batch_size"].as_u64() {
            assert!(b.is_power_of_two(), "{r}");
            assert!(r["peak_reserved"].as_u64().unwrap() <= 2 << 20, "{r}");
        }
    }
    let any = ferrograd(&plan_args(&[
        "--budget",
        "2MiB",
        "--batch-steps",
        "any",
        "--json",
    ]));
    let v_any: serde_json::Value = serde_json::from_slice(&any.stdout).unwrap();
    let largest = |v: &serde_json::Value| v["budget"][0]["batch_size"].as_u64().unwrap();
    assert!(largest(&v_any) >= largest(&v), "{v_any}");
    let err = stderr_of(&plan_args(&["--budget", "10KiB"]));
    assert!(
        err.contains("parameters alone are more than the budget") && err.contains("at least"),
        "{err}"
    );
}

#[test]
fn train_fit_budget_picks_a_configuration_and_stays_within_it() {
    let args = [
        &small_with(&[("--batch-size", "64")])[..],
        &["--fit-budget", "1MiB", "--json"],
    ]
    .concat();
    let out = ferrograd(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("fit to 1024.00 KiB") && err.contains("rule:"),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["peak_bytes"].as_u64().unwrap() <= 1 << 20, "{v}");
    assert_eq!(v["peak_bytes"], v["predicted_peak_bytes"]);
}

#[test]
fn plan_refuses_what_train_refuses_with_the_same_words() {
    for bad in [
        &["--recompute", "sometimes"][..],
        &["--step-in-backward", "--accum", "2"][..],
        &["--freeze", "transformer.nothing.*"][..],
        &["--weights", "bf16", "--amp", "bf16"][..],
        &["--weights", "bf16", "--optimizer", "sgd"][..],
        &["--weights", "f16"][..],
    ] {
        let train_err = stderr_of(&[SMALL, bad].concat());
        let plan_err = stderr_of(&plan_args(bad));
        assert_eq!(plan_err, train_err, "{bad:?}");
    }
    let err = stderr_of(&plan_args(&["--n-embd", "4294967296", "--n-head", "1"]));
    assert!(
        err.starts_with("error:") && !err.contains("panicked"),
        "{err}"
    );
    let err = stderr_of(&plan_args(&["--vocab-size", "3"]));
    assert!(err.contains("--vocab-size"), "{err}");
    let err = stderr_of(&plan_args(&["--fit-budget", "1GiB"]));
    assert!(err.contains("plan --budget"), "{err}");
}

/// `--ranks 2` trains on two in-process ranks and reports each rank's peak by category, in
/// the report side by side and in the JSON; `--zero 1` shards AdamW's state; on a GPU it is
/// refused, pointing to NCCL.
#[test]
fn ranks_train_data_parallel_on_the_cpu() {
    let out = ferrograd(&[SMALL, &["--ranks", "2", "--json"]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    for r in ranks {
        assert!(r["by_category_at_peak"]["gradient"].as_u64().unwrap() > 0);
    }
    let report = ferrograd(&[SMALL, &["--ranks", "2", "--log-every", "1"]].concat());
    let text = String::from_utf8_lossy(&report.stdout);
    assert!(
        text.contains("peak per rank") && text.contains("rank 1"),
        "{text}"
    );
    // Step lines go where the progress bar draws (stderr).
    let log = String::from_utf8_lossy(&report.stderr);
    let step_lines = log.lines().filter(|l| l.contains(" | rank peaks ")).count();
    assert_eq!(step_lines, 3, "every step logs each rank's peak: {log}");
    assert!(
        text.contains("for one process without data parallelism"),
        "{text}"
    );
    let zero = ferrograd(&[SMALL, &["--ranks", "2", "--zero", "1", "--json"]].concat());
    assert!(
        zero.status.success(),
        "{}",
        String::from_utf8_lossy(&zero.stderr)
    );
    let err = stderr_of(&[SMALL, &["--ranks", "2", "--device", "cuda"]].concat());
    assert!(err.contains("NCCL") && err.contains("--ranks"), "{err}");
}

#[test]
fn zero_state_is_saved_whole_and_resumes_on_any_number_of_ranks() {
    let dir = TestDir::new("cli-zero-state");
    let state = dir.arg("zero.safetensors");
    let first = small_with(&[("--max-steps", "2")]);
    let out = ferrograd(
        &[
            &first[..],
            &["--ranks", "2", "--zero", "1", "--save", &state],
        ]
        .concat(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The gathered state is plain AdamW's: one process without --zero resumes it, and so
    // do four sharded ranks (each takes its new shard).
    for extra in [&["--json"][..], &["--ranks", "4", "--zero", "1", "--json"]] {
        let out = ferrograd(&[SMALL, &["--resume", &state], extra].concat());
        assert!(
            out.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["steps"], 1, "{v}");
        assert_eq!(v["step_reached"], 3, "{v}");
        assert!(v["final_loss"].as_f64().unwrap().is_finite(), "{v}");
    }
}

/// The tensors of a saved state, as f64 values (exact for every float dtype it holds).
fn state_values(path: &str) -> Vec<(String, Vec<f64>)> {
    let (tensors, _) = ferrograd::io::load_state(std::path::Path::new(path)).unwrap();
    let mut v: Vec<(String, Vec<f64>)> = tensors
        .into_iter()
        .map(|(k, t)| {
            (
                k,
                t.to_dtype(ferrograd::DType::F64).unwrap().to_vec().unwrap(),
            )
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// `--weights bf16`: the report and the JSON say so, the plan predicts the measured peak to the
/// byte, a run stopped and resumed ends bit for bit where an uninterrupted one does (the master
/// copies travel in the state), and the state resumes only with the same --weights.
#[test]
fn weights_bf16_trains_plans_and_resumes_with_master_copies() {
    let bf16 = ["--weights", "bf16"];
    let out = ferrograd(&plan_args(&["--weights", "bf16", "--json"]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut train = plan_args(&["--weights", "bf16", "--json"]);
    train[0] = "train";
    let run: serde_json::Value = serde_json::from_slice(&ferrograd(&train).stdout).unwrap();
    assert_eq!(plan["plan"]["peak_allocated"], run["peak_bytes"], "{run}");
    assert_eq!(
        plan["plan"]["by_category_at_peak"],
        run["by_category_at_peak"]
    );
    assert_eq!(
        (&run["weights"], &run["master_weights"]),
        (&"bf16".into(), &true.into())
    );
    let text = output_of(&[SMALL, &bf16].concat());
    assert!(
        text.contains("weights: bf16, with f32 master copies and f32 moments in AdamW"),
        "{text}"
    );

    let dir = TestDir::new("cli-bf16-weights");
    let (straight, half, resumed) = (dir.arg("a"), dir.arg("b"), dir.arg("c"));
    let json = |extra: &[&str]| -> serde_json::Value {
        let out = output_of(&[SMALL, &bf16, &["--json"], extra].concat());
        serde_json::from_str(out.lines().find(|l| l.starts_with('{')).unwrap()).unwrap()
    };
    let all = json(&["--save", &straight]);
    json(&["--stop-after", "2", "--save", &half]);
    let tail = json(&["--resume", &half, "--save", &resumed]);
    assert_eq!(tail["steps"], 1, "{tail}");
    assert_eq!(all["final_loss"], tail["final_loss"]);
    let (a, c) = (state_values(&straight), state_values(&resumed));
    assert!(a.iter().any(|(k, _)| k.ends_with(".master")), "{a:?}");
    assert_eq!(a, c, "the resumed state, bit for bit");

    let err = stderr_of(&[SMALL, &["--resume", &half]].concat());
    assert!(
        err.contains("--weights bf16") && err.contains("this run uses --weights f32"),
        "{err}"
    );
}

/// `info` names the kernel cache's folder as the environment sets it, or says it is off.
#[test]
fn info_says_where_kernels_are_cached() {
    let dir = TestDir::new("kernel-cache-info");
    let run = |value: &std::ffi::OsStr| {
        let out = Command::new(env!("CARGO_BIN_EXE_ferrograd"))
            .arg("info")
            .env("FERROGRAD_KERNEL_CACHE", value)
            .output()
            .expect("the ferrograd binary runs");
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let folder = dir.path("kernels");
    let placed = run(folder.as_os_str());
    let line = placed
        .lines()
        .find(|l| l.starts_with("kernels"))
        .unwrap_or_else(|| panic!("no kernels line in:\n{placed}"));
    assert!(line.contains(&folder.display().to_string()), "{line}");
    assert!(line.contains("0 modules"), "{line}");
    assert!(line.contains("0 tuned GEMM problems"), "{line}");
    // Two GEMM choices an earlier run stored, and a line cut short that is not one.
    std::fs::create_dir_all(&folder).unwrap();
    let problem = "4 14 14 68 8192 2304 768 0 1 768 768 256 256 256 256 256 0";
    std::fs::write(
        folder.join("gemm-choices-NVIDIA_H100-cublaslt130100.txt"),
        format!(
            "{problem} 3\n{} 0\n4 14 14 68 81\n",
            problem.replace("2304", "768")
        ),
    )
    .unwrap();
    let stored = run(folder.as_os_str());
    assert!(stored.contains("2 tuned GEMM problems"), "{stored}");
    let off = run(std::ffi::OsStr::new("off"));
    assert!(off.contains("kernels  not cached"), "{off}");
}
