// Skinny family: M <= 32 rows (decode-style GEMV-like products), memory-bound on reading B.
// The floor is reading B once, so every B element is loaded by exactly one thread, as part of a
// float4 (B_VEC) or four floats, coalesced across the warp: lane l of a warp owns columns
// n0 + 4l .. n0 + 4l + 3 and warp w handles the k's with k % 8 == w. A (tiny) is staged in
// shared memory one KCHUNK of k at a time and read as broadcasts. The 8 warps' partial sums are
// added in warp order through shared memory (deterministic), and with split-K (gridDim.y > 1)
// each block row writes its slice of the workspace for splitk_reduce.cu.
#include "common.cuh"

#ifndef MT
#define MT 16  // rows held per thread: M rounded up to 8, 16 or 32
#endif
#ifndef B_VEC
#define B_VEC 1
#endif
#define THREADS 256
#define WARPS 8
#define COLS 128     // 32 lanes x 4 columns
#define KCHUNK (MT == 32 ? 128 : 256)  // k values of A staged per round (static smem < 48 KiB)
#define A_LD (MT + 1)  // pad: the staging writes walk k, which would otherwise hit one bank

// One block per SM: capping registers at 128 for two blocks (MT <= 16) spilled and measured
// slower on the H200 (decode16: 9.4 -> 6.0 TFLOP/s, benchmarks/NOTES.md).
extern "C" __global__ void __launch_bounds__(THREADS, 1) fastmm_skinny(FASTMM_PARAMS) {
    FASTMM_UNPACK
    __shared__ float As[KCHUNK * A_LD];
    __shared__ float red[MT * COLS];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int kc_begin, kc_end;
    split_range(K, KCHUNK, kc_begin, kc_end);
    const int tiles_n = (N + COLS - 1) / COLS;

    for (int z = blockIdx.z; z < batch_total; z += gridDim.z) {
        FASTMM_BATCH_OFFSETS(z)
        for (int tile = blockIdx.x; tile < tiles_n; tile += gridDim.x) {
            const int n = tile * COLS + lane * 4;
            float acc[MT][4];
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[m][j] = 0.f;

            for (int kc = kc_begin; kc < kc_end; ++kc) {
                const int k0 = kc * KCHUNK;
                __syncthreads();  // the previous chunk's reads of As are done
                for (int i = threadIdx.x; i < KCHUNK * MT; i += THREADS) {
                    const int k = i % KCHUNK, m = i / KCHUNK;  // k fastest: coalesced for row-major A
                    As[k * A_LD + m] = (m < M && k0 + k < K) ? Ab[(i64)m * sAm + (i64)(k0 + k) * sAk] : 0.f;
                }
                __syncthreads();
#pragma unroll 8
                for (int kk = warp; kk < KCHUNK; kk += WARPS) {
                    const int k = k0 + kk;
                    float b[4];
                    const float* row = Bb + (i64)k * sBk;
#if B_VEC
                    // N % 4 == 0 and aligned: the float4 is wholly inside or outside
                    const float4 v = (k < K && n < N) ? *(const float4*)(row + n) : make_float4(0.f, 0.f, 0.f, 0.f);
                    b[0] = v.x; b[1] = v.y; b[2] = v.z; b[3] = v.w;
#else
#pragma unroll
                    for (int j = 0; j < 4; ++j) b[j] = (k < K && n + j < N) ? row[(i64)(n + j) * sBn] : 0.f;
#endif
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        const float a = As[kk * A_LD + m];
#pragma unroll
                        for (int j = 0; j < 4; ++j) acc[m][j] = fmaf(a, b[j], acc[m][j]);
                    }
                }
            }
            // Sum the warps' partials in warp order (same bits every run).
            for (int w = 0; w < WARPS; ++w) {
                __syncthreads();
                if (warp == w) {
#pragma unroll
                    for (int m = 0; m < MT; ++m)
#pragma unroll
                        for (int j = 0; j < 4; ++j)
                            red[m * COLS + lane * 4 + j] = (w == 0 ? 0.f : red[m * COLS + lane * 4 + j]) + acc[m][j];
                }
            }
            __syncthreads();
            for (int i = threadIdx.x; i < MT * COLS; i += THREADS) {
                const int m = i / COLS, c = tile * COLS + i % COLS;
                if (m < M && c < N) Cb[(i64)m * sCm + (i64)c * sCn] = red[i];
            }
        }
    }
}
