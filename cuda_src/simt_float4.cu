// SIMT family, register-staged: global -> registers (float4 where the layout allows) -> shared,
// double-buffered shared tiles, one barrier per k-tile. Runs on every supported arch (the path
// for cards without cp.async); the next tile's global loads are in flight during the FFMA loop.
#include "simt_core.cuh"

#ifndef A_MODE
#define A_MODE LOAD_VEC_K
#endif
#ifndef B_MODE
#define B_MODE LOAD_VEC_FAST
#endif

// A k-tile of one operand, held in registers between its global load and its shared store.
template <int MODE, int FT>
struct StagedTile {
    typedef TileMap<MODE, FT> Map;
    TileCursor<MODE, FT> cur;
    float r[Map::PER_THREAD * Map::UNIT];

    __device__ __forceinline__ void load(int k0, int K) {
#pragma unroll
        for (int p = 0; p < Map::PER_THREAD; ++p) {
            const bool ok = cur.ok(p, k0, K);
            if (Map::UNIT == 4) {
                float4 v = ok ? *(const float4*)cur.at(p, k0) : make_float4(0.f, 0.f, 0.f, 0.f);
                r[4 * p] = v.x; r[4 * p + 1] = v.y; r[4 * p + 2] = v.z; r[4 * p + 3] = v.w;
            } else {
                r[p] = ok ? *cur.at(p, k0) : 0.f;
            }
        }
    }

    __device__ __forceinline__ void store(float* S, int stride) const {
#pragma unroll
        for (int p = 0; p < Map::PER_THREAD; ++p) {
            const int k = cur.k_of(p), f = cur.f_of(p);
            if (MODE == LOAD_VEC_FAST) {
                *(float4*)&S[k * stride + f] = make_float4(r[4 * p], r[4 * p + 1], r[4 * p + 2], r[4 * p + 3]);
            } else if (MODE == LOAD_VEC_K) {
#pragma unroll
                for (int j = 0; j < 4; ++j) S[(k + j) * stride + f] = r[4 * p + j];
            } else {
                S[k * stride + f] = r[p];
            }
        }
    }
};

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) fastmm_simt_float4(FASTMM_PARAMS FASTMM_EPILOGUE_PARAMS) {
    FASTMM_UNPACK
    FASTMM_EPILOGUE
    __shared__ __align__(16) float As[2][A_TILE_FLOATS];
    __shared__ __align__(16) float Bs[2][B_TILE_FLOATS];
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    const int k_tiles = (K + BK - 1) / BK;
    int am, bn;
    thread_origin(am, bn);

    for (int z = blockIdx.z; z < batch_total; z += gridDim.z) {
        FASTMM_BATCH_OFFSETS(z)
        for (int tile = blockIdx.x; tile < tiles_m * tiles_n; tile += gridDim.x) {
            int tm, tn;
            tile_coords<8>(tile, tiles_m, tiles_n, tm, tn);
            const int m0 = tm * BM, n0 = tn * BN;
            float acc[THREAD_M][THREAD_N];
            zero_tile(acc);

            StagedTile<A_MODE, BM> a;
            StagedTile<B_MODE, BN> b;
            a.cur.init(Ab, M, sAm, sAk, m0);
            b.cur.init(Bb, N, sBn, sBk, n0);
            if (k_tiles > 0) {
                a.load(0, K);
                b.load(0, K);
                a.store(As[0], A_STRIDE);
                b.store(Bs[0], B_STRIDE);
            }
            __syncthreads();
            for (int kt = 0; kt < k_tiles; ++kt) {
                const int cur = kt & 1;
                const bool more = kt + 1 < k_tiles;
                if (more) {  // issue the next tile's loads before the math that hides them
                    a.load((kt + 1) * BK, K);
                    b.load((kt + 1) * BK, K);
                }
                compute_tile(As[cur], Bs[cur], am, bn, acc);
                if (more) {
                    a.store(As[cur ^ 1], A_STRIDE);
                    b.store(Bs[cur ^ 1], B_STRIDE);
                }
                __syncthreads();
            }
            store_tile(Cb, M, N, sCm, sCn, m0, n0, am, bn, acc, epi);
        }
    }
}
