// rows.cu — the row family's kernels (backend/rows.rs): softmax and layer norm with their
// backwards, one block of BLOCK threads per row, looping over rows with a grid stride. They
// mirror backend/cpu/rows.rs: per-row statistics accumulate in double whatever the element
// type (except the warp-per-row layer norms, in f32 as PyTorch's: see there), and sums that
// cross rows (weight gradients) add fixed partitions in a fixed order.
// Pointers arrive already offset to the first element; a `*k` int argument is the dtype code
// (DT_* in the generated header) of a float buffer whose type may differ from the rows'
// (statistics, losses). Compiled after the generated codes and prelude.cuh.
//
// Layer norm is templated on the rows' type T and on the type Y of its output (forward) or
// of the output's gradient (backward): Y is T, or f16/bf16 for f32 rows (autocast's f32
// residual stream feeding a half-precision matmul), so no cast kernel runs before or after.

// ---- softmax ---------------------------------------------------------------------------------

// y = softmax(x) or log_softmax(x) over rows of n.
template <typename T>
__device__ void softmax_fwd(const T* x, T* y, i64 rows, i64 n, int log_) {
    __shared__ double sh[BLOCK];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * n;
        T* yr = y + r * n;
        double m = NEG_INF;
        for (i64 j = threadIdx.x; j < n; j += BLOCK) m = fmax(m, to_d(xr[j]));
        m = block_max(m, sh);
        double s = 0.0;
        for (i64 j = threadIdx.x; j < n; j += BLOCK) s += exp(to_d(xr[j]) - m);
        s = block_sum(s, sh);
        if (log_) {
            const double ls = log(s);
            for (i64 j = threadIdx.x; j < n; j += BLOCK) yr[j] = from_d<T>((to_d(xr[j]) - m) - ls);
        } else {
            const double inv = 1.0 / s;
            for (i64 j = threadIdx.x; j < n; j += BLOCK)
                yr[j] = from_d<T>(exp(to_d(xr[j]) - m) * inv);
        }
    }
}

// From the saved output y: softmax gx = y (gy - Σ gy·y); log-softmax gx = gy - exp(y) Σ gy.
template <typename T>
__device__ void softmax_bwd(const T* y, const T* gy, T* gx, i64 rows, i64 n, int log_) {
    __shared__ double sh[BLOCK];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* yr = y + r * n;
        const T* gr = gy + r * n;
        T* outr = gx + r * n;
        double s = 0.0;
        for (i64 j = threadIdx.x; j < n; j += BLOCK)
            s += log_ ? to_d(gr[j]) : to_d(yr[j]) * to_d(gr[j]);
        s = block_sum(s, sh);
        for (i64 j = threadIdx.x; j < n; j += BLOCK) {
            const double yv = to_d(yr[j]), g = to_d(gr[j]);
            outr[j] = from_d<T>(log_ ? g - exp(yv) * s : yv * (g - s));
        }
    }
}

// ---- layer norm ------------------------------------------------------------------------------

// An output of type Y from the f64 result h of rows of type T: rounded to T as T's own output
// is, then converted as the cast kernels convert that value (f32 -> f16/bf16, in
// elementwise.cu). Nothing more when Y is T.
template <typename T, typename Y>
struct LnOut {
    static __device__ __forceinline__ Y of(double h) { return from_f<Y>(to_f(from_d<T>(h))); }
};
template <typename T>
struct LnOut<T, T> {
    static __device__ __forceinline__ T of(double h) { return from_d<T>(h); }
};

// A residual sum s = x + h in the rows' type T, rounded as the add op rounds it: h of T, or
// f16/bf16 beside f32 rows (widened exactly, as autocast's residual add reads it).
__device__ __forceinline__ float residual_add(float x, float h) { return __fadd_rn(x, h); }
__device__ __forceinline__ float residual_add(float x, f16_t h) { return __fadd_rn(x, to_f(h)); }
__device__ __forceinline__ float residual_add(float x, bf16_t h) { return __fadd_rn(x, to_f(h)); }
__device__ __forceinline__ double residual_add(double x, double h) { return __dadd_rn(x, h); }
__device__ __forceinline__ f16_t residual_add(f16_t x, f16_t h) { return t_add(x, h); }
__device__ __forceinline__ bf16_t residual_add(bf16_t x, bf16_t h) { return t_add(x, h); }

