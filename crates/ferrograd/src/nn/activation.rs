//! Parameter-free activation modules.

use super::Module;
use crate::base::Result;
use crate::ops::GeluApprox;
use crate::tensor::Tensor;

pub struct Relu;

impl Module for Relu {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.relu()
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }
}

pub struct Gelu(pub GeluApprox);

impl Module for Gelu {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.gelu(self.0)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }
}
