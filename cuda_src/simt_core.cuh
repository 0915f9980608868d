// Pieces shared by the two SIMT families (simt_float4.cu, simt_cp_async.cu): how a tile of an
// operand is copied into shared memory, the register-blocked outer-product step, the epilogue.
//
// Shared layout: both operands are stored k-major, As[k][m] and Bs[k][n], each row padded by 4
// floats. k-major lets a thread fetch its 8 A values and 8 B values for one k with four 16-byte
// loads (LDS.128); the pad keeps the transposing stores of row-major A free of bank conflicts
// and leaves rows 16-byte aligned.
//
// Block = WARPS_M x WARPS_N warps. Each lane computes a THREAD_M x 8 thread tile made of 4 x 4
// sub-tiles, spread so that the lanes of a warp read consecutive float4s of A and of B:
//   THREAD_M = 8:  lanes 8 (m) x 4 (n), warp tile 64 x 32; 16 floats read per 64 FFMA.
//   THREAD_M = 16: lanes 4 (m) x 8 (n), warp tile 64 x 64; 24 floats per 128 FFMA - a third less
//                  shared-memory traffic per FFMA, which is what limits the 8 x 8 tile on sm90.
//   THREAD_M = 4:  lanes 4 (m) x 8 (n), warp tile 16 x 64; 12 floats per 32 FFMA. The 32-row tiles
//                  of products with few rows (decode), where a 64-row tile computes mostly padding.
#pragma once
#include "common.cuh"

#ifndef WARPS_M
#define WARPS_M 2
#endif
#ifndef WARPS_N
#define WARPS_N 4
#endif
#ifndef BK
#define BK 8
#endif

#ifndef THREAD_M
#define THREAD_M 8
#endif
#define THREAD_N 8
#define LANES_M (THREAD_M == 8 ? 8 : 4)
#define LANES_N (32 / LANES_M)
#define A_GROUP_STRIDE (LANES_M * 4)  // distance between a lane's 4-row groups
#define B_GROUP_STRIDE (LANES_N * 4)  // distance between a lane's two 4-column groups
#define THREADS (WARPS_M * WARPS_N * 32)
#define BM (WARPS_M * LANES_M * THREAD_M)
#define BN (WARPS_N * LANES_N * THREAD_N)
#define PAD 4
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1  // 2 caps registers at 128 for two 256-thread blocks per SM (small spills)
#endif
#define A_STRIDE (BM + PAD)
#define B_STRIDE (BN + PAD)
#define A_TILE_FLOATS (BK * A_STRIDE)
#define B_TILE_FLOATS (BK * B_STRIDE)

// How an operand tile moves from global to shared memory (chosen on the host, see plan.py):
#define LOAD_VEC_FAST 0  // 16-byte vectors along m (A) / n (B): operand contiguous there, aligned
#define LOAD_VEC_K 1     // 16-byte vectors along k, transposed by the shared store (register path)
#define LOAD_ELEM_K 2    // single elements, consecutive lanes along k (k-contiguous, unaligned)
#define LOAD_ELEM_FAST 3 // single elements, consecutive lanes along m / n

// Geometry of one operand tile: FT = tile extent along m or n (the "f" dim), BK along k.
// Copy unit u = tid + p * THREADS covers a row of ROW_UNITS units, so a thread's units differ only
// in their row: (k, f) = (k_t + p * DK, f_t + p * DF). Written this way (no division of u) the
// compiler keeps one pointer per operand and steps it, instead of re-deriving 64-bit addresses
// for every copy (that cost ~15% of the issue slots in the first version).
template <int MODE, int FT>
struct TileMap {
    static constexpr int UNIT = (MODE == LOAD_VEC_FAST || MODE == LOAD_VEC_K) ? 4 : 1;
    static constexpr int UNITS = BK * FT / UNIT;
    static constexpr int PER_THREAD = UNITS / THREADS;
    static constexpr bool ROWS_ARE_K = MODE == LOAD_VEC_FAST || MODE == LOAD_ELEM_FAST;
    static constexpr int ROW_UNITS = ROWS_ARE_K ? FT / UNIT : BK / UNIT;
    static constexpr int DK = ROWS_ARE_K ? THREADS / ROW_UNITS : 0;
    static constexpr int DF = ROWS_ARE_K ? 0 : THREADS / ROW_UNITS;
    static_assert(UNITS % THREADS == 0, "tile must split evenly over the threads");
    static_assert(THREADS % ROW_UNITS == 0, "a row of copy units must split evenly over the threads");
};

