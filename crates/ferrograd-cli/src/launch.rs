//! `ferrograd launch --nproc-per-node N -- COMMAND...`: starts N local processes, one per
//! rank, with the variables torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE,
//! LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), prefixes every line they print with
//! `[rank K] `, and, when one exits with a failure, stops the others and exits with that
//! rank's status. Single node only; no restarts; rank 0 hosts the rendezvous store itself.
//!
//! Each rank runs in a process group of its own, so stopping a rank (SIGTERM, then SIGKILL
//! after --grace-period) reaches whatever it started too, and nothing outlives the launch.
//! Because the ranks are then outside the terminal's group, Ctrl-C reaches only this process,
//! which passes it on as the same stop.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use ferrograd::dist::LaunchEnv;

/// How often the launcher looks at its ranks (std has no wait-for-any-child).
const POLL: Duration = Duration::from_millis(20);

#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// Processes to start on this machine, one per rank (one per GPU).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    nproc_per_node: u64,
    /// Address of rank 0, where the ranks meet.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store rank 0 hosts; 0 picks a free one.
    #[arg(long, default_value_t = 0)]
    master_port: u16,
    /// Seconds a rank has to exit after SIGTERM (time to save its state) before SIGKILL.
    #[arg(long, default_value_t = 30)]
    grace_period: u64,
    /// The command every rank runs, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<String>,
}

/// A rank failed (or a signal stopped the launch): the launch exits with `exit_code`.
#[derive(Debug)]
pub struct LaunchFailed {
    pub exit_code: u8,
    what: String,
}

impl std::fmt::Display for LaunchFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.what)
    }
}

impl std::error::Error for LaunchFailed {}

/// A running rank and the threads copying its output.
struct Rank {
    child: Child,
    status: Option<ExitStatus>,
    copiers: Vec<JoinHandle<()>>,
}

pub fn run(a: LaunchArgs) -> anyhow::Result<()> {
    let stop = stop_on_signals()?;
    let port = match a.master_port {
        0 => free_port(&a.master_addr)?,
        p => p,
    };
    let world = a.nproc_per_node as usize;
    let mut ranks = Vec::with_capacity(world);
    for rank in 0..world {
        let env = LaunchEnv {
            rank,
            local_rank: rank,
            world_size: world,
            local_world_size: world,
            master_addr: a.master_addr.clone(),
            master_port: port,
            use_agent_store: false,
            restart_count: 0,
        };
        match spawn(&a.command, &env) {
            Ok(r) => ranks.push(r),
            Err(e) => {
                stop_all(&mut ranks, Duration::from_secs(a.grace_period));
                return Err(e);
            }
        }
    }
    let outcome = supervise(&mut ranks, &stop);
    // After success too: what a finished rank left running would hold its output pipes open
    // (and outlive the launch).
    stop_all(&mut ranks, Duration::from_secs(a.grace_period));
    for r in &mut ranks {
        r.copiers.drain(..).for_each(|h| drop(h.join()));
    }
    outcome
}

/// A port nobody listens on now (the ranks bind it a moment later; the kernel hands out
/// ephemeral ports at random, so another process taking it in between is unlikely).
fn free_port(addr: &str) -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind((addr, 0))
        .or_else(|_| std::net::TcpListener::bind(("0.0.0.0", 0)))
        .map_err(|e| anyhow::anyhow!("cannot find a free port ({e}); pass --master-port"))?;
    Ok(l.local_addr()?.port())
}

fn spawn(command: &[String], env: &LaunchEnv) -> anyhow::Result<Rank> {
    let (program, args) = command
        .split_first()
        .context("no command to launch after `--`")?;
    let mut child = Command::new(program)
        .args(args)
        .envs(env.to_vars())
        // Our rank 0 hosts its own store: an outer torchrun's agent store is not ours.
        .env_remove("TORCHELASTIC_USE_AGENT_STORE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot start rank {}: `{program}`: {e}", env.rank))?;
    let mut copiers = Vec::new();
    if let Some(out) = child.stdout.take() {
        copiers.push(copy_lines(out, env.rank, false));
    }
    if let Some(err) = child.stderr.take() {
        copiers.push(copy_lines(err, env.rank, true));
    }
    Ok(Rank {
        child,
        status: None,
        copiers,
    })
}

