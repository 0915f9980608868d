"""Where the host time of one fastmm.matmul call goes: cProfile over repeated calls of one shape
(`python benchmarks/host_profile.py 1000 1000 1000 tf32 [batch]`), top functions by own time."""
from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

sys.path.insert(0, ".")
import fastmm  # noqa: E402


def main(argv):
    M, N, K = (int(x) for x in argv[:3])
    precision = argv[3] if len(argv) > 3 else "ieee"
    batch = (int(argv[4]),) if len(argv) > 4 else ()
    a, b = torch.randn(*batch, M, K, device="cuda"), torch.randn(*batch, K, N, device="cuda")
    for _ in range(3):
        fastmm.matmul(a, b, precision=precision)
    torch.cuda.synchronize()
    calls = 200
    t0 = time.perf_counter()
    for _ in range(calls):
        fastmm.matmul(a, b, precision=precision)
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    print(f"{batch}x{M}x{N}x{K} {precision}: {host:.1f} us host per call ({fastmm.explain(a, b, precision=precision).kernel})")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fastmm.matmul(a, b, precision=precision)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main(sys.argv[1:])
