//! Tensor: an `Arc` over a storage, a layout (shape, strides, offset) and autograd state.
//! Clones and views are cheap; the storage is freed when its last view is dropped.

mod checks;
mod create;
mod generate;
mod meta;
mod node;
mod random;
mod readout;
mod saved;

pub use crate::base::{DType, Device, Layout, broadcast_shape, contiguous_strides, resolve_dim};
pub(crate) use checks::{check_float, check_pair, check_same_device};
pub use create::HostElem;
pub use meta::{AutogradMeta, GradProduct, GradSink, PostAccumulateHook, ProductForm, TensorHook};
pub(crate) use meta::{SinksOff, run_hooks};
pub(crate) use node::InputMeta;
pub use node::{BackwardFn, Edge, Node};
pub(crate) use node::{live_nodes, set_tracking_step, start_tracking, stop_tracking, track};
pub(crate) use random::with_default;
pub use random::{Generator, get_rng_state, manual_seed, set_rng_state};
pub use readout::Readout;
pub use saved::SavedTensor;
pub(crate) use saved::{RunningNode, take_pending as take_pending_saves};

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::backend::{self, HostValues, Storage, View};
use crate::base::{Error, Result};
use crate::memory::Category;

#[derive(Clone)]
pub struct Tensor(pub(crate) Arc<TensorImpl>);

pub struct TensorImpl {
    storage: Arc<Storage>,
    layout: Layout,
    meta: Arc<AutogradMeta>,
}

