#!/usr/bin/env python3
"""Should the SIMT cp.async kernel copy an operand that is contiguous along m (A) or n (B) in
16-byte units (LOAD_VEC_FAST, one cp.async.cg a unit) or in single floats (LOAD_ELEM_FAST,
cp.async.ca of 4 bytes, consecutive lanes along m / n)? NOTES run 35: single floats ran grad_W's
m-contiguous A 2.6% faster on the 128 x 256 tile (``a_t_probe.py``).

    python benchmarks/probes/copy_unit_probe.py [--only NAME,...] [--rounds R] [--check-only]

Per row (a product, its layout, a tile), the plain kernel (one launch over every tile,
variants.with_macros) with the planner's copy modes ("vec") and with single floats for A
("A1"), for B ("B1") or both ("A1B1"), where the operand is contiguous along m / n; GPU us per
call (probe_util.time_us, rounds alternating the variants, the median), each checked against
float64 first; torch.matmul on the same operands beside them. ``--check-only``: the checks,
no timing (a sanitizer run). The tile is forced over the product's own plan, whose stage count
it keeps (e.g. 12 for a 128 x 128 tile where the planner builds that tile with 6): the variants of
a row compare with each other, not with the planner's build of that tile.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.families import LOAD_ELEM_FAST, LOAD_VEC_FAST  # noqa: E402
from probe_util import need_gpu, rel_err, time_us, timing_line  # noqa: E402
from variants import layout_operands, run_cfg, with_macros  # noqa: E402

TILES = {"128x256": (2, 4, 16), "128x128": (2, 2, 16), "128x64": (2, 2, 8), "64x64": (1, 2, 8)}
# name: (M, N, K, layout, tile); layout (variants.layout_operands) "tn": A = G^T (m-contiguous),
# B row-major; "nn": both row-major (as x @ W^T's B after its row-major staging copy, grad_x's W, Conv1D's W)
ROWS = {
    "gradw_4k": (4096, 1024, 8192, "tn", "128x256"),
    "gradw_head": (32000, 1024, 8192, "tn", "128x256"),
    "gradx_4k": (8192, 1024, 4096, "nn", "128x256"),
    "fwd_up_rm": (8192, 4096, 1024, "nn", "128x256"),
    "fwd_1k_rm": (8192, 1024, 1024, "nn", "128x256"),
    "gradw_1k_128": (1024, 1024, 1576, "tn", "128x128"),
    "nn_2k_128": (2048, 2048, 1024, "nn", "128x128"),
    "gradw_768_64": (768, 768, 4096, "tn", "128x64"),
    "nn_1k_64": (1024, 768, 1024, "nn", "128x64"),
    "gradw_512_6464": (512, 768, 4096, "tn", "64x64"),
    "nn_512_6464": (512, 512, 2048, "nn", "64x64"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="copy_unit_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check-only", action="store_true")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    names = o.only.split(",") if o.only else list(ROWS)
    worst = 0.0
    for name in names:
        M, N, K, layout, tile = ROWS[name]
        torch.manual_seed(0)
        a, b = layout_operands(M, N, K, layout)
        c = torch.empty(M, N, device="cuda")
        wm, wn, tm = TILES[tile]
        with torch.no_grad():
            plan = dispatch.matmul_fastmm(a, b, None, "ieee")[1]
            # (from float4 units wherever the layout allows them: the planner's own choice since
            # NOTES run 35 is A in single floats on the 128 x 256 tile)
            float4_a = {"A_MODE": LOAD_VEC_FAST} if layout == "tn" else {}
            base = with_macros(plan.kernel, M, N, WARPS_M=wm, WARPS_N=wn, THREAD_M=tm, **float4_a)
            modes = dict(base.macros)
            variants = {"vec": base}
            if modes["A_MODE"] == LOAD_VEC_FAST:
                variants["A1"] = with_macros(base, M, N, A_MODE=LOAD_ELEM_FAST)
            if modes["B_MODE"] == LOAD_VEC_FAST:
                variants["B1"] = with_macros(base, M, N, B_MODE=LOAD_ELEM_FAST)
            if len(variants) == 3:
                variants["A1B1"] = with_macros(base, M, N, A_MODE=LOAD_ELEM_FAST, B_MODE=LOAD_ELEM_FAST)
            fns = {v: (lambda cfg=cfg: run_cfg(cfg, plan, a, b, c)) for v, cfg in variants.items()}
            fns["torch"] = lambda: torch.matmul(a, b, out=c)
            errs = {}
            rows = min(M, 384)
            for v, fn in fns.items():
                c.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                errs[v] = rel_err(c[:rows], a[:rows], b)
                if v != "torch":
                    worst = max(worst, errs[v])
            times = {v: [] for v in fns}
            for _ in range(0 if o.check_only else o.rounds):
                for v, fn in fns.items():
                    times[v].append(time_us(fn, inner=5, samples=9))
        print(f"{name} {M}x{N}x{K} {layout} tile {tile} (A_MODE {modes['A_MODE']}, B_MODE {modes['B_MODE']})")
        for v in fns:
            if not times[v]:
                print(f"   {v:6s} err {errs[v]:.1e}")
                continue
            print(timing_line(v, times[v], 2 * M * N * K, errs[v], base=statistics.median(times["vec"]), width=6),
                  flush=True)
    print(f"largest error of a fastmm variant: {worst:.1e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
