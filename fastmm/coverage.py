"""``fastmm.coverage``: which matmuls of a model's forward and backward ran on fastmm, which on
torch, and why.

The model runs once under a TorchDispatchMode that sees every operator call below autograd,
and a TorchFunctionMode that notes the calls of ``F.scaled_dot_product_attention``.
fastmm's products show up as its registered ops (``fastmm::matmul``, ``fastmm::linear``,
``fastmm::addmm``: while a dispatch mode is active fastmm takes that route, see
:func:`fastmm.ops.use_registered_op`), each with the kernel its plan names or the reason torch
served it (:func:`fastmm.explain`); torch's own products show up as aten ops (``mm``, ``bmm``,
``addmm``, ``baddbmm``, ...), and the attention core of ``F.scaled_dot_product_attention`` as its
fused kernels, or, where SDPA takes its math path (float32 with ``enable_gqa`` on CUDA, say), as
the products made inside the SDPA call (forward) and by the autograd nodes they made (backward):
attention too, not products left on torch. (With the function mode on, torch does not take
``nn.TransformerEncoderLayer``'s inference fast path, which needs no grad anyway.)

A float32 product left on torch in the forward names the module whose forward made it (the
innermost ``Module.__call__`` on the Python stack when torch ran it): what ``fastmm.patch`` did not
reach, e.g. a functional ``torch.matmul`` in a module ``patch(model, functional=False)`` left
alone or that the functional routing did not find (see :func:`fastmm.patch`).
"""
from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .shapes import flat_rows

#: aten products (overload packets) that a float32 matmul of a model can land on when it is not
#: routed through fastmm.
_TORCH_PRODUCTS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "matmul", "linear",
                   "_addmm_activation", "addr", "outer"}
_ATTENTION = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")


@dataclass
class CoverageEntry:
    phase: str  # "forward" or "backward"
    op: str  # "fastmm::linear", "aten::mm", ...
    shapes: tuple  # the operands' shapes
    where: str  # "fastmm", "torch" or "attention"
    detail: str  # the kernel, or why torch ran it
    module: str = ""  # for a product torch ran in the forward: the module whose forward made it ("ClassName name")


@dataclass
class CoverageReport:
    entries: list[CoverageEntry] = field(default_factory=list)

    def counts(self) -> Counter:
        """Calls per place: ``{"fastmm": n, "torch": n, "attention": n}``."""
        return Counter(e.where for e in self.entries)

    def on_torch(self) -> list[CoverageEntry]:
        """The float32 products torch computed (the attention core of SDPA not counted)."""
        return [e for e in self.entries if e.where == "torch"]

    def __str__(self) -> str:
        c = self.counts()
        lines = [f"fastmm coverage: {c['fastmm']} products on fastmm, {c['torch']} on torch, "
                 f"{c['attention']} attention cores (SDPA, not a matmul fastmm serves)"]
        rows = Counter((e.phase, e.op, e.where, e.detail) for e in self.entries)
        for (phase, op, where, detail), n in sorted(rows.items()):
            lines.append(f"  {phase:8s} {n:4d} x {op:24s} {where:9s} {detail}")
        return "\n".join(lines)


def _shapes(args) -> tuple:
    return tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))


def _fastmm_products(name: str, args, kwargs) -> list[tuple]:
    """[(a, b, precision)] of a fastmm op call, each product as fastmm.explain takes it
    (linear_grads makes two: grad_x = g @ w, grad_w = g^T @ x, rows flattened)."""
    if name == "linear":
        return [(args[0], args[1].t(), args[3] if len(args) > 3 else kwargs.get("precision"))]
    if name == "addmm":
        return [(args[1], args[2], args[5] if len(args) > 5 else kwargs.get("precision"))]
    if name == "linear_grads":
        g, x, w = args[:3]
        precision = args[3] if len(args) > 3 else kwargs.get("precision")
        return [(g, w, precision), (flat_rows(g).t(), flat_rows(x), precision)]
    return [(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("precision"))]


_CALL_IMPL = torch.nn.Module._call_impl.__code__
_SDPA_MARK = "fastmm.coverage: a product inside F.scaled_dot_product_attention"


