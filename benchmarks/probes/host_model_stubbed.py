#!/usr/bin/env python3
"""A whole model's training step on the host, without a GPU: models.py's tiny models (toy sizes,
CPU tensors) on torch and patched with ``fastmm.patch``, fastmm on a simulated H200 whose launches
are stubbed (no arithmetic), so the patched step's extra time over torch's is fastmm's Python
around its products, counted the way a real step calls it (every route, the lm_head, the
backward's Python nodes), not one layer in a loop. torch's side computes its small products on the
CPU (a few us each), so the difference is a lower bound of fastmm's host cost a step.

    python benchmarks/probes/host_model_stubbed.py                      # every model, ieee
    python benchmarks/probes/host_model_stubbed.py --models llama --profile 20   # + where it goes

Prints, a model: the step's time torch / fastmm (best of ``--rounds`` medians, steps interleaved),
the difference, fastmm's launches a step and the difference a launch. ``--profile N``: the N
entries with the most time of their own over the patched model's steps (cProfile): fastmm's
functions, torch.autograd's, and the C calls of the step (torch's ops among them, whoever made
them). The stubbed launches leave fastmm's outputs unwritten: denormals are flushed on both sides,
so that whatever those bytes hold does not slow the ops that read them.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import importlib.util
import pstats
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import torch  # noqa: E402

import fastmm  # noqa: E402
from fastmm import dispatch, fast_path  # noqa: E402
from fastmm.problem import DeviceFacts  # noqa: E402
from fastmm.runtime import launcher, tensor_map  # noqa: E402


class _OnCuda:
    """A CPU tensor as dispatch.not_served_reason sees it on the simulated GPU (as tests/conftest.py)."""

    device = torch.device("cuda", 0)

    def __init__(self, t):
        self._t = t

    def __getattr__(self, name):
        return getattr(self._t, name)


def simulate_h200_stubbed() -> list[int]:
    """CPU tensors pass for CUDA ones on a simulated H200; loads return the config, launches do
    nothing but count (returned list: one entry a launch)."""
    launches: list[int] = []
    real_reason = dispatch.not_served_reason
    explain_module = importlib.import_module("fastmm.explain")
    dispatch.runtime_reason = lambda: None
    dispatch.not_served_reason = explain_module.not_served_reason = lambda a, b: real_reason(_OnCuda(a), _OnCuda(b))
    dispatch.device_facts = lambda index: DeviceFacts.simulated_device("sm_90", index)
    torch.cuda.current_device = lambda: 0
    torch.cuda.is_current_stream_capturing = lambda: False
    fast_path._cuda_device = lambda: 0
    dispatch.current_stream = lambda index: 7

    def launch(cfg, stream, args, *rest):
        launches.append(1)

    launcher.load = lambda dev, cfg: cfg
    launcher.launch = launch
    launcher.launch_with_maps = launch
    launcher.maps_launcher = lambda cfg: lambda stream, maps, args: launches.append(1)
    tensor_map.encode = lambda ptr, spec, tf32=True: (ptr, spec, tf32)
    return launches


def load_models_module():
    spec = importlib.util.spec_from_file_location("fastmm_bench_models", HERE.parent / "models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def one_step(model, batch, loss_fn) -> None:
    model.zero_grad(set_to_none=True)
    loss_fn(model(**batch)).backward()


def step_times(models, batch, loss_fn, steps: int) -> list[float]:
    """Median wall time (us) of a step of each model, steps interleaved (A B B A ...)."""
    times = [[] for _ in models]
    for s in range(steps):
        for i in (range(len(models)) if s % 2 == 0 else reversed(range(len(models)))):
            t0 = time.perf_counter()
            one_step(models[i], batch, loss_fn)
            times[i].append(1e6 * (time.perf_counter() - t0))
    return [statistics.median(t) for t in times]


def generate_us(models, prompt, tokens: int, rounds: int) -> list[float]:
    """Best over ``rounds`` of the wall time (us) a token of a greedy generate call of each
    model, calls interleaved."""
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, use_cache=True, pad_token_id=0)
    times = [[] for _ in models]
    with torch.no_grad():
        for r in range(rounds):
            for i in (range(len(models)) if r % 2 == 0 else reversed(range(len(models)))):
                t0 = time.perf_counter()
                models[i].generate(prompt, **kw)
                times[i].append(1e6 * (time.perf_counter() - t0) / tokens)
    return [min(t) for t in times]


def decode(models_py, o, launches) -> int:
    """Decode's host cost a token: torch's model against the patched one (and one patched with
    ``functional=False``: modules only), both sides' SDPA on the math path (torch's composite in
    C++, fastmm's :func:`~fastmm.attention.math_attention` routed as on a CUDA device)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fastmm import patching
    patching.takes_math_path = lambda *args: True  # (on CUDA, grouped-query float32 SDPA is the math path)
    print(f"{'model':<9}{'torch us':>10}{'fastmm us':>11}{'modules us':>12}{'launches':>10}  (a token)")
    for name in o.models.split(","):
        model, batch, _, decoder = models_py.build(name, tiny=True)
        if not decoder:
            continue
        model.eval()
        prompt = batch["input_ids"][:1, :8]
        with sdpa_kernel(SDPBackend.MATH):
            patched = fastmm.patch(copy.deepcopy(model), precision=o.precision)
            modules = fastmm.patch(copy.deepcopy(model), precision=o.precision, functional=False)
            sides = [model, patched, modules]
            generate_us(sides, prompt, 4, 2)  # (first calls: plans, remembered entries, probes)
            del launches[:]
            generate_us([patched], prompt, o.decode, 1)
            per_token = len(launches) / o.decode
            t, f, m = generate_us(sides, prompt, o.decode, o.rounds)
            print(f"{name:<9}{t:10.1f}{f:11.1f}{m:12.1f}{per_token:10.1f}")
            if o.profile:
                prof = cProfile.Profile()
                kw = dict(max_new_tokens=o.decode, min_new_tokens=o.decode, do_sample=False, use_cache=True,
                          pad_token_id=0)
                with torch.no_grad():
                    prof.enable()
                    for _ in range(o.rounds):
                        patched.generate(prompt, **kw)
                    prof.disable()
                stats = pstats.Stats(prof)
                rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])
                n = o.rounds * o.decode
                print(f"  top {o.profile} by own time (us a token: own / with callees, calls a token)")
                for (file, line, fn), (cc, nc, tt, ct, _) in rows[:o.profile]:
                    where = f"{Path(file).name}:{line}" if file != "~" else ""
                    print(f"  {1e6 * tt / n:8.1f} {1e6 * ct / n:8.1f} {nc / n:6.1f}  {fn} {where}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama,gpt2,bert,vit,encoder")
    ap.add_argument("--precision", default="ieee", choices=("ieee", "tf32", "tf32x3"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--decode", type=int, default=0, metavar="TOKENS",
                    help="greedy decoding of the decoders (llama, gpt2) instead of a training step: TOKENS new "
                         "tokens a generate call, us a token; SDPA taken as the math path on both sides")
    o = ap.parse_args()
    torch.set_num_threads(1)  # (torch's CPU arithmetic on one thread: no pool to wake an op)
    torch.set_flush_denormal(True)
    launches = simulate_h200_stubbed()
    models_py = load_models_module()
    if o.decode:
        return decode(models_py, o, launches)
    print(f"{'model':<9}{'torch us':>10}{'fastmm us':>11}{'diff us':>9}{'launches':>10}{'us/launch':>11}")
    for name in o.models.split(","):
        model, batch, loss_fn, _ = models_py.build(name, tiny=True)
        model.train()
        patched = fastmm.patch(copy.deepcopy(model), precision=o.precision)
        for _ in range(3):  # first calls: plans, NVRTC (disk cache), remembered entries
            one_step(model, batch, loss_fn)
            one_step(patched, batch, loss_fn)
        del launches[:]
        one_step(patched, batch, loss_fn)
        per_step = len(launches)
        best = [min(x) for x in zip(*(step_times([model, patched], batch, loss_fn, o.steps) for _ in range(o.rounds)))]
        diff = best[1] - best[0]
        print(f"{name:<9}{best[0]:10.1f}{best[1]:11.1f}{diff:9.1f}{per_step:10d}{diff / max(per_step, 1):11.2f}")
        if o.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(o.steps):
                one_step(patched, batch, loss_fn)
            prof.disable()
            stats = pstats.Stats(prof)
            rows = [(k, v) for k, v in stats.stats.items() if "fastmm" in k[0] or "autograd" in k[0] or k[0] == "~"]
            rows.sort(key=lambda kv: -kv[1][2])
            print(f"  top {o.profile} by own time over {o.steps} steps (us a step: own / with callees, calls a step)")
            for (file, line, fn), (cc, nc, tt, ct, _) in rows[:o.profile]:
                where = f"{Path(file).name}:{line}" if file != "~" else ""
                print(f"  {1e6 * tt / o.steps:8.1f} {1e6 * ct / o.steps:8.1f} {nc / o.steps:6.1f}  {fn} {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
