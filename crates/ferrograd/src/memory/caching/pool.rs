//! Block bookkeeping of the caching allocator: every block of every segment, keyed by address
//! and linked to its neighbours in the segment, plus the two free pools (small, large) ordered
//! by `(stream, size, address)` for best-fit search. Pure mechanics: the statistics are
//! updated by the policy from what `take` and `release` report.

use std::collections::{BTreeSet, HashMap};

use crate::memory::allocator::PolicyBlock;
use crate::memory::stats::Pool;

use super::sizes::should_split;

/// A stream of the device. Blocks are only reused on the stream they were allocated on.
pub type StreamId = u64;
/// The only stream until the device backend has several.
pub const DEFAULT_STREAM: StreamId = 0;

/// One contiguous piece of a segment, free or handed out.
#[derive(Clone, Debug)]
struct Block {
    addr: u64,
    size: usize,
    stream: StreamId,
    pool: Pool,
    /// Neighbours in the same segment (by address); both None = the block is the segment.
    prev: Option<u64>,
    next: Option<u64>,
    allocated: bool,
    /// The caller's unrounded size while allocated.
    requested: usize,
}

impl Block {
    fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
    fn key(&self) -> FreeKey {
        (self.stream, self.size, self.addr)
    }
}

/// Free-pool order: same stream together, then smallest first, then lowest address.
type FreeKey = (StreamId, usize, u64);

/// What handing out a free block did, for the statistics.
pub struct Taken {
    pub block: PolicyBlock,
    /// The free block was already part of a split segment (it counted as inactive split).
    pub already_split: bool,
    /// Size of the free remainder split off behind the handed-out block, if any.
    pub remainder: Option<usize>,
}

/// What returning a block did, for the statistics.
pub struct Released {
    pub size: usize,
    pub requested: usize,
    pub pool: Pool,
    /// Free neighbours absorbed into the returned block (count, bytes).
    pub merged: (i64, i64),
    /// Size of the resulting free block if it is still part of a split segment.
    pub split_free: Option<usize>,
}

/// A segment as `segments()` reports it (PyTorch's snapshot `SegmentInfo`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    pub addr: u64,
    pub size: usize,
    pub pool: Pool,
    pub stream: StreamId,
    pub blocks: Vec<BlockInfo>,
}

/// A block inside a `SegmentInfo`, in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    pub addr: u64,
    pub size: usize,
    pub allocated: bool,
    /// The caller's size (0 for free blocks).
    pub requested: usize,
}

#[derive(Default)]
pub struct Blocks {
    all: HashMap<u64, Block>,
    small: BTreeSet<FreeKey>,
    large: BTreeSet<FreeKey>,
}

impl Blocks {
    fn free_set(&mut self, pool: Pool) -> &mut BTreeSet<FreeKey> {
        match pool {
            Pool::Small => &mut self.small,
            Pool::Large => &mut self.large,
        }
    }

    fn is_free(&self, addr: Option<u64>) -> Option<&Block> {
        self.all.get(&addr?).filter(|b| !b.allocated)
    }

    /// `get_free_block`: address of the smallest free block on `stream` of at least `size`
    /// bytes, lowest address first among equals.
    pub fn best_fit(&self, pool: Pool, stream: StreamId, size: usize) -> Option<u64> {
        let set = match pool {
            Pool::Small => &self.small,
            Pool::Large => &self.large,
        };
        set.range((stream, size, 0)..=(stream, usize::MAX, u64::MAX))
            .next()
            .map(|&(_, _, addr)| addr)
    }

    /// Registers a fresh segment from the device as one free, unsplit block.
    pub fn add_segment(&mut self, addr: u64, size: usize, stream: StreamId, pool: Pool) {
        let block = Block {
            addr,
            size,
            stream,
            pool,
            prev: None,
            next: None,
            allocated: false,
            requested: 0,
        };
        self.free_set(pool).insert(block.key());
        self.all.insert(addr, block);
    }

