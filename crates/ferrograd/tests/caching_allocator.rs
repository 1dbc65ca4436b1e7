//! The caching policy behind the public `Allocator` front, on a simulated device: what a
//! CUDA device's tensors will see (statistics, category sums, the OOM error, cache reuse).

use std::sync::Arc;

use ferrograd::memory::{Allocation, Allocator, CachingPolicy, SimulatedDevice};
use ferrograd::{Category, Device, Error};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn allocator(capacity: usize) -> (Arc<Allocator>, SimulatedDevice) {
    let dev = SimulatedDevice::new(capacity as u64);
    let policy = CachingPolicy::new(dev.clone());
    (Allocator::new(Device::Cuda(0), Box::new(policy)), dev)
}

fn alloc(a: &Arc<Allocator>, n: usize) -> Allocation {
    a.malloc(n, Category::Temporary, "test").unwrap()
}

#[test]
fn freed_memory_stays_reserved_until_empty_cache() {
    let (a, dev) = allocator(64 * MIB);
    let x = a.malloc(1000, Category::Parameter, "init").unwrap();
    assert_eq!(x.size(), 1024);
    assert_eq!(
        (a.memory_allocated(), a.memory_reserved()),
        (1024, 2 * MIB as u64)
    );
    assert_eq!(a.by_category().get(Category::Parameter), 1024);
    drop(x);
    assert_eq!(
        (a.memory_allocated(), a.memory_reserved()),
        (0, 2 * MIB as u64)
    );
    assert_eq!(
        dev.live_allocations(),
        1,
        "the segment is cached, not freed"
    );
    a.empty_cache();
    assert_eq!(a.memory_reserved(), 0);
    assert_eq!(a.max_memory_reserved(), 2 * MIB as u64);
    assert_eq!(
        (dev.allocs(), dev.frees(), dev.live_allocations()),
        (1, 1, 0)
    );
    assert_eq!(a.mem_info().free, 64 * MIB as u64);
}

#[test]
fn steady_state_loop_stops_calling_the_device() {
    let (a, dev) = allocator(256 * MIB);
    let sizes = [4 * KIB, 3 * MIB, 600 * KIB, 12 * MIB + 5, 100, 7 * MIB];
    let step = || {
        let live: Vec<Allocation> = sizes.iter().map(|&n| alloc(&a, n)).collect();
        drop(live);
    };
    step();
    let (allocs, reserved) = (dev.allocs(), a.memory_reserved());
    for _ in 0..10 {
        step();
    }
    assert_eq!(
        dev.allocs(),
        allocs,
        "every later iteration is served from the cache"
    );
    assert_eq!(a.memory_reserved(), reserved);
    let st = a.stats();
    assert_eq!(st.allocation.all.allocated, 11 * sizes.len() as i64);
    assert_eq!(st.allocated_bytes.all.current, 0);
    assert_eq!(st.inactive_split.all.current, 0);
    let flat = st.to_flat_map();
    assert_eq!(flat["num_device_alloc"], allocs as i64);
    assert_eq!(flat["segment.all.current"], a.stats().segment.all.current);
}

#[test]
fn out_of_memory_is_an_error_with_a_report() {
    let (a, _dev) = allocator(4 * MIB);
    let _w = a.malloc(1000, Category::Parameter, "init").unwrap();
    let err = a
        .malloc(3 * MIB, Category::SavedActivation, "matmul")
        .unwrap_err();
    assert!(err.is_out_of_memory());
    let Error::OutOfMemory(report) = &err else {
        panic!("expected OutOfMemory, got {err}");
    };
    assert_eq!((report.allocated, report.reserved), (1024, 2 * MIB as u64));
    assert_eq!(
        (report.capacity, report.free),
        (4 * MIB as u64, 2 * MIB as u64)
    );
    assert_eq!(report.requested, 3 * MIB as u64);
    let text = err.to_string();
    assert!(
        text.contains("1024 bytes is allocated by ferrograd and 2.00 MiB reserved"),
        "{text}"
    );
    assert!(
        text.contains("total capacity of 4.00 MiB of which 2.00 MiB is free"),
        "{text}"
    );
    assert!(text.contains("for matmul"), "{text}");
    let st = a.stats();
    assert_eq!((st.num_ooms, st.num_alloc_retries), (1, 1));
    // Nothing leaked: the failed request left the statistics as they were.
    assert_eq!(st.allocation.all.current, 1);
    assert_eq!(a.live_blocks(), 1);
}

#[test]
fn cached_segments_are_released_to_serve_a_request_that_needs_them() {
    let (a, dev) = allocator(24 * MIB);
    let keep = alloc(&a, 100);
    drop(alloc(&a, 3 * MIB)); // 20 MiB segment, now cached
    let big = alloc(&a, 21 * MIB); // needs a 22 MiB segment: only fits after a retry
    assert_eq!(big.size(), 22 * MIB);
    let st = a.stats();
    assert_eq!((st.num_alloc_retries, st.num_ooms), (1, 0));
    assert_eq!(a.memory_reserved(), 24 * MIB as u64);
    assert_eq!((dev.allocs(), dev.frees()), (3, 1));
    drop((keep, big));
}

/// A small deterministic generator, so the stress test needs no dependency.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

#[test]
fn random_workload_keeps_blocks_disjoint_and_books_balanced() {
    let (a, dev) = allocator(8 << 30);
    let mut rng = Lcg(7);
    let mut live: Vec<Allocation> = Vec::new();
    for step in 0..4000 {
        if live.len() < 64 && !rng.next().is_multiple_of(3) {
            let n = match rng.next() % 4 {
                0 => (rng.next() % 2048) as usize,
                1 => (rng.next() % MIB as u64) as usize,
                2 => (rng.next() % (12 * MIB as u64)) as usize,
                _ => (rng.next() % (40 * MIB as u64)) as usize,
            };
            live.push(alloc(&a, n));
        } else if !live.is_empty() {
            live.swap_remove((rng.next() as usize) % live.len());
        }
        if step % 500 == 0 {
            a.empty_cache();
        }
        let mut spans: Vec<(u64, u64)> = live
            .iter()
            .filter(|b| b.size() > 0)
            .map(|b| (b.addr(), b.addr() + b.size() as u64))
            .collect();
        spans.sort();
        assert!(
            spans.windows(2).all(|w| w[0].1 <= w[1].0),
            "live blocks overlap at step {step}"
        );
        let st = a.stats();
        let live_bytes: u64 = live.iter().map(|b| b.size() as u64).sum();
        assert_eq!(a.memory_allocated(), live_bytes);
        assert!(a.memory_allocated() <= a.memory_reserved());
        assert_eq!(a.memory_reserved(), dev.used());
        assert_eq!(
            st.num_device_alloc - st.num_device_free,
            dev.live_allocations() as i64
        );
        assert_eq!(st.segment.all.current, dev.live_allocations() as i64);
    }
    live.clear();
    let st = a.stats();
    // The workload did exercise the cache: splits, and far fewer segments than requests.
    assert!(st.inactive_split.all.allocated > 100);
    assert!(st.num_device_alloc * 10 < st.allocation.all.allocated);
    assert_eq!(
        (st.allocation.all.current, st.inactive_split.all.current),
        (0, 0)
    );
    assert_eq!(
        (
            st.inactive_split_bytes.all.current,
            st.requested_bytes.all.current
        ),
        (0, 0)
    );
    a.empty_cache();
    assert_eq!((a.memory_reserved(), dev.live_allocations()), (0, 0));
}
