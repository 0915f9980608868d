// Hopper TF32 family (sm_90a only): wgmma.mma_async fed by the bulk tensor copy engine (TMA).
//
// One block = 3 warpgroups (2 with BM = 64, below). Warpgroup 0 is the producer: one thread issues
// the TMA copies of the A tile (BM x BK) and the B tile (BN x BK) of each k-step into a ring of
// STAGES shared-memory slots, each completing on that slot's "full" mbarrier. Warpgroups 1 and 2
// are consumers: each owns 64 rows of the 128-row tile, waits for a slot, issues BK/8 wgmma m64nBNk8 on it and frees
// it (the "empty" mbarrier) once those wgmmas have read it. setmaxnreg moves registers from the
// producer (which needs few) to the consumers (BN/2 fp32 accumulators each). BN is 64, 96, 128,
// 160, 192 or 256: the host picks the width whose whole waves of tiles take least time. A block walks
// work items (tile, batch entry) with a stride of the grid: one each, or, launched one block an
// SM (persistent), several, the producer filling the ring for the next while the consumers store.
//
// TMA_STORE = 1: the consumers stage C in shared memory and the copy engine writes it (see the
// epilogue); else they store it from registers. C_COPY_OUT = 1 (a C whose rows the copy engine
// cannot take: an odd width, a pitch or base not 16-byte aligned): staged the same way, then the
// consumer threads write it out, a warp a row of 32 columns at a time, coalesced single floats.
// From registers such a C went out as single floats two columns apart, 8 rows an instruction: a
// product whose K is short is mostly its C (attention's 197-token scores at K = 64 ran at half
// of cuBLAS's speed, benchmarks/NOTES.md run 53).
//
// EPILOGUE_VECTOR = 1 or 2 (with EPILOGUE, not SPLIT): D is one vector, the same for every row (1:
// F.linear's bias, D[n]) or for every column (2: D[m], the same bias of a product computed as
// C^T). The epilogue is then applied to the accumulators as they are stored or staged, one or two
// D values a thread loaded ahead, instead of a sweep over C after (a D of any strides).
//
// PINGPONG = 1 (tf32, K-major A, no fused epilogue but a vector one; C from registers, or with
// TMA_STORE through a staging region of each warpgroup's own): the two consumer warpgroups take turns
// instead of sharing each tile. Each owns whole 128-row tiles (two m64nBNk8 accumulator sets,
// BN fp32 registers a thread) and the block's work items alternate between them: 0, 2, 4, ... to
// warpgroup 1, 1, 3, 5, ... to warpgroup 2. One warpgroup's main loop runs while the other stores
// its tile, so the tensor core does not wait for epilogues (the cooperative form stores every
// tile with both warpgroups and the tensor core idle: at K = 768-1024 that is 15-25% of a tile).
// The main loops are ordered by two named barriers (ORDER_BAR): a warpgroup starts its next item
// only once the other has waited for every slot of its own. That keeps the ring consumed in the order the
// producer fills it, and it is what makes the full barriers' phase parity safe to wait on: a
// warpgroup never waits on a slot more than one fill ahead of the last one consumed.
//
// BM = 64 (the cooperative form, tf32, K-major A): one consumer warpgroup (256 threads a block) on
// tiles of 64 rows, for products of at most 64 rows (decode's x @ W.t() at M = 17-64): a 128-row
// tile there runs half its wgmmas on the rows past M and copies them from L2 (zeros).
//
// SPLIT = 1 (the cooperative form, C from registers, a batch of 1): K is split over gridDim.y
// blocks per tile (split_range, common.cuh), for products whose tiles alone leave most SMs idle
// (decode's x @ W.t() at M = 17-128: a few dozen tiles of a long K). Each block stores its
// partial tile into its slice of a workspace (M x N slices sC0 apart, contiguous along n, or
// along m where C_VEC = 2); the last of a tile's blocks to arrive sums the slices in slice order into
// Out through the epilogue (the same bits every run; split_finish below). One launch: no reduce
// pass.
//
// Operands are K-major in shared memory (TF32 wgmma reads nothing else from there): the A map
// walks (k, m), the B map walks (k, n), i.e. B^T row-major. An n-contiguous B is never read here
// as such: the host computes C^T = B^T A^T instead, with B^T as an A_MN operand (below). Rows are 32 floats = 128 bytes with the 128-byte swizzle, which the copy engine
// writes and the wgmma descriptors read with the same XOR pattern: conflict-free for both.
// The maps use the TFLOAT32 element type: the copy engine rounds fp32 to TF32 on the way in
// (checked against cvt.rna by tests/test_gpu.py), the tensor core would otherwise truncate.
//
// A_MN = 1: A is MN-major (m contiguous; the host also maps B-row-major products here as
// C^T = B^T A^T). TF32 wgmma cannot read such a tile from shared memory, so each consumer thread
// loads its fragments with 8-byte shared loads and feeds A from registers. The A tile arrives as
// four 32-row boxes (128 bytes of m by BK rows of k, 128-byte swizzle). A warp's 16 fragment rows
// are tile rows chosen so those loads hit every bank exactly twice per instruction (the minimum
// for 256 bytes), and so that fragment rows g and g + 8 are adjacent tile rows: with C^T written
// as C (C_VEC = 2) each thread then stores float2 pairs along C's contiguous dim. On a 64-row
// tile (one consumer warpgroup, none to cover its loads) each k-step's fragments are loaded while
// the step before runs (a_mn_step).
//
// The batch is walked as in common.cuh (z = z0 * batch_inner + z1) through the maps' 3rd and 4th
// dims; an operand broadcast along one of them has that dim of size 1 (BCAST bit clear).
//
// PRECISION_X3 = 1 ("tf32x3"): the host has split each operand into K-major big = tf32(x) and
// small = tf32(x - big) buffers (stage_kmajor.cu), so a slot holds four tiles. Per k-step:
//   small_acc += A_big * B_small + A_small * B_big      (tensor core, the whole K)
//   step      += A_big * B_big                            (tensor core, PROMOTE_EVERY k-steps)
//   acc       += step      (then: fp32, its rounding error added to small_acc: COMPENSATE)
// The big products leave the tensor core every PROMOTE_EVERY k-steps (the host picks 1 or 2 by K,
// families.X3_SHORT_K) because its fp32 accumulation is not round-to-nearest: the error grows with
// the k-steps left in it (measured, benchmarks/NOTES.md run 8); the small terms are 2^-11
// smaller, so their drift does not show. C = acc + small_acc, except where acc is not finite.
//
// X3_A_REGS = 1 (tf32x3 on 128-row tiles): A is not staged. Its fp32 tile arrives K-major (a plain
// fp32 map; a slot then holds [A][B big][B small]), and each consumer thread loads its own wgmma
// fragments of it with 4-byte shared loads (the 128-byte swizzle puts a warp's 32 loads in 32
// banks), splits them into big = tf32(x) and small = tf32(x - big) in registers (the values the
// staging pass makes) and feeds both to wgmma from registers. The staging pass read A and wrote
// both halves, and the kernel read them back: 5 passes over A's bytes for the 1 here; and the
// products read A from shared memory once a k-step, not three times.
//
// X3_SPLIT_B = 1 (tf32x3 on 64-row tiles): B is not staged. Its fp32 tile arrives in the slot's
// B-big place (a plain fp32 map) and the consumer threads split it there, big = tf32(x) in place
// and small = tf32(x - big) beside it (0 for +-Inf / NaN: the same values as stage_kmajor's
// halves), before the k-step's wgmmas. A decode product's W is then read once from memory,
// where staging it wrote and read back both halves (3x its bytes) on every call.
#include "common.cuh"

#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "wgmma_tf32.cu is built for sm_90a only (wgmma and setmaxnreg)"
#endif

