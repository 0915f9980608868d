// skinny_kmajor family: M <= 32 rows of A against a B that is K-contiguous (B = W^T with W
// stored [N, K], as nn.Linear keeps its weight: the decode GEMV). Memory-bound on reading W
// once, so W is read along its rows, where its bytes are contiguous:
//
// - A warp owns 4 * KR_R rows of W at a time. Lane (rs = lane / 8, kq = lane % 8) reads rows
//   rs, rs + 4, ... and the float4 at k = 32 * step + 4 * kq: one load instruction of the warp
//   covers 128 contiguous bytes (a whole cache line) of each of 4 rows.
// - A's slice of the block's K range is staged in shared memory once (cp.async, zero-filled past
//   M and K; waited for behind the first W loads) and read as float4 at the same k: the 4 row groups of a warp read the same 8
//   addresses, one conflict-free wavefront per m, reused for KR_R rows.
// - A block owns BN = KR_G * KR_WARPS * 4 * KR_R rows of W (KR_G groups per warp, one after the
//   other, each reusing the staged A) and one slice of K (gridDim.y slices of KR_KS, at most).
//   With more than one slice, each block stores its partial C in its workspace slice and, as
//   the skinny family does, the last block of a tile to arrive sums the slices in slice order
//   (KR_FUSED: split_arrive_last, common.cuh): no second launch.
// - At the end of a group the 8 kq lanes' partial sums are added by a halving exchange (each
//   shuffle step sends half of the remaining sums), the same fixed tree every run.
// - KR_KW > 1 splits the block's K range over its warps instead: KR_KW warps share each row
//   group, each taking a run of whole U-step groups, and their sums meet in shared memory, added
//   in warp order (a fixed order). That gives a GEMV of few rows its blocks without a split over
//   blocks, whose arrival and last-block sum cost a few us at the end of a ~20 us kernel.
#include "common.cuh"

#ifndef MT
#define MT 4  // A rows held per thread: M rounded up to 1, 2, 4, 8, 16 or 32
#endif
#ifndef KR_R
#define KR_R 4  // rows of W per lane group, each a KR_R-way reuse of every A value read
#endif
#ifndef KR_U
#define KR_U 4  // k steps (32 k each) loaded ahead of their FMAs
#endif
#ifndef KR_WARPS
#define KR_WARPS 8
#endif
#ifndef KR_G
#define KR_G 1  // row groups per warp
#endif
#ifndef KR_KW
#define KR_KW 1  // warps sharing a row group, each a part of the block's K range
#endif
#ifndef KR_KS
#define KR_KS 1024  // k per block (the split unit); a multiple of 32 * KR_U
#endif
#ifndef B_VEC
#define B_VEC 1  // W rows read as float4 (K % 4 == 0, row stride % 4 == 0, 16-byte aligned)
#endif
#ifndef A_VEC
#define A_VEC 0  // A staged with 16-byte copies along k (same conditions on A)
#endif
#ifndef KR_FUSED
#define KR_FUSED 0
#endif
#ifndef KR_MINB
#define KR_MINB 2
#endif

#define KR_THREADS (KR_WARPS * 32)
#define KR_ROWS_PER_WARP (4 * KR_R)
#define KR_ROW_WARPS (KR_WARPS / KR_KW)  // warps along N
#define KR_GROUP_ROWS (KR_ROW_WARPS * KR_ROWS_PER_WARP)
#define KR_BN (KR_G * KR_GROUP_ROWS)
#define KR_V (MT * KR_R)  // partial sums per lane: acc[m * KR_R + r]
#define KR_STEPS (KR_KS / 32)

static_assert(KR_KS % (32 * KR_U) == 0, "KR_KS must be a multiple of 32 * KR_U");
static_assert((KR_V & (KR_V - 1)) == 0, "MT * KR_R must be a power of two");
static_assert(KR_WARPS % KR_KW == 0, "KR_KW must divide KR_WARPS");

// Halving levels of the 8-lane reduction (offsets 4, 2, 1) and the sums a lane keeps.
#define KR_HALVINGS (KR_V >= 8 ? 3 : KR_V == 4 ? 2 : KR_V == 2 ? 1 : 0)
#define KR_KEEP (KR_V >> KR_HALVINGS)

#if __CUDA_ARCH__ >= 800

