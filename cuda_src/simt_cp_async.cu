// SIMT family, cp.async pipeline (sm80+): STAGES shared buffers filled by asynchronous copies
// straight from global memory, so STAGES-1 k-tiles are in flight while one is computed, and no
// registers are spent staging. Out-of-range elements are zero-filled by the copy itself.
// Row-major A is transposed into the k-major shared layout with 4-byte copies (a 16-byte copy
// cannot transpose): 4 copies per thread per k-tile on the 128 x 256 tile, against 1024 FFMA.
//
// Issue slots per k-tile are the budget (sm_90, 128 x 256 tile, row-major A: 1110 instructions
// per k-tile, 1024 of them FFMA). The main loop runs over the iterations whose copy is a k-tile
// wholly inside K: no k bound check, a source address is one 64-bit add (unit pointer + the
// tile's k offset), the m / n checks are loop-invariant predicates and the stage addresses are
// stepped. The copies a partial last k-tile needs are checked ones, in the prologue or the tail.
#include "simt_core.cuh"

#ifndef STAGES
#define STAGES 3
#endif
// Fragment sets: shared loads run FRAG_DEPTH - 1 k-steps ahead of their FFMAs. ptxas places a
// step's loads deep inside the previous step's FFMAs; a third set leaves them a whole step to
// land (16 x 8 tiles: 207-228 registers; 8192x4096x6144 50.03 -> 50.11, 4096^3 49.36 -> 49.77
// TFLOP/s on the H200, NOTES.md run 12). The 8 x 8 tiles (capped at 168 registers) and a B
// copied in single floats along k spill with three: they keep two.
#ifndef FRAG_DEPTH
#define FRAG_DEPTH ((THREAD_M == 16 && B_MODE != LOAD_ELEM_K) ? 3 : 2)
#endif
#ifndef STREAM_K
#define STREAM_K 0  // 1: the stream-K entry (fastmm_simt_cp_async_stream_k) instead of the plain one
#endif
#ifndef A_MODE
#define A_MODE LOAD_ELEM_K
#endif
#ifndef B_MODE
#define B_MODE LOAD_VEC_FAST
#endif
// Blocks per SM the registers must allow. Left free, ptxas hoists a whole k-tile of fragment
// loads for the 8 x 8 thread tile (up to 255 registers), which costs the small tiles a third of
// their resident warps; 12 warps per SM (168 registers) is what they had, without spills.
#ifndef CP_MIN_BLOCKS
#define CP_MIN_BLOCKS ((THREAD_M == 8 && BK == 8) ? 384 / THREADS : MIN_BLOCKS)
#endif

// Copy units a thread holds (single floats along k, each in its own row) from which their
// source rows are chained (AsyncTile::ROW_CHAIN): the narrow tiles' A (16); of the other tiles
// only (1, 4, 4)'s B copied along k (not a planned tile). 8 would take in the 8-unit copies of the
// standard tiles too (their A_MODE 2 spills of 4-8 bytes go), untimed.
#ifndef ROW_CHAIN_MIN
#define ROW_CHAIN_MIN 16
#endif

#define A_RING_BACK ((STAGES - 1) * (A_TILE_FLOATS * 4))  // bytes from the last stage to stage 0
#define B_RING_BACK ((STAGES - 1) * (B_TILE_FLOATS * 4))

#if __CUDA_ARCH__ >= 800
// p + bytes, opaque to the compiler: the pointer stays one 64-bit value (one add per copy)
// instead of being re-derived from its parts.
__device__ __forceinline__ const float* add_bytes(const float* p, i64 bytes) {
    const float* r;
    asm("add.s64 %0, %1, %2;\n" : "=l"(r) : "l"(p), "l"(bytes));
    return r;
}

// The copy of a row-chained unit (AsyncTile::ROW_CHAIN): if the unit's row exists (q > fp, q:
// rows from the thread's first to the operand's end, fp: the unit's distance from the first), the
// source steps one row on (src += step) and is copied, else the source stays at the last row that
// exists (or the clamped first row: always mapped) and the destination is zero-filled (ignore-src).
// One predicate serves the step and the copy; nothing per unit is held across the loop (ptxas
// makes it an ISETP, the 64-bit add, two SEL and the copy: the edge tiles' loop, see tile_product).
template <int BYTES>
__device__ __forceinline__ void cp_async_row_step(unsigned dst, const float*& src, i64 step, int q, int fp) {
    static_assert(BYTES == 16 || BYTES == 4, "cp.async copies 4 or 16 bytes here");
    if (BYTES == 16)
        asm volatile("{\n .reg .pred ign;\n setp.le.s32 ign, %1, %3;\n @!ign add.s64 %0, %0, %2;\n"
                     " cp.async.cg.shared.global [%4], [%0], 16, ign;\n}\n"
                     : "+l"(src) : "r"(q), "l"(step), "r"(fp), "r"(dst) : "memory");
    else
        asm volatile("{\n .reg .pred ign;\n setp.le.s32 ign, %1, %3;\n @!ign add.s64 %0, %0, %2;\n"
                     " cp.async.ca.shared.global [%4], [%0], 4, ign;\n}\n"
                     : "+l"(src) : "r"(q), "l"(step), "r"(fp), "r"(dst) : "memory");
}

