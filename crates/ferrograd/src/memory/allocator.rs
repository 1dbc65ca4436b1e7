//! The per-device allocator front: the single source of truth for bytes on a device.
//!
//! It owns the statistics, the live-block table (category, origin) and the category sums,
//! and delegates *where* bytes come from to a `Policy`: the host policy counts exact bytes
//! (CPU tensors own their buffers), the caching policy hands out sub-blocks of reserved
//! segments with PyTorch's rules. Tensor storages hold an `Allocation`, whose drop frees it.
//!
//! Private pools (see `private_pool`) are driven from here: while one is active, the drop of
//! a block from outside it is deferred until the pool's release; the block stays live and keeps its category, so the sums always equal
//! `memory_allocated`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::caching::SegmentInfo;
use super::private_pool::{PoolBook, PrivatePoolBytes, PrivatePoolId};
use super::recorder::{self, Action, Origin, Record, SnapshotBlock, SnapshotSegment};
use super::scope::{self, ScopeMemory};
use super::stats::{DeviceStats, Pool};
use crate::base::Device;
use crate::base::{Category, CategoryBytes};
use crate::base::{Error, Result};
use crate::base::{LiveBlockInfo, OomReport};

/// A block as the policy hands it out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyBlock {
    /// Device address (0 on the host, where the buffer is owned by the storage).
    pub addr: u64,
    /// Size after rounding: what `allocated_bytes` counts.
    pub size: usize,
    pub pool: Pool,
}

/// A segment the policy reserved from (or gave back to) the device, reported to the front
/// for the recorder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentEvent {
    /// True for a reserve, false for a release.
    pub reserved: bool,
    pub addr: u64,
    pub size: usize,
    /// The stream the segment serves (a private pool's own for its segments).
    pub stream: u64,
}

/// Total and free bytes of the device, as its driver reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    pub total: u64,
    pub free: u64,
}

/// Where a device's bytes come from. Implementations update the statistics they own
/// (allocation, allocated/active/requested bytes, segments, reserved, inactive split).
pub trait Policy: Send {
    /// A block of at least `requested` bytes, or None when even freeing the cache and retrying
    /// cannot serve it. The front counts the OOM.
    fn malloc(&mut self, requested: usize, stats: &mut DeviceStats) -> Option<PolicyBlock>;
    fn free(&mut self, block: &PolicyBlock, requested: usize, stats: &mut DeviceStats);
    /// Returns whole free segments to the driver.
    fn empty_cache(&mut self, stats: &mut DeviceStats);
    fn mem_info(&self) -> MemInfo;
    /// True only for the placeholder of a device whose backend has not opened it.
    fn is_unopened(&self) -> bool {
        false
    }
    /// The stream new blocks are served on.
    fn stream(&self) -> u64 {
        0
    }
    /// Whether every block is a segment of its own (a policy that caches nothing).
    fn segment_per_block(&self) -> bool {
        false
    }
    /// The segments and the blocks tiling them (None when `segment_per_block`, or there are
    /// no segments).
    fn segments(&self) -> Option<Vec<SegmentInfo>> {
        None
    }
    /// Hands over the segment reserves and releases made since the last call, in order
    /// (buffered only while a recording runs). A policy without segments has none.
    fn drain_segment_events(&mut self, _out: &mut dyn FnMut(SegmentEvent)) {}
    /// Whether the policy has private pools (the hooks below do nothing otherwise).
    fn supports_private_pools(&self) -> bool {
        false
    }
    /// Serves every request from `pool`'s own segments until `end_private_pool`.
    fn begin_private_pool(&mut self, _pool: PrivatePoolId) {}
    /// Serves requests from the shared pools again.
    fn end_private_pool(&mut self) {}
    /// `pool` is dead: its segments may go back to the device.
    fn release_private_pool(&mut self, _pool: PrivatePoolId, _stats: &mut DeviceStats) {}
    /// Bytes of the segments reserved for `pool`.
    fn private_pool_reserved(&self, _pool: PrivatePoolId) -> usize {
        0
    }
}

struct LiveBlock {
    block: PolicyBlock,
    requested: usize,
    base: Category,
    saved_refs: u32,
    /// The op that asked, and (while recording) the module and call site.
    origin: Origin,
    /// The scope of the thread that allocated it (see `scope`).
    scope: Option<u16>,
    /// The stream the policy served it on (a private pool's own while one was active).
    stream: u64,
    /// The private pool it was allocated in, if any.
    pool: Option<PrivatePoolId>,
}