// A thread's copy units of one operand tile (see TileMap), for the tile at (f0, k0 = 0).
// Element (f, k) of the operand is at base + f * sF + k * sK; for the vector modes the stride of
// the contiguous dim is 1, so one formula serves every mode.
template <int MODE, int FT>
struct TileCursor {
    typedef TileMap<MODE, FT> Map;
    const float* first;  // this thread's unit p = 0 at k0 = 0
    i64 step;            // distance between its consecutive units
    i64 sK;
    int k_t, f_t;
    unsigned f_ok;       // bit p: unit p's row/column exists (f < F)

    __device__ __forceinline__ void init(const float* base, int F, i64 sF, i64 sK_, int f0) {
        const int r = threadIdx.x / Map::ROW_UNITS, c = (threadIdx.x % Map::ROW_UNITS) * Map::UNIT;
        k_t = Map::ROWS_ARE_K ? r : c;
        f_t = Map::ROWS_ARE_K ? c : r;
        sK = sK_;
        first = base + (i64)(f0 + f_t) * sF + (i64)k_t * sK;
        step = (i64)Map::DK * sK + (i64)Map::DF * sF;
        f_ok = 0;
#pragma unroll
        for (int p = 0; p < Map::PER_THREAD; ++p)
            f_ok |= (unsigned)(f0 + f_t + p * Map::DF < F) << p;
    }
    __device__ __forceinline__ int k_of(int p) const { return k_t + p * Map::DK; }
    __device__ __forceinline__ int f_of(int p) const { return f_t + p * Map::DF; }
    __device__ __forceinline__ bool ok(int p, int k0, int K) const {
        return ((f_ok >> p) & 1u) && k0 + k_of(p) < K;
    }
    __device__ __forceinline__ const float* at(int p, int k0) const {
        return first + (i64)k0 * sK + p * step;
    }
};

