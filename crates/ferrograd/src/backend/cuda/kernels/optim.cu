// optim.cu — the optimizer family's kernels (backend/optim.rs), compiled after the generated
// codes and prelude.cuh: the SGD step (one elementwise launch), and multi-tensor kernels where
// one launch updates every tensor of a list (Adam, the mixed-precision unscale). For those the
// host uploads a table with one entry per tensor (device addresses, element count, index of its
// first chunk); the grid walks the chunks of all tensors, each block taking whole chunks and
// finding its tensor by binary search.
//
// Adam follows backend/cpu/optim.rs term by term in the compute type (f32 for
// f32/f16/bf16, f64 for f64), rounding once per store. The _rn intrinsics keep the compiler
// from contracting a multiply and an add into an FMA the CPU does not do, so f32 results are
// bit-identical to the CPU's.

#define OPTIM_BLOCK 256
// Elements per chunk (a block's unit of work): 16 per thread.
#define ADAM_CHUNK 4096

// One tensor of the list. Mirrors `AdamRow` in cuda/optim.rs (Row<4> of multi_tensor.rs, 48 bytes).
struct AdamEntry {
    u64 p;
    u64 g;
    u64 m;
    u64 v;
    i64 n;
    i64 first_chunk;  // Σ ceil(n / ADAM_CHUNK) over the entries before this one
};

// The step's scalars, derived on the host in f64 and read from device memory (so that a
// replayed graph reads the values the host staged for that step). Mirrors `AdamHyper` in
// cuda/optim.rs.
struct AdamHyper {
    double l2;        // g += l2 · p when has_l2 (coupled weight decay)
    double decay;     // p *= decay first (1 unless decoupled weight decay)
    double w1;        // 1 - beta1, the lerp weight of exp_avg
    double beta2;
    double w2;        // 1 - beta2
    double bc2_sqrt;  // sqrt(1 - beta2^t)
    double neg_step;  // -lr / (1 - beta1^t)
    double eps;
    double lr;
    double beta1;
    int has_l2;
    int pad;
};
static_assert(sizeof(AdamHyper) == 88, "AdamHyper must match its Rust twin (cuda/optim.rs)");

// The step's scalars; where the device keeps the step count (AdamStep::count_at), the bias
// corrections of step count + 1, as the host derives them (powf of the step as a double): a
// step the device skipped is then not counted, though the host never read its flag.
__device__ __forceinline__ AdamHyper adam_hyper(const AdamHyper* staged, const double* count) {
    AdamHyper h = *staged;
    if (count != nullptr) {
        const double t = *count + 1.0;
        h.bc2_sqrt = sqrt(1.0 - pow(h.beta2, t));
        h.neg_step = -(h.lr / (1.0 - pow(h.beta1, t)));
    }
    return h;
}

__device__ __forceinline__ float o_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float o_sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float o_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float o_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float o_sqrt(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double o_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double o_sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double o_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double o_div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ double o_sqrt(double a) { return __dsqrt_rn(a); }

template <typename T>
__device__ void adam_multi(const AdamEntry* tab, int count, i64 chunks, const AdamHyper& h,
                           const double* grad_scale, const float* skip) {
    // A GradScaler's found_inf, read on the device: the step leaves everything as it is.
    if (skip != nullptr && *skip != 0.0f) return;
    typedef typename T::C C;
    typedef typename T::S S;
    // Scalars rounded to the compute type, as the CPU's `AdamC::new` does.
    const C l2 = (C)h.l2, decay = (C)h.decay, w1 = (C)h.w1, beta2 = (C)h.beta2, w2 = (C)h.w2;
    const C bc2_sqrt = (C)h.bc2_sqrt, neg_step = (C)h.neg_step, eps = (C)h.eps;
    const C one = (C)1;
    // The clipping coefficient, read on the device (no host round trip for the norm).
    const bool scaled = grad_scale != nullptr;
    const C gscale = scaled ? (C)*grad_scale : one;
    // torch's lerp switches formula at |weight| = 0.5.
    const bool w1_small = w1 < (C)0.5 && w1 > (C)-0.5;
    for (i64 c = blockIdx.x; c < chunks; c += gridDim.x) {
        const AdamEntry e = tab[entry_of(tab, count, c)];
        const i64 start = (c - e.first_chunk) * (i64)ADAM_CHUNK;
        const i64 end = e.n < start + ADAM_CHUNK ? e.n : start + ADAM_CHUNK;
        S* pp = (S*)e.p;
        const S* gp = (const S*)e.g;
        S* mp = (S*)e.m;
        S* vp = (S*)e.v;
        for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
            C p = o_mul(T::ld(pp[i]), decay);
            C g = T::ld(gp[i]);
            if (scaled) g = o_mul(g, gscale);
            if (h.has_l2) g = o_add(g, o_mul(l2, p));
            C m = T::ld(mp[i]);
            m = w1_small ? o_add(m, o_mul(w1, o_sub(g, m)))
                         : o_sub(g, o_mul(o_sub(g, m), o_sub(one, w1)));
            C v = o_add(o_mul(T::ld(vp[i]), beta2), o_mul(o_mul(w2, g), g));
            const C denom = o_add(o_div(o_sqrt(v), bc2_sqrt), eps);
            p = o_add(p, o_div(o_mul(neg_step, m), denom));
            pp[i] = T::st(p);
            mp[i] = T::st(m);
            vp[i] = T::st(v);
        }
    }
}

