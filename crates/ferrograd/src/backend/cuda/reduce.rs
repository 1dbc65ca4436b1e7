//! CUDA reductions (sum, max, min, argmax) over any sorted set of dims of a strided float
//! input, accumulated in f64 (kernels/reduce.cu). The host splits the input into the kept
//! dims (one output each) and the reduced dims, merges what memory allows, and picks a
//! kernel by shape: a thread per output for short reductions, a block per output for rows, a
//! 32-output tile for columns (a tile of 32 16-byte vectors for the sum of whole-vector
//! rows, every bias gradient); long reductions with few outputs are split across blocks and
//! finished by a second kernel in a fixed order (deterministic sums).

use cudarc::driver::LaunchConfig;

use super::launch::{Arg, Module, Strided, dev_ptr, dtype_code, launch, suffix, temp};
use super::{CudaDevice, codes};
use crate::backend::check::within as check_bounds;
use crate::backend::{ReduceKernels, ReduceOp, Storage, View};
use crate::base::Result;

pub(super) static KERNELS: Module = Module::new("reduce", include_str!("kernels/reduce.cu"));

/// At most this many reduced elements: one thread per output.
const THREAD_MAX_IN: usize = 32;
/// Grid size cap; kernels loop over the remaining work items.
const MAX_GRID: usize = 1 << 20;
/// Aim for about this many blocks when splitting long reductions (a few per SM).
const TARGET_BLOCKS: usize = 1024;
/// Least reduced elements per split of a row (block) reduction.
const ROW_SPLIT_MIN: usize = 4096;
/// Least reduced elements per split of a column (tile) reduction.
const COL_SPLIT_MIN: usize = 256;
/// Least reduced elements per split of a vector column reduction: each thread then reads at
/// least 8 rows, and a (8192, 768) bias gradient still spreads over a few hundred blocks.
const COL_VEC_SPLIT_MIN: usize = 64;
/// Outputs per column tile, and the rows of threads that share its reduced elements
/// (COLS_X, COLS_Y in reduce.cu).
const COLS_X: usize = 32;
const COLS_Y: usize = 8;

/// The op code (R_* in codes.rs).
fn reduce_code(op: ReduceOp) -> i32 {
    match op {
        ReduceOp::Sum => codes::R_SUM,
        ReduceOp::Max => codes::R_MAX,
        ReduceOp::Min => codes::R_MIN,
        ReduceOp::ArgMax => codes::R_ARGMAX,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Thread,
    Block,
    Cols,
    /// reduce_cols_vec_*: sums of rows of `ld`-spaced, whole-vector rows.
    ColsVec {
        ld: usize,
    },
}

/// The kernel and how many splits (each `chunk` reduced elements) it runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    kernel: Kernel,
    splits: usize,
    chunk: usize,
}

/// Chooses a kernel for `x` reduced to its `outer` dims (n_out outputs) over its `inner`
/// ones (n_in elements each), as split_dims gives them.
fn plan_of(
    op: ReduceOp,
    x: View,
    (outer, inner): (&Strided, &Strided),
    n_out: usize,
    n_in: usize,
) -> Plan {
    match vector_rows(op, x, outer, inner) {
        Some(ld) if n_in > THREAD_MAX_IN => {
            let units = (n_out / (16 / x.storage.dtype().size_in_bytes())).div_ceil(COLS_X);
            split(Kernel::ColsVec { ld }, units, n_in, COL_VEC_SPLIT_MIN)
        }
        _ => plan(
            n_out,
            n_in,
            inner.inner_stride() == Some(1),
            outer.inner_stride() == Some(1),
        ),
    }
}

/// The row spacing `ld` (in elements) when a sum runs over the rows of a matrix whose rows
/// are whole 16-byte vectors from a 16-byte boundary: one contiguous kept dim, one reduced
/// dim. The allocator's blocks start on 16-byte boundaries, so the layout decides (and the
/// planner, which has no addresses, decides the same).
fn vector_rows(op: ReduceOp, x: View, outer: &Strided, inner: &Strided) -> Option<usize> {
    let size = x.storage.dtype().size_in_bytes();
    let per_vector = 16 / size;
    let (n_out, ld) = (outer.shape[0] as usize, inner.strides[0]);
    let fits = op == ReduceOp::Sum
        && outer.rank == 1
        && inner.rank == 1
        && outer.strides[0] == 1
        && ld >= n_out as i64
        && n_out.is_multiple_of(per_vector)
        && (ld as usize).is_multiple_of(per_vector)
        && (outer.offset as usize * size).is_multiple_of(16);
    fits.then_some(ld as usize)
}

