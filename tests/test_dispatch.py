"""fastmm.dispatch: the full path of a call. Whether fastmm's kernels serve it at all
(not_served_reason) and, where they do not, that torch.matmul gets it with the reason and the
precision asked for; on the emulated GPU (conftest.emulated_gpu), what the full path does with
out=, K = 0, empty results, variants, launch offsets and staged operands, a refused tensor map
and a capture that would need a compile; the plan cache (PlanCache) and plan_for."""
from __future__ import annotations

import warnings

import pytest
import torch

import fastmm
from fastmm import dispatch, fast_path
from fastmm.families import LOAD_ELEM_K, LOAD_VEC_FAST, Skinny, simt_core
from fastmm.plan import FamilyCannotRun, select
from fastmm.problem import DeviceFacts, Problem
from fastmm.runtime import launcher, tensor_map
from conftest import CudaLooking, outcome, relative_error

NAN = float("nan")
CPU_REASON = "operands are on cpu and cpu; fastmm kernels run on CUDA devices"


@pytest.fixture
def fallbacks(monkeypatch):
    """Records every dispatch.fallback call as (a, b, out, precision, reason), and makes sure
    fastmm computed nothing itself (dispatch.run is never reached)."""
    calls = []
    real = dispatch.fallback

    def spy(a, b, out, precision, reason):
        calls.append((a, b, out, precision, reason))
        return real(a, b, out, precision, reason)

    def no_run(*args, **kwargs):
        raise AssertionError("fastmm planned or launched a call it should have handed to torch")

    monkeypatch.setattr(dispatch, "fallback", spy)
    monkeypatch.setattr(dispatch, "run", no_run)
    return calls


# --- CPU operands: torch computes, told why and at which precision ---------------------------------

CPU_CASES = {
    "2d": lambda: (torch.randn(3, 4), torch.randn(4, 5)),
    "batched-broadcast": lambda: (torch.randn(2, 1, 3, 4), torch.randn(5, 4, 6)),
    "vector-matrix": lambda: (torch.randn(4), torch.randn(2, 4, 5)),
    "column-major": lambda: (torch.randn(4, 3).t(), torch.randn(5, 4).t()),
    "expanded": lambda: (torch.randn(1, 3, 4).expand(2, 3, 4), torch.randn(4, 5)),
    "k-zero": lambda: (torch.randn(3, 0), torch.randn(0, 5)),
    "float64": lambda: (torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)),
}


@pytest.mark.parametrize("case", list(CPU_CASES))
@pytest.mark.parametrize("precision", ["ieee", "tf32", "tf32x3"])
@pytest.mark.parametrize("with_out", [False, True])
def test_cpu_operands_go_to_torch_with_the_cpu_reason_and_the_precision_asked(fallbacks, case, precision, with_out):
    a, b = CPU_CASES[case]()
    out = torch.empty(0, dtype=a.dtype) if with_out else None
    result, plan, reason = dispatch.matmul_fastmm(a, b, out, precision)
    assert plan is None and reason == CPU_REASON
    (fa, fb, fout, fprecision, freason), = fallbacks
    assert fa is a and fb is b and fout is out and (fprecision, freason) == (precision, CPU_REASON)
    assert result is out if with_out else result.shape == torch.matmul(a, b).shape


@pytest.mark.parametrize("setting,expected", [("highest", "ieee"), ("high", "tf32")])
def test_fastmm_matmul_hands_torch_the_resolved_precision(fallbacks, setting, expected):
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        fastmm.matmul(torch.randn(3, 4), torch.randn(4, 5))
    finally:
        torch.set_float32_matmul_precision(old)
    assert [call[3] for call in fallbacks] == [expected]


def test_the_fallback_leaves_torchs_precision_setting_alone_for_cpu_operands(fallbacks, monkeypatch):
    asked = []
    real = dispatch.torch_precision

    def spy(precision):
        asked.append(precision)
        return real(precision)

    monkeypatch.setattr(dispatch, "torch_precision", spy)
    fastmm.matmul(torch.randn(3, 4), torch.randn(4, 5), precision="tf32")
    assert asked == [None]  # CPU: torch's CPU matmul has no TF32 to switch


