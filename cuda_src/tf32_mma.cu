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
// (4 floats on 32-wide rows, 8 on the 64- to 256-wide ones) keep every fragment read below free
// of bank conflicts (see "Fragments"). A_VEC / B_VEC: 16-byte copies (contiguous, aligned); else 4-byte copies,
// which also serve operands with no unit stride at all. Interior blocks copy through TileStream
// (one pointer, an IMAD.WIDE per copy); edge blocks and a partial last k-tile through copy_tile.
//
// FRAG_PIPE = 1 (tf32 with 16-byte copies of both operands): two fragment register sets, so a
// k-step's mmas overlap the next k-step's loads and roundings (8192x4096x6144 on the H200, 128 x 256
// blocks: 147.7 -> 204.4 TFLOP/s with 3 stages, 208.6 with 4; NOTES.md run 12).
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
#ifndef FRAG_PIPE
#define FRAG_PIPE 0
#endif
#if FRAG_PIPE && PRECISION_X3
#error "FRAG_PIPE is for tf32 (tf32x3 has no registers for a second fragment set)"
#endif
#ifndef PROMOTE
#define PROMOTE PRECISION_X3  // add each k-step's big products into fp32 registers (see above)
#endif
#ifndef COMPENSATE
// tf32x3's promotion add: 1 = fast_two_sum_add (3 adds; Dekker's, exact while the running sum
// is the larger, as it is after the first k-steps; the wgmma kernel's default since run 8), 2 =
// two_sum_add (6 adds, exact always). The adds are most of the k-loop's fp32 work (64 x 16 warps:
// 192 of ~250 per k-step), and this kernel is bound by issue, not by its tensor cores.
#define COMPENSATE 1
#endif
#define WARP_M 64
#define BK 32
#if FRAG_PIPE && (BK / 8) % 2 != 0
#error "FRAG_PIPE alternates two fragment sets: the next k-tile's first k-step must land in set 0"
#endif
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
// How the block's threads cover a ROWS x COLS tile (COLS contiguous in shared memory) with
// W-float units: TPR threads across a row, each taking CPT units of it (TPR * W apart) in each of
// ROWS / DR passes (DR rows apart).
template <int ROWS, int COLS, bool VEC>
struct TileCover {
    static constexpr int W = VEC ? 4 : 1;
    static constexpr int ROW_UNITS = COLS / W;
    static constexpr int TPR = ROW_UNITS < THREADS ? ROW_UNITS : THREADS;
    static constexpr int CPT = ROW_UNITS / TPR;
    static constexpr int DR = THREADS / TPR;
    static constexpr int PASSES = ROWS / DR;
    static_assert(ROW_UNITS % TPR == 0 && THREADS % TPR == 0 && ROWS % DR == 0, "tile must split evenly");
    static __device__ __forceinline__ int row() { return threadIdx.x / TPR; }
    static __device__ __forceinline__ int col() { return (threadIdx.x % TPR) * W; }
    // Shared offset (floats) of unit (p, j) from the thread's first unit.
    static __device__ __forceinline__ int dst_off(int p, int j, int LD) { return p * DR * LD + j * TPR * W; }
};

// Copy a ROWS x COLS tile starting at (r0, c0), checking every unit. Element (r, c) of the
// operand is at base + r * s_row + c * s_col, and exists while r < R, c < Cn. Used for blocks at
// the operand's edges and for a partial last k-tile; TileStream below serves the rest.
template <int ROWS, int COLS, int LD, bool VEC>
__device__ __forceinline__ void copy_tile(float* S, const float* base, int R, int Cn, i64 s_row,
                                          i64 s_col, int r0, int c0) {
    typedef TileCover<ROWS, COLS, VEC> T;
    const int r_t = T::row(), c_t = T::col();
    const float* first = base + (i64)(r0 + r_t) * s_row + (i64)(c0 + c_t) * s_col;
    const i64 step = (i64)T::DR * s_row;
    const unsigned dst = smem_addr(S + r_t * LD + c_t);
#pragma unroll
    for (int j = 0; j < T::CPT; ++j) {
        const bool c_ok = c0 + c_t + j * T::TPR * T::W < Cn;
        const float* col = first + (i64)(j * T::TPR * T::W) * s_col;
#pragma unroll
        for (int p = 0; p < T::PASSES; ++p) {
            const bool ok = c_ok && r0 + r_t + p * T::DR < R;
            const float* src = ok ? col + p * step : base;  // invalid: reads nothing, mapped address
            cp_async_to<VEC ? 16 : 4>(dst + 4u * T::dst_off(p, j, LD), src, ok);
        }
    }
}

