// attention.cu — fused scaled-dot-product attention on tensor cores (FlashAttention-2's
// algorithm), forward and backward, for f16 and bf16 heads with f32 accumulation.
//
// Compiled once per (element type, head dim): the launcher (cuda/attention.rs) prepends
// `#define ATTN_BF16` or `#define ATTN_F16` and `#define HEAD_DIM n` (a multiple of 16, at
// most 128), so every loop over the head dim unrolls and every fragment array stays in
// registers.
//
// Operands: q, k, v, out, gout and the three gradients are (B, H, T, D) views with unit stride
// along D, described by `Heads` (element offset and the b, h, t strides); lse and delta are
// dense (B, H, T) f32. Kernels:
// Each of attn_fwd, attn_bwd_dkdv and attn_bwd_dq has a twin with a `_dropout` suffix that
// applies dropout to the probabilities (a compile-time switch: the plain kernels keep their
// registers). Kernels:
//   attn_fwd      one CTA per (64 queries, b·h): Q in registers, K/V tiles streamed through
//                 shared memory, online softmax; writes out and lse = log Σ exp(scaled scores).
//   attn_delta    delta = rowsum(gout ∘ out) per query, f32.
//   attn_bwd_dkdv one CTA per (64 keys, b·h): every query tile that sees those keys, the
//                 probabilities recomputed from lse; dK and dV accumulate in registers.
//   attn_bwd_dq   one CTA per (64 queries, b·h): every key tile the queries see; dQ in
//                 registers. Two kernels instead of float atomics: the backward is
//                 deterministic.
// Causal tiles past the diagonal are never visited. Streamed tiles are double-buffered in
// dynamic shared memory: the next tile's cp.async copies are in flight while the current one
// is multiplied (the launcher sizes the buffers with the *_SMEM formulas below).
//
// Fragments follow PTX's mma.m16n8k16 layouts: lane = 4·g + t; an accumulator tile (16 × 8)
// holds rows g and g + 8, columns 2t and 2t + 1. Two neighbouring accumulator tiles are
// exactly one A operand (16 × 16), so probabilities feed the next product without a trip
// through shared memory.
//
// On Hopper (sm_90a) at head dim 64 the three kernels run their products as warpgroup MMA
// instead (ATTN_WGMMA, below the mma.sync kernels): the same CTAs, tiles and per-warp rows,
// with tiles in wgmma's 128-byte swizzle read through descriptors, and the same softmax,
// masks and dropout draws (shared functions): the paths differ only in how the tensor cores
// sum each product.

#define D HEAD_DIM
#define WARPS 4
#define THREADS (WARPS * 32)
// Shared-memory rows are padded by 16 bytes, so the 8 row addresses of one ldmatrix fall in
// distinct banks.
#define LDS (D + 8)
// Queries per CTA of the forward and dQ kernels, keys per CTA of dK/dV: 16 per warp.
#define BM 64
// Keys per streamed tile (forward, dQ), and queries per tile of the dK/dV kernel: smaller
// at wide heads so the accumulators fit in registers and the tiles in 48 KiB.
#define BN (D <= 64 ? 64 : 32)
#define BQ (D <= 64 ? 64 : (D <= 96 ? 32 : 16))
// Keys per tile of the dQ kernel, whose Q and dO tiles also stay in shared memory.
#define BNQ (D <= 64 ? 64 : (D <= 112 ? 32 : 16))

// Dynamic shared memory per kernel, in bytes; mirrored by `smem_bytes` in cuda/attention.rs
// and checked on entry. Forward: two stages of (K, V) tiles; the query tile borrows stage 1
// until its fragments are in registers. dK/dV: the CTA's K and V, then two stages of
// (Q, dO) tiles and of their (lse, delta) rows. dQ: the CTA's Q and dO, two (K, V) stages.
#define FWD_STAGE (2 * BN * LDS)
#define DKDV_STAGE (2 * BQ * LDS)
#define DQ_STAGE (2 * BNQ * LDS)
#define FWD_SMEM (2 * FWD_STAGE * 2)
#define DKDV_SMEM ((2 * BM * LDS + 2 * DKDV_STAGE) * 2 + 2 * 2 * BQ * 4)
#define DQ_SMEM ((2 * BM * LDS + 2 * DQ_STAGE) * 2)

// CTAs per SM that the register budget must allow (__launch_bounds__' second argument), for
// kernels at head dims up to 64, where the bound costs at most a few bytes of spills: left
// alone, the dK/dV kernel takes 172 registers (2 CTAs of 4 warps per SM) and fits in 168
// (3 CTAs); the forward takes 141 (3) and the dropout forward 160 (3), and both fit in 128
// (4). The dQ kernels reach 4 CTAs by themselves; wider heads keep what the compiler picks.
#define FWD_CTAS (D <= 64 ? 4 : 1)
#define FWD_DROPOUT_CTAS (D <= 64 ? 4 : 1)
#define DKDV_CTAS (D <= 64 ? 3 : 1)


#if D % 16 != 0 || D > 128
#error "HEAD_DIM must be a multiple of 16, at most 128"
#endif

// kept() of (i, j) and (i, j + 1): one Philox call when both fall in one call's eight draws.
__device__ __forceinline__ void kept2(const Problem& p, int bh, int i, int j, bool k[2]) {
    u64 n = ((u64)bh * p.t + i) * p.t + j;
    u32 w[4];
    philox4x32_10(n >> 3, p.key, w);
    k[0] = draw16(w, n) < p.threshold;
    if (((n + 1) >> 3) != (n >> 3)) philox4x32_10((n + 1) >> 3, p.key, w);
    k[1] = draw16(w, n + 1) < p.threshold;
}

// The eight draws of one Philox call, as bit e = draw e survives (draw e: half e % 2 of word
// e / 2).
__device__ __forceinline__ u32 kept8(const Problem& p, u64 call) {
    u32 w[4];
    philox4x32_10(call, p.key, w);
    u32 bits = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        bits |= (u32)((w[e] & 0xffffu) < p.threshold) << (2 * e);
        bits |= (u32)((w[e] >> 16) < p.threshold) << (2 * e + 1);
    }
    return bits;
}

// Shared draws. One Philox call yields the draws of eight neighbouring keys of one query, and
// those keys lie in different lanes: the lanes that hold them make one call between them
// instead of one each, and pass the results round. A call's keys then start at a multiple of
// eight in every row, so these need T % 8 == 0 (else kept2/kept per element).

// The forward's and dQ's layout (queries as rows): lane (g, t4) holds keys c + 2·t4 + {0, 1}
// of rows r and r + 8 in the 8-key column tile at c. Two tiles (c and c + 8) hold four calls'
// keys per g: row r + 8i of tile u is one call, and the four lanes of a g (t4 = i + 2u) make
// one call each, put its 8 bits in byte t4 of a word, and two shuffles give all four the
// whole word. k[u][i][e]: key c + 8u + 2·t4 + e of row r + 8·i.
__device__ __forceinline__ void kept_rows2(const Problem& p, int bh, int r, int c, int t4,
                                           bool k[2][2][2]) {
    const u64 n = ((u64)bh * p.t + r + 8 * (t4 & 1)) * p.t + c + 8 * (t4 >> 1);
    u32 v = kept8(p, n >> 3) << (8 * t4);
    v |= __shfl_xor_sync(0xffffffffu, v, 1);
    v |= __shfl_xor_sync(0xffffffffu, v, 2);
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) k[u][i][e] = (v >> (8 * (i + 2 * u) + 2 * t4 + e)) & 1;
}

