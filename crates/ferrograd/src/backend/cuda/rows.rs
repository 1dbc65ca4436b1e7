//! CUDA launchers of the row family (backend/rows.rs; kernels in kernels/rows.cu): softmax
//! and layer norm with their backwards, one block per row (layer norms of rows up to 1,024
//! wide: a warp per row, which also sums the parameter gradients). Arguments arrive validated.
//! Semantics and the dtypes of the statistics follow the CPU reference (backend/cpu/rows.rs).
//! Sums across rows (weight gradients) add fixed partitions in a fixed order: results do not
//! depend on scheduling. A layer norm whose output (and output gradient) is f16/bf16 over f32
//! rows runs kernels named by both dtypes (`layer_norm_fwd_f32_bf16`...).

use cudarc::driver::LaunchConfig;

use super::launch::{
    Arg, BLOCK, Module, addr, float_code, i64_of, launch, quads_aligned, rows_cfg, suffix, temp,
};
use super::{CudaDevice, ptr};
use crate::backend::rows::{LayerNorm, LayerNormBackward, RowKernels, Softmax, SoftmaxBackward};
use crate::backend::{View, rows_cols};
use crate::base::{DType, Result};

/// rows.cu compiled once per dtype of the rows (the f32 module also holds the layer norms
/// with f16/bf16 outputs): a run compiles only the row kernels of the dtypes it uses, and
/// compiling all of them at once took NVRTC 18 s on a 2-core host.
pub(super) static KERNELS: [Module; 4] = [
    Module::with_defines("rows_f32", "#define ROWS_F32\n", SOURCE),
    Module::with_defines("rows_f64", "#define ROWS_F64\n", SOURCE),
    Module::with_defines("rows_f16", "#define ROWS_F16\n", SOURCE),
    Module::with_defines("rows_bf16", "#define ROWS_BF16\n", SOURCE),
];
const SOURCE: &str = include_str!("kernels/rows.cu");

/// The module with the row kernels of rows of `dtype`.
fn kernels(op: &'static str, dtype: DType) -> Result<&'static Module> {
    let i = match dtype {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        // suffix() names the error for any other dtype.
        other => return suffix(op, other).map(|_| &KERNELS[0]),
    };
    Ok(&KERNELS[i])
}

impl RowKernels for CudaDevice {
    fn softmax(&self, a: &Softmax) -> Result<()> {
        softmax(self, a)
    }
    fn softmax_backward(&self, a: &SoftmaxBackward) -> Result<()> {
        softmax_backward(self, a)
    }
    fn layer_norm(&self, a: &LayerNorm) -> Result<()> {
        layer_norm(self, a)
    }
    fn layer_norm_backward(&self, a: &LayerNormBackward) -> Result<()> {
        layer_norm_backward(self, a)
    }
    fn layer_norm_backward_writes_half(&self, a: &LayerNormBackward) -> bool {
        warp_slots(a.x.storage.dtype(), rows_cols(a.x.layout).1).is_some()
    }
    fn layer_norm_backward_sums_half(&self, a: &LayerNormBackward) -> bool {
        sums_half(a)
    }
}

/// The address of an optional operand; 0 (a null pointer) when absent.
fn optional(v: &Option<View>) -> Result<u64> {
    v.as_ref().map_or(Ok(0), addr)
}

// ---- softmax ----------------------------------------------------------------------------------

fn softmax(d: &CudaDevice, a: &Softmax) -> Result<()> {
    let (log, s) = (a.log, suffix("softmax", a.x.storage.dtype())?);
    let (rows, n) = rows_cols(a.x.layout);
    let (x, y) = (addr(&a.x)?, ptr(a.y)?);
    if rows * n == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(y),
        i64_of(rows),
        i64_of(n),
        Arg::I32(log as i32),
    ];
    launch(
        d,
        kernels("softmax", a.x.storage.dtype())?,
        &format!("softmax_fwd_{s}"),
        rows_cfg(rows),
        &args,
    )
}