impl LiveBlock {
    fn category(&self) -> Category {
        if self.saved_refs > 0 && self.base.becomes_saved_when_held_by_graph() {
            Category::SavedActivation
        } else {
            self.base
        }
    }
}

struct State {
    policy: Box<dyn Policy>,
    stats: DeviceStats,
    categories: CategoryBytes,
    categories_at_peak: CategoryBytes,
    live: HashMap<u64, LiveBlock>,
    next_id: u64,
    /// Per-scope sums, indexed by scope id.
    scopes: Vec<ScopeMemory>,
    pools: PoolBook,
}

impl State {
    fn scope_mut(&mut self, id: Option<u16>) -> Option<&mut ScopeMemory> {
        let i = usize::from(id?);
        if self.scopes.len() <= i {
            self.scopes.resize(i + 1, ScopeMemory::default());
        }
        self.scopes.get_mut(i)
    }

    /// The live private pool whose release the free of block `id` must wait for: the active
    /// pool when the block is not its own (the graph being captured may read it at every
    /// replay).
    fn defer_to(&self, id: u64) -> Option<PrivatePoolId> {
        let b = self.live.get(&id).filter(|b| b.block.size > 0)?;
        self.pools.active().filter(|&active| b.pool != Some(active))
    }
}

/// One device's allocator.
pub struct Allocator {
    device: Device,
    state: Mutex<State>,
}

/// A live block; dropping it frees the bytes.
pub struct Allocation {
    id: u64,
    size: usize,
    addr: u64,
    allocator: Arc<Allocator>,
}

impl Allocator {
    pub fn new(device: Device, policy: Box<dyn Policy>) -> Arc<Self> {
        Arc::new(Allocator {
            device,
            state: Mutex::new(State {
                policy,
                stats: DeviceStats::default(),
                categories: CategoryBytes::default(),
                categories_at_peak: CategoryBytes::default(),
                live: HashMap::new(),
                next_id: 1,
                scopes: Vec::new(),
                pools: PoolBook::default(),
            }),
        })
    }

