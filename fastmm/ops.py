"""fastmm with autograd, and as torch.library custom ops for torch.compile and CUDA graphs.

Registered ops (what torch.compile, ``torch.library.opcheck``, fake tensors and dispatch modes
see; each with a fake, an autograd formula (but linear_grads) and ``precision=None`` following
torch's setting):

- ``fastmm::matmul(a, b, precision=None) -> Tensor``: torch.matmul, allocating a contiguous result;
- ``fastmm::matmul_out(a, b, precision, out) -> ()``: into ``out`` (already the right shape);
- ``fastmm::linear(x, weight, bias=None, precision=None) -> Tensor``: ``F.linear``;
- ``fastmm::addmm(c, a, b, beta=1, alpha=1, precision=None) -> Tensor``: ``torch.addmm``;
- ``fastmm::linear_grads(g, x, weight, precision=None) -> (Tensor, Tensor)``: both gradients of
  ``x @ weight.t()``, what fastmm::linear's backward calls with grad mode off (a compiled
  graph's): one op call for the two products. It has no autograd formula of its own.

In eager mode the same products take a cheaper route: ``torch.autograd.Function`` subclasses
whose forward and backward call :func:`fastmm.fast_path.compute` directly. A Python custom op
pays its dispatch and its autograd wrapper on every call (measured: 134 us to enqueue one
Linear-sized product with grad, against 19 us without), which made patched models CPU-bound.
The route is taken for plain tensors only, outside torch.compile and outside any
TorchDispatchMode (FlopCounterMode, fake tensors), where data pointers are real.

The registered ops' bodies take the same steady-state path (:func:`fastmm.fast_path.compute`):
a compiled graph calls them on the same layouts step after step, and a repeat is then a lookup
and a launch, not a trip through the planner's full path.

Gradients are single products wherever the layout allows: for ``x @ W`` with ``x`` of shape
(..., K) the weight's gradient is one product with K = all rows (``x`` flattened), not one per
batch entry followed by a reduction; grad_x is folded the same way (``fastmm.shapes``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from . import fast_path
from .dispatch import transform_active
from .fast_path import compute, compute_fused, compute_linear
from .precision import autocast_half_active, autocast_half_active_on, resolve_precision, torch_precision
from .problem import PRECISIONS
from .shapes import PLAIN_TYPES, addmm_bias_fits, analyse, flat_rows, raise_torch_error, resize_out

def tracing_or_in_dispatch_mode() -> bool:
    """torch.compile is tracing, or a TorchDispatchMode is active: the registered op is what they
    must see (the eager route reads data pointers)."""
    return torch.compiler.is_compiling() or is_in_torch_dispatch_mode()


def use_registered_op(*tensors) -> bool:
    """Whether a call must go through the registered op (torch.compile, a TorchDispatchMode, a
    tensor subclass such as FakeTensor or DTensor) rather than the eager route."""
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():  # (tracing_or_in_dispatch_mode, inlined)
        return True
    for t in tensors:  # (a loop: any() over a generator costs ~0.3 us more on every call)
        if t is not None and type(t) not in PLAIN_TYPES:
            return True
    return False


# ---------------------------------------------------------------------------------------------
# gradient formulas, written once over a product function ``mm(x, y)`` (fastmm eagerly, the
# registered op when traced)

def _restore_squeezed(g: torch.Tensor, a_dim: int, b_dim: int) -> torch.Tensor:
    # The squeezed N dim before the M dim: for 1-D @ 1-D the grad is 0-d, and only this order
    # turns it into the (1, 1) matrix the products below expect.
    if b_dim == 1:
        g = g.unsqueeze(-1)
    if a_dim == 1:
        g = g.unsqueeze(-2)
    return g


def matmul_grads(mm, a, b, g, need_a: bool, need_b: bool):
    """(grad_a, grad_b) of ``a @ b`` (torch.matmul rules) for the output gradient ``g``."""
    a_shape, b_shape = a.shape, b.shape
    g = _restore_squeezed(g, len(a_shape), len(b_shape))
    a2 = a.unsqueeze(0) if len(a_shape) == 1 else a
    b2 = b.unsqueeze(-1) if len(b_shape) == 1 else b
    grad_a = grad_b = None
    if need_a:
        ga = mm(g, b2.transpose(-1, -2))  # N-D grad @ a matrix: folded into one product
        grad_a = ga.sum_to_size(a2.shape).reshape(a_shape)
    if need_b:
        if b2.dim() == 2 and a2.dim() > 2:
            # one product over every row: (K, rows) @ (rows, N), K of the weight gradient = tokens
            gb = mm(flat_rows(a2).transpose(0, 1), flat_rows(g))
        else:
            gb = mm(a2.transpose(-1, -2), g).sum_to_size(b2.shape)
        grad_b = gb.reshape(b_shape)
    return grad_a, grad_b


def linear_grads(mm, x, w, g, need_x: bool, need_w: bool):
    """(grad_x, grad_weight) of ``x @ w.t()`` (a bias's: :func:`bias_grad`)."""
    grad_x = mm(g, w) if need_x else None  # folded: (..., N) @ (N, K)
    grad_w = mm(flat_rows(g).t(), flat_rows(x)) if need_w else None  # (N, rows) @ (rows, K)
    return grad_x, grad_w


# ---------------------------------------------------------------------------------------------
# eager autograd

def _eager_mm(precision: str):
    def mm(x, y):
        if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):  # double backward
            return _Matmul.apply(x, y, precision)
        return compute(x, y, None, precision)
    return mm


