//! Storage: a device buffer plus the allocator's record of it. A storage is shared by all
//! views of it (`Arc<Storage>`); dropping the last view frees the bytes in the allocator.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::cpu::CpuData;
use crate::base::Result;
use crate::base::{DType, Device};
use crate::memory::{self, Allocation, Category};

/// Device-specific contents.
pub enum BackendData {
    Cpu(CpuData),
    /// A sub-block of a segment the device's caching allocator reserved.
    Cuda(super::cuda::CudaBuffer),
    /// The meta device holds no bytes; only the allocator's accounting exists.
    Meta,
}

pub struct Storage {
    alloc: Allocation,
    dtype: DType,
    len: usize,
    data: RwLock<BackendData>,
    /// Bumped by every in-place write, so autograd can tell that a saved tensor changed.
    version: AtomicU64,
    /// The I64 values a device buffer was uploaded with. While no in-place write has changed
    /// the buffer (version 0), kernels check ids and class targets against these instead of
    /// reading the device back: a training step's token ids come from the host, and each
    /// read-back would stall the host until the GPU caught up.
    uploaded_i64: OnceLock<Arc<[i64]>>,
}

impl Storage {
    /// Accounts the bytes first (so an impossible request is an OOM error before any host or
    /// device allocation is attempted), then builds the data with `make(address)`.
    pub fn new(
        device: Device,
        dtype: DType,
        len: usize,
        category: Category,
        origin: &'static str,
        make: impl FnOnce(u64) -> Result<BackendData>,
    ) -> Result<Storage> {
        let bytes = len.checked_mul(dtype.size_in_bytes()).ok_or_else(|| {
            crate::base::Error::shape(
                origin,
                format!("{len} elements of {dtype} are more bytes than an address holds"),
            )
        })?;
        // Opening the device first registers a GPU's memory with its allocator.
        super::backend(device)?;
        let alloc = memory::allocator(device)?.malloc(bytes, category, origin)?;
        let data = make(alloc.addr())?;
        Ok(Storage {
            alloc,
            dtype,
            len,
            data: RwLock::new(data),
            version: AtomicU64::new(0),
            uploaded_i64: OnceLock::new(),
        })
    }

    /// Remembers the I64 values this fresh buffer was just uploaded with.
    pub(crate) fn remember_upload(&self, values: Arc<[i64]>) {
        if self.dtype == DType::I64 && values.len() == self.len && self.version() == 0 {
            let _ = self.uploaded_i64.set(values);
        }
    }

    /// The values the buffer was uploaded with, if no in-place write has changed it since.
    pub(crate) fn uploaded_i64s(&self) -> Option<&[i64]> {
        (self.version() == 0)
            .then(|| self.uploaded_i64.get().map(|v| &v[..]))
            .flatten()
    }

    pub fn device(&self) -> Device {
        self.alloc.device()
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn allocation(&self) -> &Allocation {
        &self.alloc
    }
    pub fn read(&self) -> RwLockReadGuard<'_, BackendData> {
        self.data.read().unwrap_or_else(|e| e.into_inner())
    }
    pub fn write(&self) -> RwLockWriteGuard<'_, BackendData> {
        self.data.write().unwrap_or_else(|e| e.into_inner())
    }
    /// How many in-place writes this buffer has seen.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Relaxed)
    }
    /// Records an in-place write.
    pub fn bump_version(&self) {
        self.version.fetch_add(1, Ordering::Relaxed);
    }
    /// Same buffer?
    pub fn same(&self, other: &Storage) -> bool {
        std::ptr::eq(self, other)
    }
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Storage({} x {}, {:?})",
            self.len, self.dtype, self.alloc
        )
    }
}
