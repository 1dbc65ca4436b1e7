// Fused-op kernels of the CUDA backend, compiled by NVRTC (no standard headers: the types and
// the half-precision conversions are defined here). They mirror the CPU reference kernels
// (backend/cpu/fused_*.rs): per-row statistics accumulate in double whatever the element type,
// sums that cross rows or blocks add fixed partitions in a fixed order (deterministic), and
// f16/bf16 arithmetic that the CPU does in the element type (SGD, MSE backward) rounds after
// every operation here too.
//
// Conventions: row kernels run one block of BLOCK (256) threads per row, looping over rows
// with a grid stride; elementwise kernels use grid-stride loops; every index is 64-bit.
// Pointers arrive already offset to the first element. A "kind" argument names the float type
// behind a `void*` (0 f32, 1 f64, 2 f16, 3 bf16) for statistics whose dtype may differ from
// the rows'.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define BLOCK 256
#define NEG_INF (-__longlong_as_double(0x7ff0000000000000LL))

struct f16_t {
    u16 bits;
};
struct bf16_t {
    u16 bits;
};

// ---- conversions --------------------------------------------------------------------------

__device__ __forceinline__ i64 min_i64(i64 a, i64 b) { return a < b ? a : b; }

// IEEE half bits -> float (exact).
__device__ __forceinline__ float h2f(u16 h) {
    const u32 sign = ((u32)h & 0x8000u) << 16;
    const u32 e = ((u32)h >> 10) & 0x1fu;
    const u32 m = (u32)h & 0x3ffu;
    if (e == 0) {
        // Subnormal (or zero): m * 2^-24, exact in float.
        const float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

// sig >> shift rounded to nearest, ties to even; shift in [1, 63].
__device__ __forceinline__ u64 rne_shift(u64 sig, int shift) {
    u64 q = sig >> shift;
    const u64 rem = sig & ((1ull << shift) - 1ull);
    const u64 half = 1ull << (shift - 1);
    if (rem > half || (rem == half && (q & 1ull))) q += 1ull;
    return q;
}

// double -> half bits, one rounding (nearest even), overflow to infinity.
__device__ u16 d2h(double x) {
    const u64 b = (u64)__double_as_longlong(x);
    const u16 sign = (u16)((b >> 48) & 0x8000u);
    const int e = (int)((b >> 52) & 0x7ff);
    const u64 m = b & 0xfffffffffffffull;
    if (e == 0x7ff) return (u16)(sign | 0x7c00u | (m ? 0x200u : 0u));
    if (e == 0) return sign;  // double subnormals are far below half's range
    const int ue = e - 1023;
    if (ue > 15) return (u16)(sign | 0x7c00u);
    // Normal halves keep 10 of the 52 mantissa bits; subnormals count units of 2^-24.
    const int shift = ue >= -14 ? 42 : 28 - ue;
    if (shift > 63) return sign;
    const u64 q = rne_shift(m | (1ull << 52), shift);
    // q includes the implicit bit (1024..2048) for normals; a carry to 2048 bumps the
    // exponent (up to infinity), and a subnormal rounding up to 1024 becomes the smallest
    // normal: both fall out of the addition.
    if (ue >= -14) return (u16)(sign | (((u32)(ue + 15) << 10) + (u32)q - 1024u));
    return (u16)(sign | (u32)q);
}

// double -> bfloat16 bits, one rounding (nearest even), overflow to infinity.
__device__ u16 d2bf(double x) {
    const u64 b = (u64)__double_as_longlong(x);
    const u16 sign = (u16)((b >> 48) & 0x8000u);
    const int e = (int)((b >> 52) & 0x7ff);
    const u64 m = b & 0xfffffffffffffull;
    if (e == 0x7ff) return (u16)(sign | 0x7f80u | (m ? 0x40u : 0u));
    if (e == 0) return sign;
    const int ue = e - 1023;
    if (ue > 127) return (u16)(sign | 0x7f80u);
    // Normal bf16 keeps 7 mantissa bits; subnormals count units of 2^-133.
    const int shift = ue >= -126 ? 45 : -81 - ue;
    if (shift > 63) return sign;
    const u64 q = rne_shift(m | (1ull << 52), shift);
    if (ue >= -126) return (u16)(sign | (((u32)(ue + 127) << 7) + (u32)q - 128u));
    return (u16)(sign | (u32)q);
}

__device__ __forceinline__ double to_d(float v) { return (double)v; }
__device__ __forceinline__ double to_d(double v) { return v; }
__device__ __forceinline__ double to_d(f16_t v) { return (double)h2f(v.bits); }
__device__ __forceinline__ double to_d(bf16_t v) {
    return (double)__uint_as_float(((u32)v.bits) << 16);
}

template <typename T> __device__ T from_d(double v);
template <> __device__ __forceinline__ float from_d<float>(double v) { return (float)v; }
template <> __device__ __forceinline__ double from_d<double>(double v) { return v; }
template <> __device__ __forceinline__ f16_t from_d<f16_t>(double v) {
    f16_t r;
    r.bits = d2h(v);
    return r;
}
template <> __device__ __forceinline__ bf16_t from_d<bf16_t>(double v) {
    bf16_t r;
    r.bits = d2bf(v);
    return r;
}

// Arithmetic in the element type, as the CPU's generic kernels do it: f16/bf16 widen to float
// per operation and round back. The _rn intrinsics keep the compiler from fusing a multiply
// and an add into an FMA the CPU does not do.
__device__ __forceinline__ float t_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float t_sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float t_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double t_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double t_sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double t_mul(double a, double b) { return __dmul_rn(a, b); }

#define HALF_OPS(T, TOF)                                                                      \
    __device__ __forceinline__ T t_add(T a, T b) {                                           \
        return from_d<T>((double)__fadd_rn(TOF(a), TOF(b)));                                 \
    }                                                                                         \
    __device__ __forceinline__ T t_sub(T a, T b) {                                           \
        return from_d<T>((double)__fsub_rn(TOF(a), TOF(b)));                                 \
    }                                                                                         \
    __device__ __forceinline__ T t_mul(T a, T b) {                                           \
        return from_d<T>((double)__fmul_rn(TOF(a), TOF(b)));                                 \
    }

__device__ __forceinline__ float f16_f(f16_t v) { return h2f(v.bits); }
__device__ __forceinline__ float bf16_f(bf16_t v) { return __uint_as_float(((u32)v.bits) << 16); }
HALF_OPS(f16_t, f16_f)
HALF_OPS(bf16_t, bf16_f)

// Element i of a float buffer of the given kind, widened / stored from double.
__device__ double load_k(const void* p, i64 i, int kind) {
    switch (kind) {
        case 0: return to_d(((const float*)p)[i]);
        case 1: return ((const double*)p)[i];
        case 2: return to_d(((const f16_t*)p)[i]);
        default: return to_d(((const bf16_t*)p)[i]);
    }
}

__device__ void store_k(void* p, i64 i, int kind, double v) {
    switch (kind) {
        case 0: ((float*)p)[i] = from_d<float>(v); break;
        case 1: ((double*)p)[i] = v; break;
        case 2: ((f16_t*)p)[i] = from_d<f16_t>(v); break;
        default: ((bf16_t*)p)[i] = from_d<bf16_t>(v); break;
    }
}

// ---- block reductions (blockDim.x == BLOCK) --------------------------------------------------

// Sum of v over the block, returned to every thread. `sh` may be reused right after.
__device__ double block_sum(double v, double* sh) {
    const int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] += sh[t + s];
        __syncthreads();
    }
    const double r = sh[0];
    __syncthreads();
    return r;
}

