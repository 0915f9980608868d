"""``fastmm.coverage``: which matmuls of a model's forward and backward ran on fastmm, which on
torch, and why.

The model runs once under a TorchDispatchMode that sees every operator call below autograd.
fastmm's products show up as its registered ops (``fastmm::matmul``, ``fastmm::linear``,
``fastmm::addmm``: while a dispatch mode is active fastmm takes that route, see
:func:`fastmm.ops.use_registered_op`), each with the kernel its plan names or the reason torch
served it (:func:`fastmm.explain`); torch's own products show up as aten ops (``mm``, ``bmm``,
``addmm``, ``baddbmm``, ...), and the attention core of ``F.scaled_dot_product_attention`` as its
fused kernels.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


def _fastmm_operands(name: str, args, kwargs):
    """(a, b, precision) of a fastmm op call, the product as fastmm.explain takes it."""
    if name == "linear":
        return args[0], args[1].t(), (args[3] if len(args) > 3 else kwargs.get("precision"))
    if name == "addmm":
        return args[1], args[2], (args[5] if len(args) > 5 else kwargs.get("precision"))
    return args[0], args[1], (args[2] if len(args) > 2 else kwargs.get("precision"))


class _Recorder(TorchDispatchMode):
    def __init__(self, report: CoverageReport):
        super().__init__()
        self.report = report
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func._opname
        if ns == "fastmm":
            from .explain import explain

            a, b, precision = _fastmm_operands(name, args, kwargs)
            plan = explain(a, b, precision=precision)
            where, detail = ("fastmm", plan.kernel) if plan.kernel else ("torch", f"fastmm fell back: {plan.fallback}")
            self.report.entries.append(CoverageEntry(self.phase, f"fastmm::{name}", _shapes(args), where, detail))
        elif ns == "aten" and name.startswith(_ATTENTION):
            self.report.entries.append(CoverageEntry(self.phase, f"aten::{name}", _shapes(args), "attention",
                                                     "attention core inside F.scaled_dot_product_attention"))
        elif ns == "aten" and name in _TORCH_PRODUCTS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if tensors and all(t.dtype == torch.float32 for t in tensors):
                self.report.entries.append(CoverageEntry(self.phase, f"aten::{name}", _shapes(args), "torch",
                                                         "not routed through fastmm"))
        return func(*args, **kwargs)


def coverage(model, *example_inputs, backward: bool = True, loss=None, **example_kwargs) -> CoverageReport:
    """Run ``model(*example_inputs, **example_kwargs)`` once (and, with ``backward``, the backward
    of ``loss(output)``, by default the sum of every float tensor in the output) and report where
    each float32 matmul ran. Parameter gradients accumulate as in a training step; zero them after
    if that matters."""
    report = CoverageReport()
    recorder = _Recorder(report)
    with recorder:
        out = model(*example_inputs, **example_kwargs)
        if backward:
            value = loss(out) if loss is not None else _sum_of(out)
            recorder.phase = "backward"
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
