// Skinny family: M <= 32 rows (decode-style GEMV-like products), memory-bound on reading B.
// The floor is reading B once, so every B element is loaded by exactly one thread, as part of a
// float4 (B_VEC) or four floats, coalesced across the warp: lane l of a warp owns columns
// n0 + 4l .. n0 + 4l + 3 and warp w handles the k's with k % 8 == w. A (tiny) is staged in
// shared memory one KCHUNK of k at a time and read as broadcasts. The 8 warps' partial sums are
// added in warp order through shared memory (deterministic), and with split-K (gridDim.y > 1)
// each block row writes its slice of the workspace for splitk_reduce.cu.
#include "common.cuh"

// SK_V2 = 1 selects the second design below (benchmarks/NOTES.md, "skinny v2"); 0 (the default)
// is the kernel above it, unchanged.
#ifndef SK_V2
#define SK_V2 0
#endif

#if !SK_V2

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
extern "C" __global__ void __launch_bounds__(THREADS, 1) fastmm_skinny(FASTMM_PARAMS FASTMM_EPILOGUE_PARAMS) {
    grid_dependency_sync();  // launched as a programmatic dependent launch on sm_90+ (ptx.cuh)
    FASTMM_UNPACK
    FASTMM_EPILOGUE
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
                if (m < M && c < N) Cb[(i64)m * sCm + (i64)c * sCn] = epi(red[i], m, c);  // (split: EPILOGUE = 0)
            }
        }
    }
}

#else  // SK_V2
// ================================================================================================
// skinny v2 (SK_V2 = 1): more of B in flight per SM, A read as float4, one barrier per stage.
//
// Block: SK_THREADS threads own BN columns (n0 .. n0 + BN) and the block's K range (all of K, or
// one split of it: gridDim.y > 1, as before). A thread owns CPT columns (one or two float4 of a
// B row: 4*cl + c, and with CPT = 8 also BN/2 + 4*cl + c) and "quads" of 4 consecutive k rows.
// LANES_N = BN / CPT lanes span the columns; the other lanes and warps split k into KG groups:
// k-group g takes quads g, g + KG, ... of each stage of KS = 4 * KG * QPT rows. Per k row a
// thread reads CPT/4 float4 of B and MT/4 float4 of A from shared memory (A is stored k-major,
// As[k][m], so the lanes of an 8-lane phase read one or two addresses: broadcasts, no bank
// conflicts) and does MT * CPT FMAs: smem instructions per FFMA = (MT + CPT) / (4 * MT * CPT),
// and only CPT + 4 operand registers are live next to the MT * CPT sums.
//
// Stages of (B tile KS x BN, A tile KS x MT) go through a ring of SK_STAGES slots in dynamic
// shared memory, one __syncthreads per stage:
// SK_PIPE 1 (sm80+): cp.async copies, SK_STAGES - 1 stages of B in flight per block.
// SK_PIPE 0 (any arch): SK_STAGES = 2; the next stage is loaded into registers (each thread its
//   share: 4 * QPT * CPT floats of B) before this stage's FMAs and stored to the other slot after.
//
// End of a tile: the KG partial sums of each output are added in a fixed tree (deterministic):
// first across the GPW k-groups of a warp by a halving exchange (each shuffle step sends half of
// the remaining values, so a lane ends with MT*CPT/GPW finished sums), then across warps through
// shared memory in warp order (SK_RED slots, each summing warps slot, slot + SK_RED, ... in order,
// then the slots in order).
#ifndef MT
#define MT 16  // rows per thread: a multiple of 4 up to 32 (the planner passes M rounded up)
#endif
#ifndef B_VEC
#define B_VEC 1
#endif
#ifndef A_KFAST
#define A_KFAST 1  // A k-contiguous: copy A with k fastest across threads (else m fastest)
#endif
#ifndef A_VEC
#define A_VEC 0  // SK_PIPE 0: load A[m][k..k+3] as one float4 (k-contiguous, K % 4 == 0, aligned)
#endif
#ifndef SK_PIPE
#define SK_PIPE 1
#endif
#ifndef SK_THREADS
#define SK_THREADS 256
#endif
#ifndef SK_BN
#define SK_BN 32
#endif
#ifndef SK_CPT
#define SK_CPT 8
#endif
#ifndef SK_QPT
#define SK_QPT 1
#endif
#ifndef SK_STAGES
#define SK_STAGES 3
#endif
#ifndef SK_RED
#define SK_RED (SK_THREADS / 32)
#endif
#ifndef SK_MINB
#define SK_MINB 1
#endif
#ifndef SK_RUNROLL
#define SK_RUNROLL 4  // k rows unrolled in the FMA loop: fewer = fewer registers for loads hoisted ahead
#endif
#ifndef SK_FUSED
#define SK_FUSED 0  // split-K summed by the last block of each column tile (split_arrive_last)
#endif

