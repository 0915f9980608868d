// Hopper TF32 family (sm_90a only): wgmma.mma_async fed by the bulk tensor copy engine (TMA).
//
// One block = 3 warpgroups. Warpgroup 0 is the producer: one thread issues the TMA copies of the
// A tile (BM x BK) and the B tile (BN x BK) of each k-step into a ring of STAGES shared-memory
// slots, each completing on that slot's "full" mbarrier. Warpgroups 1 and 2 are consumers: each
// owns 64 rows of the 128-row tile, waits for a slot, issues BK/8 wgmma m64nBNk8 on it and frees
// it (the "empty" mbarrier) once those wgmmas have read it. setmaxnreg moves registers from the
// producer (which needs few) to the consumers (BN/2 fp32 accumulators each).
//
// Operands are K-major in shared memory (TF32 wgmma reads nothing else): the A map walks (k, m),
// the B map walks (k, n), i.e. B^T row-major; the host stages a transposed copy when B is
// n-contiguous. Rows are 32 floats = 128 bytes with the 128-byte swizzle, which the copy engine
// writes and the wgmma descriptors read with the same XOR pattern: conflict-free for both.
// The maps use the TFLOAT32 element type: the copy engine rounds fp32 to TF32 on the way in
// (checked against cvt.rna by tests/test_gpu.py), the tensor core would otherwise truncate.
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
#define BM 128
#define BK 32  // 32 floats = 128 bytes: one swizzle row
#define THREADS 384
#define A_BYTES (BM * BK * 4)
#define B_BYTES (BN * BK * 4)
#define PARTS (PRECISION_X3 ? 2 : 1)  // tiles per operand in a slot: big (and small)
#define STAGE_BYTES (PARTS * (A_BYTES + B_BYTES))  // [A big][A small][B big][B small]
#define ACC (BN / 2)  // fp32 accumulators per consumer thread

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }
// Keep the compiler from moving accumulator reads/writes across an asynchronous wgmma.
__device__ __forceinline__ void reg_fence(float& r) { asm volatile("" : "+f"(r) :: "memory"); }

// Shared-memory matrix descriptor: K-major tile, rows of 128 bytes, 128-byte swizzle; groups of
// 8 rows are 1024 bytes apart (stride byte offset); the leading byte offset is unused here.
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32)
           | (1ull << 62);
}

// D(64x128) (+)= A(64x8, smem) * B(8x128, smem); 64 fp32 accumulators per thread.
__device__ __forceinline__ void wgmma_m64n128k8(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
        "{" 
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate));
}

// D(64x256) (+)= A(64x8, smem) * B(8x256, smem); 128 fp32 accumulators per thread.
__device__ __forceinline__ void wgmma_m64n256k8(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 "
        "{" 
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(accumulate));
}

#if BN == 256
#define WGMMA wgmma_m64n256k8
#elif BN == 128
#define WGMMA wgmma_m64n128k8
#else
#error "BN must be 128 or 256"
#endif
#if PRECISION_X3 && BN != 128
#error "tf32x3 holds three accumulator sets: BN must be 128"
#endif

