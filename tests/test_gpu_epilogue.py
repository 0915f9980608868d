"""The fused epilogue on a real GPU (skipped without CUDA): ``F.linear``'s bias and ``torch.addmm``'s
beta * C + alpha * (A @ B) applied in the store of every kernel family and second pass, against a
float64 reference. Fresh ``torch.randn`` inputs per check; C filled with NaN where beta = 0 (it
must not be read). Tolerances as tests/test_gpu.py (ieee 1e-5, tf32 1e-3, tf32x3 1e-6) on the
Frobenius error vs float64, relative to |alpha| |A| |B| + |beta| |D| for the family sweep (tiny
outputs can cancel) and to the result elsewhere.
"""
from __future__ import annotations

import pytest
import torch

import fastmm
from fastmm import dispatch
from fastmm.families import WgmmaTf32
from fastmm.families.wgmma_tf32 import STAGED_TURNS_160
from fastmm.plan import EPILOGUE_MACRO

pytestmark = pytest.mark.cuda

TOL = {"ieee": 1e-5, "tf32": 1e-3, "tf32x3": 1e-6}
NAN = float("nan")
FAMILY_PRECISIONS = [("scalar", "ieee"), ("simt_float4", "ieee"), ("simt_cp_async", "ieee"), ("skinny", "ieee"),
                     ("skinny_kmajor", "ieee"), ("skinny_kmajor", "tf32"), ("kmajor_mma", "tf32"),
                     ("kmajor_mma", "tf32x3"), ("tf32_mma", "tf32"),
                     ("tf32_mma", "tf32x3"), ("wgmma_tf32", "tf32"), ("wgmma_tf32", "tf32x3")]
SHAPES = [(1, 1, 1), (3, 5, 4), (17, 19, 23), (31, 96, 132), (129, 96, 132), (257, 129, 193), (1000, 1000, 1000)]
#: (name, beta, alpha, D's shape as a function of (M, N), B given as nn.Linear stores it)
FORMS = [("linear_bias", 1, 1, lambda M, N: (N,), True),
         ("addmm_full_t", 0.5, -2.0, lambda M, N: (N, M), False),  # D transposed: read through its strides
         ("addmm_column_beta0_nan", 0, 3.0, lambda M, N: (M, 1), False),
         ("addmm_column", -0.5, 1.5, lambda M, N: (M, 1), False),  # D one value a row, read
         # D one value a column (a bias over C's columns: the largest SIMT tile stores C through
         # shared memory then, each thread reading its column's value once), with alpha and beta,
         # and with beta = 0 and NaN in D (not read)
         ("addmm_bias_alpha_beta", 0.5, -2.0, lambda M, N: (N,), True),
         ("addmm_bias_beta0_nan", 0, 0.25, lambda M, N: (N,), True)]


def randn(*shape) -> torch.Tensor:
    return torch.randn(*shape, device="cuda")


