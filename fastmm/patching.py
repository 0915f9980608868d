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

:func:`patch` also routes the functional matmuls of the model's forward (``functional=True``,
the default): a FastmmMode entered by forward hooks around the modules whose code makes them (see
:func:`patch` for how they are found and what it costs).

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

import dis
import inspect
import sys
import threading
import types
import weakref

import torch
from torch.overrides import TorchFunctionMode

from . import ops
from .api import matmul as _fastmm_matmul
from .attention import computes_as_torch, math_attention, takes_math_path
from .precision import autocast_any_half_active, autocast_half_active, resolve_precision, resolve_precision_eager
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
        # (Parameters from their dict: Module.__getattr__ costs ~1 us a lookup; a property or a
        # buffer is read with getattr)
        params = self._parameters
        w = params[weight] if weight in params else getattr(self, weight)
        b = None if bias is None else params[bias] if bias in params else getattr(self, bias)
        if not (plain_tensor(x) and plain_tensor(w) and (b is None or plain_tensor(b))) or x.dim() == 0:
            return cls.forward(self, x)
        eager = not ops.tracing_or_in_dispatch_mode()
        if autocast_any_half_active(x) if eager else autocast_half_active(x.device.type):
            return cls.forward(self, x)
        added = None
        if b is not None and b.dim() > 1:
            # (the forward's "+ b" broadcasts, which with a bias of more than one dim is not
            # F.linear's fold (a (1, N) bias on a 1-D x gives (1, N)): the sum is torch's own)
            added, b = b, None
        if eager:  # x @ W^T (+ b), or for [in, out] x @ W (+ b): F.linear's product on W^T's view
            precision = resolve_precision_eager(self.precision)
            y = (ops.linear_eager(x, w, b, precision) if layout == "out_in"
                 else ops.linear_in_out_eager(x, w, b, precision))
        else:
            y = ops.linear(x, w if layout == "out_in" else w.t(), b, self.precision)
        return y if added is None else y + added

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


