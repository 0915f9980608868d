"""Macro variants of the SIMT cp.async kernel on the current GPU (NOTES.md runs 11-13), and the
helpers other probes build kernel variants with:

    python benchmarks/probes/variants.py --simt-check NAME=VALUE ...
        the planner's SIMT plans (split-K, stream-K, cluster pairs, staging, batches) with these
        macros added by a SimtCpAsync variant handed to the planner, over every layout and some
        awkward shapes, each against float64
    python benchmarks/probes/variants.py --simt-time NAME=VALUE ... [--rounds R]
        the headline shapes (8192x4096x6144, 4096^3), the planner's SIMT kernel with and without
        these macros (the plain kernel, one launch over every tile: no split-K or stream-K),
        alternating rounds, next to torch.matmul; e.g. FRAG_DEPTH=3, STAGES=8, FMA_ZIGZAG=0, or
        WARPS_N=2 THREAD_M=8 for the 128x128 tile with 8x8 outputs per thread

--simt-check adds macros the family does not set itself (STAGES replaces its own); --simt-time
can replace any (tile, block, grid and shared memory are recomputed).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.families import FAMILIES  # noqa: E402
from fastmm.runtime import launcher, runners  # noqa: E402
from fastmm.shapes import analyse, build_problem  # noqa: E402
from probe_util import SimtOption, need_gpu, rel_err, time_ms  # noqa: E402


def run_cfg(cfg, plan, a, b, c):
    """One plain launch of ``cfg`` (no second pass) for a @ b -> c."""
    p, _ = build_problem(analyse(a, b), c, plan.problem.precision)
    loaded = launcher.load(plan.device, cfg)
    stream = dispatch.current_stream(plan.device.index)
    launcher.launch(loaded, stream, (a.data_ptr(), b.data_ptr(), c.data_ptr()) + runners.gemm_args(p))


def with_macros(cfg, M, N, **over):
    """``cfg`` (simt_cp_async, simt_float4 or tf32_mma) with some macros replaced; tile, block,
    grid and shared memory recomputed. Always the plain kernel (one launch over every tile, no
    split-K, no cluster pairs), also where the planner took stream-K or split-K."""
    m = dict(cfg.macros)
    for split_macro in ("STREAM_K", "SPLIT_PAIR", "SPLIT_FUSED", "OUT_VEC"):
        m.pop(split_macro, None)
    m.update(over)
    wm, wn = m.get("WARPS_M", 2), m.get("WARPS_N", 4)
    if cfg.family == "tf32_mma":
        wtn = m.get("WARP_N", 32)
        bm, bn, bk = wm * 64, wn * wtn, 32
        a_f = bm * (bk + 4) if m["A_SMEM_MK"] else bk * (bm + 8)
        b_f = bk * (bn + 8) if m["B_SMEM_KN"] else bn * (bk + 4)
        smem = (a_f + b_f) * 4 * m["STAGES"]
    else:
        bm, bn, bk = wm * 64, wn * (32 if m.get("THREAD_M", 8) == 8 else 64), m.get("BK", 8)
        smem = FAMILIES[cfg.family].smem_bytes(bm, bn, m.get("STAGES", 2))
    threads = wm * wn * 32
    tiles = -(-M // bm) * -(-N // bn)
    return dataclasses.replace(cfg, macros=tuple(m.items()), smem=smem, tile=(bm, bn, bk), block=threads,
                               block_dims=(threads, 1, 1), grid=(tiles, 1, cfg.grid[2]),
                               entry=FAMILIES[cfg.family].entry, stream_k=None, split_pair=False, split_fused=False)


def check_and_time(cfg, plan, a, b, c, rows=256):
    """Run ``cfg`` once into a NaN-filled ``c``, check its first ``rows`` rows against float64,
    then time it: (median ms, relative error)."""
    c.fill_(float("nan"))
    run_cfg(cfg, plan, a, b, c)
    torch.cuda.synchronize()
    err = rel_err(c[:rows], a[:rows], b)
    return time_ms(lambda: run_cfg(cfg, plan, a, b, c)), err


SHAPES = [(1, 1, 1), (3, 5, 4), (17, 19, 23), (129, 96, 132), (257, 129, 193), (4097, 4095, 4093), (1000, 1000, 1000)]


def layout_operands(M, N, K, layout, batch=()):
    """Operands of M x N x K: "nn" row-major, "tn" A transposed, "nt" B transposed, "off" both
    at a storage offset (4- and 12-byte aligned pointers)."""
    a = torch.randn(*batch, M, K, device="cuda") if layout[0] != "t" else torch.randn(*batch, K, M, device="cuda").mT
    b = torch.randn(*batch, K, N, device="cuda") if layout != "nt" else torch.randn(*batch, N, K, device="cuda").mT
    if layout == "off":
        a = torch.randn(M * K + 1, device="cuda")[1:].view(M, K)
        b = torch.randn(K * N + 3, device="cuda")[3:].view(K, N)
    return a, b


def parse_macros(items):
    try:
        return {k: int(v) for k, v in (x.split("=") for x in items)}
    except ValueError:
        raise SystemExit(f"macros are NAME=INTEGER, got {' '.join(items)}") from None


def simt_check(extra) -> int:
    variant = SimtOption(extra=tuple(extra.items()))
    fails = 0
    cases = [(s, lay, ()) for s in SHAPES + [(256, 256, 65536), (128, 11008, 4096), (2048, 1024, 4096),
                                             (3000, 3000, 3000)]
             for lay in ("nn", "tn", "nt", "off")] + [((512, 384, 640), "nn", (3,)), ((512, 384, 640), "tn", (2, 2))]
    for (M, N, K), layout, batch in cases:
        a, b = layout_operands(M, N, K, layout, batch)
        c = torch.full((*batch, M, N), float("nan"), device="cuda")
        _, plan, reason = dispatch.matmul_fastmm(a, b, c, "ieee", force="simt_cp_async", variants=(variant,))
        torch.cuda.synchronize()
        if reason is not None:
            fails += 1
            print(f"FAIL {M}x{N}x{K} {layout} batch {batch}: torch.matmul ran ({reason})")
            continue
        assert all(dict(plan.kernel.macros).get(k) == v for k, v in extra.items()), plan.kernel.macros
        err = rel_err(c, a, b)
        if not err <= 1e-5:
            fails += 1
            print(f"FAIL {extra} {M}x{N}x{K} {layout} batch {batch} err={err:.2e} grid {plan.kernel.grid}")
    print(f"simt_cp_async with {extra}: {len(cases)} cases, {fails} failures", flush=True)
    return 1 if fails else 0


def simt_time(extra, rounds) -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    dev_index = torch.cuda.current_device()
    for M, N, K in ((8192, 4096, 6144), (4096, 4096, 4096)):
        a, b = layout_operands(M, N, K, "nn")
        c = torch.empty(M, N, device="cuda")
        flops = 2 * M * N * K
        p, _ = build_problem(analyse(a, b), c, "ieee")
        plan = dispatch.plan_for(p, dev_index, "simt_cp_async")
        times = {}
        for _ in range(rounds):
            times.setdefault("torch", []).append(time_ms(lambda: torch.matmul(a, b, out=c)))
            for v in (dict(), extra):
                t, err = check_and_time(with_macros(plan.kernel, M, N, **v), plan, a, b, c, rows=512)
                assert err <= 1e-5, (v, err)
                times.setdefault(str(v), []).append(t)
        print(f"{M}x{N}x{K} ieee, TFLOP/s per round:")
        for name, ts in times.items():
            print(f"  {name:40s} " + " ".join(f"{flops / t / 1e9:7.2f}" for t in ts), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="variants.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--simt-check", nargs="+", metavar="NAME=VALUE")
    mode.add_argument("--simt-time", nargs="+", metavar="NAME=VALUE")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of --simt-time (default 3)")
    o = ap.parse_args(argv)
    extra = parse_macros(o.simt_check or o.simt_time)
    if not need_gpu(ap.prog):
        return 2
    torch.manual_seed(0)
    return simt_check(extra) if o.simt_check else simt_time(extra, o.rounds)


if __name__ == "__main__":
    raise SystemExit(main())