def test_an_out_overlapping_an_input_is_never_handed_to_torch_as_out(fallbacks, monkeypatch):
    """torch.matmul(a, b, out=a) may read what it already overwrote: the fallback computes aside,
    applies torch's resize rule and copies into out."""
    handed = []
    real = dispatch.torch_matmul
    monkeypatch.setattr(dispatch, "torch_matmul", lambda a, b, out: handed.append(out) or real(a, b, out))
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    a0 = a.clone()
    assert fastmm.matmul(a, b, out=a) is a
    assert relative_error(a, a0, b) <= 1e-6 and handed == []
    x = torch.randn(2, 8, 8)
    y = torch.randn(8, 8)
    expected, out = x[0] @ y, x[1]  # out is the other half of A's buffer
    assert fastmm.matmul(x[0], y, out=out) is out
    assert relative_error(out, expected) <= 1e-6 and handed == []
    c = torch.empty(64, 64)
    fastmm.matmul(a0, b, out=c)  # apart from the inputs: torch writes it
    assert len(handed) == 1 and handed[0] is c


# --- not_served_reason: the decision, on stand-ins for CUDA tensors -----------------------------------

@pytest.fixture
def runtime_ok(monkeypatch):
    monkeypatch.setattr(dispatch, "runtime_reason", lambda: None)
    monkeypatch.delenv("FASTMM_DISABLE", raising=False)


@pytest.mark.parametrize("a_kw,b_kw,words", [
    ({}, {}, None),
    ({"dtype": torch.float64}, {"dtype": torch.float64}, "dtypes are torch.float64 and torch.float64"),
    ({}, {"dtype": torch.float16}, "fastmm kernels compute float32"),
    ({}, {"device": "cuda:1"}, "operands are on different devices (cuda:0, cuda:1)"),
    ({"device": "cpu"}, {}, "operands are on cpu and cuda:0"),
    ({"is_sparse": True}, {}, "sparse or non-strided layout"),
    ({}, {"layout": torch.sparse_csr}, "sparse or non-strided layout"),
    ({"complex": True}, {}, "complex dtype"),
    ({}, {"is_nested": True}, "nested tensor"),
])
def test_not_served_reason_names_what_fastmm_kernels_cannot_take(runtime_ok, a_kw, b_kw, words):
    reason = dispatch.not_served_reason(CudaLooking(64, 32, **a_kw), CudaLooking(32, 16, **b_kw))
    if words is None:
        assert reason is None
    else:
        assert reason is not None and words in reason, reason


def test_not_served_reason_gives_autocast_half_matmuls_to_torch(runtime_ok, monkeypatch):
    monkeypatch.setattr(dispatch, "autocast_half_active", lambda device_type: device_type == "cuda")
    assert "torch.autocast" in dispatch.not_served_reason(CudaLooking(4, 4), CudaLooking(4, 4))


def test_fastmm_disable_wins_over_everything(monkeypatch, fallbacks):
    monkeypatch.setenv("FASTMM_DISABLE", "1")
    assert "FASTMM_DISABLE=1" in dispatch.not_served_reason(CudaLooking(4, 4), CudaLooking(4, 4))
    assert "FASTMM_DISABLE=1" in dispatch.not_served_reason(torch.zeros(2, 2), torch.zeros(2, 2))
    fastmm.matmul(torch.randn(5, 3), torch.randn(3, 2))
    assert len(fallbacks) == 1 and "FASTMM_DISABLE=1" in fallbacks[0][4]


def test_the_runtime_is_asked_only_after_the_operands_pass(monkeypatch):
    monkeypatch.delenv("FASTMM_DISABLE", raising=False)
    asked = []
    monkeypatch.setattr(dispatch, "runtime_reason", lambda: asked.append(1) or "no NVRTC (test)")
    assert dispatch.not_served_reason(CudaLooking(4, 4, dtype=torch.float64), CudaLooking(4, 4)).startswith("dtypes")
    assert asked == []  # an operand fastmm cannot take is named first
    assert dispatch.not_served_reason(CudaLooking(4, 4), CudaLooking(4, 4)) == "no NVRTC (test)"


# --- the full path on the emulated GPU --------------------------------------------------------------

def test_an_out_of_another_dtype_or_with_overlapping_elements_gets_torchs_error(emulated_gpu):
    a, b = torch.randn(64, 48), torch.randn(48, 80)
    for out in (torch.empty(64, 80, dtype=torch.float64), torch.randn(1, 80).expand(64, 80)):
        theirs = outcome(lambda: torch.matmul(a, b, out=out))
        assert theirs is not None and outcome(lambda: fastmm.matmul(a, b, out=out)) == theirs
    assert emulated_gpu.launches == [] and emulated_gpu.slow_calls == 0


