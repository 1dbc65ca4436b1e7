// index.cu — the index family's kernels (backend/index.rs): gather rows by id, deterministic
// scatter-add (one block per destination row, positions in id order), and `where` over up to
// WHERE_MAX_DIMS merged strided dims. Ids were checked on the host. Compiled after the
// generated codes and prelude.cuh.

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
// and rounded once: one block per destination row, so the result is deterministic. The number
// of groups is read from the table (*groups), so a replayed graph can take another batch's.
template <typename T>
__device__ void index_add(const T* g, i64 rs, i64 cs, const i64* dest, const i64* start,
                          const i64* order, const i64* groups_at, T* out, i64 d) {
    const i64 groups = *groups_at;
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

#define INDEX_KERNELS(S, T)                                                                        \
    extern "C" __global__ void index_add_##S(const T* g, i64 rs, i64 cs, const i64* dest,          \
                                             const i64* start, const i64* order,                   \
                                             const i64* groups, T* out, i64 d) {                   \
        index_add<T>(g, rs, cs, dest, start, order, groups, out, d);                               \
    }

FOR_FLOATS(INDEX_KERNELS)

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
