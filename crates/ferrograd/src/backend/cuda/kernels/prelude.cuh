// prelude.cuh — the one prelude of every kernel file (rows.cu, loss.cu, index.cu, optim.cu,
// elementwise.cu, reduce.cu): prepended to each source before NVRTC compiles it, after the
// `#define` block of integer codes (DT_* dtype codes, U_*/B_*/R_* op codes) that
// backend/cuda/codes.rs generates from its one table — no kernel file defines a code itself.
// NVRTC has no standard or CUDA headers without include paths, so the integer types, the
// f16/bf16 conversions, element access by dtype code, strided indexing and block reductions
// are defined here, once.
//
// Conventions: element counts and offsets are 64-bit; elementwise kernels walk their elements
// with a grid-stride loop, so any grid size is correct; row kernels run one block of BLOCK
// threads per row.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define MAX_RANK 8
#define I64_MAX 0x7fffffffffffffffLL
#define I64_MIN (-I64_MAX - 1LL)

// A view of a buffer: element offset, then shape and strides (in elements, possibly negative
// or zero) of up to MAX_RANK dims. Mirrors `Strided` in cuda/launch.rs (#[repr(C)]).
struct Strided {
    i64 offset;
    int rank;
    int index32;  // 1: fewer than 2^31 elements, 32-bit index math is exact
    i64 shape[MAX_RANK];
    i64 strides[MAX_RANK];
};

// Storage offset of the i-th element in row-major order. The host merges dims that walk
// memory as one and drops size-1 dims, so contiguous views arrive with rank <= 1.
__device__ __forceinline__ i64 strided_offset(const Strided& s, i64 i) {
    if (s.rank == 1) return s.offset + i * s.strides[0];
    i64 off = s.offset;
    if (s.index32 && i <= 0x7fffffffLL) {
        // 32-bit division: a 64-bit one is a long software sequence on the GPU, and this
        // runs once per dim per element.
        u32 j = (u32)i;
#pragma unroll
        for (int d = MAX_RANK - 1; d >= 0; --d) {
            if (d < s.rank) {
                u32 n = (u32)s.shape[d];
                u32 q = j / n;
                off += (i64)(j - q * n) * s.strides[d];
                j = q;
            }
        }
        return off;
    }
#pragma unroll
    for (int d = MAX_RANK - 1; d >= 0; --d) {
        if (d < s.rank) {
            i64 n = s.shape[d];
            i64 q = i / n;
            off += (i - q * n) * s.strides[d];
            i = q;
        }
    }
    return off;
}

__device__ __forceinline__ i64 grid_start() {
    return (i64)blockIdx.x * (i64)blockDim.x + (i64)threadIdx.x;
}

__device__ __forceinline__ i64 grid_step() {
    return (i64)gridDim.x * (i64)blockDim.x;
}

__device__ __forceinline__ double f64_inf() {
    return __longlong_as_double(0x7ff0000000000000LL);
}

// ---- multi-tensor tables (cuda/multi_tensor.rs) ---------------------------------------------
// The entry holding global chunk c in a multi-tensor table (Adam's, unscale's, the casts'):
// the last one whose first_chunk <= c (empty tensors are left out of the table by the host, so
// it is the one that covers c).
template <typename Entry>
__device__ __forceinline__ int entry_of(const Entry* tab, int count, i64 c) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = lo + (hi - lo + 1) / 2;
        if (tab[mid].first_chunk <= c) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// ---- IEEE half (binary16) and bfloat16, stored as raw u16 bits ---------------------------

__device__ __forceinline__ float f16_to_f32(u16 h) {
    u32 sign = ((u32)h & 0x8000u) << 16;
    u32 e = ((u32)h >> 10) & 0x1fu;
    u32 m = (u32)h & 0x3ffu;
    if (e == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    if (e == 0u) {
        // zero or subnormal: m * 2^-24, exact in f32
        float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

// Round to nearest, ties to even (as the half crate and F16C do).
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u32 x = __float_as_uint(f);
    u32 sign = (x >> 16) & 0x8000u;
    u32 ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {
        // inf stays inf; NaN stays a quiet NaN with its top payload bits
        return (u16)(sign | 0x7c00u | (ax > 0x7f800000u ? (0x200u | ((ax >> 13) & 0x3ffu)) : 0u));
    }
    if (ax >= 0x477ff000u) return (u16)(sign | 0x7c00u);  // >= 65520 rounds to inf
    if (ax < 0x38800000u) {
        // below 2^-14: a half subnormal (or zero); below 2^-25 everything rounds to zero
        if (ax < 0x33000000u) return (u16)sign;
        u32 e = ax >> 23;                    // 102..112
        u32 m = (ax & 0x7fffffu) | 0x800000u;
        u32 shift = 126u - e;                // 14..24
        u32 hm = m >> shift;
        u32 rem = m & ((1u << shift) - 1u);
        u32 halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (hm & 1u))) hm += 1u;
        return (u16)(sign | hm);
    }
    u32 h = (ax - 0x38000000u) >> 13;         // rebias 127 -> 15, keep 10 mantissa bits
    u32 rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h += 1u;  // carry may reach inf: correct
    return (u16)(sign | h);
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40u);  // quiet NaN
    x += 0x7fffu + ((x >> 16) & 1u);  // ties to even; overflow carries into inf
    return (u16)(x >> 16);
}

