// attention_f32.cu — fused scaled-dot-product attention for f32 heads: FlashAttention-2's
// algorithm with f32 accuracy on tensor cores. Every product runs as three TF32 products
// (`mma.sync` m16n8k8, f32 accumulation): each operand x is split into big = x rounded to
// TF32's 10 mantissa bits and small = the rest (x - big, exact in f32) truncated to TF32, and
// a·b = small_a·big_b + big_a·small_b + big_a·big_b, the small terms first. What is dropped
// (small·small and the truncation of small) is about 2^-21 of each product, near f32's own
// rounding (2^-24) and far below TF32's (2^-11): the products stay f32-accurate with TF32 off,
// as PyTorch's f32 memory-efficient attention computes them. Beside attention.cu's f16/bf16
// kernels, with the same kernels, arguments and results: forward writes out and lse (natural log),
// attn_delta writes rowsum(gout ∘ out), and the backward is two kernels (dK/dV per key tile,
// dQ per query tile), deterministic, causal tiles past the diagonal never visited. Each of
// attn_fwd, attn_bwd_dkdv and attn_bwd_dq has a `_dropout` twin (the mask drawn as the
// dropout op draws it over the composed path's probabilities, from the Problem's key).
//
// Compiled once per head dim: the launcher (cuda/attention.rs) prepends `#define HEAD_DIM n`.
// Operands are (B, H, T, D) views with unit stride along D (`Heads`); lse and delta are dense
// (B, H, T) f32.
//
// Work split: 4 warps of 32 lanes, lane = 4g + t. Warp w owns rows 16w .. 16w + 15 of the
// CTA's 64 and a lane the two rows 16w + g and 16w + g + 8 of them (`Lane::row`); of a
// streamed tile or of the head dim, the columns 2t and 2t + 1 of every 8 (`Lane::col`): the
// accumulator layout of mma.m16n8k8, so no value moves between a product and the softmax.
// Row statistics are reduced over the 4 lanes of a row (a quad) by shuffles, and
// probabilities go through shared memory for the product with the next operand. Shared rows
// are padded by 4 floats, so a fragment read along rows (8 rows × 4 columns: every A operand,
// and K's, dO's or Q's rows as B) falls in distinct banks; the (BN × D) tile multiplied by
// probabilities is read across rows (4 rows × 8 columns) and meets two-way conflicts. Needs
// compute capability 8.0 (TF32 `mma.sync`), as attention.cu does.
//
// Tiles arrive by 16-byte asynchronous copies (cp.async) where every row start is 16-byte
// aligned (`Problem::vec`), by plain loads otherwise, and the next tile's copies fly while
// the current one is multiplied: the forward keeps two stages of K/V tiles; the backward
// kernels, whose shared memory holds three CTAs per SM only with one stage, refill each
// streamed operand as soon as its last product has read it (dK/dV: dO during the dSᵀ·Q
// product, Q during the next V·dOᵀ; dQ: V during the dS·K product, K during the next
// dO·Vᵀ).

#define D HEAD_DIM
#define THREADS 128
#define BM 64
// Keys per streamed tile (forward, dQ) and queries per tile (dK/dV).
#define BN 32
#define LDF (D + 4)
#define LDP (BN + 4)
#define RPT 2           // rows per lane
#define CPT (BN / 4)    // tile columns per lane: 2 in each of the BN / 8 column groups
#define DPT (D / 4)     // head-dim columns per lane, likewise

// Dynamic shared memory per kernel, in bytes; mirrored by `smem_bytes_f32` in
// cuda/attention.rs and checked on entry. Forward: Q (64 rows), two stages of K and V tiles,
// P. dK/dV: K and V (64 rows), Q and dO tiles, lse and delta rows, Pᵀ and dSᵀ. dQ: Q and dO
// (64 rows), K and V tiles, dS.
#define FWD_STAGE (2 * BN * LDF)
#define FWD_SMEM_F32 ((BM * LDF + 2 * FWD_STAGE + BM * LDP) * 4)
#define DKDV_SMEM_F32 (((2 * BM + 2 * BN) * LDF + 2 * BN + 2 * BM * LDP) * 4)
#define DQ_SMEM_F32 (((2 * BM + 2 * BN) * LDF + BM * LDP) * 4)

#if D % 16 != 0 || D > 128
#error "HEAD_DIM must be a multiple of 16, at most 128"
#endif

