//! Autocast regions, as PyTorch's `torch.autocast` with the CUDA op policy: while a region is
//! active on this thread, matmul-like ops (`matmul`, `linear`) cast their float inputs to the
//! region's f16/bf16 and produce a half-precision output, and precision-sensitive ops
//! (softmax, log_softmax, layer_norm, cross_entropy, mse_loss, sum, exp, log, pow) cast half
//! inputs to f32. Every other op runs in its inputs' dtype. F64 tensors are never cast,
//! integer tensors neither.
//!
//! Casts go through `Tensor::to_dtype`, so gradients flow back to f32 master weights in f32.
//!
//! Regions nest: each guard restores the previous state when dropped. The state applies to
//! tensors on every device (the CPU too, which makes the policy testable to the byte).
//!
//! Weight-cast cache: inside a region, the half-precision cast of an f32 leaf that requires
//! grad (a parameter) is made once and reused, keyed by the tensor's identity, its storage's
//! version (an in-place update such as an optimizer step makes a new cast) and the dtype. A
//! weight used twice (GPT's tied embedding and head) or in several micro-batches is cast
//! once. The cached tensor is a `to_dtype` graph node that saves nothing, so each graph that
//! uses it can backpropagate through it (no retain_graph needed). The linear-like ops
//! (linear, gelu_linear, mlp_gelu) go around it: they record their node on the f32 parameter
//! and write its gradient in f32 from their half operands (see `ops/autocast.rs`), so no half
//! gradient is cast back. The fused classifier (linear_cross_entropy) does not: it holds its
//! dw from the forward to backward, where f32 would double those bytes at a step's peak, so
//! its one half dw is cast back. The cache lives until the
//! OUTERMOST guard on the thread drops (disabled regions count in the nesting too, as in
//! PyTorch). Cached casts count as `temporary` bytes while only the cache holds them and as
//! `saved_activation` while a graph saves them.
//!
//! The backward engine runs with autocast disabled: backward ops run in the dtypes the
//! forward chose, whether `backward()` is called inside a region or after it.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Weak};

use crate::base::{Error, Layout, Result};
use crate::tensor::{DType, Tensor, TensorImpl};

/// The dtypes an autocast region can run matmul-like ops in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AmpDType {
    F16,
    BF16,
}

impl AmpDType {
    pub fn dtype(self) -> DType {
        match self {
            AmpDType::F16 => DType::F16,
            AmpDType::BF16 => DType::BF16,
        }
    }
}

impl From<AmpDType> for DType {
    fn from(d: AmpDType) -> DType {
        d.dtype()
    }
}

impl TryFrom<DType> for AmpDType {
    type Error = Error;

    fn try_from(d: DType) -> Result<AmpDType> {
        match d {
            DType::F16 => Ok(AmpDType::F16),
            DType::BF16 => Ok(AmpDType::BF16),
            other => Err(Error::invalid(
                "autocast",
                format!(
                    "autocast runs matmul-like ops in f16 or bf16, not {other}; for full precision run without an autocast region"
                ),
            )),
        }
    }
}

/// Cache key: the source tensor, the target dtype, and whether the cast recorded a graph node
/// (a cast made under `no_grad` must not stand in for one that gradients flow through).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct CacheKey {
    source: usize,
    dtype: DType,
    recorded: bool,
}

impl CacheKey {
    fn of(source: &Tensor, dtype: DType, recorded: bool) -> CacheKey {
        CacheKey {
            source: Arc::as_ptr(&source.0) as usize,
            dtype,
            recorded,
        }
    }
}

struct CacheEntry {
    /// Keeps the source's address from being reused by another tensor while the entry lives.
    _source: Weak<TensorImpl>,
    /// The source storage's version when cast.
    version: u64,
    cast: Tensor,
    /// The rows of the cast's storage when it is a zero-padded (rows, k) block of which the
    /// cast is the first rows (see `zero_padded`).
    padded_rows: Option<usize>,
    /// When it was cached: the region's end frees casts in this order (a map's order would
    /// depend on addresses, and with it how the caching allocator's free blocks merge).
    order: u64,
}

thread_local! {
    /// The active region's dtype; None outside regions and in disabled ones.
    static ACTIVE: Cell<Option<DType>> = const { Cell::new(None) };
    /// Live guards (enabled or disabled) on this thread.
    static DEPTH: Cell<usize> = const { Cell::new(0) };
    static CACHE: RefCell<HashMap<CacheKey, CacheEntry>> = RefCell::new(HashMap::new());
    /// Casts cached on this thread so far (each entry's `order`).
    static CACHED: Cell<u64> = const { Cell::new(0) };
}

