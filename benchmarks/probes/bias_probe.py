#!/usr/bin/env python3
"""What a fused bias costs: GPU us per call of x @ W.t() + b (F.linear's form, W stored [N, K])
and x @ W + b (GPT-2's Conv1D: addmm with a row-major W) against the same product without the
bias, on fastmm (the bias applied in the kernel's stores) and on torch (cuBLASLt's epilogue),
back to back (probe_util.time_us), with each result's error against float64:

    python benchmarks/probes/bias_probe.py [--precisions ieee,tf32] [--only NAME,...]

A fused bias should cost next to nothing: it is one vector read once per tile and an add per
output, on a product whose main loop reads K values per output.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fastmm  # noqa: E402
from probe_util import need_gpu, time_us  # noqa: E402

#: (name, M, N, K, layout): "wt" = x @ W.t() + b, "rm" = x @ W + b (W stored [K, N])
PRODUCTS = (("bert_head", 8192, 32000, 1024, "wt"), ("bert_qkvo", 8192, 1024, 1024, "wt"),
            ("bert_up", 8192, 4096, 1024, "wt"), ("bert_down", 8192, 1024, 4096, "wt"),
            ("gpt2_attn", 8192, 3072, 1024, "rm"), ("gpt2_up", 8192, 4096, 1024, "rm"),
            ("gpt2_down", 8192, 1024, 4096, "rm"), ("t1024_qkvo", 1024, 1024, 1024, "wt"),
            ("t1024_attn", 1024, 3072, 1024, "rm"), ("odd_bias", 777, 1531, 1000, "wt"))


def rel(c: torch.Tensor, ref: torch.Tensor) -> float:
    return ((c.double() - ref).norm() / ref.norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="ieee")
    ap.add_argument("--only", default="")
    o = ap.parse_args()
    if not need_gpu("bias_probe.py"):
        return 2
    only = set(filter(None, o.only.split(",")))
    print("GPU us per call | fastmm: bias / none / +% | torch: bias / none / +% | err fastmm / torch | kernel")
    for prec in o.precisions.split(","):
        torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
        for name, M, N, K, layout in PRODUCTS:
            if only and name not in only:
                continue
            torch.manual_seed(0)
            x = torch.randn(M, K, device="cuda")
            w = torch.randn(N, K, device="cuda") if layout == "wt" else torch.randn(K, N, device="cuda")
            b = torch.randn(N, device="cuda")
            if layout == "wt":
                fm = (lambda: fastmm.linear(x, w, b, precision=prec), lambda: fastmm.linear(x, w, None, precision=prec))
                tt = (lambda: F.linear(x, w, b), lambda: F.linear(x, w))
                ref = (x.double() @ w.double().t() + b.double())
            else:
                fm = (lambda: fastmm.addmm(b, x, w, precision=prec), lambda: fastmm.matmul(x, w, precision=prec))
                tt = (lambda: torch.addmm(b, x, w), lambda: torch.mm(x, w))
                ref = (x.double() @ w.double() + b.double())
            err_f, err_t = rel(fm[0](), ref), rel(tt[0](), ref)
            us = [time_us(f) for f in (*fm, *tt)]
            exp = fastmm.explain(x, w.t() if layout == "wt" else w, precision=prec)
            print(f"{prec:6} {name:11} {M}x{N}x{K} {layout} | {us[0]:8.1f} {us[1]:8.1f} {100 * (us[0] / us[1] - 1):+5.1f}% | "
                  f"{us[2]:8.1f} {us[3]:8.1f} {100 * (us[2] / us[3] - 1):+5.1f}% | {err_f:.1e} / {err_t:.1e} | "
                  f"{exp.kernel} {'x'.join(map(str, exp.launch['tile'])) if exp.kernel else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