#ifndef BN
#define BN 256
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef C_VEC
#define C_VEC 1
#endif
#ifndef PRECISION_X3
#define PRECISION_X3 0
#endif
#ifndef A_MN
#define A_MN 0
#endif
#ifndef TMA_STORE
#define TMA_STORE 0  // 1: C leaves through shared memory and the copy engine (see the epilogue)
#endif
#ifndef C_COPY_OUT
#define C_COPY_OUT 0  // 1: C leaves through shared memory and the consumers' coalesced stores
#endif
#if TMA_STORE && C_COPY_OUT
#error "C leaves through the copy engine (TMA_STORE) or the consumers' stores (C_COPY_OUT), not both"
#endif
#define C_STAGED (TMA_STORE || C_COPY_OUT)  // C staged in shared memory C_BOXES boxes at a time
#ifndef PINGPONG
#define PINGPONG 0
#endif
#ifndef EPILOGUE_VECTOR
#define EPILOGUE_VECTOR 0
#endif
#if EPILOGUE_VECTOR && (!EPILOGUE || SPLIT)
#error "EPILOGUE_VECTOR applies a fused epilogue in the stores of C (SPLIT applies it in split_finish)"
#endif
#if PINGPONG && (PRECISION_X3 || A_MN || C_COPY_OUT || (EPILOGUE && !EPILOGUE_VECTOR))
// (a D of any strides: applied in the store loop, its loads and addresses spill at BN 128-192
// with two accumulator sets, and a second sweep over C read back would outlast the other
// consumer's main loop; the cooperative form applies it to C staged for the copy engine)
#error "PINGPONG is built for tf32 with a K-major A, C from registers or through the copy engine, without a fused epilogue but a vector one"
#endif
#if PINGPONG && BN > 192
#error "PINGPONG holds a whole 128 x BN tile a warpgroup: BN must be at most 192"
#endif
#ifndef SPLIT
#define SPLIT 0
#endif
#if SPLIT && (PINGPONG || C_STAGED)
#error "SPLIT stores its slices from registers into workspace slices (along m where C_VEC = 2, else along n), in the cooperative form"
#endif
#define ORDER_BAR 2  // PINGPONG: named barriers 2 and 3 (0: __syncthreads, 1: consumer_sync)
#define WG_BAR 4  // PINGPONG with TMA_STORE: named barriers 4 and 5, each consumer warpgroup's own
#ifndef C_BOXES
#define C_BOXES 4  // C_STAGED: 32-column boxes of C staged at once (BM x 32 floats each)
#endif
#if A_MN && PRECISION_X3
#error "tf32x3 reads split K-major halves: A_MN is for tf32 only"
#endif
#ifndef COMPENSATE
#define COMPENSATE 1  // tf32x3 promotion: 2 = two_sum_add, 1 = fast_two_sum_add, 0 = plain add
#endif
#if COMPENSATE == 2
#define PROMOTE(sum, x, err) two_sum_add(sum, x, err)
#elif COMPENSATE == 1
#define PROMOTE(sum, x, err) fast_two_sum_add(sum, x, err)
#else
#define PROMOTE(sum, x, err) ((sum) += (x))
#endif
#ifndef PROMOTE_EVERY
#define PROMOTE_EVERY 2  // tf32x3: k-steps of big products kept in the tensor core between promotions
#endif
#ifndef BM
#define BM 128  // 64: one consumer warpgroup (see "BM = 64" above)
#endif
#if BM != 128 && BM != 64
#error "BM is 128 (two consumer warpgroups) or 64 (one)"
#endif
#define CONSUMERS (BM / 64)  // consumer warpgroups, 64 rows each
#define CONSUMER_THREADS (128 * CONSUMERS)
#ifndef X3_SPLIT_B
#define X3_SPLIT_B 0
#endif
#ifndef X3_A_REGS
#define X3_A_REGS 0
#endif
#if X3_A_REGS && !(PRECISION_X3 && BM == 128 && !X3_SPLIT_B)
#error "X3_A_REGS splits A into tf32x3's halves in registers on 128-row tiles"
#endif
#if BM == 64 && (PINGPONG || (PRECISION_X3 && !X3_SPLIT_B))
#error "BM = 64 is the cooperative form, tf32 (tf32x3 with X3_SPLIT_B)"
#endif
#if X3_SPLIT_B && !(PRECISION_X3 && BM == 64)
#error "X3_SPLIT_B splits B into tf32x3's halves on 64-row tiles"
#endif
#if X3_SPLIT_B && STAGES < 2
#error "X3_SPLIT_B splits the next slot while a step's wgmmas read this one: STAGES >= 2"
#endif
#if STAGES < 2
#error "the consumers hold a slot until the next one's wgmmas are queued: STAGES >= 2"
#endif
#define BK 32  // 32 floats = 128 bytes: one swizzle row
#define THREADS (128 + CONSUMER_THREADS)
#define A_BYTES (BM * BK * 4)
#define B_BYTES (BN * BK * 4)
#define PARTS (PRECISION_X3 ? 2 : 1)  // tiles per operand in a slot: big (and small)
#define A_PARTS (PRECISION_X3 && !X3_A_REGS ? 2 : 1)  // A tiles in a slot (X3_A_REGS: A in fp32)
#define B_OFFSET (A_PARTS * A_BYTES)  // B's tile (big) in a slot
#define STAGE_BYTES (A_PARTS * A_BYTES + PARTS * B_BYTES)  // [A big][A small][B big][B small] (X3_A_REGS: [A][B big][B small])
#define LOAD_BYTES (STAGE_BYTES - X3_SPLIT_B * B_BYTES)  // what the copy engine writes a slot
#define ACC (BN / 2)  // fp32 accumulators per consumer thread
#define C_BOX_BYTES (BM * 32 * 4)
#if C_STAGED
#if C_VEC == 2
#error "C staged in shared memory goes out along n (C_VEC = 2 stores an m-contiguous C)"
#endif
#define C_STAGE_BYTES (C_BOXES * C_BOX_BYTES * (PINGPONG ? 2 : 1))  // (PINGPONG: a region each consumer)
#else
#define C_STAGE_BYTES 0
#endif
// C_STAGED's sweeps over a staged box (the fused epilogue, the copy-out): consumer thread ct takes
// column ct % 32 and rows ct / 32 + BOX_RSTEP * i (8 apart with two consumer warpgroups, 4 with
// one; BOX_RN = 16 rows a thread), so a warp reads (and writes) 32 adjacent floats of a row.
#define BOX_RSTEP (CONSUMER_THREADS / 32)
#define BOX_RN (BM / BOX_RSTEP)

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }
// Keep the compiler from moving accumulator reads/writes across an asynchronous wgmma (and from
// reusing an A fragment's registers while a wgmma may still read them).
__device__ __forceinline__ void reg_fence(float& r) { asm volatile("" : "+f"(r) :: "memory"); }
__device__ __forceinline__ void reg_fence(unsigned& r) { asm volatile("" : "+r"(r) :: "memory"); }
// (every register of a k-step's wgmma A fragments, fed from registers: A_MN, X3_A_REGS)
__device__ __forceinline__ void reg_fence(unsigned (&fa)[BK / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < BK / 8; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) reg_fence(fa[kk][i]);
}
__device__ __forceinline__ void lds_v2(unsigned addr, unsigned& x, unsigned& y) {
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(x), "=r"(y) : "r"(addr));
}
__device__ __forceinline__ void sts_v2(unsigned addr, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" :: "r"(addr), "f"(x), "f"(y) : "memory");
}
__device__ __forceinline__ void lds_v4(unsigned addr, float* x) {
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(x[0]), "=f"(x[1]), "=f"(x[2]), "=f"(x[3]) : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void sts_v4(unsigned addr, const float* x) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" :: "r"(addr), "f"(x[0]), "f"(x[1]), "f"(x[2]), "f"(x[3])
                 : "memory");
}
__device__ __forceinline__ float lds_f32(unsigned addr) {
    float x;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x) : "r"(addr) : "memory");
    return x;
}
__device__ __forceinline__ void sts_f32(unsigned addr, float x) {
    asm volatile("st.shared.f32 [%0], %1;\n" :: "r"(addr), "f"(x) : "memory");
}
// The consumer warpgroups only: named barrier 1 (0 is __syncthreads).
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;\n" :: "n"(CONSUMER_THREADS) : "memory"); }
// PINGPONG's hand-off between the consumer warpgroups: 128 threads arrive, the other 128 wait.
__device__ __forceinline__ void order_wait(int id) { asm volatile("bar.sync %0, 256;\n" :: "r"(id) : "memory"); }
__device__ __forceinline__ void order_signal(int id) { asm volatile("bar.arrive %0, 256;\n" :: "r"(id) : "memory"); }
// PINGPONG with TMA_STORE: one consumer warpgroup's 128 threads (its staging region is its own).
__device__ __forceinline__ void warpgroup_sync(int cw) { asm volatile("bar.sync %0, 128;\n" :: "r"(WG_BAR + cw) : "memory"); }
// Byte offset of C element (r, c) in a staged 32-column box: rows of 128 bytes, 16-byte chunks
// XOR-swizzled by the row (the copy engine's 128-byte swizzle), so that a warp's float2 writes of
// 8 rows x 4 column pairs touch every bank the minimum number of times.
__device__ __forceinline__ unsigned c_box_offset(int r, int c) {
    return r * 128 + ((((unsigned)c >> 2) ^ (r & 7)) << 4) + (c & 3) * 4;
}
// The copy engine's stores of ``boxes`` staged C boxes (the first at shared address ``stage``, its
// columns from n0, rows from m0), committed as one bulk group: one thread issues them, after every
// writer of the boxes has fenced its writes and met the others at a barrier (each caller's own).
__device__ __forceinline__ void store_c_boxes(const TensorMap* mapC, unsigned stage, int boxes, int n0, int m0,
                                              int z1, int z0) {
#pragma unroll
    for (int bx = 0; bx < boxes; ++bx) tma_store_4d(mapC, stage + bx * C_BOX_BYTES, n0 + 32 * bx, m0, z1, z0);
    bulk_commit();
}
#if C_STAGED
// Column c of a staged box, this thread's BOX_RN rows (r0 + BOX_RSTEP i): all loaded before any is
// used, so their latencies overlap (one at a time, each sweep waited out every load in turn).
__device__ __forceinline__ void lds_box_column(unsigned box, int r0, int c, float (&v)[BOX_RN]) {
#pragma unroll
    for (int i = 0; i < BOX_RN; ++i) v[i] = lds_f32(box + c_box_offset(r0 + BOX_RSTEP * i, c));
}
#endif

