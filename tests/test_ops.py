"""fastmm as torch.library custom ops (fastmm.ops): opcheck of both ops on CPU inputs (where the ops
hand the product to torch), the ops and the backward's products computed by fastmm's kernels on
the emulated GPU (conftest.emulated_gpu), gradients through fastmm.matmul, and torch.compile
seeing one opaque op."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.library import opcheck

import fastmm  # noqa: F401  (registers torch.ops.fastmm.*)
import emulation
from conftest import relative_error


def r(*shape, grad=False, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, requires_grad=grad)


def _sliced_a():
    return torch.randn(7, 9)[1:4, 2:6]  # (3, 4), row stride 9, offset 11


CASES = {
    "contiguous": lambda: (r(3, 4), r(4, 5)),
    "transposed": lambda: (r(4, 3).T, r(5, 4).T),
    "sliced": lambda: (_sliced_a(), torch.randn(6, 7)[1:5, 1:6]),
    "strided_columns": lambda: (torch.randn(3, 8)[:, ::2], torch.randn(4, 10)[:, ::2]),
    "empty_m": lambda: (r(0, 4), r(4, 5)),
    "empty_k": lambda: (r(3, 0), r(0, 5)),
    "empty_batch": lambda: (r(0, 3, 4), r(4, 5)),
    "batched": lambda: (r(2, 3, 4), r(2, 4, 5)),
    "broadcast": lambda: (r(2, 1, 3, 4), r(5, 4, 6)),
    "expanded_batch": lambda: (r(1, 3, 4).expand(4, 3, 4), r(4, 4, 5)),
    "1d_1d": lambda: (r(4), r(4)),
    "1d_2d": lambda: (r(4), r(4, 5)),
    "2d_1d": lambda: (r(3, 4), r(4)),
    "1d_3d": lambda: (r(4), r(2, 4, 5)),
    "3d_1d": lambda: (r(2, 3, 4), r(4)),
}
GRAD_CASES = {
    "grad_a": lambda: (r(3, 4, grad=True), r(4, 5)),
    "grad_b": lambda: (r(3, 4), r(4, 5, grad=True)),
    "grad_both_broadcast": lambda: (r(2, 1, 3, 4, grad=True), r(5, 4, 6, grad=True)),
    "grad_1d_1d": lambda: (r(4, grad=True), r(4, grad=True)),
    "grad_1d_3d": lambda: (r(4, grad=True), r(2, 4, 5, grad=True)),
    "grad_transposed": lambda: (r(4, 3, grad=True).T, r(5, 4).T),
}


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("case", sorted(CASES) + sorted(GRAD_CASES))
def test_opcheck_matmul(case, precision):
    a, b = {**CASES, **GRAD_CASES}[case]()
    opcheck(torch.ops.fastmm.matmul, (a, b, precision))


# torch.matmul itself warns for 1-D @ 2-D with a right-shaped out (it resizes out to (1, N) inside)
@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized:UserWarning")
@pytest.mark.parametrize("case", sorted(CASES))
def test_opcheck_matmul_out(case):
    a, b = CASES[case]()
    out = torch.empty(torch.matmul(a, b).shape)
    opcheck(torch.ops.fastmm.matmul_out, (a, b, "ieee", out))


def test_ops_compute_the_product_with_fastmm_kernels(emulated_gpu):
    a, b = torch.randn(2, 30, 40), torch.randn(40, 50)
    assert relative_error(torch.ops.fastmm.matmul(a, b, "ieee"), a, b) <= 1e-6
    out = torch.full((2, 30, 50), float("nan"))
    assert torch.ops.fastmm.matmul_out(a, b, "ieee", out) is None
    assert relative_error(out, a, b) <= 1e-6
    assert len(emulated_gpu.launches) == 2  # one kernel launch per op call


def test_repeated_op_calls_take_the_steady_state_path(emulated_gpu):
    """What a compiled graph does: call the registered ops again and again on the same layouts.
    After the first call of each layout plans it, a repeat is a lookup and a launch: no call
    goes through the full path again, and each still launches fastmm's kernel."""
    x, w, bias = torch.randn(3, 30, 40), torch.randn(50, 40), torch.randn(50)
    a, b, c = torch.randn(30, 40), torch.randn(40, 50), torch.randn(30, 50)
    calls = (lambda: torch.ops.fastmm.matmul(a, b, "ieee"), lambda: torch.ops.fastmm.linear(x, w, bias, "ieee"),
             lambda: torch.ops.fastmm.addmm(c, a, b, 0.5, 2.0, "ieee"))
    firsts, finishing = [], []  # each call's result, and whether its last launch applies an epilogue
    for call in calls:
        firsts.append(call())
        finishing.append(("EPILOGUE", 1) in emulated_gpu.launches[-1].cfg.macros)
    slow, launches = emulated_gpu.slow_calls, len(emulated_gpu.launches)
    assert slow == 3 and launches >= 3  # one plan each: linear's bias and addmm's c are fused into a store
    assert finishing == [False, True, True]
    for first, call in zip(firsts, calls):
        assert torch.equal(call(), first)
    assert emulated_gpu.slow_calls == slow and len(emulated_gpu.launches) == 2 * launches  # the same launches again
    ref = x.double() @ w.double().T + bias.double()
    assert ((firsts[1].double() - ref).norm() / ref.norm()).item() <= 1e-6
    ref = 0.5 * c.double() + 2.0 * (a.double() @ b.double())
    assert ((firsts[2].double() - ref).norm() / ref.norm()).item() <= 1e-6


