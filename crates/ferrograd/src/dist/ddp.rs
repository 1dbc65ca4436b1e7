//! `Ddp`: data-parallel training around any `Module`, as PyTorch's DistributedDataParallel.
//!
//! - construction broadcasts every parameter from rank 0 (so replicas start equal) and
//!   buckets the trainable ones (`buckets.rs`: reverse parameter order, 1 MiB then 25 MiB,
//!   one dtype per bucket);
//! - each `.grad` is a view into its bucket's flat buffer (`gradient_as_bucket_view`, on by
//!   default): the forward binds the views, backward accumulates into them in place, so no
//!   second copy of the gradients exists and the buckets' bytes count as `gradient` (off,
//!   gradients are copied into the bucket and back: twice the gradient bytes);
//! - a post-accumulate-grad hook on every parameter marks it ready; once a bucket's members
//!   are all ready, it is averaged across ranks at once (buckets strictly in index order, the
//!   same on every rank), while backward goes on with earlier layers;
//! - after the first synchronised backward the buckets are rebuilt from the order in which
//!   gradients arrived (rank 0's order, broadcast, so every rank agrees);
//! - `no_sync` (or `GradSync::set_require_sync(false)`) lets gradients accumulate locally;
//!   the first backward outside it reduces the sum;
//! - a parameter that took no part in the loss is an error naming it (at `finish`, or at the
//!   next forward), not a hang.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::GradSync;
use super::buckets::{
    Bucket, BucketItem, DEFAULT_BUCKET_BYTES_CAP, DEFAULT_FIRST_BUCKET_BYTES, initial_assignment,
    rebuilt_assignment,
};
use super::group::{ProcessGroup, ReduceOp};
use crate::autograd::no_grad;
use crate::base::{Error, Result};
use crate::nn::{Module, Recompute};
use crate::tensor::{DType, Tensor};

/// DDP's knobs; `Default` is PyTorch's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DdpConfig {
    /// The cap of every bucket but the first (PyTorch: bucket_cap_mb = 25).
    pub bucket_cap_bytes: usize,
    /// The cap of the first bucket (PyTorch: 1 MiB).
    pub first_bucket_bytes: usize,
    /// Each `.grad` is a view into its bucket (true, the default here; PyTorch's default is
    /// false). False keeps gradients in tensors of their own and copies them into the
    /// bucket and back around the reduction: a second copy of every gradient.
    pub gradient_as_bucket_view: bool,
}

impl Default for DdpConfig {
    fn default() -> Self {
        DdpConfig {
            bucket_cap_bytes: DEFAULT_BUCKET_BYTES_CAP,
            first_bucket_bytes: DEFAULT_FIRST_BUCKET_BYTES,
            gradient_as_bucket_view: true,
        }
    }
}

/// A module whose gradients are averaged over a process group.
pub struct Ddp<M: Module> {
    module: M,
    reducer: Reducer,
}

/// The part of DDP that does the work, apart from the module: buckets, hooks, reductions
/// (PyTorch's name for it). Call `prepare_forward` before each training forward.
pub struct Reducer {
    state: Arc<Mutex<State>>,
}

/// Everything the hooks and the forward share.
struct State {
    group: Arc<dyn ProcessGroup>,
    names: Vec<String>,
    /// The trainable parameters, in the module's order.
    params: Vec<Tensor>,
    items: Vec<BucketItem>,
    caps: [usize; 2],
    as_views: bool,
    buckets: Vec<Bucket>,
    /// Parameter → (bucket, position in it).
    slot_of: Vec<(usize, usize)>,
    require_sync: bool,
    /// A synchronised backward is under way: its counters below are live.
    armed: bool,
    /// Members of each bucket not ready yet in this backward.
    pending: Vec<usize>,
    ready: Vec<bool>,
    /// The next bucket to reduce (buckets go strictly in order).
    next_bucket: usize,
    /// Gradient arrival order of the first synchronised backward (until the rebuild).
    arrival: Vec<usize>,
    rebuilt: bool,
}