/// Restores the previous autocast state when dropped; the outermost one also frees the
/// weight-cast cache. Not `Send`: the state it restores belongs to this thread.
#[must_use = "autocast is active only while the guard lives; bind it: let _amp = autocast(AmpDType::BF16);"]
pub struct AutocastGuard {
    previous: Option<DType>,
    _thread: PhantomData<*const ()>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        let _ = ACTIVE.try_with(|a| a.set(self.previous));
        let outermost = DEPTH
            .try_with(|d| {
                let n = d.get().saturating_sub(1);
                d.set(n);
                n == 0
            })
            .unwrap_or(false);
        if outermost {
            clear_cache();
        }
    }
}

fn enter(dtype: Option<DType>) -> AutocastGuard {
    let previous = ACTIVE.with(|a| a.replace(dtype));
    DEPTH.with(|d| d.set(d.get() + 1));
    AutocastGuard {
        previous,
        _thread: PhantomData,
    }
}

/// Runs matmul-like ops in `dtype` and precision-sensitive ops in f32 until the guard drops
/// (`with torch.autocast("cuda", dtype=...)`). Wrap the forward pass and the loss.
pub fn autocast(dtype: AmpDType) -> AutocastGuard {
    enter(Some(dtype.dtype()))
}

/// `autocast` for a dtype known only at run time (e.g. parsed from the command line): an
/// error for anything but F16 and BF16.
pub fn try_autocast(dtype: DType) -> Result<AutocastGuard> {
    Ok(autocast(AmpDType::try_from(dtype)?))
}

/// Turns autocast off until the guard drops (`torch.autocast(..., enabled=False)`), e.g. for
/// a part of the model that must run in f32 inside a region.
pub fn autocast_disabled() -> AutocastGuard {
    enter(None)
}

/// Re-enters a state read earlier with `autocast_dtype()`: a region of that dtype, or a
/// disabled one for None. For code that re-runs a forward later (activation recomputation
/// in backward) and must cast as the original forward did.
pub fn set_autocast(state: Option<DType>) -> Result<AutocastGuard> {
    match state {
        Some(d) => try_autocast(d),
        None => Ok(autocast_disabled()),
    }
}

/// The dtype of the active region on this thread; None when autocast is off.
pub fn autocast_dtype() -> Option<DType> {
    ACTIVE.with(Cell::get)
}

pub fn is_autocast_enabled() -> bool {
    autocast_dtype().is_some()
}

/// Drops every cached cast, oldest first (taken out first: dropping tensors must not run
/// under the borrow).
fn clear_cache() {
    let Ok(old) = CACHE.try_with(|c| std::mem::take(&mut *c.borrow_mut())) else {
        return;
    };
    let mut entries: Vec<CacheEntry> = old.into_values().collect();
    entries.sort_by_key(|e| e.order);
    drop(entries);
}

/// The cast of `source` to `dtype` cached in this thread's region, made with grad mode
/// `recorded`, if the source's storage has not changed since (its version).
pub(crate) fn cached_cast(source: &Tensor, dtype: DType, recorded: bool) -> Option<Tensor> {
    let key = CacheKey::of(source, dtype, recorded);
    let version = source.storage().version();
    CACHE.with(|c| {
        c.borrow()
            .get(&key)
            .filter(|e| e.version == version)
            .map(|e| e.cast.clone())
    })
}

/// Keeps `cast` (of `source` to `dtype`, made with grad mode `recorded`) until the outermost
/// region ends; `padded_rows` when its storage is a zero-padded block of that many rows. A
/// stale entry (older version) is replaced.
pub(crate) fn cache_cast(
    source: &Tensor,
    dtype: DType,
    recorded: bool,
    cast: &Tensor,
    padded_rows: Option<usize>,
) {
    let entry = CacheEntry {
        _source: Arc::downgrade(&source.0),
        version: source.storage().version(),
        cast: cast.clone(),
        padded_rows,
        order: CACHED.with(|n| {
            n.set(n.get() + 1);
            n.get()
        }),
    };
    let key = CacheKey::of(source, dtype, recorded);
    // The replaced entry is dropped outside the borrow.
    let stale = CACHE.with(|c| c.borrow_mut().insert(key, entry));
    drop(stale);
}

/// The zero-padded (rows, k) block behind `w` when `w` (n, k) is a cached cast made as its
/// first n rows (a GEMM at a padded width then reads the cast itself instead of a padded
/// copy), as a new view without history; None otherwise. A cast replaced in the cache since
/// is found no more and gets its copy.
pub(crate) fn zero_padded(w: &Tensor, rows: usize) -> Option<Tensor> {
    CACHE.with(|c| {
        c.borrow()
            .values()
            .find(|e| {
                e.padded_rows == Some(rows)
                    && e.cast.shares_storage(w)
                    && e.cast.layout() == w.layout()
            })
            .map(|e| {
                let k = w.shape()[1];
                e.cast.with_layout(Layout::contiguous(&[rows, k]))
            })
    })
}