// 16-byte shared load from a 32-bit shared address. volatile: stays after the barrier.
__device__ __forceinline__ void lds128(float* v, unsigned addr) {
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3]) : "r"(addr));
}

// A thread's A and B values for one k-step of a stage whose thread fragments start at shared
// addresses a_addr, b_addr.
struct Frag {
    float a[THREAD_M], b[THREAD_N];
    __device__ __forceinline__ void load(unsigned a_addr, unsigned b_addr, int k) {
#pragma unroll
        for (int g = 0; g < THREAD_M / 4; ++g) lds128(&a[4 * g], a_addr + (k * A_STRIDE + g * A_GROUP_STRIDE) * 4);
#pragma unroll
        for (int h = 0; h < 2; ++h) lds128(&b[4 * h], b_addr + (k * B_STRIDE + h * B_GROUP_STRIDE) * 4);
    }
};

// One k-tile from shared memory, with `copies` (the next tile's cp.async) issued after the
// first k-step's FFMAs. The loads of step k + 1 are issued before the FFMAs of step k (in
// program order; the volatile loads also stay in that order around the copies), so step 1's
// loads are in flight while step 0 and the copies issue, instead of waiting behind the copies.
template <class Copies>
__device__ __forceinline__ void compute_tile_at(unsigned a_addr, unsigned b_addr, float acc[THREAD_M][THREAD_N],
                                                const Copies& copies) {
    constexpr int D = FRAG_DEPTH;
    Frag f[D];
#pragma unroll
    for (int d = 0; d + 1 < D; ++d) f[d].load(a_addr, b_addr, d);
#pragma unroll
    for (int k = 0; k < BK; ++k) {
        if (k + D - 1 < BK) f[(k + D - 1) % D].load(a_addr, b_addr, k + D - 1);
        outer_product(f[k % D].a, f[k % D].b, acc);
        if (k == 0) copies();
    }
}

// A thread's copy units of one operand (geometry: TileMap): per unit a pointer at k0 = 0, plus
// a byte offset along k per tile. A unit whose row / column lies outside the operand (f >= F)
// points at the tile's first row / column (f0 < F) instead, and copies with src-size 0 (zero
// fill): its address stays mapped for every k-tile inside K, so interior copies need no select.
template <int MODE, int FT>
struct AsyncTile {
    typedef TileMap<MODE, FT> Map;
    static_assert(MODE != LOAD_VEC_K, "cp.async cannot transpose a 16-byte vector");
    static constexpr int P = Map::PER_THREAD;
    static constexpr int BYTES = Map::UNIT * 4;
    // Units in P different rows (DF != 0: single floats along k), many of them (the narrow tiles'
    // A, 16 a thread): one pointer, stepped a row per unit (see cp_async_row_step), instead of a
    // pointer per unit (32 registers) and the row bits, which ptxas held pre-shifted (up to 16
    // more), across the main loop: at the 255-register cap those builds spilled 16-136 bytes
    // (ptxas -v, sm_80 / 86 / 90). Where the tile lies inside the operand the chain needs no
    // predicate: one 64-bit add and the copy per unit, one instruction fewer than before.
    static constexpr bool ROW_CHAIN = Map::DF != 0 && P >= ROW_CHAIN_MIN;
    static_assert(!ROW_CHAIN || Map::DK == 0, "row-chained units share their k");
    const float* src[ROW_CHAIN ? 1 : P];  // unit p at k0 = 0 (row / column clamped into the operand, see above)
    i64 rstep;            // ROW_CHAIN: DF * sF * 4, bytes from unit p to unit p + 1
    int q_rem;            // ROW_CHAIN: F - f0 - f_t; unit p's row exists iff p * DF < q_rem
    i64 kstep;            // BK * sK * 4: bytes from one k-tile to the next
    i64 dk;               // DK * sK * 4: bytes from unit p to unit p + 1 when they share a row
    unsigned dst;         // shared byte address of unit 0 in stage 0
    unsigned f_ok;        // bit p: unit p's row / column exists
    int k_t;