// kept_rows2 where T % 8 == 0, else kept2 per row and tile.
__device__ __forceinline__ void kept_in_rows2(const Problem& p, int bh, int r, int c, int t4,
                                              bool k[2][2][2]) {
    if (p.t % 8 == 0) {
        kept_rows2(p, bh, r, c, t4, k);
    } else {
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
            for (int i = 0; i < 2; ++i) kept2(p, bh, r + 8 * i, c + 8 * u + 2 * t4, k[u][i]);
    }
}

// The dK/dV kernel's layout (keys as rows): lane (g, t4) holds keys kb + g and kb + g + 8 of
// queries q + 2·t4 + {0, 1} in the 8-query column tile at q. Two tiles (q and q + 8) take 32
// calls, one per lane: lane L draws the keys kb + 8·(L >> 4) .. + 7 of query q + (L & 15).
// Lane (g, t4) needs bit g of the calls of lanes 16·(e >> 1) + 8u + 2·t4 + (e & 1) (element e
// of tile u): eight ballots (one per bit) hand every lane each call's bit k as bit L of a
// word, and each lane keeps the word of its g. Element e of tile u survives where bit
// 16·(e >> 1) + 8u + (e & 1) of the result is set (mask_at).
__device__ __forceinline__ u32 kept_cols2(const Problem& p, int bh, int q, int kb, int g,
                                          int t4) {
    const int lane = 4 * g + t4;
    const u64 n = ((u64)bh * p.t + q + (lane & 15)) * p.t + kb + 8 * (lane >> 4);
    const u32 mine = kept8(p, n >> 3);
    u32 w = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const u32 bit_k = __ballot_sync(0xffffffffu, (mine >> k) & 1);
        if (k == g) w = bit_k;
    }
    return (w >> (2 * t4)) & 0x03030303u;
}

// The dK/dV kernel's mask value (0 or 1/(1 - p)) of element e of tile j, from its bits
// (kept_cols2's layout, one word per two tiles).
__device__ __forceinline__ float mask_at(const u32* mb, int j, int e, const Problem& p) {
    return ((mb[j >> 1] >> (16 * (e >> 1) + 8 * (j & 1) + (e & 1))) & 1) ? p.inv_keep : 0.f;
}



// ---- tensor-core primitives ------------------------------------------------------------

// 2^x in one MUFU instruction, results below 2^-126 flushed to zero: exp2f's denormal
// handling costs four more instructions per probability and changes nothing that a sum with
// the row's largest probability (1) can show.
__device__ __forceinline__ float fast_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}

// Four 8 × 8 b16 matrices; lane l gives the row address of matrix l / 8.
__device__ __forceinline__ void ldsm_x4(u32 r[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x4_t(u32 r[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// c (16 × 8, f32) += a (16 × 16) · b (16 × 8).
__device__ __forceinline__ void mma(float c[4], const u32 a[4], u32 b0, u32 b1) {
#ifdef ATTN_BF16
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two floats as one register of two 16-bit elements, `lo` in the low half (round to nearest).
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#ifdef ATTN_BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

__device__ __forceinline__ float elem_to_f32(u16 v) {
#ifdef ATTN_BF16
    return bf16_to_f32(v);
#else
    return f16_to_f32(v);
#endif
}

__device__ __forceinline__ u16 f32_to_elem(float v) {
#ifdef ATTN_BF16
    return f32_to_bf16(v);
#else
    return f32_to_f16(v);
#endif
}

// Lane l's row and column inside a 16 × 16 block for ldmatrix.x4: for an A operand (and a
// transposed B) matrix l / 8 is (rows +8 if odd, columns +8 if ≥ 2); for a B operand read
// from [n][k] rows the roles swap.
__device__ __forceinline__ int a_row(int lane) { return (lane & 7) + ((lane >> 3) & 1) * 8; }
__device__ __forceinline__ int a_col(int lane) { return (lane >> 4) * 8; }
__device__ __forceinline__ int b_row(int lane) { return (lane & 7) + (lane >> 4) * 8; }
__device__ __forceinline__ int b_col(int lane) { return ((lane >> 3) & 1) * 8; }

// The A operand of one 16 × 16 block: two neighbouring accumulator tiles (c0, c1 → row g,
// c2, c3 → row g + 8) packed to 16 bits.
__device__ __forceinline__ void acc_to_a(u32 a[4], const float lo[4], const float hi[4]) {
    a[0] = pack2(lo[0], lo[1]);
    a[1] = pack2(lo[2], lo[3]);
    a[2] = pack2(hi[0], hi[1]);
    a[3] = pack2(hi[2], hi[3]);
}

// s (16 rows × N) = A rows (16 × D, at `a`, row stride LDS) · Bᵀ, B (N × D) at `b`.
template <int N>
__device__ __forceinline__ void rows_times_rows_t(float s[N / 8][4], const u16* a, const u16* b,
                                                  int lane) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        u32 af[4];
        ldsm_x4(af, a + a_row(lane) * LDS + kk * 16 + a_col(lane));
#pragma unroll
        for (int nn = 0; nn < N / 16; ++nn) {
            u32 bf[4];
            ldsm_x4(bf, b + (nn * 16 + b_row(lane)) * LDS + kk * 16 + b_col(lane));
            mma(s[2 * nn], af, bf[0], bf[1]);
            mma(s[2 * nn + 1], af, bf[2], bf[3]);
        }
    }
}

// acc (16 × D) += A (one 16 × 16 block, as fragments) · the 16 rows of V (16 × D) at `v`.
// acc_times_rows keeps its own copy of this loop: calling this from it made the compiler
// spill in the dK/dV kernel.
__device__ __forceinline__ void block_times_rows(float acc[D / 8][4], const u32 af[4],
                                                 const u16* v, int lane) {
#pragma unroll
    for (int dn = 0; dn < D / 16; ++dn) {
        u32 bf[4];
        ldsm_x4_t(bf, v + a_row(lane) * LDS + dn * 16 + a_col(lane));
        mma(acc[2 * dn], af, bf[0], bf[1]);
        mma(acc[2 * dn + 1], af, bf[2], bf[3]);
    }
}

// acc (16 × D) += P (16 × N, accumulator tiles) · V (N × D at `v`, row stride LDS).
template <int N>
__device__ __forceinline__ void acc_times_rows(float acc[D / 8][4], const float p[N / 8][4],
                                               const u16* v, int lane) {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
        u32 af[4];
        acc_to_a(af, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
            u32 bf[4];
            ldsm_x4_t(bf, v + (kk * 16 + a_row(lane)) * LDS + dn * 16 + a_col(lane));
            mma(acc[2 * dn], af, bf[0], bf[1]);
            mma(acc[2 * dn + 1], af, bf[2], bf[3]);
        }
    }
}

// ---- tiles through shared memory ----------------------------------------------------------

// rows [r0, r0 + R) of a (T, D) head into smem (row stride LDS); rows at or past T are zero.
template <int R>
__device__ __forceinline__ void load_rows(u16* dst, const u16* base, const Heads& v, int b, int h,
                                          int r0, const Problem& p) {
    const int chunks = D / 8;  // 8 elements (16 bytes) each
    for (int i = threadIdx.x; i < R * chunks; i += THREADS) {
        int r = i / chunks, c = (i % chunks) * 8;
        u16* d = dst + r * LDS + c;
        int t = r0 + r;
        if (t >= p.t) {
            *(uint4*)d = make_uint4(0, 0, 0, 0);
        } else {
            const u16* s = base + row_at(v, b, h, t) + c;
            if (p.vec) {
                *(uint4*)d = *(const uint4*)s;
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) d[e] = s[e];
            }
        }
    }
}

// ---- asynchronous copies (cp.async, attention_common.cuh) -----------------------------------

extern __shared__ uint4 dyn_smem[];

// load_rows as copies in flight (part of the next committed group) when every row start is
// 16-byte aligned; otherwise the plain loads, complete on return.
template <int R>
__device__ __forceinline__ void load_rows_async(u16* dst, const u16* base, const Heads& v, int b,
                                                int h, int r0, const Problem& p) {
    if (!p.vec) {
        load_rows<R>(dst, base, v, b, h, r0, p);
        return;
    }
    const int chunks = D / 8;
    const u16* first = base + row_at(v, b, h, 0);  // an aligned address for the zero rows
    for (int i = threadIdx.x; i < R * chunks; i += THREADS) {
        int r = i / chunks, c = (i % chunks) * 8;
        int t = r0 + r;
        bool in = t < p.t;
        cp_async16(dst + r * LDS + c, (in ? base + row_at(v, b, h, t) : first) + c, in ? 16 : 0);
    }
}

// The K tile of keys [k0, k0 + N) from stage `st` of `stages` (its V tile N rows after it),
// once it has arrived. First waits until every warp is done with the other stage, then starts
// the copies of the next key tile into it, so they fly while this tile is multiplied.
template <int N>
__device__ __forceinline__ const u16* kv_tile(u16* stages, int stage_elems, int st, int k0,
                                              int keys, const u16* qkv, const Heads& kv,
                                              const Heads& vv, int b, int h, const Problem& p) {
    __syncthreads();
    if (k0 + N < keys) {
        u16* next = stages + (st ^ 1) * stage_elems;
        load_rows_async<N>(next, qkv, kv, b, h, k0 + N, p);
        load_rows_async<N>(next + N * LDS, qkv, vv, b, h, k0 + N, p);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    return stages + st * stage_elems;
}

// A warp's 16 accumulator rows (16 × D) · mul, stored to rows [r0, r0 + 16) of `v` below T.
__device__ __forceinline__ void store_rows(u16* base, const Heads& v, int b, int h, int r0,
                                           const float acc[D / 8][4], float mul0, float mul1,
                                           const Problem& p, int lane) {
    int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        int t = r0 + g + half * 8;
        if (t >= p.t) continue;
        float mul = half ? mul1 : mul0;
        u16* row = base + row_at(v, b, h, t);
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            int c = j * 8 + 2 * t4;
            u16 lo = f32_to_elem(acc[j][2 * half] * mul);
            u16 hi = f32_to_elem(acc[j][2 * half + 1] * mul);
            if (p.vec) {
                *(u32*)(row + c) = (u32)lo | ((u32)hi << 16);
            } else {
                row[c] = lo;
                row[c + 1] = hi;
            }
        }
    }
}