// FFMA order within a k-step (any order gives the same sums: one FFMA per output per k).
// An FFMA reads three registers; those not served by the operand reuse cache (a .reuse read of
// the same register in the same slot by the previous instruction) all in one of the two register
// banks (index parity) cost an extra cycle. Row i reuses a[i]; FMA_ZIGZAG 1 walks the columns in
// the order 1 0 3 2 5 4 7 6 on even rows and reversed on odd rows, so each row starts with the
// b its predecessor ended with (reused), and where ptxas reorders, a row's first FFMA pairs a[i]
// with a b[j] of the other parity (the fragments sit in 4-aligned registers: a[i] has i's parity),
// which cannot be a three-way conflict. sm_90, 16 x 8 thread tile, cp.async kernel: 67 of 1024
// FFMA have three uncached same-bank sources in plain i/j order (FMA_ZIGZAG 0), 7 zig-zagged.
#ifndef FMA_ZIGZAG
#define FMA_ZIGZAG 1
#endif
// acc += a (column) x b (row): THREAD_M * 8 FFMA, one per output.
__device__ __forceinline__ void outer_product(const float a[THREAD_M], const float b[THREAD_N],
                                              float acc[THREAD_M][THREAD_N]) {
#pragma unroll
    for (int i = 0; i < THREAD_M; ++i)
#pragma unroll
        for (int jj = 0; jj < THREAD_N; ++jj) {
            const int j = FMA_ZIGZAG ? ((i & 1) ? THREAD_N - 1 - jj : jj) ^ 1 : jj;
            acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
}

// One step of k: THREAD_M A values x 8 B values -> THREAD_M * 8 FFMA into acc.
__device__ __forceinline__ void outer_product_step(const float* As, const float* Bs, int k,
                                                   int am, int bn, float acc[THREAD_M][THREAD_N]) {
    float a[THREAD_M], b[THREAD_N];
#pragma unroll
    for (int g = 0; g < THREAD_M / 4; ++g)
        *(float4*)&a[4 * g] = *(const float4*)&As[k * A_STRIDE + am + g * A_GROUP_STRIDE];
#pragma unroll
    for (int h = 0; h < 2; ++h)
        *(float4*)&b[4 * h] = *(const float4*)&Bs[k * B_STRIDE + bn + h * B_GROUP_STRIDE];
    outer_product(a, b, acc);
}

// k-steps [K0, K1) of a shared tile.
template <int K0, int K1>
__device__ __forceinline__ void compute_steps(const float* As, const float* Bs, int am, int bn,
                                              float acc[THREAD_M][THREAD_N]) {
#pragma unroll
    for (int k = K0; k < K1; ++k) outer_product_step(As, Bs, k, am, bn, acc);
}

__device__ __forceinline__ void compute_tile(const float* As, const float* Bs, int am, int bn,
                                             float acc[THREAD_M][THREAD_N]) {
    compute_steps<0, BK>(As, Bs, am, bn, acc);
}

// Thread's place in the block tile: first A column (m) and B column (n) of its sub-tiles.
__device__ __forceinline__ void thread_origin_of(unsigned tid, int& am, int& bn) {
    const int warp = tid / 32, lane = tid % 32;
    am = (warp / WARPS_N) * (LANES_M * THREAD_M) + (lane / LANES_N) * 4;
    bn = (warp % WARPS_N) * (LANES_N * THREAD_N) + (lane % LANES_N) * 4;
}

__device__ __forceinline__ void thread_origin(int& am, int& bn) { thread_origin_of(threadIdx.x, am, bn); }

__device__ __forceinline__ void zero_tile(float acc[THREAD_M][THREAD_N]) {
#pragma unroll
    for (int i = 0; i < THREAD_M; ++i)
#pragma unroll
        for (int j = 0; j < THREAD_N; ++j) acc[i][j] = 0.f;
}

// Write the thread tile; rows/cols outside C are skipped. VEC: C rows contiguous, N % 4 == 0
// and 16-byte aligned, so a float4 is either wholly inside or wholly outside. epi: the fused
// epilogue of an output's final store (the identity for partial sums: a default Epilogue with
// EPILOGUE = 0, or store_partial).
template <bool VEC, int I0 = 0, int I1 = THREAD_M, class Epi>  // (rows I0 .. I1 - 1 of the thread's tile)
__device__ __forceinline__ void store_tile_as(float* Cb, int M, int N, i64 sCm, i64 sCn, int m0, int n0,
                                              int am, int bn, const float acc[THREAD_M][THREAD_N], const Epi& epi) {
#pragma unroll
    for (int i = I0; i < I1; ++i) {
        const int m = m0 + am + (i / 4) * A_GROUP_STRIDE + (i % 4);
        if (m >= M) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int n = n0 + bn + h * B_GROUP_STRIDE;
            if (VEC) {
                if (n < N)
                    *(float4*)&Cb[(i64)m * sCm + n] =
                        make_float4(epi(acc[i][4 * h], m, n), epi(acc[i][4 * h + 1], m, n + 1),
                                    epi(acc[i][4 * h + 2], m, n + 2), epi(acc[i][4 * h + 3], m, n + 3));
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (n + j < N) Cb[(i64)m * sCm + (i64)(n + j) * sCn] = epi(acc[i][4 * h + j], m, n + j);
            }
        }
    }
}

// The identity epilogue: partial sums (split-K slices, stream-K pieces) are stored as they are.
struct NoEpilogue {
    __device__ __forceinline__ float operator()(float acc, int, int) const { return acc; }
};

#ifndef C_VEC
#define C_VEC 0
#endif
// The final store into C (C_VEC: set by the planner from C's layout), through the epilogue.
__device__ __forceinline__ void store_tile(float* Cb, int M, int N, i64 sCm, i64 sCn, int m0, int n0,
                                           int am, int bn, const float acc[THREAD_M][THREAD_N], const Epilogue& epi) {
    store_tile_as<C_VEC != 0>(Cb, M, N, sCm, sCn, m0, n0, am, bn, acc, epi);
}
