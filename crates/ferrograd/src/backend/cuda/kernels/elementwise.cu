// elementwise.cu — unary, binary and in-place binary float kernels, the strided copy with
// dtype conversion, and fill. Compiled after the generated codes and prelude.cuh. One launch per op call: the op is a
// runtime code (uniform across the grid, so the switch costs no divergence) plus an f64
// parameter (a second one for clamp's upper bound). The formulas follow
// backend/cpu/elementwise.rs term by term.

// Op codes (U_*, B_*) come from the generated header (backend/cuda/codes.rs).

#define GELU_C 0.7978845608028654      // sqrt(2/pi)
#define GELU_A 0.044715
#define FRAC_1_SQRT_2 0.7071067811865476
#define PI_F64 3.141592653589793

// Math in the compute type: f32 functions for f32/f16/bf16, f64 functions for f64.
__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }
// GELU (tanh form) where the result is stored in half precision: 1 + tanh(u) = 2 σ(2u) and
// 1 - tanh²(u) = 4 σ(2u) σ(-2u), with σ from the hardware exp. tanhf is a long sequence that
// made GELU compute-bound on large activations; the hardware tanh is fast but its absolute
// error swamps 1 + tanh(u) for negative inputs, where σ stays relatively exact (a few f32
// ulps, far below a bf16/f16 step). f32 and f64 keep the CPU's formula. The reciprocal is the
// hardware's approximation (one instruction, within an ulp of f32) rather than __frcp_rn's
// correctly rounded sequence, which kept the GELU waiting on arithmetic: GPT-2's recomputed
// GELU (B8, 25M bf16 elements) went from 46.1 to 38.9 µs a call on an H100. 1/inf is 0
// either way.
__device__ __forceinline__ float rcp_approx(float v) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}
__device__ __forceinline__ float sigmoid_fast(float z) { return rcp_approx(1.0f + __expf(-z)); }

__device__ __forceinline__ float gelu_tanh_half(float x) {
    const float u = (float)GELU_C * (x + (float)GELU_A * x * x * x);
    return x * sigmoid_fast(2.0f * u);
}

// g · gelu'(x) = g (½(1 + t) + ½ x (1 - t²) c (1 + 3 a x²)) with t = tanh(u).
__device__ __forceinline__ float gelu_tanh_backward_half(float g, float x) {
    const float u = (float)GELU_C * (x + (float)GELU_A * x * x * x);
    const float s = sigmoid_fast(2.0f * u);
    const float dt = 2.0f * s * (1.0f - s);  // ½ (1 - t²)
    return g * (s + x * dt * (float)GELU_C * (1.0f + 3.0f * (float)GELU_A * x * x));
}

__device__ __forceinline__ float m_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double m_abs(double x) { return fabs(x); }
__device__ __forceinline__ float m_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double m_pow(double x, double y) { return pow(x, y); }
// NaN-ignoring maximum, as Rust's f32::max / f64::max.
__device__ __forceinline__ float m_max(float x, float y) { return fmaxf(x, y); }
__device__ __forceinline__ double m_max(double x, double y) { return fmax(x, y); }
// A product the compiler may not fuse into a following add (FMA contraction), so sums of
// products round as on the CPU; this matters where they cancel (1 - y², tanh backward).
__device__ __forceinline__ float mul_rn(float x, float y) { return __fmul_rn(x, y); }
__device__ __forceinline__ double mul_rn(double x, double y) { return __dmul_rn(x, y); }

template <typename T>
__device__ __forceinline__ typename T::C unary_op(int op, double p, double q,
                                                  typename T::C x) {
    typedef typename T::C C;
    const C zero = (C)0, one = (C)1, hf = T::cparam(0.5);
    switch (op) {
        case U_NEG: return -x;
        case U_EXP: return m_exp(x);
        case U_LOG: return m_log(x);
        case U_SQRT: return m_sqrt(x);
        case U_TANH: return m_tanh(x);
        case U_SIGMOID: return one / (one + m_exp(-x));
        case U_RELU: return x > zero ? x : zero;
        case U_GELU_TANH: {
            if constexpr (T::HALF) return gelu_tanh_half(x);
            C u = T::cparam(GELU_C) * (x + mul_rn(T::cparam(GELU_A) * x * x, x));
            return hf * x * (one + m_tanh(u));
        }
        case U_GELU_ERF: {
            // in f64 for every dtype, as the CPU does
            double xd = (double)x;
            return T::cparam(0.5 * xd * (1.0 + erf(xd * FRAC_1_SQRT_2)));
        }
        case U_ABS: return m_abs(x);
        case U_ADD_SCALAR: return x + T::cparam(p);
        case U_MUL_SCALAR: return x * T::cparam(p);
        case U_POW_SCALAR: return m_pow(x, T::cparam(p));
        case U_STEP: return x > zero ? one : zero;
        case U_CLAMP: {
            // [p, q]; comparisons with NaN are false, so NaN passes through (torch.clamp)
            const C lo = T::cparam(p), hi = T::cparam(q);
            const C y = x < lo ? lo : x;
            return y > hi ? hi : y;
        }
        default: return x;
    }
}

