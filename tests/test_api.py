"""torch.matmul semantics of fastmm.matmul / fastmm.explain on the CPU (fastmm.api,
fastmm.explain, fastmm.config): errors worded as torch words them, CPU results identical to
torch's, ``out=`` rules, precision resolution, and how a call becomes a Problem for the planner.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import fastmm
from fastmm import api
from fastmm.families import LOAD_ELEM_FAST, LOAD_ELEM_K, LOAD_VEC_FAST, LOAD_VEC_K
from fastmm.plan import select
from fastmm.problem import DeviceFacts

SM90 = DeviceFacts.simulated_device("sm_90")


def outcome(fn):
    """(exception type name, message) of ``fn()``, or None when it returns."""
    try:
        fn()
    except Exception as exc:  # the comparison below is the assertion
        return type(exc).__name__, str(exc)
    return None


def noncontig(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dims stored column-major (other strides, other torch paths)."""
    if t.dim() < 2:
        return t
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.fixture
def restore_float32_precision():
    old = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(old)


# --- errors ------------------------------------------------------------------------------------

MISMATCHED = [
    ((3,), (4,)),  # 1-D / 1-D
    ((3, 4), (5,)),  # 2-D / 1-D
    ((3,), (4, 5)),  # 1-D / 2-D
    ((3, 4), (5, 6)),  # 2-D / 2-D
    ((2, 3, 4), (2, 5, 6)),  # batched, K differs
    ((2, 3, 4), (3, 4, 5)),  # batch dims do not broadcast
    ((2, 3, 4), (5,)),
    ((4,), (2, 5, 6)),
    ((2, 3, 4), (5, 6)),
    ((2, 1, 3, 4), (3, 5, 6)),
    ((5,), (2, 3, 4, 6)),
    ((2, 3, 4), (7, 1, 5, 6)),
    ((), (3,)),  # 0-d inputs
    ((3,), ()),
    ((), ()),
    ((3, 4), ()),
]


@pytest.mark.parametrize("layout", ["contiguous", "column-major"])
@pytest.mark.parametrize("sa,sb", MISMATCHED, ids=[f"{a}@{b}" for a, b in MISMATCHED])
def test_shape_errors_are_torchs_errors(sa, sb, layout):
    a, b = torch.randn(sa), torch.randn(sb)
    if layout == "column-major":
        a, b = noncontig(a), noncontig(b)
    expected = outcome(lambda: torch.matmul(a, b))
    assert expected is not None and expected[0] == "RuntimeError"
    assert outcome(lambda: fastmm.matmul(a, b)) == expected
    assert outcome(lambda: fastmm.matmul(a, b, precision="tf32")) == expected
    out = torch.empty(0)
    assert outcome(lambda: fastmm.matmul(a, b, out=out)) == outcome(lambda: torch.matmul(a, b, out=torch.empty(0)))


def test_2d_shape_error_names_both_shapes():
    with pytest.raises(RuntimeError) as exc:
        fastmm.matmul(torch.randn(3, 4), torch.randn(5, 6))
    assert str(exc.value) == "mat1 and mat2 shapes cannot be multiplied (3x4 and 5x6)"


def test_0d_error_says_at_least_1d():
    with pytest.raises(RuntimeError, match="both arguments to matmul need to be at least 1D, but they are 0D and 1D"):
        fastmm.matmul(torch.tensor(2.0), torch.randn(3))


@pytest.mark.parametrize("case", ["dtype_mismatch", "not_a_tensor", "out_with_grad", "out_wrong_dtype", "out_int"])
def test_other_errors_are_torchs_errors(case):
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    calls = {
        "dtype_mismatch": ((a, b.double()), {}),
        "not_a_tensor": (([1.0, 2.0], torch.randn(2)), {}),
        "out_with_grad": ((a.clone().requires_grad_(), b), {"out": torch.empty(3, 5)}),
        "out_wrong_dtype": ((a, b), {"out": torch.empty(3, 5, dtype=torch.float64)}),
        "out_int": ((a, b), {"out": torch.empty(3, 5, dtype=torch.int32)}),
    }
    args, kwargs = calls[case]
    expected = outcome(lambda: torch.matmul(*args, **kwargs))
    assert expected is not None
    assert outcome(lambda: fastmm.matmul(*args, **kwargs)) == expected


