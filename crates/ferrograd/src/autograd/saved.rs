//! Saved tensors: what a graph node keeps for its backward. Saving re-labels an op output's
//! bytes as `saved_activation` for as long as the graph holds them; dropping the node (after
//! its backward without retain_graph, or when the graph is dropped) releases them.
//!
//! A saved tensor is stored detached (no grad_fn): a node that saves its own output must not
//! own itself, which would leak the graph (PyTorch's SavedVariable does the same).

use crate::tensor::Tensor;

pub struct SavedTensor {
    tensor: Tensor,
}

impl SavedTensor {
    pub fn new(t: &Tensor) -> SavedTensor {
        let tensor = t.detach();
        tensor.storage().allocation().add_saved_ref();
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
