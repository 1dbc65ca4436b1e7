// attention_common.cuh — what the attention kernels of every element type share (attention.cu
// for f16/bf16, attention_f32.cu for f32): the operand and problem structs the launcher
// (cuda/attention.rs) passes, the dropout mask's draw, the asynchronous copies and small
// helpers. Prepended to each attention kernel file by the launcher, after prelude.cuh.

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// A (B, H, T, D) view: element offset and strides of b, h and t (D has unit stride).
// Mirrors `Heads` in cuda/attention.rs (#[repr(C)]).
struct Heads {
    i64 offset, sb, sh, st;
};

// The problem. Mirrors `Problem` in cuda/attention.rs.
struct Problem {
    int b, h, t, causal;
    float scale;       // applied to q·k
    float scale_log2;  // scale · log2(e): scores in base 2, so exp is one exp2
    int vec;           // 1: every row start is 16-byte aligned (8-element loads)
    u32 threshold;     // dropout on the probabilities: kept where a 16-bit draw is below it
    u64 key;           // the dropout mask's Philox key
    float inv_keep;    // 1 / (1 - p): the kept probabilities' scale
    int pad;
    u64 seed;          // 0, or the device address of a u64 that a replayed graph's step
                       // rewrites: the key is then key ^ *seed (a new mask every replay)
};

static_assert(sizeof(Problem) == 56, "Problem must match its Rust twin (cuda/attention.rs)");

// The problem with its dropout key for this launch (the dropout kernels' entries).
__device__ __forceinline__ Problem keyed(Problem p) {
    if (p.seed) p.key ^= *(const u64*)p.seed;
    return p;
}

// Whether probability (query i, key j) of pair bh survives dropout. Its draw is half n % 2
// (the low half first) of word (n / 2) % 4 of philox(n / 8, key), 16 bits, with
// n = (bh · T + i) · T + j: exactly the mask the dropout op draws over the composed path's
// (B, H, T, T) probabilities (backend/philox.rs).
__device__ __forceinline__ u32 draw16(const u32 w[4], u64 n) {
    const u32 word = (n & 4) ? ((n & 2) ? w[3] : w[2]) : ((n & 2) ? w[1] : w[0]);
    return (n & 1) ? word >> 16 : word & 0xffffu;
}

__device__ __forceinline__ bool kept(const Problem& p, int bh, int i, int j) {
    u64 n = ((u64)bh * p.t + i) * p.t + j;
    u32 w[4];
    philox4x32_10(n >> 3, p.key, w);
    return draw16(w, n) < p.threshold;
}

__device__ __forceinline__ i64 row_at(const Heads& v, int b, int h, i64 t) {
    return v.offset + (i64)b * v.sb + (i64)h * v.sh + t * v.st;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// The grid is (B · H pairs, tiles of 64 rows). The block scheduler hands out CTAs in order
// of their linear index, x fastest, so every pair's tile y is dealt before any pair's tile
// y + 1. Causal tiles differ in work (a query tile's keys, a key tile's queries), and y runs
// from the heaviest to the lightest: longest first, so the grid ends on short CTAs instead
// of on a pair's heaviest one, which left most SMs idle while it finished.
__device__ __forceinline__ int pair_index() { return (int)blockIdx.x; }

// The query tile of this CTA: the last (most keys) first when causal.
__device__ __forceinline__ int tile_index(const Problem& p) {
    return p.causal ? (int)(gridDim.y - 1 - blockIdx.y) : (int)blockIdx.y;
}

// The key tile of a dK/dV CTA: the first (most queries) first.
__device__ __forceinline__ int key_tile_index() { return (int)blockIdx.y; }

// The launch's dynamic shared memory, in bytes.
__device__ __forceinline__ u32 dyn_smem_bytes() {
    u32 r;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(r));
    return r;
}

// A launcher that sized the buffers differently from these formulas faults at once instead
// of reading past them.
__device__ __forceinline__ void check_smem(u32 need) {
    if (dyn_smem_bytes() < need) __trap();
}

// The asynchronous copies (cp_async16, ...) are prelude.cuh's.

// Reductions over the 4 lanes that hold one row of an mma accumulator (a quad: lanes 4g to
// 4g + 3).
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