/// Chooses a kernel. `inner_unit`: the innermost reduced dim is contiguous (rows);
/// `outer_unit`: neighbouring outputs read neighbouring elements (columns).
fn plan(n_out: usize, n_in: usize, inner_unit: bool, outer_unit: bool) -> Plan {
    let whole = |kernel| Plan {
        kernel,
        splits: 1,
        chunk: n_in.max(1),
    };
    if n_in <= THREAD_MAX_IN {
        return whole(Kernel::Thread);
    }
    let (kernel, units, min_chunk) = if !inner_unit && outer_unit {
        (Kernel::Cols, n_out.div_ceil(COLS_X), COL_SPLIT_MIN)
    } else {
        (Kernel::Block, n_out, ROW_SPLIT_MIN)
    };
    split(kernel, units, n_in, min_chunk)
}

/// `kernel` over `units` work units (outputs or tiles), each reduction split into chunks of
/// at least `min_chunk` elements until about TARGET_BLOCKS items exist.
fn split(kernel: Kernel, units: usize, n_in: usize, min_chunk: usize) -> Plan {
    if units >= TARGET_BLOCKS / 2 {
        return Plan {
            kernel,
            splits: 1,
            chunk: n_in.max(1),
        };
    }
    let splits = n_in
        .div_ceil(min_chunk)
        .min(TARGET_BLOCKS.div_ceil(units.max(1)))
        .max(1);
    let chunk = n_in.div_ceil(splits).max(1);
    Plan {
        kernel,
        // no empty trailing splits
        splits: n_in.div_ceil(chunk).max(1),
        chunk,
    }
}

/// Threads per block for a block reduction over `n` elements: a power of two in 32..=256.
fn block_threads(n: usize) -> u32 {
    n.next_power_of_two().clamp(32, 256) as u32
}

fn config(blocks: usize, threads: (u32, u32)) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.clamp(1, MAX_GRID) as u32, 1, 1),
        block_dim: (threads.0, threads.1, 1),
        shared_mem_bytes: 0,
    }
}

/// Kept and reduced dims of a view: (outer, inner, n_out, n_in).
fn split_dims(x: View, dims: &[usize]) -> Result<(Strided, Strided, usize, usize)> {
    let (shape, strides) = (x.layout.shape(), x.layout.strides());
    let rank = shape.len();
    let pick = |keep: bool| -> (Vec<usize>, Vec<isize>) {
        (0..rank)
            .filter(|d| dims.contains(d) != keep)
            .map(|d| (shape[d], strides[d]))
            .unzip()
    };
    let (os, ost) = pick(true);
    let (is, ist) = pick(false);
    let (n_out, n_in) = (os.iter().product(), is.iter().product());
    let outer = Strided::new("reduce", x.layout.offset(), &os, &ost)?;
    let inner = Strided::new("reduce", 0, &is, &ist)?;
    Ok((outer, inner, n_out, n_in))
}

/// f64 values then i64 indices, one per (output, split); sums of whole-vector rows need no
/// indices.
fn partials_bytes(kernel: Kernel, parts: usize) -> usize {
    match kernel {
        Kernel::ColsVec { .. } => parts * 8,
        _ => parts * 16,
    }
}

/// The bytes of the partial results a reduction of `x` over `dims` takes, if it splits its
/// inputs (the planner counts the same block).
pub(crate) fn scratch_bytes(op: ReduceOp, x: View, dims: &[usize]) -> Result<Option<usize>> {
    let (outer, inner, n_out, n_in) = split_dims(x, dims)?;
    if n_out == 0 {
        return Ok(None);
    }
    let p = plan_of(op, x, (&outer, &inner), n_out, n_in);
    Ok((p.splits > 1).then(|| partials_bytes(p.kernel, n_out * p.splits)))
}

