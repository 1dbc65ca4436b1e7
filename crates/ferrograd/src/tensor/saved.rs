//! Saved tensors: what a graph node keeps for its backward. Saving re-labels an op output's
//! bytes as `saved_activation` for as long as the graph holds them; dropping the node (after
//! its backward without retain_graph, or when the graph is dropped) releases them.
//!
//! A saved tensor is stored detached (no grad_fn): a node that saves its own output must not
//! own itself, which would leak the graph (PyTorch's SavedVariable does the same). For a
//! backward that is itself recorded (`create_graph`), `unpack` gives the saved value back
//! with its history: an input's own autograd state, or, for the node's output, the node that
//! is running (PyTorch keeps a weak reference to grad_fn for outputs for the same reason).

//!
//! Each save also notes the buffer's version: the node that recorded it checks, before its
//! backward, that no in-place op changed what it saved (PyTorch's version counter).

use std::cell::RefCell;
use std::sync::{Arc, Weak};

use super::Tensor;
use super::meta::AutogradMeta;
use super::node::Node;
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

thread_local! {
    /// The node whose backward runs now under `create_graph` (innermost last): a saved output
    /// unpacks with it as grad_fn.
    static RUNNING: RefCell<Vec<Arc<Node>>> = const { RefCell::new(Vec::new()) };
}

/// Marks `node` as running its backward until the guard drops.
pub(crate) struct RunningNode;

impl RunningNode {
    pub(crate) fn enter(node: &Arc<Node>) -> RunningNode {
        RUNNING.with(|r| r.borrow_mut().push(Arc::clone(node)));
        RunningNode
    }
}

impl Drop for RunningNode {
    fn drop(&mut self) {
        RUNNING.with(|r| r.borrow_mut().pop());
    }
}

/// Whose history a saved value has when it is unpacked for a recorded backward.
enum Origin {
    /// An input (or any tensor that existed before the op): its own autograd state. No
    /// cycle: the state points to earlier nodes only.
    Input(Arc<AutogradMeta>),
    /// The op's own output: the node running its backward.
    Output,
}

pub struct SavedTensor {
    tensor: Tensor,
    origin: Origin,
}

impl SavedTensor {
    /// Saves a tensor that existed before the op (an input, or a view of one).
    pub fn new(t: &Tensor) -> SavedTensor {
        SavedTensor::save(t, Origin::Input(Arc::clone(t.meta())))
    }

    /// Saves the op's own output (`out` in `record`'s closure maker).
    pub fn output(out: &Tensor) -> SavedTensor {
        SavedTensor::save(out, Origin::Output)
    }

    fn save(t: &Tensor, origin: Origin) -> SavedTensor {
        let tensor = t.detach();
        let storage = tensor.storage();
        storage.allocation().add_saved_ref();
        PENDING.with(|p| {
            p.borrow_mut()
                .push((Arc::downgrade(storage), storage.version()))
        });
        SavedTensor { tensor, origin }
    }

    /// The saved value without history (what a backward that is not recorded reads).
    pub fn get(&self) -> &Tensor {
        &self.tensor
    }

    /// The saved value with its history, for a backward recorded under `create_graph`: a
    /// gradient computed from it can be differentiated again with respect to what made it.
    pub fn unpack(&self) -> Tensor {
        let meta = match &self.origin {
            Origin::Input(meta) => Arc::clone(meta),
            Origin::Output => match RUNNING.with(|r| r.borrow().last().cloned()) {
                Some(node) => Arc::new(AutogradMeta::with_grad_fn(node)),
                None => return self.tensor.clone(),
            },
        };
        self.tensor.with_meta(meta)
    }
}

impl Drop for SavedTensor {
    fn drop(&mut self) {
        self.tensor.storage().allocation().remove_saved_ref();
    }
}
