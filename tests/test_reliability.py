"""Reliability: special values, faults and concurrency.

GPU (skipped without CUDA):
- NaN, +-Inf and subnormal inputs (and subnormal products) come out as torch.matmul's float32
  result at the same precision says, for every kernel family and the split-K reduce;
- 8 Python threads on 8 streams with different shapes: all correct, each kernel compiled once;
- tensors on cuda:1 (two GPUs) run on modules loaded for device 1, and explain names cuda:1;
- a compile error, an unusable NVRTC, a full disk: a warning once, torch.matmul or memory-only
  operation, explain says why.
CPU (CI): the same fault paths at the level a CPU reaches (fastmm.dispatch with a simulated device up
to the kernel load, the disk cache with real NVRTC and simulated I/O errors), stale entries after a
change of source, fastmm version or NVRTC version, and the ``python -m fastmm cache`` commands.
"""
from __future__ import annotations

import errno
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import fastmm
import fastmm.runtime.cache as cache_module
from fastmm import dispatch, errors, fast_path
from fastmm.errors import FastmmWarning
from fastmm.families import FAMILIES
from fastmm.plan import select
from fastmm.precision import torch_precision
from fastmm.problem import DeviceFacts, Problem
from fastmm.runtime import compiler, launcher, sources
from fastmm.runtime.cache import CacheWarning, DiskCache, decode, default_cache
from fastmm.runtime.compiler import CompileError, compile_cubin
from conftest import CudaLooking, relative_error, run_forced, simulate_h200

REPO = Path(__file__).resolve().parent.parent
HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
explain_module = importlib.import_module("fastmm.explain")  # (fastmm.explain is the function)
PRECISIONS = ("ieee", "tf32", "tf32x3")
TOL = {"ieee": 1e-5, "tf32": 1e-3, "tf32x3": 1e-5}  # element-wise, relative to (|A| |B|)_ij
NAN, INF = float("nan"), float("inf")


@pytest.fixture
def fresh_state(tmp_cache, monkeypatch):
    """A new process, in effect: empty kernel cache folder, nothing loaded or planned, no
    warnings given yet (all restored after the test)."""
    monkeypatch.setattr(launcher, "_modules", {})
    monkeypatch.setattr(dispatch, "PLANS", dispatch.PlanCache())
    monkeypatch.setattr(fast_path, "ENTRIES", {})
    monkeypatch.setattr(errors, "_warned", set())
    return tmp_cache


@pytest.fixture
def fresh_runtime_reason():
    """dispatch.runtime_reason asked afresh in this test (it is decided once per process), and
    again after it: the test's fault must not stay cached for the tests that follow."""
    dispatch.runtime_reason.cache_clear()
    yield
    dispatch.runtime_reason.cache_clear()


def recorded(category):
    """Context manager recording every warning; .of(category) filters them."""

    class Rec(warnings.catch_warnings):
        def __enter__(self):
            self.list = super().__enter__()
            warnings.simplefilter("always")
            return self

        def of(self, cat=category):
            return [w for w in self.list if issubclass(w.category, cat)]

    return Rec(record=True)


def torch_at(precision: str, a, b):
    """torch.matmul as the precision asks (tf32x3 and ieee: full fp32)."""
    with torch_precision(precision):
        return torch.matmul(a, b)


def abs_scale(a, b) -> torch.Tensor:
    """(|A| |B|) in float64 with non-finite inputs counted as 0 (a finite output has none)."""
    fa = torch.where(torch.isfinite(a), a, 0).double().abs()
    fb = torch.where(torch.isfinite(b), b, 0).double().abs()
    return torch.matmul(fa, fb)


# =============================================================================================
# GPU: special values

#: (family, precision, M, N, K); "dispatch" = the dispatcher's choice (these shapes split K)
SPECIAL_CASES = [
    ("skinny", "ieee", 5, 67, 45), ("skinny", "ieee", 8, 128, 64),
    ("scalar", "ieee", 70, 67, 45),
    ("simt_float4", "ieee", 70, 67, 45), ("simt_float4", "ieee", 64, 128, 64),
    ("simt_cp_async", "ieee", 70, 67, 45), ("simt_cp_async", "ieee", 64, 128, 64),
    ("tf32_mma", "tf32", 70, 67, 45), ("tf32_mma", "tf32", 64, 128, 64),
    ("tf32_mma", "tf32x3", 70, 67, 45), ("tf32_mma", "tf32x3", 64, 128, 64),
    ("dispatch", "ieee", 64, 64, 2048), ("dispatch", "tf32", 64, 64, 4096), ("dispatch", "tf32x3", 64, 64, 4096),
    ("dispatch", "ieee", 16, 512, 1024),
    # staged: operands copied into zero-padded aligned buffers first (plan.staging; large M or N)
    ("simt_cp_async", "ieee", 1030, 130, 65), ("tf32_mma", "tf32", 1030, 1030, 7), ("tf32_mma", "tf32x3", 1030, 1030, 7),
]
SPECIAL_IDS = [f"{f}-{p}-{m}x{n}x{k}" for f, p, m, n, k in SPECIAL_CASES]


