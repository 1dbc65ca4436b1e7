//! `LaunchEnv`: where this process sits in a multi-process run, read once at process start
//! from the variables torchrun (and `ferrograd launch`) give every rank: RANK, LOCAL_RANK,
//! WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE.
//! None of them set means a plain single process; some set but not all, or values that
//! contradict each other, is an error that names the variables. Only `from_env` reads the
//! environment; everything below it takes the values explicitly.

use crate::base::{Error, Result};

/// The variables whose presence makes a process a rank of a multi-process run.
pub const LAUNCH_VARS: [&str; 7] = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
];

/// The ones every rank must have: all but the last (the agent-store flag, false when unset).
const REQUIRED: &[&str] = match LAUNCH_VARS.split_last() {
    Some((_, required)) => required,
    None => &[],
};

const CONTEXT: &str = "torchrun environment";

/// One rank's place in a multi-process run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank, 0..world_size.
    pub rank: usize,
    /// Rank on this node, 0..local_world_size: the CUDA device a rank uses.
    pub local_rank: usize,
    pub world_size: usize,
    /// Ranks on this node (torchrun's --nproc-per-node).
    pub local_world_size: usize,
    /// Host of the rendezvous store (rank 0's node).
    pub master_addr: String,
    pub master_port: u16,
    /// torchrun's agent already hosts a PyTorch TCPStore on MASTER_ADDR:MASTER_PORT: ranks
    /// talk to it as clients and nobody binds the port.
    pub use_agent_store: bool,
    /// TORCHELASTIC_RESTART_COUNT (0 when unset): a restarted worker group meets an agent
    /// store that still holds the previous attempt's keys, so keys carry this number.
    pub restart_count: u64,
}

impl LaunchEnv {
    /// Reads the launch variables of this process. `None` when none is set.
    pub fn from_env() -> Result<Option<LaunchEnv>> {
        Self::from_lookup(|k| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned()))
    }

    /// As `from_env`, from explicit (name, value) pairs.
    pub fn from_pairs(pairs: &[(&str, &str)]) -> Result<Option<LaunchEnv>> {
        Self::from_lookup(|k| {
            pairs
                .iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.to_string())
        })
    }

    /// As `from_env`, with `get` giving a variable's value. Empty values count as unset.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        if LAUNCH_VARS.iter().all(|k| get(k).is_none()) {
            return Ok(None);
        }
        check_all_present(&get)?;
        let text = |k: &str| get(k).unwrap_or_default();
        let env = LaunchEnv {
            rank: number(&text, "RANK")?,
            local_rank: number(&text, "LOCAL_RANK")?,
            world_size: number(&text, "WORLD_SIZE")?,
            local_world_size: number(&text, "LOCAL_WORLD_SIZE")?,
            master_addr: text("MASTER_ADDR").trim().to_string(),
            master_port: port(&text("MASTER_PORT"))?,
            use_agent_store: flag(get("TORCHELASTIC_USE_AGENT_STORE"))?,
            restart_count: match get("TORCHELASTIC_RESTART_COUNT") {
                Some(_) => number(&text, "TORCHELASTIC_RESTART_COUNT")?,
                None => 0,
            },
        };
        env.check()?;
        Ok(Some(env))
    }

    /// The variables that place a process at `rank` (what a launcher sets for its child).
    pub fn to_vars(&self) -> Vec<(&'static str, String)> {
        vec![
            ("RANK", self.rank.to_string()),
            ("LOCAL_RANK", self.local_rank.to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("LOCAL_WORLD_SIZE", self.local_world_size.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
        ]
    }

    /// `MASTER_ADDR:MASTER_PORT`, with an IPv6 address in brackets.
    pub fn endpoint(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }

    fn check(&self) -> Result<()> {
        let fail = |d: String| Err(Error::distributed(CONTEXT, d));
        if self.world_size == 0 {
            return fail("WORLD_SIZE=0: a run needs at least one rank".into());
        }
        if self.rank >= self.world_size {
            return fail(format!(
                "RANK={} is not below WORLD_SIZE={} (ranks count from 0)",
                self.rank, self.world_size
            ));
        }
        if self.local_world_size == 0 || self.local_world_size > self.world_size {
            return fail(format!(
                "LOCAL_WORLD_SIZE={} must be between 1 and WORLD_SIZE={}",
                self.local_world_size, self.world_size
            ));
        }
        if self.local_rank >= self.local_world_size {
            return fail(format!(
                "LOCAL_RANK={} is not below LOCAL_WORLD_SIZE={} (local ranks count from 0)",
                self.local_rank, self.local_world_size
            ));
        }
        Ok(())
    }
}

fn check_all_present(get: &impl Fn(&str) -> Option<String>) -> Result<()> {
    let (set, missing): (Vec<&str>, Vec<&str>) = REQUIRED.iter().partition(|k| get(k).is_some());
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::distributed(
        CONTEXT,
        format!(
            "{} set but {} not: a rank needs all of {} (torchrun and `ferrograd launch` set them), a single process none",
            if set.is_empty() {
                "TORCHELASTIC_USE_AGENT_STORE is".to_string()
            } else {
                format!(
                    "{} {}",
                    set.join(", "),
                    if set.len() == 1 { "is" } else { "are" }
                )
            },
            missing.join(", "),
            REQUIRED.join(", ")
        ),
    ))
}

fn number<T: std::str::FromStr>(text: &impl Fn(&str) -> String, name: &str) -> Result<T> {
    let v = text(name);
    v.trim().parse().map_err(|_| {
        Error::distributed(
            CONTEXT,
            format!("{name}={v:?} is not a non-negative whole number"),
        )
    })
}

fn port(v: &str) -> Result<u16> {
    match v.trim().parse::<u16>() {
        Ok(0) => Err(Error::distributed(
            CONTEXT,
            "MASTER_PORT=0: every rank must be given the same fixed port (`ferrograd launch --master-port 0` picks a free one and passes it on)",
        )),
        Ok(p) => Ok(p),
        Err(_) => Err(Error::distributed(
            CONTEXT,
            format!("MASTER_PORT={v:?} is not a port number (1 to 65535)"),
        )),
    }
}

fn flag(v: Option<String>) -> Result<bool> {
    let Some(v) = v else { return Ok(false) };
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" => Ok(true),
        "0" | "false" | "no" => Ok(false),
        _ => Err(Error::distributed(
            CONTEXT,
            format!("TORCHELASTIC_USE_AGENT_STORE={v:?} is neither True nor False"),
        )),
    }
}
