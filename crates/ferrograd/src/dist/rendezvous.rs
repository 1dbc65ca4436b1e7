//! `Rendezvous`: the ranks of a multi-process run meet at a TCPStore before they build their
//! communicator — torchrun's agent store when TORCHELASTIC_USE_AGENT_STORE is true, else a
//! `StoreServer` that rank 0 starts on MASTER_ADDR:MASTER_PORT. On it ranks announce their
//! world size (a mismatch is an error naming both numbers), broadcast a few bytes from rank 0
//! (the 128-byte NCCL unique id: `share_unique_id`) and pass barriers. A rank that does not
//! arrive in time is an error naming it. Not a transport for tensors: that is NCCL's job.
//!
//! Keys live under `ferrograd/<restart>/<session>/`: a restarted torchrun worker group meets
//! an agent store holding the previous attempt's keys, and a process may meet the same store
//! more than once; each rank counts its own joins in the store, so the n-th join of every
//! rank lands in session n. Broadcasts and barriers are numbered in call order, like
//! collectives: every rank makes the same calls in the same order.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::launch_env::LaunchEnv;
use super::store::{StoreClient, connect_until, secs};
use super::store_server::StoreServer;
use crate::base::{Error, Result};

/// How long ranks wait for each other by default (a first CUDA context can take a while).
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

const CONTEXT: &str = "rendezvous";
/// How long rank 0 keeps its store up after a failed join, so the other ranks can read what
/// they need to report the same failure.
const FAILURE_GRACE: Duration = Duration::from_millis(500);
const POLL_MIN: Duration = Duration::from_millis(1);
const POLL_MAX: Duration = Duration::from_millis(50);

/// One rank's membership in a rendezvous.
pub struct Rendezvous {
    env: LaunchEnv,
    client: StoreClient,
    /// Rank 0's own store, when no agent hosts one.
    server: Option<StoreServer>,
    timeout: Duration,
    namespace: String,
    broadcasts: u64,
    barriers: u64,
}

impl Rendezvous {
    /// Meets every rank of `env`'s run at its store, within `timeout`; rank 0 starts the store
    /// unless torchrun's agent hosts one.
    pub fn join(env: &LaunchEnv, timeout: Duration) -> Result<Rendezvous> {
        let deadline = Instant::now() + timeout;
        let hosts = env.rank == 0 && !env.use_agent_store;
        let server = if hosts {
            Some(StoreServer::bind(&env.master_addr, env.master_port)?)
        } else {
            None
        };
        let client = connect(env, deadline, timeout)?;
        let mut rdv = Rendezvous {
            env: env.clone(),
            client,
            server,
            timeout,
            namespace: String::new(),
            broadcasts: 0,
            barriers: 0,
        };
        let joins = format!("{}/joins/{}", rdv.root(), env.rank);
        let session = rdv.client.add(&joins, 1)?;
        if same_rank_twice(env, session) {
            return Err(Error::distributed(
                CONTEXT,
                format!(
                    "two processes joined the rendezvous at {} as rank {} (RANK={} twice); give every process its own RANK",
                    env.endpoint(),
                    env.rank,
                    env.rank
                ),
            ));
        }
        rdv.namespace = format!("{}/{session}", rdv.root());
        if let Err(e) = rdv.announce(deadline) {
            if rdv.server.is_some() {
                // The others are a round trip or two from finding the same mismatch: the
                // store outlives this error long enough for their messages to name it too.
                std::thread::sleep(FAILURE_GRACE);
            }
            return Err(e);
        }
        Ok(rdv)
    }

    pub fn rank(&self) -> usize {
        self.env.rank
    }

    pub fn world_size(&self) -> usize {
        self.env.world_size
    }

    /// Rank 0's `value` on every rank: rank 0 passes `Some`, the others `None`.
    pub fn broadcast_bytes(&mut self, key: &str, value: Option<&[u8]>) -> Result<Vec<u8>> {
        self.broadcasts += 1;
        let full = format!("{}/bcast/{}/{key}", self.namespace, self.broadcasts);
        match (self.env.rank, value) {
            (0, Some(v)) => {
                self.client.set(&full, v)?;
                Ok(v.to_vec())
            }
            (0, None) => Err(Error::invalid(
                "Rendezvous::broadcast_bytes",
                "rank 0 is the source of a broadcast and must pass Some(bytes)",
            )),
            (_, Some(_)) => Err(Error::invalid(
                "Rendezvous::broadcast_bytes",
                "only rank 0 passes bytes to a broadcast; the other ranks pass None",
            )),
            (_, None) => self.receive(&full, key),
        }
    }

    /// Returns once every rank has called `barrier` as many times as this one.
    pub fn barrier(&mut self, name: &str) -> Result<()> {
        self.barriers += 1;
        let prefix = format!("{}/barrier/{}", self.namespace, self.barriers);
        self.client
            .set(&format!("{prefix}/{}", self.env.rank), b"1")?;
        let deadline = Instant::now() + self.timeout;
        self.await_ranks(
            &prefix,
            deadline,
            &format!("reach barrier {name:?}"),
            |_, _| Ok(()),
        )
    }

    /// Leaves the rendezvous. Rank 0, when it hosts the store, keeps it up until every rank
    /// has left, so nobody loses the store mid-read; the others wait for it to close. (Dropping
    /// a `Rendezvous` without `close` stops rank 0's store at once: right after a failure.)
    pub fn close(mut self) -> Result<()> {
        let prefix = format!("{}/left", self.namespace);
        self.client
            .set(&format!("{prefix}/{}", self.env.rank), b"1")?;
        match self.server.take() {
            Some(server) => {
                let deadline = Instant::now() + self.timeout;
                let left =
                    self.await_ranks(&prefix, deadline, "leave the rendezvous", |_, _| Ok(()));
                server.stop();
                left
            }
            None if !self.env.use_agent_store => {
                self.client.await_close(self.timeout);
                Ok(())
            }
            None => Ok(()),
        }
    }

