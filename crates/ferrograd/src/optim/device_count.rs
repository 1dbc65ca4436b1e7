//! A step count kept on the device, for optimizer steps that the device may skip (a
//! GradScaler's inf/NaN flag, `Optimizer::step_unless_found_inf`): the step's kernels read it
//! (Adam's bias corrections, SGD's first step), one more kernel advances it unless the flag is
//! raised, and the host, which never reads the flag, learns how many steps ran only when it
//! asks (`settle`, which waits for the device).

use crate::backend::capture;
use crate::backend::optim::{self, CountStep};
use crate::base::{Device, Error, Result};
use crate::memory::{self, Category};
use crate::tensor::{DType, Tensor};

/// The count of the parameters that step together (`members`): every one of them has taken
/// as many steps as `count` holds.
pub(super) struct DeviceCount {
    /// One F64 element on the members' device (optimizer state).
    count: Tensor,
    members: Vec<usize>,
    /// `count`'s value when the host last read it.
    known: u64,
    /// Steps queued since then (eager or replayed), each counted if it runs: at most this
    /// many were. A planned device runs nothing and its flags read as clear, so for it every
    /// one counts.
    issued: u64,
}

impl DeviceCount {
    /// A count for `members` (parameter indices, in order) on `device`, holding `at`. Made
    /// beside the optimizer's state, outside any graph's pool (a warm-up step makes it, and
    /// it outlives the graph); not while capturing, where its first value would be replayed.
    pub(super) fn start(
        op: &'static str,
        device: Device,
        members: Vec<usize>,
        at: u64,
    ) -> Result<DeviceCount> {
        if capture::capturing_on(device) {
            return Err(Error::invalid(
                op,
                "the step count that the device keeps is made by an eager step before a capture; run one step with the same parameters first",
            ));
        }
        let count = memory::allocator(device)?.outside_private_pool(|| {
            Tensor::alloc(
                &[1],
                DType::F64,
                device,
                Category::OptimizerState,
                "optimizer_step_count",
            )
        })?;
        count.fill_(at as f64)?;
        Ok(DeviceCount {
            count,
            members,
            known: at,
            issued: 0,
        })
    }

    /// Whether this count is the one of `members` on `device`.
    pub(super) fn covers(&self, members: &[usize], device: Device) -> bool {
        self.members == members && self.count.device() == device
    }

    pub(super) fn members(&self) -> &[usize] {
        &self.members
    }

    /// The count in device memory, for the step's kernels.
    pub(super) fn tensor(&self) -> &Tensor {
        &self.count
    }

    /// The value when the host last read it (`settle`).
    pub(super) fn known(&self) -> u64 {
        self.known
    }

    /// Queues the count's advance after a step's kernels: one more unless `found_inf` is
    /// raised. Issued while capturing too: the capture's first replay runs it.
    pub(super) fn advance(&mut self, found_inf: &Tensor) -> Result<()> {
        self.issued += 1;
        optim::count_step(&CountStep {
            count: self.count.storage(),
            skip_if: Some(found_inf.view()),
        })
    }

    /// A replay of a captured step that advances this count.
    pub(super) fn replayed(&mut self) {
        self.issued += 1;
    }

    /// Steps issued since the last read (to undo a failed capture's).
    pub(super) fn issued(&self) -> u64 {
        self.issued
    }

    pub(super) fn set_issued(&mut self, issued: u64) {
        self.issued = issued;
    }

    /// Reads the count (waiting for the device): how many of the steps issued since the last
    /// read ran. An error if the device counted more than were issued.
    pub(super) fn settle(&mut self, op: &'static str) -> Result<u64> {
        let ran = if self.count.device() == Device::Meta {
            self.issued
        } else {
            (self.count.item()? as u64).saturating_sub(self.known)
        };
        if ran > self.issued {
            return Err(Error::invalid(
                op,
                format!(
                    "the device counted {ran} steps of the {} queued since its count was last read",
                    self.issued
                ),
            ));
        }
        self.known += ran;
        self.issued = 0;
        Ok(ran)
    }
}