template <typename T>
__device__ __forceinline__ typename T::C binary_op(int op, double p, typename T::C a,
                                                   typename T::C b) {
    typedef typename T::C C;
    const C zero = (C)0, one = (C)1;
    switch (op) {
        case B_ADD: return a + b;
        case B_SUB: return a - b;
        case B_MUL: return a * b;
        case B_DIV: return a / b;
        case B_POW: return m_pow(a, b);
        case B_MAXIMUM: return m_max(a, b);
        case B_ADD_SCALED: return a + mul_rn(T::cparam(p), b);
        case B_ASSIGN: return b;
        case B_RELU_BACKWARD: return b > zero ? a : zero;
        case B_TANH_BACKWARD: return a * (one - mul_rn(b, b));
        case B_SIGMOID_BACKWARD: return a * b * (one - b);
        case B_GELU_TANH_BACKWARD: {
            if constexpr (T::HALF) return gelu_tanh_backward_half(a, b);
            const C c = T::cparam(GELU_C), k = T::cparam(GELU_A), hf = T::cparam(0.5);
            C t = m_tanh(c * (b + mul_rn(k * b * b, b)));
            // both products rounded before the sum, as on the CPU (no FMA)
            C left = mul_rn(hf, one + t);
            C right = mul_rn(hf * b * (one - mul_rn(t, t)) * c,
                             one + mul_rn(T::cparam(3.0) * k * b, b));
            return a * (left + right);
        }
        case B_GELU_ERF_BACKWARD: {
            double x = (double)b;
            double cdf = 0.5 * (1.0 + erf(x * FRAC_1_SQRT_2));
            double pdf = exp(-0.5 * x * x) / sqrt(2.0 * PI_F64);
            return a * T::cparam(cdf + mul_rn(x, pdf));
        }
        case B_EQ: return a == b ? one : zero;
        default: return a;
    }
}

// ---- 16-byte accesses ---------------------------------------------------------------------
// Operands that are contiguous from a 16-byte aligned address (every tensor the allocator
// hands out, and most views of one) move as 16-byte vectors: 8 bf16/f16, 4 f32 or 2 f64 per
// load and store, with one index per vector instead of per element. The arithmetic is the
// scalar path's, element by element. The test is uniform over the grid (no divergence), and
// the grid-stride loops cover n for any grid, so the host may launch one thread per vector.

// Eight elements of S, on a 16-byte boundary (one vector for 2-byte S, two for f32).
template <typename S>
struct alignas(16) Pack8 {
    S v[8];
};

// Whether view `s` of `base` walks memory contiguously from a 16-byte aligned address.
template <typename S>
__device__ __forceinline__ bool vec16_view(const S* base, const Strided& s) {
    const bool contiguous = s.rank == 0 || (s.rank == 1 && s.strides[0] == 1);
    return contiguous && aligned16(base + s.offset);
}

// out[i] = op(x[i]) over 16-byte vectors of contiguous, aligned operands.
template <typename T>
__device__ __forceinline__ void unary_vec(int op, double p, double q, const typename T::S* x,
                                          typename T::S* out, i64 n) {
    typedef typename T::S S;
    constexpr int N = 16 / sizeof(S);
    const Pack16<S>* xv = (const Pack16<S>*)x;
    Pack16<S>* ov = (Pack16<S>*)out;
    const i64 chunks = n / N;
    for (i64 c = grid_start(); c < chunks; c += grid_step()) {
        const Pack16<S> a = xv[c];
        Pack16<S> r;
#pragma unroll
        for (int k = 0; k < N; ++k) r.v[k] = T::st(unary_op<T>(op, p, q, T::ld(a.v[k])));
        ov[c] = r;
    }
    for (i64 i = chunks * N + grid_start(); i < n; i += grid_step()) {
        out[i] = T::st(unary_op<T>(op, p, q, T::ld(x[i])));
    }
}

