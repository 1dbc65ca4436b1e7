//! Policy-level tests of the caching allocator against a simulated device, with exact byte
//! counts. After every step `check` recomputes the statistics from the block layout, so the
//! incremental bookkeeping cannot drift from the segments it describes.

use super::*;
use crate::memory::device_memory::SimulatedDevice;
use crate::memory::private_pool::PrivatePoolId;
use crate::memory::stats::Stat;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

struct Fixture {
    policy: CachingPolicy<SimulatedDevice>,
    stats: DeviceStats,
}

impl Fixture {
    fn new(capacity: usize) -> Self {
        Fixture {
            policy: CachingPolicy::new(SimulatedDevice::new(capacity as u64)),
            stats: DeviceStats::default(),
        }
    }
    fn malloc(&mut self, n: usize) -> PolicyBlock {
        let b = self
            .policy
            .malloc(n, &mut self.stats)
            .expect("malloc failed");
        self.check();
        b
    }
    fn try_malloc(&mut self, n: usize) -> Option<PolicyBlock> {
        let b = self.policy.malloc(n, &mut self.stats);
        self.check();
        b
    }
    fn free(&mut self, b: &PolicyBlock) {
        self.policy.free(b, 0, &mut self.stats);
        self.check();
    }
    fn empty_cache(&mut self) {
        self.policy.empty_cache(&mut self.stats);
        self.check();
    }
    fn layout(&self) -> Vec<Vec<(usize, bool)>> {
        let segs = self.policy.segments();
        segs.iter()
            .map(|s| s.blocks.iter().map(|b| (b.size, b.allocated)).collect())
            .collect()
    }
    fn begin(&mut self, pool: u32) -> PrivatePoolId {
        let pool = PrivatePoolId(pool);
        self.policy.begin_private_pool(pool);
        pool
    }
    fn end(&mut self) {
        self.policy.end_private_pool();
    }
    fn release(&mut self, pool: PrivatePoolId) {
        self.policy.release_private_pool(pool, &mut self.stats);
        self.check();
    }
    fn pool_reserved(&self, pool: PrivatePoolId) -> usize {
        self.policy.private_pool_reserved(pool)
    }
    /// The stream of the segment holding `addr`.
    fn stream_at(&self, addr: u64) -> Option<StreamId> {
        let segs = self.policy.segments();
        let seg = segs
            .iter()
            .find(|s| (s.addr..s.addr + s.size as u64).contains(&addr))?;
        Some(seg.stream)
    }
    fn cur_reserved(&self) -> i64 {
        self.stats.reserved_bytes.all.current
    }
    fn cur_allocated(&self) -> i64 {
        self.stats.allocated_bytes.all.current
    }

    /// Recomputes every `current` from the segments and compares.
    fn check(&self) {
        let mut want = DeviceStats::default();
        for s in self.policy.segments() {
            let p = s.pool;
            want.segment.increase(p, 1);
            want.reserved_bytes.increase(p, s.size as i64);
            let split = s.blocks.len() > 1;
            for b in &s.blocks {
                if b.allocated {
                    want.allocation.increase(p, 1);
                    want.allocated_bytes.increase(p, b.size as i64);
                    want.active.increase(p, 1);
                    want.active_bytes.increase(p, b.size as i64);
                    want.requested_bytes.increase(p, b.requested as i64);
                } else if split {
                    want.inactive_split.increase(p, 1);
                    want.inactive_split_bytes.increase(p, b.size as i64);
                }
            }
        }
        let cur = |d: &DeviceStats| -> Vec<[i64; 3]> {
            [
                &d.allocation,
                &d.allocated_bytes,
                &d.active,
                &d.active_bytes,
                &d.requested_bytes,
                &d.segment,
                &d.reserved_bytes,
                &d.inactive_split,
                &d.inactive_split_bytes,
            ]
            .iter()
            .map(|a| [a.all.current, a.small_pool.current, a.large_pool.current])
            .collect()
        };
        assert_eq!(
            cur(&self.stats),
            cur(&want),
            "statistics drifted from the block layout"
        );
        let dev = self.policy.device();
        assert_eq!(
            dev.used() as i64,
            self.cur_reserved(),
            "reserved differs from device usage"
        );
        assert_eq!(dev.allocs() as i64, self.stats.num_device_alloc);
        assert_eq!(dev.frees() as i64, self.stats.num_device_free);
    }
}