// Max of v over the block (NaN-ignoring like fmax and the CPU's f64::max).
__device__ double block_max(double v, double* sh) {
    const int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] = fmax(sh[t], sh[t + s]);
        __syncthreads();
    }
    const double r = sh[0];
    __syncthreads();
    return r;
}

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

// y = (x - mean) rstd [· w] [+ b]; mean and rstd (biased variance, two passes) stored with
// kind sk. w and b may be null.
template <typename T>
__device__ void layer_norm_fwd(const T* x, const T* w, const T* b, T* y, void* mean, void* rstd,
                               int sk, i64 rows, i64 n, double eps) {
    __shared__ double sh[BLOCK];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * n;
        T* yr = y + r * n;
        double s = 0.0;
        for (i64 j = threadIdx.x; j < n; j += BLOCK) s += to_d(xr[j]);
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
            yr[j] = from_d<T>(h);
        }
        if (threadIdx.x == 0) {
            store_k(mean, r, sk, mu);
            store_k(rstd, r, sk, rs);
        }
    }
}

// gx = rstd (ĝ - mean(ĝ) - x̂ mean(ĝ x̂)) with x̂ = (x - mean) rstd and ĝ = gy · w.
template <typename T>
__device__ void layer_norm_bwd(const T* x, const T* w, const void* mean, const void* rstd, int sk,
                               const T* gy, T* gx, i64 rows, i64 n) {
    __shared__ double sh[BLOCK];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * n;
        const T* gr = gy + r * n;
        T* outr = gx + r * n;
        const double mu = load_k(mean, r, sk), rs = load_k(rstd, r, sk);
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
            outr[j] = from_d<T>(rs * (gh - mean_g - xh * mean_gx));
        }
    }
}

