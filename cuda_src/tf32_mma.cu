// Tensor-core family (sm80+): mma.sync m16n8k8 with TF32 inputs and fp32 accumulators, fed by a
// cp.async multi-stage pipeline.
//
// PRECISION_X3 = 0: "tf32" - each input rounded once to TF32 with cvt.rna (never truncated).
// PRECISION_X3 = 1: "tf32x3" - x = big + small, big = tf32(x), small = tf32(x - big); the two
//   cross products go to their own accumulator, added to the big one only at the end, so the
//   small terms are not lost against the large running sum (DESIGN.md: the Triton bug).
//   The big*big products are also taken out of the tensor core after every k-step and added in
//   fp32 registers: the tensor core's own fp32 accumulation is not round-to-nearest (it drifts by
//   about 2^-23 per step, always the same way), which measured 1.4e-5 relative error at K=6144
//   when left in the tensor core - worse than plain fp32 FFMA.
//
// Each operand keeps the layout it has in global memory: As[m][k] when A is k-contiguous
// (row-major) else As[k][m]; Bs[k][n] when B is n-contiguous else Bs[n][k]. The row pads
// (4 floats on 32-wide rows, 8 on 64/128-wide rows) make every fragment read below hit 32
// distinct banks. A_VEC / B_VEC: 16-byte copies (contiguous, aligned); else 4-byte copies,
// which also serve operands with no unit stride at all.
#include "common.cuh"

#ifndef WARPS_M
#define WARPS_M 2
#endif
#ifndef WARPS_N
#define WARPS_N 4
#endif
#ifndef WARP_N
#define WARP_N 32
#endif
#ifndef STAGES
#define STAGES 3
#endif
#ifndef PRECISION_X3
#define PRECISION_X3 0
#endif
#ifndef PROMOTE
#define PROMOTE PRECISION_X3  // add each k-step's big products into fp32 registers (see above)
#endif
#define WARP_M 64
#define BK 32
#define MI (WARP_M / 16)
#define NI (WARP_N / 8)
#define THREADS (WARPS_M * WARPS_N * 32)
#define BM (WARPS_M * WARP_M)
#define BN (WARPS_N * WARP_N)

// Shared tile shapes: rows x (row length + pad).
#if A_SMEM_MK
#define A_ROWS BM
#define A_COLS BK
#define A_LD (BK + 4)
#else
#define A_ROWS BK
#define A_COLS BM
#define A_LD (BM + 8)
#endif
#if B_SMEM_KN
#define B_ROWS BK
#define B_COLS BN
#define B_LD (BN + 8)
#else
#define B_ROWS BN
#define B_COLS BK
#define B_LD (BK + 4)
#endif
#define A_TILE_FLOATS (A_ROWS * A_LD)
#define B_TILE_FLOATS (B_ROWS * B_LD)

#if __CUDA_ARCH__ >= 800
// Copy a ROWS x COLS tile (COLS contiguous in shared memory) starting at (r0, c0). Element
// (r, c) of the operand is at base + r * s_row + c * s_col, and exists while r < R, c < Cn.
template <int ROWS, int COLS, int LD, bool VEC>
__device__ __forceinline__ void copy_tile(float* S, const float* base, int R, int Cn, i64 s_row,
                                          i64 s_col, int r0, int c0) {
    constexpr int W = VEC ? 4 : 1;
    constexpr int ROW_UNITS = COLS / W;
    constexpr int TPR = ROW_UNITS < THREADS ? ROW_UNITS : THREADS;  // threads across one row
    constexpr int CPT = ROW_UNITS / TPR;                            // units per thread per row
    constexpr int DR = THREADS / TPR;                               // rows per pass of the block
    static_assert(ROW_UNITS % TPR == 0 && THREADS % TPR == 0 && ROWS % DR == 0, "tile must split evenly");
    // Thread's units: (r_t + p * DR, c_t + j * TPR * W); written without dividing a unit index so
    // the address is one pointer stepped by loop-invariant strides.
    const int r_t = threadIdx.x / TPR, c_t = (threadIdx.x % TPR) * W;
    const float* first = base + (i64)(r0 + r_t) * s_row + (i64)(c0 + c_t) * s_col;
    const i64 step = (i64)DR * s_row;
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
        const bool c_ok = c0 + c_t + j * TPR * W < Cn;
        const float* col = first + (i64)(j * TPR * W) * s_col;
#pragma unroll
        for (int p = 0; p < ROWS / DR; ++p) {
            const bool ok = c_ok && r0 + r_t + p * DR < R;
            const float* src = ok ? col + p * step : base;  // invalid: reads nothing, mapped address
            float* dst = &S[(r_t + p * DR) * LD + c_t + j * TPR * W];
            if (VEC) cp_async_16(dst, src, ok);
            else cp_async_4(dst, src, ok);
        }
    }
}

