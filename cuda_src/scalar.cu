// Scalar fallback: correct for every shape, stride (including 0 and negative-free arbitrary
// strides), storage offset and pointer alignment. 16x16 shared tiles, one output per thread,
// plain fp32 FMA. Used only when no tiled family can take the problem.
#include "common.cuh"

#define TILE 16

extern "C" __global__ void __launch_bounds__(TILE * TILE) fastmm_scalar(FASTMM_PARAMS FASTMM_EPILOGUE_PARAMS) {
    FASTMM_UNPACK
    FASTMM_EPILOGUE
    __shared__ float As[TILE][TILE + 1];
    __shared__ float Bs[TILE][TILE + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int tiles_n = (N + TILE - 1) / TILE;
    const int tiles_m = (M + TILE - 1) / TILE;
    const i64 tiles = (i64)tiles_m * tiles_n;
    for (int z = blockIdx.z; z < batch_total; z += gridDim.z) {
        FASTMM_BATCH_OFFSETS(z)
        for (i64 t = blockIdx.x; t < tiles; t += gridDim.x) {
            const int m = (int)(t / tiles_n) * TILE + ty;
            const int n = (int)(t % tiles_n) * TILE + tx;
            float acc = 0.f;
            for (int k0 = 0; k0 < K; k0 += TILE) {
                // Loads are guarded; out-of-range elements become zeros.
                const int ka = k0 + tx, kb = k0 + ty;
                As[ty][tx] = (m < M && ka < K) ? Ab[(i64)m * sAm + (i64)ka * sAk] : 0.f;
                Bs[ty][tx] = (kb < K && n < N) ? Bb[(i64)kb * sBk + (i64)n * sBn] : 0.f;
                __syncthreads();
#pragma unroll
                for (int k = 0; k < TILE; ++k) acc = fmaf(As[ty][k], Bs[k][tx], acc);
                __syncthreads();
            }
            if (m < M && n < N) Cb[(i64)m * sCm + (i64)n * sCn] = epi(acc, m, n);
        }
    }
}