    // S: stage 0 of this operand's shared buffer.
    __device__ __forceinline__ void init(const float* base, int F, i64 sF, i64 sK, int f0,
                                         const float* S, int stride) {
        const int r = threadIdx.x / Map::ROW_UNITS, c = (threadIdx.x % Map::ROW_UNITS) * Map::UNIT;
        k_t = Map::ROWS_ARE_K ? r : c;
        const int f_t = Map::ROWS_ARE_K ? c : r;
        kstep = (i64)BK * sK * 4;
        dk = (i64)Map::DK * sK * 4;
        f_ok = 0;
        if constexpr (ROW_CHAIN) {
            rstep = (i64)Map::DF * sF * 4;
            q_rem = F - f0 - f_t;
            src[0] = base + (i64)(q_rem > 0 ? f0 + f_t : f0) * sF + (i64)k_t * sK;
        } else {
#pragma unroll
            for (int p = 0; p < P; ++p) {
                const int f = f0 + f_t + p * Map::DF;
                const bool ok = f < F;
                f_ok |= (unsigned)ok << p;
                src[p] = base + (i64)(ok ? f : f0) * sF + (i64)(k_t + p * Map::DK) * sK;
            }
        }
        dst = smem_addr(S + k_t * stride + f_t);
    }
    // Destination of unit p within a stage: a constant offset from unit 0.
    static __device__ __forceinline__ unsigned dst_off(int p, int stride) {
        return (unsigned)(p * (Map::DK * stride + Map::DF)) * 4u;
    }
    // Source of unit p for the k-tile koff bytes along k from k0 = 0. Units that share their row
    // (DF == 0) and are many are reached from unit 0 by steps of dk: one live pointer instead of
    // one per unit (registers), for two more adds per tile.
    static constexpr bool CHAIN = Map::DF == 0 && P > 2;
    __device__ __forceinline__ const float* unit_src(int p, i64 koff, const float* prev) const {
        return CHAIN && p > 0 ? add_bytes(prev, dk) : add_bytes(src[p], koff);
    }
    // Copy the k-tile koff = k0 * sK * 4 bytes along k into the stage at byte offset `stage` from
    // stage 0; every unit lies inside K.
    // FULL (ROW_CHAIN): every unit's row exists (the tile lies inside the operand along f), so
    // none is predicated: per unit one 64-bit add and the copy.
    template <bool FULL = false>
    __device__ __forceinline__ void copy_interior(unsigned stage, int stride, i64 koff) const {
        if constexpr (ROW_CHAIN && FULL) {
            const float* s = add_bytes(src[0], koff);
#pragma unroll
            for (int p = 0; p < P; ++p) {
                if (p > 0) s = add_bytes(s, rstep);
                cp_async_to<BYTES>(dst + stage + dst_off(p, stride), s, true);
            }
            return;
        } else if constexpr (ROW_CHAIN) {
            row_chain(stage, stride, add_bytes(src[0], koff), q_rem);
            return;
        }
        const float* s = nullptr;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            s = unit_src(p, koff, s);
            cp_async_to<BYTES>(dst + stage + dst_off(p, stride), s, (f_ok >> p) & 1u);
        }
    }
    // ROW_CHAIN: unit 0 from s (its row, or row f0 where it does not exist; or the operand's base
    // past K), unit p from s stepped p rows on while they exist (q: see cp_async_row_step).
    __device__ __forceinline__ void row_chain(unsigned stage, int stride, const float* s, int q) const {
        cp_async_to<BYTES>(dst + stage, s, q > 0);
#pragma unroll
        for (int p = 1; p < P; ++p)
            cp_async_row_step<BYTES>(dst + stage + dst_off(p, stride), s, rstep, q, p * Map::DF);
    }
    // The same for the k-tile at k0, which may reach past K: units at k >= K read nothing (the
    // operand's base stands in as their mapped address) and are zero-filled.
    __device__ __forceinline__ void copy_checked(unsigned stage, int stride, int k0, int K, const float* base,
                                                 i64 koff) const {
        if constexpr (ROW_CHAIN) {  // (every unit at k0 + k_t: one k check; past K nothing steps)
            const bool k_in = k0 + k_t < K;
            row_chain(stage, stride, k_in ? add_bytes(src[0], koff) : base, k_in ? q_rem : 0);
            return;
        }
        const float* s = nullptr;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            s = unit_src(p, koff, s);
            const bool k_in = k0 + k_t + p * Map::DK < K;
            cp_async_to<BYTES>(dst + stage + dst_off(p, stride), k_in ? s : base, k_in && ((f_ok >> p) & 1u));
        }
    }
};