    pub fn device(&self) -> Device {
        self.device
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the counters half-updated in a way that
        // matters more than losing all statistics, so recover the guard.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Accounts `requested` bytes under `category`; `origin` names the op that asked.
    pub fn malloc(
        self: &Arc<Self>,
        requested: usize,
        category: Category,
        origin: &'static str,
    ) -> Result<Allocation> {
        let recording = recorder::is_recording();
        let mut st = self.lock();
        let st = &mut *st;
        let Some(block) = st.policy.malloc(requested, &mut st.stats) else {
            st.stats.num_ooms += 1;
            if recording {
                self.record_oom(st, requested, origin);
            }
            return Err(Error::OutOfMemory(Box::new(
                self.oom_report(st, requested, origin),
            )));
        };
        let origin = if recording {
            recorder::current_origin(origin)
        } else {
            Origin {
                op: origin,
                ..Origin::NONE
            }
        };
        let id = st.next_id;
        st.next_id += 1;
        st.categories.add(category, block.size as u64);
        if st.stats.allocated_bytes.all.current >= st.stats.allocated_bytes.all.peak {
            st.categories_at_peak = st.categories;
        }
        let (size, addr) = (block.size, block.addr);
        let scope = scope::current();
        if let Some(s) = st.scope_mut(scope) {
            s.add(category, size as u64);
        }
        let live = LiveBlock {
            block,
            requested,
            base: category,
            saved_refs: 0,
            origin,
            scope,
            stream: st.policy.stream(),
            pool: st.pools.active(),
        };
        if recording {
            self.record_block(st, Action::Alloc, &live, category);
        }
        st.live.insert(id, live);
        Ok(Allocation {
            id,
            size,
            addr,
            allocator: Arc::clone(self),
        })
    }

    /// `malloc` from the shared pools even while a private pool is active, for a block that
    /// outlives any capture (the cuBLAS workspace, kept for the process; a step buffer that
    /// a graph rewrites): made in the pool, it would keep the pool's segment after the graph.
    pub fn malloc_shared(
        self: &Arc<Self>,
        requested: usize,
        category: Category,
        origin: &'static str,
    ) -> Result<Allocation> {
        self.outside_private_pool(|| self.malloc(requested, category, origin))
    }

    /// Runs `f` with its allocations served from the shared pools even while a private pool
    /// is active (`malloc_shared` for whole tensors: state made during a step that the
    /// graph's pool must not keep).
    pub fn outside_private_pool<R>(self: &Arc<Self>, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let active = self.lock().pools.active();
        let Some(pool) = active else {
            return f();
        };
        self.end_private_pool()?;
        let r = f();
        self.begin_private_pool(pool)?;
        r
    }

    /// The drop of block `id`: freed now, or deferred until a private pool's release.
    fn free(&self, id: u64) {
        let mut st = self.lock();
        let st = &mut *st;
        match st.defer_to(id) {
            Some(pool) => st.pools.defer(pool, id),
            None => self.free_now(st, id),
        }
    }

    /// Takes block `id` out of the accounting and gives its bytes back to the policy.
    fn free_now(&self, st: &mut State, id: u64) {
        let recording = recorder::is_recording();
        if let Some(b) = st.live.remove(&id) {
            st.categories.sub(b.category(), b.block.size as u64);
            if let Some(s) = st.scope_mut(b.scope) {
                s.sub(b.category(), b.block.size as u64);
            }
            if recording {
                self.record_block(st, Action::Free, &b, b.category());
            }
            st.policy.free(&b.block, b.requested, &mut st.stats);
            if recording {
                self.record_segments(st, Some((&b, false)));
            }
        }
    }

    /// Records an allocation (after the segment it needed) or a free (before the segment it
    /// releases, which `free` records after the policy ran).
    fn record_block(&self, st: &mut State, action: Action, b: &LiveBlock, category: Category) {
        if b.block.size == 0 {
            return;
        }
        if action == Action::Alloc {
            self.record_segments(st, Some((b, true)));
        }
        recorder::record(Record {
            action,
            device: self.device,
            addr: b.block.addr,
            size: b.block.size as u64,
            requested: b.requested as u64,
            stream: b.stream,
            category,
            origin: b.origin,
        });
    }

    /// Records the segments the policy reserved or released; for a policy with one segment
    /// per block, the front records the reserve (true) or release of `around`'s segment.
    fn record_segments(&self, st: &mut State, around: Option<(&LiveBlock, bool)>) {
        let device = self.device;
        let origin = around.map_or(Origin::NONE, |(b, _)| b.origin);
        let mut emit = |e: SegmentEvent| {
            recorder::record(Record {
                action: if e.reserved {
                    Action::SegmentAlloc
                } else {
                    Action::SegmentFree
                },
                device,
                addr: e.addr,
                size: e.size as u64,
                requested: 0,
                stream: e.stream,
                category: Category::Temporary,
                origin,
            })
        };
        st.policy.drain_segment_events(&mut emit);
        if let Some((b, reserved)) = around
            && b.block.size > 0
            && st.policy.segment_per_block()
        {
            emit(SegmentEvent {
                reserved,
                addr: b.block.addr,
                size: b.block.size,
                stream: b.stream,
            });
        }
    }

    fn record_oom(&self, st: &mut State, requested: usize, op: &'static str) {
        self.record_segments(st, None);
        let device_free = st.policy.mem_info().free;
        recorder::record(Record {
            action: Action::Oom { device_free },
            device: self.device,
            addr: 0,
            size: requested as u64,
            requested: requested as u64,
            stream: st.policy.stream(),
            category: Category::Temporary,
            origin: recorder::current_origin(op),
        });
    }

    /// The segments and blocks as they are now, with each live block's category and origin.
    pub(super) fn snapshot(&self) -> Vec<SnapshotSegment> {
        let st = self.lock();
        let owner = |b: &LiveBlock| Some((b.category(), b.origin));
        let live: HashMap<u64, &LiveBlock> = st
            .live
            .values()
            .filter(|b| b.block.size > 0)
            .map(|b| (b.block.addr, b))
            .collect();
        let Some(segments) = st.policy.segments() else {
            let mut own: Vec<_> = live.values().collect();
            own.sort_by_key(|b| b.block.addr);
            return own
                .into_iter()
                .map(|b| SnapshotSegment {
                    device: self.device,
                    addr: b.block.addr,
                    size: b.block.size as u64,
                    stream: b.stream,
                    pool: b.block.pool,
                    blocks: vec![SnapshotBlock {
                        addr: b.block.addr,
                        size: b.block.size as u64,
                        requested: b.requested as u64,
                        owner: owner(b),
                    }],
                })
                .collect();
        };
        segments
            .into_iter()
            .map(|s| SnapshotSegment {
                device: self.device,
                addr: s.addr,
                size: s.size as u64,
                stream: s.stream,
                pool: s.pool,
                blocks: s
                    .blocks
                    .iter()
                    .map(|b| SnapshotBlock {
                        addr: b.addr,
                        size: b.size as u64,
                        requested: b.requested as u64,
                        owner: b
                            .allocated
                            .then(|| live.get(&b.addr).and_then(|l| owner(l)))
                            .flatten(),
                    })
                    .collect(),
            })
            .collect()
    }

    /// Applies `f` to a live block's category state, moving its bytes between sums.
    fn relabel(&self, id: u64, f: impl FnOnce(&mut LiveBlock)) {
        let recording = recorder::is_recording();
        let mut st = self.lock();
        let st = &mut *st;
        if let Some(b) = st.live.get_mut(&id) {
            let before = b.category();
            f(b);
            let after = b.category();
            if before != after {
                st.categories.sub(before, b.block.size as u64);
                st.categories.add(after, b.block.size as u64);
                let (scope, size) = (b.scope, b.block.size as u64);
                if let Some(s) = st.scopes.get_mut(scope.map_or(usize::MAX, usize::from)) {
                    s.sub(before, size);
                    s.add(after, size);
                }
                if recording && b.block.size > 0 {
                    recorder::record(Record {
                        action: Action::Relabel { from: before },
                        device: self.device,
                        addr: b.block.addr,
                        size: b.block.size as u64,
                        requested: b.requested as u64,
                        stream: b.stream,
                        category: after,
                        origin: b.origin,
                    });
                }
            }
        }
    }

    fn oom_report(&self, st: &State, requested: usize, origin: &'static str) -> OomReport {
        let mut largest: Vec<LiveBlockInfo> = st
            .live
            .values()
            .map(|b| LiveBlockInfo {
                bytes: b.block.size as u64,
                category: b.category(),
                origin: b.origin.op,
            })
            .collect();
        largest.sort_by_key(|b| std::cmp::Reverse(b.bytes));
        largest.truncate(5);
        let info = st.policy.mem_info();
        OomReport {
            device: self.device,
            requested: requested as u64,
            origin,
            capacity: info.total,
            free: info.free,
            allocated: st.stats.allocated_bytes.all.current as u64,
            reserved: st.stats.reserved_bytes.all.current as u64,
            by_category: st.categories,
            largest,
        }
    }

    /// Every live block: its size, category and the op that allocated it.
    pub fn live_block_infos(&self) -> Vec<LiveBlockInfo> {
        self.lock()
            .live
            .values()
            .map(|b| LiveBlockInfo {
                bytes: b.block.size as u64,
                category: b.category(),
                origin: b.origin.op,
            })
            .collect()
    }

    pub fn stats(&self) -> DeviceStats {
        self.lock().stats.clone()
    }
    pub fn memory_allocated(&self) -> u64 {
        self.lock().stats.allocated_bytes.all.current as u64
    }
    pub fn max_memory_allocated(&self) -> u64 {
        self.lock().stats.allocated_bytes.all.peak as u64
    }
    pub fn memory_reserved(&self) -> u64 {
        self.lock().stats.reserved_bytes.all.current as u64
    }
    pub fn max_memory_reserved(&self) -> u64 {
        self.lock().stats.reserved_bytes.all.peak as u64
    }
    pub fn by_category(&self) -> CategoryBytes {
        self.lock().categories
    }
    /// Category sums at the moment `max_memory_allocated` was last reached.
    pub fn by_category_at_peak(&self) -> CategoryBytes {
        self.lock().categories_at_peak
    }
    pub fn reset_peak_memory_stats(&self) {
        let mut st = self.lock();
        st.stats.reset_peak();
        st.categories_at_peak = st.categories;
        st.scopes.iter_mut().for_each(ScopeMemory::reset_peak);
    }
    /// The bytes of scope `id` (zeros for a scope that allocated nothing).
    pub fn scope_memory(&self, id: u16) -> ScopeMemory {
        let st = self.lock();
        st.scopes.get(usize::from(id)).copied().unwrap_or_default()
    }
    pub fn reset_accumulated_memory_stats(&self) {
        self.lock().stats.reset_accumulated();
    }
    pub fn empty_cache(&self) {
        let recording = recorder::is_recording();
        let mut st = self.lock();
        let st = &mut *st;
        st.policy.empty_cache(&mut st.stats);
        if recording {
            self.record_segments(st, None);
        }
    }
    /// Whether this is a GPU's placeholder, waiting for its backend to register memory.
    pub(crate) fn is_unopened(&self) -> bool {
        self.lock().policy.is_unopened()
    }

    pub fn mem_info(&self) -> MemInfo {
        self.lock().policy.mem_info()
    }
    /// Number of live blocks (for leak checks in tests).
    pub fn live_blocks(&self) -> usize {
        self.lock().live.len()
    }
}

/// Private pools (CUDA-graph capture). Pool ids are this allocator's own.
impl Allocator {
    /// A fresh pool id; the pool reserves nothing until it is begun.
    pub fn create_private_pool(&self) -> PrivatePoolId {
        self.lock().pools.create()
    }

