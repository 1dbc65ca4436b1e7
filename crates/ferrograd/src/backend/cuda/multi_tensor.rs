//! The multi-tensor launch shared by the fused optimizer-style kernels (the Adam step, the
//! gradient unscale) and autocast's weight casts: the host uploads one table row per tensor —
//! its device addresses, its element count and the index of its first chunk — and one launch
//! walks the chunks of every tensor, each block finding its tensor by binary search
//! (kernels/optim.cu, kernels/elementwise.cu).
//! Here: grouping tensors by dtype (one launch per dtype), numbering chunks, uploading the
//! table and choosing the grid.

use cudarc::driver::LaunchConfig;

use super::CudaDevice;
use crate::base::{DType, Device};
use crate::base::{Error, Result};
use crate::memory::{Allocation, Category};

/// Threads per block (OPTIM_BLOCK and AMP_BLOCK in optim.cu, CAST_MANY_BLOCK in elementwise.cu).
pub(crate) const BLOCK: u32 = 256;
/// Elements per chunk, a block's unit of work (ADAM_CHUNK, AMP_CHUNK, CAST_CHUNK).
pub(crate) const CHUNK: usize = 4096;
/// Most blocks a launch asks for; further chunks are taken by a grid-stride loop.
const MAX_BLOCKS: usize = 65_535 * 32;

/// One tensor: `A` device addresses (parameter, gradient, state...) and its element count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Row<const A: usize> {
    pub addrs: [u64; A],
    pub n: usize,
}

/// The rows of each dtype, in first-seen order; empty tensors are left out.
pub(crate) struct Groups<const A: usize>(Vec<(DType, Vec<Row<A>>)>);

impl<const A: usize> Groups<A> {
    pub fn new() -> Self {
        Groups(Vec::new())
    }

    pub fn push(&mut self, dtype: DType, row: Row<A>) {
        if row.n == 0 {
            return;
        }
        match self.0.iter_mut().find(|(d, _)| *d == dtype) {
            Some((_, rows)) => rows.push(row),
            None => self.0.push((dtype, vec![row])),
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &(DType, Vec<Row<A>>)> {
        self.0.iter()
    }
}

/// The uploaded table of one launch: pass `addr`, `count` and `chunks` as the kernel's first
/// three arguments and launch with `config()`. Holds the table's block until dropped; a later
/// user of the block is ordered after the launch on the device's single stream.
pub(crate) struct Table {
    pub addr: u64,
    pub count: i32,
    pub chunks: i64,
    /// Where the words uploaded after the table start (`upload_with`; the table's end).
    pub trailer: u64,
    _block: Allocation,
}

impl Table {
    /// Uploads `rows` as `[addrs.., n, first_chunk]` per row (the kernels' entry structs);
    /// None when there is nothing to do.
    pub fn upload<const A: usize>(
        d: &CudaDevice,
        rows: &[Row<A>],
        label: &'static str,
    ) -> Result<Option<Table>> {
        Table::upload_with(d, rows, &[], label)
    }

    /// `upload`, with `trailer` uploaded right after the table in the same copy (a launch's
    /// scalars: one upload instead of two).
    pub fn upload_with<const A: usize>(
        d: &CudaDevice,
        rows: &[Row<A>],
        trailer: &[u64],
        label: &'static str,
    ) -> Result<Option<Table>> {
        let (mut words, chunks) = table_words(rows);
        if chunks == 0 {
            return Ok(None);
        }
        let table_len = words.len();
        words.extend_from_slice(trailer);
        let count = i32::try_from(rows.len())
            .map_err(|_| Error::invalid(label, "more than 2^31 tensors in one launch"))?;
        let block = crate::memory::allocator(Device::Cuda(d.ordinal()))?.malloc(
            words.len() * 8,
            Category::Temporary,
            label,
        )?;
        d.copy_to_device(block.addr(), bytemuck::cast_slice(&words))?;
        Ok(Some(Table {
            addr: block.addr(),
            count,
            chunks: chunks as i64,
            trailer: block.addr() + (table_len * 8) as u64,
            _block: block,
        }))
    }

    pub fn config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((self.chunks as usize).min(MAX_BLOCKS) as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// The table's words, `[addrs.., n, first_chunk]` per row, and the total number of chunks.
fn table_words<const A: usize>(rows: &[Row<A>]) -> (Vec<u64>, usize) {
    let mut words = Vec::with_capacity(rows.len() * (A + 2));
    let mut chunks = 0usize;
    for r in rows {
        words.extend(r.addrs);
        words.extend([r.n as u64, chunks as u64]);
        chunks += r.n.div_ceil(CHUNK);
    }
    (words, chunks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_numbered_across_tensors() {
        let rows: Vec<Row<1>> = [1, 4096, 4097, 10_000]
            .into_iter()
            .map(|n| Row { addrs: [7], n })
            .collect();
        let (words, total) = table_words(&rows);
        assert_eq!(total, 1 + 1 + 2 + 3);
        let firsts: Vec<u64> = words.chunks(3).map(|w| w[2]).collect();
        assert_eq!(firsts, vec![0, 1, 2, 4]);
        assert_eq!(&words[..3], &[7, 1, 0]);
    }

    #[test]
    fn empty_tensors_are_left_out_and_dtypes_grouped() {
        let mut g = Groups::<1>::new();
        g.push(DType::F32, Row { addrs: [1], n: 3 });
        g.push(DType::F16, Row { addrs: [2], n: 0 });
        g.push(DType::F16, Row { addrs: [3], n: 5 });
        g.push(DType::F32, Row { addrs: [4], n: 1 });
        let seen: Vec<(DType, Vec<u64>)> = g
            .iter()
            .map(|(d, rows)| (*d, rows.iter().map(|r| r.addrs[0]).collect()))
            .collect();
        assert_eq!(seen, vec![(DType::F32, vec![1, 4]), (DType::F16, vec![3])]);
    }
}
