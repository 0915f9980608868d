#!/usr/bin/env python3
"""TF32 wgmma: every tile width against the rule of run 18, on the products models run.

    python benchmarks/probes/wgmma_waves_probe.py [--precisions tf32,tf32x3] [--only NAME,...]

For each product and precision: GPU us per call (probe_util.time_us) of
- "fill": run 18's plan, one block a tile, C stored from registers
  (``WgmmaTf32(tile_rule="fill", persistent=False, tma_store=False)``);
- "fill+p": the same tile, persistent (one block an SM walking the tiles) whatever the size;
- "direct": the planner's width and schedule with C stored from registers (no TMA store);
- "c2", "c4": the same with 2 or 4 boxes of C staged at once (the ring loses slots to fit 4);
- each tile width BN, persistent where the planner's rule says so, C through the copy engine
  (``WgmmaTf32(force_bn=BN)``);
- with ``--pingpong``: each width with the consumers taking turns ("pp"), and at 128, 160 and 192
  wide taking turns with C through the copy engine ("ppt", a staging region each consumer);
- the planner's plan (which width ``wave_cost`` picks), and torch (TF32 allowed for tf32;
  full fp32 for tf32x3);
then the planner's choice against the best width and against "fill". Every output is checked
against float64 (relative Frobenius error) and every width's bits against the planner's: each
output sums its k-steps in the same order whatever the tile, so they must be equal.
The kernels are compiled first, on every core (into fastmm's disk cache).
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
from fastmm.families.wgmma_tf32 import wave_cost  # noqa: E402
from fastmm.plan import select  # noqa: E402
from fastmm.problem import Problem  # noqa: E402
from probe_util import compile_plans, need_gpu, rel_err, time_us  # noqa: E402

#: (name, batch, M, N, K, B layout): "wt" = x @ W.t() (B K-contiguous), "rm" = row-major B
PRODUCTS = (
    ("gpt2_qkv", 0, 4096, 2304, 768, "wt"), ("gpt2_mlp_down", 0, 4096, 768, 3072, "rm"),
    ("vit_mlp_up", 0, 4728, 3072, 768, "wt"), ("bert_qkv", 0, 4096, 3072, 1024, "wt"),
    ("bert_ff_down", 0, 4096, 1024, 4096, "wt"), ("step8k_up", 0, 8192, 2816, 1024, "wt"),
    ("step8k_qkv768", 0, 8192, 2304, 768, "wt"), ("step1k_up", 0, 1024, 2816, 1024, "wt"),
    ("step1k_q", 0, 1024, 1024, 1024, "wt"), ("step1k_down", 0, 1024, 1024, 2816, "wt"),
    ("llama_qo", 0, 2048, 4096, 4096, "wt"), ("llama_kv", 0, 2048, 1024, 4096, "wt"),
    ("llama_up", 0, 2048, 14336, 4096, "wt"), ("gpt2_lm_head", 0, 4096, 50257, 768, "wt"),
    ("qwen2_up_1000", 0, 1000, 18944, 3584, "wt"), ("mistral_qo_333", 0, 333, 4096, 4096, "wt"),
    ("phi3_qkv_77", 0, 77, 9216, 3072, "wt"), ("grad_x_8k", 0, 8192, 1024, 2816, "rm"),
    ("vitl_mlp_3152", 0, 3152, 4096, 1024, "wt"), ("square4k", 0, 4096, 4096, 4096, "rm"),
    ("attn_qkT_512", 128, 512, 512, 64, "wt"), ("attn_pv_512", 128, 512, 64, 512, "rm"),
    ("attn_qkT_2k", 32, 2048, 2048, 128, "wt"), ("attn_pv_2k", 32, 2048, 128, 2048, "rm"),
    ("attn_small", 1024, 128, 128, 64, "wt"),
    ("decode64_up", 0, 64, 14336, 4096, "wt"), ("decode96", 0, 96, 4096, 4096, "wt"),
    ("bert_base_ff_up", 0, 4096, 3072, 768, "wt"), ("prefill_512_qo", 0, 512, 4096, 4096, "wt"),
    ("t5_ff_2k", 0, 2048, 2048, 512, "wt"), ("attn128_qkT", 64, 1024, 1024, 128, "wt"),
    ("vit_attn_qkT", 768, 197, 197, 64, "wt"), ("vit_attn_pv", 768, 197, 64, 197, "rm"),
    ("step8k_q", 0, 8192, 1024, 1024, "wt"), ("step8k_ffup", 0, 8192, 4096, 1024, "wt"),
    ("step8k_head", 0, 8192, 32000, 1024, "wt"),
    # session 36: short K (64-256) with wide outputs, where C's stores weigh most
    ("smallK_8k", 0, 8192, 8192, 128, "rm"), ("attn_qkT_4k", 16, 4096, 4096, 128, "wt"),
    ("gemma_qkT_1k", 32, 1024, 1024, 256, "wt"), ("attn_qkT_1k_h64", 64, 1024, 1024, 64, "wt"),
    ("mlp_k256", 0, 8192, 4096, 256, "wt"), ("attn_qkT_2k_h96", 32, 2048, 2048, 96, "wt"),
    ("lora_up_r64", 0, 8192, 4096, 64, "rm"), ("attn_qkT_3k", 8, 3072, 3072, 128, "wt"),
    ("wt_k128_8k", 0, 8192, 8192, 128, "wt"), ("wt_k128_16k", 0, 16384, 4096, 128, "wt"),
    ("bmm_rm_k128", 32, 2048, 2048, 128, "rm"), ("attn_qkT_2k_b8", 8, 2048, 2048, 128, "wt"),
    # session 44: products whose H100 plan moved to taking turns with C through the copy engine
    # (K = 512, a 152k-word head, batched x @ W^T), written before their first run
    ("wt_k512_11k", 0, 4096, 11008, 512, "wt"), ("head_k512_8k", 0, 8192, 32000, 512, "wt"),
    ("wt_1000_14k", 0, 1000, 14336, 2048, "wt"), ("qwen05_head_512", 0, 512, 151936, 896, "wt"),
    ("bmm_wt_512_k4k", 8, 512, 2304, 4096, "wt"), ("bmm_wt_788_768", 8, 788, 768, 768, "wt"),
    ("bmm_wt_head_2k", 8, 2048, 32000, 2048, "wt"), ("wt_11k_k1024", 0, 4096, 11008, 1024, "wt"),
)


def operands(batch, M, N, K, layout):
    lead = (batch,) if batch else ()
    a = torch.randn(*lead, M, K, device="cuda")
    b = torch.randn(*lead, N, K, device="cuda").transpose(-1, -2) if layout == "wt" else torch.randn(*lead, K, N, device="cuda")
    return a, b


def variants_for(x3: bool, pingpong: bool = False):
    coop = {"pingpong": False}  # (the consumers share each tile)
    out = {"fill": WgmmaTf32(tile_rule="fill", persistent=False, tma_store=False, **coop),
           "fill+p": WgmmaTf32(tile_rule="fill", persistent="always", tma_store=False, **coop),
           "direct": WgmmaTf32(tma_store=False, **coop), "c2": WgmmaTf32(c_boxes=2, **coop),
           "c4": WgmmaTf32(c_boxes=4, **coop)}
    for bn, _ in WgmmaTf32.tile_options(x3):
        out[f"bn{bn}"] = WgmmaTf32(force_bn=bn, **coop)
    if pingpong and not x3:  # the consumers taking turns on whole tiles (PINGPONG), each width it takes
        for bn in (64, 96, 128, 192):
            out[f"pp{bn}"] = WgmmaTf32(force_bn=bn, pingpong="always")
        for bn in (128, 160, 192):  # (C through the copy engine, a staging region each consumer)
            out[f"ppt{bn}"] = WgmmaTf32(force_bn=bn, pingpong="always", pingpong_tma_store=True,
                                        extra_widths=((160, 5),) if bn == 160 else ())
    out["coop"] = WgmmaTf32(**coop)  # run 23's planner: the consumers always share tiles
    out["planner"] = WgmmaTf32()
    return out


def precompile(jobs, dev) -> None:
    """Compile the kernels of every (problem, variant) plan on all cores into the disk cache."""
    n = compile_plans([select(p, dev, variants=(v,), force="wgmma_tf32") for p, v in jobs], dev.arch)
    print(f"compiled {n} kernels", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="tf32,tf32x3")
    ap.add_argument("--only", default="")
    ap.add_argument("--pingpong", action="store_true", help="also each width with the consumers taking turns")
    o = ap.parse_args()
    if not need_gpu("wgmma_waves_probe.py"):
        return 2
    torch.manual_seed(0)
    dev = dispatch.device_facts(torch.cuda.current_device())
    rows = [r for r in PRODUCTS if not o.only or r[0] in o.only.split(",")]
    precs = o.precisions.split(",")
    jobs = []
    for prec in precs:
        for v in variants_for(prec == "tf32x3", o.pingpong).values():
            for name, batch, M, N, K, layout in rows:
                jobs.append((Problem.dense(M, N, K, prec, batch=batch or 1, b_t=layout == "wt"), v))
    precompile(jobs, dev)
    bad = 0
    for prec in precs:
        torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
        vs = variants_for(prec == "tf32x3", o.pingpong)
        names = list(vs)
        print(f"\n{prec}: GPU us per call; 'chose' is the planner's width and its us against the best width's "
              "and against run 18's plan ('fill')")
        print(f"{'product':<16} {'shape':<20} " + " ".join(f"{n:>8}" for n in names)
              + f" {'torch':>8} {'chose':>6} {'best':>6} {'pl/best':>7} {'fill/pl':>7} {'torch/pl':>8} {'err':>8} same")
        for name, batch, M, N, K, layout in rows:
            a, b = operands(batch, M, N, K, layout)
            out = torch.empty(*((batch,) if batch else ()), M, N, device="cuda")
            ref_bits, errs, same, times, plan = None, [], True, {}, None
            for vn in names:
                v = (vs[vn],)
                c = torch.full_like(out, float("nan"))
                _, pl, _ = dispatch.matmul_fastmm(a, b, c, prec, force="wgmma_tf32", variants=v)
                if vn == "planner":
                    plan = pl
                errs.append(rel_err(c, a, b))
                if ref_bits is None:
                    ref_bits = c.clone()
                else:
                    same &= torch.equal(c, ref_bits)
                times[vn] = time_us(lambda: dispatch.matmul_fastmm(a, b, out, prec, force="wgmma_tf32", variants=v))
            tt = time_us(lambda: torch.matmul(a, b, out=out))
            widths = [n for n in names if n.startswith("bn")]
            best = min(widths, key=times.get)
            chose = plan.kernel.tile[1] if plan.kernel.family == "wgmma_tf32" else plan.kernel.family
            shape = (f"{batch}x" if batch else "") + f"{M}x{N}x{K}" + (" W^T" if layout == "wt" else "")
            worst = max(errs)
            bad += (not same) or worst > (5e-3 if prec == "tf32" else 1e-5)
            print(f"{name:<16} {shape:<20} " + " ".join(f"{times[n]:8.1f}" for n in names)
                  + f" {tt:8.1f} {chose!s:>6} {best[2:]:>6} {times['planner'] / times[best]:7.3f} "
                  f"{times['fill'] / times['planner']:7.3f} {tt / times['planner']:8.3f} {worst:8.1e} {same}", flush=True)
            # what the wave model predicted for each width, to fit it
            print(f"{'':<16} {'predicted':<20} " + " ".join(
                f"{wave_cost(plan.launch_problem or plan.problem, dev, int(n[2:])):8.1f}" if n.startswith("bn") else f"{'':>8}"
                for n in names), flush=True)
    print(f"\nrows wrong or differing between widths: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
