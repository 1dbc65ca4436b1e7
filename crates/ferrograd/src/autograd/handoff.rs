//! A value one backward function leaves for a later one of the same backward pass (the column
//! sums a layer norm's backward makes for the Linear before it, `ops::column_sums`). One slot
//! per thread, tagged with the pass that filled it: only that pass can take it, and the engine
//! empties it when that pass ends, finished or failed, so nothing left there outlives the
//! pass (a pass that stops on an error, out of memory say, between the leaving and the taking
//! would otherwise keep the value's memory alive after it returned).

use std::any::Any;
use std::cell::RefCell;

use super::engine::backward_id;

thread_local! {
    static SLOT: RefCell<Option<(u64, Box<dyn Any>)>> = const { RefCell::new(None) };
}

/// Leaves `value` for a later backward function of this pass, replacing what was there.
pub(crate) fn leave<T: Any>(value: T) {
    SLOT.with(|s| *s.borrow_mut() = Some((backward_id(), Box::new(value))));
}

/// Takes what this pass left, if it is a `T` (the slot is emptied either way).
pub(crate) fn take<T: Any>() -> Option<T> {
    let (pass, value) = SLOT.with(|s| s.borrow_mut().take())?;
    if pass != backward_id() {
        return None;
    }
    value.downcast::<T>().ok().map(|v| *v)
}

/// Empties the slot if pass `id` filled it (the engine, as the pass ends).
pub(super) fn end_of_pass(id: u64) {
    SLOT.with(|s| {
        let mut slot = s.borrow_mut();
        if slot.as_ref().is_some_and(|(pass, _)| *pass == id) {
            *slot = None;
        }
    });
}

/// Whether the slot holds anything (for tests).
#[cfg(test)]
pub(crate) fn is_empty() -> bool {
    SLOT.with(|s| s.borrow().is_none())
}