// f64 -> f32 rounded to odd: the later rounding to 16 bits is then the correctly rounded
// result of the f64 value (no double-rounding error; f32 keeps >= 2 extra bits everywhere).
__device__ __forceinline__ float f64_to_f32_odd(double v) {
    float t = __double2float_rz(v);
    if (v == v && (double)t != v) t = __uint_as_float(__float_as_uint(t) | 1u);
    return t;
}

// A NaN keeps its sign and becomes the quiet NaN (0x7e00 / 0x7fc0), as the CPU's half crate
// stores f64 NaNs; the f32 step would lose both (the GPU's f64 -> f32 NaN is canonical).
__device__ __forceinline__ u16 f64_nan_sign(double v) {
    return (u16)(((u64)__double_as_longlong(v) >> 48) & 0x8000u);
}
__device__ __forceinline__ u16 f64_to_f16(double v) {
    if (v != v) return (u16)(f64_nan_sign(v) | 0x7e00u);
    return f32_to_f16(f64_to_f32_odd(v));
}
__device__ __forceinline__ u16 f64_to_bf16(double v) {
    if (v != v) return (u16)(f64_nan_sign(v) | 0x7fc0u);
    return f32_to_bf16(f64_to_f32_odd(v));
}

// Rust's `as i64`: saturating, NaN -> 0.
__device__ __forceinline__ i64 f64_to_i64(double v) {
    if (v != v) return 0;
    if (v >= 9223372036854775808.0) return I64_MAX;
    if (v <= -9223372036854775808.0) return I64_MIN;
    return (i64)v;
}

// ---- element access by runtime dtype code ------------------------------------------------

__device__ __forceinline__ double load_f64(const void* p, int dt, i64 i) {
    switch (dt) {
        case DT_F32: return (double)((const float*)p)[i];
        case DT_F64: return ((const double*)p)[i];
        case DT_F16: return (double)f16_to_f32(((const u16*)p)[i]);
        case DT_BF16: return (double)bf16_to_f32(((const u16*)p)[i]);
        case DT_I64: return (double)((const i64*)p)[i];
        default: return (double)((const u8*)p)[i];
    }
}

// Stores `v` converted as the CPU backend converts (from_f64; ints saturate; u8 = v != 0).
__device__ __forceinline__ void store_f64(void* p, int dt, i64 i, double v) {
    switch (dt) {
        case DT_F32: ((float*)p)[i] = (float)v; break;
        case DT_F64: ((double*)p)[i] = v; break;
        case DT_F16: ((u16*)p)[i] = f64_to_f16(v); break;
        case DT_BF16: ((u16*)p)[i] = f64_to_bf16(v); break;
        case DT_I64: ((i64*)p)[i] = f64_to_i64(v); break;
        default: ((u8*)p)[i] = (v != 0.0) ? 1 : 0; break;
    }
}

// ---- 16-byte vectors -----------------------------------------------------------------------
// 16 bytes of S, moved as one load or store: 8 bf16/f16, 4 f32 or 2 f64.
template <typename S>
struct alignas(16) Pack16 {
    S v[16 / sizeof(S)];
};

// Four neighbouring elements of S, moved as one 8- or 16-byte load or store (a row's group of
// four in the dropout and layer norm kernels).
template <typename S>
struct alignas(4 * sizeof(S)) Quad {
    S v[4];
};

__device__ __forceinline__ bool aligned16(const void* p) {
    return (((unsigned long long)p) & 15ull) == 0;
}

// ---- float element types for templated kernels -------------------------------------------
// S: storage type; C: compute type (f16/bf16 compute in f32, as the CPU backend does).
// HALF: the stored result keeps 8 (bf16) or 11 (f16) bits, so hardware approximations a few
// f32 ulps off (exp.approx) are as good as the exact functions there.
// cparam: a host f64 parameter rounded to the element type first (the CPU's T::from_f64).

struct F32T {
    typedef float S;
    typedef float C;
    static constexpr bool HALF = false;
    static __device__ __forceinline__ C ld(S v) { return v; }
    static __device__ __forceinline__ S st(C v) { return v; }
    static __device__ __forceinline__ C cparam(double p) { return (float)p; }
};

struct F64T {
    typedef double S;
    typedef double C;
    static constexpr bool HALF = false;
    static __device__ __forceinline__ C ld(S v) { return v; }
    static __device__ __forceinline__ S st(C v) { return v; }
    static __device__ __forceinline__ C cparam(double p) { return p; }
};

struct F16T {
    typedef u16 S;
    typedef float C;
    static constexpr bool HALF = true;
    static __device__ __forceinline__ C ld(S v) { return f16_to_f32(v); }
    static __device__ __forceinline__ S st(C v) { return f32_to_f16(v); }
    static __device__ __forceinline__ C cparam(double p) { return f16_to_f32(f64_to_f16(p)); }
};

