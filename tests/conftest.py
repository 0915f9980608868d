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
        # the GPU cannot run the family, or (wgmma) a batched operand it only reads K-major
        if any(why in str(exc) for why in ("needs sm", "sm_90a instruction", "batched operands must already be K-major",
                                           "made for a batch of 1 only")):
            pytest.skip(str(exc))
        raise
    assert reason is None, f"fell back to torch: {reason}"
    return result, plan