    /// Serves every allocation of this device from `pool`'s own segments until
    /// `end_private_pool`. A pool may be begun again after its end (several graphs sharing
    /// one pool), until it is released.
    pub fn begin_private_pool(&self, pool: PrivatePoolId) -> Result<()> {
        let mut st = self.lock();
        self.check_pools(&st, "begin_private_pool")?;
        st.pools.begin(pool)?;
        st.policy.begin_private_pool(pool);
        Ok(())
    }

    /// Ends the active pool: allocations come from the shared pools again. The pool's
    /// segments stay reserved for it until its release.
    pub fn end_private_pool(&self) -> Result<()> {
        let mut st = self.lock();
        self.check_pools(&st, "end_private_pool")?;
        st.pools.end()?;
        st.policy.end_private_pool();
        Ok(())
    }

    /// Ends `pool`'s life: performs the frees it deferred, in the order of the drops, then
    /// gives the pool's entirely
    /// free segments back to the device; the others go once their blocks are freed, at the
    /// next `empty_cache` (or retry after a refused device alloc).
    pub fn release_private_pool(&self, pool: PrivatePoolId) -> Result<()> {
        let recording = recorder::is_recording();
        let mut st = self.lock();
        let st = &mut *st;
        self.check_pools(st, "release_private_pool")?;
        for id in st.pools.release(pool)? {
            self.free_now(st, id);
        }
        st.policy.release_private_pool(pool, &mut st.stats);
        if recording {
            self.record_segments(st, None);
        }
        Ok(())
    }

