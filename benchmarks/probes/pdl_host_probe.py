#!/usr/bin/env python3
"""Does a programmatic dependent launch cost host-bound decode calls host time? Each
decode-sized product (x @ W.t(), out= preallocated) called back to back, its host time per call
measured with the GPU kept busy ahead (probe_util.enqueue_us), launched as planned (the skinny
families: a dependent launch on sm_90) and plainly (FASTMM_PDL=0), rounds alternating, every
plan made again for each mode; torch.matmul beside.

    python benchmarks/probes/pdl_host_probe.py [--rounds 5] [--calls 150]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

import fastmm  # noqa: E402
from fastmm import config, fast_path  # noqa: E402
from probe_util import enqueue_us, need_gpu  # noqa: E402

SHAPES = ((1, 1024, 1024), (1, 256, 1024), (1, 1024, 4096), (1, 2816, 1024), (8, 1024, 1024), (1, 4096, 4096))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdl_host_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=150)
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    before = os.environ.get(config.PDL_ENV)
    print("host us per call (median of rounds)      torch       plain   dependent")
    try:
        for M, N, K in SHAPES:
            x = torch.randn(M, K, device="cuda")
            w = torch.randn(N, K, device="cuda")
            out = torch.empty(M, N, device="cuda")
            times = {"torch": [], "plain": [], "dependent": []}
            for r in range(o.rounds):
                for mode in (("plain", "dependent") if r % 2 == 0 else ("dependent", "plain")):
                    os.environ[config.PDL_ENV] = "0" if mode == "plain" else "1"
                    fast_path.forget_plans()  # (the launch mode is read when a plan's kernel is loaded)
                    times[mode].append(enqueue_us(lambda: fastmm.matmul(x, w.t(), out=out, precision="ieee"), o.calls))
                times["torch"].append(enqueue_us(lambda: torch.matmul(x, w.t(), out=out), o.calls))
            med = {k: statistics.median(v) for k, v in times.items()}
            family = fastmm.explain(x, w.t(), precision="ieee").kernel
            print(f"{M}x{N}x{K} W^T ({family}){'':8s} {med['torch']:7.1f} {med['plain']:11.1f} {med['dependent']:11.1f}",
                  flush=True)
    finally:
        if before is None:
            os.environ.pop(config.PDL_ENV, None)
        else:
            os.environ[config.PDL_ENV] = before
        fast_path.forget_plans()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
