//! Optimizer step in backward: each parameter is updated the moment its gradient is
//! complete (a post-accumulate-grad hook), and that gradient is freed at once — so the
//! gradients of all parameters never exist together. PyTorch offers this only by hand.
//!
//! Same result as `backward(); step(); zero_grad()` for optimizers whose update of one
//! parameter reads only that parameter's gradient and state (SGD, Adam, AdamW). Not with
//! global-norm clipping or gradient accumulation, which need every gradient before any step.

use std::sync::{Arc, Mutex, Weak};

use crate::error::{Error, Result};
use crate::optim::Optimizer;

/// The installed strategy: owns the optimizer; the hooks hold only weak references, so
/// dropping this handle turns them into no-ops.
pub struct StepInBackward<O: Optimizer + Send + 'static> {
    optimizer: Arc<Mutex<O>>,
}

impl<O: Optimizer + Send + 'static> StepInBackward<O> {
    /// Registers one hook per parameter of `optimizer`.
    pub fn install(optimizer: O) -> Result<Self> {
        let params = optimizer.params().to_vec();
        let optimizer = Arc::new(Mutex::new(optimizer));
        for (index, p) in params.iter().enumerate() {
            let weak: Weak<Mutex<O>> = Arc::downgrade(&optimizer);
            p.register_post_accumulate_grad_hook(move |leaf| {
                let Some(opt) = weak.upgrade() else {
                    return Ok(());
                };
                let mut opt = opt
                    .lock()
                    .map_err(|_| Error::autograd("the optimizer's lock was poisoned by a panic"))?;
                opt.step_param(index)?;
                leaf.set_grad(None)
            })?;
        }
        Ok(StepInBackward { optimizer })
    }

    /// Runs `f` with the optimizer (to change its learning rate, read its state...).
    pub fn with_optimizer<R>(&self, f: impl FnOnce(&mut O) -> R) -> Result<R> {
        let mut opt = self
            .optimizer
            .lock()
            .map_err(|_| Error::autograd("the optimizer's lock was poisoned by a panic"))?;
        Ok(f(&mut opt))
    }
}
