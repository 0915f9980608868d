"""skinny_kmajor (x @ W.t(), M <= 32): how many K slices, and is a short call host- or GPU-bound?

For decode shapes: torch.matmul and fastmm.matmul called back to back (CUDA events around 200
calls, median of 7; and the host's wall time per call of the same loop), then the GPU time
alone: 20 calls captured in a CUDA graph and replayed, for torch, for the planner's plan and for
every K split the family can take with 1, 2, 4 or 8 warps of a block along K (the variant
SkinnyKmajor(split=S, kw=KW)); GB/s of W. Beside them,
what reading W alone costs on this GPU: torch's row sums of W (``torch.sum(w, 1)``, a read-bound
reduction: the floor a GEMV can hope for, launch and tail included) and a copy of W.
    python3 benchmarks/probes/kmajor_split_probe.py [--no-pdl]
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

import fastmm  # noqa: E402
from fastmm import dispatch  # noqa: E402
from fastmm.families import SkinnyKmajor  # noqa: E402
from probe_util import graph_us, need_gpu  # noqa: E402

SHAPES = [(1, 1024, 4096), (1, 4096, 4096), (2, 4096, 4096), (4, 4096, 4096), (16, 4096, 4096), (1, 14336, 4096),
          (1, 4096, 14336), (4, 1024, 4096), (8, 4096, 14336)]
#: KR_KW swept (warps of a block along K; skinny_kmajor.cu)
KWS = (1, 2, 4, 8)


def loop_us(fn, calls=200, reps=7):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        for _ in range(calls):
            fn()
        e1.record()
        host.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
        gpu.append(e0.elapsed_time(e1) / calls * 1e3)
    return statistics.median(gpu), statistics.median(host)


def main():
    print("FASTMM_PDL =", os.environ.get("FASTMM_PDL", "(default: on)"))
    for M, N, K in SHAPES:
        x = torch.randn(M, K, device="cuda")
        w = torch.randn(N, K, device="cuda")
        out = torch.empty(M, N, device="cuda")
        b = w.t()
        gb = N * K * 4 / 1e3
        t_loop, t_host = loop_us(lambda: torch.matmul(x, b, out=out))
        t_graph = graph_us(lambda: torch.matmul(x, b, out=out))
        f_loop, f_host = loop_us(lambda: fastmm.matmul(x, b, out=out, precision="ieee"))
        f_graph = graph_us(lambda: fastmm.matmul(x, b, out=out, precision="ieee"))
        plan = fastmm.explain(x, b, precision="ieee").plan
        print(f"{M}x{N}x{K}: back to back: torch {t_loop:.1f} us (host {t_host:.1f}), fastmm {f_loop:.1f} us "
              f"(host {f_host:.1f}); graph replay: torch {t_graph:.1f} us ({gb / t_graph:.0f} GB/s), fastmm "
              f"{f_graph:.1f} us ({gb / f_graph:.0f} GB/s, {t_graph / f_graph:.2f}x), plan S {plan.kernel.grid[1]} "
              f"KW {dict(plan.kernel.macros).get('KR_KW', 1)}")
        rowsum = torch.empty(N, device="cuda")
        wcopy = torch.empty_like(w)
        r_graph = graph_us(lambda: torch.sum(w, 1, out=rowsum))
        c_graph = graph_us(lambda: wcopy.copy_(w))
        print(f"    reading W alone: torch.sum(w, 1) {r_graph:.1f} us ({gb / r_graph:.0f} GB/s); a copy of W "
              f"{c_graph:.1f} us ({gb / c_graph:.0f} GB/s of W read, as much written)")
        del wcopy
        ref = x.double() @ b.double()
        for kw in KWS:
            for S in (1, 2, 4, 8, 16, 32):
                fam = SkinnyKmajor(split=S, kw=kw)
                out.fill_(float("nan"))
                _, p, reason = dispatch.matmul_fastmm(x, b, out, "ieee", variants=(fam,))
                assert reason is None and p.kernel.family == "skinny_kmajor"
                err = ((out.double() - ref).norm() / ref.norm()).item()
                us = graph_us(lambda: dispatch.matmul_fastmm(x, b, out, "ieee", variants=(fam,)))
                print(f"    KW {kw} S {p.kernel.grid[1]:3d} (KS {p.kernel.tile[2]:5d}, {p.kernel.grid[0] * p.kernel.grid[1]:5d} "
                      f"blocks): graph {us:7.1f} us ({gb / us:5.0f} GB/s, {t_graph / us:.2f}x torch), err {err:.1e}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-pdl", action="store_true", help="FASTMM_PDL=0: plain launches")
    args = ap.parse_args()
    if args.no_pdl:
        os.environ["FASTMM_PDL"] = "0"  # (read when a plan is prepared: before the first call)
    if not need_gpu("kmajor_split_probe.py"):
        raise SystemExit(2)
    main()