fn softmax_backward(d: &CudaDevice, a: &SoftmaxBackward) -> Result<()> {
    let (log, s) = (a.log, suffix("softmax_backward", a.y.storage.dtype())?);
    let (rows, n) = rows_cols(a.y.layout);
    let (y, gy, gx) = (addr(&a.y)?, addr(&a.gy)?, ptr(a.gx)?);
    if rows * n == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(y),
        Arg::Ptr(gy),
        Arg::Ptr(gx),
        i64_of(rows),
        i64_of(n),
        Arg::I32(log as i32),
    ];
    launch(
        d,
        kernels("softmax_backward", a.y.storage.dtype())?,
        &format!("softmax_bwd_{s}"),
        rows_cfg(rows),
        &args,
    )
}

// ---- layer norm -------------------------------------------------------------------------------

/// The kernel-name suffix of a layer norm over rows of `x` with an output (or output
/// gradient) of `y`: x's dtype, then y's when it differs (rows.cu's LN_KERNELS).
fn ln_suffix(op: &'static str, x: DType, y: DType) -> Result<String> {
    let s = suffix(op, x)?;
    if x == y {
        return Ok(s.to_string());
    }
    Ok(format!("{s}_{}", suffix(op, y)?))
}

fn layer_norm(d: &CudaDevice, a: &LayerNorm) -> Result<()> {
    const OP: &str = "layer_norm";
    let dt = a.x.storage.dtype();
    let (eps, s) = (a.eps, ln_suffix(OP, dt, a.y.dtype())?);
    let (rows, n) = rows_cols(a.x.layout);
    let (x, w, b) = (addr(&a.x)?, optional(&a.weight)?, optional(&a.bias)?);
    let (res, sum) = match &a.residual {
        Some(r) => (addr(&r.h)?, ptr(r.sum)?),
        None => (0, 0),
    };
    let (y, mean, rstd) = (ptr(a.y)?, ptr(a.mean)?, ptr(a.rstd)?);
    let sk = float_code(OP, a.mean.dtype())?;
    if rows == 0 {
        return Ok(());
    }
    let mut args = vec![
        Arg::Ptr(x),
        Arg::Ptr(res),
        Arg::Ptr(sum),
        Arg::Ptr(w),
        Arg::Ptr(b),
        Arg::Ptr(y),
        Arg::Ptr(mean),
        Arg::Ptr(rstd),
        Arg::I32(sk),
        i64_of(rows),
        i64_of(n),
        Arg::F64(eps),
    ];
    let (kernel, cfg, warp_rows) = layer_norm_kernel("layer_norm_fwd", &s, dt, rows, n);
    if warp_rows {
        let aligned = [(dt, &[x, sum, w, b][..]), (a.y.dtype(), &[res, y][..])];
        args.push(groups_move_as_vectors(n, &aligned));
    }
    launch(d, kernels(OP, dt)?, &kernel, cfg, &args)
}

/// Threads per block of the warp-per-row kernels (LN_WARP_BLOCK in rows.cu): four rows.
const LN_WARP_BLOCK: u32 = 128;

/// The warp-per-row kernels' `vec` argument: 1 where every group of four elements of a row
/// can move as one vector, that is n is a multiple of four and each address (0: absent) is a
/// multiple of four elements of its dtype.
fn groups_move_as_vectors(n: usize, addrs: &[(DType, &[u64])]) -> Arg<'static> {
    let aligned = addrs.iter().all(|(dt, ps)| quads_aligned(*dt, ps));
    Arg::I32((n.is_multiple_of(4) && aligned) as i32)
}

/// Registers per lane of the warp-per-row layer norm kernels (PER in rows.cu).
const WARP_ROW_SLOTS: [usize; 4] = [8, 16, 24, 32];

