#!/usr/bin/env python3
"""Single-float C (N % 4 != 0) stored through shared memory on every SIMT tile, not the largest
alone: for each product, torch.matmul, the planner's fp32 plan with
``SimtCpAsync(stage_c_all_tiles=False)`` (C from the registers but on the largest tile), and
the planner's plan (on sm_90 its tile staged where the kernel stores C in single floats, the
shared memory grown to hold the tile where the pipeline's buffers do not), GPU us a
call (back-to-back calls behind a sleep kernel, probe_util.time_us), each checked against float64
on fresh inputs with the output poisoned with NaN first.

    python benchmarks/probes/stage_c_probe.py [--only NAME,...] [--precision ieee]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.families import SimtCpAsync  # noqa: E402
from probe_util import need_gpu, rel_err, time_us  # noqa: E402

#: name: (batch, M, N, K, B^T: B given as a transposed view of an [N, K] tensor)
PRODUCTS = {
    "vit_qkT": (768, 197, 197, 64, True),  # ViT-B/16 attention scores, batch x heads = 64 x 12
    "clip_qkT": (96, 77, 77, 64, True),  # CLIP text attention scores
    "vit_qkT_b64": (64, 197, 197, 64, True),
    "vit_pv": (768, 197, 64, 197, False),  # (C 64 wide: float4 stores, unchanged: a control)
    "odd_999": (1, 999, 1001, 1003, True),
    "odd_small_701": (1, 300, 701, 1100, True),
    "lm_head_30522": (1, 2048, 30522, 768, True),  # BERT's vocabulary (the 128 x 256 tile: staged before)
    "n_4095": (1, 4097, 4095, 1024, False),
    "n_1001_k64": (1, 4096, 1001, 64, False),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="stage_c_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated names of PRODUCTS")
    ap.add_argument("--precision", default="ieee", help="ieee or tf32x3 (both plan fp32 SIMT kernels here)")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    names = o.only.split(",") if o.only else list(PRODUCTS)
    variant = (SimtCpAsync(stage_c_all_tiles=False),)
    print(f"{'product':<15} {'shape':<24} {'torch':>8} {'regs':>8} {'planned':>8} {'gain':>6}  plan (planned macros)"
          "  errors torch / regs / planned")
    for name in names:
        batch, M, N, K, bt = PRODUCTS[name]
        a = torch.randn(batch, M, K, device="cuda").squeeze(0)
        b = torch.randn(batch, N, K, device="cuda").squeeze(0).transpose(-1, -2) if bt else \
            torch.randn(batch, K, N, device="cuda").squeeze(0)
        out = torch.empty(*a.shape[:-1], N, device="cuda")
        times, errs = [], []
        t_torch = time_us(lambda: torch.matmul(a, b))
        e_torch = rel_err(torch.matmul(a, b), a, b)
        plans = []
        for var in (variant, ()):
            def run(var=var):
                return dispatch.matmul_fastmm(a, b, out, o.precision, variants=var)
            out.fill_(float("nan"))
            _, plan, reason = run()
            if plan is None or plan.kernel is None or reason is not None:
                print(f"{name}: not served by a fastmm plan ({reason})")
                break
            plans.append(plan)
            errs.append(rel_err(out, a, b))
            times.append(time_us(run))
        if len(times) < 2:
            continue
        staged = dict(plans[1].kernel.macros)
        what = (f"{plans[0].kernel.family} {plans[0].kernel.tile[0]}x{plans[0].kernel.tile[1]}"
                f"{f' split {plans[0].kernel.split_k}' if plans[0].kernel.split_k > 1 else ''}"
                f" (C_STAGED={staged.get('C_STAGED', 0)}, C_STAGE_FLOATS={staged.get('C_STAGE_FLOATS', '-')})")
        shape = f"{batch}x{M}x{N}x{K}{' B^T' if bt else ''}"
        print(f"{name:<15} {shape:<24} {t_torch:8.1f} {times[0]:8.1f} {times[1]:8.1f} {times[0] / times[1]:6.2f}x  "
              f"{what}  {e_torch:.1e} / {errs[0]:.1e} / {errs[1]:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