def run_family(family, precision, a, b):
    if family == "dispatch":
        exp = fastmm.explain(a, b, precision=precision)
        assert exp.kernel is not None, str(exp)
        return fastmm.matmul(a, b, precision=precision)
    result, plan = run_forced(a, b, family, precision)
    assert plan.kernel.family == family
    if max(a.shape[0], b.shape[1]) >= 1024:  # the staging cases of SPECIAL_CASES
        assert plan.staging, "expected a staged operand"
    return result


def special_inputs(M, N, K, seed=0):
    """randn A, B with NaN, +-Inf and 0 placed so that C has NaN rows and columns, +-Inf,
    Inf * 0 = NaN and Inf - Inf = NaN entries (M >= 4, N >= 6, K >= 6)."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
    a[0, 0] = NAN  # row 0 of C: NaN
    b[2, 0] = NAN  # column 0 of C: NaN
    a[1, 1] = INF  # row 1: +-Inf by the sign of B[1, n] ...
    b[1, 3] = 0.0  # ... and Inf * 0 = NaN at (1, 3)
    a[2, 1], a[2, 3] = INF, -INF  # row 2: Inf - Inf = NaN where B[1, n], B[3, n] > 0
    b[1, 4], b[3, 4] = 1.0, 1.0
    b[5, 5] = -INF  # column 5: -+Inf by the sign of A[m, 5] ...
    a[3, 5] = 0.0  # ... and 0 * -Inf = NaN at (3, 5)
    a[M - 1, K - 1] = -INF  # the last row, through the last k (edge tiles)
    b[K - 1, N - 1] = INF
    return a, b


@requires_cuda
@pytest.mark.parametrize("family,precision,M,N,K", SPECIAL_CASES, ids=SPECIAL_IDS)
def test_nan_and_inf_propagate_as_in_torch(family, precision, M, N, K):
    a, b = special_inputs(M, N, K)
    a, b = a.cuda(), b.cuda()
    got = run_family(family, precision, a, b)
    ref = torch_at(precision, a, b)
    torch.cuda.synchronize()
    for name, f in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
        mine, theirs = f(got), f(ref)
        assert torch.equal(mine, theirs), (
            f"{name} at {mine.sum().item()} places, torch has {theirs.sum().item()}; differ at "
            f"{(mine != theirs).nonzero()[:8].tolist()}")
    assert torch.isnan(ref[0]).all() and torch.isnan(ref[:, 0]).all() and torch.isnan(ref[1, 3])
    finite = torch.isfinite(ref)
    bound = TOL[precision] * abs_scale(a, b)[finite] + 1e-30
    diff = (got[finite].double() - torch.matmul(a.double(), b.double())[finite]).abs()
    assert torch.all(diff <= bound), f"finite entries: worst {(diff / bound).max().item():.2f} x the tolerance"


def _ints(shape, g):
    """Nonzero small integers (+-1..3): exact in TF32, summed exactly in fp32."""
    return torch.randint(1, 4, shape, generator=g).float() * (torch.randint(0, 2, shape, generator=g) * 2 - 1)


@requires_cuda
@pytest.mark.parametrize("family,precision,M,N,K", SPECIAL_CASES, ids=SPECIAL_IDS)
@pytest.mark.parametrize("kind", ["subnormal_inputs", "subnormal_products"])
def test_subnormals_are_kept_as_in_torch(kind, family, precision, M, N, K):
    """Subnormal inputs (+-1..3 * 2^-130, which TF32 holds exactly too) times normal ones
    (* 2^90), and normal inputs whose products are subnormal (2^-70 * 2^-70 = 2^-140): every
    product and partial sum is a multiple of 2^-149 or 2^-40 small enough to be exact in fp32, so
    a kernel that keeps subnormals (no flush to zero) matches float64 bit for bit, as torch's fp32
    matmul does. tf32x3 must too (fp32-accurate). At "tf32" the tensor cores may flush subnormal
    products: there the result must match torch's TF32 result or the exact one."""
    g = torch.Generator().manual_seed(1)
    if kind == "subnormal_inputs":
        a, b = _ints((M, K), g) * 2.0**-130, _ints((K, N), g) * 2.0**90
    else:
        a, b = _ints((M, K), g) * 2.0**-70, _ints((K, N), g) * 2.0**-70
    exact = torch.matmul(a.double(), b.double())
    assert torch.equal(exact.float().double(), exact)  # representable: the check can be exact
    assert (a.abs() < torch.finfo(torch.float32).tiny).all() if kind == "subnormal_inputs" else \
        (exact.abs() < torch.finfo(torch.float32).tiny).all()
    a, b = a.cuda(), b.cuda()
    got = run_family(family, precision, a, b).cpu()
    torch.cuda.synchronize()
    if precision == "tf32" and not torch.equal(got.double(), exact):
        theirs = torch_at("tf32", a, b).cpu()
        assert torch.equal(got, theirs), "neither the exact product nor torch's TF32 result"
        return
    wrong = (got.double() != exact)
    assert not wrong.any(), (f"{int(wrong.sum())} of {exact.numel()} differ (flushed to zero: "
                             f"{int(((got == 0) & (exact != 0)).sum())}); torch fp32 matches: "
                             f"{torch.equal(torch_at('ieee', a, b).cpu().double(), exact)}")