def rel(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """||got - ref|| / ||scale|| (default: ||ref||)."""
    return ((got.double() - ref).norm() / (ref if scale is None else scale).norm()).item()


def fused_call(M, N, K, form, precision):
    """(result, float64 reference, plan) of one fused product through dispatch.matmul_fused."""
    _, beta, alpha, d_shape, linear = form
    a = randn(M, K)
    b = randn(N, K).t() if linear else randn(K, N)
    d = randn(*d_shape(M, N))
    if form[0] == "addmm_full_t":
        d = d.t()
    if beta == 0:
        d = torch.full_like(d, NAN)
    result, plan, reason = dispatch.matmul_fused(a, b, d, alpha, beta, precision)
    assert reason is None and result is not None, reason
    ref = alpha * (a.double() @ b.double()) + (0 if beta == 0 else beta * d.double())
    # The error's scale: |alpha| |A| |B| + |beta| |D|, not |result|: a handful of outputs (1 x 1)
    # can cancel (a . b close to -D), where even an exactly rounded result has a large relative
    # error against itself (tf32 1x1x1 with a bias failed that way once)
    scale = abs(alpha) * (a.double().abs() @ b.double().abs()) + (0 if beta == 0 else abs(beta) * d.double().abs())
    return result, ref.expand(M, N), scale.expand(M, N), plan


def finishing(plan):
    """The launch that finishes C: the reduce or fixup where there is one (stream-K: both)."""
    return [c for c in (plan.kernel, plan.reduce) if c is not None and EPILOGUE_MACRO in c.macros]


@pytest.mark.parametrize("form", FORMS, ids=[f[0] for f in FORMS])
@pytest.mark.parametrize("M,N,K", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("family,precision", FAMILY_PRECISIONS, ids=[f"{f}-{p}" for f, p in FAMILY_PRECISIONS])
def test_every_family_applies_the_epilogue_in_its_store(monkeypatch, family, precision, M, N, K, form):
    monkeypatch.setenv("FASTMM_KERNEL", family)
    got, ref, scale, plan = fused_call(M, N, K, form, precision)
    why = dict(plan.rejected).get(family, "")
    if plan.kernel.family != family and "FASTMM_KERNEL" in why:
        # the family cannot run this problem (skinny: M <= 32; arch): the planner chose another
        pytest.skip(why)
    assert plan.kernel.family == family and finishing(plan)
    assert not torch.isnan(got).any()
    assert rel(got, ref, scale) <= TOL[precision], (plan.describe(), rel(got, ref, scale))


#: the plans with more than one launch, and the forms a heuristic plan takes at model sizes
PLANS = [(1024, 2816, 1024, "ieee", "split-K + reduce"), (256, 256, 65536, "ieee", "cluster pairs + reduce"),
         (8192, 4096, 6144, "ieee", "stream-K + fixup"), (1, 4096, 4096, "ieee", "decode, fused split"),
         (7, 11008, 4096, "tf32", "decode, fused split"), (1024, 2816, 1024, "tf32x3", "wgmma staged x3"),
         (2048, 2048, 2048, "tf32", "wgmma"), (512, 768, 3072, "tf32", "heuristic"),
         (4096, 1024, 1024, "ieee", "the 128 x 256 SIMT tile, one pass"),
         (4096, 4095, 1024, "ieee", "single-float C through shared memory")]


@pytest.mark.parametrize("form", FORMS, ids=[f[0] for f in FORMS])
@pytest.mark.parametrize("M,N,K,precision,what", PLANS, ids=[f"{p[0]}x{p[1]}x{p[2]}-{p[3]}" for p in PLANS])
def test_multi_launch_plans_apply_it_once_in_the_pass_that_finishes(M, N, K, precision, what, form):
    got, ref, scale, plan = fused_call(M, N, K, form, precision)
    assert finishing(plan), plan.describe()
    assert not torch.isnan(got).any()
    assert rel(got, ref, scale) <= TOL[precision], (what, plan.describe(), rel(got, ref, scale))


def test_a_row_major_b_on_wgmma_reads_d_transposed():
    """tf32 with row-major A and B: wgmma computes C^T = B^T A^T in place (swap_ab)."""
    a, b, c = randn(1024, 512), randn(512, 768), randn(1024, 1)
    result, plan, reason = dispatch.matmul_fused(a, b, c, 2.0, 0.5, "tf32")
    assert reason is None and plan.swap_ab and plan.kernel.family == "wgmma_tf32", plan.describe()
    assert rel(result, 2.0 * (a.double() @ b.double()) + 0.5 * c.double()) <= TOL["tf32"]


#: name -> (a and b, D as a function of (M, N), alpha, beta, D a vector along: 1 n, 2 m, 0 neither):
#: x @ W^T with N % 4 == 0 (C through the copy engine's staging, or from registers), odd N
#: (C's rows allow no tensor map: staged and written by the consumers, C_COPY_OUT, or from
#: registers), a row-major B (C^T from registers, float2 along m: a
#: bias over C's columns is one over the kernel's rows; with odd N, B^T is copied instead); M past
#: a tile, several tiles a persistent block. A bias is added to the accumulators as they are
#: stored (EPILOGUE_VECTOR); a D of any strides in a sweep after the store.
WGMMA_EPILOGUE_CASES = {
    "linear-staged": (lambda: (randn(333, 200), randn(1540, 200).t()), lambda m, n: randn(n), 1.0, 1.0, 1),
    "linear-odd-n": (lambda: (randn(333, 200), randn(1537, 200).t()), lambda m, n: randn(n), 1.0, 1.0, 1),
    "row-scaled": (lambda: (randn(333, 200), randn(1540, 200).t()), lambda m, n: randn(1, n), 0.5, -2.0, 1),
    "swap-bias": (lambda: (randn(1100, 136), randn(136, 904)), lambda m, n: randn(n), 1.0, 1.0, 1),
    "swap-bias-odd-n": (lambda: (randn(1100, 136), randn(136, 901)), lambda m, n: randn(n), 1.0, 1.0, 1),
    "swap-full-d": (lambda: (randn(1100, 136), randn(136, 901)), lambda m, n: randn(n, m).t(), 0.5, -2.0, 0),
    "column-beta0": (lambda: (randn(2100, 72), randn(520, 72).t()), lambda m, n: torch.full((m, 1), NAN, device="cuda"),
                     3.0, 0.0, 2),
    "column-scaled": (lambda: (randn(2100, 72), randn(521, 72).t()), lambda m, n: randn(m, 1), -1.5, 0.75, 2),
}


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("bn", [64, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("case", sorted(WGMMA_EPILOGUE_CASES))
def test_wgmma_applies_the_epilogue_at_every_width_and_store_form(case, bn, precision):
    """wgmma's epilogue on C staged for the copy engine (every box of every width), staged and
    written by the consumers (C_COPY_OUT, where the copy engine cannot take C), stored from
    registers, and (a bias, tf32, up to 192 wide) with the consumers taking turns (C from registers
    or through the copy engine): right against
    float64 into NaN-free results, and the same bits every way (each output is alpha * the same
    sum + beta * D)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("wgmma needs sm_90")
    # (160 wide: tf32, taken by the staged turns only, STAGED_TURNS_160; every form built here)
    extra = (STAGED_TURNS_160,) if bn == STAGED_TURNS_160[0] and precision == "tf32" else ()
    if bn not in {w for w, _ in WgmmaTf32.tile_options(precision == "tf32x3") + extra}:
        pytest.skip(f"no {bn}-wide tile for {precision}")
    make_ab, make_d, alpha, beta, vector = WGMMA_EPILOGUE_CASES[case]
    a, b = make_ab()
    m, n = a.shape[0], b.shape[1]
    d = make_d(m, n)
    ref = alpha * (a.double() @ b.double()) + (beta * d.double() if beta else 0)
    variants = [WgmmaTf32(force_bn=bn, tma_store=tma_store, pingpong=False, split=False, extra_widths=extra)
                for tma_store in (True, False)]
    variants.append(WgmmaTf32(force_bn=bn, tma_store=False, c_copy_out=False, pingpong=False, split=False,
                              extra_widths=extra))
    if precision == "tf32" and vector and bn <= 192:  # (PINGPONG takes a bias, not with A fed from registers)
        # (128-row tiles: the 64-row tile is the cooperative form only)
        variants.append(WgmmaTf32(force_bn=bn, pingpong="always", pingpong_tma_store=False, split=False, rows64=False,
                                  extra_widths=extra))
        # ... and C through the copy engine, each consumer warpgroup its own staging region
        variants.append(WgmmaTf32(force_bn=bn, pingpong="always", pingpong_tma_store=True, split=False, rows64=False,
                                  extra_widths=extra))
    results = []
    for variant in variants:
        result, plan, reason = dispatch.matmul_fused(a, b, d, alpha, beta, precision, force="wgmma_tf32",
                                                     variants=(variant,))
        assert reason is None and plan.kernel.family == "wgmma_tf32", reason
        macros = dict(plan.kernel.macros)
        assert EPILOGUE_MACRO in plan.kernel.macros and plan.kernel.tile[1] == bn
        # computed as C^T (a row-major B read in place): the bias runs along the kernel's other dim
        assert macros.get("EPILOGUE_VECTOR", 0) == ({1: 2, 2: 1}.get(vector, 0) if plan.swap_ab else vector), plan.describe()
        assert macros.get("PINGPONG", 0) == (variant.pingpong == "always" and not macros["A_MN"]), plan.describe()
        stores_tma = variant.tma_store and (variant.pingpong != "always" or variant.pingpong_tma_store is True)
        if variant.pingpong != "always" or macros.get("PINGPONG"):
            assert bool(macros.get("TMA_STORE")) == (stores_tma and n % 4 == 0 and not plan.swap_ab), plan.describe()
            if not variant.c_copy_out:
                assert not macros.get("C_COPY_OUT"), plan.describe()
        assert not torch.isnan(result).any()
        assert rel(result, ref) <= TOL[precision], (plan.describe(), rel(result, ref))
        results.append(result)
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("precision", ["ieee", "tf32", "tf32x3"])
def test_linear_and_addmm_repeat_through_the_steady_state_path(precision):
    """The public calls, three times each with fresh operands: the same kernels, each call's own D."""
    for _ in range(3):
        x, w, bias = randn(4, 77, 256), randn(320, 256), randn(320)
        y = fastmm.linear(x, w, bias, precision=precision)
        assert rel(y, x.double() @ w.double().t() + bias.double()) <= TOL[precision]
        c, a, b = randn(320), randn(77, 256), randn(256, 320)
        z = fastmm.addmm(c, a, b, beta=0.25, alpha=1.5, precision=precision)
        assert rel(z, 1.5 * (a.double() @ b.double()) + 0.25 * c.double()) <= TOL[precision]


def test_a_cuda_graph_replays_the_fused_linear():
    x, w, bias = randn(64, 512), randn(1024, 512), randn(1024)
    fastmm.linear(x, w, bias, precision="ieee")  # compile and load before the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fastmm.linear(x, w, bias, precision="ieee")
    for _ in range(2):
        x.copy_(randn(64, 512))
        bias.copy_(randn(1024))
        g.replay()
        torch.cuda.synchronize()
        assert rel(y, x.double() @ w.double().t() + bias.double()) <= TOL["ieee"]
