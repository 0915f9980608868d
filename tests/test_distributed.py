"""torch.distributed: a 2-process DDP training step of a fastmm-patched model equals a 1-process
run on the concatenated batch, and the processes share one kernel cache without corrupting it.

The work is benchmarks/ddp_check.py (also a standalone script for a 2-GPU machine); these tests
run it in a subprocess and check its report and the cache it leaves behind:
- on two GPUs (NCCL), the real thing (skipped with fewer than two GPUs);
- on the CPU (gloo), in CI: the same script, DDP and fastmm.patch's layers, with torch computing
  (fastmm hands CPU tensors to torch.matmul).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fastmm.runtime.cache import DiskCache

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "ddp_check.py"


def run_check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict, Path]:
    cache = tmp_path / "shared-cache"
    report = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cache-dir", str(cache), "--json", str(report), *args],
                          capture_output=True, text=True, env=env, timeout=600, cwd=str(REPO))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc, json.loads(report.read_text()), cache


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.skipif(not dist.is_available() or not dist.is_nccl_available(), reason="torch built without NCCL")
def test_two_gpu_ddp_step_matches_one_process_and_the_shared_cache_stays_valid(tmp_path):
    proc, report, cache = run_check(tmp_path, "--precision", "ieee", "--precision", "tf32", "--precision", "tf32x3")
    print(proc.stdout)  # the report, for the log (pytest -s or -rA)
    assert report["ok"] and report["problems"] == [], proc.stdout
    for precision, r in report["precisions"].items():
        assert not any(k.startswith("torch") for k in r["kernels"]), (precision, r["kernels"])
        assert max(r["worst_rel_error"].values()) <= r["tolerance"]
    results = DiskCache(cache).verify()
    assert results and all(ok for _, ok in results), [p.name for p, ok in results if not ok]
    assert list(cache.glob("*.tmp")) == [] and list(cache.glob(".*.tmp")) == []
    c = report["cache"]
    assert sum(c["compiles_per_rank"]) + c["compiles_reference"] == len(results)  # each kernel compiled once


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
def test_ddp_check_on_cpu_processes(tmp_path):
    proc, report, cache = run_check(tmp_path, "--cpu", "--precision", "ieee", "--steps", "1")
    assert report["ok"] and report["device"] == "cpu (gloo)", proc.stdout
    w = report["precisions"]["ieee"]["worst_rel_error"]
    assert max(w.values()) <= 1e-5
    assert w["grad"] > 0  # two computations (ranks vs one process), not one result compared with itself
    assert "ddp_check: OK" in proc.stdout