// y = (x - mean) rstd [· w] [+ b]; mean and rstd (biased variance, two passes) stored with
// kind sk. w and b may be null. With a residual branch h (of y's type; null: none), the rows
// are s = x + h, written to sum in the first pass and read back from there by the same
// thread (each thread keeps its columns in every pass).
template <typename T, typename Y>
__device__ void layer_norm_fwd(const T* x, const Y* res, T* sum, const T* w, const T* b, Y* y,
                               void* mean, void* rstd, int sk, i64 rows, i64 n, double eps) {
    __shared__ double sh[BLOCK];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * n;
        Y* yr = y + r * n;
        double s = 0.0;
        if (res) {
            const Y* hr = res + r * n;
            T* sr = sum + r * n;
            for (i64 j = threadIdx.x; j < n; j += BLOCK) {
                const T v = residual_add(xr[j], hr[j]);
                sr[j] = v;
                s += to_d(v);
            }
            xr = sr;
        } else {
            for (i64 j = threadIdx.x; j < n; j += BLOCK) s += to_d(xr[j]);
        }
        const double mu = block_sum(s, sh) / (double)n;
        double v = 0.0;
        for (i64 j = threadIdx.x; j < n; j += BLOCK) {
            const double d = to_d(xr[j]) - mu;
            v += d * d;
        }
        const double var = block_sum(v, sh) / (double)n;
        const double rs = 1.0 / sqrt(var + eps);
        for (i64 j = threadIdx.x; j < n; j += BLOCK) {
            double h = (to_d(xr[j]) - mu) * rs;
            if (w) h *= to_d(w[j]);
            if (b) h += to_d(b[j]);
            yr[j] = LnOut<T, Y>::of(h);
        }
        if (threadIdx.x == 0) {
            store_f64(mean, sk, r, mu);
            store_f64(rstd, sk, r, rs);
        }
    }
}

// gx = rstd (ĝ - mean(ĝ) - x̂ mean(ĝ x̂)) with x̂ = (x - mean) rstd and ĝ = gy · w; with a
// prior (may be gx itself), gx = prior + that, rounded as a separate add in T would round it.
template <typename T>
__device__ __forceinline__ T ln_grad_out(const T* prior, i64 i, T local) {
    return prior ? t_add(prior[i], local) : local;
}

template <typename T, typename Y>
__device__ void layer_norm_bwd(const T* x, const T* w, const void* mean, const void* rstd, int sk,
                               const Y* gy, const T* prior, T* gx, i64 rows, i64 n) {
    __shared__ double sh[BLOCK];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * n;
        const Y* gr = gy + r * n;
        T* outr = gx + r * n;
        const double mu = load_f64(mean, sk, r), rs = load_f64(rstd, sk, r);
        double sg = 0.0, sgx = 0.0;
        for (i64 j = threadIdx.x; j < n; j += BLOCK) {
            const double gh = to_d(gr[j]) * (w ? to_d(w[j]) : 1.0);
            const double xh = (to_d(xr[j]) - mu) * rs;
            sg += gh;
            sgx += gh * xh;
        }
        const double mean_g = block_sum(sg, sh) / (double)n;
        const double mean_gx = block_sum(sgx, sh) / (double)n;
        for (i64 j = threadIdx.x; j < n; j += BLOCK) {
            const double gh = to_d(gr[j]) * (w ? to_d(w[j]) : 1.0);
            const double xh = (to_d(xr[j]) - mu) * rs;
            outr[j] = ln_grad_out(prior, r * n + j, from_d<T>(rs * (gh - mean_g - xh * mean_gx)));
        }
    }
}

