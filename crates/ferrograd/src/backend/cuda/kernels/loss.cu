// loss.cu — the loss family's kernels (backend/loss.rs): cross-entropy (one block per row;
// for half-precision rows also the loss and gradient in one pass) and the two-stage MSE. They
// mirror backend/cpu/loss.rs: statistics in double, sums across rows or blocks in a fixed order
// (deterministic); f16/bf16 arithmetic that the CPU does in the element type (MSE backward)
// rounds after every operation here too.
// Pointers arrive already offset to the first element; a `*k` int argument is the dtype code
// (DT_* in the generated header) of a float buffer whose type may differ from the rows'
// (statistics, losses). Compiled after the generated codes and prelude.cuh.

// ---- cross-entropy ---------------------------------------------------------------------------

// Rows of the logits (and of their gradient) are `ld` elements apart: c, or c padded to the
// GEMM's aligned row stride.

// exp at the rows' precision, as the CPU's exp_of: f32 for f32/f16/bf16 (several times
// cheaper than double's on the GPU), double for f64. Sums still accumulate in double.
template <typename T> __device__ __forceinline__ double exp_t(double v) {
    return (double)expf((float)v);
}
template <> __device__ __forceinline__ double exp_t<double>(double v) { return exp(v); }

// Per row: lse (kind lk) and -log p(target) into nll (0 when ignored). Targets were checked on
// the host; the range test only keeps a bad one from reading out of bounds.
template <typename T>
__device__ void cross_entropy_fwd(const T* x, i64 ld, const i64* t, i64 rows, i64 c, i64 ignore,
                                  void* lse, int lk, double* nll) {
    __shared__ double sh[BLOCK];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * ld;
        double m = NEG_INF;
        for (i64 j = threadIdx.x; j < c; j += BLOCK) m = fmax(m, to_d(xr[j]));
        m = block_max(m, sh);
        double s = 0.0;
        for (i64 j = threadIdx.x; j < c; j += BLOCK) s += exp_t<T>(to_d(xr[j]) - m);
        s = block_sum(s, sh);
        if (threadIdx.x == 0) {
            const double l = m + log(s);
            store_f64(lse, lk, r, l);
            const i64 tr = t[r];
            nll[r] = (tr == ignore || tr < 0 || tr >= c) ? 0.0 : l - to_d(xr[tr]);
        }
    }
}

// The logits' gradient rounds as an f32 softmax's followed by a cast would: through f32.
template <typename T> __device__ __forceinline__ T round_grad(double v) {
    return from_d<T>((double)(float)v);
}
template <> __device__ __forceinline__ double round_grad<double>(double v) { return v; }

// glogits = (softmax - onehot) · gloss / count per row, zero rows where the target is ignored.
// gx may be x itself: each element is read, then written, by the same thread.
template <typename T>
__device__ void cross_entropy_bwd(const T* x, i64 ld, const i64* t, const void* lse, int lk,
                                  const void* gloss, int gk, double count, T* gx, i64 rows, i64 c,
                                  i64 ignore) {
    const double scale = load_f64(gloss, gk, 0) / count;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * ld;
        T* outr = gx + r * ld;
        const i64 tr = t[r];
        if (tr == ignore) {
            for (i64 j = threadIdx.x; j < c; j += blockDim.x) outr[j] = from_d<T>(0.0);
            continue;
        }
        const double l = load_f64(lse, lk, r);
        for (i64 j = threadIdx.x; j < c; j += blockDim.x) {
            const double p = exp_t<T>(to_d(xr[j]) - l);
            const double hot = j == tr ? 1.0 : 0.0;
            outr[j] = round_grad<T>((p - hot) * scale);
        }
    }
}

