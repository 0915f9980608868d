// Second pass of split-K: C[m][n] = sum over s of W[s][m][n], summed in order s = 0, 1, ... so
// the result is the same bits on every run (no atomics). W is S contiguous M x N slices. With
// EPILOGUE = 1 this pass applies the plan's fused epilogue (the GEMM's slices are partial sums).
// The slices were just written and sit in L2, read once: a thread issues IN_FLIGHT loads
// (ld.global.cg, L2 only) before adding them, still in order. The plain loop kept 4 loads in
// flight: 17.9 -> 13.3 us per launch for 66 slices of 256 x 256 on the H200 (NOTES.md run 12).
#include "common.cuh"

#define IN_FLIGHT 16  // loads a thread issues before adding them

extern "C" __global__ void __launch_bounds__(256) fastmm_splitk_reduce(
    const float* __restrict__ W, float* __restrict__ C, i64 M, i64 N, i64 S, i64 sCm, i64 sCn FASTMM_EPILOGUE_PARAMS) {
    FASTMM_EPILOGUE
    const i64 slice = M * N;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < slice; i += (i64)gridDim.x * blockDim.x) {
        const float* w = W + i;
        float sum = 0.f;
        i64 s = 0;
        for (; s + IN_FLIGHT <= S; s += IN_FLIGHT) {
            float v[IN_FLIGHT];
#pragma unroll
            for (int u = 0; u < IN_FLIGHT; ++u) v[u] = ld_l2(w + (s + u) * slice);
#pragma unroll
            for (int u = 0; u < IN_FLIGHT; ++u) sum += v[u];
        }
        for (; s < S; ++s) sum += ld_l2(w + s * slice);
        const int m = (int)(i / N), n = (int)(i % N);
        C[(i64)m * sCm + (i64)n * sCn] = epi(sum, m, n);
    }
}