// ---- layer norm, one warp per row ---------------------------------------------------------
// Rows of at most 32 * PER elements in f32/f16/bf16 (a transformer's width; PER is 8, 16, 24
// or 32, the host picks the least that holds the row): a warp holds its row in registers, so
// x and gy are read once, the sums are warp shuffles (no shared memory, no block barrier), and
// four rows share a block. The row is dealt out in groups of four: group q (elements 4q to
// 4q + 3) to lane q % 32, slot q / 32. With `vec` (n a multiple of four and every pointer on
// a group's bytes, the host checks) a group moves as one 8- or 16-byte load or store.
// Every load of a row's elements (x, the residual branch, gy, the prior) is issued before its
// first store: the stores may alias them as far as the compiler knows (sum may be x, gx may
// be prior), so a store between two loads would make each load wait for the one before it
// (the weights, read by every row, come from the cache). The arithmetic is f32, as PyTorch's
// CUDA kernels compute it (two passes for the variance, every sum over a row in f32); the
// block kernels above and the CPU reference compute in double, which made these kernels about
// 4% slower (conversions to and from double run at a sixteenth of the f32 rate).
__device__ __forceinline__ float warp_sum_f(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// An f32 result as an element of Y (rounded once, nearest even, for f16/bf16).
template <typename Y>
__device__ __forceinline__ Y f32_as(float v) {
    return from_f<Y>(v);
}
template <>
__device__ __forceinline__ float f32_as<float>(float v) {
    return v;
}
// f16 and bf16 by the hardware's rounding (prelude.cuh).
template <>
__device__ __forceinline__ f16_t f32_as<f16_t>(float v) {
    return f16_rn_hw(v);
}
template <>
__device__ __forceinline__ bf16_t f32_as<bf16_t>(float v) {
    return bf16_rn_hw(v);
}

// The warp's row index and the warp stride over rows.
__device__ __forceinline__ i64 warp_row() { return (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); }
__device__ __forceinline__ i64 warp_rows() { return (i64)gridDim.x * (blockDim.x >> 5); }

// Elements e to e + 3 of a row of n: zero past n.
template <typename T>
__device__ __forceinline__ void load_group(const T* row, i64 e, i64 n, int vec, T out[4]) {
    if (vec && e < n) {
        const Quad<T> q = *(const Quad<T>*)(row + e);
#pragma unroll
        for (int k = 0; k < 4; ++k) out[k] = q.v[k];
        return;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = e + k < n ? row[e + k] : T{};
}

template <typename T>
__device__ __forceinline__ void store_group(T* row, i64 e, i64 n, int vec, const T in[4]) {
    if (vec && e < n) {
        Quad<T> q;
#pragma unroll
        for (int k = 0; k < 4; ++k) q.v[k] = in[k];
        *(Quad<T>*)(row + e) = q;
        return;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k)
        if (e + k < n) row[e + k] = in[k];
}

// sums[e + k] += v[k] for the group's elements below n (e < n). With `vec` (n a multiple of
// four, so the group is whole and its four sums 16-byte aligned) one 16-byte read and write:
// a warp's lanes then touch adjacent 16-byte slots, where four scalar updates each met 4-way
// bank conflicts. The same additions either way.
__device__ __forceinline__ void add_group(float* sums, i64 e, i64 n, int vec, const float v[4]) {
    if (vec) {
        float4 s = *(float4*)(sums + e);
        s.x += v[0];
        s.y += v[1];
        s.z += v[2];
        s.w += v[3];
        *(float4*)(sums + e) = s;
        return;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k)
        if (e + k < n) sums[e + k] += v[k];
}

// The first element of slot i's group in this lane.
__device__ __forceinline__ i64 group_at(int lane, int i) { return 4 * ((i64)lane + 32 * i); }

template <typename T, typename Y, int PER>
__device__ void layer_norm_fwd_warp(const T* x, const Y* res, T* sum, const T* w, const T* b,
                                    Y* y, void* mean, void* rstd, int sk, i64 rows, i64 n,
                                    double eps, int vec) {
    constexpr int G = PER / 4;
    const int lane = threadIdx.x & 31;
    for (i64 r = warp_row(); r < rows; r += warp_rows()) {
        T e[G][4];
#pragma unroll
        for (int i = 0; i < G; ++i) load_group(x + r * n, group_at(lane, i), n, vec, e[i]);
        if (res) {
            Y h[G][4];
#pragma unroll
            for (int i = 0; i < G; ++i) load_group(res + r * n, group_at(lane, i), n, vec, h[i]);
#pragma unroll
            for (int i = 0; i < G; ++i) {
#pragma unroll
                for (int k = 0; k < 4; ++k) e[i][k] = residual_add(e[i][k], h[i][k]);
                store_group(sum + r * n, group_at(lane, i), n, vec, e[i]);
            }
        }
        float v[G][4];
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < G; ++i)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                v[i][k] = to_f(e[i][k]);  // zero past n
                s += v[i][k];
            }
        const float mu = warp_sum_f(s) / (float)n;
        float q = 0.f;
#pragma unroll
        for (int i = 0; i < G; ++i)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float d = v[i][k] - mu;
                if (group_at(lane, i) + k < n) q += d * d;
            }
        const float rs = 1.f / sqrtf(warp_sum_f(q) / (float)n + (float)eps);
        // w and b of group i + 1 are loaded before group i's store: y may alias them as far as
        // the compiler knows, so loaded after that store, each group would wait for its own.
        T wg[2][4], bg[2][4];
        if (w) load_group(w, group_at(lane, 0), n, vec, wg[0]);
        if (b) load_group(b, group_at(lane, 0), n, vec, bg[0]);
#pragma unroll
        for (int i = 0; i < G; ++i) {
            const i64 at = group_at(lane, i);
            if (at >= n) break;
            if (i + 1 < G) {
                if (w) load_group(w, group_at(lane, i + 1), n, vec, wg[(i + 1) & 1]);
                if (b) load_group(b, group_at(lane, i + 1), n, vec, bg[(i + 1) & 1]);
            }
            Y out[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                float h = (v[i][k] - mu) * rs;
                if (w) h *= to_f(wg[i & 1][k]);
                if (b) h += to_f(bg[i & 1][k]);
                out[k] = f32_as<Y>(h);
            }
            store_group(y + r * n, at, n, vec, out);
        }
        if (lane == 0) {
            store_f64(mean, sk, r, mu);
            store_f64(rstd, sk, r, rs);
        }
    }
}

