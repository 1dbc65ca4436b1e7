//! Capturing a device's queued work into a graph that replays it (CUDA graphs), device
//! independent: what a capture may and may not do, and the graph it leaves.
//!
//! A capture runs ordinary host code (a whole training step) while the device records every
//! kernel, copy and memset instead of running them; `Graph::replay` then runs them all again
//! with one launch. What makes a replay right or wrong:
//!
//! - Memory: every block handed out during the capture comes from a private pool of the
//!   device's allocator, kept for the graph's life, so the recorded addresses stay the
//!   graph's. A block from outside the pool freed during the capture stays allocated until
//!   the graph goes (the graph may read it).
//! - Host values: a kernel argument or an upload made during the capture is replayed as it
//!   was. Values that change per step must reach the kernels through device memory that the
//!   host rewrites before each replay (the optimizer's rate and step count, the batch and
//!   what the host derived from it, the dropout seed that every mask's key is XORed with),
//!   or the capture must be refused (`refuse`).
//! - Host checks: ids and class targets are checked on the host from the values they were
//!   uploaded with. A capture notes each check (`note_ids`), and `Graph::check_input` runs
//!   them again on the values a replay will use.
//! - Waiting: nothing may read the device back while capturing; the backend says so as an
//!   error, and the capture is abandoned.
//! - Ownership: a capture owns its device. The device has one stream and one active pool, so
//!   work another thread queued on it meanwhile would be recorded instead of run, and its
//!   blocks would come from the graph's pool: capture from the only thread using the device
//!   (as a training loop does).

use std::cell::RefCell;

use super::{HostValues, backend};
use crate::base::{DType, Device, Error, Layout, Result};
use crate::memory::{self, PrivatePoolId};

/// A host-side check a captured kernel launch relied on, for one input buffer.
#[derive(Clone, Debug, PartialEq)]
pub enum IdCheck {
    /// Every id selects one of `rows` rows (an embedding lookup).
    Rows { rows: usize },
    /// Every target is a class below `classes` or `ignore_index`, and exactly `counted` of
    /// them are not ignored (the loss divides by that count, baked into the launch).
    Targets {
        classes: usize,
        ignore_index: i64,
        counted: usize,
    },
}

/// One noted check: the buffer's address, the layout the kernel read it with, the check.
#[derive(Clone, Debug)]
struct Note {
    addr: u64,
    layout: Layout,
    check: IdCheck,
}

/// Words a kernel of the step reads that the host derived from an input buffer (an
/// embedding backward's grouping of the ids): before each replay they are made again from
/// the replay's ids and written into the buffer, in stream order.
pub(crate) type Derive = Box<dyn Fn(&[i64]) -> Result<Vec<i64>> + Send>;

struct Derived {
    /// The device buffer the kernel reads (kept for the graph's life).
    buffer: u64,
    /// The input buffer and the layout the words were derived through.
    input: u64,
    layout: Layout,
    derive: Derive,
}

/// What the capture on this thread has learnt so far.
struct Log {
    device: Device,
    notes: Vec<Note>,
    derived: Vec<Derived>,
    /// The step's dropout seed buffer, once a dropout kernel asked for it.
    seed: Option<u64>,
    refused: Option<String>,
}

thread_local! {
    static ACTIVE: RefCell<Option<Log>> = const { RefCell::new(None) };
}

/// Whether `device` captures graphs: a GPU, or the meta device while it plans for one (its
/// capture takes the same memory and replays nothing).
pub fn can_capture(device: Device) -> bool {
    match device {
        Device::Cuda(_) => true,
        Device::Meta => super::plans_for_cuda(),
        Device::Cpu => false,
    }
}

/// Whether this thread is capturing work on `device`.
pub fn capturing_on(device: Device) -> bool {
    ACTIVE.with(|a| a.borrow().as_ref().is_some_and(|l| l.device == device))
}

/// Whether this thread is capturing work on any device.
pub fn capturing() -> bool {
    ACTIVE.with(|a| a.borrow().is_some())
}

/// Marks the running capture (if any) as one that cannot be replayed, saying why; the
/// capture then ends in that error instead of a graph.
pub fn refuse(reason: impl Into<String>) {
    ACTIVE.with(|a| {
        if let Some(log) = a.borrow_mut().as_mut() {
            log.refused.get_or_insert_with(|| reason.into());
        }
    });
}

