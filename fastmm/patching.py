"""Putting fastmm into existing models: swap their ``nn.Linear`` modules, or route the matmuls of a
block of code.

- :func:`patch` / :func:`unpatch`: replace every plain ``torch.nn.Linear`` in a model by
  :class:`fastmm.nn.Linear` (and back), sharing the Parameter objects, so optimizers, tied weights
  and checkpoints are unaffected.
- :func:`use_fastmm`: a ``torch.overrides.TorchFunctionMode`` that routes ``torch.matmul``, ``@``,
  ``torch.mm``, ``torch.bmm`` and ``torch.nn.functional.linear`` (function and method forms) on
  float32 tensors through ``torch.ops.fastmm.matmul`` for a block of code, whichever module
  makes the call (but see below for torch functions written in Python).

What neither reaches: ``nn.MultiheadAttention`` (and so the attention half of ``nn.Transformer*``
layers) keeps its projections in ``in_proj_weight`` and in ``out_proj``, a
``NonDynamicallyQuantizableLinear`` subclass, and computes them in
``F.multi_head_attention_forward`` straight from the weights; ``out_proj.forward`` is never
called, so swapping it would change nothing, and patch leaves it (and every other subclass of
``nn.Linear``) alone. The mode does not reach inside either: a torch function mode sees each
public torch function once, at the outermost level, and ``F.multi_head_attention_forward`` is a
Python function that dispatches ``__torch_function__`` itself, so the mode is handed the whole
call and the matmuls inside it run on torch (torch takes a mode off the stack while its handler
runs).

Inference fast path: in eval mode without grad, ``nn.TransformerEncoderLayer`` runs a fused
kernel that reads ``linear1.weight`` / ``linear2.weight`` directly, bypassing the patched modules
(results are torch's). ``torch.backends.mha.set_fastpath_enabled(False)`` turns that path off; so
does running inside :func:`use_fastmm` (torch skips the fast path while a function mode is active).
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from .api import matmul as _fastmm_matmul
from .api import autocast_half_active, resolve_precision
from .nn import Linear, plain_tensor

__all__ = ["patch", "unpatch", "use_fastmm", "FastmmMode"]


# ---------------------------------------------------------------------------------------------
# module swapping

def _swap(model: torch.nn.Module, source: type, convert) -> torch.nn.Module:
    """Replace every child whose type is exactly ``source`` by ``convert(child)``. A module that
    appears at several places (shared) becomes one new module at all of them."""
    if type(model) is source:
        return convert(model)
    done: dict[int, torch.nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and type(child) is source:
                new = done.get(id(child))
                if new is None:
                    new = done[id(child)] = convert(child)
                setattr(parent, name, new)
    return model


def patch(model: torch.nn.Module, precision: str | None = None) -> torch.nn.Module:
    """Swap every ``torch.nn.Linear`` in ``model`` (exact type; subclasses and modules already
    patched are left alone) for a :class:`fastmm.nn.Linear` that uses the same Parameters.

    Works in place and returns ``model``; if ``model`` itself is an ``nn.Linear`` the converted
    module is returned (use the return value). ``precision`` is given to every swapped layer
    (``None``: follow ``torch.set_float32_matmul_precision`` at call time).
    """
    if precision is not None:
        resolve_precision(precision)
    return _swap(model, torch.nn.Linear, lambda m: Linear.from_linear(m, precision=precision))


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: every :class:`fastmm.nn.Linear` becomes a plain ``torch.nn.Linear`` with
    the same Parameters. In place; returns ``model`` (or the converted module if ``model`` is one)."""
    return _swap(model, Linear, Linear.to_linear)


# ---------------------------------------------------------------------------------------------
# the function mode

def _operands(args, kwargs, first: str, second: str, allowed: tuple[str, ...] = ()):
    """(a, b, extra kwargs) from a call like ``f(a, b, **kw)``, or None for any other form."""
    if len(args) > 2 or any(k not in (first, second) + allowed for k in kwargs):
        return None
    names = (first, second)
    values = list(args) + [kwargs.get(n) for n in names[len(args):]]
    if any(n in kwargs for n in names[:len(args)]) or values[0] is None or values[1] is None:
        return None
    return values[0], values[1], {k: v for k, v in kwargs.items() if k in allowed}


