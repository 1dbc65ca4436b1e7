//! Inverted dropout, as in PyTorch: in training each element is zeroed with probability p and
//! the kept ones are scaled by 1/(1-p), so the expected value is unchanged and evaluation needs
//! no rescaling. The mask is drawn on the host from a seeded `Generator` (same seed, same
//! mask), uploaded in the input's dtype holding 0 or 1/(1-p), and saved: backward is g * mask.

use super::binary::binary_forward;
use crate::autograd::{SavedTensor, record};
use crate::backend::BinaryOp;
use crate::base::{Error, Result};
use crate::memory::Category;
use crate::tensor::{DType, Device, Generator, Tensor, with_default};

impl Tensor {
    /// Zeroes each element with probability `p` and scales the rest by 1/(1-p) when `train`;
    /// returns self unchanged when `p == 0` or not training. Draws the mask from `rng`.
    #[track_caller]
    pub fn dropout(&self, p: f64, train: bool, rng: &mut Generator) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::invalid(
                "dropout",
                format!("p must be a probability in [0, 1], got {p}"),
            ));
        }
        super::check_float("dropout", self)?;
        if p == 0.0 || !train {
            return Ok(self.clone());
        }
        let mask = dropout_mask(self, p, rng)?;
        let out = binary_forward(BinaryOp::Mul, self, &mask, "dropout")?;
        Ok(record("dropout", &[self], out, |_, _| {
            let mask = SavedTensor::new(&mask);
            move |g: &Tensor, _: &[bool]| {
                Ok(vec![Some(binary_forward(
                    BinaryOp::Mul,
                    g,
                    mask.get(),
                    "dropout_backward",
                )?)])
            }
        }))
    }

    /// `dropout` with the process-wide default generator (seeded by `manual_seed`).
    #[track_caller]
    pub fn dropout_default(&self, p: f64, train: bool) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        with_default(|rng| self.dropout(p, train, rng))
    }
}

/// 0 or 1/(1-p) per element of `x`, in x's dtype; an op temporary (saved while a graph holds
/// it). Kept where a uniform draw u < 1-p, as `bernoulli_(1 - p)`.
fn dropout_mask(x: &Tensor, p: f64, rng: &mut Generator) -> Result<Tensor> {
    let (shape, dtype, device) = (x.shape(), x.dtype(), x.device());
    // p == 1 drops everything; the meta device only needs the bytes accounted.
    if p == 1.0 || device == Device::Meta {
        return Tensor::output(shape, dtype, device, "dropout_mask");
    }
    let n = x.numel();
    let mask = if dtype == DType::F64 {
        let scale = 1.0 / (1.0 - p);
        let keep = |u: f64| if u < 1.0 - p { scale } else { 0.0 };
        Tensor::from_vec(
            rng.uniform(n, 0.0, 1.0).into_iter().map(keep).collect(),
            shape,
            device,
        )?
    } else {
        // f32 draws for f32 and the half types: no f64 buffer for large activations.
        let (keep_below, scale) = ((1.0 - p) as f32, (1.0 / (1.0 - p)) as f32);
        let keep = |u: f32| if u < keep_below { scale } else { 0.0 };
        Tensor::from_vec_as(
            rng.uniform_f32(n, 0.0, 1.0).into_iter().map(keep).collect(),
            shape,
            dtype,
            device,
        )?
    };
    mask.set_category(Category::Temporary);
    Ok(mask)
}
