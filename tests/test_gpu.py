"""fastmm's kernels on a real GPU, against a float64 reference (skipped without CUDA).

Each kernel family is forced through ``dispatch.matmul_fastmm(..., force=family)`` (the test checks the
plan really used it), and the default path runs through ``fastmm.matmul`` (checking explain says a
fastmm kernel, not torch, served it). Tolerances, relative Frobenius error vs float64:
ieee 1e-5, tf32 1e-3, tf32x3 1e-6. Inputs are fresh ``torch.randn`` values for every check.
"""
from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

import fastmm
from fastmm import dispatch, fast_path, ops
from fastmm.families import FAMILIES, SimtCpAsync, Skinny, WgmmaTf32
from fastmm.families.wgmma_tf32 import SPLIT_FORCED_SLICE_K, STAGED_TURNS_160, persistent_pays
from fastmm.plan import TINY_K, TINY_OUTPUTS
from fastmm.runtime import launcher
from fastmm.shapes import analyse, build_problem
from conftest import CANARY, at_offset, guarded_outputs, relative_error, run_forced

pytestmark = pytest.mark.cuda

TOL = {"ieee": 1e-5, "tf32": 1e-3, "tf32x3": 1e-6}
FAMILY_PRECISIONS = [("scalar", "ieee"), ("simt_float4", "ieee"), ("simt_cp_async", "ieee"),
                     ("tf32_mma", "tf32"), ("tf32_mma", "tf32x3"), ("wgmma_tf32", "tf32"),
                     ("wgmma_tf32", "tf32x3")]
FP_IDS = [f"{f}-{p}" for f, p in FAMILY_PRECISIONS]
TENSOR_CORE_FAMILIES = ("tf32_mma", "wgmma_tf32", "kmajor_mma")
PRECISIONS = ("ieee", "tf32", "tf32x3")
SHAPES = [(1, 1, 1), (3, 5, 4), (17, 19, 23), (129, 96, 132), (257, 129, 193), (1000, 1000, 1000),
          (4097, 4095, 4093)]
SHAPE_IDS = ["x".join(map(str, s)) for s in SHAPES]
SMALL = [(64, 64, 64), (67, 65, 63)]  # aligned dims / odd dims, for the exhaustive combinations
SMALL_IDS = ["64^3", "67x65x63"]
NAN = float("nan")


def randn(*shape) -> torch.Tensor:
    return torch.randn(*shape, device="cuda")


def check(c, a, b, precision, rel_err) -> None:
    assert not torch.isnan(c).any(), "NaN in the result (an output element was not written?)"
    err = rel_err(c, a, b)
    if c.numel() < 64 and err > TOL[precision]:
        # A handful of long dot products can cancel (|a.b| << |a||b|), and then even a correctly
        # rounded fp32 sum has a large relative error: measure those against |A||B| instead.
        err = relative_error(c, a, b, scale="abs")
    assert err <= TOL[precision], f"relative error {err:.3g} > {TOL[precision]} ({precision})"


def forced(a, b, family, precision, out=None):
    """``a @ b`` on ``family``; skips where the GPU cannot run it (e.g. sm75 and cp.async)."""
    result, plan = run_forced(a, b, family, precision, out)
    if plan is not None:  # None only when the result has no elements
        assert plan.kernel.family == family
        assert plan.precision_used == (precision if family in TENSOR_CORE_FAMILIES else "ieee")
    return result


def exact_reference(a, b):
    return torch.matmul(a.double(), b.double()).float()


# --- every family on the named shapes -----------------------------------------------------------

