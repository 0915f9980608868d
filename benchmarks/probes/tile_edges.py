"""Edge cases of simt_cp_async's 64-row and 64-wide tiles of 16 x 8 outputs a thread
(HALF_TILE_OPTIONS, NARROW_TILE_OPTIONS), forced one option at a time, for compute-sanitizer
(memcheck, racecheck) to watch:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --report-api-errors no \\
        python benchmarks/probes/tile_edges.py [--tiles half|narrow|all] [--quick]

Inputs are small integers (exact in fp32 sums), built on the CPU and copied over; each output is
NaN-filled and must equal the float64 product exactly; inputs must come back unchanged. M, N and
K around the tiles' edges (1, 3, 17, 63-65, 129, 300), K not a multiple of the k-tile, unaligned
rows (K or N odd), nn.Linear's W^T, a row-major B, an m-contiguous A, batch 3 and a broadcast B,
split-K with a reduce pass and with the fused sum. Prints one line per failing case and a
summary; exits 1 if any case was wrong. (``--report-api-errors no``: cuda-python probes driver entry
points it may not find, cuGetProcAddress answering CUDA_ERROR_INVALID_VALUE, 34 times at start-up;
memcheck counts those as errors unless told not to.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.families.simt_cp_async import HALF_TILE_OPTIONS, NARROW_TILE_OPTIONS  # noqa: E402
from probe_util import SimtOption, need_gpu  # noqa: E402


def operands(M, N, K, batch, layout, gen):
    """(a, b) on the GPU in ``layout``: "linear" (b = W.t()), "rowmajor", "a_t" (a m-contiguous)."""
    def ints(*shape):
        return torch.randint(-3, 4, shape, generator=gen).float()

    bs = (batch,) if batch > 1 else ()
    a = ints(*bs, K, M).transpose(-1, -2) if layout == "a_t" else ints(*bs, M, K)
    b = ints(N, K).t() if layout == "linear" else ints(K, N)
    return a.cuda(), b.cuda()


HALF_CASES = [(64, 4096, 1024, 1, "linear"), (33, 1000, 1100, 1, "linear"), (1, 256, 300, 2, "linear"),
              (300, 700, 1100, 1, "linear"), (129, 129, 777, 1, "linear"), (17, 2051, 64, 3, "linear"),
              (64, 255, 7, 1, "linear"), (65, 300, 301, 1, "rowmajor"), (3, 260, 2049, 1, "rowmajor"),
              (48, 260, 999, 1, "a_t"), (300, 700, 1100, 1, "a_t"), (63, 64, 4096, 3, "rowmajor")]
NARROW_CASES = [(512, 64, 512, 3, "linear"), (384, 48, 300, 3, "rowmajor"), (4, 64, 300, 2, "a_t"),
                (260, 1, 301, 1, "rowmajor"), (129, 64, 4096, 1, "linear"), (1000, 61, 7, 2, "a_t")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tile_edges.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiles", choices=("half", "narrow", "all"), default="all")
    ap.add_argument("--quick", action="store_true", help="the first four cases of each tile (for racecheck)")
    ap.add_argument("--verbose", action="store_true", help="a line per case, each synchronized (so a sanitizer's "
                                                           "report follows the case it belongs to)")
    args = ap.parse_args(argv)
    if not need_gpu("tile_edges.py"):
        return 2
    work = []
    if args.tiles in ("half", "all"):
        work += [(t, c) for t in HALF_TILE_OPTIONS for c in HALF_CASES[:4 if args.quick else None]]
    if args.tiles in ("narrow", "all"):
        work += [(t, c) for t in NARROW_TILE_OPTIONS for c in NARROW_CASES[:4 if args.quick else None]]
    gen = torch.Generator().manual_seed(0)
    ran = wrong = skipped = 0
    for tile, (M, N, K, batch, layout) in work:
        for split in (0, 1):
            a, b = operands(M, N, K, batch, layout, gen)
            a0, b0 = a.clone(), b.clone()
            out = torch.full(a.shape[:-1] + b.shape[-1:], float("nan"), device="cuda")
            fam = SimtOption(option=tile + (split,))
            _, plan, reason = dispatch.matmul_fastmm(a, b, out, "ieee", force="simt_cp_async", variants=(fam,))
            if reason is not None or plan.kernel.family != "simt_cp_async":
                skipped += 1  # (a copy or load mode this tile does not take: the planner says so)
                continue
            ran += 1
            if args.verbose:
                torch.cuda.synchronize()
                print(f"case {tile} split={split} {M}x{N}x{K} batch {batch} {layout}: {dict(plan.kernel.macros)} "
                      f"grid {plan.kernel.grid}{' + reduce' if plan.reduce else ''}", flush=True)
            ref = torch.matmul(a.cpu().double(), b.cpu().double())
            ok = torch.equal(out.cpu().double(), ref) and torch.equal(a, a0) and torch.equal(b, b0)
            if not ok:
                wrong += 1
                print(f"WRONG {tile} split={split} {M}x{N}x{K} batch {batch} {layout}: {plan.describe()}")
    torch.cuda.synchronize()
    print(f"tile_edges: {ran} cases run, {wrong} wrong, {skipped} not planned on the forced tile")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
