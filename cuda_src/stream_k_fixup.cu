// Second pass of a stream-K plan (fastmm_simt_cp_async_stream_k in simt_cp_async.cu): each tile
// after the first whole_tiles was computed in pieces by consecutive stream-K blocks, every piece
// in its own dense bm x bn workspace slot. This sums a tile's pieces in block order, so the
// result is the same bits on every run (no atomics), and writes the tile into C, skipping rows
// and columns outside C, through the plan's fused epilogue (EPILOGUE = 1).
// Grid: (ceil(bm * bn / 4 / 256), tiles after whole_tiles); a thread
// owns 4 consecutive elements of a tile row (bn % 4 == 0: one 16-byte load per piece).
#include "common.cuh"

#define THREADS 256
#define IN_FLIGHT 8  // pieces a thread loads before adding them (a tile may have many, all in L2)

__device__ __forceinline__ void add4(float4& s, const float4& v) {
    s.x += v.x;
    s.y += v.y;
    s.z += v.z;
    s.w += v.w;
}

// sm_80: left to itself ptxas (NVRTC 13.5) fits this kernel in 32 registers and spills 4 bytes;
// told 4 blocks an SM (64 registers) it spills none. Elsewhere the bound is left as measured.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 800
#define FIXUP_BOUNDS __launch_bounds__(THREADS, 4)
#else
#define FIXUP_BOUNDS __launch_bounds__(THREADS)
#endif

extern "C" __global__ void FIXUP_BOUNDS fastmm_stream_k_fixup(
    const float* __restrict__ W, float* __restrict__ C, i64 M_, i64 N_, i64 sCm, i64 sCn, i64 bm_, i64 bn_,
    i64 k_tiles, i64 whole_tiles, i64 iters FASTMM_EPILOGUE_PARAMS) {
    FASTMM_EPILOGUE
    // The slot offsets of this tile's pieces, shared by the block (divisions done once per piece,
    // not per element); up to THREADS pieces at a time.
    __shared__ i64 piece_at[THREADS];
    const int M = (int)M_, N = (int)N_, bm = (int)bm_, bn = (int)bn_;
    const int e = 4 * (blockIdx.x * THREADS + threadIdx.x);  // first element, row-major in the tile
    const int t = blockIdx.y;  // counted from whole_tiles, as the stream-K blocks count
    // The tile's k-tiles are [t * k_tiles, (t + 1) * k_tiles) of the stream-K sequence; block c
    // holds [c * iters, (c + 1) * iters), and the tile is piece t - (c * iters) / k_tiles of it.
    // 32-bit: the planner keeps the sequence (blocks x iters) below 2^31, as the GEMM counts.
    const int kt = (int)k_tiles, it = (int)iters;
    const int segs = (int)stream_k_segments(iters, k_tiles);
    const int c_first = t * kt / it, c_last = (t * kt + kt - 1) / it;
    const bool mine = e < bm * bn;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int c0 = c_first; c0 <= c_last; c0 += THREADS) {
        const int n = min(THREADS, c_last - c0 + 1);
        __syncthreads();  // the previous group's offsets are read
        if ((int)threadIdx.x < n) {
            const int c = c0 + threadIdx.x;
            piece_at[threadIdx.x] = (i64)(c * segs + t - c * it / kt) * ((i64)bm * bn);
        }
        __syncthreads();
        if (!mine) continue;
        int u = 0;
        for (; u + IN_FLIGHT <= n; u += IN_FLIGHT) {
            float4 v[IN_FLIGHT];
#pragma unroll
            for (int q = 0; q < IN_FLIGHT; ++q) v[q] = ld_l2_v4(W + piece_at[u + q] + e);
#pragma unroll
            for (int q = 0; q < IN_FLIGHT; ++q) add4(sum, v[q]);
        }
        for (; u < n; ++u) add4(sum, ld_l2_v4(W + piece_at[u] + e));
    }
    if (!mine) return;
    int tm, tn;
    tile_coords<8>((int)whole_tiles + t, (M + bm - 1) / bm, (N + bn - 1) / bn, tm, tn);
    const int m = tm * bm + e / bn, n = tn * bn + e % bn;
    if (m >= M) return;
    float* c = C + (i64)m * sCm + (i64)n * sCn;
    if (n < N) c[0] = epi(sum.x, m, n);
    if (n + 1 < N) c[sCn] = epi(sum.y, m, n + 1);
    if (n + 2 < N) c[2 * sCn] = epi(sum.z, m, n + 2);
    if (n + 3 < N) c[3 * sCn] = epi(sum.w, m, n + 3);
}
