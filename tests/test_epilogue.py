"""The fused epilogue: ``F.linear``'s bias and ``torch.addmm``'s beta * C + alpha * (A @ B) are
applied by the store that finishes each output (the GEMM's own, a split-K reduce, a fused split's
last block), not by a second pass over C.

CPU tests: the planner's placement of EPILOGUE on a simulated H200, and whole calls on the
emulated GPU (tests/emulation.py), whose kernels read D, alpha and beta from the launch arguments
fastmm passes, so a wrong stride, a transposed D (plans computing C^T) or an epilogue applied
twice gives a wrong result here. The GPU tests run the same calls on the real kernels.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

import fastmm
from fastmm.families import FAMILIES
from fastmm.plan import EPILOGUE_MACRO, select
from fastmm.problem import EPILOGUE_BIAS_M, EPILOGUE_BIAS_N, EPILOGUE_D, DeviceFacts, Problem, epilogue_form, transposed

NAN = float("nan")
H200 = DeviceFacts.simulated_device("sm_90")
TOL = {"ieee": 1e-6, "tf32": 3e-3, "tf32x3": 1e-6}


def fused(cfg) -> bool:
    return cfg is not None and EPILOGUE_MACRO in cfg.macros


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


# --- where the planner puts it ----------------------------------------------------------------

def plan_of(M, N, K, precision="ieee", family=None, dev=H200, form=EPILOGUE_D, **kw):
    p = dataclasses.replace(Problem.dense(M, N, K, precision, **kw), epilogue=form)
    return select(p, dev, family)


def test_a_single_launch_plan_applies_it_in_the_gemm():
    plan = plan_of(2048, 2048, 512)
    assert plan.reduce is None and fused(plan.kernel)
    assert "epilogue" in dict(plan.kernel.details)
    assert "EPILOGUE=1" in plan.describe()
    # and a problem without one builds the kernel without it
    assert not fused(select(Problem.dense(2048, 2048, 512), H200).kernel)


def test_a_split_k_plan_applies_it_in_the_reduce_not_in_the_slices():
    plan = plan_of(256, 256, 65536)  # largeK: 128x256 tiles, many slices added in cluster pairs
    assert plan.kernel.split_k > 1 and not plan.kernel.split_fused and plan.reduce is not None
    assert fused(plan.reduce) and not fused(plan.kernel)


def test_a_fused_split_applies_it_in_the_gemm_that_sums_its_slices():
    plan = plan_of(8, 4096, 14336, b_t=True)  # decode: skinny_kmajor, its last block sums the slices
    assert plan.kernel.family == "skinny_kmajor" and plan.kernel.split_fused and plan.reduce is None
    assert fused(plan.kernel)
    plan = plan_of(1, 4096, 4096, b_t=True)  # the GEMV: its warps split K, one launch, no slices
    assert plan.kernel.family == "skinny_kmajor" and dict(plan.kernel.macros)["KR_KW"] == 8
    assert not plan.kernel.split_fused and plan.reduce is None and fused(plan.kernel)
    plan = plan_of(1024, 2816, 1024, b_t=True)  # a 1024-token MLP layer: SIMT split 3 ways, summed by its last block
    assert plan.kernel.family == "simt_cp_async" and plan.kernel.split_k == 3
    assert plan.kernel.split_fused and plan.reduce is None and fused(plan.kernel)


def test_stream_k_applies_it_in_the_whole_tiles_and_in_the_fixup():
    plan = plan_of(8192, 4096, 6144)
    assert plan.kernel.stream_k is not None, plan.describe()
    assert fused(plan.kernel) and fused(plan.reduce)


def test_cluster_pairs_leave_it_to_the_reduce():
    plan = plan_of(256, 256, 65536)
    assert plan.kernel.split_pair, plan.describe()
    assert fused(plan.reduce) and not fused(plan.kernel)


def test_wgmma_applies_it_in_its_store_and_its_stagers_never():
    plan = plan_of(2048, 2048, 2048, "tf32", a_t=True)
    assert plan.kernel.family == "wgmma_tf32" and fused(plan.kernel)
    assert not any(fused(s) for s in plan.stagers)


@pytest.mark.parametrize("d_shape,form", [((1024,), EPILOGUE_BIAS_N), ((), EPILOGUE_BIAS_N), ((1, 1024), EPILOGUE_BIAS_N),
                                          ((512, 1), EPILOGUE_BIAS_M), ((512, 1024), EPILOGUE_D),
                                          ((1024, 512), EPILOGUE_D)])
def test_the_epilogue_form_is_what_d_broadcasts_along(d_shape, form):
    """A bias (one row for every row of C), a column, or a D read per output, from the strides D
    has once broadcast to C's 512 x 1024 (a transposed D is read through its strides)."""
    d = torch.zeros(d_shape)
    d = d.t() if d_shape == (1024, 512) else d
    assert epilogue_form(d.expand(512, 1024).stride()) == form
    p = dataclasses.replace(Problem.dense(512, 1024, 64), epilogue=form)
    back = {EPILOGUE_BIAS_N: EPILOGUE_BIAS_M, EPILOGUE_BIAS_M: EPILOGUE_BIAS_N}.get(form, form)
    assert transposed(p).epilogue == back and transposed(transposed(p)).epilogue == form