#define WARPS (SK_THREADS / 32)
#define BN SK_BN
#define CPT SK_CPT
#define NH (CPT / 4)                 // float4 per B row per thread
#define LANES_N (BN / CPT)           // lanes across the columns
#define GPW (32 / LANES_N)           // k-groups per warp
#define KG (SK_THREADS / LANES_N)    // k-groups per block
#define KS (4 * KG * SK_QPT)         // k rows per stage
#define BNP (BN + (LANES_N == 4 ? 4 : 0))  // B tile row pitch: rows 4 apart land 16 banks apart
#define AP (MT % 8 == 0 ? MT + 4 : MT)  // A tile pitch per k row: rows 4 apart, 16 banks apart
#define STAGE_FLOATS (KS * BNP + KS * AP)
#define VPT (MT * CPT)               // partial sums per thread
#define VPL (VPT / GPW)              // finished sums per lane after the in-warp exchange
#define B_VR (BN / 4)                // float4 per B tile row
#define B_RSTEP (SK_THREADS / B_VR)  // B tile rows apart of one thread's float4 copies
#define B_PER (KS / B_RSTEP)         // float4 of a B tile per thread (= SK_QPT * CPT)
#define A_ELEMS ((MT * KS + SK_THREADS - 1) / SK_THREADS)  // A elements (4-byte) per thread
#define A_VECS ((MT * KS / 4 + SK_THREADS - 1) / SK_THREADS)  // A float4 per thread (A_VEC)

static_assert(CPT == 4 || CPT == 8, "SK_CPT is 4 or 8");
static_assert(BN % CPT == 0 && (LANES_N == 4 || LANES_N == 8 || LANES_N == 16 || LANES_N == 32),
              "BN / CPT lanes must be 4, 8, 16 or 32");
static_assert(SK_THREADS % 32 == 0 && WARPS % SK_RED == 0, "SK_RED must divide the warp count");
static_assert(VPT % GPW == 0, "MT * CPT must be a multiple of the k-groups per warp");
static_assert(MT % 4 == 0 && MT >= 4 && MT <= 32, "MT is a multiple of 4, 4..32");
static_assert(SK_THREADS % B_VR == 0 && KS % B_RSTEP == 0, "B tile copy mapping");
static_assert(SK_STAGES >= 2 && (SK_PIPE || SK_STAGES == 2), "a ring of >= 2 slots (2 for SK_PIPE 0)");
#if SK_PIPE && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "SK_PIPE 1 needs cp.async (sm_80+)"
#endif

// Element i of a stage's A tile (MT x KS): k fastest across threads when A is k-contiguous.
#if A_KFAST
#define SK_A_MK(i, m, k) const int m = (i) / KS, k = (i) % KS;
#else
#define SK_A_MK(i, m, k) const int m = (i) % MT, k = (i) / MT;
#endif

// When the thread count is a multiple of the fast extent, a thread's A elements are one (m, k)
// stepped by a constant: then one running pointer serves them all (no 64-bit address per element).
#if A_KFAST
#define A_REGULAR (SK_THREADS % KS == 0)
#define A_DM (SK_THREADS / KS)
#define A_DK 0
#else
#define A_REGULAR (SK_THREADS % MT == 0)
#define A_DM 0
#define A_DK (SK_THREADS / MT)
#endif

