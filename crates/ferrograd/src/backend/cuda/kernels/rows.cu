// rows.cu — the row family's kernels (backend/rows.rs): softmax and layer norm with their
// backwards, one block of BLOCK threads per row, looping over rows with a grid stride. They
// mirror backend/cpu/rows.rs: per-row statistics accumulate in double whatever the element
// type, and sums that cross rows (weight gradients) add fixed partitions in a fixed order.
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
// or 32, the host picks the least that holds the row): a warp holds its row in registers
// (element j in lane j % 32, slot j / 32; f32 holds every such value exactly), so x and gy are read once, the sums are warp shuffles (no shared memory, no
// block barrier), and eight rows share a block. The arithmetic is the block kernels' above,
// in double; only the order of the per-row sums differs.
__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The warp's row index and the warp stride over rows.
__device__ __forceinline__ i64 warp_row() { return (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); }
__device__ __forceinline__ i64 warp_rows() { return (i64)gridDim.x * (blockDim.x >> 5); }

template <typename T, typename Y, int PER>
__device__ void layer_norm_fwd_warp(const T* x, const Y* res, T* sum, const T* w, const T* b,
                                    Y* y, void* mean, void* rstd, int sk, i64 rows, i64 n,
                                    double eps) {
    const int lane = threadIdx.x & 31;
    for (i64 r = warp_row(); r < rows; r += warp_rows()) {
        const T* xr = x + r * n;
        Y* yr = y + r * n;
        float v[PER];
        double s = 0.0;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const i64 j = lane + 32 * i;
            T e = j < n ? xr[j] : T{};
            if (res && j < n) {
                e = residual_add(e, res[r * n + j]);
                sum[r * n + j] = e;
            }
            v[i] = to_f(e);
            s += (double)v[i];
        }
        const double mu = warp_sum_d(s) / (double)n;
        double q = 0.0;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const double d = (double)v[i] - mu;
            if (lane + 32 * i < n) q += d * d;
        }
        const double rs = 1.0 / sqrt(warp_sum_d(q) / (double)n + eps);
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const i64 j = lane + 32 * i;
            if (j >= n) break;
            double h = ((double)v[i] - mu) * rs;
            if (w) h *= to_d(w[j]);
            if (b) h += to_d(b[j]);
            yr[j] = LnOut<T, Y>::of(h);
        }
        if (lane == 0) {
            store_f64(mean, sk, r, mu);
            store_f64(rstd, sk, r, rs);
        }
    }
}

template <typename T, typename Y, int PER>
__device__ void layer_norm_bwd_warp(const T* x, const T* w, const void* mean, const void* rstd,
                                    int sk, const Y* gy, const T* prior, T* gx, i64 rows, i64 n) {
    const int lane = threadIdx.x & 31;
    for (i64 r = warp_row(); r < rows; r += warp_rows()) {
        const T* xr = x + r * n;
        const Y* gr = gy + r * n;
        T* outr = gx + r * n;
        const double mu = load_f64(mean, sk, r), rs = load_f64(rstd, sk, r);
        float xv[PER], gv[PER];
        double sg = 0.0, sgx = 0.0;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const i64 j = lane + 32 * i;
            const bool in = j < n;
            xv[i] = in ? to_f(xr[j]) : 0.0f;
            gv[i] = in ? to_f(gr[j]) : 0.0f;
            const double gh = (double)gv[i] * (w && in ? to_d(w[j]) : 1.0);
            sg += gh;
            sgx += gh * (((double)xv[i] - mu) * rs);
        }
        const double mean_g = warp_sum_d(sg) / (double)n;
        const double mean_gx = warp_sum_d(sgx) / (double)n;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const i64 j = lane + 32 * i;
            if (j >= n) break;
            const double gh = (double)gv[i] * (w ? to_d(w[j]) : 1.0);
            const double xh = ((double)xv[i] - mu) * rs;
            outr[j] = ln_grad_out(prior, r * n + j, from_d<T>(rs * (gh - mean_g - xh * mean_gx)));
        }
    }
}

// S names the kernels: the rows' dtype, then the output's when it differs (f32_bf16: f32
// rows, a bf16 output and output gradient).
#define LN_WARP_KERNELS(S, T, Y, PER)                                                              \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                            \
        layer_norm_fwd_warp##PER##_##S(const T* x, const Y* res, T* sum, const T* w, const T* b,   \
                                       Y* y, void* mean, void* rstd, int sk, i64 rows, i64 n,      \
                                       double eps) {                                               \
        layer_norm_fwd_warp<T, Y, PER>(x, res, sum, w, b, y, mean, rstd, sk, rows, n, eps);        \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                            \
        layer_norm_bwd_warp##PER##_##S(const T* x, const T* w, const void* mean,                   \
                                       const void* rstd, int sk, const Y* gy, const T* prior,      \
                                       T* gx, i64 rows, i64 n) {                                   \
        layer_norm_bwd_warp<T, Y, PER>(x, w, mean, rstd, sk, gy, prior, gx, rows, n);              \
    }
#define LN_WARP_SIZES(S, T, Y)                                                  \
    LN_WARP_KERNELS(S, T, Y, 8) LN_WARP_KERNELS(S, T, Y, 16) LN_WARP_KERNELS(S, T, Y, 24) \
        LN_WARP_KERNELS(S, T, Y, 32)


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

// Stage 2: column j adds its chunk partials; gw / gb (kind ok) may be null. A block of
// 32 x 32 threads takes 32 columns: lane ty sums chunks ty, ty + 32, ... of column tx (the
// reads of a warp are 32 adjacent columns), then lane 0 adds the 32 lane sums in lane
// order. A fixed partition, so the sums are reproducible; and 32 times the parallelism of
// one thread per column, which left the GPU waiting on one long chain of loads per column.
extern "C" __global__ void __launch_bounds__(1024)
    layer_norm_params_finish(const double* part, i64 chunks, i64 n, void* gw, void* gb, int ok) {
    __shared__ double sa[32][33];
    __shared__ double sb[32][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const i64 j = (i64)blockIdx.x * 32 + tx;
    double a = 0.0, b = 0.0;
    if (j < n) {
        for (i64 c = ty; c < chunks; c += 32) {
            a += part[c * n + j];
            b += part[(chunks + c) * n + j];
        }
    }
    sa[ty][tx] = a;
    sb[ty][tx] = b;
    __syncthreads();
    if (ty == 0 && j < n) {
        double ta = 0.0, tb = 0.0;
        for (int l = 0; l < 32; ++l) {
            ta += sa[l][tx];
            tb += sb[l][tx];
        }
        if (gw) store_f64(gw, ok, j, ta);
        if (gb) store_f64(gb, ok, j, tb);
    }
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
LN_WARP_SIZES(f32, float, float)
LN_WARP_SIZES(f32_f16, float, f16_t)
LN_WARP_SIZES(f32_bf16, float, bf16_t)
#elif defined(ROWS_F64)
ROW_KERNELS(f64, double)
#elif defined(ROWS_F16)
ROW_KERNELS(f16, f16_t)
LN_WARP_SIZES(f16, f16_t, f16_t)
#elif defined(ROWS_BF16)
ROW_KERNELS(bf16, bf16_t)
LN_WARP_SIZES(bf16, bf16_t, bf16_t)
#else
#error "rows.cu is compiled once per dtype of the rows: define ROWS_F32, ROWS_F64, ROWS_F16 or ROWS_BF16"
#endif