#: The backward passes' product functions, one per (resolved) precision, made once.
_EAGER_MM = {precision: _eager_mm(precision) for precision in PRECISIONS}

# torch.autograd.Function.apply is a Python wrapper (torch/autograd/function.py) around the C-level
# apply: a few us a call, a fair share of an enqueue-bound product's host time. Where no functorch
# transform is active it does no more than unwrap dead functorch wrappers (tensors that outlived
# their transform) and call it, since these Functions define no setup_context: so the eager route
# does that itself (``_c_apply``). Inside a transform torch serves the call instead
# (:func:`torch_in_transform`: the wrapper would refuse these Functions). A torch without
# ``unwrap_if_dead`` takes the wrapper.
_unwrap = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)


def torch_in_transform(precision: str, t: torch.Tensor, fn):
    """``fn()``, torch's own op for the call, at ``precision`` (tf32x3 as full fp32): the route
    under a torch.func transform. Its wrapped tensors have no data pointer for fastmm's kernels,
    and fastmm's autograd Functions have no functorch rules (they would raise), so torch serves
    the call, as the transform expects. Torch function modes are off for it (a ``use_fastmm``
    block would route it back here)."""
    with torch_precision(precision if t.is_cuda else None), torch._C.DisableTorchFunction():
        return fn()


def _c_apply(fn: type):
    """``fn``'s C-level apply (torch._C._FunctionBase.apply bound to ``fn``)."""
    return super(torch.autograd.Function, fn).apply


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, precision):
        ctx.precision = precision
        ctx.save_for_backward(a, b)
        return compute(a, b, None, precision)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        grad_a, grad_b = matmul_grads(_EAGER_MM[ctx.precision], a, b, g, *ctx.needs_input_grad[:2])
        return grad_a, grad_b, None


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, precision):
        ctx.precision, ctx.bias_shape = precision, None if bias is None else bias.shape
        ctx.save_for_backward(x, w)
        return compute_linear(x, w, bias, precision)

    @staticmethod
    def backward(ctx, g):
        return _eager_linear_backward(ctx, g, linear_grads, False)


def _eager_linear_backward(ctx, g, formula, in_out: bool):
    """A Linear-form layer's backward (``formula``: :func:`linear_grads`, or :func:`in_out_grads`
    for w stored [in, out]): a repeat layout's two products from one remembered entry (one key,
    no views: fastmm.fast_path.linear_backward); a double backward (grad enabled here) the
    formula, whose products record autograd."""
    x, w = ctx.saved_tensors
    nx, nw, nb = ctx.needs_input_grad[:3]
    mm = _EAGER_MM[ctx.precision]
    if torch.is_grad_enabled():
        grads = formula(mm, x, w, g, nx, nw)
    else:
        grads = (None, None) if not (nx or nw) else fast_path.linear_backward(
            g, x, w, ctx.precision, nx, nw, lambda: formula(mm, x, w, g, nx, nw), in_out)
    return grads + (bias_grad(g, ctx.bias_shape) if nb else None, None)