def test_the_backward_products_are_fastmm_launches(emulated_gpu):
    """grad_a = grad @ b^T and grad_b = a^T @ grad (summed over the broadcast batch dim) run as
    fastmm products on transposed views: one launch each, no copies of a, b or grad."""
    a = torch.randn(2, 30, 40).requires_grad_()
    b = torch.randn(40, 50).requires_grad_()
    y = fastmm.matmul(a, b, precision="ieee")
    assert len(emulated_gpu.launches) == 1
    g = torch.randn(2, 30, 50)
    y.backward(g)
    assert len(emulated_gpu.launches) == 3
    grad_a, grad_b = g.double() @ b.detach().double().T, (a.detach().double().transpose(-1, -2) @ g.double()).sum(0)
    assert relative_error(a.grad, grad_a) <= 1e-6 and relative_error(b.grad, grad_b) <= 1e-6


def test_functional_op_result_is_contiguous_and_not_an_input():
    a, b = r(4, 3).T, r(5, 4).T
    c = torch.ops.fastmm.matmul(a, b, "ieee")
    assert c.is_contiguous() and c.untyped_storage().data_ptr() not in (
        a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr())


@pytest.mark.parametrize("op", ["matmul", "matmul_out"])
def test_ops_reject_an_unknown_precision(op):
    a, b = r(3, 4), r(4, 5)
    args = (a, b, "bogus") if op == "matmul" else (a, b, "bogus", torch.empty(3, 5))
    with pytest.raises(ValueError, match="'ieee', 'tf32', 'tf32x3'"):
        getattr(torch.ops.fastmm, op)(*args)


# --- autograd ----------------------------------------------------------------------------------

GRAD_SHAPES = [
    ((3, 4), (4, 5)),
    ((4,), (4,)),
    ((4,), (4, 5)),
    ((3, 4), (4,)),
    ((2, 1, 3, 4), (5, 4, 2)),
    ((3, 4), (2, 4, 5)),
    ((4,), (2, 4, 3)),
    ((2, 3, 4), (4,)),
    ((1, 3, 4), (2, 4, 5)),
]


@pytest.mark.parametrize("sa,sb", GRAD_SHAPES, ids=[f"{a}@{b}" for a, b in GRAD_SHAPES])
def test_gradcheck_through_fastmm_matmul(sa, sb):
    a, b = r(*sa, grad=True, dtype=torch.float64), r(*sb, grad=True, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x, y: fastmm.matmul(x, y, precision="ieee"), (a, b))


@pytest.mark.parametrize("sa,sb", GRAD_SHAPES[:5], ids=[f"{a}@{b}" for a, b in GRAD_SHAPES[:5]])
def test_gradgradcheck_through_fastmm_matmul(sa, sb):
    a, b = r(*sa, grad=True, dtype=torch.float64), r(*sb, grad=True, dtype=torch.float64)
    assert torch.autograd.gradgradcheck(lambda x, y: fastmm.matmul(x, y, precision="ieee"), (a, b))