// A half-precision parameter with an f32 master copy (llm.c's scheme): the f32 step of
// adam_multi on (master, exp_avg, exp_avg_sq), fed the gradient widened to f32, then the
// parameter = the new master rounded once. Mirrors `AdamMasterRow` in cuda/optim.rs.
struct AdamMasterEntry {
    u64 p;
    u64 g;
    u64 m;
    u64 v;
    u64 w;  // the f32 master
    i64 n;
    i64 first_chunk;
};

template <typename T>
__device__ void adam_master_multi(const AdamMasterEntry* tab, int count, i64 chunks,
                                  const AdamHyper& h, const double* grad_scale,
                                  const float* skip) {
    if (skip != nullptr && *skip != 0.0f) return;
    const float l2 = (float)h.l2, decay = (float)h.decay, w1 = (float)h.w1;
    const float beta2 = (float)h.beta2, w2 = (float)h.w2, bc2_sqrt = (float)h.bc2_sqrt;
    const float neg_step = (float)h.neg_step, eps = (float)h.eps;
    const bool w1_small = w1 < 0.5f && w1 > -0.5f;
    const bool scaled = grad_scale != nullptr;
    const float gscale = scaled ? (float)*grad_scale : 1.0f;
    for (i64 c = blockIdx.x; c < chunks; c += gridDim.x) {
        const AdamMasterEntry e = tab[entry_of(tab, count, c)];
        const i64 start = (c - e.first_chunk) * (i64)ADAM_CHUNK;
        const i64 end = e.n < start + ADAM_CHUNK ? e.n : start + ADAM_CHUNK;
        typename T::S* pp = (typename T::S*)e.p;
        const typename T::S* gp = (const typename T::S*)e.g;
        float* mp = (float*)e.m;
        float* vp = (float*)e.v;
        float* wp = (float*)e.w;
        for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
            float p = o_mul(wp[i], decay);
            float g = T::ld(gp[i]);
            if (scaled) g = o_mul(g, gscale);
            if (h.has_l2) g = o_add(g, o_mul(l2, p));
            float m = mp[i];
            m = w1_small ? o_add(m, o_mul(w1, o_sub(g, m)))
                         : o_sub(g, o_mul(o_sub(g, m), o_sub(1.0f, w1)));
            const float v = o_add(o_mul(vp[i], beta2), o_mul(o_mul(w2, g), g));
            const float denom = o_add(o_div(o_sqrt(v), bc2_sqrt), eps);
            p = o_add(p, o_div(o_mul(neg_step, m), denom));
            wp[i] = p;
            pp[i] = T::st(p);
            mp[i] = m;
            vp[i] = v;
        }
    }
}

extern "C" __global__ void __launch_bounds__(OPTIM_BLOCK)
    adam_master_multi_bf16(const AdamMasterEntry* tab, int count, i64 chunks,
                           const AdamHyper* h, const double* grad_scale, const float* skip,
                           const double* steps) {
    adam_master_multi<BF16T>(tab, count, chunks, adam_hyper(h, steps), grad_scale, skip);
}
extern "C" __global__ void __launch_bounds__(OPTIM_BLOCK)
    adam_master_multi_f16(const AdamMasterEntry* tab, int count, i64 chunks,
                          const AdamHyper* h, const double* grad_scale, const float* skip,
                          const double* steps) {
    adam_master_multi<F16T>(tab, count, chunks, adam_hyper(h, steps), grad_scale, skip);
}

#define OPTIM_KERNELS(SUFFIX, T)                                                               \
    extern "C" __global__ void __launch_bounds__(OPTIM_BLOCK)                                  \
        adam_multi_##SUFFIX(const AdamEntry* tab, int count, i64 chunks, const AdamHyper* h,   \
                            const double* grad_scale, const float* skip,                       \
                            const double* steps) {                                             \
        adam_multi<T>(tab, count, chunks, adam_hyper(h, steps), grad_scale, skip);             \
    }

