"""An NVRTC outside the versions fastmm supports (13.x: pyproject's nvidia-cuda-nvrtc>=13,<14) is
not used: fastmm decides so once, explain gives the reason, a CUDA call goes to torch.matmul with
one warning. The version is simulated (fastmm.runtime.compiler.nvrtc_version), so these run on
any machine; what is asserted is fastmm's decision, not torch's result."""
from __future__ import annotations

import warnings

import pytest
import torch

import fastmm
from conftest import CudaLooking
from fastmm import dispatch, errors
from fastmm.errors import FastmmWarning
from fastmm.runtime import compiler


@pytest.fixture
def nvrtc_at(monkeypatch):
    """Pretend the NVRTC library reports (major, minor); dispatch's once-per-process decision
    and the warnings given so far are reset (and reset again after the test)."""
    try:
        compiler._cuda_core()
    except Exception as exc:  # the version check comes after cuda.core's import
        pytest.skip(f"cuda.core is not importable here: {exc}")
    monkeypatch.setattr(errors, "_warned", set())
    monkeypatch.delenv("FASTMM_DISABLE", raising=False)
    dispatch.runtime_reason.cache_clear()

    def use(major: int, minor: int) -> None:
        monkeypatch.setattr(compiler, "nvrtc_version", lambda: (major, minor))
        dispatch.runtime_reason.cache_clear()

    yield use
    dispatch.runtime_reason.cache_clear()


@pytest.mark.parametrize("version", [(12, 8), (12, 9), (14, 0), (11, 8)])
def test_an_nvrtc_outside_13x_is_not_used_and_explain_says_why(nvrtc_at, version):
    nvrtc_at(*version)
    reason = compiler.nvrtc_unavailable_reason()
    assert reason is not None
    assert "NVRTC %d.%d" % version in reason and "13.x" in reason and "nvidia-cuda-nvrtc>=13,<14" in reason
    assert dispatch.runtime_reason() == reason
    assert dispatch.runtime_reason() is dispatch.runtime_reason()  # decided once per process
    a, b = CudaLooking(64, 32), CudaLooking(32, 16)
    assert dispatch.not_served_reason(a, b) == reason  # a CUDA float32 call: NVRTC is the reason
    exp = fastmm.explain(a, b, precision="ieee")
    assert exp.kernel is None and exp.fallback == reason
    assert f"runs: torch.matmul, because {reason}" in str(exp)


@pytest.mark.parametrize("version", [(13, 0), (13, 5), (13, 9)])
def test_every_13x_nvrtc_is_used(nvrtc_at, version):
    nvrtc_at(*version)
    assert compiler.nvrtc_unavailable_reason() is None
    assert dispatch.runtime_reason() is None


class _CudaCall:
    """A CPU tensor as dispatch.matmul_fastmm sees a CUDA operand (is_cuda, device cuda:0);
    torch itself is never reached: dispatch.fallback is replaced in the test."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, t):
        self._t = t

    def __getattr__(self, name):
        return getattr(self._t, name)


def test_an_unsupported_nvrtc_is_warned_once_and_torch_serves_every_call(nvrtc_at, monkeypatch):
    nvrtc_at(12, 8)
    handed = []

    def to_torch(a, b, out, precision, reason):
        handed.append(reason)
        return "torch's result"

    monkeypatch.setattr(dispatch, "fallback", to_torch)
    a, b = _CudaCall(torch.randn(64, 32)), _CudaCall(torch.randn(32, 16))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for precision in ("ieee", "tf32", "ieee"):
            result, plan, reason = dispatch.matmul_fastmm(a, b, None, precision)
            assert result == "torch's result" and plan is None
    ours = [str(w.message) for w in seen if issubclass(w.category, FastmmWarning)]
    assert len(ours) == 1, ours
    assert "NVRTC 12.8" in ours[0] and "13.x" in ours[0] and "torch.matmul" in ours[0]
    assert handed == [compiler.nvrtc_unavailable_reason()] * 3
