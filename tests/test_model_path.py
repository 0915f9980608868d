"""The model path on the CPU: folding N-D @ matrix into one product, gradients as single
products, the eager autograd route against the registered ops, fused-call semantics of
``fastmm.linear`` / ``fastmm.addmm``, the op schemas, and what ``patch`` converts.

On a CPU fastmm's kernels do not run (the dispatcher hands the product to torch), so these tests
check fastmm's own decisions: the Shapes it builds, the products it asks for (recorded at
``fastmm.ops.compute``), the route a call takes, and the semantics its own code adds (scaling,
bias, masks), against torch computing the same thing independently.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fastmm
from fastmm import fast_path, ops
from fastmm.shapes import analyse
from conftest import outcome, relative_error

NAN = float("nan")


# --- folding -------------------------------------------------------------------------------

def test_an_nd_operand_times_a_matrix_is_folded_into_one_product_on_a_view():
    x = torch.randn(4, 256, 64)
    w = torch.randn(96, 64)
    s = analyse(x, w.t())
    assert s.folded and s.batch == () and (s.M, s.N, s.K) == (1024, 96, 64)
    assert s.a.data_ptr() == x.data_ptr() and s.a.shape == (1024, 64)  # a view, no copy
    assert s.out_shape == (4, 256, 96)
    assert s.b.stride() == (1, 64)  # W read K-contiguous in place


def test_an_operand_whose_rows_do_not_merge_is_folded_by_a_copy():
    """As torch.matmul's reshape: one product over all rows, on a contiguous copy of x; a meta
    stand-in of its layout where nothing is launched (planning, explain)."""
    x = torch.randn(256, 4, 64).transpose(0, 1)  # (4, 256, 64), rows of one batch 4*64 apart
    x0 = x.clone()
    w = torch.randn(64, 32)
    planned = analyse(x, w)
    assert planned.folded and planned.copied and planned.batch == () and planned.M == 1024
    assert planned.a.device.type == "meta" and planned.a.stride() == (64, 1)
    s = planned.materialized(x)
    assert s.copied and s.a.is_contiguous() and s.a.data_ptr() != x.data_ptr()
    assert torch.equal(s.a, x0.reshape(1024, 64)) and torch.equal(x, x0)
    assert s.out_shape == (4, 256, 32)
    plain = analyse(torch.randn(4, 256, 64), w)  # rows that a view merges: nothing to make
    assert not plain.copied and plain.materialized(x) is plain


def test_a_batched_matrix_vector_product_folds_too():
    s = analyse(torch.randn(3, 5, 8), torch.randn(8))
    assert s.folded and (s.M, s.N) == (15, 1) and s.out_shape == (3, 5)


def test_the_folded_result_is_viewed_into_out_or_computed_aside():
    s = analyse(torch.randn(2, 3, 4), torch.randn(4, 5))
    out = torch.empty(2, 3, 5)
    assert s.matrix_view(out).shape == (6, 5) and s.matrix_view(out).data_ptr() == out.data_ptr()
    strided = torch.empty(3, 2, 5).transpose(0, 1)  # rows of out cannot be one (6, 5) view
    assert s.matrix_view(strided) is None  # (dispatch then computes aside and copies; GPU-tested)


# --- gradients: one product for the weight ---------------------------------------------------

@pytest.fixture
def products(monkeypatch):
    """Every product the eager route asks fastmm for: (a shape, b shape)."""
    seen = []
    real, real_fused, real_linear = ops.compute, ops.compute_fused, ops.compute_linear

    def recording(a, b, out, precision):
        seen.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, out, precision)

    def recording_fused(a, b, d, alpha, beta, precision):  # (with a bias or addmm's input)
        seen.append((tuple(a.shape), tuple(b.shape)))
        return real_fused(a, b, d, alpha, beta, precision)

    def recording_linear(x, w, bias, precision):  # F.linear's x @ w.t()
        seen.append((tuple(x.shape), tuple(w.t().shape)))
        return real_linear(x, w, bias, precision)

    monkeypatch.setattr(ops, "compute", recording)
    monkeypatch.setattr(ops, "compute_fused", recording_fused)
    monkeypatch.setattr(ops, "compute_linear", recording_linear)
    return seen


def test_a_linear_layer_backward_is_two_products_with_the_tokens_as_k(products):
    x = torch.randn(4, 8, 16, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    y = fastmm.linear(x, w, b, precision="ieee")
    g = torch.randn_like(y)
    y.backward(g)
    assert products == [((4, 8, 16), (16, 32)),  # forward: x @ W^T
                        ((4, 8, 32), (32, 16)),  # grad_x = g @ W (folded inside)
                        ((32, 32), (32, 16))]  # grad_W = g^T @ x: one product, K = 4 * 8 tokens
    ref_x, ref_w, ref_b = (t.detach().double().requires_grad_() for t in (x, w, b))
    F.linear(ref_x, ref_w, ref_b).backward(g.double())
    for got, ref in ((x.grad, ref_x.grad), (w.grad, ref_w.grad), (b.grad, ref_b.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_a_frozen_linear_layers_backward_is_the_input_gradient_alone(products):
    """A frozen weight and bias (a LoRA base layer): grad_x is the one product (no flattened
    gradient made for the others)."""
    x = torch.randn(4, 8, 16, requires_grad=True)
    w, b = torch.randn(32, 16), torch.randn(32)
    y = fastmm.linear(x, w, b, precision="ieee")
    g = torch.randn_like(y)
    y.backward(g)
    assert products == [((4, 8, 16), (16, 32)), ((4, 8, 32), (32, 16))]
    torch.testing.assert_close(x.grad, g @ w, rtol=1e-5, atol=1e-5)


def test_a_matmul_with_a_weight_matrix_gets_its_gradient_in_one_product(products):
    a = torch.randn(3, 5, 7, requires_grad=True)
    b = torch.randn(7, 2, requires_grad=True)
    fastmm.matmul(a, b, precision="ieee").sum().backward()
    assert ((7, 15), (15, 2)) in products  # a flattened, transposed: K = 15 rows
    assert len(products) == 3
    torch.testing.assert_close(b.grad, a.detach().reshape(-1, 7).t() @ torch.ones(15, 2))


def test_a_broadcast_matrix_operand_keeps_per_batch_products_and_sums():
    a = torch.randn(5, 7, requires_grad=True)
    b = torch.randn(3, 7, 2, requires_grad=True)
    fastmm.matmul(a, b, precision="ieee").sum().backward()
    torch.testing.assert_close(a.grad, (torch.ones(3, 5, 2) @ b.detach().transpose(1, 2)).sum(0))


# --- the route a call takes ------------------------------------------------------------------

def test_eager_calls_with_grad_take_the_autograd_function_not_the_registered_op():
    x = torch.randn(2, 3, requires_grad=True)
    y = fastmm.matmul(x, torch.randn(3, 4))
    assert type(y.grad_fn).__name__ == "_MatmulBackward"
    z = fastmm.linear(x, torch.randn(4, 3), torch.randn(4))
    assert type(z.grad_fn).__name__ == "_LinearBackward"


def test_inside_a_dispatch_mode_the_registered_op_is_used():
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        fastmm.linear(x, w).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    # the mode saw fastmm's ops (their FLOP formulas): the forward and the two backward products,
    # 2*M*N*K each; torch's products inside them (the CPU fallback) are not seen a second time
    assert {str(op).split(".")[0] for op in counts} == {"fastmm"}, counts
    assert sum(counts.values()) == 3 * 2 * 8 * 16 * 32
    assert ops.use_registered_op(x) is False


def test_fake_tensors_go_through_the_op_and_its_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 8, 16)
        w = torch.empty(32, 16)
        y = fastmm.linear(x, w, torch.empty(32))
        z = fastmm.matmul(x, w.t())
    assert y.shape == (4, 8, 32) and z.shape == (4, 8, 32)


def test_torch_compile_sees_the_registered_op():
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    layer = fastmm.nn.Linear(16, 8)
    torch._dynamo.reset()
    out = torch.compile(layer, backend=backend)(torch.randn(3, 16))
    assert any("fastmm.linear" in t for t in seen), seen
    assert out.shape == (3, 8)


# --- epilogue semantics ------------------------------------------------------------------------

def test_linear_adds_the_bias_to_every_row():
    x, w, b = torch.randn(2, 3, 5), torch.randn(4, 5), torch.randn(4)
    torch.testing.assert_close(fastmm.linear(x, w, b, precision="ieee"), F.linear(x, w, b))
    torch.testing.assert_close(fastmm.linear(x, w, precision="ieee"), F.linear(x, w))


@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2.0), (0, 1), (0, -3.0), (2, 0)])
@pytest.mark.parametrize("c_shape", [(6, 4), (4,), (1, 4), (6, 1)])
def test_addmm_is_beta_c_plus_alpha_ab_and_beta_zero_ignores_nan(beta, alpha, c_shape):
    a, b = torch.randn(6, 5), torch.randn(5, 4)
    c = torch.full(c_shape, NAN) if beta == 0 else torch.randn(c_shape)
    got = fastmm.addmm(c, a, b, beta=beta, alpha=alpha, precision="ieee")
    ref = alpha * (a.double() @ b.double()) + (0 if beta == 0 else beta * c.double())
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.double(), ref.expand(6, 4), rtol=1e-5, atol=1e-5)


def test_linear_and_addmm_leave_half_autocast_to_torch():
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fastmm.linear(x, w, b)
        z = fastmm.addmm(b, x, w.t())
    assert y.dtype == z.dtype == torch.bfloat16  # torch's autocast rules ran them, in half


def test_addmm_gradients_match_torch():
    c, a, b = (torch.randn(s, requires_grad=True) for s in ((4,), (6, 5), (5, 4)))
    fastmm.addmm(c, a, b, beta=0.5, alpha=2.0).sum().backward()
    refs = [t.detach().clone().requires_grad_() for t in (c, a, b)]
    torch.addmm(*refs, beta=0.5, alpha=2.0).sum().backward()
    for got, ref in zip((c, a, b), refs):
        torch.testing.assert_close(got.grad, ref.grad)


@pytest.mark.parametrize("beta", [1, 0.5])
def test_addmm_backward_scales_the_input_gradient_only_for_beta_other_than_one(beta):
    """GPT-2's Conv1D is addmm(bias, x, W) with beta = 1: the bias gradient is g summed over
    rows, with no elementwise pass making g * 1 first (on the GPU a read and a write of the whole
    output gradient, every Conv1D of every step); beta = 0.5 makes that one multiply. The
    gradients are torch's."""
    c, a, b = (torch.randn(s, requires_grad=True) for s in ((4,), (6, 5), (5, 4)))
    g = torch.randn(6, 4)
    y = fastmm.addmm(c, a, b, beta=beta)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y.backward(g)
    muls = [e.name for e in prof.events() if e.name == "aten::mul"]
    assert len(muls) == (0 if beta == 1 else 1)
    refs = [t.detach().clone().requires_grad_() for t in (c, a, b)]
    torch.addmm(*refs, beta=beta).backward(g)
    for got, ref in zip((c, a, b), refs):
        torch.testing.assert_close(got.grad, ref.grad)