impl Tensor {
    /// A tensor over a storage with no autograd history.
    pub(crate) fn from_storage(storage: Arc<Storage>, layout: Layout) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            storage,
            layout,
            meta: Arc::new(AutogradMeta::default()),
        }))
    }

    /// True when no other tensor or view shares this tensor's buffer (an op may then reuse
    /// the buffer for its result once it no longer needs the values).
    pub(crate) fn owns_its_storage_alone(&self) -> bool {
        Arc::strong_count(&self.0) == 1 && Arc::strong_count(&self.0.storage) == 1
    }

    /// A new view of this tensor's storage (no autograd history: callers record it).
    pub(crate) fn with_layout(&self, layout: Layout) -> Tensor {
        Tensor::from_storage(Arc::clone(&self.0.storage), layout)
    }

    /// The same data sharing `meta` (history, `.grad`): a saved tensor unpacked with the
    /// autograd identity it was saved with.
    pub(crate) fn with_meta(&self, meta: Arc<AutogradMeta>) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            storage: Arc::clone(&self.0.storage),
            layout: self.0.layout.clone(),
            meta,
        }))
    }

    /// The same data with `node` as its grad_fn.
    pub(crate) fn with_grad_fn(&self, node: Arc<Node>) -> Tensor {
        let meta = Arc::new(AutogradMeta::with_grad_fn(Arc::clone(&node)));
        if let Ok(mut out) = node.output.lock() {
            *out = Arc::downgrade(&meta);
        }
        Tensor(Arc::new(TensorImpl {
            storage: Arc::clone(&self.0.storage),
            layout: self.0.layout.clone(),
            meta,
        }))
    }

    pub fn shape(&self) -> &[usize] {
        self.0.layout.shape()
    }
    pub fn dims(&self) -> usize {
        self.0.layout.rank()
    }
    pub fn numel(&self) -> usize {
        self.0.layout.numel()
    }
    pub fn dtype(&self) -> DType {
        self.0.storage.dtype()
    }
    pub fn device(&self) -> Device {
        self.0.storage.device()
    }
    pub fn layout(&self) -> &Layout {
        &self.0.layout
    }
    pub fn strides(&self) -> &[isize] {
        self.0.layout.strides()
    }
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }
    pub fn storage(&self) -> &Arc<Storage> {
        &self.0.storage
    }
    pub(crate) fn view(&self) -> View<'_> {
        View {
            storage: &self.0.storage,
            layout: &self.0.layout,
        }
    }
    pub(crate) fn meta(&self) -> &Arc<AutogradMeta> {
        &self.0.meta
    }
    /// Bytes of this tensor's elements (a view counts its own elements only).
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype().size_in_bytes()
    }
    /// Whether two tensors share a storage.
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0.storage, &other.0.storage)
    }

    /// The memory category of this tensor's storage (what its bytes count as).
    pub fn category(&self) -> Option<Category> {
        self.0.storage.allocation().category()
    }
    /// Re-labels this tensor's storage (e.g. parameters, optimizer state).
    pub fn set_category(&self, c: Category) {
        self.0.storage.allocation().set_category(c);
    }

    // ---- autograd state -------------------------------------------------------------------

    pub fn requires_grad(&self) -> bool {
        self.0.meta.requires_grad()
    }
    pub fn is_leaf(&self) -> bool {
        self.0.meta.grad_fn.is_none()
    }
    pub fn grad_fn(&self) -> Option<&Arc<Node>> {
        self.0.meta.grad_fn.as_ref()
    }

    /// Sets `requires_grad` on a leaf (builder style: returns the same tensor).
    pub fn requires_grad_(self, requires: bool) -> Result<Tensor> {
        if !self.is_leaf() {
            return Err(Error::autograd(
                "requires_grad can only be changed on leaf tensors; use .detach() to get a leaf",
            ));
        }
        if requires && !self.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: "requires_grad_",
                dtype: self.dtype(),
                hint: "only floating-point tensors can require gradients",
            });
        }
        self.0.meta.requires_grad.store(requires, Ordering::Relaxed);
        let _ = self.0.meta.owner.set(Arc::downgrade(&self.0));
        Ok(self)
    }

    /// The accumulated gradient (`.grad`), if any.
    pub fn grad(&self) -> Option<Tensor> {
        self.0.meta.grad_slot().clone()
    }
    /// Replaces `.grad` (None frees it: zero_grad(set_to_none=True)).
    pub fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        if let Some(g) = &grad {
            if g.shape() != self.shape() {
                return Err(Error::shape(
                    "set_grad",
                    format!(
                        "gradient shape {:?} differs from the tensor's {:?}",
                        g.shape(),
                        self.shape()
                    ),
                ));
            }
            check_pair("set_grad", self, g)?;
            g.set_category(Category::Gradient);
        }
        *self.0.meta.grad_slot() = grad;
        Ok(())
    }
    /// Keep `.grad` for this non-leaf tensor during backward.
    /// Errors on a tensor that does not require grad (it will never have one), as PyTorch.
    pub fn retain_grad(&self) -> Result<()> {
        if !self.requires_grad() {
            return Err(Error::autograd(
                "retain_grad() on a tensor that does not require grad: it will never receive a gradient",
            ));
        }
        self.0.meta.retains_grad.store(true, Ordering::Relaxed);
        Ok(())
    }
    /// Registers a hook on this tensor's gradient; it may return a replacement. On a
    /// non-leaf the hook is kept by its grad_fn, so it runs even if this handle is dropped.
    pub fn register_hook(
        &self,
        hook: impl Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync + 'static,
    ) {
        let h: TensorHook = Box::new(hook);
        let hooks = match self.grad_fn() {
            Some(node) => &node.hooks,
            None => &self.0.meta.hooks,
        };
        hooks.lock().unwrap_or_else(|e| e.into_inner()).push(h);
    }
    /// Registers a hook that runs after this leaf's `.grad` was accumulated in a backward.
    pub fn register_post_accumulate_grad_hook(
        &self,
        hook: impl FnMut(&Tensor) -> Result<()> + Send + 'static,
    ) -> Result<()> {
        if !self.is_leaf() || !self.requires_grad() {
            return Err(Error::autograd(
                "post-accumulate-grad hooks can only be registered on leaf tensors that require grad",
            ));
        }
        let h: PostAccumulateHook = Box::new(hook);
        self.0
            .meta
            .post_accumulate_hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(h);
        Ok(())
    }
    /// Sets (or with None removes) this leaf's gradient sink: ops that can offer their
    /// gradient for it as a product of two factors hand the factors to the sink instead.
    pub fn set_grad_sink(&self, sink: Option<Arc<dyn GradSink>>) -> Result<()> {
        if sink.is_some() && (!self.is_leaf() || !self.requires_grad()) {
            return Err(Error::autograd(
                "a gradient sink can only be set on a leaf tensor that requires grad",
            ));
        }
        *self
            .0
            .meta
            .grad_sink
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = sink;
        Ok(())
    }
    /// The sink that may take this tensor's gradient now: a leaf's, unless tensor hooks
    /// must see the gradient, a `.grad` is already being accumulated into, or the backward
    /// running returns or records its gradients (`autograd::grad`, create_graph).
    pub(crate) fn usable_grad_sink(&self) -> Option<Arc<dyn GradSink>> {
        let meta = &self.0.meta;
        if !self.is_leaf() || meta.has_hooks() || meta.grad_slot().is_some() || meta::sinks_off() {
            return None;
        }
        meta.grad_sink()
    }
    /// The same data without autograd history.
    pub fn detach(&self) -> Tensor {
        self.with_layout(self.0.layout.clone())
    }

    // ---- reading values -------------------------------------------------------------------

    pub(crate) fn to_host(&self) -> Result<HostValues> {
        HOST_READS.with(|n| n.set(n.get() + 1));
        backend::backend(self.device())?.to_host(self.view())
    }

    /// The elements in row-major order, converted to `T`.
    pub fn to_vec<T: HostElem>(&self) -> Result<Vec<T>> {
        Ok(T::from_host(self.to_host()?))
    }

    /// The single value of a one-element tensor.
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(Error::shape(
                "item",
                format!(
                    "item() needs exactly one element, the tensor has shape {:?}",
                    self.shape()
                ),
            ));
        }
        Ok(self.to_vec::<f64>()?[0])
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor(shape={:?}, dtype={}, device={}",
            self.shape(),
            self.dtype(),
            self.device()
        )?;
        if let Some(n) = self.grad_fn() {
            write!(f, ", grad_fn={}", n.name())?;
        } else if self.requires_grad() {
            write!(f, ", requires_grad=true")?;
        }
        if self.numel() <= 16
            && let Ok(v) = self.to_vec::<f64>()
        {
            write!(f, ", values={v:?}")?;
        }
        write!(f, ")")
    }
}

thread_local! {
    static HOST_READS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many times this thread has read tensor values to the host. On a GPU each read waits
/// for the device, and a step that reads cannot be captured as a CUDA graph: a training step
/// should read nothing (its loss is read when a log shows it).
pub fn host_reads() -> u64 {
    HOST_READS.with(|n| n.get())
}
