//! CUDA launchers of the attention family (backend/attention.rs): FlashAttention-2 on tensor
//! cores for f16 and bf16 heads (kernels/attention.cu) and for f32 heads as three TF32
//! products per product, f32-accurate (kernels/attention_f32.cu, the same kernels and
//! arguments), head dims a multiple of 16 up
//! to 128. Each (dtype, head dim) is its own NVRTC module, compiled on first use, so the
//! kernels unroll over the head dim. Other dtypes and head dims are not covered (`supports`
//! says so and the model composes matmul, softmax and matmul instead).
//!
//! Shapes: q, k, v, out, gout and the gradients (B, H, T, D) by strides, unit stride along D;
//! lse and delta (B, H, T) dense f32. No temporaries: forward writes out and lse, backward
//! writes delta, then dK/dV, then dQ. Dropout on the probabilities runs in the kernels' twins
//! (Philox in-kernel, the mask replayed in backward from its key; none is stored).

use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::launch::{Arg, Module, addr, launch};
use super::{CudaDevice, ptr};
use crate::backend::View;
use crate::backend::attention::{Attention, AttentionBackward, AttentionDropout, AttentionKernels};
use crate::base::{DType, Error, Layout, Result};

/// Threads per CTA (WARPS · 32 in attention.cu) and rows per CTA tile (BM).
const THREADS: u32 = 128;
const TILE: usize = 64;
/// The most tiles of TILE rows one launch covers (the grid's y limit): the longest T.
const MAX_TILES: usize = 65_535;

macro_rules! module {
    ($elem:literal, $d:literal) => {
        Module::with_defines(
            concat!("attention_", $elem, "_", $d),
            concat!("#define ATTN_", $elem, "\n#define HEAD_DIM ", $d, "\n"),
            concat!(
                include_str!("kernels/attention_common.cuh"),
                include_str!("kernels/attention.cu")
            ),
        )
    };
}

/// The head dims with a kernel build: multiples of 16 up to 128.
const HEAD_DIMS: [usize; 8] = [16, 32, 48, 64, 80, 96, 112, 128];

/// One module per head dim of `HEAD_DIMS`, for element type `$elem`.
macro_rules! modules {
    ($elem:literal) => {
        [
            module!($elem, 16),
            module!($elem, 32),
            module!($elem, 48),
            module!($elem, 64),
            module!($elem, 80),
            module!($elem, 96),
            module!($elem, 112),
            module!($elem, 128),
        ]
    };
}

pub(super) static BF16: [Module; 8] = modules!("BF16");
pub(super) static F16: [Module; 8] = modules!("F16");

/// The f32 kernels' module for head dim `$d`.
macro_rules! module_f32 {
    ($d:literal) => {
        Module::with_defines(
            concat!("attention_f32_", $d),
            concat!("#define HEAD_DIM ", $d, "\n"),
            concat!(
                include_str!("kernels/attention_common.cuh"),
                include_str!("kernels/attention_f32.cu")
            ),
        )
    };
}

pub(super) static F32: [Module; 8] = [
    module_f32!(16),
    module_f32!(32),
    module_f32!(48),
    module_f32!(64),
    module_f32!(80),
    module_f32!(96),
    module_f32!(112),
    module_f32!(128),
];

/// Whether the fused kernels cover `dtype` and `head_dim` on a GPU. A free function, so the
/// planner can ask without a GPU.
pub(crate) fn supports(dtype: DType, head_dim: usize) -> bool {
    matches!(dtype, DType::BF16 | DType::F16 | DType::F32) && HEAD_DIMS.contains(&head_dim)
}

fn module(op: &'static str, dtype: DType, head_dim: usize) -> Result<&'static Module> {
    let at = HEAD_DIMS.iter().position(|&d| d == head_dim);
    match (dtype, at) {
        (DType::BF16, Some(i)) => Ok(&BF16[i]),
        (DType::F16, Some(i)) => Ok(&F16[i]),
        (DType::F32, Some(i)) => Ok(&F32[i]),
        _ => Err(Error::invalid(
            op,
            format!(
                "the GPU's fused attention covers f32, f16 and bf16 heads of dim 16, 32, ... \
                 128, not {dtype} with head dim {head_dim}; use the composed attention"
            ),
        )),
    }
}

/// A (B, H, T, D) view as the kernels take it (`struct Heads` in attention.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct Heads {
    offset: i64,
    sb: i64,
    sh: i64,
    st: i64,
}

