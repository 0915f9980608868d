"""Property-based tests (hypothesis): random shapes, batches with broadcasting, storage offsets,
transposed / row-strided / element-strided views, 1-D operands, every precision, forced kernel
families.

GPU part (skipped without CUDA): the result is within the precision's tolerance of a float64
reference, has torch.matmul's shape and dtype, an ``out=`` is returned and nothing outside it is
written, the inputs are unchanged, and ``fastmm.explain`` never raises. The error measure is
||C - A@B||_F / || |A| @ |B| ||_F (float64): rounding errors are bounded element-wise by a
multiple of (|A| |B|)_ij, so this stays meaningful for tiny K and for products that cancel (where
a relative error against ||A@B|| blows up), and when it is zero (A or B all zeros, or K = 0) the
result must be exactly zero. Tolerances: ieee and tf32x3 1e-5, tf32 1e-3.

CPU part (runs in CI): the same generator and the same checks on the emulated GPU (conftest's
emulated_gpu: CPU tensors pass for CUDA ones on a simulated H200 and the kernels are emulated
from their arguments, tests/emulation.py), so fastmm's own plans, launch arguments, staging and
out= handling compute every result; and the dispatcher's plan for the same operands on every
simulated device is valid (a kernel unless a documented fallback applies, shared memory within
the device's limit, grid within the hardware limits, block size as the kernel's macros define
it, split-K only with its reduce pass).

Example counts: FASTMM_HYPOTHESIS_EXAMPLES (default 2000) for the GPU test,
FASTMM_HYPOTHESIS_CPU_EXAMPLES (default 100) for the CPU one. test_zz_example_counts checks that
the counts were reached and prints them (and records them as junit properties).
"""
from __future__ import annotations

import math
import os
import random
import warnings
from collections import Counter
import dataclasses
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import fastmm
from fastmm import dispatch
from fastmm.families import FAMILIES, MAX_GRID_Z, WgmmaTf32
from fastmm.plan import INT32_MAX, select
from fastmm.problem import PRECISIONS, DeviceFacts
from fastmm.shapes import analyse, build_problem
from conftest import relative_error

HAS_CUDA = torch.cuda.is_available()
GPU_EXAMPLES = int(os.environ.get("FASTMM_HYPOTHESIS_EXAMPLES", "2000"))
CPU_EXAMPLES = int(os.environ.get("FASTMM_HYPOTHESIS_CPU_EXAMPLES", "100"))
TOL = {"ieee": 1e-5, "tf32": 1e-3, "tf32x3": 1e-5}
ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
SIM = {arch: DeviceFacts.simulated_device(arch) for arch in ARCHS}
MAX_DIM = 300
MAX_BATCH = 5  # per batch dim
MAX_BATCH_TOTAL = 12  # product of the result's batch dims (keeps one case below ~1e9 multiply-adds)
LAYOUTS = ("row", "col", "rowpad", "colpad", "step2")
FORCE = (None, None, None, None, "skinny_kmajor", "skinny", "wgmma_tf32", "tf32_mma", "simt_cp_async", "simt_float4",
         "scalar")

#: examples run per test in this process (test_zz_example_counts reads them)
COUNTS: Counter = Counter()


# ---------------------------------------------------------------------------------------------
# the generator: one function, driven by hypothesis (tests) or by random (kernel warm-up)

@dataclass(frozen=True)
class Operand:
    rows: int
    cols: int
    vector: bool  # 1-D: A is a vector of its cols (K), B of its rows (K)
    batch: tuple[int, ...]  # its own batch dims (size 1 broadcasts)
    expand: tuple[bool, ...]  # per batch dim: stored once and expanded (stride 0)
    layout: str  # one of LAYOUTS
    pad: int
    offset: int  # storage offset, floats