// ---- forward ----------------------------------------------------------------------------------

// Scores of a warp's 16 queries (this thread's rows `row` and row + 8) against BN keys at k0
// into probabilities, folding them into the running max m and sum l (base-2 units) and
// rescaling the output accumulator o. Keys past T and, causally, keys after the query are
// masked where the tile holds such keys (`edge`). The running max is of raw scores: the scale
// is positive, so scaling after the max changes nothing, and each exponent is then one FFMA.
__device__ __forceinline__ void online_softmax(float s[BN / 8][4], float o[D / 8][4], float m[2],
                                               float l[2], int row, int k0, bool edge,
                                               const Problem& p, int t4) {
    if (edge) {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int col = k0 + j * 8 + 2 * t4 + (e & 1);
                if (col >= p.t || (p.causal && col > row + (e >> 1) * 8)) s[j][e] = neg_inf();
            }
        }
    }
    float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
    float alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        // m: the running max in base-2 units (scaled).
        mx[i] = fmaxf(m[i], quad_max(mx[i]) * p.scale_log2);
        // A row with every key so far masked keeps m = -inf; exp2 of (-inf) - (-inf) is
        // NaN, so such rows subtract 0 instead.
        float base = mx[i] == neg_inf() ? 0.f : mx[i];
        alpha[i] = fast_exp2(m[i] - base);
        m[i] = mx[i];
        l[i] *= alpha[i];
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            float p0 = fast_exp2(fmaf(s[j][2 * i], p.scale_log2, -base));
            float p1 = fast_exp2(fmaf(s[j][2 * i + 1], p.scale_log2, -base));
            s[j][2 * i] = p0;
            s[j][2 * i + 1] = p1;
            l[i] += p0 + p1;
        }
    }
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
    }
}

// Dropout on a warp's probabilities or their gradients (rows `row` and row + 8, N keys from
// k0): dropped elements become 0, kept ones are scaled by 1 / (1 - p) where SCALE (the
// forward drops what multiplies V and scales its output at the end instead).
template <int N, bool SCALE>
__device__ __forceinline__ void drop_in_rows(float s[N / 8][4], int bh, int row, int k0,
                                             const Problem& p, int t4) {
#pragma unroll
    for (int j = 0; j < N / 8; j += 2) {
        bool k[2][2][2];
        kept_in_rows2(p, bh, row, k0 + j * 8, t4, k);
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& v = s[j + u][2 * i + e];
                    if (SCALE) {
                        v = k[u][i][e] ? v * p.inv_keep : 0.f;
                    } else if (!k[u][i][e]) {
                        v = 0.f;
                    }
                }
    }
}

// out = o / l (and dropout's 1 / (1 - p)) for a warp's 16 queries from `first`, and their
// lse = ln Σ exp(scaled scores).
__device__ __forceinline__ void finish_rows(u16* out, const Heads& ov, float* lse,
                                            float o[D / 8][4], const float m[2], float l[2],
                                            int bh, int b, int h, int first, bool drop,
                                            const Problem& p, int lane) {
    const int g = lane >> 2, t4 = lane & 3;
    float inv[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] = quad_sum(l[i]);
        inv[i] = l[i] > 0.f ? (drop ? p.inv_keep : 1.f) / l[i] : 0.f;
        int row = first + g + i * 8;
        if (t4 == 0 && row < p.t)
            lse[(i64)bh * p.t + row] = l[i] > 0.f ? (m[i] + log2f(l[i])) * LN2 : neg_inf();
    }
    store_rows(out, ov, b, h, first, o, inv[0], inv[1], p, lane);
}

template <bool DROP>
__device__ __forceinline__ void attn_fwd_impl(const u16* qkv, Heads qv, Heads kv, Heads vv, u16* out, Heads ov, float* lse, Problem p) {
    check_smem(FWD_SMEM);
    u16* const smem = (u16*)dyn_smem;
    u16* const sq = smem + FWD_STAGE;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int bh = pair_index(), b = bh / p.h, h = bh % p.h;
    const int q0 = tile_index(p) * BM;
    const int keys = p.causal ? min(p.t, q0 + BM) : p.t;

    load_rows_async<BM>(sq, qkv, qv, b, h, q0, p);
    load_rows_async<BN>(smem, qkv, kv, b, h, 0, p);
    load_rows_async<BN>(smem + BN * LDS, qkv, vv, b, h, 0, p);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    // This warp's queries as A operands, kept in registers for every key tile.
    u32 qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        ldsm_x4(qf[kk], sq + (warp * 16 + a_row(lane)) * LDS + kk * 16 + a_col(lane));

    float o[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
    const int row0 = q0 + warp * 16 + g;  // this thread's rows: row0 and row0 + 8

    for (int k0 = 0, st = 0; k0 < keys; k0 += BN, st ^= 1) {
        // Stage 1 held the query tile until the first pass through here.
        const u16* sk = kv_tile<BN>(smem, FWD_STAGE, st, k0, keys, qkv, kv, vv, b, h, p);
        const u16* sv = sk + BN * LDS;

        float s[BN / 8][4];
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int nn = 0; nn < BN / 16; ++nn) {
                u32 bf[4];
                ldsm_x4(bf, sk + (nn * 16 + b_row(lane)) * LDS + kk * 16 + b_col(lane));
                mma(s[2 * nn], qf[kk], bf[0], bf[1]);
                mma(s[2 * nn + 1], qf[kk], bf[2], bf[3]);
            }
        }
        const bool edge = k0 + BN > p.t || (p.causal && k0 + BN > q0 + warp * 16);
        online_softmax(s, o, m, l, row0, k0, edge, p, t4);
        if (DROP) drop_in_rows<BN, false>(s, bh, row0, k0, p, t4);
        acc_times_rows<BN>(o, s, sv, lane);
    }
    finish_rows(out, ov, lse, o, m, l, bh, b, h, q0 + warp * 16, DROP, p, lane);
}

