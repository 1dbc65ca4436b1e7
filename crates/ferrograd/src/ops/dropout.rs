//! Inverted dropout, as in PyTorch: in training each element is zeroed with probability p and
//! the kept ones are scaled by 1/(1-p), so the expected value is unchanged and evaluation needs
//! no rescaling. The mask (0 or 1/(1-p) in the input's dtype) comes from a counter-based
//! generator (Philox) keyed by one draw of a seeded `Generator`: the same seed gives the same
//! mask on every device. It is never stored: the forward multiplies as it draws, and the
//! backward draws the same mask again from the saved key (g · mask), so a dropout saves no
//! bytes at all (PyTorch saves a mask per call).

use crate::autograd::record;
use crate::backend::elementwise;
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
        let (shape, dtype, device) = (self.shape(), self.dtype(), self.device());
        // p == 1 drops everything: zeros, and a zero gradient.
        if p == 1.0 {
            let out = Tensor::output(shape, dtype, device, "dropout")?;
            return Ok(record("dropout", &[self], out, |_, _| {
                move |g: &Tensor, _: &[bool]| {
                    Ok(vec![Some(Tensor::output(
                        g.shape(),
                        g.dtype(),
                        g.device(),
                        "dropout_backward",
                    )?)])
                }
            }));
        }
        let (keep, key) = (1.0 - p, rng.next_u64());
        let out = masked(self, keep, key, "dropout")?;
        Ok(record("dropout", &[self], out, |_, _| {
            move |g: &Tensor, _: &[bool]| Ok(vec![Some(masked(g, keep, key, "dropout_backward")?)])
        }))
    }

    /// `dropout` with the process-wide default generator (seeded by `manual_seed`).
    #[track_caller]
    pub fn dropout_default(&self, p: f64, train: bool) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        with_default(|rng| self.dropout(p, train, rng))
    }
}

/// x · the mask of `key` (kept where the draw u < keep, as `bernoulli_(keep)`), in a new
/// tensor: one pass over x on its device.
fn masked(x: &Tensor, keep: f64, key: u64, origin: &'static str) -> Result<Tensor> {
    let x = x.detached_contiguous()?;
    let out = Tensor::output_uninit(x.shape(), x.dtype(), x.device(), origin)?;
    elementwise::dropout_apply(x.view(), out.storage(), keep, key)?;
    Ok(out)
}
