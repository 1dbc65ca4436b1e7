//! Scopes: a label a thread puts on the blocks it allocates, so that one device's bytes can
//! be told apart by who asked for them — the in-process data-parallel ranks are threads
//! sharing the CPU's allocator, and each runs in the scope of its rank. The allocator keeps
//! per-scope category sums and peaks beside its totals; a block stays in the scope it was
//! allocated in wherever it is freed. Blocks allocated outside any scope (or on a worker
//! thread of a parallel kernel) count in the totals only, so the scopes' sums are at most
//! `memory_allocated`, never more.

use std::cell::Cell;

use crate::base::CategoryBytes;

thread_local! {
    static SCOPE: Cell<Option<u16>> = const { Cell::new(None) };
}

/// The scope of this thread's allocations, if any.
pub(crate) fn current() -> Option<u16> {
    SCOPE.with(Cell::get)
}

/// Puts this thread's allocations in scope `id` until the guard is dropped.
pub fn enter_scope(id: u16) -> ScopeGuard {
    ScopeGuard(SCOPE.with(|s| s.replace(Some(id))))
}

/// Restores the thread's previous scope.
pub struct ScopeGuard(Option<u16>);

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        SCOPE.with(|s| s.set(self.0));
    }
}

/// One scope's bytes on a device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScopeMemory {
    /// Live bytes by category now.
    pub by_category: CategoryBytes,
    /// The highest total of live bytes since the last peak reset.
    pub peak: u64,
    /// The categories at that peak.
    pub by_category_at_peak: CategoryBytes,
}

impl ScopeMemory {
    pub fn allocated(&self) -> u64 {
        self.by_category.total()
    }

    pub(crate) fn add(&mut self, c: crate::base::Category, bytes: u64) {
        self.by_category.add(c, bytes);
        if self.allocated() >= self.peak {
            self.peak = self.allocated();
            self.by_category_at_peak = self.by_category;
        }
    }

    pub(crate) fn sub(&mut self, c: crate::base::Category, bytes: u64) {
        self.by_category.sub(c, bytes);
    }

    pub(crate) fn reset_peak(&mut self) {
        self.peak = self.allocated();
        self.by_category_at_peak = self.by_category;
    }
}
