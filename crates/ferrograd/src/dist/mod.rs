//! Data-parallel training: every rank holds a replica, computes gradients on its share of the
//! batch, and the ranks average them.
//!
//! - `group` — the `ProcessGroup` contract (all-reduce, broadcast, reduce-scatter,
//!   all-gather, barrier on flat float tensors);
//! - `in_process` — ranks as threads of one process, deterministic reductions: CI tests the
//!   whole data-parallel logic on the CPU with it;
//! - `buckets` — PyTorch's bucket assignment and the flat buffers gradients live in;
//! - `ddp` — `Ddp`, the DistributedDataParallel wrapper around any module;
//! - `zero1` — `Zero1`, AdamW with its state sharded over the ranks (ZeRO stage 1);
//! - `launch_env` — `LaunchEnv`, a rank's place in a multi-process run, from the torchrun
//!   variables (RANK, LOCAL_RANK, WORLD_SIZE, ..., MASTER_ADDR, MASTER_PORT);
//! - `store` / `store_server` — a client of PyTorch's TCPStore wire protocol (torchrun's
//!   agent hosts one) and a minimal server for the same commands, which rank 0 starts
//!   otherwise;
//! - `rendezvous` — `Rendezvous`: processes meet at the store, check their world sizes,
//!   broadcast bytes from rank 0 and pass barriers; `share_unique_id` gives every rank
//!   rank 0's NCCL unique id;
//! - `nccl` — `NcclGroup`, one process per GPU, collectives by NCCL on a stream of its own;
//!   `NcclGroup::join` meets the other ranks through the rendezvous first.
//!
//! Memory: in-process ranks share their device's allocator, so its statistics and category
//! sums are totals over the ranks (each holds its own replica, gradients and state). Each
//! rank's thread allocates in the memory scope of its rank: `memory::scope_memory(device,
//! rank)` is that rank's bytes by category and its own peak (the ranks' sums add up to at
//! most `memory_allocated`: a parallel kernel's scratch, taken on a worker thread, counts in
//! the totals only).

mod buckets;
mod ddp;
mod group;
mod in_process;
mod launch_env;
mod nccl;
mod rendezvous;
mod store;
mod store_server;
mod zero1;

pub use buckets::{
    Bucket, BucketItem, DEFAULT_BUCKET_BYTES_CAP, DEFAULT_FIRST_BUCKET_BYTES, bucket_assignment,
    initial_assignment, rebuilt_assignment,
};
pub use ddp::{Ddp, DdpConfig, NoSync, Reducer};
pub use group::{ProcessGroup, ReduceOp};
pub use in_process::{DEFAULT_TIMEOUT, InProcessGroup};
pub use launch_env::{LAUNCH_VARS, LaunchEnv};
pub use nccl::{NcclGroup, nccl_unique_id};
pub use rendezvous::{NCCL_UNIQUE_ID_BYTES, RENDEZVOUS_TIMEOUT, Rendezvous, share_unique_id};
pub use store::StoreClient;
pub use store_server::StoreServer;
pub use zero1::Zero1;

use crate::base::Result;

/// What a training step needs from data parallelism between its micro-batches and its
/// optimizer step (the `Trainer` calls it; `Ddp::grad_sync` gives one).
pub trait GradSync: Send + Sync {
    /// Whether the coming micro-batch's backward reduces gradients: false for all but the
    /// last micro-batch of an accumulated step (gradients then accumulate locally).
    fn set_require_sync(&self, on: bool);
    /// After the step's last backward: every gradient was reduced, or an error naming the
    /// parameters that got none.
    fn finish(&self) -> Result<()>;
}