// Stage 1 of the weight/bias gradients: grid (ceil(n / BLOCK), chunks). Thread (j, c) sums
// column j over the rows of chunk c in order into part[c][j] (Σ gy x̂) and
// part[chunks + c][j] (Σ gy).
template <typename T>
__device__ void layer_norm_params(const T* x, const T* gy, const void* mean, const void* rstd,
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
        gw += g * (to_d(x[r * n + j]) - load_k(mean, r, sk)) * load_k(rstd, r, sk);
        gb += g;
    }
    part[c * n + j] = gw;
    part[(chunks + c) * n + j] = gb;
}

// Stage 2: column j adds its chunk partials in chunk order; gw / gb (kind ok) may be null.
extern "C" __global__ void layer_norm_params_finish(const double* part, i64 chunks, i64 n,
                                                    void* gw, void* gb, int ok) {
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += step) {
        double a = 0.0, b = 0.0;
        for (i64 c = 0; c < chunks; ++c) {
            a += part[c * n + j];
            b += part[(chunks + c) * n + j];
        }
        if (gw) store_k(gw, j, ok, a);
        if (gb) store_k(gb, j, ok, b);
    }
}

// ---- cross-entropy ---------------------------------------------------------------------------

// Per row: lse (kind lk) and -log p(target) into nll (0 when ignored). Targets were checked on
// the host; the range test only keeps a bad one from reading out of bounds.
template <typename T>
__device__ void cross_entropy_fwd(const T* x, const i64* t, i64 rows, i64 c, i64 ignore, void* lse,
                                  int lk, double* nll) {
    __shared__ double sh[BLOCK];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * c;
        double m = NEG_INF;
        for (i64 j = threadIdx.x; j < c; j += BLOCK) m = fmax(m, to_d(xr[j]));
        m = block_max(m, sh);
        double s = 0.0;
        for (i64 j = threadIdx.x; j < c; j += BLOCK) s += exp(to_d(xr[j]) - m);
        s = block_sum(s, sh);
        if (threadIdx.x == 0) {
            const double l = m + log(s);
            store_k(lse, r, lk, l);
            const i64 tr = t[r];
            nll[r] = (tr == ignore || tr < 0 || tr >= c) ? 0.0 : l - to_d(xr[tr]);
        }
    }
}

// glogits = (softmax - onehot) · gloss / count per row, zero rows where the target is ignored.
template <typename T>
__device__ void cross_entropy_bwd(const T* x, const i64* t, const void* lse, int lk,
                                  const void* gloss, int gk, double count, T* gx, i64 rows, i64 c,
                                  i64 ignore) {
    const double scale = load_k(gloss, 0, gk) / count;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * c;
        T* outr = gx + r * c;
        const i64 tr = t[r];
        if (tr == ignore) {
            for (i64 j = threadIdx.x; j < c; j += blockDim.x) outr[j] = from_d<T>(0.0);
            continue;
        }
        const double l = load_k(lse, r, lk);
        for (i64 j = threadIdx.x; j < c; j += blockDim.x) {
            const double p = exp(to_d(xr[j]) - l);
            const double hot = j == tr ? 1.0 : 0.0;
            outr[j] = from_d<T>((p - hot) * scale);
        }
    }
}