// out[i] = op(a[i], b[i]) over 16-byte vectors of contiguous, aligned operands.
template <typename T>
__device__ __forceinline__ void binary_vec(int op, double p, const typename T::S* a,
                                           const typename T::S* b, typename T::S* out, i64 n) {
    typedef typename T::S S;
    constexpr int N = 16 / sizeof(S);
    const Pack16<S>* av = (const Pack16<S>*)a;
    const Pack16<S>* bv = (const Pack16<S>*)b;
    Pack16<S>* ov = (Pack16<S>*)out;
    const i64 chunks = n / N;
    for (i64 c = grid_start(); c < chunks; c += grid_step()) {
        const Pack16<S> x = av[c], y = bv[c];
        Pack16<S> r;
#pragma unroll
        for (int k = 0; k < N; ++k) r.v[k] = T::st(binary_op<T>(op, p, T::ld(x.v[k]), T::ld(y.v[k])));
        ov[c] = r;
    }
    for (i64 i = chunks * N + grid_start(); i < n; i += grid_step()) {
        out[i] = T::st(binary_op<T>(op, p, T::ld(a[i]), T::ld(b[i])));
    }
}

// Whether view `s` is one element broadcast to every index (its only stride is 0).
__device__ __forceinline__ bool scalar_view(const Strided& s) {
    return s.rank == 1 && s.strides[0] == 0;
}

// out[i] = op(a[i], v) (or op(v, a[i]) when V_FIRST) for one value v, over 16-byte vectors
// of a contiguous, aligned a and out: a scalar operand (a loss gradient, a clip coefficient)
// costs no load per element, and the rest streams at the vector width.
template <typename T, bool V_FIRST>
__device__ __forceinline__ void binary_vec_value(int op, double p, const typename T::S* a,
                                                 typename T::C v, typename T::S* out, i64 n) {
    typedef typename T::S S;
    constexpr int N = 16 / sizeof(S);
    const Pack16<S>* av = (const Pack16<S>*)a;
    Pack16<S>* ov = (Pack16<S>*)out;
    const i64 chunks = n / N;
    for (i64 c = grid_start(); c < chunks; c += grid_step()) {
        const Pack16<S> x = av[c];
        Pack16<S> r;
#pragma unroll
        for (int k = 0; k < N; ++k)
            r.v[k] = T::st(V_FIRST ? binary_op<T>(op, p, v, T::ld(x.v[k]))
                                   : binary_op<T>(op, p, T::ld(x.v[k]), v));
        ov[c] = r;
    }
    for (i64 i = chunks * N + grid_start(); i < n; i += grid_step()) {
        out[i] = T::st(V_FIRST ? binary_op<T>(op, p, v, T::ld(a[i])) : binary_op<T>(op, p, T::ld(a[i]), v));
    }
}

// out[i] = op(x[i]); out is contiguous with n elements.
template <typename T>
__device__ __forceinline__ void unary_run(int op, double p, double q, const typename T::S* x,
                                          const Strided& xs, typename T::S* out, i64 n) {
    if (vec16_view(x, xs) && aligned16(out)) {
        unary_vec<T>(op, p, q, x + xs.offset, out, n);
        return;
    }
    for (i64 i = grid_start(); i < n; i += grid_step()) {
        out[i] = T::st(unary_op<T>(op, p, q, T::ld(x[strided_offset(xs, i)])));
    }
}

// out[i] = op(a[i], b[i]); a and b are pre-broadcast views of out's shape.
template <typename T>
__device__ __forceinline__ void binary_run(int op, double p, const typename T::S* a, const Strided& sa,
                                           const typename T::S* b, const Strided& sb,
                                           typename T::S* out, i64 n) {
    if (vec16_view(a, sa) && vec16_view(b, sb) && aligned16(out)) {
        binary_vec<T>(op, p, a + sa.offset, b + sb.offset, out, n);
        return;
    }
    if (vec16_view(a, sa) && scalar_view(sb) && aligned16(out)) {
        binary_vec_value<T, false>(op, p, a + sa.offset, T::ld(b[sb.offset]), out, n);
        return;
    }
    if (scalar_view(sa) && vec16_view(b, sb) && aligned16(out)) {
        binary_vec_value<T, true>(op, p, b + sb.offset, T::ld(a[sa.offset]), out, n);
        return;
    }
    for (i64 i = grid_start(); i < n; i += grid_step()) {
        typename T::C va = T::ld(a[strided_offset(sa, i)]);
        typename T::C vb = T::ld(b[strided_offset(sb, i)]);
        out[i] = T::st(binary_op<T>(op, p, va, vb));
    }
}

