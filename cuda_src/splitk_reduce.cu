// Second pass of split-K: C[m][n] = sum over s of W[s][m][n], summed in order s = 0, 1, ... so
// the result is the same bits on every run (no atomics). W is S contiguous M x N slices.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) fastmm_splitk_reduce(
    const float* __restrict__ W, float* __restrict__ C, i64 M, i64 N, i64 S, i64 sCm, i64 sCn) {
    const i64 slice = M * N;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < slice; i += (i64)gridDim.x * blockDim.x) {
        float sum = 0.f;
        for (i64 s = 0; s < S; ++s) sum += W[s * slice + i];
        C[(i / N) * sCm + (i % N) * sCn] = sum;
    }
}