@pytest.mark.parametrize("M,N,K", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("family,precision", FAMILY_PRECISIONS, ids=FP_IDS)
def test_family_matches_float64(family, precision, M, N, K, rel_err):
    a, b = randn(M, K), randn(K, N)
    a0, b0 = a.clone(), b.clone()
    c = forced(a, b, family, precision)
    assert c.shape == (M, N) and c.dtype == torch.float32 and c.is_contiguous()
    check(c, a, b, precision, rel_err)
    out = torch.full((M, N), NAN, device="cuda")  # every element must be overwritten
    assert forced(a, b, family, precision, out=out) is out
    check(out, a, b, precision, rel_err)
    assert torch.equal(a, a0) and torch.equal(b, b0)  # inputs never modified (no in-place rounding)


@pytest.mark.parametrize("M,N,K", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_default_path_matches_float64(precision, M, N, K, rel_err):
    a, b = randn(M, K), randn(K, N)
    a0, b0 = a.clone(), b.clone()
    exp = fastmm.explain(a, b, precision=precision)
    assert exp.kernel in FAMILIES and exp.fallback is None, str(exp)
    check(fastmm.matmul(a, b, precision=precision), a, b, precision, rel_err)
    a2, b2 = randn(M, K), randn(K, N)  # the second call of a shape takes the steady-state path
    check(fastmm.matmul(a2, b2, precision=precision), a2, b2, precision, rel_err)
    out = torch.full((M, N), NAN, device="cuda")
    assert fastmm.matmul(a, b, precision=precision, out=out) is out
    check(out, a, b, precision, rel_err)
    assert torch.equal(a, a0) and torch.equal(b, b0)


@pytest.mark.parametrize("M,N,K", [(16, 4096, 4096), (64, 64, 16384), (256, 256, 8192)], ids=str)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_skinny_and_long_k_shapes(precision, M, N, K, rel_err):
    """Where the planner splits K (a second, fixed-order reduce pass)."""
    a, b = randn(M, K), randn(K, N)
    exp = fastmm.explain(a, b, precision=precision)
    assert exp.kernel is not None, str(exp)
    first = fastmm.matmul(a, b, precision=precision)
    check(first, a, b, precision, rel_err)
    assert torch.equal(fastmm.matmul(a, b, precision=precision), first)  # deterministic: same bits


SPLIT_FAST = [(16, 4096, 4096, "ieee"), (16, 4096, 4096, "tf32"), (256, 256, 65536, "ieee"), (256, 256, 8192, "tf32")]


@pytest.mark.parametrize("M,N,K,precision", SPLIT_FAST, ids=["skinny-ieee", "skinny-tf32", "simt-largeK-ieee",
                                                             "tf32_mma-longK-tf32"])
@pytest.mark.parametrize("out_kind", ["none", "nan", "transposed"])
def test_split_k_plans_take_the_fast_path_and_stay_correct(out_kind, M, N, K, precision, rel_err):
    """Split-K plans (a GEMM into a workspace, then splitk_reduce) are served by the steady-state
    entry from the second call on: fresh inputs each call, out=None / a NaN-poisoned out / a
    column-major out (C strides other than the workspace's), the same bits on the same inputs."""

    def make_out():
        if out_kind == "none":
            return None
        if out_kind == "nan":
            return torch.full((M, N), NAN, device="cuda")
        return torch.full((N, M), NAN, device="cuda").t()

    a, b = randn(M, K), randn(K, N)
    exp = fastmm.explain(a, b, precision=precision, out=make_out())
    fused = exp.plan.kernel.split_fused  # the skinny kernel sums its own slices (sm_90)
    assert exp.kernel is not None and (exp.plan.reduce is not None or fused) and exp.plan.kernel.split_k > 1, str(exp)
    for _ in range(4):
        a, b, out = randn(M, K), randn(K, N), make_out()
        c = fastmm.matmul(a, b, precision=precision, out=out)
        assert out is None or c is out
        assert c.shape == (M, N) and (out is not None or c.is_contiguous())
        check(c, a, b, precision, rel_err)
        entry = fast_path.ENTRIES.get(fast_path.key_of(a, b, out, precision))
        assert isinstance(entry, fast_path.FastEntry) and entry.runner is not None, (
            "no fast entry with its split runner after a call")
    first = fastmm.matmul(a, b, precision=precision, out=make_out()).clone()
    for _ in range(3):
        assert torch.equal(fastmm.matmul(a, b, precision=precision, out=make_out()), first)  # fixed-order sum


def test_split_k_fast_path_on_two_streams_at_once_keeps_workspaces_apart(rel_err):
    """Queued split-K calls on two streams, no sync between: each call's workspace is freed on
    return and reused by later calls of its own stream only (stream-ordered allocator)."""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    shapes = {s1: (16, 4096, 4096), s2: (64, 64, 16384)}
    for M, N, K in shapes.values():
        a, b = randn(M, K), randn(K, N)
        assert fastmm.explain(a, b, precision="ieee").plan.kernel.split_k > 1
        fastmm.matmul(a, b, precision="ieee")  # planned; later calls take the fast path
    inputs = {s: [(randn(M, K), randn(K, N)) for _ in range(8)] for s, (M, N, K) in shapes.items()}
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    results = {s1: [], s2: []}
    for i in range(8):
        for s in (s1, s2):
            with torch.cuda.stream(s):
                results[s].append(fastmm.matmul(*inputs[s][i], precision="ieee"))
    torch.cuda.synchronize()
    for s in (s1, s2):
        for c, (a, b) in zip(results[s], inputs[s]):
            check(c, a, b, "ieee", rel_err)


FUSED_SPLIT = [(16, 4096, 4096), (1, 4096, 4096), (16, 4099, 4096), (12, 1000, 65536), (8, 1000, 65536)]


def _fused_plan_or_skip(a, b):
    plan = fastmm.explain(a, b, precision="ieee").plan
    if plan.kernel is None or not plan.kernel.split_fused:
        pytest.skip(f"no fused split-K plan on this device: {plan.describe()}")
    return plan


def _eager_counters_are_zero() -> None:
    from fastmm.runtime import arrivals

    torch.cuda.synchronize()
    for key, buf in arrivals._buffers.items():
        assert not arrivals.values(buf).any(), f"arrival counters of {key} not back at 0 after the launches"


@pytest.mark.parametrize("M,N,K", FUSED_SPLIT, ids=str)
def test_fused_split_k_gives_the_bits_of_the_second_pass(M, N, K, rel_err):
    """The skinny kernel's own slice sums (last block per column tile) add the slices in the
    order splitk_reduce does: the same bits as the two-launch plan (the variant
    Skinny(fuse_split=False), planned and cached apart from the registry's skinny), into a
    NaN-poisoned out, and every arrival counter is 0 again afterwards."""
    a, b = randn(M, K), randn(K, N)
    plan = _fused_plan_or_skip(a, b)
    fused = []
    for _ in range(2):  # the second call: the fast path, the stream's counters reused
        out = torch.full((M, N), NAN, device="cuda")
        assert fastmm.matmul(a, b, out=out) is out
        fused.append(out)
    check(fused[0], a, b, "ieee", rel_err)
    assert torch.equal(fused[0], fused[1])
    _eager_counters_are_zero()
    out = torch.full((M, N), NAN, device="cuda")
    result, two, reason = dispatch.matmul_fastmm(a, b, out, "ieee", variants=(Skinny(fuse_split=False),))
    assert reason is None and result is out, reason
    assert two.kernel.family == "skinny" and not two.kernel.split_fused and two.reduce is not None
    assert two.reduce.family == "splitk_reduce" and two.kernel.grid == plan.kernel.grid  # the same slices
    assert torch.equal(out, fused[0])


# (M, N, K, layout): the 1024-token products of a small model (x @ W.t(), grad_x, grad_W), and
# odd sizes whose workspace and C take single floats
SIMT_FUSED = [(1024, 1024, 1024, "linear"), (1024, 2816, 1024, "linear"), (1024, 256, 1024, "linear"),
              (2816, 1024, 1024, "a_t"), (1000, 1000, 1024, "linear"), (999, 1001, 1100, "a_t"),
              (394, 3072, 768, "linear")]  # (the split model's 64 x 256 tile in 3 slices, sm_90)


@dataclasses.dataclass(frozen=True)
class PinnedSimt(SimtCpAsync):
    """simt_cp_async planned on one tile option (tile + split flag) with the family's ``split``:
    the same tile and slices as another plan, whatever its rules or the split model would pick."""

    option: tuple = ()

    def configure(self, p, dev, option=None):
        return super().configure(p, dev, self.option if option is None else option)


def pinned_like(plan, **changes) -> PinnedSimt:
    """A PinnedSimt of ``plan``'s simt_cp_async tile and K split, with ``changes``."""
    m = dict(plan.kernel.macros)
    return PinnedSimt(option=(m["WARPS_M"], m["WARPS_N"], m["THREAD_M"], 1), split=plan.kernel.split_k,
                      split_model=False, **changes)


@pytest.mark.parametrize("M,N,K,layout", SIMT_FUSED, ids=str)
@pytest.mark.parametrize("out_kind", ["nan", "transposed"])
def test_simt_fused_split_gives_the_bits_of_the_reduce_pass(M, N, K, layout, out_kind, rel_err):
    """simt_cp_async's split-K plans of a few slices sum them in their last block per tile
    (SPLIT_FUSED), in slice order: the same bits as the GEMM + splitk_reduce plan of the variant
    SimtCpAsync(fuse_split=False) on the same tile and slices (PinnedSimt), into a NaN-poisoned out, row- or
    column-major, and every arrival counter back at 0 afterwards."""
    a = randn(K, M).t() if layout == "a_t" else randn(M, K)
    b = randn(N, K).t() if layout == "linear" else randn(K, N)

    def make_out():
        return torch.full((M, N), NAN, device="cuda") if out_kind == "nan" else torch.full((N, M), NAN, device="cuda").t()

    plan = fastmm.explain(a, b, precision="ieee", out=make_out()).plan
    if plan.kernel is None or plan.kernel.family != "simt_cp_async" or not plan.kernel.split_fused:
        pytest.skip(f"no fused SIMT split on this device: {plan.describe()}")
    assert plan.reduce is None and "last block" in plan.describe()
    fused = []
    for _ in range(2):  # the second call: the fast path, the stream's counters reused
        out = make_out()
        assert fastmm.matmul(a, b, precision="ieee", out=out) is out
        fused.append(out)
    check(fused[0], a, b, "ieee", rel_err)
    assert torch.equal(fused[0], fused[1])
    _eager_counters_are_zero()
    out = make_out()
    unfused = pinned_like(plan, fuse_split=False)  # (the same tile and slices, summed by splitk_reduce)
    result, two, reason = dispatch.matmul_fastmm(a, b, out, "ieee", variants=(unfused,))
    assert reason is None and result is out, reason
    assert not two.kernel.split_fused and two.reduce is not None and two.reduce.family == "splitk_reduce"
    assert two.kernel.grid == plan.kernel.grid and two.kernel.tile == plan.kernel.tile  # the same slices
    assert torch.equal(out, fused[0])


#: (a, b): single-float C (N % 4 != 0) on the SIMT tiles other than the largest, which store it
#: through shared memory as planned on sm_90 and from the registers with
#: SimtCpAsync(stage_c_all_tiles=False)
STAGED_C_CASES = {
    "attention-scores-197": lambda: (randn(64, 197, 128), randn(64, 197, 128).transpose(1, 2)),  # 128 x 128, grown
    "attention-scores-197-k64": lambda: (randn(64, 197, 64), randn(64, 197, 64).transpose(1, 2)),  # 128 x 64, grown
    "attention-scores-77": lambda: (randn(96, 77, 64), randn(96, 77, 64).transpose(1, 2)),  # 128 x 64, grown
    "attention-scores-77-b24": lambda: (randn(24, 77, 64), randn(24, 77, 64).transpose(1, 2)),  # 64 x 64
    "split-slices-701": lambda: (randn(300, 1100), randn(701, 1100).t()),  # 64 x 64 in 8 slices: the workspace
    "rows-2048-n1001": lambda: (randn(2048, 64), randn(1001, 64).t()),  # 128 x 128, grown, into C itself
}


@pytest.mark.parametrize("case", list(STAGED_C_CASES))
def test_single_float_c_staged_on_any_simt_tile_gives_the_planned_bits(case):
    """The planned staged store (the tile through shared memory, grown past the pipeline's buffers
    where they do not hold it: C_STAGE_FLOATS) writes the same values as the store from the
    registers, every output (both outputs start NaN) and nothing past the output's ends (a guard
    of canaries either side of it in one flat buffer; a split plan's staged store writes its
    workspace, which splitk_reduce then sums into C)."""
    if torch.cuda.get_device_capability() < SimtCpAsync.stage_c_cc:
        pytest.skip(f"C is staged from sm_{SimtCpAsync.stage_c_cc[0]}{SimtCpAsync.stage_c_cc[1]} on")
    a, b = STAGED_C_CASES[case]()
    shape, guard = (*a.shape[:-1], b.shape[-1]), 4096
    outs = []
    for variants in ((SimtCpAsync(stage_c_all_tiles=False),), ()):
        flat = torch.full((guard + math.prod(shape) + guard,), CANARY, device="cuda")
        out = flat[guard:guard + math.prod(shape)].view(shape).fill_(NAN)
        result, plan, reason = dispatch.matmul_fastmm(a, b, out, "ieee", variants=variants)
        assert reason is None and result is out and plan.kernel.family == "simt_cp_async", reason
        assert torch.all(flat[:guard] == CANARY) and torch.all(flat[guard + math.prod(shape):] == CANARY)
        outs.append((out, plan))
    (registers, p0), (staged, p1) = outs
    assert "C_STAGED" not in dict(p0.kernel.macros)
    assert dict(p1.kernel.macros).get("C_STAGED") == 1 and p1.kernel.tile == p0.kernel.tile
    assert torch.equal(registers, staged)
    assert relative_error(staged, a, b) < TOL["ieee"]
    if a.dim() == 2:  # C a window of a wider matrix (rows pitched past N), canaries all around it
        _, window, untouched = guarded_outputs(*shape)
        result, p2, reason = dispatch.matmul_fastmm(a, b, window, "ieee")
        assert reason is None and dict(p2.kernel.macros).get("C_STAGED") == 1, reason
        assert torch.equal(window, staged) and untouched()


#: (a, b, precision): products of a few rows, on simt_cp_async's 32-row tiles
SHORT_TILE_CASES = {
    "decode-linear-long-k": lambda: (randn(32, 8192), randn(4096, 8192).t(), "ieee"),  # x @ W.t(), split
    "rows-17-odd-n-linear": lambda: (randn(17, 1100), randn(1531, 1100).t(), "ieee"),
    "rows-3-row-major-b": lambda: (randn(3, 2053), randn(2053, 700), "ieee"),
    "rows-1-batched-odd-k": lambda: (randn(4, 1, 333), randn(4, 333, 257), "ieee"),
    "rows-29-unaligned-a": lambda: (at_offset((29, 999), 1), randn(999, 1030), "ieee"),
    "rows-24-unaligned-b": lambda: (randn(24, 517), at_offset((517, 1027), 1), "tf32x3"),  # B in single floats
    "lm-head-decode": lambda: (randn(20, 768), randn(50257, 768).t(), "tf32x3"),
}


@pytest.mark.parametrize("bn", [256, 128])
@pytest.mark.parametrize("case", sorted(SHORT_TILE_CASES))
def test_simt_short_tiles_compute_few_row_products(case, bn, rel_err):
    """The 32-row SIMT tiles (THREAD_M 4: 4 x 8 outputs a thread) at both widths, with the split
    the planner gives them (cluster pairs + reduce, fused slices, none): x @ W.t(), row-major and
    batched B, an unaligned A, odd N and K, into NaN-poisoned contiguous and transposed outputs;
    the two give the same bits (each output sums its k-steps, and its slices, in the same order)."""
    a, b, precision = SHORT_TILE_CASES[case]()
    M, N = a.shape[-2], b.shape[-1]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    outs = []
    for out in (torch.full(batch + (M, N), NAN, device="cuda"), torch.full(batch + (N, M), NAN, device="cuda").mT):
        result, plan = run_forced(a, b, "simt_cp_async", precision, out, variants=(SimtCpAsync(short_bn=bn),))
        assert result is out and plan.kernel.family == "simt_cp_async"
        m = dict(plan.kernel.macros)
        assert m["THREAD_M"] == 4 and plan.kernel.tile[:2] == (32, bn), plan.describe()
        check(out, a, b, precision, rel_err)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    _eager_counters_are_zero()


def _chain_reference(x0, ws, steps):
    """The float64 products x0 @ ws[0] @ ws[1] ... after each of ``steps`` steps (ws cycled)."""
    ref, out = x0.double(), []
    for i in range(steps):
        ref = ref @ ws[i % len(ws)].double()
        out.append(ref)
    return out


def _check_chain(got, refs, what, first=0):
    """Step first + i of a chain: got[i] against refs[i], within the tolerance of that many steps."""
    for i, (g, ref) in enumerate(zip(got, refs), start=first):
        assert not torch.isnan(g).any(), f"{what}, step {i}: NaN (a launch read before the one ahead wrote?)"
        err = relative_error(g, ref)
        assert err <= TOL["ieee"] * (i + 1), f"{what}, step {i}: relative error {err:.3g}"


@pytest.mark.parametrize("M,K", [(16, 4096), (1, 4096), (32, 8192), (5, 1000)], ids=str)
def test_dependent_launches_chained_back_to_back_are_exact(M, K, monkeypatch):
    """Skinny launches are programmatic dependent launches on sm_90+ (scheduled while the kernel
    ahead finishes; its wait must hold them until that one is done). Chains of calls, each
    reading what the call before wrote, compared with the same chain in float64 at every step:
    (1) back to back into NaN-poisoned buffers, nothing queued between the calls; (2) ping-pong
    out= buffers, nothing between: each call also overwrites what the call before read;
    (3) ping-pong with torch kernels between (a NaN fill, a copy of each result)."""
    monkeypatch.delenv("FASTMM_PDL", raising=False)
    x0 = randn(M, K)
    ws = [randn(K, K) / math.sqrt(K) for _ in range(3)]
    plan = fastmm.explain(x0, ws[0], precision="ieee").plan
    assert plan is not None and plan.kernel.family == "skinny"
    dependent = torch.cuda.get_device_capability() >= (9, 0)
    assert plan.kernel.dependent_launch is dependent
    lc = launcher.load(plan.device, plan.kernel).launch_config
    assert bool(getattr(lc, "programmatic_stream_serialization", False)) is dependent
    steps = 24
    refs = _chain_reference(x0, ws, steps)
    torch.cuda.synchronize()

    bufs = [x0] + [torch.full((M, K), NAN, device="cuda") for _ in range(steps)]
    for i in range(steps):
        fastmm.matmul(bufs[i], ws[i % 3], out=bufs[i + 1])
    torch.cuda.synchronize()
    _check_chain(bufs[1:], refs, "back to back")

    pp = [x0.clone(), torch.full((M, K), NAN, device="cuda")]
    torch.cuda.synchronize()
    for i in range(steps):
        fastmm.matmul(pp[i % 2], ws[i % 3], out=pp[(i + 1) % 2])
    torch.cuda.synchronize()
    _check_chain([pp[steps % 2]], refs[-1:], "ping-pong", first=steps - 1)

    pp = [x0.clone(), torch.full((M, K), NAN, device="cuda")]
    outs = []
    for i in range(steps):
        src, dst = pp[i % 2], pp[(i + 1) % 2]
        dst.fill_(NAN)
        fastmm.matmul(src, ws[i % 3], out=dst)
        outs.append(dst.clone())
    torch.cuda.synchronize()
    _check_chain(outs, refs, "ping-pong with torch kernels between")


def test_fused_split_k_on_two_streams_at_once_uses_separate_counters(rel_err):
    """Queued fused calls on two streams, no sync between: each stream counts in its own
    buffer, so concurrent launches of the same plan never see each other's arrivals."""
    M, N, K = 16, 4096, 4096
    a, b = randn(M, K), randn(K, N)
    _fused_plan_or_skip(a, b)
    fastmm.matmul(a, b)
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    inputs = {s: [(randn(M, K), randn(K, N)) for _ in range(6)] for s in streams}
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    results = {s: [] for s in streams}
    for i in range(6):
        for s in streams:
            with torch.cuda.stream(s):
                results[s].append(fastmm.matmul(*inputs[s][i]))
    torch.cuda.synchronize()
    for s in streams:
        for c, (x, y) in zip(results[s], inputs[s]):
            check(c, x, y, "ieee", rel_err)
    _eager_counters_are_zero()


def test_fused_split_k_in_a_cuda_graph_has_its_own_counters(rel_err):
    """A fused launch captured into a graph counts in a buffer of its own, zeroed by a fill in
    the graph: replays on another stream, while eager calls of the same plan run on the capture
    stream and the default one, stay correct."""
    M, N, K = 16, 4096, 4096
    a, b = randn(M, K), randn(K, N)
    _fused_plan_or_skip(a, b)
    out = torch.full((M, N), NAN, device="cuda")
    fastmm.warmup(a, b, out=out)
    torch.cuda.synchronize()
    capture, replay = torch.cuda.Stream(), torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        fastmm.matmul(a, b, out=out)
    eager = [(randn(M, K), randn(K, N)) for _ in range(4)]
    for i in range(3):
        a.copy_(randn(M, K))
        b.copy_(randn(K, N))
        out.fill_(NAN)
        replay.wait_stream(torch.cuda.current_stream())
        capture.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(replay):
            graph.replay()
        with torch.cuda.stream(capture):  # the same plan on the stream the graph was captured on
            on_capture = [fastmm.matmul(x, y) for x, y in eager]
        on_default = [fastmm.matmul(x, y) for x, y in eager]
        torch.cuda.synchronize()
        check(out, a, b, "ieee", rel_err)
        for c1, c2, (x, y) in zip(on_capture, on_default, eager):
            check(c1, x, y, "ieee", rel_err)
            assert torch.equal(c1, c2)
    _eager_counters_are_zero()


SPLIT_PAIRS = [(256, 256, 65536), (250, 254, 40000), (129, 256, 50000), (100, 256, 60000)]


@pytest.mark.parametrize("M,N,K", SPLIT_PAIRS, ids=str)
@pytest.mark.parametrize("out_kind", ["nan", "transposed"])
def test_split_k_in_cluster_pairs_matches_float64(M, N, K, out_kind, rel_err):
    """Split-K blocks in cluster pairs (sm_90) that add their partial tiles through distributed
    shared memory, then splitk_reduce over half the slices: right into a NaN-poisoned or a
    column-major out, for M and N off the tile (N % 4 != 0: single-float stores), and the same
    bits on every run."""
    a, b = randn(M, K), randn(K, N)
    plan = fastmm.explain(a, b, precision="ieee").plan
    if plan.kernel is None or not plan.kernel.split_pair:
        pytest.skip(f"no cluster-pair split-K plan on this device: {plan.describe()}")
    assert plan.reduce is not None and plan.kernel.split_slices == plan.kernel.split_k // 2

    def make_out():
        if out_kind == "nan":
            return torch.full((M, N), NAN, device="cuda")
        return torch.full((N, M), NAN, device="cuda").t()

    first = fastmm.matmul(a, b, out=make_out())
    check(first, a, b, "ieee", rel_err)
    for _ in range(3):
        assert torch.equal(fastmm.matmul(a, b, out=make_out()), first)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_simt_families_serve_tf32_requests_at_fp32_accuracy(precision, rel_err):
    a, b = randn(300, 200), randn(200, 260)
    for family in ("simt_float4", "simt_cp_async", "scalar"):
        c = forced(a, b, family, precision)  # checks precision_used == "ieee"
        check(c, a, b, "ieee", rel_err)


# --- x @ W.t() on SIMT: W (K-contiguous) copied row-major first (simt_core.transposes_b) -------

# plain, stream-K (K odd), split-K in cluster pairs (on the H200), N past 2^15 and not a multiple of 4
WT_STAGED = [(768, 16384, 1024), (1000, 4099, 1023), (2048, 3072, 1024), (2048, 50257, 768)]


@pytest.mark.parametrize("M,N,K", WT_STAGED, ids=str)
@pytest.mark.parametrize("w_offset", [0, 1])  # W's storage offset: float4 reads of W, or single floats
@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_simt_reads_a_transposed_weight_from_its_row_major_copy(precision, w_offset, M, N, K, rel_err):
    x, w = randn(M, K), at_offset((N, K), w_offset)
    w_before = w.clone()
    out, out2, untouched = guarded_outputs(M, N)
    out.fill_(NAN)
    out2.fill_(NAN)
    plan = run_forced(x, w.t(), "simt_cp_async", precision, out)[1]
    # (staged where the in-place plan takes the 128 x 256 tile without a fused split: on the
    # H200 all four; a GPU with fewer SMs may split some of them instead)
    in_place = run_forced(x, w.t(), "simt_cp_async", precision, variants=(SimtCpAsync(transpose_b=False),))[1]
    staged = in_place.kernel.tile[:2] == (128, 256) and not in_place.kernel.split_fused
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert staged, in_place.describe()
    assert plan.staging == ((("b", K, -(-N // 4) * 4),) if staged else ()), plan.describe()
    if staged:
        assert dict(plan.stagers[0].macros)["SRC_VEC"] == int(w_offset == 0 and K % 4 == 0)
    check(out, x, w.t(), "ieee", rel_err)
    fastmm.matmul(x, w.t(), out=out2, precision="ieee")  # the default plan: the same staging for ieee
    check(out2, x, w.t(), "ieee", rel_err)
    assert untouched() and torch.equal(w, w_before)
    # the Linear path: a fused bias on the same plan, from the fast entry on later calls
    bias = randn(N)
    for _ in range(2):
        y = fastmm.linear(x, w, bias, precision="ieee")
        assert rel_err(y, x.double() @ w.double().t() + bias.double()) <= TOL["ieee"]
    assert torch.equal(w, w_before)


# --- exact answers ---------------------------------------------------------------------------

@pytest.mark.parametrize("family,precision", FAMILY_PRECISIONS + [("default", p) for p in PRECISIONS],
                         ids=FP_IDS + [f"default-{p}" for p in PRECISIONS])
def test_small_examples_are_exact(family, precision):
    def mm(a, b):
        return fastmm.matmul(a, b, precision=precision) if family == "default" else forced(a, b, family, precision)

    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device="cuda")
    b = torch.tensor([[5.0, 6.0], [7.0, 8.0]], device="cuda")
    assert torch.equal(mm(a, b), torch.tensor([[19.0, 22.0], [43.0, 50.0]], device="cuda"))
    row = torch.tensor([[1.0, 2.0, 3.0]], device="cuda")
    col = torch.tensor([[4.0, 5.0, 6.0]], device="cuda").T
    assert torch.equal(mm(row, col), torch.tensor([[32.0]], device="cuda"))
    v = fastmm.matmul(torch.tensor([1.0, 2.0, 3.0], device="cuda"), torch.tensor([4.0, 5.0, 6.0], device="cuda"),
                      precision=precision)
    assert v.shape == () and v.item() == 32.0


@pytest.mark.parametrize("M,N,K", [(129, 96, 132), (257, 129, 193), (64, 256, 1000)], ids=str)
@pytest.mark.parametrize("family,precision", FAMILY_PRECISIONS, ids=FP_IDS)
def test_small_integer_inputs_give_exact_sums(family, precision, M, N, K):
    """Integers in [-3, 3] are exact in TF32 and every partial sum is exact in fp32, so any
    correct kernel returns the float64 answer bit for bit (CUTLASS's trick)."""
    a = torch.randint(-3, 4, (M, K), device="cuda").float()
    b = torch.randint(-3, 4, (K, N), device="cuda").float()
    c = forced(a, b, family, precision)
    assert torch.equal(c, exact_reference(a, b))
    assert c.abs().sum() > 0


# --- strides, offsets, views ------------------------------------------------------------------

@pytest.mark.parametrize("M,N,K", SMALL, ids=SMALL_IDS)
@pytest.mark.parametrize("offset", [1, 2, 3])
@pytest.mark.parametrize("which", ["a", "b", "c"])
@pytest.mark.parametrize("family,precision", FAMILY_PRECISIONS, ids=FP_IDS)
def test_storage_offsets(family, precision, which, offset, M, N, K, rel_err):
    a = at_offset((M, K), offset) if which == "a" else randn(M, K)
    b = at_offset((K, N), offset) if which == "b" else randn(K, N)
    out = at_offset((M, N), offset, fill=NAN) if which == "c" else torch.full((M, N), NAN, device="cuda")
    forced(a, b, family, precision, out=out)
    check(out, a, b, precision, rel_err)


@pytest.mark.parametrize("offset", [1, 2, 3])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_storage_offsets_on_every_operand_default_path(precision, offset, rel_err):
    M, N, K = 300, 260, 196
    a, b = at_offset((M, K), offset), at_offset((K, N), (offset + 1) % 4)
    out = at_offset((M, N), (offset + 2) % 4, fill=NAN)
    assert fastmm.explain(a, b, precision=precision, out=out).kernel is not None
    fastmm.matmul(a, b, precision=precision, out=out)
    check(out, a, b, precision, rel_err)


@pytest.mark.parametrize("M,N,K", SMALL + [(300, 260, 196)], ids=SMALL_IDS + ["300x260x196"])
@pytest.mark.parametrize("views", ["aT", "bT", "aT_bT"])
@pytest.mark.parametrize("family,precision", FAMILY_PRECISIONS, ids=FP_IDS)
def test_transposed_views(family, precision, views, M, N, K, rel_err):
    a = randn(K, M).T if "aT" in views else randn(M, K)
    b = randn(N, K).T if "bT" in views else randn(K, N)
    check(forced(a, b, family, precision), a, b, precision, rel_err)
    out = randn(N, M).fill_(NAN).T  # a column-major out
    forced(a, b, family, precision, out=out)
    check(out, a, b, precision, rel_err)


@pytest.mark.parametrize("pad", [1, 2, 4])
@pytest.mark.parametrize("family,precision", FAMILY_PRECISIONS, ids=FP_IDS)
def test_row_strided_slices(family, precision, pad, rel_err):
    M, N, K = 130, 96, 100
    a = randn(M, K + pad)[:, :K]
    b = randn(K, N + pad)[:, :N]
    out = torch.full((M, N + pad), NAN, device="cuda")[:, :N]
    forced(a, b, family, precision, out=out)
    check(out, a, b, precision, rel_err)
    a2 = randn(M, 2 * K)[:, ::2]  # no unit stride at all
    check(forced(a2, b, family, precision), a2, b, precision, rel_err)


BATCHED = [
    ((3, 33, 40), (3, 40, 65)),
    ((2, 1, 33, 40), (3, 40, 65)),  # broadcast both ways
    ((33, 40), (4, 40, 65)),
    ((4, 33, 40), (40, 65)),
    ((2, 1, 4, 33, 40), (1, 3, 4, 40, 65)),  # three batch dims that cannot merge: two launches
    ((40,), (3, 40, 65)),
    ((3, 33, 40), (40,)),
    ((5, 1, 2, 40), (5, 40, 1)),
]


@pytest.mark.parametrize("sa,sb", BATCHED, ids=[f"{a}@{b}" for a, b in BATCHED])
@pytest.mark.parametrize("family,precision", FAMILY_PRECISIONS, ids=FP_IDS)
def test_batched_and_broadcast_shapes(family, precision, sa, sb, rel_err):
    a, b = randn(*sa), randn(*sb)
    c = forced(a, b, family, precision)
    assert c.shape == torch.matmul(a.cpu(), b.cpu()).shape
    check(c, a, b, precision, rel_err)


#: Small tf32 products in large batches, where the cost model weighs wgmma's persistent tiles
#: against the fp32 SIMT plan (NOTES run 57): (batch, M, N, K, B as a transposed view).
SMALL_BATCHED = [(4096, 64, 64, 64, False), (512, 64, 64, 32, True), (1024, 128, 64, 64, True),
                 (512, 77, 77, 64, False)]


@pytest.mark.parametrize("batch,M,N,K,bt", SMALL_BATCHED, ids=[f"{b}x{m}x{n}x{k}{'-bt' if t else ''}"
                                                               for b, m, n, k, t in SMALL_BATCHED])
def test_small_batched_tf32_products_on_the_planned_kernel_match_float64(batch, M, N, K, bt, rel_err):
    """Whatever the planner picks for these (wgmma's persistent tiles, or the fp32 plan where the
    cost model has it faster), the dispatcher's own call writes every output at the accuracy of
    the precision it ran."""
    a = randn(batch, M, K)
    b = randn(batch, N, K).transpose(1, 2) if bt else randn(batch, K, N)
    out = torch.full((batch, M, N), NAN, device="cuda")
    plan = fastmm.explain(a, b, precision="tf32").plan
    assert plan.kernel is not None, plan.fallback
    fastmm.matmul(a, b, out=out, precision="tf32")
    tol = TOL["ieee"] if plan.precision_used == "ieee" else TOL["tf32"]
    assert not torch.isnan(out).any() and rel_err(out, a, b) <= tol, plan.describe()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_expanded_stride_zero_batch(precision, rel_err):
    a = randn(1, 70, 50).expand(6, 70, 50)
    b = randn(6, 50, 90)
    check(fastmm.matmul(a, b, precision=precision), a, b, precision, rel_err)
    out = torch.full((6, 70, 90), NAN, device="cuda")
    fastmm.matmul(b.transpose(-1, -2), a.transpose(-1, -2), precision=precision, out=out.transpose(-1, -2))
    check(out, a, b, precision, rel_err)


def test_batch_beyond_the_grid_z_limit(rel_err):
    a, b = randn(70_000, 4, 8), randn(70_000, 8, 4)
    for precision in ("ieee", "tf32"):
        check(fastmm.matmul(a, b, precision=precision), a, b, precision, rel_err)


# --- empty and degenerate shapes ------------------------------------------------------------------

@pytest.mark.parametrize("family,precision", FAMILY_PRECISIONS + [("default", "ieee")], ids=FP_IDS + ["default"])
def test_k_zero_gives_zeros_and_empty_dims_give_empty_results(family, precision):
    def mm(a, b, out=None):
        if family == "default":
            return fastmm.matmul(a, b, precision=precision, out=out)
        return forced(a, b, family, precision, out=out)

    out = torch.full((37, 41), NAN, device="cuda")
    assert mm(randn(37, 0), randn(0, 41), out=out) is out
    assert torch.equal(out, torch.zeros(37, 41, device="cuda"))
    assert torch.equal(mm(randn(3, 37, 0), randn(0, 41)), torch.zeros(3, 37, 41, device="cuda"))
    assert mm(randn(0, 16), randn(16, 41)).shape == (0, 41)
    assert mm(randn(37, 16), randn(16, 0)).shape == (37, 0)
    assert mm(randn(0, 37, 16), randn(16, 41)).shape == (0, 37, 41)
    assert mm(randn(0), randn(0)).item() == 0.0


# --- out= ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", PRECISIONS)
def test_out_overlapping_an_input_gives_the_right_answer(precision, rel_err):
    for n in (64, 257):
        a, b = randn(n, n), randn(n, n)
        a0, b0 = a.clone(), b.clone()
        assert fastmm.matmul(a, b, out=a, precision=precision) is a
        check(a, a0, b0, precision, rel_err)
        assert fastmm.matmul(a0, b, out=b, precision=precision) is b
        check(b, a0, b0, precision, rel_err)
        buf = randn(2, n, n)  # out is one half of a buffer whose other half is an input
        x, y = buf[0].clone(), b0.clone()
        fastmm.matmul(buf[0], y, out=buf[1], precision=precision)
        check(buf[1], x, y, precision, rel_err)
        t = randn(n, n)  # out is the transpose of an input
        t0 = t.clone()
        fastmm.matmul(t, b0, out=t.T, precision=precision)
        check(t.T, t0, b0, precision, rel_err)


@pytest.mark.parametrize("family,precision", FAMILY_PRECISIONS, ids=FP_IDS)
def test_out_overlapping_an_input_on_each_family(family, precision, rel_err):
    a, b = randn(96, 96), randn(96, 96)
    a0 = a.clone()
    forced(a, b, family, precision, out=a)
    check(a, a0, b, precision, rel_err)


def test_out_of_the_wrong_shape_is_resized_with_torchs_warning(rel_err):
    a, b = randn(30, 20), randn(20, 10)
    out = randn(4, 4)
    with pytest.warns(UserWarning, match="An output with one or more elements was resized"):
        assert fastmm.matmul(a, b, out=out, precision="ieee") is out
    assert out.shape == (30, 10)
    check(out, a, b, "ieee", rel_err)


def test_resized_outs_are_resized_on_every_call_not_only_the_first(rel_err):
    """The steady-state path is keyed by out's shape before the call: an out that needed resizing
    must not leave an entry that writes M x N floats into the next small out."""
    a, b = randn(300, 200), randn(200, 100)
    for _ in range(3):
        for small in (torch.empty(0, device="cuda"), torch.full((4, 4), NAN, device="cuda")):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch's resize warning for (4, 4)
                got = fastmm.matmul(a, b, out=small, precision="ieee")
            assert got is small and small.shape == (300, 100)
            check(small, a, b, "ieee", rel_err)


def test_a_refused_tensor_map_falls_back_to_torch(monkeypatch, rel_err):
    needs_sm90()
    from fastmm.runtime import tensor_map

    def refuse(*args, **kwargs):
        raise tensor_map.TensorMapError("refused (test)")

    monkeypatch.setattr(tensor_map, "encode", refuse)
    monkeypatch.setattr(dispatch, "PLANS", dispatch.PlanCache())
    monkeypatch.setattr(fast_path, "ENTRIES", {})
    a, b = randn(2048, 1024), randn(1024, 1536)
    out = torch.full((2048, 1536), NAN, device="cuda")
    assert fastmm.matmul(a, b, out=out, precision="tf32") is out
    check(out, a, b, "tf32", rel_err)
    assert fastmm.matmul(a, b, precision="tf32").shape == (2048, 1536)  # the fallback is remembered


def test_wgmma_tf32x3_with_an_odd_number_of_k_steps_past_the_short_k(rel_err):
    """K > X3_SHORT_K promotes every 2 k-steps; 4097 = 128 steps of 32 + 1: the last, odd step
    runs the kernel's leftover branch."""
    needs_sm90()
    a, b = randn(256, 4097), randn(4097, 384)
    c, plan = forced_plan(a, b, "wgmma_tf32", "tf32x3")
    assert dict(plan.kernel.macros)["PROMOTE_EVERY"] == 2
    check(c, a, b, "tf32x3", rel_err)
    assert relative_error(c, a.double() @ b.double()) <= 3e-7


def test_out_errors_are_torchs_errors():
    a, b = randn(3, 4), randn(4, 5)
    for out in (torch.empty(3, 5, device="cuda", dtype=torch.float64), torch.empty(3, 5)):
        with pytest.raises(RuntimeError) as theirs:
            torch.matmul(a, b, out=out.clone())
        with pytest.raises(RuntimeError) as ours:
            fastmm.matmul(a, b, out=out)
        assert str(ours.value) == str(theirs.value)
    with pytest.raises(RuntimeError) as theirs:
        torch.matmul(a, b.cpu())
    with pytest.raises(RuntimeError) as ours:
        fastmm.matmul(a, b.cpu())
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("M,N,K", [(129, 96, 132), (257, 129, 193), (67, 65, 63)], ids=str)
@pytest.mark.parametrize("family,precision", FAMILY_PRECISIONS, ids=FP_IDS)
def test_nothing_outside_the_output_is_written(family, precision, M, N, K, rel_err):
    canary = -12345.0
    g = 4096  # guard floats on each side
    flat = torch.full((g + M * N + g,), canary, device="cuda")
    out = flat[g:g + M * N].view(M, N)
    padded = torch.full((M + 2, N + 8), canary, device="cuda")
    out2 = padded[1:M + 1, 4:N + 4]
    a_buf = randn(g + M * K + g)  # inputs live inside guarded buffers too
    b_buf = randn(g + K * N + g)
    a_before, b_before = a_buf.clone(), b_buf.clone()
    a = a_buf[g:g + M * K].view(M, K)
    b = b_buf[g:g + K * N].view(K, N)
    forced(a, b, family, precision, out=out)
    forced(a, b, family, precision, out=out2)
    torch.cuda.synchronize()
    check(out, a, b, precision, rel_err)
    check(out2, a, b, precision, rel_err)
    assert torch.all(flat[:g] == canary) and torch.all(flat[g + M * N:] == canary)
    mask = torch.ones_like(padded, dtype=torch.bool)
    mask[1:M + 1, 4:N + 4] = False
    assert torch.all(padded[mask] == canary)
    assert torch.equal(a_buf, a_before) and torch.equal(b_buf, b_before)


# --- beyond 32-bit element offsets ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tall_a():
    """A with more than 2^31 elements (8.6 GB): offsets into it need 64-bit arithmetic."""
    rows = 2**31 // 1024 + 257
    return torch.randn(rows, 1024, device="cuda")


@pytest.mark.parametrize("family,precision", FAMILY_PRECISIONS, ids=FP_IDS)
def test_operands_past_2_31_elements(tall_a, family, precision):
    b = randn(1024, 8)
    c = forced(tall_a, b, family, precision)
    for rows in (slice(0, 64), slice(-64, None)):
        assert relative_error(c[rows], tall_a[rows].double() @ b.double()) <= TOL[precision]


# --- the skinny family (M <= 32) ------------------------------------------------------------------

SKINNY_M = (1, 3, 8, 9, 16, 17, 31, 32)
SKINNY_N = (1, 5, 128, 130, 4096)
SKINNY_K = (1, 7, 256, 257, 4096, 16384)


def forced_plan(a, b, family, precision, out=None):
    """``a @ b`` on ``family`` (no skip: for families every supported GPU runs): (result, plan)."""
    result, plan, reason = dispatch.matmul_fastmm(a, b, out, precision, force=family)
    assert reason is None, f"fell back to torch: {reason}"
    assert plan is not None and plan.kernel.family == family
    assert plan.precision_used == (precision if family in TENSOR_CORE_FAMILIES else "ieee")
    return result, plan


@pytest.mark.parametrize("K", SKINNY_K)
@pytest.mark.parametrize("N", SKINNY_N)
def test_skinny_matches_float64(N, K, rel_err):
    """Every M <= 32 of interest, forced onto skinny (at ieee, and at tf32 which it serves at fp32
    accuracy) and through the dispatcher, into fresh results and NaN-poisoned ``out``."""
    b = randn(K, N)
    b0 = b.clone()
    for M in SKINNY_M:
        a = randn(M, K)
        a0 = a.clone()
        c, plan = forced_plan(a, b, "skinny", "ieee")
        assert c.shape == (M, N) and c.dtype == torch.float32 and c.is_contiguous()
        m = dict(plan.kernel.macros)  # rows per thread: M rounded up to 4 (v2) or to 8, 16, 32 (v1)
        assert m["MT"] == (max(4, -(-M // 4) * 4) if m.get("SK_V2") else 8 if M <= 8 else 16 if M <= 16 else 32)
        check(c, a, b, "ieee", rel_err)
        out = torch.full((M, N), NAN, device="cuda")
        assert forced_plan(a, b, "skinny", "tf32", out=out)[0] is out
        check(out, a, b, "ieee", rel_err)
        # the dispatcher: skinny (B row-major; K = 1 too, where B is one row) unless the problem is
        # tiny; a single column (N = 1) is K-contiguous as well, which skinny_kmajor reads first
        # (kmajor_mma's tensor cores for tf32 at 8 to 32 rows)
        exp = fastmm.explain(a, b, precision="tf32")
        tiny = not (M * N > TINY_OUTPUTS or K > TINY_K)
        kmajor = "kmajor_mma" if 8 <= M <= 32 else "skinny_kmajor"
        assert exp.kernel == ("scalar" if tiny else kmajor if N == 1 else "skinny"), str(exp)
        out = torch.full((M, N), NAN, device="cuda")
        assert fastmm.matmul(a, b, precision="tf32", out=out) is out
        check(out, a, b, "tf32" if exp.kernel == "kmajor_mma" else "ieee", rel_err)
        check(fastmm.matmul(a, b, precision="ieee"), a, b, "ieee", rel_err)
        assert torch.equal(a, a0) and torch.equal(b, b0)


@pytest.mark.parametrize("M,N,K", [(1, 130, 257), (9, 4096, 4096), (32, 1000, 300)], ids=str)
def test_skinny_transposed_views(M, N, K, rel_err):
    cases = {"bT": (randn(M, K), randn(N, K).T), "aT": (randn(K, M).T, randn(K, N)),
             "aT_bT": (randn(K, M).T, randn(N, K).T)}
    for name, (a, b) in cases.items():
        c, plan = forced_plan(a, b, "skinny", "ieee")
        assert dict(plan.kernel.macros)["B_VEC"] == int("bT" not in name and N % 4 == 0), name
        check(c, a, b, "ieee", rel_err)
        out = randn(N, M).fill_(NAN).T  # a column-major out
        forced_plan(a, b, "skinny", "ieee", out=out)
        check(out, a, b, "ieee", rel_err)


@pytest.mark.parametrize("M,N,K", [(8, 4096, 4096), (17, 130, 257), (32, 1024, 16384)], ids=str)
@pytest.mark.parametrize("offset", [1, 2, 3])
@pytest.mark.parametrize("which", ["a", "b", "c"])
def test_skinny_storage_offsets(which, offset, M, N, K, rel_err):
    a = at_offset((M, K), offset) if which == "a" else randn(M, K)
    b = at_offset((K, N), offset) if which == "b" else randn(K, N)
    out = at_offset((M, N), offset, fill=NAN) if which == "c" else torch.full((M, N), NAN, device="cuda")
    _, plan = forced_plan(a, b, "skinny", "ieee", out=out)
    assert dict(plan.kernel.macros)["B_VEC"] == int(which != "b" and N % 4 == 0)
    check(out, a, b, "ieee", rel_err)


SKINNY_BATCHED = [
    ((3, 16, 256), (3, 256, 4096)),  # batch 3
    ((16, 4096), (3, 4096, 1024)),  # A broadcast over the batch (stride 0)
    ((1, 9, 300), (3, 300, 130)),  # A broadcast through a size-1 dim
    ((3, 32, 257), (1, 257, 1028)),  # B broadcast (a plain matrix B would be folded: M = 96)
    ((2, 1, 31, 257), (3, 257, 128)),  # broadcast both ways
    ((5, 1, 40), (5, 40, 4096)),  # M = 1
    ((2, 1, 4, 8, 40), (1, 3, 4, 40, 130)),  # three batch dims that cannot merge: two launches
]


@pytest.mark.parametrize("sa,sb", SKINNY_BATCHED, ids=[f"{a}@{b}" for a, b in SKINNY_BATCHED])
def test_skinny_batched_and_broadcast_shapes(sa, sb, rel_err):
    a, b = randn(*sa), randn(*sb)
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    out = torch.full(shape, NAN, device="cuda")
    _, plan = forced_plan(a, b, "skinny", "ieee", out=out)
    assert plan.kernel.split_k == 1 and plan.reduce is None  # never split a batch
    check(out, a, b, "ieee", rel_err)
    check(forced_plan(a, b, "skinny", "ieee")[0], a, b, "ieee", rel_err)
    check(fastmm.matmul(a, b, precision="ieee"), a, b, "ieee", rel_err)
    expanded = randn(1, *sa[-2:]).expand(3, *sa[-2:])  # a stride-0 batch dim on A
    b3 = randn(3, *sb[-2:])
    check(forced_plan(expanded, b3, "skinny", "ieee")[0], expanded, b3, "ieee", rel_err)


def test_skinny_batch_beyond_the_grid_z_limit(rel_err):
    a, b = randn(70_000, 4, 8), randn(70_000, 8, 12)  # grid.z capped at 65535: blocks loop over z
    c, plan = forced_plan(a, b, "skinny", "ieee")
    assert plan.kernel.grid[2] == 65535
    check(c, a, b, "ieee", rel_err)


def test_skinny_k_zero_and_empty_shapes():
    out = torch.full((16, 300), NAN, device="cuda")
    assert dispatch.matmul_fastmm(randn(16, 0), randn(0, 300), out, "ieee", force="skinny")[0] is out
    assert torch.equal(out, torch.zeros(16, 300, device="cuda"))
    assert dispatch.matmul_fastmm(randn(0, 16), randn(16, 300), None, "ieee", force="skinny")[0].shape == (0, 300)
    assert dispatch.matmul_fastmm(randn(16, 16), randn(16, 0), None, "ieee", force="skinny")[0].shape == (16, 0)


@pytest.mark.parametrize("M,N,K", [(1, 130, 257), (17, 4099, 4096), (32, 1024, 16384)], ids=str)
def test_skinny_writes_nothing_outside_the_output(M, N, K, rel_err):
    out, out2, untouched = guarded_outputs(M, N)
    a, b = randn(M, K), randn(K, N)
    forced_plan(a, b, "skinny", "ieee", out=out)
    forced_plan(a, b, "skinny", "ieee", out=out2)
    torch.cuda.synchronize()
    check(out, a, b, "ieee", rel_err)
    check(out2, a, b, "ieee", rel_err)
    assert untouched()


def test_skinny_small_integer_inputs_give_exact_sums():
    for M, N, K in ((1, 4096, 4096), (17, 130, 257), (32, 1028, 16384)):
        a = torch.randint(-3, 4, (M, K), device="cuda").float()
        b = torch.randint(-3, 4, (K, N), device="cuda").float()
        c = forced_plan(a, b, "skinny", "ieee")[0]
        assert torch.equal(c, exact_reference(a, b)), (M, N, K)


# --- wgmma (sm_90a): TMA-fed tensor cores ----------------------------------------------------------

def needs_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on compute capability 9.0 only")


def tf32_round(x: torch.Tensor, ties_even: bool = False) -> torch.Tensor:
    """fp32 -> TF32 (10 mantissa bits) in integer arithmetic: to nearest, ties away from zero
    (cvt.rna) or to even."""
    bits = x.view(torch.int32)
    low = bits & 0x1FFF
    up = (low > 0x1000) | ((low == 0x1000) & ((bits & 0x2000) != 0 if ties_even else True))
    return ((bits & ~0x1FFF) + up.int() * 0x2000).view(torch.float32)


def test_wgmma_rounds_its_inputs_to_nearest_not_truncated():
    """C = A @ I reproduces A as the tensor core saw it: each element must be A rounded to TF32
    (as cvt.rna does; the copy engine's rounding may break exact ties to even), not truncated."""
    needs_sm90()
    a = randn(256, 64) * 3
    eye = torch.eye(64, device="cuda")
    eye_k = eye.t().contiguous().t()  # the same, K-major as a B
    # A as the shared-memory operand (B row-major: swapped, or K-major), then A fed from
    # registers (m-contiguous A; and a row-major B read as B^T through registers, C = I @ B)
    for x, y, data in ((a, eye, a), (a, eye_k, a), (a.t().contiguous().t(), eye_k, a), (eye[:, :64], a.t().contiguous(), a.t())):
        c, plan = forced_plan(x, y, "wgmma_tf32", "tf32")
        rna, rne = tf32_round(data), tf32_round(data, ties_even=True)
        trunc = data.contiguous().view(torch.int32).bitwise_and(~0x1FFF).view(torch.float32)
        assert torch.all((c == rna) | (c == rne)), f"wgmma inputs are not rounded to nearest TF32 ({plan.describe()})"
        assert (c != trunc).float().mean() > 0.3  # about half the elements round up


WGMMA_CASES = {
    "row-major": lambda: (randn(1024, 768), randn(768, 512)),
    "b-k-major": lambda: (randn(1024, 768), randn(512, 768).t()),
    "a-transposed": lambda: (randn(768, 1024).t(), randn(768, 512)),
    "both-transposed": lambda: (randn(768, 300).t(), randn(520, 768).t()),
    "unaligned": lambda: (randn(1025, 1023), randn(1023, 1021)),
    "k-tail": lambda: (randn(200, 37), randn(37, 260)),
    "tiny": lambda: (randn(5, 3), randn(3, 7)),
    "strided-rows": lambda: (randn(640, 1000)[:, :520], randn(600, 1200)[:520, :600]),
    "offset": lambda: (randn(640 * 512 + 4)[4:].view(640, 512), randn(512 * 384 + 1)[1:].view(512, 384)),
    "batched-k-major": lambda: (randn(6, 300, 256), randn(6, 200, 256).transpose(-1, -2)),
    "broadcast-b": lambda: (randn(3, 2, 130, 64), randn(2, 96, 64).transpose(-1, -2)),
    "broadcast-a": lambda: (randn(130, 64), randn(5, 96, 64).transpose(-1, -2)),
    # B n-contiguous (C^T = B^T A^T) and A m-contiguous, read in place and fed from registers
    "a-transposed-wide": lambda: (randn(768, 300).t(), randn(768, 1000)),
    "batched-row-major": lambda: (randn(6, 300, 256), randn(6, 256, 200)),
    "batched-a-m-contiguous": lambda: (randn(6, 256, 300).transpose(-1, -2), randn(6, 200, 256).transpose(-1, -2)),
    "broadcast-b-row-major": lambda: (randn(3, 2, 130, 64), randn(2, 64, 96)),
    "broadcast-a-row-major": lambda: (randn(130, 64), randn(5, 64, 96)),
    "expanded-b-row-major": lambda: (randn(4, 200, 96), randn(96, 136).expand(4, 96, 136)),
    # batches that need K-major copies (made per matrix of the operand's own batch)
    "batched-unaligned": lambda: (randn(3, 130, 37), randn(3, 37, 99)),
    "batched-both-mn": lambda: (randn(3, 96, 200).transpose(-1, -2), randn(3, 96, 136)),
    "broadcast-4d-strided": lambda: (randn(2, 1, 70, 90)[..., :66], randn(3, 66, 260)[..., 2:203]),
}


#: C with contiguous rows the copy engine cannot write (odd widths, an odd pitch, a base 4 bytes
#: past 16-byte alignment): (a, b, the rows' pitch of out=, or None for a fresh C)
COPY_OUT_CASES = {
    "scores-197": lambda: (randn(24, 197, 64), randn(24, 197, 64).transpose(-1, -2), None),
    "scores-77": lambda: (randn(16, 77, 64), randn(16, 77, 64).transpose(-1, -2), None),
    # (more tiles than SMs: persistent blocks stage tile after tile, two box groups a tile)
    "scores-197-persistent": lambda: (randn(300, 197, 64), randn(300, 197, 64).transpose(-1, -2), None),
    "linear-odd": lambda: (randn(333, 517), randn(1001, 517).t(), None),
    "pitch-odd": lambda: (randn(300, 256), randn(640, 256).t(), 643),
    "base-offset": lambda: (randn(260, 384), randn(200, 384).t(), -1),
}


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("case", sorted(COPY_OUT_CASES))
def test_wgmma_writes_c_rows_the_copy_engine_cannot_take_through_shared_memory(case, precision, rel_err):
    """C_COPY_OUT: C staged in shared memory, then written by the consumer threads, a warp 32
    adjacent floats of a row at a time. Every output is written (NaN-poisoned C), nothing past N
    or outside the view is (the padding of a wider buffer keeps its NaN), against float64."""
    needs_sm90()
    a, b, pitch = COPY_OUT_CASES[case]()
    shape = a.shape[:-1] + b.shape[-1:]
    buf = None
    if pitch is None:
        out = torch.full(shape, NAN, device="cuda")
    elif pitch == -1:  # (a C whose base is one float past a 16-byte boundary: no tensor map)
        buf = torch.full((shape[0] * shape[1] + 1,), NAN, device="cuda")
        out = buf[1:].view(shape)
    else:
        buf = torch.full((shape[0], pitch), NAN, device="cuda")
        out = buf[:, :shape[1]]
    c, plan = forced_plan(a, b, "wgmma_tf32", precision, out=out)
    m = dict(plan.kernel.macros)
    assert c is out and m.get("C_COPY_OUT") == 1 and not m.get("TMA_STORE"), plan.describe()
    assert "written by the consumer threads" in dict(plan.kernel.details)["C stores"]
    if case == "scores-197-persistent":  # (the staging buffer reused across tiles and box groups)
        assert plan.kernel.grid[0] < plan.kernel.work_items and m["BN"] > 32 * m["C_BOXES"], plan.describe()
    check(c, a, b, precision, rel_err)
    if pitch is not None and pitch > 0:
        assert torch.isnan(buf[:, shape[1]:]).all()  # the pitch's padding: not written
    elif pitch == -1:
        assert torch.isnan(buf[0])


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("case", sorted(WGMMA_CASES))
def test_wgmma_layouts_match_float64(case, precision, rel_err):
    needs_sm90()
    a, b = WGMMA_CASES[case]()
    a0, b0 = a.clone(), b.clone()
    c, plan = forced_plan(a, b, "wgmma_tf32", precision)
    check(c, a, b, precision, rel_err)
    assert torch.equal(a, a0) and torch.equal(b, b0)  # inputs untouched (no rounding in place)
    out = torch.full(c.shape, NAN, device="cuda")
    assert forced_plan(a, b, "wgmma_tf32", precision, out=out)[0] is out
    check(out, a, b, precision, rel_err)


#: Layouts for every tile width, plus products of more tiles than SMs (a persistent block walks
#: several tiles, across batch entries), odd N against every width (padded last tile columns).
WGMMA_WIDTH_CASES = {
    "b-k-major": lambda: (randn(1024, 768), randn(520, 768).t()),
    "swap": lambda: (randn(640, 512), randn(512, 648)[:, :643]),
    "a_regs": lambda: (randn(512, 640).t(), randn(643, 512).t()),
    "unaligned": lambda: (randn(333, 1023), randn(1023, 1021)),
    "many-tiles-batched": lambda: (randn(3, 1100, 200), randn(200, 1500)),
    "many-tiles-k-major": lambda: (randn(2100, 136), randn(2500, 136).t()),
    "broadcast-b": lambda: (randn(3, 2, 130, 64), randn(2, 96, 64).transpose(-1, -2)),
}


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("bn", sorted({bn for x3 in (False, True) for bn, _ in WgmmaTf32.tile_options(x3)}))
@pytest.mark.parametrize("case", sorted(WGMMA_WIDTH_CASES))
def test_wgmma_every_tile_width_computes_every_tile(case, bn, precision, rel_err):
    """Each tile width the planner may pick, persistent (one block an SM walking the tiles) and
    one block a tile, C stored by the copy engine and from registers: right into NaN-poisoned
    outputs, and the same bits every way and as the planner's own width (each output sums its
    k-steps in the same order whatever the tile)."""
    needs_sm90()
    if bn not in {w for w, _ in WgmmaTf32.tile_options(precision == "tf32x3")}:
        pytest.skip(f"no {bn}-wide tile for {precision}")
    a, b = WGMMA_WIDTH_CASES[case]()
    outs = []
    coop = {"pingpong": False}  # (both consumer warpgroups on each tile: the copy-engine stores' form)
    variants = (WgmmaTf32(force_bn=bn, persistent="always", **coop), WgmmaTf32(force_bn=bn, persistent=False, **coop),
                WgmmaTf32(force_bn=bn, tma_store=False, **coop), WgmmaTf32())
    for variant in variants:
        out = torch.full(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), NAN,
                         device="cuda")
        result, plan, reason = dispatch.matmul_fastmm(a, b, out, precision, force="wgmma_tf32", variants=(variant,))
        assert reason is None and result is out and plan.kernel.family == "wgmma_tf32"
        if variant.force_bn:
            assert plan.kernel.tile[1] == bn
            p = plan.launch_problem or plan.problem
            work = -(-p.M // plan.kernel.tile[0]) * -(-p.N // bn) * p.batch_total  # (64 rows: the mid-size rule)
            assert plan.kernel.work_items == work
            persistent = variant.persistent == "always" or (variant.persistent and persistent_pays(p, plan.device, work))
            assert plan.kernel.grid[0] == (min(work, plan.device.sm_count) if persistent else work)
            # C through the copy engine wherever its rows allow a tensor map (N % 4 == 0 here)
            # (tf32 computes a row-major B's product as C^T: m-contiguous, stored from registers)
            assert bool(dict(plan.kernel.macros).get("TMA_STORE")) == (
                variant.tma_store and b.shape[-1] % 4 == 0 and not plan.swap_ab)
        check(out, a, b, precision, rel_err)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("bn", [64, 96, 128, 160, 192])
@pytest.mark.parametrize("case", sorted(WGMMA_WIDTH_CASES) + ["odd-items-per-block"])
def test_wgmma_pingpong_consumers_compute_every_tile(case, bn, rel_err):
    """The consumer warpgroups taking turns on whole tiles (PINGPONG) wherever the kernel allows
    it (tf32, a K-major A), C from registers and through the copy engine (each warpgroup its
    own staging region, where C allows a tensor map): right into NaN-poisoned outputs, blocks
    with one tile, with an even and an odd number of tiles, and the same bits as the
    cooperative form. (160 wide: the staged turns' width where its waves fill better, STAGED_TURNS_160.)"""
    needs_sm90()
    a, b = WGMMA_WIDTH_CASES[case]() if case in WGMMA_WIDTH_CASES else (randn(1408, 96), randn(2100, 96).t())
    outs = []
    extra = (STAGED_TURNS_160,) if bn == STAGED_TURNS_160[0] else ()
    # (128-row tiles: the 64-row tile is the cooperative form only, and the mid-size rule would
    # give these products 64 rows)
    for variant in (WgmmaTf32(force_bn=bn, pingpong="always", pingpong_tma_store=False, rows64=False, extra_widths=extra),
                    WgmmaTf32(force_bn=bn, pingpong="always", pingpong_tma_store=True, rows64=False, extra_widths=extra),
                    WgmmaTf32(force_bn=bn, pingpong=False, rows64=False, extra_widths=extra)):
        out = torch.full(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), NAN,
                         device="cuda")
        result, plan, reason = dispatch.matmul_fastmm(a, b, out, "tf32", force="wgmma_tf32", variants=(variant,))
        assert reason is None and result is out and plan.kernel.tile[:2] == (128, bn)
        m = dict(plan.kernel.macros)
        if variant.pingpong:
            assert bool(m.get("PINGPONG")) == (m["A_MN"] == 0), plan.describe()
            if m.get("PINGPONG"):
                assert plan.kernel.grid[0] == min(plan.kernel.work_items, plan.device.sm_count)
                # (C's rows of 16-byte multiples, n contiguous: a tensor map's; C^T is m-contiguous)
                assert bool(m.get("TMA_STORE")) == (variant.pingpong_tma_store and b.shape[-1] % 4 == 0
                                                    and not plan.swap_ab), plan.describe()
        else:
            assert "PINGPONG" not in m
        check(out, a, b, "tf32", rel_err)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


#: (a, b, precision, forced slices or None for the planner's rule): K split over blocks (SPLIT)
WGMMA_SPLIT_CASES = {
    "decode-linear-rule": lambda: (randn(48, 11008), randn(4096, 11008).t(), "tf32", None),  # x @ W.t()
    "decode-odd-n-rule": lambda: (randn(33, 8200), randn(2001, 8200).t(), "tf32", None),
    "short-k-forced": lambda: (randn(300, 1100), randn(700, 1100).t(), "tf32", 2),
    "a_regs-odd-n-uneven-slices": lambda: (randn(8288, 200).t(), randn(333, 8288).t(), "tf32", 5),
    "swap-row-major-b": lambda: (randn(130, 6000), randn(6000, 300), "tf32", 4),
    "copied-a": lambda: (randn(64, 8191), randn(8191, 1024), "tf32", 4),  # A's rows copied K-major
    "tf32x3-forced": lambda: (randn(64, 4096), randn(4096, 256), "tf32x3", 3),
    # > 64 rows, few tiles, W^T of 64 MiB under a partial 64-row tile: the 128-row split (ROWS64_MID_PARTIAL_L2_SHARE)
    "tall-linear-rule": lambda: (randn(80, 4100), randn(4096, 4100).t(), "tf32", None),
    "tall-swapped-rule": lambda: (randn(700, 6000), randn(6000, 300), "tf32", None),
    # C^T with an odd number of columns as launched (197; A fed from registers), on 128- and
    # 64-row tiles; and an odd N whose B is copied K-major (partial tiles of an odd width)
    "swap-odd-columns": lambda: (randn(197, 3072), randn(3072, 768), "tf32", 3),
    "swap-odd-columns-64-rows": lambda: (randn(197, 3072), randn(3072, 768), "tf32",
                                         WgmmaTf32(split=2, rows64="always")),
    "copied-b-odd-width": lambda: (randn(197, 3072), randn(3072, 771), "tf32", 3),
    # a row-major B of 771 columns in rows of 776 (read in place): C^T of 771 rows as launched, the
    # m-contiguous workspace's lines padded to 772, the last row pair a single row
    "swap-padded-pitch-odd-rows": lambda: (randn(197, 3072), randn(3072, 776)[:, :771], "tf32", 3),
}


@pytest.mark.parametrize("case", sorted(WGMMA_SPLIT_CASES))
def test_wgmma_split_k_sums_every_tiles_slices_in_order(case, rel_err):
    """K split over blocks, each tile's last block summing the slices (SPLIT): the planner's
    split for decode-like products (few tiles, long K) and forced counts (uneven slices, A fed from
    registers, a swapped product, tf32x3), right into NaN-poisoned contiguous and transposed
    outputs; a second call into a fresh output gives the same bits (the slices are added in slice
    order, and the arrival counters are back at zero after each launch), and so does the
    transposed output wherever it runs as many slices (each output sums the same k-steps in the
    same order whatever the tile's height or C's form; A_MN writing a transposed C along n can
    take other slices)."""
    needs_sm90()
    a, b, precision, slices = WGMMA_SPLIT_CASES[case]()
    if isinstance(slices, WgmmaTf32):
        variant, slices = slices, slices.split
    else:
        variant = WgmmaTf32() if slices is None else WgmmaTf32(split=slices)
    M, N = a.shape[-2], b.shape[-1]
    outs, kernels = [], []
    for out in (torch.full((M, N), NAN, device="cuda"), torch.full((N, M), NAN, device="cuda").t(),
                torch.full((M, N), NAN, device="cuda")):
        result, plan, reason = dispatch.matmul_fastmm(a, b, out, precision, force="wgmma_tf32", variants=(variant,))
        assert reason is None and result is out, reason
        m = dict(plan.kernel.macros)
        assert m.get("SPLIT") == 1 and plan.kernel.split_fused and plan.reduce is None, plan.describe()
        assert plan.kernel.grid[1] == (slices or plan.kernel.grid[1]) > 1
        check(out, a, b, precision, rel_err)
        outs.append(out)
        kernels.append((plan.kernel.macros, plan.kernel.grid))
    assert kernels[0] == kernels[2] and torch.equal(outs[0], outs[2])
    contiguous_slices, transposed_slices = kernels[0][1][1], kernels[1][1][1]  # (grid[1])
    assert transposed_slices != contiguous_slices or torch.equal(outs[0], outs[1])


#: Products of at most 64 rows (and one of more), both operands K-major: the 64-row tile (BM = 64,
#: one consumer warpgroup)
WGMMA_ROWS64_CASES = {
    "one-row": lambda: (randn(1, 4096), randn(1000, 4096).t()),
    "17-rows-odd-n": lambda: (randn(17, 2050), randn(1001, 2050).t()),
    "64-rows": lambda: (randn(64, 4096), randn(2048, 4096).t()),
    "k-tail": lambda: (randn(33, 1000), randn(520, 1000).t()),  # K: a last k-step of 8 (zeros past K)
    "batched": lambda: (randn(6, 64, 96), randn(6, 300, 96).transpose(1, 2)),
    "folded-120-rows": lambda: (randn(3, 40, 200), randn(264, 200).t()),  # two tile rows, the last part-full
    # the mid-size rule's products (ROWS64_MID_WIDTHS): 64 and 128 wide, split in 4 from K = 3072, last rows part-full
    "mid-300-rows": lambda: (randn(300, 1600), randn(700, 1600).t()),  # (K >= 1536: the test's 3 forced slices)
    "mid-999-rows": lambda: (randn(999, 1536), randn(1001, 1536).t()),
    "mid-197-rows-split": lambda: (randn(197, 3100), randn(768, 3100).t()),
}


#: A fed from registers (A_MN) on 64-row tiles: a row-major B (computed as C^T: its rows are the
#: kernel's m) and an m-contiguous A; k-step counts odd and even, a last k-step of 8, one k-step,
#: persistent blocks walking many tiles, a batch
WGMMA_A_MN_ROWS64_CASES = {
    "row-major-b": lambda: (randn(300, 1000), randn(1000, 700)),
    "row-major-b-odd-k-steps": lambda: (randn(130, 972), randn(972, 452)),  # 31 k-steps, the last of 12
    "row-major-b-one-k-step": lambda: (randn(77, 32), randn(32, 1024)),
    "row-major-b-k-tail": lambda: (randn(50, 8), randn(8, 260)),
    "row-major-b-many-tiles": lambda: (randn(40, 100), randn(100, 40000)),
    "row-major-b-batched": lambda: (randn(6, 96, 200), randn(6, 200, 264)),
    "row-major-b-split": lambda: (randn(197, 3100), randn(3100, 768)),  # (the rule splits it: C^T 768 x 197, 4 slices)
    # below ROWS64_MID_SPLIT_MIN_K (ROWS64_A_MN_SPLIT_MIN_K): C^T 256 x 384 on 64 x 64 tiles, 4 uneven slices
    "row-major-b-short-k-split": lambda: (randn(384, 2084), randn(2084, 256)),
    # over more than 2048 lines (C^T 3000 x 50: decode's grad_x): 64 x 64 tiles in 2 slices
    "row-major-b-many-lines-split": lambda: (randn(50, 4100), randn(4100, 3000)),
    "m-contiguous-a": lambda: (randn(1100, 1000).t(), randn(700, 1100).t()),
    "m-contiguous-a-odd-n": lambda: (randn(996, 1000).t(), randn(1001, 996).t()),  # C by single floats
}


#: The cases whose planner's plan takes 64-row tiles (A_MN: where C is written along m, the C^T of
#: a row-major B; an m-contiguous A read in place keeps 128 rows)
WGMMA_ROWS64_RULE_CASES = {"one-row", "17-rows-odd-n", "64-rows", "mid-300-rows", "mid-999-rows", "mid-197-rows-split",
                           "row-major-b", "row-major-b-split", "row-major-b-short-k-split",
                           "row-major-b-many-lines-split"}
#: the planner's slices of the A_MN rule cases (unsplit where not named)
WGMMA_A_MN_RULE_SPLITS = {"row-major-b-split": 4, "row-major-b-short-k-split": 4, "row-major-b-many-lines-split": 2}


@pytest.mark.parametrize("case", sorted(WGMMA_ROWS64_CASES) + sorted(WGMMA_A_MN_ROWS64_CASES))
def test_wgmma_64_row_tiles_compute_every_output(case, rel_err):
    """The 64-row tile, A read K-major or fed from registers (A_MN: each k-step's fragments
    loaded during the step before, a_mn_step), with C from registers and through the copy engine,
    persistent and one block a tile, every width, unsplit and split: right into NaN-poisoned
    outputs; every unsplit form gives the same bits as the 128-row tile (each output sums its
    k-steps in the same order), a split the same bits on both heights; nothing written outside C;
    a bias over columns or rows and an addmm input fused in the store match float64; the
    planner's own plan takes 64 rows where its rule says (A_MN: as C^T, split where its rule says,
    and right unsplit too)."""
    needs_sm90()
    a_mn = case in WGMMA_A_MN_ROWS64_CASES
    a, b = (WGMMA_A_MN_ROWS64_CASES if a_mn else WGMMA_ROWS64_CASES)[case]()
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])

    def run(variant, out=None):
        out = torch.full(shape, NAN, device="cuda") if out is None else out
        result, plan, reason = dispatch.matmul_fastmm(a, b, out, "tf32", force="wgmma_tf32", variants=(variant,))
        assert reason is None and result is out and plan.kernel.family == "wgmma_tf32", reason
        assert dict(plan.kernel.macros)["A_MN"] == int(a_mn) and not (a_mn and plan.staging), plan.describe()
        check(out, a, b, "tf32", rel_err)
        return out, plan

    ref, plan = run(WgmmaTf32(rows64=False, split=False))
    assert plan.kernel.tile[0] == 128 and plan.kernel.block == 384
    for variant in (WgmmaTf32(rows64="always", split=False), WgmmaTf32(rows64="always", split=False, tma_store=False),
                    WgmmaTf32(rows64="always", split=False, persistent=False),
                    *(WgmmaTf32(rows64="always", split=False, force_bn=bn) for bn in (64, 96, 192, 256))):
        out, plan = run(variant)
        assert dict(plan.kernel.macros)["BM"] == plan.kernel.tile[0] == 64 and plan.kernel.block == 256
        assert torch.equal(out, ref), plan.describe()
    if len(shape) == 2:  # nothing written outside C (rows past M above all), contiguous and in a window
        for variant in (WgmmaTf32(rows64="always", split=False), WgmmaTf32(rows64="always", split=False, tma_store=False),
                        WgmmaTf32(rows64="always", split=2)):
            out, out2, untouched = guarded_outputs(*shape)
            for o in (out, out2):
                run(variant, o)
            assert untouched(), variant
        if a.shape[-1] >= 3 * SPLIT_FORCED_SLICE_K:  # K split over blocks: the same slices on both heights, bits
            outs = []
            for variant in (WgmmaTf32(rows64=False, split=3), WgmmaTf32(rows64="always", split=3)):
                out, plan = run(variant)
                assert plan.kernel.split_fused and plan.kernel.grid[1] == 3, plan.describe()
                outs.append(out)
            assert torch.equal(outs[0], outs[1])
        for d, alpha, beta in ((randn(shape[-1]), 1.0, 1.0), (randn(shape[-2], 1), 1.0, 1.0),
                               (randn(*shape), -0.5, 2.0)):
            for variant in (WgmmaTf32(rows64="always", split=False),
                            WgmmaTf32(rows64="always", split=False, tma_store=False),
                            WgmmaTf32(rows64="always", split=False, force_bn=256)):
                result, plan, reason = dispatch.matmul_fused(a, b, d, alpha, beta, "tf32", force="wgmma_tf32",
                                                             variants=(variant,))
                assert reason is None and plan.kernel.tile[0] == 64 and ("EPILOGUE", 1) in plan.kernel.macros
                want = alpha * (a.double() @ b.double()) + beta * d.double()
                assert not torch.isnan(result).any()
                assert ((result.double() - want).norm() / want.norm()).item() <= TOL["tf32"], plan.describe()
    if case in WGMMA_ROWS64_RULE_CASES:  # the planner's own plan (A_MN: 64 rows as C^T)
        out, plan = run(WgmmaTf32())
        assert plan.kernel.tile[0] == 64, plan.describe()
        if a_mn:
            assert plan.swap_ab and plan.kernel.split_k == WGMMA_A_MN_RULE_SPLITS.get(case, 1), plan.describe()
            unsplit = run(WgmmaTf32(rows64_a_mn_split=False))[1].kernel
            assert unsplit.tile[0] == 64 and unsplit.split_k == 1
            assert run(WgmmaTf32(rows64_a_mn=False))[1].kernel.tile[0] == 128
        if len(shape) == 2:  # the same bits as the 128-row tile where neither splits
            assert plan.kernel.split_k > 1 or torch.equal(out, ref), plan.describe()
    elif a_mn and not a.is_contiguous():  # an m-contiguous A read in place: 128-row tiles (ROWS64_A_MN_SPLIT)
        assert run(WgmmaTf32())[1].kernel.tile[0] == 128


#: tf32x3 on 64-row tiles: B read as fp32 and split into its TF32 halves by the kernel
WGMMA_X3_SPLIT_B_CASES = dict(WGMMA_ROWS64_CASES, **{
    "row-major-b": lambda: (randn(40, 700), randn(700, 300)),  # B copied K-major in fp32, split by the kernel
    "inf-and-nan": lambda: (randn(20, 512), _with_specials(randn(384, 512)).t()),
    # persistent blocks walking several tiles: the last k-step of a tile splits the next tile's first slot
    "many-tiles-one-k-step": lambda: (randn(48, 32), randn(40000, 32).t()),
    "many-tiles": lambda: (randn(64, 100), randn(40000, 100).t()),
    "many-tiles-batched": lambda: (randn(16, 64, 520), randn(16, 2048, 520).transpose(1, 2)),
})


def _with_specials(w):
    """``w`` with an Inf, a -Inf and a NaN in its first rows (each spoils its own output column)."""
    w[0, 5], w[1, 7], w[2, 9] = float("inf"), float("-inf"), float("nan")
    return w


def run_x3_on_wgmma(a, b, shape, variant, specials: bool, rel_err):
    """tf32x3 forced onto wgmma with ``variant`` into a NaN-poisoned C, checked against float64;
    with ``specials`` (Inf / NaN in an operand) fp32's answer: the outputs that met them are
    non-finite as in float64, the rest right. Returns (C, plan)."""
    out = torch.full(shape, NAN, device="cuda")
    result, plan, reason = dispatch.matmul_fastmm(a, b, out, "tf32x3", force="wgmma_tf32", variants=(variant,))
    assert reason is None and result is out and plan.kernel.family == "wgmma_tf32", reason
    if specials:
        want = torch.matmul(a.double(), b.double())
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(out), finite) and torch.equal(torch.isnan(out), torch.isnan(want))
        assert ((out.double() - want)[finite].norm() / want[finite].norm()).item() <= TOL["tf32x3"]
    else:
        check(out, a, b, "tf32x3", rel_err)
    return out, plan


@pytest.mark.parametrize("case", sorted(WGMMA_X3_SPLIT_B_CASES))
def test_wgmma_tf32x3_on_64_row_tiles_splits_b_in_the_kernel(case, rel_err):
    """tf32x3 on 64-row tiles (X3_SPLIT_B: only A staged in halves, B split in shared memory),
    with C through the copy engine and from registers, unsplit and split: right into NaN-poisoned
    outputs at fp32-level error, and the same bits as the 128-row plan that stages both operands'
    halves (the same halves, summed in the same order); Inf and NaN in B as fp32 gives them; a
    fused bias matches float64."""
    needs_sm90()
    a, b = WGMMA_X3_SPLIT_B_CASES[case]()
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    specials = case == "inf-and-nan"

    def run(variant):
        return run_x3_on_wgmma(a, b, shape, variant, specials, rel_err)

    ref, plan = run(WgmmaTf32(rows64=False, split=False))
    assert plan.kernel.tile[0] == 128 and len(plan.staging) == 2
    variants = [WgmmaTf32(rows64="always", split=False), WgmmaTf32(rows64="always", split=False, tma_store=False)]
    for variant in variants:
        out, plan = run(variant)
        m = dict(plan.kernel.macros)
        assert m["BM"] == 64 and m["X3_SPLIT_B"] == 1 and m["PRECISION_X3"] == 1, plan.describe()
        in_place = b.stride(-2) == 1 and b.stride(-1) % 4 == 0  # (else an fp32 K-major copy of B, not split)
        assert [w for w, _, _ in plan.staging] == (["a"] if in_place else ["a", "bt"]), plan.describe()
        assert torch.equal(out, ref) or specials and torch.equal(out.isnan(), ref.isnan()), plan.describe()
    if len(shape) == 2 and a.shape[-1] >= 1024:  # K split over blocks: the same bits on both tile heights
        outs = [run(v)[0] for v in (WgmmaTf32(rows64=False, split=3), WgmmaTf32(rows64="always", split=3))]
        assert torch.equal(outs[0], outs[1])
    if len(shape) == 2 and not specials:
        d = randn(shape[-1])
        result, plan, reason = dispatch.matmul_fused(a, b, d, 1.0, 1.0, "tf32x3", force="wgmma_tf32",
                                                     variants=(WgmmaTf32(rows64="always"),))
        assert reason is None and dict(plan.kernel.macros)["X3_SPLIT_B"] == 1
        want = a.double() @ b.double() + d.double()
        assert ((result.double() - want).norm() / want.norm()).item() <= TOL["tf32x3"], plan.describe()


#: tf32x3 on 128-row tiles with A split into its halves in registers (X3_A_REGS)
WGMMA_X3_A_REGS_CASES = {
    "row-major-a": lambda: (randn(1000, 1000), randn(700, 1000).t()),
    "k-tail": lambda: (randn(300, 1004), randn(520, 1004).t()),  # a last k-step of 12 (zeros past K)
    "one-k-step": lambda: (randn(260, 32), randn(390, 32).t()),
    "m-contiguous-a": lambda: (randn(1000, 700).t(), randn(600, 1000).t()),  # A copied K-major in fp32
    "unaligned-a-rows": lambda: (randn(500, 1001), randn(1001, 300)),  # both copied (A in fp32)
    "row-major-b": lambda: (randn(700, 512), randn(512, 900)),  # B^T staged in halves
    "inf-and-nan": lambda: (_with_specials(randn(384, 512)), randn(300, 512).t()),
    "many-tiles": lambda: (randn(4100, 256), randn(2100, 256).t()),  # persistent blocks, several tiles each
    "batched": lambda: (randn(4, 300, 260), randn(4, 200, 260).transpose(1, 2)),
}


@pytest.mark.parametrize("case", sorted(WGMMA_X3_A_REGS_CASES))
def test_wgmma_tf32x3_splitting_a_in_registers_gives_the_staged_bits(case, rel_err):
    """X3_A_REGS: A read in fp32 (in place, or its K-major fp32 copy) and split into its TF32
    halves in each thread's registers: right into NaN-poisoned outputs at fp32-level error, at
    every tf32x3 width, C through the copy engine and from registers; the same bits as the plan
    that stages A's halves (the same halves, summed in the same order); Inf and NaN in A as fp32
    gives them; a fused bias matches float64."""
    needs_sm90()
    a, b = WGMMA_X3_A_REGS_CASES[case]()
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    specials = case == "inf-and-nan"

    def run(variant):
        out, plan = run_x3_on_wgmma(a, b, shape, variant, specials, rel_err)
        assert plan.kernel.tile[0] == 128, plan.describe()
        return out, plan

    for bn in (128, 96, 64):
        for tma in (True, False):
            out, plan = run(WgmmaTf32(force_bn=bn, tma_store=tma, x3_a_regs=True))
            assert dict(plan.kernel.macros)["X3_A_REGS"] == 1, plan.describe()
            # (the staged plan at the same promotion interval: the 128-wide build storing C from
            # registers promotes every k-step where the others promote every 2, K > X3_SHORT_K)
            every = dict(plan.kernel.macros)["PROMOTE_EVERY"]
            ref, ref_plan = run(WgmmaTf32(force_bn=bn, tma_store=tma, promote_every=every))
            assert "X3_A_REGS" not in dict(ref_plan.kernel.macros)
            in_place = a.stride(-1) == 1 and a.stride(-2) % 4 == 0
            staged = {w: dict(s.macros)["SPLIT"] for (w, _, _), s in zip(plan.staging, plan.stagers)}
            assert staged == ({"bt": 1} if in_place else {"a": 0, "bt": 1}), plan.describe()
            assert torch.equal(out, ref) or specials and torch.equal(out.isnan(), ref.isnan()), plan.describe()
    if len(shape) == 2 and not specials:
        for d in (randn(shape[-1]), randn(shape[-2], 1)):
            result, plan, reason = dispatch.matmul_fused(a, b, d, 1.0, 1.0, "tf32x3", force="wgmma_tf32",
                                                         variants=(WgmmaTf32(x3_a_regs=True),))
            assert reason is None and dict(plan.kernel.macros)["X3_A_REGS"] == 1
            want = a.double() @ b.double() + d.double()
            assert ((result.double() - want).norm() / want.norm()).item() <= TOL["tf32x3"], plan.describe()


#: Products the planner's own rule gives X3_A_REGS (narrow, tall, A read in place, 64 tiles or
#: more): attention's P @ V at head sizes 64 and 128, dS @ K over a 4-D batch, a grouped-query k/v
#: projection x @ W.t() at N = 256, a batch with an odd M and K.
PLANNER_X3_A_REGS_CASES = {
    "p-at-v-64": lambda: (randn(32, 512, 512), randn(32, 512, 64)),
    "p-at-v-128": lambda: (randn(8, 1024, 1024), randn(8, 1024, 128)),
    "ds-at-k-4d": lambda: (randn(2, 8, 1024, 1024), randn(2, 8, 1024, 64)),
    "kv-projection-256": lambda: (randn(4096, 512), randn(256, 512).t()),
    "odd-rows": lambda: (randn(8, 1000, 520), randn(8, 520, 72)),
}


@pytest.mark.parametrize("case", sorted(PLANNER_X3_A_REGS_CASES))
def test_tf32x3_planner_splits_a_in_registers_on_narrow_tall_products(case, rel_err):
    """The planner's own tf32x3 plan (no forcing) on attention's P @ V / dS @ K and a narrow
    projection: wgmma with A split in registers and only B's halves staged; right into a
    NaN-poisoned C at fp32-level error, and the same bits as the plan that stages A's halves."""
    needs_sm90()
    a, b = PLANNER_X3_A_REGS_CASES[case]()
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    out = torch.full(shape, NAN, device="cuda")
    result, plan, reason = dispatch.matmul_fastmm(a, b, out, "tf32x3")
    assert reason is None and result is out and plan.kernel.family == "wgmma_tf32", plan.describe()
    assert dict(plan.kernel.macros).get("X3_A_REGS") == 1 and [w for w, _, _ in plan.staging] == ["bt"], plan.describe()
    check(out, a, b, "tf32x3", rel_err)
    ref, staged = run_x3_on_wgmma(a, b, shape, WgmmaTf32(x3_a_regs=False, force_bn=plan.kernel.tile[1]), False, rel_err)
    assert "X3_A_REGS" not in dict(staged.kernel.macros)
    if staged.kernel.tile == plan.kernel.tile and dict(staged.kernel.macros).get("TMA_STORE") == dict(
            plan.kernel.macros).get("TMA_STORE"):
        assert torch.equal(out, ref), plan.describe()


@pytest.mark.parametrize("beta", [1.0, 0.0])
def test_wgmma_split_k_applies_the_epilogue_once_in_the_sum(beta):
    """A fused bias / addmm input on a split plan: the slices are stored raw and the last block's
    sum applies alpha * sum + beta * D once (beta = 0: D, all NaN, is not read)."""
    needs_sm90()
    a, w = randn(48, 11008), randn(4096, 11008)
    d = randn(4096) if beta else torch.full((4096,), NAN, device="cuda")
    result, plan, reason = dispatch.matmul_fused(a, w.t(), d, -1.5, beta, "tf32")
    assert reason is None and plan.kernel.family == "wgmma_tf32" and plan.kernel.split_fused, plan.describe()
    assert ("EPILOGUE", 1) in plan.kernel.macros
    ref = -1.5 * (a.double() @ w.double().t()) + (beta * d.double() if beta else 0)
    assert not torch.isnan(result).any()
    assert ((result.double() - ref).norm() / ref.norm()).item() <= TOL["tf32"]


WGMMA_IN_PLACE = {  # (a, b) -> the form the planner must pick: no copies
    "swap": lambda: (randn(640, 512), randn(512, 648)[:, :643]),  # row-major B, odd N (M' of C^T)
    "a_regs": lambda: (randn(512, 640).t(), randn(643, 512).t()),  # m-contiguous A, K-major B
    "swap-batched": lambda: (randn(5, 200, 96), randn(5, 96, 328)),
    "a_regs-batched": lambda: (randn(5, 96, 200).transpose(-1, -2), randn(5, 328, 96).transpose(-1, -2)),
}


@pytest.mark.parametrize("case", sorted(WGMMA_IN_PLACE))
def test_wgmma_reads_row_major_b_and_m_contiguous_a_in_place(case, rel_err):
    """No K-major copy for these layouts (the plan says so), and right results into fresh,
    NaN-poisoned, m-contiguous (float2 along m) and transposed (strided) outputs."""
    needs_sm90()
    a, b = WGMMA_IN_PLACE[case]()
    c, plan = forced_plan(a, b, "wgmma_tf32", "tf32")
    assert plan.staging == () and plan.swap_ab == case.startswith("swap"), plan.describe()
    assert dict(plan.kernel.macros)["A_MN"] == 1
    check(c, a, b, "tf32", rel_err)
    M, N = a.shape[-2], b.shape[-1]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    outs = (torch.full(batch + (M, N), NAN, device="cuda"),
            torch.full(batch + (M, N + 5), NAN, device="cuda")[..., :N],  # another row pitch
            torch.full(batch + (N, M + 1), NAN, device="cuda")[..., :M].transpose(-1, -2),  # m-contiguous, odd M
            torch.full(batch + (N, M + 2), NAN, device="cuda")[..., :M].transpose(-1, -2))  # m-contiguous, even pitch
    for out in outs:
        assert forced_plan(a, b, "wgmma_tf32", "tf32", out=out)[0] is out
        check(out, a, b, "tf32", rel_err)
    a.copy_(randn(*a.shape))  # same layout and pointers, new values: no stale result
    b.copy_(randn(*b.shape))
    check(forced_plan(a, b, "wgmma_tf32", "tf32")[0], a, b, "tf32", rel_err)


def test_wgmma_is_the_default_tf32_path_for_large_products(rel_err):
    needs_sm90()
    for a, b in ((randn(2048, 1024), randn(1024, 1536)), (randn(2048, 1024), randn(1536, 1024).t()),
                 (randn(4, 512, 512), randn(4, 512, 512).transpose(-1, -2))):
        c = fastmm.matmul(a, b, precision="tf32")
        assert fastmm.explain(a, b, precision="tf32").kernel == "wgmma_tf32"
        check(c, a, b, "tf32", rel_err)
        assert relative_error(c, a.double() @ b.double()) <= 3e-4 or c.numel() < 2**20


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
def test_wgmma_steady_state_calls_with_new_operands_stay_correct(precision, rel_err):
    """Later calls of a shape take the fast entry (its runner: copies, maps, launch) with new
    pointers every time (new tensor maps), into fresh results and a reused, NaN-poisoned out."""
    needs_sm90()
    for shape_a, shape_b in (((1536, 520), (520, 1024)), ((3, 600, 256), (3, 256, 520)), ((1100, 1029), (1029, 1030))):
        out = torch.full(torch.broadcast_shapes(shape_a[:-2], shape_b[:-2]) + (shape_a[-2], shape_b[-1]), NAN,
                         device="cuda")
        for i in range(4):
            a, b = randn(*shape_a), randn(*shape_b)
            c = fastmm.matmul(a, b, precision=precision)
            check(c, a, b, precision, rel_err)
            out.fill_(NAN)
            assert fastmm.matmul(a, b, precision=precision, out=out) is out
            check(out, a, b, precision, rel_err)
            if i == 0:
                assert fastmm.explain(a, b, precision=precision).kernel == "wgmma_tf32", (shape_a, shape_b)
        entry = fast_path.ENTRIES.get(fast_path.key_of(a, b, out, precision))
        assert isinstance(entry, fast_path.FastEntry), "no steady-state entry after four calls"


def test_wgmma_tf32x3_error_on_randn_2048_cubed_beats_fp32():
    needs_sm90()
    a, b = randn(2048, 2048), randn(2048, 2048)
    c, plan = forced_plan(a, b, "wgmma_tf32", "tf32x3")
    ref = a.double() @ b.double()
    with _no_tf32():
        err, fp32 = relative_error(c, ref), relative_error(torch.matmul(a, b), ref)
    assert err <= 3.0e-7 and err < fp32, (err, fp32)  # issue 5: <= 3e-7 (cuBLAS fp32: ~8e-7)


@pytest.mark.parametrize("K", [64, 256, 288, 512, 1024, 2048, 4096, 16384, 65536])  # (wgmma: X3_SHORT_K 256)
@pytest.mark.parametrize("family", ["wgmma_tf32", "tf32_mma"])
def test_tf32x3_is_never_less_accurate_than_fp32_along_k(family, K):
    if family == "wgmma_tf32":
        needs_sm90()
    a, b = randn(512, K), randn(K, 512)
    ref = a.double() @ b.double()
    c, _ = forced_plan(a, b, family, "tf32x3")
    with _no_tf32():
        fp32 = relative_error(torch.matmul(a, b), ref)
    assert relative_error(c, ref) <= max(fp32, 1e-7), (K, relative_error(c, ref), fp32)


class _no_tf32:
    """torch.matmul in plain fp32 (cuBLAS FFMA) for the comparison."""

    def __enter__(self):
        self.old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.old


def test_wgmma_tf32x3_keeps_its_accuracy_over_a_large_dynamic_range():
    """Rows of A scaled by 1e-15 .. 1e15 (and B's columns the other way): the halves are split
    per element, so every output keeps fp32-class relative accuracy."""
    needs_sm90()
    scale = 10.0 ** torch.linspace(-15, 15, 1024, device="cuda")
    a, b = randn(1024, 1024) * scale[:, None], randn(1024, 1024) / scale[None, :].flip(-1)
    c, _ = forced_plan(a, b, "wgmma_tf32", "tf32x3")
    ref = a.double() @ b.double()
    row_err = ((c.double() - ref).norm(dim=1) / ref.norm(dim=1)).max().item()
    assert row_err <= 1e-6, row_err


def test_wgmma_tf32x3_propagates_inf_and_nan_as_fp32_does():
    needs_sm90()
    a, b = randn(256, 128), randn(128, 192)
    a[3, 5], a[7, 9], b[11, 2] = float("inf"), float("nan"), float("-inf")
    c, _ = forced_plan(a, b, "wgmma_tf32", "tf32x3")
    ref = torch.matmul(a.double(), b.double())
    assert torch.equal(torch.isnan(c), torch.isnan(ref)) and torch.equal(torch.isinf(c), torch.isinf(ref))
    assert torch.equal(c[torch.isinf(ref)], ref[torch.isinf(ref)].float())
    finite = torch.isfinite(ref)
    assert relative_error(c[finite], ref[finite]) <= TOL["tf32x3"]


def test_wgmma_error_on_randn_2048_cubed_is_within_the_tf32_bound():
    needs_sm90()
    a, b = randn(2048, 2048), randn(2048, 2048)
    c, _ = forced_plan(a, b, "wgmma_tf32", "tf32")
    assert relative_error(c, a.double() @ b.double()) <= 3.0e-4  # issue 5's bound (cvt.rna mma.sync: ~1.9e-4)


# --- split-K gives the same bits every run ----------------------------------------------------------

SPLIT_CASES = [("skinny", "ieee", (16, 4096, 4096)), ("skinny", "tf32", (1, 4096, 16384)),
               ("skinny", "ieee", (32, 1028, 16384)), ("simt_cp_async", "ieee", (256, 256, 65536)),
               ("tf32_mma", "tf32", (256, 256, 65536))]


@pytest.mark.parametrize("family,precision,mnk", SPLIT_CASES, ids=[f"{f}-{p}-{'x'.join(map(str, s))}"
                                                                   for f, p, s in SPLIT_CASES])
def test_split_k_results_are_bitwise_reproducible(family, precision, mnk, rel_err):
    M, N, K = mnk
    a, b = randn(M, K), randn(K, N)
    try:
        first, plan = forced_plan(a, b, family, precision)
    except ValueError as exc:
        if "needs sm" in str(exc):
            pytest.skip(str(exc))
        raise
    if plan.kernel.split_k == 1:
        pytest.skip(f"{plan.device.name} ({plan.device.sm_count} SMs) does not split K here")
    assert plan.reduce is not None or plan.kernel.split_fused  # a second pass, or the kernel's own sums
    check(first, a, b, "ieee" if family != "tf32_mma" else precision, rel_err)
    for _ in range(3):
        again, _ = forced_plan(a, b, family, precision)
        assert torch.equal(again, first)
        out = torch.full((M, N), NAN, device="cuda")
        forced_plan(a, b, family, precision, out=out)
        assert torch.equal(out, first)
    # the dispatcher's own choice for the shape (skinny, simt_cp_async or tf32_mma, split too)
    assert torch.equal(fastmm.matmul(a, b, precision=precision), fastmm.matmul(a, b, precision=precision))


# --- stream-K: whole tiles, then pieces of the rest, summed by the fixup pass ---------------------

def in_head_form(cfg, N: int, sm_count: int):
    """``cfg`` (a one-launch stream-K plan) in the head form, worked out here from its numbers:
    its whole tiles rounded down to whole rows of tiles in a plain launch first, the other
    tiles' k-tiles dealt evenly over ``sm_count`` blocks (at most)."""
    import dataclasses

    from fastmm.families.base import StreamK

    sk, (bm, bn, _) = cfg.stream_k, cfg.tile
    tiles_n = -(-N // bn)
    rows = sk.whole_tiles // tiles_n
    rest = sk.tiles - rows * tiles_n
    iters = -(-rest * sk.k_tiles // sm_count)
    blocks = -(-rest * sk.k_tiles // iters)
    head = StreamK(0, blocks, iters, sk.k_tiles, rest, rows * bm, rows * tiles_n)
    return dataclasses.replace(cfg, grid=(blocks, 1, 1), stream_k=head)


def stream_k_run(a, b, out, sm_count: int, head_form: bool = False):
    """``a @ b`` into ``out`` by the stream-K plan the planner makes for a GPU of ``sm_count``
    SMs (few SMs: small problems get several waves and pieced tiles), run on this GPU (the
    kernel's correctness does not depend on the SM count); ``head_form``: that plan in the head
    form (:func:`in_head_form`), its head launch made by work_split.stream_k_head_config.
    Returns the kernel config."""
    import dataclasses

    from fastmm.families import second_pass_config, stream_k_head_config
    from fastmm.runtime import runners
    from fastmm.runtime.device import device_facts

    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    real = device_facts(index)
    if real.cc < (8, 0):
        pytest.skip("cp.async needs sm80+")
    s = analyse(a, b)
    problem, offsets = build_problem(s, s.matrix_view(out), "ieee")
    assert len(offsets) == 1
    dev = dataclasses.replace(real, sm_count=sm_count)
    cfg = FAMILIES["simt_cp_async"].configure(problem, dev, FAMILIES["simt_cp_async"].tile_options[0] + (1,))
    assert cfg.stream_k is not None, cfg.details
    head = None
    if head_form:
        cfg = in_head_form(cfg, problem.N, sm_count)
        head = launcher.load(real, stream_k_head_config(cfg))
    fix = second_pass_config(problem, dev, cfg)
    run = runners.plan_runner(launcher.load(real, cfg), launcher.load(real, fix), cfg, problem, a.device, head)
    # The runner takes its workspace from the caching allocator: a NaN-filled block of that size,
    # freed just before, is what it gets, so a slot the kernel fails to write shows as NaN.
    poison = torch.full((cfg.stream_k.workspace_floats(*cfg.tile[:2]),), NAN, device="cuda")
    del poison
    (oa, ob, oc), = offsets
    run(a.data_ptr() + 4 * oa, b.data_ptr() + 4 * ob, out.data_ptr() + 4 * oc, dispatch.current_stream(index))
    return cfg


STREAM_K_CASES = [  # (M, N, K, layout, SMs): layouts as in variants.py; odd extents reach edge tiles
    (1024, 1024, 512, "nn", 7),      # 32 tiles of 128x256 on 7 SMs: 4 waves + 4 pieced tiles
    (1000, 1001, 1003, "nn", 5),     # N, K not multiples of 4 (single-float B copies, K tail)
    (1031, 770, 517, "tn", 7),       # A transposed, odd extents
    (777, 1030, 300, "nt", 10),      # B transposed
    (1024, 1024, 4096, "nn", 30),    # 32 tiles on 30 SMs: 2 tiles in 15 pieces each
    (2048, 512, 256, "nn", 13),      # 32 k-tiles per tile
]


@pytest.mark.parametrize("head_form", [False, True], ids=["one_launch", "head_form"])
@pytest.mark.parametrize("M,N,K,layout,sms", STREAM_K_CASES, ids=["x".join(map(str, c[:3])) + f"-{c[3]}-{c[4]}sm"
                                                                   for c in STREAM_K_CASES])
def test_stream_k_plans_match_float64(M, N, K, layout, sms, head_form, rel_err):
    """Every output written once (NaN-poisoned out, inside a larger buffer that must stay
    untouched), the right sum, the same bits on a second run; in one launch and in the head
    form (C's first rows in a plain launch, the stream-K launch moved down past them)."""
    a = randn(M, K) if layout[0] != "t" else randn(K, M).t()
    b = randn(K, N) if layout[1] != "t" else randn(N, K).t()
    a0, b0 = a.clone(), b.clone()
    big = torch.full((M + 2, N + 3), NAN, device="cuda")
    out = big[1:M + 1, 2:N + 2]
    cfg = stream_k_run(a, b, out, sms, head_form)
    assert cfg.stream_k.pieced_tiles > 0
    assert (cfg.stream_k.head_rows > 0) == head_form and (cfg.stream_k.whole_tiles == 0 or not head_form)
    check(out, a, b, "ieee", rel_err)
    rest = big.clone()
    rest[1:M + 1, 2:N + 2] = 0
    assert torch.isnan(rest).sum().item() == big.numel() - M * N  # nothing written outside out
    first = out.clone()
    out.fill_(NAN)
    stream_k_run(a, b, out, sms, head_form)
    assert torch.equal(out, first)  # fixed-order sums: the same bits every run
    assert torch.equal(a, a0) and torch.equal(b, b0)


def test_grad_w_in_the_head_form_with_an_epilogue_matches_float64(rel_err):
    """A^T @ B of 4 waves and 4 tiles of 128 x 256 on this GPU: on sm_90 the planner's plan is
    stream-K's head form (the whole waves in the plain kernel's launch, the last tile row in the
    stream-K launch). Its fused epilogues move down with it: a bias over the columns, and a D of
    its own row stride (addmm's beta * C) whose rows must line up with the product's, through
    fastmm.matmul, fastmm.addmm and out=, first and steady-state calls."""
    props = torch.cuda.get_device_properties(0)
    if (props.major, props.minor) < (8, 0):
        pytest.skip("cp.async needs sm80+")
    sms = props.multi_processor_count
    M, N, K = 128 * (sms + 1), 1024, 1024  # 4 (sms + 1) tiles of 128 x 256
    exp = fastmm.explain(randn(K, M).t(), randn(K, N), precision="ieee")
    if (props.major, props.minor) == (9, 0):
        assert exp.plan.head is not None and exp.plan.kernel.stream_k.head_rows == 128 * sms, str(exp)
        assert "first" in exp.launch and "stream-K head" in dict(exp.plan.head.details), str(exp)
    for _ in range(2):
        a, b = randn(K, M).t(), randn(K, N)
        check(fastmm.matmul(a, b, precision="ieee"), a, b, "ieee", rel_err)
        bias, d = randn(N), randn(M + 5, N + 3)[3:M + 3, 1:N + 1]  # (D with a row stride of N + 3)
        for c, beta, alpha in ((bias, 1.0, 1.0), (d, 0.5, 2.0)):
            want = torch.addmm(c.double(), a.double(), b.double(), beta=beta, alpha=alpha)
            got = fastmm.addmm(c, a, b, beta=beta, alpha=alpha, precision="ieee")
            err = ((got.double() - want).norm() / want.norm()).item()
            assert err <= TOL["ieee"], (c.shape, beta, alpha, err)
            out = torch.full((M, N), NAN, device="cuda")
            fastmm.addmm(c, a, b, beta=beta, alpha=alpha, precision="ieee", out=out)
            assert torch.equal(out, got)


def test_stream_k_is_the_default_for_a_partial_last_wave_and_takes_the_fast_path(rel_err):
    """A product whose 128x256 tiles leave the last wave part-empty on this GPU runs stream-K
    (whole waves, then the rest in pieces, then the fixup) through fastmm.matmul, first call
    and steady-state calls, correct with fresh inputs, the same bits on the same inputs."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if torch.cuda.get_device_capability(0) < (8, 0):
        pytest.skip("cp.async needs sm80+")
    M, N, K = 128 * (sms + sms // 2 + 1), 256, 2048  # 1.5 waves and one tile
    a, b = randn(M, K), randn(K, N)
    exp = fastmm.explain(a, b, precision="ieee")
    assert exp.plan.kernel.stream_k is not None and exp.plan.reduce.family == "stream_k_fixup", str(exp)
    assert "stream-K" in str(exp)
    for _ in range(3):
        a, b = randn(M, K), randn(K, N)
        check(fastmm.matmul(a, b, precision="ieee"), a, b, "ieee", rel_err)
        entry = fast_path.ENTRIES.get(fast_path.key_of(a, b, None, "ieee"))
        assert isinstance(entry, fast_path.FastEntry) and entry.runner is not None, (
            "no fast entry with the fixup pass after a call")
    out = torch.full((M, N), NAN, device="cuda")
    first = fastmm.matmul(a, b, precision="ieee", out=out).clone()
    check(first, a, b, "ieee", rel_err)
    assert torch.equal(fastmm.matmul(a, b, precision="ieee"), first)


def test_skinny_operands_past_2_31_elements(tall_a):
    """64-bit offsets in skinny: B of more than 2^31 elements read row-major (float4) and as a
    transposed view, and A of more than 2^31 elements as a strided view."""
    rows = tall_a.shape[0]
    a = randn(4, rows)  # B = tall_a: K = rows, N = 1024, k * sBk passes 2^31
    c = forced_plan(a, tall_a, "skinny", "ieee")[0]
    for cols in (slice(0, 16), slice(-16, None)):
        assert relative_error(c[:, cols], a.double() @ tall_a[:, cols].double()) <= TOL["ieee"]
    a = randn(3, 1024)  # B = tall_a^T: N = rows, n * sBn passes 2^31
    c = forced_plan(a, tall_a.T, "skinny", "ieee")[0]
    for r in (slice(0, 64), slice(-64, None)):
        assert relative_error(c[:, r], a.double() @ tall_a[r].T.double()) <= TOL["ieee"]
    a = tall_a.T[:8]  # A = (8, rows) with k-stride 1024: k * sAk passes 2^31
    b = randn(rows, 16)
    c = forced_plan(a, b, "skinny", "ieee")[0]
    assert relative_error(c, a.double() @ b.double()) <= TOL["ieee"]


# --- explain and the cache ------------------------------------------------------------------------

@pytest.mark.parametrize("precision", PRECISIONS)
def test_explain_on_cuda_names_the_kernel_and_the_cache_state(precision):
    a, b = randn(512, 384), randn(384, 256)
    fastmm.matmul(a, b, precision=precision)
    exp = fastmm.explain(a, b, precision=precision)
    major, minor = torch.cuda.get_device_capability(a.device)
    assert exp.capability == f"{major}.{minor}" and str(a.device) in exp.device
    assert exp.kernel in FAMILIES and exp.parameters and exp.launch["grid"]
    assert exp.cache.startswith("in memory")
    text = str(exp)
    assert f"kernel: {exp.kernel}" in text and "cache: in memory" in text
    assert "M=512 N=256 K=384" in text
    if (major, minor) == (9, 0) and precision == "tf32x3":
        # 8 tiles: wgmma declines, and on sm_90 tf32x3 then runs fp32 SIMT (mma.sync is slower there)
        assert exp.kernel == "simt_cp_async" and exp.precision_used == "ieee" and "fp32 SIMT path" in text
    elif major >= 8 and precision != "ieee":
        assert exp.kernel in TENSOR_CORE_FAMILIES and exp.precision_used == precision


def test_explain_on_cuda_for_inputs_torch_serves():
    for dtype in (torch.float64, torch.float16):
        a, b = randn(8, 8).to(dtype), randn(8, 8).to(dtype)
        exp = fastmm.explain(a, b)
        assert exp.kernel is None and str(dtype) in exp.fallback
        assert torch.equal(fastmm.matmul(a, b), torch.matmul(a, b))


def test_cache_state_goes_from_compiled_to_memory_to_disk(tmp_cache, monkeypatch, rel_err):
    # an empty in-process state, as in a new process
    monkeypatch.setattr(launcher, "_modules", {})
    monkeypatch.setattr(dispatch, "PLANS", dispatch.PlanCache())
    monkeypatch.setattr(fast_path, "ENTRIES", {})
    a, b = randn(300, 200), randn(200, 100)
    exp = fastmm.explain(a, b, precision="ieee")
    assert exp.cache.startswith("not compiled yet") and str(tmp_cache) in exp.cache
    plan = exp.plan
    first = launcher.load(plan.device, plan.kernel)
    assert first.state == "compiled" and first.path is not None and first.path.parent == tmp_cache
    assert launcher.load(plan.device, plan.kernel).state == "memory"
    assert fastmm.explain(a, b, precision="ieee").cache.startswith("in memory (compiled by this process)")
    monkeypatch.setattr(launcher, "_modules", {})  # a second process, same cache folder
    assert fastmm.explain(a, b, precision="ieee").cache.startswith("on disk, not loaded yet")
    assert launcher.load(plan.device, plan.kernel).state == "disk"
    assert fastmm.explain(a, b, precision="ieee").cache.startswith("in memory (loaded from the disk cache)")
    check(fastmm.matmul(a, b, precision="ieee"), a, b, "ieee", rel_err)
    torch.cuda.synchronize()


def test_forced_kernel_environment_variable(monkeypatch, rel_err):
    a, b = randn(500, 300), randn(300, 400)
    monkeypatch.setenv("FASTMM_KERNEL", "scalar")
    assert fastmm.explain(a, b, precision="tf32").kernel == "scalar"
    check(fastmm.matmul(a, b, precision="tf32"), a, b, "ieee", rel_err)
    monkeypatch.setenv("FASTMM_DISABLE", "1")
    exp = fastmm.explain(a, b)
    assert exp.kernel is None and "FASTMM_DISABLE" in exp.fallback
    check(fastmm.matmul(a, b, precision="ieee"), a, b, "ieee", rel_err)  # torch.matmul, at ieee


# --- streams and CUDA graphs ----------------------------------------------------------------------

def test_launches_go_on_the_current_stream(rel_err):
    a, b = randn(512, 512), randn(512, 512)
    fastmm.matmul(a, b, precision="ieee")  # compiled and loaded outside the timing below
    new_a = randn(512, 512)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms of work queued first on the side stream
        a.copy_(new_a)  # runs after the sleep, on the side stream
        c = fastmm.matmul(a, b, precision="ieee")  # must queue behind the copy
    torch.cuda.synchronize()
    check(c, new_a, b, "ieee", rel_err)


def test_two_streams_at_once_each_get_the_right_answer(rel_err):
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    a1, b1 = randn(512, 384), randn(384, 640)
    a2, b2 = randn(300, 500), randn(500, 200)
    fastmm.matmul(a1, b1, precision="ieee")
    fastmm.matmul(a2, b2, precision="tf32")
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    outs1, outs2 = [], []
    for _ in range(20):
        with torch.cuda.stream(s1):
            outs1.append(fastmm.matmul(a1, b1, precision="ieee"))
        with torch.cuda.stream(s2):
            outs2.append(fastmm.matmul(a2, b2, precision="tf32"))
    torch.cuda.synchronize()
    for c in outs1:
        check(c, a1, b1, "ieee", rel_err)
    for c in outs2:
        check(c, a2, b2, "tf32", rel_err)


GRAPH_SHAPES = [(256, 320, 192), (64, 64, 16384), (3, 5, 4), (8, 2048, 4096), (1536, 1024, 520), (1100, 1030, 1029),
                (25472, 256, 1024), (256, 256, 16384)]
# tiled, split-K (two kernels), scalar, skinny (split-K too); on sm_90 at tf32/tf32x3: wgmma read in
# place (C^T = B^T A^T) or with its copies (tf32x3 always; K % 4 != 0: both operands); ieee on the
# H200: 199 tiles of 128x256 on 132 SMs, stream-K (its workspace from the graph's pool); ieee on
# the H200: split-K in cluster pairs


@pytest.mark.parametrize("M,N,K", GRAPH_SHAPES, ids=["tiled", "long_k", "tiny", "skinny", "wgmma", "wgmma_copies",
                                                     "stream_k", "split_pairs"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_cuda_graph_capture_after_warmup_replays_with_new_values(precision, M, N, K, rel_err):
    a, b = randn(M, K), randn(K, N)
    out = torch.full((M, N), NAN, device="cuda")
    fastmm.warmup(a, b, precision=precision)
    fastmm.warmup(a, b, precision=precision, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c = fastmm.matmul(a, b, precision=precision)
        fastmm.matmul(a, b, precision=precision, out=out)
    for _ in range(3):
        a.copy_(randn(M, K))
        b.copy_(randn(K, N))
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        check(c, a, b, precision, rel_err)
        check(out, a, b, precision, rel_err)


def test_capturing_an_unwarmed_shape_raises_and_says_warm_up(tmp_cache, monkeypatch):
    monkeypatch.setattr(launcher, "_modules", {})  # nothing loaded in this process
    monkeypatch.setattr(dispatch, "PLANS", dispatch.PlanCache())
    monkeypatch.setattr(fast_path, "ENTRIES", {})
    a, b = randn(200, 136), randn(136, 168)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="(?i)warm"):
        with torch.cuda.graph(graph):
            fastmm.matmul(a, b, precision="ieee")
    assert launcher._modules == {}  # nothing was compiled or loaded during the capture
    torch.cuda.synchronize()


# --- autograd, custom ops, torch.compile on the GPU ---------------------------------------------

GRAD_SHAPES = [((130, 70), (70, 90)), ((2, 1, 33, 40), (3, 40, 65)), ((70,), (70, 90)), ((130, 70), (70,)),
               ((3, 33, 40), (40, 65))]


@pytest.mark.parametrize("sa,sb", GRAD_SHAPES, ids=[f"{a}@{b}" for a, b in GRAD_SHAPES])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_custom_op_gradients_match_float64(precision, sa, sb):
    a = randn(*sa).requires_grad_()
    b = randn(*sb).requires_grad_()
    y = torch.ops.fastmm.matmul(a, b, precision)
    g = torch.randn_like(y)
    y.backward(g)
    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    y64 = torch.matmul(a64, b64)
    y64.backward(g.double())
    assert relative_error(y.detach(), y64.detach()) <= TOL[precision]
    assert relative_error(a.grad, a64.grad) <= TOL[precision]
    assert relative_error(b.grad, b64.grad) <= TOL[precision]


def test_fastmm_matmul_backward_runs_fastmm_kernels_and_matches_float64(monkeypatch):
    """The forward and both backward products (grad @ b^T, a^T @ grad) are products fastmm's
    kernels served (no fallback reason; first calls of their layouts, so each takes the full
    path, where they are counted), and the gradients match float64."""
    served = []  # the fallback reason of every product the fastmm op computed (None: kernels ran)
    real = dispatch.matmul_fastmm

    def counting(a, b, out, precision, *args, **kwargs):
        result = real(a, b, out, precision, *args, **kwargs)
        served.append(result[2])
        return result

    monkeypatch.setattr(dispatch, "matmul_fastmm", counting)  # (the eager route looks it up here)
    fast_path.forget_plans()  # no steady-state entry left from an earlier test
    a, b = randn(64, 48).requires_grad_(), randn(48, 80).requires_grad_()
    y = fastmm.matmul(a, b, precision="ieee")
    assert served == [None]
    y.square().sum().backward()
    assert served == [None, None, None], served
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    (a64 @ b64).square().sum().backward()
    assert relative_error(a.grad, a64.grad) <= 1e-5 and relative_error(b.grad, b64.grad) <= 1e-5


CUDA_OPCHECK = {
    "contiguous": lambda: (randn(33, 40), randn(40, 65)),
    "transposed": lambda: (randn(40, 33).T, randn(65, 40).T),
    "offset": lambda: (at_offset((33, 40), 1), at_offset((40, 65), 3)),
    "empty": lambda: (randn(0, 40), randn(40, 65)),
    "k_zero": lambda: (randn(33, 0), randn(0, 65)),
    "broadcast": lambda: (randn(2, 1, 33, 40), randn(3, 40, 65)),
    "vector": lambda: (randn(40), randn(3, 40, 65)),
    "grad": lambda: (randn(33, 40).requires_grad_(), randn(40, 65).requires_grad_()),
}


@pytest.mark.parametrize("case", sorted(CUDA_OPCHECK))
def test_opcheck_on_cuda(case):
    a, b = CUDA_OPCHECK[case]()
    torch.library.opcheck(torch.ops.fastmm.matmul, (a, b, "ieee"))
    if not (a.requires_grad or b.requires_grad):
        out = torch.empty(torch.matmul(a, b).shape, device="cuda")
        torch.library.opcheck(torch.ops.fastmm.matmul_out, (a, b, "ieee", out))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_torch_compile_fullgraph_equals_eager_on_cuda(precision, rel_err):
    torch._dynamo.reset()

    def f(x, y):
        return fastmm.matmul(torch.relu(x), y, precision=precision) * 2

    a, b = randn(4, 96, 80), randn(80, 72)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, eager = compiled(a, b), f(a, b)
    assert relative_error(got, eager) <= TOL[precision]
    check(got / 2, torch.relu(a), b, precision, rel_err)
    torch._dynamo.reset()


# --- other devices --------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_gpu_runs_on_its_own_modules(rel_err):
    a, b = torch.randn(300, 200, device="cuda:1"), torch.randn(200, 100, device="cuda:1")
    for precision in PRECISIONS:
        c = fastmm.matmul(a, b, precision=precision)
        assert c.device == a.device
        check(c, a, b, precision, rel_err)
    exp = fastmm.explain(a, b)
    assert "cuda:1" in exp.device and exp.kernel is not None
    assert any(index == 1 for index, _, _ in launcher._modules)


# --- mid-size products on the split model's plans (simt_split_model, sm_90) ---------------------

MODELLED = [  # (M, N, K, layout): W^T, a row-major W (grad_x), odd widths and depths
    (1500, 2048, 512, "b_t"), (733, 1999, 517, "b_t"), (1023, 1537, 769, "b_t"), (394, 3072, 768, "b_t"),
    (1100, 512, 2048, "b_t"), (1576, 768, 2304, ""), (640, 1024, 1536, ""), (611, 2222, 333, "b_t"),
    (1234, 517, 2222, ""), (1000, 3072, 1024, "b_t"),
]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("M,N,K,layout", MODELLED, ids=["x".join(map(str, m[:3])) + m[3] for m in MODELLED])
def test_mid_size_products_on_the_modelled_tile_and_split_match_float64(M, N, K, layout, bias, rel_err):
    """Every plan the mid-size split model picks here (tiles and splits the rules did not reach:
    64-row tiles split and fused, the 128 x 256 tile in odd slices) against float64, into a
    NaN-filled out=, with and without F.linear's bias; the plan is the model's on sm_90."""
    a = randn(M, K)
    w = randn(N, K) if layout == "b_t" else randn(K, N).t()  # (a row-major W: its transposed view)
    b = w.t()
    bias_v = randn(N) if bias else None
    plan = fastmm.explain(a, b, precision="ieee").plan
    assert plan.kernel is not None and plan.kernel.family == "simt_cp_async", plan.describe()
    if torch.cuda.get_device_capability() == (9, 0):
        assert "tile and split" in dict(plan.kernel.details), plan.describe()
    a0, w0 = a.clone(), w.clone()
    out = torch.full((M, N), NAN, device="cuda")
    if bias:
        got = fastmm.linear(a, w, bias_v, precision="ieee")
        ref = torch.addmm(bias_v.double(), a.double(), w.double().t()).float()
        assert not torch.isnan(got).any()
        assert rel_err(got, ref) <= TOL["ieee"]
    else:
        assert fastmm.matmul(a, b, out=out, precision="ieee") is out
        check(out, a, b, "ieee", rel_err)
    assert torch.equal(a, a0) and torch.equal(w, w0)