/// `{stem}_warp{PER}_{s}` with four rows (one per warp) to a block of LN_WARP_BLOCK threads
/// when a row fits a warp's registers and the dtype has those kernels; `{stem}_{s}` with a
/// block per row otherwise. The flag says which: the warp-per-row kernels take more arguments.
fn layer_norm_kernel(
    stem: &str,
    s: &str,
    dtype: DType,
    rows: usize,
    n: usize,
) -> (String, LaunchConfig, bool) {
    match warp_slots(dtype, n) {
        Some(per) => {
            let warps = (LN_WARP_BLOCK / 32) as usize;
            let mut cfg = rows_cfg(rows.div_ceil(warps));
            cfg.block_dim.0 = LN_WARP_BLOCK;
            (format!("{stem}_warp{per}_{s}"), cfg, true)
        }
        None => (format!("{stem}_{s}"), rows_cfg(rows), false),
    }
}

/// PER of the warp-per-row kernels for rows of `n` elements of `dtype`, if they take them
/// (f64 rows have none).
fn warp_slots(dtype: DType, n: usize) -> Option<usize> {
    let per = WARP_ROW_SLOTS.iter().find(|&&p| 32 * p >= n).copied();
    per.filter(|_| dtype != DType::F64)
}

/// SMs of an H100 or H200: the warp-per-row backward that also sums the parameter gradients
/// runs one grid's worth of blocks per SM slot, each writing one partial. The count depends on
/// the shape and dtypes alone (not the device), so the sums and the planner's bytes do too.
const PARAM_SMS: usize = 132;

/// Blocks per SM the warp-per-row backward runs (its launch bounds in rows.cu, BWD24 of
/// LN_WARP_SIZES, where one is set; LN_HALF_TOO_MIN holds the variant that also writes gx
/// in half precision to the same): four for f32 rows with bf16 gradients at PER 24, else three.
fn ln_bwd_blocks_per_sm(rows: DType, grads: DType, per: usize) -> usize {
    if (rows, grads, per) == (DType::F32, DType::BF16, 24) {
        4
    } else {
        3
    }
}

/// Blocks per SM of the warp-per-row backward these arguments take (three where no such
/// kernel runs; the grid is then another).
fn bwd_blocks_per_sm(a: &LayerNormBackward) -> usize {
    let (dtype, g) = (a.x.storage.dtype(), a.gy.storage.dtype());
    let n = rows_cols(a.x.layout).1;
    warp_slots(dtype, n).map_or(3, |per| ln_bwd_blocks_per_sm(dtype, g, per))
}

/// Blocks of the warp-per-row backward that also sums the parameter gradients: one per four
/// rows, at most as many as the SMs run at once.
fn fused_param_blocks(rows: usize, per_sm: usize) -> usize {
    rows.div_ceil((LN_WARP_BLOCK / 32) as usize)
        .clamp(1, PARAM_SMS * per_sm)
}