/// Notes that a kernel launch checked the ids at `addr` (read through `layout`) on the host.
pub(crate) fn note_ids(addr: u64, layout: &Layout, check: IdCheck) {
    ACTIVE.with(|a| {
        if let Some(log) = a.borrow_mut().as_mut() {
            log.notes.push(Note {
                addr,
                layout: layout.clone(),
                check,
            });
        }
    });
}

/// Notes that the words in the device buffer at `buffer` were made from the ids at `input`
/// (read through `layout`) by `derive`, which makes them again from a replay's ids.
pub(crate) fn note_derived_buffer(buffer: u64, input: u64, layout: &Layout, derive: Derive) {
    ACTIVE.with(|a| {
        if let Some(log) = a.borrow_mut().as_mut() {
            log.derived.push(Derived {
                buffer,
                input,
                layout: layout.clone(),
                derive,
            });
        }
    });
}

/// The device address of the running capture's dropout seed, made by `make` on first use
/// (dropout kernels draw with key ^ seed; a replay writes a new seed). Outside a capture: 0.
pub(crate) fn step_seed(make: impl FnOnce() -> Result<u64>) -> Result<u64> {
    if let Some(seed) = ACTIVE.with(|a| a.borrow().as_ref().and_then(|l| l.seed)) {
        return Ok(seed);
    }
    if !capturing() {
        return Ok(0);
    }
    let seed = make()?;
    ACTIVE.with(|a| {
        if let Some(log) = a.borrow_mut().as_mut() {
            log.seed = Some(seed);
        }
    });
    Ok(seed)
}

/// A device's recorded work, replayable with one launch (the backend's half of a graph).
pub trait GraphExec: Send {
    /// Queues the recorded work once more on the device's stream.
    fn launch(&self) -> Result<()>;
}

/// What a backend does to capture: start recording its stream, and stop, handing over the
/// recording (or, on `abandon`, dropping it).
/// Only CUDA devices capture; the defaults say so.
pub trait Capture {
    fn begin_capture(&self) -> Result<()> {
        Err(no_graphs())
    }
    fn end_capture(&self) -> Result<Box<dyn GraphExec>> {
        Err(no_graphs())
    }
    /// Ends a capture that failed, discarding what was recorded.
    fn abandon_capture(&self) {}
}

fn no_graphs() -> Error {
    Error::invalid("graph capture", "only CUDA devices capture graphs")
}

/// A private memory pool of a device's allocator, given back when dropped. Work can run in it
/// before its capture (`run`): a warm-up step whose activations come from the pool leaves
/// the shared segments to what lives on (parameters, optimizer state), and the capture then
/// reuses the pool's segments instead of reserving the step's bytes a second time.
pub struct Pool {
    device: Device,
    id: PrivatePoolId,
}

impl Pool {
    /// A new pool on `device` (one that captures: `can_capture`).
    pub fn new(device: Device) -> Result<Pool> {
        if !can_capture(device) {
            return Err(Error::NotSupportedOnDevice {
                op: "private memory pool",
                device,
            });
        }
        let id = memory::allocator(device)?.create_private_pool();
        Ok(Pool { device, id })
    }

    /// Runs `f` with every allocation of the device served from this pool (not captured).
    pub fn run<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let alloc = memory::allocator(self.device)?;
        alloc.begin_private_pool(self.id)?;
        let r = f();
        alloc.end_private_pool()?;
        r
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if let Ok(a) = memory::allocator(self.device) {
            let _ = a.release_private_pool(self.id);
        }
    }
}

/// A captured piece of work, its private memory pool and the host checks it relied on.
/// Dropping it waits for the device, then gives the pool back.
pub struct Graph {
    exec: Option<Box<dyn GraphExec>>,
    device: Device,
    /// Dropped after `drop` has waited for the device (fields drop after the body).
    pool: Pool,
    notes: Vec<Note>,
    derived: Vec<Derived>,
    /// The dropout seed the step's kernels read, if any dropout ran in it.
    seed: Option<u64>,
}

/// Whether an input's new values let a graph replay, and if not, why.
#[derive(Clone, Debug, PartialEq)]
pub enum InputCheck {
    /// Every check the capture relied on holds.
    Replayable,
    /// The values are valid but the capture baked in something they change (a target count):
    /// capture again.
    Recapture(String),
}

/// Captures what `f` queues on `device` into a graph. The device is synchronised first (so a
/// capture never overlaps earlier work) and its cached free segments are given back, and
/// every block `f` allocates comes from a new private pool. On error (from `f`, from the
/// backend, or a `refuse`d capture) nothing was run on the device, the pool is given back,
/// and the error says why.
pub fn capture<R>(device: Device, f: impl FnOnce() -> Result<R>) -> Result<(Graph, R)> {
    if !can_capture(device) {
        return Err(Error::NotSupportedOnDevice {
            op: "graph capture",
            device,
        });
    }
    capture_in(Pool::new(device)?, f)
}