extern __shared__ float4 smem_v4[];
#define smem_f32 ((float*)smem_v4)

// Rows [t0, t0 + R) of a view into shared memory (row stride LDF), zeros past T: as 16-byte
// copies in flight (part of the next committed group) when every row start is 16-byte
// aligned, as plain loads, complete on return, otherwise.
template <int R>
__device__ __forceinline__ void load_rows(float* dst, const float* base, const Heads& v, int b,
                                          int h, int t0, const Problem& p) {
    const float* head = base + row_at(v, b, h, 0);
    if (!p.vec) {
        for (int idx = threadIdx.x; idx < R * D; idx += THREADS) {
            const int r = idx / D, c = idx % D, t = t0 + r;
            dst[r * LDF + c] = t < p.t ? head[t * v.st + c] : 0.f;
        }
        return;
    }
    constexpr int CHUNKS = D / 4;  // float4 per row
    static_assert(R * CHUNKS % THREADS == 0, "whole rounds of copies");
#pragma unroll
    for (int n = 0; n < R * CHUNKS / THREADS; ++n) {
        const int idx = threadIdx.x + n * THREADS;
        const int r = idx / CHUNKS, c = (idx % CHUNKS) * 4, t = t0 + r;
        const bool in = t < p.t;
        // Rows past T read nothing (zero fill) from a valid address.
        cp_async16(dst + r * LDF + c, head + (in ? t * v.st : 0) + c, in ? 16 : 0);
    }
}

// n f32 values of a dense (B, H, T) row (lse, delta) from t0 into shared memory, zeros past T,
// as 4-byte copies in flight.
__device__ __forceinline__ void load_stats(float* dst, int n, const float* row, int t0,
                                           const Problem& p) {
    for (int i = threadIdx.x; i < n; i += THREADS) {
        const bool in = t0 + i < p.t;
        cp_async4(dst + i, row + (in ? t0 + i : 0), in ? 4 : 0);
    }
}

// A lane's place in the CTA's tiles: warp w, row group g, column pair t.
struct Lane {
    int w, g, t;
    __device__ __forceinline__ Lane()
        : w(threadIdx.x >> 5), g((threadIdx.x >> 2) & 7), t(threadIdx.x & 3) {}
    // The CTA tile's row of this lane's accumulator row i (of RPT).
    __device__ __forceinline__ int row(int i) const { return 16 * w + g + 8 * i; }
    // The tile's (or head dim's) column of this lane's accumulator column j.
    __device__ __forceinline__ int col(int j) const { return 8 * (j >> 1) + 2 * t + (j & 1); }
};

// x = big + small, each a TF32 value in an f32 register: big is x rounded half away from zero
// to 10 mantissa bits (half an ulp added, the low 13 bits dropped), small the exact remainder
// truncated likewise.
__device__ __forceinline__ void split_tf32(float x, u32& big, u32& small) {
    big = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    small = __float_as_uint(x - __uint_as_float(big)) & 0xffffe000u;
}