def test_the_reason_for_a_refused_out_is_given_before_torch_raises(emulated_gpu, monkeypatch):
    reasons = []
    monkeypatch.setattr(dispatch, "fallback", lambda a, b, out, precision, reason: reasons.append(reason))
    a, b = torch.randn(64, 48), torch.randn(48, 80)
    dispatch.matmul_fastmm(a, b, torch.empty(64, 80, dtype=torch.float64), "ieee")
    dispatch.matmul_fastmm(a, b, torch.randn(1, 80).expand(64, 80), "ieee")
    assert reasons == ["out has another dtype or device", "out has internally overlapping memory"]


def test_k_zero_writes_zeros_without_a_launch(emulated_gpu):
    out = torch.full((37, 41), NAN)
    result, plan, reason = dispatch.matmul_fastmm(torch.randn(37, 0), torch.randn(0, 41), out, "ieee")
    assert result is out and reason is None and plan is not None and plan.kernel is not None
    assert torch.equal(out, torch.zeros(37, 41)) and emulated_gpu.launches == []


def test_an_empty_result_plans_and_launches_nothing(emulated_gpu):
    result, plan, reason = dispatch.matmul_fastmm(torch.randn(0, 16), torch.randn(16, 41), None, "ieee")
    assert result.shape == (0, 41) and plan is None and reason is None
    assert emulated_gpu.launches == [] and emulated_gpu.slow_calls == 0


def test_an_out_overlapping_an_input_is_computed_aside_then_copied(emulated_gpu):
    a, b = torch.randn(96, 96), torch.randn(96, 96)
    a0 = a.clone()
    result, plan, reason = dispatch.matmul_fastmm(a, b, a, "ieee")
    assert result is a and reason is None
    (launch,) = emulated_gpu.launches
    assert launch.pointers[2] != a.data_ptr()  # the kernel wrote a buffer of its own
    assert relative_error(a, a0, b) <= 1e-6


def test_batch_dims_the_kernel_cannot_walk_are_launched_once_per_outer_index(emulated_gpu):
    M, N, K = 40, 48, 36
    a, b = torch.randn(2, 1, 4, M, K), torch.randn(1, 3, 4, K, N)
    result, plan, _ = dispatch.matmul_fastmm(a, b, None, "ieee")
    assert relative_error(result, a, b) <= 1e-6
    first, second = emulated_gpu.launches
    assert second.pointers[0] - first.pointers[0] == 4 * 4 * M * K  # A's outer batch stride
    assert second.pointers[1] == first.pointers[1]  # B broadcast over the outer dim
    assert second.pointers[2] - first.pointers[2] == 4 * 12 * M * N
    assert first.rest == second.rest


def test_a_staged_operand_is_read_from_its_padded_copy(emulated_gpu):
    """B with rows of 1023 floats (no 16-byte copies): copied into a zero-padded 1024-float pitch
    by the plan's stager (stage_kmajor, row by row), and the GEMM reads the copy with the launch
    problem's strides."""
    a, b = torch.randn(2048, 128), torch.randn(128, 1023)
    result, plan, _ = dispatch.matmul_fastmm(a, b, None, "ieee")
    assert plan.staging == (("b", 128, 1024),) and plan.launch_problem.b_strides == (1024, 1)
    copy, gemm = emulated_gpu.launches
    assert copy.family == "stage_kmajor" and dict(copy.cfg.macros)["SRC_R_CONTIG"] == 0
    assert copy.pointers[0] == b.data_ptr() and copy.args[3:8] == (128, 1023, 1023, 1, 1024)
    assert gemm.pointers[1] == copy.pointers[1] != b.data_ptr() and gemm.args[8:10] == (1024, 1)  # B's strides as passed
    assert relative_error(result, a, b) <= 1e-6


