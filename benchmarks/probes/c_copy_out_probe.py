#!/usr/bin/env python3
"""wgmma_tf32's C through shared memory and the consumers' coalesced stores (C_COPY_OUT) against
C stored from registers, where C's rows are contiguous but not 16-byte aligned (an odd width): the
same plan built both ways, GPU us by CUDA graph replay, each checked against float64, beside
torch's call at the row's precision (TF32 for tf32, full fp32 for tf32x3).

    PYTHONPATH=. python benchmarks/probes/c_copy_out_probe.py [--shapes FILE] [--precisions tf32,tf32x3]

Default rows: attention's Q @ K^T at odd token counts (197, 577, 77), P @ V and odd-width
nn.Linear products; ``--shapes``: a suite file's model rows instead (bench.py's layouts).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.families import FAMILIES  # noqa: E402
from fastmm.plan import select  # noqa: E402
from probe_util import compile_plans, graph_us, need_gpu, rel_err  # noqa: E402

ROWS = [dict(name="vit_attn_qkT", M=197, N=197, K=64, layout="bmm_bt", batch=768),
        dict(name="deit_s_attn_qkT", M=197, N=197, K=64, layout="bmm_bt", batch=96),
        dict(name="vitl336_attn_qkT", M=577, N=577, K=64, layout="bmm_bt", batch=64),
        dict(name="clip_attn_qkT", M=77, N=77, K=64, layout="bmm_bt", batch=96),
        dict(name="vit_attn_pv_dv", M=197, N=197, K=197, layout="bmm", batch=96),
        dict(name="odd_733", M=733, N=1999, K=517, layout="linear"),
        dict(name="odd_linear_999", M=999, N=1001, K=1003, layout="linear"),
        dict(name="gpt2_lm_head_2k", M=2048, N=50257, K=768, layout="linear"),
        dict(name="odd_gx_1234", M=1234, N=517, K=2222, layout="rowmajor_b")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="c_copy_out_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--precisions", default="tf32,tf32x3")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    import candidates
    from fastmm.precision import torch_precision

    rows = candidates.model_rows(None, o.shapes)[0] if o.shapes else ROWS
    dev = dispatch.device_facts(torch.cuda.current_device())
    fams = {"copy-out": FAMILIES["wgmma_tf32"], "registers": FAMILIES["wgmma_tf32"].__class__(c_copy_out=False)}
    items = []
    for s in rows:
        a, b, out = candidates.operands(s, torch.device("cuda"))
        for prec in o.precisions.split(","):
            prob = candidates.problem_of(a, b, out, prec)
            plans = {k: select(prob, dev, "wgmma_tf32", None, (f,)) for k, f in fams.items()}
            items.append((s, prec, a, b, out, plans))
    print(f"compiled {compile_plans([p for *_, ps in items for p in ps.values()], dev.arch)} kernels", flush=True)
    print(f"{'row':<18} {'shape':<22} {'prec':<7} {'torch':>8} {'copy-out':>9} {'registers':>10}  ratio  C stores (copy-out plan)")
    for s, prec, a, b, out, plans in items:
        with torch_precision(prec):
            t_torch = graph_us(lambda: torch.matmul(a, b, out=out))
        us = {}
        for k, f in fams.items():
            out.fill_(float("nan"))
            _, plan, reason = dispatch.matmul_fastmm(a, b, out, prec, force="wgmma_tf32", variants=(f,))
            if reason is not None:
                us[k] = float("nan")
                continue
            err = rel_err(out, a, b)
            bound = 1e-5 if prec == "tf32x3" else 5e-3
            t = graph_us(lambda: dispatch.matmul_fastmm(a, b, out, prec, force="wgmma_tf32", variants=(f,)))
            us[k] = t if err < bound else float("inf")
        detail = dict(plans["copy-out"].kernel.details).get("C stores", "") if plans["copy-out"].kernel else ""
        shape = f"{s.get('batch', 1)}x{s['M']}x{s['N']}x{s['K']}"
        print(f"{s['name']:<18} {shape:<22} {prec:<7} {t_torch:8.1f} {us['copy-out']:9.1f} {us['registers']:10.1f}  "
              f"{us['registers'] / us['copy-out']:5.2f}  {detail[:60]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
