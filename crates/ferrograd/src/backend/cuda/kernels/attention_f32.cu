// attention_f32.cu — fused scaled-dot-product attention for f32 heads: FlashAttention-2's
// algorithm in f32 FMAs (no tensor cores, no TF32: exact f32 products, as the composed path
// without TF32 computes them). The correct slower path beside attention.cu's f16/bf16 kernels,
// with the same kernels, arguments and results: forward writes out and lse (natural log),
// attn_delta writes rowsum(gout ∘ out), and the backward is two kernels (dK/dV per key tile,
// dQ per query tile), deterministic, causal tiles past the diagonal never visited. Each of
// attn_fwd, attn_bwd_dkdv and attn_bwd_dq has a `_dropout` twin (the mask drawn as the
// dropout op draws it over the composed path's probabilities, from the Problem's key).
//
// Compiled once per head dim: the launcher (cuda/attention.rs) prepends `#define HEAD_DIM n`.
// Operands are (B, H, T, D) views with unit stride along D (`Heads`); lse and delta are dense
// (B, H, T) f32.
//
// Work split: 128 threads; thread (r, c) = (tid / 8, tid % 8) owns 4 rows (4r .. 4r + 3) of
// the CTA's 64; of a streamed tile, the columns c, c + 8, ...; of the head dim, the pairs
// 2c, 2c + 1 in every group of 16. Score tiles live in registers, row statistics are reduced
// over the 8 lanes of a row group by shuffles, and probabilities go through shared memory for
// the product with the next operand. Shared rows are padded by 4 floats: products read them
// as float4 along the head dim and the probabilities as float4 along the tile, and the 8
// lanes of a row group then fall in distinct banks (broadcast across lanes reading one row).
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
#define RPT 4           // rows per thread
#define CPT (BN / 8)    // tile columns per thread
#define DPT (D / 8)     // head-dim columns per thread: pairs 2c + 16m', m' < D / 16

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

// The head-dim column of this thread's accumulator m: pairs 2c, 2c + 1 of each 16.
__device__ __forceinline__ int dim_col(int c, int m) { return 16 * (m >> 1) + 2 * c + (m & 1); }

// acc[i][j] = Σ_k a[(4r + i) · LDF + k] · bt[(c + 8j) · LDF + k]: rows of `a` against rows of
// `bt` (this thread's 4 rows, its CPT columns), k in order, four at a time.
__device__ __forceinline__ void rows_dot_rows(float acc[RPT][CPT], const float* a,
                                              const float* bt, int r, int c) {
#pragma unroll
    for (int i = 0; i < RPT; ++i)
#pragma unroll
        for (int j = 0; j < CPT; ++j) acc[i][j] = 0.f;
#pragma unroll 4
    for (int k = 0; k < D; k += 4) {
        float4 av[RPT], bv[CPT];
#pragma unroll
        for (int i = 0; i < RPT; ++i) av[i] = *(const float4*)&a[(4 * r + i) * LDF + k];
#pragma unroll
        for (int j = 0; j < CPT; ++j) bv[j] = *(const float4*)&bt[(c + 8 * j) * LDF + k];
#pragma unroll
        for (int i = 0; i < RPT; ++i)
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                float s = fmaf(av[i].x, bv[j].x, acc[i][j]);
                s = fmaf(av[i].y, bv[j].y, s);
                s = fmaf(av[i].z, bv[j].z, s);
                acc[i][j] = fmaf(av[i].w, bv[j].w, s);
            }
    }
}

// acc[i][m] += Σ_j w[(4r + i) · LDP + j] · rows[j · LDF + dim_col(c, m)] for j < n (a
// multiple of 4), in order: this thread's 4 rows of a (64 × n) weight tile times an (n × D)
// row tile, at its DPT head-dim columns.
__device__ __forceinline__ void weights_times_rows(float acc[RPT][DPT], const float* w,
                                                   const float* rows, int n, int r, int c) {
    for (int j = 0; j < n; j += 4) {
        // The weights as scalars indexed by jj, not a `jj == 0 ? w4.x : ...` chain over a
        // float4: NVVM spends seconds per kernel on those selects (same code after unrolling).
        float wt[RPT][4];
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const float4 w4 = *(const float4*)&w[(4 * r + i) * LDP + j];
            wt[i][0] = w4.x;
            wt[i][1] = w4.y;
            wt[i][2] = w4.z;
            wt[i][3] = w4.w;
        }
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
            const float* row = rows + (j + jj) * LDF + 2 * c;
#pragma unroll
            for (int mm = 0; mm < D / 16; ++mm) {
                const float2 x = *(const float2*)&row[16 * mm];
#pragma unroll
                for (int i = 0; i < RPT; ++i) {
                    const float wv = wt[i][jj];
                    acc[i][2 * mm] = fmaf(wv, x.x, acc[i][2 * mm]);
                    acc[i][2 * mm + 1] = fmaf(wv, x.y, acc[i][2 * mm + 1]);
                }
            }
        }
    }
}

// Reductions over the 8 lanes of a row group (lanes 8q .. 8q + 7 of a warp).
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
    for (int s = 1; s < 8; s <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, s));
    return v;
}
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int s = 1; s < 8; s <<= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
    return v;
}

