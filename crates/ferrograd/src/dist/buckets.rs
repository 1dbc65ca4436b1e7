//! Gradient buckets of data-parallel training: which parameters share one all-reduce
//! (`bucket_assignment`, PyTorch's `_compute_bucket_assignment_by_size`), and the flat
//! buffer of one bucket whose slices are the parameters' `.grad` (`Bucket`). Not here: when
//! a bucket is reduced (ddp.rs).

use crate::autograd::no_grad;
use crate::base::{Error, Result};
use crate::memory::Category;
use crate::tensor::{DType, Device, Tensor};

/// PyTorch's cap on a bucket (reducer.hpp `kDefaultBucketBytesCap`).
pub const DEFAULT_BUCKET_BYTES_CAP: usize = 25 * 1024 * 1024;
/// PyTorch's cap on the first bucket (`kDefaultFirstBucketBytes`): the first gradients
/// ready are reduced early instead of waiting for 25 MiB of others.
pub const DEFAULT_FIRST_BUCKET_BYTES: usize = 1024 * 1024;

/// What bucketing needs to know of one parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketItem {
    pub bytes: usize,
    pub dtype: DType,
    pub device: Device,
}

impl BucketItem {
    pub fn of(t: &Tensor) -> BucketItem {
        BucketItem {
            bytes: t.nbytes(),
            dtype: t.dtype(),
            device: t.device(),
        }
    }
}

/// One bucket being filled for a (dtype, device).
struct Open {
    key: (DType, Device),
    indices: Vec<usize>,
    bytes: usize,
    /// Which of the size limits applies to this key's current bucket.
    limit: usize,
}

/// PyTorch's `compute_bucket_assignment_by_size` (reducer.cpp): walks `items` in order,
/// one open bucket per (dtype, device), and closes a bucket once its bytes reach the
/// current limit; each key moves to the next limit after closing one (the last repeats).
/// `order[i]` is the parameter index of `items[i]` (None: i itself). Without an order the
/// buckets are sorted by their smallest index, as PyTorch does. The buckets still open at
/// the end come last, in the order their key was first seen (PyTorch's come in its hash
/// map's order, which only differs with several dtypes or devices).
pub fn bucket_assignment(
    items: &[BucketItem],
    limits: &[usize],
    order: Option<&[usize]>,
) -> Result<Vec<Vec<usize>>> {
    check_assignment_args(items.len(), limits, order)?;
    let mut closed: Vec<Vec<usize>> = Vec::new();
    let mut open: Vec<Open> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let index = order.map_or(i, |o| o[i]);
        let key = (item.dtype, item.device);
        let k = match open.iter().position(|b| b.key == key) {
            Some(k) => k,
            None => {
                open.push(Open {
                    key,
                    indices: Vec::new(),
                    bytes: 0,
                    limit: 0,
                });
                open.len() - 1
            }
        };
        let b = &mut open[k];
        b.indices.push(index);
        b.bytes += item.bytes;
        if b.bytes >= limits[b.limit] {
            closed.push(std::mem::take(&mut b.indices));
            b.bytes = 0;
            b.limit = (b.limit + 1).min(limits.len() - 1);
        }
    }
    closed.extend(
        open.into_iter()
            .map(|b| b.indices)
            .filter(|v| !v.is_empty()),
    );
    if order.is_none() {
        closed.sort_by_key(|b| b.iter().copied().min());
    }
    Ok(closed)
}

fn check_assignment_args(n: usize, limits: &[usize], order: Option<&[usize]>) -> Result<()> {
    if limits.is_empty() || limits.contains(&0) {
        return Err(Error::invalid(
            "bucket_assignment",
            "give at least one bucket size limit, each above zero",
        ));
    }
    if let Some(o) = order {
        let mut seen = vec![false; n];
        let ok = o.len() == n
            && o.iter()
                .all(|&i| i < n && !std::mem::replace(&mut seen[i], true));
        if !ok {
            return Err(Error::invalid(
                "bucket_assignment",
                format!("the order must name each of the {n} parameters once"),
            ));
        }
    }
    Ok(())
}

/// The buckets DDP starts with: filled in reverse parameter order (the order in which
/// backward usually finishes gradients), first bucket 1 MiB, then 25 MiB — the assignment
/// PyTorch's rebuild makes when gradients do arrive in that order. (PyTorch 2.11 itself
/// starts with one bucket per dtype when find_unused_parameters is off and buckets by size
/// only at the rebuild; starting sized lets the first step overlap too.)
pub fn initial_assignment(items: &[BucketItem], caps: [usize; 2]) -> Result<Vec<Vec<usize>>> {
    let reversed: Vec<usize> = (0..items.len()).rev().collect();
    let in_order: Vec<BucketItem> = reversed.iter().map(|&i| items[i]).collect();
    bucket_assignment(&in_order, &caps, Some(&reversed))
}

/// The rebuild after the first step: the same limits over the order in which gradients
/// actually arrived (`arrival[k]` = the k-th parameter whose gradient was ready).
pub fn rebuilt_assignment(
    items: &[BucketItem],
    arrival: &[usize],
    caps: [usize; 2],
) -> Result<Vec<Vec<usize>>> {
    let in_order: Vec<BucketItem> = arrival
        .iter()
        .map(|&i| {
            items.get(i).copied().ok_or_else(|| {
                Error::invalid(
                    "DDP",
                    format!("gradient arrival names parameter {i}, which does not exist"),
                )
            })
        })
        .collect::<Result<_>>()?;
    bucket_assignment(&in_order, &caps, Some(arrival))
}

/// One bucket: a flat buffer (n,) of one dtype whose consecutive slices are the gradients
/// of `members`, in order. The buffer counts as `gradient`.
pub struct Bucket {
    pub flat: Tensor,
    pub members: Vec<usize>,
    /// Element offset of each member's slice.
    pub offsets: Vec<usize>,
}

impl Bucket {
    pub fn new(params: &[Tensor], members: Vec<usize>) -> Result<Bucket> {
        let first = params[members[0]].clone();
        let mut offsets = Vec::with_capacity(members.len());
        let mut n = 0;
        for &m in &members {
            offsets.push(n);
            n += params[m].numel();
        }
        let flat = Tensor::alloc(
            &[n],
            first.dtype(),
            first.device(),
            Category::Gradient,
            "ddp_bucket",
        )?;
        Ok(Bucket {
            flat,
            members,
            offsets,
        })
    }

    /// Member `k`'s slice, shaped like its parameter (a view: no copy).
    pub fn view(&self, k: usize, param: &Tensor) -> Result<Tensor> {
        let _g = no_grad();
        self.flat
            .narrow(0, self.offsets[k], param.numel())?
            .reshape(param.shape())
    }

    pub fn nbytes(&self) -> usize {
        self.flat.nbytes()
    }
}
