#!/usr/bin/env python3
"""SIMT split-K summed by its own last block per tile (SPLIT_FUSED) against the GEMM +
splitk_reduce pair, on the products a 1024-token model step runs in ieee.

    python benchmarks/probes/fused_split_probe.py [--tokens 1024] [--hidden 1024,4096]

For each product (forward ``x @ W.t()``, grad_x ``g @ W``, grad_W ``g.t() @ x`` of the projections
of a Llama-style layer of width ``hidden``, FFN 11/4 of it, and a 32000-word head): the planner's
plan, its GPU time per call (back-to-back calls behind a sleep kernel: probe_util.time_us) fused
and as the two-launch variant ``SimtCpAsync(fuse_split=False)`` (the same tiles and slices), the
host time to enqueue one call of each (probe_util.enqueue_us), torch's GPU time, and whether the
two plans' results are the same bits. Products the planner does not fuse are listed with their
plan only.
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
from probe_util import enqueue_us, need_gpu, rel_err, time_us  # noqa: E402


def products(tokens: int, hidden: int):
    """(name, A, B): the forward, grad_x and grad_W operands of a layer's projections."""
    ffn, kv = hidden * 11 // 4, hidden // 4
    for name, n_out, n_in in (("q", hidden, hidden), ("kv", kv, hidden), ("up", ffn, hidden), ("down", hidden, ffn),
                              ("head", 32000, hidden)):
        x, w, g = (torch.randn(tokens, n_in, device="cuda"), torch.randn(n_out, n_in, device="cuda"),
                   torch.randn(tokens, n_out, device="cuda"))
        yield f"{name}_fwd", x, w.t()
        yield f"{name}_grad_x", g, w
        yield f"{name}_grad_w", g.t(), x


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fused_split_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", default="1024,4096")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    two = (SimtCpAsync(fuse_split=False),)
    print(f"{'product':<14} {'M x N x K':<18} {'plan':<34} {'fused us':>9} {'2-launch':>9} {'torch':>8} "
          f"{'host f/2':>12}  same  err")
    for hidden in (int(h) for h in o.hidden.split(",")):
        for name, a, b in products(o.tokens, hidden):
            M, K, N = a.shape[0], a.shape[1], b.shape[1]
            out = torch.empty(M, N, device="cuda")
            plan = dispatch.matmul_fastmm(a, b, out, "ieee")[1]
            cfg = plan.kernel
            what = f"{cfg.family} {cfg.tile[0]}x{cfg.tile[1]} s{cfg.split_k}" + (" pair" if cfg.split_pair else "")
            shape = f"{M}x{N}x{K}"
            t_torch = time_us(lambda: torch.matmul(a, b, out=out))
            if not cfg.split_fused:
                print(f"{name:<14} {shape:<18} {what:<34} {'-':>9} {'-':>9} {t_torch:8.1f}")
                continue
            fused = dispatch.matmul_fastmm(a, b, torch.empty(M, N, device="cuda"), "ieee")[0].clone()
            pair = dispatch.matmul_fastmm(a, b, torch.empty(M, N, device="cuda"), "ieee", variants=two)[0].clone()
            t_f = time_us(lambda: dispatch.matmul_fastmm(a, b, out, "ieee"))
            t_2 = time_us(lambda: dispatch.matmul_fastmm(a, b, out, "ieee", variants=two))
            h_f = enqueue_us(lambda: dispatch.matmul_fastmm(a, b, out, "ieee"), 100)
            h_2 = enqueue_us(lambda: dispatch.matmul_fastmm(a, b, out, "ieee", variants=two), 100)
            print(f"{name:<14} {shape:<18} {what + ' fused':<34} {t_f:9.1f} {t_2:9.1f} {t_torch:8.1f} "
                  f"{h_f:5.1f}/{h_2:5.1f}  {str(torch.equal(fused, pair)):<5} {rel_err(fused, a, b):.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