// KR_FUSED: C is the split workspace (slice y at C + y * sC0, as for splitk_reduce); the sums go
// to Out (strides sOm, sOn); arrivals holds one zeroed counter per tile of rows.
#if KR_FUSED
#define KR_FUSED_PARAMS , float* __restrict__ Out, i64 sOm, i64 sOn, unsigned* __restrict__ arrivals
#else
#define KR_FUSED_PARAMS
#endif

__device__ __forceinline__ float4 kr_load_w(const float* row, int k, int kend, bool ok) {
#if B_VEC
    // K % 4 == 0: the float4 is wholly inside [0, kend) or wholly outside
    return ok && k < kend ? *(const float4*)(row + k) : make_float4(0.f, 0.f, 0.f, 0.f);
#else
    float4 v;
    v.x = ok && k < kend ? row[k] : 0.f;
    v.y = ok && k + 1 < kend ? row[k + 1] : 0.f;
    v.z = ok && k + 2 < kend ? row[k + 2] : 0.f;
    v.w = ok && k + 3 < kend ? row[k + 3] : 0.f;
    return v;
#endif
}

extern "C" __global__ void __launch_bounds__(KR_THREADS, KR_MINB) fastmm_skinny_kmajor(FASTMM_PARAMS KR_FUSED_PARAMS FASTMM_EPILOGUE_PARAMS) {
    grid_dependency_sync();  // launched as a programmatic dependent launch on sm_90+ (ptx.cuh)
    FASTMM_UNPACK
    FASTMM_EPILOGUE
    const bool final_store = gridDim.y == 1;  // (a split's blocks store partial sums)
    extern __shared__ float4 kr_smem4[];
    float* As = (float*)kr_smem4;  // As[m * KR_KS + k - kbeg]
#if KR_KW > 1
    float* red = As + MT * KR_KS;  // red[(j * MT + m) * KR_GROUP_ROWS + row]: warp j's sums of a group
#endif
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int kq = lane % 8, rs = lane / 8;
    const int tile = blockIdx.x;
    const int kbeg = (int)blockIdx.y * KR_KS, kend = min(K, kbeg + KR_KS);
    const int n0 = tile * KR_BN;

    for (int z = blockIdx.z; z < batch_total; z += gridDim.z) {
        FASTMM_BATCH_OFFSETS(z)
        // --- stage A[0:MT, kbeg:kbeg + KR_KS), zeros past M and past kend ---
        __syncthreads();  // the previous batch entry's reads of As are done
#if A_VEC
        for (int i = threadIdx.x; i < MT * (KR_KS / 4); i += KR_THREADS) {
            const int m = i / (KR_KS / 4), k = kbeg + 4 * (i % (KR_KS / 4));
            const bool ok = m < M && k < kend;
            cp_async_16(As + m * KR_KS + (k - kbeg), ok ? Ab + (i64)m * sAm + k : Ab, ok);
        }
#else
        for (int i = threadIdx.x; i < MT * KR_KS; i += KR_THREADS) {
            const int m = i / KR_KS, k = kbeg + i % KR_KS;  // k fastest: coalesced for row-major A
            const bool ok = m < M && k < kend;
            cp_async_4(As + i, ok ? Ab + (i64)m * sAm + (i64)k * sAk : Ab, ok);
        }
#endif
        cp_async_commit();

#pragma unroll 1
        for (int g = 0; g < KR_G; ++g) {
            const int row_local = (warp / KR_KW) * KR_ROWS_PER_WARP + rs;  // (its first row in the group)
            const int row0 = n0 + g * KR_GROUP_ROWS + row_local;
            const float* wrow[KR_R];
            bool wok[KR_R];
#pragma unroll
            for (int r = 0; r < KR_R; ++r) {
                wok[r] = row0 + 4 * r < N;
                wrow[r] = Bb + (i64)(wok[r] ? row0 + 4 * r : 0) * sBn;
            }
            float acc[KR_V];
#pragma unroll
            for (int i = 0; i < KR_V; ++i) acc[i] = 0.f;

            // this warp's k steps: whole groups of KR_U (k steps past kend read zeros of As and
            // of W), the groups shared out over the KR_KW warps of the row group in turn
            const int groups = (kend - kbeg + 32 * KR_U - 1) / (32 * KR_U);
            const int j = warp % KR_KW;
            const int s_lo = KR_U * (j * groups / KR_KW), s_hi = KR_U * ((j + 1) * groups / KR_KW);
            float4 w[KR_U][KR_R];
#pragma unroll
            for (int u = 0; u < KR_U; ++u)
#pragma unroll
                for (int r = 0; r < KR_R; ++r)
                    w[u][r] = kr_load_w(wrow[r], kbeg + 32 * (s_lo + u) + 4 * kq, kend, wok[r] && s_lo < s_hi);
            if (g == 0) {  // A's slice has landed: waited for behind the first W loads (every warp)
                cp_async_wait<0>();
                __syncthreads();
            }
#pragma unroll 1
            for (int s = s_lo; s < s_hi; s += KR_U) {
                if (s != s_lo) {
#pragma unroll
                    for (int u = 0; u < KR_U; ++u)
#pragma unroll
                        for (int r = 0; r < KR_R; ++r)
                            w[u][r] = kr_load_w(wrow[r], kbeg + 32 * (s + u) + 4 * kq, kend, wok[r]);
                }
#pragma unroll
                for (int u = 0; u < KR_U; ++u) {
                    const float* ak = As + 32 * (s + u) + 4 * kq;
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        const float4 a = *(const float4*)(ak + m * KR_KS);
#pragma unroll
                        for (int r = 0; r < KR_R; ++r) {
                            float t = acc[m * KR_R + r];
                            t = fmaf(a.x, w[u][r].x, t);
                            t = fmaf(a.y, w[u][r].y, t);
                            t = fmaf(a.z, w[u][r].z, t);
                            t = fmaf(a.w, w[u][r].w, t);
                            acc[m * KR_R + r] = t;
                        }
                    }
                }
            }
            // --- the 8 kq lanes' sums: halving exchange (offsets 4, 2, 1), then plain adds ---
#pragma unroll
            for (int st = 0; st < 3; ++st) {
                const int offset = 4 >> st;
                if (st < KR_HALVINGS) {
                    const int half = KR_V >> (st + 1);
                    const bool upper = (kq & offset) != 0;
#pragma unroll
                    for (int i = 0; i < KR_V / 2; ++i) {
                        if (i < half) {
                            const float send = upper ? acc[i] : acc[i + half];
                            const float keep = upper ? acc[i + half] : acc[i];
                            acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
                        }
                    }
                } else {
                    acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], offset);
                }
            }
            // lane keeps sums e = base + i (i < KR_KEEP) of acc's original order e = m * KR_R + r
            int base = 0;
            bool writer = true;