def test_a_k_contiguous_b_of_a_large_product_is_transposed_first(emulated_gpu):
    """x @ W.t() with M >= TRANSPOSE_B_MIN_M on the 128 x 256 tile: W (K-contiguous) is copied
    row-major by stage_kmajor (through shared memory), and the SIMT GEMM reads that copy with
    float4 loads along N; below that M, W is read in place."""
    M = simt_core.TRANSPOSE_B_MIN_M
    x, w = torch.randn(M, 36), torch.randn(8191, 36)
    result, plan, _ = dispatch.matmul_fastmm(x, w.t(), None, "ieee")
    assert plan.kernel.family == "simt_cp_async" and plan.staging == (("b", 36, 8192),)
    assert dict(plan.kernel.macros)["B_MODE"] == LOAD_VEC_FAST and plan.kernel.tile[:2] == (128, 256)
    copy, gemm = emulated_gpu.launches[:2]
    assert copy.family == "stage_kmajor" and dict(copy.cfg.macros)["SRC_R_CONTIG"] == 1
    assert copy.pointers[0] == w.data_ptr() and copy.args[3:8] == (36, 8191, 1, 36, 8192)
    assert gemm.pointers[1] == copy.pointers[1] and gemm.args[8:10] == (8192, 1)
    assert relative_error(result, x, w.t()) <= 1e-6
    emulated_gpu.clear()
    x = torch.randn(M - 1, 36)
    result, plan, _ = dispatch.matmul_fastmm(x, w.t(), None, "ieee")
    assert plan.staging == () and dict(plan.kernel.macros)["B_MODE"] == LOAD_ELEM_K
    assert emulated_gpu.launches[0].pointers[1] == w.data_ptr()
    assert relative_error(result, x, w.t()) <= 1e-6


def test_a_copy_kernel_that_fails_to_build_is_remembered_as_itself(emulated_gpu, monkeypatch):
    """The stager of a staged plan (stage_kmajor) that fails to compile: that call falls back to
    torch with a warning naming stage_kmajor, and the failure is recorded under the stager, so
    the same GEMM kernel (a row-major W: no copy) still serves its own calls."""
    from fastmm.errors import FastmmWarning
    from fastmm.runtime.compiler import CompileError

    def load(dev, cfg):
        if cfg.family == "stage_kmajor":
            raise CompileError("NVRTC failed on stage_kmajor.cu: error: simulated failure")
        return cfg
    monkeypatch.setattr(launcher, "load", load)
    M = simt_core.TRANSPOSE_B_MIN_M
    x, w = torch.randn(M, 36), torch.randn(8192, 36)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        result, plan, reason = dispatch.matmul_fastmm(x, w.t(), None, "ieee")
    assert reason is not None and "stage_kmajor failed to compile" in reason and "simulated failure" in reason
    assert [str(r.message) for r in rec if issubclass(r.category, FastmmWarning)][0].startswith(
        "fastmm: kernel stage_kmajor failed to compile")
    assert emulated_gpu.launches == [] and relative_error(result, x, w.t()) <= 1e-6  # torch served it
    assert dispatch.plan_for(plan.problem, 0).kernel is None  # (the plan needing the copy: torch from now on)
    staged_gemm = select(plan.problem, dispatch.device_facts(0)).kernel
    row = torch.empty(36, 8192)  # the same product with W row-major: the same GEMM, no copy
    row.copy_(w.t())  # (torch.empty: memory the emulation knows)
    result, plan, reason = dispatch.matmul_fastmm(x, row, None, "ieee")
    assert reason is None and plan.kernel == staged_gemm and not plan.staging
    assert emulated_gpu.families == ["simt_cp_async"] and relative_error(result, x, row) <= 1e-6


def test_a_variant_is_planned_and_cached_apart_from_the_registrys_family(emulated_gpu):
    """Skinny(fuse_split=False) makes the two-launch split-K plan (splitk_reduce sums the
    slices) where the registry's Skinny sums them in the kernel; the plan says which variant it
    used, and each is cached under its own key, so neither serves the other's calls."""
    gpu = emulated_gpu
    a, b = torch.randn(16, 4096), torch.randn(4096, 4096)
    unfused = (Skinny(fuse_split=False),)
    two, plan, _ = dispatch.matmul_fastmm(a, b, None, "ieee", variants=unfused)
    assert gpu.families == ["skinny", "splitk_reduce"] and plan.variants == unfused
    assert not plan.kernel.split_fused and "variant: Skinny(fuse_split=False" in plan.describe()
    gpu.clear()
    one = fastmm.matmul(a, b, precision="ieee")  # the public path: the registry's family
    assert gpu.families == ["skinny"] and gpu.slow_calls == 2
    default = fast_path.ENTRIES[fast_path.key_of(a, b, None, "ieee")].kernel
    assert default.split_fused and default.grid == plan.kernel.grid  # the same split, summed in the kernel
    assert relative_error(two, a, b) <= 1e-6 and torch.equal(one, two)  # both sum the slices in slice order
    assert len(dispatch.PLANS.prepared) == 2
    gpu.clear()
    dispatch.matmul_fastmm(a, b, None, "ieee", variants=unfused)  # its own cached plan again
    assert gpu.families == ["skinny", "splitk_reduce"] and len(dispatch.PLANS.prepared) == 2