fn stat(current: i64, peak: i64, allocated: i64, freed: i64) -> Stat {
    Stat {
        current,
        peak,
        allocated,
        freed,
    }
}

#[test]
fn requests_are_rounded_to_512() {
    let mut f = Fixture::new(64 * MIB);
    for (n, size) in [
        (1, 512),
        (511, 512),
        (512, 512),
        (513, 1024),
        (1536, 1536),
        (1537, 2048),
    ] {
        let b = f.malloc(n);
        assert_eq!(b.size, size, "malloc({n})");
    }
    assert_eq!(
        f.stats.requested_bytes.all.current,
        1 + 511 + 512 + 513 + 1536 + 1537
    );
    assert_eq!(f.cur_allocated(), 512 * 3 + 1024 + 1536 + 2048);
}

#[test]
fn zero_bytes_get_a_null_block_and_touch_nothing() {
    let mut f = Fixture::new(64 * MIB);
    let b = f.malloc(0);
    assert_eq!((b.addr, b.size), (0, 0));
    f.free(&b);
    assert_eq!(f.stats, DeviceStats::default());
}

#[test]
fn one_mib_is_small_and_one_byte_more_is_large() {
    let mut f = Fixture::new(64 * MIB);
    let a = f.malloc(MIB);
    assert_eq!(a.pool, Pool::Small);
    assert_eq!(f.stats.reserved_bytes.small_pool.current, 2 * MIB as i64);
    let b = f.malloc(MIB + 1);
    assert_eq!((b.pool, b.size), (Pool::Large, MIB + 512));
    assert_eq!(f.stats.reserved_bytes.large_pool.current, 20 * MIB as i64);
    assert_eq!(f.stats.allocated_bytes.small_pool.current, MIB as i64);
    assert_eq!(
        f.stats.allocated_bytes.large_pool.current,
        (MIB + 512) as i64
    );
    assert_eq!(f.stats.segment.all.current, 2);
}

#[test]
fn three_mib_request_reserves_20_mib_and_second_request_reuses_the_rest() {
    let mut f = Fixture::new(64 * MIB);
    let a = f.malloc(3 * MIB);
    assert_eq!(f.cur_reserved(), 20 * MIB as i64);
    assert_eq!(f.layout(), vec![vec![(3 * MIB, true), (17 * MIB, false)]]);
    let b = f.malloc(5 * MIB);
    assert_eq!(
        b.addr,
        a.addr + 3 * MIB as u64,
        "carved from the same segment"
    );
    assert_eq!(
        (f.stats.num_device_alloc, f.stats.segment.all.current),
        (1, 1)
    );
    assert_eq!(f.cur_reserved(), 20 * MIB as i64);
    assert_eq!(f.cur_allocated(), 8 * MIB as i64);
}

#[test]
fn ten_mib_and_above_get_segments_rounded_to_2_mib() {
    let mut f = Fixture::new(64 * MIB);
    f.malloc(10 * MIB);
    assert_eq!(f.cur_reserved(), 10 * MIB as i64);
    f.malloc(10 * MIB + 1);
    assert_eq!(f.cur_reserved(), (10 + 12) as i64 * MIB as i64);
    // The 12 MiB segment has 2 MiB - 512 left: more than 1 MiB, so it was split. It is the
    // second segment, below the first (the device hands out decreasing addresses).
    assert_eq!(
        f.layout()[0],
        vec![(10 * MIB + 512, true), (2 * MIB - 512, false)]
    );
    f.malloc(10 * MIB - 512);
    assert_eq!(
        f.cur_reserved(),
        42 * MIB as i64,
        "9.99 MiB still gets a 20 MiB segment"
    );
}