// ---- Hopper: the forward on warpgroup MMA (wgmma) ---------------------------------------------

// On sm_90a (H100, H200) at head dim 64 the forward's two products run as wgmma: the CTA's four
// warps are one warpgroup, whose m64n64k16 products read K and V straight from shared memory
// (no ldmatrix per warp) and Q's tile likewise; the probabilities stay in registers as the A
// operand of P·V. Accumulator and A fragments are those of mma.sync per warp (warp w holds rows
// 16w .. 16w + 15), so the softmax above serves both paths. Tiles are 64 rows of 64 elements
// (128 bytes) in the 128-byte swizzle wgmma's descriptors name: 16-byte chunk c of row r sits
// at chunk c ^ (r % 8), each tile starting on 1024 bytes.
#if D == 64 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTN_WGMMA 1
#else
#define ATTN_WGMMA 0
#endif

#if ATTN_WGMMA
#define SW_TILE (64 * 64)
// Q, then two stages of (K, V); 1024 bytes more to align the first tile.
#define FWD_WG_SMEM (5 * SW_TILE * 2 + 1024)

#ifdef ATTN_BF16
#define WG_TYPES ".bf16.bf16"
#else
#define WG_TYPES ".f16.f16"
#endif

// Element (r, c) of a swizzled tile.
__device__ __forceinline__ int sw_at(int r, int c) {
    return r * 64 + (((c >> 3) ^ (r & 7)) << 3) + (c & 7);
}

// Rows [r0, r0 + 64) of a (T, 64) head into a swizzled tile, as load_rows_async does (copies
// in flight with p.vec, else plain loads); rows at or past T are zero. A thread moves the same
// 16-byte column chunk c of rows r, r + RP, r + 2 RP, ...: RP is a multiple of 8, so the
// chunk's swizzled place only moves by whole rows, and a tile's copies take one address
// computation and a few additions (they were a third of the forward loop's instructions).
__device__ __forceinline__ void load_tile_sw(u16* dst, const u16* base, const Heads& v, int b,
                                             int h, int r0, const Problem& p) {
    constexpr int RP = THREADS / 8;  // rows per pass: 8 chunks of 16 bytes a row
    static_assert(RP % 8 == 0 && 64 % RP == 0, "whole passes of 8-row swizzle groups");
    const int r = threadIdx.x >> 3, c = (threadIdx.x & 7) * 8;
    const u16* head = base + row_at(v, b, h, 0);  // also the aligned address of the zero rows
    const u16* src = head + (i64)(r0 + r) * v.st + c;
    const i64 step = (i64)RP * v.st;
    u16* const d = dst + sw_at(r, c);
    if (p.vec) {
#pragma unroll
        for (int k = 0; k < 64 / RP; ++k) {
            const bool in = r0 + r + k * RP < p.t;
            cp_async16(d + k * RP * 64, in ? src + k * step : head + c, in ? 16 : 0);
        }
        return;
    }
    for (int k = 0; k < 64 / RP; ++k) {
        const bool in = r0 + r + k * RP < p.t;
#pragma unroll
        for (int e = 0; e < 8; ++e) d[k * RP * 64 + e] = in ? src[k * step + e] : (u16)0;
    }
}

// Copies that landed by cp.async or plain stores (the generic proxy) become visible to wgmma's
// reads (the async proxy) after this and a barrier.
__device__ __forceinline__ void fence_async_proxy() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The first 1024-byte boundary in dynamic shared memory (the launch asks 1024 bytes more).
__device__ __forceinline__ u16* aligned_1024(void* smem) {
    const u32 misalign = smem_addr(smem) & 1023;
    return (u16*)((char*)smem + ((1024 - misalign) & 1023));
}

// kv_tile for swizzled tiles: the K tile of keys [k0, k0 + 64) from stage `st` (its V tile
// after it), once it has arrived and is visible to wgmma; the next key tile's copies start
// into the other stage first.
__device__ __forceinline__ const u16* kv_tile_sw(u16* stages, int st, int k0, int keys,
                                                 const u16* qkv, const Heads& kv, const Heads& vv,
                                                 int b, int h, const Problem& p) {
    __syncthreads();
    if (k0 + 64 < keys) {
        u16* next = stages + (st ^ 1) * 2 * SW_TILE;
        load_tile_sw(next, qkv, kv, b, h, k0 + 64, p);
        load_tile_sw(next + SW_TILE, qkv, vv, b, h, k0 + 64, p);
    }
    cp_async_commit();
    cp_async_wait<1>();
    fence_async_proxy();
    __syncthreads();
    return stages + st * 2 * SW_TILE;
}

// A shared-memory matrix descriptor of a swizzled tile: start address, leading byte offset
// (unused by K-major operands; between 64-column blocks for N-major ones, of which a 64-wide
// tile has one), 1024 bytes between groups of 8 rows, 128-byte swizzle.
__device__ __forceinline__ u64 sw_desc(const u16* tile) {
    return (u64)((smem_addr(tile) & 0x3ffff) >> 4) | ((u64)(SW_TILE * 2 >> 4) << 16) |
           ((u64)(1024 >> 4) << 32) | (1ull << 62);
}
// A descriptor's step to the next 16 columns of a K-major tile (32 bytes) and to the next 16
// rows of an N-major one (2048 bytes), in its 16-byte units.
#define SW_K_STEP 2
#define SW_ROW_STEP 128

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_wait_all() {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// The accumulators are written behind the compiler's back until the wait: this pins every
// read and write of them to its side of the wait (and of the fence).
__device__ __forceinline__ void wg_pin(float d[8][4]) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

// At the head of a loop whose accumulators carry over from the last iteration's products: a
// wait (nothing is in flight there, so it costs nothing) that shows ptxas the carried registers
// settled. Without it ptxas may place its own wait for them inside a branch that differs
// between the warps (a causal edge, a bounds check), and then serialises every wgmma of the
// kernel, each product waited for before the next issues (its note C7518): the dK/dV kernel
// compiled so (scripts/check_wgmma.sh looks for the note).
__device__ __forceinline__ void wg_settled(float d[8][4]) {
    wg_wait_all();
    wg_pin(d);
}
__device__ __forceinline__ void wg_settled(float a[8][4], float b[8][4]) {
    wg_wait_all();
    wg_pin(a);
    wg_pin(b);
}

// The 32 f32 accumulator registers of an m64n64 product (this thread's fragment d[8][4]): as
// the instruction's operand list, and as the asm statement's read-write operands %0 to %31.
#define WG_ACC_REGS                                                                            \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_ACC_ROW(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define WG_ACC(d)                                                                              \
    WG_ACC_ROW(d, 0), WG_ACC_ROW(d, 1), WG_ACC_ROW(d, 2), WG_ACC_ROW(d, 3), WG_ACC_ROW(d, 4), \
        WG_ACC_ROW(d, 5), WG_ACC_ROW(d, 6), WG_ACC_ROW(d, 7)

// d (64 × 64, f32; this thread's fragment) += A · B, A (64 × 16) and B (16 × 64) K-major tiles
// in shared memory.
__device__ __forceinline__ void wgmma_ss(float d[8][4], u64 a, u64 b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32" WG_TYPES " "
        WG_ACC_REGS ", %32, %33, 1, 1, 1, 0, 0;\n"
        : WG_ACC(d)
        : "l"(a), "l"(b));
}

