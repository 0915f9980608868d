"""benchmarks/soak.py on a CPU: it imports cleanly, parses its arguments, and without a GPU exits
with a message instead of running (the soak itself needs a CUDA GPU)."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("fastmm_soak_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # importing runs nothing
    return module


def test_arguments_and_their_defaults(soak):
    args = soak.parse_args([])
    assert (args.minutes, args.threads, args.check_every, args.json) == (10.0, 4, 8, None)
    assert args.kinds == list(soak.KINDS) and args.warmup_fraction == 0.2
    args = soak.parse_args(["--minutes", "0.5", "--threads", "2", "--kinds", "random, graph", "--json", "x.json"])
    assert (args.minutes, args.threads, args.kinds, args.json) == (0.5, 2, ["random", "graph"], "x.json")
    for bad in (["--kinds", "random,warp"], ["--minutes", "0"], ["--threads", "0"], ["--warmup-fraction", "1"]):
        with pytest.raises(SystemExit):
            soak.parse_args(bad)


def test_tolerance_per_precision_widens_for_long_sums(soak):
    assert soak.tolerance("ieee", 1000) == 1e-5 and soak.tolerance("tf32", 65536) == 1e-3
    assert soak.tolerance("tf32x3", 1 << 20) == pytest.approx(math.sqrt(1 << 20) * 2.0 ** -24)


def test_without_a_gpu_it_says_so_and_exits_2(soak, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert soak.main(["--minutes", "0.01"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_the_check_passes_a_close_result_and_fails_a_wrong_or_nan_one(soak, capsys):
    import types

    a, b = torch.randn(40, 300, dtype=torch.float64), torch.randn(300, 50, dtype=torch.float64)
    ref = a @ b
    worker = types.SimpleNamespace(torch=torch, stats=soak.Stats())
    check = soak.Worker.check.__get__(worker)
    assert check("close", ref.float(), ref, "ieee", 300)
    wrong = ref.float().clone()
    wrong[3, 4] += 1.0
    assert not check("wrong", wrong, ref, "ieee", 300, detail={"case": 1})
    wrong[3, 4] = float("nan")
    assert not check("nan", wrong, ref, "tf32", 300)
    assert not check("shape", ref.float()[:, :49], ref, "ieee", 300)
    assert (worker.stats.checks, worker.stats.failures) == (4, 3)
    assert worker.stats.samples[0]["case"] == 1 and "FAILURE" in capsys.readouterr().out
