#!/usr/bin/env python3
"""x @ W.t() on the SIMT family with W (K-contiguous, nn.Linear's layout) copied row-major first
(the planner's default from TRANSPOSE_B_MIN_M rows, simt_core.transposes_b) against W read in
place (the variant ``SimtCpAsync(transpose_b=False)``: single-float cp.async along K), in ieee.

    python benchmarks/probes/transpose_b_probe.py [--rows 256,512,768,1024,2048,8192]

For each weight shape of a few models and each row count: GPU time per call of the staged plan
(``SimtCpAsync(transpose_big_tile_only=False)``: staged from any row count the probe asks,
whatever the in-place plan's tile; "(ip ...)" gives that plan's tile where it differs) and of the
in-place one (probe_util.time_us: back-to-back calls behind a sleep kernel, so host time does not
count); the same product on a row-major copy of W made beforehand (the staged plan's GEMM without
its copy: the difference is the copy's cost); torch's time; TFLOP/s; and both plans' error
against float64.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.families import SimtCpAsync, simt_core  # noqa: E402
from probe_util import need_gpu, rel_err, time_us  # noqa: E402

#: (name, out_features, in_features) of nn.Linear weights: Llama-3-8B, BERT-large, GPT-2, an odd one
WEIGHTS = (("llama_qo", 4096, 4096), ("llama_up", 14336, 4096), ("llama_down", 4096, 14336),
           ("bert_qkv", 3072, 1024), ("gpt2_fc", 3072, 768), ("gpt2_head", 50257, 768), ("odd", 1001, 1100))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="transpose_b_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="256,512,768,1024,2048,8192")
    ap.add_argument("--only", default="", help="weight names, comma-separated")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    torch.manual_seed(0)
    in_place = (SimtCpAsync(transpose_b=False),)
    staged = (SimtCpAsync(transpose_big_tile_only=False),)  # staged whatever the in-place plan's tile
    threshold = simt_core.TRANSPOSE_B_MIN_M
    simt_core.TRANSPOSE_B_MIN_M = 1  # stage at every row count asked for (before any plan is cached)
    only = {n for n in o.only.split(",") if n}
    print(f"planner threshold: TRANSPOSE_B_MIN_M = {threshold} rows")
    print(f"{'weight':<11} {'M x N x K':<18} {'plan (staged)':<36} {'staged us':>10} {'in place':>9} {'row-major':>9} "
          f"{'torch':>8} {'TF/s st/ip/torch':>18} {'in place/staged':>15}  err st / ip")
    for name, n_out, n_in in WEIGHTS:
        if only and name not in only:
            continue
        w = torch.randn(n_out, n_in, device="cuda")
        for M in (int(r) for r in o.rows.split(",")):
            x = torch.randn(M, n_in, device="cuda")
            b = w.t()
            out = torch.empty(M, n_out, device="cuda")
            staged_plan = dispatch.matmul_fastmm(x, b, out, "ieee", force="simt_cp_async", variants=staged)[1]
            assert staged_plan.staging, staged_plan.describe()
            st = dispatch.matmul_fastmm(x, b, torch.full_like(out, float("nan")), "ieee", force="simt_cp_async",
                                        variants=staged)[0]
            ip = dispatch.matmul_fastmm(x, b, torch.full_like(out, float("nan")), "ieee", force="simt_cp_async",
                                        variants=in_place)[0]
            err_st, err_ip = rel_err(st, x, b), rel_err(ip, x, b)
            row = b.contiguous()
            t_st = time_us(lambda: dispatch.matmul_fastmm(x, b, out, "ieee", force="simt_cp_async", variants=staged))
            t_ip = time_us(lambda: dispatch.matmul_fastmm(x, b, out, "ieee", force="simt_cp_async", variants=in_place))
            ip_plan = dispatch.matmul_fastmm(x, b, out, "ieee", force="simt_cp_async", variants=in_place)[1]
            t_row = time_us(lambda: dispatch.matmul_fastmm(x, row, out, "ieee", force="simt_cp_async"))
            t_torch = time_us(lambda: torch.matmul(x, b, out=out))
            cfg = staged_plan.kernel
            what = f"{cfg.tile[0]}x{cfg.tile[1]} s{cfg.split_k}" + (" fused" if cfg.split_fused else "")
            ic = ip_plan.kernel
            if (ic.tile, ic.split_k, ic.split_fused) != (cfg.tile, cfg.split_k, cfg.split_fused):
                what += f" (ip {ic.tile[0]}x{ic.tile[1]} s{ic.split_k}{' fused' if ic.split_fused else ''})"
            tf = [2 * M * n_out * n_in / t / 1e6 for t in (t_st, t_ip, t_torch)]
            print(f"{name:<11} {f'{M}x{n_out}x{n_in}':<18} {what:<36} {t_st:10.1f} {t_ip:9.1f} {t_row:9.1f} "
                  f"{t_torch:8.1f} {tf[0]:6.1f}/{tf[1]:5.1f}/{tf[2]:5.1f} {t_ip / t_st:15.3f}  {err_st:.1e} / {err_ip:.1e}")
            del x, out, row, st, ip
        del w
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
