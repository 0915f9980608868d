#!/usr/bin/env python3
"""Small and mid-size fp32 products on simt_cp_async: how many K slices fill the H200? The split
model counts a tile's blocks per SM as ``blocks_per_sm`` (until NOTES run 33 2 for tiles of up
to 4 warps, while the 2-warp 64 x 64 tile is built for 6, CP_MIN_BLOCKS; now the 8 x 8 tiles as
built, at most 4): which count puts the planned split nearest the best? For each product:
torch.matmul, the planned plan, and the planner's tile with K split S ways (the variant
SimtCpAsync(split=S, stream_k=False); up to 4 slices summed by their last block, more by
splitk_reduce), GPU us by CUDA graph replay, each checked against float64.

    python benchmarks/probes/simt_split_probe.py [--splits 1,2,3,4,6,8,12,16] \\
        [--shapes FILE [--rows a,b]] [--fused-max N] [--tiles planned|all] [--json PATH]

``--shapes``: the products of a suite file's model rows (their layouts as bench.py lays them out)
in place of the list below; every kernel is compiled first, on all cores. ``--tiles all``: every tile the family
offers the product (``SimtCpAsync.options``), each with each split, not the planner's tile alone
(``probe_util.SimtOption``); ``--json PATH``: every timing of every product, for fitting a rule
offline. ``--fused-max N``: the
swept plans sum up to N slices in their own last blocks (``SimtCpAsync.fused_split_max``; the
planner's FUSED_SPLIT_MAX is 4), more by splitk_reduce, so that one sweep with N = 16 and one with
the default put the two sums of the same split side by side (NOTES run 46). A summary line a
product: the planned split and time, the best swept, torch.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

import fastmm  # noqa: E402
from fastmm import dispatch  # noqa: E402
from fastmm.families import SimtCpAsync  # noqa: E402
from fastmm.plan import select  # noqa: E402
from probe_util import SimtOption, compile_plans, graph_us, need_gpu, rel_err  # noqa: E402

#: (M, N, K, B^T: x @ W.t() with W stored [N, K])
PRODUCTS = [(300, 700, 1100, True), (197, 768, 3072, True), (128, 4096, 4096, True), (256, 1024, 4096, True),
            (512, 512, 2048, False), (1000, 1000, 1000, False), (77, 1531, 2053, False), (64, 14336, 4096, True),
            (384, 768, 768, True), (96, 3072, 768, True)]


def products(o):
    """(name, a, b) of each product, on the GPU."""
    if o.shapes is None:
        for M, N, K, bt in PRODUCTS:
            a = torch.randn(M, K, device="cuda")
            b = torch.randn(N, K, device="cuda").t() if bt else torch.randn(K, N, device="cuda")
            yield f"{M}x{N}x{K}{' W^T' if bt else ''}", a, b
        return
    import candidates
    rows, _ = candidates.model_rows(o.rows, o.shapes)
    for s in rows:
        a, b, _ = candidates.operands(s, torch.device("cuda"))
        yield f"{s['name']} {s['M']}x{s['N']}x{s['K']} {s.get('layout')}", a, b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="simt_split_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--splits", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--rows", default=None)
    ap.add_argument("--fused-max", type=int, default=None)
    ap.add_argument("--tiles", choices=("planned", "all"), default="planned")
    ap.add_argument("--json", default=None)
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    splits = [int(x) for x in o.splits.split(",")]
    items = list(products(o))
    dev = dispatch.device_facts(torch.cuda.current_device())
    planned_plans = [fastmm.explain(a, b, precision="ieee").plan for _, a, b in items]
    fused = {} if o.fused_max is None else {"fused_split_max": o.fused_max}
    fam0 = SimtCpAsync()

    def tiles_of(plan):  # the (WARPS_M, WARPS_N, THREAD_M) options swept for a plan's product
        if o.tiles == "planned" or plan.kernel is None or plan.kernel.family != "simt_cp_async":
            return [None]
        return list(dict.fromkeys(tuple(opt[:3]) for opt in fam0.options(plan.problem, dev)))

    def variant(tile, S):
        if tile is None:
            return SimtCpAsync(split=S, stream_k=False, **fused)
        return SimtOption(option=tile + (1,), split=S, stream_k=False, **fused)

    swept = [select(p.problem, dev, "simt_cp_async", None, (variant(t, S),))
             for p in planned_plans for t in tiles_of(p) for S in splits]
    print(f"compiled {compile_plans(planned_plans + [p for p in swept if p.kernel is not None], dev.arch)} kernels",
          flush=True)  # all first, on all cores
    summary, records = [], []
    for (name, a, b), plan in zip(items, planned_plans):
        out = torch.empty(a.shape[:-1] + b.shape[-1:], device="cuda")
        t_torch = graph_us(lambda: torch.matmul(a, b, out=out))
        t_plan = graph_us(lambda: fastmm.matmul(a, b, out=out, precision="ieee"))
        cfg = plan.kernel
        planned = cfg.split_slices if cfg.split_k > 1 else 1
        print(f"{name}: torch {t_torch:.1f} us, planned {t_plan:.1f} us "
              f"({cfg.family} {cfg.tile}, split {planned}, grid {cfg.grid})", flush=True)
        rec = {"name": name, "problem": [plan.problem.M, plan.problem.N, plan.problem.K], "torch_us": t_torch,
               "planned": {"family": cfg.family, "tile": list(cfg.tile), "split": planned,
                           "stream_k": cfg.stream_k is not None, "us": t_plan}, "swept": []}
        records.append(rec)
        if cfg.family != "simt_cp_async":
            continue
        best = (t_plan, planned, tuple(cfg.tile))
        for tile in tiles_of(plan):
            row = []
            for S in splits:
                fam = variant(tile, S)
                out.fill_(float("nan"))
                _, p, reason = dispatch.matmul_fastmm(a, b, out, "ieee", force="simt_cp_async", variants=(fam,))
                if reason is not None:
                    row.append(f"S{S} -")
                    continue
                err = rel_err(out, a, b)
                us = graph_us(lambda: dispatch.matmul_fastmm(a, b, out, "ieee", force="simt_cp_async", variants=(fam,)))
                got = p.kernel.split_slices if p.kernel.split_k > 1 else 1
                row.append(f"S{got}{'f' if p.kernel.split_fused else ''} {us:.1f}{'' if err < 1e-5 else ' ERR%.0e' % err}")
                rec["swept"].append({"tile": list(p.kernel.tile), "option": list(tile or ()), "asked": S, "split": got,
                                     "fused": p.kernel.split_fused, "us": us, "err": err})
                if err < 1e-5 and us < best[0]:
                    best = (us, got, tuple(p.kernel.tile))
            shown = p.kernel.tile if tile is not None and p is not None and p.kernel is not None else cfg.tile
            print("    tile " + "x".join(map(str, shown)) + ": " + ", ".join(row), flush=True)
        summary.append(f"{name} | {planned} | {t_plan:.1f} | {'x'.join(map(str, best[2]))} S{best[1]} | {best[0]:.1f} "
                       f"| {t_torch:.1f}")
        if o.json:
            Path(o.json).write_text(json.dumps(records, indent=1))
    print("product | planned split | us | best tile, split | us | torch us")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
