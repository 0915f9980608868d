// fastmm kernel ABI shared by every family: one signature, so the launcher needs one argument list.
//
//   C[z][m][n] = sum_k A[z][m][k] * B[z][k][n]   for z < batch_total
//
// Every operand is described by element strides (64-bit: offsets past 2^31 elements are fine).
// The batch is flattened from at most two broadcast dimensions: z = z0 * batch_inner + z1, and an
// operand's batch offset is z0 * s?0 + z1 * s?1 (a stride of 0 broadcasts).
#pragma once
#include "ptx.cuh"

#define FASTMM_PARAMS                                                             \
    const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, \
    i64 M_, i64 N_, i64 K_,                                                       \
    i64 sAm, i64 sAk, i64 sBk, i64 sBn, i64 sCm, i64 sCn,                         \
    i64 batch_inner_, i64 batch_total_,                                           \
    i64 sA0, i64 sA1, i64 sB0, i64 sB1, i64 sC0, i64 sC1

// Fused epilogue (EPILOGUE = 1): the store that finishes an output writes
//   alpha * acc + beta * D[m][n]
// instead of acc, D being one M x N matrix given by element strides (a stride of 0 broadcasts:
// a bias is D with sDm = 0) and shared by every batch entry. beta == 0 never reads D, so NaN
// there is ignored, as torch.addmm ignores its input then. The parameters come last, after a
// kernel's own (FASTMM_EPILOGUE_PARAMS), alpha and beta as the bits of a float32 (the launcher
// passes 64-bit integers only). Stores of partial sums (split-K slices, stream-K pieces) never
// apply it: the pass that finishes an output does (its reduce, fixup or last-arriving block).
//
// EPILOGUE_FORM (set by the planner from D's strides, which it knows when it plans): 0 = D of any
// strides, read per output; 1 = one value per column (sDm = 0: F.linear's bias), which a store
// loop may then read once for all the outputs of a column (Epilogue::column; the SIMT tile's C
// through shared memory, simt_cp_async.cu).
#ifndef EPILOGUE
#define EPILOGUE 0
#endif
#ifndef EPILOGUE_FORM
#define EPILOGUE_FORM 0
#endif
#if EPILOGUE_FORM && !EPILOGUE
#error "EPILOGUE_FORM describes the fused epilogue's D: it needs EPILOGUE = 1"
#endif
#if EPILOGUE
#define FASTMM_EPILOGUE_PARAMS , const float* __restrict__ D_, i64 sDm_, i64 sDn_, i64 alpha_bits_, i64 beta_bits_
#define FASTMM_EPILOGUE \
    const Epilogue epi{D_, sDm_, sDn_, __int_as_float((int)alpha_bits_), __int_as_float((int)beta_bits_)};
#else
#define FASTMM_EPILOGUE_PARAMS
#define FASTMM_EPILOGUE const Epilogue epi{};
#endif

struct Epilogue {
#if EPILOGUE
    const float* D;
    i64 sDm, sDn;
    float alpha, beta;
    // D at output (m, n): read only where beta != 0 (beta = 0 never reads D, NaN included).
    __device__ __forceinline__ float d_at(int m, int n) const { return D[(i64)m * sDm + (i64)n * sDn]; }
    // Form 1: D's value for column n of every row (0 past N, or where beta = 0: then not read).
    __device__ __forceinline__ float column(int n, int N) const { return beta != 0.f && n < N ? D[(i64)n * sDn] : 0.f; }
    // The output from its product ``acc`` and D's value ``d`` there (unused where beta = 0): for a
    // kernel that loads D ahead of the store (wgmma's EPILOGUE_VECTOR, form 1's staged store).
    __device__ __forceinline__ float apply(float acc, float d) const {
        const float v = alpha * acc;  // (exact for alpha = 1: a bias is acc + D, as an add after would be)
        return beta != 0.f ? fmaf(beta, d, v) : v;
    }
    __device__ __forceinline__ float operator()(float acc, int m, int n) const {
        return apply(acc, beta != 0.f ? d_at(m, n) : 0.f);
    }
#else
    __device__ __forceinline__ float operator()(float acc, int, int) const { return acc; }
#endif
};

// Every parameter is 64 bits wide so the host can pass plain Python ints (pointer-sized) with no
// per-call conversion; sizes themselves are < 2^31 (the planner checks), so kernels use int.
#define FASTMM_UNPACK \
    const int M = (int)M_, N = (int)N_, K = (int)K_;                              \
    const int batch_inner = (int)batch_inner_, batch_total = (int)batch_total_;

// Split-K: with gridDim.y = S > 1, block row y computes k-tiles [y * per, (y + 1) * per) and
// writes its partial C to C + y * sC0 (the host passes a batch of 1 and a workspace of S slices;
// splitk_reduce.cu then sums the slices in a fixed order, so results are the same bits every
// run). With gridDim.y = 1 this is the whole K range and the C offset is 0.
__device__ __forceinline__ void split_range(int K, int bk, int& kt_begin, int& kt_end) {
    const int total = (K + bk - 1) / bk;
    const int per = (total + gridDim.y - 1) / gridDim.y;
    kt_begin = min(total, (int)blockIdx.y * per);
    kt_end = min(total, kt_begin + per);
}

