"""Property-based tests (hypothesis) of the model path on the emulated GPU: ``fastmm.linear`` (every
``fastmm.nn.Linear`` forward), ``fastmm.addmm`` and their gradients, over random layouts of x,
the weight, the bias and addmm's C, every precision, called twice with fresh values in the same
memory (the second call takes the steady-state entries the first left: fastmm.fast_path).

Why: the steady-state path serves a repeat call from a key of shapes, strides, pointer
alignment, precision and switches alone, and a Linear's backward from one key for both products.
A key that misses something a plan depends on serves a later call with another layout's launch.
So each example is a call, 1-3 variants of it that change one field each (a layout, the
precision, the gradients asked for, a family forced with FASTMM_KERNEL), then the call again, all
in one process's entries.

Layouts, as models make them: x of 1 to 4 dims, contiguous, seq-first (a transposed batch view),
a slice of wider rows, at an odd storage offset (4-byte aligned only), or K-strided; the weight
contiguous, a block of rows of a bigger one (``in_proj_weight.chunk(3)``), the transposed view
of an [in, out] matrix (GPT-2's Conv1D), or a slice of wider rows; the bias absent, contiguous,
strided or at an odd offset. Gradients for a random subset of the inputs.

Checks, each call: the result's shape is F.linear's (torch.addmm's); its error against float64
is within the precision's tolerance, measured against || |x| |W^T| + |bias| ||_F (rounding
errors are bounded element-wise by that); fastmm's kernels computed it (launches were made);
the inputs are unchanged; each gradient is within the tolerance of float64 autograd's, against
the same kind of bound for its product. addmm: beta = 0 ignores a NaN-filled C. The emulated
kernels compute in float64 (tests/emulation.py): what is checked is where fastmm's plans read and
write, not the kernels' rounding (the GPU tests do that).

Example counts: FASTMM_HYPOTHESIS_CPU_EXAMPLES (default 100), as tests/test_properties.py.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastmm
from fastmm import config

CPU_EXAMPLES = int(os.environ.get("FASTMM_HYPOTHESIS_CPU_EXAMPLES", "100"))
#: Tolerances of the error against || |x| |W^T| + |bias| ||_F: ieee and tf32x3 near fp32 rounding
#: over these K (<= 80), tf32 a TF32 rounding of each input
TOL = {"ieee": 1e-5, "tf32": 1e-3, "tf32x3": 1e-5}
SETTINGS = settings(max_examples=CPU_EXAMPLES, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def bounded_error(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> float:
    """||got - ref||_F / ||bound||_F in float64 (0 for an exact result where the bound is 0)."""
    diff = (got.detach().double() - ref.detach().double()).norm().item()
    norm = bound.double().norm().item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / norm


# ---------------------------------------------------------------------------------------------
# layouts: a leaf tensor (the memory, made by torch.randn: the emulation knows it) and the view
# of it the call takes, made by the same function for the float32 and float64 copies

@dataclass(frozen=True)
class Operand:
    """``view(base)`` is the operand; ``base`` (shape ``base_shape``) is the leaf that gets the
    gradient."""

    base_shape: tuple[int, ...]
    view: object
    layout: str

    def make(self, requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        base = torch.randn(self.base_shape)
        if requires_grad:
            base.requires_grad_()
        return base, self.view(base)


def x_operand(lead: tuple[int, ...], K: int, layout: str) -> Operand:
    if layout == "seq_first":  # (L, N, K) stored, read as (N, L, K): rows that merge only by a copy
        return Operand((lead[1], lead[0]) + lead[2:] + (K,), lambda t: t.transpose(0, 1), layout)
    if layout == "wide_rows":  # each row a slice of a wider one (q of a fused qkv activation)
        return Operand(lead + (K + 3,), lambda t: t[..., 1:K + 1], layout)
    if layout == "offset":  # 4-byte aligned only
        return Operand((math.prod(lead) * K + 1,), lambda t: t[1:].view(lead + (K,)), layout)
    if layout == "k_strided":  # K not contiguous (every other element)
        return Operand(lead + (2 * K,), lambda t: t[..., ::2], layout)
    return Operand(lead + (K,), lambda t: t, "contiguous")


def weight_operand(N: int, K: int, layout: str) -> Operand:
    if layout == "chunk":  # the middle third of a fused [3N, K] weight (in_proj_weight.chunk(3))
        return Operand((3 * N, K), lambda t: t[N:2 * N], layout)
    if layout == "in_out":  # stored [K, N] (GPT-2's Conv1D), passed transposed
        return Operand((K, N), lambda t: t.t(), layout)
    if layout == "wide_rows":
        return Operand((N, K + 5), lambda t: t[:, 2:K + 2], layout)
    return Operand((N, K), lambda t: t, "contiguous")


def bias_operand(N: int, layout: str) -> Operand | None:
    if layout == "none":
        return None
    if layout == "strided":
        return Operand((2 * N,), lambda t: t[::2], layout)
    if layout == "offset":
        return Operand((N + 1,), lambda t: t[1:], layout)
    return Operand((N,), lambda t: t, "contiguous")


#: A dim of 1-80, a multiple of 4 half the time: where rows of floats are 16-byte aligned the
#: planner reads them in place (tensor maps, float4 loads), so a layout that breaks the alignment
#: (an offset, a slice) plans differently from the same dims contiguous
DIM = st.one_of(st.integers(1, 20).map(lambda v: 4 * v), st.integers(1, 80))


def draw_variants(draw, fields: dict) -> list[dict]:
    """A call (a value of each field), 1-3 variants of it that each change one field, then the
    first call again. The remembered entries are keyed on what a plan depends on: a key that
    misses what tells two such calls apart serves the second with the first's entry, and only
    calls alike in every other field meet under one key."""
    base = {name: draw(strategy) for name, strategy in fields.items()}
    variants = [base]
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(sorted(fields)))
        value = draw(fields[name].filter(lambda v, old=base[name]: v != old))
        variants.append({**base, name: value})
    return variants + [base]


@st.composite
def linear_cases(draw):
    """Shapes, then variants of a call of them (layouts, bias, precision, gradients, a forced
    family): :func:`draw_variants`."""
    rank = draw(st.integers(1, 4))
    # (rows: a few, where the decode families plan, or 30-100 in one dim, where the tiled ones do)
    lead = tuple(draw(st.one_of(st.integers(1, 6), st.integers(30, 100)) if i == 0 else st.integers(1, 4))
                 for i in range(rank - 1))
    K, N = draw(DIM), draw(DIM)
    x_layouts = ["contiguous", "offset", "k_strided"] + (["wide_rows"] if rank > 1 else []) + \
        (["seq_first"] if rank > 2 else [])
    fields = dict(
        x_layout=st.sampled_from(x_layouts), w_layout=st.sampled_from(["contiguous", "chunk", "in_out", "wide_rows"]),
        bias_layout=st.sampled_from(["none", "contiguous", "strided", "offset"]),
        precision=st.sampled_from(["ieee", "tf32", "tf32x3"]),
        grads=st.sampled_from([(), ("x",), ("w",), ("x", "w"), ("x", "w", "bias"), ("w", "bias")]),
        family=st.sampled_from([None, None, None, *FORCED]))
    variants = draw_variants(draw, fields)
    return dict(lead=lead, K=K, N=N, variants=variants)


#: Families a variant may force (FASTMM_KERNEL: part of every remembered call's key): the tensor-core
#: and decode families the planner leaves for larger products, at the small sizes these tests run.
#: Where the forced family cannot run a product, the planner chooses (fastmm.dispatch.plan_for).
FORCED = ("simt_cp_async", "tf32_mma", "wgmma_tf32", "skinny", "skinny_kmajor", "kmajor_mma")


def force(monkeypatch, family: str | None) -> None:
    """FASTMM_KERNEL set to ``family`` (unset for None) for the variant; monkeypatch restores it."""
    if family is None:
        monkeypatch.delenv(config.FORCE_KERNEL_ENV, raising=False)
    else:
        monkeypatch.setenv(config.FORCE_KERNEL_ENV, family)


def _fresh_values(tensors) -> None:
    """New random values in the same memory (the next call's operands: same pointers and layouts)."""
    with torch.no_grad():
        for t in tensors:
            if t is not None:
                t.copy_(torch.randn(t.shape))


@SETTINGS
@given(case=linear_cases())
def test_random_linear_layers_and_their_gradients_match_float64_on_every_call(emulated_gpu, monkeypatch, case):
    """``F.linear(x, W, bias)`` as fastmm.linear computes it, forward and backward, for every
    variant of the example (:func:`linear_cases`)."""
    for variant in case["variants"]:
        force(monkeypatch, variant["family"])
        check_linear(emulated_gpu, case["lead"], case["K"], case["N"], variant)


def check_linear(emulated_gpu, lead: tuple[int, ...], K: int, N: int, case: dict) -> None:
    """One variant: its operands made, then two calls (the second with fresh values in the same
    memory), each checked with its gradients."""
    precision = case["precision"]
    ox, ow = x_operand(lead, K, case["x_layout"]), weight_operand(N, K, case["w_layout"])
    ob = bias_operand(N, case["bias_layout"])
    grads = case["grads"] if not (ob is None and "bias" in case["grads"]) else ("x", "w")
    xb, x = ox.make(requires_grad="x" in grads)
    wb, w = ow.make(requires_grad="w" in grads)
    bb, b = ob.make(requires_grad="bias" in grads) if ob is not None else (None, None)
    leaves = {name: t for name, t in (("x", xb), ("w", wb), ("bias", bb)) if t is not None}
    tol = TOL[precision]
    for call in range(2):
        if call:
            _fresh_values(leaves.values())
            for t in leaves.values():
                t.grad = None
        before = [t.detach().clone() for t in leaves.values()]
        emulated_gpu.clear()
        slow = emulated_gpu.slow_calls
        y = fastmm.linear(x, w, b, precision=precision)
        # float64 reference, on the same views of float64 copies of the leaves
        refs = {name: t.detach().double().requires_grad_(t.requires_grad) for name, t in leaves.items()}
        rx, rw = ox.view(refs["x"]), ow.view(refs["w"])
        rb = ob.view(refs["bias"]) if ob is not None else None
        ref = F.linear(rx, rw, rb)
        assert y.shape == ref.shape and y.dtype == torch.float32, (y.shape, ref.shape)
        bound = rx.detach().abs() @ rw.detach().abs().t() + (0 if rb is None else rb.detach().abs())
        err = bounded_error(y, ref, bound)
        assert err <= tol, f"call {call}: forward error {err:.3g} > {tol} ({case})"
        assert emulated_gpu.launches, f"call {call}: no fastmm launch ({case})"
        if grads:
            g = torch.randn(y.shape)
            emulated_gpu.clear()
            y.backward(g)
            # (the products of x's and w's gradients are fastmm's; a bias's alone is a sum)
            assert emulated_gpu.launches or grads == ("bias",), f"call {call}: a backward without fastmm ({case})"
            ref.backward(g.double())
            gd = g.double()
            g_rows = gd.reshape(-1, N)
            x_rows = rx.detach().reshape(-1, K)
            for name in grads:
                leaf, rleaf = leaves[name], refs[name]
                assert leaf.grad is not None and leaf.grad.shape == leaf.shape, (name, case)
                # the product each gradient is (in the view's coordinates), bounded as the forward
                if name == "x":
                    scale = gd.abs() @ rw.detach().abs()
                elif name == "w":
                    scale = g_rows.abs().t() @ x_rows.abs()
                else:
                    scale = g_rows.abs().sum(0)
                err = bounded_error(leaf.grad, rleaf.grad, scale)
                assert err <= tol, f"call {call}: grad of {name} error {err:.3g} > {tol} ({case})"
        # the repeat (same layouts, same memory) takes the remembered entries, forward and backward
        assert not call or emulated_gpu.slow_calls == slow, f"the repeat call planned again ({case})"
        after = [t.detach() for t in leaves.values()]
        assert all(torch.equal(a, b_) for a, b_ in zip(before, after)), f"call {call}: an input was modified ({case})"


@st.composite
def addmm_cases(draw):
    """Shapes, then variants of a call of them (layouts of A and B, C's broadcast, beta, alpha,
    precision, gradients, a forced family): :func:`draw_variants`."""
    M, K, N = draw(DIM), draw(DIM), draw(DIM)
    fields = dict(
        a_t=st.booleans(), b_t=st.booleans(),
        c_shape=st.sampled_from(["scalar", "one", "row", "column", "full", "full_t"]),
        beta=st.sampled_from([0.0, 1.0, 0.5]), alpha=st.sampled_from([1.0, -2.0, 0.25]),
        precision=st.sampled_from(["ieee", "tf32", "tf32x3"]), grads=st.booleans(),
        family=st.sampled_from([None, None, None, *FORCED]))
    variants = draw_variants(draw, fields)
    return dict(M=M, K=K, N=N, variants=variants)


@SETTINGS
@given(case=addmm_cases())
def test_random_addmm_calls_match_float64_on_every_call(emulated_gpu, monkeypatch, case):
    """``beta * C + alpha * (A @ B)`` for every broadcast of C, A and B row-major or transposed
    views; beta = 0 ignores a NaN-filled C (as torch.addmm); gradients of A, B and C."""
    for variant in case["variants"]:
        force(monkeypatch, variant["family"])
        check_addmm(emulated_gpu, case["M"], case["K"], case["N"], variant)


def check_addmm(emulated_gpu, M: int, K: int, N: int, case: dict) -> None:
    precision = case["precision"]
    beta, alpha = case["beta"], case["alpha"]
    shapes = {"scalar": (), "one": (1,), "row": (N,), "column": (M, 1), "full": (M, N), "full_t": (N, M)}
    c_shape = shapes[case["c_shape"]]
    oa = Operand((K, M), lambda t: t.t(), "t") if case["a_t"] else Operand((M, K), lambda t: t, "contiguous")
    ob = Operand((N, K), lambda t: t.t(), "t") if case["b_t"] else Operand((K, N), lambda t: t, "contiguous")
    oc = Operand(c_shape, (lambda t: t.t()) if case["c_shape"] == "full_t" else (lambda t: t), case["c_shape"])
    grad = case["grads"] and beta != 0  # (a NaN C has no gradient to compare)
    ab, a = oa.make(requires_grad=grad)
    bb, b = ob.make(requires_grad=grad)
    cb = torch.full(c_shape, float("nan")) if beta == 0 else torch.randn(c_shape)
    if grad:
        cb.requires_grad_()
    c = oc.view(cb)
    tol = TOL[precision]
    for call in range(2):
        if call:
            _fresh_values([ab, bb] + ([cb] if beta != 0 else []))
            for t in (ab, bb, cb):
                t.grad = None
        before = [t.detach().clone() for t in (ab, bb, cb)]
        emulated_gpu.clear()
        slow = emulated_gpu.slow_calls
        got = fastmm.addmm(c, a, b, beta=beta, alpha=alpha, precision=precision)
        ra, rb = (t.detach().double().requires_grad_(grad) for t in (ab, bb))
        rcb = cb.detach().double().requires_grad_(grad)
        rA, rB, rC = oa.view(ra), ob.view(rb), oc.view(rcb)
        prod = rA @ rB
        ref = alpha * prod + (beta * rC if beta != 0 else 0)
        assert got.shape == (M, N) and not torch.isnan(got).any(), (got.shape, case)
        bound = abs(alpha) * (rA.detach().abs() @ rB.detach().abs()) + (abs(beta) * rC.detach().abs() if beta else 0)
        err = bounded_error(got, ref.expand(M, N), bound.expand(M, N) if torch.is_tensor(bound) else bound)
        assert err <= tol, f"call {call}: error {err:.3g} > {tol} ({case})"
        assert emulated_gpu.launches, f"call {call}: no fastmm launch ({case})"
        if grad:
            g = torch.randn(M, N)
            emulated_gpu.clear()
            got.backward(g)
            assert emulated_gpu.launches, f"call {call}: a backward without fastmm ({case})"
            ref.expand(M, N).backward(g.double())
            gd = g.double()
            checks = ((ab, ra, abs(alpha) * (gd.abs() @ rB.detach().abs().t())),
                      (bb, rb, abs(alpha) * (rA.detach().abs().t() @ gd.abs())),
                      (cb, rcb, (abs(beta) * gd.abs()).sum_to_size(rC.shape)))
            for leaf, rleaf, scale in checks:
                assert leaf.grad is not None and leaf.grad.shape == leaf.shape, case
                err = bounded_error(leaf.grad, rleaf.grad, scale)
                assert err <= tol, f"call {call}: gradient error {err:.3g} > {tol} ({case})"
        assert not call or emulated_gpu.slow_calls == slow, f"the repeat call planned again ({case})"
        after = [t.detach() for t in (ab, bb, cb)]
        assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1]), f"call {call}: A or B modified ({case})"
        assert torch.isnan(after[2]).all() if beta == 0 else torch.equal(after[2], before[2]), f"call {call}: C modified"