// Shared-memory matrix descriptor: K-major tile, rows of 128 bytes, 128-byte swizzle; groups of
// 8 rows are 1024 bytes apart (stride byte offset); the leading byte offset is unused here.
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32)
           | (1ull << 62);
}

// Operand lists of the wgmma wrappers: the accumulators tied 8 at a time ("+f": read and
// written by the instruction), and their %-numbers in the PTX string, 16 at a time.
#define ACC8(b) "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), "+f"(d[b + 6]), "+f"(d[b + 7])
#define ACC16(b) ACC8(b), ACC8(b + 8)
#define R16_0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define R16_1 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define R16_2 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define R16_3 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define R16_4 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define R16_5 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define R16_6 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
#define R16_7 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// BN: the tile's columns, also the wgmma's N (m64nBNk8). The planner picks it so the tiles fill
// the SMs in whole waves (families/wgmma_tf32.py). Per BN: the accumulators' operands and
// %-numbers, then the %-numbers of what follows them (_ss: A and B descriptors, the accumulate
// flag; _rs: A's four registers, B's descriptor, the flag).
#if BN == 64
#define ACC_OPS ACC16(0), ACC16(16)
#define ACC_REGS R16_0 ", " R16_1
#define SS_ARGS "%32, %33", "%34"
#define RS_ARGS "{%32, %33, %34, %35}, %36", "%37"
#elif BN == 96
#define ACC_OPS ACC16(0), ACC16(16), ACC16(32)
#define ACC_REGS R16_0 ", " R16_1 ", " R16_2
#define SS_ARGS "%48, %49", "%50"
#define RS_ARGS "{%48, %49, %50, %51}, %52", "%53"
#elif BN == 128
#define ACC_OPS ACC16(0), ACC16(16), ACC16(32), ACC16(48)
#define ACC_REGS R16_0 ", " R16_1 ", " R16_2 ", " R16_3
#define SS_ARGS "%64, %65", "%66"
#define RS_ARGS "{%64, %65, %66, %67}, %68", "%69"
#elif BN == 160
#define ACC_OPS ACC16(0), ACC16(16), ACC16(32), ACC16(48), ACC16(64)
#define ACC_REGS R16_0 ", " R16_1 ", " R16_2 ", " R16_3 ", " R16_4
#define SS_ARGS "%80, %81", "%82"
#define RS_ARGS "{%80, %81, %82, %83}, %84", "%85"
#elif BN == 192
#define ACC_OPS ACC16(0), ACC16(16), ACC16(32), ACC16(48), ACC16(64), ACC16(80)
#define ACC_REGS R16_0 ", " R16_1 ", " R16_2 ", " R16_3 ", " R16_4 ", " R16_5
#define SS_ARGS "%96, %97", "%98"
#define RS_ARGS "{%96, %97, %98, %99}, %100", "%101"
#elif BN == 256
#define ACC_OPS ACC16(0), ACC16(16), ACC16(32), ACC16(48), ACC16(64), ACC16(80), ACC16(96), ACC16(112)
#define ACC_REGS R16_0 ", " R16_1 ", " R16_2 ", " R16_3 ", " R16_4 ", " R16_5 ", " R16_6 ", " R16_7
#define SS_ARGS "%128, %129", "%130"
#define RS_ARGS "{%128, %129, %130, %131}, %132", "%133"
#else
#error "BN must be 64, 96, 128, 160, 192 or 256"
#endif
#if PRECISION_X3 && BN > 128
#error "tf32x3 holds three accumulator sets: BN must be at most 128"
#endif
#define STR_(x) #x
#define STR(x) STR_(x)
#define WGMMA_ASM(operands, pred) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, " pred ", 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n" STR(BN) "k8.f32.tf32.tf32 {" ACC_REGS "}, " operands ", p, 1, 1;\n}\n"
#define WGMMA_ASM_(args) WGMMA_ASM(args)