// ---- cross-entropy over half-precision rows, 16-byte vectors ---------------------------------
// The LM head's logits: f16/bf16 rows whose stride is a whole number of 16-byte vectors from
// an aligned start (the host checks). Each thread moves 8 logits per access, and the
// arithmetic runs in f32 with the hardware exp: the gradient is rounded to 8 or 11 bits and
// the statistics stay far inside f32's range, so double buys nothing there but time. The
// forward is one pass (an online max and rescaled sum per thread, combined per block).

#define NEG_INF_F (-__int_as_float(0x7f800000))

// Adds v to a running (max m, sum s of exp(x - m)). -inf adds nothing; NaN poisons s.
__device__ __forceinline__ void online_add(float v, float& m, float& s) {
    if (v > m) {
        s = s * __expf(m - v) + 1.0f;
        m = v;
    } else if (m != NEG_INF_F) {
        s += __expf(v - m);
    }
}

// Adds this thread's share of a row to its running (max m, sum s): the 16-byte vectors
// threadIdx.x, + STRIDE, ... of the row's whole vectors at xv (the row itself), then the
// elements of xr past the last whole vector.
template <typename T, int STRIDE>
__device__ __forceinline__ void online_row(const Pack16<T>* xv, const T* xr, i64 c, float& m,
                                           float& s) {
    const i64 nv = c / 8;
    for (i64 v = threadIdx.x; v < nv; v += STRIDE) {
        const Pack16<T> p = xv[v];
#pragma unroll
        for (int k = 0; k < 8; ++k) online_add(to_f(p.v[k]), m, s);
    }
    for (i64 j = nv * 8 + threadIdx.x; j < c; j += STRIDE) online_add(to_f(xr[j]), m, s);
}

template <typename T>
__device__ void cross_entropy_fwd_vec(const T* x, i64 ld, const i64* t, i64 rows, i64 c,
                                      i64 ignore, void* lse, int lk, double* nll) {
    __shared__ double sh[BLOCK];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * ld;
        float m = NEG_INF_F, s = 0.0f;
        online_row<T, BLOCK>((const Pack16<T>*)xr, xr, c, m, s);
        const double big = block_max((double)m, sh);
        const double part = m == NEG_INF_F ? 0.0 : (double)s * exp((double)m - big);
        const double sum = block_sum(part, sh);
        if (threadIdx.x == 0) {
            const double l = big + log(sum);
            store_f64(lse, lk, r, l);
            const i64 tr = t[r];
            nll[r] = (tr == ignore || tr < 0 || tr >= c) ? 0.0 : l - to_d(xr[tr]);
        }
    }
}

// As cross_entropy_bwd; the gradient of each logit is (exp(x - lse) - onehot) · scale in f32.
template <typename T>
__device__ void cross_entropy_bwd_vec(const T* x, i64 ld, const i64* t, const void* lse, int lk,
                                      const void* gloss, int gk, double count, T* gx, i64 rows,
                                      i64 c, i64 ignore) {
    const float scale = (float)(load_f64(gloss, gk, 0) / count);
    const i64 nv = c / 8;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * ld;
        T* outr = gx + r * ld;
        const Pack16<T>* xv = (const Pack16<T>*)xr;
        Pack16<T>* ov = (Pack16<T>*)outr;
        const i64 tr = t[r];
        const bool ignored = tr == ignore;
        const float l = (float)load_f64(lse, lk, r);
        for (i64 v = threadIdx.x; v < nv; v += blockDim.x) {
            const Pack16<T> p = xv[v];
            Pack16<T> o;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const float hot = v * 8 + k == tr ? 1.0f : 0.0f;
                const float g = (__expf(to_f(p.v[k]) - l) - hot) * scale;
                o.v[k] = from_f<T>(ignored ? 0.0f : g);
            }
            ov[v] = o;
        }
        for (i64 j = nv * 8 + threadIdx.x; j < c; j += blockDim.x) {
            const float hot = j == tr ? 1.0f : 0.0f;
            const float g = (__expf(to_f(xr[j]) - l) - hot) * scale;
            outr[j] = from_f<T>(ignored ? 0.0f : g);
        }
    }
}