// dst[i] = op(dst[i], src[i]); the host guarantees src does not alias dst except exactly
// element for element (then each thread reads the element it writes).
template <typename T>
__device__ __forceinline__ void inplace_run(int op, double p, typename T::S* dst,
                                            const typename T::S* src, const Strided& ss, i64 n) {
    if (vec16_view(src, ss) && aligned16(dst)) {
        // Each thread reads a whole vector of dst and src before writing it back, so the exact
        // element-for-element alias stays safe.
        binary_vec<T>(op, p, dst, src + ss.offset, dst, n);
        return;
    }
    if (scalar_view(ss)) {
        // dst *= 1 changes nothing (a loss gradient of one scaling the gradients a fused
        // loss saved, every step): each thread reads the one value and leaves, no pass.
        const typename T::C v = T::ld(src[ss.offset]);
        if (op == B_MUL && v == (typename T::C)1) return;
        if (aligned16(dst)) {
            binary_vec_value<T, false>(op, p, dst, v, dst, n);
            return;
        }
    }
    for (i64 i = grid_start(); i < n; i += grid_step()) {
        typename T::C vs = T::ld(src[strided_offset(ss, i)]);
        dst[i] = T::st(binary_op<T>(op, p, T::ld(dst[i]), vs));
    }
}

// dst (rows, cols) op= src broadcast over rows (a bias): thread x takes column j of a stripe
// of ROW_STRIPE rows, so src is read once per stripe and no element needs a division to
// find its column. The same arithmetic as inplace_run.
#define ROW_STRIPE 16
template <typename T>
__device__ __forceinline__ void inplace_rows_run(int op, double p, typename T::S* dst,
                                                 const typename T::S* src, i64 rows, i64 cols) {
    const i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    const typename T::C vs = T::ld(src[j]);
    const i64 r0 = (i64)blockIdx.y * ROW_STRIPE;
    const i64 r1 = r0 + ROW_STRIPE < rows ? r0 + ROW_STRIPE : rows;
    for (i64 r = r0; r < r1; ++r) {
        typename T::S* d = dst + r * cols + j;
        *d = T::st(binary_op<T>(op, p, T::ld(*d), vs));
    }
}

// inplace_rows_run over 16-byte vectors: the rows are one flat run of vectors, thread t
// takes vector t and the bias vector t mod (cols / N), so every thread of every block works
// whatever the row length. The host launches it only when cols is a multiple of N and dst
// and src are 16-byte aligned, so every row starts on a vector boundary.
template <typename T>
__device__ __forceinline__ void inplace_rows_vec_run(int op, double p, typename T::S* dst,
                                                     const typename T::S* src, i64 rows, i64 cols) {
    typedef typename T::S S;
    constexpr int N = 16 / sizeof(S);
    const i64 per_row = cols / N, total = rows * per_row;
    Pack16<S>* dv = (Pack16<S>*)dst;
    const Pack16<S>* sv = (const Pack16<S>*)src;
    // 32-bit division where the indices fit: a 64-bit one is a long software sequence.
    const bool small = total <= 0x7fffffffLL;
    for (i64 t = grid_start(); t < total; t += grid_step()) {
        const i64 jv = small ? (i64)((u32)t % (u32)per_row) : t % per_row;
        Pack16<S> a = dv[t];
        const Pack16<S> b = sv[jv];
#pragma unroll
        for (int k = 0; k < N; ++k) a.v[k] = T::st(binary_op<T>(op, p, T::ld(a.v[k]), T::ld(b.v[k])));
        dv[t] = a;
    }
}

