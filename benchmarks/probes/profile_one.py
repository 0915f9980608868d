"""Run one fastmm matmul a few times, for a profiler or sanitizer to watch (ncu_stalls.sh and
ncu_memory.sh run it under ncu), then print its error against float64:

    python benchmarks/probes/profile_one.py M N K [precision] [family] [--b-t] [--a-t]
        [--option WM,WN,TM,SPLIT] [--macro NAME=VALUE ...]

``family`` forces a kernel family (default: the planner's choice). ``--b-t``: B = W.t() with W
stored [N, K] (nn.Linear's layout); ``--a-t``: A = G.t() with G stored [K, M] (grad_W's).
``--option`` and ``--macro`` (simt_cp_async only): plan one tile option (WARPS_M, WARPS_N,
THREAD_M, split allowed 0/1), as a tuned choice gives it, and add or replace macros of its
kernels (FMA_ZIGZAG=0, CP_MIN_BLOCKS=2, ...). Each call goes through the
full dispatch path (fastmm.dispatch.matmul_fastmm), so every launch of the plan runs: staging
copies, the GEMM, a second pass.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.problem import PRECISIONS  # noqa: E402
from probe_util import SimtOption, need_gpu, rel_err  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="profile_one.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("M", type=int)
    ap.add_argument("N", type=int)
    ap.add_argument("K", type=int)
    ap.add_argument("precision", nargs="?", default="ieee", choices=PRECISIONS)
    ap.add_argument("family", nargs="?", default=None, help="force this kernel family")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--b-t", action="store_true", help="B = W.t(), W stored [N, K]")
    ap.add_argument("--a-t", action="store_true", help="A = G.t(), G stored [K, M]")
    ap.add_argument("--option", default=None, help="simt_cp_async tile option WM,WN,TM,SPLIT")
    ap.add_argument("--macro", action="append", default=[], help="NAME=VALUE added to simt_cp_async's macros")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    a = torch.randn(o.K, o.M, device="cuda").t() if o.a_t else torch.randn(o.M, o.K, device="cuda")
    b = torch.randn(o.N, o.K, device="cuda").t() if o.b_t else torch.randn(o.K, o.N, device="cuda")
    c = torch.full((o.M, o.N), float("nan"), device="cuda")
    plan = reason = None
    variants = ()
    if o.option or o.macro:
        option = tuple(int(x) for x in o.option.split(",")) if o.option else None
        extra = tuple((k, int(v)) for k, v in (m.split("=") for m in o.macro))
        variants, o.family = (SimtOption(option=option, extra=extra),), "simt_cp_async"
    for _ in range(o.calls):
        _, plan, reason = dispatch.matmul_fastmm(a, b, c, o.precision, force=o.family, variants=variants)
    torch.cuda.synchronize()
    what = f"torch.matmul ({reason})" if reason else plan.kernel.describe()
    print(f"{o.M}x{o.N}x{o.K} {o.precision}: {what}")
    print("rel err", rel_err(c, a, b))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