// p + bytes * n as one IMAD.WIDE (the compiler otherwise splits the 64-bit add).
__device__ __forceinline__ const float* wide_add(const float* p, int bytes, int n) {
    const float* r;
    asm("mad.wide.s32 %0, %1, %2, %3;\n" : "=l"(r) : "r"(bytes), "r"(n), "l"(p));
    return r;
}

// The unchecked copies of an interior block (all its rows and columns inside the operand) for the
// k-tiles wholly inside K: one pointer, stepped a k-tile at a time, from which each unit is one
// IMAD.WIDE away (byte offsets below 2^31: `fits`). copy_tile's checks and 64-bit address math
// took ~280 of the main loop's 705 instructions per k-tile (SASS, NOTES run 12).
template <int ROWS, int COLS, int LD, bool VEC>
struct TileStream {
    typedef TileCover<ROWS, COLS, VEC> T;
    const float* src;  // this thread's first unit in the next k-tile to copy
    i64 k_bytes;       // one k-tile along k
    int pass_bytes;    // DR rows
    int col_bytes;     // TPR units along a row (CPT > 1)
    unsigned dst;      // the thread's first unit, shared byte offset within a stage

    // (r0, c0): the tile's first element in the first k-tile; sK: the operand's k stride.
    __device__ __forceinline__ void init(const float* base, i64 s_row, i64 s_col, i64 sK, int r0, int c0) {
        src = base + (i64)(r0 + T::row()) * s_row + (i64)(c0 + T::col()) * s_col;
        k_bytes = (i64)BK * sK * 4;
        pass_bytes = (int)(T::DR * s_row * 4);
        col_bytes = (int)(T::TPR * T::W * s_col * 4);
        dst = (unsigned)(T::row() * LD + T::col()) * 4u;
    }
    // Whether every unit offset of a tile fits the 32-bit offsets above.
    static __device__ __forceinline__ bool fits(i64 s_row, i64 s_col) {
        return (i64)ROWS * s_row * 4 < (1ll << 31) && (i64)COLS * s_col * 4 < (1ll << 31);
    }
    __device__ __forceinline__ void copy(const float* S) const {
        const unsigned d = smem_addr(S) + dst;
#pragma unroll
        for (int j = 0; j < T::CPT; ++j) {
            const float* col = j == 0 ? src : wide_add(src, col_bytes, j);
#pragma unroll
            for (int p = 0; p < T::PASSES; ++p)
                cp_async_to<VEC ? 16 : 4>(d + 4u * T::dst_off(p, j, LD), p == 0 ? col : wide_add(col, pass_bytes, p), true);
        }
    }
    __device__ __forceinline__ void advance() {
        asm("add.s64 %0, %0, %1;\n" : "+l"(src) : "l"(k_bytes));
    }
};

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