    /// The bytes reserved for `pool` and those of its live blocks (zeros for an unknown pool).
    pub fn private_pool_bytes(&self, pool: PrivatePoolId) -> PrivatePoolBytes {
        let st = self.lock();
        let allocated = st
            .live
            .values()
            .filter(|b| b.pool == Some(pool))
            .map(|b| b.block.size as u64)
            .sum();
        PrivatePoolBytes {
            reserved: st.policy.private_pool_reserved(pool) as u64,
            allocated,
        }
    }

    /// Errors unless this device's policy has private pools.
    fn check_pools(&self, st: &State, op: &'static str) -> Result<()> {
        if st.policy.supports_private_pools() {
            return Ok(());
        }
        let device = self.device;
        let why = if st.policy.is_unopened() {
            format!("{device} has not been opened by its backend yet")
        } else {
            format!("{device} has none")
        };
        Err(Error::invalid(
            op,
            format!("private memory pools exist only on CUDA devices; {why}"),
        ))
    }
}

impl Allocation {
    /// Rounded size, as counted in `allocated_bytes`.
    pub fn size(&self) -> usize {
        self.size
    }
    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn device(&self) -> Device {
        self.allocator.device
    }
    pub fn set_category(&self, c: Category) {
        self.allocator.relabel(self.id, |b| b.base = c);
    }
    pub fn category(&self) -> Option<Category> {
        self.allocator
            .lock()
            .live
            .get(&self.id)
            .map(|b| b.category())
    }
    /// The autograd graph starts holding this block for backward.
    pub(crate) fn add_saved_ref(&self) {
        self.allocator.relabel(self.id, |b| b.saved_refs += 1);
    }
    pub(crate) fn remove_saved_ref(&self) {
        self.allocator
            .relabel(self.id, |b| b.saved_refs = b.saved_refs.saturating_sub(1));
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        self.allocator.free(self.id);
    }
}

impl std::fmt::Debug for Allocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Allocation({} bytes on {})",
            self.size, self.allocator.device
        )
    }
}
