//! Memory: the source of truth for bytes. One `Allocator` per device keeps PyTorch-style
//! statistics and attributes every live block to a `Category`. The free functions here are
//! the user-facing API (`memory_allocated(device)` and friends), named as in `torch.cuda`.

mod allocator;
mod caching;
mod device_memory;
mod host;
mod private_pool;
pub mod recorder;
mod scope;
mod stats;
mod summary;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

pub use crate::base::{Category, CategoryBytes, LiveBlockInfo, OomReport, format_size};
pub use allocator::{Allocation, Allocator, MemInfo, Policy, PolicyBlock, SegmentEvent};
pub use caching::{BlockInfo, CachingPolicy, SegmentInfo, StreamId, pool_stream};
pub use device_memory::{DeviceMemory, SimulatedDevice, Unopened};
pub use host::HostPolicy;
pub use private_pool::{PrivatePoolBytes, PrivatePoolId};
pub use scope::{ScopeGuard, ScopeMemory, enter_scope};
pub use stats::{DeviceStats, Pool, SMALL_SIZE, Stat, StatArray};

use crate::base::Device;
use crate::base::{Error, Result};

type Registry = Mutex<HashMap<Device, Arc<Allocator>>>;

fn registry() -> &'static Registry {
    static REG: OnceLock<Registry> = OnceLock::new();
    REG.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The allocator of `device`, created on first use. A GPU's allocator starts without device
/// memory (statistics read zero, allocations fail) until its backend opens the device and
/// registers the driver's memory with `register_device_memory`: memory knows no backend.
pub fn allocator(device: Device) -> Result<Arc<Allocator>> {
    let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(a) = reg.get(&device) {
        return Ok(Arc::clone(a));
    }
    let policy: Box<dyn Policy> = match device {
        Device::Cpu => Box::new(HostPolicy::new(HostPolicy::physical_memory())),
        Device::Meta => Box::new(HostPolicy::new(u64::MAX)),
        Device::Cuda(_) => Box::new(Unopened),
    };
    let a = Allocator::new(device, policy);
    reg.insert(device, Arc::clone(&a));
    Ok(a)
}

/// Gives `device`'s allocator its driver memory, with the caching policy on top. Called by a
/// backend when it opens the device; a policy installed earlier (a simulated device in tests)
/// is kept.
pub fn register_device_memory(device: Device, memory: impl DeviceMemory + 'static) {
    let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
    if reg.get(&device).is_some_and(|a| !a.is_unopened()) {
        return;
    }
    reg.insert(
        device,
        Allocator::new(device, Box::new(CachingPolicy::new(memory))),
    );
}

/// Replaces a device's allocator policy (e.g. a memory limit for the host, or a simulated
/// device in tests). Only valid while the device has no live blocks.
pub fn install_policy(device: Device, policy: Box<dyn Policy>) -> Result<()> {
    let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(a) = reg.get(&device)
        && a.live_blocks() > 0
    {
        return Err(Error::invalid(
            "install_policy",
            format!(
                "{device} still has {} live blocks; drop its tensors first",
                a.live_blocks()
            ),
        ));
    }
    reg.insert(device, Allocator::new(device, policy));
    Ok(())
}

/// Every device's segments and blocks, for a recording's final state.
fn all_segments() -> Vec<recorder::SnapshotSegment> {
    let allocators: Vec<Arc<Allocator>> = registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .values()
        .cloned()
        .collect();
    let mut segments: Vec<_> = allocators.iter().flat_map(|a| a.snapshot()).collect();
    segments.sort_by_key(|s| (format!("{}", s.device), s.addr));
    segments
}

/// Bytes occupied by tensors on `device` (`torch.cuda.memory_allocated`).
pub fn memory_allocated(device: Device) -> Result<u64> {
    Ok(allocator(device)?.memory_allocated())
}
/// Peak of `memory_allocated` since start or the last `reset_peak_memory_stats`.
pub fn max_memory_allocated(device: Device) -> Result<u64> {
    Ok(allocator(device)?.max_memory_allocated())
}
/// Bytes held by the allocator (allocated + cached).
pub fn memory_reserved(device: Device) -> Result<u64> {
    Ok(allocator(device)?.memory_reserved())
}
pub fn max_memory_reserved(device: Device) -> Result<u64> {
    Ok(allocator(device)?.max_memory_reserved())
}
pub fn reset_peak_memory_stats(device: Device) -> Result<()> {
    allocator(device)?.reset_peak_memory_stats();
    Ok(())
}
/// All statistics, flattened and key-sorted like `torch.cuda.memory_stats()`.
pub fn memory_stats(device: Device) -> Result<std::collections::BTreeMap<String, i64>> {
    Ok(allocator(device)?.stats().to_flat_map())
}
/// Live bytes per category; the sum equals `memory_allocated`.
pub fn memory_by_category(device: Device) -> Result<CategoryBytes> {
    Ok(allocator(device)?.by_category())
}
/// The bytes that threads in scope `id` allocated on `device` (a data-parallel rank's, for
/// in-process ranks): by category now, and the scope's own peak with its categories.
pub fn scope_memory(device: Device, id: u16) -> Result<ScopeMemory> {
    Ok(allocator(device)?.scope_memory(id))
}
/// A readable table of the statistics and the category breakdown.
pub fn memory_summary(device: Device) -> Result<String> {
    let a = allocator(device)?;
    Ok(summary::memory_summary(
        device,
        &a.stats(),
        &a.by_category(),
        false,
    ))
}
/// Returns cached, unused memory to the driver (a no-op on the host, which caches nothing).
pub fn empty_cache(device: Device) -> Result<()> {
    allocator(device)?.empty_cache();
    Ok(())
}