impl Reducer {
    /// Broadcasts `module`'s parameters from rank 0, buckets the trainable ones and hooks
    /// them. The module stays the caller's (`Ddp` owns one; a training job may keep its own).
    pub fn new(
        module: &dyn Module,
        group: Arc<dyn ProcessGroup>,
        cfg: DdpConfig,
    ) -> Result<Reducer> {
        if cfg.bucket_cap_bytes == 0 || cfg.first_bucket_bytes == 0 {
            return Err(Error::invalid(
                "DDP",
                "bucket caps must be above zero bytes",
            ));
        }
        broadcast_parameters(module, &*group)?;
        let (names, params): (Vec<String>, Vec<Tensor>) = module
            .named_parameters()
            .into_iter()
            .filter(|(_, p)| p.requires_grad())
            .unzip();
        if params.is_empty() {
            return Err(Error::invalid(
                "DDP",
                "the module has no parameter that requires grad",
            ));
        }
        let items: Vec<BucketItem> = params.iter().map(BucketItem::of).collect();
        let caps = [cfg.first_bucket_bytes, cfg.bucket_cap_bytes];
        let assignment = initial_assignment(&items, caps)?;
        let mut state = State {
            group,
            names,
            params,
            items,
            caps,
            as_views: cfg.gradient_as_bucket_view,
            buckets: Vec::new(),
            slot_of: Vec::new(),
            require_sync: true,
            armed: false,
            pending: Vec::new(),
            ready: Vec::new(),
            next_bucket: 0,
            arrival: Vec::new(),
            rebuilt: false,
        };
        state.install_buckets(assignment)?;
        let state = Arc::new(Mutex::new(state));
        install_hooks(&state)?;
        Ok(Reducer { state })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Call before each training forward: reports a synchronised backward that left buckets
    /// unreduced, rebuilds the buckets once, binds the gradient views and arms the counters.
    pub fn prepare_forward(&self) -> Result<()> {
        self.lock().prepare()
    }

    /// Gradients accumulate locally (no reduction) until the guard is dropped; the first
    /// backward after it reduces the accumulated sum. Run the forward inside it too.
    pub fn no_sync(&self) -> NoSync<'_> {
        let mut st = self.lock();
        let before = st.require_sync;
        st.require_sync = false;
        NoSync {
            state: &self.state,
            before,
        }
    }

    /// The handle a `Trainer` uses to switch synchronisation per micro-batch and to check
    /// that every gradient was reduced.
    pub fn grad_sync(&self) -> Arc<dyn GradSync> {
        Arc::new(DdpSync(Arc::clone(&self.state)))
    }

    /// Checks that the last synchronised backward reduced every bucket, naming the
    /// parameters that got no gradient otherwise; rebuilds the buckets after the first one.
    pub fn finish(&self) -> Result<()> {
        self.lock().finish()
    }

    /// The buckets as parameter names, in reduction order.
    pub fn bucket_names(&self) -> Vec<Vec<String>> {
        let st = self.lock();
        st.buckets
            .iter()
            .map(|b| b.members.iter().map(|&m| st.names[m].clone()).collect())
            .collect()
    }

    /// Bytes held by the buckets (the gradients' only storage).
    pub fn bucket_bytes(&self) -> usize {
        self.lock().buckets.iter().map(Bucket::nbytes).sum()
    }

    /// Whether the buckets were rebuilt from the observed gradient order.
    pub fn buckets_rebuilt(&self) -> bool {
        self.lock().rebuilt
    }
}

impl<M: Module> Ddp<M> {
    /// Wraps `module` with PyTorch's defaults.
    pub fn new(module: M, group: Arc<dyn ProcessGroup>) -> Result<Ddp<M>> {
        Ddp::with_config(module, group, DdpConfig::default())
    }

