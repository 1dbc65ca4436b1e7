//! `ferrograd launch` end to end: every rank gets the torchrun variables and its lines come
//! back prefixed `[rank K] `; a failing rank stops its siblings (and what they started) and
//! the launch exits with its status, naming it; a SIGTERM to the launcher stops every rank;
//! a program that cannot start is an error; and `train` under a launcher refuses the CPU,
//! pointing to --ranks N.

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ferrograd");

fn launch(n: &str, command: &[&str]) -> Output {
    Command::new(BIN)
        .args(["launch", "--nproc-per-node", n, "--"])
        .args(command)
        .output()
        .expect("the ferrograd binary runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Whether `pid` is a live process (a zombie waiting to be reaped is not).
fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit(')')
        .next()
        .and_then(|s| s.trim().chars().next());
    !matches!(state, Some('Z') | Some('X') | None)
}

/// The pids a rank printed as "<word> <pid>".
fn pids(out: &str, word: &str) -> Vec<u32> {
    out.lines()
        .filter_map(|l| l.split_once(&format!("] {word} ")))
        .map(|(_, pid)| pid.trim().parse().expect("a pid"))
        .collect()
}

fn gone_soon(pid: u32) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if !alive(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn launch_gives_every_rank_the_torchrun_variables_and_prefixes_its_lines() {
    let script = r#"echo "vars $RANK/$WORLD_SIZE $LOCAL_RANK/$LOCAL_WORLD_SIZE $MASTER_ADDR:$MASTER_PORT"; echo "to stderr" >&2"#;
    let out = launch("3", &["sh", "-c", script]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let mut port = None;
    for r in 0..3 {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("[rank {r}] vars {r}/3 {r}/3 127.0.0.1:")))
            .unwrap_or_else(|| panic!("no line of rank {r} in {stdout}"));
        let p: u16 = line.rsplit(':').next().unwrap().parse().unwrap();
        assert!(p != 0 && port.is_none_or(|q| q == p), "{stdout}");
        port = Some(p);
    }
    let stderr = text(&out.stderr);
    for r in 0..3 {
        assert!(
            stderr.contains(&format!("[rank {r}] to stderr\n")),
            "{stderr}"
        );
    }
}

#[test]
fn launch_passes_a_fixed_master_address_and_port() {
    let out = Command::new(BIN)
        .args([
            "launch",
            "--nproc-per-node",
            "1",
            "--master-port",
            "29999",
            "--",
        ])
        .args(["sh", "-c", "echo $MASTER_ADDR:$MASTER_PORT"])
        .output()
        .unwrap();
    assert_eq!(text(&out.stdout), "[rank 0] 127.0.0.1:29999\n");
}

#[test]
fn a_failing_rank_stops_the_others_and_sets_the_exit_status() {
    // Every rank starts a sleeper of its own (a grandchild of the launch), then rank 1 fails.
    let script = r#"sleep 60 & echo "sleeper $!"; echo "shell $$"; if [ "$RANK" = 1 ]; then sleep 0.5; exit 3; fi; wait"#;
    let start = Instant::now();
    let out = launch("3", &["sh", "-c", script]);
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "the launch waited for the sleepers"
    );
    assert_eq!(out.status.code(), Some(3));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("rank 1 exited with status 3; the other ranks were stopped"),
        "{stderr}"
    );
    let stdout = text(&out.stdout);
    let all = [pids(&stdout, "sleeper"), pids(&stdout, "shell")].concat();
    assert_eq!(all.len(), 6, "{stdout}");
    for pid in all {
        assert!(gone_soon(pid), "process {pid} outlived the launch");
    }
}

#[test]
fn a_rank_killed_by_a_signal_fails_the_launch() {
    let out = launch(
        "2",
        &[
            "sh",
            "-c",
            r#"if [ "$RANK" = 0 ]; then kill -KILL $$; fi; sleep 60"#,
        ],
    );
    assert_eq!(out.status.code(), Some(128 + 9));
    assert!(text(&out.stderr).contains("rank 0 was killed by signal 9"));
}

#[test]
fn sigterm_to_the_launch_stops_every_rank() {
    let mut launch = Command::new(BIN)
        .args(["launch", "--nproc-per-node", "2", "--", "sh", "-c"])
        .arg(r#"sleep 60 & echo "sleeper $!"; wait"#)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(launch.stdout.take().unwrap()).lines();
    let sleepers: Vec<u32> = (0..2)
        .map(|_| pids(&lines.next().unwrap().unwrap(), "sleeper")[0])
        .collect();
    let killed = Command::new("kill")
        .args(["-TERM", &launch.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = launch.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(143));
    assert!(text(&out.stderr).contains("stopped by a signal"));
    for pid in sleepers {
        assert!(gone_soon(pid), "process {pid} outlived the launch");
    }
}

#[test]
fn a_program_that_cannot_start_is_an_error() {
    let out = launch("2", &["/no/such/program"]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("cannot start rank 0: `/no/such/program`"),
        "{stderr}"
    );
}

#[test]
fn train_under_launch_on_the_cpu_points_to_ranks() {
    let out = launch("2", &[BIN, "train", "--max-steps", "1"]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("] error: this process is rank "),
        "{stderr}"
    );
    assert!(
        stderr.contains("NCCL, which needs CUDA devices"),
        "{stderr}"
    );
    assert!(stderr.contains("--ranks N"), "{stderr}");
    assert!(stderr.contains("exited with status 1"), "{stderr}");
}

#[test]
fn train_with_some_torchrun_variables_names_the_missing_ones() {
    let out = Command::new(BIN)
        .args(["train", "--max-steps", "1"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("RANK, WORLD_SIZE are set but LOCAL_RANK"),
        "{stderr}"
    );
}