// (c0, c1; c2, c3) += a · b over one k8 step, a (16 × 8) and b (8 × 8) as TF32 fragments.
__device__ __forceinline__ void mma_tf32(float& c0, float& c1, float& c2, float& c3,
                                         const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// An operand fragment split: the four (A) or two (B) values as big and small halves.
struct Frag4 {
    u32 big[4], small[4];
};

// The A fragment of rows r0 and r0 + 8 of a row-major tile (stride ld) at columns k + t and
// k + t + 4.
__device__ __forceinline__ Frag4 a_frag(const float* rows, int ld, const Lane& L, int k) {
    const float* at = rows + L.g * ld + k + L.t;
    Frag4 f;
    split_tf32(at[0], f.big[0], f.small[0]);
    split_tf32(at[8 * ld], f.big[1], f.small[1]);
    split_tf32(at[4], f.big[2], f.small[2]);
    split_tf32(at[8 * ld + 4], f.big[3], f.small[3]);
    return f;
}

// acc tile n (columns 8n .. 8n + 7 of both rows) += a · b in three TF32 products, b's column
// g given as its elements k = t and k = t + 4.
template <int N>
__device__ __forceinline__ void mma_3xtf32(float acc[RPT][N], int n, const Frag4& a, float b0,
                                           float b1) {
    u32 bb0, bs0, bb1, bs1;
    split_tf32(b0, bb0, bs0);
    split_tf32(b1, bb1, bs1);
    float& c0 = acc[0][2 * n];
    float& c1 = acc[0][2 * n + 1];
    float& c2 = acc[1][2 * n];
    float& c3 = acc[1][2 * n + 1];
    mma_tf32(c0, c1, c2, c3, a.small, bb0, bb1);
    mma_tf32(c0, c1, c2, c3, a.big, bs0, bs1);
    mma_tf32(c0, c1, c2, c3, a.big, bb0, bb1);
}

// acc = a_rows · bt_rowsᵀ: this warp's 16 rows of `a` (row stride LDF) against the BN rows of
// `bt`, k over the head dim.
__device__ __forceinline__ void rows_dot_rows(float acc[RPT][CPT], const float* a,
                                              const float* bt, const Lane& L) {
#pragma unroll
    for (int i = 0; i < RPT; ++i)
#pragma unroll
        for (int j = 0; j < CPT; ++j) acc[i][j] = 0.f;
    const float* const rows = a + 16 * L.w * LDF;
#pragma unroll 2
    for (int k = 0; k < D; k += 8) {
        const Frag4 af = a_frag(rows, LDF, L, k);
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            const float* b = bt + (8 * n + L.g) * LDF + k + L.t;
            mma_3xtf32<CPT>(acc, n, af, b[0], b[4]);
        }
    }
}

// acc += w · rows: this warp's 16 rows of a (64 × BN) weight tile (row stride LDP) times a
// (BN × D) row tile (row stride LDF).
__device__ __forceinline__ void weights_times_rows(float acc[RPT][DPT], const float* w,
                                                   const float* rows, const Lane& L) {
    const float* const wr = w + 16 * L.w * LDP;
#pragma unroll 2
    for (int k = 0; k < BN; k += 8) {
        const Frag4 af = a_frag(wr, LDP, L, k);
        const float* const b = rows + (k + L.t) * LDF + L.g;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) mma_3xtf32<DPT>(acc, n, af, b[8 * n], b[4 * LDF + 8 * n]);
    }
}

// This lane's rows of a (64 × D) accumulator into a view, times `scale`, rows past T left.
__device__ __forceinline__ void store_rows(float* base, const Heads& v, int b, int h, int t0,
                                           const float acc[RPT][DPT], const float scale[RPT],
                                           const Problem& p, const Lane& L) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int t = t0 + L.row(i);
        if (t >= p.t) continue;
        float* row = base + row_at(v, b, h, t);
#pragma unroll
        for (int m = 0; m < DPT; ++m) row[L.col(m)] = acc[i][m] * scale[i];
    }
}

// ---- forward ----------------------------------------------------------------------------------

