//! Column sums of a gradient, handed from the op that wrote the gradient to the op that
//! needs them. A pre-norm block's residual branch ends in a biased Linear (attention's and the
//! MLP's projections); that Linear's bias gradient is Σ_rows of the gradient its output gets,
//! which the next layer norm's backward writes (f32 rows, half branch). The norm's kernel sums
//! the columns of that gradient as it writes it and offers the sums here; the Linear's
//! backward takes them instead of reading the (rows, out) gradient again in a reduction.
//!
//! An offer is taken only for the very buffer it was made for, unchanged (the same storage at
//! the same version, read whole from its start) and in the dtype asked for; anything else
//! sums afresh. One offer is held at a time, in the backward pass's hand-off slot
//! (`autograd::handoff`): the next offer or take drops it, and so does the end of the pass,
//! also when the pass stops on an error before the Linear takes it.

use std::sync::{Arc, Weak};

use crate::autograd::handoff;
use crate::backend::Storage;
use crate::tensor::{DType, Tensor};

/// A gradient buffer as it was when something was computed from it: its storage (not kept
/// alive), that storage's version and the element count read from its start. A tensor is
/// that buffer while it is the same storage, unchanged, read whole and contiguously.
pub(super) struct BufferId {
    of: Weak<Storage>,
    version: u64,
    numel: usize,
}

impl BufferId {
    pub(super) fn of(t: &Tensor) -> BufferId {
        BufferId {
            of: Arc::downgrade(t.storage()),
            version: t.storage().version(),
            numel: t.numel(),
        }
    }

    pub(super) fn is(&self, t: &Tensor) -> bool {
        self.of
            .upgrade()
            .is_some_and(|s| Arc::ptr_eq(&s, t.storage()))
            && t.storage().version() == self.version
            && t.layout().is_contiguous()
            && t.layout().offset() == 0
            && t.numel() == self.numel
    }
}

struct Offer {
    of: BufferId,
    /// Σ_rows of the gradient: one value per column.
    sums: Tensor,
}

/// Offers `sums`, the column sums of `grad` (contiguous (rows, n) from its storage's start).
pub(super) fn offer(grad: &Tensor, sums: Tensor) {
    let offer = Offer {
        of: BufferId::of(grad),
        sums,
    };
    handoff::leave(offer);
}

/// The offer (dropped either way) when it holds the column sums of g2 (rows, n) in `dtype`.
pub(super) fn take(g2: &Tensor, dtype: DType) -> Option<Tensor> {
    let offer = handoff::take::<Offer>()?;
    let n = *g2.shape().last()?;
    let same = offer.of.is(g2) && offer.sums.shape() == [n] && offer.sums.dtype() == dtype;
    same.then_some(offer.sums)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::Device;

    fn grad() -> Tensor {
        Tensor::from_vec(vec![1f32, 2., 3., 4., 5., 6.], &[2, 3], Device::Cpu).unwrap()
    }

    fn sums() -> Tensor {
        Tensor::from_vec(vec![5f32, 7., 9.], &[3], Device::Cpu).unwrap()
    }

    #[test]
    fn an_offer_is_taken_once_for_its_own_buffer() {
        let g = grad();
        offer(&g, sums());
        let got = take(&g.reshape(&[2, 3]).unwrap(), DType::F32).expect("the same buffer");
        assert_eq!(got.to_vec::<f32>().unwrap(), [5., 7., 9.]);
        assert!(take(&g, DType::F32).is_none(), "taken once");
    }

    /// A backward whose function offers sums and then fails, as a pass that runs out of
    /// memory between a layer norm's backward and the Linear's does.
    struct OffersThenFails(std::sync::Arc<std::sync::Mutex<Option<Weak<Storage>>>>);

    impl crate::autograd::CustomFunction for OffersThenFails {
        fn forward(
            &mut self,
            _: &mut crate::autograd::FunctionCtx,
            inputs: &[Tensor],
        ) -> crate::Result<Tensor> {
            inputs[0].mul_scalar(2.0)
        }

        fn backward(
            &mut self,
            _: &crate::autograd::FunctionCtx,
            g: &Tensor,
        ) -> crate::Result<Vec<Option<Tensor>>> {
            let s = sums();
            *self.0.lock().unwrap() = Some(Arc::downgrade(s.storage()));
            offer(g, s);
            Err(crate::base::Error::invalid("test", "fails after its offer"))
        }
    }

    #[test]
    fn an_offer_goes_with_a_backward_that_fails_before_it_is_taken() {
        let held = std::sync::Arc::new(std::sync::Mutex::new(None));
        let x = grad().requires_grad_(true).unwrap();
        let y = crate::autograd::apply_custom(OffersThenFails(held.clone()), &[x]).unwrap();
        assert!(y.sum_all().unwrap().backward().is_err());
        let sums = held.lock().unwrap().clone().expect("the backward ran");
        assert!(
            sums.upgrade().is_none(),
            "the offered sums outlived the failed backward"
        );
        assert!(crate::autograd::handoff::is_empty());
    }

    #[test]
    fn another_buffer_a_changed_one_a_part_or_another_dtype_takes_nothing() {
        let g = grad();
        offer(&g, sums());
        assert!(take(&grad(), DType::F32).is_none(), "another buffer");
        offer(&g, sums());
        assert!(take(&g, DType::F64).is_none(), "another dtype");
        offer(&g, sums());
        g.mul_scalar_(2.0).unwrap();
        assert!(take(&g, DType::F32).is_none(), "changed in place");
        let g = grad();
        offer(&g, sums());
        let first_row = g.narrow(0, 0, 1).unwrap();
        assert!(take(&first_row, DType::F32).is_none(), "a part of it");
        offer(&g, sums());
        assert!(
            take(&g.reshape(&[3, 2]).unwrap(), DType::F32).is_none(),
            "other columns"
        );
    }
}