#define CROSS_ENTROPY_VEC_KERNELS(S, T)                                                            \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                            \
        cross_entropy_fwd_vec_##S(const T* x, i64 ld, const i64* t, i64 rows, i64 c, i64 ignore,   \
                                  void* lse, int lk, double* nll) {                                \
        cross_entropy_fwd_vec<T>(x, ld, t, rows, c, ignore, lse, lk, nll);                         \
    }                                                                                              \
    extern "C" __global__ void cross_entropy_bwd_vec_##S(                                          \
        const T* x, i64 ld, const i64* t, const void* lse, int lk, const void* gloss, int gk,      \
        double count, T* gx, i64 rows, i64 c, i64 ignore) {                                        \
        cross_entropy_bwd_vec<T>(x, ld, t, lse, lk, gloss, gk, count, gx, rows, c, ignore);        \
    }

CROSS_ENTROPY_VEC_KERNELS(f16, f16_t)
CROSS_ENTROPY_VEC_KERNELS(bf16, bf16_t)

// ---- cross-entropy and its gradient in one kernel, half-precision rows -----------------------
// The fused classifier's chunks: per row, -log p(target) into nll and the logits overwritten by
// (softmax - onehot) · gloss / count, as cross_entropy_fwd_vec then cross_entropy_bwd_vec would
// give (the log-sum-exp stays in f32, the value the backward rounds it to). One block of
// CE_GRAD_BLOCK threads per row and two blocks per SM: the row is read three times (its max,
// its sum of exps, its gradient) while at most two rows per SM (26 MB on 132 SMs for GPT-2's
// 100 KB rows) are live, so the later reads come from L2 and the logits cross HBM once each
// way; on Hopper, rows that fit are staged in shared memory instead (the STAGED form below).

#define CE_GRAD_BLOCK 1024

// The block's max (then sum) of one float per thread, in a fixed order; red holds 32 floats.
__device__ __forceinline__ float ce_block_max(float v, float* red) {
    for (int s = 16; s > 0; s >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, s));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[threadIdx.x & 31];
    for (int s = 16; s > 0; s >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, s));
    __syncthreads();
    return v;
}
__device__ __forceinline__ float ce_block_sum(float v, float* red) {
    for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[threadIdx.x & 31];
    for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
    __syncthreads();
    return v;
}

// 2^v on the special-function unit (ex2.approx, flushing subnormal results): the exps below are
// 2^(x log2 e - shift), one fused multiply-add and this instruction each.
__device__ __forceinline__ float ex2_approx(float v) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}
#define LOG2E_F 1.4426950408889634f

// The gradient of one logit v of a row with log-sum-exp l (l2 = l log2 e):
// (exp(v - l) - onehot) · scale, in f32.
__device__ __forceinline__ float ce_grad(float v, float l2, bool hot, float scale) {
    return (ex2_approx(fmaf(v, LOG2E_F, -l2)) - (hot ? 1.0f : 0.0f)) * scale;
}

