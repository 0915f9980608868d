"""fastmm as torch.library custom ops, so models can use it under autograd, torch.compile and
CUDA graphs.

- ``fastmm::matmul(a, b, precision) -> Tensor``: functional, allocates its (contiguous) result.
- ``fastmm::matmul_out(a, b, precision, out) -> ()``: writes into ``out`` (already the right
  shape: :func:`fastmm.matmul` applies torch's resize rules before calling it).
Both run fastmm kernels where they can and torch.matmul elsewhere (CPU tensors included), so
they are usable - and testable with ``torch.library.opcheck`` - everywhere.
"""
from __future__ import annotations

import torch

from .api import analyse, matmul_fastmm, resolve_precision


@torch.library.custom_op("fastmm::matmul", mutates_args=())
def matmul_op(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    resolve_precision(precision)  # an unknown name is a ValueError here, not a KeyError in the planner
    result, _, _ = matmul_fastmm(a, b, None, precision)
    # A fresh, contiguous tensor on every path: what the fake below promises.
    return result.contiguous() if not result.is_contiguous() else result


@matmul_op.register_fake
def _(a, b, precision):
    torch._check(a.dtype == b.dtype, lambda: f"expected a and b to have the same dtype, but got: {a.dtype} != {b.dtype}")
    return a.new_empty(analyse(a, b).out_shape)


@torch.library.custom_op("fastmm::matmul_out", mutates_args={"out"})
def matmul_out_op(a: torch.Tensor, b: torch.Tensor, precision: str, out: torch.Tensor) -> None:
    resolve_precision(precision)
    matmul_fastmm(a, b, out, precision)


@matmul_out_op.register_fake
def _(a, b, precision, out):
    return None


def _setup_context(ctx, inputs, output):
    a, b, precision = inputs
    ctx.precision = precision
    ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None)
    ctx.a_shape, ctx.b_shape = a.shape, b.shape


def _backward(ctx, grad):
    """grad_a = grad @ b^T, grad_b = a^T @ grad, through fastmm itself on transposed views (no
    copies), then summed over the batch dims that were broadcast, back to each input's shape."""
    a, b = ctx.saved_tensors
    a_shape, b_shape = ctx.a_shape, ctx.b_shape
    g = grad
    # Restore the squeezed N dim before the M dim: for 1-D @ 1-D the grad is 0-d, and only this
    # order turns it into the (1, 1) matrix the products below expect.
    if len(b_shape) == 1:
        g = g.unsqueeze(-1)
    if len(a_shape) == 1:
        g = g.unsqueeze(-2)
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        b2 = b.unsqueeze(-1) if len(b_shape) == 1 else b
        ga = torch.ops.fastmm.matmul(g, b2.transpose(-1, -2), ctx.precision)
        a2_shape = (1,) + tuple(a_shape) if len(a_shape) == 1 else tuple(a_shape)
        grad_a = ga.sum_to_size(a2_shape).reshape(a_shape)
    if ctx.needs_input_grad[1]:
        a2 = a.unsqueeze(0) if len(a_shape) == 1 else a
        gb = torch.ops.fastmm.matmul(a2.transpose(-1, -2), g, ctx.precision)
        b2_shape = tuple(b_shape) + (1,) if len(b_shape) == 1 else tuple(b_shape)
        grad_b = gb.sum_to_size(b2_shape).reshape(b_shape)
    return grad_a, grad_b, None


matmul_op.register_autograd(_backward, setup_context=_setup_context)


def matmul_autograd(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    return torch.ops.fastmm.matmul(a, b, precision)