// With `part` (else null) the backward also sums the weight and bias gradients' partials of
// its block, so no second pass reads x and gy again: each warp adds Σ gy x̂ and Σ gy of its
// rows, in row order, to its own two rows of n floats of dynamic shared memory (a lane touches
// only its own columns), then the block adds its warps in order, in double, and stores the
// sum rounded to f32 into part[block][j] (Σ gy x̂) and part[blocks + block][j] (Σ gy) — the
// layout that layer_norm_params_finish_f32 adds up, one chunk per block. f32, not double:
// each warp's sums are f32 already, and the partials are a tenth of the backward's traffic.
// The grid depends on the shape alone, so the partition, and the sums, are reproducible.
// With `gxh` (else null) gx is also written rounded to Y, as a cast kernel rounds it: the
// gradient of a half residual branch whose f32 sum these rows are, with no cast launch. With
// `half_sums` too (and `part`), a third row of partials sums gxh's columns as written (the
// branch's Linear's bias gradient, Σ_rows gxh), at part[2 · blocks + block][j].
template <typename T, typename Y, int PER, bool HALF_TOO>
__device__ void layer_norm_bwd_warp(const T* x, const T* w, const void* mean, const void* rstd,
                                    int sk, const Y* gy, const T* prior, T* gx, Y* gxh, i64 rows,
                                    i64 n, float* part, int vec, int half_sums) {
    constexpr int G = PER / 4;
    const int lane = threadIdx.x & 31;
    const bool sum_half = HALF_TOO && part && half_sums;
    // Rows of n floats per warp: Σ gy x̂, Σ gy, and Σ gxh when summed.
    const int sum_rows = sum_half ? 3 : 2;
    // 16-byte aligned: add_group moves a lane's four sums as one vector.
    extern __shared__ __align__(16) float ln_sums[];
    float* const sums = ln_sums + (threadIdx.x >> 5) * sum_rows * n;  // this warp's rows
    if (part) {
        for (i64 j = lane; j < sum_rows * n; j += 32) sums[j] = 0.f;
        __syncwarp();
    }
    for (i64 r = warp_row(); r < rows; r += warp_rows()) {
        const float mu = (float)load_f64(mean, sk, r), rs = (float)load_f64(rstd, sk, r);
        T xe[G][4], pe[G][4];
        Y ge[G][4];
#pragma unroll
        for (int i = 0; i < G; ++i) {
            const i64 at = group_at(lane, i);
            load_group(x + r * n, at, n, vec, xe[i]);
            load_group(gy + r * n, at, n, vec, ge[i]);
        }
        // ĝ = gy · w and x̂ per element; both zero past n (x̂ is kept only where it is in).
        // w is read where it is used (a cache hit), not held: registers for more warps.
        float sg = 0.f, sgx = 0.f;
#pragma unroll
        for (int i = 0; i < G; ++i) {
            T wg[4];
            if (w) load_group(w, group_at(lane, i), n, vec, wg);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const bool in = group_at(lane, i) + k < n;
                const float g = to_f(ge[i][k]) * (w ? to_f(wg[k]) : 1.f);
                const float xn = in ? (to_f(xe[i][k]) - mu) * rs : 0.f;
                sg += g;
                sgx += g * xn;
            }
        }
        // The later gradient of these rows, in flight while the row sums reduce.
        if (prior)
#pragma unroll
            for (int i = 0; i < G; ++i) load_group(prior + r * n, group_at(lane, i), n, vec, pe[i]);
        const float mean_g = warp_sum_f(sg) / (float)n;
        const float mean_gx = warp_sum_f(sgx) / (float)n;
        // w again (a cache hit): keeping the first loop's copy costs a lane PER registers.
        // Group i + 1's is loaded before group i's stores, which may alias it as far as the
        // compiler knows: loaded after them, each group would wait for its own.
        T wg[2][4];
        if (w) load_group(w, group_at(lane, 0), n, vec, wg[0]);
#pragma unroll
        for (int i = 0; i < G; ++i) {
            const i64 at = group_at(lane, i);
            if (at >= n) break;
            if (w && i + 1 < G) load_group(w, group_at(lane, i + 1), n, vec, wg[(i + 1) & 1]);
            T out[4];
            float gxn[4], gk[4];  // this group's terms of Σ gy x̂ and Σ gy
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float g = to_f(ge[i][k]) * (w ? to_f(wg[i & 1][k]) : 1.f);
                const float xn = (to_f(xe[i][k]) - mu) * rs;
                const T local = f32_as<T>(rs * (g - mean_g - xn * mean_gx));
                out[k] = prior ? t_add(pe[i][k], local) : local;
                gk[k] = to_f(ge[i][k]);
                gxn[k] = gk[k] * xn;
            }
            store_group(gx + r * n, at, n, vec, out);
            if (HALF_TOO) {
                Y half[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) half[k] = f32_as<Y>(to_f(out[k]));
                store_group(gxh + r * n, at, n, vec, half);
                if (sum_half) {
                    float hk[4];
#pragma unroll
                    for (int k = 0; k < 4; ++k) hk[k] = to_f(half[k]);
                    add_group(sums + 2 * n, at, n, vec, hk);
                }
            }
            if (part) {
                add_group(sums, at, n, vec, gxn);
                add_group(sums + n, at, n, vec, gk);
            }
        }
    }
    if (part) {
        __syncthreads();
        const int warps = blockDim.x >> 5;
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
            double a = 0.0, b = 0.0, c = 0.0;
            for (int v = 0; v < warps; ++v) {
                const float* rows_v = ln_sums + v * sum_rows * n;
                a += (double)rows_v[j];
                b += (double)rows_v[n + j];
                if (sum_half) c += (double)rows_v[2 * n + j];
            }
            part[(i64)blockIdx.x * n + j] = (float)a;
            part[((i64)gridDim.x + blockIdx.x) * n + j] = (float)b;
            if (sum_half) part[(2 * (i64)gridDim.x + blockIdx.x) * n + j] = (float)c;
        }
    }
}