// Per row, three passes over its vectors, none with a branch per element: the max (exact in
// any order), the sum of exp(x - max), then the gradient (every pass reading shared memory
// where STAGED). An ignored row writes zeros. The target's element is found per vector (its
// offset in the vector, or -1), not by a 64-bit compare per element.
// STAGED: the row's whole vectors go to shared memory first (nv · 16 bytes of it, which the
// launcher gives): each thread starts all its copies at once (cp.async needs no registers,
// where the 32 a thread has at two blocks per SM leave room for one 16-byte load in flight),
// and every pass reads shared memory. Each thread stages and reads only its own vectors, in
// the same order either way: the same values bit for bit.
template <typename T, bool STAGED>
__device__ void cross_entropy_grad_vec(T* x, i64 ld, const i64* t, i64 rows, i64 c, i64 ignore,
                                       const void* gloss, int gk, double count, double* nll) {
    extern __shared__ __align__(16) unsigned char ce_stage[];
    __shared__ float red[32];
    const float scale = (float)(load_f64(gloss, gk, 0) / count);
    const i64 nv = c / 8;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        T* xr = x + r * ld;
        Pack16<T>* xv = (Pack16<T>*)xr;
        const Pack16<T>* src = STAGED ? (const Pack16<T>*)ce_stage : xv;
        if (STAGED) {
            for (i64 v = threadIdx.x; v < nv; v += CE_GRAD_BLOCK)
                cp_async16((Pack16<T>*)ce_stage + v, xv + v, 16);
            cp_async_commit();
        }
        const i64 tr = t[r];
        const bool ignored = tr == ignore, valid = !ignored && tr >= 0 && tr < c;
        // Read before any thread overwrites the row (the reductions below synchronise).
        const float target = threadIdx.x == 0 && valid ? to_f(xr[tr]) : 0.0f;
        if (STAGED) cp_async_wait<0>();
        if (ignored) {
            // The whole block: no loss, a zero gradient.
            const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
            for (i64 v = threadIdx.x; v < nv; v += CE_GRAD_BLOCK) *(uint4*)(xv + v) = zero;
            for (i64 j = nv * 8 + threadIdx.x; j < c; j += CE_GRAD_BLOCK) xr[j] = from_f<T>(0.0f);
            if (threadIdx.x == 0) nll[r] = 0.0;
            __syncthreads();
            continue;
        }
        float m = NEG_INF_F;
        for (i64 v = threadIdx.x; v < nv; v += CE_GRAD_BLOCK) {
            const Pack16<T> p = src[v];
#pragma unroll
            for (int k = 0; k < 8; ++k) m = fmaxf(m, to_f(p.v[k]));
        }
        for (i64 j = nv * 8 + threadIdx.x; j < c; j += CE_GRAD_BLOCK) m = fmaxf(m, to_f(xr[j]));
        const float big = ce_block_max(m, red);
        // A row of -inf: every exp 0 and l = -inf. (fmaxf drops a NaN; the sum then keeps it.)
        const float shift = big == NEG_INF_F ? 0.0f : big * LOG2E_F;
        float s = 0.0f;
        for (i64 v = threadIdx.x; v < nv; v += CE_GRAD_BLOCK) {
            const Pack16<T> p = src[v];
#pragma unroll
            for (int k = 0; k < 8; ++k) s += ex2_approx(fmaf(to_f(p.v[k]), LOG2E_F, -shift));
        }
        for (i64 j = nv * 8 + threadIdx.x; j < c; j += CE_GRAD_BLOCK)
            s += ex2_approx(fmaf(to_f(xr[j]), LOG2E_F, -shift));
        const float l = big + logf(ce_block_sum(s, red));
        if (threadIdx.x == 0) nll[r] = valid ? (double)l - (double)target : 0.0;
        const float l2 = l * LOG2E_F;
        for (i64 v = threadIdx.x; v < nv; v += CE_GRAD_BLOCK) {
            const Pack16<T> p = src[v];
            const i64 off = tr - v * 8;
            const int hk = valid && off >= 0 && off < 8 ? (int)off : -1;
            uint4 o;
            u32* w = (u32*)&o;
#pragma unroll
            for (int k = 0; k < 8; k += 2)
                w[k / 2] = pack2_rn<T>(ce_grad(to_f(p.v[k]), l2, k == hk, scale),
                                       ce_grad(to_f(p.v[k + 1]), l2, k + 1 == hk, scale));
            *(uint4*)(xv + v) = o;
        }
        for (i64 j = nv * 8 + threadIdx.x; j < c; j += CE_GRAD_BLOCK)
            xr[j] = from_f<T>(ce_grad(to_f(xr[j]), l2, j == tr, scale));
        // The next row's target read must not pass this row's last writes of another thread.
        __syncthreads();
    }
}