#pragma unroll
            for (int st = 0; st < 3; ++st) {
                const int offset = 4 >> st;
                if (st < KR_HALVINGS) {
                    if (kq & offset) base += KR_V >> (st + 1);
                } else if (kq & offset) {
                    writer = false;  // its partner holds the same sum
                }
            }
#if KR_KW > 1
            if (writer) {
#pragma unroll
                for (int i = 0; i < KR_KEEP; ++i) {
                    const int e = base + i, m = e / KR_R, r = e % KR_R;
                    red[(j * MT + m) * KR_GROUP_ROWS + row_local + 4 * r] = acc[i];
                }
            }
            __syncthreads();
            for (int t = threadIdx.x; t < MT * KR_GROUP_ROWS; t += KR_THREADS) {
                const int m = t / KR_GROUP_ROWS, row = t % KR_GROUP_ROWS, n = n0 + g * KR_GROUP_ROWS + row;
                if (m < M && n < N) {
                    float v = red[m * KR_GROUP_ROWS + row];
#pragma unroll
                    for (int jj = 1; jj < KR_KW; ++jj) v += red[(jj * MT + m) * KR_GROUP_ROWS + row];
                    Cb[(i64)m * sCm + (i64)n * sCn] = final_store ? epi(v, m, n) : v;
                }
            }
            __syncthreads();  // (red is rewritten by the next group)
#else
            if (writer) {
#pragma unroll
                for (int i = 0; i < KR_KEEP; ++i) {
                    const int e = base + i, m = e / KR_R, r = e % KR_R, n = row0 + 4 * r;
                    if (m < M && n < N) Cb[(i64)m * sCm + (i64)n * sCn] = final_store ? epi(acc[i], m, n) : acc[i];
                }
            }
#endif
        }
        cp_async_wait<0>();  // (K = 0: the copies were never waited for; before the next entry's staging)
#if KR_FUSED
        // (a split has a batch of 1: z == 0 here, and Cb is this block's workspace slice)
        if (split_arrive_last(arrivals + tile))
            split_sum_slices(C, sCm, sCn, sC0, Out, sOm, sOn, M, N, MT, n0, KR_BN, epi, arrivals + tile);
#endif
    }
}

#endif  // __CUDA_ARCH__ >= 800
