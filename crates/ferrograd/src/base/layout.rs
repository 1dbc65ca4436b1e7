//! Layout = shape + strides (in elements) + offset into the storage. Views (reshape of a
//! contiguous tensor, permute, transpose, narrow, expand) are new layouts over the same
//! storage; nothing here touches data.

use crate::base::{Error, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    shape: Vec<usize>,
    strides: Vec<isize>,
    offset: usize,
}

/// Row-major strides for a shape. Shapes come from `checked_numel`-checked sizes, so the
/// products fit; they saturate rather than wrap if one did not (a stride that large is never
/// walked: the shape has no storage to walk).
pub fn contiguous_strides(shape: &[usize]) -> Vec<isize> {
    let mut strides = vec![0isize; shape.len()];
    let mut acc = 1isize;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(isize::try_from(d.max(1)).unwrap_or(isize::MAX));
    }
    strides
}

/// The element count of `shape`, or an error naming `op` when it does not fit in memory's
/// address space (no overflowed product ever reaches a kernel).
pub fn checked_numel(op: &'static str, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or_else(|| {
            Error::shape(
                op,
                format!("shape {shape:?} has more elements than fit in memory"),
            )
        })
}

/// Resolves a possibly negative dim (PyTorch style: -1 = last) against a rank.
pub fn resolve_dim(op: &'static str, dim: isize, rank: usize) -> Result<usize> {
    // A 0-dim tensor takes dim 0 or -1, as in PyTorch.
    let r = rank.max(1) as isize;
    let d = if dim < 0 { dim + r } else { dim };
    if d < 0 || d >= r {
        return Err(Error::Index {
            op,
            detail: format!("dim {dim} is out of range for a tensor of rank {rank}"),
        });
    }
    Ok(d as usize)
}

/// The shape two shapes broadcast to (numpy/PyTorch rules: align right, 1 stretches).
pub fn broadcast_shape(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i + a.len() >= rank {
            a[i + a.len() - rank]
        } else {
            1
        };
        let db = if i + b.len() >= rank {
            b[i + b.len() - rank]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(Error::shape(
                    op,
                    format!(
                        "shapes {a:?} and {b:?} cannot be broadcast together (dim {i}: {da} vs {db})"
                    ),
                ));
            }
        };
    }
    Ok(out)
}

