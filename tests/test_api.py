"""fastmm.matmul's public semantics (fastmm.api): errors worded as torch words them, unknown
precisions refused, ``out=`` rules, K = 0, where a call goes (the autograd op, torch for autocast,
the full or the steady-state path), and fastmm.explain's answer. Results are checked on the
emulated GPU (conftest.emulated_gpu), where fastmm's own plans and launch arguments compute them;
on CPU tensors fastmm hands every call to torch (tests/test_dispatch.py checks that decision).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import fastmm
from fastmm import api, ops
from conftest import outcome, relative_error


def noncontig(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dims stored column-major (other strides, other torch
    paths), in memory from torch.empty (which the emulated GPU knows as memory)."""
    if t.dim() < 2:
        return t
    return torch.empty(t.shape[:-2] + (t.shape[-1], t.shape[-2])).transpose(-1, -2).copy_(t)


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
    """fastmm checks shapes itself (fastmm.shapes.analyse) before anything else, on every device:
    its errors must read as torch's, whose wording depends on the operands' strides."""
    a, b = torch.randn(sa), torch.randn(sb)
    if layout == "column-major":
        a, b = noncontig(a), noncontig(b)
    expected = outcome(lambda: torch.matmul(a, b))
    assert expected is not None and expected[0] == "RuntimeError"
    assert outcome(lambda: fastmm.matmul(a, b)) == expected
    assert outcome(lambda: fastmm.matmul(a, b, precision="tf32")) == expected
    out = torch.empty(0)
    assert outcome(lambda: fastmm.matmul(a, b, out=out)) == outcome(lambda: torch.matmul(a, b, out=torch.empty(0)))


def test_shape_errors_on_the_gpu_path_are_torchs_errors(emulated_gpu):
    for sa, sb in MISMATCHED[:12]:
        a, b = torch.randn(sa), torch.randn(sb)
        assert outcome(lambda: fastmm.matmul(a, b)) == outcome(lambda: torch.matmul(a, b)), (sa, sb)
    assert emulated_gpu.launches == []


def test_shape_errors_with_out_are_torchs_words_for_the_call_with_out():
    """torch words some mismatches by out's size (a matrix @ vector: "size mismatch, got input
    (1), ..." with out=, "input (3)" without): fastmm's error is torch's for the same call."""
    for sa, sb, so in (((3, 4), (5,), (1,)), ((3, 4), (5, 6), (3, 6)), ((2, 3, 4), (5, 6), (2, 3, 6))):
        a, b = torch.randn(sa), torch.randn(sb)
        mine, ref = torch.zeros(so), torch.zeros(so)
        theirs = outcome(lambda: torch.matmul(a, b, out=ref))
        assert theirs is not None and outcome(lambda: fastmm.matmul(a, b, out=mine, precision="ieee")) == theirs


def test_matmul_shape_errors_are_worded_by_the_installed_torch(monkeypatch):
    """The error comes from torch.matmul itself (a stand-in here), not from fastmm's copy of some
    release's words (2.15 changed a 2-D product's)."""
    class TorchsWords(RuntimeError):
        pass

    def refuse(*args, **kwargs):
        raise TorchsWords("torch.matmul")

    monkeypatch.setattr(torch, "matmul", refuse)
    for sa, sb in MISMATCHED:
        with pytest.raises(TorchsWords):
            fastmm.matmul(torch.randn(sa), torch.randn(sb), precision="ieee")


def test_2d_shape_error_names_both_shapes():
    a, b = torch.randn(3, 4), torch.randn(5, 6)
    with pytest.raises(RuntimeError) as exc:
        fastmm.matmul(a, b)
    assert "shapes cannot be multiplied (3x4 and 5x6)" in str(exc.value)
    assert outcome(lambda: fastmm.matmul(a, b)) == outcome(lambda: torch.matmul(a, b))  # (the installed torch's words)


def test_0d_error_says_at_least_1d():
    with pytest.raises(RuntimeError, match="both arguments to matmul need to be at least 1D, but they are 0D and 1D"):
        fastmm.matmul(torch.tensor(2.0), torch.randn(3))