// Threads per block of the warp-per-row kernels (cuda/rows.rs launches them so): four rows
// to a block. The backward takes about 128 registers a lane at rows of 768 (f32 rows, bf16
// gradients): four blocks of four warps to an SM. Blocks of eight warps would fit two, and
// bounding the registers to fit more of those made the compiler spill.
#define LN_WARP_BLOCK 128
// Blocks per SM the forward is held to at rows up to 768: 80 registers instead of 88 to 96.
// The forward waits on its loads, so more warps in flight hide more of them (5% faster on an
// H100 at GPT-2's rows; 8 blocks spilled and ran slower). With the weights loaded a group
// ahead, ptxas 13.0 spills a few bytes at rows of 768 (8 B for f32 rows with a bf16 or f16
// output); held to 5 blocks instead (96 registers, none), the bf16 forward
// was slower on an H100 (38.1 against 36.2 µs).
#define LN_FWD_MIN_BLOCKS(PER) ((PER) <= 24 ? 6 : 1)

// The backward that also writes gx rounded to Y (`_half_too`) is held to as many blocks per
// SM as the plain one: with w read where it is used and the later gradient loaded after the
// row sums, it fits four at rows of 768 without spilling (three when it held both).
#define LN_HALF_TOO_MIN(BWD_MIN) (BWD_MIN)