#[test]
fn large_block_is_handed_out_whole_when_at_most_1_mib_would_remain() {
    let mut f = Fixture::new(64 * MIB);
    let a = f.malloc(19 * MIB);
    // 19 MiB gets a 20 MiB segment (2 MiB multiple); 1 MiB would remain: no split.
    assert_eq!(a.size, 20 * MIB);
    assert_eq!(f.cur_allocated(), 20 * MIB as i64);
    assert_eq!(f.stats.requested_bytes.all.current, 19 * MIB as i64);
    assert_eq!(f.layout(), vec![vec![(20 * MIB, true)]]);
    f.free(&a);
    // Now from the cached 20 MiB block: 19 MiB - 512 leaves 1 MiB + 512, which splits.
    let b = f.malloc(19 * MIB - 512);
    assert_eq!(b.size, 19 * MIB - 512);
    assert_eq!(
        f.layout(),
        vec![vec![(19 * MIB - 512, true), (MIB + 512, false)]]
    );
    assert_eq!(f.stats.num_device_alloc, 1);
}

#[test]
fn freeing_merges_neighbours_back_into_one_block() {
    let mut f = Fixture::new(64 * MIB);
    let a = f.malloc(100 * KIB);
    let b = f.malloc(200 * KIB);
    let c = f.malloc(300 * KIB);
    let rest = 2 * MIB - 600 * KIB;
    assert_eq!(
        f.layout(),
        vec![vec![
            (100 * KIB, true),
            (200 * KIB, true),
            (300 * KIB, true),
            (rest, false)
        ]]
    );
    f.free(&a);
    f.free(&c);
    // c merged with the tail; a stays alone: two free pieces around b.
    assert_eq!(
        f.layout(),
        vec![vec![
            (100 * KIB, false),
            (200 * KIB, true),
            (300 * KIB + rest, false)
        ]]
    );
    assert_eq!(f.stats.inactive_split.all.current, 2);
    f.free(&b);
    assert_eq!(f.layout(), vec![vec![(2 * MIB, false)]]);
    assert_eq!(f.policy.blocks.free_blocks(), 1);
    assert_eq!(f.stats.inactive_split.all.current, 0);
    // The merged block serves the largest small request from its start, without a new segment.
    let big = f.malloc(MIB);
    assert_eq!(big.addr, a.addr);
    assert_eq!(f.stats.num_device_alloc, 1);
}

#[test]
fn best_fit_takes_the_smallest_block_that_fits() {
    let mut f = Fixture::new(64 * MIB);
    let a = f.malloc(100 * KIB);
    let _b = f.malloc(512);
    let c = f.malloc(300 * KIB);
    let _d = f.malloc(512);
    f.free(&a);
    f.free(&c);
    // Free: 100 KiB at a, 300 KiB at c, and the ~1.6 MiB tail.
    assert_eq!(f.malloc(250 * KIB).addr, c.addr);
    assert_eq!(f.malloc(90 * KIB).addr, a.addr);
    assert_eq!(f.stats.num_device_alloc, 1);
}

#[test]
fn empty_cache_frees_only_whole_free_segments() {
    let mut f = Fixture::new(64 * MIB);
    let small = f.malloc(1000);
    let large = f.malloc(3 * MIB);
    // 18 MiB does not fit in the 17 MiB left of the 20 MiB segment: a segment of its own.
    let big = f.malloc(18 * MIB);
    f.free(&large);
    f.free(&big);
    assert_eq!(f.cur_reserved(), (2 + 20 + 18) as i64 * MIB as i64);
    f.empty_cache();
    // The small segment still holds a live block: it stays, with its free part.
    assert_eq!(f.cur_reserved(), 2 * MIB as i64);
    assert_eq!(f.stats.reserved_bytes.large_pool.current, 0);
    assert_eq!(f.stats.segment.all, stat(1, 3, 3, 2));
    assert_eq!((f.stats.num_device_alloc, f.stats.num_device_free), (3, 2));
    assert_eq!(
        f.stats.inactive_split_bytes.all.current,
        (2 * MIB - 1024) as i64
    );
    f.free(&small);
    f.empty_cache();
    assert_eq!(f.cur_reserved(), 0);
    assert_eq!(f.policy.device().live_allocations(), 0);
}

