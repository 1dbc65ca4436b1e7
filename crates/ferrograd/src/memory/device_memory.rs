//! Raw device memory: the two driver calls the caching policy builds on (`cuMemAlloc` /
//! `cuMemFree` on a real GPU) plus `mem_info` (`cuMemGetInfo`), and `SimulatedDevice`, a
//! fixed-capacity stand-in that lets the caching policy be tested on any machine.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::allocator::{MemInfo, Policy, PolicyBlock};
use super::stats::DeviceStats;

/// What a device driver offers the caching policy. Segments are whole driver allocations;
/// the policy never frees part of one.
pub trait DeviceMemory: Send {
    /// Address of `bytes` fresh bytes, or None when the device cannot provide them.
    fn alloc(&mut self, bytes: usize) -> Option<u64>;
    /// Returns a segment obtained from `alloc` (same address and size).
    fn free(&mut self, addr: u64, bytes: usize);
    fn mem_info(&self) -> MemInfo;
}

/// The policy of a GPU whose backend has not opened it yet: nothing allocated, nothing
/// reserved, and an allocation is refused (the allocator reports it as out of memory with a
/// zero capacity). Storages open their device's backend before allocating, so users only
/// meet it through statistics, which read zero as in PyTorch before CUDA is initialised.
pub struct Unopened;

impl Policy for Unopened {
    fn malloc(&mut self, _requested: usize, _stats: &mut DeviceStats) -> Option<PolicyBlock> {
        None
    }
    fn free(&mut self, _block: &PolicyBlock, _requested: usize, _stats: &mut DeviceStats) {}
    fn empty_cache(&mut self, _stats: &mut DeviceStats) {}
    fn mem_info(&self) -> MemInfo {
        MemInfo { total: 0, free: 0 }
    }
    fn is_unopened(&self) -> bool {
        true
    }
}

/// Addresses are handed out downwards from here (far above 0, the address of zero-size
/// blocks, and above any capacity's worth of segments).
const TOP_ADDR: u64 = 1 << 52;
/// Addresses move in steps of this, like a driver's allocation granularity.
const ADDR_ALIGN: u64 = 2 << 20;

/// A device of `capacity` bytes that hands out decreasing addresses and counts calls.
///
/// Decreasing, because the CUDA driver does (seen on an H200, driver 580: each new segment
/// of a training run lies below the one before), and the caching policy breaks ties between
/// equally good free blocks by the lower address, so a plan picks the blocks the real run
/// picks only when its segments are ordered as the driver orders them. With increasing
/// addresses a GPT-2 plan with the GELU recomputed reserved one (B·T, 4C) segment less
/// than the run (384 MiB at B 64).
///
/// Clones share one device: a test keeps a clone to read the counters after the policy took
/// ownership, or allocates from it directly to play another process using the same GPU.
/// Freeing an unknown address or with the wrong size panics: that is a policy bug, and the
/// simulator exists to catch it.
#[derive(Clone)]
pub struct SimulatedDevice {
    state: Arc<Mutex<SimState>>,
}

struct SimState {
    capacity: u64,
    used: u64,
    /// The lowest address handed out so far: the next segment ends here.
    low_addr: u64,
    live: HashMap<u64, usize>,
    allocs: u64,
    frees: u64,
    failed_allocs: u64,
}

impl SimulatedDevice {
    pub fn new(capacity: u64) -> Self {
        SimulatedDevice {
            state: Arc::new(Mutex::new(SimState {
                capacity,
                used: 0,
                low_addr: TOP_ADDR,
                live: HashMap::new(),
                allocs: 0,
                frees: 0,
                failed_allocs: 0,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn capacity(&self) -> u64 {
        self.lock().capacity
    }
    /// Bytes currently handed out.
    pub fn used(&self) -> u64 {
        self.lock().used
    }
    /// Successful `alloc` calls.
    pub fn allocs(&self) -> u64 {
        self.lock().allocs
    }
    /// `free` calls.
    pub fn frees(&self) -> u64 {
        self.lock().frees
    }
    /// `alloc` calls refused for lack of capacity.
    pub fn failed_allocs(&self) -> u64 {
        self.lock().failed_allocs
    }
    /// Number of allocations not yet freed.
    pub fn live_allocations(&self) -> usize {
        self.lock().live.len()
    }
}

impl DeviceMemory for SimulatedDevice {
    fn alloc(&mut self, bytes: usize) -> Option<u64> {
        let mut st = self.lock();
        let fits = st
            .used
            .checked_add(bytes as u64)
            .is_some_and(|u| u <= st.capacity);
        if !fits {
            st.failed_allocs += 1;
            return None;
        }
        let step = (bytes as u64).div_ceil(ADDR_ALIGN).max(1) * ADDR_ALIGN;
        let addr = st.low_addr.checked_sub(step)?;
        st.low_addr = addr;
        st.used += bytes as u64;
        st.allocs += 1;
        st.live.insert(addr, bytes);
        Some(addr)
    }

    fn free(&mut self, addr: u64, bytes: usize) {
        let mut st = self.lock();
        let size = st.live.remove(&addr);
        assert_eq!(
            size,
            Some(bytes),
            "simulated device: free({addr:#x}, {bytes}) does not match a live allocation"
        );
        st.used -= bytes as u64;
        st.frees += 1;
    }

    fn mem_info(&self) -> MemInfo {
        let st = self.lock();
        MemInfo {
            total: st.capacity,
            free: st.capacity - st.used,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hands_out_decreasing_addresses_within_capacity() {
        let mut d = SimulatedDevice::new(5 << 20);
        let a = d.alloc(2 << 20).unwrap();
        let b = d.alloc(3 << 20).unwrap();
        assert!(b + (3 << 20) <= a, "each segment below the one before");
        assert_eq!(d.alloc(1), None);
        assert_eq!(d.failed_allocs(), 1);
        assert_eq!(
            d.mem_info(),
            MemInfo {
                total: 5 << 20,
                free: 0
            }
        );
        d.free(a, 2 << 20);
        assert_eq!(d.mem_info().free, 2 << 20);
        let c = d.alloc(2 << 20).unwrap();
        assert!(c < b, "addresses are never reused");
        assert_eq!((d.allocs(), d.frees(), d.live_allocations()), (3, 1, 2));
    }

    #[test]
    fn clones_share_one_device() {
        let d = SimulatedDevice::new(4 << 20);
        let mut other = d.clone();
        other.alloc(3 << 20).unwrap();
        assert_eq!(d.used(), 3 << 20);
        assert_eq!(d.mem_info().free, 1 << 20);
    }

    #[test]
    #[should_panic(expected = "does not match a live allocation")]
    fn double_free_is_caught() {
        let mut d = SimulatedDevice::new(4 << 20);
        let a = d.alloc(512).unwrap();
        d.free(a, 512);
        d.free(a, 512);
    }
}
