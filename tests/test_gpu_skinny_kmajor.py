"""The skinny_kmajor family on a real GPU: ``x @ W.t()`` with W stored ``[N, K]`` (B K-contiguous,
as nn.Linear reads its weight), M <= 32, against float64 (skipped without CUDA). Fresh random
inputs for every check, NaN-poisoned ``out``, inputs checked unmodified."""
from __future__ import annotations

import math

import pytest
import torch

import fastmm
from fastmm import dispatch
from fastmm.plan import TINY_K, TINY_OUTPUTS
from fastmm.runtime import launcher
from conftest import at_offset, guarded_outputs, relative_error

pytestmark = pytest.mark.cuda

FAMILY = "skinny_kmajor"
NAN = float("nan")
TOL = 1e-5  # the family computes fp32 FMAs for every precision request
MS = (1, 2, 3, 5, 8, 13, 16, 17, 31, 32)
NS = (1, 5, 100, 1001, 4096)
KS = (1, 3, 64, 257, 999, 4096, 14336)


def randn(*shape) -> torch.Tensor:
    return torch.randn(*shape, device="cuda")


def needs_sm80():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("skinny_kmajor stages A with cp.async (sm80+)")


def check(c, a, b) -> None:
    assert not torch.isnan(c).any(), "NaN in the result (an output element was not written?)"
    ref = torch.matmul(a.double(), b.double())
    err = relative_error(c, ref)
    if c.numel() < 64 and err > TOL:  # a few long sums can cancel: measure against |A||B|
        err = relative_error(c, a, b, scale="abs")
    assert err <= TOL, f"relative error {err:.3g}"


def forced(a, b, precision="ieee", out=None):
    result, plan, reason = dispatch.matmul_fastmm(a, b, out, precision, force=FAMILY)
    assert reason is None, f"fell back to torch: {reason}"
    assert plan.kernel.family == FAMILY and plan.precision_used == "ieee"
    return result, plan


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("N", NS)
def test_weight_layout_products_match_float64(N, K):
    """Every M of interest against W^T: forced onto the family (ieee, and tf32 into a NaN-filled
    out), and through the dispatcher, which picks this family unless the problem is tiny. K = 1
    with N > 1: W^T is one row, contiguous along N too, and the family leaves it to skinny."""
    needs_sm80()
    w = randn(N, K)
    w0 = w.clone()
    for M in MS:
        x = randn(M, K)
        x0 = x.clone()
        if K == 1 and N > 1:
            with pytest.raises(ValueError, match="B is N-contiguous too"):
                forced(x, w.t())
            exp = fastmm.explain(x, w.t(), precision="tf32")
            assert exp.kernel == ("scalar" if M * N <= TINY_OUTPUTS else "skinny"), str(exp)
            check(fastmm.matmul(x, w.t(), precision="tf32"), x, w.t())
            continue
        c, plan = forced(x, w.t())
        assert c.shape == (M, N) and c.is_contiguous()
        assert dict(plan.kernel.macros)["MT"] == 1 << max(0, (M - 1).bit_length())
        check(c, x, w.t())
        out = torch.full((M, N), NAN, device="cuda")
        assert forced(x, w.t(), "tf32", out=out)[0] is out
        check(out, x, w.t())
        exp = fastmm.explain(x, w.t(), precision="tf32")
        tiny = M * N <= TINY_OUTPUTS and K <= TINY_K
        tensor_cores = 8 <= M <= 32  # tf32 at 8 to 32 rows: kmajor_mma (tests/test_gpu_kmajor_mma.py)
        # (from 17 rows with N >= 4096 and K >= 2048 on sm_90: wgmma's 64-row tiles reading W in
        # place, or splitting K from 8192, go ahead of the decode families: wgmma_tf32.AHEAD_*)
        wgmma = M >= 17 and N >= 4096 and K >= 2048 and torch.cuda.get_device_capability() == (9, 0)
        assert exp.kernel == ("scalar" if tiny else "wgmma_tf32" if wgmma else "kmajor_mma" if tensor_cores
                              else FAMILY), str(exp)
        check(fastmm.matmul(x, w.t(), precision="ieee" if tensor_cores else "tf32"), x, w.t())
        assert torch.equal(x, x0) and torch.equal(w, w0)


@pytest.mark.parametrize("M,N,K", [(1, 130, 257), (9, 4096, 4096), (32, 1000, 300), (4, 14336, 4096)], ids=str)
def test_transposed_a_and_column_major_out(M, N, K):
    needs_sm80()
    w = randn(N, K)
    for name, a in {"a": randn(M, K), "aT": randn(K, M).t()}.items():
        c, plan = forced(a, w.t())
        assert dict(plan.kernel.macros)["A_VEC"] == int(name == "a" and K % 4 == 0), name
        check(c, a, w.t())
        out = randn(N, M).fill_(NAN).t()
        forced(a, w.t(), out=out)
        check(out, a, w.t())