def test_wgmma_adds_a_bias_to_its_accumulators_and_keeps_the_plain_products_plan():
    """A bias needs no sweep over C: the plan of the product without one (here the persistent
    PINGPONG of a 32000-wide head), plus EPILOGUE_VECTOR. A D read per output keeps the
    cooperative form (PINGPONG cannot apply it)."""
    plain = select(Problem.dense(8192, 32000, 1024, "tf32", b_t=True), H200)
    bias = plan_of(8192, 32000, 1024, "tf32", form=EPILOGUE_BIAS_N, b_t=True)
    full = plan_of(8192, 32000, 1024, "tf32", form=EPILOGUE_D, b_t=True)
    pm, bm, fm = (dict(x.kernel.macros) for x in (plain, bias, full))
    assert pm.get("PINGPONG") == 1, plain.describe()
    assert bm.pop("EPILOGUE_VECTOR") == 1 and bm.pop("EPILOGUE") == 1 and bm == pm
    assert bias.kernel.grid == plain.kernel.grid and bias.kernel.tile == plain.kernel.tile
    assert "EPILOGUE_VECTOR" not in fm and "PINGPONG" not in fm and fm["EPILOGUE"] == 1


def test_a_bias_of_a_product_computed_transposed_runs_along_the_kernels_rows():
    """tf32 with a row-major B (GPT-2's Conv1D): wgmma computes C^T = B^T A^T, so the bias over
    C's columns is one over the kernel's rows (EPILOGUE_VECTOR 2), and a column of D the other way."""
    plan = plan_of(8192, 4096, 1024, "tf32", form=EPILOGUE_BIAS_N)
    assert plan.swap_ab and plan.kernel.family == "wgmma_tf32", plan.describe()
    assert dict(plan.kernel.macros)["EPILOGUE_VECTOR"] == 2
    assert dict(plan_of(8192, 4096, 1024, "tf32", form=EPILOGUE_BIAS_M).kernel.macros)["EPILOGUE_VECTOR"] == 1


@pytest.mark.parametrize("form", [EPILOGUE_BIAS_N, EPILOGUE_BIAS_M, EPILOGUE_D])
def test_the_largest_simt_tile_stores_a_bias_over_columns_through_shared_memory(form):
    """On sm_90 the 128 x 256 SIMT tile that finishes C with a bias over its columns stores the
    tile through shared memory (C_STAGED), each thread reading its column's bias once
    (EPILOGUE_FORM 1): from the registers, any read of the bias slowed the main loop (ptxas
    allocates its registers around the epilogue), 3.2-3.4% of the product (NOTES run 34). Plain
    and stream-K plans; not a split's slices (the pass that sums them applies it), not a D of
    any strides or a bias over rows (read per output, as before), not other GPUs or tiles."""
    def staged(plan):
        m = dict(plan.kernel.macros)
        return m.get("C_STAGED") == 1, m.get("EPILOGUE_FORM")

    bias = form == EPILOGUE_BIAS_N
    plain = plan_of(8192, 1024, 1024, form=form, b_t=True)  # (W^T: B copied row-major first)
    assert plain.kernel.tile == (128, 256, 8) and plain.reduce is None and fused(plain.kernel)
    assert staged(plain) == ((True, 1) if bias else (False, None))
    stream_k = plan_of(8192, 4096, 6144, form=form)
    assert stream_k.kernel.stream_k is not None and fused(stream_k.kernel) and fused(stream_k.reduce)
    assert staged(stream_k) == ((True, 1) if bias else (False, None))
    assert "EPILOGUE_FORM" not in dict(stream_k.reduce.macros)
    odd = plan_of(4096, 4095, 1024, form=form)  # single-float C: staged with or without a bias
    assert staged(odd) == (True, 1 if bias else None)
    split = plan_of(2048, 1024, 1024, form=form, b_t=True)  # the same tile in 2 slices: the reduce adds D
    assert split.kernel.tile == (128, 256, 8) and split.kernel.split_k == 2 and not split.kernel.split_fused
    assert dict(split.kernel.macros)["C_VEC"] == 1 and fused(split.reduce) and not fused(split.kernel)
    assert staged(split) == (False, None)
    assert staged(plan_of(8192, 1024, 1024, form=form, b_t=True, dev=DeviceFacts.simulated_device("sm_80"))) == (False, None)
    tf32 = plan_of(8192, 1024, 1024, "tf32", form=form, b_t=True)
    assert tf32.kernel.family == "wgmma_tf32" and "EPILOGUE_FORM" not in dict(tf32.kernel.macros)
    if bias:
        assert "through shared memory" in dict(plain.kernel.details)["C stores"]
        assert "bias read once" in dict(plain.kernel.details)["C stores"]


