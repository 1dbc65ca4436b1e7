//! Shape and movement ops: views where the layout allows (no copy), a copy otherwise.
//! Backward of a view is the inverse movement of the gradient.

use crate::autograd::record;
use crate::base::{Error, Result};
use crate::tensor::{DType, Layout, Tensor, resolve_dim};

impl Tensor {
    /// Same elements in a new shape (see `reshape_infer` for -1). A view when the tensor is
    /// contiguous, else a copy.
    #[track_caller]
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let n = crate::base::checked_numel("reshape", shape)?;
        if n != self.numel() {
            return Err(Error::shape(
                "reshape",
                format!(
                    "cannot reshape {:?} ({} elements) into {shape:?} ({n} elements)",
                    self.shape(),
                    self.numel()
                ),
            ));
        }
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let out = match self.layout().reshape_view(shape) {
            Some(l) => self.with_layout(l),
            None => {
                let c = self.contiguous_copy()?;
                c.with_layout(Layout::contiguous(shape))
            }
        };
        let orig = self.shape().to_vec();
        Ok(record("reshape", &[self], out, move |_, _| {
            move |g: &Tensor, _: &[bool]| Ok(vec![Some(g.reshape(&orig)?)])
        }))
    }

    /// Reshape where one entry may be -1 (inferred); any other negative size is refused.
    #[track_caller]
    pub fn reshape_infer(&self, shape: &[isize]) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let refuse = |why: &str| {
            Err(Error::shape(
                "reshape",
                format!("cannot reshape {:?} into {shape:?}: {why}", self.shape()),
            ))
        };
        if let Some(&bad) = shape.iter().find(|&&d| d < -1) {
            return refuse(&format!(
                "{bad} is not a size; use -1 for the one inferred dim"
            ));
        }
        if shape.iter().filter(|&&d| d == -1).count() > 1 {
            return refuse("only one dim can be -1");
        }
        let given: Vec<usize> = shape
            .iter()
            .filter(|&&d| d >= 0)
            .map(|&d| d as usize)
            .collect();
        let known = crate::base::checked_numel("reshape", &given)?;
        let numel = self.numel();
        let inferred = numel.checked_div(known);
        let dims: Vec<usize> = match (shape.contains(&-1), inferred) {
            (false, _) => given,
            (true, Some(n)) if n * known == numel => shape
                .iter()
                .map(|&d| if d == -1 { n } else { d as usize })
                .collect(),
            (true, _) => {
                return refuse(&format!(
                    "{numel} elements are not a whole multiple of the other dims' {known}"
                ));
            }
        };
        self.reshape(&dims)
    }

    /// Reorders dims (a view). Backward: the inverse permutation.
    pub fn permute(&self, dims: &[usize]) -> Result<Tensor> {
        let out = self.with_layout(self.layout().permute(dims)?);
        let mut inverse = vec![0; dims.len()];
        for (i, &d) in dims.iter().enumerate() {
            inverse[d] = i;
        }
        Ok(record("permute", &[self], out, move |_, _| {
            move |g: &Tensor, _: &[bool]| Ok(vec![Some(g.permute(&inverse)?)])
        }))
    }

    /// Swaps two dims (negative dims count from the end). A view.
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let r = self.dims();
        let (a, b) = (
            resolve_dim("transpose", d0, r)?,
            resolve_dim("transpose", d1, r)?,
        );
        if r == 0 {
            return Ok(self.clone()); // a 0-dim tensor is its own transpose
        }
        let mut dims: Vec<usize> = (0..r).collect();
        dims.swap(a, b);
        self.permute(&dims)
    }

    /// Transpose of a 2-D tensor (a view).
    pub fn t(&self) -> Result<Tensor> {
        if self.dims() != 2 {
            return Err(Error::shape(
                "t",
                format!("t() needs a 2-D tensor, got shape {:?}", self.shape()),
            ));
        }
        self.transpose(0, 1)
    }

    /// `len` entries of `dim` from `start` (a view). Backward: the gradient placed into zeros.
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let d = resolve_dim("narrow", dim, self.dims())?;
        let out = self.with_layout(self.layout().narrow(d, start, len)?);
        let shape = self.shape().to_vec();
        Ok(record("narrow", &[self], out, move |_, _| {
            move |g: &Tensor, _: &[bool]| {
                let full = Tensor::output(&shape, g.dtype(), g.device(), "narrow_backward")?;
                let region = full.layout().narrow(d, start, len)?;
                crate::backend::elementwise::copy(
                    g.view(),
                    crate::backend::View {
                        storage: full.storage(),
                        layout: &region,
                    },
                )?;
                Ok(vec![Some(full)])
            }
        }))
    }

    /// Broadcast to `shape` (a view with stride 0). Backward: sum over the stretched dims.
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        let out = self.with_layout(self.layout().broadcast_to(shape)?);
        let orig = self.shape().to_vec();
        Ok(record("expand", &[self], out, move |_, _| {
            move |g: &Tensor, _: &[bool]| Ok(vec![Some(g.sum_to(&orig)?)])
        }))
    }

    /// A contiguous tensor with the same values (self when already contiguous).
    #[track_caller]
    pub fn contiguous(&self) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let out = self.contiguous_copy()?;
        Ok(record("contiguous", &[self], out, |_, _| {
            |g: &Tensor, _: &[bool]| Ok(vec![Some(g.clone())])
        }))
    }

    /// A fresh contiguous copy that keeps the history (recorded as `contiguous`): a backward
    /// under create_graph stores such a copy as `.grad` without cutting its graph.
    pub(crate) fn copy_recorded(&self) -> Result<Tensor> {
        let out = self.contiguous_copy()?;
        Ok(record("contiguous", &[self], out, |_, _| {
            |g: &Tensor, _: &[bool]| Ok(vec![Some(g.clone())])
        }))
    }

    /// Inserts a dim of size 1 at `dim`.
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let d = resolve_dim("unsqueeze", dim, self.dims() + 1)?;
        let mut shape = self.shape().to_vec();
        shape.insert(d, 1);
        self.reshape_or_view(&shape)
    }

    /// Removes `dim` if it has size 1.
    pub fn squeeze(&self, dim: isize) -> Result<Tensor> {
        let d = resolve_dim("squeeze", dim, self.dims())?;
        if self.shape().get(d) != Some(&1) {
            return Ok(self.clone());
        }
        let mut shape = self.shape().to_vec();
        shape.remove(d);
        self.reshape_or_view(&shape)
    }

    /// Reshape that only adds or removes size-1 dims: always a view, even when strided.
    fn reshape_or_view(&self, shape: &[usize]) -> Result<Tensor> {
        if self.is_contiguous() {
            return self.reshape(shape);
        }
        // Keep the strides of the non-unit dims in order.
        let mut strides = Vec::with_capacity(shape.len());
        let mut src = self
            .shape()
            .iter()
            .zip(self.strides())
            .filter(|(d, _)| **d != 1);
        for &d in shape {
            strides.push(if d == 1 {
                1
            } else {
                *src.next().map(|(_, s)| s).unwrap_or(&1)
            });
        }
        let out = self.with_layout(Layout::new(shape.to_vec(), strides, self.layout().offset()));
        let orig = self.shape().to_vec();
        Ok(record("view", &[self], out, move |_, _| {
            move |g: &Tensor, _: &[bool]| Ok(vec![Some(g.reshape(&orig)?)])
        }))
    }

    /// Converts to `dtype`. Backward: the gradient converted back.
    #[track_caller]
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let out = self.copy_as(dtype, "to_dtype")?;
        Ok(recorded_cast(self, out))
    }
}