    /// `alloc_found_block`: hands out the front `size` bytes of the free block at `addr`,
    /// leaving the rest free in the pool when `should_split` says so. None if `addr` is not
    /// a free block.
    pub fn take(&mut self, addr: u64, size: usize, requested: usize) -> Option<Taken> {
        let block = self
            .all
            .get(&addr)
            .filter(|b| !b.allocated && b.size >= size)?;
        let (key, pool, stream, already_split) =
            (block.key(), block.pool, block.stream, block.is_split());
        let remainder = should_split(pool, block.size, size).then(|| block.size - size);
        self.free_set(pool).remove(&key);
        if let Some(rest) = remainder {
            self.split_off(addr, size, rest, stream, pool);
        }
        let block = self.all.get_mut(&addr)?;
        block.allocated = true;
        block.requested = requested;
        Some(Taken {
            block: PolicyBlock {
                addr,
                size: block.size,
                pool,
            },
            already_split,
            remainder,
        })
    }

    /// Shrinks the block at `addr` to `size` and inserts a free block of `rest` bytes after it.
    fn split_off(&mut self, addr: u64, size: usize, rest: usize, stream: StreamId, pool: Pool) {
        let rest_addr = addr + size as u64;
        let Some(block) = self.all.get_mut(&addr) else {
            return;
        };
        let old_next = block.next.replace(rest_addr);
        block.size = size;
        if let Some(n) = old_next.and_then(|n| self.all.get_mut(&n)) {
            n.prev = Some(rest_addr);
        }
        let remainder = Block {
            addr: rest_addr,
            size: rest,
            stream,
            pool,
            prev: Some(addr),
            next: old_next,
            allocated: false,
            requested: 0,
        };
        self.free_set(pool).insert(remainder.key());
        self.all.insert(rest_addr, remainder);
    }

    /// `free_block`: marks the block at `addr` free, merges it with free neighbours of its
    /// segment and puts the result in its pool. None if `addr` is not an allocated block.
    pub fn release(&mut self, addr: u64) -> Option<Released> {
        let block = self.all.get_mut(&addr).filter(|b| b.allocated)?;
        block.allocated = false;
        let (size, requested, pool) =
            (block.size, std::mem::take(&mut block.requested), block.pool);
        let (prev, next) = (block.prev, block.next);
        let mut merged = (0, 0);
        let mut head = addr;
        if let Some(n) = self.is_free(next).map(|b| b.addr) {
            merged.0 += 1;
            merged.1 += self.absorb_next(addr, n) as i64;
        }
        if let Some(p) = self.is_free(prev).map(|b| b.addr) {
            merged.0 += 1;
            merged.1 += self.all.get(&p).map_or(0, |b| b.size) as i64;
            self.absorb_next(p, addr);
            head = p;
        }
        let merged_block = self.all.get(&head)?;
        let (key, split_free) = (
            merged_block.key(),
            merged_block.is_split().then_some(merged_block.size),
        );
        self.free_set(pool).insert(key);
        Some(Released {
            size,
            requested,
            pool,
            merged,
            split_free,
        })
    }

    /// Merges the free block at `right` (the `next` of `left`) into `left`, taking both out
    /// of the free pool (the caller re-inserts the result). Returns `right`'s size.
    fn absorb_next(&mut self, left: u64, right: u64) -> usize {
        let Some(r) = self.all.remove(&right) else {
            return 0;
        };
        self.free_set(r.pool).remove(&r.key());
        if let Some(l) = self.all.get(&left) {
            let key = l.key();
            self.free_set(l.pool).remove(&key);
        }
        if let Some(n) = r.next.and_then(|n| self.all.get_mut(&n)) {
            n.prev = Some(left);
        }
        if let Some(l) = self.all.get_mut(&left) {
            l.size += r.size;
            l.next = r.next;
        }
        r.size
    }