struct BF16T {
    typedef u16 S;
    typedef float C;
    static constexpr bool HALF = true;
    static __device__ __forceinline__ C ld(S v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ S st(C v) { return f32_to_bf16(v); }
    static __device__ __forceinline__ C cparam(double p) { return bf16_to_f32(f64_to_bf16(p)); }
};

// ---- float element types for the row, loss, index and SGD kernels ----------------------------
// Templates over the storage type itself: f16/bf16 travel as wrapped bits; to_d widens to
// double, from_d rounds once (nearest even) with the conversions above.

#define BLOCK 256
#define NEG_INF (-__longlong_as_double(0x7ff0000000000000LL))

struct f16_t {
    u16 bits;
};
struct bf16_t {
    u16 bits;
};

#define FOR_FLOATS(M) M(f32, float) M(f64, double) M(f16, f16_t) M(bf16, bf16_t)

__device__ __forceinline__ i64 min_i64(i64 a, i64 b) { return a < b ? a : b; }

__device__ __forceinline__ double to_d(float v) { return (double)v; }
__device__ __forceinline__ double to_d(double v) { return v; }
__device__ __forceinline__ double to_d(f16_t v) { return (double)f16_to_f32(v.bits); }
__device__ __forceinline__ double to_d(bf16_t v) { return (double)bf16_to_f32(v.bits); }

template <typename T> __device__ T from_d(double v);
template <> __device__ __forceinline__ float from_d<float>(double v) { return (float)v; }
template <> __device__ __forceinline__ double from_d<double>(double v) { return v; }
template <> __device__ __forceinline__ f16_t from_d<f16_t>(double v) {
    f16_t r;
    r.bits = f64_to_f16(v);
    return r;
}
template <> __device__ __forceinline__ bf16_t from_d<bf16_t>(double v) {
    bf16_t r;
    r.bits = f64_to_bf16(v);
    return r;
}

// The same in f32, for kernels that compute f16/bf16 (and f32) in float: to_f widens exactly,
// from_f rounds once (nearest even). An f16 widens by the hardware's cvt (one instruction
// where f16_to_f32's integer decoding takes several; every value the same but for a NaN's
// payload, which these kernels' arithmetic does not keep anyway).
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(f16_t v) {
#if __CUDA_ARCH__ >= 800
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(v.bits));
    return r;
#else
    return f16_to_f32(v.bits);
#endif
}
__device__ __forceinline__ float to_f(bf16_t v) { return bf16_to_f32(v.bits); }

template <typename T> __device__ T from_f(float v);
template <> __device__ __forceinline__ f16_t from_f<f16_t>(float v) {
    f16_t r;
    r.bits = f32_to_f16(v);
    return r;
}
template <> __device__ __forceinline__ bf16_t from_f<bf16_t>(float v) {
    bf16_t r;
    r.bits = f32_to_bf16(v);
    return r;
}

// ---- f32 -> f16/bf16 by the hardware's rounding, for hot kernels ----------------------------
// cvt.rn from sm_80 on: one instruction for one value, or for two packed in a word, where the
// integer rounding of f32_to_bf16 / f32_to_f16 takes several a value. Nearest even, the same
// bits as those but for a NaN's payload (the hardware's canonical NaN).
__device__ __forceinline__ bf16_t bf16_rn_hw(float v) {
#if __CUDA_ARCH__ >= 800
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
    return r;
#else
    return from_f<bf16_t>(v);
#endif
}

__device__ __forceinline__ f16_t f16_rn_hw(float v) {
#if __CUDA_ARCH__ >= 800
    f16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
    return r;
#else
    return from_f<f16_t>(v);
#endif
}

// Two values rounded to T in one 32-bit word, lo in the low half.
template <typename T> __device__ __forceinline__ u32 pack2_rn(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2_rn<bf16_t>(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
#endif
}
template <> __device__ __forceinline__ u32 pack2_rn<f16_t>(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (u32)f32_to_f16(lo) | ((u32)f32_to_f16(hi) << 16);
#endif
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

HALF_OPS(f16_t, to_f)
HALF_OPS(bf16_t, to_f)

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

// ---- asynchronous copies (cp.async): global → shared without a trip through registers -----

__device__ __forceinline__ u32 smem_addr(const void* p) {
    // The compiler's own conversion, so a constant offset from one base folds into the
    // instruction's immediate instead of costing integer instructions per access.
    return (u32)__cvta_generic_to_shared(p);
}

// 16 bytes from `src`, or zeros when `bytes` is 0 (nothing is read then).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async4(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- counter-based random numbers -----------------------------------------------------

// Philox 4x32-10, as backend/philox.rs: the four words for `counter` under `key`.
__device__ __forceinline__ void philox4x32_10(u64 counter, u64 key, u32 c[4]) {
    c[0] = (u32)counter; c[1] = (u32)(counter >> 32); c[2] = 0; c[3] = 0;
    u32 k0 = (u32)key, k1 = (u32)(key >> 32);
    for (int round = 0; round < 10; round++) {
        if (round > 0) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        u32 hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
        u32 hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
        u32 n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
    }
}