def test_gradient_of_one_side_only():
    a, b = r(3, 4, grad=True, dtype=torch.float64), r(4, 5, dtype=torch.float64)
    fastmm.matmul(a, b).sum().backward()
    assert torch.allclose(a.grad, torch.ones(3, 5, dtype=torch.float64) @ b.T)
    assert b.grad is None


def test_grad_takes_the_eager_autograd_function_and_the_op_under_a_dispatch_mode():
    """Eager calls with grad use fastmm's autograd.Function (no custom-op dispatch per call); a
    TorchDispatchMode (here FlopCounterMode) gets the registered op, whose autograd it sees."""
    from torch.utils.flop_counter import FlopCounterMode

    a, b = r(3, 4, grad=True), r(4, 5)
    y = fastmm.matmul(a, b)
    assert y.requires_grad and type(y.grad_fn).__name__ == "_MatmulBackward"
    with FlopCounterMode(display=False) as counter:
        z = fastmm.matmul(a, b)
    assert "fastmm" in str(z.grad_fn.name()).lower()
    assert sum(counter.get_flop_counts()["Global"].values()) == 2 * 3 * 4 * 5


def test_no_grad_mode_returns_a_plain_tensor_computed_without_the_autograd_op(emulated_gpu, monkeypatch):
    def refuse(*args):
        raise AssertionError("fastmm.matmul took the autograd op under no_grad")

    monkeypatch.setattr(fastmm.ops, "matmul_autograd", refuse)
    a, b = torch.randn(30, 40).requires_grad_(), torch.randn(40, 50)
    with torch.no_grad():
        y = fastmm.matmul(a, b)
    assert not y.requires_grad and y.grad_fn is None
    assert relative_error(y, a, b) <= 1e-6 and emulated_gpu.launches


# --- torch.compile -----------------------------------------------------------------------------

@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_equals_eager(fresh_dynamo, backend):
    def f(x, y, z):
        return fastmm.matmul(torch.relu(x), y, precision="ieee") @ z + 1

    a, b, c = r(2, 8, 16), r(16, 12), r(12,)
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    assert torch.allclose(compiled(a, b, c), f(a, b, c), rtol=1e-6, atol=1e-6)
    a2, b2, c2 = r(2, 8, 16), r(16, 12), r(12,)  # new values, same shapes: no retrace needed
    assert torch.allclose(compiled(a2, b2, c2), f(a2, b2, c2), rtol=1e-6, atol=1e-6)


def test_compile_sees_fastmm_as_one_custom_op(fresh_dynamo):
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x, y):
        return fastmm.matmul(x, y, precision="tf32") * 2

    a, b = r(3, 4), r(4, 5)
    compiled = torch.compile(f, fullgraph=True, backend=record)
    assert torch.equal(compiled(a, b), f(a, b))
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.fastmm.matmul.default in targets or torch.ops.fastmm.matmul in targets


def test_compile_with_out_equals_eager(fresh_dynamo):
    def f(x, y, o):
        fastmm.matmul(x, y, out=o, precision="ieee")
        return o * 3

    a, b = r(3, 4), r(4, 5)
    o1, o2 = torch.empty(3, 5), torch.empty(3, 5)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(a, b, o1), f(a, b, o2))
    assert torch.equal(o1, o2) and torch.equal(o1, a @ b)


def test_compile_backward_equals_eager(fresh_dynamo):
    def loss(x, y):
        return fastmm.matmul(x, y, precision="ieee").square().sum()

    a, b = r(2, 3, 4, grad=True), r(4, 5, grad=True)
    loss(a, b).backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    torch.compile(loss, fullgraph=True, backend="aot_eager")(a, b).backward()
    assert torch.allclose(a.grad, ga, rtol=1e-5, atol=1e-5) and torch.allclose(b.grad, gb, rtol=1e-5, atol=1e-5)


# --- calls that need no gradient: straight to the op's body ------------------------------------

def _python_calls(fn):
    """fn()'s result and the (file, function) of every Python function it called (the
    dispatcher's Python kernels included: a profile hook sees them)."""
    seen = []

    def hook(frame, event, arg):
        if event == "call":
            seen.append((frame.f_code.co_filename, frame.f_code.co_name))

    sys.setprofile(hook)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return result, seen


def _through_autograd_layer(seen) -> bool:
    """Whether custom_op's autograd layer (torch/_library/autograd.py) ran."""
    return any(f.endswith(os.path.join("_library", "autograd.py")) for f, _ in seen)


