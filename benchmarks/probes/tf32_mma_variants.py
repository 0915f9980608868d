"""tf32_mma (mma.sync) on the current GPU: correctness of the forced family on awkward shapes and
every operand layout, then the headline shape timed for a few tile / stage variants (NOTES.md
runs 11-12):

    python benchmarks/probes/tf32_mma_variants.py [--no-sweep] [--layouts nn,tn,nt]
    python benchmarks/probes/tf32_mma_variants.py --x3-warp-n
    python benchmarks/probes/tf32_mma_variants.py --x3-compensate

--no-sweep skips the correctness sweep (each timed variant is still checked on its first rows).
--x3-warp-n: tf32x3 with 64 x 32 warp tiles against 64 x 16 (WARP_N) at a few shapes and layouts
(issue 16: the 64 x 32 tile sits at the 255-register cap and spills under NVRTC 13.0).
--x3-compensate: tf32x3's promotion add, two_sum_add (COMPENSATE=2) against fast_two_sum_add (1),
time and error against float64 at a few shapes, K up to 65536.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.shapes import analyse, build_problem  # noqa: E402
from probe_util import need_gpu, rel_err, time_ms  # noqa: E402
from variants import check_and_time, with_macros  # noqa: E402

SHAPES = [(1, 1, 1), (3, 5, 4), (17, 19, 23), (129, 96, 132), (257, 129, 193), (1000, 1000, 1000), (4097, 4095, 4093)]
LAYOUTS = ("nn", "tn", "nt", "tt", "off")
W24 = dict(WARPS_M=2, WARPS_N=4, WARP_N=64)
W22 = dict(WARPS_M=2, WARPS_N=2, WARP_N=64)
# run 12: two fragment sets (FRAG_PIPE) against one, and the stage counts
VARIANTS = [dict(), dict(W24, STAGES=3), dict(W24, FRAG_PIPE=0, STAGES=3), dict(W22, FRAG_PIPE=1, STAGES=3),
            dict(W22, FRAG_PIPE=0, STAGES=3)]


def operands(M, N, K, layout):
    a = torch.randn(K, M, device="cuda").t() if layout[0] == "t" else torch.randn(M, K, device="cuda")
    b = torch.randn(N, K, device="cuda").t() if layout[1:2] == "t" else torch.randn(K, N, device="cuda")
    if layout == "off":
        a = torch.randn(M * K + 1, device="cuda")[1:].view(M, K)
        b = torch.randn(K * N + 3, device="cuda")[3:].view(K, N)
    return a, b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tf32_mma_variants.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-sweep", action="store_true", help="skip the correctness sweep")
    ap.add_argument("--layouts", default="nn,tn,nt", help="layouts timed at the headline shape (default nn,tn,nt)")
    ap.add_argument("--x3-warp-n", action="store_true", help="tf32x3: WARP_N 32 against 16")
    ap.add_argument("--x3-compensate", action="store_true", help="tf32x3: two_sum_add against fast_two_sum_add")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    if o.x3_warp_n:
        return x3_warp_n()
    if o.x3_compensate:
        return x3_compensate()
    fails = 0
    layouts = o.layouts.split(",")
    dev_index = torch.cuda.current_device()
    for prec, tol in (("tf32", 1e-3), ("tf32x3", 1e-6)) if not o.no_sweep else ():
        for (M, N, K) in SHAPES:
            for layout in LAYOUTS:
                a, b = operands(M, N, K, layout)
                c = torch.full((M, N), float("nan"), device="cuda")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    _, plan, _ = dispatch.matmul_fastmm(a, b, c, prec, force="tf32_mma")
                    torch.cuda.synchronize()
                if caught:  # e.g. a kernel that failed to build: torch served the call
                    fails += 1
                    print(f"WARNING {prec} {M}x{N}x{K} {layout}: {caught[0].message}"[:300])
                err = rel_err(c, a, b)
                if not err <= tol:
                    fails += 1
                    print(f"FAIL {prec} {M}x{N}x{K} {layout} err={err:.2e} {dict(plan.kernel.macros)}")
        print(f"checked tf32_mma {prec}", flush=True)
    print(f"correctness failures: {fails}", flush=True)

    M, N, K = 8192, 4096, 6144
    flops = 2 * M * N * K
    rows = []
    for layout in layouts:
        a, b = operands(M, N, K, layout)
        c = torch.empty(M, N, device="cuda")
        torch.backends.cuda.matmul.allow_tf32 = True
        t = time_ms(lambda: torch.matmul(a, b, out=c))
        rows.append((f"torch tf32 {layout}", t, flops / t / 1e9, 0.0))
        s = analyse(a, b)
        for prec, variants in (("tf32", VARIANTS if layout == "nn" else VARIANTS[:1]), ("tf32x3", [dict()])):
            p, _ = build_problem(s, c, prec)
            plan = dispatch.plan_for(p, dev_index, "tf32_mma")
            for v in variants:
                t, err = check_and_time(with_macros(plan.kernel, M, N, **v), plan, a, b, c)
                rows.append((f"tf32_mma {prec} {layout} {v or 'planner'}", t, flops / t / 1e9, err))
    print(f"\n{M}x{N}x{K}: variant | ms | TFLOP/s | rel err (first 256 rows)")
    for r in rows:
        print(f"{r[0]:70s} {r[1]:8.3f} {r[2]:8.1f} {r[3]:.1e}")
    return 1 if fails else 0


def x3_warp_n() -> int:
    """tf32x3 on mma.sync: each shape and layout with the planner's warp grid at WARP_N = 32 and
    16 (and the stage count the planner gave), plain kernel (no split-K)."""
    dev_index = torch.cuda.current_device()
    print("shape layout | warps | WARP_N 32: ms TFLOP/s err | WARP_N 16: ms TFLOP/s err | 16 vs 32")
    for (M, N, K) in ((8192, 4096, 6144), (2048, 2048, 2048), (1024, 2816, 1024), (1000, 1000, 1000), (512, 512, 512)):
        for layout in ("nn", "tn", "nt"):
            a, b = operands(M, N, K, layout)
            c = torch.empty(M, N, device="cuda")
            p, _ = build_problem(analyse(a, b), c, "tf32x3")
            plan = dispatch.plan_for(p, dev_index, "tf32_mma")
            if plan.staging:  # (run_cfg launches on the operands as they are: no padded copies)
                print(f"{M}x{N}x{K} {layout}: skipped, the plan stages its operands")
                continue
            m = dict(plan.kernel.macros)
            res = {}
            for wn in (32, 16):
                t, err = check_and_time(with_macros(plan.kernel, M, N, WARP_N=wn), plan, a, b, c)
                res[wn] = (t, 2 * M * N * K / t / 1e9, err)
            print(f"{M}x{N}x{K} {layout} | {m['WARPS_M']}x{m['WARPS_N']} | "
                  + " | ".join(f"{t:.3f} {tf:.1f} {e:.1e}" for t, tf, e in res.values())
                  + f" | {res[32][0] / res[16][0]:.3f}x", flush=True)
    return 0


def x3_compensate() -> int:
    """tf32x3 on mma.sync with each promotion add: the planner's configuration (plain kernel, no
    split-K), COMPENSATE=2 (two_sum_add) and 1 (fast_two_sum_add), time and error of the first
    256 rows against float64."""
    dev_index = torch.cuda.current_device()
    print("shape layout | COMPENSATE 2: ms TFLOP/s err | COMPENSATE 1: ms TFLOP/s err | 1 vs 2")
    for (M, N, K) in ((2048, 2048, 2048), (1024, 2816, 1024), (1000, 1000, 1000), (512, 512, 512),
                      (256, 256, 65536), (128, 1024, 16384)):
        for layout in ("nn", "tn", "nt"):
            a, b = operands(M, N, K, layout)
            c = torch.empty(M, N, device="cuda")
            p, _ = build_problem(analyse(a, b), c, "tf32x3")
            plan = dispatch.plan_for(p, dev_index, "tf32_mma")
            if plan.staging:
                print(f"{M}x{N}x{K} {layout}: skipped, the plan stages its operands")
                continue
            res = {}
            for comp in (2, 1):
                t, err = check_and_time(with_macros(plan.kernel, M, N, COMPENSATE=comp), plan, a, b, c)
                res[comp] = (t, 2 * M * N * K / t / 1e9, err)
            print(f"{M}x{N}x{K} {layout} | " + " | ".join(f"{t:.3f} {tf:.1f} {e:.2e}" for t, tf, e in res.values())
                  + f" | {res[2][0] / res[1][0]:.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