__device__ __forceinline__ constexpr int sk_log2(int x) { return x <= 1 ? 0 : 1 + sk_log2(x / 2); }
#define LOG_GPW sk_log2(GPW)

// The same pointer, but opaque to the optimiser: addresses derived from it inside a stage cannot be
// hoisted out of the stage loop, where the copies' 64-bit addresses would each hold two registers
// for the whole loop (ptxas spilled them).
__device__ __forceinline__ const float* sk_opaque(const float* p) {
    asm volatile("" : "+l"(p));
    return p;
}

// Where a stage's rows [k0, k0 + KS) come from; rows at or past kend (and columns past N, rows
// of A past M) read as zeros.
struct SkSrc {
    const float* Bb;
    const float* Ab;
    i64 sAm, sAk, sBk, sBn;
    int kend, n0, M, N;
};

#if SK_PIPE
// Issue the cp.async copies of the stage starting at row k0 into one ring slot.
__device__ __forceinline__ void sk_copy_stage(float* Bs, float* As, const SkSrc& x, int k0) {
    const int tid = threadIdx.x;
    const float* Bb = sk_opaque(x.Bb);
    const float* Ab = sk_opaque(x.Ab);
#if B_VEC
    // a thread keeps its column, its rows step by B_RSTEP
    const int r0 = tid / B_VR, c = (tid % B_VR) * 4;
    const bool col_ok = x.n0 + c < x.N;
    const float* src = Bb + (i64)(k0 + r0) * x.sBk + (x.n0 + c);
    const i64 step = (i64)B_RSTEP * x.sBk;
#pragma unroll
    for (int t = 0; t < B_PER; ++t) {
        const bool ok = col_ok && k0 + r0 + t * B_RSTEP < x.kend;
        cp_async_16(&Bs[(r0 + t * B_RSTEP) * BNP + c], ok ? src : Bb, ok);
        src += step;
    }
#elif SK_THREADS % BN == 0
    // 4-byte copies; a thread keeps its column, its rows step by SK_THREADS / BN
    constexpr int RS = SK_THREADS / BN;
    const int r0 = tid / BN, c = tid % BN;
    const bool col_ok = x.n0 + c < x.N;
    const float* src = Bb + (i64)(k0 + r0) * x.sBk + (i64)(x.n0 + c) * x.sBn;
    const i64 step = (i64)RS * x.sBk;
#pragma unroll 4
    for (int t = 0; t < 4 * B_PER; ++t) {
        const bool ok = col_ok && k0 + r0 + t * RS < x.kend;
        cp_async_4(&Bs[(r0 + t * RS) * BNP + c], ok ? src : Bb, ok);
        src += step;
    }
#else
#pragma unroll 4
    for (int t = 0; t < 4 * B_PER; ++t) {
        const int i = t * SK_THREADS + tid, r = i / BN, c = i % BN;
        const bool ok = k0 + r < x.kend && x.n0 + c < x.N;
        cp_async_4(&Bs[r * BNP + c], ok ? Bb + (i64)(k0 + r) * x.sBk + (i64)(x.n0 + c) * x.sBn : Bb, ok);
    }
#endif
    // A tile, transposed to As[k][m]
#if A_REGULAR
    SK_A_MK(tid, m0, kk0)
    const float* pa = Ab + (i64)m0 * x.sAm + (i64)(k0 + kk0) * x.sAk;
    const i64 astep = (i64)A_DM * x.sAm + (i64)A_DK * x.sAk;
#pragma unroll 4
    for (int t = 0; t < A_ELEMS; ++t) {
        const int m = m0 + t * A_DM, k = kk0 + t * A_DK;
        if (m < MT && k < KS) {  // the slot exists
            const bool ok = m < x.M && k0 + k < x.kend;
            cp_async_4(&As[k * AP + m], ok ? pa : Ab, ok);
        }
        pa += astep;
    }
#else
#pragma unroll 4
    for (int t = 0; t < A_ELEMS; ++t) {
        const int i = t * SK_THREADS + tid;
        if ((MT * KS) % SK_THREADS == 0 || i < MT * KS) {
            SK_A_MK(i, m, k)
            const bool ok = m < x.M && k0 + k < x.kend;
            cp_async_4(&As[k * AP + m], ok ? Ab + (i64)m * x.sAm + (i64)(k0 + k) * x.sAk : Ab, ok);
        }
    }
#endif
}
#else
// SK_PIPE 0: this thread's share of a stage, in registers between the loads and the stores.
struct SkRegs {
#if B_VEC
    float4 b[B_PER];
#else
    float b[4 * B_PER];
#endif
#if A_VEC
    float4 a[A_VECS];
#else
    float a[A_ELEMS];
#endif
};

