"""Where the host time of one fastmm.matmul call goes: the wall time per call of repeated calls of
one shape (not synchronized in between), then cProfile over the same calls, top functions by
their own time:

    python benchmarks/probes/host_profile.py M N K [precision] [batch] [--calls N] [--top N]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

import fastmm  # noqa: E402
from probe_util import need_gpu  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="host_profile.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("M", type=int)
    ap.add_argument("N", type=int)
    ap.add_argument("K", type=int)
    ap.add_argument("precision", nargs="?", default="ieee", choices=fastmm.PRECISIONS)
    ap.add_argument("batch", nargs="?", type=int, default=0, help="a batch dim of this size on both operands")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=22, help="functions listed")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    batch = (o.batch,) if o.batch else ()
    a, b = torch.randn(*batch, o.M, o.K, device="cuda"), torch.randn(*batch, o.K, o.N, device="cuda")
    for _ in range(3):
        fastmm.matmul(a, b, precision=o.precision)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(o.calls):
        fastmm.matmul(a, b, precision=o.precision)
    host = (time.perf_counter() - t0) / o.calls * 1e6
    torch.cuda.synchronize()
    kernel = fastmm.explain(a, b, precision=o.precision).kernel or "torch.matmul"
    print(f"{'x'.join(map(str, batch + (o.M, o.N, o.K)))} {o.precision}: {host:.1f} us host per call ({kernel})")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(o.calls):
        fastmm.matmul(a, b, precision=o.precision)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(o.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