#define ELEMENTWISE_KERNELS(SUFFIX, T)                                                        \
    extern "C" __global__ void inplace_rows_##SUFFIX(int op, double p, T::S* dst,            \
                                                     const T::S* src, i64 rows, i64 cols) {  \
        inplace_rows_run<T>(op, p, dst, src, rows, cols);                                     \
    }                                                                                         \
    extern "C" __global__ void inplace_rows_vec_##SUFFIX(int op, double p, T::S* dst,        \
                                                         const T::S* src, i64 rows,           \
                                                         i64 cols) {                          \
        inplace_rows_vec_run<T>(op, p, dst, src, rows, cols);                                 \
    }                                                                                         \
    extern "C" __global__ void unary_##SUFFIX(int op, double p, double q, const T::S* x,     \
                                              Strided xs, T::S* out, i64 n) {               \
        unary_run<T>(op, p, q, x, xs, out, n);                                                \
    }                                                                                         \
    extern "C" __global__ void binary_##SUFFIX(int op, double p, const T::S* a, Strided sa,  \
                                               const T::S* b, Strided sb, T::S* out, i64 n) { \
        binary_run<T>(op, p, a, sa, b, sb, out, n);                                           \
    }                                                                                         \
    extern "C" __global__ void inplace_##SUFFIX(int op, double p, T::S* dst, const T::S* src, \
                                                Strided ss, i64 n) {                         \
        inplace_run<T>(op, p, dst, src, ss, n);                                               \
    }


// ---- the hot ops, specialised --------------------------------------------------------------
// The kernels above read the op as a runtime code, so every element goes through the switch
// and rounds the op's constants (GELU's, from f64) again. The ops that dominate a transformer
// step get 16-byte-vector kernels of their own with the op fixed at compile time: the switch
// and the constant conversions fold away. Same formulas, element for element. The host
// launches them only on contiguous, 16-byte aligned operands (and, for the row kernel, rows
// that are whole vectors).
#define HOT_KERNELS(SUFFIX, T)                                                                \
    extern "C" __global__ void gelu_tanh_vec_##SUFFIX(const T::S* x, T::S* out, i64 n) {      \
        unary_vec<T>(U_GELU_TANH, 0.0, 0.0, x, out, n);                                       \
    }                                                                                         \
    extern "C" __global__ void add_vec_##SUFFIX(const T::S* a, const T::S* b, T::S* out,      \
                                                i64 n) {                                      \
        binary_vec<T>(B_ADD, 0.0, a, b, out, n);                                              \
    }                                                                                         \
    extern "C" __global__ void add_inplace_vec_##SUFFIX(T::S* dst, const T::S* src, i64 n) {  \
        binary_vec<T>(B_ADD, 0.0, dst, src, dst, n);                                          \
    }                                                                                         \
    extern "C" __global__ void gelu_tanh_backward_inplace_vec_##SUFFIX(T::S* dst,             \
                                                                       const T::S* src,       \
                                                                       i64 n) {               \
        binary_vec<T>(B_GELU_TANH_BACKWARD, 0.0, dst, src, dst, n);                           \
    }                                                                                         \
    extern "C" __global__ void add_rows_vec_##SUFFIX(T::S* dst, const T::S* src, i64 rows,    \
                                                     i64 cols) {                              \
        inplace_rows_vec_run<T>(B_ADD, 0.0, dst, src, rows, cols);                            \
    }


// ---- one f16/bf16 operand beside f32 --------------------------------------------------------
// out (f32) = op(a, b) where one operand is f16/bf16 (autocast's f32 residual stream plus a
// half-precision branch). The half operand widens to f32 as it is read, exactly as the cast
// kernels widen it, so every result is binary_f32's on the cast operand — without the cast's
// kernel and buffer. Kernels are named by both operand dtypes: binary_f32_bf16, add_vec_bf16_f32.

// Eight elements per step over contiguous, 16-byte aligned operands: one 16-byte vector of
// the half operand, two of each f32 one.
template <typename A, typename B>
__device__ __forceinline__ void binary_widened_vec(int op, double p, const typename A::S* a,
                                                   const typename B::S* b, float* out, i64 n) {
    typedef typename A::S SA;
    typedef typename B::S SB;
    const Pack8<SA>* av = (const Pack8<SA>*)a;
    const Pack8<SB>* bv = (const Pack8<SB>*)b;
    Pack8<float>* ov = (Pack8<float>*)out;
    const i64 chunks = n / 8;
    for (i64 c = grid_start(); c < chunks; c += grid_step()) {
        const Pack8<SA> x = av[c];
        const Pack8<SB> y = bv[c];
        Pack8<float> r;
#pragma unroll
        for (int k = 0; k < 8; ++k) r.v[k] = binary_op<F32T>(op, p, A::ld(x.v[k]), B::ld(y.v[k]));
        ov[c] = r;
    }
    for (i64 i = chunks * 8 + grid_start(); i < n; i += grid_step()) {
        out[i] = binary_op<F32T>(op, p, A::ld(a[i]), B::ld(b[i]));
    }
}

