//! Private pools through the allocator front on a simulated device: deferred frees, the pool's bytes, and the errors, with the category sums checked against
//! `memory_allocated` after every step.

use std::sync::Arc;

use crate::base::{Category, Device};
use crate::memory::{
    Allocation, Allocator, CachingPolicy, HostPolicy, PrivatePoolBytes, PrivatePoolId,
    SimulatedDevice, pool_stream,
};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn allocator(capacity: usize) -> (Arc<Allocator>, SimulatedDevice) {
    let dev = SimulatedDevice::new(capacity as u64);
    let policy = CachingPolicy::new(dev.clone());
    (Allocator::new(Device::Cuda(0), Box::new(policy)), dev)
}

/// Allocates and checks the invariant.
fn alloc(a: &Arc<Allocator>, n: usize, category: Category) -> Allocation {
    let x = a.malloc(n, category, "test").expect("malloc failed");
    sums_match(a);
    x
}

/// Drops and checks the invariant.
fn drop_checked(a: &Arc<Allocator>, x: Allocation) {
    drop(x);
    sums_match(a);
}

fn sums_match(a: &Allocator) {
    assert_eq!(
        a.by_category().total(),
        a.memory_allocated(),
        "category sums differ from memory_allocated"
    );
}

fn bytes(reserved: usize, allocated: usize) -> PrivatePoolBytes {
    PrivatePoolBytes {
        reserved: reserved as u64,
        allocated: allocated as u64,
    }
}

#[test]
fn a_shared_block_dropped_during_capture_stays_allocated_until_release() {
    let (a, dev) = allocator(64 * MIB);
    let w = alloc(&a, 1000, Category::Parameter);
    let pool = a.create_private_pool();
    a.begin_private_pool(pool).unwrap();
    let x = alloc(&a, 4 * KIB, Category::Temporary);
    drop_checked(&a, w);
    // The graph may read w at every replay: still allocated, still a parameter.
    assert_eq!(a.memory_allocated(), (KIB + 4 * KIB) as u64);
    assert_eq!(a.by_category().get(Category::Parameter), KIB as u64);
    assert_eq!(a.live_blocks(), 2);
    // The pool's own block frees at once, into the pool.
    drop_checked(&a, x);
    assert_eq!(a.memory_allocated(), KIB as u64);
    assert_eq!(a.private_pool_bytes(pool), bytes(2 * MIB, 0));
    a.end_private_pool().unwrap();
    sums_match(&a);
    assert_eq!(a.by_category().get(Category::Parameter), KIB as u64);
    let streams: Vec<u64> = a.snapshot().iter().map(|s| s.stream).collect();
    // In address order: the pool's segment came second, below the shared one.
    assert_eq!(streams, vec![pool_stream(pool), 0]);
    a.release_private_pool(pool).unwrap();
    sums_match(&a);
    assert_eq!((a.memory_allocated(), a.live_blocks()), (0, 0));
    assert_eq!(a.by_category().get(Category::Parameter), 0);
    // w's shared segment stays cached; the pool's free segment went back to the device.
    assert_eq!(a.memory_reserved(), 2 * MIB as u64);
    assert_eq!((dev.allocs(), dev.frees()), (2, 1));
    assert_eq!(a.private_pool_bytes(pool), bytes(0, 0));
}

#[test]
fn releasing_a_pool_with_live_blocks_keeps_their_segment_until_empty_cache() {
    let (a, dev) = allocator(64 * MIB);
    let pool = a.create_private_pool();
    a.begin_private_pool(pool).unwrap();
    let out = alloc(&a, 3 * MIB, Category::Temporary);
    let tmp = alloc(&a, 1000, Category::Temporary);
    drop_checked(&a, tmp);
    a.end_private_pool().unwrap();
    a.empty_cache();
    assert_eq!(
        a.memory_reserved(),
        22 * MIB as u64,
        "a live pool keeps its segments"
    );
    a.release_private_pool(pool).unwrap();
    assert_eq!(a.memory_reserved(), 20 * MIB as u64);
    assert_eq!(a.private_pool_bytes(pool), bytes(20 * MIB, 3 * MIB));
    drop_checked(&a, out);
    assert_eq!(a.memory_reserved(), 20 * MIB as u64);
    a.empty_cache();
    assert_eq!((a.memory_reserved(), dev.live_allocations()), (0, 0));
}

