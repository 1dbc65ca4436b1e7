//! Embedding: a (V, D) table of learned rows, looked up by integer ids. Initialised like
//! PyTorch's `nn.Embedding`: weight ~ N(0, 1).

use super::Module;
use crate::base::{Error, Result};
use crate::memory::Category;
use crate::tensor::{DType, Device, Generator, Tensor};

#[derive(Clone)]
pub struct Embedding {
    /// (V, D)
    pub weight: Tensor,
}

impl Embedding {
    pub fn new(
        num_embeddings: usize,
        embedding_dim: usize,
        device: Device,
        g: &mut Generator,
    ) -> Result<Embedding> {
        let weight = Tensor::normal_with(
            &[num_embeddings, embedding_dim],
            0.0,
            1.0,
            DType::F32,
            device,
            g,
        )?;
        Embedding::from_weight(weight)
    }

    /// Wraps an existing (V, D) tensor as the table; it becomes a parameter that requires grad.
    pub fn from_weight(weight: Tensor) -> Result<Embedding> {
        if weight.dims() != 2 {
            return Err(Error::shape(
                "Embedding",
                format!(
                    "the weight must be 2-D (V, D), got shape {:?}",
                    weight.shape()
                ),
            ));
        }
        weight.set_category(Category::Parameter);
        Ok(Embedding {
            weight: weight.requires_grad_(true)?,
        })
    }

    pub fn num_embeddings(&self) -> usize {
        self.weight.shape()[0]
    }

    pub fn embedding_dim(&self) -> usize {
        self.weight.shape()[1]
    }
}

impl Module for Embedding {
    /// ids: I64 (...) → (..., D)
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.weight.embedding(ids)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".to_string(), self.weight.clone())]
    }
}
