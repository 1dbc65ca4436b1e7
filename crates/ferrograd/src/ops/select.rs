//! Joining, splitting and selecting: cat, split, chunk, where, masked_fill.
//! cat copies each input into its region of one output (backward: the gradient narrowed back
//! per input, views); split and chunk are views (narrow); where and masked_fill pick
//! elementwise through one kernel with a U8 condition, broadcasting like PyTorch, with no
//! trip through host memory.

use crate::autograd::{SavedTensor, record};
use crate::backend::index::{self, Where};
use crate::backend::{View, elementwise};
use crate::base::{Error, Result};
use crate::tensor::{DType, Tensor, broadcast_shape, resolve_dim};

/// `cond ? a : b` with all three broadcast together, no autograd. `cond` is U8; `a` and `b`
/// share a dtype (any).
pub(crate) fn where_forward(
    cond: &Tensor,
    a: &Tensor,
    b: &Tensor,
    name: &'static str,
) -> Result<Tensor> {
    if cond.dtype() != DType::U8 {
        return Err(Error::UnsupportedDType {
            op: name,
            dtype: cond.dtype(),
            hint: "the condition/mask must be U8 (0 = false, non-zero = true), e.g. Tensor::from_vec::<u8>(..)",
        });
    }
    super::check_pair(name, a, b)?;
    super::check_same_device(name, cond, a)?;
    let shape = broadcast_shape(
        name,
        &broadcast_shape(name, cond.shape(), a.shape())?,
        b.shape(),
    )?;
    let (lc, la, lb) = (
        cond.broadcast_layout(&shape)?,
        a.broadcast_layout(&shape)?,
        b.broadcast_layout(&shape)?,
    );
    let out = Tensor::output_uninit(&shape, a.dtype(), a.device(), name)?;
    index::select_where(&Where {
        cond: View {
            storage: cond.storage(),
            layout: &lc,
        },
        a: View {
            storage: a.storage(),
            layout: &la,
        },
        b: View {
            storage: b.storage(),
            layout: &lb,
        },
        out: out.storage(),
    })?;
    Ok(out)
}

/// A 0-dim op temporary holding `value` (broadcast by `where` with stride 0: no bytes per
/// element).
fn scalar_like(like: &Tensor, value: f64, origin: &'static str) -> Result<Tensor> {
    let s = Tensor::output(&[], like.dtype(), like.device(), origin)?;
    if value != 0.0 {
        elementwise::fill(s.storage(), value)?;
    }
    Ok(s)
}

/// The gradient routed by the condition, `cond ? g : 0` when `g_when_true` else
/// `cond ? 0 : g`, summed back to an input's `shape`.
fn routed_grad(cond: &Tensor, g: &Tensor, g_when_true: bool, shape: &[usize]) -> Result<Tensor> {
    let zero = scalar_like(g, 0.0, "where_backward")?;
    // Recorded (where) when a backward runs under create_graph.
    let routed = if g_when_true {
        Tensor::where_(cond, g, &zero)?
    } else {
        Tensor::where_(cond, &zero, g)?
    };
    routed.sum_to(shape)
}

/// (shape of the concatenation, length of each input along `dim`).
fn cat_shape(tensors: &[Tensor], dim: usize) -> Result<(Vec<usize>, Vec<usize>)> {
    let first = &tensors[0];
    let mut shape = first.shape().to_vec();
    shape[dim] = 0;
    let mut lens = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        super::check_pair("cat", first, t)?;
        let same_elsewhere = t.dims() == first.dims()
            && t.shape()
                .iter()
                .zip(first.shape())
                .enumerate()
                .all(|(k, (a, b))| k == dim || a == b);
        if !same_elsewhere {
            return Err(Error::shape(
                "cat",
                format!(
                    "tensor {i} has shape {:?} but tensor 0 has {:?}: all dims except the cat dim {dim} must match",
                    t.shape(),
                    first.shape()
                ),
            ));
        }
        shape[dim] += t.shape()[dim];
        lens.push(t.shape()[dim]);
    }
    Ok((shape, lens))
}