def test_a_wgmma_split_sums_its_slices_through_the_general_epilogue():
    """SPLIT applies the epilogue where the last block sums the slices: no EPILOGUE_VECTOR."""
    plan = plan_of(48, 4096, 11008, "tf32", form=EPILOGUE_BIAS_N, b_t=True)
    macros = dict(plan.kernel.macros)
    assert plan.kernel.family == "wgmma_tf32" and macros.get("SPLIT") == 1, plan.describe()
    assert macros["EPILOGUE"] == 1 and "EPILOGUE_VECTOR" not in macros


# --- whole calls on the emulated GPU ----------------------------------------------------------

#: (family forced, precision, x shape, out features): a linear layer each family serves; long K
#: for the split plans
LINEAR_CASES = [
    ("scalar", "ieee", (2, 9, 12), 20),
    ("simt_float4", "ieee", (2, 24, 40), 36),
    ("simt_cp_async", "ieee", (2, 24, 40), 36),
    ("simt_cp_async", "ieee", (64, 16384), 64),  # split-K + reduce
    ("tf32_mma", "tf32", (2, 24, 40), 36),
    ("tf32_mma", "tf32x3", (3, 30, 41), 50),  # K not a multiple of 4
    ("tf32_mma", "tf32", (64, 8192), 64),  # split-K + reduce
    ("wgmma_tf32", "tf32", (2, 64, 64), 96),
    ("wgmma_tf32", "tf32x3", (100, 72), 40),
    ("wgmma_tf32", "tf32", (2, 20, 64), 96),  # 40 rows: the 64-row tile, C through the copy engine
    ("wgmma_tf32", "tf32", (48, 2048), 2048),  # the 64-row tile, K split in 4: the bias in the sum
    ("wgmma_tf32", "tf32x3", (40, 72), 2048),  # tf32x3 on 64-row tiles: B split by the kernel
    ("wgmma_tf32", "tf32x3", (48, 2048), 2048),  # ... and K split in 4
    ("skinny", "ieee", (2, 8, 64), 200),
    ("skinny_kmajor", "ieee", (1, 4096), 96),  # decode: a fused split
    ("skinny_kmajor", "tf32", (5, 300), 130),
    ("kmajor_mma", "tf32", (1, 4096), 96),  # decode on tensor cores: a fused split
    ("kmajor_mma", "tf32x3", (3, 5, 300), 130),  # K not a multiple of 4: single-float loads
]


@pytest.mark.parametrize("family,precision,x_shape,n", LINEAR_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in LINEAR_CASES])
def test_linear_bias_is_added_by_the_store_that_finishes_each_output(emulated_gpu, monkeypatch, family, precision,
                                                                     x_shape, n):
    monkeypatch.setenv("FASTMM_KERNEL", family)
    x, w, bias = torch.randn(x_shape), torch.randn(n, x_shape[-1]), torch.randn(n)
    y = fastmm.linear(x, w, bias, precision=precision)
    ref = x.double() @ w.double().t() + bias.double()
    assert y.shape == ref.shape and rel(y, ref) <= TOL[precision]
    launches = emulated_gpu.launches
    assert family in emulated_gpu.families
    # one launch applies the epilogue, the one that finishes C; nothing runs after it
    assert [fused(x.cfg) for x in launches].count(True) == 1 and fused(launches[-1].cfg), emulated_gpu.families


@pytest.mark.parametrize("family,precision", [("simt_cp_async", "ieee"), ("wgmma_tf32", "tf32"), ("wgmma_tf32", "tf32x3"),
                                              ("skinny", "ieee"), ("tf32_mma", "tf32")])