    pub fn with_config(module: M, group: Arc<dyn ProcessGroup>, cfg: DdpConfig) -> Result<Ddp<M>> {
        let reducer = Reducer::new(&module, group, cfg)?;
        Ok(Ddp { module, reducer })
    }

    pub fn module(&self) -> &M {
        &self.module
    }

    pub fn module_mut(&mut self) -> &mut M {
        &mut self.module
    }

    pub fn into_inner(self) -> M {
        self.module
    }

    /// The bucketing and reduction state (buckets, no_sync, the Trainer's handle).
    pub fn reducer(&self) -> &Reducer {
        &self.reducer
    }

    /// Runs `f` on the wrapped module as a forward of DDP: for a model whose training forward
    /// is not `Module::forward` (`Gpt::forward_loss`).
    pub fn forward_with<R>(&self, f: impl FnOnce(&M) -> Result<R>) -> Result<R> {
        self.reducer.prepare_forward()?;
        f(&self.module)
    }

    /// See `Reducer::no_sync`.
    pub fn no_sync(&self) -> NoSync<'_> {
        self.reducer.no_sync()
    }

    /// See `Reducer::grad_sync`.
    pub fn grad_sync(&self) -> Arc<dyn GradSync> {
        self.reducer.grad_sync()
    }

    /// See `Reducer::finish`.
    pub fn finish(&self) -> Result<()> {
        self.reducer.finish()
    }

    pub fn bucket_names(&self) -> Vec<Vec<String>> {
        self.reducer.bucket_names()
    }

    pub fn bucket_bytes(&self) -> usize {
        self.reducer.bucket_bytes()
    }

    pub fn buckets_rebuilt(&self) -> bool {
        self.reducer.buckets_rebuilt()
    }
}

impl<M: Module> Module for Ddp<M> {
    /// x: whatever the wrapped module takes. Binds the gradient views and, when gradients
    /// will be synchronised, arms the bucket counters for the coming backward.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.reducer.prepare_forward()?;
        self.module.forward(x)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.module.named_parameters()
    }

    fn train(&mut self, mode: bool) {
        self.module.train(mode);
    }

    fn set_recompute_policy(&mut self, policy: Recompute) -> Result<()> {
        self.module.set_recompute_policy(policy)
    }
}

/// Restores synchronisation when dropped (see `Ddp::no_sync`).
pub struct NoSync<'a> {
    state: &'a Arc<Mutex<State>>,
    before: bool,
}

impl Drop for NoSync<'_> {
    fn drop(&mut self) {
        lock(self.state).require_sync = self.before;
    }
}

struct DdpSync(Arc<Mutex<State>>);

impl GradSync for DdpSync {
    fn set_require_sync(&self, on: bool) {
        lock(&self.0).require_sync = on;
    }

    fn finish(&self) -> Result<()> {
        lock(&self.0).finish()
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // The state stays consistent between statements; a panic elsewhere must not hide it.
    state.lock().unwrap_or_else(|e| e.into_inner())
}

/// Every parameter (trainable or not) takes rank 0's values; shapes and dtypes that differ
/// between ranks are an error of the broadcast.
fn broadcast_parameters(module: &dyn Module, group: &dyn ProcessGroup) -> Result<()> {
    for (name, p) in module.named_parameters() {
        group.broadcast(&p, 0).map_err(|e| {
            Error::invalid(
                "DDP",
                format!("broadcasting parameter {name} from rank 0: {e}"),
            )
        })?;
    }
    Ok(())
}

/// One post-accumulate-grad hook per trainable parameter. Hooks hold the state weakly: a
/// dropped `Ddp` leaves inert hooks behind, not a cycle that keeps it alive.
fn install_hooks(state: &Arc<Mutex<State>>) -> Result<()> {
    let params = lock(state).params.clone();
    for (i, p) in params.iter().enumerate() {
        let weak: Weak<Mutex<State>> = Arc::downgrade(state);
        p.register_post_accumulate_grad_hook(move |leaf| match weak.upgrade() {
            Some(st) => lock(&st).grad_ready(i, leaf),
            None => Ok(()),
        })?;
    }
    Ok(())
}

impl State {
    fn install_buckets(&mut self, assignment: Vec<Vec<usize>>) -> Result<()> {
        let mut buckets = Vec::with_capacity(assignment.len());
        let mut slot_of = vec![(0, 0); self.params.len()];
        for (b, members) in assignment.into_iter().enumerate() {
            for (k, &m) in members.iter().enumerate() {
                slot_of[m] = (b, k);
            }
            buckets.push(Bucket::new(&self.params, members)?);
        }
        // Gradients living in the old buckets move into the new ones.
        let old = std::mem::replace(&mut self.buckets, buckets);
        self.slot_of = slot_of;
        for i in 0..self.params.len() {
            if self.as_views && self.params[i].grad().is_some() {
                self.bind_view(i)?;
            }
        }
        drop(old);
        Ok(())
    }

