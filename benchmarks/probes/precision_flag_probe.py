"""Does torch's global TF32 flag, or fastmm's precision argument, change the time of a fastmm
call whose kernel is the same either way (decode16, 16x4096x4096: ``skinny`` for every precision)?
Issue 16 left open why bench.py's decode16 tf32 row ran 0.73x torch where ieee ran 3.2x:

    python benchmarks/probes/precision_flag_probe.py [M N K] [--calls N]

For each (torch.backends.cuda.matmul.allow_tf32, precision) pair, in one process: the wall time
per back-to-back eager call (synchronized at the ends), the GPU time per call from CUDA events
around 200 calls, and the GPU time of the same calls replayed from a CUDA graph (no host).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

import fastmm  # noqa: E402
from probe_util import need_gpu  # noqa: E402


def per_call_us(fn, calls):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(calls):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6, e0.elapsed_time(e1) * 1e3 / calls


def graph_us(fn, calls):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(calls // 20):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / (calls // 20 * 20)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="precision_flag_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("dims", nargs="*", type=int, default=[16, 4096, 4096])
    ap.add_argument("--calls", type=int, default=200)
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    M, N, K = o.dims
    a, b = torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda")
    c = torch.empty(M, N, device="cuda")
    print(f"{M}x{N}x{K}: allow_tf32 | precision | kernel | wall us/call | events us/call | graph us/call")
    for rnd in range(2):
        for flag in (False, True):
            for prec in ("ieee", "tf32", "tf32x3"):
                torch.backends.cuda.matmul.allow_tf32 = flag
                fn = lambda: fastmm.matmul(a, b, out=c, precision=prec)  # noqa: E731
                kernel = fastmm.explain(a, b, precision=prec, out=c).kernel
                wall, ev = per_call_us(fn, o.calls)
                gr = graph_us(fn, o.calls)
                print(f"round {rnd} | {flag} | {prec} | {kernel} | {wall:.2f} | {ev:.2f} | {gr:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
