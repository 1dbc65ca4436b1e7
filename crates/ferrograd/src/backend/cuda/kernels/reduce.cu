// reduce.cu — sum / max / min / argmax over any set of dims of a strided float input.
// Compiled after the generated codes and prelude.cuh. The host splits the input into `outer` (kept dims, one output
// element each) and `inner` (reduced dims, walked by a linear index j in row-major order).
// Every value is accumulated in f64 whatever the input dtype (the CPU backend sums in f64).
//
// Kernels (the host picks one, plus reduce_finish when it splits the reduced elements):
// - reduce_thread_*: one thread per output, for few reduced elements.
// - reduce_block_*: one block per (output, split): the block's threads stride over the split's
//   reduced elements (adjacent in memory when the innermost reduced dim is contiguous, the
//   row case) and combine with a warp-shuffle tree.
// - reduce_cols_*: 32 neighbouring outputs per (32 x 8) block, for reductions over outer dims
//   (bias gradients: sum over rows of (N, C)): a warp reads 32 adjacent outputs' elements at
//   once, the 8 rows of threads split the reduced elements.
// - reduce_cols_vec_*: the sum of the rows of a matrix whose rows are whole 16-byte vectors
//   (the bias gradient of every linear layer): as reduce_cols_*, but each thread takes one
//   vector of outputs, so a warp reads 512 contiguous bytes of a row per load.
// With one split a kernel writes the output; with several it writes f64 partials at
// o * splits + s that reduce_finish combines in a fixed order (reduce_cols_vec_*: at
// s * n_out + o, for reduce_cols_finish), so sums are the same bits on every run.

// Op codes (R_*) come from the generated header (backend/cuda/codes.rs).

// A running result: value and (argmax only) the index of the element it came from.
struct Acc {
    double v;
    i64 i;
};

__device__ __forceinline__ Acc acc_identity(int op) {
    Acc a;
    a.i = I64_MAX;
    if (op == R_SUM) a.v = 0.0;
    else if (op == R_MIN) a.v = f64_inf();
    else a.v = -f64_inf();
    return a;
}

// Associative and commutative, so any combination order gives the CPU's answer (up to the
// rounding of sums). Max/min propagate NaN, as PyTorch (and the CPU backend) do. Argmax
// gives the first maximum, unless there is a NaN, in which case the first NaN (PyTorch's
// rule, the CPU's too).
__device__ __forceinline__ Acc acc_combine(int op, Acc a, Acc b) {
    switch (op) {
        case R_SUM: a.v = a.v + b.v; return a;
        case R_MAX: a.v = (a.v != a.v || b.v != b.v) ? a.v + b.v : fmax(a.v, b.v); return a;
        case R_MIN: a.v = (a.v != a.v || b.v != b.v) ? a.v + b.v : fmin(a.v, b.v); return a;
        default: {
            bool an = a.v != a.v, bn = b.v != b.v;
            if (an || bn) {
                if (an && bn) return a.i < b.i ? a : b;
                return an ? a : b;
            }
            if (a.v > b.v) return a;
            if (b.v > a.v) return b;
            return a.i < b.i ? a : b;
        }
    }
}

__device__ __forceinline__ Acc acc_elem(double v, i64 j) {
    Acc a;
    a.v = v;
    a.i = j;
    return a;
}

// Writes one output element converted to the output dtype (argmax writes the index).
__device__ __forceinline__ void store_result(void* out, int odt, i64 o, int op, Acc a) {
    if (op == R_ARGMAX) {
        i64 idx = a.i == I64_MAX ? 0 : a.i;  // no elements: index 0, as the CPU
        if (odt == DT_I64) {
            ((i64*)out)[o] = idx;
            return;
        }
        store_f64(out, odt, o, (double)idx);
        return;
    }
    store_f64(out, odt, o, a.v);
}

// Writes a finished (output, split) result: the output itself, or its partial.
__device__ __forceinline__ void emit(int op, Acc a, i64 o, i64 s, i64 splits, void* out, int odt,
                                     double* part_v, i64* part_i, int partial) {
    if (partial) {
        part_v[o * splits + s] = a.v;
        part_i[o * splits + s] = a.i;
    } else {
        store_result(out, odt, o, op, a);
    }
}

// Tree over a warp; every lane must take part. Lane 0 ends with the warp's result.
__device__ __forceinline__ Acc warp_reduce(int op, Acc a) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        Acc b;
        b.v = __shfl_down_sync(0xffffffffu, a.v, off);
        b.i = __shfl_down_sync(0xffffffffu, a.i, off);
        a = acc_combine(op, a, b);
    }
    return a;
}

