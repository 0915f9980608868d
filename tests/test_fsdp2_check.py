"""FSDP2: benchmarks/fsdp2_check.py (a fastmm-patched Llama under ``fully_shard`` on 2 processes,
losses against the unpatched model's) runs on CPU processes with gloo, in CI: the script, FSDP2
with fastmm's layers (each layer's forward reads unsharded full-shape plain weights and goes to the
fastmm op, its backward through fastmm's), with torch computing the products. The real check, on
two GPUs, is the script itself (its docstring has the command)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "fsdp2_check.py"


def _has_fsdp2() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        return True
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard  # noqa: F401
            return True
        except ImportError:
            return False


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
@pytest.mark.skipif(not dist.is_available() or not _has_fsdp2(), reason="torch without FSDP2 (fully_shard)")
def test_fsdp2_check_on_cpu_processes(tmp_path):
    pytest.importorskip("transformers")
    report_path = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--tiny", "--steps", "2",
                           "--cache-dir", str(tmp_path / "cache"), "--json", str(report_path)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=str(REPO))
    if proc.returncode == 2 and "could not train the unpatched model on CPU" in proc.stdout:
        pytest.skip("FSDP2 does not run on CPU processes with gloo in this torch")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "fsdp2_check: OK" in proc.stdout and "loss diff" in proc.stdout and "fastmm ieee" in proc.stdout, proc.stdout
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["problems"] == [] and report["device"] == "cpu (gloo)", proc.stdout
    assert set(report["precisions"]) == {"ieee", "tf32x3"}
    for precision, r in report["precisions"].items():
        # The first pass's gradients first: a difference there names its parameter (worst_param),
        # where a later step's loss only says that something differed (the H200 host's CPU
        # processes, torch 2.11: step 2's loss off by 3.9e-8 in ieee, not reproduced here; NOTES run 41).
        assert r["grad0"]["worst"] == 0.0 and r["grad0"]["missing"] == [], (precision, r["grad0"], report["torch"])
        assert len(r["rel_diff"]) == 2 and r["max_rel_diff"] <= r["tolerance"], (precision, r)
        # (on the CPU fastmm hands the products to torch)
        assert r["max_rel_diff"] == 0.0, (precision, r, report["torch"])
        for rank, probes in report["probes"][precision].items():
            n = probes["layers"]
            assert n == 2 * 7 + 1, probes  # 2 decoder layers of 7 projections, and lm_head
            assert probes["forwards"] == probes["eager"] == probes["backwards"] == n and probes["bad"] == [], probes
    for run in report["runs"].values():
        assert run["sharded"] and run["local_numel"] < run["param_numel"], run
