"""Shared fixtures: an isolated kernel cache, the CUDA skip, and the float64 error measure."""
from __future__ import annotations

import pytest
import torch

import fastmm.runtime.cache as cache_module

HAS_CUDA = torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped when torch.cuda.is_available() is False")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


#: For single tests outside a module marked ``cuda``.
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """Point the process-wide kernel cache at a fresh folder for one test (restored after)."""
    folder = tmp_path / "fastmm-cache"
    monkeypatch.setenv("FASTMM_CACHE_DIR", str(folder))
    monkeypatch.setattr(cache_module, "_default", None)
    return folder


def relative_error(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """||c - a@b||_F / ||a@b||_F with the reference and the difference in float64."""
    ref = torch.matmul(a.double(), b.double())
    assert tuple(c.shape) == tuple(ref.shape), f"result shape {tuple(c.shape)} != reference {tuple(ref.shape)}"
    return ((c.double() - ref).norm() / ref.norm()).item()


@pytest.fixture
def rel_err():
    """The :func:`relative_error` function (a fixture so test modules need no import path)."""
    return relative_error


def run_forced(a, b, family, precision, out=None):
    """``fastmm.api.matmul_fastmm`` forced onto ``family``: (result, plan). Skips where the GPU
    cannot run the family (e.g. cp.async on sm75); a fallback to torch fails the test."""
    from fastmm import api

    try:
        result, plan, reason = api.matmul_fastmm(a, b, out, precision, force=family)
    except ValueError as exc:
        # the GPU cannot run the family
        if any(why in str(exc) for why in ("needs sm", "sm_90a instruction")):
            pytest.skip(str(exc))
        raise
    assert reason is None, f"fell back to torch: {reason}"
    return result, plan


def simulate_h200(monkeypatch):
    """CPU tensors pass for CUDA ones on a simulated H200 with an empty plan cache: the setting of
    the CPU emulation fixtures (tests/test_fast_path.py, tests/test_wgmma_host.py), which then
    replace the launcher with their kernel emulations. Current stream: 7. Returns the record
    they fill: ``launches`` (theirs to append to) and ``slow_calls``, the calls that took the
    full path (api._run)."""
    import importlib
    import types

    from fastmm import api
    from fastmm.problem import DeviceFacts

    explain_module = importlib.import_module("fastmm.explain")  # (fastmm.explain is the function)
    monkeypatch.setattr(api, "_not_served_reason", lambda a, b: None)
    monkeypatch.setattr(explain_module, "_not_served_reason", lambda a, b: None)
    monkeypatch.setattr(api, "device_facts", lambda index: DeviceFacts.simulated_device("sm_90", index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(api, "_current_stream", lambda index: 7)
    monkeypatch.setattr(api, "_prepared", {})
    monkeypatch.setattr(api, "_fast", {})
    monkeypatch.setattr(api, "_failed", {})
    for name in ("FASTMM_KERNEL", "FASTMM_TUNE", "FASTMM_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    gpu = types.SimpleNamespace(launches=[], slow_calls=0)
    real_run = api._run

    def counting_run(*args, **kwargs):
        gpu.slow_calls += 1
        return real_run(*args, **kwargs)

    monkeypatch.setattr(api, "_run", counting_run)
    return gpu
