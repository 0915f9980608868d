"""Where the host time of one fastmm.matmul call goes: the wall time per call of repeated calls of
one shape (not synchronized in between), then cProfile over the same calls, top functions by
their own time:

    python benchmarks/probes/host_profile.py M N K [precision] [batch] [--calls N] [--top N]
    python benchmarks/probes/host_profile.py M N K [precision] [batch] --linear

``--linear``: the same for a ``fastmm.nn.Linear(K, N)`` layer on an input of (batch, M, K):
forward without grad, forward with grad, forward plus backward, each beside torch's Linear (the
GPU kept busy ahead, so only enqueue time counts), each profiled.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

import fastmm  # noqa: E402
from probe_util import enqueue_us, need_gpu  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="host_profile.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("M", type=int)
    ap.add_argument("N", type=int)
    ap.add_argument("K", type=int)
    ap.add_argument("precision", nargs="?", default="ieee", choices=fastmm.PRECISIONS)
    ap.add_argument("batch", nargs="?", type=int, default=0, help="a batch dim of this size on both operands")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=22, help="functions listed")
    ap.add_argument("--linear", action="store_true", help="profile a fastmm.nn.Linear layer instead")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    if o.linear:
        return profile_linear(o)
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


def profile_linear(o) -> int:
    torch.manual_seed(0)
    ref = torch.nn.Linear(o.K, o.N, device="cuda")
    fm = fastmm.nn.Linear.from_linear(ref, precision=o.precision)
    batch = (o.batch,) if o.batch else ()
    x = torch.randn(*batch, o.M, o.K, device="cuda")
    xg = x.clone().requires_grad_()
    g = torch.randn(*batch, o.M, o.N, device="cuda")
    cases = (("forward, no grad", lambda m: m(x), True), ("forward with grad", lambda m: m(xg), False),
             ("forward + backward", lambda m: m(xg).backward(g), False))
    for what, fn, no_grad in cases:
        calls = o.calls if "backward" not in what else max(20, o.calls // 4)
        ctx = torch.no_grad if no_grad else contextlib.nullcontext
        with ctx():
            t, f = enqueue_us(lambda: fn(ref), calls), enqueue_us(lambda: fn(fm), calls)
            print(f"\n=== {what}: torch {t:.1f} us, fastmm {f:.1f} us per call ({o.precision})")
            prof = cProfile.Profile()
            torch.cuda._sleep(200_000_000)
            prof.enable()
            for _ in range(calls):
                fn(fm)
            prof.disable()
            torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(o.top)
    return 0




if __name__ == "__main__":
    raise SystemExit(main())