@pytest.mark.parametrize("c_shape", [(), (1,), (72,), (1, 72), (48, 1), (48, 72)])
@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, -2.0), (0, 3.0)])
def test_addmm_applies_beta_c_and_alpha_in_the_store(emulated_gpu, monkeypatch, family, precision, c_shape, beta, alpha):
    """Every broadcast of C (a row, a column, a scalar, all of it), scaled; beta = 0 ignores C,
    NaN included. wgmma tf32 with a row-major B computes C^T (its plan swaps A and B): D is read
    transposed there."""
    monkeypatch.setenv("FASTMM_KERNEL", family)
    M = 24 if family == "skinny" else 48
    c_shape = tuple(M if d == 48 else d for d in c_shape)
    a, b = torch.randn(M, 36), torch.randn(36, 72)
    c = torch.full(c_shape, NAN) if beta == 0 else torch.randn(c_shape)
    got = fastmm.addmm(c, a, b, beta=beta, alpha=alpha, precision=precision)
    ref = alpha * (a.double() @ b.double()) + (0 if beta == 0 else beta * c.double())
    assert not torch.isnan(got).any()
    assert got.shape == (M, 72) and rel(got, ref.expand(M, 72)) <= TOL[precision]
    assert fused(emulated_gpu.launches[-1].cfg)
    if (family, precision) == ("wgmma_tf32", "tf32"):
        assert fastmm.explain(a, b, precision=precision).plan.swap_ab  # (the case this covers)
    if family == "wgmma_tf32":  # a row or a column of C: added to the accumulators (the kernel's rows if swapped)
        along_n = len(c_shape) < 2 or c_shape[0] == 1
        along_m = not along_n and c_shape[1] == 1
        swapped = precision == "tf32"
        vector = 0 if not (along_n or along_m) else (1 if along_n != swapped else 2)
        assert dict(emulated_gpu.launches[-1].cfg.macros).get("EPILOGUE_VECTOR", 0) == vector


def test_a_transposed_c_is_read_through_its_strides(emulated_gpu):
    a, b, c = torch.randn(40, 24), torch.randn(24, 56), torch.randn(56, 40).t()
    got = fastmm.addmm(c, a, b, beta=2.0, precision="ieee")
    assert rel(got, a.double() @ b.double() + 2 * c.double()) <= 1e-6
    assert fused(emulated_gpu.launches[-1].cfg)


def test_a_repeat_is_one_lookup_and_reads_the_new_bias(emulated_gpu):
    """The steady-state path passes each call's D: a fresh bias tensor (another pointer) must be
    the one added, with no call through the full path."""
    x, w = torch.randn(4, 16, 40), torch.randn(36, 40)
    biases = []  # (kept alive: a freed bias's memory may be handed to the next one)
    for i in range(3):
        bias = torch.randn(36)
        biases.append(bias)
        y = fastmm.linear(x, w, bias, precision="ieee")
        assert rel(y, x.double() @ w.double().t() + bias.double()) <= 1e-6
        if i == 0:
            slow = emulated_gpu.slow_calls
    assert emulated_gpu.slow_calls == slow
    ptrs = {x.pointers[-1] for x in emulated_gpu.launches if fused(x.cfg)}
    assert len(ptrs) == 3  # each call's own bias


def test_with_grad_the_forward_is_fused_and_the_gradients_are_right(emulated_gpu):
    x = torch.randn(2, 20, 24, requires_grad=True)
    w = torch.randn(30, 24, requires_grad=True)
    bias = torch.randn(30, requires_grad=True)
    y = fastmm.linear(x, w, bias, precision="ieee")
    assert fused(emulated_gpu.launches[-1].cfg)
    g = torch.randn(y.shape)  # (torch.randn: memory the emulation knows)
    y.backward(g)
    refs = [t.detach().double().requires_grad_() for t in (x, w, bias)]
    F.linear(*refs).backward(g.double())
    for got, ref in zip((x.grad, w.grad, bias.grad), refs):
        assert rel(got, ref.grad) <= 1e-6


def test_products_it_cannot_fuse_still_get_their_epilogue(emulated_gpu):
    """A 1-D input: the product, then the bias added."""
    w, bias = torch.randn(36, 40), torch.randn(36)
    x1 = torch.randn(40)
    torch.testing.assert_close(fastmm.linear(x1, w, bias, precision="ieee"), F.linear(x1, w, bias), rtol=1e-5, atol=1e-5)
    assert not any(fused(x.cfg) for x in emulated_gpu.launches)


