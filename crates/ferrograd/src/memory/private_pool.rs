//! Private memory pools, the memory side of CUDA-graph capture (PyTorch's `MempoolId_t`).
//!
//! A captured graph replays its kernels on the device addresses handed out while it was
//! captured, so the memory behind those addresses must stay the graph's own until the graph
//! is gone. While a pool is active every allocation of the device is served from segments
//! reserved for that pool alone (the caching policy keeps them apart from the shared pools
//! and never gives them back while the pool lives). This file holds the pool's id and the
//! front's bookkeeping: which pools exist, which one is active, and the frees that wait for
//! a pool's release because its graph may still read the block (a block from outside the
//! pool dropped during capture).
//!
//! The active pool is the device's, not a thread's or a stream's (PyTorch routes by capture
//! stream; this device has one stream): every allocation on the device while it is active
//! goes to it. A pool that is never released keeps its segments and its deferred blocks for
//! the allocator's life.

use std::collections::HashMap;
use std::fmt;

use crate::base::{Error, Result};

/// A private pool of one device's allocator (ids are per allocator).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PrivatePoolId(pub(super) u32);

impl fmt::Display for PrivatePoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "private pool {}", self.0)
    }
}

/// What a private pool holds on its device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrivatePoolBytes {
    /// Bytes of the segments reserved for the pool.
    pub reserved: u64,
    /// Bytes of the live blocks in those segments (deferred frees included).
    pub allocated: u64,
}

/// The front's view of its private pools.
#[derive(Default)]
pub(super) struct PoolBook {
    /// Ids handed out so far (ids run from 1 to `created`).
    created: u32,
    active: Option<PrivatePoolId>,
    /// Pools whose release ran; their ids cannot be begun again.
    released: Vec<PrivatePoolId>,
    /// Per pool, the live blocks (allocator ids) whose free waits for the pool's release, in
    /// the order they were dropped.
    deferred: HashMap<PrivatePoolId, Vec<u64>>,
}

impl PoolBook {
    pub fn create(&mut self) -> PrivatePoolId {
        self.created += 1;
        PrivatePoolId(self.created)
    }

    pub fn active(&self) -> Option<PrivatePoolId> {
        self.active
    }

    /// Errors unless `pool` was created here and is not released yet.
    fn check_live(&self, op: &'static str, pool: PrivatePoolId) -> Result<()> {
        if pool.0 == 0 || pool.0 > self.created {
            return Err(Error::invalid(
                op,
                format!("{pool} was not created by this allocator"),
            ));
        }
        if self.released.contains(&pool) {
            return Err(Error::invalid(op, format!("{pool} was already released")));
        }
        Ok(())
    }

    pub fn begin(&mut self, pool: PrivatePoolId) -> Result<()> {
        const OP: &str = "begin_private_pool";
        self.check_live(OP, pool)?;
        if let Some(active) = self.active {
            return Err(Error::invalid(
                OP,
                format!("{active} is already active; end it before beginning {pool}"),
            ));
        }
        self.active = Some(pool);
        Ok(())
    }

    pub fn end(&mut self) -> Result<()> {
        match self.active.take() {
            Some(_) => Ok(()),
            None => Err(Error::invalid(
                "end_private_pool",
                "no private pool is active; begin one first",
            )),
        }
    }

    /// Marks `pool` released and hands back the frees it deferred, in order.
    pub fn release(&mut self, pool: PrivatePoolId) -> Result<Vec<u64>> {
        const OP: &str = "release_private_pool";
        self.check_live(OP, pool)?;
        if self.active == Some(pool) {
            return Err(Error::invalid(
                OP,
                format!("{pool} is still active; end it before releasing it"),
            ));
        }
        self.released.push(pool);
        Ok(self.deferred.remove(&pool).unwrap_or_default())
    }

    /// Puts the free of block `id` off until `pool` is released.
    pub fn defer(&mut self, pool: PrivatePoolId, id: u64) {
        self.deferred.entry(pool).or_default().push(id);
    }
}

#[cfg(test)]
mod tests;