// binary_run with the operands' own types; a and b are pre-broadcast views of out's shape.
template <typename A, typename B>
__device__ __forceinline__ void binary_widened_run(int op, double p, const typename A::S* a,
                                                   const Strided& sa, const typename B::S* b,
                                                   const Strided& sb, float* out, i64 n) {
    if (vec16_view(a, sa) && vec16_view(b, sb) && aligned16(out)) {
        binary_widened_vec<A, B>(op, p, a + sa.offset, b + sb.offset, out, n);
        return;
    }
    for (i64 i = grid_start(); i < n; i += grid_step()) {
        const float va = A::ld(a[strided_offset(sa, i)]);
        const float vb = B::ld(b[strided_offset(sb, i)]);
        out[i] = binary_op<F32T>(op, p, va, vb);
    }
}

#define WIDENED_KERNELS(SUFFIX, A, B)                                                         \
    extern "C" __global__ void binary_##SUFFIX(int op, double p, const A::S* a, Strided sa,  \
                                               const B::S* b, Strided sb, float* out, i64 n) { \
        binary_widened_run<A, B>(op, p, a, sa, b, sb, out, n);                                \
    }                                                                                         \
    extern "C" __global__ void add_vec_##SUFFIX(const A::S* a, const B::S* b, float* out,     \
                                                i64 n) {                                      \
        binary_widened_vec<A, B>(B_ADD, 0.0, a, b, out, n);                                   \
    }


// ---- copy and fill -----------------------------------------------------------------------

template <typename E>
__device__ __forceinline__ void copy_same(const E* src, const Strided& ss, E* dst, const Strided& ds,
                                          i64 n) {
    for (i64 i = grid_start(); i < n; i += grid_step()) {
        dst[strided_offset(ds, i)] = src[strided_offset(ss, i)];
    }
}

#if defined(EW_SHARED)
// dst view = src view (same element count, each walked in its own row-major order),
// converting from dtype `sd` to `dd` as the CPU backend does. Same dtype: a bit copy.
extern "C" __global__ void copy_strided(const void* src, int sd, Strided ss, void* dst, int dd,
                                        Strided ds, int same_size, i64 n) {
    if (sd == dd) {
        switch (same_size) {
            case 1: copy_same<u8>((const u8*)src, ss, (u8*)dst, ds, n); return;
            case 2: copy_same<u16>((const u16*)src, ss, (u16*)dst, ds, n); return;
            case 4: copy_same<u32>((const u32*)src, ss, (u32*)dst, ds, n); return;
            default: copy_same<u64>((const u64*)src, ss, (u64*)dst, ds, n); return;
        }
    }
    for (i64 i = grid_start(); i < n; i += grid_step()) {
        i64 si = strided_offset(ss, i), di = strided_offset(ds, i);
        if (sd == DT_U8 && dd == DT_I64) {
            ((i64*)dst)[di] = (i64)((const u8*)src)[si];
        } else if (sd == DT_I64 && dd == DT_U8) {
            ((u8*)dst)[di] = ((const i64*)src)[si] != 0 ? 1 : 0;
        } else {
            store_f64(dst, dd, di, load_f64(src, sd, si));
        }
    }
}
#endif

// Contiguous casts among f32, f16 and bf16 through f32 (exact for every source value, so the
// same single rounding as copy_strided's path): dst[i] = convert(src[i]).
__device__ __forceinline__ float cast_ld(float v) { return v; }
__device__ __forceinline__ float cast_ld_f16(u16 v) { return f16_to_f32(v); }
__device__ __forceinline__ float cast_ld_bf16(u16 v) { return bf16_to_f32(v); }

