//! Embedding lookup: rows of a (V, D) weight gathered by integer ids. Backward adds each
//! gradient row into its id's row of a zero (V, D) tensor, repeated ids in order
//! (deterministic). The graph saves only the ids, never the weight: the gradient of a lookup
//! does not depend on the looked-up values. A tied weight (GPT's embedding and classifier)
//! already has the classifier's gradient pending when the lookup's backward runs: the rows are
//! added into that buffer in place, so no second (V, D) gradient is zeroed, filled and added.

use crate::autograd::{SavedTensor, record, take_pending_grad};
use crate::backend::View;
use crate::backend::index::{self, IndexAdd, IndexSelect};
use crate::base::{Error, Result};
use crate::tensor::{DType, Layout, Tensor};

impl Tensor {
    /// Looks up rows of this weight. weight: (V, D), ids: I64 of any shape (...) → (..., D).
    /// Every id must be in 0..V.
    #[track_caller]
    pub fn embedding(&self, ids: &Tensor) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let (v, d) = check_embedding(self, ids)?;
        let mut shape = ids.shape().to_vec();
        shape.push(d);
        let out = Tensor::output_uninit(&shape, self.dtype(), self.device(), "embedding")?;
        index::index_select(&IndexSelect {
            weight: self.view(),
            ids: ids.view(),
            out: out.storage(),
        })
        .map_err(as_embedding_error)?;
        Ok(record("embedding", &[self], out, |_, _| {
            let ids = SavedTensor::new(ids);
            move |g: &Tensor, _: &[bool]| {
                let prior = take_pending_grad(0, |p| {
                    p.shape() == [v, d]
                        && p.dtype() == g.dtype()
                        && p.device() == g.device()
                        && p.is_exclusive()
                });
                let gweight = embedding_backward(g, ids.get(), (v, d), prior)?;
                Ok(vec![Some(gweight)])
            }
        }))
    }
}

/// (V, D) of a valid weight/ids pair.
fn check_embedding(weight: &Tensor, ids: &Tensor) -> Result<(usize, usize)> {
    super::check_float("embedding", weight)?;
    super::check_same_device("embedding", weight, ids)?;
    if ids.dtype() != DType::I64 {
        return Err(Error::UnsupportedDType {
            op: "embedding",
            dtype: ids.dtype(),
            hint: "ids must be int64 (DType::I64)",
        });
    }
    match weight.shape() {
        &[v, d] => Ok((v, d)),
        s => Err(Error::shape(
            "embedding",
            format!("the weight must be 2-D (V, D), got shape {s:?}"),
        )),
    }
}

/// The kernel names itself `index_select`; the user called `embedding`.
fn as_embedding_error(e: Error) -> Error {
    match e {
        Error::Index { detail, .. } => Error::Index {
            op: "embedding",
            detail,
        },
        e => e,
    }
}

/// gweight (V, D): row r = prior's row r (zero without a prior) + Σ of g's rows at the
/// positions where ids == r, in order. g: (..., D) with ids: (...); prior: the weight's
/// gradient from its other uses, (V, D) in g's dtype, exclusive (written in place).
fn embedding_backward(
    g: &Tensor,
    ids: &Tensor,
    (v, d): (usize, usize),
    prior: Option<Tensor>,
) -> Result<Tensor> {
    let gweight = match prior {
        Some(p) => p,
        None => Tensor::output(&[v, d], g.dtype(), g.device(), "embedding_backward")?,
    };
    let n = ids.numel();
    // A gradient expanded from a sum (all strides 0) collapses to (N, D) without a copy.
    let copy;
    let (storage, layout) = match rows_layout(g.layout(), n, d) {
        Some(l) => (g.storage(), l),
        None => {
            copy = g.contiguous_copy()?;
            (copy.storage(), Layout::contiguous(&[n, d]))
        }
    };
    let rows = View {
        storage,
        layout: &layout,
    };
    index::index_add(&IndexAdd {
        grad: rows,
        ids: ids.view(),
        out: gweight.storage(),
    })?;
    Ok(gweight)
}

/// The (N, D) view of a (..., D) layout, when its leading dims step through memory with
/// one stride (each outer dim's stride = inner stride × inner extent).
fn rows_layout(l: &Layout, n: usize, d: usize) -> Option<Layout> {
    let lead = l.rank().checked_sub(1)?;
    let mut row_stride: Option<isize> = None;
    let mut extent = 1usize;
    for (&size, &stride) in l.shape()[..lead].iter().zip(&l.strides()[..lead]).rev() {
        if size == 1 {
            continue;
        }
        match row_stride {
            None => row_stride = Some(stride),
            Some(s) if stride == s * extent as isize => {}
            Some(_) => return None,
        }
        extent *= size;
    }
    Some(Layout::new(
        vec![n, d],
        vec![row_stride.unwrap_or(0), l.strides()[lead]],
        l.offset(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_layout_collapses_contiguous_and_expanded() {
        let c = Layout::contiguous(&[2, 3, 4]);
        assert_eq!(rows_layout(&c, 6, 4).unwrap().strides(), &[4, 1]);
        let e = Layout::new(vec![2, 3, 4], vec![0, 0, 0], 0);
        assert_eq!(rows_layout(&e, 6, 4).unwrap().strides(), &[0, 0]);
        let t = Layout::contiguous(&[3, 2, 4]).permute(&[1, 0, 2]).unwrap();
        assert!(rows_layout(&t, 6, 4).is_none());
    }
}
