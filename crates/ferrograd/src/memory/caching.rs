//! PyTorch's CUDA caching allocator as a device-independent `Policy`: it carves tensors out
//! of large segments obtained from a `DeviceMemory` and keeps freed blocks cached for reuse,
//! so that steady-state training never calls the driver.
//!
//! The rules (PyTorch `c10/cuda/CUDACachingAllocator.cpp`, native backend, default config):
//!
//! - Rounding: a request below 512 bytes becomes 512, anything else the next multiple of 512.
//!   A zero-byte request gets a null (address 0, size 0) block and touches nothing.
//! - Pools: a rounded size of at most 1 MiB is served from the small pool, anything larger
//!   from the large pool. Segments, and every block carved from them, belong to one pool.
//! - Reuse: free blocks are ordered by (stream, size, address); a request takes the smallest
//!   free block of its pool on its stream that is large enough (best fit, lowest address
//!   among equals). Blocks are never handed to another stream.
//! - Splitting: the request takes the front of the block. In the small pool the rest is split
//!   off as a free block if it is at least 512 bytes; in the large pool only if it is more
//!   than 1 MiB, otherwise the whole block is handed out and `allocated_bytes` counts all of
//!   it.
//! - Miss: a new segment is requested from the device: 2 MiB for small requests, 20 MiB for
//!   requests below 10 MiB, else the request rounded up to a multiple of 2 MiB. If the device
//!   refuses, every cached segment that is entirely free is returned to the device (as
//!   `empty_cache` does), `num_alloc_retries` is incremented and the device is asked once
//!   more; if it refuses again the request fails (the front counts `num_ooms` and reports).
//! - Free: the block is merged with the free blocks directly before and after it in its
//!   segment and goes back to its pool. Nothing is returned to the device on free.
//! - `empty_cache`: every free block that is a whole segment goes back to the device. Segments
//!   holding any live block stay: their free parts are "inactive split" memory.
//! - Statistics, applied to `all` and the block's pool: `allocation`, `allocated_bytes` (block
//!   sizes), `active`, `active_bytes` and `requested_bytes` (caller sizes) follow handing out
//!   and freeing (one stream: no pending frees, so active equals allocated); `segment` and
//!   `reserved_bytes` follow device allocs and frees, counted in `num_device_alloc` /
//!   `num_device_free`; `inactive_split[_bytes]` counts the free blocks of split segments,
//!   updated incrementally exactly where PyTorch updates it (`alloc_found_block`,
//!   `free_block`), so its allocated/freed totals match PyTorch's too.
//!
//! Private pools (CUDA-graph capture, PyTorch's `beginAllocateToPool` / `endAllocateToPool` /
//! `releasePool`): while a pool is active every request is served from that pool's own
//! segments, with all the rules above. A pool is a stream of its own (`pool_stream`), so its
//! blocks never serve, and are never merged with, the shared pools' and other pools' blocks;
//! its frees go back to its own free lists. Its segments count in `segment` and
//! `reserved_bytes` (small or large by size, as in PyTorch) and its blocks in every other
//! statistic like shared ones. While the pool lives (from its first begin until its release)
//! neither `empty_cache` nor the retry after a refused device alloc gives its segments back.
//! Its release gives back at once every segment of the pool that is entirely free; a segment
//! still holding live blocks stays until they are freed, and then goes back at the next
//! `empty_cache` or retry, like PyTorch's freeable graph pools — in between it serves nobody.
//!
//! Not implemented (all off by default in PyTorch): `max_split_size_mb` and oversize blocks,
//! `roundup_power2_divisions`, garbage collection with a memory fraction, expandable segments
//! and cross-stream frees (`record_stream` events).

mod pool;
mod sizes;

pub use pool::{BlockInfo, DEFAULT_STREAM, SegmentInfo, StreamId};

use std::collections::HashSet;

use super::allocator::{MemInfo, Policy, PolicyBlock, SegmentEvent};
use super::device_memory::DeviceMemory;
use super::private_pool::PrivatePoolId;
use super::stats::{DeviceStats, Pool, StatArray};
use pool::{Blocks, Released, Taken};
use sizes::{MAX_REQUEST, allocation_size, round_size};