// Eight elements per step when both pointers are 16-byte aligned (see the 16-byte accesses).
#define CAST_KERNEL(NAME, S, LOAD, D, STORE)                                                  \
    extern "C" __global__ void NAME(const S* src, D* dst, i64 n) {                            \
        i64 done = 0;                                                                         \
        if (aligned16(src) && aligned16(dst)) {                                               \
            const Pack8<S>* sv = (const Pack8<S>*)src;                                        \
            Pack8<D>* dv = (Pack8<D>*)dst;                                                    \
            const i64 chunks = n / 8;                                                         \
            for (i64 c = grid_start(); c < chunks; c += grid_step()) {                        \
                const Pack8<S> a = sv[c];                                                     \
                Pack8<D> r;                                                                   \
                _Pragma("unroll") for (int k = 0; k < 8; ++k) r.v[k] = STORE(LOAD(a.v[k]));   \
                dv[c] = r;                                                                    \
            }                                                                                 \
            done = chunks * 8;                                                                \
        }                                                                                     \
        for (i64 i = done + grid_start(); i < n; i += grid_step()) dst[i] = STORE(LOAD(src[i])); \
    }


#if defined(EW_SHARED)
// Every element of a contiguous buffer = the `size`-byte little-endian pattern `bits`.
extern "C" __global__ void fill_bits(void* dst, int size, u64 bits, i64 n) {
    for (i64 i = grid_start(); i < n; i += grid_step()) {
        switch (size) {
            case 1: ((u8*)dst)[i] = (u8)bits; break;
            case 2: ((u16*)dst)[i] = (u16)bits; break;
            case 4: ((u32*)dst)[i] = (u32)bits; break;
            default: ((u64*)dst)[i] = bits; break;
        }
    }
}
#endif

// ---- dropout masks ------------------------------------------------------------------------

// out[i] = x[i] · m_i, m_i = the mask value `bits` (1/keep in the dtype) where element i's draw
// (half i % 2 of word (i / 2) % 4 of philox(i / 8, key), 16 bits) is below `keep`, else 0; the
// product in the compute type, rounded once (as a multiply by a stored mask). One thread per
// Philox call, eight elements; with `aligned` (x and out start on a multiple of four
// elements' bytes, the host checks) they move as two vector loads and two vector stores.
// seed: null, or a captured step's seed (rewritten before each replay): the key is key ^ *seed.
template <typename T>
__device__ __forceinline__ void dropout_apply_run(const typename T::S* x, typename T::S* out,
                                                  u64 bits, u64 key, const u64* seed,
                                                  double keep, i64 n, int aligned) {
    if (seed) key ^= *seed;
    typedef typename T::S S;
    S m;
    memcpy(&m, &bits, sizeof(S));  // little-endian: the low bytes hold the value
    const typename T::C scale = T::ld(m), zero = (typename T::C)0;
    // u < keep for u = draw / 2^16 is draw < ceil(keep · 2^16): exact, as keep · 2^16 is.
    const u32 below = (u32)ceil(keep * 65536.0);
    const i64 calls = (n + 7) / 8;
    for (i64 g = grid_start(); g < calls; g += grid_step()) {
        u32 w[4];
        philox4x32_10((u64)g, key, w);
        // Draw e of this call: half e % 2 of word e / 2.
        u32 kept = 0;
#pragma unroll
        for (int e = 0; e < 8; e++) kept |= (u32)(((w[e >> 1] >> (16 * (e & 1))) & 0xffffu) < below) << e;
        if (aligned && g * 8 + 8 <= n) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                Quad<S> q = ((const Quad<S>*)x)[2 * g + h];
#pragma unroll
                for (int j = 0; j < 4; j++)
                    q.v[j] = T::st(T::ld(q.v[j]) * ((kept >> (4 * h + j)) & 1 ? scale : zero));
                ((Quad<S>*)out)[2 * g + h] = q;
            }
            continue;
        }
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const i64 i = g * 8 + e;
            if (i >= n) break;
            out[i] = T::st(T::ld(x[i]) * ((kept >> e) & 1 ? scale : zero));
        }
    }
}

// Many contiguous casts in one launch (autocast's weight casts ahead of a forward): the host
// uploads a table with one entry per tensor (cuda/multi_tensor.rs); each block takes whole
// chunks of CAST_CHUNK elements and finds its tensor by binary search. Per element the same
// conversion as CAST_KERNEL, so the results are bit-identical to one cast per tensor.
#define CAST_MANY_BLOCK 256
#define CAST_CHUNK 4096
// One tensor of the list. Mirrors the rows of cuda/multi_tensor.rs (Row<2>, 32 bytes).
struct CastEntry {
    u64 src;
    u64 dst;
    i64 n;
    i64 first_chunk;  // Σ ceil(n / CAST_CHUNK) over the entries before this one
};

