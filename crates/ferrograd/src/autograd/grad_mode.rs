//! Grad mode: whether ops record a graph. `no_grad()` returns a guard that turns recording
//! off on this thread until it is dropped (like `with torch.no_grad():`).

use std::cell::Cell;

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Restores the previous grad mode when dropped.
#[must_use = "grad mode is restored when the guard is dropped; bind it: let _g = no_grad();"]
pub struct GradModeGuard {
    previous: bool,
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.previous));
    }
}

fn set_grad_enabled(enabled: bool) -> GradModeGuard {
    let previous = GRAD_ENABLED.with(|g| g.replace(enabled));
    GradModeGuard { previous }
}

/// No graph is recorded and nothing is saved for backward while the guard lives.
pub fn no_grad() -> GradModeGuard {
    set_grad_enabled(false)
}

/// Re-enables recording inside a `no_grad` region.
pub fn enable_grad() -> GradModeGuard {
    set_grad_enabled(true)
}