// d (64 × 64, f32) += A · B, A (64 × 16) from registers (mma.sync's A fragment per warp), B
// (16 × 64) an N-major tile in shared memory (rows of 64 contiguous columns).
__device__ __forceinline__ void wgmma_rs_nmajor(float d[8][4], const u32 a[4], u64 b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32" WG_TYPES " "
        WG_ACC_REGS ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
        : WG_ACC(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d = A Bᵀ (64 × 64, f32, over the head dim), A and B K-major tiles by descriptor: issued;
// wg_commit, wg_wait_all and wg_pin(d) before d is read.
__device__ __forceinline__ void wg_issue_rows_times_rows_t(float d[8][4], u64 a, u64 b) {
#pragma unroll
    for (int j = 0; j < 8; ++j) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.f;
    wg_pin(d);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) wgmma_ss(d, a + kk * SW_K_STEP, b + kk * SW_K_STEP);
}

// acc += P B: P the 64 × 64 accumulator tile p (this thread's fragment) packed to 16 bits as
// four A blocks of 16 columns, B (64 rows) an N-major tile by descriptor: issued; wg_commit,
// wg_wait_all and wg_pin(acc) before acc is read.
__device__ __forceinline__ void wg_issue_acc_times_rows(float acc[8][4], const float p[8][4],
                                                        u64 b) {
    u32 a[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) acc_to_a(a[kk], p[2 * kk], p[2 * kk + 1]);
    wg_pin(acc);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs_nmajor(acc, a[kk], b + kk * SW_ROW_STEP);
}

template <bool DROP>
__device__ __forceinline__ void attn_fwd_wgmma_impl(const u16* qkv, Heads qv, Heads kv, Heads vv,
                                                    u16* out, Heads ov, float* lse, Problem p) {
    check_smem(FWD_WG_SMEM);
    u16* const sq = aligned_1024(dyn_smem);
    u16* const stages = sq + SW_TILE;  // 2 × (K tile, V tile)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int bh = pair_index(), b = bh / p.h, h = bh % p.h;
    const int q0 = tile_index(p) * BM;
    const int keys = p.causal ? min(p.t, q0 + BM) : p.t;

    load_tile_sw(sq, qkv, qv, b, h, q0, p);
    load_tile_sw(stages, qkv, kv, b, h, 0, p);
    load_tile_sw(stages + SW_TILE, qkv, vv, b, h, 0, p);
    cp_async_commit();
    const u64 qd = sw_desc(sq);

    float o[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
    const int row0 = q0 + warp * 16 + g;  // this thread's rows: row0 and row0 + 8

    for (int k0 = 0, st = 0; k0 < keys; k0 += BN, st ^= 1) {
        wg_settled(o);
        const u16* sk = kv_tile_sw(stages, st, k0, keys, qkv, kv, vv, b, h, p);
        const u64 kd = sw_desc(sk), vd = sw_desc(sk + SW_TILE);

        // S = Q Kᵀ.
        float s[BN / 8][4];
        wg_issue_rows_times_rows_t(s, qd, kd);
        wg_commit();
        wg_wait_all();
        wg_pin(s);

        const bool edge = k0 + BN > p.t || (p.causal && k0 + BN > q0 + warp * 16);
        online_softmax(s, o, m, l, row0, k0, edge, p, t4);
        if (DROP) drop_in_rows<BN, false>(s, bh, row0, k0, p, t4);

        // O += P V.
        wg_issue_acc_times_rows(o, s, vd);
        wg_commit();
        wg_wait_all();
        wg_pin(o);
    }
    finish_rows(out, ov, lse, o, m, l, bh, b, h, q0 + warp * 16, DROP, p, lane);
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS, FWD_CTAS)
    attn_fwd(const u16* qkv, Heads qv, Heads kv, Heads vv, u16* out, Heads ov, float* lse, Problem p) {
#if ATTN_WGMMA
    attn_fwd_wgmma_impl<false>(qkv, qv, kv, vv, out, ov, lse, p);
#else
    attn_fwd_impl<false>(qkv, qv, kv, vv, out, ov, lse, p);
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS, FWD_DROPOUT_CTAS)
    attn_fwd_dropout(const u16* qkv, Heads qv, Heads kv, Heads vv, u16* out, Heads ov, float* lse, Problem p) {
#if ATTN_WGMMA
    attn_fwd_wgmma_impl<true>(qkv, qv, kv, vv, out, ov, lse, keyed(p));
#else
    attn_fwd_impl<true>(qkv, qv, kv, vv, out, ov, lse, keyed(p));
#endif
}

// ---- backward -------------------------------------------------------------------------------

// delta[row] = Σ_d gout · out. A row is DELTA_LANES lanes of 8 elements each (added in order),
// then added up by shuffles within those lanes, so a warp takes 32 / DELTA_LANES rows at once.
// With p.vec (every row start on 16 bytes) a lane's 8 elements are one 16-byte load of each
// operand, else 8 loads: the same sums in the same order, so the same bits either way.
#define DELTA_LANES (D <= 16 ? 2 : D <= 32 ? 4 : D <= 64 ? 8 : 16)
extern "C" __global__ void attn_delta(const u16* out, Heads ov, const u16* gout, Heads gv,
                                      float* delta, Problem p) {
    constexpr int per_warp = 32 / DELTA_LANES;
    const int lane = threadIdx.x & 31, sub = lane % DELTA_LANES, c = 8 * sub;
    const i64 rows = (i64)p.b * p.h * p.t;
    const i64 warp = (i64)blockIdx.x * WARPS + (threadIdx.x >> 5), warps = (i64)gridDim.x * WARPS;
    for (i64 r0 = warp * per_warp; r0 < rows; r0 += warps * per_warp) {
        const i64 r = r0 + lane / DELTA_LANES;
        float acc = 0.f;
        if (r < rows && c < D) {
            const int t = (int)(r % p.t), bh = (int)(r / p.t), b = bh / p.h, h = bh % p.h;
            const u16* o = out + row_at(ov, b, h, t) + c;
            const u16* go = gout + row_at(gv, b, h, t) + c;
            Pack16<u16> ov8, gv8;
            if (p.vec) {
                ov8 = *(const Pack16<u16>*)o;
                gv8 = *(const Pack16<u16>*)go;
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    ov8.v[e] = o[e];
                    gv8.v[e] = go[e];
                }
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) acc += elem_to_f32(ov8.v[e]) * elem_to_f32(gv8.v[e]);
        }
#pragma unroll
        for (int s = DELTA_LANES / 2; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
        if (sub == 0 && r < rows) delta[r] = acc;
    }
}

// The (Q, dO) tile of queries [q0, q0 + BQ) and their (lse, delta) rows into one stage of
// the dK/dV kernel, in flight; rows past T are zeros (the kernel masks them).
__device__ __forceinline__ void load_query_stage(u16* sq, float* sl, const u16* qkv, const Heads& qv,
                                                 const u16* gout, const Heads& gov, const float* lse,
                                                 const float* delta, int bh, int q0, const Problem& p) {
    const int b = bh / p.h, h = bh % p.h;
    load_rows_async<BQ>(sq, qkv, qv, b, h, q0, p);
    load_rows_async<BQ>(sq + BQ * LDS, gout, gov, b, h, q0, p);
    for (int i = threadIdx.x; i < BQ; i += THREADS) {
        int t = q0 + i;
        bool in = t < p.t;
        i64 at = (i64)bh * p.t + (in ? t : 0);
        cp_async4(sl + i, lse + at, in ? 4 : 0);
        cp_async4(sl + BQ + i, delta + at, in ? 4 : 0);
    }
}

// With dropout: the kept mask of a dK/dV tile (queries q0.., this warp's keys from kb) as
// bits, not floats, so the registers go to the tiles: element e of tile j at bit
// 16·(e >> 1) + 8·(j & 1) + (e & 1) of mb[j / 2], as kept_cols2 lays them out. Drawn before
// the products, so the generator's temporaries are dead while the tiles are live.
__device__ __forceinline__ void dkdv_mask(u32 mb[BQ / 16], const Problem& p, int bh, int q0,
                                          int kb, int g, int t4) {
    const bool shared = p.t % 8 == 0;
#pragma unroll
    for (int j = 0; j < BQ / 8; j += 2) {
        u32 bits = 0;
        if (shared) {
            bits = kept_cols2(p, bh, q0 + j * 8, kb, g, t4);
        } else {
#pragma unroll
            for (int u = 0; u < 2; ++u)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    bits |= (u32)kept(p, bh, q0 + (j + u) * 8 + 2 * t4 + (e & 1),
                                      kb + g + (e >> 1) * 8)
                            << (16 * (e >> 1) + 8 * u + (e & 1));
        }
        mb[j / 2] = bits;
    }
}

// Sᵀ scores (this warp's 16 keys from kb × BQ queries from q0) into probabilities Pᵀ from the
// queries' lse (`sl`, natural log); zero where the key follows the query (causal, `edge`) and
// for queries past T (zero rows, zero lse).
__device__ __forceinline__ void dkdv_probabilities(float pt[BQ / 8][4], const float* sl, int q0,
                                                   int kb, const Problem& p, int g, int t4) {
    const bool edge = p.causal && q0 < kb + 16, tail = q0 + BQ > p.t;
#pragma unroll
    for (int j = 0; j < BQ / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int qi = j * 8 + 2 * t4 + (e & 1);
            pt[j][e] = fast_exp2(fmaf(pt[j][e], p.scale_log2, -__fmul_rn(sl[qi], LOG2E)));
        }
    }
    if (edge || tail) {
#pragma unroll
        for (int j = 0; j < BQ / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int qi = j * 8 + 2 * t4 + (e & 1);
                int key = kb + g + (e >> 1) * 8;
                if ((edge && q0 + qi < key) || (tail && q0 + qi >= p.t)) pt[j][e] = 0.f;
            }
        }
    }
}

