"""The kmajor_mma family on a real GPU: ``x @ W.t()`` with W stored ``[N, K]`` (B K-contiguous),
M <= 32, on TF32 tensor cores (tf32, and tf32x3 with split operands), against float64 (skipped
without CUDA). Fresh random inputs for every check, NaN-poisoned ``out``, inputs checked
unmodified. Tolerances as tests/test_gpu.py: tf32 1e-3, tf32x3 1e-6."""
from __future__ import annotations


import pytest
import torch

from fastmm import dispatch
from conftest import at_offset, guarded_outputs, relative_error

pytestmark = pytest.mark.cuda

FAMILY = "kmajor_mma"
NAN = float("nan")
TOL = {"tf32": 1e-3, "tf32x3": 1e-6}
MS = (1, 2, 3, 5, 8, 9, 13, 16, 17, 24, 32)
NS = (1, 5, 17, 100, 1001, 4096)
KS = (3, 31, 64, 257, 999, 4096, 14336)


def randn(*shape) -> torch.Tensor:
    return torch.randn(*shape, device="cuda")


def needs_sm80():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("kmajor_mma needs TF32 mma.sync (sm80+)")


def check(c, a, b, precision) -> None:
    assert not torch.isnan(c).any(), "NaN in the result (an output element was not written?)"
    err = relative_error(c, a, b)
    if c.numel() < 64 and err > TOL[precision]:  # a few long sums can cancel: measure against |A||B|
        err = relative_error(c, a, b, scale="abs")
    assert err <= TOL[precision], f"relative error {err:.3g} ({precision})"


def forced(a, b, precision, out=None):
    result, plan, reason = dispatch.matmul_fastmm(a, b, out, precision, force=FAMILY)
    assert reason is None, f"fell back to torch: {reason}"
    assert plan.kernel.family == FAMILY and plan.precision_used == precision
    return result, plan


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("N", NS)
def test_weight_layout_products_match_float64(N, K, precision):
    """Every M of the family against W^T, into a fresh C and into a NaN-filled out."""
    needs_sm80()
    w = randn(N, K)
    w0 = w.clone()
    for M in MS:
        x = randn(M, K)
        x0 = x.clone()
        c, plan = forced(x, w.t(), precision)
        assert c.shape == (M, N) and c.is_contiguous()
        assert dict(plan.kernel.macros)["KM_MF"] == (1 if M <= 8 else 2 if M <= 16 else 4)
        check(c, x, w.t(), precision)
        out = torch.full((M, N), NAN, device="cuda")
        assert forced(x, w.t(), precision, out=out)[0] is out
        check(out, x, w.t(), precision)
        assert torch.equal(x, x0) and torch.equal(w, w0)


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("M,N,K", [(1, 130, 257), (9, 4096, 4096), (16, 1000, 300), (4, 14336, 4096)], ids=str)
def test_transposed_a_and_column_major_out(M, N, K, precision):
    needs_sm80()
    w = randn(N, K)
    for name, a in {"a": randn(M, K), "aT": randn(K, M).t()}.items():
        c, plan = forced(a, w.t(), precision)
        vec = name == "a" and K % 4 == 0 or (name == "aT" and M == 1 and K % 4 == 0)
        assert dict(plan.kernel.macros)["A_VEC"] == int(vec), (name, plan.describe())
        check(c, a, w.t(), precision)
        out = randn(N, M).fill_(NAN).t()
        forced(a, w.t(), precision, out=out)
        check(out, a, w.t(), precision)


@pytest.mark.parametrize("M,N,K", [(8, 4096, 4096), (16, 130, 256), (1, 1024, 14336)], ids=str)
@pytest.mark.parametrize("offset", [1, 2, 3])
@pytest.mark.parametrize("which", ["a", "w", "c"])
def test_storage_offsets_take_the_single_float_paths(which, offset, M, N, K):
    """Operands one to three floats into their storage: no 16-byte vectors on A or W."""
    needs_sm80()

    a = at_offset((M, K), offset) if which == "a" else randn(M, K)
    w = at_offset((N, K), offset) if which == "w" else randn(N, K)
    out = at_offset((M, N), offset, NAN) if which == "c" else torch.full((M, N), NAN, device="cuda")
    _, plan = forced(a, w.t(), "tf32", out=out)
    macros = dict(plan.kernel.macros)
    vec = int(which == "c")
    assert macros["B_VEC"] == vec and macros["A_VEC"] == vec
    check(out, a, w.t(), "tf32")