// Fragments. An m16n8k8 mma multiplies a 16 x 8 "A role" fragment (4 registers per lane) by an
// 8 x 8 "B role" fragment (2 registers, which must be an aligned register pair, as must the A
// role's 4). Which operand takes which role is chosen so that fragments load straight into their
// registers with few instructions (ROLE_SWAP, below); the k order is the natural one throughout
// (a0/a1 and b0 at k = kk + t, a2/a3 and b1 at kk + t + 4; lane = 4 g + t).
//   A role from an operand whose shared rows run along k (X[r][k], "ALONG_K"): ldmatrix x4, one
//     16 x 8 fragment per instruction, fragment row g + 8 h is tile row 16 i + 8 h + g.
//   A role from an operand stored X[k][r]: fragment rows g and g + 8 are made tile rows 2 g and
//     2 g + 1 (16 i + 2 g + h), so (a0, a1) and (a2, a3) are 8-byte loads of rows kk + t and
//     kk + t + 4. The pitch (rows padded by 8 floats: 8 banks mod 32) spreads each half warp's
//     16 lanes over 32 distinct banks.
//   B role from X[c][k]: ldmatrix x4 (two 8-column fragments per instruction), natural columns.
//   B role from X[k][c]: two 4-byte loads (rows kk + t, kk + t + 4; banks 8 t + g: distinct).
// (Tried first: 16-byte loads of 4 columns per lane for a row-major B in the B role; its b0 and
// b1 come from different rows, so SASS needed ~3 register moves per mma.) Loads per k-step of a
// 64 x 64 warp tile: 8 (A [m][k], B [n][k]) to 24, 12 for row-major A and B (roles swapped),
// against 32 4-byte loads before (NOTES.md run 11). tf32x3 keeps B in the B role and reads
// k-contiguous tiles with 4-byte loads: its split values then fit the registers (no spills).
#if B_SMEM_KN && !PRECISION_X3
#define ROLE_SWAP 1  // B takes the A role: the product is computed as C^T = B^T A^T per fragment
#else
#define ROLE_SWAP 0  // (tf32x3 keeps B in the B role: its warp tile then holds fewer B-role
                     // fragments and small parts; with 64 x 32 warps, 4 instead of 8, which spilled)
#endif
#if ROLE_SWAP
#define RA (WARP_N / 16)  // A-role fragments per warp tile (along n)
#define RB (WARP_M / 8)   // B-role fragments (along m)
#define RA_ALONG_K 0      // B stored [k][n]: its rows run along n
#define RB_ALONG_K A_SMEM_MK
#define RA_LD B_LD
#define RB_LD A_LD
#else
#define RA (WARP_M / 16)
#define RB (WARP_N / 8)
#define RA_ALONG_K A_SMEM_MK
#define RB_ALONG_K (!B_SMEM_KN)
#define RA_LD A_LD
#define RB_LD B_LD
#endif

__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const float* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// Raw (unrounded) A-role fragment i at k-step kk; X = the A-role tile, r0 = the warp's first row.
__device__ __forceinline__ void load_arole(const float* X, int r0, int kk, int lane, int i, float v[4]) {
#if RA_ALONG_K && PRECISION_X3
    // tf32x3: 4-byte loads, as for its B role below
    const int g = lane / 4, t = lane % 4;
    const float* row = X + (r0 + 16 * i + g) * RA_LD + kk + t;
    v[0] = row[0]; v[1] = row[8 * RA_LD]; v[2] = row[4]; v[3] = row[8 * RA_LD + 4];
#elif RA_ALONG_K
    // matrix q = lane / 8: rows 16 i + 8 (q % 2) .. + 7, k from kk + 4 (q / 2): a0 .. a3
    unsigned r[4];
    ldmatrix_x4(r, X + (r0 + 16 * i + (lane % 8) + 8 * ((lane / 8) % 2)) * RA_LD + kk + 4 * (lane / 16));
#pragma unroll
    for (int q = 0; q < 4; ++q) v[q] = __uint_as_float(r[q]);
#else
    const int g = lane / 4, t = lane % 4;
    const float2 lo = *(const float2*)(X + (kk + t) * RA_LD + r0 + 16 * i + 2 * g);
    const float2 hi = *(const float2*)(X + (kk + t + 4) * RA_LD + r0 + 16 * i + 2 * g);
    v[0] = lo.x; v[1] = lo.y; v[2] = hi.x; v[3] = hi.y;
#endif
}

// Tile row of A-role fragment i's row g + 8 h (relative to the warp's first row).
__device__ __forceinline__ int arole_row(int i, int h, int g) {
#if RA_ALONG_K
    return 16 * i + 8 * h + g;
#else
    return 16 * i + 2 * g + h;
#endif
}

// Raw B-role fragments j = 0 .. RB - 1 at k-step kk; X = the B-role tile, c0 = the warp's first
// column (B-role columns are always in natural order: fragment column c of j is 8 j + c).
__device__ __forceinline__ void load_brole(const float* X, int c0, int kk, int lane, float v[RB][2]) {
#if RB_ALONG_K && PRECISION_X3
    // tf32x3: 4-byte loads (with ldmatrix, ptxas kept more of its split values live and spilled)
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < RB; ++j) {
        v[j][0] = X[(c0 + 8 * j + g) * RB_LD + kk + t];
        v[j][1] = X[(c0 + 8 * j + g) * RB_LD + kk + t + 4];
    }