// D(64xBN) (+)= A(64x8) * B(8xBN), fp32 accumulators (BN/2 per thread); B K-major in shared
// memory. _ss: A K-major in shared memory too. _rs: A from registers (the fragment of
// mma.m16n8k8 per warp: rows g, g + 8 at k = t, then at k = t + 4), for an A that is not K-major
// in memory.
__device__ __forceinline__ void wgmma_ss(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(WGMMA_ASM_(SS_ARGS) : ACC_OPS : "l"(da), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_rs(float* d, const unsigned* a, unsigned long long db, int accumulate) {
    asm volatile(WGMMA_ASM_(RS_ARGS)
                 : ACC_OPS : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}

#if PRECISION_X3
#if X3_SPLIT_B
// X3_SPLIT_B: wait for the slot of ring position ``it`` and split its B tile into its halves, 16
// bytes a thread at a time (the swizzle moves whole 16-byte chunks, so both halves keep the copy
// engine's layout); then the writes are made visible to the tensor core's (async proxy) reads and
// every consumer thread's part is done.
__device__ __forceinline__ void split_b_slot(unsigned base, unsigned bars, int it) {
    const int s = it % STAGES;
    mbar_wait(bars + 8 * s, (it / STAGES) & 1);
    const unsigned b_tile = base + s * STAGE_BYTES + B_OFFSET, b_small = b_tile + B_BYTES;
#pragma unroll 1  // (few registers: it runs beside the three accumulator sets of the step's wgmmas)
    for (unsigned c = threadIdx.x - 128; c < B_BYTES / 16; c += CONSUMER_THREADS) {
        float x[4];
        lds_v4(b_tile + 16 * c, x);
        float big[4], lo[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) tf32_halves(x[i], big[i], lo[i]);
        sts_v4(b_tile + 16 * c, big);
        sts_v4(b_small + 16 * c, lo);
    }
    fence_async_shared();
    consumer_sync();
}
#endif

// One k-step of tf32x3 for one consumer warpgroup: wait for the slot, run the big*small and
// small*big products into ``small`` and big*big into ``step`` (restarted when ``first``), wait
// for them and hand the slot back. X3_SPLIT_B: the slot was waited for and split before (by the
// step ahead, or before the block's first step), and the next slot (up to ``it_end``, the block's
// k-steps) is split while this step's wgmmas run; the big*big product goes between the two
// small ones of a k8 (the same sums in the same order), so they are not one chain.
__device__ __forceinline__ void x3_step(float* step, float* small, unsigned base, unsigned bars, int cw, int lane,
                                        int it, int kt, bool first, int it_end) {
    const int s = it % STAGES;
#if !X3_SPLIT_B
    mbar_wait(bars + 8 * s, (it / STAGES) & 1);
#endif
    const unsigned slot = base + s * STAGE_BYTES;
    const unsigned a_tile = slot + cw * 64 * 128, b_tile = slot + B_OFFSET;
    const unsigned b_small = b_tile + B_BYTES;
#if X3_A_REGS
    // This thread's fragments (rows g and g + 8 of its warp's 16, at k = t and t + 4 of each k8),
    // fp32 from the slot, split into TF32 halves here
    unsigned ab[BK / 8][4], as[BK / 8][4];
    {
        const int g = lane / 4, t = lane % 4, warp = (threadIdx.x / 32) % 4;
        const unsigned row = a_tile + (warp * 16 + g) * 128 + 4 * t;  // (row & 7 == g: the swizzle's XOR)
#pragma unroll
        for (int kk = 0; kk < BK / 8; ++kk)
#pragma unroll
            for (int i = 0; i < 4; ++i) {  // (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)
                float big, lo;
                tf32_halves(lds_f32(row + (i & 1) * (8 * 128) + (((2 * kk + (i >> 1)) ^ g) << 4)), big, lo);
                ab[kk][i] = __float_as_uint(big);
                as[kk][i] = __float_as_uint(lo);
            }
    }
#else
    const unsigned a_small = a_tile + A_BYTES;
#endif
#pragma unroll
    for (int i = 0; i < ACC; ++i) { reg_fence(step[i]); reg_fence(small[i]); }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 8; ++kk) {
#if X3_A_REGS
        wgmma_rs(small, ab[kk], smem_desc(b_small + kk * 32), kt > 0 || kk > 0);
        wgmma_rs(small, as[kk], smem_desc(b_tile + kk * 32), 1);
        wgmma_rs(step, ab[kk], smem_desc(b_tile + kk * 32), !first || kk > 0);
#elif X3_SPLIT_B
        wgmma_ss(small, smem_desc(a_tile + kk * 32), smem_desc(b_small + kk * 32), kt > 0 || kk > 0);
        wgmma_ss(step, smem_desc(a_tile + kk * 32), smem_desc(b_tile + kk * 32), !first || kk > 0);
        wgmma_ss(small, smem_desc(a_small + kk * 32), smem_desc(b_tile + kk * 32), 1);
#else
        wgmma_ss(small, smem_desc(a_tile + kk * 32), smem_desc(b_small + kk * 32), kt > 0 || kk > 0);
        wgmma_ss(small, smem_desc(a_small + kk * 32), smem_desc(b_tile + kk * 32), 1);
        wgmma_ss(step, smem_desc(a_tile + kk * 32), smem_desc(b_tile + kk * 32), !first || kk > 0);
#endif
    }
    wgmma_commit();
#if X3_SPLIT_B
    if (it + 1 < it_end) split_b_slot(base, bars, it + 1);
#endif
    wgmma_wait<0>();  // (BM = 128: the other consumer warpgroup keeps the tensor core busy meanwhile)
#pragma unroll
    for (int i = 0; i < ACC; ++i) { reg_fence(step[i]); reg_fence(small[i]); }
#if X3_A_REGS
    reg_fence(ab);  // (read by the wgmmas until the wait)
    reg_fence(as);
#endif
    if (lane == 0) mbar_arrive(bars + 8 * (STAGES + s));
}
#endif

// A thread's two adjacent outputs of row r (columns col and col + 1) stored from registers: as a
// float2 (C_VEC = 1) or as single floats, each inside N.
__device__ __forceinline__ void store_pair(float* Cb, int r, int col, int N, i64 sCm, i64 sCn, float v0, float v1) {
    float* p = Cb + (i64)r * sCm + (i64)col * sCn;
#if C_VEC == 1
    if (col < N) *(float2*)p = make_float2(v0, v1);
#else
    if (col < N) p[0] = v0;
    if (col + 1 < N) p[sCn] = v1;
#endif
}

#if EPILOGUE_VECTOR
// EPILOGUE_VECTOR's D for outputs in row m or column n: entry n of the vector (1) or entry m (2);
// 0 past the product's edge along the vector, and where beta = 0 (D is then never read). The
// stores load the row values and the column values ahead and pick one set (D_PICK, decided at
// compile time: the other set's loads are dead code).
__device__ __forceinline__ float d_row_value(const Epilogue& epi, int m, int M) {
    return EPILOGUE_VECTOR == 2 && epi.beta != 0.f && m < M ? epi.d_at(m, 0) : 0.f;
}
__device__ __forceinline__ float d_column_value(const Epilogue& epi, int n, int N) {
    return EPILOGUE_VECTOR == 1 && epi.beta != 0.f && n < N ? epi.d_at(0, n) : 0.f;
}
#define D_PICK(row_value, column_value) (EPILOGUE_VECTOR == 1 ? (column_value) : (row_value))

#endif

// Form 1's D over a tile's BN columns, for stores from registers: lane l loads columns n0 + 32 i +
// l (BN / 32 loads a lane, all issued at once, before any store), and a thread takes the values of
// its columns col0 + 8 j + e (col0 = n0 + 2 (lane % 4)) from their lanes by shuffles. Loaded inside
// the store loop instead (conditional loads, compiled where they were written: between the
// stores), each column group's pair could wait out a round trip to memory; the MLM head (8192 x
// 32000 x 1024 + bias, PINGPONG) went 1574 -> 1541 us with the loads ahead, 1492 without a bias
// (benchmarks/NOTES.md run 29). Other forms load nothing here.
struct DColumns {
#if EPILOGUE_VECTOR == 1
    float v[BN / 32];
    __device__ __forceinline__ void load(const Epilogue& epi, int n0, int N, int lane) {
#pragma unroll
        for (int i = 0; i < BN / 32; ++i) v[i] = d_column_value(epi, n0 + 32 * i + lane, N);
    }
    // D of column col0 + 8 j + e (0 past N): every lane of the warp must call it (a shuffle).
    // Column 8 j + 2 t + e of the tile is lane (8 j + 2 t + e) % 32's value j / 4 (2 t + e < 8).
    __device__ __forceinline__ float at(int j, int e, int lane) const {
        return __shfl_sync(0xffffffffu, v[j / 4], (8 * j + 2 * (lane % 4) + e) & 31);
    }
#else
    __device__ __forceinline__ void load(const Epilogue&, int, int, int) {}
    __device__ __forceinline__ float at(int, int, int) const { return 0.f; }
#endif
};

#if A_MN
// A_MN: this thread's A fragments of one k-step from the A tile at ``slot`` (k rows 8 kk + t and
// 8 kk + t + 4 of its pair of tile rows: ``a_frag``, ``a_chunk``; see A_MN above), 8 bytes a load.
__device__ __forceinline__ void load_a_frags(unsigned slot, unsigned a_frag, unsigned a_chunk, int t,
                                             unsigned (&fa)[BK / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < BK / 8; ++kk)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const unsigned kr = 8 * kk + t + 4 * half;  // 128-byte row; swizzle: chunk ^ (kr % 8)
            lds_v2(slot + a_frag + kr * 128 + ((a_chunk ^ (kr & 7)) << 4), fa[kk][2 * half], fa[kk][2 * half + 1]);
        }
}

#if BM == 64
// A_MN on a 64-row tile, k-step ``kt`` (ring position ``it``) of the block's one consumer
// warpgroup. With two, the other warpgroup's queued wgmmas keep the tensor core busy while one
// waits for its step and loads its next fragments; alone, it would idle the tensor core for
// that. So the step's wgmmas read ``cur`` (loaded by the step before) and, once the step before's
// wgmmas are done (wait_group 1: their fragments, now ``nxt``, and their slot are free), the next
// step's fragments are loaded into ``nxt`` while this step's run. The caller alternates the two
// sets, so each has its own registers.
__device__ __forceinline__ void a_mn_step(float* d, unsigned (&cur)[BK / 8][4], unsigned (&nxt)[BK / 8][4],
                                          unsigned base, unsigned bars, unsigned a_frag, unsigned a_chunk, int t,
                                          int lane, int it, int kt, int k_tiles) {
    const unsigned b_tile = base + (it % STAGES) * STAGE_BYTES + A_BYTES;
#pragma unroll
    for (int i = 0; i < ACC; ++i) reg_fence(d[i]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 8; ++kk) wgmma_rs(d, cur[kk], smem_desc(b_tile + kk * 32), kt > 0 || kk > 0);
    wgmma_commit();
    wgmma_wait<1>();
#pragma unroll
    for (int i = 0; i < ACC; ++i) reg_fence(d[i]);
    reg_fence(nxt);  // (read by the step before's wgmmas: live until they are done)
    if (kt > 0 && lane == 0) mbar_arrive(bars + 8 * (STAGES + (it - 1) % STAGES));
    if (kt + 1 < k_tiles) {
        const int s = (it + 1) % STAGES;
        mbar_wait(bars + 8 * s, ((it + 1) / STAGES) & 1);
        load_a_frags(base + s * STAGE_BYTES, a_frag, a_chunk, t, nxt);
    }
}
#endif
#endif

#if PINGPONG
// Wait until the slot of ring position ``it`` is full; its shared-memory address.
__device__ __forceinline__ unsigned wait_full_slot(unsigned base, unsigned bars, int it) {
    const int s = it % STAGES;
    mbar_wait(bars + 8 * s, (it / STAGES) & 1);
    return base + s * STAGE_BYTES;
}

// PINGPONG's register stores of one 64-row half of a tile (accumulators ``d``): thread (warp, lane)
// holds rows ``row`` and ``row`` + 8, columns col0 + 8 j and the next. A vector epilogue is
// applied on the way (D's values for this thread's two rows, or for a column pair at a time).
__device__ __forceinline__ void store_half(const float* d, float* Cb, int row, int col0, int M, int N, i64 sCm, i64 sCn,
                                           const Epilogue& epi, const DColumns& dc, int lane) {
#if EPILOGUE_VECTOR
    const float dm[2] = {d_row_value(epi, row, M), d_row_value(epi, row + 8, M)};
#endif
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#if EPILOGUE_VECTOR
        const float dn[2] = {dc.at(j, 0, lane), dc.at(j, 1, lane)};
#endif
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (row + 8 * h >= M) continue;
            float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
#if EPILOGUE_VECTOR
            v0 = epi.apply(v0, D_PICK(dm[h], dn[0]));
            v1 = epi.apply(v1, D_PICK(dm[h], dn[1]));
#endif
            store_pair(Cb, row + 8 * h, col0 + 8 * j, N, sCm, sCn, v0, v1);
        }
    }
}
#endif

