#!/usr/bin/env python3
"""The cost model's host time a call (``fastmm.cost``: ``HOST_US_*``) against the host's
enqueue time measured now, for plans of one to three launches: a plain SIMT call, wgmma
without copies, wgmma with two staging copies (odd widths on W^T), a split-K plan, tf32_mma.
The model's host figures decide where a host-bound TF32 plan gives way to full fp32
(``plan._faster_if_predicted``); they were measured in RESULTS run 21, before later work on the
host path.

    PYTHONPATH=. python benchmarks/probes/host_per_call.py [--calls 300]

Each row: the plan (family, launches, buffers), the model's host us, the measured enqueue us of
``fastmm.matmul(a, b, out=c, precision=...)`` (queued behind a GPU sleep: enqueue time only),
and torch.matmul's the same way.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

import fastmm  # noqa: E402
from fastmm import cost  # noqa: E402
from fastmm.precision import torch_precision  # noqa: E402
from probe_util import enqueue_us, need_gpu  # noqa: E402

#: (name, M, N, K, batch, B transposed, precision)
ROWS = [  # (the plan each runs is printed beside it: the names say what was meant)
    ("plain SIMT 16x4096x4096 W^T", 16, 4096, 4096, 1, True, "ieee"),
    ("SIMT 1000^3", 1000, 1000, 1000, 1, False, "ieee"),
    ("wgmma 1000^3", 1000, 1000, 1000, 1, False, "tf32"),
    ("tf32x3 1024x700x64", 1024, 700, 64, 1, False, "tf32x3"),  # (wgmma with two copies in run 21)
    ("wgmma odd_733 W^T", 733, 1999, 517, 1, True, "tf32"),
    ("wgmma odd 999x1001x1003 W^T", 999, 1001, 1003, 1, True, "tf32"),
    ("split-K 128x4096x16384", 128, 4096, 16384, 1, False, "ieee"),
    ("tf32_mma 4096 x 64^3", 64, 64, 64, 4096, False, "tf32"),
    ("bmm 512 x 64^3 tf32", 64, 64, 64, 512, False, "tf32"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="host_per_call.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    opts = ap.parse_args(argv)
    if not need_gpu("host_per_call.py"):
        return 2
    print(f"{'row':<30} {'plan':<34} {'model':>7} {'fastmm':>7} {'torch':>7}  us a call (enqueue)")
    for name, M, N, K, batch, bt, prec in ROWS:
        shape_a = (batch, M, K) if batch > 1 else (M, K)
        a = torch.randn(*shape_a, device="cuda")
        b = torch.randn(*((batch, N, K) if batch > 1 else (N, K)), device="cuda").transpose(-1, -2) if bt \
            else torch.randn(*((batch, K, N) if batch > 1 else (K, N)), device="cuda")
        c = torch.empty(*(shape_a[:-1] + (N,)), device="cuda")
        exp = fastmm.explain(a, b, precision=prec)
        pred = cost.predict(exp.plan)
        kernel = exp.plan.kernel
        launches = pred.launches if pred else 0
        plan = f"{kernel.family if kernel else 'torch'} ({launches} launch{'es' if launches != 1 else ''})"
        calls = max(20, min(opts.calls, int(60_000 / max(1.0, pred.total_us)) if pred else opts.calls))
        mine = enqueue_us(lambda: fastmm.matmul(a, b, out=c, precision=prec), calls)
        with torch_precision(prec):
            theirs = enqueue_us(lambda: torch.matmul(a, b, out=c), calls)
        print(f"{name:<30} {plan:<34} {pred.host_us if pred else float('nan'):7.1f} {mine:7.1f} {theirs:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