// acc = the product of A's rows m0 .. m0 + BM and B's columns n0 .. n0 + BN over k-tiles
// [kt_begin, kt_end) (acc starts at zero): the cp.async pipeline for one output tile. Leaves
// shared memory free for the next tile (every copy landed, every read done).
__device__ __forceinline__ void tile_product(const float* Ab, const float* Bb, int M, int N, int K,
                                             i64 sAm, i64 sAk, i64 sBk, i64 sBn, int m0, int n0,
                                             int kt_begin, int kt_end, float* As, float* Bs, int am, int bn,
                                             float acc[THREAD_M][THREAD_N]) {
    // k-tiles below kt_full lie wholly inside K; only kt_full itself may be partial.
    const int kt_full = min(kt_end, K / BK);
    AsyncTile<A_MODE, BM> ca;
    AsyncTile<B_MODE, BN> cb;
    ca.init(Ab, M, sAm, sAk, m0, As, A_STRIDE);
    cb.init(Bb, N, sBn, sBk, n0, Bs, B_STRIDE);
    zero_tile(acc);

    // Prologue: STAGES-1 tiles in flight. Every thread commits a group per step, even an empty
    // one, so the wait counts below stay uniform.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        const int kt = kt_begin + s;
        if (kt < kt_end) {
            ca.copy_checked(s * A_TILE_FLOATS * 4, A_STRIDE, kt * BK, K, Ab, (i64)kt * ca.kstep);
            cb.copy_checked(s * B_TILE_FLOATS * 4, B_STRIDE, kt * BK, K, Bb, (i64)kt * cb.kstep);
        }
        cp_async_commit();
    }
    // Tile kt (stage (kt - kt_begin) % STAGES) is read at shared addresses at / bt (this thread's
    // fragments); tile kt + STAGES - 1 is copied to a_wr / b_wr (unit 0) in the stage tile kt - 1
    // was read from, free once every warp passed this iteration's barrier. All stepped, not
    // recomputed: the stage index itself is never formed. From the last stage the read addresses
    // step back to stage 0 by a constant (A_RING_BACK, B_RING_BACK), and a copy address is a read
    // address plus a constant: the loops hold no stage-0 address. Kernels with many copy pointers
    // (single-float A and B along k on the 128 x 256 tile: 4 + 8) sit at the 255-register cap,
    // where NVRTC 13.0's ptxas spilled a stage-0 address (an 8-byte stack frame, reloaded every
    // k-tile; the 64 x 64 tile at its 168-register cap likewise); this form needs two registers
    // fewer, for at most 2 more integer instructions per k-tile (of 600-1150; issue 16).
    const unsigned a_rd = smem_addr(As + am), b_rd = smem_addr(Bs + bn);
    const unsigned a_last = a_rd + (STAGES - 1) * (A_TILE_FLOATS * 4);
    const unsigned a_to_wr = ca.dst - a_rd, b_to_wr = cb.dst - b_rd;
    unsigned at = a_rd, bt = b_rd;
    unsigned a_wr = ca.dst + (STAGES - 1) * (A_TILE_FLOATS * 4);
    unsigned b_wr = cb.dst + (STAGES - 1) * (B_TILE_FLOATS * 4);
    // Main loop: tiles kt_begin .. kt_begin + n_main - 1, whose copy (tile kt + STAGES - 1) lies
    // wholly inside K: no k check, one 64-bit add per unit.
    const int n_main = max(0, kt_full - (STAGES - 1) - kt_begin);
    i64 a_koff = (i64)(kt_begin + STAGES - 1) * ca.kstep;  // the first tile it copies
    i64 b_koff = (i64)(kt_begin + STAGES - 1) * cb.kstep;
    // (full: a constant at each call below, so each inlined copy of the loop keeps one of the
    // two copy forms and no branch. Not a generic lambda: NVRTC 13.0 takes those for host code.)
    auto main_loop = [&](const bool full) {
        for (int n = n_main; n > 0; --n) {
            cp_async_wait<STAGES - 2>();   // tile kt has landed (for this thread's copies)
            __syncthreads();               // ... and for everyone's; stage a_wr is free again
            // The copies go after the first k-step, so their address arithmetic overlaps FFMAs
            // instead of stalling every warp right after the barrier.
            compute_tile_at(at, bt, acc, [&] {
                if (full) {
                    ca.template copy_interior<true>(a_wr - ca.dst, A_STRIDE, a_koff);
                    cb.template copy_interior<true>(b_wr - cb.dst, B_STRIDE, b_koff);
                } else {
                    ca.template copy_interior<false>(a_wr - ca.dst, A_STRIDE, a_koff);
                    cb.template copy_interior<false>(b_wr - cb.dst, B_STRIDE, b_koff);
                }
                cp_async_commit();
            });
            a_koff += ca.kstep;
            b_koff += cb.kstep;
            a_wr = at + a_to_wr;
            b_wr = bt + b_to_wr;
            const bool wrap = at == a_last;
            at = wrap ? at - A_RING_BACK : at + A_TILE_FLOATS * 4;
            bt = wrap ? bt - B_RING_BACK : bt + B_TILE_FLOATS * 4;
        }
    };
    // Row-chained copies (AsyncTile::ROW_CHAIN) have a loop of their own for tiles wholly inside
    // the operand along m (n), unpredicated, so that the predicates (and ptxas's selects) cost only
    // the edge tiles: a second copy of the loop in the code. A block-uniform choice: both loops
    // hold barriers. (A branch per k-tile instead put the copies in a block of their own, a serial
    // chain of adds no FFMA could hide.) Other builds: the one loop, as before.
    if constexpr (decltype(ca)::ROW_CHAIN || decltype(cb)::ROW_CHAIN) {
        const bool full = (!decltype(ca)::ROW_CHAIN || m0 + BM <= M) && (!decltype(cb)::ROW_CHAIN || n0 + BN <= N);
        if (full)
            main_loop(true);
        else
            main_loop(false);
    } else {
        main_loop(false);
    }
    // Tail: the last tiles (at most STAGES); its copies, if any, are the last tile, which is
    // partial when K % BK != 0 (or, when the main loop ran no iteration, all tiles after the
    // prologue's): checked copies.
    for (int kt = kt_begin + n_main; kt < kt_end; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        compute_tile_at(at, bt, acc, [&] {
            const int next = kt + STAGES - 1;
            if (next < kt_end) {
                ca.copy_checked(a_wr - ca.dst, A_STRIDE, next * BK, K, Ab, (i64)next * ca.kstep);
                cb.copy_checked(b_wr - cb.dst, B_STRIDE, next * BK, K, Bb, (i64)next * cb.kstep);
            }
            cp_async_commit();
        });
        a_wr = at + a_to_wr;
        b_wr = bt + b_to_wr;
        const bool wrap = at == a_last;
        at = wrap ? at - A_RING_BACK : at + A_TILE_FLOATS * 4;
        bt = wrap ? bt - B_RING_BACK : bt + B_TILE_FLOATS * 4;
    }
    cp_async_wait<0>();
    __syncthreads();  // all reads of shared memory done before the next tile's prologue
}
#endif

