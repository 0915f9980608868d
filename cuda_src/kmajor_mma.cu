// kmajor_mma family: M <= 32 rows of A against a K-contiguous B (B = W^T, W stored [N, K] as
// nn.Linear keeps it: decode) on tensor cores, TF32 mma.sync (tf32, and tf32x3 with split
// operands). Like skinny_kmajor it streams W once along its rows; the difference is the math:
// skinny_kmajor's fp32 FFMAs read every A value from shared memory once per 2-4 W rows, which
// at M = 16 costs more than W's bytes (NOTES.md), while one m16n8k8 mma multiplies 16 W rows by
// 8 A rows from registers.
//
// - The product is computed as C^T = W A^T per fragment: W's rows take the mma's A role (16 rows
//   of W = 16 columns n of C per fragment), A's rows the B role (8 rows m per fragment, KM_MF
//   fragments). A decode row (M = 1) then wastes 7 of 8 rows of a fragment, not 15 of 16.
// - A k permutation makes every load a float4 along k: for a chunk of 32 k at kc, lane (g, t)
//   (g = lane / 4, t = lane % 4) loads k in [kc + 4t, kc + 4t + 4) ("lo") and
//   [kc + 16 + 4t, kc + 16 + 4t + 4) ("hi") of its rows, and mma step s (0..3) takes the
//   fragment's k index t from lo[s] and t + 4 from hi[s]. W and A use the same permutation, so
//   the sum over k is the same sum. One warp load then covers 64 contiguous bytes of each of 8
//   rows (two whole 32-byte sectors).
// - W rows: a warp owns 16 * KM_NF rows (columns n); lane g reads rows g and g + 8 of each
//   fragment. A rows (at most 32) are read by every warp straight from global memory (L1/L2:
//   A is small and shared by all blocks).
// - A block's KM_WARPS warps share its rows of W and deal out its K range in chunks of 32
//   (warp w takes chunks w, w + KM_WARPS, ...; KM_U chunks loaded ahead), so together they read
//   KM_WARPS * 128 contiguous bytes of each row. At the end the warps' sums are added in shared
//   memory in warp order (fixed: the same bits every run). (Warps owning rows of their own over
//   the whole K range, and 4 chunks ahead, measured no faster: benchmarks/NOTES.md run 19.)
// - tf32x3 promotes every mma step's big product into the running sum with Dekker's add (as
//   tf32_mma does): the tensor cores' own fp32 accumulation over a long K lost the accuracy the
//   split operands bought (1.2e-6 at K = 4096, 4.2e-6 at 14336 on the H200, against <= 1e-6).
// - K is split over blocks (gridDim.y slices of KM_KS) where the rows alone do not fill the
//   GPU; the last block of a column tile sums the slices in slice order (KM_FUSED, as
//   skinny_kmajor: split_arrive_last in common.cuh), no second launch.
#include "common.cuh"

#ifndef KM_MF
#define KM_MF 2  // B-role fragments: 8 rows of A each (M <= 8 * KM_MF)
#endif
#ifndef KM_NF
#define KM_NF 2  // A-role fragments per warp: 16 rows of W (columns n) each
#endif
#ifndef KM_U
#define KM_U 2  // chunks of 32 k loaded ahead of their mmas
#endif
#ifndef KM_WARPS
#define KM_WARPS 4
#endif
#ifndef KM_KS
#define KM_KS 1024  // k per block (the split unit); a multiple of 32
#endif
#ifndef B_VEC
#define B_VEC 1  // W rows read as float4 (K % 4 == 0, row stride % 4 == 0, 16-byte aligned)
#endif
#ifndef A_VEC
#define A_VEC 1  // A rows read as float4 along k (the same conditions on A, k stride 1)
#endif
#ifndef X3
#define X3 0  // tf32x3: each operand split into TF32 big + small parts, three mmas per product
#endif
#ifndef KM_FUSED
#define KM_FUSED 0
#endif
#ifndef KM_MINB
#define KM_MINB 4
#endif

#define KM_THREADS (KM_WARPS * 32)
#define KM_BN (16 * KM_NF)
#define KM_FRAGS (KM_NF * KM_MF)

static_assert(KM_KS % 32 == 0, "KM_KS must be a multiple of 32");

#if __CUDA_ARCH__ >= 800

