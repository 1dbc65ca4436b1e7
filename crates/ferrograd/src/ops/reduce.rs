//! Reductions: sum, mean, max over dims. Backward of sum is the gradient *expanded* back
//! (a stride-0 view: no bytes), which is why `loss.sum().backward()` costs nothing extra.

use crate::autograd::{SavedTensor, record};
use crate::backend::{BinaryOp, ReduceOp};
use crate::base::{Error, Result};
use crate::tensor::{DType, Tensor, resolve_dim};

/// The dims to reduce, sorted; a dim named twice (`[0, -2]` of a 2-D tensor) is refused, as
/// PyTorch refuses it.
fn resolve_dims(op: &'static str, dims: &[isize], rank: usize) -> Result<Vec<usize>> {
    let mut out: Vec<usize> = dims
        .iter()
        .map(|&d| resolve_dim(op, d, rank))
        .collect::<Result<_>>()?;
    out.sort_unstable();
    if let Some(w) = out.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::shape(
            op,
            format!(
                "dim {} appears more than once in {dims:?}; name each dim once",
                w[0]
            ),
        ));
    }
    // A 0-dim tensor accepts dim 0 / -1 (as in PyTorch) and has nothing to reduce.
    out.retain(|&d| d < rank);
    Ok(out)
}

fn kept_shape(shape: &[usize], dims: &[usize], keepdim: bool) -> Vec<usize> {
    shape
        .iter()
        .enumerate()
        .filter_map(|(i, &d)| match (dims.contains(&i), keepdim) {
            (false, _) => Some(d),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect()
}

impl Tensor {
    /// Raw reduction with the reduced dims kept as size 1, no autograd.
    pub(crate) fn reduce_dims(
        &self,
        op: ReduceOp,
        dims: &[usize],
        name: &'static str,
    ) -> Result<Tensor> {
        let dtype = if op == ReduceOp::ArgMax {
            DType::I64
        } else {
            self.dtype()
        };
        self.reduce_dims_into(op, dims, name, dtype)
    }

    /// `reduce_dims` into an output of `dtype` (the kernels accumulate in f64 whatever it is).
    pub(crate) fn reduce_dims_into(
        &self,
        op: ReduceOp,
        dims: &[usize],
        name: &'static str,
        dtype: DType,
    ) -> Result<Tensor> {
        super::check_float(name, self)?;
        let shape = kept_shape(self.shape(), dims, true);
        let out = Tensor::output_uninit(&shape, dtype, self.device(), name)?;
        crate::backend::reduce::reduce(op, self.view(), dims, out.storage())?;
        Ok(out)
    }

    /// Sum of all elements (a 0-dim tensor).
    #[track_caller]
    pub fn sum_all(&self) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let dims: Vec<isize> = (0..self.dims() as isize).collect();
        self.sum(&dims, false)
    }

    /// Sum over `dims`. Backward: the gradient broadcast back over the reduced dims.
    #[track_caller]
    pub fn sum(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if let Some([x]) = super::autocast::cast_f32([self])? {
            return x.sum(dims, keepdim);
        }
        self.sum_own_dtype(dims, keepdim)
    }

    /// `sum` without the autocast policy, written as `dtype`. Backward: the gradient back in
    /// the input's dtype, broadcast back over the reduced dims.
    fn sum_as(&self, dims: &[isize], keepdim: bool, dtype: DType) -> Result<Tensor> {
        let d = resolve_dims("sum", dims, self.dims())?;
        let kept = self.reduce_dims_into(ReduceOp::Sum, &d, "sum", dtype)?;
        let out = kept.reshape(&kept_shape(self.shape(), &d, keepdim))?;
        let (shape, keep_shape) = (self.shape().to_vec(), kept.shape().to_vec());
        let orig = self.dtype();
        Ok(record("sum", &[self], out, move |_, _| {
            move |g: &Tensor, _: &[bool]| {
                let g = g.to_dtype(orig)?.reshape(&keep_shape)?;
                Ok(vec![Some(g.expand(&shape)?)])
            }
        }))
    }

    pub(crate) fn sum_own_dtype(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.sum_as(dims, keepdim, self.dtype())
    }

    /// Mean of all elements.
    #[track_caller]
    pub fn mean_all(&self) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let dims: Vec<isize> = (0..self.dims() as isize).collect();
        self.mean(&dims, false)
    }

    /// Mean over `dims` = sum / count, in the input's dtype (as in PyTorch). The mean of no
    /// elements is NaN (0 / 0). f16 and bf16 are summed and divided in f32 and rounded once,
    /// as PyTorch does: 1,000 values of 100 have the mean 100, not the overflowed sum / 1,000.
    #[track_caller]
    pub fn mean(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let d = resolve_dims("mean", dims, self.dims())?;
        let count: usize = d.iter().map(|&i| self.shape()[i]).product();
        let scale = 1.0 / count as f64;
        match self.dtype() {
            DType::F16 | DType::BF16 => self
                .sum_as(dims, keepdim, DType::F32)?
                .mul_scalar(scale)?
                .to_dtype(self.dtype()),
            _ => self.sum_own_dtype(dims, keepdim)?.mul_scalar(scale),
        }
    }

    /// Maximum over one dim: (values, indices). Backward routes the gradient to the arg max.
    #[track_caller]
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        let _site = crate::memory::recorder::CallSite::enter();
        let d = resolve_dim("max", dim, self.dims())?;
        if self.dims() == 0 {
            // PyTorch: the value itself and index 0, both 0-dim whatever keepdim says.
            return self.reshape(&[1])?.max_dim(0, false);
        }
        if self.shape().get(d) == Some(&0) {
            return Err(Error::shape("max", "cannot take the max of an empty dim"));
        }
        let values = self.reduce_dims(ReduceOp::Max, &[d], "max")?;
        let indices = self.reduce_dims(ReduceOp::ArgMax, &[d], "argmax")?;
        let out_shape = kept_shape(self.shape(), &[d], keepdim);
        let idx_out = indices.reshape(&out_shape)?;
        let vals = values.reshape(&out_shape)?;
        let (shape, keep_shape) = (self.shape().to_vec(), values.shape().to_vec());
        let out = record("max", &[self], vals, |_, _| {
            let idx = SavedTensor::new(&indices);
            move |g: &Tensor, _: &[bool]| {
                let hot = one_hot_along(idx.get(), &shape, d, g.dtype())?;
                Ok(vec![Some(
                    hot.mul(&g.reshape(&keep_shape)?.expand(&shape)?)?,
                )])
            }
        });
        Ok((out, idx_out))
    }

    /// Minimum over one dim: (values, indices), NaN propagating and the index of the first
    /// minimum (or first NaN), as `torch.min(dim)`. It is the max of the negation, so its
    /// backward routes the gradient to the arg min.
    pub fn min_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        let d = resolve_dim("min", dim, self.dims())?;
        if self.dims() > 0 && self.shape()[d] == 0 {
            return Err(Error::shape("min", "cannot take the min of an empty dim"));
        }
        let (values, indices) = self.neg()?.max_dim(dim, keepdim)?;
        Ok((values.neg()?, indices))
    }
}

/// 1.0 at `idx` along `dim` (idx has `dim` kept as 1), 0.0 elsewhere, shape `shape`.
fn one_hot_along(idx: &Tensor, shape: &[usize], dim: usize, dtype: DType) -> Result<Tensor> {
    let mut pos_shape = vec![1; shape.len()];
    pos_shape[dim] = shape[dim];
    let positions =
        Tensor::arange(0.0, shape[dim] as f64, 1.0, dtype, idx.device())?.reshape(&pos_shape)?;
    let idx_f = idx.copy_as(dtype, "max_backward")?;
    super::binary::binary_forward(
        BinaryOp::Eq,
        &positions.expand(shape)?,
        &idx_f.expand(shape)?,
        "max_backward",
    )
}