#[test]
fn failed_device_alloc_frees_the_cache_and_retries() {
    let mut f = Fixture::new(20 * MIB);
    let a = f.malloc(3 * MIB);
    f.free(&a);
    assert_eq!(f.cur_reserved(), 20 * MIB as i64, "cached, not returned");
    // A small request misses the small pool; the device is full of our cached segment.
    let b = f.malloc(512);
    assert_eq!(f.stats.num_alloc_retries, 1);
    assert_eq!((f.stats.num_device_alloc, f.stats.num_device_free), (2, 1));
    assert_eq!(f.cur_reserved(), 2 * MIB as i64);
    assert_eq!(f.stats.reserved_bytes.all.peak, 20 * MIB as i64);
    assert_eq!(b.size, 512);
    assert_eq!(f.policy.device().failed_allocs(), 1);
}

#[test]
fn retry_keeps_segments_with_live_blocks() {
    let mut f = Fixture::new(24 * MIB);
    let _live = f.malloc(1000);
    let a = f.malloc(3 * MIB);
    f.free(&a);
    // 2 MiB small + 20 MiB large reserved; 21 MiB needs a 22 MiB segment, which does not
    // fit beside them. The 1 MiB it leaves is not split off.
    let b = f.malloc(21 * MIB);
    assert_eq!(b.size, 22 * MIB);
    assert_eq!(f.stats.num_alloc_retries, 1);
    assert_eq!(
        f.layout().len(),
        2,
        "the small segment with a live block survives"
    );
    assert_eq!(f.cur_reserved(), 24 * MIB as i64);
}

#[test]
fn out_of_memory_after_retry_returns_none() {
    let mut f = Fixture::new(4 * MIB);
    let _a = f.malloc(1000);
    assert!(f.try_malloc(3 * MIB).is_none(), "needs a 20 MiB segment");
    assert_eq!(
        f.stats.num_alloc_retries, 1,
        "the retry is counted even when it fails"
    );
    assert_eq!(f.policy.device().failed_allocs(), 2);
    assert_eq!(
        (f.cur_allocated(), f.cur_reserved()),
        (1024, 2 * MIB as i64)
    );
    assert!(
        f.try_malloc(1 << 61).is_none(),
        "more than 1 EiB fails at once"
    );
    assert_eq!(f.stats.num_alloc_retries, 1);
    assert_eq!(
        f.policy.mem_info(),
        MemInfo {
            total: 4 << 20,
            free: 2 << 20
        }
    );
}

#[test]
fn statistics_after_a_sequence_are_exact() {
    let mut f = Fixture::new(64 * MIB);
    let a = f.malloc(1000); // small: 1024 of a new 2 MiB segment
    let b = f.malloc(3 * MIB); // large: 3 MiB of a new 20 MiB segment
    f.free(&a);
    let c = f.malloc(2000); // small: 2048 from the merged 2 MiB block
    f.free(&b);
    f.free(&c);
    f.empty_cache();
    let s = &f.stats;
    let (k1, k2, m3) = (1024, 2048, 3 * MIB as i64);
    assert_eq!(s.allocation.all, stat(0, 2, 3, 3));
    assert_eq!(s.allocation.small_pool, stat(0, 1, 2, 2));
    assert_eq!(s.allocation.large_pool, stat(0, 1, 1, 1));
    assert_eq!(
        s.allocated_bytes.all,
        stat(0, k2 + m3, k1 + k2 + m3, k1 + k2 + m3)
    );
    assert_eq!(s.allocated_bytes.small_pool, stat(0, k2, k1 + k2, k1 + k2));
    assert_eq!(s.active_bytes.all, s.allocated_bytes.all);
    assert_eq!(
        s.requested_bytes.all,
        stat(0, 2000 + m3, 3000 + m3, 3000 + m3)
    );
    assert_eq!(s.segment.all, stat(0, 2, 2, 2));
    let (r2, r20) = (2 * MIB as i64, 20 * MIB as i64);
    assert_eq!(s.reserved_bytes.all, stat(0, r2 + r20, r2 + r20, r2 + r20));
    assert_eq!(s.reserved_bytes.large_pool, stat(0, r20, r20, r20));
    assert_eq!(
        (s.num_device_alloc, s.num_device_free, s.num_alloc_retries),
        (2, 2, 0)
    );
    // Inactive split: small 2 MiB-1024 (a) / 2 MiB-2048 (c); large 17 MiB (b).
    assert_eq!(s.inactive_split.all, stat(0, 2, 3, 3));
    assert_eq!(
        s.inactive_split_bytes.large_pool,
        stat(0, r20 - m3, r20 - m3, r20 - m3)
    );
    assert_eq!(
        s.inactive_split_bytes.small_pool,
        stat(0, r2 - k1, (r2 - k1) + (r2 - k2), (r2 - k1) + (r2 - k2))
    );
}

