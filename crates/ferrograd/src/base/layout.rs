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

/// Strides of `new` viewing the same elements as (`old`, `strides`) without a copy, or None
/// when a merged run of dims is not evenly spaced. Old dims are grouped from the right into
/// runs that step as one; each run must cover exactly a run of new dims.
fn view_strides(old: &[usize], strides: &[isize], new: &[usize]) -> Option<Vec<isize>> {
    if old.contains(&0) || new.contains(&0) {
        return Some(contiguous_strides(new));
    }
    let mut out = vec![0isize; new.len()];
    let mut view_d = new.len() as isize - 1;
    let mut base = strides.last().copied().unwrap_or(1);
    let (mut old_numel, mut new_numel) = (1usize, 1usize);
    for d in (0..old.len()).rev() {
        old_numel *= old[d];
        let run_ends = d == 0 || (old[d - 1] != 1 && strides[d - 1] != old_numel as isize * base);
        if !run_ends {
            continue;
        }
        while view_d >= 0 && (new_numel < old_numel || new[view_d as usize] == 1) {
            out[view_d as usize] = new_numel as isize * base;
            new_numel *= new[view_d as usize];
            view_d -= 1;
        }
        if new_numel != old_numel {
            return None;
        }
        if d > 0 {
            base = strides[d - 1];
            old_numel = 1;
            new_numel = 1;
        }
    }
    // Leading size-1 dims of the new shape take any stride.
    while view_d >= 0 {
        out[view_d as usize] = 1;
        view_d -= 1;
    }
    Some(out)
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

    /// A reshape that keeps the storage, when one exists: each run of old dims that step
    /// through memory as one (a contiguous tensor, or rows padded to an aligned stride) may be
    /// split or merged freely; dims are never merged across a gap (PyTorch's `view` rule).
    pub fn reshape_view(&self, shape: &[usize]) -> Option<Layout> {
        if self.is_contiguous() {
            return Some(Layout {
                shape: shape.to_vec(),
                strides: contiguous_strides(shape),
                offset: self.offset,
            });
        }
        let strides = view_strides(&self.shape, &self.strides, shape)?;
        Some(Layout {
            shape: shape.to_vec(),
            strides,
            offset: self.offset,
        })
    }

    /// The storage step between consecutive rows of the last dim, when every element is
    /// reached as `offset + row · step + col` (a contiguous tensor, or rows padded to an
    /// aligned stride: the layout the GEMM gives wide outputs); None otherwise.
    pub fn row_stride(&self) -> Option<usize> {
        let (&cols, lead) = self.shape.split_last()?;
        let cols_ok = cols <= 1 || self.strides[self.rank() - 1] == 1;
        let rows: usize = lead.iter().product();
        if !cols_ok {
            return None;
        }
        if rows <= 1 {
            return Some(cols);
        }
        let merged = view_strides(lead, &self.strides[..lead.len()], &[rows])?;
        usize::try_from(merged[0]).ok().filter(|&s| s >= cols)
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

    /// Rows padded to a stride of 8: (6, 5) views as (2, 3, 5) and back, but merging a row
    /// with its neighbour crosses the gap.
    #[test]
    fn padded_rows_reshape_as_views_without_crossing_the_gap() {
        let padded = Layout::new(vec![6, 5], vec![8, 1], 3);
        assert_eq!(padded.row_stride(), Some(8));
        let split = padded.reshape_view(&[2, 3, 5]).unwrap();
        assert_eq!(split.strides(), &[24, 8, 1]);
        assert_eq!(split.offset(), 3);
        assert_eq!(split.row_stride(), Some(8));
        assert_eq!(split.reshape_view(&[6, 5]).unwrap().strides(), &[8, 1]);
        assert_eq!(
            padded.reshape_view(&[6, 5, 1]).unwrap().strides(),
            &[8, 1, 1]
        );
        assert!(padded.reshape_view(&[30]).is_none());
        assert!(padded.reshape_view(&[3, 10]).is_none());
        let offsets: Vec<usize> = split.offsets().collect();
        let direct: Vec<usize> = padded.offsets().collect();
        assert_eq!(offsets, direct);
    }

    #[test]
    fn row_stride_needs_unit_columns_and_evenly_spaced_rows() {
        assert_eq!(Layout::contiguous(&[4, 7]).row_stride(), Some(7));
        assert_eq!(Layout::contiguous(&[7]).row_stride(), Some(7));
        let t = Layout::contiguous(&[4, 7]).permute(&[1, 0]).unwrap();
        assert_eq!(t.row_stride(), None);
        // (2, 3, 5) whose batch step is not 3 rows: not one row stride.
        assert_eq!(
            Layout::new(vec![2, 3, 5], vec![40, 8, 1], 0).row_stride(),
            None
        );
    }
}
