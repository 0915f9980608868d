#!/usr/bin/env python3
"""TF32 wgmma on products of at most 64 rows (and mid-size ones): the 64-row tile (BM = 64, one consumer warpgroup)
against the 128-row one at each width and number of K slices, and against the other families
that take such products.

    python benchmarks/probes/wgmma_rows_probe.py [--only NAME,...] [--rows 128,64] [--widths 128,256]
        [--splits 1,2,4] [--families kmajor_mma,tf32_mma] [--precision tf32x3] [--rounds 3] [--rule128] [--a-mn]

For each product: GPU us per call (probe_util.time_us, the median of ``--rounds`` alternating
rounds) of the planner's plan, of every forced (rows, width, slices), of each forced family that
takes the product and of torch with TF32 allowed (``--precision tf32x3``: tf32x3 requests, B
split by the kernel on 64-row tiles, against torch in fp32); each result's error against float64
must be TF32-level, or fp32-level for tf32x3 (checked: the probe stops on one that is not). Decode's W is larger than L2 (but 64 x 4096 x 4096's 64 MiB, about L2's size).
``--a-mn``: also the planner with ``rows64_a_mn`` flipped from its default (A fed from registers on
64-row tiles where C is written along m; on since run 42), for the "rm" products (grad_x with a
row-major W) above all. ``--a-mn-split``: also the planner with ``rows64_a_mn_split`` flipped
(A_MN's 64-row tiles split by the 64-row rule; on since NOTES run 44). ``--a-mn-k``: also the planner
with A_MN's 64-row split from K-major A's K bound (``rows64_a_mn_split_min_k``, lowered in NOTES run 45).
``--a-mn-lines``: also the planner with ``rows64_a_mn_split_max_lines`` the other way (the bound of 2048
M + N lines on A_MN's 64-row split where the planner has none, as since NOTES run 46; none where it has one).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.families import WgmmaTf32  # noqa: E402
from fastmm.families.wgmma_tf32 import ROWS64_A_MN_SPLIT_OLD_MAX_LINES, ROWS64_MID_SPLIT_MIN_K  # noqa: E402
from fastmm.plan import select  # noqa: E402
from fastmm.runtime.device import device_facts  # noqa: E402
from fastmm.shapes import analyse, build_problem  # noqa: E402
from probe_util import compile_plans, need_gpu, rel_err, time_us  # noqa: E402

#: (name, batch, M, N, K, layout): "wt" = x @ W.t() (W stored [N, K]); "bt" = a batch of A @ B^T;
#: "rm" = g @ W, W row-major; "mn" = A and B transposed views; "at" = A a transposed view, B row-major;
#: "ct" = A and B transposed views into a transposed C (out = an [N, M] tensor's .t()); "brm" = a batch of A @ B,
#: B row-major
PRODUCTS = (("dec64_up", 1, 64, 14336, 4096, "wt"), ("dec48_down", 1, 48, 4096, 11008, "wt"),
            ("dec32_down", 1, 32, 4096, 14336, "wt"), ("dec64_4k", 1, 64, 4096, 4096, "wt"),
            ("dec32_qwen", 1, 32, 3584, 18944, "wt"), ("dec24_gemma_up", 1, 24, 16384, 2048, "wt"),
            ("dec64_kv", 1, 64, 1024, 4096, "wt"), ("dec16_up", 1, 16, 14336, 4096, "wt"),
            ("bmm64_qk", 128, 64, 512, 64, "bt"),
            # the rule's edges: 17-32 rows at K = 4096-8192, few tiles over a long K
            ("dec24_4k", 1, 24, 4096, 4096, "wt"), ("dec17_8k", 1, 17, 4096, 8192, "wt"),
            ("dec24_kv", 1, 24, 1024, 4096, "wt"), ("p64_512_8k", 1, 64, 512, 8192, "wt"),
            ("p48_128_64k", 1, 48, 128, 65536, "wt"), ("dec33_odd", 1, 33, 2001, 8200, "wt"),
            ("dec64_2k", 1, 64, 2048, 4096, "wt"),
            # mid-size products (65-1000 rows) whose 128-row tiles fill few SMs: 64-row tiles there?
            ("odd_small", 1, 300, 700, 1100, "wt"), ("mid384", 1, 384, 768, 768, "wt"),
            ("vit1_down", 1, 197, 768, 3072, "wt"), ("mid512_2k", 1, 512, 512, 2048, "wt"),
            ("mid256_4k", 1, 256, 1024, 4096, "wt"), ("mid128_4k", 1, 128, 4096, 4096, "wt"),
            ("mid1000", 1, 1000, 1000, 1000, "wt"), ("mid96_3k", 1, 96, 3072, 768, "wt"),
            ("mid77", 1, 77, 1531, 2053, "wt"), ("mid700", 1, 700, 2304, 768, "wt"),
            ("mid128_11k", 1, 128, 4096, 11008, "wt"), ("mid200_1k", 1, 200, 1024, 1024, "wt"),
            # products of the other row files whose tf32 plan the mid-size rule (ROWS64_MID_WIDTHS) moved to
            # 64-row tiles, none of them measured when the rule was written (NOTES run 40), and one it left
            ("decode80_qo", 1, 80, 4096, 4096, "wt"), ("decode96", 1, 96, 4096, 4096, "wt"),
            ("qwen15_qkv_511", 1, 511, 2048, 1536, "wt"), ("odd_999", 1, 999, 1001, 1003, "wt"),
            ("tok1000_kv", 1, 1000, 256, 1024, "wt"), ("q1k", 1, 1024, 1024, 1024, "wt"),
            ("gemm_n64", 1, 8192, 64, 1024, "wt"), ("tok448_down", 1, 448, 2048, 8192, "wt"),
            ("tok192_qo", 1, 192, 4096, 4096, "wt"), ("r145", 1, 145, 2560, 1536, "wt"),
            ("r1171", 1, 1171, 384, 768, "wt"), ("r90", 1, 90, 1024, 2048, "wt"), ("r124", 1, 124, 4096, 768, "wt"),
            ("r948", 1, 948, 384, 1024, "wt"), ("r66", 1, 66, 2048, 5120, "wt"), ("r337", 1, 337, 2048, 768, "wt"),
            ("r65", 1, 65, 2560, 512, "wt"), ("r65_4k", 1, 65, 4096, 4096, "wt"), ("r200_4k", 1, 200, 1000, 4096, "wt"),
            ("mid200_16k", 1, 200, 2048, 16384, "wt"),
            # partial last rows with B of 24-25 MiB, near the L2 condition's bound (ROWS64_MID_PARTIAL_L2_SHARE)
            ("tall130", 1, 130, 1536, 4100, "wt"), ("p100_3k", 1, 100, 2048, 3072, "wt"),
            ("p200_1536_4k", 1, 200, 1536, 4096, "wt"),
            # A fed from registers (A_MN): grad_x = g @ W with W row-major ("rm": computed as C^T, W^T the
            # kernel's m-contiguous A), 128-row tiles only before rows64_a_mn; and one m-contiguous A ("mn")
            ("gx_qwen15_up_511", 1, 511, 1536, 8960, "rm"), ("gx_t5base_ff_1024", 1, 1024, 768, 3072, "rm"),
            ("gx_whisper_1500", 1, 1500, 384, 1536, "rm"), ("gx_llama1k_up", 1, 1024, 1024, 2816, "rm"),
            ("gx_llama1k_qo", 1, 1024, 1024, 1024, "rm"), ("gx_llama1k_kv", 1, 1024, 1024, 256, "rm"),
            ("gx_odd_small", 1, 300, 1100, 700, "rm"), ("gx_bert512_up", 1, 512, 1024, 4096, "rm"),
            ("gx_vit_up", 1, 197, 768, 3072, "rm"), ("gx_vit_down", 1, 197, 3072, 768, "rm"),
            ("gx_gpt2_2k_qkv", 1, 2048, 768, 2304, "rm"), ("gx_tok4k_kv", 1, 4096, 4096, 1024, "rm"),
            ("mn_1000", 1, 1000, 700, 1100, "mn"),
            # C^T products the A_MN rule of run 42 moved that the probe had not timed: few tiles over a
            # long K (the 128-row rule split it), a short K
            ("gx_tall_6000", 1, 700, 300, 6000, "rm"), ("gx_tok2k_kv", 1, 2048, 512, 2048, "rm"),
            ("gx_n48_8k", 1, 4096, 48, 8192, "rm"),
            # (run 43) decode-sized grad_x with a row-major W: 48 rows, K = 11008 (C^T: 4096 x 48)
            ("gx_dec48_down", 1, 48, 4096, 11008, "rm"),
            # (run 44) plans rows64_a_mn_split moves: a decode grad_x as C^T 4096 x 64, a grad_W (g.t() @ x,
            # "at": A a transposed view, B row-major), and largeK, which it must leave to tf32_mma's deep split
            ("gx_dec64_4k", 1, 64, 4096, 4096, "rm"), ("gw_tok320", 1, 320, 768, 3072, "at"),
            ("largeK_rm", 1, 256, 256, 65536, "rm"),
            # A_MN 64-row plans unsplit over a long K that wgmma's heuristic_reason leaves to tf32_mma (its
            # estimate counts 128 x 64 tiles of the product as given; 4096 x 48 x 8192 ran 58.5 us unsplit
            # on 64-row tiles, tf32_mma 82.7)
            ("gx_n48_14k", 1, 4096, 48, 14336, "rm"), ("gx_384_2816", 1, 384, 256, 2816, "rm"),
            ("gx_65_14k", 1, 65, 2816, 14336, "rm"), ("gx_511_11k", 1, 511, 768, 11008, "rm"),
            ("gw_512_11k", 1, 512, 768, 11008, "at"),
            # (run 45) A_MN products the K-major mid-size split's two guards held unsplit (K < 3072, and at
            # K = 4096 the fill guard, which stays)
            ("gx_66_2k", 1, 66, 768, 2048, "rm"), ("gx_tok300_4k", 1, 300, 1024, 4096, "rm"),
            ("gw_tok320_4k", 1, 320, 1024, 4096, "at"), ("rm_512_2k", 1, 512, 512, 2048, "rm"),
            # (run 45) a sample of the plans (of a 405,224-plan grid) that lowering A_MN's split K bound moved
            # with 128-wide splits allowed (1686), each kind: from tf32_mma's split or the 64-row tile
            # unsplit, in place (rm) or staged (at); the final rule (1182) leaves the 128-wide ones
            # (192 x 700, 300 x 768, 197 x 1000) unsplit
            ("k45_rm_128_320", 1, 128, 320, 2048, "rm"), ("k45_rm_768_96", 1, 768, 96, 2816, "rm"),
            ("k45_rm_192_700", 1, 192, 700, 2304, "rm"), ("k45_rm_320_320", 1, 320, 320, 2304, "rm"),
            ("k45_rm_1000_96", 1, 1000, 96, 2304, "rm"), ("k45_rm_300_768", 1, 300, 768, 2816, "rm"),
            ("k45_at_256_384", 1, 256, 384, 2816, "at"), ("k45_at_128_512", 1, 128, 512, 2304, "at"),
            ("k45_at_197_300", 1, 197, 300, 2816, "at"), ("k45_at_65_256", 1, 65, 256, 2048, "at"),
            ("k45_at_197_1000", 1, 197, 1000, 2048, "at"),
            # (run 45) decode-sized grad_x (g @ W, 24-65 tokens) over 2048+ lines that the old A_MN lines
            # bound (ROWS64_A_MN_SPLIT_OLD_MAX_LINES, lifted in run 46) kept off the 64-row split, from each
            # family the planner gave them
            ("l45_48_3072_2816", 1, 48, 3072, 2816, "rm"), ("l45_48_2816_8192", 1, 48, 2816, 8192, "rm"),
            ("l45_48_2048_8192", 1, 48, 2048, 8192, "rm"), ("l45_24_4096_8192", 1, 24, 4096, 8192, "rm"),
            ("l45_32_2048_11008", 1, 32, 2048, 11008, "rm"), ("l45_65_2048_4096", 1, 65, 2048, 4096, "rm"),
            ("l45_48_3584_14336", 1, 48, 3584, 14336, "rm"),
            # (run 46) the other kinds of move lifting that bound made over the grid (1522 plans): from the
            # 128-row tile's split, to 128-wide 64-row splits, A staged (g.t() @ x: "at"), C^T given ("ct")
            ("l46_rm_2048_128_11008", 1, 2048, 128, 11008, "rm"), ("l46_rm_128_2048_3072", 1, 128, 2048, 3072, "rm"),
            ("l46_rm_64_2304_3584", 1, 64, 2304, 3584, "rm"), ("l46_at_64_2304_4096", 1, 64, 2304, 4096, "at"),
            ("l46_at_48_3584_3584", 1, 48, 3584, 3584, "at"), ("l46_at_24_2816_11008", 1, 24, 2816, 11008, "at"),
            ("l46_ct_3584_16_14336", 1, 3584, 16, 14336, "ct"), ("l46_ct_2304_24_2048", 1, 2304, 24, 2048, "ct"),
            ("l46_ct_128_2048_8192", 1, 128, 2048, 8192, "ct"),
            # (run 46) tf32x3 requests (--precision tf32x3 --families simt_cp_async) whose wgmma plan copies both
            # operands' halves at 20-24 FLOP per copied byte (WGMMA_COPY_MIN_FLOP_PER_BYTE: 20): attn_pv_2k ran it
            # at 0.836x torch fp32 on an H100 where the fp32 SIMT plan ran 1.063x; a bound of 24 would move 1250
            # grid plans to SIMT, these among them ("brm": a batch of A @ B, B row-major). Since run 47 the bound
            # scales with the DRAM bandwidth (copy_min_flop_per_byte: 29.3 on an H100), and these run SIMT there
            ("x46_pv_2k", 32, 2048, 128, 2048, "brm"), ("x46_dq_2k", 32, 2048, 128, 2048, "bt"),
            ("x46_wt_128_14336", 1, 128, 14336, 3072, "wt"), ("x46_mn_16384_128", 1, 16384, 128, 3072, "mn"),
            ("x46_rm_128_8960", 1, 128, 8960, 1024, "rm"), ("x46_rm_6000_128", 1, 6000, 128, 8192, "rm"),
            ("x46_mn_16384_128_1k", 1, 16384, 128, 1024, "mn"), ("x46_at_128_5120", 1, 128, 5120, 2048, "at"),
            ("x46_mn_11008_128", 1, 11008, 128, 512, "mn"))

#: --a-mn's variant: the planner with rows64_a_mn the other way from its default
A_MN_FLIPPED = WgmmaTf32(rows64_a_mn=not WgmmaTf32().rows64_a_mn)
A_MN_SPLIT_FLIPPED = WgmmaTf32(rows64_a_mn_split=not WgmmaTf32().rows64_a_mn_split)
A_MN_K_OLD = WgmmaTf32(rows64_a_mn_split_min_k=ROWS64_MID_SPLIT_MIN_K)
A_MN_LINES_FLIPPED = WgmmaTf32(rows64_a_mn_split_max_lines=ROWS64_A_MN_SPLIT_OLD_MAX_LINES
                               if WgmmaTf32().rows64_a_mn_split_max_lines is None else None)
#: the planner variants each --a-mn* flag adds: (label, variant, the field it flips)
FLIPS = {"a_mn": ("a_mn_flipped", A_MN_FLIPPED, "rows64_a_mn"),
         "a_mn_split": ("a_mn_split_flipped", A_MN_SPLIT_FLIPPED, "rows64_a_mn_split"),
         "a_mn_k": ("a_mn_k_old", A_MN_K_OLD, "rows64_a_mn_split_min_k"),
         "a_mn_lines": ("a_mn_lines_flipped", A_MN_LINES_FLIPPED, "rows64_a_mn_split_max_lines")}
BOUND = {"tf32": 2e-3, "tf32x3": 1e-5}  # relative error: TF32 ~3e-4 at these K, tf32x3 ~1e-7


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--rows", default="128,64")
    ap.add_argument("--widths", default="128,256")
    ap.add_argument("--splits", default="1,2,4")
    ap.add_argument("--families", default="kmajor_mma,tf32_mma")
    ap.add_argument("--precision", default="tf32", choices=("tf32", "tf32x3"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rule128", action="store_true",
                    help="also time the planner with 64-row tiles off (WgmmaTf32(rows64=False)): the mid-size rule's A/B")
    ap.add_argument("--a-mn", action="store_true",
                    help="also time the planner with rows64_a_mn flipped from its default "
                    "(A fed from registers on 64-row tiles as C^T)")
    ap.add_argument("--a-mn-split", action="store_true",
                    help="also time the planner with rows64_a_mn_split flipped from its default (A_MN's "
                    "64-row tiles split by the 64-row rule; NOTES runs 43-44)")
    ap.add_argument("--a-mn-k", action="store_true",
                    help="also time the planner with rows64_a_mn_split_min_k = ROWS64_MID_SPLIT_MIN_K (A_MN's "
                    "64-row tiles above 64 rows split from K-major A's K bound, as before NOTES run 45)")
    ap.add_argument("--a-mn-lines", action="store_true",
                    help="also time the planner with rows64_a_mn_split_max_lines the other way (the old bound of "
                    "2048 M + N lines on A_MN's 64-row split, lifted in NOTES run 46)")
    o = ap.parse_args()
    if not need_gpu("wgmma_rows_probe.py"):
        return 2
    torch.manual_seed(0)
    prec = o.precision
    torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
    only = set(filter(None, o.only.split(",")))
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    variants = {f"r{rows}/{bn}/{s}": WgmmaTf32(rows64="always" if rows == 64 else False, force_bn=bn,
                                               split=s if s > 1 else False)
                for rows in ints(o.rows) for bn in ints(o.widths) for s in ints(o.splits)}
    families = [f for f in o.families.split(",") if f]
    products = [x for x in PRODUCTS if not only or x[0] in only]
    dev = device_facts(0)

    def operands(batch, M, N, K, layout):
        if layout == "wt":
            return torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda").t()
        if layout == "rm":
            return torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda")
        if layout == "at":
            return torch.randn(K, M, device="cuda").t(), torch.randn(K, N, device="cuda")
        if layout in ("mn", "ct"):
            return torch.randn(K, M, device="cuda").t(), torch.randn(N, K, device="cuda").t()
        if layout == "brm":
            return torch.randn(batch, M, K, device="cuda"), torch.randn(batch, K, N, device="cuda")
        return torch.randn(batch, M, K, device="cuda"), torch.randn(batch, N, K, device="cuda").transpose(1, 2)

    def output(a, N, layout):
        if layout == "ct":
            return torch.empty(N, a.shape[-2], device="cuda").t()
        return torch.empty(*a.shape[:-1], N, device="cuda")

    # every kernel compiled first, on all cores
    plans = []
    for name, batch, M, N, K, layout in products:
        a, b = operands(batch, M, N, K, layout)
        out = output(a, N, layout)
        sh = analyse(a, b).materialized(a)
        p, _ = build_problem(sh, sh.matrix_view(out), prec)
        plans.append(select(p, dev))
        if o.rule128:
            plans.append(select(p, dev, variants=(WgmmaTf32(rows64=False),)))
        for flag, (_, variant, _) in FLIPS.items():
            if getattr(o, flag):
                plans.append(select(p, dev, variants=(variant,)))
        for kw in [{"force": "wgmma_tf32", "variants": (v,)} for v in variants.values()] + [{"force": f} for f in families]:
            try:
                plans.append(select(p, dev, **kw))
            except Exception:  # noqa: BLE001  (a forced variant the family declines)
                pass
    if plans:  # (all of them)
        print(f"compiled {compile_plans(plans, 'sm_90')} kernels", flush=True)

    print(f"{prec}: GPU us per call; forced columns are rows/width/slices")
    for name, batch, M, N, K, layout in products:
        a, b = operands(batch, M, N, K, layout)
        out = output(a, N, layout)
        runs, descs = {}, {}

        def add(label, **kw):
            c = torch.full_like(out, float("nan"))
            try:
                _, plan, reason = dispatch.matmul_fastmm(a, b, c, prec, **kw)
            except ValueError:  # (a forced family that cannot run the product)
                return
            if reason is not None or plan is None or plan.kernel is None:
                return
            if "force" in kw and plan.kernel.family != kw["force"]:
                return
            err = rel_err(c, a, b)
            if not err < BOUND[prec]:
                raise SystemExit(f"{name} {label}: error {err:.2e} against float64 ({plan.describe()})")
            k = plan.kernel
            descs[label] = f"{k.family[:6]} {k.tile[0]}x{k.tile[1]}x{k.tile[2]}" + (f"/{k.split_k}" if k.split_k > 1 else "")
            runs[label] = lambda: dispatch.matmul_fastmm(a, b, out, prec, **kw)

        add("planner")
        if o.rule128:  # the planner without 64-row tiles: its plan before the mid-size rule, for M > 64
            add("rule128", variants=(WgmmaTf32(rows64=False),))
        for flag, (label, variant, _) in FLIPS.items():  # the planner with one field flipped
            if getattr(o, flag):
                add(label, variants=(variant,))
        for label, v in variants.items():
            add(label, force="wgmma_tf32", variants=(v,))
        for f in families:
            add(f, force=f)
        runs["torch"] = lambda: torch.matmul(a, b, out=out)
        rounds = {label: [] for label in runs}
        for _ in range(o.rounds):
            for label, fn in runs.items():
                rounds[label].append(time_us(fn))
        t = {label: statistics.median(r) for label, r in rounds.items()}
        forced = [lab for lab in t if lab not in ("planner", "torch", "rule128") + tuple(x[0] for x in FLIPS.values())]
        if forced:
            best = min(forced, key=t.get)
            w_bytes = 4.0 * N * K * (batch if layout in ("bt", "brm") else 1)  # B's bytes (TB/s = bytes / us / 1e6)
            print(f"\n{name} {batch}x{M}x{N}x{K} {layout}: planner {descs.get('planner')} "
                  f"{t.get('planner', float('nan')):.1f} us, "
                  f"torch {t['torch']:.1f}, best {best} {t[best]:.1f} ({w_bytes / t[best] / 1e6:.2f} TB/s of B; "
                  f"torch {w_bytes / t['torch'] / 1e6:.2f})")
            print("  " + "  ".join(f"{lab} {t[lab]:.1f}" for lab in forced), flush=True)
        if "rule128" in t:
            print(f"  A/B {name}: planner {t['planner']:.1f} us ({descs['planner']}) against {t['rule128']:.1f} "
                  "without "
                  f"64-row tiles ({descs['rule128']}): {t['rule128'] / t['planner']:.2f}x; torch {t['torch']:.1f}")
        for label, variant, field in FLIPS.values():
            if label in t:
                print(f"  A/B {name}: planner {t['planner']:.1f} us ({descs['planner']}) against {t[label]:.1f} "
                      f"with {field}={getattr(variant, field)} ({descs[label]}): "
                      f"{t[label] / t['planner']:.2f}x the planner's speed; torch {t['torch']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