#if SPLIT
#define SPLIT_PARAMS , float* __restrict__ Out, i64 sOm, i64 sOn, unsigned* __restrict__ arrivals
// The end of a SPLIT block's work item, for the consumer warpgroups (the producer's threads
// gave their registers away, so they take no part): count this block's stored slice of the tile
// (m0, n0) in the tile's arrival counter; the last of its gridDim.y blocks then adds the
// slices in slice order (0.f + s0 + s1 + ..., as split_sum_slices in common.cuh) into Out with
// the epilogue, and puts the counter back to 0 for the next launch on the stream. The fences make
// every block's slice visible before its arrival counts, and the last block's L2 reads (ld.cg)
// come after it saw the count.
//
// The workspace is laid out along C's contiguous dim: m-contiguous slices where the kernel
// stores A_MN's adjacent row pairs along m (C_VEC = 2: C^T), row-major ones otherwise; either way
// its lines padded to a multiple of 4 floats (the host's split_workspace), so that the partial
// tiles go out in float2 pairs and the sum reads float4 units of 4 outputs along that dim.
// The sum walks the tile in those units (a line of the tile is BN / 4 units of a row, or with
// C_VEC = 2 BM / 4 units of a column), a thread taking SUM_UNITS units at a time and loading 4
// slices of all of them before adding any: one L2 round trip per 4 slices of 4 units. (One output
// at a time, 8 slices' loads in flight, cost ~10 us a tile: 300 x 700 x 1100 ran 24.2 us in 2
// slices against 14.5 unsplit, probes/wgmma_split_probe.py. An A_MN split on row-major slices of
// an odd width stored and summed single floats and wrote C^T across its rows: a 2-slice split of
// 511 x 1536 x 8960 as C^T ran 124 us against 111 unsplit on an H100, NOTES run 43.) A unit goes
// into Out as one float4 where Out is contiguous along it and aligned, else output by output.
#define SUM_UNITS 4
__device__ __forceinline__ void split_finish(const float* W, i64 sWm, i64 sWn, i64 slice, float* Out, i64 sOm,
                                             i64 sOn, int M, int N, int m0, int n0, unsigned* counter,
                                             const Epilogue& epi) {
    __shared__ unsigned is_last;
    const int ct = threadIdx.x - 128;  // 0..CONSUMER_THREADS - 1 over the consumer warpgroups
    __threadfence();
    consumer_sync();
    if (ct == 0) is_last = atomicAdd(counter, 1u) == gridDim.y - 1;
    consumer_sync();
    if (!is_last) return;
    __threadfence();
    const int S = gridDim.y;
    const int rows = min(BM, M - m0), cols = min(BN, N - n0);
    // (along: the dim of a unit's 4 outputs, m where the workspace is m-contiguous; lines: the other)
    constexpr bool ALONG_M = C_VEC == 2;
    constexpr int LINE_UNITS = (ALONG_M ? BM : BN) / 4;
    const int along = ALONG_M ? rows : cols, lines = ALONG_M ? cols : rows;
    const i64 sWe = ALONG_M ? sWm : sWn, sWl = ALONG_M ? sWn : sWm, sOe = ALONG_M ? sOm : sOn;
    const bool vec = sWe == 1 && sWl % 4 == 0 && slice % 4 == 0 && ((size_t)W & 15) == 0;
    const int units = lines * LINE_UNITS;
    for (int u0 = ct; u0 < units; u0 += CONSUMER_THREADS * SUM_UNITS) {
        float sum[SUM_UNITS][4];
#pragma unroll
        for (int j = 0; j < SUM_UNITS; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) sum[j][e] = 0.f;
        for (int s0 = 0; s0 < S; s0 += 4) {
            float v[4][SUM_UNITS][4];
#pragma unroll
            for (int q = 0; q < 4; ++q)
#pragma unroll
                for (int j = 0; j < SUM_UNITS; ++j) {
                    const int u = u0 + CONSUMER_THREADS * j;
                    const int line = u / LINE_UNITS, at = 4 * (u % LINE_UNITS);
                    const int r = ALONG_M ? at : line, c = ALONG_M ? line : at;
                    const float* p = W + (i64)(m0 + r) * sWm + (i64)(n0 + c) * sWn + (i64)(s0 + q) * slice;
                    const bool ok = u < units && s0 + q < S && at < along;
                    // (a unit across the edge of M or N reads its outputs one by one: the lines'
                    // padding is never written, and is not read either)
                    if (vec && at + 4 <= along) {
                        const float4 x = ok ? ld_l2_v4_ordered(p) : make_float4(0.f, 0.f, 0.f, 0.f);
                        v[q][j][0] = x.x; v[q][j][1] = x.y; v[q][j][2] = x.z; v[q][j][3] = x.w;
                    } else {
#pragma unroll
                        for (int e = 0; e < 4; ++e) v[q][j][e] = ok && at + e < along ? ld_l2_ordered(p + e * sWe) : 0.f;
                    }
                }
#pragma unroll
            for (int q = 0; q < 4; ++q)
#pragma unroll
                for (int j = 0; j < SUM_UNITS; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (s0 + q < S) sum[j][e] += v[q][j][e];
        }
#pragma unroll
        for (int j = 0; j < SUM_UNITS; ++j) {
            const int u = u0 + CONSUMER_THREADS * j;
            const int line = u / LINE_UNITS, at = 4 * (u % LINE_UNITS);
            if (u >= units || at >= along) continue;
            const int m = m0 + (ALONG_M ? at : line), n = n0 + (ALONG_M ? line : at);
            float* q = Out + (i64)m * sOm + (i64)n * sOn;
            float x[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) x[e] = at + e < along ? epi(sum[j][e], m + (ALONG_M ? e : 0), n + (ALONG_M ? 0 : e)) : 0.f;
            if (sOe == 1 && at + 3 < along && ((size_t)q & 15) == 0) {
                *(float4*)q = make_float4(x[0], x[1], x[2], x[3]);
            } else {
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (at + e < along) q[e * sOe] = x[e];
            }
        }
    }
    if (ct == 0) *(volatile unsigned*)counter = 0u;
}
#else
#define SPLIT_PARAMS
#endif

#if TMA_STORE
#define MAP_C , const __grid_constant__ TensorMap mapC
#else
#define MAP_C
#endif
#if PRECISION_X3 && X3_SPLIT_B
#define MAP_PARAMS const __grid_constant__ TensorMap mapA, const __grid_constant__ TensorMap mapA2, \
                   const __grid_constant__ TensorMap mapB MAP_C
#elif PRECISION_X3 && X3_A_REGS
#define MAP_PARAMS const __grid_constant__ TensorMap mapA, const __grid_constant__ TensorMap mapB, \
                   const __grid_constant__ TensorMap mapB2 MAP_C
#elif PRECISION_X3
#define MAP_PARAMS const __grid_constant__ TensorMap mapA, const __grid_constant__ TensorMap mapA2, \
                   const __grid_constant__ TensorMap mapB, const __grid_constant__ TensorMap mapB2 MAP_C
#else
#define MAP_PARAMS const __grid_constant__ TensorMap mapA, const __grid_constant__ TensorMap mapB MAP_C
#endif

// The block's work items are w = blockIdx.x, + gridDim.x, ... over (tile, batch entry) pairs,
// tiles in grouped order (tile_coords) and the batch outermost. The host launches one block per
// work item, or (persistent) one per SM: then the producer fills the ring with the next item's
// first k-steps while the consumers store this one's tile, instead of every tile starting from an
// empty pipeline after its epilogue.
__device__ __forceinline__ void work_item(long long w, int tiles, int tiles_m, int tiles_n, int& z, int& tm, int& tn) {
    z = (int)(w / tiles);
    tile_coords<8>((int)(w - (long long)z * tiles), tiles_m, tiles_n, tm, tn);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) fastmm_wgmma_tf32(
    MAP_PARAMS, float* __restrict__ C,
    i64 M_, i64 N_, i64 K_, i64 sCm, i64 sCn, i64 batch_inner_, i64 batch_total_, i64 sC0, i64 sC1, i64 bcast
    SPLIT_PARAMS FASTMM_EPILOGUE_PARAMS) {
    const int M = (int)M_, N = (int)N_, K = (int)K_;
    const int batch_inner = (int)batch_inner_, batch_total = (int)batch_total_;
    extern __shared__ unsigned char smem_raw[];
    // Swizzled tiles must start on a 1024-byte boundary; the host asks for 1 KiB of slack.
    const unsigned base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const unsigned c_stage = base + STAGES * STAGE_BYTES;  // C_STAGED: C's boxes (1024-aligned)
    const unsigned bars = c_stage + C_STAGE_BYTES;  // full[STAGES], then empty[STAGES]
    const int wg = threadIdx.x / 128;
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN, tiles = tiles_m * tiles_n;
    const long long work = (long long)tiles * batch_total;  // (tile, batch entry) pairs
#if SPLIT
    int k_first, k_end;  // this block's k-tiles: slice blockIdx.y of gridDim.y
    split_range(K, BK, k_first, k_end);
    const int k_tiles = k_end - k_first;  // (the host makes no empty slice)
#else
    const int k_first = 0, k_tiles = (K + BK - 1) / BK;
#endif

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bars + 8 * s, 1);                     // the producer's arrive + the bytes
            mbar_init(bars + 8 * (STAGES + s), (PINGPONG ? 1 : CONSUMERS) * 4);  // one arrive per consuming warp
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (threadIdx.x == 0) {
            tma_prefetch_map(&mapA);
            tma_prefetch_map(&mapB);
            int it = 0;
            for (long long w = blockIdx.x; w < work; w += gridDim.x) {
                int z, tm, tn;
                work_item(w, tiles, tiles_m, tiles_n, z, tm, tn);
                const int z0 = z / batch_inner, z1 = z % batch_inner;
                const int a2 = (bcast & 1) ? z1 : 0, a3 = (bcast & 2) ? z0 : 0;
                const int b2 = (bcast & 4) ? z1 : 0, b3 = (bcast & 8) ? z0 : 0;
                for (int kt = 0; kt < k_tiles; ++kt, ++it) {
                    const int s = it % STAGES;
                    const unsigned phase = (it / STAGES) & 1;
                    mbar_wait(bars + 8 * (STAGES + s), phase ^ 1);
                    const unsigned full = bars + 8 * s, dst = base + s * STAGE_BYTES;
                    const int kc = (k_first + kt) * BK;  // the k-step's first k
                    mbar_arrive_expect_tx(full, LOAD_BYTES);
#if A_MN
#pragma unroll
                    for (int j = 0; j < BM / 32; ++j)  // box j: tile rows 32j..32j+31, all BK k rows
                        tma_load_4d(dst + j * (32 * BK * 4), &mapA, full, tm * BM + 32 * j, kc, a2, a3);
#else
                    tma_load_4d(dst, &mapA, full, kc, tm * BM, a2, a3);
#endif
#if PRECISION_X3
#if !X3_A_REGS
                    tma_load_4d(dst + A_BYTES, &mapA2, full, kc, tm * BM, a2, a3);
#endif
                    tma_load_4d(dst + B_OFFSET, &mapB, full, kc, tn * BN, b2, b3);
#if !X3_SPLIT_B
                    tma_load_4d(dst + B_OFFSET + B_BYTES, &mapB2, full, kc, tn * BN, b2, b3);
#endif
#else
                    tma_load_4d(dst + A_BYTES, &mapB, full, kc, tn * BN, b2, b3);
#endif
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
#if PINGPONG
        const int cw = wg - 1;  // which work items: j = cw, cw + 2, ... of this block's
        const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
        float d[ACC], d2[ACC];  // the tile's rows 0-63 and 64-127
        for (long long j = cw;; j += 2) {
            const long long w = blockIdx.x + j * gridDim.x;
            if (w >= work) break;
            int z, tm, tn;
            work_item(w, tiles, tiles_m, tiles_n, z, tm, tn);
            int it = (int)(j * k_tiles);  // this item's first position in the ring
            if (j > 0) order_wait(ORDER_BAR + cw);  // the other warpgroup has issued its last k-step
#pragma unroll
            for (int i = 0; i < ACC; ++i) { d[i] = 0.f; d2[i] = 0.f; }
            for (int kt = 0; kt < k_tiles; ++kt, ++it) {
                const unsigned slot = wait_full_slot(base, bars, it);
                const unsigned b_tile = slot + A_BYTES;
#pragma unroll
                for (int i = 0; i < ACC; ++i) { reg_fence(d[i]); reg_fence(d2[i]); }
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 8; ++kk) {
                    const unsigned long long db = smem_desc(b_tile + kk * 32);
                    wgmma_ss(d, smem_desc(slot + kk * 32), db, kt > 0 || kk > 0);
                    wgmma_ss(d2, smem_desc(slot + 64 * 128 + kk * 32), db, kt > 0 || kk > 0);
                }
                wgmma_commit();
                wgmma_wait<1>();  // the previous k-step's slot is read: hand it back
#pragma unroll
                for (int i = 0; i < ACC; ++i) { reg_fence(d[i]); reg_fence(d2[i]); }
                if (kt > 0 && lane == 0) mbar_arrive(bars + 8 * (STAGES + (it - 1) % STAGES));
            }
            // Every slot of this item has been waited for: the other warpgroup may start waiting on
            // the next item's (its wgmmas queue behind these).
            if (w + gridDim.x < work) order_signal(ORDER_BAR + 1 - cw);
            wgmma_wait<0>();
#pragma unroll
            for (int i = 0; i < ACC; ++i) { reg_fence(d[i]); reg_fence(d2[i]); }
            if (lane == 0) mbar_arrive(bars + 8 * (STAGES + (it - 1) % STAGES));

            FASTMM_EPILOGUE
            DColumns dc;  // (form 1: the tile's D, loaded once for both halves)
            dc.load(epi, tn * BN, N, lane);
#if TMA_STORE
            // Through this warpgroup's own staging region, C_BOXES boxes of 128 x 32 at a time, as
            // the cooperative form's epilogue (below) does with both: written swizzled, then one
            // thread hands them to the copy engine, which also clips the tile at M and N. The other
            // warpgroup's main loop runs meanwhile; before a box is written again, the stores that
            // read it last must be done reading (this warpgroup's thread 0 issued them).
            {
                const int wt = threadIdx.x % 128;
                const unsigned stage = c_stage + cw * (C_BOXES * C_BOX_BYTES);
                const int z0 = z / batch_inner, z1 = z % batch_inner;
                const int r = warp * 16 + lane / 4;  // tile rows r, r + 8 (d) and r + 64, r + 72 (d2)
#if EPILOGUE_VECTOR
                const float dm[4] = {d_row_value(epi, tm * BM + r, M), d_row_value(epi, tm * BM + r + 8, M),
                                     d_row_value(epi, tm * BM + r + 64, M), d_row_value(epi, tm * BM + r + 72, M)};
#endif
#pragma unroll
                for (int b0 = 0; b0 < BN / 32; b0 += C_BOXES) {
                    if (wt == 0) bulk_wait_read_all();
                    warpgroup_sync(cw);
#pragma unroll
                    for (int j = 0; j < BN / 8; ++j) {
                        if (j / 4 < b0 || j / 4 >= b0 + C_BOXES) continue;
#if EPILOGUE_VECTOR
                        const float dn[2] = {dc.at(j, 0, lane), dc.at(j, 1, lane)};
#endif
                        const unsigned box = stage + (j / 4 - b0) * C_BOX_BYTES;
                        const int col = 8 * (j % 4) + 2 * (lane % 4);
#pragma unroll
                        for (int h = 0; h < 4; ++h) {  // rows r, r + 8 of d, then of d2
                            const float* acc = h < 2 ? d : d2;
                            float v0 = acc[4 * j + 2 * (h % 2)], v1 = acc[4 * j + 2 * (h % 2) + 1];
#if EPILOGUE_VECTOR
                            v0 = epi.apply(v0, D_PICK(dm[h], dn[0]));
                            v1 = epi.apply(v1, D_PICK(dm[h], dn[1]));
#endif
                            sts_v2(box + c_box_offset(r + 8 * (h % 2) + 64 * (h / 2), col), v0, v1);
                        }
                    }
                    const int boxes = (BN / 32 - b0) < C_BOXES ? (BN / 32 - b0) : C_BOXES;
                    fence_async_shared();  // (each writer: its writes, before the copy engine reads)
                    warpgroup_sync(cw);
                    if (wt == 0) store_c_boxes(&mapC, stage, boxes, tn * BN + 32 * b0, tm * BM, z1, z0);
                }
            }
#else
            float* Cb = C + (i64)(z / batch_inner) * sC0 + (i64)(z % batch_inner) * sC1;
            const int row = tm * BM + warp * 16 + lane / 4;
            const int col0 = tn * BN + 2 * (lane % 4);
            store_half(d, Cb, row, col0, M, N, sCm, sCn, epi, dc, lane);
            store_half(d2, Cb, row + 64, col0, M, N, sCm, sCn, epi, dc, lane);
#endif
        }
#if TMA_STORE
        if (threadIdx.x % 128 == 0) bulk_wait_all();  // (each warpgroup's stores read its region until done)
#endif
#else
        const int cw = wg - 1;  // which 64 rows of the tile
        const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
        float d[ACC];  // tf32: the accumulators; tf32x3: the promoted big products
#if A_MN
        // Tile rows of this thread's fragment rows g (pair_row) and g + 8 (pair_row + 1); the
        // fragment of k-step kk sits at k rows 8kk + t and 8kk + t + 4 of box (2 cw + warp / 2).
        const int g = lane / 4, t = lane % 4;
        const int m_in_box = 16 * (g / 4) + 8 * (warp % 2) + 2 * (g % 4);
        const int pair_row = 32 * (2 * cw + warp / 2) + m_in_box;
        const unsigned a_frag = (2 * cw + warp / 2) * (32 * BK * 4) + (m_in_box % 4) * 4;
        const unsigned a_chunk = m_in_box / 4;
#endif
#if PRECISION_X3
        float step[ACC], small[ACC];
        // the k-steps this block takes: its work items' (blockIdx.x, + gridDim.x, ...)
        const int it_end = work > blockIdx.x ? (int)((work - 1 - blockIdx.x) / gridDim.x + 1) * k_tiles : 0;
#if X3_SPLIT_B
        if (it_end > 0) split_b_slot(base, bars, 0);
#endif
#endif
        int it = 0;  // k-steps consumed so far, over every work item: the ring's position
        for (long long w = blockIdx.x; w < work; w += gridDim.x) {
            int z, tm, tn;
            work_item(w, tiles, tiles_m, tiles_n, z, tm, tn);
#pragma unroll
            for (int i = 0; i < ACC; ++i) d[i] = 0.f;
#if PRECISION_X3
            // Groups of PROMOTE_EVERY k-steps, each step's code written out (a run-time test
            // in the loop made ptxas spill the three accumulator sets).
            int kt = 0;
            for (; kt + PROMOTE_EVERY <= k_tiles; kt += PROMOTE_EVERY) {
#pragma unroll
                for (int g = 0; g < PROMOTE_EVERY; ++g) x3_step(step, small, base, bars, cw, lane, it++, kt + g, g == 0, it_end);
#pragma unroll
                for (int i = 0; i < ACC; ++i) PROMOTE(d[i], step[i], small[i]);  // the add's error joins small
            }
            if (kt < k_tiles) {
#pragma unroll
                for (int g = 0; g < PROMOTE_EVERY - 1; ++g)
                    if (kt + g < k_tiles) x3_step(step, small, base, bars, cw, lane, it++, kt + g, g == 0, it_end);
#pragma unroll
                for (int i = 0; i < ACC; ++i) PROMOTE(d[i], step[i], small[i]);
            }
#elif A_MN && BM == 64
            {
                unsigned fa0[BK / 8][4], fa1[BK / 8][4];  // the two fragment sets (a_mn_step)
                mbar_wait(bars + 8 * (it % STAGES), (it / STAGES) & 1);
                load_a_frags(base + (it % STAGES) * STAGE_BYTES, a_frag, a_chunk, t, fa0);
                for (int kt = 0; kt < k_tiles; kt += 2) {  // (k_tiles >= 1: K > 0, no empty slice)
                    a_mn_step(d, fa0, fa1, base, bars, a_frag, a_chunk, t, lane, it++, kt, k_tiles);
                    if (kt + 1 < k_tiles)
                        a_mn_step(d, fa1, fa0, base, bars, a_frag, a_chunk, t, lane, it++, kt + 1, k_tiles);
                }
                wgmma_wait<0>();
#pragma unroll
                for (int i = 0; i < ACC; ++i) reg_fence(d[i]);
                reg_fence(fa0);
                reg_fence(fa1);
                if (lane == 0) mbar_arrive(bars + 8 * (STAGES + (it - 1) % STAGES));
            }
#else
            for (int kt = 0; kt < k_tiles; ++kt, ++it) {
                const int s = it % STAGES;
                mbar_wait(bars + 8 * s, (it / STAGES) & 1);
                const unsigned slot = base + s * STAGE_BYTES;
                const unsigned b_tile = slot + A_BYTES;
#if A_MN
                unsigned fa[BK / 8][4];
                load_a_frags(slot, a_frag, a_chunk, t, fa);
#pragma unroll
                for (int i = 0; i < ACC; ++i) reg_fence(d[i]);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 8; ++kk) wgmma_rs(d, fa[kk], smem_desc(b_tile + kk * 32), kt > 0 || kk > 0);
                wgmma_commit();
                // All of this step's wgmmas done: their fragment registers may be reused and the
                // slot goes back to the producer. (The other consumer warpgroup's queued wgmmas
                // keep the tensor core busy while this one loads its next fragments.)
                wgmma_wait<0>();
#pragma unroll
                for (int i = 0; i < ACC; ++i) reg_fence(d[i]);
                reg_fence(fa);
                if (lane == 0) mbar_arrive(bars + 8 * (STAGES + s));
            }
#else
                const unsigned a_tile = slot + cw * 64 * 128;
#pragma unroll
                for (int i = 0; i < ACC; ++i) reg_fence(d[i]);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 8; ++kk)
                    wgmma_ss(d, smem_desc(a_tile + kk * 32), smem_desc(b_tile + kk * 32), kt > 0 || kk > 0);
                wgmma_commit();
                // The previous k-step's wgmmas are done reading their slot once at most this
                // step's group is in flight: hand that slot back to the producer.
                wgmma_wait<1>();
#pragma unroll
                for (int i = 0; i < ACC; ++i) reg_fence(d[i]);
                if (kt > 0 && lane == 0) mbar_arrive(bars + 8 * (STAGES + (it - 1) % STAGES));
            }
            wgmma_wait<0>();
#pragma unroll
            for (int i = 0; i < ACC; ++i) reg_fence(d[i]);
            if (lane == 0) mbar_arrive(bars + 8 * (STAGES + (it - 1) % STAGES));
#endif  // A_MN
#endif  // PRECISION_X3

            // Epilogue: thread (warp, lane) holds, for each 8-column group j, fragment rows g and
            // g + 8 of its warp's 16 rows, columns 2t and 2t + 1 (g = lane / 4, t = lane % 4).
#if A_MN
            const int tile_row = pair_row, row_step = 1;  // fragment row g + 8 is tile row + 1
#else
            const int tile_row = cw * 64 + warp * 16 + lane / 4, row_step = 8;
#endif
#if C_STAGED
            // Through shared memory: the consumer warpgroups write C_BOXES boxes of 32 columns
            // into the staging buffer (swizzled), then one thread hands them to the copy engine and
            // everyone goes on to the next tile's main loop while the stores drain. Stored from
            // registers, every SM wrote its tile at the same moment with the tensor cores idle:
            // ~27 ns per KiB of tile, 17% of a 128 x 256 tile at K = 768 (NOTES run 23). The copy
            // engine also clips the tile at M and N. Before the buffer is written again, the
            // store that read it last must be done reading (wait_group.read).
            {
                const int ct = threadIdx.x - 128;  // 0..CONSUMER_THREADS - 1 over the consumer warpgroups
                const int z0 = z / batch_inner, z1 = z % batch_inner;
#if EPILOGUE_VECTOR
                // D for this thread's two rows (form 2), or its columns box group by box group (1),
                // loaded before the wait for the staging buffer: their latency hides under it.
                FASTMM_EPILOGUE
                const int row_m = tm * BM + tile_row, col_n = tn * BN + 2 * (lane % 4);
                const float dm[2] = {d_row_value(epi, row_m, M), d_row_value(epi, row_m + row_step, M)};
#endif
#pragma unroll
                for (int b0 = 0; b0 < BN / 32; b0 += C_BOXES) {
#if EPILOGUE_VECTOR
                    float dn[4 * C_BOXES][2];  // columns col_n + 8 j (+ 1), j = 4 b0 ...
#pragma unroll
                    for (int j = 0; j < 4 * C_BOXES; ++j)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            dn[j][e] = 4 * b0 + j < BN / 8 ? d_column_value(epi, col_n + 8 * (4 * b0 + j) + e, N) : 0.f;
#endif
#if TMA_STORE
                    if (ct == 0) bulk_wait_read_all();
#endif
                    consumer_sync();  // (C_COPY_OUT: the last boxes' copy-out has read the buffer)
#pragma unroll
                    for (int j = 0; j < BN / 8; ++j) {
                        if (j / 4 < b0 || j / 4 >= b0 + C_BOXES) continue;
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
#if PRECISION_X3
                            // Where the big products overflowed or met Inf/NaN, that is the fp32 answer.
                            v0 = isfinite(v0) ? v0 + small[4 * j + 2 * h] : v0;
                            v1 = isfinite(v1) ? v1 + small[4 * j + 2 * h + 1] : v1;
#endif
#if EPILOGUE_VECTOR
                            v0 = epi.apply(v0, D_PICK(dm[h], dn[j - 4 * b0][0]));
                            v1 = epi.apply(v1, D_PICK(dm[h], dn[j - 4 * b0][1]));
#endif
                            sts_v2(c_stage + (j / 4 - b0) * C_BOX_BYTES
                                       + c_box_offset(tile_row + row_step * h, 8 * (j % 4) + 2 * (lane % 4)), v0, v1);
                        }
                    }
                    const int boxes = (BN / 32 - b0) < C_BOXES ? (BN / 32 - b0) : C_BOXES;
#if EPILOGUE && !EPILOGUE_VECTOR
                    // The fused epilogue on the staged values: a thread per column of a box row, so
                    // the D loads are coalesced along n. A thread's 16 rows of a box are all read
                    // before any is written back: the staging loads and stores are asm volatile with a
                    // memory clobber, so a row at a time waited out every D load's latency in turn
                    // (x @ W^T + bias at 0.52-0.59x of cuBLAS's fused bias, NOTES run 27).
                    consumer_sync();
                    {
                        FASTMM_EPILOGUE
                        const int c = ct % 32, r0 = ct / 32;
#pragma unroll 1
                        for (int bx = 0; bx < boxes; ++bx) {
                            const int n = tn * BN + 32 * (b0 + bx) + c;
                            const unsigned box = c_stage + bx * C_BOX_BYTES;
                            float v[BOX_RN];
                            lds_box_column(box, r0, c, v);
#pragma unroll
                            for (int i = 0; i < BOX_RN; ++i) {
                                const int m = tm * BM + r0 + BOX_RSTEP * i;
                                if (m < M && n < N) v[i] = epi(v[i], m, n);
                            }
#pragma unroll
                            for (int i = 0; i < BOX_RN; ++i) sts_f32(box + c_box_offset(r0 + BOX_RSTEP * i, c), v[i]);  // (outside M, N: unchanged, and clipped by the copy engine)
                        }
                    }
#endif
#if TMA_STORE
                    fence_async_shared();  // (each writer: its writes, before the copy engine reads)
                    consumer_sync();
                    if (ct == 0) store_c_boxes(&mapC, c_stage, boxes, tn * BN + 32 * b0, tm * BM, z1, z0);
#else
                    // Copy-out: lane c of a warp takes column c of a box, the warps rows RSTEP apart,
                    // so each store instruction writes 32 adjacent floats of one row (128 bytes). A
                    // thread loads its rows of a box before it stores any (16 shared loads in flight).
                    consumer_sync();
                    {
                        const int c = ct % 32, r0 = ct / 32;
                        float* Cb = C + (i64)z0 * sC0 + (i64)z1 * sC1;
#pragma unroll 1
                        for (int bx = 0; bx < boxes; ++bx) {
                            const int n = tn * BN + 32 * (b0 + bx) + c;
                            float v[BOX_RN];
                            lds_box_column(c_stage + bx * C_BOX_BYTES, r0, c, v);
                            if (n < N) {
#pragma unroll
                                for (int i = 0; i < BOX_RN; ++i) {
                                    const int m = tm * BM + r0 + BOX_RSTEP * i;
                                    if (m < M) Cb[(i64)m * sCm + (i64)n * sCn] = v[i];
                                }
                            }
                        }
                    }
#endif
                }
            }