def bias_grad(g: torch.Tensor, shape) -> torch.Tensor:
    """The gradient of a bias of ``shape`` added to every row of the output (gradient ``g``): g's
    rows summed (F.linear's bias, one value a column), or for a bias that broadcasts otherwise
    (a (1, N) row, a scalar) g summed to its shape. The rows are summed over g's leading dims as
    they are, not over a flattened view: no view to make (~1.5 us a call on the host), and no
    copy where those dims do not merge (a seq-first g)."""
    # (a 1-D g is its own row sum: sum over dims () would sum it all)
    grad = g.sum(0) if g.dim() == 2 else g.sum(tuple(range(g.dim() - 1))) if g.dim() > 2 else g
    if grad.shape == shape:
        return grad
    if len(shape) > g.dim() or not all(s in (1, d) for s, d in zip(reversed(shape), reversed(g.shape))):
        # (F.linear's fold: the bias was added to the (rows, N) product, as addmm adds it: a
        # (1, N) bias on a 1-D x, whose output is (N,), or a (rows, 1) one)
        g = g.reshape(-1, g.shape[-1])
    return g.sum_to_size(shape)


def in_out_grads(mm, x, w, g, need_x: bool, need_w: bool):
    """(grad_x, grad_weight) of ``x @ w``, w stored [in, out] (GPT-2's Conv1D): the weight's
    gradient x^T g in w's own layout."""
    grad_x = mm(g, w.t()) if need_x else None  # folded: (..., N) @ (N, K)
    grad_w = mm(flat_rows(x).t(), flat_rows(g)) if need_w else None  # (K, rows) @ (rows, N)
    return grad_x, grad_w


class _LinearInOut(torch.autograd.Function):
    """``x @ w + bias`` with w stored [in, out]: forward F.linear's product on w.t()'s view (the
    bias fused, x's rows folded), backward :func:`in_out_grads` (from one remembered entry on a
    repeat, as :class:`_Linear`'s)."""

    @staticmethod
    def forward(ctx, x, w, bias, precision):
        ctx.precision, ctx.bias_shape = precision, None if bias is None else bias.shape
        ctx.save_for_backward(x, w)
        return compute_linear(x, w.t(), bias, precision)

    @staticmethod
    def backward(ctx, g):
        return _eager_linear_backward(ctx, g, in_out_grads, True)


class _Addmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, c, a, b, beta, alpha, precision):
        ctx.precision, ctx.beta, ctx.alpha, ctx.c_shape = precision, beta, alpha, c.shape
        ctx.save_for_backward(a, b)
        return compute_fused(a, b, c, alpha, beta, precision)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        nc, na, nb = ctx.needs_input_grad[:3]
        return _addmm_grads(_EAGER_MM[ctx.precision], a, b, g, ctx.c_shape, ctx.beta, ctx.alpha, nc, na, nb) \
            + (None, None, None)


if _unwrap is None:
    _MATMUL_APPLY, _LINEAR_APPLY, _ADDMM_APPLY = _Matmul.apply, _Linear.apply, _Addmm.apply
    _LINEAR_IN_OUT_APPLY = _LinearInOut.apply

    def _unwrap(t):
        return t
else:
    _MATMUL_APPLY, _LINEAR_APPLY, _ADDMM_APPLY = _c_apply(_Matmul), _c_apply(_Linear), _c_apply(_Addmm)
    _LINEAR_IN_OUT_APPLY = _c_apply(_LinearInOut)


def _addmm_grads(mm, a, b, g, c_shape, beta, alpha, need_c, need_a, need_b):
    # (beta = 1, the usual addmm, a bias: g itself, as torch's addmm backward: no pass over g)
    grad_c = (g if beta == 1 else g * beta).sum_to_size(c_shape) if need_c else None
    ga, gb = matmul_grads(mm, a, b, g, need_a, need_b)
    if alpha != 1:
        ga = ga * alpha if ga is not None else None
        gb = gb * alpha if gb is not None else None
    return grad_c, ga, gb