#[test]
fn inactive_split_counts_free_blocks_of_split_segments() {
    let mut f = Fixture::new(64 * MIB);
    let a = f.malloc(4 * KIB);
    let b = f.malloc(4 * KIB);
    let c = f.malloc(4 * KIB);
    let tail = (2 * MIB - 12 * KIB) as i64;
    assert_eq!(
        (
            f.stats.inactive_split.all.current,
            f.stats.inactive_split_bytes.all.current
        ),
        (1, tail)
    );
    f.free(&b); // a hole between a and c: a second inactive split block
    assert_eq!(
        (
            f.stats.inactive_split.all.current,
            f.stats.inactive_split_bytes.all.current
        ),
        (2, tail + 4096)
    );
    let d = f.malloc(4 * KIB); // best fit: the hole, taken whole
    assert_eq!(d.addr, b.addr);
    assert_eq!(f.stats.inactive_split.all.current, 1);
    f.free(&a);
    f.free(&d);
    // a and d merged into one 8 KiB hole; the tail is the other inactive split block.
    assert_eq!(
        (
            f.stats.inactive_split.all.current,
            f.stats.inactive_split_bytes.all.current
        ),
        (2, tail + 8192)
    );
    f.free(&c); // the segment is whole again: nothing is inactive split any more
    assert_eq!(f.stats.inactive_split.all, stat(0, 2, 3, 3));
    assert_eq!(f.stats.inactive_split_bytes.all.current, 0);
    assert_eq!(f.stats.inactive_split.large_pool, Stat::default());
}

#[test]
fn external_use_of_the_device_leads_to_oom() {
    let dev = SimulatedDevice::new(24 * MIB as u64);
    let mut other = dev.clone();
    other.alloc(10 * MIB).unwrap();
    let mut p = CachingPolicy::new(dev);
    let mut stats = DeviceStats::default();
    assert!(
        p.malloc(3 * MIB, &mut stats).is_none(),
        "20 MiB no longer fit"
    );
    assert!(p.malloc(5 * KIB, &mut stats).is_some(), "2 MiB still do");
    assert_eq!(stats.num_alloc_retries, 1);
}

/// A small deterministic generator for the random workload.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

#[test]
fn random_workload_on_a_tight_device_keeps_the_books_exact() {
    // 64 MiB forces misses, retries and OOMs; `check` runs after every step.
    let mut f = Fixture::new(64 * MIB);
    let mut rng = Lcg(11);
    let mut live = Vec::new();
    let mut ooms = 0;
    for _ in 0..3000 {
        if rng.below(3) != 0 {
            let n = match rng.below(3) {
                0 => rng.below(4 * KIB),
                1 => rng.below(MIB + KIB),
                _ => rng.below(24 * MIB),
            };
            match f.try_malloc(n) {
                Some(b) => live.push(b),
                None => ooms += 1,
            }
        } else if !live.is_empty() {
            let b = live.swap_remove(rng.below(live.len()));
            f.free(&b);
        }
        if rng.below(200) == 0 {
            f.empty_cache();
        }
    }
    assert!(
        ooms > 0 && f.stats.num_alloc_retries > 0,
        "the device was never tight"
    );
    for b in live.drain(..) {
        f.free(&b);
    }
    assert_eq!(f.stats.inactive_split.all.current, 0);
    f.empty_cache();
    assert_eq!(
        (f.cur_reserved(), f.policy.device().live_allocations()),
        (0, 0)
    );
}