fn layer_norm_backward(d: &CudaDevice, a: &LayerNormBackward) -> Result<()> {
    const OP: &str = "layer_norm_backward";
    let dtype = a.x.storage.dtype();
    let s = ln_suffix(OP, dtype, a.gy.storage.dtype())?;
    let (rows, n) = rows_cols(a.x.layout);
    let (x, w) = (addr(&a.x)?, optional(&a.weight)?);
    let (mean, rstd) = (addr(&a.mean)?, addr(&a.rstd)?);
    let sk = float_code(OP, a.mean.storage.dtype())?;
    let (gy, gx) = (addr(&a.gy)?, ptr(a.gx)?);
    let prior = optional(&a.prior)?;
    let grads = ParamGrads {
        x,
        gy,
        gw: a.gweight.map(ptr).transpose()?.unwrap_or(0),
        gb: a.gbias.map(ptr).transpose()?.unwrap_or(0),
        gh: a
            .gx_half_sums
            .filter(|_| sums_half(a))
            .map(ptr)
            .transpose()?
            .unwrap_or(0),
        kind: float_code(OP, dtype)?,
    };
    if rows == 0 {
        // No rows: gx is empty and the parameter gradients stay the caller's zeros.
        return Ok(());
    }
    let stats = [Arg::Ptr(mean), Arg::Ptr(rstd), Arg::I32(sk)];
    let mut args = [
        &[Arg::Ptr(x), Arg::Ptr(w)][..],
        &stats,
        &[
            Arg::Ptr(gy),
            Arg::Ptr(prior),
            Arg::Ptr(gx),
            i64_of(rows),
            i64_of(n),
        ],
    ]
    .concat();
    let (kernel, mut cfg, warp_rows) = layer_norm_kernel("layer_norm_bwd", &s, dtype, rows, n);
    let module = kernels(OP, dtype)?;
    let params = param_scratch_bytes(a);
    // The half copy of gx, which only the warp-per-row kernels write (the entry function
    // converts gx otherwise).
    let half = match a.gx_half {
        Some(h) if warp_rows => Some(ptr(h)?),
        _ => None,
    };
    if !warp_rows {
        launch(d, module, &kernel, cfg, &args)?;
        if params.is_some() {
            layer_norm_param_grads(d, (module, &s), &grads, &stats, rows, n)?;
        }
        return Ok(());
    }
    // The warp kernels sum the parameter gradients' partials as they go (kernels/rows.cu).
    let part = params.map(|bytes| temp(d, bytes, OP)).transpose()?;
    let g = a.gy.storage.dtype();
    let per_sm = bwd_blocks_per_sm(a);
    let blocks = fused_param_blocks(rows, per_sm);
    if part.is_some() {
        cfg.grid_dim.0 = blocks as u32;
        // Two or three f32 rows of n per warp: at most 48 KiB, for rows of 1024.
        cfg.shared_mem_bytes = (LN_WARP_BLOCK / 32) * grads.sum_rows() * n as u32 * 4;
    }
    let kernel = match half {
        Some(h) => {
            // gxh follows gx: rows.cu's `_half_too` kernels.
            args.insert(args.len() - 2, Arg::Ptr(h));
            format!("{kernel}_half_too")
        }
        None => kernel,
    };
    args.push(Arg::Ptr(part.as_ref().map_or(0, |p| p.addr())));
    let aligned = [
        (dtype, &[x, w, prior, gx][..]),
        (g, &[gy, half.unwrap_or(0)][..]),
    ];
    args.push(groups_move_as_vectors(n, &aligned));
    if half.is_some() {
        args.push(Arg::I32(i32::from(grads.gh != 0)));
    }
    launch(d, module, &kernel, cfg, &args)?;
    match part {
        Some(part) => params_finish(d, (module, WARP_FINISH), part.addr(), blocks, n, &grads),
        None => Ok(()),
    }
}

/// Inputs and outputs of the weight/bias gradient reduction (addresses; 0 = absent output),
/// and the half gradient's column sums where the warp kernel adds them up too.
struct ParamGrads {
    x: u64,
    gy: u64,
    gw: u64,
    gb: u64,
    gh: u64,
    kind: i32,
}

impl ParamGrads {
    /// The sums each chunk writes a row of partials for: weight, bias, and the half
    /// gradient's where asked for.
    fn sum_rows(&self) -> u32 {
        2 + u32::from(self.gh != 0)
    }
}

/// (rows per chunk, chunks) of the column sums: enough (chunk, column) threads to fill the
/// GPU, at most 512 chunks. Depends on the shape alone, so the sums are reproducible.
fn param_chunks(rows: usize, n: usize) -> (usize, usize) {
    let want = ((1usize << 18) / n.max(1)).clamp(1, 512).min(rows.max(1));
    let per = rows.div_ceil(want).max(1);
    (per, rows.div_ceil(per).max(1))
}