def matmul_autograd(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    """``a @ b`` with gradients: the eager route, or the registered op where it must be."""
    if use_registered_op(a, b):
        return torch.ops.fastmm.matmul(a, b, precision)
    if transform_active():
        return torch_in_transform(precision, a, lambda: torch.matmul(a, b))
    return _MATMUL_APPLY(_unwrap(a), _unwrap(b), precision)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           precision: str | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on fastmm: ``x @ weight.t()`` (weight read in place) plus the
    bias, with gradients where they are needed."""
    precision = resolve_precision(precision)
    if autocast_half_active_on(x):  # autocast owns the dtype: torch computes in half
        return torch.nn.functional.linear(x, weight, bias)
    if use_registered_op(x, weight, bias):
        return torch.ops.fastmm.linear(x, weight, bias, precision)
    return linear_eager(x, weight, bias, precision)


def linear_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, precision: str) -> torch.Tensor:
    """:func:`linear`'s eager route, for callers that made its checks already (plain tensors,
    no autocast to a half dtype, not compiling, no dispatch mode; ``precision`` resolved):
    ``fastmm.nn.Linear`` runs it on every call of every layer, so nothing is checked twice."""
    if transform_active():
        return torch_in_transform(precision, x, lambda: torch.nn.functional.linear(x, weight, bias))
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                         or (bias is not None and bias.requires_grad))):
        return compute_linear(x, weight, bias, precision)
    return _LINEAR_APPLY(_unwrap(x), _unwrap(weight), None if bias is None else _unwrap(bias), precision)


def linear_in_out_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        precision: str) -> torch.Tensor:
    """``x @ weight + bias`` with weight stored [in, out] (GPT-2's Conv1D), on the eager route (its
    caller made :func:`linear_eager`'s checks): F.linear's product on weight.t()'s view, and with
    gradients :class:`_LinearInOut`, whose weight gradient comes out in weight's own layout."""
    if transform_active():
        return torch_in_transform(precision, x, lambda: torch.nn.functional.linear(x, weight.t(), bias))
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                         or (bias is not None and bias.requires_grad))):
        return compute_linear(x, weight.t(), bias, precision)
    return _LINEAR_IN_OUT_APPLY(_unwrap(x), _unwrap(weight), None if bias is None else _unwrap(bias), precision)


def addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1,
          precision: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.addmm(c, a, b, beta=beta, alpha=alpha, out=out)`` on fastmm: beta * c + alpha * (a @ b),
    with a and b matrices and c broadcastable to the result. ``out`` follows torch's rules
    (resized if its shape differs, with torch's warning when it had elements; no autograd); the
    result is computed aside and copied in, so an ``out`` that overlaps an input is safe."""
    precision = resolve_precision(precision)
    if out is not None:  # (out='s own errors come first, as torch's; then the shapes, with out)
        return _addmm_into(out, c, a, b, beta, alpha, precision)
    _check_addmm(c, a, b)
    if autocast_half_active_on(a):  # autocast owns the dtype: torch computes in half
        return torch.addmm(c, a, b, beta=beta, alpha=alpha)
    if transform_active():
        return torch_in_transform(precision, a, lambda: torch.addmm(c, a, b, beta=beta, alpha=alpha))
    if use_registered_op(c, a, b):
        return torch.ops.fastmm.addmm(c, a, b, beta, alpha, precision)
    if torch.is_grad_enabled() and (c.requires_grad or a.requires_grad or b.requires_grad):
        return _ADDMM_APPLY(_unwrap(c), _unwrap(a), _unwrap(b), beta, alpha, precision)
    return compute_fused(a, b, c, alpha, beta, precision)


def _addmm_into(out: torch.Tensor, c, a, b, beta, alpha, precision: str) -> torch.Tensor:
    if torch.is_grad_enabled() and any(t.requires_grad for t in (out, c, a, b)):
        raise RuntimeError("addmm(): functions with out=... arguments don't support automatic differentiation, "
                           "but one of the arguments requires grad.")
    if out.dtype != a.dtype or out.device != a.device or autocast_half_active(a.device.type):
        return torch.addmm(c, a, b, beta=beta, alpha=alpha, out=out)  # torch's rules and errors
    if not _addmm_shapes_ok(c, a, b):  # (torch's words for the call with out=: it resizes out first)
        raise_torch_error(torch.addmm, c, a, b, beta=beta, alpha=alpha, out=out)
    result = addmm(c, a, b, beta=beta, alpha=alpha, precision=precision)
    resize_out(out, tuple(result.shape))
    return out.copy_(result)


def _addmm_shapes_ok(c, a, b) -> bool:
    """torch.addmm's shape rules (mat1 and mat2 matrices of a common K; C expanded to the
    product's shape: at most 2 dims, each equal or 1), written out: torch.broadcast_shapes cost
    ~8 us a call, a third of a decode-sized addmm's host time (NOTES run 28), and let a C through
    that expand refuses."""
    return a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0] and addmm_bias_fits(c, a.shape[0], b.shape[1])


def _check_addmm(c, a, b) -> None:
    """:func:`_addmm_shapes_ok`, in torch.addmm's own words where a rule fails
    (shapes.raise_torch_error: nothing is computed)."""
    if not _addmm_shapes_ok(c, a, b):
        raise_torch_error(torch.addmm, c, a, b)


# ---------------------------------------------------------------------------------------------
# the registered ops

def matmul_body(a: torch.Tensor, b: torch.Tensor, precision: Optional[str] = None) -> torch.Tensor:
    precision = resolve_precision(precision)  # an unknown name is a ValueError here
    result = compute(a, b, None, precision)
    # A fresh, contiguous tensor on every path: what the fake below promises.
    return result.contiguous() if not result.is_contiguous() else result


matmul_op = torch.library.custom_op("fastmm::matmul", matmul_body, mutates_args=())


@matmul_op.register_fake
def _(a, b, precision=None):
    torch._check(a.dtype == b.dtype, lambda: f"expected a and b to have the same dtype, but got: {a.dtype} != {b.dtype}")
    return a.new_empty(analyse(a, b).out_shape)


@torch.library.custom_op("fastmm::matmul_out", mutates_args={"out"})
def matmul_out_op(a: torch.Tensor, b: torch.Tensor, precision: Optional[str], out: torch.Tensor) -> None:
    compute(a, b, out, resolve_precision(precision))


@matmul_out_op.register_fake
def _(a, b, precision, out):
    return None


def _op_mm(precision):
    return lambda x, y: torch.ops.fastmm.matmul(x, y, precision)


def _matmul_setup(ctx, inputs, output):
    a, b, precision = inputs
    ctx.precision = precision
    ctx.save_for_backward(a, b)


def _matmul_backward(ctx, g):
    a, b = ctx.saved_tensors
    grad_a, grad_b = matmul_grads(_op_mm(ctx.precision), a, b, g, *ctx.needs_input_grad[:2])
    return grad_a, grad_b, None


matmul_op.register_autograd(_matmul_backward, setup_context=_matmul_setup)


def linear_body(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                precision: Optional[str] = None) -> torch.Tensor:
    result = compute_linear(x, weight, bias, resolve_precision(precision))
    return result.contiguous() if not result.is_contiguous() else result


linear_op = torch.library.custom_op("fastmm::linear", linear_body, mutates_args=())


@linear_op.register_fake
def _(x, weight, bias=None, precision=None):
    torch._check(x.dtype == weight.dtype, lambda: f"expected x and weight to have the same dtype, but got: "
                                                  f"{x.dtype} != {weight.dtype}")
    torch._check(weight.dim() == 2, lambda: "weight must be a matrix")
    # (F.linear's own shape rules and errors on the fakes, what the op follows: a traced graph
    # fails where eager does, and a bias of more than one dim gets F.linear's result shape)
    return x.new_empty(torch.nn.functional.linear(x, weight, bias).shape)


def _linear_setup(ctx, inputs, output):
    x, weight, bias, precision = inputs
    ctx.precision, ctx.bias_shape = precision, None if bias is None else bias.shape
    ctx.save_for_backward(x, weight)


def _linear_backward(ctx, g):
    x, w = ctx.saved_tensors
    nx, nw, nb = ctx.needs_input_grad[:3]
    if nx and nw and not torch.is_grad_enabled() and w.dim() == 2 and g.shape == x.shape[:-1] + w.shape[:1]:
        # (a compiled graph's backward, traced with grad mode off: one op call for both products;
        # a double backward, grad mode on, takes the differentiable products one by one)
        grads = torch.ops.fastmm.linear_grads(g, x, w, ctx.precision)
    else:
        grads = linear_grads(_op_mm(ctx.precision), x, w, g, nx, nw)
    return grads + (bias_grad(g, ctx.bias_shape) if nb else None, None)


linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


def linear_grads_body(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      precision: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight) of ``x @ weight.t()`` for the output gradient ``g`` (g of x's
    leading shape by weight's rows), in one call: the registered linear's backward where both are
    needed and grad mode is off (a compiled graph's). One call of an op where two were made, each
    ~10-15 us of dispatcher and Python on the GPU machine's host (NOTES.md run 51), and both
    products launched from one remembered entry (fastmm.fast_path.linear_backward). Not
    differentiable itself: a double backward takes the product ops one by one."""
    precision = resolve_precision(precision)
    if not _linear_grads_dtypes_fit(g, x, weight):  # (the fake's checks, in its words)
        raise RuntimeError(_linear_grads_dtypes(g, x, weight))
    if not _linear_grads_shapes_fit(g, x, weight):
        raise RuntimeError(_linear_grads_shapes(g, x, weight))

    def mm(a, b):  # (no autograd here: the op's inputs may require grad, its body records none)
        return compute(a, b, None, precision)

    grad_x, grad_w = fast_path.linear_backward(g, x, weight, precision, True, True,
                                               lambda: linear_grads(mm, x, weight, g, True, True))
    return (grad_x if grad_x.is_contiguous() else grad_x.contiguous(),
            grad_w if grad_w.is_contiguous() else grad_w.contiguous())


def _linear_grads_shapes_fit(g, x, weight) -> bool:
    return (weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1]
            and g.shape == x.shape[:-1] + weight.shape[:1])