def test_a_refused_tensor_map_hands_the_problem_to_torch_for_good(emulated_gpu, monkeypatch):
    def refuse(ptr, spec, *, tf32=True):
        raise tensor_map.TensorMapError("refused (test)")

    monkeypatch.setattr(tensor_map, "encode", refuse)
    monkeypatch.setenv("FASTMM_KERNEL", "wgmma_tf32")
    a, b = torch.randn(256, 64), torch.randn(64, 136)
    with pytest.warns(fastmm.FastmmWarning, match="could not describe an operand to the copy engine"):
        result, plan, reason = dispatch.matmul_fastmm(a, b, None, "tf32")
    assert plan.kernel is None and "refused (test)" in reason and relative_error(result, a, b) <= 1e-6
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        _, again, reason2 = dispatch.matmul_fastmm(a, b, None, "tf32")
    assert again.kernel is None and reason2 == reason and emulated_gpu.launches == []


def test_capturing_a_call_whose_kernel_is_not_loaded_raises_and_loads_nothing(emulated_gpu, monkeypatch):
    loads = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(launcher, "is_loaded", lambda dev, cfg: False)
    monkeypatch.setattr(launcher, "load", lambda dev, cfg: loads.append(cfg) or cfg)
    with pytest.raises(RuntimeError, match="not loaded yet.*CUDA graph.*fastmm.warmup"):
        fastmm.matmul(torch.randn(200, 136), torch.randn(136, 168), precision="ieee")
    assert loads == [] and emulated_gpu.launches == [] and dispatch.PLANS.prepared == {}
    monkeypatch.setattr(launcher, "is_loaded", lambda dev, cfg: True)  # warmed up: captured
    a, b = torch.randn(200, 136), torch.randn(136, 168)
    assert relative_error(fastmm.matmul(a, b, precision="ieee"), a, b) <= 1e-6


# --- the plan cache and plan_for --------------------------------------------------------------------

def test_the_plan_cache_is_bounded_and_clear_keeps_the_failed_kernels(monkeypatch):
    monkeypatch.setattr(dispatch, "MAX_CACHED_SHAPES", 2)
    cache = dispatch.PlanCache()
    cache.failed[("k",)] = "why"
    for i in range(3):
        cache.put((i,), dispatch.Prepared("plan"))
    assert list(cache.prepared) == [(2,)]  # emptied when full, then refilled
    cache.clear()
    assert cache.prepared == {} and cache.failed == {("k",): "why"}


def test_a_failed_kernel_is_known_by_its_device_source_and_macros_not_its_geometry():
    """Whether a kernel builds depends on its source and macros: a problem of another size with
    the same kernel must not try NVRTC again."""
    from fastmm.plan import select

    dev = DeviceFacts.simulated_device("sm_90")
    small = select(Problem.dense(384, 300, 64), dev).kernel
    large = select(Problem.dense(768, 300, 64), dev).kernel
    assert small.macros == large.macros and small.grid != large.grid
    assert dispatch.PlanCache.failure_key(0, small) == dispatch.PlanCache.failure_key(0, large)
    assert dispatch.PlanCache.failure_key(1, small) != dispatch.PlanCache.failure_key(0, small)


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(dispatch, "device_facts", lambda index: DeviceFacts.simulated_device("sm_90", index))
    monkeypatch.setattr(dispatch, "PLANS", dispatch.PlanCache())
    monkeypatch.delenv("FASTMM_KERNEL", raising=False)


def test_plan_for_consults_the_failed_kernels(sm90):
    p = Problem.dense(100, 300, 8192, "tf32", b_t=True)  # (5 tiles at K = 8192: tf32_mma splits K)
    plan = dispatch.plan_for(p, 0)
    assert plan.kernel is not None and plan.kernel.family == "tf32_mma"
    dispatch.PLANS.failed[dispatch.PlanCache.failure_key(0, plan.kernel)] = "kernel tf32_mma failed to compile (boom)"
    failed = dispatch.plan_for(p, 0)
    assert failed.kernel is None and failed.reduce is None
    assert failed.fallback == "kernel tf32_mma failed to compile (boom)"
    assert failed.rejected == plan.rejected and failed.problem == p
    assert dispatch.plan_for(p, 1).kernel == plan.kernel  # another device: not failed there
    assert dispatch.plan_for(Problem.dense(512, 512, 512, "ieee"), 0).kernel is not None