// Tree over the block (blockDim.x a multiple of 32, at most 1024). Thread 0 ends with the
// block's result. Callers __syncthreads() before calling again (the scratch is reused).
__device__ __forceinline__ Acc block_reduce(int op, Acc a) {
    __shared__ double sv[32];
    __shared__ i64 si[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int warps = (blockDim.x + 31) >> 5;
    a = warp_reduce(op, a);
    if (lane == 0) {
        sv[warp] = a.v;
        si[warp] = a.i;
    }
    __syncthreads();
    if (warp == 0) {
        Acc b = lane < warps ? acc_elem(sv[lane], si[lane]) : acc_identity(op);
        a = warp_reduce(op, b);
    }
    return a;
}

template <typename T>
__device__ __forceinline__ double ld_f64(const typename T::S* x, i64 k) {
    return (double)T::ld(x[k]);
}

template <typename T>
__device__ __forceinline__ void reduce_thread_run(int op, const typename T::S* x, const Strided& outer,
                                                  const Strided& inner, i64 n_out, i64 n_in,
                                                  void* out, int odt) {
    for (i64 o = grid_start(); o < n_out; o += grid_step()) {
        i64 base = strided_offset(outer, o);
        Acc a = acc_identity(op);
        for (i64 j = 0; j < n_in; ++j) {
            a = acc_combine(op, a, acc_elem(ld_f64<T>(x, base + strided_offset(inner, j)), j));
        }
        store_result(out, odt, o, op, a);
    }
}

// Work item w = (output o, split s); split s covers reduced elements [s*chunk, (s+1)*chunk).
template <typename T>
__device__ __forceinline__ void reduce_block_run(int op, const typename T::S* x, const Strided& outer,
                                                 const Strided& inner, i64 n_out, i64 n_in,
                                                 i64 splits, i64 chunk, void* out, int odt,
                                                 double* part_v, i64* part_i, int partial) {
    i64 items = n_out * splits;
    for (i64 w = blockIdx.x; w < items; w += gridDim.x) {
        i64 o = w / splits, s = w - o * splits;
        i64 base = strided_offset(outer, o);
        i64 lo = s * chunk;
        i64 hi = lo + chunk < n_in ? lo + chunk : n_in;
        Acc a = acc_identity(op);
        for (i64 j = lo + threadIdx.x; j < hi; j += blockDim.x) {
            a = acc_combine(op, a, acc_elem(ld_f64<T>(x, base + strided_offset(inner, j)), j));
        }
        a = block_reduce(op, a);
        if (threadIdx.x == 0) emit(op, a, o, s, splits, out, odt, part_v, part_i, partial);
        __syncthreads();
    }
}

#define COLS_X 32
#define COLS_Y 8

// Work item w = (tile t of 32 outputs, split s). blockDim must be (COLS_X, COLS_Y).
template <typename T>
__device__ __forceinline__ void reduce_cols_run(int op, const typename T::S* x, const Strided& outer,
                                                const Strided& inner, i64 n_out, i64 n_in,
                                                i64 splits, i64 chunk, void* out, int odt,
                                                double* part_v, i64* part_i, int partial) {
    __shared__ double cv[COLS_Y][COLS_X + 1];
    __shared__ i64 ci[COLS_Y][COLS_X + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    i64 tiles = (n_out + COLS_X - 1) / COLS_X;
    i64 items = tiles * splits;
    for (i64 w = blockIdx.x; w < items; w += gridDim.x) {
        i64 t = w / splits, s = w - t * splits;
        i64 o = t * COLS_X + tx;
        Acc a = acc_identity(op);
        if (o < n_out) {
            i64 base = strided_offset(outer, o);
            i64 lo = s * chunk;
            i64 hi = lo + chunk < n_in ? lo + chunk : n_in;
            for (i64 j = lo + ty; j < hi; j += COLS_Y) {
                a = acc_combine(op, a, acc_elem(ld_f64<T>(x, base + strided_offset(inner, j)), j));
            }
        }
        cv[ty][tx] = a.v;
        ci[ty][tx] = a.i;
        __syncthreads();
        if (ty == 0 && o < n_out) {
            for (int k = 1; k < COLS_Y; ++k) a = acc_combine(op, a, acc_elem(cv[k][tx], ci[k][tx]));
            emit(op, a, o, s, splits, out, odt, part_v, part_i, partial);
        }
        __syncthreads();
    }
}

// Sums of the rows of x (n_in rows of n_out elements, rows `ld` elements apart; n_out and ld
// multiples of the vector width V, x 16-byte aligned). Work item w = (tile t of COLS_X
// vectors, split s); blockDim must be (COLS_X, COLS_Y). Each thread sums its vector's V
// columns over every COLS_Y-th row of the split, then thread i of the block adds the COLS_Y
// partial sums of the tile's column i in a fixed order. Partials (if any) are the splits'
// sums, split-major (s * n_out + o), for reduce_cols_finish.
template <typename T>
__device__ __forceinline__ void reduce_cols_vec_run(const typename T::S* x, i64 ld, i64 n_out,
                                                    i64 n_in, i64 splits, i64 chunk, void* out,
                                                    int odt, double* part_v, int partial) {
    typedef typename T::S S;
    constexpr int V = 16 / sizeof(S);
    __shared__ double cv[COLS_Y][COLS_X * V];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const i64 nv = n_out / V;
    const i64 tiles = (nv + COLS_X - 1) / COLS_X;
    const i64 items = tiles * splits;
    for (i64 w = blockIdx.x; w < items; w += gridDim.x) {
        const i64 t = w / splits, s = w - t * splits;
        const i64 vcol = t * COLS_X + tx;
        double acc[V];
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] = 0.0;
        if (vcol < nv) {
            const i64 lo = s * chunk;
            const i64 hi = lo + chunk < n_in ? lo + chunk : n_in;
            for (i64 j = lo + ty; j < hi; j += COLS_Y) {
                const Pack16<S> p = *(const Pack16<S>*)(x + j * ld + vcol * V);
#pragma unroll
                for (int k = 0; k < V; ++k) acc[k] += (double)T::ld(p.v[k]);
            }
        }
#pragma unroll
        for (int k = 0; k < V; ++k) cv[ty][tx * V + k] = acc[k];
        __syncthreads();
        const int i = ty * COLS_X + tx;
        const i64 o = t * COLS_X * V + i;
        if (i < COLS_X * V && o < n_out) {
            double a = 0.0;
            for (int k = 0; k < COLS_Y; ++k) a += cv[k][i];
            if (partial) part_v[s * n_out + o] = a;
            else store_f64(out, odt, o, a);
        }
        __syncthreads();
    }
}

#define REDUCE_KERNELS(SUFFIX, T)                                                             \
    extern "C" __global__ void reduce_thread_##SUFFIX(int op, const T::S* x, Strided outer,  \
                                                      Strided inner, i64 n_out, i64 n_in,    \
                                                      void* out, int odt) {                  \
        reduce_thread_run<T>(op, x, outer, inner, n_out, n_in, out, odt);                     \
    }                                                                                         \
    extern "C" __global__ void reduce_block_##SUFFIX(                                         \
        int op, const T::S* x, Strided outer, Strided inner, i64 n_out, i64 n_in, i64 splits, \
        i64 chunk, void* out, int odt, double* part_v, i64* part_i, int partial) {            \
        reduce_block_run<T>(op, x, outer, inner, n_out, n_in, splits, chunk, out, odt, part_v, \
                            part_i, partial);                                                 \
    }                                                                                         \
    extern "C" __global__ void reduce_cols_##SUFFIX(                                          \
        int op, const T::S* x, Strided outer, Strided inner, i64 n_out, i64 n_in, i64 splits, \
        i64 chunk, void* out, int odt, double* part_v, i64* part_i, int partial) {            \
        reduce_cols_run<T>(op, x, outer, inner, n_out, n_in, splits, chunk, out, odt, part_v,  \
                           part_i, partial);                                                  \
    }                                                                                         \
    extern "C" __global__ void reduce_cols_vec_##SUFFIX(const T::S* x, i64 ld, i64 n_out,     \
                                                        i64 n_in, i64 splits, i64 chunk,      \
                                                        void* out, int odt, double* part_v,   \
                                                        int partial) {                        \
        reduce_cols_vec_run<T>(x, ld, n_out, n_in, splits, chunk, out, odt, part_v, partial);   \
    }