ADDMM_MISFITS = [((3,), (2, 3), (4, 3)), ((3,), (2, 3, 1), (4, 3)), ((3,), (2, 4), (4,)), ((3,), (4,), (4, 3)),
                 ((2, 2, 3), (2, 4), (4, 3)), ((5, 3), (2, 4), (4, 3)), ((2, 4), (2, 4), (4, 3)),
                 ((1,), (2, 4, 4), (4, 3)), ((1,), (2, 4), (4, 4, 3))]
ADDMM_MISFIT_IDS = ["K", "3-D mat1", "1-D mat2", "1-D mat1", "3-D C", "C rows", "C columns", "3-D mat1 of K",
                    "3-D mat2 of K"]


@pytest.mark.parametrize("c,a,b", ADDMM_MISFITS, ids=ADDMM_MISFIT_IDS)
def test_addmm_errors_are_torchs_own_words(c, a, b):
    """fastmm.addmm and the registered op check shapes themselves (a fast test of torch's rules),
    and where one fails torch.addmm words the error: the installed release's words (2.15 added
    "addmm: " and calls a 3-D mat1 "self"), nothing computed, no launch. With out=, torch's
    errors for the call with out=, out's own (another dtype, autograd) before the shapes'."""
    c, a, b = torch.randn(c), torch.randn(a), torch.randn(b)
    theirs = outcome(lambda: torch.addmm(c, a, b))
    assert theirs is not None and theirs[0] == "RuntimeError"
    assert outcome(lambda: fastmm.addmm(c, a, b, precision="ieee")) == theirs
    assert outcome(lambda: torch.ops.fastmm.addmm(c, a, b, 1.0, 1.0, "ieee")) == theirs
    outs = ((torch.empty(0), False), (torch.empty(2, 3, dtype=torch.float64), False), (torch.empty(2, 3), True))
    for out, grad in outs:
        a_ = a.clone().requires_grad_(grad)
        mine, ref = out.clone(), out.clone()
        assert outcome(lambda: fastmm.addmm(c, a_, b, out=mine, precision="ieee")) == \
            outcome(lambda: torch.addmm(c, a_, b, out=ref)), (tuple(out.shape), out.dtype, grad)
        assert mine.shape == ref.shape  # (out resized, or not, as torch's call left it)