# =============================================================================================
# GPU: threads, streams, devices

THREAD_SHAPES = [  # (M, N, K, precision): tiled, split-K, skinny, scalar, tensor cores ...
    (300, 200, 100, "ieee"), (64, 64, 1024, "ieee"), (16, 512, 256, "ieee"), (3, 5, 4, "ieee"),
    (129, 96, 132, "tf32"), (257, 129, 193, "tf32x3"), (1000, 64, 64, "tf32"), (64, 64, 4096, "tf32x3"),
]


@requires_cuda
def test_eight_threads_on_eight_streams_compile_each_kernel_once(fresh_state):
    g = torch.Generator(device="cuda")
    g.manual_seed(3)
    cases = []
    for M, N, K, prec in THREAD_SHAPES:
        a = torch.randn(M, K, device="cuda", generator=g)
        b = torch.randn(K, N, device="cuda", generator=g)
        cases.append((a, b, prec))
    keys = set()
    for a, b, prec in cases:
        plan = fastmm.explain(a, b, precision=prec).plan
        keys |= {launcher.key_for(cfg, plan.device.arch) for cfg in (plan.kernel, plan.reduce) if cfg is not None}
    torch.cuda.synchronize()
    start = threading.Barrier(8)
    errors: list[str] = []

    def worker(i: int) -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                start.wait(60)
                order = [0] + [(i + j) % len(cases) for j in range(len(cases))]  # all 8 on case 0 at once first
                for rep in range(3):
                    for j in order:
                        a, b, prec = cases[j]
                        c = fastmm.matmul(a, b, precision=prec)
                        stream.synchronize()
                        err = relative_error(c, a, b, scale="abs")
                        if not err <= TOL[prec]:
                            errors.append(f"thread {i} case {j} rep {rep}: error {err:.2e}")
        except Exception as exc:  # reported below, with the thread that saw it
            errors.append(f"thread {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert errors == []
    assert default_cache().compiles == len(keys), f"{default_cache().compiles} compiles for {len(keys)} kernels"
    assert {key for _, key, _ in launcher._modules} == keys and len(launcher._modules) == len(keys)
    assert len(list(fresh_state.glob("*.cubin"))) == len(keys)


@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_cuda1_run_on_modules_loaded_for_device_1(fresh_state):
    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda:1")
    g.manual_seed(5)
    a = torch.randn(300, 200, device="cuda:1", generator=g)
    b = torch.randn(200, 100, device="cuda:1", generator=g)
    current = []  # torch's current device after each first call (checked last)
    for precision in PRECISIONS:
        exp = fastmm.explain(a, b, precision=precision)
        assert exp.device.startswith("cuda:1 ") and "on cuda:1" in str(exp), str(exp)
        assert exp.plan.device.index == 1 and exp.kernel is not None
        key = launcher.key_for(exp.plan.kernel, exp.plan.device.arch)
        c = fastmm.matmul(a, b, precision=precision)
        assert c.device == a.device
        assert (1, key, exp.plan.kernel.entry) in launcher._modules and (0, key, exp.plan.kernel.entry) not in launcher._modules
        current.append(torch.cuda.current_device())
        torch.cuda.synchronize(1)
        assert relative_error(c, a, b, scale="abs") <= TOL[precision]
        assert fastmm.explain(a, b, precision=precision).cache.startswith("in memory")
    side = torch.cuda.Stream(device=1)  # a side stream of device 1, while device 0 is current
    side.wait_stream(torch.cuda.current_stream(1))
    with torch.cuda.stream(side):
        c = fastmm.matmul(a, b, precision="ieee")
    side.synchronize()
    assert relative_error(c, a, b, scale="abs") <= TOL["ieee"]
    a0, b0 = a.to("cuda:0"), b.to("cuda:0")  # the same problem on device 0 gets its own module
    c0 = fastmm.matmul(a0, b0, precision="ieee")
    kernel = fastmm.explain(a0, b0, precision="ieee").plan.kernel
    key = launcher.key_for(kernel, dispatch.device_facts(0).arch)
    assert (0, key, kernel.entry) in launcher._modules and (1, key, kernel.entry) in launcher._modules
    torch.cuda.synchronize(0)
    assert relative_error(c0, a0, b0, scale="abs") <= TOL["ieee"]
    assert current == [0] * len(PRECISIONS), (
        f"torch's current device after loading modules for cuda:1 was {current}: fastmm changed the caller's "
        "current device (launcher.load sets the CUDA context of the kernel's device current)")


# =============================================================================================
# GPU: faults on the real path

def _broken_compile(calls):
    def broken(source, macros, arch):
        calls.append((source, macros))
        raise CompileError(f"NVRTC failed on {source} for {arch}: error: simulated failure\n(log)")
    return broken


@requires_cuda
def test_compile_error_on_gpu_warns_once_and_torch_serves(fresh_state, monkeypatch):
    calls = []
    monkeypatch.setattr(launcher, "compile_cubin", _broken_compile(calls))
    a, b = torch.randn(300, 200, device="cuda"), torch.randn(200, 100, device="cuda")
    with recorded(FastmmWarning) as rec:
        first = fastmm.matmul(a, b, precision="ieee")
        again = fastmm.matmul(a, b, precision="ieee")
        other = fastmm.matmul(torch.randn(310, 200, device="cuda"), b, precision="ieee")
    assert torch.equal(first, torch_at("ieee", a, b)) and torch.equal(again, first) and other.shape == (310, 100)
    found = rec.of()
    assert len(found) == 1, [str(w.message) for w in found]
    assert "failed to compile" in str(found[0].message) and "torch.matmul" in str(found[0].message)
    exp = fastmm.explain(a, b, precision="ieee")
    assert exp.kernel is None and "failed to compile" in exp.fallback and "simulated failure" in exp.fallback
    assert "runs: torch.matmul, because kernel" in str(exp)
    assert launcher._modules == {}


@requires_cuda
def test_nvrtc_missing_on_gpu_warns_once_and_torch_serves(fresh_state, fresh_runtime_reason, monkeypatch):
    def gone():
        raise OSError("libnvrtc.so.13: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(compiler, "nvrtc_version", gone)
    a, b = torch.randn(300, 200, device="cuda"), torch.randn(200, 100, device="cuda")
    exp = fastmm.explain(a, b, precision="ieee")
    assert exp.kernel is None and "NVRTC is not usable" in exp.fallback and "libnvrtc" in exp.fallback
    with recorded(FastmmWarning) as rec:
        c = fastmm.matmul(a, b, precision="ieee")
        fastmm.matmul(a, b, precision="tf32")
    assert torch.equal(c, torch_at("ieee", a, b))
    found = rec.of()
    assert len(found) == 1 and "NVRTC" in str(found[0].message), (
        f"the issue asks for one clear warning when NVRTC is missing; got {[str(w.message) for w in found]}")


@requires_cuda
@pytest.mark.parametrize("where", ["replace", "mkstemp"])
def test_full_disk_on_gpu_one_warning_then_memory_only(fresh_state, monkeypatch, where):
    calls = _fail_write_with(where, monkeypatch)
    shapes = [(300, 200, 100, "ieee"), (129, 96, 132, "tf32"), (3, 5, 4, "ieee"), (64, 64, 1024, "ieee")]
    with recorded(CacheWarning) as rec:
        for rep in range(2):
            for M, N, K, prec in shapes:
                a, b = torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda")
                c = fastmm.matmul(a, b, precision=prec)
                torch.cuda.synchronize()
                assert relative_error(c, a, b, scale="abs") <= TOL[prec]
    assert len(rec.of()) == 1, [str(w.message) for w in rec.of()]
    assert len(calls) == 1  # the first failed write; after it, nothing touches the disk
    assert list(fresh_state.glob("*.cubin")) == [] and list(fresh_state.glob("*.tmp")) == []
    assert launcher._modules and all(path is None for _, _, path in launcher._modules.values())
    a, b = torch.randn(300, 100, device="cuda"), torch.randn(100, 200, device="cuda")
    assert "memory-only cache" in fastmm.explain(a, b, precision="ieee").cache


# =============================================================================================
# CPU: the full path's fault handling, reached with a simulated device

@pytest.fixture
def simulated_gpu(monkeypatch):
    """CPU tensors pass for CUDA ones on a simulated H200 up to the kernel load (conftest's
    simulate_h200): everything fastmm.dispatch decides before a launch runs here (the load
    itself needs a GPU). Records the reason of every call handed to torch (dispatch.fallback)."""
    simulate_h200(monkeypatch)
    reasons = []
    real = dispatch.fallback

    def spy(a, b, out, precision, reason):
        reasons.append(reason)
        return real(a, b, out, precision, reason)

    monkeypatch.setattr(dispatch, "fallback", spy)
    return reasons


def test_compile_error_warns_once_falls_back_and_explain_says_why(fresh_state, simulated_gpu, monkeypatch):
    calls = []
    monkeypatch.setattr(launcher, "compile_cubin", _broken_compile(calls))
    a, b = torch.randn(300, 200), torch.randn(200, 100)
    with recorded(FastmmWarning) as rec:
        first = fastmm.matmul(a, b, precision="ieee")
        again = fastmm.matmul(a, b, precision="ieee")
        out = torch.full((300, 100), NAN)
        assert fastmm.matmul(a, b, precision="ieee", out=out) is out
    assert first.shape == again.shape == (300, 100) and torch.equal(out, first)
    # every call went to torch, for the compile error (the first one's reason is NVRTC's)
    assert len(simulated_gpu) == 3
    assert all(r.startswith("kernel simt_cp_async failed to compile") for r in simulated_gpu)
    found = rec.of()
    assert len(found) == 1, [str(w.message) for w in found]
    text = str(found[0].message)
    assert "simt_cp_async failed to compile" in text and "simulated failure" in text and "torch.matmul" in text
    assert len(calls) == 1  # remembered: not compiled again for the same problem
    exp = fastmm.explain(a, b, precision="ieee")
    assert exp.kernel is None and exp.fallback.startswith("kernel simt_cp_async failed to compile")
    assert "runs: torch.matmul, because kernel simt_cp_async failed to compile" in str(exp)
    # other kernels are unaffected: a tf32 problem plans its tensor-core kernel as before
    assert fastmm.explain(a, b, precision="tf32").kernel == "wgmma_tf32"
    assert fast_path.ENTRIES == {} and launcher._modules == {}


def test_a_failed_kernel_is_not_recompiled_for_another_shape(fresh_state, simulated_gpu, monkeypatch):
    calls = []
    monkeypatch.setattr(launcher, "compile_cubin", _broken_compile(calls))
    b = torch.randn(200, 100)
    with recorded(FastmmWarning):
        for rows in (300, 310, 320, 330):
            fastmm.matmul(torch.randn(rows, 200), b, precision="ieee")
    assert len(calls) == 1, f"NVRTC ran {len(calls)} times for one failing kernel"
    assert len(simulated_gpu) == 4


@pytest.mark.parametrize("fault", ["nvrtc_library", "cuda_core_import", "sources_missing"])
def test_runtime_unusable_is_the_reason_explain_gives(monkeypatch, fresh_runtime_reason, fault):
    def nvrtc_gone():
        raise OSError("libnvrtc.so.13: cannot open shared object file: No such file or directory")

    def core_gone():
        raise ImportError("No module named 'cuda.core'")

    def sources_gone():
        raise FileNotFoundError("fastmm kernel sources (cuda_src/) not found next to /nowhere")

    target, fake, words = {
        "nvrtc_library": (compiler, ("nvrtc_version", nvrtc_gone), ("NVRTC is not usable", "libnvrtc.so.13")),
        "cuda_core_import": (compiler, ("_cuda_core", core_gone), ("NVRTC is not usable", "cuda.core")),
        "sources_missing": (dispatch, ("source_dir", sources_gone), ("cuda_src/) not found",)),  # (its import of it)
    }[fault]
    monkeypatch.setattr(target, *fake)
    monkeypatch.delenv("FASTMM_DISABLE", raising=False)
    reason = dispatch.runtime_reason()
    assert reason is not None and all(w in reason for w in words), reason
    assert dispatch.runtime_reason() is reason  # decided once per process
    a, b = CudaLooking(64, 32), CudaLooking(32, 16)
    assert dispatch.not_served_reason(a, b) == reason  # a CUDA float32 call: the runtime is the reason
    exp = fastmm.explain(a, b, precision="ieee")
    assert exp.kernel is None and exp.fallback == reason and exp.device == "cuda:0"
    assert f"runs: torch.matmul, because {reason}" in str(exp)
    # CPU operands still name the device first
    assert "cpu" in dispatch.not_served_reason(torch.zeros(2, 2), torch.zeros(2, 2))


# =============================================================================================
# CPU: the disk cache under I/O faults (real NVRTC for the first kernel, fake ones after)

def _configs(n: int):
    dev = DeviceFacts.simulated_device("sm_90")
    out = []
    for p in (Problem.dense(16, 16, 16), Problem.dense(512, 512, 512), Problem.dense(512, 512, 512, "tf32"),
              Problem.dense(8, 512, 512)):
        cfg = select(p, dev).kernel
        out.append((f"{cfg.family}-sm_90", launcher.key_for(cfg, "sm_90"), cfg))
    return out[:n]


class _ModuleWith:
    """A stand-in for a module (os, tempfile) as fastmm.runtime.cache sees it, with some
    functions replaced: only the cache's calls are affected, not the rest of the process."""

    def __init__(self, module, **replaced):
        self._module = module
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(self._module, name)


def _fail_write_with(where, monkeypatch):
    """Make the cache's entry write fail with ENOSPC at ``where``; returns the call log."""
    calls = []

    def no_space(*args, **kwargs):
        calls.append(where)
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "replace":
        monkeypatch.setattr(cache_module, "os", _ModuleWith(os, replace=no_space))
    elif where == "mkstemp":
        monkeypatch.setattr(cache_module, "tempfile", _ModuleWith(cache_module.tempfile, mkstemp=no_space))
    elif where == "write":
        real_fdopen = os.fdopen

        class Full:
            def __init__(self, fh):
                self.fh = fh

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.fh.close()

            def write(self, data):
                no_space()

            def flush(self):
                pass

            def fileno(self):
                return self.fh.fileno()

        monkeypatch.setattr(cache_module, "os", _ModuleWith(os, fdopen=lambda fd, mode="r", *a, **k: Full(real_fdopen(fd, mode))))
    return calls


@pytest.mark.parametrize("where", ["replace", "write", "mkstemp"])
def test_full_disk_gives_one_warning_and_the_kernels_anyway(tmp_path, monkeypatch, where):
    cache = DiskCache(tmp_path)
    assert cache.usable()  # the folder was fine when first probed; the disk fills up later
    calls = _fail_write_with(where, monkeypatch)
    (name0, key0, cfg0), *others = _configs(3)
    with recorded(CacheWarning) as rec:
        first = cache.get_or_compile(name0, key0, "sm_90", lambda: compile_cubin(cfg0.source, cfg0.macros, "sm_90"))
        rest = [cache.get_or_compile(n, k, "sm_90", lambda: b"fake cubin " + k.encode()) for n, k, _ in others]
        again = cache.get_or_compile(name0, key0, "sm_90", lambda: b"recompiled")
    assert first.state == "compiled" and first.cubin[:4] == b"\x7fELF" and first.path is None
    assert [r.cubin for r in rest] == [b"fake cubin " + k.encode() for _, k, _ in others]
    assert again.cubin == b"recompiled"  # memory-only: the caller (the launcher) keeps the modules
    warned = rec.of()
    assert len(warned) == 1, [str(w.message) for w in warned]
    assert "No space left on device" in str(warned[0].message) and "memory only" in str(warned[0].message)
    assert calls == [where]  # one failed attempt, then the disk is left alone
    assert not cache.usable()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == []


def test_default_cache_stays_memory_only_after_a_failed_write(tmp_cache, monkeypatch):
    _fail_write_with("replace", monkeypatch)
    cache = default_cache()
    with recorded(CacheWarning) as rec:
        cache.get_or_compile("x-sm_90", "a" * 64, "sm_90", lambda: b"one")
        assert default_cache() is cache and not default_cache().usable()
        default_cache().get_or_compile("x-sm_90", "b" * 64, "sm_90", lambda: b"two")
    assert len(rec.of()) == 1


def test_unavailable_file_lock_does_not_stop_the_cache(tmp_path, monkeypatch):
    """flock can fail (ENOLCK on some network file systems): compile without the lock."""
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    res = DiskCache(tmp_path).get_or_compile("x-sm_90", "c" * 64, "sm_90", lambda: b"payload")
    assert res.state == "compiled" and res.cubin == b"payload" and res.path is not None
    assert DiskCache(tmp_path).get_or_compile("x-sm_90", "c" * 64, "sm_90", lambda: b"other").state == "disk"


def test_unreadable_entry_is_reported_bad_not_raised(tmp_path):
    cache = DiskCache(tmp_path)
    good = cache.get_or_compile("x-sm_90", "d" * 64, "sm_90", lambda: b"payload").path
    (tmp_path / "x-sm_90-folder.cubin").mkdir()  # something the cache cannot read as a file
    assert dict(cache.verify()) == {good: True, tmp_path / "x-sm_90-folder.cubin": False}


# =============================================================================================
# CPU: stale entries

@pytest.fixture
def scratch_cuda_src(tmp_path, monkeypatch):
    copy = tmp_path / "cuda_src"
    shutil.copytree(sources.source_dir(), copy)
    monkeypatch.setattr(sources, "source_dir", lambda: copy)
    for fn in (sources.read_source, sources.source_digest):
        fn.cache_clear()
    yield copy
    for fn in (sources.read_source, sources.source_digest):
        fn.cache_clear()


def test_changed_source_version_or_nvrtc_never_reuses_a_stale_entry(tmp_path, scratch_cuda_src, monkeypatch):
    dev = DeviceFacts.simulated_device("sm_90")
    cfg = select(Problem.dense(512, 512, 512, "tf32"), dev).kernel
    name = f"{cfg.family}-sm_90"
    folder = tmp_path / "cache"
    seen = []

    def fetch(payload):
        for fn in (sources.read_source, sources.source_digest):
            fn.cache_clear()
        key = launcher.key_for(cfg, "sm_90")
        res = DiskCache(folder).get_or_compile(name, key, "sm_90", lambda: payload)
        seen.append(key)
        return res

    assert (fetch(b"v1").state, fetch(b"never").cubin) == ("compiled", b"v1")
    (scratch_cuda_src / cfg.source).write_text((scratch_cuda_src / cfg.source).read_text() + "\n// changed\n")
    assert (fetch(b"v2 source").state, fetch(b"v2 source").cubin) == ("compiled", b"v2 source")
    (scratch_cuda_src / "ptx.cuh").write_text((scratch_cuda_src / "ptx.cuh").read_text() + "\n// header\n")
    assert fetch(b"v3 header").cubin == b"v3 header"
    monkeypatch.setattr(cache_module, "__version__", "999.0.0")
    assert fetch(b"v4 fastmm").cubin == b"v4 fastmm"
    monkeypatch.setattr(launcher, "nvrtc_version", lambda: (99, 9))
    assert fetch(b"v5 nvrtc").cubin == b"v5 nvrtc"
    assert len(set(seen)) == 5  # five keys, in the order of the changes
    entries = DiskCache(folder).entries()
    assert len(entries) == 5 and all(dict(DiskCache(folder).verify()).values())
    # an old entry copied over the new key's file is not taken for it
    newest = DiskCache(folder).path_for(name, seen[-1])
    oldest = DiskCache(folder).path_for(name, seen[0])
    newest.write_bytes(oldest.read_bytes())
    res = DiskCache(folder).get_or_compile(name, seen[-1], "sm_90", lambda: b"v5 again")
    assert (res.state, res.cubin) == ("compiled", b"v5 again")
    assert decode(newest.read_bytes(), "sm_90", seen[-1]) == b"v5 again"


# =============================================================================================
# CPU: the cache command line

def _cli(args, folder, check_rc=0):
    env = dict(os.environ, FASTMM_CACHE_DIR=str(folder), PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "fastmm", *args], capture_output=True, text=True, env=env, timeout=300,
                          cwd=str(REPO))
    if check_rc is not None:
        assert proc.returncode == check_rc, f"{args}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_cache_cli_lists_verifies_precompiles_and_clears(tmp_path):
    if compiler.nvrtc_unavailable_reason() is not None:
        pytest.skip(compiler.nvrtc_unavailable_reason())
    folder = tmp_path / "kernels"
    proc = _cli(["cache", "precompile", "--arch", "sm_90"], folder)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("sm_90 (")]
    assert line and " compiled, 0 already cached" in line[0], proc.stdout
    n = int(line[0].split(": ")[1].split(" kernels")[0])
    assert n >= len(FAMILIES) and f"{n}/{n}" in proc.stderr, (proc.stdout, proc.stderr)  # the progress bar
    entries = sorted(folder.glob("*.cubin"))
    assert len(entries) == n
    assert {p.name.split("-sm_90")[0] for p in entries} >= set(FAMILIES) | {"splitk_reduce", "stage_kmajor"}
    assert any(p.name.startswith("wgmma_tf32-sm_90a-") for p in entries)  # built for its own target

    listing = _cli(["cache", "list"], folder).stdout
    total = sum(p.stat().st_size for p in entries)
    assert f"{n} entries, {total:,d} B in {folder}" in listing
    assert all(p.name in listing for p in entries)
    assert f"{n} valid, 0 bad" in _cli(["cache", "verify"], folder).stdout

    entries[0].write_bytes(entries[0].read_bytes()[:100])  # truncated
    (folder / "stray-sm_90-0123.cubin").write_bytes(b"garbage")
    proc = _cli(["cache", "verify"], folder, check_rc=1)
    assert f"{n - 1} valid, 2 bad" in proc.stdout and f"BAD  {entries[0].name}" in proc.stdout
    proc = _cli(["cache", "verify", "--delete-bad"], folder)
    assert "deleted 2 bad entries" in proc.stdout and not entries[0].exists()
    proc = _cli(["cache", "precompile", "--arch", "sm_90"], folder)  # only the deleted one again
    assert f"1 compiled, {n - 1} already cached" in proc.stdout, proc.stdout
    assert f"{n} valid, 0 bad" in _cli(["cache", "verify"], folder).stdout

    assert f"removed {n} entries from {folder}" in _cli(["cache", "clear"], folder).stdout
    assert list(folder.glob("*.cubin")) == [] and list(folder.glob("*.lock")) == []