#else
            float* Cb = C + (i64)(z / batch_inner) * sC0 + (i64)(z % batch_inner) * sC1;
#if SPLIT
            Cb += (i64)blockIdx.y * sC0;  // this block's workspace slice (a batch of 1)
#endif
            const int row = tm * BM + tile_row;
            const int col0 = tn * BN + 2 * (lane % 4);
#if EPILOGUE_VECTOR
            FASTMM_EPILOGUE
            const float dm[2] = {d_row_value(epi, row, M), d_row_value(epi, row + row_step, M)};  // (form 2)
            DColumns dc;  // (form 1)
            dc.load(epi, tn * BN, N, lane);
#endif
#if C_VEC == 2
#if !A_MN
#error "C_VEC = 2 stores the adjacent row pairs of A_MN"
#endif
            // C contiguous along m (a product computed transposed): float2 over the row pair.
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = col0 + 8 * j + e;
#if EPILOGUE_VECTOR
                    const float dn = dc.at(j, e, lane);  // (all lanes: a shuffle)
#endif
                    if (col >= N || row >= M) continue;
#if EPILOGUE_VECTOR
                    const float v0 = epi.apply(d[4 * j + e], D_PICK(dm[0], dn)), v1 = epi.apply(d[4 * j + 2 + e], D_PICK(dm[1], dn));
