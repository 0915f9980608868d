"""Where a split-K plan's time goes, on the GPU: the full call, its GEMM launch alone, its second
pass alone (on a workspace the GEMM just wrote: L2-warm, as in a real call), the fused plan
(the kernel sums its own slices) where the planner makes one, and torch.matmul,
median of CUDA-event samples (10 calls queued behind a sleep kernel) in alternating rounds. Then the GEMM alone at K, K/2 and K/4 with
the same grid (same splits), and at K/16, K/64: a line through those gives the time per k-tile and the fixed cost of
a block (pipeline fill, partial tile stored), the part a longer K does not amortise.

    python benchmarks/probes/split_anatomy.py [M N K] [--macros NAME=V,...] [--rounds R]

Default problems: largeK (256x256x65536) and decode16 (16x4096x4096). ``--macros`` rebuilds the
GEMM with some macros replaced, keeping the plan's grid: e.g. STAGES=6; SPLIT_PAIR=0 for the
unpaired split rows of the 128x256 SIMT tile on sm_90 (run 14 compared those, and 8 / 12 stages,
with split_pair_probe.py, since deleted: ``--macros SPLIT_PAIR=0,STAGES=12`` and so on give the
same GEMM and plan times).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

import fastmm  # noqa: E402
from fastmm import dispatch  # noqa: E402
from fastmm.families import FAMILIES, second_pass_config  # noqa: E402
from fastmm.runtime import launcher, runners  # noqa: E402
from fastmm.shapes import analyse, build_problem  # noqa: E402
from probe_util import need_gpu, rel_err, time_us  # noqa: E402


def gemm_launch(loaded, cfg, a, b, work, stream):
    """The GEMM of a split plan alone, into ``work``, for operands a, b (any K)."""
    s = analyse(a, b)
    c = torch.empty(a.shape[0], b.shape[1], device="cuda")
    p, _ = build_problem(s, c, "ieee")
    args = (a.data_ptr(), b.data_ptr(), work.data_ptr()) + runners.split_gemm_args(p)
    return lambda: launcher.launch(loaded, stream, args)


def anatomy(M, N, K, macros, rounds):
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = dispatch.device_facts(torch.cuda.current_device())
    a, b = torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda")
    c = torch.full((M, N), float("nan"), device="cuda")
    s = analyse(a, b)
    problem, _ = build_problem(s, c, "ieee")
    planned = dispatch.plan_for(problem, dev.index).kernel
    if planned is None:
        print(f"{M}x{N}x{K}: torch.matmul serves it; nothing to take apart")
        return
    # the two-launch form of the same plan (GEMM into the workspace, then splitk_reduce): the
    # parts are timed on it; a fused plan (the kernel sums its own slices) is timed whole beside
    # it. A family that can fuse (skinny) is handed to the planner as a variant that does not.
    fam = FAMILIES[planned.family]
    variants = (dataclasses.replace(fam, fuse_split=False),) if hasattr(fam, "fuse_split") else ()
    cfg = dispatch.plan_for(problem, dev.index, variants=variants).kernel
    split = cfg.split_k
    if split <= 1 or cfg.stream_k is not None:
        print(f"{M}x{N}x{K}: the plan ({cfg.family}, grid {cfg.grid}) is not split-K; nothing to take apart")
        return
    if macros:
        m = dict(cfg.macros)
        m.update(macros)
        pair = bool(m.pop("SPLIT_PAIR", 0))
        if pair:
            m["SPLIT_PAIR"] = 1
        smem = cfg.smem
        if cfg.family == "simt_cp_async":  # the stages, and the pairs' exchange region (SimtCore)
            fam = FAMILIES[cfg.family]
            bm, bn, _ = cfg.tile
            smem = fam.smem_bytes(bm, bn, m["STAGES"]) + (fam.pair_region_bytes(cfg.block, m["THREAD_M"]) if pair else 0)
        cfg = dataclasses.replace(cfg, macros=tuple(m.items()), smem=smem, split_pair=pair)
    second = second_pass_config(problem, dev, cfg)
    loaded, rloaded = launcher.load(dev, cfg), launcher.load(dev, second)
    stream = dispatch.current_stream(dev.index)
    run = runners.plan_runner(loaded, rloaded, cfg, problem, a.device)
    full = lambda: run(a.data_ptr(), b.data_ptr(), c.data_ptr(), stream)  # noqa: E731
    full()
    err = rel_err(c, a, b)
    work = torch.full((split * M * N,), float("nan"), device="cuda")
    gemm = gemm_launch(loaded, cfg, a, b, work, stream)
    rtail = (work.data_ptr(), c.data_ptr(), problem.M, problem.N, cfg.split_slices, *problem.c_strides)
    reduce = lambda: launcher.launch(rloaded, stream, rtail)  # noqa: E731
    fused = {}
    if planned.split_fused and not macros:
        frun = runners.fused_split_runner(launcher.load(dev, planned), planned, problem, a.device)
        fused = {"fused plan": lambda: frun(a.data_ptr(), b.data_ptr(), c.data_ptr(), stream)}
        c.fill_(float("nan"))
        fused[next(iter(fused))]()
        print(f"  fused plan: rel err {rel_err(c, a, b):.2e}")
    parts = {"fastmm.matmul": lambda: fastmm.matmul(a, b, out=c), **fused, "plan (GEMM + pass)": full,
             "GEMM alone": gemm, "second pass alone": reduce,
             "torch.matmul": lambda: torch.matmul(a, b, out=c)}
    qs = (2, 4, 16, 64)
    for q in qs:
        kq = K // q
        parts[f"GEMM alone, K/{q}"] = gemm_launch(loaded, cfg, a[:, :kq], b[:kq], work, stream)
    times = {k: [] for k in parts}
    for _ in range(rounds):
        for k, fn in parts.items():
            times[k].append(time_us(fn))
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"\n{M}x{N}x{K}: {cfg.family} tile {cfg.tile}, grid {cfg.grid}, split {split}, "
          f"macros {dict(macros) if macros else 'planner'}; rel err {err:.2e}")
    for k, t in med.items():
        print(f"  {k:<22} {t:8.2f} us")
    k_tiles = -(-K // cfg.tile[2])
    per_block = -(-k_tiles // split)
    # time(Kq) = fixed + per_block(Kq) * t_k: a least-squares line through K, K/2, K/4
    xs = [per_block / q for q in (1, 2, 4)]
    ys = [med["GEMM alone"], med["GEMM alone, K/2"], med["GEMM alone, K/4"]]
    print("  GEMM alone by k-tiles per block: " + ", ".join(
        f"{per_block / q:.1f}: {med['GEMM alone' + ('' if q == 1 else f', K/{q}')]:.2f} us" for q in (1,) + qs))
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    print(f"  per block: {per_block} k-tiles; line: {slope:.3f} us per k-tile, fixed {my - slope * mx:.2f} us; "
          f"second pass + gap = plan - GEMM = {med['plan (GEMM + pass)'] - med['GEMM alone']:.2f} us; "
          f"fastmm / torch = {med['torch.matmul'] / med['fastmm.matmul']:.3f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="split_anatomy.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", nargs="*", type=int, help="M N K (default: 256 256 65536, then 16 4096 4096)")
    ap.add_argument("--macros", default="", help="NAME=V,... replaced in the GEMM")
    ap.add_argument("--rounds", type=int, default=3)
    o = ap.parse_args(argv)
    if o.shape and len(o.shape) != 3:
        ap.error("the shape is M N K")
    macros = {k: int(v) for k, v in (x.split("=") for x in o.macros.split(",") if x)}
    if not need_gpu(ap.prog):
        return 2
    shapes = [tuple(o.shape)] if o.shape else [(256, 256, 65536), (16, 4096, 4096)]
    for M, N, K in shapes:
        anatomy(M, N, K, macros, o.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