@dataclass(frozen=True)
class Spec:
    M: int
    N: int
    K: int
    a: Operand
    b: Operand
    out: str  # "none", "fresh", "offset", "transposed"
    out_offset: int
    precision: str
    force: str | None
    seed: int


class _Hyp:
    def __init__(self, draw):
        self.draw = draw

    def int(self, lo, hi):
        return self.draw(st.integers(lo, hi))

    def pick(self, options):
        return self.draw(st.sampled_from(options))


class _Rand:
    """random.Random with a lean towards the edges, as hypothesis has."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def int(self, lo, hi):
        if self.rng.random() < 0.2:
            return self.rng.choice([lo, hi, min(lo + 1, hi), max(hi - 1, lo)])
        return self.rng.randint(lo, hi)

    def pick(self, options):
        return self.rng.choice(list(options))


def make_spec(c) -> Spec:
    M, N, K = c.int(0, MAX_DIM), c.int(0, MAX_DIM), c.int(0, MAX_DIM)
    rank = c.int(0, 3)
    full = [c.int(0, MAX_BATCH) for _ in range(rank)]
    while math.prod(n for n in full if n) > MAX_BATCH_TOTAL:
        full[full.index(max(full))] = 1

    def operand(rows, cols):
        vector = c.int(0, 7) == 0
        dims, expand = [], []
        if not vector:
            for n in full[rank - c.int(0, rank):]:
                how = c.pick(("same", "same", "one", "expand"))
                dims.append(1 if how == "one" else n)
                expand.append(how == "expand" and n > 1)
        return Operand(rows, cols, vector, tuple(dims), tuple(expand), c.pick(LAYOUTS), c.int(1, 3), c.int(0, 3))

    a = operand(M, K)
    b = operand(K, N)
    out = c.pick(("none", "none", "fresh", "offset", "transposed"))
    return Spec(M, N, K, a, b, out, c.int(1, 3), c.pick(PRECISIONS), c.pick(FORCE), c.int(0, 2**31 - 1))


@st.composite
def specs(draw) -> Spec:
    return make_spec(_Hyp(draw))


def random_specs(n: int, seed: int = 0) -> list[Spec]:
    c = _Rand(random.Random(seed))
    return [make_spec(c) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# tensors from a spec

def _geometry(op: Operand, which: str):
    """(sizes, strides, storage offset, storage length) of the view of operand ``which`` (a, b)."""
    if op.vector:
        n = op.cols if which == "a" else op.rows
        step = 2 if op.layout == "step2" else 1
        return (n,), (step,), op.offset, op.offset + max(n - 1, 0) * step + 1
    r, k = op.rows, op.cols
    inner = {"row": (k, 1), "col": (1, r), "rowpad": (k + op.pad, 1), "colpad": (1, r + op.pad),
             "step2": (2 * k, 2)}[op.layout]
    extent = 1 + max(r - 1, 0) * inner[0] + max(k - 1, 0) * inner[1]
    sizes, strides = [r, k], list(inner)
    for n, expanded in zip(reversed(op.batch), reversed(op.expand)):
        sizes.insert(0, n)
        strides.insert(0, 0 if expanded else extent)
        if not expanded:
            extent *= max(n, 1)
    return tuple(sizes), tuple(strides), op.offset, op.offset + extent


def materialize(op: Operand, which: str, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, the whole buffer behind it) with random values."""
    sizes, strides, offset, length = _geometry(op, which)
    base = torch.randn(length + 8, device=device, generator=gen)
    return base.as_strided(sizes, strides, offset), base


def make_out(spec: Spec, shape, device):
    """(out, buffer behind it, mask of out's elements in the buffer) or (None, None, None)."""
    if spec.out == "none":
        return None, None, None
    if spec.out == "transposed" and len(shape) >= 2:
        t = torch.full(shape[:-2] + (shape[-1], shape[-2]), float("nan"), device=device)
        out = t.transpose(-1, -2)
        return out, t, None
    off = spec.out_offset if spec.out == "offset" else 0
    n = math.prod(shape)
    base = torch.full((off + n + 8,), -777.0, device=device)
    out = base[off:off + n].view(shape)
    out.fill_(float("nan"))
    mask = torch.zeros(base.shape, dtype=torch.bool, device=device)
    mask[off:off + n] = True
    return out, base, mask