@pytest.mark.parametrize("c,a,b", ADDMM_MISFITS, ids=ADDMM_MISFIT_IDS)
def test_addmm_shape_errors_are_worded_by_the_installed_torch(c, a, b, monkeypatch):
    """Not fastmm's copy of some release's words: the error comes from torch.addmm itself (a
    stand-in here), whichever words torch uses, on the eager route and the registered op."""
    class TorchsWords(RuntimeError):
        pass

    def refuse(*args, **kwargs):
        raise TorchsWords("torch.addmm")

    c, a, b = torch.randn(c), torch.randn(a), torch.randn(b)
    monkeypatch.setattr(torch, "addmm", refuse)
    with pytest.raises(TorchsWords):
        fastmm.addmm(c, a, b, precision="ieee")
    with pytest.raises(TorchsWords):
        torch.ops.fastmm.addmm(c, a, b, 1.0, 1.0, "ieee")


@pytest.mark.parametrize("bias", [None, (6,), (1, 6), ()], ids=["no bias", "bias", "(1, N) bias", "scalar bias"])
@pytest.mark.parametrize("x_shape", [(3, 4), (4,), (2, 3, 4)], ids=["2-D x", "1-D x", "3-D x"])
def test_linear_shape_errors_are_f_linears_words(x_shape, bias, monkeypatch):
    """A K mismatch in F.linear's form is worded as F.linear words it (with a bias torch 2.15
    says "addmm: ...", without one "mm: ...", where matmul's words would be "mm: ..." both
    times): fastmm.linear, fastmm.nn.Linear and the registered op, against F.linear itself; then
    with F.linear replaced by a stand-in, that the words are F.linear's own."""
    x, w = torch.randn(x_shape), torch.randn(6, 5)
    b = None if bias is None else torch.randn(bias)
    layer = fastmm.nn.Linear(5, 6, bias=b is not None, precision="ieee")
    theirs = outcome(lambda: F.linear(x, w, b))
    assert theirs is not None and theirs[0] == "RuntimeError"
    assert outcome(lambda: fastmm.linear(x, w, b, precision="ieee")) == theirs
    assert outcome(lambda: torch.ops.fastmm.linear(x, w, b, "ieee")) == theirs
    with torch.no_grad():
        layer.weight.copy_(w)
        if b is not None:
            layer.bias = torch.nn.Parameter(b)
        assert outcome(lambda: layer(x)) == theirs

    class TorchsWords(RuntimeError):
        pass

    def refuse(*args, **kwargs):
        raise TorchsWords("F.linear")

    monkeypatch.setattr(torch.nn.functional, "linear", refuse)
    with pytest.raises(TorchsWords):
        fastmm.linear(x, w, b, precision="ieee")


LINEAR_BIASES = [(6,), (1, 6), (1, 1, 6), (1,), (), (3, 6), (2, 3, 6), (2, 1, 6), (6, 1), (24, 1)]