def patch(model: torch.nn.Module, precision: str | None = None, *, functional: bool | str = True) -> torch.nn.Module:
    """Put ``model``'s matmuls on fastmm: every ``torch.nn.Linear`` (exact type) becomes a
    :class:`fastmm.nn.Linear` using the same Parameters; ``nn.MultiheadAttention``, GPT-2's
    ``Conv1D`` (where ``transformers`` is imported) and classes given to :func:`register` /
    :func:`register_linear_like` are converted in place to their fastmm subclass. Subclasses of
    these and modules already patched are left alone.

    ``functional`` reaches the matmuls that no module conversion reaches: calls of
    ``torch.matmul`` / ``@`` / ``mm`` / ``bmm`` / ``F.linear`` / ``addmm`` / ``baddbmm`` /
    ``addbmm`` on float32 tensors made by the model's own code in its forward (Hugging Face's
    ``eager_attention_forward``: ``q @ k^T`` and ``attn @ v``; a rotary embedding's
    ``inv_freq @ positions``; a subclass of ``nn.Linear``). They then run on fastmm's ops, and
    so does their backward (fastmm's own autograd). CUDA and CPU tensors, as
    :class:`fastmm.nn.Linear` (on CPU the fastmm op hands the product to torch):

    - ``True`` (default): routed where they are made. At patch time the modules whose forward
      code (or a function or method it names, three calls deep) names such a call or uses ``@``
      get a forward pre-hook and an ``always_call`` forward hook (candidates; modules inside
      converted ones excepted). A candidate's first forward in training mode and in eval mode is
      a probe: it runs under a :class:`FastmmMode` that also notes which module's forward made
      each call it routed (modules found that were no candidate get the hooks too). From then
      on the hooks enter a mode only around the modules that made such calls, with fastmm's own
      modules inside them run with the mode taken off the stack; a candidate that made none
      (the attention of an SDPA model whose SDPA calls take a fused kernel) loses its hooks.
      ``F.scaled_dot_product_attention`` is routed where torch would take its math path (float32
      on CUDA with grouped-query attention: :mod:`fastmm.attention`) and fastmm's precision is
      not the one torch computes at (tf32x3; tf32 under torch's "highest"; ieee under "high"),
      so there a grouped-query SDPA model's attention keeps its hooks and its products run on
      fastmm; at torch's own precision its math path is torch's (the same products, less host
      time: :func:`fastmm.attention.computes_as_torch`). With ``precision=None`` that holds at
      every call; with a precision named, the attention's hooks are kept dormant, and route
      again should torch's setting change. Hooks with nothing to do (dormant, or a candidate
      that routed nothing waiting for its probe in the other training value: inference only)
      are parked on ``model`` (one pre-hook, :class:`_Watch`): a module with hooks takes
      ``Module.__call__``'s slow path, ~7 us a call of a Llama attention layer on a CPU host.
    - ``"forward"``: the mode is on for the whole of every forward of ``model`` (hooks on
      ``model``): also calls the code does not show (``getattr(torch, name)``) in modules no
      probe ran, and branches no probe took, at the price of every torch call of the forward.
    - ``False``: modules only.

    Why this default: every torch call made while a function mode is on passes through it
    (``x.shape`` too): +1.4-1.6 us a call on this repo's CPU machine, +0.9-2.7 us on an H200
    host (time.perf_counter, two machines); fastmm.nn.Linear's own host path makes ~33 such
    calls, a 4-layer Llama forward ~1300. Our models are host-bound, so the mode is kept to the
    code that needs it. Calls passing through the mode per forward of a 4-layer Llama
    (transformers 5.17, H200): eager attention 239 (``True``) against 362 (``"forward"``); SDPA
    23 (``True``: the rotary embedding's product) against 299. Forward time there (hidden 256,
    16 tokens, host-bound; 4.3-5.9 ms with ``False``): eager +0.75-1.65 ms with ``True`` (the
    routed products' own host path included), +1.4-2.2 ms with ``"forward"``; SDPA +0.14 ms
    against +1.2 ms. Hidden 1024, 4 x 256 tokens: eager +0.5 ms on a 4.5 ms forward and +1.2 ms on
    a 15.4 ms training step; SDPA ~0. The cost is that of the attention code's own torch calls,
    and it buys the issue's bar (no float32 product on torch but SDPA's core); ``False`` skips
    it. Under ``torch.compile`` the hooks enter the mode in the traced frame (nothing at run
    time): the compiled graph holds fastmm ops for those calls.

    Re-entrant and nestable: a hook enters no mode where a :class:`FastmmMode` is on the stack
    already (a :func:`use_fastmm` block around the model, whose mode then decides; an outer
    routed module; a module called inside itself), and an exception in the forward leaves no
    mode behind (``always_call``). Not covered: a ``KeyboardInterrupt`` mid-forward (torch runs
    ``always_call`` hooks for ``Exception`` only) can leave the mode on that thread's stack; and,
    with ``True``, a call in a branch that neither probe took (patching again probes again).
    :func:`fastmm.coverage` names the module of any product left on torch.

    Works in place and returns ``model``; if ``model`` itself is converted to a new module that
    is returned (use the return value). ``precision`` is given to every converted module and to
    the functional routing (``None``: follow ``torch.set_float32_matmul_precision`` at call time;
    patching again with a precision changes it).
    """
    if precision is not None:
        resolve_precision(precision)
    if functional not in (True, False, "forward"):
        raise ValueError(f"functional must be True, False or 'forward', got {functional!r}")
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

    model = _swap(model, convert)
    before = [h.routing.precision for m in model.modules() for h in m._forward_pre_hooks.values()
              if isinstance(h, (_Enter, _Watch))]
    for m in model.modules():  # patched before: set up again (probes again), with this precision
        _remove_hooks(m, None, _HOOKS)
    if functional:
        if precision is None and before:
            precision = before[0]  # patched before with a precision: keep it
        _install_functional(model, _FunctionalRouting(precision, whole_forward=functional == "forward"))
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: every :class:`fastmm.nn.Linear` becomes a plain ``torch.nn.Linear`` with
    the same Parameters, converted modules get their original class back, and the hooks of the
    functional routing are removed from every module of ``model``. In place; returns ``model``
    (or the converted module if ``model`` is one)."""
    originals = {sub: cls for cls, sub in _SUBCLASSES.items()}
    for m in model.modules():
        _remove_hooks(m, None, _HOOKS)

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


def _converted_types() -> tuple[type, ...]:
    """The classes :func:`patch` converts to: their forward computes on fastmm itself."""
    return (Linear,) + tuple(_SUBCLASSES.values())


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
    # inside the fastmm op) are not intercepted again. Every torch call made while the mode is on
    # the stack comes here (tensor attribute reads such as ``x.shape`` too): the call that is no
    # matmul takes one dict lookup and goes on. (The mode machinery costs ~1-2.7 us a call, this
    # method's part of it ~0.1 us: why patch keeps the mode to the modules that need it.)
    def __torch_function__(self, func, types, args=(), kwargs=None):
        route = _ROUTES.get(func)
        if route is not None:
            result = route(self, args, kwargs or {})
            if result is not NotImplemented:
                return result
        return func(*args, **kwargs) if kwargs else func(*args)

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

    _SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

    def _sdpa(self, args, kwargs):
        """SDPA where torch would take its math path (float32 on CUDA under grouped-query
        attention, say) and the mode's precision is not the one torch computes at: the same path
        with fastmm's products (:mod:`fastmm.attention`). Fused kernels, the math path at torch's
        own precision (``computes_as_torch``: the same products, less host time), other devices,
        tensor subclasses, a mask that is neither bool nor float32, and anything under
        ``torch.compile`` (inductor has its own SDPA patterns) stay torch's."""
        names = self._SDPA_NAMES
        # (scale and enable_gqa are keyword-only)
        if len(args) > 6 or any(k not in names for k in kwargs) or any(n in kwargs for n in names[:len(args)]):
            return NotImplemented
        defaults = (None, None, None, None, 0.0, False, None, False)
        q, k, v, mask, dropout_p, is_causal, scale, gqa = \
            list(args) + [kwargs.get(n, d) for n, d in zip(names[len(args):], defaults[len(args):])]
        tensors = (q, k, v) if mask is None else (q, k, v, mask)
        if not all(isinstance(t, torch.Tensor) for t in tensors) or torch.compiler.is_compiling() \
                or any(t.is_nested for t in tensors):
            return NotImplemented
        if mask is not None and mask.dtype == torch.bool:
            tensors = (q, k, v)  # (a boolean mask: plain, on the same device)
            if type(mask) is not torch.Tensor or mask.device != q.device:
                return NotImplemented
        if self.precision is None or not self._takes(*tensors) \
                or not takes_math_path(q, k, v, mask, dropout_p, is_causal, gqa):
            return NotImplemented  # (None follows torch's setting: torch's products, always)
        if computes_as_torch(self.precision):
            self._declined_as_torch()
            return NotImplemented
        return math_attention(q, k, v, mask, dropout_p, is_causal, scale, gqa, precision=self.precision)

    def _declined_as_torch(self) -> None:
        """A call this mode would route at another torch setting was left to torch (see
        ``_sdpa``): nothing to note but in a probe (:class:`_ProbeMode`)."""


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
    torch.nn.functional.scaled_dot_product_attention: FastmmMode._sdpa,
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
    ``F.scaled_dot_product_attention`` is routed where torch would take its math path (no fused
    kernel takes the call: float32 with ``enable_gqa`` on CUDA, say) and ``precision`` is not
    the one torch computes at (tf32x3; tf32 under torch's "highest"; ieee under "high"): the same
    path, its two products (and the four of its backward) on fastmm
    (:func:`fastmm.attention.math_attention`); where a fused kernel applies, or fastmm would
    compute what torch's own math path computes, torch's.

    ``precision``: ``None`` follows ``torch.set_float32_matmul_precision`` at each call.
    Returns the mode; ``with`` enters it (it nests with other torch function modes).
    """
    return FastmmMode(precision, devices)


# ---------------------------------------------------------------------------------------------
# patch(model, functional=...): the functional matmuls of a patched model's forward
#
# A FastmmMode on the stack costs every torch call made meanwhile (~1-2.7 us a call, ``x.shape``
# included; patch's docstring has the figures), and it changes what torch does (torch skips nn.TransformerEncoder's
# inference fast path while a function mode is on). So the mode is kept to the modules that need it:
# 1. candidates (at patch time, from the code): the modules whose class's forward, or a function or
#    method it names (globals, attributes of its class or of a module it names; three calls deep;
#    torch's own functions excluded: a torch function mode sees those as one call), names a routed
#    function (matmul, mm, bmm, linear, addmm, baddbmm, addbmm, scaled_dot_product_attention) or
#    uses ``@``;
# 2. a probe: a candidate's first forward in training mode and in eval mode runs under a
#    FastmmMode that also notes, for each call it routes, the module whose forward made it (the
#    innermost Module._call_impl frame on the Python stack). A candidate that made none (an
#    attention module whose SDPA calls take a fused kernel) loses its hooks after both probes: no
#    cost from then;
#    one that did keeps entering the mode; a module found that was no candidate gets hooks too;
# 3. shields: the converted modules inside a routed module (fastmm.nn.Linear...) run with the
#    FastmmMode taken off the stack (a pre-hook pops it, a forward hook pushes it back): their
#    forward computes on fastmm anyway and declines what the mode declines (non-plain tensors,
#    half autocast), and their host path makes ~33 torch calls that would each pay the mode.
# The hooks are objects of the classes below (picklable, deep-copyable: torch.save(model) and
# copy.deepcopy keep working); what a pre-hook did is kept on a per-thread stack of (module, mode,
# shield?) for its forward hook, which undoes only an entry of its own module (so one whose
# pre-hook did not run, an earlier pre-hook having raised, changes nothing). Under torch.compile a
# pre-hook enters the mode in the traced frame where none is on (dynamo traces it into the graph:
# the functional matmuls become fastmm ops) and pushes nothing otherwise (dynamo mishandles a list
# side effect made while an outer mode is on); probes and shields are eager-only.

#: the device types the functional routing takes, as fastmm.nn's modules (on CPU the fastmm op
#: hands the product to torch, through the same op, autograd and compile paths)
_FUNCTIONAL_DEVICES = ("cuda", "cpu")
_LOCAL = threading.local()
_CALL_IMPL = torch.nn.Module._call_impl.__code__


def _entries() -> list:
    """This thread's stack of (module, mode or None, shield?) the hooks below keep."""
    try:
        return _LOCAL.entries
    except AttributeError:
        _LOCAL.entries = []
        return _LOCAL.entries


def _fastmm_modes() -> list:
    """The FastmmModes on this thread's torch function mode stack (one C call where it is empty)."""
    if not torch._C._is_torch_function_mode_enabled():
        return []
    return [m for m in torch.overrides._get_current_function_mode_stack() if isinstance(m, FastmmMode)]


class _FunctionalRouting:
    """What one :func:`patch` call set up, shared by the hooks it installed: the precision and
    ``whole_forward`` (``functional="forward"``)."""

    def __init__(self, precision: str | None, whole_forward: bool) -> None:
        self.precision = precision
        self.whole_forward = whole_forward
        self.root: torch.nn.Module | None = None  # the model patch() was given (_install_functional)
        self.watch: _Watch | None = None  # on the root once a candidate is parked

    def mode(self) -> FastmmMode:
        return FastmmMode(self.precision, _FUNCTIONAL_DEVICES)

    def park(self, module: torch.nn.Module, hook: "_Enter") -> bool:
        """Take ``module``'s hooks off while they have nothing to do (see :class:`_Watch`), if
        it is not the root (whose own pre-hook could not put them back in time); whether it did."""
        root = getattr(self, "root", None)  # (routings pickled before it existed have none)
        if root is None or module is root:
            return False
        if self.watch is None:
            self.watch = _Watch(self)
            root.register_forward_pre_hook(self.watch, prepend=True)
        _remove_hooks(module, self)
        self.watch.parked = self.watch.parked + [(module, hook)]  # (a new list: a forward may be reading it)
        return True


class _Enter:
    """Forward pre-hook: enter the routing's mode (``routes``: the module made routed calls), or
    a probe mode (a candidate's first call in this ``training`` value), or nothing where a
    FastmmMode is on already (a :func:`use_fastmm` block, an outer routed module, this module
    inside itself).

    ``dormant``: the module's SDPA calls were left to torch in its probe only because fastmm's
    precision is the one torch computes at (``attention.computes_as_torch``). That holds as long
    as torch's setting does: the hook enters no mode while it holds (the mode would cost every
    other torch call of the module); once it no longer does, the module becomes a routed one, so
    a patch made at an explicit precision keeps computing at it whatever torch is later set to."""

    dormant = False  # (a class default: hooks pickled before it existed read False)

    def __init__(self, routing: _FunctionalRouting, routes: bool) -> None:
        self.routing, self.routes = routing, routes
        self.probed: set[bool] = set()  # the training values a probe of this module completed for

    def __call__(self, module, args):
        if torch.compiler.is_compiling():
            if not _fastmm_modes():  # (traced into the graph; the hooks inside then see it on)
                mode = self.routing.mode()
                mode.__enter__()
                _entries().append((module, mode, False))
            return
        modes = _fastmm_modes()
        if modes:
            mode = None
            if isinstance(modes[-1], _ProbeMode):
                modes[-1].seen.append((self, module))  # probed by the outer probe
        elif self.routes:
            mode = self.routing.mode()
        elif module.training not in self.probed:
            mode = _ProbeMode(self, module)
        elif self.dormant and not computes_as_torch(self.routing.precision):
            # torch's setting changed since the probe: a routed module from now on, shielded once
            # (the route itself declines a call at torch's own precision, should it change back)
            self.routes = True
            _shield_inside(module, self.routing)
            mode = self.routing.mode()
        elif self.routing.park(module, self):
            return  # (its forward hook went with it: no entry to pop)
        else:
            mode = None
        if mode is not None:
            mode.__enter__()
        _entries().append((module, mode, False))


class _Exit:
    """Forward hook (``always_call``): exit the mode its pre-hook entered; after a probe forward
    that returned, act on what it found."""

    def __init__(self, routing: _FunctionalRouting) -> None:
        self.routing = routing

    def __call__(self, module, args, output):
        entries = _entries()
        if not entries or entries[-1][0] is not module or entries[-1][2]:
            return  # its pre-hook did not run (or, compiling, entered nothing)
        mode = entries.pop()[1]
        if mode is not None:
            mode.__exit__(None, None, None)
            if isinstance(mode, _ProbeMode) and sys.exc_info()[0] is None:
                mode.finish()


class _Watch:
    """Forward pre-hook of the patched model (the root), added once a candidate is parked: the
    candidates whose hooks would do nothing on their calls (probed in the current training value
    and routing nothing; dormant while torch computes at the patch's precision) have their hooks
    taken off and kept here, because a module with hooks takes ``Module._call_impl``'s slow path:
    ~7 us a call of a Llama attention on this repo's CPU machine, two hooks doing nothing, on every
    layer of every decoded token (NOTES run 56). Here, once a forward of the root: a parked module
    gets its hooks back where its ``training`` value has not been probed, or, dormant, torch's
    setting no longer computes at the patch's precision; its pre-hook then acts on its next call.
    Under torch.compile it does nothing (what it would change are hooks, not tensors), so a
    module parked after two eager forwards of one training value and then compiled in the other
    leaves that graph's calls of it to torch, as a branch no probe took (an eager forward in that
    value first, or patching again, routes them). A module called other than through the root's
    forward is not watched: it keeps computing on torch, at torch's setting, until the root runs."""

    def __init__(self, routing: _FunctionalRouting) -> None:
        self.routing = routing
        self.parked: list[tuple[torch.nn.Module, _Enter]] = []

    def __call__(self, root, args):
        parked = self.parked
        if not parked or torch.compiler.is_compiling():
            return
        changed = None  # (torch's setting against the patch's precision: read once, where needed)
        keep = []
        for module, hook in parked:
            wake = module.training not in hook.probed
            if not wake and hook.dormant:
                if changed is None:
                    changed = not computes_as_torch(self.routing.precision)
                wake = changed
            if wake:
                if _enter_hook(module, self.routing) is None:  # (a probe may have hooked it meanwhile)
                    _add_pair(module, hook, _Exit(self.routing))
            else:
                keep.append((module, hook))
        if len(keep) != len(parked):
            self.parked = keep


class _ProbeMode(FastmmMode):
    """A FastmmMode (routing as any) that also notes the module whose forward made each call it
    routed, during one forward of a candidate (``owner``)."""

    def __init__(self, hook: _Enter, owner: torch.nn.Module) -> None:
        super().__init__(hook.routing.precision, _FUNCTIONAL_DEVICES)
        self.hook, self.owner, self.training = hook, owner, owner.training
        self.found: dict[int, torch.nn.Module | None] = {}
        self.declined: dict[int, torch.nn.Module | None] = {}  # left to torch at its own precision
        self.seen: list[tuple[_Enter, torch.nn.Module]] = []  # candidates called inside

    def _declined_as_torch(self) -> None:
        module = _calling_module()
        self.declined[id(module)] = module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        route = _ROUTES.get(func)
        if route is not None:
            result = route(self, args, kwargs or {})
            if result is not NotImplemented:
                module = _calling_module()
                self.found[id(module)] = module
                return result
        return func(*args, **kwargs) if kwargs else func(*args)

    def finish(self) -> None:
        """Hooks that enter the mode on the modules found (and the modules of their class inside
        the owner), shields inside them; dormant hooks (see :class:`_Enter`) on the modules
        whose calls were left to torch only for its precision; the candidates probed in both
        training values that made neither lose their hooks."""
        routing, owner = self.hook.routing, self.owner
        inside = {id(m): m for m in owner.modules()}
        converted = _converted_types()
        classes: dict[type, bool] = {}  # class -> routes (else dormant)
        for found, routes in ((self.found, True), (self.declined, False)):
            for m in found.values():
                if m is None or id(m) not in inside or isinstance(m, converted):
                    m = owner  # (outside the owner or unknown: the owner's forward)
                hook = _enter_hook(m, routing)
                if hook is None:
                    classes[type(m)] = classes.get(type(m), False) or routes
                elif routes:
                    hook.routes = True
                    _shield_inside(m, routing)
                else:
                    hook.dormant = True
        for m in inside.values():
            if type(m) in classes and _enter_hook(m, routing) is None:
                hook = _Enter(routing, routes=classes[type(m)])
                hook.dormant = not hook.routes
                _add_pair(m, hook, _Exit(routing))
                if hook.routes:
                    _shield_inside(m, routing)
        for hook, m in [(self.hook, owner)] + self.seen:
            hook.probed.add(self.training)
            if not hook.routes and not hook.dormant and hook.probed == {True, False}:
                _remove_hooks(m, routing)


def _calling_module() -> torch.nn.Module | None:
    """The module whose forward runs innermost: the ``self`` of the innermost
    ``Module._call_impl`` frame, or None."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


class _ShieldEnter:
    """Forward pre-hook of a converted module inside a routed module: take the FastmmMode off the
    top of the stack while its forward (fastmm's own) runs."""

    def __init__(self, routing: _FunctionalRouting) -> None:
        self.routing = routing

    def __call__(self, module, args):
        if not torch._C._is_torch_function_mode_enabled() or torch.compiler.is_compiling():
            return
        top = torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1)
        if isinstance(top, FastmmMode):
            _entries().append((module, torch._C._pop_torch_function_stack(), True))


class _ShieldExit:
    """Forward hook (``always_call``): put back what :class:`_ShieldEnter` took off."""

    def __init__(self, routing: _FunctionalRouting) -> None:
        self.routing = routing

    def __call__(self, module, args, output):
        entries = _entries()
        if entries and entries[-1][0] is module and entries[-1][2]:
            torch._C._push_on_torch_function_stack(entries.pop()[1])


_HOOKS = (_Enter, _Exit, _ShieldEnter, _ShieldExit, _Watch)


def _add_pair(module: torch.nn.Module, enter, exit_) -> None:
    # the pre-hook first (an earlier one that raises leaves the mode unentered), the forward hook
    # first too (it exits before the other forward hooks run, as the forward ended)
    module.register_forward_pre_hook(enter, prepend=True)
    module.register_forward_hook(exit_, prepend=True, always_call=True)


def _enter_hook(module: torch.nn.Module, routing: _FunctionalRouting) -> _Enter | None:
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, _Enter) and hook.routing is routing:
            return hook
    return None