// dSᵀ = Pᵀ ∘ (dPᵀ ∘ M − delta) in place of dPᵀ (`sd`: the queries' delta).
template <bool DROP>
__device__ __forceinline__ void dkdv_score_grads(float ds[BQ / 8][4], const float pt[BQ / 8][4],
                                                 const u32 mb[BQ / 16], const float* sd,
                                                 const Problem& p, int t4) {
#pragma unroll
    for (int j = 0; j < BQ / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int qi = j * 8 + 2 * t4 + (e & 1);
            float dp = DROP ? ds[j][e] * mask_at(mb, j, e, p) : ds[j][e];
            ds[j][e] = pt[j][e] * (dp - sd[qi]);
        }
    }
}

// dK, dV of 64 keys: every query tile at or after them (causal) recomputes its probabilities.
// Warp w owns keys k0 + 16w .. k0 + 16w + 15, so nothing is shared between warps but the
// tiles. Works on transposed products (keys as rows): Sᵀ = K Qᵀ, dV += Pᵀ dO,
// dPᵀ = V dOᵀ, dSᵀ = Pᵀ ∘ (dPᵀ − delta), dK += dSᵀ Q.
template <bool DROP>
__device__ __forceinline__ void attn_bwd_dkdv_impl(const u16* qkv, Heads qv, Heads kv, Heads vv, const u16* gout, Heads gov, const float* lse, const float* delta, u16* grads, Heads gkv, Heads gvv, Problem p) {
    check_smem(DKDV_SMEM);
    u16* const sk = (u16*)dyn_smem;
    u16* const sv = sk + BM * LDS;
    u16* const stages = sv + BM * LDS;                 // 2 × (Q tile, dO tile)
    float* const stats = (float*)(stages + 2 * DKDV_STAGE);  // 2 × (lse, delta)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int bh = pair_index(), b = bh / p.h, h = bh % p.h;
    const int k0 = key_tile_index() * BM;
    const int first = p.causal ? (k0 / BQ) * BQ : 0;

    load_rows_async<BM>(sk, qkv, kv, b, h, k0, p);
    load_rows_async<BM>(sv, qkv, vv, b, h, k0, p);
    load_query_stage(stages, stats, qkv, qv, gout, gov, lse, delta, bh, first, p);
    cp_async_commit();
    const u16* wk = sk + warp * 16 * LDS;
    const u16* wv = sv + warp * 16 * LDS;
    const int kb = k0 + warp * 16;  // this warp's first key

    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;

    for (int q0 = first, st = 0; q0 < p.t; q0 += BQ, st ^= 1) {
        // Every warp is done with the other stage: the next query tile streams into it.
        __syncthreads();
        if (q0 + BQ < p.t)
            load_query_stage(stages + (st ^ 1) * DKDV_STAGE, stats + (st ^ 1) * 2 * BQ, qkv, qv,
                             gout, gov, lse, delta, bh, q0 + BQ, p);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const u16* sq = stages + st * DKDV_STAGE;
        const u16* sdo = sq + BQ * LDS;
        const float* sl = stats + st * 2 * BQ;  // lse (natural log) of the tile's queries
        const float* sd = sl + BQ;               // delta of the tile's queries

        // With dropout, M (0 or 1/(1 - p)): dV takes (P ∘ M)ᵀ dO and the probabilities'
        // gradient is dP̃ ∘ M. Rows past T need no mask: their probabilities are 0 and their
        // gradients unstored.
        u32 mb[BQ / 16];
        if (DROP) dkdv_mask(mb, p, bh, q0, kb, g, t4);

        // Pᵀ (16 keys × BQ queries).
        float pt[BQ / 8][4];
        rows_times_rows_t<BQ>(pt, wk, sq, lane);
        dkdv_probabilities(pt, sl, q0, kb, p, g, t4);
        if (DROP) {
            // dV += (P ∘ M)ᵀ dO, one 16-query block of P ∘ M at a time (not a second copy of
            // the tile: at 3 CTAs per SM the registers would spill).
#pragma unroll
            for (int kk = 0; kk < BQ / 16; ++kk) {
                float lo[4], hi[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    lo[e] = pt[2 * kk][e] * mask_at(mb, 2 * kk, e, p);
                    hi[e] = pt[2 * kk + 1][e] * mask_at(mb, 2 * kk + 1, e, p);
                }
                u32 af[4];
                acc_to_a(af, lo, hi);
                block_times_rows(dv, af, sdo + kk * 16 * LDS, lane);
            }
        } else {
            acc_times_rows<BQ>(dv, pt, sdo, lane);
        }

        // dSᵀ = Pᵀ ∘ (dPᵀ − delta).
        float ds[BQ / 8][4];
        rows_times_rows_t<BQ>(ds, wv, sdo, lane);
        dkdv_score_grads<DROP>(ds, pt, mb, sd, p, t4);
        acc_times_rows<BQ>(dk, ds, sq, lane);
    }
    store_rows(grads, gkv, b, h, kb, dk, p.scale, p.scale, p, lane);
    store_rows(grads, gvv, b, h, kb, dv, 1.f, 1.f, p, lane);
}