// SAFETY: #[repr(C)], four i64, laid out as `struct Heads` (32 bytes, no padding).
unsafe impl DeviceRepr for Heads {}

impl Heads {
    fn of(l: &Layout) -> Heads {
        let s = l.strides();
        Heads {
            offset: l.offset() as i64,
            sb: s[0] as i64,
            sh: s[1] as i64,
            st: s[2] as i64,
        }
    }
    /// Whether every row starts on a 16-byte boundary of a 16-byte-aligned buffer.
    fn aligned(&self, base: u64) -> bool {
        base.is_multiple_of(16)
            && [self.offset, self.sb, self.sh, self.st]
                .iter()
                .all(|v| v % 8 == 0)
    }
}

/// The problem (`struct Problem` in attention.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct Problem {
    b: i32,
    h: i32,
    t: i32,
    causal: i32,
    scale: f32,
    scale_log2: f32,
    vec: i32,
    /// Kept where the 16-bit draw is below this: ceil(keep · 2¹⁶), as `u < keep` for
    /// u = draw / 2¹⁶.
    threshold: u32,
    key: u64,
    inv_keep: f32,
    pad: i32,
    /// 0, or the address of a captured step's seed: the kernels' key is then key ^ seed.
    seed: u64,
}

// SAFETY: #[repr(C)]: four i32, two f32, i32, u32, u64, f32, i32, u64, laid out as
// `struct Problem` (56 bytes; the u64s fall on offsets 32 and 48, so no implicit padding).
unsafe impl DeviceRepr for Problem {}

impl Problem {
    fn new(
        op: &'static str,
        q: &Layout,
        (scale, causal, dropout): (f64, bool, Option<AttentionDropout>),
        views: &[(u64, Heads)],
    ) -> Result<Problem> {
        let s = q.shape();
        let int = |n: usize| {
            i32::try_from(n).map_err(|_| Error::shape(op, format!("{n} is too large a dim")))
        };
        if s[2].div_ceil(TILE) > MAX_TILES {
            return Err(Error::shape(
                op,
                format!(
                    "T = {} exceeds the {} rows ({MAX_TILES} tiles of {TILE}) the GPU kernel \
                     launches at once; use a shorter sequence or the unfused attention",
                    s[2],
                    MAX_TILES * TILE
                ),
            ));
        }
        // The (batch, head) pairs are the grid's x, indexed by an int in the kernels.
        int(s[0] * s[1])?;
        Ok(Problem {
            b: int(s[0])?,
            h: int(s[1])?,
            t: int(s[2])?,
            causal: i32::from(causal),
            scale: scale as f32,
            scale_log2: (scale * std::f64::consts::LOG2_E) as f32,
            vec: i32::from(views.iter().all(|(base, h)| h.aligned(*base))),
            threshold: dropout.map_or(0, |d| (d.keep * 65_536.0).ceil() as u32),
            key: dropout.map_or(0, |d| d.key),
            inv_keep: dropout.map_or(1.0, |d| (1.0 / d.keep) as f32),
            pad: 0,
            seed: 0,
        })
    }

    fn is_empty(&self) -> bool {
        self.b == 0 || self.h == 0 || self.t == 0
    }

    /// One CTA per 64 rows (queries or keys) of each (batch, head) pair, with the kernel's
    /// shared memory for head dim `d` and element type `dtype` on a GPU of architecture
    /// `arch`. The pairs are the grid's x and the tiles its y, so CTAs are dealt tile by tile
    /// across all pairs, the heaviest causal tiles first (attention_common.cuh).
    fn tiles(&self, kernel: Tiled, d: usize, dtype: DType, arch: &str) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (
                (self.b * self.h) as u32,
                (self.t as usize).div_ceil(TILE) as u32,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: match (dtype, kernel) {
                (DType::F32, _) => smem_bytes_f32(kernel, d),
                _ if on_wgmma(arch, d) => wgmma_smem_bytes(kernel),
                _ => smem_bytes(kernel, d),
            },
        }
    }
}

/// The three tiled kernels.
#[derive(Clone, Copy)]
enum Tiled {
    Forward,
    DkDv,
    Dq,
}

/// Whether the f16/bf16 kernels run on warpgroup MMA (ATTN_WGMMA in attention.cu): at head
/// dim 64 on sm_90a.
fn on_wgmma(arch: &str, d: usize) -> bool {
    arch == "sm_90a" && d == 64
}