pub(crate) fn reduce(
    d: &CudaDevice,
    op: ReduceOp,
    x: View,
    dims: &[usize],
    out: &Storage,
) -> Result<()> {
    let suffix = suffix("reduce", x.storage.dtype())?;
    let odt = out.dtype();
    // Validated by the family (reduce.rs): dims, argmax's single dim, the output's dtype
    // and length.
    let (outer, inner, n_out, n_in) = split_dims(x, dims)?;
    if n_out == 0 {
        return Ok(());
    }
    check_bounds("reduce", &x)?;
    let p = plan_of(op, x, (&outer, &inner), n_out, n_in);
    let args = Args {
        op: reduce_code(op),
        x: dev_ptr(d, "reduce", x.storage)?,
        x_size: x.storage.dtype().size_in_bytes(),
        outer,
        inner,
        n_out: n_out as i64,
        n_in: n_in as i64,
        out: dev_ptr(d, "reduce", out)?,
        odt: dtype_code(odt),
    };
    if p.splits == 1 {
        return launch_main(d, suffix, p, &args, None);
    }
    let parts = n_out * p.splits;
    let scratch = temp(d, partials_bytes(p.kernel, parts), "cuda temp")?;
    let pv = scratch.addr();
    if let Kernel::ColsVec { .. } = p.kernel {
        launch_main(d, suffix, p, &args, Some((pv, 0)))?;
        return launch_cols_finish(d, p.splits, &args, pv);
    }
    let pi = pv + (parts * 8) as u64;
    launch_main(d, suffix, p, &args, Some((pv, pi)))?;
    launch_finish(d, p.splits, &args, pv, pi)
    // `scratch` is freed here; later users of the block queue behind these kernels.
}

/// Arguments every reduction kernel takes.
struct Args {
    op: i32,
    x: u64,
    /// Bytes per element of x.
    x_size: usize,
    outer: Strided,
    inner: Strided,
    n_out: i64,
    n_in: i64,
    out: u64,
    odt: i32,
}

/// Launches the planned kernel; with `parts` it writes partials there instead of `out`.
fn launch_main(
    d: &CudaDevice,
    suffix: &str,
    p: Plan,
    a: &Args,
    parts: Option<(u64, u64)>,
) -> Result<()> {
    let n_out = a.n_out as usize;
    if let Kernel::ColsVec { ld } = p.kernel {
        return launch_cols_vec(d, suffix, p, a, ld, parts);
    }
    let (name, cfg) = match p.kernel {
        Kernel::Thread => (
            format!("reduce_thread_{suffix}"),
            CudaDevice::grid_1d(n_out),
        ),
        Kernel::Block => (
            format!("reduce_block_{suffix}"),
            config(n_out * p.splits, (block_threads(p.chunk), 1)),
        ),
        Kernel::Cols | Kernel::ColsVec { .. } => (
            format!("reduce_cols_{suffix}"),
            config(
                n_out.div_ceil(COLS_X) * p.splits,
                (COLS_X as u32, COLS_Y as u32),
            ),
        ),
    };
    // The kernel's signature in reduce.cu (reduce_thread_* takes no split or partial
    // arguments); out holds n_out elements, the partial buffers n_out * splits entries each.
    let mut args = vec![
        Arg::I32(a.op),
        Arg::Ptr(a.x),
        Arg::Struct(&a.outer),
        Arg::Struct(&a.inner),
        Arg::I64(a.n_out),
        Arg::I64(a.n_in),
    ];
    let (pv, pi) = parts.unwrap_or((0, 0));
    if p.kernel != Kernel::Thread {
        args.extend([Arg::I64(p.splits as i64), Arg::I64(p.chunk as i64)]);
    }
    args.extend([Arg::Ptr(a.out), Arg::I32(a.odt)]);
    if p.kernel != Kernel::Thread {
        args.extend([Arg::Ptr(pv), Arg::Ptr(pi), Arg::I32(parts.is_some() as i32)]);
    }
    launch(d, &KERNELS, &name, cfg, &args)
}