// One block: out[0] (kind ok) = Σ part[0..count) / divisor, partials added in a fixed order.
extern "C" __global__ void __launch_bounds__(BLOCK)
    sum_to_scalar(const double* part, i64 count, double divisor, void* out, int ok) {
    __shared__ double sh[BLOCK];
    double s = 0.0;
    for (i64 i = threadIdx.x; i < count; i += BLOCK) s += part[i];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) store_k(out, 0, ok, s / divisor);
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
    const T s = from_d<T>(2.0 * load_k(g, 0, gk) / count);
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
        gx[i] = t_mul(t_sub(x[i], y[i]), s);
}

// ---- SGD ---------------------------------------------------------------------------------------

// One SGD step in place, in T arithmetic (hyper-parameters rounded to T first, as the CPU
// does). buf is null without momentum; damp = 1 - dampening.
template <typename T>
__device__ void sgd_step(const T* g, T* p, T* buf, i64 n, double lr_, double wd_, double mu_,
                         double damp_, int nesterov, int first) {
    const T lr = from_d<T>(lr_), wd = from_d<T>(wd_), mu = from_d<T>(mu_), damp = from_d<T>(damp_);
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const T pv = p[i];
        const T d = t_add(g[i], t_mul(wd, pv));
        if (!buf) {
            p[i] = t_sub(pv, t_mul(lr, d));
            continue;
        }
        const T b = first ? d : t_add(t_mul(mu, buf[i]), t_mul(damp, d));
        buf[i] = b;
        const T st = nesterov ? t_add(d, t_mul(mu, b)) : b;
        p[i] = t_sub(pv, t_mul(lr, st));
    }
}

// ---- index select / index add ----------------------------------------------------------------

// out (nids, d) row p = w row ids[p]; w strided (rs, cs). Ids were checked on the host.
// E is an unsigned integer of the element's size: a gather only moves bits.
template <typename E>
__device__ void index_select(const E* w, i64 rs, i64 cs, const i64* ids, E* out, i64 nids, i64 d) {
    const i64 total = nids * d;
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const i64 p = i / d, col = i - p * d;
        out[i] = w[ids[p] * rs + col * cs];
    }
}

// out (V, d) row dest[u] += Σ g rows order[start[u]..start[u+1]) in that order, summed in double
// and rounded once: one block per destination row, so the result is deterministic.
template <typename T>
__device__ void index_add(const T* g, i64 rs, i64 cs, const i64* dest, const i64* start,
                          const i64* order, i64 groups, T* out, i64 d) {
    for (i64 u = blockIdx.x; u < groups; u += gridDim.x) {
        const i64 row = dest[u], s0 = start[u], s1 = start[u + 1];
        for (i64 col = threadIdx.x; col < d; col += blockDim.x) {
            double acc = to_d(out[row * d + col]);
            for (i64 k = s0; k < s1; ++k) acc += to_d(g[order[k] * rs + col * cs]);
            out[row * d + col] = from_d<T>(acc);
        }
    }
}

// ---- where -------------------------------------------------------------------------------------

#define WHERE_MAX_DIMS 8

// Shape and per-operand strides (elements) of a where, dims merged on the host.
struct WhereArgs {
    i64 shape[WHERE_MAX_DIMS];
    i64 sc[WHERE_MAX_DIMS];
    i64 sa[WHERE_MAX_DIMS];
    i64 sb[WHERE_MAX_DIMS];
    int rank;
};

// out (contiguous) = cond != 0 ? a : b, all three strided over the same shape.
template <typename E>
__device__ void where_select(const u8* cond, const E* a, const E* b, E* out, i64 numel,
                             WhereArgs s) {
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += step) {
        i64 rem = i, oc = 0, oa = 0, ob = 0;
        for (int k = s.rank - 1; k >= 0; --k) {
            const i64 n = s.shape[k];
            const i64 idx = rem % n;
            rem /= n;
            oc += idx * s.sc[k];
            oa += idx * s.sa[k];
            ob += idx * s.sb[k];
        }
        out[i] = cond[oc] ? a[oa] : b[ob];
    }
}

// ---- entry points ------------------------------------------------------------------------------

