#!/usr/bin/env python3
"""The 64 x 64 SIMT tile with four warps of 4 x 8 outputs a thread against the planner's two warps
of 8 x 8, on the products the planner gives the 64 x 64 tile (ieee), everything else of the plan
kept (the K split, the reduce or fused sum, the stages, the load modes):

    PYTHONPATH=. python benchmarks/probes/four_warp_tile_probe.py [--rows NAME,...]

Why (written before its first run, 2026-12-07): on the H100 cuBLAS ran odd_small (300 x 700 x
1100, x @ W^T) as a 64 x 64 x 8 tile of four warps ("warpsize1x4x1") split along K with a second
pass, 14.9 + 3.6 us, where the planner's 64 x 64 tile of two warps took 18.8 + 3.2 (the same
split-K form; `probes/kernel_times.py --b-transposed`). With 8 x 8 outputs a thread the grid's
440 blocks put ~7 warps on an SM; four warps a block double that for the same tiles, at 1.5x the
shared-memory reads per FFMA (12 floats per 32 FFMA against 16 per 64). Expected: the GEMM 10-20%
faster where the blocks are few (a grid under ~4 blocks an SM), nothing or a loss where the SMs
are full.

For each row: GPU us per call (probe_util.time_us, behind a sleep kernel, the two tiles and torch
interleaved over ``--rounds``), each output checked against float64 first (NaN-filled C), the
two tiles' bits compared (each output sums its k-steps in the same order: they must be equal).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import benchmark as bench  # noqa: E402
from fastmm import dispatch  # noqa: E402
from fastmm.plan import select  # noqa: E402
from fastmm.runtime import launcher  # noqa: E402
from fastmm.shapes import analyse, build_problem  # noqa: E402
from probe_util import need_gpu, rel_err, time_us  # noqa: E402

#: (name, M, N, K, batch, layout as benchmark.LAYOUTS names it): rows of the shapes files the
#: planner gives the 64 x 64 tile of two warps in ieee (simulated H100, 2026-12-07)
ROWS = (
    ("odd_small", 300, 700, 1100, 1, "linear"),
    ("llama3_decode64_up", 64, 14336, 4096, 1, "linear"),
    ("decode40_up", 40, 14336, 4096, 1, "linear"),
    ("gpt2_grad_w_qkv", 768, 2304, 4096, 1, "a_t"),
    ("qwen05_qkv_768", 768, 1152, 896, 1, "linear"),
    ("smollm_up_gx_640", 640, 576, 1536, 1, "rowmajor_b"),
    ("deit_s_fc2_3152", 3152, 384, 1536, 1, "linear"),
    ("odd_733", 733, 1999, 517, 1, "linear"),
    ("short_k64", 1024, 700, 64, 1, "rowmajor"),
)
TWO_WARPS = (1, 2, 8)  # (WARPS_M, WARPS_N, THREAD_M): 64 x 64, a warp 64 x 32
FOUR_WARPS = (4, 1, 4)  # 64 x 64, a warp 16 x 64


def four_warp_plan(plan):
    """``plan`` with its 64 x 64 tile of two warps built as four (the same tile, grid and shared
    memory; twice the threads)."""
    k = plan.kernel
    m = dict(k.macros)
    m.update(zip(("WARPS_M", "WARPS_N", "THREAD_M"), FOUR_WARPS))
    threads = 32 * FOUR_WARPS[0] * FOUR_WARPS[1]
    return dataclasses.replace(plan, kernel=dataclasses.replace(k, macros=tuple(m.items()), block=threads,
                                                                  block_dims=(threads, 1, 1)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="four_warp_tile_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="", help="names of ROWS to run (default: all)")
    ap.add_argument("--rounds", type=int, default=3)
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    rows = [r for r in ROWS if not o.rows or r[0] in o.rows.split(",")]
    dev = dispatch.device_facts(torch.cuda.current_device())
    print(f"{dev.name}: GPU us per call, ieee; the plan's 64 x 64 tile in two warps (8 x 8 a thread) and in four (4 x 8)")
    print(f"{'row':<20} {'shape':<22} {'plan':<34} {'2 warps':>8} {'4 warps':>8} {'torch':>8} {'2w/4w':>6} "
          f"{'err 2w':>8} {'err 4w':>8} same")
    bad = 0
    for name, M, N, K, batch, layout in rows:
        spec = {"name": name, "M": M, "N": N, "K": K, "batch": batch, "layout": layout}
        x = bench.Inputs(spec, 1, torch.device("cuda"), seed=0)
        a, b, c = x.a[0], x.b[0], x.c[0]
        s = analyse(a, b, c)
        problem, offsets = build_problem(s, s.matrix_view(c), "ieee")
        plan = select(problem, dev)
        k = plan.kernel
        m = dict(k.macros) if k is not None else {}
        if k is None or k.family != "simt_cp_async" or (m["WARPS_M"], m["WARPS_N"], m["THREAD_M"]) != TWO_WARPS:
            print(f"{name:<20} skipped: the plan is {k.describe() if k is not None else plan.fallback}")
            continue
        split = m.get("SPLIT_FUSED") or k.grid[1]
        label = f"split {split}" + (" fused" if k.split_fused else " + reduce" if plan.reduce is not None else "")
        runs, outs, errs = {}, {}, {}
        for tag, pl in (("2w", plan), ("4w", four_warp_plan(plan))):
            hit = dispatch.Prepared(pl, launcher.load(dev, pl.kernel),
                                    launcher.load(dev, pl.reduce) if pl.reduce is not None else None)
            runs[tag] = (lambda hit=hit: dispatch.launch_plan(hit, s, c, problem, offsets, dev.index))
            c.fill_(float("nan"))
            runs[tag]()
            torch.cuda.synchronize()
            outs[tag], errs[tag] = c.clone(), rel_err(c, a, b)
        runs["torch"] = lambda: torch.matmul(a, b, out=c)
        times = {t: [] for t in runs}
        for r in range(o.rounds):
            for t in (runs if r % 2 == 0 else reversed(list(runs))):
                times[t].append(time_us(runs[t]))
        t2, t4, tt = (statistics.median(times[t]) for t in ("2w", "4w", "torch"))
        same = torch.equal(outs["2w"], outs["4w"])
        bad += (not same) or max(errs.values()) > 1e-5
        shape = (f"{batch}x" if batch > 1 else "") + f"{M}x{N}x{K} {layout}"
        print(f"{name:<20} {shape:<22} {label:<34} {t2:8.2f} {t4:8.2f} {tt:8.2f} {t2 / t4:6.3f} "
              f"{errs['2w']:8.1e} {errs['4w']:8.1e} {same}", flush=True)
    print(f"rows wrong or differing between the tiles: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