impl Tensor {
    /// `to_dtype` of each tensor, the conversions in as few launches as the device manages
    /// (one per dtype pair on the GPU where they are contiguous, instead of one each). Each
    /// result is its own graph node, as `to_dtype`'s.
    #[track_caller]
    pub fn to_dtype_many(tensors: &[Tensor], dtype: DType) -> Result<Vec<Tensor>> {
        let _site = crate::memory::recorder::CallSite::enter();
        let Some(device) = tensors.first().map(Tensor::device) else {
            return Ok(Vec::new());
        };
        if tensors.iter().any(|t| t.device() != device) {
            return tensors.iter().map(|t| t.to_dtype(dtype)).collect();
        }
        let outs = tensors
            .iter()
            .map(|t| match t.dtype() == dtype {
                true => Ok(None),
                false => Tensor::output_uninit(t.shape(), dtype, device, "to_dtype").map(Some),
            })
            .collect::<Result<Vec<_>>>()?;
        let pairs: Vec<_> = tensors
            .iter()
            .zip(&outs)
            .filter_map(|(t, o)| o.as_ref().map(|o| (t.view(), o.view())))
            .collect();
        crate::backend::elementwise::copy_many(&pairs)?;
        let recorded = tensors.iter().zip(outs).map(|(t, out)| match out {
            None => t.clone(),
            Some(out) => recorded_cast(t, out),
        });
        Ok(recorded.collect())
    }

    /// The same values on `device` (self when already there). Backward moves the gradient
    /// back. Host ↔ device copies go through host memory.
    #[track_caller]
    pub fn to_device(&self, device: crate::tensor::Device) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if device == self.device() {
            return Ok(self.clone());
        }
        let out = if device == crate::tensor::Device::Meta
            || self.device() == crate::tensor::Device::Meta
        {
            Tensor::output(self.shape(), self.dtype(), device, "to_device")?
        } else {
            let values = self.to_host()?;
            let t = Tensor::from_host_values(values, self.shape(), self.dtype(), device)?;
            t.set_category(crate::memory::Category::Temporary);
            t
        };
        let from = self.device();
        Ok(record("to_device", &[self], out, move |_, _| {
            move |g: &Tensor, _: &[bool]| Ok(vec![Some(g.to_device(from)?)])
        }))
    }

    /// `to_dtype` of a 2-D (n, k) tensor whose storage is a (rows, k) block, rows ≥ n, with
    /// zeros past the first n rows: the cast as a GEMM at a padded width reads it (see
    /// ops/aligned_gemm.rs), with no padded copy. The same graph node as `to_dtype`'s.
    pub(crate) fn to_dtype_zero_padded(&self, dtype: DType, rows: usize) -> Result<Tensor> {
        let (n, k) = (self.shape()[0], self.shape()[1]);
        let block = Tensor::output(&[rows.max(n), k], dtype, self.device(), "to_dtype")?;
        let out = block.with_layout(Layout::contiguous(&[n, k]));
        crate::backend::elementwise::copy(self.view(), out.view())?;
        Ok(recorded_cast(self, out))
    }
}

/// `out` (src converted) as src's `to_dtype` node: backward converts the gradient back.
fn recorded_cast(src: &Tensor, out: Tensor) -> Tensor {
    let orig = src.dtype();
    record("to_dtype", &[src], out, move |_, _| {
        move |g: &Tensor, _: &[bool]| Ok(vec![Some(g.to_dtype(orig)?)])
    })
}