#elif RB_ALONG_K
    // one x4 covers fragments j and j + 1: matrix q = lane / 8 is j + q / 2, k from kk + 4 (q % 2)
    static_assert(RB % 2 == 0, "ldmatrix x4 loads two 8-column fragments");
    const float* p = X + (c0 + (lane % 8) + 8 * (lane / 16)) * RB_LD + kk + 4 * ((lane / 8) % 2);
#pragma unroll
    for (int j = 0; j < RB; j += 2) {
        unsigned r[4];
        ldmatrix_x4(r, p + j * 8 * RB_LD);
        v[j][0] = __uint_as_float(r[0]); v[j][1] = __uint_as_float(r[1]);
        v[j + 1][0] = __uint_as_float(r[2]); v[j + 1][1] = __uint_as_float(r[3]);
    }
#else
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < RB; ++j) {
        v[j][0] = X[(kk + t) * RB_LD + c0 + 8 * j + g];
        v[j][1] = X[(kk + t + 4) * RB_LD + c0 + 8 * j + g];
    }
#endif
}

// Split x into its TF32 part and the TF32 rounding of the remainder. For +-Inf the remainder is
// Inf - Inf = NaN; harmless, because every output such an input reaches has a non-finite big sum,
// and the epilogue then returns the big sum alone (as fp32 would: +-Inf, or NaN for Inf * 0).
__device__ __forceinline__ void split_tf32(float x, unsigned& big, unsigned& small) {
    big = to_tf32(x);
    small = to_tf32(x - __uint_as_float(big));
}
#if PRECISION_X3
#define ACC_SMALL acc_small
// Where the big products already overflowed or met Inf/NaN, that is the fp32 answer; the cross
// terms (Inf * 0 = NaN there) must not change it.
__device__ __forceinline__ float result(const float (&acc)[RA][RB][4], const float (&small)[RA][RB][4], int i, int j, int q) {
    const float big = acc[i][j][q];
    return isfinite(big) ? big + small[i][j][q] : big;
}
#else
#define ACC_SMALL 0
__device__ __forceinline__ float result(const float (&acc)[RA][RB][4], int, int i, int j, int q) {
    return acc[i][j][q];
}
#endif

// C[m][n], C[m][n + 1] where they exist, through the fused epilogue. C_VEC: C rows contiguous,
// N even, 8-byte aligned, n even: the pair is in or out whole. A split-K plan's slices are built
// with EPILOGUE = 0 (its reduce pass applies it).
__device__ __forceinline__ void store_pair(float* Cb, int M, int N, i64 sCm, i64 sCn, int m, int n, float c0, float c1,
                                           const Epilogue& epi) {
#if C_VEC
    if (n < N) *(float2*)&Cb[(i64)m * sCm + n] = make_float2(epi(c0, m, n), epi(c1, m, n + 1));
#else
    if (n < N) Cb[(i64)m * sCm + (i64)n * sCn] = epi(c0, m, n);
    if (n + 1 < N) Cb[(i64)m * sCm + (i64)(n + 1) * sCn] = epi(c1, m, n + 1);
#endif
}
#endif

#if FRAG_PIPE
// tf32 with fragments in two register sets: k-step s + 1's fragments are loaded and rounded
// while k-step s's mmas run, so the tensor pipe is not left idle while a warp loads and
// rounds (ncu, NOTES run 12: the loop was 32 rounding pairs, then 32 mmas, with 2 warps per
// scheduler to cover for each other).
__device__ __forceinline__ void load_step(const float* At, const float* Bt, int wm, int wn, int kk, int lane,
                                          unsigned (&a)[RA][4], unsigned (&b)[RB][2]) {
#if ROLE_SWAP
    const float* Xa = Bt; const float* Xb = At;
    const int ra0 = wn, rb0 = wm;
#else
    const float* Xa = At; const float* Xb = Bt;
    const int ra0 = wm, rb0 = wn;
#endif
    float vb[RB][2];
    load_brole(Xb, rb0, kk, lane, vb);
#pragma unroll
    for (int j = 0; j < RB; ++j) {
        b[j][0] = to_tf32(vb[j][0]);
        b[j][1] = to_tf32(vb[j][1]);
    }
#pragma unroll
    for (int i = 0; i < RA; ++i) {
        float va[4];
        load_arole(Xa, ra0, kk, lane, i, va);
#pragma unroll
        for (int q = 0; q < 4; ++q) a[i][q] = to_tf32(va[q]);
    }
}