@pytest.mark.parametrize("case", ["dtype_mismatch", "not_a_tensor", "out_with_grad", "out_wrong_dtype", "out_int"])
def test_other_errors_are_torchs_errors(emulated_gpu, case):
    """Calls fastmm does not take (a dtype mismatch, a list, an out= with autograd, an out of
    another dtype) go to torch, which raises its own error: on the GPU path too."""
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
    assert emulated_gpu.launches == []


@pytest.mark.parametrize("bad", ["bogus", "IEEE", "fp32", "highest", ""])
def test_unknown_precision_raises_listing_the_allowed_values(bad):
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    for call in (lambda: fastmm.matmul(a, b, precision=bad), lambda: fastmm.explain(a, b, precision=bad)):
        with pytest.raises(ValueError) as exc:
            call()
        for allowed in ("'ieee'", "'tf32'", "'tf32x3'", "None"):
            assert allowed in str(exc.value)
        assert repr(bad) in str(exc.value)


# --- results: fastmm's own plans on the emulated GPU -------------------------------------------

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
    ((40, 70), (70, 50)),  # a tiled family (M * N > 1024)
    ((3, 40, 70), (70,)),
    ((2, 33, 48), (2, 48, 40)),
    ((0, 4), (4, 5)),  # M = 0
    ((3, 4), (4, 0)),  # N = 0
    ((3, 0), (0, 5)),  # K = 0: zeros
    ((0,), (0,)),  # K = 0, 1-D: a zero scalar
    ((2, 3, 0), (0, 5)),
    ((0, 3, 4), (4, 5)),  # batch 0
    ((2, 0, 3, 4), (1, 4, 5)),
]


def _operands(sa, sb, layout):
    a, b = torch.randn(sa), torch.randn(sb)
    if layout == "column-major":
        a, b = noncontig(a), noncontig(b)
    elif layout == "expanded" and a.dim() >= 3:
        a = a[:1].expand(a.shape)  # stride-0 batch
    return a, b


@pytest.mark.parametrize("layout", ["contiguous", "column-major", "expanded"])
@pytest.mark.parametrize("sa,sb", SHAPES, ids=[f"{a}@{b}" for a, b in SHAPES])
def test_results_have_torchs_shape_and_float64_accuracy_and_inputs_stay_unchanged(emulated_gpu, sa, sb, layout):
    """Every broadcasting form, 1-D operands, empty dims and K = 0, through fastmm.matmul at every
    precision: computed by fastmm's plans (a launch wherever the result has elements and K > 0)."""
    a, b = _operands(sa, sb, layout)
    a0, b0 = a.clone(), b.clone()
    expected = torch.matmul(a.double(), b.double())
    for precision in (None, "ieee", "tf32", "tf32x3"):
        emulated_gpu.clear()
        got = fastmm.matmul(a, b, precision=precision)
        assert got.shape == expected.shape and got.dtype == torch.float32
        # (the emulated wgmma rounds its inputs to TF32 as the H200's copy engine does)
        assert relative_error(got, expected) <= (1e-3 if "wgmma_tf32" in emulated_gpu.families else 1e-6)
        assert bool(emulated_gpu.launches) == (expected.numel() > 0 and a.shape[-1] > 0)
    assert torch.equal(a, a0) and torch.equal(b, b0)  # inputs never modified


def test_k_zero_gives_zeros(emulated_gpu):
    got = fastmm.matmul(torch.randn(3, 0), torch.randn(0, 5))
    assert torch.equal(got, torch.zeros(3, 5))
    out = torch.full((3, 5), float("nan"))
    assert fastmm.matmul(torch.randn(3, 0), torch.randn(0, 5), out=out) is out
    assert torch.equal(out, torch.zeros(3, 5))
    assert emulated_gpu.launches == []


