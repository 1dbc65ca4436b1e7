//! Saved tensors: what a graph node keeps for its backward. Saving re-labels an op output's
//! bytes as `saved_activation` for as long as the graph holds them; dropping the node (after
//! its backward without retain_graph, or when the graph is dropped) releases them.
//!
//! A saved tensor is stored detached (no grad_fn): a node that saves its own output must not
//! own itself, which would leak the graph (PyTorch's SavedVariable does the same).

//!
//! Each save also notes the buffer's version: the node that recorded it checks, before its
//! backward, that no in-place op changed what it saved (PyTorch's version counter).

use std::cell::RefCell;
use std::sync::{Arc, Weak};

use super::Tensor;
use crate::backend::Storage;

/// A saved buffer and its version at save time.
pub(crate) type SavedVersion = (Weak<Storage>, u64);

thread_local! {
    /// Saves made since the last node was recorded on this thread.
    static PENDING: RefCell<Vec<SavedVersion>> = const { RefCell::new(Vec::new()) };
}

/// Takes the saves made since the last call (the ones the node being recorded made).
pub(crate) fn take_pending() -> Vec<SavedVersion> {
    PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()))
}

pub struct SavedTensor {
    tensor: Tensor,
}

impl SavedTensor {
    pub fn new(t: &Tensor) -> SavedTensor {
        let tensor = t.detach();
        let storage = tensor.storage();
        storage.allocation().add_saved_ref();
        PENDING.with(|p| {
            p.borrow_mut()
                .push((Arc::downgrade(storage), storage.version()))
        });
        SavedTensor { tensor }
    }

    pub fn get(&self) -> &Tensor {
        &self.tensor
    }
}

impl Drop for SavedTensor {
    fn drop(&mut self) {
        self.tensor.storage().allocation().remove_saved_ref();
    }
}