#[test]
fn a_private_pool_reserves_its_own_segments_apart_from_the_shared_ones() {
    let mut f = Fixture::new(64 * MIB);
    let s = f.malloc(MIB);
    f.free(&s);
    // A whole free 2 MiB shared segment would serve the request; the pool gets its own.
    let pool = f.begin(1);
    let p = f.malloc(MIB);
    assert_ne!(p.addr, s.addr);
    assert_eq!(f.stream_at(p.addr), Some(pool_stream(pool)));
    assert_eq!(
        (f.stats.num_device_alloc, f.cur_reserved()),
        (2, 4 * MIB as i64)
    );
    assert_eq!(f.pool_reserved(pool), 2 * MIB);
    // Private segments count in the small/large statistics by size, as in PyTorch.
    assert_eq!(f.stats.segment.small_pool.current, 2);
    f.end();
    f.free(&p);
    // Shared requests fill the shared segment, then need a new one: the pool's free
    // segment serves nobody but the pool.
    assert_eq!(f.malloc(MIB).addr, s.addr);
    assert_eq!(f.malloc(MIB).addr, s.addr + MIB as u64);
    let c = f.malloc(MIB);
    assert_eq!(f.stream_at(c.addr), Some(DEFAULT_STREAM));
    assert_eq!(f.stats.num_device_alloc, 3);
    assert_eq!(f.pool_reserved(pool), 2 * MIB);
    assert_eq!(f.cur_allocated(), 3 * MIB as i64);
}

#[test]
fn two_private_pools_never_share_a_segment() {
    let mut f = Fixture::new(64 * MIB);
    let (one, two) = (PrivatePoolId(1), PrivatePoolId(2));
    f.begin(1);
    let a = f.malloc(4 * KIB);
    f.free(&a);
    f.end();
    f.begin(2);
    let b = f.malloc(4 * KIB);
    f.end();
    assert_eq!(f.stream_at(b.addr), Some(pool_stream(two)));
    assert_eq!(f.stats.num_device_alloc, 2);
    assert_eq!(
        (f.pool_reserved(one), f.pool_reserved(two)),
        (2 * MIB, 2 * MIB)
    );
}

#[test]
fn a_block_freed_in_a_private_pool_is_reused_by_the_next_pool_malloc() {
    let mut f = Fixture::new(64 * MIB);
    let pool = f.begin(1);
    let a = f.malloc(4 * KIB);
    let _b = f.malloc(4 * KIB);
    f.free(&a);
    assert_eq!(f.malloc(4 * KIB).addr, a.addr);
    let d = f.malloc(3 * MIB);
    f.free(&d);
    assert_eq!(f.malloc(3 * MIB).addr, d.addr);
    f.end();
    let e = f.malloc(5 * MIB);
    f.free(&e);
    // A later capture into the same pool takes the pool's cached rest, not the free shared
    // block of the same size.
    f.begin(1);
    assert_eq!(f.malloc(5 * MIB).addr, d.addr + 3 * MIB as u64);
    assert_eq!(f.stream_at(e.addr), Some(DEFAULT_STREAM));
    assert_eq!(
        f.stats.num_device_alloc, 3,
        "2 MiB + 20 MiB for the pool, 20 MiB shared"
    );
    assert_eq!(f.pool_reserved(pool), 22 * MIB);
}

#[test]
fn empty_cache_keeps_a_live_pools_segments_and_release_gives_them_back() {
    let mut f = Fixture::new(64 * MIB);
    let s = f.malloc(1000);
    f.free(&s);
    let pool = f.begin(1);
    let p = f.malloc(3 * MIB);
    let q = f.malloc(1000);
    f.free(&p);
    f.end();
    f.empty_cache();
    // Only the shared 2 MiB segment went; the pool keeps its free 20 MiB and its 2 MiB.
    assert_eq!(f.cur_reserved(), 22 * MIB as i64);
    assert_eq!(f.stats.num_device_free, 1);
    assert_eq!(f.pool_reserved(pool), 22 * MIB);
    f.release(pool);
    // The entirely free 20 MiB segment goes at once; the one holding q stays.
    assert_eq!(f.cur_reserved(), 2 * MIB as i64);
    assert_eq!(f.stats.num_device_free, 2);
    assert_eq!(f.pool_reserved(pool), 2 * MIB);
    f.free(&q);
    assert_eq!(
        f.cur_reserved(),
        2 * MIB as i64,
        "nothing goes back on free"
    );
    f.empty_cache();
    assert_eq!((f.cur_reserved(), f.stats.num_device_free), (0, 3));
    assert_eq!(f.policy.device().live_allocations(), 0);
    assert_eq!(f.stats.segment.all, stat(0, 3, 3, 3));
}