def test_plan_for_takes_fastmm_kernel_and_asks_for_no_tuned_choice_when_forced_or_given_variants(sm90, monkeypatch):
    asked = []
    monkeypatch.setattr(dispatch, "tuned_choice", lambda problem, dev: asked.append(problem) or None)
    p = Problem.dense(512, 512, 512)
    assert dispatch.plan_for(p, 0).kernel.family == "simt_cp_async" and asked == [p]
    monkeypatch.setenv("FASTMM_KERNEL", "scalar")
    assert dispatch.plan_for(p, 0).kernel.family == "scalar" and len(asked) == 1
    monkeypatch.delenv("FASTMM_KERNEL")
    plan = dispatch.plan_for(Problem.dense(16, 4096, 4096), 0, variants=(Skinny(variant="v1"),))
    assert "SK_V2" not in dict(plan.kernel.macros) and len(asked) == 1


def test_fastmm_kernel_forces_its_family_only_where_it_can_run(emulated_gpu, monkeypatch):
    """FASTMM_KERNEL forces its family "where it can run" (README): a product that family cannot
    run (tf32_mma computes no ieee product) is planned as without it, every entry point computes
    it with fastmm's kernels, and explain says the variable was set; the family still runs what
    it can. A name that is no family is an error."""
    monkeypatch.setenv("FASTMM_KERNEL", "tf32_mma")
    a, w, bias = torch.randn(40, 72), torch.randn(56, 72), torch.randn(56)
    unforced = select(Problem.dense(40, 56, 72, "ieee", b_t=True), dispatch.device_facts(0)).kernel.family
    for run, ref in ((lambda: fastmm.matmul(a, w.t(), precision="ieee"), a.double() @ w.double().t()),
                     (lambda: fastmm.linear(a, w, bias, precision="ieee"), a.double() @ w.double().t() + bias.double()),
                     (lambda: fastmm.addmm(bias, a, w.t(), precision="ieee"), a.double() @ w.double().t() + bias.double())):
        emulated_gpu.clear()
        assert relative_error(run(), ref) <= 1e-6
        assert emulated_gpu.families and set(emulated_gpu.families) <= {unforced, "splitk_reduce"}, emulated_gpu.families
    exp = fastmm.explain(a, w.t(), precision="ieee")
    assert exp.kernel == unforced != "tf32_mma"
    assert dict(exp.rejected)["tf32_mma"] == \
        "does not compute precision 'ieee' (FASTMM_KERNEL=tf32_mma is set; the planner chose here)"
    emulated_gpu.clear()
    assert relative_error(fastmm.matmul(a, w.t(), precision="tf32"), a.double() @ w.double().t()) <= 3e-3
    assert emulated_gpu.families[-1] == "tf32_mma"
    # the planner's own plan there, a tuned choice included (asked for as without the variable)
    asked = []
    monkeypatch.setattr(dispatch, "tuned_choice", lambda problem, dev: asked.append(problem) or None)
    p = Problem.dense(40, 56, 72, "ieee", b_t=True)
    assert dispatch.plan_for(p, 0).kernel.family == unforced and asked == [p]
    monkeypatch.setenv("FASTMM_KERNEL", "no_such_family")
    with pytest.raises(ValueError, match="unknown kernel family 'no_such_family'"):
        fastmm.matmul(a, w.t(), precision="ieee")
    with pytest.raises(FamilyCannotRun, match="kernel family 'tf32_mma' cannot run this problem"):
        dispatch.plan_for(Problem.dense(40, 56, 72, "ieee", b_t=True), 0, force="tf32_mma")  # (asked for by name)


def test_a_nested_operand_goes_to_torch_without_a_launch(emulated_gpu):
    """Nested tensors pass for plain ones by type and layout (strided): their ragged rows have no
    strides a kernel can take, so fastmm hands them to torch.matmul (before reading a stride):
    torch's result where torch takes them, torch's error where it does not."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (torch: nested tensors are a prototype)
        x = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)])
        w = torch.nested.nested_tensor([torch.randn(8, 6), torch.randn(8, 6)])
    for requires_grad in (False, True):
        out = fastmm.matmul(x, w.requires_grad_(requires_grad))
        assert out.is_nested and [t.shape for t in out.unbind()] == [(3, 6), (5, 6)]
        assert out.requires_grad == requires_grad
    with pytest.raises(RuntimeError, match="Expected both to be nested"):  # torch's words
        fastmm.matmul(x, torch.randn(8, 6))
    assert emulated_gpu.launches == []
    assert "nested" in fastmm.explain(x, w).fallback
