//! Per-tensor autograd state: `requires_grad` (leaves), `grad_fn` (non-leaves), the `.grad`
//! slot, retain_grad, hooks, and an optional gradient sink (a leaf whose gradient products
//! are consumed by an optimizer as they are produced, so no `.grad` is ever made for them).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::node::Node;
use super::{Tensor, TensorImpl};
use crate::base::Layout;
use crate::base::{Error, Result};

/// Runs on a tensor's gradient during backward; may return a replacement.
pub type TensorHook = Box<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;
/// Runs on a leaf after its gradient was accumulated into `.grad` (the leaf is passed).
pub type PostAccumulateHook = Box<dyn FnMut(&Tensor) -> Result<()> + Send>;

/// How the two factors of a `GradProduct` multiply into the gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProductForm {
    /// dW = aᵀ·b, with a: (N, m), b: (N, n): the weight of y = x·Wᵀ (a = g, b = x), or of
    /// y = x·W (a = x, b = g).
    TransposeLeft,
    /// dW = a·bᵀ, with a: (m, N), b: (n, N): the left factor of y = W·x (a = g, b = x).
    TransposeRight,
}

/// A leaf's gradient contribution offered as two factors that are not yet multiplied, so a
/// consumer can fold the product into a GEMM of its own choosing (one with beta = 1 into an
/// optimizer buffer, say) instead of materialising it.
#[derive(Clone, Copy, Debug)]
pub struct GradProduct<'a> {
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub form: ProductForm,
}

impl GradProduct<'_> {
    /// The shape of the gradient the product stands for; None when the factors are not 2-D
    /// or their shared (summed) dimension differs.
    pub fn shape(&self) -> Option<[usize; 2]> {
        let (a, b) = (self.a.shape(), self.b.shape());
        if a.len() != 2 || b.len() != 2 {
            return None;
        }
        match self.form {
            ProductForm::TransposeLeft => (a[0] == b[0]).then_some([a[1], b[1]]),
            ProductForm::TransposeRight => (a[1] == b[1]).then_some([a[0], b[0]]),
        }
    }

    /// The GEMM operands (lhs, rhs) with lhs·rhs = the gradient; transposes are views.
    pub fn operands(&self) -> Result<(Tensor, Tensor)> {
        if self.shape().is_none() {
            return Err(Error::shape(
                "GradProduct",
                format!(
                    "factors {:?} and {:?} do not form a {:?} product",
                    self.a.shape(),
                    self.b.shape(),
                    self.form
                ),
            ));
        }
        let t = |x: &Tensor| -> Result<Tensor> { Ok(x.with_layout(transposed(x.layout())?)) };
        Ok(match self.form {
            ProductForm::TransposeLeft => (t(self.a)?, self.b.clone()),
            ProductForm::TransposeRight => (self.a.clone(), t(self.b)?),
        })
    }
}

fn transposed(l: &Layout) -> Result<Layout> {
    l.permute(&[1, 0])
}

/// Takes a leaf's gradient contributions in a factored form instead of a `.grad`: an op
/// whose gradient for the leaf is a product of two tensors it already holds offers the
/// factors, and the sink may apply them directly (e.g. one GEMM into an optimizer's buffer).
pub trait GradSink: Send + Sync {
    /// Offered a gradient contribution for `param` as a product of two factors. True:
    /// consumed, the op produces no gradient for `param`. False: the op computes the
    /// gradient as usual.
    fn consume_product(&self, param: &Tensor, product: &GradProduct<'_>) -> Result<bool>;
    /// Runs when `param` has received every contribution of the current backward (after
    /// any ordinary gradient was accumulated into `.grad` and its post-accumulate hooks ran).
    fn finish(&self, param: &Tensor) -> Result<()>;
}

thread_local! {
    /// Set while a backward runs whose gradients must not be consumed by sinks (one that
    /// returns gradients, or records them for a second derivative).
    static SINKS_OFF: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Turns gradient sinks off on this thread until the guard drops.
pub(crate) struct SinksOff(bool);

impl SinksOff {
    pub(crate) fn start() -> SinksOff {
        SinksOff(SINKS_OFF.with(|s| s.replace(true)))
    }
}

impl Drop for SinksOff {
    fn drop(&mut self) {
        SINKS_OFF.with(|s| s.set(self.0));
    }
}

pub(crate) fn sinks_off() -> bool {
    SINKS_OFF.with(std::cell::Cell::get)
}

#[derive(Default)]
pub struct AutogradMeta {
    pub(crate) grad_fn: Option<Arc<Node>>,
    pub(crate) requires_grad: AtomicBool,
    pub(crate) grad: Mutex<Option<Tensor>>,
    pub(crate) retains_grad: AtomicBool,
    pub(crate) hooks: Mutex<Vec<TensorHook>>,
    pub(crate) post_accumulate_hooks: Mutex<Vec<PostAccumulateHook>>,
    pub(crate) grad_sink: Mutex<Option<Arc<dyn GradSink>>>,
    /// The leaf tensor itself, for post-accumulate hooks (weak: the leaf owns this meta).
    pub(crate) owner: OnceLock<Weak<TensorImpl>>,
}

impl AutogradMeta {
    pub(crate) fn with_grad_fn(node: Arc<Node>) -> AutogradMeta {
        AutogradMeta {
            grad_fn: Some(node),
            ..Default::default()
        }
    }

    pub(crate) fn requires_grad(&self) -> bool {
        self.grad_fn.is_some() || self.requires_grad.load(Ordering::Relaxed)
    }

    pub(crate) fn grad_slot(&self) -> std::sync::MutexGuard<'_, Option<Tensor>> {
        self.grad.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies the tensor hooks in registration order.
    pub(crate) fn run_hooks(&self, grad: Tensor) -> Result<Tensor> {
        run_hooks(&self.hooks, grad)
    }

    pub(crate) fn grad_sink(&self) -> Option<Arc<dyn GradSink>> {
        self.grad_sink
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether tensor hooks are registered (they must see every gradient, so a sink that
    /// would bypass them is not used).
    pub(crate) fn has_hooks(&self) -> bool {
        !self
            .hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    pub(crate) fn owner(&self) -> Option<Tensor> {
        self.owner.get().and_then(|w| w.upgrade()).map(Tensor)
    }
}

/// Applies `hooks` to `grad` in registration order; a hook may return a replacement.
pub(crate) fn run_hooks(hooks: &Mutex<Vec<TensorHook>>, mut grad: Tensor) -> Result<Tensor> {
    let hooks = hooks.lock().unwrap_or_else(|e| e.into_inner());
    for h in hooks.iter() {
        if let Some(g) = h(&grad)? {
            grad = g;
        }
    }
    Ok(grad)
}
