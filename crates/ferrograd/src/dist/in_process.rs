//! The in-process group: ranks are threads of one process (`InProcessGroup::run`), and a
//! collective is a rendezvous where each rank leaves its buffer, then reads everyone's. Sums
//! run in rank order with the tensor's own ops, so a result is bitwise the same on every
//! rank and from run to run — what tests of data-parallel training need, on CPU tensors (or
//! any device's, though a GPU wants NCCL). Not a transport: nothing leaves the process.
//!
//! A collective has two meetings: all ranks deposit (then each computes its result from the
//! deposits), and all ranks finish reading (only then does each write its own buffer, so no
//! rank overwrites an input another is still reading). A rank that returns an error or
//! panics marks the group failed, and every waiting rank returns an error naming it; a rank
//! that never arrives is a timeout error naming it. Each rank's thread runs in the memory
//! scope of its rank, so `memory::scope_memory(device, rank)` gives that rank's bytes by
//! category and its peak, although all ranks share the device's allocator.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::group::{ProcessGroup, ReduceOp, check_buffer, check_root, check_split};
use crate::autograd::no_grad;
use crate::base::{Error, Result};
use crate::memory;
use crate::tensor::{DType, Tensor};

/// How long a rank waits for the others at one collective before giving up.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// What one rank brought to a collective.
#[derive(Clone)]
struct Deposit {
    op: &'static str,
    /// The buffer others read: the input (all-reduce, broadcast, reduce-scatter, all-gather).
    input: Option<Tensor>,
    root: usize,
}

#[derive(Default)]
struct Exchange {
    /// Collectives completed so far; the one being met is number `generation`.
    generation: u64,
    /// Every rank has deposited; ranks are reading.
    draining: bool,
    deposits: Vec<Option<Deposit>>,
    arrived: usize,
    done: usize,
    /// The first rank that failed, and why.
    failure: Option<(usize, String)>,
}

struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<Exchange>,
    cv: Condvar,
}

impl Shared {
    fn new(world: usize, timeout: Duration) -> Result<Arc<Shared>> {
        if world == 0 {
            return Err(Error::invalid(
                "InProcessGroup::run",
                "a group needs at least one rank",
            ));
        }
        Ok(Arc::new(Shared {
            world,
            timeout,
            state: Mutex::new(Exchange {
                deposits: vec![None; world],
                ..Exchange::default()
            }),
            cv: Condvar::new(),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, Exchange> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fail(&self, rank: usize, why: String) {
        let mut st = self.lock();
        if st.failure.is_none() {
            st.failure = Some((rank, why));
        }
        self.cv.notify_all();
    }
}

/// One rank's handle on an in-process group.
pub struct InProcessGroup {
    rank: usize,
    shared: Arc<Shared>,
}

/// Marks the group failed if its rank's thread unwinds, so the others stop waiting.
struct FailOnPanic<'a> {
    shared: &'a Shared,
    rank: usize,
}

impl Drop for FailOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.shared.fail(self.rank, "panicked".into());
        }
    }
}

impl InProcessGroup {
    /// Runs `f` on `world` ranks, each a thread with its own group handle, and returns their
    /// results in rank order; an error of the rank that failed first otherwise.
    pub fn run<T: Send>(
        world: usize,
        f: impl Fn(Arc<dyn ProcessGroup>) -> Result<T> + Sync,
    ) -> Result<Vec<T>> {
        Self::run_with_timeout(world, DEFAULT_TIMEOUT, f)
    }

