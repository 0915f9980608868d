#!/usr/bin/env python3
"""TF32 wgmma's tile width where N leaves much of a 256-wide tile empty (attention's Q @ K^T at
128 keys, narrow projections): the planner's choice (128 wide for N <= 128, ``narrow_n_tile``)
against the fill rule alone (the variant ``WgmmaTf32(narrow_n_tile=False)``).

    python benchmarks/probes/wgmma_tile_probe.py

For each product: both plans' tiles, GPU time per call of both (probe_util.time_us: back-to-back
calls behind a sleep kernel) and of torch with TF32 allowed, and whether both give the same bits
(each output is accumulated in the same k order whatever the tile width). NOTES run 22 has the
same rows timed with pick_tile's area test as the alternative (N = 300: 1.05x, N = 384: 0.96x).
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.families import WgmmaTf32  # noqa: E402
from probe_util import need_gpu, time_us  # noqa: E402

#: (name, batch, M, N, K), B K-major (x @ W.t(), Q @ K^T)
PRODUCTS = (("attn_small", 1024, 128, 128, 64), ("attn_128x128_k128", 256, 128, 128, 128),
            ("attn_256x130", 256, 256, 130, 64), ("proj_n64", 0, 8192, 64, 1024), ("proj_n128", 0, 8192, 128, 1024),
            ("proj_n300", 0, 8192, 300, 1024), ("proj_n384", 0, 8192, 384, 768), ("proj_n640", 0, 4096, 640, 1024))


def main() -> int:
    if not need_gpu("wgmma_tile_probe.py"):
        return 2
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    fill_rule = (WgmmaTf32(narrow_n_tile=False),)
    print(f"{'product':<20} {'shape':<20} {'planner tile':>12} {'fill rule':>10} {'planner us':>10} {'fill us':>8} "
          f"{'torch':>8} {'fill/planner':>12} {'torch/planner':>13}  same")
    for name, batch, M, N, K in PRODUCTS:
        lead = (batch,) if batch else ()
        a = torch.randn(*lead, M, K, device="cuda")
        b = torch.randn(*lead, N, K, device="cuda").transpose(-1, -2)
        out = torch.empty(*lead, M, N, device="cuda")
        p1 = dispatch.matmul_fastmm(a, b, out, "tf32")[1]
        p2 = dispatch.matmul_fastmm(a, b, out, "tf32", variants=fill_rule)[1]
        r1 = dispatch.matmul_fastmm(a, b, torch.full_like(out, float("nan")), "tf32")[0]
        r2 = dispatch.matmul_fastmm(a, b, torch.full_like(out, float("nan")), "tf32", variants=fill_rule)[0]
        t1 = time_us(lambda: dispatch.matmul_fastmm(a, b, out, "tf32"))
        t2 = time_us(lambda: dispatch.matmul_fastmm(a, b, out, "tf32", variants=fill_rule))
        tt = time_us(lambda: torch.matmul(a, b, out=out))
        tile = lambda p: f"{p.kernel.family[:5]} {p.kernel.tile[0]}x{p.kernel.tile[1]}"  # noqa: E731
        shape = (f"{batch}x" if batch else "") + f"{M}x{N}x{K}"
        print(f"{name:<20} {shape:<20} {tile(p1):>12} {tile(p2):>10} {t1:10.1f} {t2:8.1f} {tt:8.1f} {t2 / t1:12.3f} "
              f"{tt / t1:13.3f}  {torch.equal(r1, r2)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
