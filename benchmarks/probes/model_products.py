#!/usr/bin/env python3
"""Which of a model's products make fastmm's training step slower or faster than torch's: every
float32 product of one forward + backward of the *unpatched* model, as torch ran it (operator,
shapes, strides), grouped, then each group timed alone, torch's own call against fastmm's
equivalent on operands with the same layout.

    PYTHONPATH=. python benchmarks/probes/model_products.py [--models bert,gpt2,vit]
        [--precisions tf32] [--tokens 8192] [--top 30]

Per model and precision, a table sorted by what the group costs fastmm over torch in one step
(calls x the difference of GPU us per call; L2 not flushed, back-to-back calls behind a sleep
kernel, so host time does not count): the operator and its layout, calls a step, torch and
fastmm us per call, the kernel fastmm's plan names. The last lines: the products' GPU time a step
on each side, and the difference, next to the step's own times (from ``model_step.py`` or
``models.py``) that is the part of a step's gap the products explain. Products inside
``F.scaled_dot_product_attention`` (the attention core, left to torch) are not counted.
Models come from ``benchmarks/models.py`` (needs ``transformers``).

``--decode`` (the decoders: llama, gpt2): the products of one greedy decode step instead (batch 1,
one new token after a 32-token prompt, KV cache, no grad), each group with its host time per call
as well (enqueue time, the GPU kept busy ahead): a decode step is paced by whichever of the two is
longer, call after call.
"""
from __future__ import annotations

import argparse
import collections
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE), str(HERE.parent)]  # the repo, this folder, benchmarks/

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import fastmm  # noqa: E402
from fastmm.precision import torch_precision  # noqa: E402
from probe_util import enqueue_us, need_gpu, time_us  # noqa: E402

_PRODUCTS = {"mm", "addmm", "bmm", "baddbmm"}