    pub fn run_with_timeout<T: Send>(
        world: usize,
        timeout: Duration,
        f: impl Fn(Arc<dyn ProcessGroup>) -> Result<T> + Sync,
    ) -> Result<Vec<T>> {
        let shared = Shared::new(world, timeout)?;
        let results = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world).map(|r| spawn_rank(s, r, &shared, &f)).collect();
            join_ranks(handles)
        });
        first_failure(&shared, results)
    }

    /// As `run`, but rank 0 runs `leader` on the calling thread (which may then hold what
    /// cannot cross threads, such as a progress callback), the others run `others`.
    pub fn run_with_leader<T: Send>(
        world: usize,
        timeout: Duration,
        leader: impl FnOnce(Arc<dyn ProcessGroup>) -> Result<T>,
        others: impl Fn(Arc<dyn ProcessGroup>) -> Result<T> + Sync,
    ) -> Result<Vec<T>> {
        let shared = Shared::new(world, timeout)?;
        let results = std::thread::scope(|s| {
            let handles: Vec<_> = (1..world)
                .map(|r| spawn_rank(s, r, &shared, &others))
                .collect();
            let first = run_rank(0, Arc::clone(&shared), leader);
            let mut all = vec![first];
            all.extend(join_ranks(handles));
            all
        });
        first_failure(&shared, results)
    }

    fn exchange(&self, deposit: Deposit) -> Result<(u64, Vec<Deposit>)> {
        let sh = &*self.shared;
        let op = deposit.op;
        let st = self.wait(sh.lock(), op, |s| s.draining)?;
        let mut st = st;
        let generation = st.generation;
        st.deposits[self.rank] = Some(deposit);
        st.arrived += 1;
        if st.arrived == sh.world {
            st.draining = true;
            sh.cv.notify_all();
        }
        let st = self.wait(st, op, |s| s.generation == generation && !s.draining)?;
        let all: Vec<Deposit> = st.deposits.iter().flatten().cloned().collect();
        drop(st);
        check_same_call(self.rank, &all)?;
        Ok((generation, all))
    }

    /// The second meeting: this rank has read every deposit of collective `generation`.
    fn finish(&self, generation: u64, op: &'static str) -> Result<()> {
        let sh = &*self.shared;
        let mut st = sh.lock();
        st.done += 1;
        if st.done == sh.world {
            st.deposits.iter_mut().for_each(|d| *d = None);
            (st.arrived, st.done, st.draining) = (0, 0, false);
            st.generation += 1;
            sh.cv.notify_all();
            return Ok(());
        }
        self.wait(st, op, |s| s.generation == generation).map(drop)
    }

    /// Waits while `blocked` holds, failing on another rank's failure or the timeout.
    fn wait<'a>(
        &self,
        mut st: MutexGuard<'a, Exchange>,
        op: &'static str,
        blocked: impl Fn(&Exchange) -> bool,
    ) -> Result<MutexGuard<'a, Exchange>> {
        let deadline = Instant::now() + self.shared.timeout;
        loop {
            if let Some((r, why)) = &st.failure {
                return Err(Error::invalid(
                    "ProcessGroup",
                    format!(
                        "rank {}: {op} aborted because rank {r} failed: {why}",
                        self.rank
                    ),
                ));
            }
            if !blocked(&st) {
                return Ok(st);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timeout_error(&st, op));
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn timeout_error(&self, st: &Exchange, op: &'static str) -> Error {
        let missing: Vec<usize> = if st.draining {
            Vec::new()
        } else {
            (0..self.shared.world)
                .filter(|&r| st.deposits[r].is_none())
                .collect()
        };
        Error::invalid(
            "ProcessGroup",
            format!(
                "rank {}: {op} (collective #{}) timed out after {:.1} s; ranks {missing:?} never reached it (did a rank skip a collective, or issue them in another order?)",
                self.rank,
                st.generation,
                self.shared.timeout.as_secs_f64()
            ),
        )
    }

    /// One collective: deposit `input`, compute this rank's result from every deposit, wait
    /// until all ranks have read, then `write` the result.
    fn collective(
        &self,
        op: &'static str,
        input: Option<&Tensor>,
        root: usize,
        compute: impl FnOnce(&[Deposit]) -> Result<Option<Tensor>>,
        write: impl FnOnce(Tensor) -> Result<()>,
    ) -> Result<()> {
        let _g = no_grad();
        let deposit = Deposit {
            op,
            input: input.cloned(),
            root,
        };
        let (generation, all) = self.exchange(deposit)?;
        let result = compute(&all);
        // Finish even when computing failed, so the other ranks are not left waiting.
        self.finish(generation, op)?;
        match result? {
            Some(value) => write(value),
            None => Ok(()),
        }
    }
}

type Spawned<'s, T> = std::io::Result<std::thread::ScopedJoinHandle<'s, Result<T>>>;

fn spawn_rank<'s, 'e: 's, T: Send + 's>(
    s: &'s std::thread::Scope<'s, 'e>,
    rank: usize,
    shared: &Arc<Shared>,
    f: &'s (impl Fn(Arc<dyn ProcessGroup>) -> Result<T> + Sync),
) -> Spawned<'s, T> {
    let shared = Arc::clone(shared);
    std::thread::Builder::new()
        .name(format!("rank-{rank}"))
        .spawn_scoped(s, move || run_rank(rank, shared, f))
}

/// The spawned ranks' results, in order (a panic or a thread that did not start is an error).
fn join_ranks<T>(handles: Vec<Spawned<'_, T>>) -> Vec<Result<T>> {
    handles
        .into_iter()
        .map(|h| match h {
            Ok(h) => {
                let name = h.thread().name().unwrap_or("a rank").to_string();
                h.join().unwrap_or_else(|_| {
                    Err(Error::invalid(
                        "InProcessGroup::run",
                        format!("{name} panicked"),
                    ))
                })
            }
            Err(e) => Err(Error::invalid(
                "InProcessGroup::run",
                format!("could not start a rank's thread: {e}"),
            )),
        })
        .collect()
}