    fn view_of(&self, i: usize) -> Result<Tensor> {
        let (b, k) = self.slot_of[i];
        self.buckets[b].view(k, &self.params[i])
    }

    /// Whether `g` is parameter i's slice of its bucket.
    fn is_bucket_view(&self, i: usize, g: &Tensor) -> bool {
        let (b, k) = self.slot_of[i];
        let bucket = &self.buckets[b];
        g.shares_storage(&bucket.flat)
            && g.layout().offset() == bucket.offsets[k]
            && g.is_contiguous()
    }

    /// Makes parameter i's `.grad` its bucket view: zeroed when it had none, holding the
    /// old values when it had another tensor.
    fn bind_view(&self, i: usize) -> Result<()> {
        let _g = no_grad();
        let p = &self.params[i];
        let current = p.grad();
        if let Some(g) = &current
            && self.is_bucket_view(i, g)
        {
            return Ok(());
        }
        let view = self.view_of(i)?;
        match current {
            Some(g) => view.copy_(&g.detach())?,
            None => view.zero_()?,
        }
        p.set_grad(Some(view))
    }

    /// Before a forward: report an unfinished synchronised backward, rebuild once, bind the
    /// views, and arm the counters if this step synchronises.
    fn prepare(&mut self) -> Result<()> {
        if self.armed && self.next_bucket < self.buckets.len() && self.ready.iter().any(|&r| r) {
            return Err(self.unused_error());
        }
        self.maybe_rebuild()?;
        if self.as_views {
            self.bind_all_views()?;
        }
        if self.require_sync {
            self.arm();
        }
        Ok(())
    }

    fn bind_all_views(&self) -> Result<()> {
        for b in &self.buckets {
            let empty = b.members.iter().all(|&m| self.params[m].grad().is_none());
            if empty && self.require_sync {
                // A whole bucket without gradients (after zero_grad(set_to_none)) before a
                // synchronised backward: each member's first gradient is copied into its view
                // by the hook, so zeroing the bucket and adding into it would be two wasted
                // passes over the gradient bytes.
                continue;
            }
            if empty {
                // no_sync: the gradients accumulate straight into the zeroed views.
                let _g = no_grad();
                b.flat.zero_()?;
            }
            b.members.iter().try_for_each(|&m| self.bind_view(m))?;
        }
        Ok(())
    }

    fn arm(&mut self) {
        self.pending = self.buckets.iter().map(|b| b.members.len()).collect();
        self.ready = vec![false; self.params.len()];
        self.next_bucket = 0;
        self.armed = true;
    }

    /// The hook: parameter i's gradient for this backward is complete.
    fn grad_ready(&mut self, i: usize, leaf: &Tensor) -> Result<()> {
        if !self.require_sync {
            return Ok(());
        }
        if !self.armed {
            // A backward whose forward did not go through the wrapper.
            self.arm();
        }
        if std::mem::replace(&mut self.ready[i], true) {
            return Err(Error::invalid(
                "DDP",
                format!(
                    "parameter {} got its gradient twice in one synchronised backward; accumulate inside no_sync()",
                    self.names[i]
                ),
            ));
        }
        if !self.rebuilt {
            self.arrival.push(i);
        }
        self.put_in_bucket(i, leaf)?;
        self.pending[self.slot_of[i].0] -= 1;
        self.launch_ready()
    }