// S names the kernels: the rows' dtype, then the output's when it differs (f32_bf16: f32
// rows, a bf16 output and output gradient).
#define LN_WARP_KERNELS(S, T, Y, PER, BWD_MIN)                                                              \
    extern "C" __global__ void __launch_bounds__(LN_WARP_BLOCK, LN_FWD_MIN_BLOCKS(PER))                                    \
        layer_norm_fwd_warp##PER##_##S(const T* x, const Y* res, T* sum, const T* w, const T* b,   \
                                       Y* y, void* mean, void* rstd, int sk, i64 rows, i64 n,      \
                                       double eps, int vec) {                                      \
        layer_norm_fwd_warp<T, Y, PER>(x, res, sum, w, b, y, mean, rstd, sk, rows, n, eps, vec);   \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(LN_WARP_BLOCK, BWD_MIN)                                    \
        layer_norm_bwd_warp##PER##_##S(const T* x, const T* w, const void* mean,                   \
                                       const void* rstd, int sk, const Y* gy, const T* prior,      \
                                       T* gx, i64 rows, i64 n, float* part, int vec) {             \
        layer_norm_bwd_warp<T, Y, PER, false>(x, w, mean, rstd, sk, gy, prior, gx, nullptr, rows,  \
                                              n, part, vec, 0);                                    \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(LN_WARP_BLOCK, LN_HALF_TOO_MIN(BWD_MIN))                   \
        layer_norm_bwd_warp##PER##_##S##_half_too(const T* x, const T* w, const void* mean,        \
                                       const void* rstd, int sk, const Y* gy, const T* prior,      \
                                       T* gx, Y* gxh, i64 rows, i64 n, float* part, int vec,       \
                                       int half_sums) {                                            \
        layer_norm_bwd_warp<T, Y, PER, true>(x, w, mean, rstd, sk, gy, prior, gx, gxh, rows, n,    \
                                             part, vec, half_sums);                                \
    }