// This thread's 4 rows of a (64 × D) accumulator into a view, times `scale`, rows past T left.
__device__ __forceinline__ void store_rows(float* base, const Heads& v, int b, int h, int t0,
                                           const float acc[RPT][DPT], const float scale[RPT],
                                           const Problem& p, int r, int c) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int t = t0 + 4 * r + i;
        if (t >= p.t) continue;
        float* row = base + row_at(v, b, h, t);
#pragma unroll
        for (int m = 0; m < DPT; ++m) row[dim_col(c, m)] = acc[i][m] * scale[i];
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
    const int r = threadIdx.x >> 3, c = threadIdx.x & 7;
    const int bh = blockIdx.y, b = bh / p.h, h = bh % p.h;
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
        rows_dot_rows(s, sq, sk, r, c);
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int row = q0 + 4 * r + i;
            float mx = m[i];
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                const int col = k0 + c + 8 * j;
                float v = s[i][j] * p.scale_log2;
                if (col >= p.t || (p.causal && col > row)) v = neg_inf();
                s[i][j] = v;
                mx = fmaxf(mx, v);
            }
            mx = group_max(mx);
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
                if (DROP && !kept(p, bh, row, k0 + c + 8 * j)) pr = 0.f;
                sp[(4 * r + i) * LDP + c + 8 * j] = pr;
            }
        }
        __syncthreads();
        weights_times_rows(o, sp, sv, BN, r, c);
    }
    float inv[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        l[i] = group_sum(l[i]);
        inv[i] = l[i] > 0.f ? (DROP ? p.inv_keep : 1.f) / l[i] : 0.f;
        const int row = q0 + 4 * r + i;
        if (c == 0 && row < p.t)
            lse[(i64)bh * p.t + row] = l[i] > 0.f ? (m[i] + log2f(l[i])) * LN2 : neg_inf();
    }
    store_rows(out, ov, b, h, q0, o, inv, p, r, c);
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
    const int r = threadIdx.x >> 3, c = threadIdx.x & 7;
    const int bh = blockIdx.y, b = bh / p.h, h = bh % p.h;
    const int k0 = blockIdx.x * BM;
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
        rows_dot_rows(dpt, sv, sdo, r, c);
        cp_async_wait<0>();  // its Q
        __syncthreads();
        rows_dot_rows(pt, sk, sq, r, c);
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int key = k0 + 4 * r + i;
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                const int qi = c + 8 * j, q = q0 + qi;
                float pr = exp2f(pt[i][j] * p.scale_log2 - sl[qi] * LOG2E);
                // Queries past T (zero rows) and, causally, before the key have none.
                if (q >= p.t || (p.causal && q < key)) pr = 0.f;
                float mk = 1.f;
                if (DROP) mk = (q < p.t && key < p.t && kept(p, bh, q, key)) ? p.inv_keep : 0.f;
                spt[(4 * r + i) * LDP + qi] = pr * mk;
                sdst[(4 * r + i) * LDP + qi] = pr * (dpt[i][j] * mk - sd[qi]);
            }
        }
        __syncthreads();
        weights_times_rows(dv, spt, sdo, BN, r, c);
        __syncthreads();  // every warp is done with dO, lse and delta: the next ones fly
        if (next < p.t) {
            load_rows<BN>(sdo, gout, gov, b, h, next, p);
            load_stats(sl, BN, lse_row, next, p);
            load_stats(sd, BN, delta_row, next, p);
        }
        cp_async_commit();
        weights_times_rows(dk, sdst, sq, BN, r, c);
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
    store_rows(grads, gkv, b, h, k0, dk, scales, p, r, c);
    store_rows(grads, gvv, b, h, k0, dv, ones, p, r, c);
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
    const int r = threadIdx.x >> 3, c = threadIdx.x & 7;
    const int bh = blockIdx.y, b = bh / p.h, h = bh % p.h;
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
        const int row = q0 + 4 * r + i;
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
        rows_dot_rows(dp, sdo, sv, r, c);
        cp_async_wait<0>();  // its K
        __syncthreads();
        rows_dot_rows(s, sq, sk, r, c);
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int row = q0 + 4 * r + i;
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                const int col = k0 + c + 8 * j;
                float pr = exp2f(s[i][j] * p.scale_log2 - l2[i]);
                if (col >= p.t || (p.causal && col > row)) pr = 0.f;
                float g = dp[i][j];
                if (DROP) g = (row < p.t && col < p.t && kept(p, bh, row, col)) ? g * p.inv_keep : 0.f;
                sds[(4 * r + i) * LDP + c + 8 * j] = pr * (g - dl[i]);
            }
        }
        __syncthreads();  // dS is complete and every warp is done with V: the next V flies
        if (next < keys) load_rows<BN>(sv, qkv, vv, b, h, next, p);
        cp_async_commit();
        weights_times_rows(dq, sds, sk, BN, r, c);
        __syncthreads();  // every warp is done with K and dS
        if (next < keys) load_rows<BN>(sk, qkv, kv, b, h, next, p);
        cp_async_commit();
    }
    float scales[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) scales[i] = p.scale;
    store_rows(grads, gqv, b, h, q0, dq, scales, p, r, c);
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
