"""Shared fixtures: an isolated kernel cache, the CUDA skip, the one error measure against float64,
and a simulated H200 whose kernels are emulated on the CPU (tests/emulation.py)."""
from __future__ import annotations

import importlib
import math

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


def outcome(fn):
    """(exception type name, message) of ``fn()``, or None when it returns: for comparing fastmm's
    errors with torch's own, word for word."""
    try:
        fn()
    except Exception as exc:  # (the caller's comparison is the assertion)
        return type(exc).__name__, str(exc)
    return None


def relative_error(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None = None, *,
                   scale: str = "product") -> float:
    """||c - ref||_F / ||ref||_F, in float64: ref = a @ b, or ``a`` itself where ``b`` is None (a
    reference computed already). ``scale="abs"``: divided by || |A| @ |B| ||_F instead (rounding
    errors are bounded element-wise by a multiple of (|A| |B|)_ij, so this stays meaningful where
    the product cancels or K is tiny). Where the scale is zero (a zero reference, K = 0), the
    error is 0.0 for an exact result and inf otherwise."""
    if b is None:
        assert scale == "product", "scale='abs' needs the operands"
        ref = a.detach().double()
    else:
        ref = torch.matmul(a.detach().double(), b.detach().double())
    assert tuple(c.shape) == tuple(ref.shape), f"result shape {tuple(c.shape)} != reference {tuple(ref.shape)}"
    diff = (c.detach().double() - ref).norm().item()
    if scale == "abs":
        norm = torch.matmul(a.detach().double().abs(), b.detach().double().abs()).norm().item()
    else:
        assert scale == "product", scale
        norm = ref.norm().item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


CANARY = -12345.0


def at_offset(shape, offset: int, fill: float | None = None, device="cuda") -> torch.Tensor:
    """A tensor of ``shape`` starting ``offset`` floats into its storage (randn, or ``fill``): the
    pointer is then only 4- or 8-byte aligned, which the kernels' single-float paths must take."""
    n = math.prod(shape)
    base = torch.randn(n + offset + 5, device=device) if fill is None else torch.full((n + offset + 5,), fill, device=device)
    return base[offset:offset + n].view(shape)


def guarded_outputs(M: int, N: int, device="cuda", guard: int = 4096):
    """Two M x N outputs with a canary value all around them, for a kernel that must write its
    output and nothing else: a contiguous one inside a flat buffer with ``guard`` floats either
    side, and a window (1 row and 4 columns in) of an (M + 2) x (N + 8) matrix, i.e. rows with a
    pitch of N + 8. Returns (out, out2, untouched): untouched() is True while nothing outside the
    two was written."""
    flat = torch.full((guard + M * N + guard,), CANARY, device=device)
    out = flat[guard:guard + M * N].view(M, N)
    padded = torch.full((M + 2, N + 8), CANARY, device=device)
    out2 = padded[1:M + 1, 4:N + 4]
    outside = torch.ones_like(padded, dtype=torch.bool)
    outside[1:M + 1, 4:N + 4] = False

    def untouched() -> bool:
        return bool(torch.all(flat[:guard] == CANARY) and torch.all(flat[guard + M * N:] == CANARY)
                    and torch.all(padded[outside] == CANARY))
    return out, out2, untouched


@pytest.fixture
def rel_err():
    """The :func:`relative_error` function (a fixture so test modules need no import path)."""
    return relative_error


def run_forced(a, b, family, precision, out=None, variants=()):
    """``fastmm.dispatch.matmul_fastmm`` forced onto ``family``: (result, plan). Skips where the GPU
    cannot run the family (e.g. cp.async on sm75); a fallback to torch fails the test."""
    from fastmm import dispatch

    try:
        result, plan, reason = dispatch.matmul_fastmm(a, b, out, precision, force=family, variants=variants)
    except ValueError as exc:
        # the GPU cannot run the family
        if any(why in str(exc) for why in ("needs sm", "sm_90a instruction")):
            pytest.skip(str(exc))
        raise
    assert reason is None, f"fell back to torch: {reason}"
    return result, plan