class FastmmMode(TorchFunctionMode):
    """Routes matmuls on float32 tensors of the chosen device types through fastmm (see
    :func:`use_fastmm`). Everything else goes to the original torch function untouched."""

    def __init__(self, precision: str | None = None, devices: tuple[str, ...] = ("cuda",)) -> None:
        super().__init__()
        if precision is not None:
            resolve_precision(precision)
        self.precision = precision
        self.devices = tuple(devices)

    # torch runs this with the mode taken off the mode stack, so the torch calls made here (and
    # inside the fastmm op) are not intercepted again.
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = _ROUTES.get(func)
        if route is not None:
            result = route(self, args, kwargs)
            if result is not NotImplemented:
                return result
        return func(*args, **kwargs)

    def _takes(self, *tensors) -> bool:
        a = tensors[0]
        if not all(plain_tensor(t) for t in tensors):
            return False
        dev = a.device
        return dev.type in self.devices and all(t.device == dev for t in tensors) \
            and not autocast_half_active(dev.type)

    def _mm(self, a, b):
        return torch.ops.fastmm.matmul(a, b, resolve_precision(self.precision))

    # one handler per call form; NotImplemented hands the call to torch as it was made

    def _matmul(self, args, kwargs, swap: bool = False):
        ops = _operands(args, kwargs, "input", "other", ("out",))
        if ops is None:
            return NotImplemented
        a, b, extra = ops
        if swap:
            a, b = b, a
        out = extra.get("out")
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() == 0 or b.dim() == 0:
            return NotImplemented
        if not self._takes(a, b, *(() if out is None else (out,))):
            return NotImplemented
        if out is not None:
            return _fastmm_matmul(a, b, out=out, precision=self.precision)
        return self._mm(a, b)

    def _rmatmul(self, args, kwargs):
        return self._matmul(args, kwargs, swap=True)

    def _fixed(self, args, kwargs, dims: int):
        ops = _operands(args, kwargs, "input", "mat2")
        if ops is None:
            return NotImplemented
        a, b, _ = ops
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() != dims or b.dim() != dims:
            return NotImplemented
        # torch.mm / torch.bmm do not broadcast: anything but exact shapes gets torch's own error
        if a.shape[-1] != b.shape[-2] or (dims == 3 and a.shape[0] != b.shape[0]) or not self._takes(a, b):
            return NotImplemented
        return self._mm(a, b)

    def _mm_call(self, args, kwargs):
        return self._fixed(args, kwargs, 2)

    def _bmm_call(self, args, kwargs):
        return self._fixed(args, kwargs, 3)

    def _linear(self, args, kwargs):
        if len(args) > 3 or any(k not in ("input", "weight", "bias") for k in kwargs):
            return NotImplemented
        names = ("input", "weight", "bias")
        if any(n in kwargs for n in names[:len(args)]):
            return NotImplemented
        x, w, bias = (list(args) + [kwargs.get(n) for n in names[len(args):]])[:3]
        if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() == 0 or w.dim() != 2 \
                or x.shape[-1] != w.shape[1]:
            return NotImplemented
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (w.shape[0],)):
            return NotImplemented  # unusual bias shapes: torch's broadcasting rules and errors
        if not self._takes(x, w, *(() if bias is None else (bias,))):
            return NotImplemented
        out = self._mm(x, w.t())
        return out if bias is None else out + bias


_T = torch.Tensor
_ROUTES = {
    torch.matmul: FastmmMode._matmul,
    _T.matmul: FastmmMode._matmul,
    _T.__matmul__: FastmmMode._matmul,
    _T.__rmatmul__: FastmmMode._rmatmul,
    torch.mm: FastmmMode._mm_call,
    _T.mm: FastmmMode._mm_call,
    torch.bmm: FastmmMode._bmm_call,
    _T.bmm: FastmmMode._bmm_call,
    torch.nn.functional.linear: FastmmMode._linear,
}


def use_fastmm(precision: str | None = None, *, devices: tuple[str, ...] = ("cuda",)) -> FastmmMode:
    """Route matmuls through fastmm for a block of code::

        with fastmm.use_fastmm():              # or use_fastmm("tf32")
            y = model(x)                       # torch.matmul, @, mm, bmm, F.linear -> fastmm
            y.sum().backward()                 # the backward of those calls runs on fastmm too

    Routed: ``torch.matmul`` / ``Tensor.matmul`` / ``@``, ``torch.mm`` / ``Tensor.mm``,
    ``torch.bmm`` / ``Tensor.bmm`` and ``torch.nn.functional.linear`` (bias added right after), when
    all tensors are plain float32 tensors on one device whose type is in ``devices`` (default
    CUDA; add ``"cpu"`` to exercise the path where fastmm's op falls back to ``torch.matmul``).
    Everything else - other dtypes, tensor subclasses, calls under ``torch.autocast`` with a half
    dtype for that device, ``out=`` tensors of other types, unusual call forms - goes to the
    original torch function unchanged, so errors and results are torch's own. Matmuls made
    inside torch functions that are written in Python and dispatch ``__torch_function__``
    themselves (``F.multi_head_attention_forward``) stay on torch: the mode sees only the outer call.

    ``precision``: ``None`` follows ``torch.set_float32_matmul_precision`` at each call.
    Returns the mode; ``with`` enters it (it nests with other torch function modes).
    """
    return FastmmMode(precision, devices)