impl Tensor {
    /// Concatenates along `dim` (negative counts from the end). All tensors share dtype,
    /// device and every other dim. Backward: each input gets its slice of the gradient.
    #[track_caller]
    pub fn cat(tensors: &[Tensor], dim: isize) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let first = tensors
            .first()
            .ok_or_else(|| Error::invalid("cat", "needs at least one tensor to concatenate"))?;
        if first.dims() == 0 {
            return Err(Error::shape(
                "cat",
                "0-dim tensors cannot be concatenated; unsqueeze them first",
            ));
        }
        let d = resolve_dim("cat", dim, first.dims())?;
        let (shape, lens) = cat_shape(tensors, d)?;
        let out = Tensor::output_uninit(&shape, first.dtype(), first.device(), "cat")?;
        let mut starts = Vec::with_capacity(lens.len());
        let mut start = 0;
        for (t, &len) in tensors.iter().zip(&lens) {
            let region = out.layout().narrow(d, start, len)?;
            elementwise::copy(
                t.view(),
                View {
                    storage: out.storage(),
                    layout: &region,
                },
            )?;
            starts.push(start);
            start += len;
        }
        let inputs: Vec<&Tensor> = tensors.iter().collect();
        Ok(record("cat", &inputs, out, move |_, _| {
            move |g: &Tensor, needs: &[bool]| {
                let slices = starts.iter().zip(&lens).zip(needs);
                slices
                    .map(|((&s, &len), &need)| {
                        need.then(|| g.narrow(d as isize, s, len)).transpose()
                    })
                    .collect()
            }
        }))
    }

    /// Splits `dim` into pieces of the given sizes (which must add up to its length).
    /// Each piece is a view (narrow).
    #[track_caller]
    pub fn split(&self, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
        let _site = crate::memory::recorder::CallSite::enter();
        let d = resolve_dim("split", dim, self.dims())?;
        let total = sizes.iter().try_fold(0usize, |acc, &n| acc.checked_add(n));
        if self.dims() == 0 || total != Some(self.shape()[d]) {
            let total = sizes.iter().fold(0u128, |acc, &n| acc + n as u128);
            return Err(Error::shape(
                "split",
                format!(
                    "sizes {sizes:?} add up to {total}, but dim {d} of shape {:?} differs",
                    self.shape()
                ),
            ));
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&len| {
                let piece = self.narrow(d as isize, start, len);
                start += len;
                piece
            })
            .collect()
    }

    /// `chunks` views along `dim` of ceil(len / chunks) each, the last possibly smaller (and
    /// fewer than `chunks` pieces when they run out), as `torch.chunk`.
    #[track_caller]
    pub fn chunk(&self, chunks: usize, dim: isize) -> Result<Vec<Tensor>> {
        let _site = crate::memory::recorder::CallSite::enter();
        let d = resolve_dim("chunk", dim, self.dims())?;
        if chunks == 0 || self.dims() == 0 {
            return Err(Error::invalid(
                "chunk",
                "needs at least one chunk of a tensor with at least one dim",
            ));
        }
        let len = self.shape()[d];
        let size = len.div_ceil(chunks);
        let sizes: Vec<usize> = if size == 0 {
            // An empty dim gives `chunks` empty pieces, as in PyTorch: as many as memory holds.
            let mut sizes = Vec::new();
            sizes.try_reserve_exact(chunks).map_err(|_| {
                Error::invalid(
                    "chunk",
                    format!("{chunks} chunks of an empty dim are more than memory holds"),
                )
            })?;
            sizes.resize(chunks, 0);
            sizes
        } else {
            (0..len).step_by(size).map(|s| size.min(len - s)).collect()
        };
        self.split(&sizes, dim)
    }

    /// `cond ? a : b` elementwise, the three broadcast together (`torch.where`). `cond` is a
    /// U8 mask; float `a` and `b` of different dtypes are promoted as in `add`. Backward: a
    /// gets `cond ? g : 0`, b gets `cond ? 0 : g`, each summed to its shape.
    #[track_caller]
    pub fn where_(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if let Some(d) = super::binary::promoted_dtype(a, b) {
            return Tensor::where_(cond, &a.to_dtype(d)?, &b.to_dtype(d)?);
        }
        let out = where_forward(cond, a, b, "where")?;
        let (sa, sb) = (a.shape().to_vec(), b.shape().to_vec());
        Ok(record("where", &[a, b], out, |_, _| {
            let cond = SavedTensor::new(cond);
            move |g: &Tensor, needs: &[bool]| {
                let c = cond.get();
                Ok(vec![
                    needs[0].then(|| routed_grad(c, g, true, &sa)).transpose()?,
                    needs[1]
                        .then(|| routed_grad(c, g, false, &sb))
                        .transpose()?,
                ])
            }
        }))
    }

    /// `value` where `mask` is set, self elsewhere; the mask (U8) broadcasts with self.
    /// Backward: the gradient with the filled positions zeroed.
    #[track_caller]
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        let fill = scalar_like(self, value, "masked_fill")?;
        let out = where_forward(mask, &fill, self, "masked_fill")?;
        let shape = self.shape().to_vec();
        Ok(record("masked_fill", &[self], out, |_, _| {
            let mask = SavedTensor::new(mask);
            move |g: &Tensor, _: &[bool]| Ok(vec![Some(routed_grad(mask.get(), g, false, &shape)?)])
        }))
    }
}
