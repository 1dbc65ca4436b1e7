//! Sequential: modules applied in order. Each intermediate is dropped as soon as the next
//! layer has consumed it, so only what the graph saved stays alive.

use super::Module;
use crate::base::Result;
use crate::tensor::Tensor;

#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module>>,
}

impl Sequential {
    pub fn new() -> Self {
        Sequential::default()
    }

    /// Appends a layer (builder style): `Sequential::new().push(a).push(b)`.
    pub fn push(mut self, layer: impl Module + 'static) -> Self {
        self.layers.push(Box::new(layer));
        self
    }

    pub fn len(&self) -> usize {
        self.layers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

impl Module for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            let _scope = crate::memory::recorder::module_scope_indexed("", i);
            h = layer.forward(&h)?;
        }
        Ok(h)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, l)| {
                l.named_parameters()
                    .into_iter()
                    .map(move |(n, p)| (format!("{i}.{n}"), p))
            })
            .collect()
    }

    fn train(&mut self, mode: bool) {
        for l in &mut self.layers {
            l.train(mode);
        }
    }
}
