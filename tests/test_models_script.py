"""benchmarks/models.py runs as a CPU smoke run (``--tiny --device cpu``), in CI: its rows come out
as JSON, and ``--grad-errors`` lists which parameters' gradients carry the step's error against
the float64 model, each parameter's share such that the shares' squares add up to the step's
gradient error squared (the row's own ``fastmm_grad_err``, computed separately). On the CPU every
product goes to torch, so both sides' errors are torch's; the GPU run is the script itself."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "models.py"


def test_models_script_lists_the_gradients_that_carry_the_error(tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--models", "encoder",
                           "--precisions", "ieee", "--steps", "1", "--no-generate", "--no-host",
                           "--grad-errors", "1000", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    row = rows["models"][0]
    assert row["model"] == "encoder" and row["precision"] == "ieee"
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("encoder ieee: the gradients"))
    table = []
    for line in lines[start + 2:]:
        parts = line.split()
        if len(parts) != 5:
            break
        table.append((parts[0], *map(float, parts[1:])))
    names = {name for name, *_ in table}
    assert {"layers.0.linear1.weight", "layers.1.self_attn.in_proj_weight"} <= names, names
    shares = [share_fastmm for _, _, share_fastmm, _, _ in table]
    assert max(shares) > 0
    # (three significant digits printed a share: the sum agrees to ~1%)
    assert math.isclose(math.sqrt(sum(s * s for s in shares)), row["fastmm_grad_err"], rel_tol=0.02)


def test_models_script_builds_the_family_variant_asked_for_and_refuses_unknown_ones():
    """``--wgmma FIELD=VALUE,...`` and ``--variant NAME:FIELD=VALUE,...`` (a form that is off by
    default, or the rules a model replaced, timed in whole model steps):
    the fields and their types as given; a field the family does not have stops the script with
    argparse's usage error (exit 2), before any model is built."""
    import argparse
    import importlib.util

    from fastmm.families import WgmmaTf32

    spec = importlib.util.spec_from_file_location("fastmm_models_script", SCRIPT)
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    from fastmm.families import SimtCpAsync

    assert models.wgmma_variant("x3_a_regs=True,promote_every=2,rows64=always,split=False") == WgmmaTf32(
        x3_a_regs=True, promote_every=2, rows64="always", split=False)
    assert models.family_variant("simt_cp_async:split_model=False") == SimtCpAsync(split_model=False)
    refused = [(models.wgmma_variant, bad) for bad in ("x3_a_regs", "no_such_field=1")] + [
        (models.family_variant, bad) for bad in ("simt_cp_async", "no_such_family:x=1", "simt_cp_async:no_such_field=1")]
    for parse, bad in refused:
        with pytest.raises(argparse.ArgumentTypeError, match="=VALUE"):
            parse(bad)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--wgmma", "no_such_field=1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2 and "--wgmma" in proc.stderr and "no_such_field" in proc.stderr, proc.stderr


def test_each_row_runs_the_patched_model_at_its_precision_routing_included(monkeypatch):
    """A row's precision reaches the converted modules and the functional routing (eager
    attention's products, SDPA's math path): in run 47's tf32x3 rows the routing followed torch's
    setting (full fp32) while the modules ran tf32x3. Checked where the row times its steps."""
    import argparse

    pytest.importorskip("transformers")
    from fastmm import patching

    models = _models_module()
    seen = []

    def step_ms(pair, batch, loss_fn, steps, backward_thread="device"):
        patched = pair[1]
        routing = {h.routing.precision for m in patched.modules() for h in m._forward_pre_hooks.values()
                   if isinstance(h, patching._Enter)}
        converted = {m.precision for m in patched.modules() if m.__class__.__module__.startswith("fastmm")}
        seen.append((routing, converted))
        return 1.0, 1.0

    monkeypatch.setattr(models, "step_ms", step_ms)
    opts = argparse.Namespace(tiny=True, tokens=1024, steps=1, grad_errors=0, no_generate=True, compile=(),
                              backward_thread="device")
    rows = models.bench_model("llama", ["ieee", "tf32x3"], opts, models.torch.device("cpu"))
    assert [r["precision"] for r in rows] == ["ieee", "tf32x3"]
    assert seen == [({"ieee"}, {"ieee"}), ({"tf32x3"}, {"tf32x3"})], seen


def _models_module():
    """benchmarks/models.py as a module (it is a script, not a package member)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fastmm_models_script", SCRIPT)
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    return models


@pytest.mark.parametrize("where, multithreaded", [("device", True), ("caller", False)])
def test_step_times_run_the_backward_where_backward_thread_says(where, multithreaded):
    """``--backward-thread caller`` times both sides with the autograd engine's hand-off to the
    device's worker thread turned off (torch.autograd.set_multithreading_enabled(False)), and only
    inside the timed steps; "device" leaves torch's default. Seen from inside each model's
    backward, for both models of the pair."""
    import torch

    models = _models_module()
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(torch._C._is_multithreading_enabled())
            return g * 2

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3))

        def forward(self, x):
            return Probe.apply(self.w * x)

    pair = [Net(), Net()]
    times = models.step_ms(pair, {"x": torch.randn(3)}, lambda out: out.sum(), steps=2, warmup=1,
                           backward_thread=where)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert seen == [multithreaded] * 6, seen  # (1 warm-up + 2 timed steps) x 2 models
    assert torch._C._is_multithreading_enabled()  # torch's default is back after the steps

    # one setting a model: the same model twice, once with each, its steps interleaved
    seen.clear()
    net = Net()
    models.step_ms([net, net], {"x": torch.randn(3)}, lambda out: out.sum(), steps=2, warmup=1,
                   backward_thread=["device", "caller"])
    assert seen == [True, False, True, False, False, True], seen  # warm-up, step 0 (A B), step 1 (B A)


def test_backward_thread_both_times_the_four_steps_in_one_interleaved_run(monkeypatch):
    """``--backward-thread both``: one step_ms call over torch and fastmm each with the backward on
    the device thread and on the calling thread (one drift for all four), the row's step ratio
    from the first two and ``caller_ratio`` from the last two."""
    import argparse

    pytest.importorskip("transformers")
    models = _models_module()
    calls = []

    def step_ms(ms, batch, loss_fn, steps, backward_thread="device"):
        calls.append((len(ms), ms[0] is ms[2] and ms[1] is ms[3] and ms[0] is not ms[1], backward_thread))
        return [1.0, 2.0, 3.0, 4.0]

    monkeypatch.setattr(models, "step_ms", step_ms)
    opts = argparse.Namespace(tiny=True, tokens=1024, steps=1, grad_errors=0, no_generate=True, compile=(),
                              backward_thread="both")
    (row,) = models.bench_model("encoder", ["ieee"], opts, models.torch.device("cpu"))
    assert calls == [(4, True, ["device", "device", "caller", "caller"])]
    assert (row["torch_ms"], row["fastmm_ms"], row["torch_caller_ms"], row["fastmm_caller_ms"]) == (1.0, 2.0, 3.0, 4.0)
    assert row["step_ratio"] == 0.5 and row["caller_ratio"] == 0.75