def test_rows_folded_by_a_copy_get_the_fused_bias(emulated_gpu):
    """Batch dims that fold into rows only by a copy (a transposed batch view): one product on
    the copy, the bias in its stores."""
    w, bias = torch.randn(36, 40), torch.randn(36)
    x3 = torch.randn(16, 4, 40).transpose(0, 1)
    torch.testing.assert_close(fastmm.linear(x3, w, bias, precision="ieee"), F.linear(x3, w, bias), rtol=1e-5, atol=1e-5)
    (launch,) = emulated_gpu.launches
    assert fused(launch.cfg)


def test_addmm_into_out_follows_torchs_rules(emulated_gpu):
    """out= as torch.addmm takes it: written in full (NaN-filled before), resized with torch's
    warning when its shape differs, no autograd, an out that overlaps an input still right."""
    c, a, b = torch.randn(36), torch.randn(20, 24), torch.randn(24, 36)
    ref = 0.5 * c.double() + 2.0 * (a.double() @ b.double())
    out = torch.full((20, 36), NAN)
    assert fastmm.addmm(c, a, b, beta=0.5, alpha=2.0, precision="ieee", out=out) is out
    assert rel(out, ref) <= 1e-6 and fused(emulated_gpu.launches[-1].cfg)
    out = torch.full((3, 3), NAN)
    with pytest.warns(UserWarning, match="An output with one or more elements was resized"):
        fastmm.addmm(c, a, b, beta=0.5, alpha=2.0, precision="ieee", out=out)
    assert out.shape == (20, 36) and rel(out, ref) <= 1e-6
    square = torch.randn(24, 24)
    expected = square.double() + square.double() @ square.double()
    fastmm.addmm(square, square, square, precision="ieee", out=square)  # out is every input
    assert rel(square, expected) <= 1e-6
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        fastmm.addmm(c, a.requires_grad_(), b, out=torch.empty(20, 36))
    with pytest.raises(RuntimeError, match="Expected out tensor to have dtype float"):
        fastmm.addmm(c, a.detach(), b, out=torch.empty(20, 36, dtype=torch.float64))


def test_a_bias_of_the_wrong_size_raises_torchs_error(emulated_gpu):
    x, w = torch.randn(8, 40), torch.randn(36, 40)
    with pytest.raises(RuntimeError, match="must match the size"):
        fastmm.linear(x, w, torch.randn(5), precision="ieee")


@pytest.mark.parametrize("c_shape,m", [((), 20), ((36,), 20), ((1, 36), 20), ((20, 1), 20), ((20, 36), 20), ((1, 1), 20),
                                       ((2, 20, 36), 20), ((1, 1, 36), 20), ((35,), 20), ((2, 36), 20), ((20, 2), 20),
                                       ((36, 20), 20), ((21, 36), 20), ((5, 36), 1), ((1, 36), 1)])
def test_addmm_accepts_the_inputs_torch_broadcasts_and_no_other(c_shape, m):
    """addmm's own shape check (not torch.broadcast_shapes, which cost a third of a decode-sized
    call's host time) against torch.addmm itself: the same shapes pass, the rest raise torch's
    'expanded size' error, word for word."""
    c, a, b = torch.randn(c_shape), torch.randn(m, 40), torch.randn(40, 36)
    torch_error = None
    try:
        torch.addmm(c, a, b)
    except RuntimeError as exc:
        torch_error = str(exc)
    try:
        got = fastmm.addmm(c, a, b, precision="ieee")
        ok = True
    except RuntimeError as exc:
        assert str(exc) == torch_error, (str(exc), torch_error)  # torch's words
        ok = False
    assert ok == (torch_error is None), c_shape
    if ok:
        assert torch.allclose(got, torch.addmm(c, a, b), rtol=1e-5, atol=1e-5)


def test_every_gemm_family_declares_the_epilogue_parameters():
    """Each GEMM family's kernel and each second pass takes FASTMM_EPILOGUE_PARAMS, and every
    final store goes through ``epi`` (a source check: a family that forgot one would ignore D)."""
    from fastmm.runtime.sources import read_source

    sources = {f.source for f in FAMILIES.values() if f.name != "stage_kmajor"} | {"splitk_reduce.cu",
                                                                                   "stream_k_fixup.cu"}
    for src in sorted(sources):
        text = read_source(src)
        assert "FASTMM_EPILOGUE_PARAMS" in text and re.search(r"FASTMM_EPILOGUE\n", text), src
        assert re.search(r"\bepi\b[(),]", text), src  # the stores use it (epi(...), or passed on: , epi)