#define CAST_MANY_KERNEL(NAME, S, LOAD, D, STORE)                                              \
    extern "C" __global__ void __launch_bounds__(CAST_MANY_BLOCK)                              \
        NAME(const CastEntry* tab, int count, i64 chunks) {                                    \
        for (i64 c = blockIdx.x; c < chunks; c += gridDim.x) {                                 \
            const CastEntry e = tab[entry_of(tab, count, c)];                                  \
            const i64 start = (c - e.first_chunk) * (i64)CAST_CHUNK;                           \
            const S* src = (const S*)e.src + start;                                            \
            D* dst = (D*)e.dst + start;                                                        \
            const i64 len = e.n - start < CAST_CHUNK ? e.n - start : CAST_CHUNK;               \
            if (len == CAST_CHUNK) {                                                           \
                /* A whole chunk: all sixteen loads in flight before the first store. */       \
                S v[CAST_CHUNK / CAST_MANY_BLOCK];                                             \
                _Pragma("unroll") for (int k = 0; k < CAST_CHUNK / CAST_MANY_BLOCK; ++k)       \
                    v[k] = src[k * CAST_MANY_BLOCK + threadIdx.x];                             \
                _Pragma("unroll") for (int k = 0; k < CAST_CHUNK / CAST_MANY_BLOCK; ++k)       \
                    dst[k * CAST_MANY_BLOCK + threadIdx.x] = STORE(LOAD(v[k]));                \
            } else {                                                                           \
                for (i64 i = threadIdx.x; i < len; i += CAST_MANY_BLOCK)                       \
                    dst[i] = STORE(LOAD(src[i]));                                              \
            }                                                                                  \
        }                                                                                      \
    }

#define DROPOUT_KERNEL(SUFFIX, T)                                                             \
    extern "C" __global__ void dropout_apply_##SUFFIX(const T::S* x, T::S* out, u64 bits,     \
                                                      u64 key, const u64* seed, double keep,  \
                                                      i64 n, int aligned) {                   \
        dropout_apply_run<T>(x, out, bits, key, seed, keep, n, aligned);                      \
    }

// ---- the modules ----------------------------------------------------------------------------
// The file is compiled once per float dtype (EW_F32, EW_F64, EW_F16, EW_BF16: that dtype's
// op kernels) and once for what takes no single dtype (EW_SHARED: the strided copy, fill,
// the casts and the f16/bf16-beside-f32 kernels), so a run compiles only the dtypes it uses
// (cuda/elementwise.rs picks the module).
#if defined(EW_SHARED)
WIDENED_KERNELS(f32_f16, F32T, F16T)
WIDENED_KERNELS(f32_bf16, F32T, BF16T)
WIDENED_KERNELS(f16_f32, F16T, F32T)
WIDENED_KERNELS(bf16_f32, BF16T, F32T)
CAST_KERNEL(cast_f32_bf16, float, cast_ld, u16, f32_to_bf16)
CAST_KERNEL(cast_bf16_f32, u16, cast_ld_bf16, float, cast_ld)
CAST_KERNEL(cast_f32_f16, float, cast_ld, u16, f32_to_f16)
CAST_KERNEL(cast_f16_f32, u16, cast_ld_f16, float, cast_ld)
CAST_MANY_KERNEL(cast_many_f32_bf16, float, cast_ld, u16, f32_to_bf16)
CAST_MANY_KERNEL(cast_many_f32_f16, float, cast_ld, u16, f32_to_f16)
#elif defined(EW_F32)
ELEMENTWISE_KERNELS(f32, F32T)
HOT_KERNELS(f32, F32T)
DROPOUT_KERNEL(f32, F32T)
#elif defined(EW_F64)
ELEMENTWISE_KERNELS(f64, F64T)
DROPOUT_KERNEL(f64, F64T)
#elif defined(EW_F16)
ELEMENTWISE_KERNELS(f16, F16T)
HOT_KERNELS(f16, F16T)
DROPOUT_KERNEL(f16, F16T)
#elif defined(EW_BF16)
ELEMENTWISE_KERNELS(bf16, BF16T)
HOT_KERNELS(bf16, BF16T)
DROPOUT_KERNEL(bf16, BF16T)
#else
#error "elementwise.cu is compiled per module: define EW_SHARED, EW_F32, EW_F64, EW_F16 or EW_BF16"
#endif
