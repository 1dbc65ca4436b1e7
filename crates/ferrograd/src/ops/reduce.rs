//! Reductions: sum, mean, max over dims. Backward of sum is the gradient *expanded* back
//! (a stride-0 view: no bytes), which is why `loss.sum().backward()` costs nothing extra.

use crate::autograd::{SavedTensor, record};
use crate::backend::{BinaryOp, ReduceOp};
use crate::base::{Error, Result};
use crate::tensor::{DType, Tensor, resolve_dim};

fn resolve_dims(op: &'static str, dims: &[isize], rank: usize) -> Result<Vec<usize>> {
    let mut out: Vec<usize> = dims
        .iter()
        .map(|&d| resolve_dim(op, d, rank))
        .collect::<Result<_>>()?;
    // A 0-dim tensor accepts dim 0 / -1 (as in PyTorch) and has nothing to reduce.
    out.retain(|&d| d < rank);
    out.sort_unstable();
    out.dedup();
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
        super::check_float(name, self)?;
        let shape = kept_shape(self.shape(), dims, true);
        let dtype = if op == ReduceOp::ArgMax {
            DType::I64
        } else {
            self.dtype()
        };
        let out = Tensor::output_uninit(&shape, dtype, self.device(), name)?;
        crate::backend::reduce::reduce(op, self.view(), dims, out.storage())?;
        Ok(out)
    }

    /// Sum of all elements (a 0-dim tensor).
    pub fn sum_all(&self) -> Result<Tensor> {
        let dims: Vec<isize> = (0..self.dims() as isize).collect();
        self.sum(&dims, false)
    }

    /// Sum over `dims`. Backward: the gradient broadcast back over the reduced dims.
    pub fn sum(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        if let Some([x]) = super::autocast::cast_f32([self])? {
            return x.sum(dims, keepdim);
        }
        self.sum_own_dtype(dims, keepdim)
    }

    /// `sum` without the autocast policy: `mean` keeps its input's dtype, as in PyTorch.
    pub(crate) fn sum_own_dtype(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let d = resolve_dims("sum", dims, self.dims())?;
        let kept = self.reduce_dims(ReduceOp::Sum, &d, "sum")?;
        let out = kept.reshape(&kept_shape(self.shape(), &d, keepdim))?;
        let (shape, keep_shape) = (self.shape().to_vec(), kept.shape().to_vec());
        Ok(record("sum", &[self], out, move |_, _| {
            move |g: &Tensor, _: &[bool]| Ok(vec![Some(g.reshape(&keep_shape)?.expand(&shape)?)])
        }))
    }

    /// Mean of all elements.
    pub fn mean_all(&self) -> Result<Tensor> {
        let dims: Vec<isize> = (0..self.dims() as isize).collect();
        self.mean(&dims, false)
    }

    /// Mean over `dims` = sum / count.
    pub fn mean(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let d = resolve_dims("mean", dims, self.dims())?;
        let count: usize = d.iter().map(|&i| self.shape()[i]).product();
        self.sum_own_dtype(dims, keepdim)?
            .mul_scalar(1.0 / count.max(1) as f64)
    }

    /// Maximum over one dim: (values, indices). Backward routes the gradient to the arg max.
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
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