@pytest.mark.parametrize("bad", ["bogus", "IEEE", "fp32", "highest", ""])
def test_unknown_precision_raises_listing_the_allowed_values(bad):
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    for call in (lambda: fastmm.matmul(a, b, precision=bad), lambda: fastmm.explain(a, b, precision=bad),
                 lambda: api.resolve_precision(bad)):
        with pytest.raises(ValueError) as exc:
            call()
        for allowed in ("'ieee'", "'tf32'", "'tf32x3'", "None"):
            assert allowed in str(exc.value)
        assert repr(bad) in str(exc.value)


# --- precision ---------------------------------------------------------------------------------

@pytest.mark.parametrize("setting,expected", [("highest", "ieee"), ("high", "tf32"), ("medium", "tf32")])
def test_precision_none_follows_torch_float32_matmul_setting(restore_float32_precision, setting, expected):
    torch.set_float32_matmul_precision(setting)
    assert api.resolve_precision(None) == expected
    assert fastmm.explain(torch.randn(3, 4), torch.randn(4, 5)).precision_requested == expected


def test_precision_none_follows_the_cuda_tf32_flag(restore_float32_precision):
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = True
    assert api.resolve_precision(None) == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = False
    assert api.resolve_precision(None) == "ieee"


def test_precision_none_survives_mixed_torch_precision_apis(restore_float32_precision):
    # set_float32_matmul_precision then allow_tf32: torch 2.13's own getter raises here
    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.matmul.allow_tf32 = False
    assert api.resolve_precision(None) == "ieee"
    torch.backends.cuda.matmul.allow_tf32 = True
    assert api.resolve_precision(None) == "tf32"


@pytest.mark.parametrize("precision", ["ieee", "tf32", "tf32x3"])
def test_explicit_precision_is_kept(restore_float32_precision, precision):
    for setting in ("highest", "high"):
        torch.set_float32_matmul_precision(setting)
        assert api.resolve_precision(precision) == precision


@pytest.mark.parametrize("setting", ["highest", "high", "medium"])
@pytest.mark.parametrize("precision,tf32", [("ieee", False), ("tf32", True), ("tf32x3", False)])
def test_torch_fallback_precision_is_applied_then_restored(restore_float32_precision, setting, precision, tf32):
    torch.set_float32_matmul_precision(setting)
    with api._torch_precision(precision):
        assert torch.backends.cuda.matmul.allow_tf32 is tf32
    assert torch.get_float32_matmul_precision() == setting  # the user's setting, still readable
    with pytest.raises(KeyError):
        with api._torch_precision(precision):
            raise KeyError("restored on errors too")
    assert torch.get_float32_matmul_precision() == setting


# --- CPU tensors: exactly torch's results ------------------------------------------------------

SHAPES = [
    ((4,), (4,)),
    ((4,), (4, 5)),
    ((3, 4), (4,)),
    ((3, 4), (4, 5)),
    ((2, 3, 4), (4,)),
    ((4,), (2, 4, 5)),
    ((2, 3, 4), (4, 5)),
    ((3, 4), (2, 4, 5)),
    ((2, 3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (5, 4, 6)),
    ((2, 1, 3, 4), (1, 5, 4, 6)),
    ((1, 3, 4), (7, 4, 2)),
    ((0, 4), (4, 5)),  # M = 0
    ((3, 4), (4, 0)),  # N = 0
    ((3, 0), (0, 5)),  # K = 0: zeros
    ((0,), (0,)),  # K = 0, 1-D: a zero scalar
    ((2, 3, 0), (0, 5)),
    ((0, 3, 4), (4, 5)),  # batch 0
    ((2, 0, 3, 4), (1, 4, 5)),
]


def _operands(sa, sb, layout, dtype):
    a, b = torch.randn(sa, dtype=dtype), torch.randn(sb, dtype=dtype)
    if layout == "column-major":
        a, b = noncontig(a), noncontig(b)
    elif layout == "expanded" and a.dim() >= 3:
        a = a[:1].expand(a.shape)  # stride-0 batch
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "column-major", "expanded"])
@pytest.mark.parametrize("sa,sb", SHAPES, ids=[f"{a}@{b}" for a, b in SHAPES])
def test_cpu_results_are_exactly_torchs(sa, sb, layout, dtype):
    a, b = _operands(sa, sb, layout, dtype)
    a0, b0 = a.clone(), b.clone()
    expected = torch.matmul(a, b)
    for precision in (None, "ieee", "tf32", "tf32x3"):
        got = fastmm.matmul(a, b, precision=precision)
        assert got.shape == expected.shape and got.dtype == expected.dtype and got.device == expected.device
        assert torch.equal(got, expected)
    assert torch.equal(a, a0) and torch.equal(b, b0)  # inputs never modified


