#!/usr/bin/env python3
"""grad_W's products (A = G^T, contiguous along m; B row-major) as planned, with A copied in
single floats along m on the 128 x 256 SIMT tile (``SimtCpAsync.a_single_float_tiles``, the
planner's choice since NOTES run 35) against float4 units (the plans before, "float4 A") and
with the 128 x 128 tile copying A in single floats too ("+128x128"), over every plan form those
tiles take: one launch, split-K (cluster pairs, the fused sum), stream-K.

    python benchmarks/probes/a_t_probe.py [--only NAME,...] [--rounds R]

GPU us per call (probe_util.time_us; rounds alternate the variants, the median of each), each
checked against float64 first, torch.matmul on the same operands beside them. (Run 35's first
version also timed cp.async.ca and an L2 prefetch hint on the 16-byte copies, and stream-K over
every SM for the one-wave products: none faster, NOTES run 35.)
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.families import FAMILIES  # noqa: E402
from probe_util import need_gpu, rel_err, time_us, timing_line  # noqa: E402
from variants import layout_operands  # noqa: E402

PRODUCTS = {  # name: (M, N, K) of G^T @ X, G of K x M
    "gradw_4k": (4096, 1024, 8192),      # bert up: one launch, 128 tiles
    "gradw_4k_t": (1024, 4096, 8192),    # bert down
    "gradw_1k": (1024, 1024, 8192),      # q/k/v/o: split 4 in cluster pairs
    "gradw_kv": (256, 1024, 8192),       # llama k/v: split 16 in pairs
    "gradw_768": (768, 768, 4096),       # split 7
    "gradw_2k": (2048, 2048, 1024),      # one launch
    "gradw_llama_up": (14336, 4096, 2048),  # stream-K
    "gradw_head": (32000, 1024, 8192),   # stream-K
    "gradw_1k_up": (2816, 1024, 1024),   # llama at 1024 tokens: 128 x 128, split 3 (fused)
    "gradw_1k_down": (1024, 2816, 1024),
    "gradw_2k_512": (2048, 1024, 512),   # 128 x 128, split 2 (fused)
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="a_t_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="")
    ap.add_argument("--rounds", type=int, default=3)
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    fam = FAMILIES["simt_cp_async"]
    float4_a = (dataclasses.replace(fam, a_single_float_tiles=()),)
    # (the 128 x 128 tile of 16 x 8 outputs a thread too: 1.8% faster in one plain-kernel
    # measurement, copy_unit_probe.py's gradw_1k_128)
    with_128 = (dataclasses.replace(fam, a_single_float_tiles=fam.a_single_float_tiles + ((128, 128),)),)
    names = o.only.split(",") if o.only else list(PRODUCTS)
    worst = 0.0
    for name in names:
        M, N, K = PRODUCTS[name]
        torch.manual_seed(0)
        a, b = layout_operands(M, N, K, "tn")
        c = torch.empty(M, N, device="cuda")
        fns = {"planned": lambda: dispatch.matmul_fastmm(a, b, c, "ieee"),
               "float4 A": lambda: dispatch.matmul_fastmm(a, b, c, "ieee", variants=float4_a),
               "+128x128": lambda: dispatch.matmul_fastmm(a, b, c, "ieee", variants=with_128),
               "torch": lambda: torch.matmul(a, b, out=c)}
        with torch.no_grad():
            plans, errs = {}, {}
            for v, fn in fns.items():
                c.fill_(float("nan"))
                r = fn()
                torch.cuda.synchronize()
                if v != "torch":
                    plans[v] = r[1].kernel
                errs[v] = rel_err(c[:512], a[:512], b)
                worst = max(worst, errs[v]) if v != "torch" else worst
            times = {v: [] for v in fns}
            for _ in range(o.rounds):
                for v, fn in fns.items():
                    times[v].append(time_us(fn, inner=5, samples=9))
        k = plans["planned"]
        forms = " / ".join(f"{v}: A_MODE {dict(x.macros)['A_MODE']}, split {x.split_k}, stream-K "
                           f"{x.stream_k is not None}" for v, x in plans.items())
        print(f"{name} {M}x{N}x{K} A^T: {k.describe().splitlines()[0]} ({forms})")
        for v in fns:
            print(timing_line(v, times[v], 2 * M * N * K, errs[v]), flush=True)
    print(f"largest error of a fastmm plan: {worst:.1e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