class _Products(TorchDispatchMode):
    """Notes each float32 aten product outside SDPA: (op, shapes, strides, scalars)."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()
        self.in_sdpa = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._opname
        if func.namespace == "aten" and name in _PRODUCTS and not self.in_sdpa:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if tensors and all(t.dtype == torch.float32 for t in tensors):
                sig = (name, tuple((tuple(t.shape), tuple(t.stride())) for t in tensors),
                       (kwargs.get("beta", 1), kwargs.get("alpha", 1)))
                self.calls[sig] += 1
        return func(*args, **kwargs)


class _Sdpa(TorchFunctionMode):
    def __init__(self, rec: _Products):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        self.rec.in_sdpa += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.rec.in_sdpa -= 1


def _operand(shape, stride) -> torch.Tensor:
    """A tensor of this shape and stride (a transposed view, a broadcast stride of 0 ...) over
    fresh random memory (never zeros)."""
    span = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 1
    return torch.randn(span, device="cuda").as_strided(shape, stride)


def _layout(name, operands) -> str:
    """x @ W^T, rowmajor_b, A^T ... in bench.py's words, from the last two dims' strides."""
    a, b = operands[-2], operands[-1]
    a_t = a.stride(-2) == 1 and a.shape[-2] > 1
    b_t = b.stride(-2) == 1 and b.shape[-2] > 1
    bias = " +bias" if name in ("addmm", "baddbmm") and operands[0].dim() < 2 else ""
    form = {(False, True): "x@W^T", (False, False): "row-major", (True, False): "A^T", (True, True): "A^T@B^T"}[(a_t, b_t)]
    return form + bias


def _time_group(sig, precision: str, host: bool = False):
    name, metas, (beta, alpha) = sig
    ops = [_operand(s, st) for s, st in metas]
    aten = getattr(torch.ops.aten, name)
    if name in ("mm", "bmm"):
        torch_fn = lambda: aten(*ops)  # noqa: E731
        fastmm_fn = lambda: fastmm.matmul(ops[0], ops[1], precision=precision)  # noqa: E731
        explained = fastmm.explain(ops[0], ops[1], precision=precision)
    elif name == "addmm":
        torch_fn = lambda: aten(*ops, beta=beta, alpha=alpha)  # noqa: E731
        fastmm_fn = lambda: fastmm.addmm(*ops, beta=beta, alpha=alpha, precision=precision)  # noqa: E731
        explained = fastmm.explain(ops[1], ops[2], precision=precision)
    else:  # baddbmm: fastmm has no such call of its own; the patched model's route is matmul + add
        torch_fn = lambda: aten(*ops, beta=beta, alpha=alpha)  # noqa: E731
        fastmm_fn = lambda: torch.add(ops[0] * beta, fastmm.matmul(ops[1], ops[2], precision=precision), alpha=alpha)  # noqa: E731
        explained = fastmm.explain(ops[1], ops[2], precision=precision)
    with torch_precision(precision):
        t_us = time_us(torch_fn, inner=5, samples=11)
    f_us = time_us(fastmm_fn, inner=5, samples=11)
    kernel = explained.kernel or f"torch ({explained.fallback})"
    shapes = " ".join("x".join(map(str, s)) for s, _ in metas)
    if host:  # (no grad, as in decoding; 200 calls of a decode-sized product stay far inside the sleep)
        with torch.no_grad():
            with torch_precision(precision):
                t_host = enqueue_us(torch_fn, 200)
            f_host = enqueue_us(fastmm_fn, 200)
        return name, shapes, _layout(name, ops), t_us, f_us, kernel, t_host, f_host
    return name, shapes, _layout(name, ops), t_us, f_us, kernel


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="model_products.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="bert,gpt2,vit")
    ap.add_argument("--precisions", default="tf32")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--decode", action="store_true", help="one greedy decode step's products (llama, gpt2), host time too")
    o = ap.parse_args(argv)
    if not need_gpu(ap.prog):
        return 2
    warnings.filterwarnings("ignore")
    import models

    if o.decode:
        return _decode(o, models)
    for model_name in o.models.split(","):
        model, batch, loss_fn, _ = models.build(model_name, tokens=o.tokens)
        model = model.cuda().train()
        batch = {k: v.cuda() for k, v in batch.items()}
        rec = _Products()
        with rec, _Sdpa(rec):
            loss_fn(model(**batch)).backward()
        model.zero_grad(set_to_none=True)
        for precision in o.precisions.split(","):
            rows = []
            for sig, n in rec.calls.items():
                rows.append((n,) + _time_group(sig, precision))
            rows.sort(key=lambda r: -(r[0] * (r[5] - r[4])))
            t_all = sum(r[0] * r[4] for r in rows)
            f_all = sum(r[0] * r[5] for r in rows)
            print(f"\n{model_name} {precision}, {o.tokens} tokens: {sum(r[0] for r in rows)} products in "
                  f"{len(rows)} groups; GPU ms a step: torch {t_all / 1e3:.3f}, fastmm {f_all / 1e3:.3f} "
                  f"(fastmm - torch {(f_all - t_all) / 1e3:+.3f} ms)")
            print(f"  {'calls':>5} {'op':7} {'shapes':34} {'layout':16} {'torch us':>9} {'fastmm us':>9} "
                  f"{'ratio':>6} {'+ms/step':>8}  kernel")
            for n, name, shapes, layout, t_us, f_us, kernel in rows[:o.top]:
                print(f"  {n:5d} {name:7} {shapes:34} {layout:16} {t_us:9.1f} {f_us:9.1f} {t_us / f_us:6.2f} "
                      f"{n * (f_us - t_us) / 1e3:+8.3f}  {kernel}")
        del model
        torch.cuda.empty_cache()
    return 0


def _decode(o, models) -> int:
    """--decode: the products of one decode step (after a 32-token prompt), GPU and host time."""
    for model_name in o.models.split(","):
        model, batch, _, decoder = models.build(model_name)
        if not decoder:
            print(f"{model_name}: not a decoder, skipped")
            continue
        model = model.cuda().eval()
        prompt = batch["input_ids"][:1, :32].cuda()
        rec = _Products()
        with torch.no_grad():
            out = model(input_ids=prompt, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            with rec, _Sdpa(rec):
                model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
        for precision in o.precisions.split(","):
            rows = [(n,) + _time_group(sig, precision, host=True) for sig, n in rec.calls.items()]
            rows.sort(key=lambda r: -(r[0] * (max(r[5], r[8]) - max(r[4], r[7]))))
            paced = [sum(r[0] * max(r[i], r[j]) for r in rows) for i, j in ((4, 7), (5, 8))]
            print(f"\n{model_name} {precision}, one decode step: {sum(r[0] for r in rows)} products in {len(rows)} groups; "
                  f"us a step, each call paced by the longer of GPU and host time: torch {paced[0]:.0f}, "
                  f"fastmm {paced[1]:.0f}")
            print(f"  {'calls':>5} {'op':7} {'shapes':34} {'layout':16} {'GPU torch':>9} {'fastmm':>7} "
                  f"{'host torch':>10} {'fastmm':>7}  kernel")
            for n, name, shapes, layout, t_us, f_us, kernel, t_host, f_host in rows[:o.top]:
                print(f"  {n:5d} {name:7} {shapes:34} {layout:16} {t_us:9.1f} {f_us:7.1f} {t_host:10.1f} {f_host:7.1f}  {kernel}")
        del model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