def _bodies(seen) -> list[str]:
    return [name for f, name in seen if name in ("matmul_body", "linear_body", "addmm_body", "linear_grads_body")]


OP_CALLS = {
    "matmul": lambda x, w, c: torch.ops.fastmm.matmul(x, w.t(), "ieee"),
    "linear": lambda x, w, c: torch.ops.fastmm.linear(x, w, None, "ieee"),
    "addmm": lambda x, w, c: torch.ops.fastmm.addmm(c, x, w.t(), 0.5, 2.0, "ieee"),
}


@pytest.mark.parametrize("op", sorted(OP_CALLS))
def test_an_op_call_that_needs_no_gradient_goes_straight_to_its_body(op):
    """What a compiled graph's steps do (grad mode off): the registered op runs its body with no
    Python autograd layer in between (ops._direct_kernel); with grad mode on and an input that
    requires grad it takes the layer (and its gradient is right); with grad mode on and nothing
    requiring grad, straight again. Each result is the product."""
    if not fastmm.ops.DIRECT_KERNELS:
        pytest.skip("this torch lacks the internals the direct kernels read")
    call = OP_CALLS[op]
    x, w, c = r(4, 8), r(6, 8, grad=True), r(4, 6)
    want = {"matmul": x @ w.t(), "linear": x @ w.t(), "addmm": 0.5 * c + 2.0 * (x @ w.t())}[op].detach()
    with torch.no_grad():
        out, seen = _python_calls(lambda: call(x, w, c))
    assert not _through_autograd_layer(seen) and len(_bodies(seen)) == 1, seen
    assert torch.allclose(out, want, rtol=1e-6, atol=1e-6) and not out.requires_grad
    out, seen = _python_calls(lambda: call(x, w.detach(), c))
    assert not _through_autograd_layer(seen) and torch.allclose(out, want, rtol=1e-6, atol=1e-6)
    out, seen = _python_calls(lambda: call(x, w, c))
    assert _through_autograd_layer(seen) and out.requires_grad
    g = r(4, 6)
    out.backward(g)
    scale = 2.0 if op == "addmm" else 1.0
    assert torch.allclose(w.grad, scale * (g.t() @ x), rtol=1e-5, atol=1e-5)