impl Layout {
    pub fn contiguous(shape: &[usize]) -> Self {
        Layout {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    pub fn new(shape: Vec<usize>, strides: Vec<isize>, offset: usize) -> Self {
        Layout {
            shape,
            strides,
            offset,
        }
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn strides(&self) -> &[isize] {
        &self.strides
    }
    pub fn offset(&self) -> usize {
        self.offset
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Row-major contiguous (size-1 dims may have any stride; a tensor with no elements is
    /// contiguous whatever its strides, as in PyTorch).
    pub fn is_contiguous(&self) -> bool {
        if self.shape.contains(&0) {
            return true;
        }
        let mut expected = 1isize;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected *= d as isize;
        }
        true
    }

    /// A view with dims reordered.
    pub fn permute(&self, dims: &[usize]) -> Result<Layout> {
        let rank = self.rank();
        let mut seen = vec![false; rank];
        if dims.len() != rank
            || dims
                .iter()
                .any(|&d| d >= rank || std::mem::replace(&mut seen[d], true))
        {
            return Err(Error::shape(
                "permute",
                format!(
                    "{dims:?} is not a permutation of the {rank} dims of shape {:?}",
                    self.shape
                ),
            ));
        }
        Ok(Layout {
            shape: dims.iter().map(|&d| self.shape[d]).collect(),
            strides: dims.iter().map(|&d| self.strides[d]).collect(),
            offset: self.offset,
        })
    }

    /// A view of `len` elements of `dim` starting at `start`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Layout> {
        let end = start.checked_add(len);
        if dim >= self.rank() || end.is_none_or(|end| end > self.shape[dim]) {
            return Err(Error::Index {
                op: "narrow",
                detail: format!(
                    "{len} entries from {start} of dim {dim} do not fit in shape {:?}: \
                     start + len must be at most the dim's size",
                    self.shape
                ),
            });
        }
        let mut shape = self.shape.clone();
        shape[dim] = len;
        // A view with no elements keeps the offset: start may point past the storage (the
        // end of an empty dim), and kernels slice from the offset.
        let offset = if shape.contains(&0) {
            self.offset
        } else {
            (self.offset as isize + start as isize * self.strides[dim]) as usize
        };
        Ok(Layout {
            shape,
            strides: self.strides.clone(),
            offset,
        })
    }

    /// A view broadcast to `shape` (stride 0 on stretched dims; new leading dims allowed).
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Layout> {
        if shape.len() < self.rank() {
            return Err(Error::shape(
                "expand",
                format!(
                    "cannot expand shape {:?} to fewer dims {shape:?}",
                    self.shape
                ),
            ));
        }
        checked_numel("expand", shape)?;
        let lead = shape.len() - self.rank();
        let mut strides = vec![0isize; shape.len()];
        for (i, &target) in shape.iter().enumerate().skip(lead) {
            let (d, s) = (self.shape[i - lead], self.strides[i - lead]);
            strides[i] = if d == target {
                s
            } else if d == 1 {
                0
            } else {
                return Err(Error::shape(
                    "expand",
                    format!(
                        "cannot expand shape {:?} to {shape:?}: dim {i} is {d}, not 1",
                        self.shape
                    ),
                ));
            };
        }
        Ok(Layout {
            shape: shape.to_vec(),
            strides,
            offset: self.offset,
        })
    }

    /// A reshape that keeps the storage, possible when the layout is contiguous.
    pub fn reshape_view(&self, shape: &[usize]) -> Option<Layout> {
        if self.is_contiguous() {
            Some(Layout {
                shape: shape.to_vec(),
                strides: contiguous_strides(shape),
                offset: self.offset,
            })
        } else {
            None
        }
    }

    /// Storage offsets of every element in row-major order.
    pub fn offsets(&self) -> StridedOffsets<'_> {
        StridedOffsets::new(self)
    }

    /// The span of storage elements this layout can touch (for bounds checks).
    pub fn max_offset(&self) -> usize {
        if self.numel() == 0 {
            return self.offset;
        }
        let extent: isize = self
            .shape
            .iter()
            .zip(&self.strides)
            .map(|(&d, &s)| (d as isize - 1) * s.max(0))
            .sum();
        (self.offset as isize + extent) as usize
    }
}

/// Iterates storage offsets of a strided layout in row-major order.
pub struct StridedOffsets<'a> {
    layout: &'a Layout,
    index: Vec<usize>,
    next: Option<isize>,
}

impl<'a> StridedOffsets<'a> {
    fn new(layout: &'a Layout) -> Self {
        let next = (layout.numel() > 0).then_some(layout.offset as isize);
        StridedOffsets {
            layout,
            index: vec![0; layout.rank()],
            next,
        }
    }
}

impl Iterator for StridedOffsets<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        let cur = self.next?;
        let (shape, strides) = (&self.layout.shape, &self.layout.strides);
        let mut pos = cur;
        let mut dim = shape.len();
        loop {
            if dim == 0 {
                self.next = None;
                break;
            }
            dim -= 1;
            self.index[dim] += 1;
            pos += strides[dim];
            if self.index[dim] < shape[dim] {
                self.next = Some(pos);
                break;
            }
            pos -= strides[dim] * shape[dim] as isize;
            self.index[dim] = 0;
        }
        Some(cur as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_of_transposed_view() {
        let l = Layout::contiguous(&[2, 3]).permute(&[1, 0]).unwrap();
        assert_eq!(l.offsets().collect::<Vec<_>>(), vec![0, 3, 1, 4, 2, 5]);
        assert!(!l.is_contiguous());
    }

    #[test]
    fn broadcast_shapes() {
        assert_eq!(
            broadcast_shape("t", &[2, 1, 4], &[3, 1]).unwrap(),
            vec![2, 3, 4]
        );
        assert!(broadcast_shape("t", &[2, 3], &[4]).is_err());
    }

    #[test]
    fn expand_uses_zero_strides() {
        let l = Layout::contiguous(&[3, 1])
            .broadcast_to(&[2, 3, 4])
            .unwrap();
        assert_eq!(l.strides(), &[0, 1, 0]);
        assert_eq!(l.offsets().take(5).collect::<Vec<_>>(), vec![0, 0, 0, 0, 1]);
    }
}