/// Bytes of one partial sum: the warp kernels' blocks write f32 (`float* part`), the chunk
/// sums double (`double* part`), and each finish reads its own (kernels/rows.cu).
const WARP_PARTIAL_BYTES: usize = 4;
const CHUNK_PARTIAL_BYTES: usize = 8;
/// The finish kernels that add up those partials.
const WARP_FINISH: &str = "layer_norm_params_finish_f32";
const CHUNK_FINISH: &str = "layer_norm_params_finish";

/// The bytes of the column-sum partials a layer norm backward takes for its parameter
/// gradients, if it makes any (the planner counts the same block): one row of n f32 per block
/// of the warp kernels, else one of n doubles per chunk of the separate column sums.
pub(crate) fn param_scratch_bytes(a: &LayerNormBackward) -> Option<usize> {
    let (rows, n) = rows_cols(a.x.layout);
    let wanted = params_wanted(a) && rows > 0 && n > 0;
    let (partials, bytes) = match warp_slots(a.x.storage.dtype(), n) {
        Some(_) => (
            fused_param_blocks(rows, bwd_blocks_per_sm(a)),
            WARP_PARTIAL_BYTES,
        ),
        None => (param_chunks(rows, n).1, CHUNK_PARTIAL_BYTES),
    };
    let vectors = 2 + usize::from(sums_half(a));
    wanted.then(|| vectors * partials * n * bytes)
}

fn params_wanted(a: &LayerNormBackward) -> bool {
    a.gweight.is_some() || a.gbias.is_some()
}

/// Whether the warp kernel sums the half gradient's columns (`gx_half_sums`) beside the
/// parameter gradients' (a third row of partials): where it writes that gradient and sums
/// the parameters'. Elsewhere the entry function reduces the half gradient afterwards.
pub(crate) fn sums_half(a: &LayerNormBackward) -> bool {
    let (rows, n) = rows_cols(a.x.layout);
    a.gx_half.is_some()
        && a.gx_half_sums.is_some()
        && params_wanted(a)
        && rows > 0
        && warp_slots(a.x.storage.dtype(), n).is_some()
}

/// gweight = Σ_r gy x̂ and gbias = Σ_r gy per column, in two deterministic stages: each chunk
/// of rows sums its columns in row order, then each column adds its chunks in chunk order.
fn layer_norm_param_grads(
    d: &CudaDevice,
    (module, s): (&'static Module, &str),
    p: &ParamGrads,
    stats: &[Arg],
    rows: usize,
    n: usize,
) -> Result<()> {
    let (per, chunks) = param_chunks(rows, n);
    let part = temp(
        d,
        2 * chunks * n * CHUNK_PARTIAL_BYTES,
        "layer_norm_backward",
    )?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK as usize) as u32, chunks as u32, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let args = [
        &[Arg::Ptr(p.x), Arg::Ptr(p.gy)][..],
        stats,
        &[
            Arg::Ptr(part.addr()),
            i64_of(rows),
            i64_of(n),
            i64_of(per),
            i64_of(chunks),
        ],
    ]
    .concat();
    launch(d, module, &format!("layer_norm_params_{s}"), cfg, &args)?;
    params_finish(d, (module, CHUNK_FINISH), part.addr(), chunks, n, p)
}

/// Columns and chunk lanes of one block of the second stage (LN_FIN_COLS and LN_FIN_LANES in
/// kernels/rows.cu).
const FINISH_COLS: usize = 16;
const FINISH_LANES: u32 = 64;