/// Private pools' streams are this bit plus the pool's number: apart from every real stream,
/// and small enough to stay exact where a snapshot stores it as a JSON or pickle integer.
const PRIVATE_POOL_STREAMS: StreamId = 1 << 48;

/// The stream a private pool's blocks are keyed on (what `segments()` shows for its segments).
pub fn pool_stream(pool: PrivatePoolId) -> StreamId {
    PRIVATE_POOL_STREAMS | StreamId::from(pool.0)
}

/// The caching policy over a device's raw memory `D`.
pub struct CachingPolicy<D: DeviceMemory> {
    device: D,
    blocks: Blocks,
    /// Stream that new requests are served on: `DEFAULT_STREAM`, or the active private
    /// pool's stream.
    stream: StreamId,
    /// Streams of the private pools begun and not yet released: their segments stay.
    live_pools: HashSet<StreamId>,
    /// Segment reserves and releases not yet handed to the recorder (only while recording).
    segment_events: Vec<SegmentEvent>,
}

impl<D: DeviceMemory> CachingPolicy<D> {
    pub fn new(device: D) -> Self {
        CachingPolicy {
            device,
            blocks: Blocks::default(),
            stream: DEFAULT_STREAM,
            live_pools: HashSet::new(),
            segment_events: Vec::new(),
        }
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    /// Every segment and its blocks, by address (what a memory snapshot shows).
    pub fn segments(&self) -> Vec<SegmentInfo> {
        self.blocks.segments()
    }

    /// A free block of at least `size` bytes in `pool`: cached, or a new segment.
    fn find_or_allocate(
        &mut self,
        size: usize,
        pool: Pool,
        stats: &mut DeviceStats,
    ) -> Option<u64> {
        if let Some(addr) = self.blocks.best_fit(pool, self.stream, size) {
            return Some(addr);
        }
        let seg = allocation_size(size);
        self.alloc_segment(seg, pool, stats).or_else(|| {
            // PyTorch counts the retry when it is attempted, whether or not it then succeeds.
            self.release_cached(stats);
            stats.num_alloc_retries += 1;
            self.alloc_segment(seg, pool, stats)
        })
    }

    fn alloc_segment(&mut self, size: usize, pool: Pool, stats: &mut DeviceStats) -> Option<u64> {
        let addr = self.device.alloc(size)?;
        self.blocks.add_segment(addr, size, self.stream, pool);
        self.note_segment(true, addr, size, self.stream);
        stats.segment.increase(pool, 1);
        stats.reserved_bytes.increase(pool, size as i64);
        stats.num_device_alloc += 1;
        Some(addr)
    }

    fn note_segment(&mut self, reserved: bool, addr: u64, size: usize, stream: StreamId) {
        if super::recorder::is_recording() {
            self.segment_events.push(SegmentEvent {
                reserved,
                addr,
                size,
                stream,
            });
        }
    }

    /// `release_cached_blocks`: gives every entirely free segment back to the device, except
    /// those of live private pools (a captured graph still uses their addresses).
    fn release_cached(&mut self, stats: &mut DeviceStats) {
        let live = &self.live_pools;
        let drained = self.blocks.drain_free_segments(|s| !live.contains(&s));
        self.give_back(drained, stats);
    }

    /// Returns segments taken out of the pools to the device.
    fn give_back(&mut self, drained: Vec<(u64, usize, Pool, StreamId)>, stats: &mut DeviceStats) {
        for (addr, size, pool, stream) in drained {
            self.device.free(addr, size);
            self.note_segment(false, addr, size, stream);
            stats.segment.decrease(pool, 1);
            stats.reserved_bytes.decrease(pool, size as i64);
            stats.num_device_free += 1;
        }
    }
}

/// `alloc_found_block`'s statistics.
fn record_take(stats: &mut DeviceStats, t: &Taken, requested: usize) {
    let (pool, size) = (t.block.pool, t.block.size as i64);
    match (t.remainder, t.already_split) {
        // An inactive split block shrinks by the handed-out part; the count is unchanged.
        (Some(_), true) => stats.inactive_split_bytes.decrease(pool, size),
        // A whole segment is split for the first time: its remainder is a new inactive split.
        (Some(rest), false) => {
            stats.inactive_split_bytes.increase(pool, rest as i64);
            stats.inactive_split.increase(pool, 1);
        }
        // An inactive split block is handed out whole.
        (None, true) => {
            stats.inactive_split_bytes.decrease(pool, size);
            stats.inactive_split.decrease(pool, 1);
        }
        (None, false) => {}
    }
    stats.allocation.increase(pool, 1);
    stats.allocated_bytes.increase(pool, size);
    stats.active.increase(pool, 1);
    stats.active_bytes.increase(pool, size);
    stats.requested_bytes.increase(pool, requested as i64);
}

/// `free` + `free_block`'s statistics.
fn record_release(stats: &mut DeviceStats, r: &Released) {
    let (pool, size) = (r.pool, r.size as i64);
    stats.allocation.decrease(pool, 1);
    stats.allocated_bytes.decrease(pool, size);
    let (mut blocks, mut bytes) = (-r.merged.0, -r.merged.1);
    if let Some(free) = r.split_free {
        blocks += 1;
        bytes += free as i64;
    }
    apply_net(&mut stats.inactive_split, r.pool, blocks);
    apply_net(&mut stats.inactive_split_bytes, r.pool, bytes);
    stats.active.decrease(pool, 1);
    stats.active_bytes.decrease(pool, size);
    stats.requested_bytes.decrease(pool, r.requested as i64);
}

/// Applies a net change as PyTorch does: one increase or one decrease, never both, so the
/// allocated/freed totals count the net movement only.
fn apply_net(stat: &mut StatArray, pool: Pool, delta: i64) {
    if delta > 0 {
        stat.increase(pool, delta);
    } else if delta < 0 {
        stat.decrease(pool, -delta);
    }
}

impl<D: DeviceMemory> Policy for CachingPolicy<D> {
    fn malloc(&mut self, requested: usize, stats: &mut DeviceStats) -> Option<PolicyBlock> {
        if requested == 0 {
            return Some(PolicyBlock {
                addr: 0,
                size: 0,
                pool: Pool::Small,
            });
        }
        if requested as u64 >= MAX_REQUEST {
            return None;
        }
        let size = round_size(requested);
        let pool = Pool::for_size(size);
        let addr = self.find_or_allocate(size, pool, stats)?;
        let taken = self.blocks.take(addr, size, requested)?;
        record_take(stats, &taken, requested);
        Some(taken.block)
    }

