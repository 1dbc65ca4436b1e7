//! In-place updates: gradient accumulation, optimizer steps, zeroing. They mutate a whole
//! contiguous storage and record no graph; using one on a tensor that takes part in autograd
//! while grad mode is on is an error, as in PyTorch.

use crate::autograd::is_grad_enabled;
use crate::backend::{BinaryOp, View, elementwise};
use crate::base::{Error, Result};
use crate::tensor::Tensor;

impl Tensor {
    fn check_inplace_target(&self, op: &'static str) -> Result<()> {
        if !self.is_contiguous()
            || self.layout().offset() != 0
            || self.numel() != self.storage().len()
        {
            return Err(Error::invalid(
                op,
                "in-place ops need a tensor that owns its whole contiguous storage; call .contiguous_owned() first",
            ));
        }
        if self.requires_grad() && is_grad_enabled() {
            return Err(Error::autograd(format!(
                "{op}: a tensor that requires grad is being modified in place while grad mode is on; wrap the update in no_grad()"
            )));
        }
        Ok(())
    }

    fn inplace(&self, op: BinaryOp, src: &Tensor, name: &'static str) -> Result<()> {
        self.check_inplace_target(name)?;
        super::check_pair(name, self, src)?;
        let l = src.broadcast_layout(self.shape())?;
        // The entry function bumps the version: autograd sees the write.
        elementwise::binary_inplace(
            op,
            self.storage(),
            View {
                storage: src.storage(),
                layout: &l,
            },
        )?;
        Ok(())
    }

    /// self += other
    #[track_caller]
    pub fn add_(&self, other: &Tensor) -> Result<()> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.inplace(BinaryOp::Add, other, "add_")
    }
    /// self += alpha * other
    #[track_caller]
    pub fn add_scaled_(&self, other: &Tensor, alpha: f64) -> Result<()> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.inplace(BinaryOp::AddScaled(alpha), other, "add_scaled_")
    }
    /// self *= other
    #[track_caller]
    pub fn mul_(&self, other: &Tensor) -> Result<()> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.inplace(BinaryOp::Mul, other, "mul_")
    }
    /// self = other (broadcast)
    #[track_caller]
    pub fn copy_(&self, other: &Tensor) -> Result<()> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.inplace(BinaryOp::Assign, other, "copy_")
    }
    /// self *= c
    #[track_caller]
    pub fn mul_scalar_(&self, c: f64) -> Result<()> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.check_inplace_target("mul_scalar_")?;
        let s = Tensor::scalar(c, self.dtype(), self.device())?;
        self.inplace(BinaryOp::Mul, &s, "mul_scalar_")
    }
    /// Every element = value
    #[track_caller]
    pub fn fill_(&self, value: f64) -> Result<()> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.check_inplace_target("fill_")?;
        elementwise::fill(self.storage(), value)?;
        Ok(())
    }
    /// Every element = 0
    #[track_caller]
    pub fn zero_(&self) -> Result<()> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.fill_(0.0)
    }
    /// A tensor that owns its whole contiguous storage (self if it already does).
    #[track_caller]
    pub fn contiguous_owned(&self) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if self.is_contiguous()
            && self.layout().offset() == 0
            && self.numel() == self.storage().len()
        {
            Ok(self.clone())
        } else {
            self.contiguous_copy()
        }
    }
}
