#!/usr/bin/env python3
"""TF32 wgmma with K split over blocks (SPLIT: each tile's last block sums the slices): for
products whose tiles leave SMs idle (decode's x @ W.t() at M = 16-128, small products with a long
K), which (tile width, slices) is fastest, and how far the planner's rule (WgmmaTf32.split_choice)
is from it.

    python benchmarks/probes/wgmma_split_probe.py [--only NAME,...] [--widths 64,128,256] [--splits 1,2,3,4,6,8]
        [--precision tf32x3]

For each product: GPU us per call (probe_util.time_us) of the planner's plan, of wgmma unsplit
(``WgmmaTf32(split=False)``), of each forced (width, slices), of kmajor_mma (M <= 32) and tf32_mma
forced, and of torch with TF32 allowed; the fastest forced one, and each result's error against
float64 (all must be TF32-level). ``--precision tf32x3``: the same for tf32x3 requests (their
planner's plan, fp32 SIMT where wgmma declines, against the forced splits; torch in fp32).
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
from probe_util import need_gpu, rel_err, time_us  # noqa: E402

#: (name, M, N, K, layout): "wt" = x @ W.t() (W stored [N, K]), "rm" = row-major B, "at" = A a
#: transposed view (grad_W's x^T) with a row-major B
PRODUCTS = (("dec16_4k", 16, 4096, 4096, "wt"), ("dec32_qwen", 32, 3584, 18944, "wt"),
            ("dec48_down", 48, 4096, 11008, "wt"), ("dec64_up", 64, 14336, 4096, "wt"),
            ("dec64_4k", 64, 4096, 4096, "wt"), ("dec96_4k", 96, 4096, 4096, "wt"),
            ("dec128_4k", 128, 4096, 4096, "wt"), ("dec77_phi3", 77, 9216, 3072, "wt"),
            ("dec32_down", 32, 4096, 14336, "wt"), ("odd_small", 300, 700, 1100, "wt"),
            ("issue_77", 77, 1531, 2053, "rm"), ("p200_1k_4k", 200, 1000, 4096, "wt"),
            ("p100_300_8k", 100, 300, 8192, "wt"), ("largeK", 256, 256, 65536, "rm"),
            ("gx_1k_down", 1024, 1024, 2816, "rm"), ("prefill512", 512, 4096, 4096, "wt"),
            ("mistral333", 333, 4096, 4096, "wt"),
            # session 26: 17-32 rows at K < 8192, and more than 64 rows with few tiles and a long K
            ("dec24_4k", 24, 4096, 4096, "wt"), ("dec24_kv", 24, 1024, 4096, "wt"),
            ("dec24_gemma_up", 24, 16384, 2048, "wt"), ("dec80_4k", 80, 4096, 4096, "wt"),
            ("p200_gemma_down", 200, 2048, 16384, "wt"), ("gx511_qwen", 511, 1536, 8960, "rm"),
            ("gx1024_t5", 1024, 768, 3072, "rm"), ("gw768_gpt2", 768, 2304, 4096, "at"),
            ("p1000_4k_4k", 1000, 1024, 4096, "wt"),
            # session 35: an lm_head's grad_x at 1024 tokens (K = the vocabulary)
            ("gx1024_vocab", 1024, 1024, 32000, "rm"), ("gx2048_vocab", 2048, 1024, 32000, "rm"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--widths", default="64,128,256")
    ap.add_argument("--splits", default="1,2,3,4,6,8")
    ap.add_argument("--precision", default="tf32", choices=("tf32", "tf32x3"))
    o = ap.parse_args()
    if not need_gpu("wgmma_split_probe.py"):
        return 2
    torch.manual_seed(0)
    prec = o.precision
    torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
    widths = [int(x) for x in o.widths.split(",")]
    splits = [int(x) for x in o.splits.split(",")]
    only = set(filter(None, o.only.split(",")))
    forced = {f"{bn}/{s}": WgmmaTf32(force_bn=bn, split=s if s > 1 else False) for bn in widths for s in splits}
    print(f"{prec}: GPU us per call; forced columns are width/slices (a forced count is capped at K / 512)")
    for name, M, N, K, layout in PRODUCTS:
        if only and name not in only:
            continue
        a = torch.randn(K, M, device="cuda").t() if layout == "at" else torch.randn(M, K, device="cuda")
        b = torch.randn(N, K, device="cuda").t() if layout == "wt" else torch.randn(K, N, device="cuda")
        out = torch.empty(M, N, device="cuda")
        times, errs, descs = {}, [], {}

        def run(label, **kw):
            c = torch.full_like(out, float("nan"))
            _, plan, reason = dispatch.matmul_fastmm(a, b, c, prec, **kw)
            if reason is not None or plan is None or plan.kernel is None:
                return
            if "force" in kw and plan.kernel.family != kw["force"]:
                return
            errs.append(rel_err(c, a, b))
            k = plan.kernel
            descs[label] = f"{k.family[:6]} {k.tile[1]}" + (f"/{k.split_k}" if k.split_k > 1 else "")
            times[label] = time_us(lambda: dispatch.matmul_fastmm(a, b, out, prec, **kw))

        run("planner")
        run("unsplit", force="wgmma_tf32", variants=(WgmmaTf32(split=False),))
        for label, v in forced.items():
            run(label, force="wgmma_tf32", variants=(v,))
        if M <= 32 and prec == "tf32":
            run("kmajor_mma", force="kmajor_mma")
        run("tf32_mma", force="tf32_mma")
        times["torch"] = time_us(lambda: torch.matmul(a, b, out=out))
        best = min((t, lab) for lab, t in times.items() if lab in forced)
        print(f"\n{name} {M}x{N}x{K}{' W^T' if layout == 'wt' else ' A^T' if layout == 'at' else ''}: planner {descs.get('planner')} "
              f"{times.get('planner', float('nan')):.1f} us, torch {times['torch']:.1f}, best forced {best[1]} "
              f"{best[0]:.1f} ({descs.get(best[1])}), unsplit {times.get('unsplit', float('nan')):.1f}, "
              f"kmajor_mma {times.get('kmajor_mma', float('nan')):.1f}, tf32_mma {times.get('tf32_mma', float('nan')):.1f}; "
              f"max error {max(errs):.1e}")
        print("  " + "  ".join(f"{lab} {times[lab]:.1f}" for lab in forced if lab in times), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