// BWD24: blocks per SM the backward at rows of 513 to 768 is held to (cuda/rows.rs sizes its
// grid from it: ln_bwd_blocks_per_sm).
#define LN_WARP_SIZES(S, T, Y, BWD24)                                                          \
    LN_WARP_KERNELS(S, T, Y, 8, 1) LN_WARP_KERNELS(S, T, Y, 16, 1) LN_WARP_KERNELS(S, T, Y, 24, BWD24) \
        LN_WARP_KERNELS(S, T, Y, 32, 1)


// Stage 1 of the weight/bias gradients: grid (ceil(n / BLOCK), chunks). Thread (j, c) sums
// column j over the rows of chunk c in order into part[c][j] (Σ gy x̂) and
// part[chunks + c][j] (Σ gy).
template <typename T, typename Y>
__device__ void layer_norm_params(const T* x, const Y* gy, const void* mean, const void* rstd,
                                  int sk, double* part, i64 rows, i64 n, i64 rows_per_chunk,
                                  i64 chunks) {
    const i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 c = blockIdx.y;
    if (j >= n || c >= chunks) return;
    const i64 r0 = c * rows_per_chunk;
    const i64 r1 = min_i64(rows, r0 + rows_per_chunk);
    double gw = 0.0, gb = 0.0;
    for (i64 r = r0; r < r1; ++r) {
        const double g = to_d(gy[r * n + j]);
        gw += g * (to_d(x[r * n + j]) - load_f64(mean, sk, r)) * load_f64(rstd, sk, r);
        gb += g;
    }
    part[c * n + j] = gw;
    part[(chunks + c) * n + j] = gb;
}

// Stage 2: column j adds its chunk partials (P: double from the chunk sums above, f32 from
// the warp kernels' blocks), in double; gw / gb / gh (kind ok) may be null (gh, the
// sums of the half gradient, has a third row of partials only when given). blockIdx.y picks
// the sum (weight, bias, half) and a block of LN_FIN_COLS x LN_FIN_LANES threads takes
// LN_FIN_COLS columns of it: lane ty sums chunks ty, ty + LN_FIN_LANES, ... of column tx (a
// warp reads two runs of adjacent columns), lanes fold in four in lane order, and
// lane 0 adds the rest in order. A fixed partition, so the sums are reproducible; one block
// per (sum, 16 columns) fills the GPU at GPT-2's widths (144 blocks at 768 with three sums),
// where one block per 32 columns of all three sums left most SMs idle.
#define LN_FIN_COLS 16
#define LN_FIN_LANES 64
template <typename P>
__device__ void layer_norm_params_finish_run(const P* part, i64 chunks, i64 n, void* gw,
                                             void* gb, void* gh, int ok) {
    __shared__ double sh[LN_FIN_LANES][LN_FIN_COLS + 1];
    void* const out = blockIdx.y == 0 ? gw : blockIdx.y == 1 ? gb : gh;
    if (!out) return;  // the whole block: this sum is not asked for
    const int tx = threadIdx.x, ty = threadIdx.y;
    const i64 j = (i64)blockIdx.x * LN_FIN_COLS + tx;
    const P* rows = part + (i64)blockIdx.y * chunks * n;
    double a = 0.0;
    if (j < n)
        for (i64 c = ty; c < chunks; c += LN_FIN_LANES) a += (double)rows[c * n + j];
    sh[ty][tx] = a;
    __syncthreads();
    constexpr int Q = LN_FIN_LANES / 4;
    if (ty < Q) sh[ty][tx] = ((sh[ty][tx] + sh[ty + Q][tx]) + sh[ty + 2 * Q][tx]) + sh[ty + 3 * Q][tx];
    __syncthreads();
    if (ty == 0 && j < n) {
        double t = 0.0;
        for (int l = 0; l < Q; ++l) t += sh[l][tx];
        store_f64(out, ok, j, t);
    }
}
extern "C" __global__ void __launch_bounds__(LN_FIN_COLS * LN_FIN_LANES)
    layer_norm_params_finish(const double* part, i64 chunks, i64 n, void* gw, void* gb, void* gh,
                             int ok) {
    layer_norm_params_finish_run(part, chunks, n, gw, gb, gh, ok);
}
extern "C" __global__ void __launch_bounds__(LN_FIN_COLS * LN_FIN_LANES)
    layer_norm_params_finish_f32(const float* part, i64 chunks, i64 n, void* gw, void* gb,
                                 void* gh, int ok) {
    layer_norm_params_finish_run(part, chunks, n, gw, gb, gh, ok);
}