class _OnCuda:
    """A CPU tensor as fastmm.dispatch.not_served_reason sees it on the simulated GPU: on cuda:0,
    everything else its own (dtype, layout, ...), so the other rules still apply."""

    device = torch.device("cuda", 0)

    def __init__(self, t):
        self._t = t

    def __getattr__(self, name):
        return getattr(self._t, name)


def simulate_h200(monkeypatch):
    """CPU tensors pass for CUDA ones (float32 ones: fastmm.dispatch.not_served_reason still applies
    its other rules) on a simulated H200 with a usable runtime, empty plan caches (fastmm.dispatch's
    PLANS, fastmm.fast_path's ENTRIES) and no warning given yet: the setting of the emulated GPU
    (the ``emulated_gpu`` fixture, which also replaces the launcher). Current stream: 7. Returns
    the record (tests/emulation.py EmulatedGpu) whose ``slow_calls`` counts the calls that took
    the full path (fastmm.dispatch.run)."""
    from emulation import EmulatedGpu
    from fastmm import dispatch, errors, fast_path
    from fastmm.problem import DeviceFacts

    explain_module = importlib.import_module("fastmm.explain")  # (fastmm.explain is the function)
    real_reason = dispatch.not_served_reason  # (it looks up runtime_reason in the module: patched below)

    def served_as_if_on_cuda(a, b):
        return real_reason(_OnCuda(a), _OnCuda(b))

    monkeypatch.setattr(dispatch, "runtime_reason", lambda: None)
    monkeypatch.setattr(dispatch, "not_served_reason", served_as_if_on_cuda)
    monkeypatch.setattr(explain_module, "not_served_reason", served_as_if_on_cuda)
    monkeypatch.setattr(dispatch, "device_facts", lambda index: DeviceFacts.simulated_device("sm_90", index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # (the steady-state path reads torch's C getter, which a CUDA build of torch has and which
    # raises where no driver is)
    monkeypatch.setattr(fast_path, "_cuda_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(dispatch, "current_stream", lambda index: 7)
    monkeypatch.setattr(dispatch, "PLANS", dispatch.PlanCache())
    monkeypatch.setattr(fast_path, "ENTRIES", {})
    monkeypatch.setattr(errors, "_warned", set())
    for name in ("FASTMM_KERNEL", "FASTMM_TUNE", "FASTMM_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    gpu = EmulatedGpu()
    real_run = dispatch.run

    def counting_run(*args, **kwargs):
        gpu.slow_calls += 1
        return real_run(*args, **kwargs)

    monkeypatch.setattr(dispatch, "run", counting_run)
    return gpu


@pytest.fixture
def emulated_gpu(tmp_cache, monkeypatch):
    """A simulated H200 (:func:`simulate_h200`) whose launches are emulated on the CPU
    (tests/emulation.py): fastmm.matmul on CPU tensors then runs fastmm's own plans, launch
    arguments and runners, and the kernels compute C from the memory those arguments point at.
    Yields the record of launches (``launches``, ``families``) and full-path calls (``slow_calls``)."""
    import emulation
    from fastmm.runtime import arrivals

    arrivals.forget()  # (the emulated stream's counters live in CPU memory made during the test;
    # before the simulation: a real device's counters, made by an earlier test, are freed by it)
    gpu = simulate_h200(monkeypatch)
    emulation.install(monkeypatch, gpu)
    yield gpu
    emulation.forget()
    arrivals.forget()


class CudaLooking:
    """Just enough of a CUDA float32 tensor for fastmm.dispatch.not_served_reason (keywords
    change one attribute: dtype, device, layout, is_sparse, complex, is_nested)."""

    def __init__(self, *shape, dtype=torch.float32, device="cuda:0", layout=torch.strided, is_sparse=False,
                 complex=False, is_nested=False):
        self.shape = torch.Size(shape)
        self.device = torch.device(device)
        self.dtype = dtype
        self.is_sparse = is_sparse
        self.is_nested = is_nested
        self.layout = layout
        self._complex = complex

    def is_complex(self):
        return self._complex
