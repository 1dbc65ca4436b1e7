//! ferrograd: a training engine whose first concern is memory.
//!
//! The tour, bottom up. Each module imports only modules above it in this list (a test,
//! tests/layering.rs, reads this list and the crate's `crate::` paths and enforces it):
//!
//! 1. `base` — plain data every layer needs: `Device`, `DType`, `Layout`, memory
//!    `Category`, the `Error` type and the out-of-memory report it carries.
//! 2. `memory` — one allocator per device, the only source of byte counts: PyTorch-style
//!    statistics (`memory_allocated`, `max_memory_allocated`, `memory_reserved`, ...), a
//!    category for every live block that always sums to `memory_allocated`, and the caching
//!    policy for GPUs. It knows no backend: a GPU backend registers its driver memory. Its
//!    recorder keeps a bounded history of allocator events, labelled with the op, module,
//!    phase, step and call site that the layers above push down.
//! 3. `backend` — the narrow contract with devices: storages, and op families passed as
//!    typed data (elementwise, reduce, matmul, rows, loss, index, optim) with `cpu` (the
//!    reference), `cuda` (cuBLAS and NVRTC kernels) and `meta` (shapes and bytes only).
//!    Backends know nothing of autograd.
//! 4. `tensor` — `Tensor` = `Arc` over a storage + layout + autograd state; views share
//!    storage. The graph's data (nodes, edges, saved tensors, hooks) lives with the tensor
//!    that carries it; the operand checks every op starts with too.
//! 5. `amp` — autocast regions: per-thread state and the weight-cast cache.
//! 6. `autograd` — recording ops into graphs, the iterative deterministic backward engine,
//!    grad modes, custom functions, activation recomputation, higher-order gradients
//!    (`create_graph`, `autograd::grad`), and the leak check (`LeakCheck`), which names who
//!    holds memory that grows step over step.
//! 7. `ops` — every op's forward and backward side by side, with autocast's op policy.
//! 8. `optim` — SGD, Adam/AdamW, clipping, learning-rate schedules.
//! 9. `nn` — modules: Linear, Embedding, LayerNorm, attention, MLP, GPT (with its
//!    recomputation policy).
//! 10. `dist` — data parallelism: the `ProcessGroup` contract and an in-process group (ranks
//!     as threads, deterministic reductions), `Ddp` (bucketed all-reduce from gradient hooks,
//!     gradients as views into the buckets) and `Zero1` (AdamW state sharded over ranks);
//!     for multi-process runs, `LaunchEnv` (the torchrun variables) and a `Rendezvous` over
//!     PyTorch's TCPStore protocol that shares rank 0's NCCL unique id, and `NcclGroup` (a
//!     process per GPU, collectives on a communication stream of its own).
//! 11. `train` — memory strategies, one small file each (accumulation, freezing, step in
//!     backward, the `GradScaler`), composed by the `Trainer` with the model's recomputation
//!     policy and, when data-parallel, the gradient synchronisation.
//! 12. `data` — the shipped corpus and a character tokenizer.
//! 13. `io` — training state in safetensors, written atomically; memory recordings exported
//!     for PyTorch's memory_viz, Chrome/Perfetto and the browser.
//! 14. `plan` — the planner: any step run on the meta device with a target device's
//!     allocation policy simulated, giving its peak before it runs (to the byte on the host).
//! 15. `job` — the main job: a character-level GPT trained (AdamW or SGD), evaluated, sampled
//!     and saved; its batch refused or fitted to a budget by the planner.
//! 16. `demo` — the memory demo: an MLP step with its bytes explained.

pub mod amp;
pub mod autograd;
pub mod backend;
pub mod base;
pub mod data;
pub mod demo;
pub mod dist;
pub mod io;
pub mod job;
pub mod memory;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod plan;
pub mod tensor;
pub mod train;

pub use autograd::{BackwardOptions, LeakCheck, enable_grad, is_grad_enabled, no_grad};
pub use base::{Error, Result};
pub use memory::Category;
pub use tensor::{DType, Device, Generator, Tensor, manual_seed};