def _shield_inside(scope: torch.nn.Module, routing: _FunctionalRouting) -> None:
    converted = _converted_types()
    for m in scope.modules():
        if m is not scope and isinstance(m, converted) and not any(
                isinstance(h, _ShieldEnter) and h.routing is routing for h in m._forward_pre_hooks.values()):
            _add_pair(m, _ShieldEnter(routing), _ShieldExit(routing))


def _remove_hooks(module: torch.nn.Module, routing: _FunctionalRouting | None,
                  kinds: tuple[type, ...] = (_Enter, _Exit)) -> None:
    """Remove ``module``'s hooks of these kinds that belong to ``routing`` (None: to any)."""
    for table in (module._forward_pre_hooks, module._forward_hooks):
        for key, hook in list(table.items()):
            if isinstance(hook, kinds) and (routing is None or hook.routing is routing):
                del table[key]
                module._forward_hooks_always_called.pop(key, None)


def _install_functional(model: torch.nn.Module, routing: _FunctionalRouting) -> None:
    converted = _converted_types()
    routing.root = model
    if isinstance(model, converted):
        return  # (its forward is fastmm's own)
    if routing.whole_forward:
        _add_pair(model, _Enter(routing, routes=True), _Exit(routing))
        _shield_inside(model, routing)
        return
    # a converted module's forward is fastmm's own and calls none of its children (MHA's
    # out_proj): nothing inside it is a candidate (hooks there would also turn off
    # nn.TransformerEncoderLayer's inference fast path, which declines modules with hooks)
    stack, done = [model], set()
    while stack:
        m = stack.pop()
        if id(m) in done or isinstance(m, converted) or isinstance(m, torch.jit.ScriptModule):
            continue  # (a scripted module's code is TorchScript: no Python calls to route)
        done.add(id(m))
        if _makes_routed_calls(m):
            _add_pair(m, _Enter(routing, routes=False), _Exit(routing))
        stack.extend(c for c in m._modules.values() if c is not None)


# --- candidates: what a module's code names ---------------------------------------------------

#: names of the functions FastmmMode routes (as attributes: torch.matmul, x.mm, F.linear, ...)
_ROUTED_NAMES = frozenset({"matmul", "mm", "bmm", "linear", "addmm", "baddbmm", "addbmm", "__matmul__",
                           "__rmatmul__", "scaled_dot_product_attention"})
_BINARY_OP = dis.opmap.get("BINARY_OP", -1)  # Python >= 3.11: argument 4 is @, 17 is @=
_BINARY_OP_MATMUL = frozenset(i for i, (_, sign) in enumerate(getattr(dis, "_nb_ops", ())) if sign in ("@", "@=")) \
    or frozenset({4, 17})
_MATMUL_OPS = frozenset(dis.opmap[n] for n in ("BINARY_MATRIX_MULTIPLY", "INPLACE_MATRIX_MULTIPLY", "BINARY_OP")
                        if n in dis.opmap)
_SCAN_DEPTH = 3
_CANDIDATE_CLASSES: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


def _makes_routed_calls(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward may make a call :class:`FastmmMode` routes, by its code."""
    own = module.__dict__.get("forward")  # (a forward set on the instance)
    if own is not None:
        return _safe_scan(own, type(module))
    cls = type(module)
    known = _CANDIDATE_CLASSES.get(cls)
    if known is None:
        known = _CANDIDATE_CLASSES[cls] = _safe_scan(cls.forward, cls)
    return known


def _safe_scan(forward, cls: type) -> bool:
    try:
        return _scan(forward, cls, _SCAN_DEPTH, set(), top=True)
    except Exception:  # (code this reading does not expect: no candidate; "forward" covers it)
        return False


def _scan(fn, cls: type | None, depth: int, seen: set, top: bool = False) -> bool:
    """Whether the function ``fn`` (its decorators' wrapped functions too) names a routed
    function or uses ``@``, or calls a function that does (``depth`` calls deep). Below the
    forward (``top``), torch's own functions are not read: they dispatch ``__torch_function__``
    themselves (the mode sees the outer call) or are Module machinery."""
    while fn is not None:
        fn = getattr(fn, "__func__", fn)  # (a bound method)
        code = getattr(fn, "__code__", None)
        if code is not None and code not in seen and (top or not _from_torch(fn)):
            seen.add(code)
            if _scan_code(code, getattr(fn, "__globals__", {}), cls, depth, seen):
                return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _from_torch(fn) -> bool:
    module = getattr(fn, "__module__", None) or ""
    return module == "torch" or module.startswith("torch.")


def _scan_code(code: types.CodeType, globals_: dict, cls: type | None, depth: int, seen: set) -> bool:
    if not _ROUTED_NAMES.isdisjoint(code.co_names):
        return True
    raw = code.co_code  # (op, arg) byte pairs; an @ has an argument below 256: no EXTENDED_ARG
    if any(op in _MATMUL_OPS and (op != _BINARY_OP or arg in _BINARY_OP_MATMUL)
           for op, arg in zip(raw[::2], raw[1::2])):
        return True
    for const in code.co_consts:  # nested functions, lambdas, comprehensions
        if isinstance(const, types.CodeType) and _scan_code(const, globals_, cls, depth, seen):
            return True
    if depth == 0:
        return False
    holders = [m for name in code.co_names
               if isinstance(m := globals_.get(name), types.ModuleType) and not m.__name__.startswith("torch")]
    for name in code.co_names:
        # (getattr_static: no descriptor runs, no lazy module imports anything)
        targets = [globals_.get(name)] + [inspect.getattr_static(h, name, None) for h in holders]
        if cls is not None:
            targets.append(inspect.getattr_static(cls, name, None))
        for target in targets:
            if isinstance(target, (staticmethod, classmethod)):
                target = target.__func__
            if isinstance(target, types.FunctionType) and _scan(target, cls, depth - 1, seen):
                return True
    return False