/// Dynamic shared memory of those kernels (FWD_WG_SMEM, DKDV_WG_SMEM, DQ_WG_SMEM), in bytes:
/// tiles of 64 rows of 64 two-byte elements (the forward's Q and two stages of K and V; dK/dV's
/// K, V and two stages of Q and dO with their lse and delta rows; dQ's Q, dO and two stages of
/// K and V), and 1024 bytes to align the first tile.
fn wgmma_smem_bytes(kernel: Tiled) -> u32 {
    const TILE_BYTES: u32 = 64 * 64 * 2;
    let stats = 2 * 2 * 64 * 4;
    1024 + match kernel {
        Tiled::Forward => 5 * TILE_BYTES,
        Tiled::DkDv => 6 * TILE_BYTES + stats,
        Tiled::Dq => 6 * TILE_BYTES,
    }
}

/// Dynamic shared memory of a tiled kernel at head dim `d`, in bytes: attention.cu's
/// FWD_SMEM, DKDV_SMEM and DQ_SMEM from its tile sizes (the kernels check it on entry).
/// Padded rows of d + 8 elements; keys per streamed tile (forward), queries per tile (dK/dV)
/// and keys per tile (dQ) shrink at wide heads, as BN, BQ and BNQ do there.
fn smem_bytes(kernel: Tiled, d: usize) -> u32 {
    let lds = d + 8;
    let bn = if d <= 64 { 64 } else { 32 };
    let bq = match d {
        0..=64 => 64,
        65..=96 => 32,
        _ => 16,
    };
    let bnq = match d {
        0..=64 => 64,
        65..=112 => 32,
        _ => 16,
    };
    let elems = match kernel {
        Tiled::Forward => 2 * (2 * bn * lds),
        Tiled::DkDv => 2 * TILE * lds + 2 * (2 * bq * lds),
        Tiled::Dq => 2 * TILE * lds + 2 * (2 * bnq * lds),
    };
    let stats = match kernel {
        Tiled::DkDv => 2 * 2 * bq * 4,
        _ => 0,
    };
    (elems * 2 + stats) as u32
}

/// Dynamic shared memory of an f32 tiled kernel at head dim `d`, in bytes: attention_f32.cu's
/// FWD_SMEM_F32, DKDV_SMEM_F32 and DQ_SMEM_F32 (rows of d + 4 floats; 64-row CTA tiles,
/// 32-row streamed tiles, two stages of them in the forward; probability tiles of 36-float
/// rows).
fn smem_bytes_f32(kernel: Tiled, d: usize) -> u32 {
    const BM: usize = TILE;
    const BN: usize = 32;
    let (ldf, ldp) = (d + 4, BN + 4);
    let floats = match kernel {
        Tiled::Forward => (BM + 2 * 2 * BN) * ldf + BM * ldp,
        Tiled::DkDv => (2 * BM + 2 * BN) * ldf + 2 * BN + 2 * BM * ldp,
        Tiled::Dq => (2 * BM + 2 * BN) * ldf + BM * ldp,
    };
    (floats * 4) as u32
}

/// Lanes per row of the f16/bf16 attn_delta: DELTA_LANES in attention.cu.
fn delta_lanes(d: usize) -> usize {
    match d {
        0..=16 => 2,
        17..=32 => 4,
        33..=64 => 8,
        _ => 16,
    }
}