@pytest.mark.parametrize("bias_shape", LINEAR_BIASES, ids=[str(b) for b in LINEAR_BIASES])
@pytest.mark.parametrize("x_shape,seq_first", [((5,), False), ((3, 5), False), ((2, 3, 5), False), ((2, 3, 5), True),
                                               ((4, 2, 3, 5), False)],
                         ids=["1-D x", "2-D x", "3-D x", "3-D seq-first x", "4-D x"])
def test_linear_with_any_bias_gives_f_linears_result_and_gradients(emulated_gpu, x_shape, seq_first, bias_shape,
                                                                   monkeypatch):
    """F.linear's result for a bias of more than one dim depends on its path, which torch picks by
    x's layout (a contiguous x's rows folded and the bias added as addmm adds it: a (1, N) bias on
    a 1-D x gives (N,); else the product then an in-place add): fastmm gives torch's shape,
    values and gradients, or torch's error. (torch 2.13's meta tensors accept a (1, 1, N) bias on
    a folded 3-D x, which real tensors refuse: fastmm, deciding on meta tensors, computes it.)"""
    # (tensors made by torch.randn / empty: the emulated GPU's memory)
    x0 = torch.randn((x_shape[1], x_shape[0]) + x_shape[2:]).transpose(0, 1) if seq_first else torch.randn(x_shape)
    if seq_first:  # (grad_W reads x's rows from a copy made by torch's reshape)
        import emulation
        monkeypatch.setattr(emulation, "CHECK_MEMORY", False)
    w0, b0 = torch.randn(6, 5), torch.randn(bias_shape)
    theirs = outcome(lambda: F.linear(x0, w0, b0))
    if theirs is not None:
        meta = [torch.empty_strided(t.shape, t.stride(), device="meta") for t in (x0, w0, b0)]
        if outcome(lambda: F.linear(*meta)) is None:
            pytest.skip("this torch's meta tensors accept what real ones refuse")
        assert outcome(lambda: fastmm.linear(x0, w0, b0, precision="ieee")) == theirs
        return
    x, w, b = (t.detach().requires_grad_() for t in (x0, w0, b0))
    xr, wr, br = (t.detach().requires_grad_() for t in (x0, w0, b0))
    y, yr = fastmm.linear(x, w, b, precision="ieee"), F.linear(xr, wr, br)
    assert y.shape == yr.shape
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    g = torch.randn(yr.shape)
    y.backward(g)
    yr.backward(g)
    for got, ref in ((x, xr), (w, wr), (b, br)):
        assert got.grad.shape == ref.grad.shape
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # (the repeat: the entry a first call left, or the same path again)
        torch.testing.assert_close(fastmm.linear(x0, w0, b0, precision="ieee"), yr, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias_shape", [(6,), (), (1,)], ids=["(N,)", "()", "(1,)"])
@pytest.mark.parametrize("x_shape,seq_first", [((5,), False), ((3, 5), False), ((2, 3, 5), False), ((2, 3, 5), True)],
                         ids=["1-D x", "2-D x", "3-D x", "3-D seq-first x"])
def test_a_row_bias_never_asks_torch_for_the_shape(emulated_gpu, monkeypatch, x_shape, seq_first, bias_shape):
    """Biases of at most one dim (every model's) take fastmm's own path, first call and repeat:
    asking torch for F.linear's shape on meta tensors (~0.6 ms) is for biases of more dims."""
    import emulation
    monkeypatch.setattr(emulation, "CHECK_MEMORY", False)  # (seq-first rows: a copy by torch's reshape)
    monkeypatch.setattr(fast_path, "linear_shape", lambda *a: pytest.fail("linear_shape called"))
    x = torch.randn((x_shape[1], x_shape[0]) + x_shape[2:]).transpose(0, 1) if seq_first else torch.randn(x_shape)
    w, b = torch.randn(6, 5), torch.randn(bias_shape)
    for _ in range(2):
        torch.testing.assert_close(fastmm.linear(x, w, b, precision="ieee"), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_f_linears_shape_for_a_rare_bias_is_asked_once_per_layout(emulated_gpu, monkeypatch):
    """The meta-tensor answer is remembered by the shapes and strides it depends on."""
    asked = []
    real = fast_path.linear_shape
    monkeypatch.setattr(fast_path, "linear_shape", lambda *a: asked.append(1) or real(*a))
    w, b = torch.randn(6, 5), torch.randn(1, 6)
    for call in range(3):
        x = torch.randn(5)
        torch.testing.assert_close(fastmm.linear(x, w, b, precision="ieee"), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        if call == 0:  # (x's layout, then its folded rows' (1, K): F.linear's shape for each)
            first = len(asked)
            assert first == 2
    assert len(asked) == first
    fastmm.linear(torch.randn(2, 3, 5), w, b, precision="ieee")  # (another layout: asked again)
    assert len(asked) > first


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
@pytest.mark.parametrize("x_shape,bias_shape", [((5,), (1, 6)), ((4, 2, 3, 5), (1, 1, 6)), ((2, 3, 5), (3, 1)),
                                                ((2, 3, 5), (6,)), ((2, 3, 5), (2, 3, 7))],
                         ids=["1-D x, (1, N)", "4-D x, (1, 1, N)", "3-D x, (R, 1)", "3-D x, (N,)", "no broadcast"])
def test_a_registered_layer_adds_its_bias_as_its_forward_does(emulated_gpu, monkeypatch, layout, x_shape, bias_shape):
    """A registered Linear-like layer's forward is x @ W^T + b ("out_in") or x @ W + b
    ("in_out"), a broadcasting sum: with a bias of more than one dim that is not F.linear's fold
    (a (1, N) bias on a 1-D x gives (1, N)), the patched layer gives the module's own result,
    gradients or error."""
    class OutIn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.bias = torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(bias_shape))

        def forward(self, x):
            return x @ self.weight.t() + self.bias

    import emulation
    monkeypatch.setattr(emulation, "CHECK_MEMORY", False)  # (torch's autograd sums the bias's broadcast)

    def make():  # (parameters made by torch.randn: the emulated GPU's memory)
        return OutIn() if layout == "out_in" else _InOutLayer(5, 6, bias_shape)

    module, twin = make(), make()
    twin.load_state_dict(module.state_dict())
    fastmm.register_linear_like(type(module), layout=layout)
    patched = fastmm.patch(torch.nn.Sequential(twin), precision="ieee")[0]
    assert type(patched) is not type(module)
    x = torch.randn(x_shape)
    theirs = outcome(lambda: module(x))
    if theirs is not None:
        assert outcome(lambda: patched(x)) == theirs
        return
    xr, xp = x.detach().requires_grad_(), torch.empty(x.shape).copy_(x).requires_grad_()
    y, yr = patched(xp), module(xr)
    assert y.shape == yr.shape
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    g = torch.randn(yr.shape)
    y.backward(g)
    yr.backward(g)
    torch.testing.assert_close(xp.grad, xr.grad, rtol=1e-5, atol=1e-5)
    for p, q in zip(patched.parameters(), module.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)


def test_the_ops_fakes_refuse_the_shapes_their_ops_refuse():
    """Under FakeTensorMode (torch.compile's tracing) fastmm::addmm and fastmm::linear refuse a K
    mismatch and a C that does not expand, as the ops themselves do: a traced graph does not
    carry a shape error to run time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        c, a, b = torch.empty(3), torch.empty(2, 4), torch.empty(5, 3)
        with pytest.raises(RuntimeError):
            torch.ops.fastmm.addmm(c, a, b, 1.0, 1.0, "ieee")
        with pytest.raises(RuntimeError):
            torch.ops.fastmm.addmm(torch.empty(5, 3), a, torch.empty(4, 3), 1.0, 1.0, "ieee")
        with pytest.raises(RuntimeError):
            torch.ops.fastmm.linear(torch.empty(3, 4), torch.empty(6, 5), None, "ieee")
        assert torch.ops.fastmm.addmm(c, a, torch.empty(4, 3), 1.0, 1.0, "ieee").shape == (2, 3)
        assert torch.ops.fastmm.linear(torch.empty(3, 5), torch.empty(6, 5), None, "ieee").shape == (3, 6)


# --- the op schemas ------------------------------------------------------------------------------

def test_precision_is_optional_on_every_op():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    torch.testing.assert_close(torch.ops.fastmm.matmul(a, b), a @ b)
    torch.testing.assert_close(torch.ops.fastmm.linear(a, b.t()), a @ b)
    torch.testing.assert_close(torch.ops.fastmm.addmm(torch.zeros(5), a, b), a @ b)
    for op in (torch.ops.fastmm.matmul, torch.ops.fastmm.linear, torch.ops.fastmm.addmm):
        arg = next(x for x in op.default._schema.arguments if x.name == "precision")
        assert arg.default_value is None and "str?" in str(arg.type) or str(arg.type) == "Optional[str]"
    with pytest.raises(ValueError, match="precision"):
        torch.ops.fastmm.matmul(a, b, "fp16")


@pytest.mark.parametrize("case", ["plain", "empty", "noncontig", "batched"])
def test_opcheck_on_every_op(case):
    from torch.library import opcheck

    if case == "empty":
        x, w, c = torch.randn(0, 4), torch.randn(5, 4), torch.randn(5)
    elif case == "noncontig":
        x, w, c = torch.randn(4, 3).t(), torch.randn(4, 5).t(), torch.randn(5)
    elif case == "batched":
        x, w, c = torch.randn(2, 3, 4), torch.randn(5, 4), torch.randn(5)
    else:
        x, w, c = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    x, w, c = (t.requires_grad_() for t in (x, w, c))
    opcheck(torch.ops.fastmm.matmul.default, (x, w.t(), "ieee"))
    opcheck(torch.ops.fastmm.linear.default, (x, w, c, "ieee"))
    if x.dim() == 2:
        opcheck(torch.ops.fastmm.addmm.default, (c, x, w.t(), 0.5, 2.0, "ieee"))


# --- patch: what it converts ---------------------------------------------------------------------

def test_patch_converts_multihead_attention_in_place_with_the_same_state():
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    ref = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    ref.load_state_dict(mha.state_dict())
    params = [id(p) for p in mha.parameters()]
    assert fastmm.patch(mha) is mha
    assert isinstance(mha, fastmm.nn.MultiheadAttention) and [id(p) for p in mha.parameters()] == params
    assert mha.state_dict().keys() == ref.state_dict().keys()
    q, k = torch.randn(2, 5, 16), torch.randn(2, 6, 16)
    mask = torch.rand(5, 6) > 0.6
    mask[:, 0] = False  # no row fully masked
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, -2:] = True
    for kw in ({}, {"attn_mask": mask}, {"key_padding_mask": pad}, {"attn_mask": mask, "key_padding_mask": pad},
               {"need_weights": False, "key_padding_mask": pad}, {"average_attn_weights": False}):
        got, got_w = mha(q, k, k, **kw)
        want, want_w = ref(q, k, k, **kw)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if want_w is not None:
            torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-5)
    fastmm.unpatch(mha)
    assert type(mha) is torch.nn.MultiheadAttention


@pytest.mark.parametrize("form", ["seq_first", "unbatched"])
def test_a_converted_multihead_attention_matches_torch_in_every_input_layout(form):
    mha = torch.nn.MultiheadAttention(16, 2)
    ref = torch.nn.MultiheadAttention(16, 2)
    ref.load_state_dict(mha.state_dict())
    fastmm.patch(mha)
    shape = (5, 2, 16) if form == "seq_first" else (5, 16)
    x, kv = torch.randn(shape), torch.randn((6,) + shape[1:])
    for args in ((x, x, x), (x, kv, kv)):
        for need_weights in (True, False):
            got, got_w = mha(*args, need_weights=need_weights)
            want, want_w = ref(*args, need_weights=need_weights)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if want_w is not None:
                torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-5)


def test_batch_first_attention_projects_its_rows_in_place_and_repeats_without_planning(emulated_gpu, monkeypatch):
    """A batch-first input's rows are one matrix as they are: the in-projection reads x itself
    (a seq-first view of it would fold only by a copy, and its weight gradient too), and a
    repeated training step takes remembered entries only, no full-path call."""
    import emulation
    gpu = emulated_gpu
    monkeypatch.setattr(emulation, "CHECK_MEMORY", False)  # (SDPA's output: made by torch's op)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    ref = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    ref.load_state_dict(mha.state_dict())
    fastmm.patch(mha, precision="ieee")
    x = torch.randn(3, 5, 16, requires_grad=True)
    for step in range(3):
        gpu.clear()
        slow = gpu.slow_calls
        got, _ = mha(x, x, x, need_weights=False)
        if step == 0:
            assert gpu.launches[0].pointers[0] == x.data_ptr()  # the in-projection on x's own rows
        got.pow(2).sum().backward()
        if step > 0:
            assert gpu.slow_calls == slow
    want, _ = ref(x, x, x, need_weights=False)
    want.pow(2).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mha.in_proj_weight.grad / 3, ref.in_proj_weight.grad, rtol=1e-4, atol=1e-5)


def test_patch_reaches_every_projection_of_a_transformer_encoder():
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    fastmm.patch(model)
    report = fastmm.coverage(model, torch.randn(2, 5, 16))
    assert report.counts()["torch"] == len([e for e in report.entries if e.op.startswith("fastmm::")])
    assert not [e for e in report.entries if e.op.startswith("aten::") and e.where == "torch"]


def test_register_linear_like_converts_a_users_class_both_ways():
    class Proj(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(6, 4))  # [in, out]
            self.bias = torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            return x @ self.weight + self.bias

    sub = fastmm.register_linear_like(Proj, layout="in_out")
    model = torch.nn.Sequential(Proj())
    x = torch.randn(3, 5, 6)
    want = model(x)
    fastmm.patch(model, precision="ieee")
    assert type(model[0]) is sub and model[0].precision == "ieee"
    report = fastmm.coverage(model, x)
    assert {e.op for e in report.entries} == {"fastmm::linear", "fastmm::matmul"}  # (x @ W on W^T's view)
    torch.testing.assert_close(model(x), want)
    fastmm.unpatch(model)
    assert type(model[0]) is Proj


class _InOutLayer(torch.nn.Module):
    """x @ W (+ b) with W stored [in, out] (GPT-2's Conv1D form); ``bias_shape`` None: no bias."""

    def __init__(self, k, n, bias_shape=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(k, n))
        self.bias = None if bias_shape is None else torch.nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        return x @ self.weight + (0 if self.bias is None else self.bias)


def _in_out_layer(k, n, bias_shape=None):
    fastmm.register_linear_like(_InOutLayer, layout="in_out")
    return fastmm.patch(torch.nn.Sequential(_InOutLayer(k, n, bias_shape)), precision="ieee")[0]


@pytest.mark.parametrize("frozen", ["none", "input", "weight"])
def test_an_in_out_layer_takes_the_linear_path_with_its_weight_gradient_in_its_own_layout(emulated_gpu, frozen):
    """A registered [in, out] layer (GPT-2's Conv1D form): x @ W through F.linear's path on W^T's
    view, one launch with the bias added in its stores, its repeat served by the linear entry;
    with gradients, its backward's two products from one remembered entry on a repeat (grad_x
    on (g, W), grad_W = x^T g on (x, g)), the weight gradient in W's own [in, out] layout (no
    transposed gradient for autograd to copy). Right against float64, the repeat's gradients
    bit-equal to the first's."""
    from fastmm import fast_path

    layer = _in_out_layer(16, 12, (12,))
    if frozen == "weight":
        layer.requires_grad_(False)
    w, b = layer.weight.detach(), layer.bias.detach()
    x0 = torch.randn(3, 5, 16)
    for _ in range(2):
        emulated_gpu.clear()
        with torch.no_grad():
            y = layer(x0)
        assert len(emulated_gpu.launches) == 1
        assert y.shape == (3, 5, 12) and relative_error(y, x0.double() @ w.double() + b.double()) <= 1e-6
    assert type(fast_path.ENTRIES.get(fast_path.linear_key(x0, layer.weight.t(), layer.bias, "ieee"))) \
        is fast_path.FastEntry
    g = torch.randn(3, 5, 12)
    grads = []
    for _ in range(3):
        x = x0.detach().requires_grad_(frozen != "input")  # (x0's memory: the emulation reads what it made)
        layer.zero_grad(set_to_none=True)
        layer(x).backward(g)
        grads.append((x.grad, layer.weight.grad, layer.bias.grad))
    key = fast_path.linear_grads_key(g, x0, w, "ieee", frozen != "input", frozen != "weight", g.data_ptr(),
                                     x0.data_ptr(), w.data_ptr(), in_out=True)
    assert type(fast_path.ENTRIES.get(key)) is fast_path.LinearGradsEntry
    for later in grads[1:]:
        assert all((a is None and c is None) or torch.equal(a, c) for a, c in zip(later, grads[0]))
    gx, gw, gb = grads[-1]
    if frozen != "input":
        assert relative_error(gx, g.double() @ w.double().t()) <= 1e-6
    if frozen != "weight":
        assert gw.stride() == (12, 1)
        assert relative_error(gw, x0.double().reshape(15, 16).t() @ g.double().reshape(15, 12)) <= 1e-6
        torch.testing.assert_close(gb, g.sum((0, 1)))


def test_an_in_out_layers_double_backward_after_a_remembered_one_records_its_products(emulated_gpu):
    """create_graph through an [in, out] layer whose layout has its remembered backward entry:
    the formula runs, recording autograd, so d/dW of sum(v * grad_x), grad_x = g W^T, is v^T g."""
    layer = _in_out_layer(16, 12)
    x, g = torch.randn(3, 5, 16, requires_grad=True), torch.randn(3, 5, 12)
    layer(x).backward(g)
    layer(x).backward(g)  # (served by the entry)
    (grad_x,) = torch.autograd.grad(layer(x), x, g, create_graph=True)
    assert grad_x.requires_grad
    v = torch.randn(grad_x.shape)
    (second,) = torch.autograd.grad(grad_x, layer.weight, v)
    assert relative_error(second, v.double().reshape(15, 16).t() @ g.double().reshape(15, 12)) <= 1e-6


def test_an_in_out_layer_on_rows_no_view_merges_takes_the_formula(emulated_gpu, monkeypatch):
    """x's rows merge only by a copy (a transpose of its leading dims): grad_W = x^T g reads the
    copy, so the layout's combined backward key is never fast, and every backward is right."""
    import emulation
    from fastmm import fast_path

    monkeypatch.setattr(emulation, "CHECK_MEMORY", False)  # (the copy is made by torch's reshape)
    layer = _in_out_layer(16, 12)
    x0, g = torch.randn(5, 3, 16).transpose(0, 1), torch.randn(3, 5, 12)
    for _ in range(3):
        x = x0.detach().requires_grad_()
        layer.zero_grad(set_to_none=True)
        layer(x).backward(g)
        x64, g64 = x0.double().reshape(15, 16), g.double().reshape(15, 12)
        assert relative_error(layer.weight.grad, x64.t() @ g64) <= 1e-6
        assert relative_error(x.grad, g.double() @ layer.weight.detach().double().t()) <= 1e-6
    key = fast_path.linear_grads_key(g, x0, layer.weight, "ieee", True, True, g.data_ptr(), x0.data_ptr(),
                                     layer.weight.data_ptr(), in_out=True)
    assert fast_path.ENTRIES.get(key) is fast_path.NOT_FAST


def test_square_linear_and_in_out_layers_of_one_layout_keep_their_own_backward_entries(emulated_gpu):
    """K = N: a Linear (x @ W^T) and an [in, out] layer (x @ W) on the same x, W and g layouts
    have backward products of the same shapes; their remembered entries stay apart, and each
    backward, interleaved, gives its own gradients."""
    lin = fastmm.nn.Linear(16, 16, bias=False, precision="ieee")
    inout = _in_out_layer(16, 16)
    x0, g = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    for _ in range(3):
        for layer, w_t in ((lin, False), (inout, True)):
            x = x0.detach().requires_grad_()
            layer.zero_grad(set_to_none=True)
            layer(x).backward(g)
            w64, x64, g64 = layer.weight.detach().double(), x0.double().reshape(15, 16), g.double().reshape(15, 16)
            assert relative_error(x.grad, g.double() @ (w64.t() if w_t else w64)) <= 1e-6
            assert relative_error(layer.weight.grad, x64.t() @ g64 if w_t else g64.t() @ x64) <= 1e-6


@pytest.mark.parametrize("form", ["linear", "in_out"])
@pytest.mark.parametrize("bias_shape", [(1, 12), (), (1,)])
def test_a_bias_that_broadcasts_otherwise_gets_a_gradient_of_its_own_shape(emulated_gpu, form, bias_shape):
    """F.linear and x @ W + b accept a bias of shape (1, N), () or (1,): its gradient is g summed
    to that shape (torch's), not the (N,) of a row bias; a first and a repeat backward."""
    layer = fastmm.nn.Linear(16, 12, precision="ieee") if form == "linear" else _in_out_layer(16, 12, bias_shape)
    if form == "linear":
        layer.bias = torch.nn.Parameter(torch.randn(bias_shape))
    for _ in range(2):
        x, g = torch.randn(3, 5, 16), torch.randn(3, 5, 12)
        layer.zero_grad(set_to_none=True)
        layer(x).backward(g)
        assert layer.bias.grad.shape == bias_shape
        torch.testing.assert_close(layer.bias.grad, g.sum_to_size(bias_shape))


def test_gpt2_conv1d_is_converted_where_transformers_is_installed():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    ref = transformers.GPT2LMHeadModel(cfg)
    ref.load_state_dict(model.state_dict())
    fastmm.patch(model)
    from transformers.pytorch_utils import Conv1D

    convs = [m for m in model.modules() if isinstance(m, Conv1D)]
    assert convs and all(type(m).__name__ == "FastmmConv1D" for m in convs)
    ids = torch.randint(0, 50, (2, 7))
    torch.testing.assert_close(model(ids).logits, ref(ids).logits)
    report = fastmm.coverage(model, input_ids=ids, labels=ids, loss=lambda out: out.loss)
    leftovers = [e for e in report.entries if e.op.startswith("aten::") and e.where == "torch"
                 and e.shapes[0][-1] not in (8,)]  # (SDPA's CPU math path: its own bmm, head dim 8)
    assert not leftovers, leftovers
    assert model.state_dict().keys() == ref.state_dict().keys()


@pytest.mark.parametrize("name", ["llama", "bert", "vit"])
def test_transformers_models_convert_and_keep_their_outputs(name):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    tf = transformers
    torch.manual_seed(0)
    if name == "llama":
        cfg = tf.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=50)
        make, inp = (lambda: tf.LlamaForCausalLM(cfg)), {"input_ids": torch.randint(0, 50, (2, 7))}
    elif name == "bert":
        cfg = tf.BertConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                            vocab_size=50, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        make, inp = (lambda: tf.BertModel(cfg)), {"input_ids": torch.randint(0, 50, (2, 7))}
    else:
        cfg = tf.ViTConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        make, inp = (lambda: tf.ViTModel(cfg)), {"pixel_values": torch.randn(2, 3, 16, 16)}
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    fastmm.patch(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is fastmm.nn.Linear for m in linears)
    out, want = model(**inp), ref(**inp)
    key = "logits" if hasattr(want, "logits") else "last_hidden_state"
    torch.testing.assert_close(getattr(out, key), getattr(want, key))
    report = fastmm.coverage(model, **inp)
    fastmm_calls = [e for e in report.entries if e.op.startswith("fastmm::")]
    assert len(fastmm_calls) >= 2 * len(linears)  # every Linear forward, and its backward products
    assert model.state_dict().keys() == ref.state_dict().keys()


# --- a patched model's step: no pass over memory that torch's step does not make ---------------

#: torch ops that read and write whole tensors (elementwise math, copies, reductions): each one a
#: kernel and a trip through memory on the GPU
MEMORY_PASSES = ("aten::mul", "aten::add", "aten::add_", "aten::sub", "aten::div", "aten::copy_", "aten::clone",
                 "aten::cat", "aten::sum", "aten::fill_", "aten::zero_")


def _tiny_model(tf, name):
    """(model, inputs, loss of the output) at toy sizes, dims multiples of 4."""
    ids = {"input_ids": torch.randint(0, 64, (2, 8))}
    if name == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel(cfg), dict(ids, labels=ids["input_ids"]), lambda out: out.loss
    if name == "llama":
        cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=64)
        return tf.LlamaForCausalLM(cfg), dict(ids, labels=ids["input_ids"]), lambda out: out.loss
    if name == "bert":
        cfg = tf.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            vocab_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return tf.BertModel(cfg), ids, lambda out: out.last_hidden_state.pow(2).mean()
    cfg = tf.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       image_size=16, patch_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return tf.ViTModel(cfg), {"pixel_values": torch.randn(2, 3, 16, 16)}, lambda out: out.last_hidden_state.pow(2).mean()


def _memory_passes(model, inputs, loss_fn):
    """(count of each MEMORY_PASSES op in one forward + backward, the loss), the emulated
    kernels' own torch ops left out (emulation.EMULATED_KERNEL)."""
    from emulation import EMULATED_KERNEL

    loss_fn(model(**inputs)).backward()  # (a first step: plans made, grads allocated)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = loss_fn(model(**inputs))
        loss.backward()

    def in_kernel(e):
        while e is not None:
            if e.name == EMULATED_KERNEL:
                return True
            e = e.cpu_parent
        return False

    names = [e.name for e in prof.events() if e.name in MEMORY_PASSES and not in_kernel(e)]
    return {op: names.count(op) for op in MEMORY_PASSES}, loss.item()


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit"])
def test_a_patched_models_step_makes_no_memory_pass_torchs_does_not(emulated_gpu, monkeypatch, name):
    """A training step (forward + backward) of a tiny Hugging Face model, patched, on the
    emulated GPU: fastmm runs every product (its kernels emulated), and around them it makes no
    more elementwise, copy or reduction ops than torch's own step, op by op (such an op is a
    pass over the tensor's memory on the GPU: GPT-2's Conv1D backward once made g * 1 for its
    bias). The losses agree."""
    import copy

    import emulation

    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    monkeypatch.setattr(emulation, "CHECK_MEMORY", False)  # (activations are made by torch's ops)
    torch.manual_seed(0)
    model, inputs, loss_fn = _tiny_model(tf, name)
    patched = copy.deepcopy(model)
    fastmm.patch(patched, precision="ieee")
    theirs, their_loss = _memory_passes(model, inputs, loss_fn)
    ours, our_loss = _memory_passes(patched, inputs, loss_fn)
    assert emulated_gpu.launches, "fastmm ran no product"
    assert {op: n for op, n in ours.items() if n > theirs[op]} == {}, (ours, theirs)
    assert our_loss == pytest.approx(their_loss, rel=1e-5)
