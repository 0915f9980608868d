#!/usr/bin/env python3
"""Does a tf32x3 product err the same way on every row when A is one-signed? The encoder's tf32x3
gradient excess (NOTES runs 39-40) sits in its last layer norm, whose gradients sum the output
over all 8192 tokens: an error common to a column's rows adds up T times there, where independent
errors add up sqrt(T) times. N(0, 1) operands showed no such bias (RESULTS run 34); linear2's A is
a ReLU output (every entry >= 0), so a rounding that leans one way (the tensor core's accumulation,
the halves' rounding) would not cancel over k there.

    python benchmarks/probes/x3_bias_probe.py [--sizes 8192x1024x4096,8192x4096x1024] [--seeds 2]

For each size and A's distribution (N(0,1); relu(N(0,1)); |N(0,1)|), B = N(0, 1/K) read as W^T
(nn.Linear's layout), fresh inputs per seed: fastmm tf32x3, fastmm ieee and torch fp32 against
float64, three numbers each: the relative Frobenius error of C; the mean error over all outputs
as a share of the error's rms (a bias); the relative error of C's column sums (sum over rows, as a
bias gradient sums over tokens), against the same for float64's column sums.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

import fastmm  # noqa: E402
from probe_util import need_gpu  # noqa: E402

DISTS = {"normal": lambda x: x, "relu": torch.relu, "abs": torch.abs}


def stats(c: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    err = c.double() - ref
    rel = (err.norm() / ref.norm()).item()
    bias = (err.mean() / err.pow(2).mean().sqrt()).item()
    cols, cols_ref = c.double().sum(0), ref.sum(0)
    return rel, bias, ((cols - cols_ref).norm() / cols_ref.norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8192x1024x4096,8192x4096x1024")
    ap.add_argument("--seeds", type=int, default=2)
    o = ap.parse_args()
    if not need_gpu("x3_bias_probe.py"):
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    print("size dist seed | rel err C (torch fp32 / fastmm ieee / fastmm tf32x3) | mean err / rms err | "
          "rel err of column sums")
    for size in o.sizes.split(","):
        M, N, K = (int(x) for x in size.split("x"))
        for name, dist in DISTS.items():
            for seed in range(o.seeds):
                torch.manual_seed(seed)
                a = dist(torch.randn(M, K, device="cuda"))
                w = torch.randn(N, K, device="cuda") / K ** 0.5
                ref = a.double() @ w.double().t()
                rows = []
                for label, fn in (("torch", lambda: torch.matmul(a, w.t())),
                                  ("ieee", lambda: fastmm.matmul(a, w.t(), precision="ieee")),
                                  ("tf32x3", lambda: fastmm.matmul(a, w.t(), precision="tf32x3"))):
                    c = fn()
                    torch.cuda.synchronize()
                    rows.append((label, stats(c, ref)))
                cells = [" / ".join(f"{r[i]:.2e}" for _, r in rows) for i in range(3)]
                print(f"{size} {name} {seed} | {cells[0]} | {cells[1]} | {cells[2]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