#if KM_FUSED
#define KM_FUSED_PARAMS , float* __restrict__ Out, i64 sOm, i64 sOn, unsigned* __restrict__ arrivals
#else
#define KM_FUSED_PARAMS
#endif

// W is read once: past L1 (no allocation there), so A's rows stay in it.
__device__ __forceinline__ float4 km_ld_stream(const float* p) {
    float4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

// Four floats of a row at k .. k + 3 (stride sk between them); zeros past kend or for a row
// that is not there.
template <bool VEC, bool STREAM>
__device__ __forceinline__ float4 km_load4(const float* row, i64 sk, int k, int kend, bool ok) {
    if (VEC) {  // K % 4 == 0: the float4 is wholly inside [0, kend) or wholly outside
        if (!(ok && k < kend)) return make_float4(0.f, 0.f, 0.f, 0.f);
        return STREAM ? km_ld_stream(row + k) : __ldg((const float4*)(row + k));
    }
    float4 v;
    v.x = ok && k < kend ? __ldg(row + (i64)k * sk) : 0.f;
    v.y = ok && k + 1 < kend ? __ldg(row + (i64)(k + 1) * sk) : 0.f;
    v.z = ok && k + 2 < kend ? __ldg(row + (i64)(k + 2) * sk) : 0.f;
    v.w = ok && k + 3 < kend ? __ldg(row + (i64)(k + 3) * sk) : 0.f;
    return v;
}

__device__ __forceinline__ float km_at(const float4& v, int s) {
    return s == 0 ? v.x : s == 1 ? v.y : s == 2 ? v.z : v.w;
}

// TF32 big part of x, and (X3) the TF32 small part x - big.
__device__ __forceinline__ void km_split(float x, unsigned& big, unsigned& small) {
    big = to_tf32(x);
#if X3
    small = to_tf32(x - __uint_as_float(big));
#else
    small = 0u;
#endif
}

extern "C" __global__ void __launch_bounds__(KM_THREADS, KM_MINB) fastmm_kmajor_mma(FASTMM_PARAMS KM_FUSED_PARAMS FASTMM_EPILOGUE_PARAMS) {
    grid_dependency_sync();  // launched as a programmatic dependent launch on sm_90+ (ptx.cuh)
    FASTMM_UNPACK
    FASTMM_EPILOGUE
    const bool final_store = gridDim.y == 1;  // (a split's blocks store partial sums)
    __shared__ float red[KM_WARPS][KM_FRAGS * 4][32];  // each warp's sums, [warp][value][lane]
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;
    const int tile = blockIdx.x;
    const int kbeg = (int)blockIdx.y * KM_KS, kend = min(K, kbeg + KM_KS);
    const int n0 = tile * KM_BN;
    const int chunks = (kend - kbeg + 31) / 32;

    for (int z = blockIdx.z; z < batch_total; z += gridDim.z) {
        FASTMM_BATCH_OFFSETS(z)
        // this lane's rows: W rows n0 + 16 f + g + 8 h, A rows 8 j + g
        const float* wrow[KM_NF][2];
        bool wok[KM_NF][2];
#pragma unroll
        for (int f = 0; f < KM_NF; ++f)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int n = n0 + 16 * f + g + 8 * h;
                wok[f][h] = n < N;
                wrow[f][h] = Bb + (i64)(wok[f][h] ? n : 0) * sBn;
            }
        const float* arow[KM_MF];
        bool aok[KM_MF];
#pragma unroll
        for (int j = 0; j < KM_MF; ++j) {
            aok[j] = 8 * j + g < M;
            arow[j] = Ab + (i64)(aok[j] ? 8 * j + g : 0) * sAm;
        }
        float acc[KM_NF][KM_MF][4];
#if X3
        float acc_small[KM_NF][KM_MF][4];
#endif
#pragma unroll
        for (int f = 0; f < KM_NF; ++f)
#pragma unroll
            for (int j = 0; j < KM_MF; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    acc[f][j][c] = 0.f;
#if X3
                    acc_small[f][j][c] = 0.f;
#endif
                }

#pragma unroll 1
        for (int c0 = warp; c0 < chunks; c0 += KM_WARPS * KM_U) {
            float4 w[KM_U][KM_NF][2][2];  // [chunk][fragment][row g / g + 8][lo / hi]
            float4 a[KM_U][KM_MF][2];     // [chunk][fragment][lo / hi]
#pragma unroll
            for (int u = 0; u < KM_U; ++u) {
                const int chunk = c0 + u * KM_WARPS;
                const int k = kbeg + 32 * chunk + 4 * t;
                const bool in = chunk < chunks;
#pragma unroll
                for (int f = 0; f < KM_NF; ++f)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int q = 0; q < 2; ++q)
                            w[u][f][h][q] = km_load4<B_VEC, true>(wrow[f][h], sBk, k + 16 * q, kend, in && wok[f][h]);
#pragma unroll
                for (int j = 0; j < KM_MF; ++j)
#pragma unroll
                    for (int q = 0; q < 2; ++q)
                        a[u][j][q] = km_load4<A_VEC, false>(arow[j], sAk, k + 16 * q, kend, in && aok[j]);
            }
#pragma unroll
            for (int u = 0; u < KM_U; ++u)
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    unsigned b[KM_MF][2], bs[KM_MF][2];
#pragma unroll
                    for (int j = 0; j < KM_MF; ++j) {
                        km_split(km_at(a[u][j][0], s), b[j][0], bs[j][0]);
                        km_split(km_at(a[u][j][1], s), b[j][1], bs[j][1]);
                    }
#pragma unroll
                    for (int f = 0; f < KM_NF; ++f) {
                        unsigned x[4], xs[4];  // A-role fragment: (row g, k t), (g + 8, t), (g, t + 4), (g + 8, t + 4)
                        km_split(km_at(w[u][f][0][0], s), x[0], xs[0]);
                        km_split(km_at(w[u][f][1][0], s), x[1], xs[1]);
                        km_split(km_at(w[u][f][0][1], s), x[2], xs[2]);
                        km_split(km_at(w[u][f][1][1], s), x[3], xs[3]);
#pragma unroll
                        for (int j = 0; j < KM_MF; ++j) {
#if X3
                            mma_tf32_16x8x8(acc_small[f][j], xs, b[j]);
                            mma_tf32_16x8x8(acc_small[f][j], x, bs[j]);
                            float part[4] = {0.f, 0.f, 0.f, 0.f};
                            mma_tf32_16x8x8(part, x, b[j]);
#pragma unroll
                            for (int q = 0; q < 4; ++q) fast_two_sum_add(acc[f][j][q], part[q], acc_small[f][j][q]);
#else
                            mma_tf32_16x8x8(acc[f][j], x, b[j]);
#endif
                        }
                    }
                }
        }
        // --- the warps' sums, added in warp order ---
        __syncthreads();  // (the previous batch entry's reads of red are done)
