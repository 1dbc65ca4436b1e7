//! Inverted dropout, as in PyTorch: in training each element is zeroed with probability p and
//! the kept ones are scaled by 1/(1-p), so the expected value is unchanged and evaluation needs
//! no rescaling. The mask is made on the tensor's device from a seeded `Generator` (same seed,
//! same mask, on every device), holds 0 or 1/(1-p) in the input's dtype, and is saved:
//! backward is g * mask.

use super::binary::binary_forward;
use crate::autograd::{SavedTensor, record};
use crate::backend::{BinaryOp, elementwise};
use crate::base::{Error, Result};
use crate::tensor::{Generator, Tensor, with_default};

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
/// it). Made on x's device by a counter-based generator (Philox) whose key is the next draw of
/// `rng`: the same generator state gives the same mask on every device, and recomputation
/// replays it from the generator state alone. Kept where the draw u < 1-p, as
/// `bernoulli_(1 - p)`.
fn dropout_mask(x: &Tensor, p: f64, rng: &mut Generator) -> Result<Tensor> {
    let (shape, dtype, device) = (x.shape(), x.dtype(), x.device());
    // p == 1 drops everything (zeros).
    if p == 1.0 {
        return Tensor::output(shape, dtype, device, "dropout_mask");
    }
    let key = rng.next_u64();
    let mask = Tensor::output_uninit(shape, dtype, device, "dropout_mask")?;
    elementwise::dropout_mask(mask.storage(), 1.0 - p, key)?;
    Ok(mask)
}
