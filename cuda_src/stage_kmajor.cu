// Staging pass of the TMA family: copy one operand into a dense K-major buffer that a tensor map
// can describe,
//     dst[r * ld + k] = src[r * sR + k * sK]        for r < R, k < K
// (R = M for A; R = N for B, whose K-major form is B transposed). The row pitch ld is K rounded
// up to 4 floats (16 bytes, a tensor map's stride unit); the pad is written with zeros and never
// read. Batches: matrix z (z0 = z / batch_inner, z1 = z % batch_inner) of the source starts at
// z0 * s0 + z1 * s1 and goes to dst + z * R * ld (the host passes only the batch dims the operand
// really has, so a broadcast operand is copied once).
//
// SPLIT = 1 (tf32x3): dst gets big = tf32(x) and dst2 small = tf32(x - big), both rounded to
// nearest (cvt.rna), so the GEMM reads ready-made TF32 halves. For +-Inf and NaN small is 0: the
// big part alone then carries the fp32 answer.
//
// Blocks of 256 threads copy 64 x 64 tiles, writing float4 along k. SRC_R_CONTIG = 1 (source
// contiguous along r, e.g. B row-major): the tile goes through shared memory, read along r and
// written along k, so both sides are coalesced. Otherwise the source is read along k directly.
// SRC_VEC = 1: the source's contiguous dim is read as float4 (the host checked the alignment).
#include "common.cuh"

#ifndef SRC_R_CONTIG
#define SRC_R_CONTIG 0
#endif
#ifndef SRC_VEC
#define SRC_VEC 0
#endif
#ifndef SPLIT
#define SPLIT 0
#endif
#define TILE 64

__device__ __forceinline__ void put4(float* dst, float* dst2, i64 at, const float v[4]) {
#if SPLIT
    float big[4], small[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) tf32_halves(v[i], big[i], small[i]);
    *(float4*)(dst + at) = make_float4(big[0], big[1], big[2], big[3]);
    *(float4*)(dst2 + at) = make_float4(small[0], small[1], small[2], small[3]);
#else
    *(float4*)(dst + at) = make_float4(v[0], v[1], v[2], v[3]);
#endif
}

// Four consecutive elements along the contiguous dim of the source (zeros out of range).
__device__ __forceinline__ void get4(const float* src, i64 at, i64 stride, int left, float v[4]) {
#if SRC_VEC
    if (left >= 4) {
        const float4 x = *(const float4*)(src + at);
        v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
        return;
    }
#endif
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = i < left ? src[at + i * stride] : 0.f;
}

// One 64 x 64 tile (rows r0.., k0..) of one matrix.
__device__ __forceinline__ void stage_tile(const float* __restrict__ src, float* __restrict__ dst,
                                           float* __restrict__ dst2, int R, int K, i64 sR, i64 sK, i64 ld,
                                           int r0, int k0) {
    const int q = (threadIdx.x % 16) * 4, row = threadIdx.x / 16;  // 16 threads x 4 floats = 64
#if SRC_R_CONTIG
    __shared__ float tile[TILE][TILE + 1];  // [k][r], padded: column reads hit distinct banks
    __syncthreads();  // the previous matrix's reads of the tile are done
#pragma unroll
    for (int p = 0; p < TILE / 16; ++p) {
        const int k = k0 + row + 16 * p, r = r0 + q;
        float v[4];
        get4(src, (i64)k * sK + (i64)r * sR, sR, k < K ? R - r : 0, v);
#pragma unroll
        for (int i = 0; i < 4; ++i) tile[row + 16 * p][q + i] = v[i];
    }
    __syncthreads();
#pragma unroll
    for (int p = 0; p < TILE / 16; ++p) {
        const int r = r0 + row + 16 * p, k = k0 + q;
        if (r < R && k < ld) {
            const float v[4] = {tile[q][row + 16 * p], tile[q + 1][row + 16 * p], tile[q + 2][row + 16 * p],
                                tile[q + 3][row + 16 * p]};
            put4(dst, dst2, (i64)r * ld + k, v);
        }
    }
#else
#pragma unroll
    for (int p = 0; p < TILE / 16; ++p) {
        const int r = r0 + row + 16 * p, k = k0 + q;
        if (r < R && k < ld) {
            float v[4];
            get4(src, (i64)r * sR + (i64)k * sK, sK, K - k, v);
            put4(dst, dst2, (i64)r * ld + k, v);
        }
    }
#endif
}

extern "C" __global__ void __launch_bounds__(256) fastmm_stage_kmajor(
    const float* __restrict__ src, float* __restrict__ dst, float* __restrict__ dst2,
    i64 R_, i64 K_, i64 sR, i64 sK, i64 ld, i64 batch_inner, i64 batch_total, i64 s0, i64 s1) {
    const int R = (int)R_, K = (int)K_;
    // 32-bit batch index (the planner keeps every size below 2^31): with a 64-bit one, z / inner
    // and z % inner were a call to the 64-bit division routine, around which ptxas kept values on
    // the stack (16-byte frame, 12 bytes spilled with SPLIT and single-float reads; issue 16).
    const int inner = (int)batch_inner, total = (int)batch_total;
    const int tiles_k = (K + TILE - 1) / TILE;
    const int r0 = (int)(blockIdx.x / tiles_k) * TILE, k0 = (int)(blockIdx.x % tiles_k) * TILE;
    for (int z = blockIdx.z; z < total; z += gridDim.z)
        stage_tile(src + (i64)(z / inner) * s0 + (i64)(z % inner) * s1, dst + (i64)z * R_ * ld,
                   dst2 + (i64)z * R_ * ld, R, K, sR, sK, ld, r0, k0);
}
