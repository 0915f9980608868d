#!/usr/bin/env python3
"""Does an ieee product's layout cost fastmm's SIMT kernel speed? Each product of a model's step
timed three ways: as the model hands it over (grad_W's A^T view, x @ W^T's K-major weight), with
the operands made row-major first (the copy not timed), and torch.matmul on the model's layout.

    python benchmarks/probes/layout_probe.py [--precision ieee] [--only NAME,...]

GPU time per call (probe_util.time_us: calls queued behind a sleep kernel).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

import fastmm  # noqa: E402
from fastmm.precision import torch_precision  # noqa: E402
from probe_util import need_gpu, rel_err, time_us  # noqa: E402

# name: (M, N, K, layout) with layout "a_t" (A = G^T, G of K x M row-major) or "w_t" (B = W^T)
PRODUCTS = {
    "gradw_1k": (1024, 1024, 8192, "a_t"),
    "gradw_4k": (4096, 1024, 8192, "a_t"),
    "gradw_head": (32000, 1024, 8192, "a_t"),
    "fwd_1k": (8192, 1024, 1024, "w_t"),
    "fwd_4k": (8192, 4096, 1024, "w_t"),
    "fwd_head": (8192, 32000, 1024, "w_t"),
}


def operands(M, N, K, layout):
    if layout == "a_t":
        a = torch.randn(K, M, device="cuda").t()
        b = torch.randn(K, N, device="cuda")
    else:
        a = torch.randn(M, K, device="cuda")
        b = torch.randn(N, K, device="cuda").t()
    return a, b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="layout_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", default="ieee")
    ap.add_argument("--only", default="")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    names = o.only.split(",") if o.only else list(PRODUCTS)
    print(f"{o.precision}: GPU us per call       model layout  row-major  torch(model)  plan (model layout)")
    with torch_precision(o.precision), torch.no_grad():
        for name in names:
            M, N, K, layout = PRODUCTS[name]
            torch.manual_seed(0)
            a, b = operands(M, N, K, layout)
            ac, bc = a.contiguous(), b.contiguous()
            out = torch.empty(M, N, device="cuda")
            for x, y in ((a, b), (ac, bc)):
                out.fill_(float("nan"))
                fastmm.matmul(x, y, out=out, precision=o.precision)
                err = rel_err(out, x, y)
                if not err < (2e-3 if o.precision == "tf32" else 1e-5):
                    print(f"{name}: error {err:.2e}")
            t_model = time_us(lambda: fastmm.matmul(a, b, out=out, precision=o.precision), inner=5, samples=9)
            t_rm = time_us(lambda: fastmm.matmul(ac, bc, out=out, precision=o.precision), inner=5, samples=9)
            t_torch = time_us(lambda: torch.matmul(a, b, out=out), inner=5, samples=9)
            e = fastmm.explain(a, b, precision=o.precision)
            plan = f"{e.kernel} {dict((k, v) for k, v in e.parameters.items() if k in ('A_MODE', 'B_MODE', 'STREAM_K', 'BN'))}"
            print(f"{name:12s} {M}x{N}x{K} {layout}  {t_model:9.1f} {t_rm:9.1f} {t_torch:11.1f}  {plan}")
            del a, b, ac, bc, out
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