/// Copies a rank's output line by line with its `[rank K] ` prefix. Whole lines under the
/// lock, so the ranks' lines never interleave mid-line; bytes, not text, so output that is
/// not UTF-8 passes through.
fn copy_lines(from: impl Read + Send + 'static, rank: usize, stderr: bool) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(from);
        let prefix = format!("[rank {rank}] ");
        let mut line = Vec::new();
        while matches!(reader.read_until(b'\n', &mut line), Ok(n) if n > 0) {
            if line.last() != Some(&b'\n') {
                line.push(b'\n');
            }
            let mut out = prefix.clone().into_bytes();
            out.extend_from_slice(&line);
            // A closed stdout (`| head`) must not stop the ranks: drop what cannot be written.
            let _ = if stderr {
                std::io::stderr().lock().write_all(&out)
            } else {
                std::io::stdout().lock().write_all(&out)
            };
            line.clear();
        }
    })
}

/// Waits for every rank to finish; the first failure (or a stop signal) ends the wait.
fn supervise(ranks: &mut [Rank], stop: &Signals) -> anyhow::Result<()> {
    loop {
        if let Some(code) = stop.code() {
            return Err(LaunchFailed {
                exit_code: code,
                what: format!(
                    "stopped by a signal: the {} ranks were stopped",
                    ranks.len()
                ),
            }
            .into());
        }
        for (rank, r) in ranks.iter_mut().enumerate() {
            if r.status.is_some() {
                continue;
            }
            r.status = r
                .child
                .try_wait()
                .map_err(|e| anyhow::anyhow!("cannot wait for rank {rank}: {e}"))?;
            match r.status {
                Some(s) if !s.success() => return Err(failure(rank, s, ranks.len()).into()),
                _ => {}
            }
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            return Ok(());
        }
        std::thread::sleep(POLL);
    }
}

fn failure(rank: usize, s: ExitStatus, world: usize) -> LaunchFailed {
    let (exit_code, how) = match (s.code(), s.signal()) {
        (Some(c), _) => (c.clamp(1, 255) as u8, format!("exited with status {c}")),
        (None, Some(sig)) => (
            (128 + sig).clamp(1, 255) as u8,
            format!("was killed by signal {sig}"),
        ),
        (None, None) => (1, format!("ended with {s}")),
    };
    let others = match world {
        1 => String::new(),
        _ => "; the other ranks were stopped".to_string(),
    };
    LaunchFailed {
        exit_code,
        what: format!("rank {rank} {how}{others}"),
    }
}

/// SIGTERM to every rank's process group, up to `grace` for the ranks to exit, then SIGKILL
/// to every group (also what a finished rank left running), and reap.
fn stop_all(ranks: &mut [Rank], grace: Duration) {
    signal_groups(ranks, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && !all_exited(ranks) {
        std::thread::sleep(POLL);
    }
    signal_groups(ranks, libc::SIGKILL);
    for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
        r.status = r.child.wait().ok();
    }
}

fn all_exited(ranks: &mut [Rank]) -> bool {
    ranks.iter_mut().all(|r| {
        if r.status.is_none() {
            r.status = r.child.try_wait().ok().flatten();
        }
        r.status.is_some()
    })
}

fn signal_groups(ranks: &[Rank], signal: libc::c_int) {
    for r in ranks {
        // Each rank leads its own group (process_group(0)), whose id is its pid.
        let group = r.child.id() as libc::pid_t;
        // SAFETY: kill(2) takes plain integers and touches no memory of ours; a group that
        // no longer exists is an ESRCH we ignore.
        unsafe {
            libc::kill(-group, signal);
        }
    }
}

/// SIGINT and SIGTERM to the launcher: the ranks are stopped and it exits 130 or 143.
struct Signals {
    int: Arc<AtomicBool>,
    term: Arc<AtomicBool>,
}

impl Signals {
    fn code(&self) -> Option<u8> {
        if self.term.load(Ordering::SeqCst) {
            Some(143)
        } else if self.int.load(Ordering::SeqCst) {
            Some(130)
        } else {
            None
        }
    }
}

fn stop_on_signals() -> anyhow::Result<Signals> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let s = Signals {
        int: Arc::new(AtomicBool::new(false)),
        term: Arc::new(AtomicBool::new(false)),
    };
    signal_hook::flag::register(SIGINT, s.int.clone())?;
    signal_hook::flag::register(SIGTERM, s.term.clone())?;
    Ok(s)
}