__device__ __forceinline__ void mma_step(float (&acc)[RA][RB][4], const unsigned (&a)[RA][4], const unsigned (&b)[RB][2]) {
#pragma unroll
    for (int i = 0; i < RA; ++i)
#pragma unroll
        for (int j = 0; j < RB; ++j) mma_tf32_16x8x8(acc[i][j], a[i], b[j]);
}
#endif

// tf32x3 says "one block per SM is enough" outright: given the block size alone, NVRTC 13.0's ptxas
// capped some 8-warp builds at 128 registers (room for two blocks) and spilled 24-48 bytes there
// (issue 16); they need ~160. tf32 keeps the bounds its FRAG_PIPE timings were measured with.
#if PRECISION_X3
#define TF32_MMA_BOUNDS __launch_bounds__(THREADS, 1)
#else
#define TF32_MMA_BOUNDS __launch_bounds__(THREADS)
#endif
extern "C" __global__ void TF32_MMA_BOUNDS fastmm_tf32_mma(FASTMM_PARAMS FASTMM_EPILOGUE_PARAMS) {
    FASTMM_UNPACK
    FASTMM_EPILOGUE
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

#if FRAG_PIPE
    for (int z = blockIdx.z; z < batch_total; z += gridDim.z) {
        FASTMM_BATCH_OFFSETS(z)
        for (int tile = blockIdx.x; tile < tiles_m * tiles_n; tile += gridDim.x) {
#else
    // The block's (batch, tile) pairs in the order of two grid-stride loops (batches outer) as one
    // loop, with C's pointer formed in the epilogue: the batch's pointers are not held through
    // the k-loop (6 registers). tf32x3's 64 x 32 warp tiles sat at the 255-register cap, where
    // this saved NVRTC 13.5 builds from spilling (issue 16; since then its warp tiles are 64 x 16,
    // ~160 registers). FRAG_PIPE keeps the nested loops: no spill there, and its k-loop's code is
    // as measured (NOTES run 12).
    const int tiles = tiles_m * tiles_n;
    for (int z = blockIdx.z, tile = blockIdx.x; z < batch_total && tile < tiles;) {
        const float* Ab = A + (i64)(z / batch_inner) * sA0 + (i64)(z % batch_inner) * sA1;
        const float* Bb = B + (i64)(z / batch_inner) * sB0 + (i64)(z % batch_inner) * sB1;
        {
#endif
            int tm, tn;
            tile_coords<8>(tile, tiles_m, tiles_n, tm, tn);
            const int m0 = tm * BM, n0 = tn * BN;
            float acc[RA][RB][4];  // [A-role fragment][B-role fragment]
#if PRECISION_X3
            float acc_small[RA][RB][4];
#endif
#pragma unroll
            for (int i = 0; i < RA; ++i)
#pragma unroll
                for (int j = 0; j < RB; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        acc[i][j][q] = 0.f;
#if PRECISION_X3
                        acc_small[i][j][q] = 0.f;
#endif
                    }

            // Copies: the unchecked streams where the block is interior and the k-tile lies
            // inside K (kt < fast_end), copy_tile's checked units elsewhere.
#if A_SMEM_MK
            TileStream<A_ROWS, A_COLS, A_LD, A_VEC> a_copy;
            a_copy.init(Ab, sAm, sAk, sAk, m0, kt_begin * BK);
            const bool a_fits = a_copy.fits(sAm, sAk);
#else
            TileStream<A_ROWS, A_COLS, A_LD, A_VEC> a_copy;
            a_copy.init(Ab, sAk, sAm, sAk, kt_begin * BK, m0);
            const bool a_fits = a_copy.fits(sAk, sAm);
#endif
#if B_SMEM_KN
            TileStream<B_ROWS, B_COLS, B_LD, B_VEC> b_copy;
            b_copy.init(Bb, sBk, sBn, sBk, kt_begin * BK, n0);
            const bool b_fits = b_copy.fits(sBk, sBn);
#else
            TileStream<B_ROWS, B_COLS, B_LD, B_VEC> b_copy;
            b_copy.init(Bb, sBn, sBk, sBk, n0, kt_begin * BK);
            const bool b_fits = b_copy.fits(sBn, sBk);
#endif
            const bool interior = m0 + BM <= M && n0 + BN <= N && a_fits && b_fits;
            const int fast_end = interior ? min(kt_end, K / BK) : kt_begin;
            // k-tile kt (issued in order) into stage s.
            auto issue = [&](int kt, int s) {
                if (kt < fast_end) {
                    a_copy.copy(As + s * A_TILE_FLOATS);
                    b_copy.copy(Bs + s * B_TILE_FLOATS);
                } else if (kt < kt_end) {
                    load_tiles(As + s * A_TILE_FLOATS, Bs + s * B_TILE_FLOATS, Ab, Bb, M, N, K,
                               sAm, sAk, sBk, sBn, m0, n0, kt * BK);
                }
                a_copy.advance();
                b_copy.advance();
            };
#pragma unroll
            for (int s = 0; s < STAGES - 1; ++s) {
                issue(kt_begin + s, s);
                cp_async_commit();
            }
            // k-tile kt is read from stage cur; kt + STAGES - 1 goes to the stage before it, which
            // every warp has finished reading once it passed this iteration's barrier.
            int cur = 0;
#if FRAG_PIPE
            // The barrier for k-tile kt + 1 comes before k-tile kt's last k-step, whose
            // fragments are in registers by then; the copies of iteration kt + 1 (into the stage
            // of kt) are issued after it, so no warp still reads that stage.
            unsigned fa[2][RA][4], fb[2][RB][2];
            if (kt_begin < kt_end) {
                cp_async_wait<STAGES - 2>();
                __syncthreads();
                load_step(As, Bs, wm, wn, 0, lane, fa[0], fb[0]);
            }
            for (int kt = kt_begin; kt < kt_end; ++kt) {
                const float* At = As + cur * A_TILE_FLOATS;
                const float* Bt = Bs + cur * B_TILE_FLOATS;
                const int wr = cur == 0 ? STAGES - 1 : cur - 1;
                cur = cur == STAGES - 1 ? 0 : cur + 1;
#pragma unroll
                for (int step = 0; step < BK / 8; ++step) {
                    if (step == 1) {
                        issue(kt + STAGES - 1, wr);
                        cp_async_commit();
                    }
                    const int p = step % 2;
                    if (step + 1 < BK / 8) {
                        load_step(At, Bt, wm, wn, 8 * (step + 1), lane, fa[p ^ 1], fb[p ^ 1]);
                    } else {  // (after the last k-tile this loads a stale stage: unused, harmless)
                        cp_async_wait<STAGES - 2>();
                        __syncthreads();
                        load_step(As + cur * A_TILE_FLOATS, Bs + cur * B_TILE_FLOATS, wm, wn, 0, lane, fa[p ^ 1], fb[p ^ 1]);
                    }
                    mma_step(acc, fa[p], fb[p]);
                }
            }
#else
            for (int kt = kt_begin; kt < kt_end; ++kt) {
                cp_async_wait<STAGES - 2>();
                __syncthreads();
                const float* At = As + cur * A_TILE_FLOATS;
                const float* Bt = Bs + cur * B_TILE_FLOATS;
                const int wr = cur == 0 ? STAGES - 1 : cur - 1;
                cur = cur == STAGES - 1 ? 0 : cur + 1;
#pragma unroll
                for (int kk = 0; kk < BK; kk += 8) {
                    if (kk == 8) {  // copies for a later tile, issued between k-steps (see simt_cp_async.cu)
                        issue(kt + STAGES - 1, wr);
                        cp_async_commit();
                    }
#if ROLE_SWAP
                    const float* Xa = Bt;  // A role: B (rows along n), from the warp's column wn
                    const float* Xb = At;  // B role: A, from the warp's row wm
                    const int ra0 = wn, rb0 = wm;
#else
                    const float* Xa = At;
                    const float* Xb = Bt;
                    const int ra0 = wm, rb0 = wn;
#endif
                    // B-role fragments rounded (or split) once per k-step; each A-role fragment
                    // right before its mmas, so fewer rounded values are live at once (tf32x3
                    // holds two accumulator sets).
                    float vb[RB][2];
                    load_brole(Xb, rb0, kk, lane, vb);
                    unsigned b[RB][2];
#if PRECISION_X3
                    unsigned bs[RB][2];
#endif
#pragma unroll
                    for (int j = 0; j < RB; ++j)
#pragma unroll
                        for (int q = 0; q < 2; ++q) {
#if PRECISION_X3
                            split_tf32(vb[j][q], b[j][q], bs[j][q]);
#else
                            b[j][q] = to_tf32(vb[j][q]);
#endif
                        }
#pragma unroll
                    for (int i = 0; i < RA; ++i) {
                        float va[4];
                        load_arole(Xa, ra0, kk, lane, i, va);
                        unsigned a[4];
#if PRECISION_X3
                        unsigned as[4];
#endif
#pragma unroll
                        for (int q = 0; q < 4; ++q) {
#if PRECISION_X3
                            split_tf32(va[q], a[q], as[q]);
#else
                            a[q] = to_tf32(va[q]);
#endif
                        }
#pragma unroll
                        for (int j = 0; j < RB; ++j) {
#if PRECISION_X3
                            mma_tf32_16x8x8(acc_small[i][j], as, b[j]);
                            mma_tf32_16x8x8(acc_small[i][j], a, bs[j]);
#endif
#if PROMOTE
                            float part[4] = {0.f, 0.f, 0.f, 0.f};
                            mma_tf32_16x8x8(part, a, b[j]);
#pragma unroll
                            for (int q = 0; q < 4; ++q) {
#if PRECISION_X3
#if COMPENSATE == 2
                                two_sum_add(acc[i][j][q], part[q], acc_small[i][j][q]);
#else
                                fast_two_sum_add(acc[i][j][q], part[q], acc_small[i][j][q]);
#endif
#else
                                acc[i][j][q] += part[q];
#endif
                            }
#else
                            mma_tf32_16x8x8(acc[i][j], a, b[j]);
#endif
                        }
                    }
                }
            }
#endif
            cp_async_wait<0>();
            __syncthreads();

#if !FRAG_PIPE
            float* Cb = C + (i64)(z / batch_inner) * sC0 + (i64)(z % batch_inner) * sC1 + (i64)blockIdx.y * sC0;
#endif
            // Epilogue: acc[i][j][2 h + e] is A-role row arole_row(i, h, g), B-role column
            // 8 j + 2 t + e. Without the swap that is (m, n), stored as pairs along n (e); with it
            // (n, m), and the A-role rows 2 g, 2 g + 1 (h) are the adjacent pair along n.
#pragma unroll
            for (int i = 0; i < RA; ++i)
#pragma unroll
                for (int j = 0; j < RB; ++j)
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
#if ROLE_SWAP
                        const int m = m0 + wm + 8 * j + 2 * t + u;
                        const int n = n0 + wn + arole_row(i, 0, g);
                        if (m < M)
                            store_pair(Cb, M, N, sCm, sCn, m, n, result(acc, ACC_SMALL, i, j, u),
                                       result(acc, ACC_SMALL, i, j, 2 + u), epi);
#else
                        const int m = m0 + wm + arole_row(i, u, g);
                        const int n = n0 + wn + 8 * j + 2 * t;
                        if (m < M)
                            store_pair(Cb, M, N, sCm, sCn, m, n, result(acc, ACC_SMALL, i, j, 2 * u),
                                       result(acc, ACC_SMALL, i, j, 2 * u + 1), epi);
#endif
                    }
        }
#if !FRAG_PIPE
        tile += gridDim.x;
        if (tile >= tiles) {
            tile = blockIdx.x;
            z += gridDim.z;
        }
#endif
    }
#endif
}