/// `capture`, in `pool` (where warm-up steps may have run: the capture reuses its segments).
pub fn capture_in<R>(pool: Pool, f: impl FnOnce() -> Result<R>) -> Result<(Graph, R)> {
    let device = pool.device;
    if capturing() {
        return Err(Error::invalid(
            "graph capture",
            "a capture is already running on this thread; captures do not nest",
        ));
    }
    let b = backend(device)?;
    super::synchronize(device)?;
    let alloc = memory::allocator(device)?;
    // The pool reserves segments of its own: the shared cache's free segments (the eager
    // steps' activations) go back first, so the device holds the step's bytes once, not twice.
    alloc.empty_cache();
    alloc.begin_private_pool(pool.id)?;
    ACTIVE.with(|a| {
        *a.borrow_mut() = Some(Log {
            device,
            notes: Vec::new(),
            derived: Vec::new(),
            seed: None,
            refused: None,
        })
    });
    let ran = b.begin_capture().and_then(|()| {
        let r = f();
        let refused = ACTIVE.with(|a| a.borrow_mut().as_mut().and_then(|l| l.refused.take()));
        match (r, refused) {
            (Ok(r), None) => b.end_capture().map(|exec| (exec, r)),
            (Ok(_), Some(why)) => {
                b.abandon_capture();
                Err(Error::invalid("graph capture", why))
            }
            (Err(e), _) => {
                b.abandon_capture();
                Err(e)
            }
        }
    });
    let log = ACTIVE.with(|a| a.borrow_mut().take());
    let ended = alloc.end_private_pool();
    let (notes, derived, seed) =
        log.map_or_else(Default::default, |l| (l.notes, l.derived, l.seed));
    let mut graph = Graph {
        exec: None,
        device,
        pool,
        notes,
        derived,
        seed,
    };
    match (ran, ended) {
        (Ok((exec, r)), Ok(())) => {
            graph.exec = Some(exec);
            Ok((graph, r))
        }
        // `graph` (no exec) releases the pool as it drops.
        (Err(e), _) | (Ok(_), Err(e)) => Err(e),
    }
}

impl Graph {
    /// Queues the captured work again.
    pub fn replay(&self) -> Result<()> {
        match &self.exec {
            Some(exec) => exec.launch(),
            None => Err(Error::invalid("graph replay", "the capture did not finish")),
        }
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Makes every buffer the step derived from the input buffer at `addr` again from
    /// `values` (its next contents, row-major over its whole storage) and writes it, in
    /// stream order: after the last replay has read the old words, before the next reads.
    pub fn refresh_input(&self, addr: u64, values: &[i64]) -> Result<()> {
        let b = backend(self.device)?;
        for d in self.derived.iter().filter(|d| d.input == addr) {
            let words = (d.derive)(&read_through(&d.layout, values)?)?;
            b.upload(DType::I64, HostValues::I64(words), d.buffer)?;
        }
        Ok(())
    }

    /// Sets the seed that the next replay's dropout masks draw with (their keys are the
    /// captured keys ^ seed; the capture itself ran with seed 0), in stream order. Nothing to
    /// do when the step has no dropout.
    pub fn set_dropout_seed(&self, seed: u64) -> Result<()> {
        match self.seed {
            Some(at) => backend(self.device)?
                .upload(DType::I64, HostValues::I64(vec![seed as i64]), at)
                .map(|_| ()),
            None => Ok(()),
        }
    }

    /// Runs `f` eagerly (nothing captured) with the device's allocations served from this
    /// graph's pool: work between two replays, in the free blocks that are the step's
    /// scratch. Whatever `f` still holds in the pool when it returns, the next replay
    /// overwrites: callers check `pool_bytes` around it (`StepGraph::run_between_steps`).
    pub fn run_in_pool<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        self.pool.run(f)
    }

    /// Bytes the graph's private pool holds on the device: (reserved, allocated now).
    pub fn pool_bytes(&self) -> Result<(u64, u64)> {
        let b = memory::allocator(self.device)?.private_pool_bytes(self.pool.id);
        Ok((b.reserved, b.allocated))
    }