    fn free(&mut self, block: &PolicyBlock, _requested: usize, stats: &mut DeviceStats) {
        if block.size == 0 {
            return;
        }
        // The block records the caller's size itself, as PyTorch's does.
        match self.blocks.release(block.addr) {
            Some(r) => record_release(stats, &r),
            None => debug_assert!(false, "caching allocator: free of unknown block {block:?}"),
        }
    }

    fn empty_cache(&mut self, stats: &mut DeviceStats) {
        self.release_cached(stats);
    }

    fn mem_info(&self) -> MemInfo {
        self.device.mem_info()
    }

    fn stream(&self) -> u64 {
        self.stream
    }

    fn segments(&self) -> Option<Vec<SegmentInfo>> {
        Some(self.blocks.segments())
    }

    fn drain_segment_events(&mut self, out: &mut dyn FnMut(SegmentEvent)) {
        for e in self.segment_events.drain(..) {
            out(e);
        }
    }

    fn supports_private_pools(&self) -> bool {
        true
    }

    fn begin_private_pool(&mut self, pool: PrivatePoolId) {
        self.stream = pool_stream(pool);
        self.live_pools.insert(self.stream);
    }

    fn end_private_pool(&mut self) {
        self.stream = DEFAULT_STREAM;
    }

    fn release_private_pool(&mut self, pool: PrivatePoolId, stats: &mut DeviceStats) {
        let stream = pool_stream(pool);
        self.live_pools.remove(&stream);
        if self.stream == stream {
            self.stream = DEFAULT_STREAM;
        }
        let drained = self.blocks.drain_free_segments(|s| s == stream);
        self.give_back(drained, stats);
    }

    fn private_pool_reserved(&self, pool: PrivatePoolId) -> usize {
        self.blocks.stream_bytes(pool_stream(pool))
    }
}

#[cfg(test)]
mod tests;