def test_cache_cli_error_paths(tmp_path, monkeypatch, capsys):
    """In-process (the same main() the subprocess runs): an empty list, an unknown arch, no GPU."""
    from fastmm import cli

    monkeypatch.setenv("FASTMM_CACHE_DIR", str(tmp_path / "none-yet"))
    monkeypatch.setattr(cache_module, "_default", None)
    assert cli.main(["cache", "list"]) == 0
    assert f"0 entries, 0 B in {tmp_path / 'none-yet'}" in capsys.readouterr().out
    assert cli.main(["cache", "verify"]) == 0 and cli.main(["cache", "clear"]) == 0
    capsys.readouterr()
    assert cli.main(["cache", "precompile", "--arch", "sm_52"]) == 2
    assert "unsupported arch ['sm_52']" in capsys.readouterr().err
    monkeypatch.setattr(cli, "gpu_reason", lambda: "torch.cuda.is_available() is False: no CUDA device or driver")
    assert cli.main(["cache", "precompile"]) == 2
    err = capsys.readouterr().err
    assert "no GPU" in err and "--arch" in err
    (tmp_path / "none-yet" / "x-sm_90-dir.cubin").mkdir(parents=True)  # unreadable, undeletable entry
    assert cli.main(["cache", "verify"]) == 1
    assert "BAD  x-sm_90-dir.cubin" in capsys.readouterr().out
    assert cli.main(["cache", "verify", "--delete-bad"]) == 1
    assert "could not delete: x-sm_90-dir.cubin" in capsys.readouterr().out


