//! The host (CPU) policy: exact byte counts, no rounding and no cache, so reserved equals
//! allocated and CPU tests can assert memory behaviour to the byte. A configurable limit
//! (default: the machine's physical memory) turns impossible requests into an OOM error
//! instead of an abort.

use super::allocator::{MemInfo, Policy, PolicyBlock};
use super::stats::{DeviceStats, Pool};

pub struct HostPolicy {
    limit: u64,
    /// The next block's address. Host buffers are owned by their storages, so a block's
    /// address is a name, not a location: unique over the process (never reused), so that a
    /// recording can tell blocks apart.
    next_addr: u64,
}

/// Where host block names start (any non-zero value; this one reads well in hex).
const FIRST_HOST_ADDR: u64 = 0x1000_0000_0000;
/// Host block names advance in steps of this many bytes, as device blocks are aligned.
const HOST_ADDR_ALIGN: u64 = 512;

impl HostPolicy {
    pub fn new(limit: u64) -> Self {
        HostPolicy {
            limit,
            next_addr: FIRST_HOST_ADDR,
        }
    }

    /// Physical memory of this machine from /proc/meminfo (MemTotal), or u64::MAX if unknown.
    pub fn physical_memory() -> u64 {
        meminfo_field("MemTotal:").unwrap_or(u64::MAX)
    }

    /// Memory the OS says is available now (MemAvailable), if it says.
    pub fn available_memory() -> Option<u64> {
        meminfo_field("MemAvailable:")
    }
}

fn meminfo_field(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

impl Policy for HostPolicy {
    fn malloc(&mut self, requested: usize, stats: &mut DeviceStats) -> Option<PolicyBlock> {
        let cur = stats.allocated_bytes.all.current as u64;
        if cur.saturating_add(requested as u64) > self.limit {
            return None;
        }
        let pool = Pool::for_size(requested);
        let n = requested as i64;
        stats.allocation.increase(pool, 1);
        stats.active.increase(pool, 1);
        stats.segment.increase(pool, 1);
        stats.allocated_bytes.increase(pool, n);
        stats.active_bytes.increase(pool, n);
        stats.requested_bytes.increase(pool, n);
        stats.reserved_bytes.increase(pool, n);
        stats.num_device_alloc += 1;
        let addr = if requested == 0 { 0 } else { self.next_addr };
        self.next_addr += (requested as u64).div_ceil(HOST_ADDR_ALIGN) * HOST_ADDR_ALIGN;
        Some(PolicyBlock {
            addr,
            size: requested,
            pool,
        })
    }

    fn free(&mut self, block: &PolicyBlock, requested: usize, stats: &mut DeviceStats) {
        let (pool, n) = (block.pool, block.size as i64);
        stats.allocation.decrease(pool, 1);
        stats.active.decrease(pool, 1);
        stats.segment.decrease(pool, 1);
        stats.allocated_bytes.decrease(pool, n);
        stats.active_bytes.decrease(pool, n);
        stats.requested_bytes.decrease(pool, requested as i64);
        stats.reserved_bytes.decrease(pool, n);
        stats.num_device_free += 1;
    }

    fn empty_cache(&mut self, _stats: &mut DeviceStats) {}

    fn segment_per_block(&self) -> bool {
        true
    }

    fn mem_info(&self) -> MemInfo {
        let total = self.limit;
        let free = HostPolicy::available_memory().unwrap_or(total).min(total);
        MemInfo { total, free }
    }
}