/// The kernel's name: each has a twin that applies dropout.
fn kernel(name: &'static str, dropout: Option<AttentionDropout>) -> &'static str {
    match (name, dropout.is_some()) {
        ("attn_fwd", true) => "attn_fwd_dropout",
        ("attn_bwd_dkdv", true) => "attn_bwd_dkdv_dropout",
        ("attn_bwd_dq", true) => "attn_bwd_dq_dropout",
        (name, _) => name,
    }
}

/// A view's base address (offset 0) and its heads.
fn operand(v: &View) -> Result<(u64, Heads)> {
    Ok((ptr(v.storage)?, Heads::of(v.layout)))
}

impl AttentionKernels for CudaDevice {
    fn supports_attention(&self, dtype: DType, head_dim: usize) -> bool {
        supports(dtype, head_dim)
    }
    fn supports_attention_dropout(&self) -> bool {
        true
    }
    fn attention(&self, a: &Attention) -> Result<()> {
        forward(self, a)
    }
    fn attention_backward(&self, a: &AttentionBackward) -> Result<()> {
        backward(self, a)
    }
}

fn forward(d: &CudaDevice, a: &Attention) -> Result<()> {
    const OP: &str = "attention";
    let [q, k, v] = a.qkv.views().map(|v| operand(&v));
    let (q, k, v, out) = (q?, k?, v?, operand(&a.out)?);
    let mut p = Problem::new(OP, a.qkv.q, (a.scale, a.causal, a.dropout), &[q, k, v, out])?;
    if a.dropout.is_some() {
        p.seed = d.dropout_seed()?;
    }
    if p.is_empty() {
        return Ok(());
    }
    let (d_head, dtype) = (a.qkv.q.shape()[3], a.qkv.storage.dtype());
    let m = module(OP, dtype, d_head)?;
    let args = [
        Arg::Ptr(q.0),
        Arg::Struct(&q.1),
        Arg::Struct(&k.1),
        Arg::Struct(&v.1),
        Arg::Ptr(out.0),
        Arg::Struct(&out.1),
        Arg::Ptr(ptr(a.lse)?),
        Arg::Struct(&p),
    ];
    let cfg = p.tiles(Tiled::Forward, d_head, dtype, d.arch());
    launch(d, m, kernel("attn_fwd", a.dropout), cfg, &args)
}

fn backward(d: &CudaDevice, a: &AttentionBackward) -> Result<()> {
    const OP: &str = "attention_backward";
    let [q, k, v] = a.qkv.views().map(|v| operand(&v));
    let [gq, gk, gv] = a.grads.views().map(|v| operand(&v));
    let (q, k, v, gq, gk, gv) = (q?, k?, v?, gq?, gk?, gv?);
    let (out, gout) = (operand(&a.out)?, operand(&a.gout)?);
    let mut p = Problem::new(
        OP,
        a.qkv.q,
        (a.scale, a.causal, a.dropout),
        &[q, k, v, gq, gk, gv, out, gout],
    )?;
    if a.dropout.is_some() {
        p.seed = d.dropout_seed()?;
    }
    if p.is_empty() {
        return Ok(());
    }
    let (d_head, dtype) = (a.qkv.q.shape()[3], a.qkv.storage.dtype());
    let m = module(OP, dtype, d_head)?;
    let (lse, delta) = (addr(&a.lse)?, ptr(a.delta)?);

    // Rows per warp of attn_delta: 32 / DELTA_LANES in attention.cu, one in attention_f32.cu.
    let rows = (p.b * p.h * p.t) as usize;
    let per_warp = match dtype {
        DType::F16 | DType::BF16 => 32 / delta_lanes(d_head),
        _ => 1,
    };
    let delta_cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(4 * per_warp).min(1 << 16) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let delta_args = [
        Arg::Ptr(out.0),
        Arg::Struct(&out.1),
        Arg::Ptr(gout.0),
        Arg::Struct(&gout.1),
        Arg::Ptr(delta),
        Arg::Struct(&p),
    ];
    launch(d, m, "attn_delta", delta_cfg, &delta_args)?;

    // Both kernels open with q, k, v, gout, lse and delta.
    let inputs = [
        Arg::Ptr(q.0),
        Arg::Struct(&q.1),
        Arg::Struct(&k.1),
        Arg::Struct(&v.1),
        Arg::Ptr(gout.0),
        Arg::Struct(&gout.1),
        Arg::Ptr(lse),
        Arg::Ptr(delta),
    ];
    let grads = [
        Arg::Ptr(gk.0),
        Arg::Struct(&gk.1),
        Arg::Struct(&gv.1),
        Arg::Struct(&p),
    ];
    let cfg = p.tiles(Tiled::DkDv, d_head, dtype, d.arch());
    launch(
        d,
        m,
        kernel("attn_bwd_dkdv", a.dropout),
        cfg,
        &[&inputs[..], &grads].concat(),
    )?;

    let grads = [Arg::Ptr(gq.0), Arg::Struct(&gq.1), Arg::Struct(&p)];
    let cfg = p.tiles(Tiled::Dq, d_head, dtype, d.arch());
    launch(
        d,
        m,
        kernel("attn_bwd_dq", a.dropout),
        cfg,
        &[&inputs[..], &grads].concat(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_layout_matches_the_kernels() {
        // attention.cu asserts sizeof(Problem) == 56 on its side.
        assert_eq!(std::mem::size_of::<Problem>(), 56);
        assert_eq!(std::mem::offset_of!(Problem, key), 32);
        assert_eq!(std::mem::offset_of!(Problem, seed), 48);
        assert_eq!(std::mem::size_of::<Heads>(), 32);
    }

    /// The f32 kernels' shared memory as attention_f32.cu sizes it (its kernels trap on a
    /// launch with less), within the 227 KiB a CTA may have at every head dim.
    #[test]
    fn f32_shared_memory_matches_the_kernels() {
        let src = include_str!("kernels/attention_f32.cu");
        for line in [
            "#define BM 64",
            "#define BN 32",
            "#define LDF (D + 4)",
            "#define LDP (BN + 4)",
            "#define FWD_STAGE (2 * BN * LDF)",
            "#define FWD_SMEM_F32 ((BM * LDF + 2 * FWD_STAGE + BM * LDP) * 4)",
            "#define DKDV_SMEM_F32 (((2 * BM + 2 * BN) * LDF + 2 * BN + 2 * BM * LDP) * 4)",
            "#define DQ_SMEM_F32 (((2 * BM + 2 * BN) * LDF + BM * LDP) * 4)",
        ] {
            assert!(src.contains(line), "attention_f32.cu lacks `{line}`");
        }
        // Head dim 64: Q (64 rows of 68 floats), two stages of K and V (4 × 32 rows), P (64
        // rows of 36).
        assert_eq!(smem_bytes_f32(Tiled::Forward, 64), (192 * 68 + 64 * 36) * 4);
        for d in HEAD_DIMS {
            for k in [Tiled::Forward, Tiled::DkDv, Tiled::Dq] {
                assert!(smem_bytes_f32(k, d) <= 227 * 1024, "head dim {d}");
            }
        }
    }

    /// The wgmma kernels' shared memory as attention.cu sizes it, and where they run.
    #[test]
    fn wgmma_kernels_match_the_source() {
        let src = include_str!("kernels/attention.cu");
        for line in [
            "#if D == 64 && defined(__CUDA_ARCH_FEAT_SM90_ALL)",
            "#define SW_TILE (64 * 64)",
            "#define FWD_WG_SMEM (5 * SW_TILE * 2 + 1024)",
            "#define DKDV_WG_SMEM (6 * SW_TILE * 2 + 2 * 2 * BQ * 4 + 1024)",
            "#define DQ_WG_SMEM (6 * SW_TILE * 2 + 1024)",
            "#define BQ (D <= 64 ? 64 : (D <= 96 ? 32 : 16))",
        ] {
            assert!(src.contains(line), "attention.cu lacks `{line}`");
        }
        // Each wgmma loop starts by settling its carried accumulators, or ptxas may serialise
        // the kernel's products (scripts/check_wgmma.sh checks the compiled kernels).
        for (kernel, head, settle) in [
            ("attn_fwd_wgmma_impl", "for (int k0 = 0,", "wg_settled(o);"),
            (
                "attn_bwd_dkdv_wgmma_impl",
                "for (int q0 = first,",
                "wg_settled(dk, dv);",
            ),
            (
                "attn_bwd_dq_wgmma_impl",
                "for (int k0 = 0,",
                "wg_settled(dq);",
            ),
        ] {
            let body = &src[src.find(kernel).expect(kernel)..];
            let at = body.find(head).expect("the kernel's loop");
            let next_line = body[at..].lines().nth(1).unwrap_or("");
            assert_eq!(next_line.trim(), settle, "{kernel}'s loop");
        }
        assert_eq!(wgmma_smem_bytes(Tiled::Forward), 41_984);
        assert_eq!(wgmma_smem_bytes(Tiled::DkDv), 51_200);
        assert_eq!(wgmma_smem_bytes(Tiled::Dq), 50_176);
        assert!(on_wgmma("sm_90a", 64));
        for (arch, d) in [
            ("sm_90a", 128),
            ("sm_90a", 32),
            ("sm_80", 64),
            ("sm_100", 64),
        ] {
            assert!(!on_wgmma(arch, d), "{arch} d{d}");
        }
    }

    /// Launch shapes per path: every kernel one CTA of 128 threads per 64 rows; shared memory
    /// from the wgmma formulas only for f16/bf16 at head dim 64 on sm_90a.
    #[test]
    fn launch_shapes_follow_the_kernel_path() {
        let p = Problem {
            b: 2,
            h: 3,
            t: 130,
            causal: 1,
            scale: 0.125,
            scale_log2: 0.125 * std::f32::consts::LOG2_E,
            vec: 1,
            threshold: 0,
            key: 0,
            inv_keep: 1.0,
            pad: 0,
            seed: 0,
        };
        for kernel in [Tiled::Forward, Tiled::DkDv, Tiled::Dq] {
            for (dtype, d, arch) in [
                (DType::BF16, 64, "sm_90a"),
                (DType::F16, 64, "sm_90a"),
                (DType::BF16, 64, "sm_80"),
                (DType::BF16, 128, "sm_90a"),
                (DType::F32, 64, "sm_90a"),
            ] {
                let cfg = p.tiles(kernel, d, dtype, arch);
                assert_eq!(
                    cfg.grid_dim,
                    (6, 3, 1),
                    "6 (b, h) pairs, 130 rows in tiles of 64"
                );
                assert_eq!(cfg.block_dim, (THREADS, 1, 1));
                let want = match dtype {
                    DType::F32 => smem_bytes_f32(kernel, d),
                    _ if arch == "sm_90a" && d == 64 => wgmma_smem_bytes(kernel),
                    _ => smem_bytes(kernel, d),
                };
                assert_eq!(cfg.shared_mem_bytes, want, "{dtype} d{d} {arch}");
            }
        }
        // The CTAs per SM that the wgmma kernels' registers allow (forward and dQ 4, dK/dV 3:
        // FWD_CTAS and DKDV_CTAS) fit in an H100's 227 KiB of shared memory per SM too.
        for (kernel, ctas) in [(Tiled::Forward, 4), (Tiled::DkDv, 3), (Tiled::Dq, 4)] {
            assert!(ctas * wgmma_smem_bytes(kernel) <= 227 * 1024);
        }
    }

    /// Every tiled kernel takes its (batch, head) pair from the grid's x and its tile from
    /// y (`tiles` launches them so), and a T of more tiles than y holds is refused, not
    /// launched short.
    #[test]
    fn tiled_kernels_read_the_pair_from_x_and_the_tile_from_y() {
        for (name, src, kernels) in [
            ("attention.cu", include_str!("kernels/attention.cu"), 6),
            (
                "attention_f32.cu",
                include_str!("kernels/attention_f32.cu"),
                3,
            ),
        ] {
            let pairs = "const int bh = pair_index(), b = bh / p.h, h = bh % p.h;";
            assert_eq!(src.matches(pairs).count(), kernels, "{name}");
            assert!(
                !src.contains("blockIdx.y"),
                "{name} reads the grid's y directly"
            );
        }
        let common = include_str!("kernels/attention_common.cuh");
        for def in [
            "int pair_index() { return (int)blockIdx.x; }",
            "return p.causal ? (int)(gridDim.y - 1 - blockIdx.y) : (int)blockIdx.y;",
            "int key_tile_index() { return (int)blockIdx.y; }",
        ] {
            assert!(common.contains(def), "attention_common.cuh lacks `{def}`");
        }
        let q = |t: usize| Layout::contiguous(&[1, 2, t, 64]);
        let problem = |t: usize| Problem::new("attention", &q(t), (0.125, true, None), &[]);
        assert!(problem(MAX_TILES * TILE).is_ok());
        let err = problem(MAX_TILES * TILE + 1).err().map(|e| e.to_string());
        let err = err.expect("one row past the grid's tiles");
        assert!(err.contains("exceeds") && err.contains("unfused"), "{err}");
    }

    /// The delta kernel's lanes per row, as attention.cu defines them: at every head dim the
    /// kernels take, the least power of two (at least 2) whose lanes of 8 elements cover D.
    #[test]
    fn delta_lanes_match_the_kernel() {
        let src = include_str!("kernels/attention.cu");
        assert!(src.contains("#define DELTA_LANES (D <= 16 ? 2 : D <= 32 ? 4 : D <= 64 ? 8 : 16)"));
        for d in HEAD_DIMS {
            let lanes = delta_lanes(d);
            let least = d.div_ceil(8).next_power_of_two().max(2);
            assert_eq!(lanes, least, "head dim {d}");
            assert!(32 % lanes == 0, "head dim {d}: whole rows per warp");
        }
    }
}