#else
                    const float v0 = d[4 * j + e], v1 = d[4 * j + 2 + e];
#endif
                    float* p = Cb + (i64)row * sCm + (i64)col * sCn;
                    if (row + 1 < M) *(float2*)p = make_float2(v0, v1);
                    else p[0] = v0;
                }
            }
#else
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                const int col = col0 + 8 * j;
#if EPILOGUE_VECTOR
                const float dn[2] = {dc.at(j, 0, lane), dc.at(j, 1, lane)};
#endif
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = row + (A_MN ? 1 : 8) * h;
                    if (r >= M) continue;
                    float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
#if PRECISION_X3
                    // Where the big products overflowed or met Inf/NaN, that is the fp32 answer.
                    v0 = isfinite(v0) ? v0 + small[4 * j + 2 * h] : v0;
                    v1 = isfinite(v1) ? v1 + small[4 * j + 2 * h + 1] : v1;
#endif
#if EPILOGUE_VECTOR
                    v0 = epi.apply(v0, D_PICK(dm[h], dn[0]));
                    v1 = epi.apply(v1, D_PICK(dm[h], dn[1]));
#endif
                    store_pair(Cb, r, col, N, sCm, sCn, v0, v1);
                }
            }
#endif  // C_VEC
#if EPILOGUE && !SPLIT && !EPILOGUE_VECTOR  // (SPLIT: applied by the sum of the slices, split_finish)
            // The fused epilogue, in a second sweep over this thread's outputs read back from C (its
            // own stores: program order makes them visible to it). Applied in the store loop above,
            // its D addresses and loads took registers next to the 2 x 64 tf32x3 accumulators (BN
            // 128) or the 128 of BN 256 and spilled 416-1480 bytes under NVRTC 13.0 (benchmarks/NOTES.md);
            // here the accumulators are dead. The tile is in L2: this costs what a separate add would
            // in memory traffic, and saves its launch. 16 outputs at a time, all read (C, then D)
            // before any is written: one at a time, each waited out two L2 round trips in turn
            // (Conv1D's row-major W + bias at 0.48-0.53x of cuBLAS, NOTES run 27).
            {
                FASTMM_EPILOGUE
#define EPI_GROUPS 4  // 8-column groups a batch (BN / 8 is a multiple of 4 at every width)
                // Output e of batch j0: the rows and columns the store loop wrote: rows row and row +
                // (A_MN ? 1 : 8), columns col0 + 8 j and the next.
                const auto output = [&](int j0, int e, int& r, int& col) {
                    r = row + ((e & 3) >> 1) * (A_MN ? 1 : 8);
                    col = col0 + 8 * (j0 + e / 4) + (e & 1);
                };
#pragma unroll 1
                for (int j0 = 0; j0 < BN / 8; j0 += EPI_GROUPS) {
                    float v[4 * EPI_GROUPS];
                    int r, col;
#pragma unroll
                    for (int e = 0; e < 4 * EPI_GROUPS; ++e) {
                        output(j0, e, r, col);
                        v[e] = (r < M && col < N) ? Cb[(i64)r * sCm + (i64)col * sCn] : 0.f;
                    }
#pragma unroll
                    for (int e = 0; e < 4 * EPI_GROUPS; ++e) {
                        output(j0, e, r, col);
                        if (r < M && col < N) v[e] = epi(v[e], r, col);
                    }
#pragma unroll
                    for (int e = 0; e < 4 * EPI_GROUPS; ++e) {
                        output(j0, e, r, col);
                        if (r < M && col < N) Cb[(i64)r * sCm + (i64)col * sCn] = v[e];
                    }
                }
#undef EPI_GROUPS
            }
#endif
#endif  // C_STAGED
#if SPLIT
            {
                FASTMM_EPILOGUE
                split_finish(C, sCm, sCn, sC0, Out, sOm, sOn, M, N, tm * BM, tn * BN, arrivals + w, epi);
            }
#endif
        }
#if TMA_STORE
        if (threadIdx.x == 128) bulk_wait_all();  // (the staging buffer lives until its stores are done)
#endif
#endif  // PINGPONG
    }
}
