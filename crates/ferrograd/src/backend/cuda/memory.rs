//! The device side of the caching allocator: segments straight from cuMemAlloc (not the
//! driver's stream-ordered pool), so "reserved" is ours to answer.

use super::device::CudaDevice;
use crate::memory::{DeviceMemory, MemInfo};

pub struct CudaMemory {
    dev: &'static CudaDevice,
}

impl CudaMemory {
    /// The memory of an opened device (registered with the allocator when it opens).
    pub(crate) fn of(dev: &'static CudaDevice) -> CudaMemory {
        CudaMemory { dev }
    }
}

impl DeviceMemory for CudaMemory {
    fn alloc(&mut self, bytes: usize) -> Option<u64> {
        self.dev.bind().ok()?;
        // SAFETY: a plain device allocation in this device's context.
        unsafe { cudarc::driver::result::malloc_sync(bytes) }.ok()
    }

    fn free(&mut self, addr: u64, _bytes: usize) {
        if self.dev.bind().is_ok() {
            // Work queued on the stream may still read the segment.
            let _ = self.dev.synchronize();
            // SAFETY: addr came from alloc above and is freed once.
            let _ = unsafe { cudarc::driver::result::free_sync(addr) };
        }
    }

    fn mem_info(&self) -> MemInfo {
        let (free, total) = self.dev.mem_info().unwrap_or((0, 0));
        MemInfo {
            total: total as u64,
            free: free as u64,
        }
    }
}