    fn root(&self) -> String {
        format!("ferrograd/{}", self.env.restart_count)
    }

    /// Announces this rank with its world size, then waits for every rank's announcement.
    fn announce(&mut self, deadline: Instant) -> Result<()> {
        let prefix = format!("{}/join", self.namespace);
        let world = self.env.world_size;
        let me = self.env.rank;
        self.client
            .set(&format!("{prefix}/{me}"), world.to_string().as_bytes())?;
        self.await_ranks(&prefix, deadline, "join the rendezvous", |rank, value| {
            let theirs = String::from_utf8_lossy(value);
            if theirs == world.to_string() {
                return Ok(());
            }
            Err(Error::distributed(
                CONTEXT,
                format!(
                    "rank {rank} was started with WORLD_SIZE={theirs} and rank {me} with WORLD_SIZE={world}; start every rank with the same WORLD_SIZE"
                ),
            ))
        })
    }

    /// Waits until `prefix/<rank>` is set for every rank, giving each value to `seen` as it
    /// arrives; at the deadline, an error naming the ranks that did not `what`. Polls one
    /// rank at a time, in rank order, so each rank sends one small CHECK per poll whatever
    /// the world size.
    fn await_ranks(
        &mut self,
        prefix: &str,
        deadline: Instant,
        what: &str,
        mut seen: impl FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let mut pause = POLL_MIN;
        for rank in 0..self.env.world_size {
            let key = format!("{prefix}/{rank}");
            while !self.client.check(&[&key])? {
                if Instant::now() >= deadline {
                    let missing = self.still_missing(prefix, rank);
                    return Err(missing_ranks_error(&self.env, &missing, what, self.timeout));
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(POLL_MAX);
            }
            let value = self.client.get(&key, self.timeout)?;
            seen(rank, &value)?;
        }
        Ok(())
    }

    /// The ranks from `first` on whose `prefix/<rank>` key is still unset.
    fn still_missing(&mut self, prefix: &str, first: usize) -> Vec<usize> {
        (first..self.env.world_size)
            .filter(|r| {
                !self
                    .client
                    .check(&[&format!("{prefix}/{r}")])
                    .unwrap_or(false)
            })
            .collect()
    }

    fn receive(&mut self, full: &str, key: &str) -> Result<Vec<u8>> {
        self.client.get(full, self.timeout).map_err(|e| {
            Error::distributed(
                CONTEXT,
                format!(
                    "rank {} waited {} for rank 0 to broadcast {key:?} ({e}); do all ranks call broadcast_bytes in the same order?",
                    self.env.rank,
                    secs(self.timeout)
                ),
            )
        })
    }
}

/// Rank 0's store is new at every join, so a second join of one rank in it is a second
/// process with the same RANK. (An agent store outlives joins: there the count is a session.)
fn same_rank_twice(env: &LaunchEnv, session: i64) -> bool {
    !env.use_agent_store && session > 1
}

/// Connects this rank to the store, naming rank 0 (or torchrun's agent) when nothing answers.
fn connect(env: &LaunchEnv, deadline: Instant, timeout: Duration) -> Result<StoreClient> {
    let stream: TcpStream = connect_until(&env.master_addr, env.master_port, deadline)
        .map_err(|e| {
            if env.use_agent_store {
                Error::distributed(
                    CONTEXT,
                    format!(
                        "torchrun's agent store at {} did not answer within {} ({e}); is this process started by torchrun, and is TORCHELASTIC_USE_AGENT_STORE right?",
                        env.endpoint(),
                        secs(timeout)
                    ),
                )
            } else {
                missing_ranks_error(env, &[0], &format!("join the rendezvous ({e})"), timeout)
            }
        })?;
    StoreClient::from_stream(stream, env.endpoint(), timeout)
}

/// "rank 1 of 2 did not join the rendezvous at 127.0.0.1:PORT within 2s; ..."
fn missing_ranks_error(env: &LaunchEnv, missing: &[usize], what: &str, t: Duration) -> Error {
    let list: Vec<String> = missing.iter().map(|r| r.to_string()).collect();
    let who = match list.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    };
    Error::distributed(
        CONTEXT,
        format!(
            "{who} of {} did not {what} at {} within {}; check that every rank was started with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE, and that none of them failed",
            env.world_size,
            env.endpoint(),
            secs(t)
        ),
    )
}

/// The NCCL unique id made by rank 0 (`id_on_rank0`: `Some` there, `None` elsewhere), on
/// every rank of `env`'s run: join, broadcast, close. The CUDA process group calls it
/// between `ncclGetUniqueId` on rank 0 and `ncclCommInitRank` on every rank.
pub fn share_unique_id(
    env: &LaunchEnv,
    id_on_rank0: Option<&[u8; NCCL_UNIQUE_ID_BYTES]>,
    timeout: Duration,
) -> Result<[u8; NCCL_UNIQUE_ID_BYTES]> {
    let mut rdv = Rendezvous::join(env, timeout)?;
    let bytes = rdv.broadcast_bytes("nccl_unique_id", id_on_rank0.map(|id| &id[..]))?;
    rdv.close()?;
    bytes.try_into().map_err(|b: Vec<u8>| {
        Error::distributed(
            CONTEXT,
            format!(
                "rank 0 broadcast an NCCL unique id of {} bytes instead of {NCCL_UNIQUE_ID_BYTES}",
                b.len()
            ),
        )
    })
}