def test_an_op_call_under_a_mode_or_fake_tensors_keeps_the_autograd_layer():
    """Grad mode off, but something below autograd must see the op: FlopCounterMode (the Python
    key) counts it, fake tensors get a fake result; both through the general path."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    x, w = r(4, 8), r(6, 8)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        _, seen = _python_calls(lambda: torch.ops.fastmm.linear(x, w, None, "ieee"))
    assert _through_autograd_layer(seen) and counter.get_total_flops() == 2 * 4 * 6 * 8
    with FakeTensorMode(), torch.no_grad():
        fx, fw = torch.empty(4, 8), torch.empty(6, 8)
        out, seen = _python_calls(lambda: torch.ops.fastmm.linear(fx, fw, None, "ieee"))
    assert isinstance(out, FakeTensor) and out.shape == (4, 6) and _through_autograd_layer(seen)


def test_an_op_called_while_dynamo_evaluates_frames_keeps_the_autograd_layer(fresh_dynamo):
    """A call from a function Dynamo does not trace but whose callees it would
    (torch.compiler.disable(recursive=False)), under a compiled caller: Dynamo's frame
    evaluation is on, so the body is reached through custom_op's layer (which shields it), and
    Dynamo compiles the caller's two frames only, not the op body's internals."""
    from torch._dynamo.testing import CompileCounter

    @torch.compiler.disable(recursive=False)
    def inner(x, w):
        return torch.ops.fastmm.linear(x, w, None, "ieee")

    def f(x, w):
        return inner(x * 2, w) + 1

    counter = CompileCounter()
    compiled = torch.compile(f, backend=counter)
    x, w = r(4, 8), r(6, 8)
    with torch.no_grad():
        compiled(x, w)
        out = compiled(x, w)
    assert counter.frame_count == 2, counter.frame_count
    assert torch.allclose(out, (x * 2) @ w.t() + 1, rtol=1e-6, atol=1e-6)


def test_an_op_call_without_gradient_carries_no_forward_mode_tangent():
    """As through custom_op's own layer (which runs the op below autograd): a dual input's
    tangent does not propagate through a direct call either (CPU tensors, where the body's
    fallback is torch's own arithmetic, which would carry it)."""
    import torch.autograd.forward_ad as fwAD

    x, w = r(4, 8), r(6, 8)
    with fwAD.dual_level():
        out = torch.ops.fastmm.linear(fwAD.make_dual(x, torch.ones_like(x)), w, None, "ieee")
        assert fwAD.unpack_dual(out).tangent is None


def test_a_compiled_training_step_calls_the_op_bodies_straight(fresh_dynamo):
    """Under torch.compile (aot_eager) the forward and backward graphs call the registered ops
    with grad mode off: each step reaches the bodies with no autograd layer, and the gradients
    equal eager's."""
    if not fastmm.ops.DIRECT_KERNELS:
        pytest.skip("this torch lacks the internals the direct kernels read")

    def step(x, w, b):
        return torch.ops.fastmm.linear(x, w, b, "ieee").square().sum()

    x, w, b = r(2, 5, 8), r(6, 8, grad=True), r(6, grad=True)
    step(x, w, b).backward()
    gw, gb = w.grad.clone(), b.grad.clone()
    w.grad = b.grad = None
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(x, w, b).backward()  # (the first call traces)
    w.grad = b.grad = None
    loss, seen = _python_calls(lambda: compiled(x, w, b))
    _, seen_back = _python_calls(lambda: loss.backward())
    assert _bodies(seen) == ["linear_body"] and not _through_autograd_layer(seen), _bodies(seen)
    assert _bodies(seen_back) == ["matmul_body"] and not _through_autograd_layer(seen_back)
    assert torch.allclose(w.grad, gw, rtol=1e-5, atol=1e-5) and torch.allclose(b.grad, gb, rtol=1e-5, atol=1e-5)


def test_a_compiled_linear_step_makes_both_gradient_products_in_one_op_call(fresh_dynamo, emulated_gpu, monkeypatch):
    """With both x and the weight needing gradients, the compiled backward calls
    fastmm::linear_grads once (straight to its body: one dispatcher call where there were two),
    whose two products come from one remembered entry on a repeat step; the gradients equal
    eager's, which equal float64's."""
    if not fastmm.ops.DIRECT_KERNELS:
        pytest.skip("this torch lacks the internals the direct kernels read")
    monkeypatch.setattr(emulation, "CHECK_MEMORY", False)  # (the graph's g is made by torch's ops)

    def step(x, w, b):
        return torch.ops.fastmm.linear(x, w, b, "ieee").square().sum()

    x, w, b = r(2, 5, 8, grad=True), r(6, 8, grad=True), r(6, grad=True)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for _ in range(2):  # (the first call traces; the second plans the products and remembers them)
        x.grad = w.grad = b.grad = None
        compiled(x, w, b).backward()
    x.grad = w.grad = b.grad = None
    loss = compiled(x, w, b)
    slow, launches = emulated_gpu.slow_calls, len(emulated_gpu.launches)
    _, seen_back = _python_calls(lambda: loss.backward())
    assert _bodies(seen_back) == ["linear_grads_body"] and not _through_autograd_layer(seen_back)
    assert emulated_gpu.slow_calls == slow and len(emulated_gpu.launches) == launches + 2  # grad_x, grad_w
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ((x64 @ w64.t() + b64) ** 2).sum().backward()
    for got, ref in ((x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert ((got.double() - ref).norm() / ref.norm()).item() <= 1e-6


LINEAR_GRADS_CASES = {
    "2d": lambda: (r(4, 6), r(4, 8), r(6, 8)),
    "3d": lambda: (r(2, 3, 6), r(2, 3, 8), r(6, 8)),
    "3d_seq_first": lambda: (r(3, 2, 6).transpose(0, 1), r(3, 2, 8).transpose(0, 1), r(6, 8)),  # rows copied
    "1d": lambda: (r(6), r(8), r(6, 8)),
}


@pytest.mark.parametrize("case", sorted(LINEAR_GRADS_CASES))
def test_opcheck_linear_grads(case):
    opcheck(torch.ops.fastmm.linear_grads, LINEAR_GRADS_CASES[case]() + ("ieee",))


@pytest.mark.parametrize("case", sorted(LINEAR_GRADS_CASES))
def test_linear_grads_are_both_gradients_of_x_times_w_transposed(emulated_gpu, case, monkeypatch):
    monkeypatch.setattr(emulation, "CHECK_MEMORY", False)  # (seq-first rows: a copy by torch's reshape)
    g, x, w = LINEAR_GRADS_CASES[case]()
    for _ in range(2):  # (the second from the remembered entry)
        gx, gw = torch.ops.fastmm.linear_grads(g, x, w, "ieee")
        assert gx.shape == x.shape and gw.shape == w.shape and gx.is_contiguous() and gw.is_contiguous()
        assert relative_error(gx, g, w) <= 1e-6
        assert relative_error(gw, g.reshape(-1, g.shape[-1]).t(), x.reshape(-1, x.shape[-1])) <= 1e-6


@pytest.mark.parametrize("args", [
    lambda: (r(2, 3, 6), r(3, 2, 8), r(6, 8)),  # g not of x's leading shape
    lambda: (r(4, 5), r(4, 8), r(6, 8)),  # g not weight's rows wide
    lambda: (r(4, 6), r(4, 7), r(6, 8)),  # x not weight's columns wide
    lambda: (r(4, 6), r(4, 8), r(6, 8, dtype=torch.float64)),  # two dtypes
])
def test_linear_grads_refuses_what_its_fake_refuses_in_the_same_words(args):
    from torch._subclasses.fake_tensor import FakeTensorMode

    g, x, w = args()
    with pytest.raises(RuntimeError) as real:
        torch.ops.fastmm.linear_grads(g, x, w, "ieee")
    with FakeTensorMode() as mode, pytest.raises(RuntimeError) as fake:
        torch.ops.fastmm.linear_grads(*(mode.from_tensor(t) for t in (g, x, w)), "ieee")
    assert str(real.value) in str(fake.value)


def test_a_double_backward_through_the_registered_linear_takes_differentiable_products():
    """Grad mode on in the backward (create_graph): the products one by one, whose own
    autograd gives the second derivatives (linear_grads has none)."""
    x, w, b = r(2, 3, 4, grad=True, dtype=torch.float64), r(5, 4, grad=True, dtype=torch.float64), \
        r(5, grad=True, dtype=torch.float64)
    assert torch.autograd.gradgradcheck(lambda x, w, b: torch.ops.fastmm.linear(x, w, b, "ieee"), (x, w, b))


def test_flop_counter_counts_the_registered_linears_three_products():
    from torch.utils.flop_counter import FlopCounterMode

    x, w = r(4, 8, grad=True), r(6, 8, grad=True)
    with FlopCounterMode(display=False) as counter:
        torch.ops.fastmm.linear(x, w, None, "ieee").sum().backward()
    assert counter.get_total_flops() == 3 * 2 * 4 * 6 * 8


# --- the eager route's autograd apply: the C-level one outside functorch transforms --------------

EAGER_FUNCTIONS = ("_Matmul", "_Linear", "_Addmm")


def test_the_eager_functions_define_no_setup_context():
    """The eager route calls their C-level apply directly, skipping what torch's Python apply does
    for a Function with setup_context (binding default arguments; under transforms, more): one
    added to these needs that route revisited."""
    from fastmm import ops

    for name in EAGER_FUNCTIONS:
        assert getattr(ops, name).setup_context is torch.autograd.Function.setup_context, name


def _eager_products(precision="ieee"):
    """Linear, matmul and addmm with gradients, and their float64 references (same inputs)."""
    x, w, bias = r(4, 3, 8, grad=True), r(5, 8, grad=True), r(5, grad=True)
    c, a, b = r(3, 5, grad=True), r(3, 8, grad=True), r(8, 5, grad=True)
    ours = [fastmm.linear(x, w, bias, precision=precision), fastmm.matmul(x, w.t(), precision=precision),
            fastmm.addmm(c, a, b, beta=0.5, alpha=2, precision=precision)]
    leaves = (x, w, bias, c, a, b)
    refs = [t.detach().double().requires_grad_() for t in leaves]
    rx, rw, rbias, rc, ra, rb = refs
    theirs = [torch.nn.functional.linear(rx, rw, rbias), rx @ rw.t(), torch.addmm(rc, ra, rb, beta=0.5, alpha=2)]
    return ours, theirs, leaves, refs


def test_outside_functorch_the_eager_route_never_calls_torchs_python_apply(monkeypatch):
    """torch's Python apply made to fail: the eager products still run, with their own backward
    nodes and right gradients (through the C-level apply)."""
    from fastmm import ops

    def refuse(*args):
        raise AssertionError("torch.autograd.Function.apply was called")

    for name in EAGER_FUNCTIONS:
        monkeypatch.setattr(getattr(ops, name), "apply", refuse)
    ours, theirs, leaves, refs = _eager_products()
    assert [type(y.grad_fn).__name__ for y in ours] == ["_LinearBackward", "_MatmulBackward", "_AddmmBackward"]
    for y, ref in zip(ours, theirs):
        g = torch.randn(y.shape)
        y.backward(g)
        ref.backward(g.double())
    for got, ref in zip(leaves, refs):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-5, atol=1e-5)


def test_under_a_functorch_transform_the_eager_route_hands_the_call_to_torch(monkeypatch):
    """Under torch.func.grad the eager route does not apply fastmm's Function (it has no
    setup_context: torch's apply refused it, which is how this call failed before): torch's own
    F.linear serves it, and the gradient is right (tests/test_transforms.py has the rest)."""
    from fastmm import ops

    calls = []
    real = ops._Linear.apply
    monkeypatch.setattr(ops._Linear, "apply", lambda *args: calls.append(len(args)) or real(*args))
    w, bias = r(5, 8, grad=True), r(5, grad=True)
    got = torch.func.grad(lambda x: fastmm.linear(x, w, bias, precision="ieee").sum())(r(3, 8))
    torch.testing.assert_close(got, torch.ones(3, 5) @ w.detach())
    assert calls == []


def test_a_tensor_that_outlived_its_functorch_transform_is_unwrapped_as_torch_would():
    """A tensor leaked out of torch.func.grad is a dead functorch wrapper (no storage of its
    own); torch's apply unwraps it, and so must the C-level route (else: "Cannot access data
    pointer of Tensor that doesn't have storage")."""
    leaked = []
    x = r(4, 8)
    torch.func.grad(lambda t: leaked.append(t) or t.sum())(x)
    (dead,) = leaked
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    w, bias = r(5, 8, grad=True), r(5, grad=True)
    for y, ref in ((fastmm.linear(dead, w, bias, precision="ieee"), x @ w.t() + bias),
                   (fastmm.matmul(dead, w.t(), precision="ieee"), x @ w.t())):
        torch.testing.assert_close(y, ref)
        (got,) = torch.autograd.grad(y.sum(), w)
        torch.testing.assert_close(got, torch.ones(5, 1) * x.sum(0))


def test_gradgradcheck_through_fastmm_linear():
    x, w, b = r(2, 3, 4, grad=True, dtype=torch.float64), r(5, 4, grad=True, dtype=torch.float64), \
        r(5, grad=True, dtype=torch.float64)
    assert torch.autograd.gradgradcheck(lambda x, w, b: fastmm.linear(x, w, b, precision="ieee"), (x, w, b))


@pytest.mark.parametrize("x_shape,n", [((0, 7), 5), ((3, 0, 7), 5), ((4, 0), 5), ((4, 7), 0), ((2, 3, 0), 0)])
def test_linear_and_matmul_gradients_of_empty_products_are_torchs(x_shape, n):
    """Products with no rows, K = 0 or N = 0: the gradients' flattened rows are still well
    defined (reshape(-1, 0) is not), and equal torch's (zeros where a sum is empty)."""
    k = x_shape[-1]
    x, w, b = r(*x_shape, grad=True), r(n, k, grad=True), r(n, grad=True)
    g = r(*x_shape[:-1], n)
    fastmm.linear(x, w, b, precision="ieee").backward(g)
    refs = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    torch.nn.functional.linear(*refs).backward(g)
    for got, ref in zip((x.grad, w.grad, b.grad), (t.grad for t in refs)):
        assert got.shape == ref.shape and torch.equal(got, ref)
    wk = r(k, n, grad=True)
    a = x.detach().requires_grad_()
    fastmm.matmul(a, wk, precision="ieee").backward(g)
    a_ref, wk_ref = a.detach().clone().requires_grad_(), wk.detach().clone().requires_grad_()
    torch.matmul(a_ref, wk_ref).backward(g)
    assert torch.equal(a.grad, a_ref.grad) and torch.equal(wk.grad, wk_ref.grad)
