// fastmm PTX helpers: the few instructions the kernels need, as inline PTX.
// Written without CUDA toolkit headers on purpose: NVRTC alone (from its pip wheel) must be
// enough to build every kernel (the toolkit's mma.h pulls in crt/ headers a pip install lacks).
#pragma once

typedef long long i64;

// Shared-memory address of a generic pointer, as the 32-bit value cp.async wants.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

#if __CUDA_ARCH__ >= 800
// 16-byte global->shared copy that bypasses L1 (.cg); src_bytes = 0 zero-fills the destination,
// which is how out-of-range vectors at tile edges become zeros without a branch in the copy.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(n) : "memory");
}
// 4-byte copy: the unit for transposing, unaligned or arbitrarily strided operands.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
    int n = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(n) : "memory");
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

// D = A(16x8, row) * B(8x8, col) + D on tensor cores, TF32 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_tf32_16x8x8(float d[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif
