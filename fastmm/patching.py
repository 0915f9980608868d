"""Putting fastmm into existing models: convert their matmul modules, or route the matmuls of a
block of code.

- :func:`patch` / :func:`unpatch`: every plain ``torch.nn.Linear`` becomes :class:`fastmm.nn.Linear`
  (and back), sharing the Parameter objects; ``nn.MultiheadAttention`` (projections on fastmm,
  attention core on ``F.scaled_dot_product_attention``), GPT-2's ``Conv1D`` where
  ``transformers`` is imported, and any class given to :func:`register` /
  :func:`register_linear_like` are converted in place (their class changes; the object, its
  Parameters, state_dict and hooks stay). Optimizers, tied weights and checkpoints are unaffected.
- :func:`use_fastmm`: a ``torch.overrides.TorchFunctionMode`` that routes ``torch.matmul``, ``@``,
  ``torch.mm``, ``torch.bmm``, ``torch.nn.functional.linear``, ``torch.addmm``, ``torch.baddbmm``
  and ``torch.addbmm`` (function and method forms) on float32 tensors through fastmm for a block
  of code, whichever module makes the call.

What the mode does not reach: torch functions written in Python that dispatch
``__torch_function__`` themselves (``F.multi_head_attention_forward``): a torch function mode
sees each public torch function once, at the outermost level, and torch takes the mode off the
stack while its handler runs, so the matmuls inside run on torch. :func:`patch` converts
``nn.MultiheadAttention`` modules instead. :func:`fastmm.coverage` lists what ran where.

Inference fast path: in eval mode without grad, ``nn.TransformerEncoderLayer`` runs a fused
kernel that reads ``linear1.weight`` / ``linear2.weight`` directly, bypassing the patched modules
(results are torch's). ``torch.backends.mha.set_fastpath_enabled(False)`` turns that path off; so
does running inside :func:`use_fastmm` (torch skips the fast path while a function mode is active).
"""
from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode

from . import ops
from .api import matmul as _fastmm_matmul
from .precision import autocast_half_active, resolve_precision
from .nn import Linear, MultiheadAttention, plain_tensor

__all__ = ["patch", "unpatch", "register", "register_linear_like", "use_fastmm", "FastmmMode"]


# ---------------------------------------------------------------------------------------------
# module swapping

def _swap(model: torch.nn.Module, convert) -> torch.nn.Module:
    """Replace every child that ``convert`` turns into another module (None: leave it). A module
    that appears at several places (shared) becomes one new module at all of them."""
    top = convert(model)
    if top is not None:
        return top
    done: dict[int, torch.nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            new = done.get(id(child))
            if new is None:
                new = convert(child)
                if new is None:
                    continue
                done[id(child)] = new
            setattr(parent, name, new)
    return model


#: class -> its fastmm subclass, for modules converted by changing their class in place (the
#: object, its Parameters, buffers and hooks stay the same; only forward differs).
_SUBCLASSES: dict[type, type] = {}


def register(cls: type, fastmm_cls: type) -> None:
    """Have :func:`patch` convert modules of exactly ``cls`` to ``fastmm_cls`` (a subclass of
    ``cls`` whose ``forward`` computes on fastmm, e.g. with :func:`fastmm.ops.linear` or
    :func:`fastmm.ops.addmm`, and reads ``self.precision``), and :func:`unpatch` back. The
    conversion changes the module's class in place: same object, Parameters, state_dict keys and
    hooks. See :func:`register_linear_like` for the common case."""
    if not (isinstance(cls, type) and isinstance(fastmm_cls, type) and issubclass(fastmm_cls, cls)):
        raise TypeError("register(cls, fastmm_cls): fastmm_cls must be a subclass of cls")
    _SUBCLASSES[cls] = fastmm_cls


def register_linear_like(cls: type, *, weight: str = "weight", bias: str | None = "bias",
                         layout: str = "out_in") -> type:
    """Register a Linear-like module class: its ``forward(x)`` is ``x @ W.t() + b``
    (``layout="out_in"``: W stored [out, in], as nn.Linear) or ``x @ W + b`` (``"in_out"``: W
    stored [in, out], as GPT-2's Conv1D), with W and b the attributes named ``weight`` and
    ``bias`` (``bias=None``: none). Returns the fastmm subclass that :func:`patch` will use."""
    if layout not in ("out_in", "in_out"):
        raise ValueError(f"layout must be 'out_in' or 'in_out', got {layout!r}")

    def forward(self, x):
        w = getattr(self, weight)
        b = getattr(self, bias) if bias is not None else None
        if not (plain_tensor(x) and plain_tensor(w) and (b is None or plain_tensor(b))) or x.dim() == 0 \
                or autocast_half_active(x.device.type):
            return cls.forward(self, x)
        if layout == "out_in":
            return ops.linear(x, w, b, self.precision)
        rows = x.reshape(-1, x.shape[-1])
        out = ops.addmm(b, rows, w, precision=self.precision) if b is not None else \
            _fastmm_matmul(rows, w, precision=self.precision)
        return out.view(x.shape[:-1] + (w.shape[1],))

    sub = type(f"Fastmm{cls.__name__}", (cls,), {"forward": forward, "precision": None,
                                                  "__doc__": f"{cls.__name__} computed by fastmm ({layout})."})
    register(cls, sub)
    return sub


def _register_known() -> None:
    """nn.MultiheadAttention always; transformers' Conv1D where transformers is imported (never
    imported here: it is no dependency)."""
    _SUBCLASSES.setdefault(torch.nn.MultiheadAttention, MultiheadAttention)
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(pytorch_utils, "Conv1D", None)
    if conv1d is not None and conv1d not in _SUBCLASSES:
        register_linear_like(conv1d, layout="in_out")


def patch(model: torch.nn.Module, precision: str | None = None) -> torch.nn.Module:
    """Put ``model``'s matmul modules on fastmm: every ``torch.nn.Linear`` (exact type) becomes a
    :class:`fastmm.nn.Linear` using the same Parameters; ``nn.MultiheadAttention``, GPT-2's
    ``Conv1D`` (where ``transformers`` is imported) and classes given to :func:`register` /
    :func:`register_linear_like` are converted in place to their fastmm subclass. Subclasses of
    these and modules already patched are left alone.

    Works in place and returns ``model``; if ``model`` itself is converted to a new module that
    is returned (use the return value). ``precision`` is given to every converted module
    (``None``: follow ``torch.set_float32_matmul_precision`` at call time).
    """
    if precision is not None:
        resolve_precision(precision)
    _register_known()

    def convert(m):
        if type(m) is torch.nn.Linear:
            return Linear.from_linear(m, precision=precision)
        sub = _SUBCLASSES.get(type(m))
        if sub is not None:
            m.__class__ = sub
            m.precision = precision
            return m
        if isinstance(m, tuple(_SUBCLASSES.values()) + (Linear,)) and m.__dict__.get("precision") != precision \
                and precision is not None:
            m.precision = precision  # patched before: take the new precision
        return None

    return _swap(model, convert)


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: every :class:`fastmm.nn.Linear` becomes a plain ``torch.nn.Linear`` with
    the same Parameters, and converted modules get their original class back. In place; returns
    ``model`` (or the converted module if ``model`` is one)."""
    originals = {sub: cls for cls, sub in _SUBCLASSES.items()}

    def convert(m):
        if type(m) is Linear:
            return Linear.to_linear(m)
        cls = originals.get(type(m))
        if cls is not None:
            m.__class__ = cls
            m.__dict__.pop("precision", None)
            return m
        return None

    return _swap(model, convert)


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
        return _fastmm_matmul(a, b, precision=self.precision)  # (autograd and compile routes inside)

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
        return ops.linear(x, w, bias, self.precision)

    def _addmm(self, args, kwargs):
        c, a, b, beta, alpha = _add_operands(args, kwargs, "mat1", "mat2")
        if c is None or a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or not self._takes(c, a, b):
            return NotImplemented
        try:
            torch.broadcast_shapes(c.shape, (a.shape[0], b.shape[1]))
        except RuntimeError:
            return NotImplemented  # torch's own error
        return ops.addmm(c, a, b, beta=beta, alpha=alpha, precision=self.precision)

    def _batched_operands(self, args, kwargs, summed: bool):
        """(c, batch1, batch2, beta, alpha) of a baddbmm (``summed`` False) or addbmm call this mode
        serves, else None: three-dimensional operands of one batch and matching k, an input that
        broadcasts to the result, tensors the mode takes (anything else: torch's own rules)."""
        c, a, b, beta, alpha = _add_operands(args, kwargs, "batch1", "batch2")
        if c is None or a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1] \
                or not self._takes(c, a, b):
            return None
        result = (a.shape[1], b.shape[2]) if summed else (a.shape[0], a.shape[1], b.shape[2])
        try:
            torch.broadcast_shapes(c.shape, result)
        except RuntimeError:
            return None
        return c, a, b, beta, alpha

    def _baddbmm(self, args, kwargs):
        operands = self._batched_operands(args, kwargs, summed=False)
        if operands is None:
            return NotImplemented
        c, a, b, beta, alpha = operands
        return _scale_add(self._mm(a, b), c, beta, alpha)

    def _addbmm(self, args, kwargs):
        operands = self._batched_operands(args, kwargs, summed=True)
        if operands is None:
            return NotImplemented
        c, a, b, beta, alpha = operands
        # sum over the batch of a_i @ b_i = one product with K = batch x k: (n, batch*k) @ (batch*k, p)
        nb, n, k = a.shape
        prod = self._mm(a.transpose(0, 1).reshape(n, nb * k), b.reshape(nb * k, b.shape[2]))
        return _scale_add(prod, c, beta, alpha)


def _add_operands(args, kwargs, first: str, second: str):
    """(c, a, b, beta, alpha) of ``f(c, a, b, *, beta=1, alpha=1)`` (torch.addmm and kin), or
    Nones for any other call form (torch then takes it as it was made)."""
    names = ("input", first, second)
    if len(args) > 3 or any(k not in names + ("beta", "alpha") for k in kwargs) \
            or any(n in kwargs for n in names[:len(args)]):
        return None, None, None, None, None
    c, a, b = (list(args) + [kwargs.get(n) for n in names[len(args):]])[:3]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if not all(isinstance(t, torch.Tensor) for t in (c, a, b)) or isinstance(beta, torch.Tensor) \
            or isinstance(alpha, torch.Tensor) or a.dim() == 0 or b.dim() == 0:
        return None, None, None, None, None
    return c, a, b, beta, alpha


def _scale_add(prod: torch.Tensor, c: torch.Tensor, beta, alpha) -> torch.Tensor:
    """beta * c + alpha * prod (beta = 0: c ignored, NaN included, as torch does)."""
    if alpha != 1:
        prod = prod * alpha
    return prod if beta == 0 else prod + (c if beta == 1 else c * beta)


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
    torch.addmm: FastmmMode._addmm,
    _T.addmm: FastmmMode._addmm,
    torch.baddbmm: FastmmMode._baddbmm,
    _T.baddbmm: FastmmMode._baddbmm,
    torch.addbmm: FastmmMode._addbmm,
    _T.addbmm: FastmmMode._addbmm,
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