def _calling_module(names: dict[int, str]) -> str:
    """The innermost module whose forward is running (the ``self`` of the innermost
    ``Module._call_impl`` frame): "ClassName name-in-the-model", or "" where none is."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            module = frame.f_locals.get("self")
            name = names.get(id(module))
            return type(module).__name__ + (f" {name}" if name else "")
        frame = frame.f_back
    return ""


class _Recorder(TorchDispatchMode):
    def __init__(self, report: CoverageReport, names: dict[int, str]):
        super().__init__()
        self.report = report
        self.phase = "forward"
        self.names = names
        self.in_sdpa = 0  # inside a call of F.scaled_dot_product_attention (_SdpaWatch)
        self.sdpa_outputs: list[torch.Tensor] = []  # the products made inside one (its math path)
        self.sdpa_nodes: dict[int, object] = {}  # their autograd nodes (kept alive), for the backward

    def start_backward(self) -> None:
        self.phase = "backward"
        for t in self.sdpa_outputs:
            if t.grad_fn is not None:
                # marked in the node's own metadata: a node's Python object need not be the same
                # one when the engine runs it
                t.grad_fn.metadata[_SDPA_MARK] = True
                self.sdpa_nodes[id(t.grad_fn)] = t.grad_fn
        self.sdpa_outputs.clear()

    def _in_sdpa(self) -> bool:
        if self.phase == "forward":
            return self.in_sdpa > 0
        node = torch._C._current_autograd_node()
        return node is not None and bool(node.metadata.get(_SDPA_MARK))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func._opname
        if ns == "fastmm":
            from .explain import explain

            products = _fastmm_products(name, args, kwargs)
            for a, b, precision in products:
                plan = explain(a, b, precision=precision)
                where, detail = ("fastmm", plan.kernel) if plan.kernel else ("torch", f"fastmm fell back: {plan.fallback}")
                shapes = _shapes(args) if len(products) == 1 else _shapes((a, b))
                self.report.entries.append(CoverageEntry(self.phase, f"fastmm::{name}", shapes, where, detail))
        elif ns == "aten" and name.startswith(_ATTENTION):
            self.report.entries.append(CoverageEntry(self.phase, f"aten::{name}", _shapes(args), "attention",
                                                     "attention core inside F.scaled_dot_product_attention"))
        elif ns == "aten" and name in _TORCH_PRODUCTS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if tensors and all(t.dtype == torch.float32 for t in tensors) and self._in_sdpa():
                self.report.entries.append(CoverageEntry(self.phase, f"aten::{name}", _shapes(args), "attention",
                                                         "attention core inside F.scaled_dot_product_attention "
                                                         "(its math path)"))
                out = func(*args, **kwargs)
                if self.phase == "forward" and isinstance(out, torch.Tensor):
                    self.sdpa_outputs.append(out)
                return out
            if tensors and all(t.dtype == torch.float32 for t in tensors):
                module = _calling_module(self.names) if self.phase == "forward" else ""
                detail = "not routed through fastmm" + (f" (in {module.split()[0]}.forward)" if module else "")
                self.report.entries.append(CoverageEntry(self.phase, f"aten::{name}", _shapes(args), "torch",
                                                         detail, module))
        return func(*args, **kwargs)


class _SdpaWatch(TorchFunctionMode):
    """Tells the recorder when a call of ``F.scaled_dot_product_attention`` runs: a function mode
    sees the call itself, before torch picks a kernel (a math path is decomposed into products
    before a dispatch mode sees them)."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs) if kwargs else func(*args)
        self.recorder.in_sdpa += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.recorder.in_sdpa -= 1


def coverage(model, *example_inputs, backward: bool = True, loss=None, **example_kwargs) -> CoverageReport:
    """Run ``model(*example_inputs, **example_kwargs)`` once (and, with ``backward``, the backward
    of ``loss(output)``, by default the sum of every float tensor in the output) and report where
    each float32 matmul ran. Parameter gradients accumulate as in a training step; zero them after
    if that matters."""
    report = CoverageReport()
    names = {id(m): n for n, m in model.named_modules()} if isinstance(model, torch.nn.Module) else {}
    recorder = _Recorder(report, names)
    with recorder, _SdpaWatch(recorder):
        out = model(*example_inputs, **example_kwargs)
        if backward:
            value = loss(out) if loss is not None else _sum_of(out)
            recorder.start_backward()
            value.backward()
    return report


def _sum_of(out) -> torch.Tensor:
    """Sum of every floating tensor in a model output (a tensor, a tuple, a dict, a ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return out.float().sum() if out.is_floating_point() else out.new_zeros((), dtype=torch.float32)
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        parts = [_sum_of(o) for o in out if isinstance(o, (torch.Tensor, list, tuple, dict))]
        parts = [p for p in parts if p.requires_grad]
        if not parts:
            raise ValueError("coverage: the model output has no tensor that needs a gradient; pass loss=")
        return sum(parts[1:], parts[0])
    raise TypeError(f"coverage: cannot sum a model output of type {type(out).__name__}; pass loss=")