// The K tile of keys [k0, k0 + BN) from stage `st` (its V tile BN rows after it), once it has
// arrived. First waits until every warp is done with the other stage (and with P), then
// starts the copies of the next key tile into it, so they fly while this tile is multiplied.
__device__ __forceinline__ const float* kv_tile(float* stages, int st, int k0, int keys,
                                                const float* qkv, const Heads& kv,
                                                const Heads& vv, int b, int h,
                                                const Problem& p) {
    __syncthreads();
    if (k0 + BN < keys) {
        float* const next = stages + (st ^ 1) * FWD_STAGE;
        load_rows<BN>(next, qkv, kv, b, h, k0 + BN, p);
        load_rows<BN>(next + BN * LDF, qkv, vv, b, h, k0 + BN, p);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    return stages + st * FWD_STAGE;
}

template <bool DROP>
__device__ __forceinline__ void attn_fwd_impl(const float* qkv, Heads qv, Heads kv, Heads vv,
                                              float* out, Heads ov, float* lse, Problem p) {
    check_smem(FWD_SMEM_F32);
    float* const sq = smem_f32;
    float* const stages = sq + BM * LDF;  // two stages of a K tile and its V tile
    float* const sp = stages + 2 * FWD_STAGE;
    const Lane L;
    const int bh = pair_index(), b = bh / p.h, h = bh % p.h;
    const int q0 = tile_index(p) * BM;
    const int keys = p.causal ? min(p.t, q0 + BM) : p.t;
    load_rows<BM>(sq, qkv, qv, b, h, q0, p);
    load_rows<BN>(stages, qkv, kv, b, h, 0, p);
    load_rows<BN>(stages + BN * LDF, qkv, vv, b, h, 0, p);
    cp_async_commit();

    float o[RPT][DPT], m[RPT], l[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        m[i] = neg_inf();
        l[i] = 0.f;
#pragma unroll
        for (int d = 0; d < DPT; ++d) o[i][d] = 0.f;
    }
    for (int k0 = 0, st = 0; k0 < keys; k0 += BN, st ^= 1) {
        const float* const sk = kv_tile(stages, st, k0, keys, qkv, kv, vv, b, h, p);
        const float* const sv = sk + BN * LDF;
        float s[RPT][CPT];
        rows_dot_rows(s, sq, sk, L);
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int row = q0 + L.row(i);
            float mx = m[i];
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                const int col = k0 + L.col(j);
                float v = s[i][j] * p.scale_log2;
                if (col >= p.t || (p.causal && col > row)) v = neg_inf();
                s[i][j] = v;
                mx = fmaxf(mx, v);
            }
            mx = quad_max(mx);
            // A row with every key so far masked keeps m = -inf (exp2 of -inf - -inf is NaN).
            const float base = mx == neg_inf() ? 0.f : mx;
            const float alpha = exp2f(m[i] - base);
            m[i] = mx;
            l[i] *= alpha;
#pragma unroll
            for (int d = 0; d < DPT; ++d) o[i][d] *= alpha;
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                float pr = exp2f(s[i][j] - base);
                l[i] += pr;
                // Dropout acts on what multiplies V, not on the normaliser l.
                if (DROP && !kept(p, bh, row, k0 + L.col(j))) pr = 0.f;
                sp[L.row(i) * LDP + L.col(j)] = pr;
            }
        }
        __syncthreads();
        weights_times_rows(o, sp, sv, L);
    }
    float inv[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        l[i] = quad_sum(l[i]);
        inv[i] = l[i] > 0.f ? (DROP ? p.inv_keep : 1.f) / l[i] : 0.f;
        const int row = q0 + L.row(i);
        if (L.t == 0 && row < p.t)
            lse[(i64)bh * p.t + row] = l[i] > 0.f ? (m[i] + log2f(l[i])) * LN2 : neg_inf();
    }
    store_rows(out, ov, b, h, q0, o, inv, p, L);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    attn_fwd(const float* qkv, Heads qv, Heads kv, Heads vv, float* out, Heads ov, float* lse,
             Problem p) {
    attn_fwd_impl<false>(qkv, qv, kv, vv, out, ov, lse, p);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    attn_fwd_dropout(const float* qkv, Heads qv, Heads kv, Heads vv, float* out, Heads ov,
                     float* lse, Problem p) {
    attn_fwd_impl<true>(qkv, qv, kv, vv, out, ov, lse, keyed(p));
}

// ---- backward ---------------------------------------------------------------------------------

// delta[row] = Σ_d gout · out, one warp per (b, h, t) row.
extern "C" __global__ void attn_delta(const float* out, Heads ov, const float* gout, Heads gv,
                                      float* delta, Problem p) {
    const int lane = threadIdx.x & 31;
    const i64 rows = (i64)p.b * p.h * p.t;
    const i64 warps = (i64)gridDim.x * (THREADS / 32);
    for (i64 rw = (i64)blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5); rw < rows; rw += warps) {
        const int t = (int)(rw % p.t), bh = (int)(rw / p.t);
        const int b = bh / p.h, h = bh % p.h;
        const float* o = out + row_at(ov, b, h, t);
        const float* go = gout + row_at(gv, b, h, t);
        float acc = 0.f;
        for (int c = lane; c < D; c += 32) acc = fmaf(o[c], go[c], acc);
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
        if (lane == 0) delta[rw] = acc;
    }
}