    /// Takes every free block that is a whole segment on a stream `drain` accepts out of the
    /// pools and returns `(addr, size, pool, stream)` of each, large pool first, for the
    /// caller to give back.
    pub fn drain_free_segments(
        &mut self,
        drain: impl Fn(StreamId) -> bool,
    ) -> Vec<(u64, usize, Pool, StreamId)> {
        let whole: Vec<FreeKey> = [&self.large, &self.small]
            .into_iter()
            .flat_map(|set| set.iter().copied())
            .filter(|&(stream, _, _)| drain(stream))
            .filter(|(_, _, addr)| self.all.get(addr).is_some_and(|b| !b.is_split()))
            .collect();
        whole
            .into_iter()
            .filter_map(|key| {
                let b = self.all.remove(&key.2)?;
                self.free_set(b.pool).remove(&key);
                Some((b.addr, b.size, b.pool, b.stream))
            })
            .collect()
    }

    /// Bytes of the segments on `stream` (its blocks tile them).
    pub fn stream_bytes(&self, stream: StreamId) -> usize {
        self.all
            .values()
            .filter(|b| b.stream == stream)
            .map(|b| b.size)
            .sum()
    }

    /// Every segment with its blocks, by address.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        let mut out: Vec<SegmentInfo> = self
            .all
            .values()
            .filter(|b| b.prev.is_none())
            .map(|head| self.segment_from(head))
            .collect();
        out.sort_by_key(|s| s.addr);
        out
    }

    fn segment_from(&self, head: &Block) -> SegmentInfo {
        let mut blocks = Vec::new();
        let mut cur = Some(head);
        while let Some(b) = cur {
            blocks.push(BlockInfo {
                addr: b.addr,
                size: b.size,
                allocated: b.allocated,
                requested: b.requested,
            });
            cur = b.next.and_then(|n| self.all.get(&n));
        }
        SegmentInfo {
            addr: head.addr,
            size: blocks.iter().map(|b| b.size).sum(),
            pool: head.pool,
            stream: head.stream,
            blocks,
        }
    }

    /// Number of free blocks in both pools.
    #[cfg(test)]
    pub fn free_blocks(&self) -> usize {
        self.small.len() + self.large.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;
    const BASE: u64 = 1 << 40;

    fn pool_with_segment(size: usize, pool: Pool) -> Blocks {
        let mut b = Blocks::default();
        b.add_segment(BASE, size, DEFAULT_STREAM, pool);
        b
    }

    fn layout(b: &Blocks) -> Vec<(usize, bool)> {
        b.segments()
            .iter()
            .flat_map(|s| s.blocks.iter().map(|x| (x.size, x.allocated)))
            .collect()
    }

    #[test]
    fn take_splits_front_and_release_merges_back() {
        let mut b = pool_with_segment(2 * MIB, Pool::Small);
        let t1 = b.take(BASE, 1024, 1000).unwrap();
        assert_eq!(
            (t1.block.addr, t1.block.size, t1.remainder),
            (BASE, 1024, Some(2 * MIB - 1024))
        );
        assert!(!t1.already_split);
        let a2 = b.best_fit(Pool::Small, DEFAULT_STREAM, 512).unwrap();
        assert_eq!(
            a2,
            BASE + 1024,
            "remainder starts right after the handed-out front"
        );
        let t2 = b.take(a2, 512, 512).unwrap();
        assert!(t2.already_split);
        assert_eq!(
            layout(&b),
            vec![(1024, true), (512, true), (2 * MIB - 1536, false)]
        );

        let r1 = b.release(BASE).unwrap();
        assert_eq!((r1.merged, r1.split_free), ((0, 0), Some(1024)));
        let r2 = b.release(a2).unwrap();
        // The middle block absorbs both free neighbours: one free block, the whole segment.
        assert_eq!(r2.merged, (2, (1024 + 2 * MIB - 1536) as i64));
        assert_eq!(r2.split_free, None);
        assert_eq!(layout(&b), vec![(2 * MIB, false)]);
        assert_eq!(b.free_blocks(), 1);
    }

    #[test]
    fn best_fit_prefers_smallest_then_lowest_address() {
        let mut b = Blocks::default();
        b.add_segment(BASE, 2 * MIB, DEFAULT_STREAM, Pool::Small);
        b.add_segment(BASE + 4 * MIB as u64, 2 * MIB, DEFAULT_STREAM, Pool::Small);
        b.add_segment(BASE + 8 * MIB as u64, 2 * MIB, DEFAULT_STREAM, Pool::Small);
        // Carve the segments so that free blocks of 1.5 MiB, 1 MiB, 1 MiB exist.
        b.take(BASE, MIB / 2, 1).unwrap();
        b.take(BASE + 4 * MIB as u64, MIB, 1).unwrap();
        b.take(BASE + 8 * MIB as u64, MIB, 1).unwrap();
        assert_eq!(
            b.best_fit(Pool::Small, DEFAULT_STREAM, 900 * 1024),
            Some(BASE + 5 * MIB as u64)
        );
        assert_eq!(
            b.best_fit(Pool::Small, DEFAULT_STREAM, MIB + 512),
            Some(BASE + (MIB / 2) as u64)
        );
        assert_eq!(b.best_fit(Pool::Small, DEFAULT_STREAM, 2 * MIB), None);
        assert_eq!(b.best_fit(Pool::Large, DEFAULT_STREAM, 512), None);
    }

    #[test]
    fn blocks_are_reused_only_on_their_stream() {
        let mut b = Blocks::default();
        b.add_segment(BASE, 2 * MIB, 7, Pool::Small);
        assert_eq!(b.best_fit(Pool::Small, DEFAULT_STREAM, 512), None);
        assert_eq!(b.best_fit(Pool::Small, 7, 512), Some(BASE));
        assert_eq!(b.best_fit(Pool::Small, 8, 512), None);
    }

    #[test]
    fn large_block_with_small_remainder_is_not_split() {
        let mut b = pool_with_segment(12 * MIB, Pool::Large);
        let t = b.take(BASE, 11 * MIB, 11 * MIB).unwrap();
        assert_eq!((t.block.size, t.remainder), (12 * MIB, None));
        assert_eq!(b.free_blocks(), 0);
    }

    #[test]
    fn drain_takes_only_whole_free_segments() {
        let mut b = Blocks::default();
        b.add_segment(BASE, 2 * MIB, DEFAULT_STREAM, Pool::Small);
        b.add_segment(BASE + 2 * MIB as u64, 20 * MIB, DEFAULT_STREAM, Pool::Large);
        b.add_segment(BASE + 22 * MIB as u64, 2 * MIB, DEFAULT_STREAM, Pool::Small);
        b.take(BASE, 512, 512).unwrap();
        let drained = b.drain_free_segments(|_| true);
        assert_eq!(
            drained,
            vec![
                (BASE + 2 * MIB as u64, 20 * MIB, Pool::Large, DEFAULT_STREAM),
                (BASE + 22 * MIB as u64, 2 * MIB, Pool::Small, DEFAULT_STREAM)
            ]
        );
        assert_eq!(layout(&b), vec![(512, true), (2 * MIB - 512, false)]);
    }

    #[test]
    fn drain_and_stream_bytes_see_only_the_streams_asked_for() {
        let mut b = Blocks::default();
        b.add_segment(BASE, 2 * MIB, DEFAULT_STREAM, Pool::Small);
        b.add_segment(BASE + 2 * MIB as u64, 20 * MIB, 7, Pool::Large);
        b.take(BASE + 2 * MIB as u64, 4 * MIB, 1).unwrap();
        assert_eq!(
            (b.stream_bytes(7), b.stream_bytes(DEFAULT_STREAM)),
            (20 * MIB, 2 * MIB)
        );
        assert!(
            b.drain_free_segments(|s| s == 7).is_empty(),
            "stream 7's segment is split"
        );
        assert_eq!(
            b.drain_free_segments(|s| s != 7),
            vec![(BASE, 2 * MIB, Pool::Small, DEFAULT_STREAM)]
        );
        assert_eq!(b.stream_bytes(DEFAULT_STREAM), 0);
    }

    #[test]
    fn release_of_unknown_or_free_block_is_refused() {
        let mut b = pool_with_segment(2 * MIB, Pool::Small);
        assert!(b.release(BASE).is_none(), "a free block cannot be freed");
        assert!(b.release(BASE + 512).is_none());
        assert!(
            b.take(BASE, 4 * MIB, 1).is_none(),
            "a block smaller than the request"
        );
    }
}
