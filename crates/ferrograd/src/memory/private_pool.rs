//! Private memory pools, the memory side of CUDA-graph capture (PyTorch's `MempoolId_t`).
//!
//! A captured graph replays its kernels on the device addresses handed out while it was
//! captured, so the memory behind those addresses must stay the graph's own until the graph
//! is gone. While a pool is active every allocation of the device is served from segments
//! reserved for that pool alone (the caching policy keeps them apart from the shared pools
//! and never gives them back while the pool lives). This file holds the pool's id.

use std::fmt;

/// A private pool of one device's allocator (ids are per allocator).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PrivatePoolId(pub(super) u32);

impl fmt::Display for PrivatePoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "private pool {}", self.0)
    }
}