__device__ __forceinline__ void sk_load_regs(SkRegs& st, const SkSrc& x, int k0) {
    const int tid = threadIdx.x;
    const float* Bb = sk_opaque(x.Bb);
    const float* Ab = sk_opaque(x.Ab);
#if B_VEC
    const int r0 = tid / B_VR, c = (tid % B_VR) * 4;
    const bool col_ok = x.n0 + c < x.N;
    const float* src = Bb + (i64)(k0 + r0) * x.sBk + (x.n0 + c);
    const i64 step = (i64)B_RSTEP * x.sBk;
#pragma unroll
    for (int t = 0; t < B_PER; ++t) {
        st.b[t] = col_ok && k0 + r0 + t * B_RSTEP < x.kend ? *(const float4*)src : make_float4(0.f, 0.f, 0.f, 0.f);
        src += step;
    }
#elif SK_THREADS % BN == 0
    constexpr int RS = SK_THREADS / BN;
    const int r0 = tid / BN, c = tid % BN;
    const bool col_ok = x.n0 + c < x.N;
    const float* src = Bb + (i64)(k0 + r0) * x.sBk + (i64)(x.n0 + c) * x.sBn;
    const i64 step = (i64)RS * x.sBk;
#pragma unroll
    for (int t = 0; t < 4 * B_PER; ++t) {
        st.b[t] = col_ok && k0 + r0 + t * RS < x.kend ? *src : 0.f;
        src += step;
    }
#else
#pragma unroll
    for (int t = 0; t < 4 * B_PER; ++t) {
        const int i = t * SK_THREADS + tid, r = i / BN, c = i % BN;
        st.b[t] = k0 + r < x.kend && x.n0 + c < x.N ? Bb[(i64)(k0 + r) * x.sBk + (i64)(x.n0 + c) * x.sBn] : 0.f;
    }
#endif
#if A_VEC
    constexpr int VK = KS / 4;
#pragma unroll
    for (int t = 0; t < A_VECS; ++t) {
        const int i = t * SK_THREADS + tid, m = i / VK, k = (i % VK) * 4;
        st.a[t] = i < MT * VK && m < x.M && k0 + k < x.kend ? *(const float4*)(Ab + (i64)m * x.sAm + (k0 + k))
                                                            : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#elif A_REGULAR
    SK_A_MK(tid, m0, kk0)
    const float* pa = Ab + (i64)m0 * x.sAm + (i64)(k0 + kk0) * x.sAk;
    const i64 astep = (i64)A_DM * x.sAm + (i64)A_DK * x.sAk;
#pragma unroll
    for (int t = 0; t < A_ELEMS; ++t) {
        const int m = m0 + t * A_DM, k = kk0 + t * A_DK;
        st.a[t] = m < MT && k < KS && m < x.M && k0 + k < x.kend ? *pa : 0.f;
        pa += astep;
    }
#else
#pragma unroll
    for (int t = 0; t < A_ELEMS; ++t) {
        const int i = t * SK_THREADS + tid;
        SK_A_MK(i, m, k)
        st.a[t] = i < MT * KS && m < x.M && k0 + k < x.kend ? Ab[(i64)m * x.sAm + (i64)(k0 + k) * x.sAk] : 0.f;
    }
#endif
}

__device__ __forceinline__ void sk_store_regs(const SkRegs& st, float* Bs, float* As) {
    const int tid = threadIdx.x;
#if B_VEC
    const int r0 = tid / B_VR, c = (tid % B_VR) * 4;
#pragma unroll
    for (int t = 0; t < B_PER; ++t) *(float4*)&Bs[(r0 + t * B_RSTEP) * BNP + c] = st.b[t];
#elif SK_THREADS % BN == 0
    constexpr int RS = SK_THREADS / BN;
    const int r0 = tid / BN, c = tid % BN;
#pragma unroll
    for (int t = 0; t < 4 * B_PER; ++t) Bs[(r0 + t * RS) * BNP + c] = st.b[t];
#else
#pragma unroll
    for (int t = 0; t < 4 * B_PER; ++t) {
        const int i = t * SK_THREADS + tid;
        Bs[(i / BN) * BNP + i % BN] = st.b[t];
    }
#endif
#if A_VEC
    constexpr int VK = KS / 4;
#pragma unroll
    for (int t = 0; t < A_VECS; ++t) {
        const int i = t * SK_THREADS + tid, m = i / VK, k = (i % VK) * 4;
        if (i < MT * VK) {
            As[(k + 0) * AP + m] = st.a[t].x; As[(k + 1) * AP + m] = st.a[t].y;
            As[(k + 2) * AP + m] = st.a[t].z; As[(k + 3) * AP + m] = st.a[t].w;
        }
    }
#else
#pragma unroll
    for (int t = 0; t < A_ELEMS; ++t) {
        const int i = t * SK_THREADS + tid;
        SK_A_MK(i, m, k)
        if (i < MT * KS) As[k * AP + m] = st.a[t];
    }
#endif
}
#endif

// This thread's rows of one stage: acc[m*CPT + h*4 + c] += A[m][r] * B[r][col(h, c)], rows (k)
// ascending; one B row (CPT values) and one A column (MT values, as MT/4 float4) live at a time.
__device__ __forceinline__ void sk_compute_stage(float (&acc)[VPT], const float* Bs, const float* As, int g, int cl) {
#pragma unroll SK_RUNROLL
    for (int qj = 0; qj < 4 * SK_QPT; ++qj) {
        const int r = 4 * (g + KG * (qj / 4)) + qj % 4;
        float4 b[NH];
#pragma unroll
        for (int h = 0; h < NH; ++h) b[h] = *(const float4*)&Bs[r * BNP + h * 4 * LANES_N + 4 * cl];
        const float* arow = As + r * AP;
#pragma unroll
        for (int m4 = 0; m4 < MT / 4; ++m4) {
            const float4 a4 = *(const float4*)&arow[4 * m4];
            const float a[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
            for (int mm = 0; mm < 4; ++mm)
#pragma unroll
                for (int h = 0; h < NH; ++h) {
                    const int o = (4 * m4 + mm) * CPT + h * 4;
                    acc[o + 0] = fmaf(a[mm], b[h].x, acc[o + 0]);
                    acc[o + 1] = fmaf(a[mm], b[h].y, acc[o + 1]);
                    acc[o + 2] = fmaf(a[mm], b[h].z, acc[o + 2]);
                    acc[o + 3] = fmaf(a[mm], b[h].w, acc[o + 3]);
                }
        }
    }
}

// SK_FUSED: C is the split workspace (slice y at C + y * sC0, as for splitk_reduce); the sums go
// to Out (strides sOm, sOn); arrivals holds one zeroed counter per column tile.
#if SK_FUSED
#define SK_FUSED_PARAMS , float* __restrict__ Out, i64 sOm, i64 sOn, unsigned* __restrict__ arrivals
#else
#define SK_FUSED_PARAMS
#endif

extern "C" __global__ void __launch_bounds__(SK_THREADS, SK_MINB) fastmm_skinny(FASTMM_PARAMS SK_FUSED_PARAMS FASTMM_EPILOGUE_PARAMS) {
    grid_dependency_sync();  // launched as a programmatic dependent launch on sm_90+ (ptx.cuh)
    FASTMM_UNPACK
    FASTMM_EPILOGUE
    // A split's blocks store partial sums (slices); the epilogue is for final values only
    const bool final_store = gridDim.y == 1;
    extern __shared__ float4 sk_smem4[];
    float* smem = (float*)sk_smem4;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int cl = lane % LANES_N, gl = lane / LANES_N, g = warp * GPW + gl;
    int kc_begin, kc_end;
    split_range(K, KS, kc_begin, kc_end);
    const int kbeg = kc_begin * KS, nst = kc_end - kc_begin;
    const int tiles_n = (N + BN - 1) / BN;

    for (int z = blockIdx.z; z < batch_total; z += gridDim.z) {
        FASTMM_BATCH_OFFSETS(z)
        for (int tile = blockIdx.x; tile < tiles_n; tile += gridDim.x) {
            const SkSrc x = {Bb, Ab, sAm, sAk, sBk, sBn, min(K, kc_end * KS), tile * BN, M, N};
            float acc[VPT];  // acc[m * CPT + cc]: row m, column cc of this thread
#pragma unroll
            for (int i = 0; i < VPT; ++i) acc[i] = 0.f;

#if SK_PIPE
#pragma unroll 1
            for (int s = 0; s < SK_STAGES - 1; ++s) {  // not unrolled: its copies' addresses would crowd the registers
                if (s < nst) {
                    float* Bs = smem + s * STAGE_FLOATS;
                    sk_copy_stage(Bs, Bs + KS * BNP, x, kbeg + s * KS);
                }
                cp_async_commit();  // always: the group count stays uniform for wait_group
            }
            int slot = 0;
            for (int s = 0; s < nst; ++s) {
                cp_async_wait<SK_STAGES - 2>();  // stage s has landed (this thread's copies) ...
                __syncthreads();                 // ... everyone's; and slot s - 1 is free again
                const int ahead = s + SK_STAGES - 1;
                if (ahead < nst) {
                    float* Bs = smem + (slot == 0 ? SK_STAGES - 1 : slot - 1) * STAGE_FLOATS;
                    sk_copy_stage(Bs, Bs + KS * BNP, x, kbeg + ahead * KS);
                }
                cp_async_commit();
                const float* Bs = smem + slot * STAGE_FLOATS;
                sk_compute_stage(acc, Bs, Bs + KS * BNP, g, cl);
                slot = slot == SK_STAGES - 1 ? 0 : slot + 1;
            }
            cp_async_wait<0>();  // nothing may still be landing in the smem the reduction reuses
#else
            if (nst > 0) {
                SkRegs st;
                sk_load_regs(st, x, kbeg);
                sk_store_regs(st, smem, smem + KS * BNP);
            }
            for (int s = 0; s < nst; ++s) {
                __syncthreads();  // slot s % 2 is stored; slot (s + 1) % 2 is no longer read
                const float* Bs = smem + (s & 1) * STAGE_FLOATS;
                float* Bn = smem + ((s + 1) & 1) * STAGE_FLOATS;
                SkRegs st;
                const bool more = s + 1 < nst;
                if (more) sk_load_regs(st, x, kbeg + (s + 1) * KS);  // in flight during the FMAs
                sk_compute_stage(acc, Bs, Bs + KS * BNP, g, cl);
                if (more) sk_store_regs(st, Bn, Bn + KS * BNP);
            }
#endif
            // --- in-warp: halving exchange over the GPW k-groups (gl bits, highest first) ---
#pragma unroll
            for (int st = 0; st < LOG_GPW; ++st) {
                const int half = VPT >> (st + 1);
                const int bit = LOG_GPW - 1 - st;
                const bool upper = (gl >> bit) & 1;
#pragma unroll
                for (int i = 0; i < VPT / 2; ++i) {  // constant bounds so both loops unroll fully
                    if (i < half) {
                        const float send = upper ? acc[i] : acc[i + half];
                        const float keep = upper ? acc[i + half] : acc[i];
                        acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, LANES_N << bit);
                    }
                }
            }
            // lane (gl, cl) now holds the warp's sums of elements e = gl * VPL + i, e = m * CPT + cc
            // --- across warps: SK_RED slots of MT x BN in shared memory ---
            float* red = smem;
#pragma unroll 1
            for (int round = 0; round < WARPS / SK_RED; ++round) {
                __syncthreads();
                if (warp / SK_RED == round) {
                    float* dst = red + (warp % SK_RED) * (MT * BN);
#pragma unroll
                    for (int i = 0; i < VPL; ++i) {
                        const int e = gl * VPL + i, m = e / CPT, cc = e % CPT;
                        const int idx = m * BN + (cc / 4) * 4 * LANES_N + 4 * cl + cc % 4;
                        dst[idx] = round == 0 ? acc[i] : dst[idx] + acc[i];
                    }
                }
            }
            __syncthreads();
            for (int i = threadIdx.x; i < MT * BN; i += SK_THREADS) {
                const int m = i / BN, c = x.n0 + i % BN;
                if (m < M && c < N) {
                    float sum = red[i];
#pragma unroll
                    for (int s = 1; s < SK_RED; ++s) sum += red[s * (MT * BN) + i];
                    Cb[(i64)m * sCm + (i64)c * sCn] = final_store ? epi(sum, m, c) : sum;
                }
            }
#if SK_FUSED
            if (split_arrive_last(arrivals + tile)) {  // (its __syncthreads also frees red)
                // Up to 8 of a thread's outputs x 4 slices in flight at a time (latency-bound:
                // one output at a time took ~5 us at decode16), each output summed in slice order.
                constexpr int SK_OUT = (MT * BN + SK_THREADS - 1) / SK_THREADS;
                constexpr int SK_STEP = SK_OUT < 8 ? SK_OUT : 8;
                const int S = gridDim.y;
#pragma unroll 1
                for (int j0 = 0; j0 < SK_OUT; j0 += SK_STEP) {
                    float sum[SK_STEP];
#pragma unroll
                    for (int j = 0; j < SK_STEP; ++j) sum[j] = 0.f;
                    for (int s = 0; s < S; s += 4) {
                        float v[4][SK_STEP];
#pragma unroll
                        for (int j = 0; j < SK_STEP; ++j) {
                            const int i = threadIdx.x + (j0 + j) * SK_THREADS, m = i / BN, c = x.n0 + i % BN;
                            const bool ok = i < MT * BN && m < M && c < N;
                            const float* w = C + (ok ? (i64)m * sCm + (i64)c * sCn : 0);
#pragma unroll
                            for (int u = 0; u < 4; ++u)
                                v[u][j] = ok && s + u < S ? ld_l2_ordered(w + (s + u) * sC0) : 0.f;
                        }
#pragma unroll
                        for (int u = 0; u < 4; ++u)
#pragma unroll
                            for (int j = 0; j < SK_STEP; ++j)
                                if (s + u < S) sum[j] += v[u][j];
                    }
#pragma unroll
                    for (int j = 0; j < SK_STEP; ++j) {
                        const int i = threadIdx.x + (j0 + j) * SK_THREADS, m = i / BN, c = x.n0 + i % BN;
                        if (i < MT * BN && m < M && c < N) Out[(i64)m * sOm + (i64)c * sOn] = epi(sum[j], m, c);
                    }
                }
                if (threadIdx.x == 0) *(volatile unsigned*)(arrivals + tile) = 0u;
            }
#endif
            __syncthreads();  // red is the next tile's ring
        }
    }
}
#endif  // SK_V2