def test_k_zero_gives_zeros():
    got = fastmm.matmul(torch.randn(3, 0), torch.randn(0, 5))
    assert torch.equal(got, torch.zeros(3, 5))
    out = torch.full((3, 5), float("nan"))
    assert fastmm.matmul(torch.randn(3, 0), torch.randn(0, 5), out=out) is out
    assert torch.equal(out, torch.zeros(3, 5))


@pytest.mark.parametrize("sa,sb", SHAPES[:12], ids=[f"{a}@{b}" for a, b in SHAPES[:12]])
def test_out_of_the_right_shape_is_filled_and_returned(sa, sb):
    a, b = torch.randn(sa), torch.randn(sb)
    expected = torch.matmul(a, b)
    theirs_out, out = torch.full(expected.shape, float("nan")), torch.full(expected.shape, float("nan"))
    with warnings.catch_warnings(record=True) as theirs:
        warnings.simplefilter("always")
        torch.matmul(a, b, out=theirs_out)
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        assert fastmm.matmul(a, b, out=out) is out
    # torch itself warns for 1-D @ 2-D (it resizes out to (1, N) internally): the same warnings
    assert [str(w.message) for w in ours] == [str(w.message) for w in theirs]
    assert out.shape == expected.shape and torch.equal(out, expected)


def test_out_of_the_wrong_shape_is_resized_with_torchs_warning():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with warnings.catch_warnings(record=True) as theirs:
        warnings.simplefilter("always")
        torch.matmul(a, b, out=torch.empty(2, 2))
    out = torch.empty(2, 2)
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        assert fastmm.matmul(a, b, out=out) is out
    assert [str(w.message) for w in ours] == [str(w.message) for w in theirs] and len(ours) == 1
    assert out.shape == (3, 5) and torch.equal(out, a @ b)


