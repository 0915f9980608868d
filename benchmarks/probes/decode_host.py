#!/usr/bin/env python3
"""Where greedy decoding's time goes, torch against ``fastmm.patch``: decode (batch 1, KV cache)
is paced by the host, so this times ms per token of each side, interleaved, and profiles the
patched model's generate call with cProfile (own time per token by file, and the top functions).

    PYTHONPATH=. python benchmarks/probes/decode_host.py [--models llama,gpt2] [--precision ieee]
        [--new-tokens 32] [--rounds 5] [--top 30]

Sides: ``torch`` (the model as built), ``fastmm`` (``fastmm.patch``, the default functional
routing: a grouped-query model's SDPA runs :func:`fastmm.attention.math_attention`) and
``modules`` (``fastmm.patch(functional=False)``: converted modules only, attention and the
rotary embedding's product on torch). Models come from ``benchmarks/models.py``'s ``build``
(hidden 1024, 4 layers, vocabulary 32000).
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE), str(HERE.parent)]

import torch  # noqa: E402

import fastmm  # noqa: E402
from fastmm.precision import torch_precision  # noqa: E402
from probe_util import enqueue_us, need_gpu, own_time_by_group  # noqa: E402


def per_token_ms(models: dict, prompt, new_tokens: int, rounds: int) -> dict:
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
    times = {name: [] for name in models}
    tokens = {}
    with torch.no_grad():
        for name, m in models.items():
            tokens[name] = m.generate(prompt, **kw)
        names = list(models)
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                models[name].generate(prompt, **kw)
                torch.cuda.synchronize()
                times[name].append(1e3 * (time.perf_counter() - t0) / new_tokens)
    same = {name: bool(torch.equal(tokens[name], tokens[names[0]])) for name in names}
    return {name: (statistics.median(t), same[name]) for name, t in times.items()}


def profile(model, prompt, new_tokens: int, top: int) -> None:
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
    prof = cProfile.Profile()
    with torch.no_grad():
        torch.cuda.synchronize()
        prof.enable()
        model.generate(prompt, **kw)
        prof.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    by_file = own_time_by_group(stats)
    print(f"  own time per token, us (cProfile's, inflated by it), {new_tokens} tokens:")
    for k, v in by_file.most_common(24):
        print(f"    {1e6 * v / new_tokens:8.1f}  {k}")
    stats.sort_stats("tottime").print_stats(top)


def attention_pieces(precision: str) -> None:
    """Host us a call of one decode step's attention (16 query heads, 4 key / value heads, head
    dim 64, 40 cached positions, [B, L, H, E] transposed as Hugging Face hands them over): torch's
    SDPA (its math path: grouped-query float32), fastmm's check that torch would take the math
    path, fastmm's math path, and the routed call under a FastmmMode."""
    import torch.nn.functional as F

    from fastmm import patching
    from fastmm.attention import math_attention, takes_math_path

    q = torch.randn(1, 1, 16, 64, device="cuda").transpose(1, 2)
    k, v = (torch.randn(1, 40, 4, 64, device="cuda").transpose(1, 2) for _ in range(2))
    mode = patching.FastmmMode(precision, ("cuda",))

    def routed():
        with mode:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    rows = [("torch SDPA (math path)", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
            ("takes_math_path", lambda: takes_math_path(q, k, v, None, 0.0, False, True)),
            ("math_attention", lambda: math_attention(q, k, v, enable_gqa=True, precision=precision)),
            ("routed SDPA (mode entered and left)", routed),
            ("an empty FastmmMode entered and left", lambda: (mode.__enter__(), mode.__exit__(None, None, None))),
            ("q.transpose(1, 2) (no mode)", lambda: q.transpose(1, 2))]
    with torch.no_grad():
        for what, fn in rows:
            print(f"  {what:<40} {enqueue_us(fn, 60):8.2f} us")  # (60 calls: ~600 launches, under the queue's ~1000)
        mode.__enter__()
        try:
            print(f"  {'q.transpose(1, 2) under the mode':<40} {enqueue_us(lambda: q.transpose(1, 2), 60):8.2f} us")
        finally:
            mode.__exit__(None, None, None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="decode_host.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama,gpt2")
    ap.add_argument("--precision", default="ieee")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--no-profile", action="store_true")
    opts = ap.parse_args(argv)
    if not need_gpu("decode_host.py"):
        return 2
    from models import build

    print(f"decode attention's pieces, {opts.precision}, host us a call:")
    attention_pieces(opts.precision)

    for name in opts.models.split(","):
        model, batch, _, decoder = build(name, tokens=1024)
        if not decoder:
            print(f"{name}: not a decoder, skipped")
            continue
        model = model.cuda().eval()
        sides = {"torch": model,
                 "fastmm": fastmm.patch(copy.deepcopy(model), precision=opts.precision),
                 "modules": fastmm.patch(copy.deepcopy(model), precision=opts.precision, functional=False)}
        prompt = batch["input_ids"][:1, :32].cuda()
        with torch_precision(opts.precision):
            res = per_token_ms(sides, prompt, opts.new_tokens, opts.rounds)
            base = res["torch"][0]
            print(f"{name} {opts.precision}: ms a token (torch / side = ratio; same tokens as torch)")
            for side, (ms, same) in res.items():
                print(f"  {side:<8} {ms:7.3f} ms  {base / ms:6.3f}  {same}")
            if not opts.no_profile:
                print(f"{name} fastmm:")
                profile(sides["fastmm"], prompt, opts.new_tokens, opts.top)
                print(f"{name} torch:")
                profile(sides["torch"], prompt, opts.new_tokens, 12)
    return 0


if __name__ == "__main__":
    sys.exit(main())