fn run_rank<T>(
    rank: usize,
    shared: Arc<Shared>,
    f: impl FnOnce(Arc<dyn ProcessGroup>) -> Result<T>,
) -> Result<T> {
    let _guard = FailOnPanic {
        shared: &shared,
        rank,
    };
    // Each rank's allocations are told apart on the device they share (`scope_memory`).
    let _scope = u16::try_from(rank).ok().map(memory::enter_scope);
    let group: Arc<dyn ProcessGroup> = Arc::new(InProcessGroup {
        rank,
        shared: Arc::clone(&shared),
    });
    let out = f(group);
    if let Err(e) = &out {
        shared.fail(rank, e.to_string());
    }
    out
}

/// The results in rank order, or the error of the rank that failed first (the others'
/// errors only say that they stopped because of it).
fn first_failure<T>(shared: &Shared, results: Vec<Result<T>>) -> Result<Vec<T>> {
    let first = shared.lock().failure.as_ref().map(|(r, _)| *r);
    let mut results: Vec<Option<Result<T>>> = results.into_iter().map(Some).collect();
    if let Some(r) = first
        && let Some(Err(_)) = &results[r]
        && let Some(Err(e)) = results[r].take()
    {
        return Err(e);
    }
    results.into_iter().flatten().collect()
}

/// Every rank must call the same collective on buffers of one dtype and size.
fn check_same_call(rank: usize, all: &[Deposit]) -> Result<()> {
    let describe = |d: &Deposit| -> (&'static str, Option<(DType, usize)>, usize) {
        (
            d.op,
            d.input.as_ref().map(|t| (t.dtype(), t.numel())),
            d.root,
        )
    };
    let first = describe(&all[0]);
    for (r, d) in all.iter().enumerate().skip(1) {
        let this = describe(d);
        if this != first {
            return Err(Error::invalid(
                "ProcessGroup",
                format!(
                    "rank {rank}: the ranks called different collectives: rank 0 {} {:?} (root {}), rank {r} {} {:?} (root {})",
                    first.0, first.1, first.2, this.0, this.1, this.2
                ),
            ));
        }
    }
    Ok(())
}

/// The reduction of `parts` (same shape and dtype), summed in rank order.
fn reduce(parts: &[Tensor], op: ReduceOp) -> Result<Tensor> {
    let mut acc = parts[0].clone();
    for p in &parts[1..] {
        acc = acc.add(p)?;
    }
    match op {
        ReduceOp::Sum => Ok(acc),
        ReduceOp::Avg => acc.div_scalar(parts.len() as f64),
    }
}

fn inputs(all: &[Deposit]) -> Result<Vec<Tensor>> {
    all.iter()
        .map(|d| {
            d.input
                .clone()
                .ok_or_else(|| Error::invalid("ProcessGroup", "a rank deposited no buffer"))
        })
        .collect()
}

impl ProcessGroup for InProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn backend_name(&self) -> &'static str {
        "in-process"
    }

    fn ranks_share_process(&self) -> bool {
        true
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<()> {
        check_buffer("all_reduce", "buffer", x)?;
        let flat = |t: &Tensor| t.reshape(&[t.numel()]);
        self.collective(
            "all_reduce",
            Some(x),
            0,
            |all| {
                let parts: Vec<Tensor> = inputs(all)?.iter().map(flat).collect::<Result<_>>()?;
                reduce(&parts, op).map(Some)
            },
            |v| x.copy_(&v.reshape(x.shape())?),
        )
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<()> {
        check_buffer("broadcast", "buffer", x)?;
        check_root("broadcast", root, self.world_size())?;
        let me = self.rank;
        self.collective(
            "broadcast",
            Some(x),
            root,
            |all| {
                Ok((me != root)
                    .then(|| inputs(all))
                    .transpose()?
                    .map(|v| v[root].clone()))
            },
            |v| x.copy_(&v),
        )
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        let world = self.world_size();
        check_split("reduce_scatter", input, output, world)?;
        let (n, me) = (output.numel(), self.rank);
        self.collective(
            "reduce_scatter",
            Some(input),
            0,
            |all| {
                let chunks: Vec<Tensor> = inputs(all)?
                    .iter()
                    .map(|t| t.reshape(&[world * n])?.narrow(0, me * n, n))
                    .collect::<Result<_>>()?;
                reduce(&chunks, op).map(Some)
            },
            |v| output.copy_(&v.reshape(output.shape())?),
        )
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        let world = self.world_size();
        check_split("all_gather", output, input, world)?;
        let n = input.numel();
        self.collective(
            "all_gather",
            Some(input),
            0,
            |all| {
                let parts: Vec<Tensor> = inputs(all)?
                    .iter()
                    .map(|t| t.reshape(&[n]))
                    .collect::<Result<_>>()?;
                Tensor::cat(&parts, 0).map(Some)
            },
            |v| output.copy_(&v.reshape(output.shape())?),
        )
    }

    fn barrier(&self) -> Result<()> {
        self.collective("barrier", None, 0, |_| Ok(None), |_| Ok(()))
    }
}