# =============================================================================================
# CPU: the sanitizer driver's own checks (benchmarks/sanitize.py), with torch standing in

def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"fastmm_bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_sanitize_driver_lists_its_cases_and_its_checks_catch_wrong_kernels(capsys):
    san = _load_script("sanitize")
    assert san.main(["--dry-run", "--quick"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("sanitize: ") and " 0 WRONG" in summary and "split-K" in summary
    dev = DeviceFacts.simulated_device("sm_90")
    cases = san.build_cases(dev, quick=True)
    assert {c.family for c in cases} >= set(FAMILIES) | {None}
    assert any(c.group == "split" for c in cases) and any(c.offsets != (0, 0, 0) for c in cases)
    assert any(san.plan_of(c, dev, *(o.view(o.base) if o else None for o in san.operands(c, 0))).kernel.split_k > 1
               for c in cases if c.group == "split")
    cpu = torch.device("cpu")
    case = san.Case("edge", "scalar", "ieee", 17, 15, 33, offsets=(1, 2, 3), c_t=True)
    assert san.run_case(case, cpu, dev, 0, mm=san.torch_stand_in).error is None

    def writes_past_the_end(a, b, out, precision, force, variants=()):
        torch.matmul(a, b, out=out)
        out.as_strided((1,), (1,), out.storage_offset() + out.stride(1) * out.shape[1] + 7).fill_(0.0)
        return out, None, None

    def off_by_one(a, b, out, precision, force, variants=()):
        torch.matmul(a, b, out=out)
        out[-1, -1] += 1.0
        return out, None, None

    def leaves_one_unwritten(a, b, out, precision, force, variants=()):
        keep = out[0, 0].clone()
        torch.matmul(a, b, out=out)
        out[0, 0] = keep  # still NaN
        return out, None, None

    def rounds_an_input(a, b, out, precision, force, variants=()):
        a.mul_(1.0 + 2.0**-12)
        return torch.matmul(a, b, out=out), None, None

    for bad, words in ((writes_past_the_end, "outside the output"), (off_by_one, "differ from the exact product"),
                       (leaves_one_unwritten, "NaN outputs"), (rounds_an_input, "input buffer changed")):
        err = san.run_case(case, cpu, dev, 0, mm=bad).error
        assert err is not None and words in err, (bad.__name__, err)