REDUCE_KERNELS(f32, F32T)
REDUCE_KERNELS(f64, F64T)
REDUCE_KERNELS(f16, F16T)
REDUCE_KERNELS(bf16, BF16T)

// Combines each output's `splits` partials (written by reduce_block_* / reduce_cols_* at
// o * splits + s); blockDim.x a multiple of 32.
extern "C" __global__ void reduce_finish(int op, const double* part_v, const i64* part_i,
                                         i64 n_out, i64 splits, void* out, int odt) {
    for (i64 o = blockIdx.x; o < n_out; o += gridDim.x) {
        Acc a = acc_identity(op);
        for (i64 s = threadIdx.x; s < splits; s += blockDim.x) {
            a = acc_combine(op, a, acc_elem(part_v[o * splits + s], part_i[o * splits + s]));
        }
        a = block_reduce(op, a);
        if (threadIdx.x == 0) store_result(out, odt, o, op, a);
        __syncthreads();
    }
}

// Combines reduce_cols_vec_*'s split-major partials: COLS_X outputs per block, blockDim
// (COLS_X, COLS_Y). Row y of threads adds splits y, y + COLS_Y, ... (a warp reads COLS_X
// neighbouring outputs' partials of one split at once), then thread x of row 0 adds its
// output's COLS_Y sums in a fixed order: the same bits on every run.
extern "C" __global__ void reduce_cols_finish(const double* part_v, i64 n_out, i64 splits,
                                              void* out, int odt) {
    __shared__ double acc[COLS_Y][COLS_X];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const i64 o = (i64)blockIdx.x * COLS_X + tx;
    double a = 0.0;
    if (o < n_out) {
#pragma unroll 4
        for (i64 s = ty; s < splits; s += COLS_Y) a += part_v[s * n_out + o];
    }
    acc[ty][tx] = a;
    __syncthreads();
    if (ty == 0 && o < n_out) {
        double t = 0.0;
        for (int k = 0; k < COLS_Y; ++k) t += acc[k][tx];
        store_f64(out, odt, o, t);
    }
}
