#!/usr/bin/env python3
"""Decode products on tensor cores: does kmajor_mma (TF32 mma.sync over W's rows) beat
skinny_kmajor (fp32 FFMA) and cuBLAS for ``x @ W.t()`` with M <= 16, and at which split?

    python benchmarks/probes/kmajor_mma_probe.py [--ms 1,2,4,8,16] [--splits 0,1,2,4,8] [--precisions tf32,tf32x3]

For each (M, N, K) and precision: GPU time per call (back-to-back calls behind a sleep kernel,
probe_util.time_us) of torch.matmul (TF32 allowed for tf32 rows, fp32 for tf32x3 rows),
skinny_kmajor and kmajor_mma (the planner's split, and each of ``--splits``: 0 = the planner's),
each with its error against float64; then the memory floor (W's bytes at 4.27 TB/s, the H200's
measured copy rate).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.families import KmajorMma  # noqa: E402
from probe_util import need_gpu, rel_err, time_us  # noqa: E402

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096), (11008, 4096))
COPY_TB_S = 4.27


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kmajor_mma_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--splits", default="0")
    ap.add_argument("--variants", default="", help="extra kmajor_mma variants, each a run of fields: u (chunks "
                    "ahead), nf (16-row W fragments a warp), s (K slices), mb (blocks an SM the registers are "
                    "bounded for), e.g. 'u1,u4,nf2u1s1,nf2u1s2mb3'")
    ap.add_argument("--shapes", default="", help="N x K pairs in place of the built-in list, e.g. '14336x4096,1024x4096'")
    ap.add_argument("--precisions", default="tf32,tf32x3")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    torch.manual_seed(0)
    splits = [int(s) for s in o.splits.split(",")]
    extra = [v for v in o.variants.split(",") if v]

    def variant(name):
        fields = {"u": "u", "nf": "nf", "s": "split", "mb": "minb"}
        parsed = re.findall(r"(nf|mb|u|s)(\d+)", name)
        if not parsed or "".join(f + v for f, v in parsed) != name or any(int(v) < 1 for _, v in parsed):
            raise SystemExit(f"kmajor_mma_probe.py: cannot read variant {name!r} (fields u, nf, s, mb, each >= 1)")
        return KmajorMma(**{fields[f]: int(v) for f, v in parsed})
    shapes = [tuple(int(d) for d in s.split("x")) for s in o.shapes.split(",")] if o.shapes else SHAPES
    print(f"{'M x N x K':<18} {'prec':<7} {'floor':>6} {'torch':>7} {'skinny_km':>9} "
          + " ".join(f"{'mma' + (f' s{s}' if s else ''):>9}" for s in splits) + " " + " ".join(f"{v:>9}" for v in extra)
          + "  best/torch  errors (torch, skinny_km, mma)")
    for N, K in shapes:
        w = torch.randn(N, K, device="cuda")
        for M in (int(m) for m in o.ms.split(",")):
            x = torch.randn(M, K, device="cuda")
            b = w.t()
            floor = N * K * 4 / (COPY_TB_S * 1e12) * 1e6
            for precision in o.precisions.split(","):
                torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
                t_torch = time_us(lambda: torch.matmul(x, b))
                e_torch = rel_err(torch.matmul(x, b), x, b)
                torch.backends.cuda.matmul.allow_tf32 = False
                out = torch.empty(M, N, device="cuda")

                def run(force, variants=()):
                    dispatch.matmul_fastmm(x, b, out, precision, force=force, variants=variants)
                run("skinny_kmajor")
                t_km = time_us(lambda: run("skinny_kmajor"))
                e_km = rel_err(out, x, b)
                times, errs = [], []
                for variants in [(KmajorMma(split=s),) if s else () for s in splits] + [(variant(v),) for v in extra]:
                    out.fill_(float("nan"))
                    run("kmajor_mma", variants)
                    errs.append(rel_err(out, x, b))
                    times.append(time_us(lambda: run("kmajor_mma", variants)))
                best = min(times + [t_km])
                print(f"{f'{M}x{N}x{K}':<18} {precision:<7} {floor:6.1f} {t_torch:7.1f} {t_km:9.1f} "
                      + " ".join(f"{t:9.1f}" for t in times)
                      + f"  {t_torch / best:9.2f}x  {e_torch:.1e} {e_km:.1e} " + " ".join(f"{e:.1e}" for e in errs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
