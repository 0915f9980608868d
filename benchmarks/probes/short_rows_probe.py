#!/usr/bin/env python3
"""Full-fp32 products of 8-48 rows (decode with a batch of sequences, on x @ W.t() or a row-major
W): the skinny families against simt_cp_async's 32-row tiles (THREAD_M 4: 32 x 256, 32 x 128)
and its usual tiles, beside torch in fp32. Which is fastest from how many rows, and which width?
Does the 32 x 128 tile gain from 4 blocks an SM (at most 128 registers, twice the slices)?

    python benchmarks/probes/short_rows_probe.py [--rows 8,16,17,24,32,48] [--only NAME,...]

GPU us per call (probe_util.time_us: back-to-back calls queued behind a sleep kernel, so the
host's time does not count) of: the planner's ieee plan, skinny_kmajor (W^T) or skinny (row-major
W) forced, simt_cp_async without the 32-row tiles (``SimtCpAsync(short_rows=0)``), with each
width forced (32 x 128 with and without ``short_min_blocks=4``), and torch.matmul in fp32; every result's error against float64 (all must be
fp32-level). The kernels are compiled first on every core.
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
from probe_util import compile_plans, need_gpu, rel_err, time_us  # noqa: E402

#: (name, N, K, B layout): "wt" = x @ W.t() (W stored [N, K]), "rm" = a row-major W [K, N]
DIMS = (("llama_qo", 4096, 4096, "wt"), ("llama_up", 14336, 4096, "wt"), ("llama_down", 4096, 14336, "wt"),
        ("qwen_down", 3584, 18944, "wt"), ("llama_kv", 1024, 4096, "wt"), ("gpt2_head", 50257, 768, "wt"),
        ("rm_4k", 4096, 4096, "rm"), ("rm_up", 11008, 4096, "rm"))

VARIANTS = {"simt_old": SimtCpAsync(short_rows=0), "simt_32x256": SimtCpAsync(short_rows=64, short_bn=256),
            "simt_32x128": SimtCpAsync(short_rows=64, short_bn=128, short_min_blocks=0),
            "simt_32x128_4b": SimtCpAsync(short_rows=64, short_bn=128, short_min_blocks=4)}


def precompile(calls) -> None:
    """Plan every call and compile its kernels into the disk cache on all cores (NVRTC)."""
    from fastmm.plan import select
    from fastmm.shapes import analyse, build_problem

    dev = dispatch.device_facts(0)
    plans = []
    for a, b, kw in calls:
        s = analyse(a, b)
        problem, _ = build_problem(s, torch.empty(s.M, s.N, device="cuda"), "ieee")
        try:
            plans.append(select(problem, dev, force=kw.get("force"), variants=kw.get("variants", ())))
        except ValueError:
            continue
    print(f"compiled {compile_plans(plans, dev.arch)} kernels", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,16,17,24,32,48")
    ap.add_argument("--only", default="")
    o = ap.parse_args()
    if not need_gpu("short_rows_probe.py"):
        return 2
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = [int(x) for x in o.rows.split(",")]
    only = set(filter(None, o.only.split(",")))
    cases = []
    for name, N, K, layout in DIMS:
        if only and name not in only:
            continue
        w = torch.randn(N, K, device="cuda") if layout == "wt" else torch.randn(K, N, device="cuda")
        b = w.t() if layout == "wt" else w
        skinny = "skinny_kmajor" if layout == "wt" else "skinny"
        for M in rows:
            a = torch.randn(M, K, device="cuda")
            kws = {"planner": {}, "simt_old": {"force": "simt_cp_async", "variants": (VARIANTS["simt_old"],)}}
            if M <= 32:
                kws[skinny] = {"force": skinny}
            for label in ("simt_32x256", "simt_32x128", "simt_32x128_4b"):
                kws[label] = {"force": "simt_cp_async", "variants": (VARIANTS[label],)}
            cases.append((name, N, K, layout, M, a, b, kws))
    precompile([(a, b, kw) for *_, a, b, kws in cases for kw in kws.values()])
    print("ieee: GPU us per call (W^T: x @ W.t(), W stored [N, K]; rm: a row-major W)")
    for name, N, K, layout, M, a, b, kws in cases:
        out = torch.empty(M, N, device="cuda")
        times, errs, descs = {}, [], {}
        for label, kw in kws.items():
            c = torch.full_like(out, float("nan"))
            try:
                _, plan, reason = dispatch.matmul_fastmm(a, b, c, "ieee", **kw)
            except ValueError:
                continue
            if reason is not None or plan is None or plan.kernel is None:
                continue
            errs.append(rel_err(c, a, b))
            k = plan.kernel
            descs[label] = f"{k.family} {k.tile[0]}x{k.tile[1]}" + (f"/{k.split_k}" if k.split_k > 1 else "")
            times[label] = time_us(lambda: dispatch.matmul_fastmm(a, b, out, "ieee", **kw))
        times["torch"] = time_us(lambda: torch.matmul(a, b, out=out))
        fastest = min((t, lab) for lab, t in times.items() if lab != "torch")
        print(f"{name} {M}x{N}x{K} {layout}: " + "  ".join(f"{lab} {t:.1f}" for lab, t in times.items())
              + f" | fastest {fastest[1]} ({descs.get(fastest[1])}), planner {descs.get('planner')}; "
              f"max error {max(errs):.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
