"""``fastmm.matmul``: torch.matmul's semantics on fastmm's kernels.

The one public entry of a call. It applies torch's type rules, resolves the precision, routes
calls that need gradients to autograd (:mod:`fastmm.ops`) and calls under torch.compile to the
opaque custom op, and computes the rest through :func:`fastmm.fast_path.compute` (the
steady-state entry of a layout seen before, else the full path of :mod:`fastmm.dispatch`).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from . import ops
from .dispatch import torch_matmul, transform_active
from .errors import FastmmWarning  # noqa: F401  (re-exported: fastmm.FastmmWarning)
from .fast_path import compute
from .precision import autocast_any_half_active, autocast_half_active_on, resolve_precision, resolve_precision_eager
from .shapes import PLAIN_TYPES, analyse, resize_out


def matmul(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None,
           precision: str | None = None) -> torch.Tensor:
    """``torch.matmul(a, b, out=out)`` on fastmm's kernels.

    ``precision``: ``None`` follows ``torch.get_float32_matmul_precision()``; ``"ieee"`` full fp32;
    ``"tf32"`` tensor cores with inputs rounded to TF32; ``"tf32x3"`` tensor cores with fp32-level
    accuracy. Inputs fastmm's kernels cannot serve (CPU tensors, other dtypes, no NVRTC, ...) go to
    ``torch.matmul``; :func:`explain` says which and why.
    """
    if type(a) in PLAIN_TYPES and type(b) in PLAIN_TYPES and (out is None or type(out) in PLAIN_TYPES) \
            and not torch.compiler.is_compiling() and not is_in_torch_dispatch_mode() and not transform_active():
        # Plain tensors in eager mode, the usual call: the tests below, each made once (this
        # path runs on every product of a decode step, where the host time is the step's time)
        precision = resolve_precision_eager(precision)
        if autocast_any_half_active(a) or a.is_nested or b.is_nested:  # (nested: ragged, torch's)
            return torch_matmul(a, b, out)
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            return torch_matmul(a, b, out) if out is not None else ops.matmul_autograd(a, b, precision)
        return compute(a, b, out, precision)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or (
            out is not None and not isinstance(out, torch.Tensor)):
        return torch_matmul(a, b, out)  # torch words the type error
    precision = resolve_precision(precision)
    if autocast_half_active_on(a) or a.is_nested or b.is_nested:  # autocast decides the dtype; fastmm is float32 only
        return torch_matmul(a, b, out)
    if transform_active() and not torch.compiler.is_compiling():  # (torch.func: torch serves it)
        return ops.torch_in_transform(precision, a, lambda: torch_matmul(a, b, out))
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        if out is not None:  # torch refuses this itself, with its own message
            return torch_matmul(a, b, out)
        return ops.matmul_autograd(a, b, precision)
    if ops.use_registered_op(a, b):
        # torch.compile, fake tensors and dispatch modes see one opaque custom op (shapes from its
        # fake) instead of the launch path, which reads data pointers such tensors do not have.
        if out is None:
            return torch.ops.fastmm.matmul(a, b, precision)
        resize_out(out, analyse(a, b).out_shape)
        torch.ops.fastmm.matmul_out(a, b, precision, out)
        return out
    return compute(a, b, out, precision)
