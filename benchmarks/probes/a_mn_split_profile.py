#!/usr/bin/env python3
"""One forced TF32 wgmma plan run a few times, for ncu to watch: the 64-row tile of width
``--bn`` in ``--split`` slices of K, on grad_x's form with a row-major W ("rm": computed as C^T,
A fed from registers, A_MN) or on its K-major twin ("wt": x @ W.t(), the same M, N, K), so that
the two can be compared kernel by kernel (why an A_MN split ran 1.3-3.3x slower than the same
tile unsplit, NOTES run 42, where K-major splits pay):

    ncu --clock-control none -k regex:fastmm --launch-skip 2 --launch-count 1 \\
        python benchmarks/probes/a_mn_split_profile.py 197 768 3072 rm --split 2

Prints the plan and its error against float64 (a wrong result stops it).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.families import WgmmaTf32  # noqa: E402
from probe_util import need_gpu, rel_err  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(prog="a_mn_split_profile.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("M", type=int)
    ap.add_argument("N", type=int)
    ap.add_argument("K", type=int)
    ap.add_argument("layout", choices=("rm", "wt"))
    ap.add_argument("--split", type=int, default=2)
    ap.add_argument("--bn", type=int, default=64)
    ap.add_argument("--calls", type=int, default=4)
    o = ap.parse_args()
    if not need_gpu(ap.prog):
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    a = torch.randn(o.M, o.K, device="cuda")
    b = torch.randn(o.K, o.N, device="cuda") if o.layout == "rm" else torch.randn(o.N, o.K, device="cuda").t()
    c = torch.full((o.M, o.N), float("nan"), device="cuda")
    fam = WgmmaTf32(rows64="always", force_bn=o.bn, split=o.split if o.split > 1 else False)
    plan = None
    for _ in range(o.calls):
        _, plan, reason = dispatch.matmul_fastmm(a, b, c, "tf32", force="wgmma_tf32", variants=(fam,))
        if reason is not None:
            raise SystemExit(f"not served: {reason}")
    torch.cuda.synchronize()
    err = rel_err(c, a, b)
    print(plan.describe().split("\nchoice")[0])
    print(f"rel err {err:.2e}")
    return 0 if err < 1e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
