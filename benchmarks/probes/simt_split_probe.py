#!/usr/bin/env python3
"""Small and mid-size fp32 products on simt_cp_async: how many K slices fill the H200? The split
model counts a tile's blocks per SM as ``blocks_per_sm`` (2 for tiles of up to 4 warps), while the
2-warp 64 x 64 tile is built for 6 (CP_MIN_BLOCKS): so are more slices faster where its tiles
are few? For each product: torch.matmul, the planned plan, and the planner's tile with K split
S ways (the variant SimtCpAsync(split=S, stream_k=False); up to 4 slices summed by their last
block, more by splitk_reduce), GPU us by CUDA graph replay, each checked against float64.

    python benchmarks/probes/simt_split_probe.py [--splits 1,2,3,4,6,8,12,16]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

import fastmm  # noqa: E402
from fastmm import dispatch  # noqa: E402
from fastmm.families import SimtCpAsync  # noqa: E402
from probe_util import graph_us, need_gpu, rel_err  # noqa: E402

#: (M, N, K, B^T: x @ W.t() with W stored [N, K])
PRODUCTS = [(300, 700, 1100, True), (197, 768, 3072, True), (128, 4096, 4096, True), (256, 1024, 4096, True),
            (512, 512, 2048, False), (1000, 1000, 1000, False), (77, 1531, 2053, False), (64, 14336, 4096, True),
            (384, 768, 768, True), (96, 3072, 768, True)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="simt_split_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--splits", default="1,2,3,4,6,8,12,16")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    splits = [int(x) for x in o.splits.split(",")]
    for M, N, K, bt in PRODUCTS:
        a = torch.randn(M, K, device="cuda")
        b = torch.randn(N, K, device="cuda").t() if bt else torch.randn(K, N, device="cuda")
        out = torch.empty(M, N, device="cuda")
        t_torch = graph_us(lambda: torch.matmul(a, b, out=out))
        t_plan = graph_us(lambda: fastmm.matmul(a, b, out=out, precision="ieee"))
        plan = fastmm.explain(a, b, precision="ieee").plan
        cfg = plan.kernel
        print(f"{M}x{N}x{K}{' W^T' if bt else ''}: torch {t_torch:.1f} us, planned {t_plan:.1f} us "
              f"({cfg.family} {cfg.describe() if hasattr(cfg, 'describe') else cfg.tile}, grid {cfg.grid})", flush=True)
        if cfg.family != "simt_cp_async":
            continue
        row = []
        for S in splits:
            fam = SimtCpAsync(split=S, stream_k=False)
            out.fill_(float("nan"))
            _, p, reason = dispatch.matmul_fastmm(a, b, out, "ieee", force="simt_cp_async", variants=(fam,))
            if reason is not None:
                row.append(f"S{S} -")
                continue
            err = rel_err(out, a, b)
            us = graph_us(lambda: dispatch.matmul_fastmm(a, b, out, "ieee", force="simt_cp_async", variants=(fam,)))
            row.append(f"S{p.kernel.grid[1]} {us:.1f}{'' if err < 1e-5 else ' ERR%.0e' % err}")
        print("    tile " + "x".join(map(str, cfg.tile)) + ": " + ", ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
