#!/usr/bin/env python3
"""Real models on fastmm against the same models on torch, side by side in one run.

    PYTHONPATH=. python3 benchmarks/models.py [--models llama,bert,gpt2,vit,encoder]
        [--precisions ieee,tf32,tf32x3] [--steps 20] [--compile llama] [--no-generate] [--json PATH]

Models are built from configs with random weights (``transformers``, an optional extra:
``pip install "fastmm[models]"``; nothing is downloaded), plus ``nn.TransformerEncoder``. For each
model and precision it reports:

- the training step (forward, loss, backward; CUDA events, warm-up, median; the two sides' steps
  interleaved), torch vs ``fastmm.patch(model)``; with ``--compile`` both sides also under
  ``torch.compile``;
- greedy generation (batch 1, KV cache) tokens/s for the decoders, and whether the tokens match;
- the logits' and the gradients' relative error against a float64 copy of the model, for torch
  fp32 and for fastmm;
- coverage: how many of the step's float32 products ran on fastmm, on torch, and attention cores.

Precisions: torch runs ``ieee`` and ``tf32x3`` rows in full fp32 and ``tf32`` rows with TF32
allowed, as bench.py compares. Prints a table last.

``--backward-thread both`` times each side's step twice, interleaved: with the backward on the
autograd engine's device thread (torch's default, the row's step columns) and on the calling
thread (``torch.autograd.set_multithreading_enabled(False)``, a line of its own); ``caller`` runs
every step so. What the hand-off to the device thread costs a host-bound step, on both sides.

``--wgmma FIELD=VALUE,...`` runs fastmm's side with the wgmma family built with those fields
(``fastmm.families.WgmmaTf32``), e.g. ``--wgmma x3_a_regs=True``: tf32x3 splitting A in registers
wherever the kernel allows it, not only where the planner's rule takes it (NOTES runs 41, 48).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, ahead of any installed fastmm

import torch  # noqa: E402

import fastmm  # noqa: E402
from fastmm.precision import torch_precision  # noqa: E402  (torch at a row's precision: TF32 for tf32 only)

# ---------------------------------------------------------------------------------------------
# the models (sizes chosen to look like a small real model: 1024 hidden, 1024 tokens a step)


def _tf():
    try:
        import transformers
    except ImportError as exc:  # the optional extra
        raise SystemExit(f"benchmarks/models.py needs transformers: pip install 'fastmm[models]' ({exc})")
    transformers.logging.set_verbosity_error()
    return transformers


def batch_dims(tokens: int) -> tuple[int, int]:
    """(sequences, sequence length) of a step of ``tokens`` tokens: 256-token sequences up to
    1024 tokens a step, 1024-token ones beyond (GPT-2's longest); whole sequences, rounded down."""
    seq = 256 if tokens <= 1024 else 1024
    return max(1, tokens // seq), seq


def build(name: str, tiny: bool = False, tokens: int = 1024):
    """(model, example batch as kwargs, loss function of the output, is a decoder). ``tiny``:
    the same architectures at toy sizes (a CPU smoke run of this script). ``tokens``: tokens a
    training step (ViT: an image of 197 tokens per 256)."""
    torch.manual_seed(0)
    B, S, H, F, L, NH, V = (2, 12, 32, 64, 2, 2, 100) if tiny else (*batch_dims(tokens), 1024, 4096, 4, 16, 32000)
    if name == "encoder":
        layer = torch.nn.TransformerEncoderLayer(H, NH, F, dropout=0.0, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, L, enable_nested_tensor=False)
        return model, {"src": torch.randn(B, S, H)}, lambda out: out.float().pow(2).mean(), False
    tf = _tf()
    ids = {"input_ids": torch.randint(0, V, (B, S))}
    if name == "llama":
        cfg = tf.LlamaConfig(hidden_size=H, intermediate_size=F * 11 // 16, num_hidden_layers=L, num_attention_heads=NH,
                             num_key_value_heads=max(1, NH // 4), vocab_size=V, max_position_embeddings=2048)
        return tf.LlamaForCausalLM(cfg), dict(ids, labels=ids["input_ids"]), lambda out: out.loss, True
    if name == "gpt2":
        cfg = tf.GPT2Config(n_embd=H, n_layer=L, n_head=NH, vocab_size=V, n_positions=1024,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel(cfg), dict(ids, labels=ids["input_ids"]), lambda out: out.loss, True
    if name == "bert":
        cfg = tf.BertConfig(hidden_size=H, intermediate_size=F, num_hidden_layers=L, num_attention_heads=NH,
                            vocab_size=V, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                            max_position_embeddings=max(512, S))
        return tf.BertForMaskedLM(cfg), dict(ids, labels=ids["input_ids"]), lambda out: out.loss, False
    if name == "vit":
        size, patch = (32, 8) if tiny else (224, 16)
        cfg = tf.ViTConfig(hidden_size=H, intermediate_size=F, num_hidden_layers=L, num_attention_heads=NH,
                           image_size=size, patch_size=patch, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = tf.ViTForImageClassification(cfg)
        images = 2 if tiny else max(1, tokens // 256)  # (197 tokens an image: 4 at the default, as before)
        return model, {"pixel_values": torch.randn(images, 3, size, size)}, lambda out: out.logits.float().pow(2).mean(), False
    raise SystemExit(f"unknown model {name!r}")


def _to(batch: dict, device, dtype=None) -> dict:
    out = {}
    for k, v in batch.items():
        v = v.to(device)
        out[k] = v.to(dtype) if dtype is not None and v.is_floating_point() else v
    return out


def _logits(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def step_ms(models, batch, loss_fn, steps: int, warmup: int = 3, backward_thread="device") -> list[float]:
    """Median time of one training step (forward, loss, backward; CUDA events) of each of
    ``models``, their steps interleaved (A B B A A B ...): the host's speed drifts over a run
    (steps of the same model moved 20-40% between runs, NOTES.md run 19), and interleaving puts
    both sides under the same drift instead of timing one block of steps after the other.

    ``backward_thread``, one for all models or a list with one per model: "device" (torch's
    default: the autograd engine runs a CUDA graph's backward on its device's worker thread) or
    "caller" (the backward on the calling thread, ``torch.autograd.set_multithreading_enabled(False)``:
    no hand-off to another thread, whose cache and TLB misses a host-bound step pays on every
    node). A model may appear twice, once with each."""
    threads = [backward_thread] * len(models) if isinstance(backward_thread, str) else list(backward_thread)

    def one(i):
        model = models[i]
        model.zero_grad(set_to_none=True)
        with torch.autograd.set_multithreading_enabled(threads[i] != "caller"):
            loss_fn(model(**batch)).backward()

    for _ in range(warmup):
        for i in range(len(models)):
            one(i)
    cuda = next(models[0].parameters()).is_cuda
    times = [[] for _ in models]
    for step in range(steps):
        order = range(len(models)) if step % 2 == 0 else reversed(range(len(models)))
        for i in order:
            if not cuda:  # (a CPU smoke run: wall time)
                t0 = time.perf_counter()
                one(i)
                times[i].append(1e3 * (time.perf_counter() - t0))
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            one(i)
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end))
    return [statistics.median(t) for t in times]


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((x.double() - ref).norm() / ref.norm()).item()


def errors(model, ref64, batch, loss_fn, by_param: dict | None = None) -> tuple[float, float]:
    """(logits error, gradient error) of ``model`` against the float64 model on the same batch;
    the gradient error is the norm of all gradients' differences over the norm of all float64
    gradients. ``by_param``: filled with each parameter's (difference norm, float64 norm) by name,
    to find which gradients carry the error."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    loss_fn(out).backward()
    logits = _logits(out).detach()
    num = den = 0.0
    for (name, p), p64 in zip(model.named_parameters(), ref64.parameters()):
        if p.grad is None or p64.grad is None:
            continue
        diff, ref = (p.grad.double() - p64.grad).norm().item(), p64.grad.norm().item()
        num += diff ** 2
        den += ref ** 2
        if by_param is not None:
            by_param[name] = (diff, ref)
    model.zero_grad(set_to_none=True)
    return rel(logits, _logits(ref64._last_out).detach()), (num ** 0.5) / (den ** 0.5 or 1.0)


def grad_error_table(torch_errs: dict, fastmm_errs: dict, total: float, top: int) -> str:
    """The ``top`` parameters by the larger of their two squared gradient differences: each
    one's difference norm over the float64 gradients' total norm (torch / fastmm; the squares
    of a column add up to the square of the step's gradient error), and its own relative error."""
    names = sorted(torch_errs, key=lambda n: -max(torch_errs[n][0], fastmm_errs.get(n, (0.0, 0.0))[0]))[:top]
    lines = [f"  {'parameter':<48}{'share torch':>13}{'share fastmm':>14}{'own torch':>11}{'own fastmm':>12}"]
    for n in names:
        (dt, ref), (df, _) = torch_errs[n], fastmm_errs.get(n, (float("nan"), 0.0))
        own_t, own_f = dt / (ref or 1), df / (ref or 1)
        lines.append(f"  {n[:47]:<48}{dt / total:13.2e}{df / total:14.2e}{own_t:11.2e}{own_f:12.2e}")
    return "\n".join(lines)


def generate_tps(models, prompt, new_tokens: int, rounds: int = 5) -> list[tuple[float, torch.Tensor]]:
    """Greedy decoding, batch 1, KV cache, of each of ``models``: (tokens per second, the tokens)
    each. A generate call is paced by the host (hundreds of small launches and Hugging Face's
    Python per token), whose speed drifts by 20-40% over a run (NOTES.md run 19); so, as
    step_ms does for steps, the models' timed calls are interleaved (A B B A A ...) over
    ``rounds`` rounds and each rate is the median of its rounds. The tokens returned are a
    model's first round's, or None where a later round gave others (greedy decoding should not)."""
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
    rates = [[] for _ in models]
    tokens: list[torch.Tensor | None] = [None] * len(models)
    with torch.no_grad():
        for model in models:
            model.generate(prompt, **kw)  # warm-up: kernels compiled and loaded
        for r in range(rounds):
            for i in (range(len(models)) if r % 2 == 0 else reversed(range(len(models)))):
                _sync(prompt.device)
                t0 = time.perf_counter()
                out = models[i].generate(prompt, **kw)
                _sync(prompt.device)
                rates[i].append(new_tokens / (time.perf_counter() - t0))
                if r == 0:
                    tokens[i] = out
                elif tokens[i] is not None and not torch.equal(tokens[i], out):
                    tokens[i] = None
    return [(statistics.median(rs), t) for rs, t in zip(rates, tokens)]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_model(name: str, precisions, opts, device) -> list[dict]:
    model, batch_cpu, loss_fn, decoder = build(name, opts.tiny, opts.tokens)
    model = model.to(device).train()
    batch = _to(batch_cpu, device)
    ref64 = copy.deepcopy(model).double()
    ref64.zero_grad(set_to_none=True)
    out64 = ref64(**_to(batch_cpu, device, torch.float64))
    loss_fn(out64).backward()
    ref64._last_out = out64
    patched = fastmm.patch(copy.deepcopy(model))
    rows = []
    for precision in precisions:
        # the converted modules and the functional routing (SDPA's math path, eager attention) both
        # at this precision: patching again with a precision sets both (the routing probes again)
        patched = fastmm.patch(patched, precision=precision)
        row = {"model": name, "precision": precision, "backward_thread": opts.backward_thread}
        with torch_precision(precision):
            if opts.backward_thread == "both":  # (the four steps interleaved: one drift for all)
                times = step_ms([model, patched, model, patched], batch, loss_fn, opts.steps,
                                backward_thread=["device", "device", "caller", "caller"])
                row["torch_ms"], row["fastmm_ms"], row["torch_caller_ms"], row["fastmm_caller_ms"] = times
                row["caller_ratio"] = row["torch_caller_ms"] / row["fastmm_caller_ms"]
            else:
                row["torch_ms"], row["fastmm_ms"] = step_ms([model, patched], batch, loss_fn, opts.steps,
                                                            backward_thread=opts.backward_thread)
            row["step_ratio"] = row["torch_ms"] / row["fastmm_ms"]
            by_t, by_f = {}, {}
            row["torch_logit_err"], row["torch_grad_err"] = errors(model, ref64, batch, loss_fn, by_t)
            row["fastmm_logit_err"], row["fastmm_grad_err"] = errors(patched, ref64, batch, loss_fn, by_f)
            if opts.grad_errors:
                total = sum(ref ** 2 for _, ref in by_t.values()) ** 0.5 or 1.0
                print(f"{name} {precision}: the gradients with the largest errors against float64", flush=True)
                print(grad_error_table(by_t, by_f, total, opts.grad_errors), flush=True)
            report = fastmm.coverage(patched, loss=loss_fn, **batch)
            patched.zero_grad(set_to_none=True)
            counts = report.counts()
            row["coverage"] = f"{counts['fastmm']} fastmm / {counts['torch']} torch / {counts['attention']} sdpa"
            row["on_torch"] = sorted({f"{e.op} {e.shapes} ({e.detail})" for e in report.on_torch()})
            if decoder and not opts.no_generate:
                prompt = batch["input_ids"][:1, :min(32, batch["input_ids"].shape[1])]
                model.eval(), patched.eval()
                (row["torch_tok_s"], t_tokens), (row["fastmm_tok_s"], f_tokens) = generate_tps(
                    [model, patched], prompt, opts.new_tokens, opts.decode_rounds)
                row["decode_ratio"] = row["fastmm_tok_s"] / row["torch_tok_s"]
                row["same_tokens"] = t_tokens is not None and f_tokens is not None and bool(torch.equal(t_tokens, f_tokens))
                model.train(), patched.train()
            if name in opts.compile:
                torch._dynamo.reset()
                cm, cp = torch.compile(model), torch.compile(patched)
                row["torch_compiled_ms"], row["fastmm_compiled_ms"] = step_ms(
                    [cm, cp], batch, loss_fn, opts.steps,
                    backward_thread="caller" if opts.backward_thread == "caller" else "device")
                row["compiled_ratio"] = row["torch_compiled_ms"] / row["fastmm_compiled_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def host_us(fns, calls: int = 200, rounds: int = 7) -> list[float]:
    """Host time to enqueue one call of each of ``fns`` (median over rounds of ``calls``
    back-to-back calls, the functions' rounds interleaved as step_ms interleaves steps; the GPU
    is kept busy ahead so the host never waits on it)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    per = [[] for _ in fns]
    for r in range(rounds):
        for i in (range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work queued first: the calls only enqueue
            t0 = time.perf_counter()
            for _ in range(calls):
                fns[i]()
            per[i].append(1e6 * (time.perf_counter() - t0) / calls)
            torch.cuda.synchronize()
    return [statistics.median(p) for p in per]


def host_costs(device) -> list[tuple[str, float, float]]:
    """(what, torch us, fastmm us) per call for one Linear layer [4, 256, 1024] @ W^T with W of
    [2816, 1024]: forward without grad, forward with grad, forward plus backward."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(1024, 2816, device=device)
    fm = fastmm.nn.Linear.from_linear(ref)
    x = torch.randn(4, 256, 1024, device=device)
    xg = x.clone().requires_grad_()
    g = torch.randn(4, 256, 2816, device=device)
    rows = []
    with torch.no_grad():
        rows.append(("forward, no grad", *host_us([lambda: ref(x), lambda: fm(x)])))
    rows.append(("forward with grad", *host_us([lambda: ref(xg), lambda: fm(xg)])))
    rows.append(("forward + backward", *host_us([lambda: ref(xg).backward(g), lambda: fm(xg).backward(g)], calls=50)))
    return rows


def table(rows: list[dict]) -> str:
    head = ("model", "prec", "torch ms", "fastmm ms", "step", "compiled", "tok/s torch", "tok/s fastmm", "decode",
            "same", "logit err t/f", "grad err t/f", "coverage")
    out = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        def f(key, fmt):
            return format(r[key], fmt) if key in r else "-"
        out.append(" | ".join((
            r["model"], r["precision"], f("torch_ms", ".2f"), f("fastmm_ms", ".2f"), f("step_ratio", ".3f") + "x",
            f("compiled_ratio", ".3f"), f("torch_tok_s", ".1f"), f("fastmm_tok_s", ".1f"), f("decode_ratio", ".3f"),
            str(r.get("same_tokens", "-")),
            f"{r['torch_logit_err']:.1e} / {r['fastmm_logit_err']:.1e}", f"{r['torch_grad_err']:.1e} / {r['fastmm_grad_err']:.1e}",
            r["coverage"])))
    return "\n".join(out)


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def family_variant(text: str):
    """A family built from ``NAME:FIELD=VALUE,...`` (e.g. ``simt_cp_async:split_model=False``; values:
    True, False, None, integers, or words), refusing a family or field that does not exist."""
    import dataclasses

    from fastmm.families import FAMILIES

    name, sep, fields_text = text.partition(":")
    if not sep or name not in FAMILIES:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:FIELD=VALUE,... with NAME one of {sorted(FAMILIES)}")
    cls = type(FAMILIES[name])
    names = {f.name for f in dataclasses.fields(cls)}
    fields = {}
    for item in filter(None, fields_text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in names:
            raise argparse.ArgumentTypeError(f"{item!r}: expected FIELD=VALUE with FIELD one of {sorted(names)}")
        words = {"True": True, "False": False, "None": None}
        fields[key] = words[value] if value in words else int(value) if value.lstrip("-").isdigit() else value
    return cls(**fields)


def wgmma_variant(text: str):
    """``WgmmaTf32`` built from ``FIELD=VALUE,...`` (:func:`family_variant` of wgmma_tf32)."""
    return family_variant("wgmma_tf32:" + text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/models.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,bert,gpt2,vit,encoder")
    parser.add_argument("--precisions", default="ieee,tf32,tf32x3")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps (median)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated")
    parser.add_argument("--no-generate", action="store_true")
    parser.add_argument("--decode-rounds", type=_positive, default=5,
                        help="timed generate calls a model, interleaved with the other side's (median)")
    parser.add_argument("--compile", default="", help="models to time under torch.compile as well (comma list)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--no-host", action="store_true", help="skip the host-time table of one Linear layer")
    parser.add_argument("--grad-errors", type=int, default=0, metavar="N",
                        help="also print the N parameters whose gradients carry the most error against float64")
    parser.add_argument("--tokens", type=int, default=1024,
                        help="tokens a training step (default 1024: 4 x 256; beyond 1024, sequences of 1024; "
                             "ViT: an image per 256). Small steps are bound by the host's enqueue time on "
                             "both sides, large ones by the GPU")
    parser.add_argument("--backward-thread", choices=("device", "caller", "both"), default="device",
                        help="where both sides' backward runs: the autograd engine's device thread (torch's "
                             "default), the calling thread (torch.autograd.set_multithreading_enabled(False)), "
                             "or both, the four steps interleaved (the step columns are the device thread's; "
                             "the caller thread's in the JSON and a line of their own)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (a smoke run; with --device cpu too)")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke run of the script")
    parser.add_argument("--wgmma", type=wgmma_variant, metavar="FIELD=VALUE,...",
                        help="fastmm's side with the wgmma family built with these fields (e.g. x3_a_regs=True)")
    parser.add_argument("--variant", type=family_variant, action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                        help="fastmm's side with family NAME built with these fields (e.g. "
                             "simt_cp_async:split_model=False); repeatable")
    opts = parser.parse_args(argv)
    variants = opts.variant + ([opts.wgmma] if opts.wgmma is not None else [])
    if variants:  # (before any product is planned: plans are cached by problem)
        from fastmm.families import FAMILIES

        for fam in variants:
            FAMILIES[fam.name] = fam
            print(f"fastmm's {fam.name} family: {fam}")
    opts.compile = [m for m in opts.compile.split(",") if m]
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks/models.py times models on a CUDA GPU, and torch sees none", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    rows = []
    for name in opts.models.split(","):
        rows += bench_model(name, opts.precisions.split(","), opts, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    host = []
    if device.type == "cuda" and not opts.no_host:
        host = host_costs(device)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"models": rows, "host_us": host}, indent=1))
    print()
    print(table(rows))
    caller = [r for r in rows if "caller_ratio" in r]
    if caller:
        print()
        print("backward on the calling thread (the same run, steps interleaved) | torch ms | fastmm ms | step")
        for r in caller:
            print(f"{r['model']} {r['precision']} | {r['torch_caller_ms']:.2f} | {r['fastmm_caller_ms']:.2f} | "
                  f"{r['caller_ratio']:.3f}x")
    if host:
        print()
        print("host us per call, Linear [4,256,1024] @ W^T, W [2816,1024] | torch | fastmm | ratio")
        for what, t, f in host:
            print(f"{what} | {t:.1f} | {f:.1f} | {t / f:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