#ifndef C_STAGED
#define C_STAGED 0  // 1: the final tile store goes through shared memory (store_tile_staged)
#endif
#if C_STAGED
// C in single floats with contiguous rows (N % 4 != 0: a vocabulary of 50257, 4095 columns), or
// any C with contiguous rows and a bias over its columns (EPILOGUE_FORM 1, below).
// Stored from the registers, a thread's 4-column groups put 4 bytes a lane 16 bytes apart: an
// instruction touches 16 sectors where a float4 store of the same lanes fills them, and at one
// block an SM (the 128 x 256 tile) the tile's store is not hidden: 4096 x 50257 x 768 W^T ran
// 45.1 TFLOP/s against 49.3 at N = 50256 (NOTES run 33). So the tile goes through the pipeline's
// buffers, idle after tile_product's last barrier, and leaves in rows of consecutive floats a
// warp (4-5 sectors an instruction). One pass: the planner asks for it only where the buffers
// hold the whole tile, or (SimtCpAsync.stage_c_all_tiles) grows the shared memory to
// C_STAGE_FLOATS (in passes, acc stays live across the first and the register-capped builds
// spilled 4-100 bytes). The row pitch keeps a float4 write of the 8 x 8 tiles' lanes (4
// along n, 64 bytes a row) on two rows' disjoint banks.
// With a bias (F.linear's, EPILOGUE_FORM 1) the float4 stores from the registers cost 3.2-3.4%
// of an 8192 x 1024 x 1024 product over the same stores without one: whatever the store reads
// D with, the main loop's registers are allocated around it (ptxas) and the loop came out
// slower each time. Staged, a thread reads one bias value and the loop is not slowed:
// 1.4-1.5% over the plain product at K = 1024, and 1.0% under it at K = 4096 (NOTES run 34).
#define C_PITCH (BN + (LANES_N == 4 ? 16 : 0))
#ifndef C_STAGE_FLOATS
// (the planner passes more where it grows the dynamic shared memory beyond the pipeline's to
// hold the tile)
#define C_STAGE_FLOATS (STAGES * (A_TILE_FLOATS + B_TILE_FLOATS))
#endif
__device__ __forceinline__ void store_tile_staged(float* stage, float* Cb, int M, int N, i64 sCm, int m0, int n0,
                                                  const float acc[THREAD_M][THREAD_N], const Epilogue& epi) {
    static_assert(BM * C_PITCH <= C_STAGE_FLOATS, "the tile must fit the shared memory");
    // The thread's place read again, opaque to the compiler: else the store's addresses (its
    // fragment's row and column, the loop's first unit) are computed once before the tile loop
    // and held across the main loop, at the register cap: 4-136 bytes of spills in 14 of 70
    // staged builds (NVRTC 13.5, sm_90; NOTES.md run 50). Recomputed here, a few integer
    // instructions a tile.
    unsigned tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    int am, bn;
    thread_origin_of(tid, am, bn);
#pragma unroll
    for (int i = 0; i < THREAD_M; ++i) {
        const int r = am + (i / 4) * A_GROUP_STRIDE + (i % 4);
#pragma unroll
        for (int h = 0; h < 2; ++h)
            *(float4*)&stage[r * C_PITCH + bn + h * B_GROUP_STRIDE] =
                make_float4(acc[i][4 * h], acc[i][4 * h + 1], acc[i][4 * h + 2], acc[i][4 * h + 3]);
    }
    __syncthreads();
    const int rows = min(BM, M - m0), cols = min(BN, N - n0);
#if EPILOGUE_FORM == 1
    // A bias over columns: the threads tile whole rows, so a thread stores the same column on
    // every row and reads that column's value once.
    static_assert(THREADS % BN == 0, "a thread's column must be the same on every row");
    const float d = epi.column(n0 + (int)tid % BN, N);
#endif
    for (int u = (int)tid; u < rows * BN; u += THREADS) {
        const int r = u / BN, c = u % BN;
        if (c < cols) {
            const int m = m0 + r, n = n0 + c;
#if EPILOGUE_FORM == 1
            Cb[(i64)m * sCm + n] = epi.apply(stage[r * C_PITCH + c], d);
#else
            Cb[(i64)m * sCm + n] = epi(stage[r * C_PITCH + c], m, n);
#endif
        }
    }
    __syncthreads();  // the reads done before the next tile's prologue writes the buffers
}
#endif

