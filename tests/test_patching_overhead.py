"""The host cost of ``fastmm.patch(model, functional=...)``: how many torch calls pass through a
FastmmMode per forward (a test, on the CPU), and, run as a script, the time of a forward and of a
training step of a Llama for each setting, with the per-call cost of a function mode::

    python tests/test_patching_overhead.py                         # CPU, tiny, eager and SDPA
    python tests/test_patching_overhead.py --device cuda --hidden 1024 --layers 4 --seq 256 --batch 4

Timing: time.perf_counter around ``--inner`` calls (CUDA synchronized before and after), the
minimum over ``--rounds`` rounds, the settings interleaved round by round (a noisy host shows in
all of them alike).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, run as a script

import fastmm  # noqa: E402
from fastmm.patching import FastmmMode  # noqa: E402

SETTINGS = (False, True, "forward")


def llama(attn: str | None, layers: int, hidden: int, device: str = "cpu"):
    import transformers as tf

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    heads = max(2, hidden // 64)
    cfg = tf.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), vocab_size=1000,
                         attn_implementation=attn)
    return tf.LlamaForCausalLM(cfg).to(device)


def mode_calls(model, **inputs) -> int:
    """Torch calls that pass through a FastmmMode in one forward (after the probes)."""
    for training in (True, False):
        model.train(training)
        with torch.no_grad():
            model(**inputs)
    count = 0
    real = FastmmMode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        nonlocal count
        count += 1
        return real(self, func, types, args, kwargs)

    FastmmMode.__torch_function__ = counting
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        FastmmMode.__torch_function__ = real
    return count


def test_the_mode_sees_only_the_calls_of_the_modules_that_need_it():
    pytest.importorskip("transformers")
    ids = {"input_ids": torch.randint(0, 1000, (2, 6))}
    counts = {}
    for attn in ("eager", "sdpa"):
        plain = llama(attn, 2, 32)
        for setting in SETTINGS:
            counts[attn, setting] = mode_calls(fastmm.patch(copy.deepcopy(plain), functional=setting), **ids)
    assert counts["eager", False] == counts["sdpa", False] == 0
    # nothing functional with SDPA (but the rotary embedding's product, in transformers 5.17)
    rotary = fastmm.patching._makes_routed_calls(plain.model.rotary_emb)
    assert counts["sdpa", True] < 30 if rotary else counts["sdpa", True] == 0
    # eager: the attention modules' own calls only; their projections are shielded
    assert 0 < counts["eager", True] < counts["eager", "forward"]
    assert counts["sdpa", "forward"] > 0


def _call_cost(device: str) -> dict[str, float]:
    """us per call of a few torch calls, without and with a FastmmMode on the stack."""
    x = torch.randn(8, 8, device=device)
    calls = {"x.shape": lambda: x.shape, "x.view(64)": lambda: x.view(64), "x + x": lambda: x + x,
             "torch.relu(x)": lambda: torch.relu(x)}
    out = {}
    for name, fn in calls.items():
        best = [float("inf"), float("inf")]
        for _ in range(7):
            for i, mode in enumerate((None, FastmmMode())):
                if mode is not None:
                    mode.__enter__()
                t0 = time.perf_counter()
                for _ in range(5000):
                    fn()
                best[i] = min(best[i], (time.perf_counter() - t0) / 5000 * 1e6)
                if mode is not None:
                    mode.__exit__(None, None, None)
        out[name] = best
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attn", default="eager,sdpa")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seq", type=int, default=12)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--mode-only", action="store_true",
                        help="after the probes, let the mode route nothing: the cost of the mode and hooks alone")
    opts = parser.parse_args()
    dev = opts.device
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    print(f"torch {torch.__version__}, device {dev}, threads {torch.get_num_threads()}")
    for name, (off, on) in _call_cost(dev).items():
        print(f"  {name:14s} {off:6.2f} us, with a FastmmMode on {on:6.2f} us (+{on - off:.2f})")
    if dev.startswith("cuda"):  # the host time of one attention product, fastmm against torch
        heads, d = max(2, opts.hidden // 64), 64
        q = torch.randn(opts.batch, heads, opts.seq, d, device=dev)
        for grad in (False, True):
            a, b = q.clone().requires_grad_(grad), q.transpose(-1, -2).clone().requires_grad_(grad)
            for name, fn in (("torch.matmul", torch.matmul), ("fastmm.matmul", fastmm.matmul)):
                fn(a, b)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    fn(a, b)
                torch.cuda.synchronize()
                print(f"  {name} {tuple(a.shape)} @ {tuple(b.shape)} grad={grad}: "
                      f"{(time.perf_counter() - t0) / 200 * 1e6:.1f} us a call")
    ids = torch.randint(0, 1000, (opts.batch, opts.seq), device=dev)
    for attn in opts.attn.split(","):
        plain = llama(attn, opts.layers, opts.hidden, dev)
        models = {"torch": plain}
        for setting in SETTINGS:
            models[f"functional={setting}"] = fastmm.patch(copy.deepcopy(plain), functional=setting)
        calls = {k: (mode_calls(m, input_ids=ids) if k != "torch" else 0) for k, m in models.items()}
        if opts.mode_only:
            fastmm.patching._FUNCTIONAL_DEVICES = ()
        for step in ("forward", "train step"):
            def run(m):
                if step == "forward":
                    with torch.no_grad():
                        m(input_ids=ids)
                else:
                    m(input_ids=ids, labels=ids).loss.backward()

            for m in models.values():
                m.train(step != "forward")
                for _ in range(3):
                    run(m)
            best = dict.fromkeys(models, float("inf"))
            for _ in range(opts.rounds):
                for k, m in models.items():
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(opts.inner):
                        run(m)
                    sync()
                    best[k] = min(best[k], (time.perf_counter() - t0) / opts.inner * 1e3)
            base = best["functional=False"]
            for k, ms in best.items():
                print(f"{attn:6s} L={opts.layers} H={opts.hidden} B={opts.batch} S={opts.seq} {step:10s} {k:18s} "
                      f"{ms:8.3f} ms  {(ms - base) * 1e3:+7.0f} us vs functional=False  "
                      f"(calls through the mode a forward: {calls[k]})")


if __name__ == "__main__":
    main()