#[test]
fn begin_twice_and_end_without_begin_are_errors() {
    let (a, _dev) = allocator(64 * MIB);
    let (one, two) = (a.create_private_pool(), a.create_private_pool());
    let err = a.end_private_pool().unwrap_err().to_string();
    assert!(err.contains("no private pool is active"), "{err}");
    a.begin_private_pool(one).unwrap();
    let err = a.begin_private_pool(two).unwrap_err().to_string();
    assert!(err.contains("private pool 1 is already active"), "{err}");
    assert!(a.begin_private_pool(one).is_err());
    a.end_private_pool().unwrap();
    assert!(a.end_private_pool().is_err());
}

#[test]
fn unknown_active_and_released_pools_are_refused() {
    let (a, _dev) = allocator(64 * MIB);
    let err = a
        .begin_private_pool(PrivatePoolId(7))
        .unwrap_err()
        .to_string();
    assert!(err.contains("was not created"), "{err}");
    let pool = a.create_private_pool();
    a.begin_private_pool(pool).unwrap();
    let err = a.release_private_pool(pool).unwrap_err().to_string();
    assert!(err.contains("still active"), "{err}");
    a.end_private_pool().unwrap();
    a.release_private_pool(pool).unwrap();
    for err in [
        a.release_private_pool(pool).unwrap_err(),
        a.begin_private_pool(pool).unwrap_err(),
    ] {
        assert!(err.to_string().contains("already released"), "{err}");
    }
}

#[test]
fn the_host_allocator_has_no_private_pools() {
    let a = Allocator::new(Device::Cpu, Box::new(HostPolicy::new(u64::MAX)));
    let pool = a.create_private_pool();
    let err = a.begin_private_pool(pool).unwrap_err().to_string();
    assert!(err.contains("exist only on CUDA devices"), "{err}");
    assert!(a.end_private_pool().is_err());
    assert!(a.release_private_pool(pool).is_err());
    assert_eq!(a.private_pool_bytes(pool), bytes(0, 0));
    // Drops on the host free at once, as always.
    let x = a.malloc(100, Category::Temporary, "test").unwrap();
    drop(x);
    assert_eq!((a.memory_allocated(), a.live_blocks()), (0, 0));
}

#[test]
fn an_out_of_memory_retry_keeps_a_live_pools_segments() {
    let (a, dev) = allocator(24 * MIB);
    let pool = a.create_private_pool();
    a.begin_private_pool(pool).unwrap();
    drop_checked(&a, alloc(&a, 3 * MIB, Category::Temporary));
    a.end_private_pool().unwrap();
    let err = a.malloc(3 * MIB, Category::Temporary, "test").unwrap_err();
    assert!(err.is_out_of_memory());
    sums_match(&a);
    assert_eq!(a.stats().num_alloc_retries, 1);
    assert_eq!(a.private_pool_bytes(pool), bytes(20 * MIB, 0));
    assert_eq!(dev.frees(), 0);
    a.release_private_pool(pool).unwrap();
    let x = alloc(&a, 3 * MIB, Category::Temporary);
    assert_eq!((x.size(), a.memory_reserved()), (3 * MIB, 20 * MIB as u64));
}

#[test]
fn a_shared_block_made_while_a_pool_is_active_lives_outside_it() {
    let (a, _dev) = allocator(64 * MIB);
    let pool = a.create_private_pool();
    a.begin_private_pool(pool).unwrap();
    let inside = alloc(&a, 4 * KIB, Category::Temporary);
    let kept = a
        .malloc_shared(3 * MIB, Category::Workspace, "test")
        .unwrap();
    sums_match(&a);
    // The pool is still the active one, and holds only its own block's segment.
    assert_eq!(a.private_pool_bytes(pool), bytes(2 * MIB, 4 * KIB));
    drop_checked(&a, inside);
    a.end_private_pool().unwrap();
    a.release_private_pool(pool).unwrap();
    a.empty_cache();
    // The pool's segment went back; the shared block (one 20 MiB segment) lives on.
    assert_eq!(a.memory_reserved(), 20 * MIB as u64);
    assert_eq!(a.by_category().get(Category::Workspace), 3 * MIB as u64);
    drop_checked(&a, kept);
}