@pytest.mark.parametrize("M,N,K", [(8, 4096, 4096), (17, 130, 257), (1, 1024, 14336)], ids=str)
@pytest.mark.parametrize("offset", [1, 2, 3])
@pytest.mark.parametrize("which", ["a", "w", "c"])
def test_storage_offsets_take_the_single_float_paths(which, offset, M, N, K):
    """Operands one to three floats into their storage: no 16-byte vectors on that operand."""
    needs_sm80()

    a = at_offset((M, K), offset) if which == "a" else randn(M, K)
    w = at_offset((N, K), offset) if which == "w" else randn(N, K)
    out = at_offset((M, N), offset, NAN) if which == "c" else torch.full((M, N), NAN, device="cuda")
    _, plan = forced(a, w.t(), out=out)
    macros = dict(plan.kernel.macros)
    assert macros["B_VEC"] == int(which != "w" and K % 4 == 0)
    assert macros["A_VEC"] == int(which != "a" and K % 4 == 0)
    check(out, a, w.t())


BATCHED = [
    ((3, 16, 256), (3, 1024, 256)),  # a batch of W's
    ((16, 1024), (3, 1000, 1024)),  # x broadcast over the batch (stride 0)
    ((2, 1, 5, 300), (3, 130, 300)),  # broadcast both ways
    ((4, 1, 64), (4, 4096, 64)),  # M = 1
]


@pytest.mark.parametrize("sa,sw", BATCHED, ids=[f"{a}@{b}" for a, b in BATCHED])
def test_batched_and_broadcast_weights(sa, sw):
    needs_sm80()
    a, w = randn(*sa), randn(*sw)
    b = w.transpose(-1, -2)
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    out = torch.full(shape, NAN, device="cuda")
    _, plan = forced(a, b, out=out)
    assert plan.kernel.split_k == 1 and plan.reduce is None  # a batch is never split
    check(out, a, b)
    check(fastmm.matmul(a, b, precision="ieee"), a, b)
    expanded = randn(1, *sa[-2:]).expand(3, *sa[-2:])  # a stride-0 batch dim on A
    b3 = randn(3, *sw[-2:]).transpose(-1, -2)
    check(forced(expanded, b3)[0], expanded, b3)


@pytest.mark.parametrize("M,N,K", [(1, 130, 257), (17, 4099, 4096), (32, 1024, 16384), (3, 1001, 999)], ids=str)
def test_writes_nothing_outside_the_output(M, N, K):
    needs_sm80()
    out, out2, untouched = guarded_outputs(M, N)
    a, w = randn(M, K), randn(N, K)
    forced(a, w.t(), out=out)
    forced(a, w.t(), out=out2)
    torch.cuda.synchronize()
    check(out, a, w.t())
    check(out2, a, w.t())
    assert untouched()


def test_small_integer_inputs_give_exact_sums():
    needs_sm80()
    for M, N, K in ((1, 4096, 4096), (17, 130, 257), (32, 1028, 16384), (5, 14336, 4096)):
        a = torch.randint(-3, 4, (M, K), device="cuda").float()
        w = torch.randint(-3, 4, (N, K), device="cuda").float()
        c = forced(a, w.t())[0]
        assert torch.equal(c, torch.matmul(a.double(), w.t().double()).float()), (M, N, K)


@pytest.mark.parametrize("M,N,K", [(4, 1024, 14336), (16, 4096, 4096), (8, 1024, 14336)], ids=str)
def test_split_plans_are_deterministic_and_leave_counters_at_zero(M, N, K):
    """The last block of a row tile sums the K slices in slice order: the same bits on every
    call, and each stream's arrival counters back at 0 afterwards."""
    needs_sm80()
    from fastmm.runtime import arrivals

    a, w = randn(M, K), randn(N, K)
    plan = fastmm.explain(a, w.t(), precision="ieee").plan
    assert plan.kernel.family == FAMILY and plan.kernel.split_fused and plan.kernel.split_k > 1, plan.describe()
    results = []
    for _ in range(3):
        out = torch.full((M, N), NAN, device="cuda")
        fastmm.matmul(a, w.t(), out=out, precision="ieee")
        results.append(out)
    check(results[0], a, w.t())
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    torch.cuda.synchronize()
    for key, buf in arrivals._buffers.items():
        assert not arrivals.values(buf).any(), f"arrival counters of {key} not back at 0"