def _linear_grads_dtypes_fit(g, x, weight) -> bool:
    return g.dtype == x.dtype and x.dtype == weight.dtype


def _linear_grads_dtypes(g, x, weight) -> str:
    return f"expected g, x and weight to have one dtype, but got: {g.dtype}, {x.dtype}, {weight.dtype}"


def _linear_grads_shapes(g, x, weight) -> str:
    return (f"linear_grads: g {tuple(g.shape)} is not the gradient of x {tuple(x.shape)} @ "
            f"weight {tuple(weight.shape)}.t()")


linear_grads_op = torch.library.custom_op("fastmm::linear_grads", linear_grads_body, mutates_args=())


@linear_grads_op.register_fake
def _(g, x, weight, precision=None):
    torch._check(_linear_grads_dtypes_fit(g, x, weight), lambda: _linear_grads_dtypes(g, x, weight))
    torch._check(_linear_grads_shapes_fit(g, x, weight), lambda: _linear_grads_shapes(g, x, weight))
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def addmm_body(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1.0, alpha: float = 1.0,
               precision: Optional[str] = None) -> torch.Tensor:
    precision = resolve_precision(precision)
    _check_addmm(c, a, b)
    result = compute_fused(a, b, c, alpha, beta, precision)
    return result.contiguous() if not result.is_contiguous() else result


addmm_op = torch.library.custom_op("fastmm::addmm", addmm_body, mutates_args=())


@addmm_op.register_fake
def _(c, a, b, beta=1.0, alpha=1.0, precision=None):
    _check_addmm(c, a, b)  # (what the op itself checks: a traced graph fails where eager does)
    return a.new_empty((a.shape[0], b.shape[1]))


def _addmm_setup(ctx, inputs, output):
    c, a, b, beta, alpha, precision = inputs
    ctx.precision, ctx.beta, ctx.alpha, ctx.c_shape = precision, beta, alpha, c.shape
    ctx.save_for_backward(a, b)


def _addmm_backward(ctx, g):
    a, b = ctx.saved_tensors
    nc, na, nb = ctx.needs_input_grad[:3]
    return _addmm_grads(_op_mm(ctx.precision), a, b, g, ctx.c_shape, ctx.beta, ctx.alpha, nc, na, nb) \
        + (None, None, None)


addmm_op.register_autograd(_addmm_backward, setup_context=_addmm_setup)


# ---------------------------------------------------------------------------------------------
# the registered ops' calls that need no autograd, straight to their bodies

