#!/usr/bin/env python3
"""tf32x3 on 128-row wgmma tiles with A split into its TF32 halves in registers (X3_A_REGS,
``WgmmaTf32(x3_a_regs=True)``) against the planner's plan that stages both operands' halves, and
torch in fp32, on the training products of the models (forward x @ W^T, grad_x = g @ W, grad_W =
g^T x), the suite's tf32x3 rows, attention's batched products with a side of the head size, and
a sample of the plans the planner's rule (X3_A_REGS_MAX_N and beside it) moved.

    python benchmarks/probes/x3_a_regs_probe.py [--only NAME,...] [--rounds 3] [--widths 128,96] [--stages 4]

Per product: GPU us per call (probe_util.time_us, median of ``--rounds`` alternating rounds) of
the staged plan, of the A-in-registers plan (the planner's width, then each of ``--widths``
forced; ``--stages N``: also the planner's width with N ring slots where they fit, a slot being
smaller without A's small half), of the planner's own plan, of the fp32 SIMT plan (forced), of
C^T = B^T A^T on 64-row tiles with the big operand split by the kernel (X3_SPLIT_B; products of
at most 128 columns), and of torch.matmul in fp32; every fastmm result checked against float64 at fp32 level
and against each other bit for bit (the same halves summed in the same order: the probe stops on
a difference). Written before the first run (NOTES run 41): the staging pass reads A and writes
its two halves (12 bytes an element) and the kernel reads both back (8), where in registers it
reads A once (4); at 8192 x 1024 x 1024 that is ~100 MB less traffic, ~30 us of a ~175 us product,
if the fragment loads and splits (16 loads, 16 splits a k-step a thread) hide under the other
warpgroup's wgmmas.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.families import WgmmaTf32  # noqa: E402
from fastmm.plan import select  # noqa: E402
from fastmm.runtime import launcher  # noqa: E402
from fastmm.runtime.device import device_facts  # noqa: E402
from fastmm.shapes import analyse, build_problem  # noqa: E402
from probe_util import compile_plans, need_gpu, rel_err, time_us  # noqa: E402

#: (name, M, N, K, layout): "wt" = x @ W.t() (W stored [N, K]), "rm" = g @ W (W row-major [K, N]),
#: "at" = g^T x (A m-contiguous: copied K-major in fp32, split by the kernel)
PRODUCTS = (("llama8k_qo", 8192, 4096, 4096, "wt"), ("llama8k_up", 8192, 11008, 4096, "wt"),
            ("llama8k_down", 8192, 4096, 11008, "wt"), ("llama8k_down_gx", 8192, 11008, 4096, "rm"),
            ("llama8k_gw_up", 11008, 4096, 8192, "at"), ("tiny8k_qo", 8192, 1024, 1024, "wt"),
            ("tiny8k_up", 8192, 2816, 1024, "wt"), ("tiny8k_down_gx", 8192, 2816, 1024, "rm"),
            ("tiny8k_gw", 1024, 1024, 8192, "at"), ("tok1k_up", 1024, 2816, 1024, "wt"),
            ("bert8k_qkv", 8192, 3072, 1024, "wt"), ("gpt2_lm_head", 4096, 50257, 768, "wt"),
            ("prefill2k_qo", 2048, 4096, 4096, "wt"), ("square4k", 4096, 4096, 4096, "wt"),
            # attention's products with a side of the head size, batched over (sequences x heads):
            # P @ V and dS @ K ("rm": the big operand K-major), P^T @ dO ("at": m-contiguous)
            ("attn_pv_64", 1024, 64, 1024, "rm", 128), ("attn_pv_128", 2048, 128, 2048, "rm", 32),
            ("attn_ptg_64", 1024, 64, 1024, "at", 128), ("attn_pv_512", 512, 64, 512, "rm", 128),
            ("attn_small", 128, 128, 64, "wt", 1024),
            # narrow projections (grouped-query k/v: 4 heads of 64) and the widths between the
            # attention products and run 42's (N >= 1024), for where A in registers stops paying
            ("kv8k_256", 8192, 256, 1024, "wt"), ("n384_8k", 8192, 384, 1024, "wt"),
            ("n512_8k", 8192, 512, 1024, "wt"), ("n768_4k", 4096, 768, 4096, "wt"),
            ("n256_2k", 2048, 256, 4096, "wt"),
            # a sample of the grid's plans that the rule moved (NOTES run 48): from the fp32 SIMT
            # plan (the copy bound) and from the staged plan
            ("g8k_64_2048", 8192, 64, 2048, "wt"), ("g16k_128_4096", 16384, 128, 4096, "rm"),
            ("g4k_197_1024", 4096, 197, 1024, "wt"), ("g11k_96_512", 11008, 96, 512, "rm"))


def with_stages(a, b, c, variant: WgmmaTf32, stages: int):
    """run() of the tf32x3 plan of a @ b -> c under ``variant`` with its ring at ``stages`` slots
    (queued as fastmm queues a prepared plan), or None where they do not fit."""
    s = analyse(a, b)
    problem, offsets = build_problem(s, c, "tf32x3")
    index = torch.cuda.current_device()
    plan = dispatch.plan_for(problem, index, "wgmma_tf32", (variant,))
    m = dict(plan.kernel.macros)
    boxes = m.get("C_BOXES", 0) if m.get("TMA_STORE") else 0
    smem = variant.smem_bytes(plan.kernel.tile[1], stages, True, boxes, plan.kernel.tile[0], bool(m.get("X3_A_REGS")))
    if smem > plan.device.smem_per_block_optin:
        return None
    m["STAGES"] = stages
    kernel = dataclasses.replace(plan.kernel, macros=tuple(m.items()), smem=smem)
    hit = dispatch.Prepared(dataclasses.replace(plan, kernel=kernel), launcher.load(plan.device, kernel), None)
    return lambda: dispatch.launch_plan(hit, s, c, problem, offsets, index)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--widths", default="128,96")
    ap.add_argument("--stages", type=int, default=0, help="also the A-in-registers plan with this many ring slots")
    o = ap.parse_args()
    if not need_gpu("x3_a_regs_probe.py"):
        return 2
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    only = set(filter(None, o.only.split(",")))
    products = [x for x in PRODUCTS if not only or x[0] in only]
    variants = {"staged": WgmmaTf32(x3_a_regs=False), "a_regs": WgmmaTf32(x3_a_regs=True)}
    variants.update({f"a_regs/{bn}": WgmmaTf32(x3_a_regs=True, force_bn=bn) for bn in map(int, o.widths.split(","))})
    dev = device_facts(0)

    def operands(M, N, K, layout, batch=()):
        if layout == "wt":
            return torch.randn(*batch, M, K, device="cuda"), torch.randn(*batch, N, K, device="cuda").mT
        if layout == "rm":
            return torch.randn(*batch, M, K, device="cuda"), torch.randn(*batch, K, N, device="cuda")
        return torch.randn(*batch, K, M, device="cuda").mT, torch.randn(*batch, K, N, device="cuda")

    plans = []
    for name, M, N, K, layout, *batch in products:
        a, b = operands(M, N, K, layout, batch)
        sh = analyse(a, b).materialized(a)
        p, _ = build_problem(sh, sh.matrix_view(torch.empty(*batch, M, N, device="cuda")), "tf32x3")
        plans += [select(p, dev, force="wgmma_tf32", variants=(v,)) for v in variants.values()]
        plans.append(select(p, dev))  # (the planner's own plan)
        del a, b
    print(f"compiled {compile_plans(plans, 'sm_90')} kernels", flush=True)

    print("tf32x3: GPU us per call (staged: both operands' halves staged; a_regs: A split in registers)")
    for name, M, N, K, layout, *batch in products:
        a, b = operands(M, N, K, layout, batch)
        outs, runs, descs = {}, {}, {}

        def checked(label, call):
            """``call(c)`` (a fastmm call writing C, or C^T of it) into a NaN-filled C, checked
            against float64; remembered under ``label`` for timing. Returns (C, plan)."""
            c = torch.full((*batch, M, N), float("nan"), device="cuda")
            _, plan, reason = call(c)
            assert reason is None, reason
            err = rel_err(c, a, b)
            if not err < 1e-5:
                raise SystemExit(f"{name} {label}: error {err:.2e} against float64 ({plan.describe()})")
            outs[label], runs[label] = c, (lambda: call(c))
            return c, plan

        def fastmm_call(x, y, swapped=False, **how):
            return lambda c: dispatch.matmul_fastmm(x, y, c.mT if swapped else c, "tf32x3", **how)

        for label, v in variants.items():
            _, plan = checked(label, fastmm_call(a, b, force="wgmma_tf32", variants=(v,)))
            k = plan.kernel
            assert k.family == "wgmma_tf32"
            descs[label] = f"{k.tile[0]}x{k.tile[1]}" + (" regs" if dict(k.macros).get("X3_A_REGS") else "")
        for label in variants:
            if label != "staged" and descs[label].split()[0] == descs["staged"].split()[0]:
                if not torch.equal(outs[label], outs["staged"]):
                    raise SystemExit(f"{name} {label}: other bits than the staged plan at the same tile")
        descs["planner"] = checked("planner", fastmm_call(a, b))[1].kernel.family
        plan = checked("simt", fastmm_call(a, b, force="simt_cp_async"))[1]
        descs["simt"] = "x".join(map(str, plan.kernel.tile[:2]))
        if o.stages:
            c = torch.full((*batch, M, N), float("nan"), device="cuda")
            run = with_stages(a, b, c, variants["a_regs"], o.stages)
            if run is not None:
                run()
                label = f"a_regs/{o.stages}st"
                if not torch.equal(c, outs["a_regs"]):
                    raise SystemExit(f"{name} {label}: other bits than with the planner's slots")
                runs[label], descs[label] = run, descs["a_regs"] + f" {o.stages} slots"
        if layout in ("rm", "at") and N <= 128:
            # C^T = B^T A^T on 64-row tiles: the head-size side as the rows, the big operand as B
            # split by the kernel (X3_SPLIT_B; read in place where it is K-major: "rm")
            plan = checked("swap64", fastmm_call(b.mT, a.mT, swapped=True, force="wgmma_tf32",
                                                 variants=(WgmmaTf32(rows64="always"),)))[1]
            descs["swap64"] = f"{plan.kernel.tile[0]}x{plan.kernel.tile[1]} C^T"
        ref = torch.empty(*batch, M, N, device="cuda")
        runs["torch fp32"] = lambda a=a, b=b: torch.matmul(a, b, out=ref)
        rounds = {label: [] for label in runs}
        for _ in range(o.rounds):
            for label, fn in runs.items():
                rounds[label].append(time_us(fn))
        t = {label: statistics.median(r) for label, r in rounds.items()}
        tflops = 2.0 * M * N * K * (batch[0] if batch else 1) / 1e6
        print(f"\n{name} {'x'.join(map(str, batch + [M, N, K]))} {layout}: torch fp32 {t['torch fp32']:.1f} us")
        for label in (lab for lab in runs if lab != "torch fp32"):
            print(f"  {label:<12} {descs[label]:<14} {t[label]:9.1f} us {tflops / t[label]:7.1f} TFLOP/s "
                  f"{t['staged'] / t[label]:5.2f}x staged, {t['torch fp32'] / t[label]:5.2f}x torch", flush=True)
        outs.clear()  # (the outputs and the calls holding them: freed before the next product's operands)
        runs.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