/// The second stage: each column adds its `chunks` partials (at `part`, of the type `kernel`
/// reads) in a fixed order into gweight, gbias and the half gradient's sums (each where asked
/// for).
fn params_finish(
    d: &CudaDevice,
    (module, kernel): (&'static Module, &str),
    part: u64,
    chunks: usize,
    n: usize,
    p: &ParamGrads,
) -> Result<()> {
    let args = [
        Arg::Ptr(part),
        i64_of(chunks),
        i64_of(n),
        Arg::Ptr(p.gw),
        Arg::Ptr(p.gb),
        Arg::Ptr(p.gh),
        Arg::I32(p.kind),
    ];
    // One block per (16 columns, sum): 64 lanes of chunks per column; a sum whose output is
    // null returns at once (kernels/rows.cu).
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(FINISH_COLS) as u32, p.sum_rows(), 1),
        block_dim: (FINISH_COLS as u32, FINISH_LANES, 1),
        shared_mem_bytes: 0,
    };
    launch(d, module, kernel, cfg, &args)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each launch goes to the module that instantiates its kernels (kernels/rows.cu's module
    /// blocks): a kernel in another module would fail to load on a GPU only.
    #[test]
    fn every_kernel_name_is_in_the_module_the_launcher_picks() {
        for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let s = suffix("test", dt).unwrap_or_default();
            let block = kernels("test", dt).unwrap().own_block().unwrap_or_default();
            assert!(block.contains(&format!("ROW_KERNELS({s},")), "{s}");
            // The warp-per-row kernels, where layer_norm_kernel asks for them.
            let (warp, _, _) = layer_norm_kernel("layer_norm_fwd", s, dt, 4, 64);
            let has_warp = block.contains(&format!("LN_WARP_SIZES({s},"));
            assert_eq!(has_warp, warp.contains("_warp"), "{s}");
        }
        // Half outputs over f32 rows: in the f32 module, block and warp kernels.
        let f32_block = kernels("test", DType::F32)
            .unwrap()
            .own_block()
            .unwrap_or_default();
        for s in ["f32_f16", "f32_bf16"] {
            assert!(f32_block.contains(&format!("LN_KERNELS({s},")), "{s}");
            assert!(f32_block.contains(&format!("LN_WARP_SIZES({s},")), "{s}");
        }
    }

    /// The warp-per-row kernels launch with the block their launch bounds and row indexing
    /// assume, and only those kernels take the `vec` flag.
    #[test]
    fn warp_kernels_launch_with_the_block_the_source_declares() {
        assert!(SOURCE.contains(&format!("#define LN_WARP_BLOCK {LN_WARP_BLOCK}\n")));
        let (name, cfg, warp) =
            layer_norm_kernel("layer_norm_bwd", "f32_bf16", DType::F32, 8192, 768);
        assert_eq!(
            (name.as_str(), warp),
            ("layer_norm_bwd_warp24_f32_bf16", true)
        );
        assert_eq!((cfg.block_dim.0, cfg.grid_dim.0), (LN_WARP_BLOCK, 2048));
        let (name, cfg, warp) = layer_norm_kernel("layer_norm_bwd", "f32", DType::F32, 8, 1100);
        assert_eq!(
            (name.as_str(), warp, cfg.block_dim.0),
            ("layer_norm_bwd_f32", false, BLOCK)
        );
    }

    /// The fused parameter sums take one partial per block, at most as many as the SMs run at
    /// once, where the warp kernels run (param_scratch_bytes sizes the partials by the same
    /// test).
    #[test]
    fn fused_parameter_sums_take_a_partial_per_block() {
        assert_eq!(fused_param_blocks(5, 3), 2);
        assert_eq!(fused_param_blocks(8192, 3), 396);
        assert_eq!(fused_param_blocks(8192, 4), 528);
        assert_eq!(warp_slots(DType::F32, 768), Some(24));
        assert_eq!(warp_slots(DType::F64, 768), None);
        assert_eq!(warp_slots(DType::BF16, 1025), None);
    }

    /// The partials' bytes are those of the type each kernel writes them in and its finish
    /// reads: f32 from the warp kernels' blocks, double from the chunk sums.
    #[test]
    fn partial_sums_take_the_bytes_of_their_kernels_dtype() {
        assert!(SOURCE.contains("i64 n, float* part, int vec, int half_sums) {"));
        assert!(SOURCE.contains("int sk, double* part, i64 rows, i64 n, i64 rows_per_chunk,"));
        assert!(SOURCE.contains(&format!("{WARP_FINISH}(const float* part,")));
        assert!(SOURCE.contains(&format!("{CHUNK_FINISH}(const double* part,")));
        assert_eq!(WARP_PARTIAL_BYTES, std::mem::size_of::<f32>());
        assert_eq!(CHUNK_PARTIAL_BYTES, std::mem::size_of::<f64>());
    }

    /// The finish's launch gives each block the columns and chunk lanes its kernel indexes by,
    /// and one grid row per sum, in the order the kernel picks them (weight, bias, half).
    #[test]
    fn the_finishs_block_matches_its_kernel() {
        assert!(SOURCE.contains(&format!("#define LN_FIN_COLS {FINISH_COLS}\n")));
        assert!(SOURCE.contains(&format!("#define LN_FIN_LANES {FINISH_LANES}\n")));
        assert!(SOURCE.contains("blockIdx.y == 0 ? gw : blockIdx.y == 1 ? gb : gh"));
    }

    /// The grid of the backward that sums the parameter gradients assumes the blocks per SM
    /// its launch bounds give: four only for f32 rows with bf16 gradients at PER 24, its kernel
    /// that also writes gx in bf16 too.
    #[test]
    fn the_backwards_grid_matches_its_launch_bounds() {
        assert!(SOURCE.contains("LN_WARP_SIZES(f32_bf16, float, bf16_t, 4)\n"));
        assert!(SOURCE.contains("LN_WARP_SIZES(bf16, bf16_t, bf16_t, 3)\n"));
        assert!(SOURCE.contains("#define LN_HALF_TOO_MIN(BWD_MIN) (BWD_MIN)\n"));
        assert!(SOURCE.contains("__launch_bounds__(LN_WARP_BLOCK, LN_HALF_TOO_MIN(BWD_MIN))"));
        for s in [
            "f32, float, float",
            "f32_f16, float, f16_t",
            "f16, f16_t, f16_t",
        ] {
            assert!(SOURCE.contains(&format!("LN_WARP_SIZES({s}, 1)\n")), "{s}");
        }
        assert_eq!(ln_bwd_blocks_per_sm(DType::F32, DType::BF16, 24), 4);
        assert_eq!(ln_bwd_blocks_per_sm(DType::F32, DType::BF16, 32), 3);
        assert_eq!(ln_bwd_blocks_per_sm(DType::F32, DType::F16, 24), 3);
        assert_eq!(ln_bwd_blocks_per_sm(DType::BF16, DType::BF16, 24), 3);
    }

    /// Groups of four move as vectors only where n and every address allow it.
    #[test]
    fn vectors_only_where_every_group_is_aligned() {
        let flag = |n, addrs: &[(DType, &[u64])]| match groups_move_as_vectors(n, addrs) {
            Arg::I32(v) => v,
            _ => panic!("not an int"),
        };
        assert_eq!(
            flag(768, &[(DType::F32, &[256, 0, 4096]), (DType::BF16, &[8])]),
            1
        );
        assert_eq!(flag(770, &[(DType::F32, &[256]), (DType::BF16, &[8])]), 0);
        assert_eq!(
            flag(768, &[(DType::F32, &[256, 260]), (DType::BF16, &[8])]),
            0
        );
        assert_eq!(flag(768, &[(DType::F32, &[256]), (DType::BF16, &[4])]), 0);
    }

    #[test]
    fn param_chunks_cover_all_rows() {
        for (rows, n) in [(1, 1), (7, 3), (1000, 768), (65536, 64), (3, 100_000)] {
            let (per, chunks) = param_chunks(rows, n);
            assert!(
                per * chunks >= rows && per * (chunks - 1) < rows,
                "{rows} {n}"
            );
            assert!(chunks <= 512);
        }
    }
}