#define CROSS_ENTROPY_GRAD_KERNEL(S, T)                                                            \
    extern "C" __global__ void __launch_bounds__(CE_GRAD_BLOCK, 2) cross_entropy_grad_vec_##S(    \
        T* x, i64 ld, const i64* t, i64 rows, i64 c, i64 ignore, const void* gloss, int gk,        \
        double count, double* nll) {                                                               \
        cross_entropy_grad_vec<T, false>(x, ld, t, rows, c, ignore, gloss, gk, count, nll);        \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(CE_GRAD_BLOCK, 2) cross_entropy_grad_staged_##S( \
        T* x, i64 ld, const i64* t, i64 rows, i64 c, i64 ignore, const void* gloss, int gk,        \
        double count, double* nll) {                                                               \
        cross_entropy_grad_vec<T, true>(x, ld, t, rows, c, ignore, gloss, gk, count, nll);         \
    }

CROSS_ENTROPY_GRAD_KERNEL(f16, f16_t)
CROSS_ENTROPY_GRAD_KERNEL(bf16, bf16_t)

// One block: out[0] (kind ok) = Σ part[0..count) / divisor, partials added in a fixed order.
extern "C" __global__ void __launch_bounds__(BLOCK)
    sum_to_scalar(const double* part, i64 count, double divisor, void* out, int ok) {
    __shared__ double sh[BLOCK];
    double s = 0.0;
    for (i64 i = threadIdx.x; i < count; i += BLOCK) s += part[i];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) store_f64(out, ok, 0, s / divisor);
}

// ---- MSE ---------------------------------------------------------------------------------------

// Stage 1 of Σ (x - y)²: block b sums a fixed grid-stride share into part[b].
template <typename T>
__device__ void mse_partial(const T* x, const T* y, i64 n, double* part) {
    __shared__ double sh[BLOCK];
    const i64 step = (i64)gridDim.x * BLOCK;
    double s = 0.0;
    for (i64 i = (i64)blockIdx.x * BLOCK + threadIdx.x; i < n; i += step) {
        const double d = to_d(x[i]) - to_d(y[i]);
        s += d * d;
    }
    s = block_sum(s, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

// gx = (x - y) · s with s = 2 gloss / count rounded to T, in T arithmetic as the CPU does.
template <typename T>
__device__ void mse_bwd(const T* x, const T* y, const void* g, int gk, T* gx, i64 n, double count) {
    const T s = from_d<T>(2.0 * load_f64(g, gk, 0) / count);
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
        gx[i] = t_mul(t_sub(x[i], y[i]), s);
}

// ---- entry points ------------------------------------------------------------------------------

#define LOSS_KERNELS(S, T)                                                                         \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                            \
        cross_entropy_fwd_##S(const T* x, i64 ld, const i64* t, i64 rows, i64 c, i64 ignore,       \
                              void* lse, int lk, double* nll) {                                    \
        cross_entropy_fwd<T>(x, ld, t, rows, c, ignore, lse, lk, nll);                             \
    }                                                                                              \
    extern "C" __global__ void cross_entropy_bwd_##S(const T* x, i64 ld, const i64* t,             \
                                                     const void* lse, int lk, const void* gloss,   \
                                                     int gk, double count, T* gx, i64 rows, i64 c, \
                                                     i64 ignore) {                                 \
        cross_entropy_bwd<T>(x, ld, t, lse, lk, gloss, gk, count, gx, rows, c, ignore);            \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                            \
        mse_partial_##S(const T* x, const T* y, i64 n, double* part) {                             \
        mse_partial<T>(x, y, n, part);                                                             \
    }                                                                                              \
    extern "C" __global__ void mse_bwd_##S(const T* x, const T* y, const void* g, int gk, T* gx,   \
                                           i64 n, double count) {                                  \
        mse_bwd<T>(x, y, g, gk, gx, n, count);                                                     \
    }

FOR_FLOATS(LOSS_KERNELS)