// dK, dV of 64 keys: every query tile at or after them (causal) recomputes its probabilities
// from lse, on transposed products (keys as rows): Sᵀ = K Qᵀ, dV += (P ∘ M)ᵀ dO,
// dPᵀ = V dOᵀ, dSᵀ = Pᵀ ∘ (dPᵀ ∘ Mᵀ − delta), dK += dSᵀ Q (M: the dropout mask as 0 or
// 1 / keep, all ones without dropout).
template <bool DROP>
__device__ __forceinline__ void attn_bwd_dkdv_impl(const float* qkv, Heads qv, Heads kv,
                                                   Heads vv, const float* gout, Heads gov,
                                                   const float* lse, const float* delta,
                                                   float* grads, Heads gkv, Heads gvv,
                                                   Problem p) {
    check_smem(DKDV_SMEM_F32);
    float* const sk = smem_f32;
    float* const sv = sk + BM * LDF;
    float* const sq = sv + BM * LDF;
    float* const sdo = sq + BN * LDF;
    float* const sl = sdo + BN * LDF;  // the query tile's lse, then its delta
    float* const sd = sl + BN;
    float* const spt = sd + BN;        // (P ∘ M)ᵀ: 64 keys × BN queries
    float* const sdst = spt + BM * LDP;  // dSᵀ
    const Lane L;
    const int bh = pair_index(), b = bh / p.h, h = bh % p.h;
    const int k0 = key_tile_index() * BM;
    const int first = p.causal ? (k0 / BN) * BN : 0;
    const float* const lse_row = lse + (i64)bh * p.t;
    const float* const delta_row = delta + (i64)bh * p.t;
    load_rows<BM>(sk, qkv, kv, b, h, k0, p);
    load_rows<BM>(sv, qkv, vv, b, h, k0, p);
    // The first query tile: dO, lse and delta in K and V's group, Q in the next.
    load_rows<BN>(sdo, gout, gov, b, h, first, p);
    load_stats(sl, BN, lse_row, first, p);
    load_stats(sd, BN, delta_row, first, p);
    cp_async_commit();
    load_rows<BN>(sq, qkv, qv, b, h, first, p);
    cp_async_commit();

    float dk[RPT][DPT], dv[RPT][DPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i)
#pragma unroll
        for (int d = 0; d < DPT; ++d) dk[i][d] = dv[i][d] = 0.f;

    for (int q0 = first; q0 < p.t; q0 += BN) {
        const int next = q0 + BN;
        float pt[RPT][CPT], dpt[RPT][CPT];
        cp_async_wait<1>();  // the tile's dO, lse and delta (and K, V the first time)
        __syncthreads();
        rows_dot_rows(dpt, sv, sdo, L);
        cp_async_wait<0>();  // its Q
        __syncthreads();
        rows_dot_rows(pt, sk, sq, L);
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int key = k0 + L.row(i);
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                const int qi = L.col(j), q = q0 + qi;
                float pr = exp2f(pt[i][j] * p.scale_log2 - sl[qi] * LOG2E);
                // Queries past T (zero rows) and, causally, before the key have none.
                if (q >= p.t || (p.causal && q < key)) pr = 0.f;
                float mk = 1.f;
                if (DROP) mk = (q < p.t && key < p.t && kept(p, bh, q, key)) ? p.inv_keep : 0.f;
                spt[L.row(i) * LDP + qi] = pr * mk;
                sdst[L.row(i) * LDP + qi] = pr * (dpt[i][j] * mk - sd[qi]);
            }
        }
        __syncthreads();
        weights_times_rows(dv, spt, sdo, L);
        __syncthreads();  // every warp is done with dO, lse and delta: the next ones fly
        if (next < p.t) {
            load_rows<BN>(sdo, gout, gov, b, h, next, p);
            load_stats(sl, BN, lse_row, next, p);
            load_stats(sd, BN, delta_row, next, p);
        }
        cp_async_commit();
        weights_times_rows(dk, sdst, sq, L);
        __syncthreads();  // ... and with Q, Pᵀ and dSᵀ
        if (next < p.t) load_rows<BN>(sq, qkv, qv, b, h, next, p);
        cp_async_commit();
    }
    float ones[RPT], scales[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        ones[i] = 1.f;
        scales[i] = p.scale;
    }
    store_rows(grads, gkv, b, h, k0, dk, scales, p, L);
    store_rows(grads, gvv, b, h, k0, dv, ones, p, L);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    attn_bwd_dkdv(const float* qkv, Heads qv, Heads kv, Heads vv, const float* gout, Heads gov,
                  const float* lse, const float* delta, float* grads, Heads gkv, Heads gvv,
                  Problem p) {
    attn_bwd_dkdv_impl<false>(qkv, qv, kv, vv, gout, gov, lse, delta, grads, gkv, gvv, p);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    attn_bwd_dkdv_dropout(const float* qkv, Heads qv, Heads kv, Heads vv, const float* gout,
                          Heads gov, const float* lse, const float* delta, float* grads,
                          Heads gkv, Heads gvv, Problem p) {
    attn_bwd_dkdv_impl<true>(qkv, qv, kv, vv, gout, gov, lse, delta, grads, gkv, gvv, keyed(p));
}

// dQ of 64 queries: every key tile they see. S = Q Kᵀ, P from lse, dP = (dO Vᵀ) ∘ M,
// dS = P ∘ (dP − delta), dQ += dS K.
template <bool DROP>
__device__ __forceinline__ void attn_bwd_dq_impl(const float* qkv, Heads qv, Heads kv, Heads vv,
                                                 const float* gout, Heads gov, const float* lse,
                                                 const float* delta, float* grads, Heads gqv,
                                                 Problem p) {
    check_smem(DQ_SMEM_F32);
    float* const sq = smem_f32;
    float* const sdo = sq + BM * LDF;
    float* const sk = sdo + BM * LDF;
    float* const sv = sk + BN * LDF;
    float* const sds = sv + BN * LDF;
    const Lane L;
    const int bh = pair_index(), b = bh / p.h, h = bh % p.h;
    const int q0 = tile_index(p) * BM;
    const int keys = p.causal ? min(p.t, q0 + BM) : p.t;
    load_rows<BM>(sq, qkv, qv, b, h, q0, p);
    load_rows<BM>(sdo, gout, gov, b, h, q0, p);
    // The first key tile: V in Q and dO's group, K in the next.
    load_rows<BN>(sv, qkv, vv, b, h, 0, p);
    cp_async_commit();
    load_rows<BN>(sk, qkv, kv, b, h, 0, p);
    cp_async_commit();
    float l2[RPT], dl[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int row = q0 + L.row(i);
        // Rows past T: lse +inf, so their probabilities are 0.
        l2[i] = row < p.t ? lse[(i64)bh * p.t + row] * LOG2E : __int_as_float(0x7f800000);
        dl[i] = row < p.t ? delta[(i64)bh * p.t + row] : 0.f;
    }
    float dq[RPT][DPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i)
#pragma unroll
        for (int d = 0; d < DPT; ++d) dq[i][d] = 0.f;

    for (int k0 = 0; k0 < keys; k0 += BN) {
        const int next = k0 + BN;
        float s[RPT][CPT], dp[RPT][CPT];
        cp_async_wait<1>();  // the tile's V (and Q, dO the first time)
        __syncthreads();
        rows_dot_rows(dp, sdo, sv, L);
        cp_async_wait<0>();  // its K
        __syncthreads();
        rows_dot_rows(s, sq, sk, L);
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int row = q0 + L.row(i);
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                const int col = k0 + L.col(j);
                float pr = exp2f(s[i][j] * p.scale_log2 - l2[i]);
                if (col >= p.t || (p.causal && col > row)) pr = 0.f;
                float g = dp[i][j];
                if (DROP) g = (row < p.t && col < p.t && kept(p, bh, row, col)) ? g * p.inv_keep : 0.f;
                sds[L.row(i) * LDP + L.col(j)] = pr * (g - dl[i]);
            }
        }
        __syncthreads();  // dS is complete and every warp is done with V: the next V flies
        if (next < keys) load_rows<BN>(sv, qkv, vv, b, h, next, p);
        cp_async_commit();
        weights_times_rows(dq, sds, sk, L);
        __syncthreads();  // every warp is done with K and dS
        if (next < keys) load_rows<BN>(sk, qkv, kv, b, h, next, p);
        cp_async_commit();
    }
    float scales[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) scales[i] = p.scale;
    store_rows(grads, gqv, b, h, q0, dq, scales, p, L);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    attn_bwd_dq(const float* qkv, Heads qv, Heads kv, Heads vv, const float* gout, Heads gov,
                const float* lse, const float* delta, float* grads, Heads gqv, Problem p) {
    attn_bwd_dq_impl<false>(qkv, qv, kv, vv, gout, gov, lse, delta, grads, gqv, p);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    attn_bwd_dq_dropout(const float* qkv, Heads qv, Heads kv, Heads vv, const float* gout,
                        Heads gov, const float* lse, const float* delta, float* grads,
                        Heads gqv, Problem p) {
    attn_bwd_dq_impl<true>(qkv, qv, kv, vv, gout, gov, lse, delta, grads, gqv, keyed(p));
}