// ---- entry points ------------------------------------------------------------------------------

#define ROW_KERNELS(S, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                            \
        softmax_fwd_##S(const T* x, T* y, i64 rows, i64 n, int log_) {                             \
        softmax_fwd<T>(x, y, rows, n, log_);                                                       \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                            \
        softmax_bwd_##S(const T* y, const T* gy, T* gx, i64 rows, i64 n, int log_) {               \
        softmax_bwd<T>(y, gy, gx, rows, n, log_);                                                  \
    }                                                                                              \
    LN_KERNELS(S, T, T)

// Layer norm of rows of T with an output (and output gradient) of Y; S as LN_WARP_KERNELS.
#define LN_KERNELS(S, T, Y)                                                                        \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                            \
        layer_norm_fwd_##S(const T* x, const Y* res, T* sum, const T* w, const T* b, Y* y,         \
                           void* mean, void* rstd, int sk, i64 rows, i64 n, double eps) {          \
        layer_norm_fwd<T, Y>(x, res, sum, w, b, y, mean, rstd, sk, rows, n, eps);                  \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                            \
        layer_norm_bwd_##S(const T* x, const T* w, const void* mean, const void* rstd, int sk,     \
                           const Y* gy, const T* prior, T* gx, i64 rows, i64 n) {                  \
        layer_norm_bwd<T, Y>(x, w, mean, rstd, sk, gy, prior, gx, rows, n);                        \
    }                                                                                              \
    extern "C" __global__ void layer_norm_params_##S(const T* x, const Y* gy, const void* mean,    \
                                                     const void* rstd, int sk, double* part,       \
                                                     i64 rows, i64 n, i64 rows_per_chunk,          \
                                                     i64 chunks) {                                 \
        layer_norm_params<T, Y>(x, gy, mean, rstd, sk, part, rows, n, rows_per_chunk, chunks);     \
    }

// One module per dtype of the rows (cuda/rows.rs defines which): the f32 one also holds the
// layer norms with f16/bf16 outputs. f64 rows have no warp-per-row kernels.
#if defined(ROWS_F32)
ROW_KERNELS(f32, float)
LN_KERNELS(f32_f16, float, f16_t)
LN_KERNELS(f32_bf16, float, bf16_t)
LN_WARP_SIZES(f32, float, float, 1)
LN_WARP_SIZES(f32_f16, float, f16_t, 1)
// Autocast GPT-2's backward: four blocks per SM at 128 registers against three at 139, 6%
// faster on an H100 with the grid raised to match (measured with 24 B of spills, which the
// 16-byte updates of the parameter sums, add_group, removed). The other dtypes spill hundreds
// of bytes under that bound.
LN_WARP_SIZES(f32_bf16, float, bf16_t, 4)
#elif defined(ROWS_F64)
ROW_KERNELS(f64, double)
#elif defined(ROWS_F16)
ROW_KERNELS(f16, f16_t)
LN_WARP_SIZES(f16, f16_t, f16_t, 1)
#elif defined(ROWS_BF16)
ROW_KERNELS(bf16, bf16_t)
// Held to three blocks per SM, the count its grid assumes: the 16-byte parameter sums took it
// from 167 to 180 registers, which leaves room for two (160 under the bound, no spills).
LN_WARP_SIZES(bf16, bf16_t, bf16_t, 3)
#else
#error "rows.cu is compiled once per dtype of the rows: define ROWS_F32, ROWS_F64, ROWS_F16 or ROWS_BF16"
#endif
