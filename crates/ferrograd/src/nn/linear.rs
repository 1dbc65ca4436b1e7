//! Linear layer: y = x Wᵀ + b with W: (out, in), b: (out). Initialised like PyTorch:
//! W, b ~ U(-1/√in, 1/√in).

use super::Module;
use crate::base::Result;
use crate::memory::Category;
use crate::tensor::{DType, Device, Generator, Tensor};

#[derive(Clone)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Linear {
    pub fn new(
        in_features: usize,
        out_features: usize,
        bias: bool,
        device: Device,
        g: &mut Generator,
    ) -> Result<Linear> {
        Linear::new_with_dtype(in_features, out_features, bias, DType::F32, device, g)
    }

    pub fn new_with_dtype(
        in_features: usize,
        out_features: usize,
        bias: bool,
        dtype: DType,
        device: Device,
        g: &mut Generator,
    ) -> Result<Linear> {
        let bound = 1.0 / (in_features.max(1) as f64).sqrt();
        let param = |shape: &[usize], g: &mut Generator| -> Result<Tensor> {
            let t = Tensor::uniform_with(shape, -bound, bound, dtype, device, g)?;
            t.set_category(Category::Parameter);
            t.requires_grad_(true)
        };
        let weight = param(&[out_features, in_features], g)?;
        let bias = if bias {
            Some(param(&[out_features], g)?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }
}

impl Module for Linear {
    /// x: (..., in) → (..., out)
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.linear(&self.weight, self.bias.as_ref())
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![("weight".to_string(), self.weight.clone())];
        if let Some(b) = &self.bias {
            v.push(("bias".to_string(), b.clone()));
        }
        v
    }
}
