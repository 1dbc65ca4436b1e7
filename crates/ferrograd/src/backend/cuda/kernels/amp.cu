// amp.cu — mixed-precision gradient unscaling (compiled after strided.cuh): one launch
// unscales every gradient of one dtype in place and raises a shared found_inf flag when any
// value is inf or NaN, as torch's _amp_foreach_non_finite_check_and_unscale_ does. The host
// uploads a table with one entry per gradient (device address, element count, index of its
// first chunk); the grid walks the chunks of all gradients, each block taking whole chunks and
// finding its gradient by binary search (the layout of optim.cu's Adam launch).
//
// Mirrors backend/cpu/fused_amp.rs: the check is on the value before scaling; the product is
// taken in the compute type (f32 for f32/f16/bf16, f64 for f64) and rounded once.

#define AMP_BLOCK 256
// Elements per chunk (a block's unit of work): 16 per thread.
#define AMP_CHUNK 4096

// One gradient of the list. Mirrors `UnscaleEntry` in amp.rs (#[repr(C)], 24 bytes).
struct UnscaleEntry {
    u64 g;
    i64 n;
    i64 first_chunk;  // Σ ceil(n / AMP_CHUNK) over the entries before this one
};

// Finite tests on the bits: no math headers under NVRTC, and immune to fast-math folding.
__device__ __forceinline__ bool amp_finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}
__device__ __forceinline__ bool amp_finite(double v) {
    return ((u64)__double_as_longlong(v) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

__device__ __forceinline__ float amp_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double amp_mul(double a, double b) { return __dmul_rn(a, b); }

// The entry holding global chunk c: the last one whose first_chunk <= c (empty gradients are
// left out of the table by the host, so it is the one that covers c).
__device__ __forceinline__ int amp_entry_of(const UnscaleEntry* tab, int count, i64 c) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = lo + (hi - lo + 1) / 2;
        if (tab[mid].first_chunk <= c) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

template <typename T>
__device__ void unscale_check(const UnscaleEntry* tab, int count, i64 chunks, float inv_scale,
                              float* found_inf) {
    typedef typename T::C C;
    typedef typename T::S S;
    const C inv = (C)inv_scale;
    const bool identity = inv_scale == 1.0f;
    bool bad = false;
    for (i64 c = blockIdx.x; c < chunks; c += gridDim.x) {
        const UnscaleEntry e = tab[amp_entry_of(tab, count, c)];
        const i64 start = (c - e.first_chunk) * (i64)AMP_CHUNK;
        const i64 end = e.n < start + AMP_CHUNK ? e.n : start + AMP_CHUNK;
        S* gp = (S*)e.g;
        for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
            const C v = T::ld(gp[i]);
            if (!amp_finite(v)) bad = true;
            if (!identity) gp[i] = T::st(amp_mul(v, inv));
        }
    }
    // Every writer stores the same value, so the race is benign (PyTorch stores plainly too).
    if (bad) *found_inf = 1.0f;
}

#define AMP_KERNELS(SUFFIX, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(AMP_BLOCK) unscale_check_##SUFFIX(            \
        const UnscaleEntry* tab, int count, i64 chunks, float inv_scale, float* found_inf) {   \
        unscale_check<T>(tab, count, chunks, inv_scale, found_inf);                            \
    }

AMP_KERNELS(f32, F32T)
AMP_KERNELS(f64, F64T)
AMP_KERNELS(f16, F16T)
AMP_KERNELS(bf16, BF16T)
