#!/usr/bin/env python3
"""Small TF32 products (a fraction of a wave of 128-row tiles): TF32 wgmma, which does not split
K, against tf32_mma, which does (the planner decides between them by WgmmaTf32.heuristic_reason's
time estimate, fitted to this probe; it was "a third of the SMs in 128 x 128 tiles" before).

    python benchmarks/probes/small_tf32_probe.py [--precisions tf32,tf32x3]

For each product: GPU us per call (probe_util.time_us) of the planner's plan, of each family
forced, and of torch (TF32 allowed for tf32; full fp32 for tf32x3), with the wgmma tile count
(narrowest width the wave rule may take: 128 x 64) and each result's error against float64.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from probe_util import need_gpu, rel_err, time_us  # noqa: E402

#: (name, M, N, K, B layout): "wt" = x @ W.t(), "rm" = row-major
PRODUCTS = (("odd_small", 300, 700, 1100, "wt"), ("issue_77", 77, 1531, 2053, "rm"), ("p256_512_1k", 256, 512, 1024, "wt"),
            ("sq512", 512, 512, 512, "rm"), ("p128_1k_1k", 128, 1024, 1024, "wt"), ("p200_1k_4k", 200, 1000, 4096, "wt"),
            ("p64_4k_4k", 64, 4096, 4096, "wt"), ("p384_768", 384, 768, 768, "wt"), ("p512_2k_512", 512, 2048, 512, "rm"),
            ("p256_4k_1k", 256, 4096, 1024, "wt"), ("p1000", 1000, 1000, 1000, "wt"), ("p100_300_8k", 100, 300, 8192, "wt"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="tf32,tf32x3")
    o = ap.parse_args()
    if not need_gpu("small_tf32_probe.py"):
        return 2
    torch.manual_seed(0)
    families = ("wgmma_tf32", "tf32_mma")
    for prec in o.precisions.split(","):
        torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
        print(f"\n{prec}: GPU us per call")
        print(f"{'product':<13} {'shape':<18} {'tiles64':>7} {'planner':>24} {'us':>7} "
              + " ".join(f"{f:>10}" for f in families) + f" {'torch':>7} {'best fam/pl':>11} {'torch/pl':>8}  errors")
        for name, M, N, K, layout in PRODUCTS:
            a = torch.randn(M, K, device="cuda")
            b = torch.randn(N, K, device="cuda").t() if layout == "wt" else torch.randn(K, N, device="cuda")
            out = torch.empty(M, N, device="cuda")
            errs, times = [], {}
            c = torch.full_like(out, float("nan"))
            _, plan, _ = dispatch.matmul_fastmm(a, b, c, prec)
            errs.append(rel_err(c, a, b))
            times["planner"] = time_us(lambda: dispatch.matmul_fastmm(a, b, out, prec))
            for fam in families:
                c = torch.full_like(out, float("nan"))
                _, pl, reason = dispatch.matmul_fastmm(a, b, c, prec, force=fam)
                if reason is not None or pl is None or pl.kernel is None or pl.kernel.family != fam:
                    times[fam] = float("nan")
                    continue
                errs.append(rel_err(c, a, b))
                times[fam] = time_us(lambda: dispatch.matmul_fastmm(a, b, out, prec, force=fam))
            tt = time_us(lambda: torch.matmul(a, b, out=out))
            k = plan.kernel
            desc = f"{k.family[:10]} {k.tile[0]}x{k.tile[1]}" + (f" s{k.split_k}" if k.split_k > 1 else "")
            best = min(times[f] for f in families if times[f] == times[f])
            tiles = -(-max(M, 1) // 128) * -(-N // 64)
            print(f"{name:<13} {M}x{N}x{K}{' W^T' if layout == 'wt' else '':<4} {tiles:>7} {desc:>24} {times['planner']:7.1f} "
                  + " ".join(f"{times[f]:10.1f}" for f in families) + f" {tt:7.1f} {best / times['planner']:11.3f} "
                  f"{tt / times['planner']:8.3f}  {' '.join(f'{e:.1e}' for e in errs)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