// Fused split-K (a kernel that sums its own slices, no second launch): after a block has stored
// its slice of a tile, it counts itself in the tile's arrival counter; the block that arrives
// last (of gridDim.y) then sums the tile's slices in slice order (0.f + s0 + s1 + ..., as
// splitk_reduce.cu does: the same bits) and resets the counter to 0 for the next launch on the
// stream. The fences make every block's slice visible before its arrival is counted, and the
// last block's reads (L2, ld.cg) come after it saw the count. The host gives each stream its
// own zeroed counters (fastmm/runtime/arrivals.py). Call with the whole block.
__device__ __forceinline__ bool split_arrive_last(unsigned* counter) {
    __threadfence();
    __syncthreads();
    unsigned before = 0;
    if (threadIdx.x == 0) before = atomicAdd(counter, 1u);
    const bool last = __syncthreads_or(threadIdx.x == 0 && before == gridDim.y - 1) != 0;
    if (last) __threadfence();
    return last;
}

// The sum a fused split's last block makes (after split_arrive_last returned true): the outputs
// (m, n0 + j), m < rows, j < cols, inside M x N, of the gridDim.y slices at C (slice stride sC0),
// added in slice order (0.f + s0 + s1 + ..., the same bits every run) into Out with the epilogue
// applied; then the tile's counter back to 0 for the next launch on the stream. Eight slices'
// loads are in flight at a time, then added in order (an add between two loads would hold the
// second back until the first's data arrived). Call with the whole block.
__device__ __forceinline__ void split_sum_slices(const float* C, i64 sCm, i64 sCn, i64 sC0, float* Out, i64 sOm,
                                                 i64 sOn, int M, int N, int rows, int n0, int cols,
                                                 const Epilogue& epi, unsigned* counter) {
    const int S = gridDim.y;
    for (int i = threadIdx.x; i < rows * cols; i += blockDim.x) {
        const int m = i / cols, n = n0 + i % cols;
        if (m < M && n < N) {
            const float* p = C + (i64)m * sCm + (i64)n * sCn;
            float sum = 0.f;
            for (int s = 0; s < S; s += 8) {
                float v[8];
#pragma unroll
                for (int u = 0; u < 8; ++u) v[u] = s + u < S ? ld_l2_ordered(p + (i64)(s + u) * sC0) : 0.f;
#pragma unroll
                for (int u = 0; u < 8; ++u)
                    if (s + u < S) sum += v[u];
            }
            Out[(i64)m * sOm + (i64)n * sOn] = epi(sum, m, n);
        }
    }
    if (threadIdx.x == 0) *(volatile unsigned*)counter = 0u;
}

// Stream-K: the most tile pieces a stretch of `iters` consecutive k-tiles can touch, in a
// sequence of tiles of k_tiles each (ceil(iters / k_tiles) whole ones, and one more where it
// starts part-way): the workspace slots each block owns. The host computes the same number.
__device__ __forceinline__ i64 stream_k_segments(i64 iters, i64 k_tiles) {
    return (iters + k_tiles - 1) / k_tiles + 1;
}

// Move A, B and C to batch z.
#define FASTMM_BATCH_OFFSETS(z)                                                   \
    const float* Ab = A + (i64)((z) / batch_inner) * sA0 + (i64)((z) % batch_inner) * sA1; \
    const float* Bb = B + (i64)((z) / batch_inner) * sB0 + (i64)((z) % batch_inner) * sB1; \
    float* Cb = C + (i64)((z) / batch_inner) * sC0 + (i64)((z) % batch_inner) * sC1 + (i64)blockIdx.y * sC0;

// Grouped tile order: walk GROUP rows of tiles column by column so blocks resident at the same
// time share A rows and B columns in L2 (the grid is 1-D over tiles, so no 65535 limit on M).
template <int GROUP>
__device__ __forceinline__ void tile_coords(int tile, int tiles_m, int tiles_n, int& tm, int& tn) {
    int per_group = GROUP * tiles_n;
    int group = tile / per_group;
    int first_m = group * GROUP;
    int rows = min(tiles_m - first_m, GROUP);
    int in_group = tile - group * per_group;
    tm = first_m + in_group % rows;
    tn = in_group / rows;
}

// sum += x, exactly: the rounding error of the fp32 add (Knuth's TwoSum, valid whatever the
// magnitudes) goes into err. tf32x3 promotes each k-step's big products with it and folds err
// into the small-term accumulator, so the promotion adds lose nothing (measured: without it the
// error at K = 1024 matched cuBLAS fp32 instead of beating it).
// fast_two_sum_add: the same in 3 adds instead of 6, exact when |sum| >= |x| (Dekker); otherwise
// its err is about as large as the add's own rounding, i.e. no worse than not compensating.
__device__ __forceinline__ void fast_two_sum_add(float& sum, float x, float& err) {
    const float s = sum + x;
    err += x - (s - sum);
    sum = s;
}
__device__ __forceinline__ void two_sum_add(float& sum, float x, float& err) {
    const float s = sum + x;
    const float bv = s - sum;
    err += (sum - (s - bv)) + (x - bv);
    sum = s;
}
