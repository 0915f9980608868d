// SIMT family, cp.async pipeline (sm80+): STAGES shared buffers filled by asynchronous copies
// straight from global memory, so STAGES-1 k-tiles are in flight while one is computed, and no
// registers are spent staging. Out-of-range vectors are zero-filled by the copy itself.
// Row-major A is transposed into the k-major shared layout with 4-byte copies (a 16-byte copy
// cannot transpose); they are 8 instructions per thread per k-tile against 1024 FFMA.
#include "simt_core.cuh"

#ifndef STAGES
#define STAGES 3
#endif
#ifndef A_MODE
#define A_MODE LOAD_ELEM_K
#endif
#ifndef B_MODE
#define B_MODE LOAD_VEC_FAST
#endif

#if __CUDA_ARCH__ >= 800
template <int MODE, int FT>
__device__ __forceinline__ void copy_tile_async(float* S, int stride, const TileCursor<MODE, FT>& cur,
                                                const float* base, int k0, int K) {
    typedef TileMap<MODE, FT> Map;
    static_assert(MODE != LOAD_VEC_K, "cp.async cannot transpose a 16-byte vector");
#pragma unroll
    for (int p = 0; p < Map::PER_THREAD; ++p) {
        const bool ok = cur.ok(p, k0, K);
        // An invalid copy reads nothing (src-size 0) but still gets a mapped address: the base.
        const float* src = ok ? cur.at(p, k0) : base;
        float* dst = &S[cur.k_of(p) * stride + cur.f_of(p)];
        if (Map::UNIT == 4) cp_async_16(dst, src, ok);
        else cp_async_4(dst, src, ok);
    }
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) fastmm_simt_cp_async(FASTMM_PARAMS) {
    FASTMM_UNPACK
#if __CUDA_ARCH__ >= 800
    extern __shared__ __align__(16) float smem[];
    float* As = smem;                             // STAGES x A_TILE_FLOATS
    float* Bs = smem + STAGES * A_TILE_FLOATS;    // STAGES x B_TILE_FLOATS
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    int kt_begin, kt_end;
    split_range(K, BK, kt_begin, kt_end);
    int am, bn;
    thread_origin(am, bn);

    for (int z = blockIdx.z; z < batch_total; z += gridDim.z) {
        FASTMM_BATCH_OFFSETS(z)
        for (int tile = blockIdx.x; tile < tiles_m * tiles_n; tile += gridDim.x) {
            int tm, tn;
            tile_coords<8>(tile, tiles_m, tiles_n, tm, tn);
            const int m0 = tm * BM, n0 = tn * BN;
            TileCursor<A_MODE, BM> ca;
            TileCursor<B_MODE, BN> cb;
            ca.init(Ab, M, sAm, sAk, m0);
            cb.init(Bb, N, sBn, sBk, n0);
            float acc[THREAD_M][THREAD_N];
            zero_tile(acc);

            // Prologue: STAGES-1 tiles in flight. Every thread commits a group per step, even an
            // empty one, so the wait counts below stay uniform.
#pragma unroll
            for (int s = 0; s < STAGES - 1; ++s) {
                if (kt_begin + s < kt_end) {
                    copy_tile_async(As + s * A_TILE_FLOATS, A_STRIDE, ca, Ab, (kt_begin + s) * BK, K);
                    copy_tile_async(Bs + s * B_TILE_FLOATS, B_STRIDE, cb, Bb, (kt_begin + s) * BK, K);
                }
                cp_async_commit();
            }
            // Stage of k-tile kt is (kt - kt_begin) % STAGES.
            for (int kt = kt_begin; kt < kt_end; ++kt) {
                cp_async_wait<STAGES - 2>();   // tile kt has landed (for this thread's copies)
                __syncthreads();               // ... and for everyone's; stage kt-1 is free again
                const int cur = (kt - kt_begin) % STAGES;
                const float* At = As + cur * A_TILE_FLOATS;
                const float* Bt = Bs + cur * B_TILE_FLOATS;
                // The first k-step goes before the copies for tile kt+STAGES-1, so their address
                // arithmetic overlaps FFMAs instead of stalling every warp right after the barrier.
                compute_steps<0, 1>(At, Bt, am, bn, acc);
                const int next = kt + STAGES - 1;
                if (next < kt_end) {
                    const int s = (next - kt_begin) % STAGES;
                    copy_tile_async(As + s * A_TILE_FLOATS, A_STRIDE, ca, Ab, next * BK, K);
                    copy_tile_async(Bs + s * B_TILE_FLOATS, B_STRIDE, cb, Bb, next * BK, K);
                }
                cp_async_commit();
                compute_steps<1, BK>(At, Bt, am, bn, acc);
            }
            cp_async_wait<0>();
            __syncthreads();  // all reads of shared memory done before the next tile's prologue
            store_tile(Cb, M, N, sCm, sCn, m0, n0, am, bn, acc);
        }
    }
#endif
}