// The final store of a tile (or a split slice into its workspace): through shared memory where
// the planner asks (C_STAGED), else from the registers.
__device__ __forceinline__ void store_final(float* smem, float* Cb, int M, int N, i64 sCm, i64 sCn, int m0, int n0,
                                            int am, int bn, const float acc[THREAD_M][THREAD_N], const Epilogue& epi) {
#if C_STAGED
    (void)sCn, (void)am, (void)bn;  // (contiguous rows: the planner's condition; the thread's place read again)
    store_tile_staged(smem, Cb, M, N, sCm, m0, n0, acc, epi);
#else
    (void)smem;
    store_tile(Cb, M, N, sCm, sCn, m0, n0, am, bn, acc, epi);
#endif
}

#ifndef SPLIT_PAIR
#define SPLIT_PAIR 0  // 1 (sm_90): split-K blocks in cluster pairs that add their partial tiles
#endif

#if SPLIT_PAIR
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "SPLIT_PAIR needs thread-block clusters (sm_90)"
#endif
#define SPLIT_PAIR_ATTR __cluster_dims__(1, 2, 1)

// Split-K in cluster pairs: the two blocks of a cluster (split rows 2j and 2j + 1) computed the
// same tile over neighbouring slices of K. Each keeps half of every thread's rows (rank 0 rows
// 0 .. THREAD_M/2 - 1, rank 1 the rest) and writes the other half straight into its partner's
// shared memory (distributed shared memory), into a region the partner's pipeline does not use,
// so no wait comes before the writes: one cluster barrier, then each adds what it received. The
// pair's sum goes to one workspace slice: half the partial tiles to store and for the reduce to
// read (largeK: 17.3 -> 8.7 MB; 177.2 us against 180.1 unpaired, NOTES run 14). own + partner's
// value: the same bits whichever block adds (fp32 addition commutes). SEND0 / KEEP0: the first
// row sent / kept. Value (i, 4h .. 4h + 3) of thread t goes to float4 ((i - SEND0) * 2 + h) *
// THREADS + t of the region (consecutive threads, consecutive 16 bytes), read by thread t. The
// region (THREADS * THREAD_M * THREAD_N / 2 floats past the pipeline's, in the dynamic shared
// memory the host sizes) is used once: a split plan's grid has a block column per tile.
template <int SEND0, int KEEP0>
__device__ __forceinline__ void pair_add(float acc[THREAD_M][THREAD_N], float* region, unsigned partner) {
    constexpr int H = THREAD_M / 2;
    static_assert(THREAD_N == 8, "two float4 per thread row");
    const unsigned at = smem_addr(region) + 16u * threadIdx.x;
    cluster_wait();  // the partner has started (its arrive at the kernel's start): its memory exists
#pragma unroll
    for (int i = 0; i < H; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            st_cluster_v4(at + 16u * (i * 2 + h) * THREADS, partner,
                          make_float4(acc[SEND0 + i][4 * h], acc[SEND0 + i][4 * h + 1], acc[SEND0 + i][4 * h + 2],
                                      acc[SEND0 + i][4 * h + 3]));
    cluster_sync();  // both halves have landed (release / acquire); neither block has left
    const float4* in = (const float4*)region;
#pragma unroll
    for (int i = 0; i < H; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float4 v = in[(i * 2 + h) * THREADS + threadIdx.x];
            acc[KEEP0 + i][4 * h] += v.x;
            acc[KEEP0 + i][4 * h + 1] += v.y;
            acc[KEEP0 + i][4 * h + 2] += v.z;
            acc[KEEP0 + i][4 * h + 3] += v.w;
        }
}
#else
#define SPLIT_PAIR_ATTR
#endif

#ifndef SPLIT_FUSED
#define SPLIT_FUSED 0  // S > 1: split-K over S slices whose last block per tile sums them (no reduce launch)
#endif
#if SPLIT_FUSED
#if SPLIT_PAIR
#error "SPLIT_FUSED and SPLIT_PAIR are separate plans"
#endif
// Fused split-K (gridDim.y = SPLIT_FUSED): each block stores its slice of the tile, then the last
// of the tile's blocks to arrive (split_arrive_last, common.cuh) sums the slices in slice order into Out with
// the epilogue: the same bits as splitk_reduce.cu. One launch instead of the GEMM + reduce pair
// (a launch's host cost and the gap between them); the planner takes it where a tile's slices
// are few, since the last block reads them all.
#define SPLIT_FUSED_PARAMS , float* __restrict__ Out, i64 sOm, i64 sOn, unsigned* __restrict__ arrivals
#ifndef OUT_VEC
#define OUT_VEC 0  // Out's rows contiguous, N % 4 == 0, 16-byte aligned: float4 stores
#endif

// The last block's sum: each output of the tile is 0.f + slice 0 + slice 1 + ... (slice order:
// the same bits as splitk_reduce.cu), stored into Out through the epilogue. The block walks the
// tile in units of 4 consecutive n (one float4 where the workspace is float4-able, C_VEC), a
// thread taking SUM_ILP units at a time with all SPLIT_FUSED slices of them loaded before any
// is added: one L2 round trip per SUM_ILP units (the volatile loads stay after
// split_arrive_last's fence).
#define SUM_ILP (8 / SPLIT_FUSED > 0 ? 8 / SPLIT_FUSED : 1)
__device__ __forceinline__ void sum_tile_slices(const float* W, i64 slice, float* Out, i64 sOm, i64 sOn, int M,
                                                int N, int m0, int n0, const Epilogue& epi) {
    constexpr int ROW_UNITS = BN / 4, UNITS = BM * ROW_UNITS;
    for (int u0 = threadIdx.x; u0 < UNITS; u0 += THREADS * SUM_ILP) {
        float v[SUM_ILP][SPLIT_FUSED][4];
#pragma unroll
        for (int u = 0; u < SUM_ILP; ++u) {
            const int unit = u0 + u * THREADS;
            const int m = m0 + unit / ROW_UNITS, n = n0 + (unit % ROW_UNITS) * 4;
            const bool ok = unit < UNITS && m < M;
#pragma unroll
            for (int s = 0; s < SPLIT_FUSED; ++s) {
                const float* p = W + s * slice + (i64)m * N + n;
                if (C_VEC) {  // (N % 4 == 0: the unit is wholly inside or outside)
                    const float4 q = ok && n < N ? ld_l2_v4_ordered(p) : make_float4(0.f, 0.f, 0.f, 0.f);
                    v[u][s][0] = q.x, v[u][s][1] = q.y, v[u][s][2] = q.z, v[u][s][3] = q.w;
                } else {
#pragma unroll
                    for (int j = 0; j < 4; ++j) v[u][s][j] = ok && n + j < N ? ld_l2_ordered(p + j) : 0.f;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < SUM_ILP; ++u) {
            const int unit = u0 + u * THREADS;
            const int m = m0 + unit / ROW_UNITS, n = n0 + (unit % ROW_UNITS) * 4;
            if (unit >= UNITS || m >= M) continue;
            float r[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                r[j] = 0.f;
#pragma unroll
                for (int s = 0; s < SPLIT_FUSED; ++s) r[j] += v[u][s][j];
            }
            if (OUT_VEC) {  // (Out's rows contiguous, N % 4 == 0, 16-byte aligned: all 4 inside or none)
                if (n < N)
                    *(float4*)&Out[(i64)m * sOm + n] = make_float4(epi(r[0], m, n), epi(r[1], m, n + 1),
                                                                   epi(r[2], m, n + 2), epi(r[3], m, n + 3));
            } else {  // (the epilogue reads D only for outputs that exist)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (n + j < N) Out[(i64)m * sOm + (i64)(n + j) * sOn] = epi(r[j], m, n + j);
            }
        }
    }
}
#else
#define SPLIT_FUSED_PARAMS
#endif

#if !STREAM_K
extern "C" __global__ void SPLIT_PAIR_ATTR __launch_bounds__(THREADS, CP_MIN_BLOCKS) fastmm_simt_cp_async(FASTMM_PARAMS SPLIT_FUSED_PARAMS FASTMM_EPILOGUE_PARAMS) {
    FASTMM_UNPACK
    FASTMM_EPILOGUE
#if __CUDA_ARCH__ >= 800
    extern __shared__ __align__(16) float smem[];
    float* As = smem;                             // STAGES x A_TILE_FLOATS
    float* Bs = smem + STAGES * A_TILE_FLOATS;    // STAGES x B_TILE_FLOATS
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    int kt_begin, kt_end;
    split_range(K, BK, kt_begin, kt_end);
#if SPLIT_PAIR
    cluster_arrive_relaxed();  // this block is running (pair_add waits for the partner's)
#endif
    int am, bn;
    thread_origin(am, bn);

#if SPLIT_FUSED
    // A batch of 1 and a block column per tile (the planner's split plans): no loops. Inside the
    // tile and batch loops the sum's values pushed the 8 x 8 thread tiles (capped at 168
    // registers) into 8-184 bytes of spills (ptxas -v, NVRTC 13.5, sm_80-sm_90).
    {
        int tm, tn;
        tile_coords<8>(blockIdx.x, tiles_m, tiles_n, tm, tn);
        float acc[THREAD_M][THREAD_N];
        tile_product(A, B, M, N, K, sAm, sAk, sBk, sBn, tm * BM, tn * BN, kt_begin, kt_end, As, Bs, am, bn, acc);
        store_tile_as<C_VEC != 0>(C + (i64)blockIdx.y * sC0, M, N, sCm, sCn, tm * BM, tn * BN, am, bn, acc,
                                  NoEpilogue{});
        if (split_arrive_last(arrivals + blockIdx.x)) {
            // the tile's origin read again (an opaque read of blockIdx.x: the compiler would
            // otherwise keep it from before the main loop, a register there)
            unsigned bx;
            asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(bx));
            tile_coords<8>((int)bx, tiles_m, tiles_n, tm, tn);
            sum_tile_slices(C, sC0, Out, sOm, sOn, M, N, tm * BM, tn * BN, epi);
            if (threadIdx.x == 0) *(volatile unsigned*)(arrivals + blockIdx.x) = 0u;  // for the next launch
        }
    }
#else
    for (int z = blockIdx.z; z < batch_total; z += gridDim.z) {
        FASTMM_BATCH_OFFSETS(z)
        for (int tile = blockIdx.x; tile < tiles_m * tiles_n; tile += gridDim.x) {
            int tm, tn;
            tile_coords<8>(tile, tiles_m, tiles_n, tm, tn);
            float acc[THREAD_M][THREAD_N];
            tile_product(Ab, Bb, M, N, K, sAm, sAk, sBk, sBn, tm * BM, tn * BN, kt_begin, kt_end, As, Bs, am,
                         bn, acc);
#if SPLIT_PAIR
            // (a batch of 1: the pair's slice of the workspace, not Cb's slice per split row)
            float* pair_slice = C + (i64)(blockIdx.y >> 1) * sC0;
            (void)Cb;
            float* region = smem + STAGES * (A_TILE_FLOATS + B_TILE_FLOATS);
            if (cluster_rank() == 0) {
                pair_add<THREAD_M / 2, 0>(acc, region, 1);
                store_tile_as<C_VEC != 0, 0, THREAD_M / 2>(pair_slice, M, N, sCm, sCn, tm * BM, tn * BN, am, bn, acc,
                                                          NoEpilogue{});
            } else {
                pair_add<0, THREAD_M / 2>(acc, region, 0);
                store_tile_as<C_VEC != 0, THREAD_M / 2, THREAD_M>(pair_slice, M, N, sCm, sCn, tm * BM, tn * BN, am, bn,
                                                                  acc, NoEpilogue{});
            }
#else
            store_final(smem, Cb, M, N, sCm, sCn, tm * BM, tn * BN, am, bn, acc, epi);  // (split: a slice, EPILOGUE = 0)
#endif
        }
    }
#endif  // SPLIT_FUSED
#endif
}
#else
// Stream-K (a batch of 1): blocks 0 .. whole_tiles - 1 each compute a whole tile (the first
// whole_tiles in tile order, whole waves of them) into C. The tiles after them would leave a
// last wave part-empty (8192x4096 in 128x256 tiles: 1024 = 7.76 waves of 132), so their k-tiles
// are dealt out evenly instead: the remaining blocks (one wave) each take `iters` consecutive
// k-tiles of the tile-major sequence of those tiles, a stretch that spans pieces of one or two
// tiles (of more where iters > k_tiles: the kernel allows it, the planner does not plan it). Each piece goes to its own workspace slot (slot j of stream-K block b: W + (b * segs +
// j) * BM * BN, dense BM x BN), and stream_k_fixup.cu sums every tile's pieces in block order:
// the same bits every run, no atomics, no block waiting for another.
extern "C" __global__ void __launch_bounds__(THREADS, CP_MIN_BLOCKS)
    fastmm_simt_cp_async_stream_k(FASTMM_PARAMS, float* __restrict__ W, i64 whole_tiles_, i64 iters_ FASTMM_EPILOGUE_PARAMS) {
    FASTMM_UNPACK
    FASTMM_EPILOGUE
#if __CUDA_ARCH__ >= 800
    extern __shared__ __align__(16) float smem[];
    float* As = smem;
    float* Bs = smem + STAGES * A_TILE_FLOATS;
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    const int k_tiles = (K + BK - 1) / BK;
    const int whole_tiles = (int)whole_tiles_;
    int am, bn;
    thread_origin(am, bn);
    // A whole-tile block's tile is one stretch of the same tile-major k-tile sequence: one loop
    // (one copy of the pipeline in the code) serves both kinds of block. 32-bit: the planner
    // keeps whole_tiles x k_tiles + blocks x iters (the end of the last stretch) below 2^31.
    const bool whole = (int)blockIdx.x < whole_tiles;
    const int b = (int)blockIdx.x - whole_tiles;  // stream-K block (whole-tile blocks: unused)
    const int iters = (int)iters_;
    const int segs = (int)stream_k_segments(iters, k_tiles);
    int g = whole ? (int)blockIdx.x * k_tiles : whole_tiles * k_tiles + b * iters;
    const int g_end = whole ? g + k_tiles : min(g + iters, tiles_m * tiles_n * k_tiles);
    for (int j = 0; g < g_end; ++j) {
        const int t = g / k_tiles;
        const int kb = g - t * k_tiles;
        const int ke = min(k_tiles, g_end - t * k_tiles);
        int tm, tn;
        tile_coords<8>(t, tiles_m, tiles_n, tm, tn);
        float acc[THREAD_M][THREAD_N];
        tile_product(A, B, M, N, K, sAm, sAk, sBk, sBn, tm * BM, tn * BN, kb, ke, As, Bs, am, bn, acc);
        if (whole)  // (uniform over the block)
            store_final(smem, C, M, N, sCm, sCn, tm * BM, tn * BN, am, bn, acc, epi);
        else  // piece j of block b: its own dense BM x BN slot
            store_tile_as<true>(W + (i64)(b * segs + j) * (BM * BN), BM, BN, BN, 1, 0, 0, am, bn, acc, NoEpilogue{});
        g = (t + 1) * k_tiles;
    }
#endif
}
#endif