def _direct_kernel(opdef, body, backend: str):
    """An Autograd<backend> kernel for the custom op ``opdef``: a call that needs no gradient
    (grad mode off, or no input requiring one), on plain tensors of ``backend`` with no mode,
    functionalization or tracing below autograd, and outside Dynamo's frame evaluation, goes
    straight to ``body``; any other call takes the autograd layer torch.library.custom_op
    builds (``make_autograd_impl``, the same one the op registers for itself).

    Why: a compiled graph (AOTAutograd's forward and backward run with grad mode off) calls
    the registered ops at every step, and custom_op's layer costs two Python kernels per call
    (the autograd one, which redispatches below autograd, then the backend one with its
    aliasing check and Dynamo guard): fastmm.linear's op without grad, launches stubbed, 12.1 us
    a call through that layer against 8.2 this way, a compiled Linear step 237 against 203
    (CPU, torch 2.13; NOTES.md run 50). A 1024-token BERT step calls the ops ~230 times. The
    checks here are what keeps every other call on the general path:
    a keyset with anything between autograd and the backend (the Python key of fake tensors
    and dispatch modes such as FlopCounterMode, Functionalize), a tensor that needs grad, or
    Dynamo evaluating frames (a call from a function compiled around, e.g. one under
    ``torch.compiler.disable(recursive=False)``: Dynamo would trace the body's frames). What the
    route leaves out of custom_op's backend wrapper: its aliasing check (the bodies return fresh
    tensors), ``set_kernel_enabled`` and kernels added by ``register_kernel`` (fastmm uses
    neither)."""
    from torch._library.autograd import make_autograd_impl  # (private: see _register_direct_kernels)

    general = make_autograd_impl(opdef._opoverload, opdef)
    after_autograd = torch._C._after_autograd_keyset
    plain = getattr(torch._C.DispatchKey, backend)
    any_requires_grad = torch._C._any_requires_grad
    dynamo_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback

    below_autograd = torch._C._AutoDispatchBelowAutograd
    # Whether a keyset has nothing between autograd and the backend, by the keyset's raw bits:
    # one C call (~0.1 us here) where the test itself takes three and an enum comparison (0.7
    # us here, 3.7 on the H100 machine's host), on every call of a compiled graph's ops.
    plain_below: dict[int, bool] = {}
    raw_repr = torch._C.DispatchKeySet.raw_repr  # (read here: a torch without it keeps the general path)

    def kernel(keyset, *args, **kwargs):
        raw = raw_repr(keyset)
        below = plain_below.get(raw)
        if below is None:
            if len(plain_below) >= 64:  # (a handful in practice: the bound only keeps it small)
                plain_below.clear()
            below = plain_below[raw] = (keyset & after_autograd).highestPriorityTypeId() == plain
        if below and dynamo_callback() is None and not (torch.is_grad_enabled() and any_requires_grad(*args)):
            with below_autograd():  # (as the general path runs it: no autograd, forward-mode AD included, inside)
                return body(*args, **kwargs)
        return general(keyset, *args, **kwargs)

    return kernel


_DIRECT = torch.library.Library("fastmm", "IMPL")  # (kept alive: the registrations live as long as it)


def _register_direct_kernels() -> bool:
    """:func:`_direct_kernel` for the functional ops on CUDA and CPU (where the emulated GPU's
    tests run it). It reads torch internals (``torch._library.autograd.make_autograd_impl``,
    the keyset constants, Dynamo's callback): a torch without them keeps custom_op's own layer,
    which is correct, only slower."""
    try:
        kernels = [(opdef._name, _direct_kernel(opdef, body, backend), "Autograd" + backend)
                   for opdef, body in ((matmul_op, matmul_body), (linear_op, linear_body), (addmm_op, addmm_body),
                                       (linear_grads_op, linear_grads_body))
                   for backend in ("CUDA", "CPU")]
    except (ImportError, AttributeError):
        return False
    for name, kernel, key in kernels:
        _DIRECT.impl(name, kernel, key, with_keyset=True)
    return True


DIRECT_KERNELS = _register_direct_kernels()


# ---------------------------------------------------------------------------------------------
# FLOP formulas, so torch.utils.flop_counter.FlopCounterMode counts fastmm's products (the mode
# sees the op, not the kernels inside it)

def _register_flop_formulas() -> None:
    try:
        from torch.utils.flop_counter import register_flop_formula
    except ImportError:  # an older torch
        return

    def product_flops(a_shape, k: int, out_shape) -> int:
        return 2 * math.prod(out_shape) * k

    @register_flop_formula(torch.ops.fastmm.matmul)
    def _(a_shape, b_shape, *args, out_shape=None, **kwargs):
        return product_flops(a_shape, a_shape[-1], out_shape)

    @register_flop_formula(torch.ops.fastmm.linear)
    def _(x_shape, w_shape, *args, out_shape=None, **kwargs):
        return product_flops(x_shape, x_shape[-1], out_shape)

    @register_flop_formula(torch.ops.fastmm.linear_grads)
    def _(g_shape, x_shape, w_shape, *args, out_shape=None, **kwargs):
        return 2 * product_flops(x_shape, w_shape[0], x_shape)  # two products of x's rows x N x K

    @register_flop_formula(torch.ops.fastmm.addmm)
    def _(c_shape, a_shape, b_shape, *args, out_shape=None, **kwargs):
        return product_flops(a_shape, a_shape[-1], out_shape)


_register_flop_formulas()
