//! In-place updates: gradient accumulation, optimizer steps, zeroing. They mutate a
//! contiguous tensor (a whole storage, or a contiguous slice of one) and record no graph; using one on a tensor that takes part in autograd
//! while grad mode is on is an error, as in PyTorch.

use crate::autograd::is_grad_enabled;
use crate::backend::{BinaryOp, View, elementwise};
use crate::base::{Error, Result};
use crate::tensor::Tensor;

impl Tensor {
    fn check_inplace_target(&self, op: &'static str) -> Result<()> {
        if !self.is_contiguous() {
            return Err(Error::invalid(
                op,
                "in-place ops need a contiguous tensor; call .contiguous_owned() first",
            ));
        }
        if self.requires_grad() && is_grad_enabled() {
            return Err(Error::autograd(format!(
                "{op}: a tensor that requires grad is being modified in place while grad mode is on; wrap the update in no_grad()"
            )));
        }
        Ok(())
    }

    /// Whether this tensor is all of its storage (the kernels' in-place form writes whole
    /// storages; a contiguous slice of a larger one, such as a gradient that is a view into
    /// a data-parallel bucket, goes through a temporary and a copy).
    fn owns_whole_storage(&self) -> bool {
        self.layout().offset() == 0 && self.numel() == self.storage().len()
    }

    /// `self = op(self, src)` on a contiguous slice of a storage: computed out of place,
    /// then copied into the slice (one temporary the size of the slice).
    fn inplace_slice(&self, op: BinaryOp, src: View) -> Result<()> {
        let src_layout = src.layout.clone();
        let value = if op == BinaryOp::Assign {
            None
        } else {
            let out = Tensor::output(self.shape(), self.dtype(), self.device(), "inplace_slice")?;
            elementwise::binary(op, self.view(), src, out.storage())?;
            Some(out)
        };
        let from = match &value {
            Some(t) => t.view(),
            None => View {
                storage: src.storage,
                layout: &src_layout,
            },
        };
        // The entry function bumps the version: autograd sees the write.
        elementwise::copy(from, self.view())
    }

    fn inplace(&self, op: BinaryOp, src: &Tensor, name: &'static str) -> Result<()> {
        self.check_inplace_target(name)?;
        super::check_pair(name, self, src)?;
        let l = src.broadcast_layout(self.shape())?;
        if !self.owns_whole_storage() {
            return self.inplace_slice(
                op,
                View {
                    storage: src.storage(),
                    layout: &l,
                },
            );
        }
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
        if !self.owns_whole_storage() {
            let v = Tensor::scalar(value, self.dtype(), self.device())?;
            return self.inplace(BinaryOp::Assign, &v, "fill_");
        }
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
