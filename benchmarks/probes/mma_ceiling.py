"""Ceiling of TF32 mma.sync (m16n8k8) on this GPU, registers only: how fast can a
kernel built on these instructions possibly go? (NOTES.md: the TF32 mma.sync target.)

    python benchmarks/probes/mma_ceiling.py [--iters N]

Each warp runs ITERS iterations of CHAINS independent mma.sync on register operands (no memory
traffic in the loop); EXTRA adds that many rounding pairs (FSETP + IADD, what cvt.rna.tf32
becomes on sm_90) per mma, to see what issue slots cost. Timed with CUDA events, median of 5.
"""
import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from probe_util import need_gpu  # noqa: E402

SRC = r"""
extern "C" __global__ void mma_loop(float* out, int iters, unsigned seed) {
    unsigned a[4], b[2];
    for (int q = 0; q < 4; ++q) a[q] = __float_as_uint(1.0f + (seed + threadIdx.x + q) * 1e-7f);
    for (int q = 0; q < 2; ++q) b[q] = __float_as_uint(1.0f - (seed + threadIdx.x + q) * 1e-7f);
    float d[CHAINS][4];
    for (int c = 0; c < CHAINS; ++c) for (int q = 0; q < 4; ++q) d[c][q] = 0.f;
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) {
#if EXTRA
            unsigned r[EXTRA];
#pragma unroll
            for (int e = 0; e < EXTRA; ++e) {
                float x = __uint_as_float(b[e % 2]) + (float)e;
                asm volatile("cvt.rna.tf32.f32 %0, %1;" : "=r"(r[e]) : "f"(x));
            }
            a[0] ^= r[0] & 1u;
#endif
            asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                : "+f"(d[c][0]), "+f"(d[c][1]), "+f"(d[c][2]), "+f"(d[c][3])
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
        }
    }
    float s = 0.f;
    for (int c = 0; c < CHAINS; ++c) for (int q = 0; q < 4; ++q) s += d[c][q];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mma_ceiling.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=4096, help="loop iterations per warp (default %(default)s)")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    from cuda.core import Device, EventOptions, LaunchConfig, Program, ProgramOptions, launch

    torch.cuda.init()
    dev = Device(torch.cuda.current_device())
    dev.set_current()
    arch = "sm_" + "".join(str(x) for x in dev.compute_capability)
    sms = dev.properties.multiprocessor_count
    stream = dev.create_stream()
    out = torch.empty(sms * 8 * 1024, device="cuda")
    iters = o.iters
    print(f"{torch.cuda.get_device_name()} ({arch}, {sms} SMs)")
    for chains, extra, warps, blocks_per_sm in [(8, 0, 4, 2), (8, 0, 8, 1), (8, 0, 8, 2), (16, 0, 8, 1),
                                                (8, 2, 8, 1), (8, 4, 8, 1), (4, 0, 4, 1), (8, 0, 16, 1)]:
        opts = ProgramOptions(arch=arch, std="c++17", define_macro=[("CHAINS", str(chains)), ("EXTRA", str(extra))])
        mod = Program(SRC, "c++", opts).compile("cubin")
        kern = mod.get_kernel("mma_loop")
        cfg = LaunchConfig(grid=sms * blocks_per_sm, block=32 * warps)
        times = []
        for rep in range(6):
            e0 = stream.record(options=EventOptions(timing_enabled=True))
            launch(stream, cfg, kern, out.data_ptr(), iters, rep)
            e1 = stream.record(options=EventOptions(timing_enabled=True))
            e1.sync()
            if rep:
                times.append(e1 - e0)
        ms = statistics.median(times)
        flop = sms * blocks_per_sm * warps * iters * chains * 2 * 16 * 8 * 8
        print(f"mma.sync tf32: {chains:2d} chains, {extra} cvt.rna per mma, {warps:2d} warps x {blocks_per_sm} blocks"
              f" per SM: {flop / ms / 1e9:7.1f} TFLOP/s ({ms:.3f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