def test_out_with_no_elements_is_resized_silently():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    out = torch.empty(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fastmm.matmul(a, b, out=out)
    assert out.shape == (3, 5) and torch.equal(out, a @ b)


def test_gpu_path_resize_rule_words_the_warning_as_torch():
    """``api._resize_out`` applies torch's rule on the CUDA path; its text must be torch's."""
    with warnings.catch_warnings(record=True) as theirs:
        warnings.simplefilter("always")
        torch.matmul(torch.randn(3, 4), torch.randn(4, 5), out=torch.empty(2, 2))
    out = torch.empty(2, 2)
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        api._resize_out(out, (3, 5))
    assert len(ours) == 1 and ours[0].category is UserWarning
    assert str(theirs[0].message).startswith(str(ours[0].message))
    assert out.shape == (3, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        api._resize_out(torch.empty(0), (3, 5))  # zero elements: silent
        api._resize_out(out, (3, 5))  # already right: nothing to do


def test_overlap_helpers():
    x = torch.randn(8, 8)
    assert api._overlaps(x, x) and api._overlaps(x[2:], x[:, 3]) and api._overlaps(x.T, x)
    assert not api._overlaps(x, torch.randn(8, 8)) and not api._overlaps(x[:0], x)
    assert api._has_internal_overlap(torch.randn(1, 4).expand(3, 4))
    assert not api._has_internal_overlap(x.T) and not api._has_internal_overlap(torch.randn(1, 4).expand(1, 4))


# --- explain ------------------------------------------------------------------------------------

def test_explain_on_cpu_says_torch_runs_and_why():
    exp = fastmm.explain(torch.randn(3, 4), torch.randn(4, 5), precision="ieee")
    assert exp.kernel is None and exp.plan is None
    assert "cpu" in exp.fallback and "CUDA" in exp.fallback
    text = str(exp)
    assert "runs: torch.matmul, because operands are on cpu and cpu" in text
    assert "precision: requested ieee" in text


def test_fastmm_disable_makes_explain_report_it(monkeypatch):
    monkeypatch.setenv("FASTMM_DISABLE", "1")
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    exp = fastmm.explain(a, b)
    assert exp.kernel is None and "FASTMM_DISABLE=1" in exp.fallback
    assert "FASTMM_DISABLE=1" in str(exp)
    assert torch.equal(fastmm.matmul(a, b), a @ b)
    monkeypatch.setenv("FASTMM_DISABLE", "0")
    assert "FASTMM_DISABLE" not in fastmm.explain(a, b).fallback


# --- how a call becomes a Problem (the CUDA path's bookkeeping, checked on CPU tensors) ---------

def _align_of(t: torch.Tensor) -> int:
    return next(n for n in (16, 8, 4, 1) if t.data_ptr() % n == 0)


def _problem(a, b, c=None, precision="ieee"):
    s = api.analyse(a, b)
    if c is None:
        c = torch.empty(s.batch + (s.M, s.N))
    return api.build_problem(s, c, precision)


@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_storage_offset_sets_alignment_and_vector_loads(offset):
    base = torch.randn(64 * 64 + 8)
    a = base[offset:offset + 64 * 64].view(64, 64)
    b = torch.randn(64, 64)
    p, offsets = _problem(a, b)
    assert offsets == [(0, 0, 0)]
    assert p.a_align == _align_of(a) and p.b_align == _align_of(b)
    assert (p.a_align == 16) == (a.data_ptr() % 16 == 0)
    m = dict(select(p, SM90, force="simt_float4").kernel.macros)
    if p.a_align < 16:
        assert m["A_MODE"] in (LOAD_ELEM_K, LOAD_ELEM_FAST)
    else:
        assert m["A_MODE"] == LOAD_VEC_K


@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_skinny_b_vec_follows_the_real_tensors_layout(offset, monkeypatch):
    """What skinny's B_VEC sees for real operands: B's storage offset, a transposed B view, a
    row-strided slice of B, and a vector A (M = 1). (On the v1 kernel, whose macros are just
    these two; v2 decides B_VEC by the same rule, checked in test_plan's random problems.)"""
    from fastmm.families import Skinny

    monkeypatch.setattr(Skinny, "variant", "v1")
    K, N = 96, 2048
    base = torch.randn(K * N + 8)
    b = base[offset:offset + K * N].view(K, N)
    p, _ = _problem(torch.randn(8, K), b)
    plan = select(p, SM90)
    assert plan.kernel.family == "skinny" and p.b_align == _align_of(b)
    assert dict(plan.kernel.macros)["B_VEC"] == int(b.data_ptr() % 16 == 0)
    p, _ = _problem(torch.randn(K), b)  # 1-D a: M = 1
    assert p.M == 1 and dict(select(p, SM90).kernel.macros) == {"MT": 8, "B_VEC": int(b.data_ptr() % 16 == 0)}
    if offset == 0:
        p, _ = _problem(torch.randn(24, K), torch.randn(N, K).T)  # B^T view: k-contiguous
        assert p.b_strides == (1, K) and dict(select(p, SM90).kernel.macros) == {"MT": 32, "B_VEC": 0}
        p, _ = _problem(torch.randn(9, K), torch.randn(K, N + 4)[:, :N])  # rows N + 4 apart: still float4
        assert dict(select(p, SM90).kernel.macros) == {"MT": 16, "B_VEC": 1}
        p, _ = _problem(torch.randn(9, K), torch.randn(K, N + 1)[:, :N])  # rows N + 1 apart: not
        assert dict(select(p, SM90).kernel.macros) == {"MT": 16, "B_VEC": 0}


def test_transposed_and_sliced_views_become_strides():
    a, b = torch.randn(40, 24).T, torch.randn(32, 40).T  # (24, 40) m-contiguous, (40, 32) k-contiguous
    p, _ = _problem(a, b)
    assert (p.M, p.N, p.K) == (24, 32, 40)
    assert p.a_strides == (1, 24) and p.b_strides == (1, 40) and p.c_strides == (32, 1)
    m = dict(select(p, SM90, force="simt_float4").kernel.macros)
    assert m["A_MODE"] == LOAD_VEC_FAST and m["B_MODE"] == LOAD_VEC_K
    wide = torch.randn(24, 45)
    p, _ = _problem(wide[:, :40], torch.randn(40, 32))  # row-strided slice
    assert p.a_strides == (45, 1)
    assert dict(select(p, SM90, force="simt_float4").kernel.macros)["A_MODE"] == LOAD_ELEM_K


def test_vectors_and_size_one_dims_get_normalized_strides():
    p, _ = _problem(torch.randn(7), torch.randn(7, 9))  # 1-D a: M = 1
    assert (p.M, p.N, p.K) == (1, 9, 7) and p.a_strides == (1, 1)
    p, _ = _problem(torch.randn(5, 7), torch.randn(7))  # 1-D b: N = 1
    assert (p.M, p.N, p.K) == (5, 1, 7) and p.b_strides == (1, 1) and p.c_strides == (1, 1)


def test_broadcast_batch_gets_zero_batch_strides():
    M, N, K = 5, 6, 7
    a, b = torch.randn(2, 1, M, K), torch.randn(3, K, N)
    p, offsets = _problem(a, b)
    assert (p.batch_inner, p.batch_total) == (3, 6) and offsets == [(0, 0, 0)]
    assert p.a_batch_strides == (M * K, 0) and p.b_batch_strides == (0, K * N)
    assert p.c_batch_strides == (3 * M * N, M * N)


def test_contiguous_batch_dims_merge_into_one():
    M, N, K = 5, 6, 7
    p, offsets = _problem(torch.randn(2, 3, M, K), torch.randn(2, 3, K, N))
    assert (p.batch_inner, p.batch_total) == (6, 6) and offsets == [(0, 0, 0)]
    assert p.a_batch_strides[1] == M * K and p.b_batch_strides[1] == K * N


def test_three_unmergeable_batch_dims_loop_over_the_outer_one():
    M, N, K = 5, 6, 7
    a, b = torch.randn(2, 1, 4, M, K), torch.randn(1, 3, 4, K, N)
    p, offsets = _problem(a, b)
    assert (p.batch_inner, p.batch_total) == (4, 12)
    assert offsets == [(0, 0, 0), (4 * M * K, 0, 12 * M * N)]  # element offsets of A, B, C per launch


def test_explain_problem_fields_match_build_problem():
    """explain() describes what build_problem produces; on CPU it falls back before that, so
    check the pieces it uses on a simulated plan instead."""
    a, b = torch.randn(2, 33, 20), torch.randn(20, 17)
    p, offsets = _problem(a, b, precision="tf32")
    plan = select(p, SM90)
    assert plan.problem is p and plan.kernel is not None and len(offsets) == 1
    assert p.layout_of("a") == "row-major" and p.a_batch_strides == (0, 33 * 20) and p.b_batch_strides == (0, 0)


def test_outer_batch_dim_of_size_zero_has_no_launch_and_does_not_crash():
    M, N, K = 5, 6, 7
    a, b = torch.randn(0, 1, 4, M, K), torch.randn(1, 3, 4, K, N)
    p, offsets = _problem(a, b)
    assert offsets == [] and (p.M, p.N, p.K) == (M, N, K)
    assert fastmm.matmul(a, b).shape == (0, 3, 4, M, N)