def operands(spec: Spec, device):
    gen = torch.Generator(device=device)
    gen.manual_seed(spec.seed)
    a, abase = materialize(spec.a, "a", device, gen)
    b, bbase = materialize(spec.b, "b", device, gen)
    return a, b, abase, bbase


def meta_operands(spec: Spec):
    """The operands on the meta device: same shapes, strides and pointer alignment, no data."""
    views = []
    for op, which in ((spec.a, "a"), (spec.b, "b")):
        sizes, strides, offset, length = _geometry(op, which)
        views.append(torch.empty(length + 8, device="meta").as_strided(sizes, strides, offset))
    return views


def forced_run(spec: Spec, a, b, out):
    """fastmm with the spec's forced family where it can run this problem, else fastmm.matmul."""
    if spec.force is not None:
        try:
            result, _, _ = dispatch.matmul_fastmm(a, b, out, spec.precision, force=spec.force)
            return result
        except ValueError as exc:
            if spec.force not in str(exc):
                raise
    return fastmm.matmul(a, b, precision=spec.precision, out=out)


# ---------------------------------------------------------------------------------------------
# dispatcher validity (CPU and GPU: plans are pure functions of the problem and the device)

def _threads_from_macros(cfg) -> int:
    m = dict(cfg.macros)
    if cfg.family == "scalar":
        return 256
    if cfg.family in ("skinny", "splitk_reduce", "stage_kmajor"):
        return 256
    if cfg.family == "skinny_kmajor":
        return m["KR_WARPS"] * 32
    if cfg.family == "kmajor_mma":
        return m["KM_WARPS"] * 32
    if cfg.family == "wgmma_tf32":  # a producer and a consumer warpgroup a 64 rows of the tile
        return 128 * (1 + m.get("BM", 128) // 64)
    return m["WARPS_M"] * m["WARPS_N"] * 32


DOCUMENTED_FALLBACKS = ("older than sm_", "exceeds 2^31-1", "more than 2^31-1 output tiles", "not 4-byte aligned")


def check_plan(plan, force: str | None) -> None:
    p, dev, cfg = plan.problem, plan.device, plan.kernel
    if cfg is None:
        assert plan.fallback and any(s in plan.fallback for s in DOCUMENTED_FALLBACKS), plan.fallback
        return
    assert force is None or cfg.family == force
    assert cfg.smem <= dev.smem_per_block_optin, (cfg.family, cfg.smem, dev.smem_per_block_optin)
    gx, gy, gz = cfg.grid
    assert 1 <= gx <= INT32_MAX and 1 <= gy <= 65535 and 1 <= gz <= MAX_GRID_Z, cfg.grid
    bx, by, bz = cfg.block_dims
    assert bx * by * bz == cfg.block == _threads_from_macros(cfg) <= 1024, (cfg.family, cfg.block_dims, cfg.macros)
    if cfg.family == "scalar":
        assert cfg.block_dims == (16, 16, 1)
    if dev.cc < (8, 0):
        assert cfg.family not in ("simt_cp_async", "tf32_mma", "wgmma_tf32", "kmajor_mma")
    if cfg.family == "wgmma_tf32":
        assert dev.cc == (9, 0) and cfg.target(dev.arch) == "sm_90a"
    if p.precision == "ieee":
        assert cfg.family not in ("tf32_mma", "wgmma_tf32", "kmajor_mma")
    assert plan.precision_used == (p.precision if cfg.family in ("tf32_mma", "wgmma_tf32", "kmajor_mma") else "ieee")
    if cfg.split_k > 1:
        assert p.batch_total == 1
        if cfg.split_fused:  # the kernel sums its own slices (the last block of each tile)
            assert plan.reduce is None and cfg.arrival_counters == gx
            assert cfg.family in ("skinny", "skinny_kmajor", "kmajor_mma", "simt_cp_async")
        else:
            assert plan.reduce is not None and plan.reduce.family == "splitk_reduce"
            assert 1 <= plan.reduce.grid[0] <= INT32_MAX and plan.reduce.block_dims == (256, 1, 1)
        units = -(-p.K // cfg.tile[2])  # k-tiles (k chunks for skinny), split as common.cuh split_range does
        per = -(-units // cfg.split_k)
        assert (cfg.split_k - 1) * per < units, f"split {cfg.split_k} of {units} k-tiles leaves a split empty"
    elif cfg.stream_k is not None:  # whole waves, then pieces summed by the fixup pass
        assert p.batch_total == 1 and plan.reduce is not None and plan.reduce.family == "stream_k_fixup"
    else:
        assert plan.reduce is None
    assert (bool(plan.staging) or plan.swap_ab) == (plan.launch_problem is not None)
    if plan.swap_ab:  # C^T = B^T A^T: the transposed problem, B fed from registers
        lp = plan.launch_problem
        assert cfg.family == "wgmma_tf32" and dict(cfg.macros)["A_MN"] == 1 and p.precision == "tf32"
        assert (lp.M, lp.N, lp.K, lp.c_strides) == (p.N, p.M, p.K, p.c_strides[::-1])
    if plan.staging:  # (needs M or N >= 768: rare at this generator's sizes, but cheap to state)
        assert cfg.family in ("simt_cp_async", "tf32_mma", "wgmma_tf32")
        assert p.batch_total == 1 or cfg.family == "wgmma_tf32"  # (its copies walk the batch)
        assert len(plan.stagers) == len(plan.staging)  # every family copies with its own kernel
        assert all(s.family == "stage_kmajor" for s in plan.stagers)
    names = [cfg.family] + [name for name, _ in plan.rejected]
    assert sorted(names) == sorted(FAMILIES)
    assert all(isinstance(reason, str) and reason for _, reason in plan.rejected)
    assert plan.describe()


def check_dispatch(spec: Spec, a, b) -> None:
    """Plans for these operands (as fastmm.matmul would build the problem) on every simulated
    device, for the dispatcher's choice and for every family forced."""
    s = analyse(a, b)
    c = torch.empty(s.batch + (s.M, s.N), device="meta")
    problem, _ = build_problem(s, c, spec.precision)
    for arch in ARCHS:
        dev = SIM[arch]
        plan = select(problem, dev)
        assert plan.kernel is not None, plan.fallback  # aligned floats, dims <= 300: always served
        check_plan(plan, None)
        for family in FAMILIES:
            try:
                forced = select(problem, dev, force=family)
            except ValueError as exc:
                assert family in str(exc)
                continue
            check_plan(forced, family)


# ---------------------------------------------------------------------------------------------
# GPU

def _compile_one(folder, name, key, arch, source, macros):
    from fastmm.runtime.cache import DiskCache
    from fastmm.runtime.compiler import compile_cubin

    DiskCache(folder).get_or_compile(name, key, arch, lambda: compile_cubin(source, macros, arch))


def precompile_for(dev: DeviceFacts, sample: list[Spec], jobs: int) -> int:
    """Compile, in ``jobs`` parallel processes, the kernels ``sample`` needs on ``dev`` that the
    disk cache lacks; returns how many."""
    import concurrent.futures
    import multiprocessing

    from fastmm.runtime import launcher
    from fastmm.runtime.cache import default_cache

    cache = default_cache()
    if not cache.usable():
        return 0
    todo = {}
    for spec in sample:
        a, b = meta_operands(spec)
        s = analyse(a, b)
        problem, _ = build_problem(s, torch.empty(s.batch + (s.M, s.N), device="meta"), spec.precision)
        for force in {None, spec.force}:
            try:
                plan = select(problem, dev, force)
            except (ValueError, ZeroDivisionError):  # (ZeroDivisionError: a planner bug the CPU test reports)
                continue
            for cfg in (plan.kernel, plan.reduce, *plan.stagers):
                if cfg is None:
                    continue
                key, target = launcher.key_for(cfg, dev.arch), cfg.target(dev.arch)  # (sm_90a for wgmma)
                name = f"{cfg.family}-{target}"
                if key not in todo and cache.read(cache.path_for(name, key), target, key) is None:
                    todo[key] = (str(cache.folder), name, key, target, cfg.source, cfg.macros)
    if not todo:
        return 0
    ctx = multiprocessing.get_context("fork")  # the children only run NVRTC, never CUDA
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a multi-threaded process
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            for fut in [pool.submit(_compile_one, *args) for args in todo.values()]:
                fut.result()
    return len(todo)


@pytest.fixture(scope="module")
def warm_kernels():
    """The kernels a sample of the generator's cases needs, compiled in parallel before the GPU
    test (one at a time inside it would spend a minute or more in NVRTC). Cases the sample
    missed compile when they come."""
    dev = dispatch.device_facts(torch.cuda.current_device())
    precompile_for(dev, random_specs(8000, seed=1), min(16, os.cpu_count() or 1))


@pytest.mark.cuda
@settings(max_examples=GPU_EXAMPLES, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs())
def test_gpu_random_matmuls_match_float64(warm_kernels, spec):
    COUNTS["gpu_tried"] += 1
    check_against_float64(spec, torch.device("cuda", torch.cuda.current_device()))
    COUNTS["gpu"] += 1


def check_against_float64(spec: Spec, device: torch.device) -> None:
    """The GPU property (the CPU test runs it on the emulated GPU)."""
    a, b, abase, bbase = operands(spec, device)
    a_before, b_before = abase.clone(), bbase.clone()
    expected_shape = torch.matmul(a.double(), b.double()).shape
    out, obuf, mask = make_out(spec, tuple(expected_shape), device)
    exp = fastmm.explain(a, b, precision=spec.precision, out=out)  # must not raise
    assert (exp.kernel is None) == (exp.fallback is not None)
    assert str(exp)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (torch's out= resize quirk for 1-D @ 2-D, where it serves)
        result = forced_run(spec, a, b, out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert result.shape == expected_shape and result.dtype == torch.float32 and result.device == a.device
    if out is not None:
        assert result is out
    assert torch.equal(abase, a_before) and torch.equal(bbase, b_before), "an input was modified"
    if mask is not None:
        assert torch.all(obuf[~mask] == -777.0), "written outside out"
    err = relative_error(result, a, b, scale="abs")
    assert err <= TOL[spec.precision], f"error {err:.3g} > {TOL[spec.precision]} ({exp.kernel}, {exp.fallback})"


# ---------------------------------------------------------------------------------------------
# CPU

@settings(max_examples=CPU_EXAMPLES, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec=specs())
def test_cpu_random_matmuls_on_the_emulated_gpu_match_float64_and_plans_are_valid(emulated_gpu, spec):
    COUNTS["cpu_tried"] += 1
    emulated_gpu.clear()
    check_against_float64(spec, torch.device("cpu"))
    a, b, _, _ = operands(spec, "cpu")
    exp = fastmm.explain(a, b, precision=spec.precision)
    computed = math.prod(exp.shapes["batch"]) * exp.shapes["M"] * exp.shapes["N"] > 0 and exp.shapes["K"] > 0
    if computed:  # fastmm's kernels computed it: launches were made
        assert exp.kernel is not None and emulated_gpu.launches, str(exp)
    check_dispatch(spec, a, b)
    COUNTS["cpu"] += 1


@settings(max_examples=CPU_EXAMPLES, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec=specs(), x3=st.booleans())
def test_cpu_random_matmuls_with_wgmma_forms_not_yet_measured_on_the_emulated_gpu(emulated_gpu, monkeypatch, spec,
                                                                                   x3):
    """The same forced onto the wgmma family with forms the planner takes only where its rules
    say switched on everywhere: tf32 on 64-row tiles wherever the kernel allows them, A fed from
    registers included (``rows64="always"``), and tf32x3 splitting A in registers
    (``x3_a_regs=True``): their plans, maps and staging compute every output right."""
    variant = WgmmaTf32(x3_a_regs=True) if x3 else WgmmaTf32(rows64="always")
    monkeypatch.setitem(FAMILIES, "wgmma_tf32", variant)
    spec = dataclasses.replace(spec, force="wgmma_tf32", precision="tf32x3" if x3 else "tf32")
    emulated_gpu.clear()
    check_against_float64(spec, torch.device("cpu"))
    for launch in emulated_gpu.launches:  # (which forms ran: --hypothesis-show-statistics)
        m = dict(launch.cfg.macros)
        if m.get("A_MN") and m.get("BM") == 64:
            event("A_MN on 64-row tiles")
        if m.get("X3_A_REGS"):
            event("X3_A_REGS")
    a, b, _, _ = operands(spec, "cpu")
    check_dispatch(spec, a, b)


def test_generator_covers_what_the_issue_asks_for():
    """The generator reaches every feature (checked on a plain random sample of its cases)."""
    sample = random_specs(4000, seed=7)
    dims = {d for s in sample for d in (s.M, s.N, s.K)}
    assert {0, 1, MAX_DIM} <= dims
    assert {s.precision for s in sample} == set(PRECISIONS)
    assert {s.a.layout for s in sample} == set(LAYOUTS)
    assert {s.a.offset for s in sample} == {0, 1, 2, 3}
    assert any(s.a.vector for s in sample) and any(s.b.vector for s in sample)
    assert any(s.a.vector and s.b.vector for s in sample)
    assert any(0 in s.a.batch for s in sample)  # an empty batch
    assert any(1 in s.a.batch and len(s.b.batch) > 0 and s.b.batch[-1] > 1 for s in sample)  # broadcast
    assert any(any(s.a.expand) for s in sample)
    assert any(len(s.a.batch) == 3 for s in sample)
    assert {s.out for s in sample} == {"none", "fresh", "offset", "transposed"}
    assert {s.force for s in sample} == set(FORCE)
    for s in sample[:300]:  # every spec builds tensors torch.matmul accepts
        a, b = meta_operands(s)
        torch.matmul(a, b)


def test_zz_example_counts(request, record_property):
    """Runs last in this module: how many hypothesis examples the tests above ran and passed
    (hypothesis stops at the first failure, so a failing test shows a short count; that failure
    is the one to read)."""
    record_property("hypothesis_gpu_examples", COUNTS["gpu"])
    record_property("hypothesis_cpu_examples", COUNTS["cpu"])
    line = (f"hypothesis examples passed: GPU {COUNTS['gpu']} of {COUNTS['gpu_tried']} run (target {GPU_EXAMPLES}"
            f"{'' if HAS_CUDA else ', no GPU here'}), CPU {COUNTS['cpu']} of {COUNTS['cpu_tried']} run "
            f"(target {CPU_EXAMPLES})")
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # straight to the terminal / log, even with -q
            reporter.write_line("")
            reporter.write_line(line)
    print(line)
    for kind, target in (("cpu", CPU_EXAMPLES), ("gpu", GPU_EXAMPLES)):
        if COUNTS[kind + "_tried"] and COUNTS[kind] == COUNTS[kind + "_tried"]:  # ran here and passed
            assert COUNTS[kind] >= target, line
