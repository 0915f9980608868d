// fastmm PTX helpers: the few instructions the kernels need, as inline PTX.
// Written without CUDA toolkit headers on purpose: NVRTC alone (from its pip wheel) must be
// enough to build every kernel (the toolkit's mma.h pulls in crt/ headers a pip install lacks).
#pragma once

typedef long long i64;

// Loads cached in L2 only (.cg): for data read once that another kernel just wrote, such as
// the partial sums the second passes of split-K and stream-K add up.
__device__ __forceinline__ float ld_l2(const float* p) {
    float v;
    asm("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
    return v;
}
// The same, volatile: it stays after the fences and barriers before it (ld_l2 is free to move,
// the compiler does not see that it reads memory). For slices other blocks of this launch wrote.
__device__ __forceinline__ float ld_l2_ordered(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float4 ld_l2_v4(const float* p) {
    float4 v;
    asm("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ float4 ld_l2_v4_ordered(const float* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p) : "memory");
    return v;
}

#if __CUDA_ARCH__ >= 900
// Thread-block clusters (sm_90): this block's rank in its cluster; a barrier of the whole
// cluster (release / acquire: shared-memory writes before it are visible to the other blocks
// after it); a 16-byte store into the shared memory of block `rank` of the cluster.
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// Split: arrive (no memory ordering) now, wait later: e.g. at the start, so that before the first
// access to a partner's shared memory the wait proves the partner has started (a block may only
// touch the shared memory of a cluster block that is running).
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void st_cluster_v4(unsigned smem_address, unsigned rank, float4 v) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_address), "r"(rank));
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(remote), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}
#endif

// Programmatic dependent launch (sm_90+; KernelConfig.dependent_launch, fastmm/runtime/launcher.py):
// the host lets a kernel be scheduled before the kernel ahead of it on the stream has finished,
// which hides the ~1 us launch gap between back-to-back kernels. So a kernel launched that way
// calls this first, before any global memory access: it waits until the kernel ahead has
// completed and its writes are visible, and only then lets the next kernel be scheduled (at
// most one grid waits behind a running one). Without such a launch (or below sm_90) both
// instructions are no-ops.
__device__ __forceinline__ void grid_dependency_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Shared-memory address of a generic pointer, as the 32-bit value cp.async wants.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

#if __CUDA_ARCH__ >= 800
// Global->shared copy of BYTES = 16 (bypasses L1: .cg) or 4 (the unit for transposing,
// unaligned or arbitrarily strided operands) to a 32-bit shared address. valid = false gives
// src-size 0: nothing is read and the destination is zero-filled, which is how out-of-range
// units at tile edges become zeros without a branch in the copy.
template <int BYTES>
__device__ __forceinline__ void cp_async_to(unsigned dst, const void* src, bool valid) {
    static_assert(BYTES == 16 || BYTES == 4, "cp.async copies 4 or 16 bytes here");
    if (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                     :: "r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                     :: "r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
// The same from a generic shared pointer.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    cp_async_to<16>(smem_addr(dst), src, valid);
}
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
    cp_async_to<4>(smem_addr(dst), src, valid);
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// Round to nearest (ties away) to TF32, as cuBLAS does: truncation doubles the error (DESIGN.md).
__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

// tf32x3's halves of x as the wgmma family stores them: big = tf32(x), small = tf32(x - big), and
// small = 0 for +-Inf / NaN (big alone then carries fp32's answer). One definition for the staging
// pass and the kernel that splits B itself (X3_SPLIT_B), whose results must be the same bits.
__device__ __forceinline__ void tf32_halves(float x, float& big, float& small) {
    big = __uint_as_float(to_tf32(x));
    small = isfinite(x) ? __uint_as_float(to_tf32(x - big)) : 0.f;
}

// D = A(16x8, row) * B(8x8, col) + D on tensor cores, TF32 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_tf32_16x8x8(float d[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

#if __CUDA_ARCH__ >= 900
// ---- Hopper: mbarriers and the bulk tensor copy engine (TMA), plain sm_90 ----

// A tensor map (CUtensorMap) as the driver encodes it: 128 opaque bytes, passed to the kernel by
// value as a __grid_constant__ parameter so the copy engine can read it from parameter space.
struct __align__(64) TensorMap { unsigned long long opaque[16]; };

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
// Make the barrier initialisation visible to the copy engine (async proxy) before first use.
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// Arrive and announce how many bytes the copies completing on this phase will deliver.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
// Spin until the phase with the given parity has completed. On a fresh barrier, parity 1 counts
// as complete (the "previous" phase), which is what lets a producer fill every stage once.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done = 0;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// 4-D tiled copy global -> shared, completing on mbarrier ``bar``; out-of-range elements read 0.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TensorMap* map, unsigned bar,
                                            int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
        :: "r"(dst), "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(map) : "memory");
}
// 4-D tiled copy shared -> global (a bulk group: commit, then wait before reusing the source);
// elements outside the map's dims are not written.
__device__ __forceinline__ void tma_store_4d(const TensorMap* map, unsigned src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                 :: "l"(map), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// The committed bulk stores have read their shared-memory source (it may be written again).
__device__ __forceinline__ void bulk_wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// The committed bulk stores are complete.
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Order this thread's shared-memory writes before later reads by the copy engine (async proxy).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#endif