#if ATTN_WGMMA
// The dK/dV kernel on wgmma (head dim 64, sm_90a): the CTA's K and V tiles are the A operands
// of Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (K-major descriptors, Q and dO K-major B operands); Pᵀ ∘ M and
// dSᵀ, in registers, are the A operands of dV += Pᵀ dO and dK += dSᵀ Q (dO and Q N-major).
// Same tiles, stages and per-warp rows as the mma.sync kernel.
#define DKDV_WG_SMEM (6 * SW_TILE * 2 + 2 * 2 * BQ * 4 + 1024)

__device__ __forceinline__ void load_query_stage_sw(u16* sq, float* sl, const u16* qkv,
                                                    const Heads& qv, const u16* gout,
                                                    const Heads& gov, const float* lse,
                                                    const float* delta, int b, int h, int q0,
                                                    const Problem& p) {
    load_tile_sw(sq, qkv, qv, b, h, q0, p);
    load_tile_sw(sq + SW_TILE, gout, gov, b, h, q0, p);
    // The queries' lse into sl[0, BQ) and their delta into sl[BQ, 2 BQ): a value a thread.
    static_assert(2 * BQ <= THREADS, "one statistic per thread");
    const int i = threadIdx.x;
    if (i < 2 * BQ) {
        const int t = q0 + i % BQ;
        const bool in = t < p.t;
        const i64 at = (i64)(b * p.h + h) * p.t + (in ? t : 0);
        cp_async4(sl + i, (i < BQ ? lse : delta) + at, in ? 4 : 0);
    }
}

template <bool DROP>
__device__ __forceinline__ void attn_bwd_dkdv_wgmma_impl(const u16* qkv, Heads qv, Heads kv, Heads vv, const u16* gout, Heads gov, const float* lse, const float* delta, u16* grads, Heads gkv, Heads gvv, Problem p) {
    check_smem(DKDV_WG_SMEM);
    u16* const sk = aligned_1024(dyn_smem);
    u16* const sv = sk + SW_TILE;
    u16* const stages = sv + SW_TILE;                    // 2 × (Q tile, dO tile)
    float* const stats = (float*)(stages + 4 * SW_TILE);  // 2 × (lse, delta)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int bh = pair_index(), b = bh / p.h, h = bh % p.h;
    const int k0 = key_tile_index() * BM;
    const int first = p.causal ? (k0 / BQ) * BQ : 0;

    load_tile_sw(sk, qkv, kv, b, h, k0, p);
    load_tile_sw(sv, qkv, vv, b, h, k0, p);
    load_query_stage_sw(stages, stats, qkv, qv, gout, gov, lse, delta, b, h, first, p);
    cp_async_commit();
    const u64 kd = sw_desc(sk), vd = sw_desc(sv);
    const int kb = k0 + warp * 16;  // this warp's first key

    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;

    for (int q0 = first, st = 0; q0 < p.t; q0 += BQ, st ^= 1) {
        wg_settled(dk, dv);
        __syncthreads();
        if (q0 + BQ < p.t)
            load_query_stage_sw(stages + (st ^ 1) * 2 * SW_TILE, stats + (st ^ 1) * 2 * BQ, qkv,
                                qv, gout, gov, lse, delta, b, h, q0 + BQ, p);
        cp_async_commit();
        cp_async_wait<1>();
        fence_async_proxy();
        __syncthreads();
        const u16* sq = stages + st * 2 * SW_TILE;
        const u64 qd = sw_desc(sq), dod = sw_desc(sq + SW_TILE);
        const float* sl = stats + st * 2 * BQ;
        const float* sd = sl + BQ;

        u32 mb[BQ / 16];
        if (DROP) dkdv_mask(mb, p, bh, q0, kb, g, t4);

        // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, both in flight at once.
        float pt[BQ / 8][4], ds[BQ / 8][4];
        wg_issue_rows_times_rows_t(pt, kd, qd);
        wg_issue_rows_times_rows_t(ds, vd, dod);
        wg_commit();
        wg_wait_all();
        wg_pin(pt);
        wg_pin(ds);

        dkdv_probabilities(pt, sl, q0, kb, p, g, t4);
        // dV += (P ∘ M)ᵀ dO, in flight while dSᵀ is computed.
        if (DROP) {
            float pm[BQ / 8][4];
#pragma unroll
            for (int j = 0; j < BQ / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) pm[j][e] = pt[j][e] * mask_at(mb, j, e, p);
            wg_issue_acc_times_rows(dv, pm, dod);
        } else {
            wg_issue_acc_times_rows(dv, pt, dod);
        }
        wg_commit();

        dkdv_score_grads<DROP>(ds, pt, mb, sd, p, t4);
        wg_issue_acc_times_rows(dk, ds, qd);
        wg_commit();
        wg_wait_all();
        wg_pin(dv);
        wg_pin(dk);
    }
    store_rows(grads, gkv, b, h, kb, dk, p.scale, p.scale, p, lane);
    store_rows(grads, gvv, b, h, kb, dv, 1.f, 1.f, p, lane);
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS, DKDV_CTAS)
    attn_bwd_dkdv(const u16* qkv, Heads qv, Heads kv, Heads vv, const u16* gout, Heads gov, const float* lse, const float* delta, u16* grads, Heads gkv, Heads gvv, Problem p) {
#if ATTN_WGMMA
    attn_bwd_dkdv_wgmma_impl<false>(qkv, qv, kv, vv, gout, gov, lse, delta, grads, gkv, gvv, p);
#else
    attn_bwd_dkdv_impl<false>(qkv, qv, kv, vv, gout, gov, lse, delta, grads, gkv, gvv, p);
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS)
    attn_bwd_dkdv_dropout(const u16* qkv, Heads qv, Heads kv, Heads vv, const u16* gout, Heads gov, const float* lse, const float* delta, u16* grads, Heads gkv, Heads gvv, Problem p) {
#if ATTN_WGMMA
    attn_bwd_dkdv_wgmma_impl<true>(qkv, qv, kv, vv, gout, gov, lse, delta, grads, gkv, gvv, keyed(p));
#else
    attn_bwd_dkdv_impl<true>(qkv, qv, kv, vv, gout, gov, lse, delta, grads, gkv, gvv, keyed(p));
#endif
}

// P from the scores S of a warp's 16 queries (rows `row`, row + 8; their lse in base 2, l2)
// against BNQ keys at k0; zero for keys past T and, causally, keys after the query, where the
// tile holds such keys.
__device__ __forceinline__ void dq_probabilities(float s[BNQ / 8][4], const float l2[2], int row,
                                                 int k0, int first_row, const Problem& p,
                                                 int t4) {
    const bool edge = k0 + BNQ > p.t || (p.causal && k0 + BNQ > first_row);
#pragma unroll
    for (int j = 0; j < BNQ / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = fast_exp2(fmaf(s[j][e], p.scale_log2, -l2[e >> 1]));
    if (edge) {
#pragma unroll
        for (int j = 0; j < BNQ / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int col = k0 + j * 8 + 2 * t4 + (e & 1);
                if (col >= p.t || (p.causal && col > row + (e >> 1) * 8)) s[j][e] = 0.f;
            }
        }
    }
}

