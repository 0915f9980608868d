"""Correctness smoke test of every kernel family and timing of kernel variants (macro overrides)
on the current GPU. A tuning aid: `python benchmarks/variants.py` prints a table last.
    python benchmarks/variants.py --simt-check NAME=VALUE ...   the planner's SIMT plans (split-K,
        staging, batches) with these macros added, every layout and awkward shape, vs float64
    python benchmarks/variants.py --simt-time NAME=VALUE ...    the headline shapes, the planner's
        SIMT kernel with and without them, rounds alternating (NOTES.md run 12)"""
from __future__ import annotations

import dataclasses
import sys

import torch

sys.path.insert(0, ".")
from fastmm import api  # noqa: E402
from fastmm.families import FAMILIES  # noqa: E402
from fastmm.runtime import launcher, runners  # noqa: E402


def run_cfg(cfg, plan, a, b, c):
    s = api.analyse(a, b)
    p, offsets = api.build_problem(s, c, plan.problem.precision)
    loaded = launcher.load(plan.device, cfg)
    stream = torch.cuda.current_stream().cuda_stream
    launcher.launch(loaded, stream, (a.data_ptr(), b.data_ptr(), c.data_ptr()) + runners.gemm_args(p))


def with_macros(cfg, M, N, **over):
    """``cfg`` with some macros replaced; tile, block, grid and shared memory recomputed. Always
    the plain kernel (one launch over every tile), also where the planner took stream-K."""
    m = dict(cfg.macros)
    m.pop("STREAM_K", None)
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
        smem = m["STAGES"] * bk * ((bm + 4) + (bn + 4)) * 4 if cfg.family == "simt_cp_async" else 0
    threads = wm * wn * 32
    tiles = -(-M // bm) * -(-N // bn)
    return dataclasses.replace(cfg, macros=tuple(m.items()), smem=smem, tile=(bm, bn, bk), block=threads,
                               block_dims=(threads, 1, 1), grid=(tiles, 1, cfg.grid[2]),
                               entry=FAMILIES[cfg.family].entry, stream_k=None)


def rel_err(c, a, b):
    ref = a.double() @ b.double()
    return ((c.double() - ref).norm() / ref.norm()).item()


def check_and_time(cfg, plan, a, b, c, rows=256):
    """Run ``cfg`` once into a NaN-filled ``c``, check its first ``rows`` rows against float64,
    then time it: (median ms, relative error)."""
    c.fill_(float("nan"))
    run_cfg(cfg, plan, a, b, c)
    torch.cuda.synchronize()
    err = rel_err(c[:rows], a[:rows], b)
    return time_ms(lambda: run_cfg(cfg, plan, a, b, c)), err


def time_ms(fn, reps=20):
    for _ in range(3):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        s.record(); fn(); e.record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) for s, e in ev)
    return t[len(t) // 2]


SHAPES = [(1, 1, 1), (3, 5, 4), (17, 19, 23), (129, 96, 132), (257, 129, 193), (4097, 4095, 4093), (1000, 1000, 1000)]


def layout_operands(M, N, K, layout, batch=()):
    a = torch.randn(*batch, M, K, device="cuda") if layout[0] != "t" else torch.randn(*batch, K, M, device="cuda").mT
    b = torch.randn(*batch, K, N, device="cuda") if layout != "nt" else torch.randn(*batch, N, K, device="cuda").mT
    if layout == "off":
        a = torch.randn(M * K + 1, device="cuda")[1:].view(M, K)
        b = torch.randn(K * N + 3, device="cuda")[3:].view(K, N)
    return a, b


def parse_macros(args):
    return {k: int(v) for k, v in (a.split("=") for a in args if "=" in a)}


def simt_with(extra):
    """Make the SIMT cp.async family add ``extra`` to its macros (a process-wide patch)."""
    fam = FAMILIES["simt_cp_async"]
    base = type(fam).extra_macros
    fam.extra_macros = lambda p, dev, bm, bn: base(fam, p, dev, bm, bn) + tuple(extra.items())


def simt_check(extra):
    simt_with(extra)
    fails = 0
    cases = [(s, lay, ()) for s in SHAPES + [(256, 256, 65536), (128, 11008, 4096), (2048, 1024, 4096)]
             for lay in ("nn", "tn", "nt", "off")] + [((512, 384, 640), "nn", (3,)), ((512, 384, 640), "tn", (2, 2))]
    for (M, N, K), layout, batch in cases:
        a, b = layout_operands(M, N, K, layout, batch)
        c = torch.full((*batch, M, N), float("nan"), device="cuda")
        _, plan, _ = api.matmul_fastmm(a, b, c, "ieee", force="simt_cp_async")
        torch.cuda.synchronize()
        assert all(dict(plan.kernel.macros).get(k) == v for k, v in extra.items()), plan.kernel.macros
        err = rel_err(c, a, b)
        if not err <= 1e-5:
            fails += 1
            print(f"FAIL {extra} {M}x{N}x{K} {layout} batch {batch} err={err:.2e}")
    print(f"simt_cp_async with {extra}: {len(cases)} cases, {fails} failures", flush=True)
    return 1 if fails else 0


def simt_time(extra):
    torch.backends.cuda.matmul.allow_tf32 = False
    for M, N, K in ((8192, 4096, 6144), (4096, 4096, 4096)):
        a, b = layout_operands(M, N, K, "nn")
        c = torch.empty(M, N, device="cuda")
        flops = 2 * M * N * K
        p, _ = api.build_problem(api.analyse(a, b), c, "ieee")
        plan = api.plan_for(p, 0, "simt_cp_async")
        times = {}
        for _ in range(3):
            times.setdefault("torch", []).append(time_ms(lambda: torch.matmul(a, b, out=c)))
            for v in (dict(), extra):
                t, err = check_and_time(with_macros(plan.kernel, M, N, **v), plan, a, b, c, rows=512)
                assert err <= 1e-5, (v, err)
                times.setdefault(str(v), []).append(t)
        print(f"{M}x{N}x{K} ieee, TFLOP/s per round:")
        for name, ts in times.items():
            print(f"  {name:40s} " + " ".join(f"{flops / t / 1e9:7.2f}" for t in ts), flush=True)
    return 0


def main():
    if "--simt-check" in sys.argv:
        return simt_check(parse_macros(sys.argv))
    if "--simt-time" in sys.argv:
        return simt_time(parse_macros(sys.argv))
    torch.manual_seed(0)
    rows = []
    fails = 0
    # correctness: each family on awkward shapes
    for fam in FAMILIES:
        for prec in ("ieee", "tf32", "tf32x3"):
            if prec not in FAMILIES[fam].precisions or (fam not in ("tf32_mma", "wgmma_tf32")) != (prec == "ieee"):
                continue  # each family at the precision(s) it is built for
            for (M, N, K) in [(1, 1, 1), (3, 5, 4), (17, 19, 23), (129, 96, 132), (257, 129, 193), (4097, 4095, 4093), (1000, 1000, 1000)]:
                for layout in ("nn", "tn", "nt", "off"):
                    a = torch.randn(M, K, device="cuda") if layout[0] != "t" else torch.randn(K, M, device="cuda").t()
                    b = torch.randn(K, N, device="cuda") if layout != "nt" else torch.randn(N, K, device="cuda").t()
                    if layout == "off":
                        a = torch.randn(M * K + 1, device="cuda")[1:].view(M, K)
                        b = torch.randn(K * N + 3, device="cuda")[3:].view(K, N)
                    c = torch.full((M, N), float("nan"), device="cuda")
                    try:
                        _, plan, _ = api.matmul_fastmm(a, b, c, prec, force=fam)
                        torch.cuda.synchronize()
                        err = rel_err(c, a, b)
                    except Exception as exc:  # report, keep going
                        err = float("nan")
                        print("ERROR", fam, prec, M, N, K, layout, exc)
                    tol = 1e-3 if prec == "tf32" else 1e-5
                    ok = err <= tol
                    fails += not ok
                    if not ok:
                        print(f"FAIL {fam} {prec} {M}x{N}x{K} {layout} err={err:.2e}")
            print(f"checked {fam} {prec}", flush=True)
    print(f"correctness failures: {fails}", flush=True)

    # timing of variants at the headline shape
    M, N, K = 8192, 4096, 6144
    a = torch.randn(M, K, device="cuda"); b = torch.randn(K, N, device="cuda"); c = torch.empty(M, N, device="cuda")
    flops = 2 * M * N * K
    torch.backends.cuda.matmul.allow_tf32 = False
    t = time_ms(lambda: torch.matmul(a, b, out=c)); rows.append(("torch ieee", t, flops / t / 1e9))
    torch.backends.cuda.matmul.allow_tf32 = True
    t = time_ms(lambda: torch.matmul(a, b, out=c)); rows.append(("torch tf32", t, flops / t / 1e9))
    torch.backends.cuda.matmul.allow_tf32 = False
    s = api.analyse(a, b)
    for prec, fam, variants in [
        ("ieee", "simt_cp_async", [dict(), dict(FMA_ZIGZAG=0), dict(WARPS_M=2, WARPS_N=2, THREAD_M=8),
                                   dict(WARPS_M=2, WARPS_N=2, THREAD_M=8, CP_MIN_BLOCKS=1), dict(BK=16, STAGES=4)]),
    ]:
        p, _ = api.build_problem(s, c, prec)
        plan = api.plan_for(p, 0, fam)
        for v in variants:
            cfg = with_macros(plan.kernel, M, N, **v)
            try:
                t, err = check_and_time(cfg, plan, a, b, c, rows=512)
                rows.append((f"{fam} {prec} {v}", t, flops / t / 1e9, err))
            except Exception as exc:
                rows.append((f"{fam} {prec} {v} ERROR {exc}"[:200], 0, 0))
    print(f"\n{M}x{N}x{K}")
    for r in rows:
        print(" | ".join(str(x) if not isinstance(x, float) else f"{x:.4g}" for x in r))
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