__device__ __forceinline__ void load_tiles(float* As, float* Bs, const float* Ab, const float* Bb,
                                           int M, int N, int K, i64 sAm, i64 sAk, i64 sBk, i64 sBn,
                                           int m0, int n0, int k0) {
#if A_SMEM_MK
    copy_tile<A_ROWS, A_COLS, A_LD, A_VEC>(As, Ab, M, K, sAm, sAk, m0, k0);
#else
    copy_tile<A_ROWS, A_COLS, A_LD, A_VEC>(As, Ab, K, M, sAk, sAm, k0, m0);
#endif
#if B_SMEM_KN
    copy_tile<B_ROWS, B_COLS, B_LD, B_VEC>(Bs, Bb, K, N, sBk, sBn, k0, n0);
#else
    copy_tile<B_ROWS, B_COLS, B_LD, B_VEC>(Bs, Bb, N, K, sBn, sBk, n0, k0);
#endif
}

__device__ __forceinline__ float a_at(const float* As, int m, int k) {
#if A_SMEM_MK
    return As[m * A_LD + k];
#else
    return As[k * A_LD + m];
#endif
}
__device__ __forceinline__ float b_at(const float* Bs, int k, int n) {
#if B_SMEM_KN
    return Bs[k * B_LD + n];
#else
    return Bs[n * B_LD + k];
#endif
}