#define FOR_FLOATS(M) M(f32, float) M(f64, double) M(f16, f16_t) M(bf16, bf16_t)

#define FLOAT_KERNELS(S, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                           \
        softmax_fwd_##S(const T* x, T* y, i64 rows, i64 n, int log_) {                            \
        softmax_fwd<T>(x, y, rows, n, log_);                                                      \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                           \
        softmax_bwd_##S(const T* y, const T* gy, T* gx, i64 rows, i64 n, int log_) {              \
        softmax_bwd<T>(y, gy, gx, rows, n, log_);                                                 \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                           \
        layer_norm_fwd_##S(const T* x, const T* w, const T* b, T* y, void* mean, void* rstd,      \
                           int sk, i64 rows, i64 n, double eps) {                                 \
        layer_norm_fwd<T>(x, w, b, y, mean, rstd, sk, rows, n, eps);                              \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                           \
        layer_norm_bwd_##S(const T* x, const T* w, const void* mean, const void* rstd, int sk,    \
                           const T* gy, T* gx, i64 rows, i64 n) {                                 \
        layer_norm_bwd<T>(x, w, mean, rstd, sk, gy, gx, rows, n);                                 \
    }                                                                                             \
    extern "C" __global__ void layer_norm_params_##S(const T* x, const T* gy, const void* mean,   \
                                                     const void* rstd, int sk, double* part,      \
                                                     i64 rows, i64 n, i64 rows_per_chunk,         \
                                                     i64 chunks) {                                \
        layer_norm_params<T>(x, gy, mean, rstd, sk, part, rows, n, rows_per_chunk, chunks);       \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                           \
        cross_entropy_fwd_##S(const T* x, const i64* t, i64 rows, i64 c, i64 ignore, void* lse,   \
                              int lk, double* nll) {                                              \
        cross_entropy_fwd<T>(x, t, rows, c, ignore, lse, lk, nll);                                \
    }                                                                                             \
    extern "C" __global__ void cross_entropy_bwd_##S(const T* x, const i64* t, const void* lse,   \
                                                     int lk, const void* gloss, int gk,           \
                                                     double count, T* gx, i64 rows, i64 c,        \
                                                     i64 ignore) {                                \
        cross_entropy_bwd<T>(x, t, lse, lk, gloss, gk, count, gx, rows, c, ignore);               \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                           \
        mse_partial_##S(const T* x, const T* y, i64 n, double* part) {                            \
        mse_partial<T>(x, y, n, part);                                                            \
    }                                                                                             \
    extern "C" __global__ void mse_bwd_##S(const T* x, const T* y, const void* g, int gk, T* gx,  \
                                           i64 n, double count) {                                 \
        mse_bwd<T>(x, y, g, gk, gx, n, count);                                                    \
    }                                                                                             \
    extern "C" __global__ void sgd_step_##S(const T* g, T* p, T* buf, i64 n, double lr,          \
                                            double wd, double mu, double damp, int nesterov,      \
                                            int first) {                                          \
        sgd_step<T>(g, p, buf, n, lr, wd, mu, damp, nesterov, first);                             \
    }                                                                                             \
    extern "C" __global__ void index_add_##S(const T* g, i64 rs, i64 cs, const i64* dest,         \
                                             const i64* start, const i64* order, i64 groups,      \
                                             T* out, i64 d) {                                     \
        index_add<T>(g, rs, cs, dest, start, order, groups, out, d);                              \
    }

FOR_FLOATS(FLOAT_KERNELS)

#define FOR_SIZES(M) M(1, u8) M(2, u16) M(4, u32) M(8, u64)

#define SIZED_KERNELS(S, E)                                                                       \
    extern "C" __global__ void index_select_##S(const E* w, i64 rs, i64 cs, const i64* ids,       \
                                                E* out, i64 nids, i64 d) {                        \
        index_select<E>(w, rs, cs, ids, out, nids, d);                                            \
    }                                                                                             \
    extern "C" __global__ void where_##S(const u8* cond, const E* a, const E* b, E* out,          \
                                         i64 numel, WhereArgs s) {                                \
        where_select<E>(cond, a, b, out, numel, s);                                               \
    }

FOR_SIZES(SIZED_KERNELS)