#pragma unroll
        for (int f = 0; f < KM_NF; ++f)
#pragma unroll
            for (int j = 0; j < KM_MF; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c)
#if X3
                    red[warp][(f * KM_MF + j) * 4 + c][lane] = acc[f][j][c] + acc_small[f][j][c];
#else
                    red[warp][(f * KM_MF + j) * 4 + c][lane] = acc[f][j][c];
#endif
        __syncthreads();
        for (int o = threadIdx.x; o < KM_FRAGS * 4 * 32; o += KM_THREADS) {
            const int v = o / 32, l = o % 32;
            const int f = v / (4 * KM_MF), j = (v / 4) % KM_MF, c = v % 4;
            // C fragment (of C^T): row n = g + 8 (c / 2), column m = 2 t + c % 2
            const int n = n0 + 16 * f + l / 4 + 8 * (c / 2), m = 8 * j + 2 * (l % 4) + c % 2;
            if (m < M && n < N) {
                float sum = 0.f;
#pragma unroll
                for (int w = 0; w < KM_WARPS; ++w) sum += red[w][v][l];
                Cb[(i64)m * sCm + (i64)n * sCn] = final_store ? epi(sum, m, n) : sum;
            }
        }
#if KM_FUSED
        // (a split has a batch of 1: z == 0 here, and Cb is this block's workspace slice)
        if (split_arrive_last(arrivals + tile))
            split_sum_slices(C, sCm, sCn, sC0, Out, sOm, sOn, M, N, 8 * KM_MF, n0, KM_BN, epi, arrivals + tile);
#endif
    }
}

#endif  // __CUDA_ARCH__ >= 800