@pytest.mark.parametrize("M,K", [(1, 4096), (16, 4096), (5, 1000)], ids=str)
def test_dependent_launches_chained_back_to_back_are_exact(M, K, monkeypatch):
    """Decode's chain: each call reads what the call before wrote, launched back to back as
    programmatic dependent launches on sm_90+ into NaN-poisoned buffers; every step against the
    same chain in float64."""
    needs_sm80()
    monkeypatch.delenv("FASTMM_PDL", raising=False)
    x0 = randn(M, K)
    ws = [randn(K, K) / math.sqrt(K) for _ in range(3)]
    plan = fastmm.explain(x0, ws[0].t(), precision="ieee").plan
    assert plan.kernel.family == FAMILY
    dependent = torch.cuda.get_device_capability() >= (9, 0)
    assert plan.kernel.dependent_launch is dependent
    lc = launcher.load(plan.device, plan.kernel).launch_config
    assert bool(getattr(lc, "programmatic_stream_serialization", False)) is dependent
    steps = 24
    bufs = [x0] + [torch.full((M, K), NAN, device="cuda") for _ in range(steps)]
    for i in range(steps):
        fastmm.matmul(bufs[i], ws[i % 3].t(), out=bufs[i + 1], precision="ieee")
    torch.cuda.synchronize()
    ref = x0.double()
    for i in range(steps):
        ref = ref @ ws[i % 3].t().double()
        got = bufs[i + 1]
        assert not torch.isnan(got).any(), f"step {i}: NaN (a launch read before the one ahead wrote?)"
        assert relative_error(got, ref) <= TOL * (i + 1), f"step {i}"


def test_nn_linear_decode_runs_on_the_family():
    """fastmm.nn.Linear with a batch of one token: its forward is this family's product."""
    needs_sm80()
    layer = fastmm.nn.Linear(4096, 1024, bias=True).cuda()
    x = randn(1, 1, 4096)
    exp = fastmm.explain(x, layer.weight.t(), precision="ieee")
    assert exp.kernel == FAMILY, str(exp)
    with torch.no_grad():
        y = layer(x)
    ref = x.double() @ layer.weight.double().t() + layer.bias.double()
    assert relative_error(y, ref) <= TOL


@pytest.mark.parametrize("kw", (2, 4, 8))
@pytest.mark.parametrize("M, N, K", [(1, 4096, 4096), (2, 100, 999 + 1), (3, 1001, 260), (4, 77, 4100),
                                     (1, 17, 300), (4, 33, 14336), (1, 5, 388)])
def test_warps_sharing_rows_along_k_match_float64(kw, M, N, K):
    """KR_KW warps of a block share its rows, each a run of whole k-step groups (warps with none
    when K is short), their sums added in shared memory: every KW against float64, into a
    NaN-filled out, with and without a split over blocks (K = 14336 at 4 rows needs 3 slices
    for A's shared memory); the inputs unmodified. (K > 256: smaller products run the scalar
    kernel whatever the variant.)"""
    needs_sm80()
    from fastmm.families import SkinnyKmajor

    a, w = randn(M, K), randn(N, K)
    a0, w0 = a.clone(), w.clone()
    out = torch.full((M, N), NAN, device="cuda")
    _, plan, reason = dispatch.matmul_fastmm(a, w.t(), out, "ieee", force=FAMILY, variants=(SkinnyKmajor(kw=kw),))
    assert reason is None and plan.kernel.family == FAMILY and dict(plan.kernel.macros)["KR_KW"] == kw
    check(out, a, w.t())
    assert torch.equal(a, a0) and torch.equal(w, w0)


def test_warps_along_k_keep_an_infinity_in_one_warps_range():
    """An infinity in A at one k: only the warp whose k steps hold it multiplies it (the others
    read neither that k of A nor of W), so each output is +-inf as in float64, never NaN."""
    needs_sm80()
    M, N, K = 2, 256, 4096
    a, w = randn(M, K), randn(N, K)
    a[0, 3000] = float("inf")
    c = fastmm.matmul(a, w.t(), precision="ieee")
    plan = fastmm.explain(a, w.t(), precision="ieee").plan
    assert plan.kernel.family == FAMILY and dict(plan.kernel.macros)["KR_KW"] == 8
    ref = a.double() @ w.t().double()
    assert torch.equal(torch.isinf(c), torch.isinf(ref)) and torch.equal(torch.isnan(c), torch.isnan(ref))
    assert torch.equal(torch.sign(c[0]), torch.sign(ref[0]))
    assert relative_error(c[1:], ref[1:]) <= TOL