OPTIM_KERNELS(f32, F32T)
OPTIM_KERNELS(f64, F64T)
OPTIM_KERNELS(f16, F16T)
OPTIM_KERNELS(bf16, BF16T)

// The device's count of the optimizer steps that ran (AdamStep::count_at, SgdStep::count_at):
// one more unless the GradScaler's flag is raised. One thread.
extern "C" __global__ void adam_count_step(double* steps, const float* skip) {
    if (skip == nullptr || *skip == 0.0f) *steps += 1.0;
}

// ---- loss scale ---------------------------------------------------------------------------------

// torch's _amp_update_scale_ on state = [scale, 1/scale, growth tracker] (the tracker as an
// f32, exact to 2^24), then the report [found, scale] a step's log reads later (null: none).
// The f32 scale times the f64 factor, rounded to f32, as `next_scale` on the host. One thread.
extern "C" __global__ void amp_update_scale(float* state, const float* found_inf, float* report,
                                            double growth, double backoff, double interval) {
    const bool found = *found_inf != 0.0f;
    float scale = state[0];
    float tracker = state[2];
    if (found) {
        scale = (float)((double)scale * backoff);
        tracker = 0.0f;
    } else if ((double)tracker + 1.0 < interval) {
        tracker += 1.0f;
    } else {
        const float grown = (float)((double)scale * growth);
        if (isfinite(grown)) scale = grown;
        tracker = 0.0f;
    }
    state[0] = scale;
    state[1] = (float)(1.0 / (double)scale);
    state[2] = tracker;
    if (report != nullptr) {
        report[0] = found ? 1.0f : 0.0f;
        report[1] = scale;
    }
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


#define SGD_KERNELS(S, T)                                                                          \
    extern "C" __global__ void sgd_step_##S(const T* g, T* p, T* buf, i64 n, double lr,            \
                                            double wd, double mu, double damp, int nesterov,       \
                                            int first, const double* lr_at, const float* skip,     \
                                            const double* steps) {                                 \
        /* A GradScaler's found_inf, read on the device: the step leaves everything as it is. */   \
        if (skip != nullptr && *skip != 0.0f) return;                                              \
        /* A replayed graph's rate follows the schedule: read where the host staged it. */         \
        const double rate = lr_at != nullptr ? *lr_at : lr;                                        \
        /* The first step of a buffer whose count the device keeps: none taken yet. */             \
        const int first_step = steps != nullptr ? (*steps == 0.0) : first;                         \
        sgd_step<T>(g, p, buf, n, rate, wd, mu, damp, nesterov, first_step);                       \
    }

FOR_FLOATS(SGD_KERNELS)

// ---- mixed-precision gradient unscaling ---------------------------------------------------------
// One launch
// unscales every gradient of one dtype in place and raises a shared found_inf flag when any
// value is inf or NaN, as torch's _amp_foreach_non_finite_check_and_unscale_ does. The host
// uploads a table with one entry per gradient (device address, element count, index of its
// first chunk); the grid walks the chunks of all gradients, each block taking whole chunks and
// finding its gradient by binary search (the layout of optim.cu's Adam launch).
//
// Mirrors backend/cpu/optim.rs: the check is on the value before scaling; the product is
// taken in the compute type (f32 for f32/f16/bf16, f64 for f64) and rounded once.

#define AMP_BLOCK 256
// Elements per chunk (a block's unit of work): 16 per thread.
#define AMP_CHUNK 4096

// One gradient of the list. Mirrors the rows of cuda/multi_tensor.rs (#[repr(C)], 24 bytes).
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

template <typename T>
__device__ void unscale_check(const UnscaleEntry* tab, int count, i64 chunks, float inv_scale,
                              float* found_inf) {
    typedef typename T::C C;
    typedef typename T::S S;
    const C inv = (C)inv_scale;
    const bool identity = inv_scale == 1.0f;
    bool bad = false;
    for (i64 c = blockIdx.x; c < chunks; c += gridDim.x) {
        const UnscaleEntry e = tab[entry_of(tab, count, c)];
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
        const UnscaleEntry* tab, int count, i64 chunks, float inv_scale,                       \
        const float* inv_scale_at, float* found_inf) {                                         \
        /* A replayed graph's scale changes per step: read where the host staged it. */        \
        const float inv = inv_scale_at != nullptr ? *inv_scale_at : inv_scale;                 \
        unscale_check<T>(tab, count, chunks, inv, found_inf);                                  \
    }

AMP_KERNELS(f32, F32T)
AMP_KERNELS(f64, F64T)
AMP_KERNELS(f16, F16T)
AMP_KERNELS(bf16, BF16T)