/// reduce_cols_vec_*: x's first element is at its view's offset, rows `ld` apart.
fn launch_cols_vec(
    d: &CudaDevice,
    suffix: &str,
    p: Plan,
    a: &Args,
    ld: usize,
    parts: Option<(u64, u64)>,
) -> Result<()> {
    let size = (a.x_size) as u64;
    let x = a.x + a.outer.offset as u64 * size;
    let per_vector = 16 / a.x_size;
    let tiles = (a.n_out as usize / per_vector).div_ceil(COLS_X);
    // reduce_cols_vec_*(const S*, i64, i64, i64, i64, i64, void*, int, double*, int)
    let args = [
        Arg::Ptr(x),
        Arg::I64(ld as i64),
        Arg::I64(a.n_out),
        Arg::I64(a.n_in),
        Arg::I64(p.splits as i64),
        Arg::I64(p.chunk as i64),
        Arg::Ptr(a.out),
        Arg::I32(a.odt),
        Arg::Ptr(parts.map_or(0, |(pv, _)| pv)),
        Arg::I32(parts.is_some() as i32),
    ];
    let cfg = config(tiles * p.splits, (COLS_X as u32, COLS_Y as u32));
    launch(
        d,
        &KERNELS,
        &format!("reduce_cols_vec_{suffix}"),
        cfg,
        &args,
    )
}

fn launch_finish(d: &CudaDevice, splits: usize, a: &Args, pv: u64, pi: u64) -> Result<()> {
    // reduce_finish(int, const double*, const i64*, i64, i64, void*, int)
    let args = [
        Arg::I32(a.op),
        Arg::Ptr(pv),
        Arg::Ptr(pi),
        Arg::I64(a.n_out),
        Arg::I64(splits as i64),
        Arg::Ptr(a.out),
        Arg::I32(a.odt),
    ];
    let cfg = config(a.n_out as usize, (block_threads(splits), 1));
    launch(d, &KERNELS, "reduce_finish", cfg, &args)
}

/// reduce_cols_finish: the split-major partials of reduce_cols_vec_*, added in split order.
fn launch_cols_finish(d: &CudaDevice, splits: usize, a: &Args, pv: u64) -> Result<()> {
    // reduce_cols_finish(const double*, i64, i64, void*, int)
    let args = [
        Arg::Ptr(pv),
        Arg::I64(a.n_out),
        Arg::I64(splits as i64),
        Arg::Ptr(a.out),
        Arg::I32(a.odt),
    ];
    let n = a.n_out as usize;
    let cfg = config(n.div_ceil(COLS_X), (COLS_X as u32, COLS_Y as u32));
    launch(d, &KERNELS, "reduce_cols_finish", cfg, &args)
}

impl ReduceKernels for CudaDevice {
    fn reduce(&self, op: ReduceOp, x: View, dims: &[usize], out: &Storage) -> Result<()> {
        reduce(self, op, x, dims, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_reductions_use_a_thread_per_output() {
        assert_eq!(plan(1000, 3, true, false).kernel, Kernel::Thread);
        assert_eq!(plan(1, 32, false, false).kernel, Kernel::Thread);
    }

    #[test]
    fn rows_use_blocks_and_columns_use_tiles() {
        assert_eq!(
            plan(4096, 4096, true, false),
            Plan {
                kernel: Kernel::Block,
                splits: 1,
                chunk: 4096
            }
        );
        // bias gradient: (8192, 768) summed over rows
        let p = plan(768, 8192, false, true);
        assert_eq!(p.kernel, Kernel::Cols);
        assert!(p.splits > 1 && p.splits * p.chunk >= 8192);
    }

    #[test]
    fn long_reductions_split_and_cover_every_element() {
        for n_in in [33, 4097, 100_000, 1 << 27] {
            let p = plan(1, n_in, true, false);
            assert!(p.splits >= 1 && p.splits <= TARGET_BLOCKS);
            // every element in exactly one split, no empty split
            assert!(p.splits * p.chunk >= n_in);
            assert!((p.splits - 1) * p.chunk < n_in);
        }
        assert_eq!(plan(1, 1 << 27, true, false).splits, TARGET_BLOCKS);
    }

    #[test]
    fn block_threads_are_warp_multiples() {
        assert_eq!(block_threads(33), 64);
        assert_eq!(block_threads(1), 32);
        assert_eq!(block_threads(1 << 20), 256);
    }
}