    /// Puts parameter i's finished gradient in its bucket: as the view itself, or copied.
    fn put_in_bucket(&self, i: usize, leaf: &Tensor) -> Result<()> {
        let Some(g) = leaf.grad() else {
            return Ok(());
        };
        if self.as_views {
            if !self.is_bucket_view(i, &g) {
                self.bind_view(i)?;
            }
            return Ok(());
        }
        let _g = no_grad();
        self.view_of(i)?.copy_(&g.detach())
    }

    /// Averages the complete buckets at the front of the queue, in index order.
    fn launch_ready(&mut self) -> Result<()> {
        // The average over one rank is the sum, which NCCL leaves in place untouched; its
        // average would still rescale every gradient byte by 1.
        let op = if self.group.world_size() == 1 {
            ReduceOp::Sum
        } else {
            ReduceOp::Avg
        };
        while self.next_bucket < self.buckets.len() && self.pending[self.next_bucket] == 0 {
            let b = &self.buckets[self.next_bucket];
            if self.as_views {
                // The gradients are the bucket: nothing reads them before `finish`.
                self.group.all_reduce_launch(&b.flat, op)?;
            } else {
                self.group.all_reduce(&b.flat, op)?;
                self.copy_back(self.next_bucket)?;
            }
            self.next_bucket += 1;
        }
        if self.next_bucket == self.buckets.len() {
            self.armed = false;
        }
        Ok(())
    }

    /// Without bucket views: the averaged values go back into each member's own `.grad`.
    fn copy_back(&self, b: usize) -> Result<()> {
        let _g = no_grad();
        for (k, &m) in self.buckets[b].members.iter().enumerate() {
            if let Some(g) = self.params[m].grad() {
                g.copy_(&self.buckets[b].view(k, &self.params[m])?)?;
            }
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        if !self.require_sync {
            return Ok(());
        }
        if self.armed {
            return Err(self.unused_error());
        }
        self.group.wait_launched()?;
        self.maybe_rebuild()
    }

    fn unused_error(&self) -> Error {
        let unused: Vec<&str> = (0..self.params.len())
            .filter(|&i| !self.ready.get(i).copied().unwrap_or(false))
            .map(|i| self.names[i].as_str())
            .collect();
        Error::invalid(
            "DDP",
            format!(
                "these parameters received no gradient in the last synchronised backward, so their buckets were never reduced: {}; make every parameter take part in the loss, or freeze the unused ones (requires_grad_(false)) before wrapping the module",
                unused.join(", ")
            ),
        )
    }

    /// After the first synchronised backward: buckets by the order gradients arrived in,
    /// rank 0's order on every rank.
    fn maybe_rebuild(&mut self) -> Result<()> {
        if self.rebuilt || self.arrival.len() != self.params.len() {
            return Ok(());
        }
        let order = self.agreed_arrival()?;
        let assignment = rebuilt_assignment(&self.items, &order, self.caps)?;
        self.rebuilt = true;
        self.arrival.clear();
        self.install_buckets(assignment)
    }

    /// Rank 0's arrival order, broadcast (indices are exact in f64).
    fn agreed_arrival(&self) -> Result<Vec<usize>> {
        let n = self.arrival.len();
        let values: Vec<f64> = self.arrival.iter().map(|&i| i as f64).collect();
        let t = Tensor::from_vec_as(values, &[n], DType::F64, self.params[0].device())?;
        self.group.broadcast(&t, 0)?;
        let order: Vec<usize> = t.to_vec::<f64>()?.into_iter().map(|v| v as usize).collect();
        Ok(order)
    }
}
