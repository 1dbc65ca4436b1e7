//! Optimizer step in backward: each parameter is updated the moment its gradient is
//! complete (a post-accumulate-grad hook), and that gradient is freed at once — so the
//! gradients of all parameters never exist together. PyTorch offers this only by hand.
//!
//! Same result as `backward(); step(); zero_grad()` for optimizers whose update of one
//! parameter reads only that parameter's gradient and state (SGD, Adam, AdamW). Not with
//! global-norm clipping or gradient accumulation, which need every gradient before any step.
//!
//! `install_fused` goes one gradient further where the optimizer's step is linear in the
//! gradient (`Optimizer::gradient_free`: SGD with plain momentum): a weight gradient that an
//! op offers as a product (a linear layer's gᵀ·x) is never made. Its GEMM writes into the
//! momentum buffer (buf ← μ·buf + gᵀ·x), and once the weight has all its contributions of
//! the backward, p ← p − lr·buf. A weight used by several ops adds each product into the
//! buffer (beta = 1) and steps once at the end; any other gradient of it arrives as `.grad`
//! and is added into the buffer before that step. Other optimizers get `install`.

use std::sync::{Arc, Mutex, Weak};

use crate::autograd::{GradProduct, GradSink, backward_id};
use crate::base::{Error, Result};
use crate::optim::Optimizer;
use crate::tensor::Tensor;

/// Which step in backward runs, for logs: `Display` says it in words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InBackwardPath {
    /// Gradient products go straight into the optimizer's state: no weight gradient is made.
    /// `why` names what allows it ("SGD momentum").
    Fused { why: &'static str },
    /// One hook per parameter steps it from its `.grad` and frees it; `optimizer` is its name.
    Hooks { optimizer: &'static str },
}

impl InBackwardPath {
    pub fn is_fused(&self) -> bool {
        matches!(self, InBackwardPath::Fused { .. })
    }
}

impl std::fmt::Display for InBackwardPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InBackwardPath::Fused { why } => {
                write!(f, "fused into the weight-gradient GEMMs ({why})")
            }
            InBackwardPath::Hooks { optimizer } => write!(f, "per-parameter hooks ({optimizer})"),
        }
    }
}

/// The installed strategy: owns the optimizer; the hooks hold only weak references, so
/// dropping this handle turns them into no-ops (and removes the fused step's sinks).
pub struct StepInBackward<O: Optimizer + Send + 'static> {
    optimizer: Arc<Mutex<O>>,
    /// Parameters carrying a gradient sink of this strategy (empty unless fused).
    sunk: Vec<Tensor>,
    path: InBackwardPath,
}

impl<O: Optimizer + Send + 'static> StepInBackward<O> {
    /// Registers one hook per parameter of `optimizer`.
    pub fn install(optimizer: O) -> Result<Self> {
        let path = InBackwardPath::Hooks {
            optimizer: optimizer.name(),
        };
        let params = optimizer.params().to_vec();
        let optimizer = Arc::new(Mutex::new(optimizer));
        for (index, p) in params.iter().enumerate() {
            let weak: Weak<Mutex<O>> = Arc::downgrade(&optimizer);
            p.register_post_accumulate_grad_hook(move |leaf| {
                let Some(opt) = weak.upgrade() else {
                    return Ok(());
                };
                let mut opt = lock(&opt)?;
                opt.step_param(index)?;
                leaf.set_grad(None)
            })?;
        }
        Ok(StepInBackward {
            optimizer,
            sunk: Vec::new(),
            path,
        })
    }

    /// Which of the two paths was installed.
    pub fn path(&self) -> &InBackwardPath {
        &self.path
    }

    /// Runs `f` with the optimizer (to change its learning rate, read its state...).
    pub fn with_optimizer<R>(&self, f: impl FnOnce(&mut O) -> R) -> Result<R> {
        let mut opt = lock(&self.optimizer)?;
        Ok(f(&mut opt))
    }

    /// The gradient-free step in backward (see the module doc): the backward peak holds no
    /// weight gradient at all. Needs an optimizer whose step is linear in the gradient
    /// (`Optimizer::gradient_free`; for SGD: momentum > 0, no dampening, Nesterov or weight
    /// decay); otherwise this is `install`. Every parameter gets a sink: one that is never
    /// offered a product (a bias) takes the ordinary per-parameter step, as `install`.
    pub fn install_fused(optimizer: O) -> Result<Self> {
        let Some(why) = optimizer.gradient_free() else {
            return Self::install(optimizer);
        };
        let params = optimizer.params().to_vec();
        let optimizer = Arc::new(Mutex::new(optimizer));
        for (index, p) in params.iter().enumerate() {
            let sink = ProductSink {
                optimizer: Arc::downgrade(&optimizer),
                index,
                pending: Mutex::new(None),
            };
            p.set_grad_sink(Some(Arc::new(sink)))?;
        }
        Ok(StepInBackward {
            optimizer,
            sunk: params,
            path: InBackwardPath::Fused { why },
        })
    }
}

impl<O: Optimizer + Send + 'static> Drop for StepInBackward<O> {
    fn drop(&mut self) {
        for p in &self.sunk {
            // Removing a sink cannot fail (only setting one checks the tensor).
            let _ = p.set_grad_sink(None);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| Error::autograd("the optimizer's lock was poisoned by a panic"))
}

/// Parameter `index`'s sink: gradient products go into the optimizer's state (SGD's momentum
/// buffer); the step is applied when the parameter has all its contributions of the backward.
struct ProductSink<O> {
    optimizer: Weak<Mutex<O>>,
    index: usize,
    /// The backward whose contributions are in the buffer but not yet applied.
    pending: Mutex<Option<u64>>,
}

impl<O> ProductSink<O> {
    fn pending(&self) -> std::sync::MutexGuard<'_, Option<u64>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<O: Optimizer + Send + 'static> GradSink for ProductSink<O> {
    fn consume_product(&self, _param: &Tensor, product: &GradProduct<'_>) -> Result<bool> {
        let Some(opt) = self.optimizer.upgrade() else {
            return Ok(false);
        };
        let mut opt = lock(&opt)?;
        let id = backward_id();
        let mut pending = self.pending();
        // The first contribution of this backward decays the buffer (beta = μ); later ones add.
        let first = *pending != Some(id);
        let consumed = opt.accumulate_product(self.index, product, first)?;
        if consumed {
            *pending = Some(id);
        }
        Ok(consumed)
    }

    fn finish(&self, param: &Tensor) -> Result<()> {
        let Some(opt) = self.optimizer.upgrade() else {
            return Ok(());
        };
        let mut opt = lock(&opt)?;
        let fused = self.pending().take() == Some(backward_id());
        match (fused, param.grad()) {
            // Only ordinary gradients: the ordinary step, as `install`.
            (false, Some(_)) => opt.step_param(self.index)?,
            (false, None) => return Ok(()),
            (true, Some(g)) => {
                opt.accumulate_gradient(self.index, &g)?;
                opt.apply_accumulated(self.index)?;
            }
            (true, None) => opt.apply_accumulated(self.index)?,
        }
        param.set_grad(None)
    }
}