    /// Runs every host check the capture made on the buffer at `addr` against `values`, the
    /// buffer's next contents (row-major, its whole storage): an out-of-range id is the
    /// error the eager kernels raise; a changed target count asks for a new capture.
    pub fn check_input(&self, addr: u64, values: &[i64]) -> Result<InputCheck> {
        let mut verdict = InputCheck::Replayable;
        for n in self.notes.iter().filter(|n| n.addr == addr) {
            if let Some(why) = run_check(&n.check, &read_through(&n.layout, values)?)? {
                verdict = InputCheck::Recapture(why);
            }
        }
        Ok(verdict)
    }
}

/// The values a kernel reads through `layout` from a buffer holding `values`.
fn read_through(layout: &Layout, values: &[i64]) -> Result<Vec<i64>> {
    layout
        .offsets()
        .map(|o| values.get(o).copied())
        .collect::<Option<_>>()
        .ok_or_else(|| {
            Error::invalid(
                "graph replay",
                "the input has fewer values than the captured step read",
            )
        })
}

/// An `IdCheck` on the values a kernel will read: Err as the eager check would fail,
/// Some(reason) when the values are valid but differ from what the capture baked in.
fn run_check(check: &IdCheck, ids: &[i64]) -> Result<Option<String>> {
    match *check {
        IdCheck::Rows { rows } => {
            super::index::check_row_ids("index_select", ids, rows)?;
            Ok(None)
        }
        IdCheck::Targets {
            classes,
            ignore_index,
            counted,
        } => {
            let now = super::loss::check_class_targets(ids, classes, ignore_index)?;
            Ok((now != counted)
                .then(|| format!("the batch counts {now} targets, the captured step {counted}")))
        }
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // The pool's blocks may still be in use by a queued replay.
        if let Some(exec) = self.exec.take() {
            let _ = super::synchronize(self.device);
            drop(exec);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A graph with no device work, holding `notes` (the host has no pools: dropping it
    /// releases nothing).
    fn graph_with(notes: Vec<Note>) -> Graph {
        let pool = Pool {
            device: Device::Cpu,
            id: memory::allocator(Device::Cpu)
                .unwrap()
                .create_private_pool(),
        };
        Graph {
            exec: None,
            device: Device::Cpu,
            pool,
            notes,
            derived: Vec::new(),
            seed: None,
        }
    }

    #[test]
    fn a_replay_runs_the_checks_the_capture_made_on_that_buffer() {
        let whole = Layout::contiguous(&[2, 3]);
        let g = graph_with(vec![
            Note {
                addr: 512,
                layout: whole.clone(),
                check: IdCheck::Rows { rows: 10 },
            },
            Note {
                addr: 1024,
                layout: whole,
                check: IdCheck::Targets {
                    classes: 10,
                    ignore_index: -100,
                    counted: 6,
                },
            },
        ]);
        let ok = [0, 9, 3, 4, 5, 1];
        assert_eq!(g.check_input(512, &ok).unwrap(), InputCheck::Replayable);
        assert_eq!(g.check_input(1024, &ok).unwrap(), InputCheck::Replayable);
        // Nothing was noted at this address: nothing to check.
        assert_eq!(g.check_input(4096, &[77]).unwrap(), InputCheck::Replayable);
        let err = g.check_input(512, &[0, 10, 3, 4, 5, 1]).unwrap_err();
        assert!(matches!(err, Error::Index { .. }), "{err}");
        let err = g.check_input(1024, &[0, 1, 2, -1, 5, 1]).unwrap_err();
        assert!(matches!(err, Error::Index { .. }), "{err}");
        // Valid, but one target fewer is counted than the captured loss divides by.
        let fewer = [0, 1, 2, -100, 5, 1];
        assert!(matches!(
            g.check_input(1024, &fewer).unwrap(),
            InputCheck::Recapture(_)
        ));
        // Fewer values than the captured view read.
        assert!(g.check_input(512, &[1, 2]).is_err());
    }

    #[test]
    fn a_check_reads_the_values_through_the_captured_layout() {
        // The kernel read every other id (a strided view from offset 1).
        let g = graph_with(vec![Note {
            addr: 512,
            layout: Layout::new(vec![3], vec![2], 1),
            check: IdCheck::Rows { rows: 5 },
        }]);
        // Out-of-range ids where the kernel does not read are not its business.
        assert_eq!(
            g.check_input(512, &[99, 1, 99, 2, 99, 4]).unwrap(),
            InputCheck::Replayable
        );
        assert!(g.check_input(512, &[0, 1, 0, 7, 0, 4]).is_err());
    }
}