#if PRECISION_X3
// One k-step of tf32x3 for one consumer warpgroup: wait for the slot, run the big*small and
// small*big products into ``small`` and big*big into ``step`` (restarted when ``first``), wait
// for them and hand the slot back.
__device__ __forceinline__ void x3_step(float* step, float* small, unsigned base, unsigned bars, int cw, int lane,
                                        int it, int kt, bool first) {
    const int s = it % STAGES;
    mbar_wait(bars + 8 * s, (it / STAGES) & 1);
    const unsigned slot = base + s * STAGE_BYTES;
    const unsigned a_tile = slot + cw * 64 * 128, b_tile = slot + 2 * A_BYTES;
    const unsigned a_small = a_tile + A_BYTES, b_small = b_tile + B_BYTES;
#pragma unroll
    for (int i = 0; i < ACC; ++i) { reg_fence(step[i]); reg_fence(small[i]); }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 8; ++kk) {
        WGMMA(small, smem_desc(a_tile + kk * 32), smem_desc(b_small + kk * 32), kt > 0 || kk > 0);
        WGMMA(small, smem_desc(a_small + kk * 32), smem_desc(b_tile + kk * 32), 1);
        WGMMA(step, smem_desc(a_tile + kk * 32), smem_desc(b_tile + kk * 32), !first || kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();  // the other consumer warpgroup keeps the tensor core busy meanwhile
#pragma unroll
    for (int i = 0; i < ACC; ++i) { reg_fence(step[i]); reg_fence(small[i]); }
    if (lane == 0) mbar_arrive(bars + 8 * (STAGES + s));
}
#endif

#if PRECISION_X3
#define MAP_PARAMS const __grid_constant__ TensorMap mapA, const __grid_constant__ TensorMap mapA2, \
                   const __grid_constant__ TensorMap mapB, const __grid_constant__ TensorMap mapB2
#else
#define MAP_PARAMS const __grid_constant__ TensorMap mapA, const __grid_constant__ TensorMap mapB
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1) fastmm_wgmma_tf32(
    MAP_PARAMS, float* __restrict__ C,
    i64 M_, i64 N_, i64 K_, i64 sCm, i64 sCn, i64 batch_inner_, i64 batch_total_, i64 sC0, i64 sC1, i64 bcast) {
    const int M = (int)M_, N = (int)N_, K = (int)K_;
    const int batch_inner = (int)batch_inner_, batch_total = (int)batch_total_;
    extern __shared__ unsigned char smem_raw[];
    // Swizzled tiles must start on a 1024-byte boundary; the host asks for 1 KiB of slack.
    const unsigned base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const unsigned bars = base + STAGES * STAGE_BYTES;  // full[STAGES], then empty[STAGES]
    const int wg = threadIdx.x / 128;
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    int tm, tn;
    tile_coords<8>(blockIdx.x, tiles_m, tiles_n, tm, tn);
    const int k_tiles = (K + BK - 1) / BK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bars + 8 * s, 1);                     // the producer's arrive + the bytes
            mbar_init(bars + 8 * (STAGES + s), 2 * 4);      // one arrive per consumer warp
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
            for (int z = blockIdx.z; z < batch_total; z += gridDim.z) {
                const int z0 = z / batch_inner, z1 = z % batch_inner;
                const int a2 = (bcast & 1) ? z1 : 0, a3 = (bcast & 2) ? z0 : 0;
                const int b2 = (bcast & 4) ? z1 : 0, b3 = (bcast & 8) ? z0 : 0;
                for (int kt = 0; kt < k_tiles; ++kt, ++it) {
                    const int s = it % STAGES;
                    const unsigned phase = (it / STAGES) & 1;
                    mbar_wait(bars + 8 * (STAGES + s), phase ^ 1);
                    const unsigned full = bars + 8 * s, dst = base + s * STAGE_BYTES;
                    mbar_arrive_expect_tx(full, STAGE_BYTES);
                    tma_load_4d(dst, &mapA, full, kt * BK, tm * BM, a2, a3);
#if PRECISION_X3
                    tma_load_4d(dst + A_BYTES, &mapA2, full, kt * BK, tm * BM, a2, a3);
                    tma_load_4d(dst + 2 * A_BYTES, &mapB, full, kt * BK, tn * BN, b2, b3);
                    tma_load_4d(dst + 2 * A_BYTES + B_BYTES, &mapB2, full, kt * BK, tn * BN, b2, b3);
#else
                    tma_load_4d(dst + A_BYTES, &mapB, full, kt * BK, tn * BN, b2, b3);
#endif
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        const int cw = wg - 1;  // which 64 rows of the tile
        const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
        float d[ACC];  // tf32: the accumulators; tf32x3: the promoted big products
#if PRECISION_X3
        float step[ACC], small[ACC];
#endif
        int it = 0;
        for (int z = blockIdx.z; z < batch_total; z += gridDim.z) {
#pragma unroll
            for (int i = 0; i < ACC; ++i) d[i] = 0.f;
#if PRECISION_X3
            // Groups of PROMOTE_EVERY k-steps, each step's code written out (a run-time test
            // in the loop made ptxas spill the three accumulator sets).
            int kt = 0;
            for (; kt + PROMOTE_EVERY <= k_tiles; kt += PROMOTE_EVERY) {
#pragma unroll
                for (int g = 0; g < PROMOTE_EVERY; ++g) x3_step(step, small, base, bars, cw, lane, it++, kt + g, g == 0);
#pragma unroll
                for (int i = 0; i < ACC; ++i) PROMOTE(d[i], step[i], small[i]);  // the add's error joins small
            }
            if (kt < k_tiles) {
#pragma unroll
                for (int g = 0; g < PROMOTE_EVERY - 1; ++g)
                    if (kt + g < k_tiles) x3_step(step, small, base, bars, cw, lane, it++, kt + g, g == 0);
#pragma unroll
                for (int i = 0; i < ACC; ++i) PROMOTE(d[i], step[i], small[i]);
            }
#else
            for (int kt = 0; kt < k_tiles; ++kt, ++it) {
                const int s = it % STAGES;
                mbar_wait(bars + 8 * s, (it / STAGES) & 1);
                const unsigned slot = base + s * STAGE_BYTES;
                const unsigned a_tile = slot + cw * 64 * 128, b_tile = slot + A_BYTES;
#pragma unroll
                for (int i = 0; i < ACC; ++i) reg_fence(d[i]);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 8; ++kk)
                    WGMMA(d, smem_desc(a_tile + kk * 32), smem_desc(b_tile + kk * 32), kt > 0 || kk > 0);
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
#endif

            // Epilogue: thread (warp, lane) holds, for each 8-column group j, rows g and g + 8
            // of its warp's 16 rows, columns 2t and 2t + 1 (g = lane / 4, t = lane % 4).
            float* Cb = C + (i64)(z / batch_inner) * sC0 + (i64)(z % batch_inner) * sC1;
            const int row = tm * BM + cw * 64 + warp * 16 + lane / 4;
            const int col0 = tn * BN + 2 * (lane % 4);
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                const int col = col0 + 8 * j;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = row + 8 * h;
                    if (r >= M) continue;
                    float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
#if PRECISION_X3
                    // Where the big products overflowed or met Inf/NaN, that is the fp32 answer.
                    v0 = isfinite(v0) ? v0 + small[4 * j + 2 * h] : v0;
                    v1 = isfinite(v1) ? v1 + small[4 * j + 2 * h + 1] : v1;
#endif
                    float* p = Cb + (i64)r * sCm + (i64)col * sCn;
#if C_VEC
                    if (col < N) *(float2*)p = make_float2(v0, v1);
#else
                    if (col < N) p[0] = v0;
                    if (col + 1 < N) p[sCn] = v1;
#endif
                }
            }
        }
    }
}