// Split x into its TF32 part and the TF32 rounding of the remainder. For +-Inf the remainder is
// Inf - Inf = NaN; harmless, because every output such an input reaches has a non-finite big sum,
// and the epilogue then returns the big sum alone (as fp32 would: +-Inf, or NaN for Inf * 0).
__device__ __forceinline__ void split_tf32(float x, unsigned& big, unsigned& small) {
    big = to_tf32(x);
    small = to_tf32(x - __uint_as_float(big));
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS) fastmm_tf32_mma(FASTMM_PARAMS) {
    FASTMM_UNPACK
#if __CUDA_ARCH__ >= 800
    extern __shared__ __align__(16) float smem[];
    float* As = smem;
    float* Bs = smem + STAGES * A_TILE_FLOATS;
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    int kt_begin, kt_end;
    split_range(K, BK, kt_begin, kt_end);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // the mma fragment coordinates of this lane
    const int wm = (warp / WARPS_N) * WARP_M, wn = (warp % WARPS_N) * WARP_N;

    for (int z = blockIdx.z; z < batch_total; z += gridDim.z) {
        FASTMM_BATCH_OFFSETS(z)
        for (int tile = blockIdx.x; tile < tiles_m * tiles_n; tile += gridDim.x) {
            int tm, tn;
            tile_coords<8>(tile, tiles_m, tiles_n, tm, tn);
            const int m0 = tm * BM, n0 = tn * BN;
            float acc[MI][NI][4];
#if PRECISION_X3
            float acc_small[MI][NI][4];
#endif
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int j = 0; j < NI; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        acc[i][j][q] = 0.f;
#if PRECISION_X3
                        acc_small[i][j][q] = 0.f;
#endif
                    }

#pragma unroll
            for (int s = 0; s < STAGES - 1; ++s) {
                if (kt_begin + s < kt_end)
                    load_tiles(As + s * A_TILE_FLOATS, Bs + s * B_TILE_FLOATS, Ab, Bb, M, N, K,
                               sAm, sAk, sBk, sBn, m0, n0, (kt_begin + s) * BK);
                cp_async_commit();
            }
            // Stage of k-tile kt is (kt - kt_begin) % STAGES.
            for (int kt = kt_begin; kt < kt_end; ++kt) {
                cp_async_wait<STAGES - 2>();
                __syncthreads();
                const int cur = (kt - kt_begin) % STAGES;
                const float* At = As + cur * A_TILE_FLOATS;
                const float* Bt = Bs + cur * B_TILE_FLOATS;
#pragma unroll
                for (int kk = 0; kk < BK; kk += 8) {
                    if (kk == 8) {  // copies for a later tile, issued between k-steps (see simt_cp_async.cu)
                        const int next = kt + STAGES - 1;
                        if (next < kt_end) {
                            const int s = (next - kt_begin) % STAGES;
                            load_tiles(As + s * A_TILE_FLOATS, Bs + s * B_TILE_FLOATS, Ab, Bb, M, N, K,
                                       sAm, sAk, sBk, sBn, m0, n0, next * BK);
                        }
                        cp_async_commit();
                    }
                    unsigned a[MI][4], b[NI][2];
#if PRECISION_X3
                    unsigned as[MI][4], bs[NI][2];
#endif
#pragma unroll
                    for (int i = 0; i < MI; ++i) {
                        const int m = wm + i * 16 + g;
                        const float v[4] = {a_at(At, m, kk + t), a_at(At, m + 8, kk + t),
                                            a_at(At, m, kk + t + 4), a_at(At, m + 8, kk + t + 4)};
#pragma unroll
                        for (int q = 0; q < 4; ++q) {
#if PRECISION_X3
                            split_tf32(v[q], a[i][q], as[i][q]);
#else
                            a[i][q] = to_tf32(v[q]);
#endif
                        }
                    }
#pragma unroll
                    for (int j = 0; j < NI; ++j) {
                        const int n = wn + j * 8 + g;
                        const float v[2] = {b_at(Bt, kk + t, n), b_at(Bt, kk + t + 4, n)};
#pragma unroll
                        for (int q = 0; q < 2; ++q) {
#if PRECISION_X3
                            split_tf32(v[q], b[j][q], bs[j][q]);
#else
                            b[j][q] = to_tf32(v[q]);
#endif
                        }
                    }
#pragma unroll
                    for (int i = 0; i < MI; ++i)
#pragma unroll
                        for (int j = 0; j < NI; ++j) {
#if PRECISION_X3
                            mma_tf32_16x8x8(acc_small[i][j], as[i], b[j]);
                            mma_tf32_16x8x8(acc_small[i][j], a[i], bs[j]);
#endif
#if PROMOTE
                            float part[4] = {0.f, 0.f, 0.f, 0.f};
                            mma_tf32_16x8x8(part, a[i], b[j]);
#pragma unroll
                            for (int q = 0; q < 4; ++q) {
#if PRECISION_X3
                                two_sum_add(acc[i][j][q], part[q], acc_small[i][j][q]);
#else
                                acc[i][j][q] += part[q];
#endif
                            }
#else
                            mma_tf32_16x8x8(acc[i][j], a[i], b[j]);
#endif
                        }
                }
            }
            cp_async_wait<0>();
            __syncthreads();

            // Epilogue: lane holds (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1) of each 16x8 piece.
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int j = 0; j < NI; ++j)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int m = m0 + wm + i * 16 + g + h * 8;
                        const int n = n0 + wn + j * 8 + 2 * t;
                        if (m >= M) continue;
#if PRECISION_X3
                        // Where the big products already overflowed or met Inf/NaN, that is the
                        // fp32 answer; the cross terms (Inf * 0 = NaN there) must not change it.
                        const float b0 = acc[i][j][2 * h], b1 = acc[i][j][2 * h + 1];
                        const float c0 = isfinite(b0) ? b0 + acc_small[i][j][2 * h] : b0;
                        const float c1 = isfinite(b1) ? b1 + acc_small[i][j][2 * h + 1] : b1;
#else
                        const float c0 = acc[i][j][2 * h], c1 = acc[i][j][2 * h + 1];
#endif
#if C_VEC
                        // C rows contiguous, N even, 8-byte aligned: the pair is in or out whole.
                        if (n < N) *(float2*)&Cb[(i64)m * sCm + n] = make_float2(c0, c1);
#else
                        if (n < N) Cb[(i64)m * sCm + (i64)n * sCn] = c0;
                        if (n + 1 < N) Cb[(i64)m * sCm + (i64)(n + 1) * sCn] = c1;
#endif
                    }
        }
    }
#endif
}