#[test]
fn the_retry_after_a_refused_device_alloc_keeps_a_live_pools_segments() {
    let mut f = Fixture::new(24 * MIB);
    let pool = f.begin(1);
    let p = f.malloc(3 * MIB);
    f.free(&p);
    f.end();
    // A shared 20 MiB segment does not fit beside the pool's free one, which must stay.
    assert!(f.try_malloc(3 * MIB).is_none());
    assert_eq!(f.stats.num_alloc_retries, 1);
    assert_eq!(
        (f.cur_reserved(), f.stats.num_device_free),
        (20 * MIB as i64, 0)
    );
    assert_eq!(f.policy.device().failed_allocs(), 2);
    f.release(pool);
    assert_eq!((f.cur_reserved(), f.stats.num_device_free), (0, 1));
    let b = f.malloc(3 * MIB);
    assert_eq!(f.stream_at(b.addr), Some(DEFAULT_STREAM));
    assert_eq!(f.stats.num_alloc_retries, 1);
}

#[test]
fn the_retry_gives_back_a_released_pools_segments_once_free() {
    let mut f = Fixture::new(24 * MIB);
    let pool = f.begin(1);
    let p = f.malloc(3 * MIB);
    f.end();
    f.release(pool);
    assert_eq!(f.cur_reserved(), 20 * MIB as i64, "p still lives in it");
    f.free(&p);
    assert_eq!(f.pool_reserved(pool), 20 * MIB);
    let b = f.malloc(3 * MIB);
    assert_eq!(f.stats.num_alloc_retries, 1);
    assert_eq!((f.stats.num_device_alloc, f.stats.num_device_free), (2, 1));
    assert_eq!(f.stream_at(b.addr), Some(DEFAULT_STREAM));
    assert_eq!(
        (f.pool_reserved(pool), f.cur_reserved()),
        (0, 20 * MIB as i64)
    );
}

#[test]
fn random_workload_with_private_pools_keeps_the_books_exact() {
    // Captures begin, end and release at random among shared traffic on a tight device;
    // `check` runs after every step, and every block must sit on the stream it was asked on.
    let mut f = Fixture::new(96 * MIB);
    let mut rng = Lcg(5);
    let mut live = Vec::new();
    let (mut next_pool, mut active, mut ended) = (1, None, Vec::new());
    let (mut in_pools, mut released, mut ooms) = (0, 0, 0);
    for _ in 0..3000 {
        match rng.below(40) {
            0 if active.is_none() => {
                active = Some(f.begin(next_pool));
                next_pool += 1;
            }
            1 if active.is_some() => {
                f.end();
                ended.extend(active.take());
            }
            2 if !ended.is_empty() => {
                let pool = ended.swap_remove(rng.below(ended.len()));
                f.release(pool);
                released += 1;
            }
            3 => f.empty_cache(),
            r if r < 26 => {
                let n = match rng.below(3) {
                    0 => rng.below(4 * KIB),
                    1 => rng.below(MIB + KIB),
                    _ => rng.below(24 * MIB),
                };
                let Some(b) = f.try_malloc(n) else {
                    ooms += 1;
                    continue;
                };
                let want = active.map_or(DEFAULT_STREAM, pool_stream);
                assert!(b.size == 0 || f.stream_at(b.addr) == Some(want));
                in_pools += usize::from(active.is_some());
                live.push(b);
            }
            _ if !live.is_empty() => {
                let b = live.swap_remove(rng.below(live.len()));
                f.free(&b);
            }
            _ => {}
        }
    }
    assert!(
        in_pools > 100 && released > 20 && ooms > 0 && f.stats.num_alloc_retries > 0,
        "the workload missed a case: {in_pools} pool mallocs, {released} releases, {ooms} OOMs"
    );
    for b in live.drain(..) {
        f.free(&b);
    }
    if let Some(pool) = active.take() {
        f.end();
        ended.push(pool);
    }
    for pool in ended {
        f.release(pool);
    }
    f.empty_cache();
    assert_eq!(
        (f.cur_reserved(), f.policy.device().live_allocations()),
        (0, 0)
    );
}