BATCHED = [
    ((3, 16, 256), (3, 1024, 256)),  # a batch of W's
    ((16, 1024), (3, 1000, 1024)),  # x broadcast over the batch (stride 0)
    ((2, 1, 5, 300), (3, 130, 300)),  # broadcast both ways
    ((4, 1, 64), (4, 4096, 64)),  # M = 1
]


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("sa,sw", BATCHED, ids=[f"{a}@{b}" for a, b in BATCHED])
def test_batched_and_broadcast_weights(sa, sw, precision):
    needs_sm80()
    a, w = randn(*sa), randn(*sw)
    b = w.transpose(-1, -2)
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    out = torch.full(shape, NAN, device="cuda")
    _, plan = forced(a, b, precision, out=out)
    assert plan.kernel.split_k == 1 and plan.reduce is None  # a batch is never split
    check(out, a, b, precision)


@pytest.mark.parametrize("M,N,K", [(1, 130, 257), (13, 4099, 4096), (16, 1024, 16384), (3, 1001, 999)], ids=str)
def test_writes_nothing_outside_the_output(M, N, K):
    needs_sm80()
    out, out2, untouched = guarded_outputs(M, N)
    a, w = randn(M, K), randn(N, K)
    forced(a, w.t(), "tf32", out=out)
    forced(a, w.t(), "tf32x3", out=out2)
    torch.cuda.synchronize()
    check(out, a, w.t(), "tf32")
    check(out2, a, w.t(), "tf32x3")
    assert untouched()


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
def test_small_integer_inputs_give_exact_sums(precision):
    """Integers of a few bits are exact in TF32, and so are their sums in fp32 here: every
    output must be exact, whatever slice or warp added it."""
    needs_sm80()
    for M, N, K in ((1, 4096, 4096), (16, 130, 257), (16, 1028, 16384), (5, 14336, 4096), (24, 130, 257),
                    (32, 1028, 16384)):
        a = torch.randint(-3, 4, (M, K), device="cuda").float()
        w = torch.randint(-3, 4, (N, K), device="cuda").float()
        c = forced(a, w.t(), precision)[0]
        assert torch.equal(c, torch.matmul(a.double(), w.t().double()).float()), (M, N, K)


def test_tf32x3_is_fp32_accurate_where_tf32_is_not():
    """The split operands must be used: tf32x3 at least 100x closer to float64 than tf32."""
    needs_sm80()
    a, w = randn(16, 4096), randn(4096, 4096)
    e_tf32 = relative_error(forced(a, w.t(), "tf32")[0], a, w.t())
    e_x3 = relative_error(forced(a, w.t(), "tf32x3")[0], a, w.t())
    assert e_x3 * 100 <= e_tf32 and e_x3 <= TOL["tf32x3"], (e_tf32, e_x3)


@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (16, 4096, 4096), (8, 1024, 14336), (32, 3584, 18944)], ids=str)
def test_split_plans_are_deterministic_and_leave_counters_at_zero(M, N, K):
    """The last block of a row tile sums the K slices in slice order, the warps of a block add in
    warp order: the same bits on every call, and the arrival counters back at 0."""
    needs_sm80()
    from fastmm.runtime import arrivals

    a, w = randn(M, K), randn(N, K)
    results = []
    for _ in range(3):
        out = torch.full((M, N), NAN, device="cuda")
        _, plan = forced(a, w.t(), "tf32", out=out)
        assert plan.kernel.split_fused and plan.kernel.split_k > 1, plan.describe()
        results.append(out)
    check(results[0], a, w.t(), "tf32")
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    torch.cuda.synchronize()
    for key, buf in arrivals._buffers.items():
        assert not arrivals.values(buf).any(), f"arrival counters of {key} not back at 0"