# --- out= ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("sa,sb", SHAPES[:15], ids=[f"{a}@{b}" for a, b in SHAPES[:15]])
def test_out_of_the_right_shape_is_filled_and_returned_without_a_warning(emulated_gpu, sa, sb):
    """(torch itself warns for 1-D @ 2-D with a right-shaped out: it resizes out to (1, N)
    inside; fastmm's rule, torch's documented one, resizes only an out of another shape.)"""
    a, b = torch.randn(sa), torch.randn(sb)
    expected = torch.matmul(a.double(), b.double())
    out = torch.full(expected.shape, float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fastmm.matmul(a, b, out=out) is out
    assert relative_error(out, expected) <= 1e-6


def test_out_of_the_wrong_shape_is_resized_with_torchs_warning(emulated_gpu):
    a, b = torch.randn(30, 40), torch.randn(40, 50)
    with warnings.catch_warnings(record=True) as theirs:
        warnings.simplefilter("always")
        torch.matmul(a, b, out=torch.empty(2, 2))
    out = torch.empty(2, 2)
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        assert fastmm.matmul(a, b, out=out) is out
    assert len(ours) == len(theirs) == 1 and str(theirs[0].message).startswith(str(ours[0].message))
    assert out.shape == (30, 50) and relative_error(out, a, b) <= 1e-6
    assert emulated_gpu.launches  # fastmm computed it


def test_out_with_no_elements_is_resized_silently(emulated_gpu):
    a, b = torch.randn(30, 40), torch.randn(40, 50)
    out = torch.empty(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fastmm.matmul(a, b, out=out)
    assert out.shape == (30, 50) and relative_error(out, a, b) <= 1e-6


@pytest.mark.parametrize("kind", ["a", "b", "other-half", "transposed-a"])
def test_out_overlapping_an_input_gives_the_product_of_the_inputs_before_the_call(emulated_gpu, kind):
    n = 48
    buf = torch.randn(2, n, n)
    a, b = buf[0], torch.randn(n, n)
    out = {"a": a, "b": b, "other-half": buf[1], "transposed-a": a.T}[kind]
    a0, b0 = a.clone(), b.clone()
    assert fastmm.matmul(a, b, out=out) is out
    assert relative_error(out, a0, b0) <= 1e-6 and emulated_gpu.launches


# --- where a call goes -------------------------------------------------------------------------

def test_a_call_that_needs_gradients_goes_to_the_autograd_op(emulated_gpu, monkeypatch):
    routed = []
    real = ops.matmul_autograd
    monkeypatch.setattr(ops, "matmul_autograd",
                        lambda a, b, precision: routed.append(precision) or real(a, b, precision))
    a, b = torch.randn(40, 30, requires_grad=True), torch.randn(30, 50)
    y = fastmm.matmul(a, b, precision="tf32x3")
    assert routed == ["tf32x3"] and y.requires_grad
    with torch.no_grad():
        assert not fastmm.matmul(a, b).requires_grad and len(routed) == 1


def test_an_autocast_half_matmul_goes_to_torch_in_that_dtype(emulated_gpu, monkeypatch):
    handed = []
    real = api.torch_matmul
    monkeypatch.setattr(api, "torch_matmul", lambda a, b, out: handed.append(out) or real(a, b, out))
    a, b = torch.randn(40, 30), torch.randn(30, 50)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fastmm.matmul(a, b)
    assert y.dtype == torch.bfloat16 and handed == [None] and emulated_gpu.launches == []


def test_the_second_call_of_a_layout_takes_the_steady_state_path(emulated_gpu):
    for _ in range(3):
        a, b = torch.randn(40, 70), torch.randn(70, 50)
        assert relative_error(fastmm.matmul(a, b, precision="ieee"), a, b) <= 1e-6
    assert emulated_gpu.slow_calls == 1 and len(emulated_gpu.launches) == 3


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
    monkeypatch.setenv("FASTMM_DISABLE", "0")
    assert "FASTMM_DISABLE" not in fastmm.explain(a, b).fallback


def test_explain_describes_the_plan_the_call_then_runs(emulated_gpu):
    """explain() plans the problem as the call builds it (batch strides, layouts, launches) and
    names the kernel the call then launches."""
    a, b = torch.randn(2, 33, 20), torch.randn(2, 20, 17)
    exp = fastmm.explain(a, b, precision="tf32")
    p = exp.plan.problem
    assert exp.kernel is not None and exp.launch["launches"] == 1
    assert p.layout_of("a") == "row-major" and p.a_batch_strides == (0, 33 * 20) and p.b_batch_strides == (0, 20 * 17)
    assert exp.shapes["batch"] == (2,) and (exp.shapes["M"], exp.shapes["N"], exp.shapes["K"]) == (33, 17, 20)
    fastmm.matmul(a, b, precision="tf32")
    assert emulated_gpu.families == [exp.kernel]
    (hit,) = fastmm.dispatch.PLANS.prepared.values()
    assert hit.plan == exp.plan  # the same problem, the same plan