// dS = P ∘ (dP ∘ M − delta) in place of dP (M: dropout's kept mask as 0 or 1/(1 − p)).
template <bool DROP>
__device__ __forceinline__ void dq_score_grads(float ds[BNQ / 8][4], const float s[BNQ / 8][4],
                                               const float dl[2], int bh, int row, int k0,
                                               const Problem& p, int t4) {
    if (DROP) drop_in_rows<BNQ, true>(ds, bh, row, k0, p, t4);
#pragma unroll
    for (int j = 0; j < BNQ / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[j][e] = s[j][e] * (ds[j][e] - dl[e >> 1]);
}

// A warp's lse (base 2) and delta for its rows `row` and row + 8; rows past T get +inf and 0,
// so their probabilities and gradients are 0.
__device__ __forceinline__ void dq_row_stats(float l2[2], float dl[2], const float* lse,
                                             const float* delta, int bh, int row,
                                             const Problem& p) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        int r = row + i * 8;
        l2[i] = r < p.t ? lse[(i64)bh * p.t + r] * LOG2E : __int_as_float(0x7f800000);
        dl[i] = r < p.t ? delta[(i64)bh * p.t + r] : 0.f;
    }
}

// dQ of 64 queries: every key tile they see. S = Q Kᵀ, P from lse, dP = dO Vᵀ,
// dS = P ∘ (dP − delta), dQ += dS K.
template <bool DROP>
__device__ __forceinline__ void attn_bwd_dq_impl(const u16* qkv, Heads qv, Heads kv, Heads vv, const u16* gout, Heads gov, const float* lse, const float* delta, u16* grads, Heads gqv, Problem p) {
    check_smem(DQ_SMEM);
    u16* const sq = (u16*)dyn_smem;
    u16* const sdo = sq + BM * LDS;
    u16* const stages = sdo + BM * LDS;  // 2 × (K tile, V tile)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int bh = pair_index(), b = bh / p.h, h = bh % p.h;
    const int q0 = tile_index(p) * BM;
    const int keys = p.causal ? min(p.t, q0 + BM) : p.t;

    load_rows_async<BM>(sq, qkv, qv, b, h, q0, p);
    load_rows_async<BM>(sdo, gout, gov, b, h, q0, p);
    load_rows_async<BNQ>(stages, qkv, kv, b, h, 0, p);
    load_rows_async<BNQ>(stages + BNQ * LDS, qkv, vv, b, h, 0, p);
    cp_async_commit();
    const int row0 = q0 + warp * 16 + g;
    float l2[2], dl[2];
    dq_row_stats(l2, dl, lse, delta, bh, row0, p);
    const u16* wq = sq + warp * 16 * LDS;
    const u16* wdo = sdo + warp * 16 * LDS;

    float dq[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.f;

    for (int k0 = 0, st = 0; k0 < keys; k0 += BNQ, st ^= 1) {
        const u16* sk = kv_tile<BNQ>(stages, DQ_STAGE, st, k0, keys, qkv, kv, vv, b, h, p);
        const u16* sv = sk + BNQ * LDS;

        float s[BNQ / 8][4];
        rows_times_rows_t<BNQ>(s, wq, sk, lane);
        dq_probabilities(s, l2, row0, k0, q0 + warp * 16, p, t4);
        float ds[BNQ / 8][4];
        rows_times_rows_t<BNQ>(ds, wdo, sv, lane);
        dq_score_grads<DROP>(ds, s, dl, bh, row0, k0, p, t4);
        acc_times_rows<BNQ>(dq, ds, sk, lane);
    }
    store_rows(grads, gqv, b, h, q0 + warp * 16, dq, p.scale, p.scale, p, lane);
}

#if ATTN_WGMMA
// The dQ kernel on wgmma (head dim 64, sm_90a): S = Q Kᵀ and dP = dO Vᵀ with all four
// operands K-major tiles in shared memory; dQ += dS K with dS from registers and K N-major.
#define DQ_WG_SMEM (6 * SW_TILE * 2 + 1024)

template <bool DROP>
__device__ __forceinline__ void attn_bwd_dq_wgmma_impl(const u16* qkv, Heads qv, Heads kv, Heads vv, const u16* gout, Heads gov, const float* lse, const float* delta, u16* grads, Heads gqv, Problem p) {
    check_smem(DQ_WG_SMEM);
    u16* const sq = aligned_1024(dyn_smem);
    u16* const sdo = sq + SW_TILE;
    u16* const stages = sdo + SW_TILE;  // 2 × (K tile, V tile)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int bh = pair_index(), b = bh / p.h, h = bh % p.h;
    const int q0 = tile_index(p) * BM;
    const int keys = p.causal ? min(p.t, q0 + BM) : p.t;

    load_tile_sw(sq, qkv, qv, b, h, q0, p);
    load_tile_sw(sdo, gout, gov, b, h, q0, p);
    load_tile_sw(stages, qkv, kv, b, h, 0, p);
    load_tile_sw(stages + SW_TILE, qkv, vv, b, h, 0, p);
    cp_async_commit();
    const int row0 = q0 + warp * 16 + g;
    float l2[2], dl[2];
    dq_row_stats(l2, dl, lse, delta, bh, row0, p);
    const u64 qd = sw_desc(sq), dod = sw_desc(sdo);

    float dq[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.f;

    for (int k0 = 0, st = 0; k0 < keys; k0 += BNQ, st ^= 1) {
        wg_settled(dq);
        const u16* sk = kv_tile_sw(stages, st, k0, keys, qkv, kv, vv, b, h, p);
        const u64 kd = sw_desc(sk), vd = sw_desc(sk + SW_TILE);

        // S = Q Kᵀ and dP = dO Vᵀ, both in flight at once.
        float s[BNQ / 8][4], ds[BNQ / 8][4];
        wg_issue_rows_times_rows_t(s, qd, kd);
        wg_issue_rows_times_rows_t(ds, dod, vd);
        wg_commit();
        wg_wait_all();
        wg_pin(s);
        wg_pin(ds);

        dq_probabilities(s, l2, row0, k0, q0 + warp * 16, p, t4);
        dq_score_grads<DROP>(ds, s, dl, bh, row0, k0, p, t4);
        wg_issue_acc_times_rows(dq, ds, kd);
        wg_commit();
        wg_wait_all();
        wg_pin(dq);
    }
    store_rows(grads, gqv, b, h, q0 + warp * 16, dq, p.scale, p.scale, p, lane);
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS)
    attn_bwd_dq(const u16* qkv, Heads qv, Heads kv, Heads vv, const u16* gout, Heads gov, const float* lse, const float* delta, u16* grads, Heads gqv, Problem p) {
#if ATTN_WGMMA
    attn_bwd_dq_wgmma_impl<false>(qkv, qv, kv, vv, gout, gov, lse, delta, grads, gqv, p);
#else
    attn_bwd_dq_impl<false>(qkv, qv, kv, vv, gout, gov, lse, delta, grads, gqv, p);
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS)
    attn_bwd_dq_dropout(const u16* qkv, Heads qv, Heads kv, Heads vv, const u16* gout, Heads gov, const float* lse, const float* delta, u16* grads, Heads gqv, Problem p) {
#if ATTN_WGMMA
    attn_bwd_dq_wgmma_impl<true>(qkv, qv, kv, vv, gout, gov, lse, delta, grads, gqv, keyed(p));
#else
    attn_bwd_dq_impl<true>(qkv, qv, kv, vv, gout, gov, lse, delta, grads, gqv, keyed(p));
#endif
}

