"""``fastmm.explain``: what the dispatcher decided for a call, and why, as data and as text."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import cost
from .dispatch import not_served_reason, plan_for
from .precision import resolve_precision
from .shapes import analyse, build_problem, result_matrix
from .plan import Plan


@dataclass
class Explanation:
    device: str
    capability: str | None
    shapes: dict
    precision_requested: str
    precision_used: str | None
    kernel: str | None  # family name, or None when torch.matmul runs
    parameters: dict = field(default_factory=dict)
    launch: dict = field(default_factory=dict)
    rejected: list = field(default_factory=list)  # (family, reason)
    fallback: str | None = None
    cache: str = ""
    plan: Plan | None = None
    # "heuristic", "tuned: <measurements>" (fastmm.tune), "forced: <family>", or why a stored
    # tuned choice was ignored
    choice: str = "heuristic"
    # The cost model's GPU time for the plan (fastmm.cost); None for torch.matmul
    prediction: cost.Prediction | None = None

    def __str__(self) -> str:
        s = self.shapes
        lines = [f"fastmm plan for {s['a_shape']} @ {s['b_shape']} on {self.device}"
                 + (f" (capability {self.capability})" if self.capability else "")]
        if "M" in s:
            lines.append(f"  problem: M={s['M']} N={s['N']} K={s['K']} batch={s['batch']}")
            for op in "abc":
                lines.append(f"  {op.upper()}: {s[op + '_layout']}, strides {s[op + '_strides']}, "
                             f"batch strides {s[op + '_batch_strides']}, pointer aligned to {s[op + '_align']} B")
        lines.append(f"  precision: requested {self.precision_requested}, used {self.precision_used or 'torch default'}")
        if self.kernel is None:
            lines.append(f"  runs: torch.matmul, because {self.fallback}")
        else:
            lines.append(f"  kernel: {self.kernel}")
            lines.append(f"  choice: {self.choice}")
            if self.prediction is not None:
                lines.append(f"  predicted: {self.prediction.describe()}")
            lines.append("  parameters: " + ", ".join(f"{k}={v}" for k, v in self.parameters.items()))
            lines.append("  launch: " + ", ".join(f"{k}={v}" for k, v in self.launch.items()))
            lines.append(f"  cache: {self.cache}")
        for name, reason in self.rejected:
            lines.append(f"  rejected {name}: {reason}")
        return "\n".join(lines)


def explain(a: torch.Tensor, b: torch.Tensor, *, precision: str | None = None,
            out: torch.Tensor | None = None) -> Explanation:
    """What :func:`fastmm.matmul` would do with these operands (nothing is computed or compiled)."""
    requested = resolve_precision(precision)
    # (a nested tensor has no one shape: its rows are ragged)
    shapes = {f"{op}_shape": "nested" if t.is_nested else tuple(t.shape) for op, t in (("a", a), ("b", b))}
    reason = not_served_reason(a, b)
    device = str(a.device)
    if reason is not None:
        return Explanation(device, None, shapes, requested, None, None, fallback=reason)
    s = analyse(a, b)
    c = s.matrix_view(out) if out is not None and tuple(out.shape) == s.out_shape else None
    if c is None:  # what matmul allocates (a meta tensor stands in; its pointer reads as 0)
        c = result_matrix(s.batch + (s.M, s.N), "meta")
    p, offsets = build_problem(s, c, requested)
    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    plan = plan_for(p, index)
    shapes.update(M=p.M, N=p.N, K=p.K, batch=s.batch, launches=len(offsets))
    for op, st, bst, al in (("a", p.a_strides, p.a_batch_strides, p.a_align), ("b", p.b_strides, p.b_batch_strides, p.b_align),
                            ("c", p.c_strides, p.c_batch_strides, p.c_align)):
        shapes.update({op + "_layout": p.layout_of(op), op + "_strides": st, op + "_batch_strides": bst, op + "_align": al})
    dev = plan.device
    exp = Explanation(f"{device} ({dev.name})", f"{dev.cc[0]}.{dev.cc[1]}", shapes, requested, plan.precision_used,
                      None, rejected=list(plan.rejected), fallback=plan.fallback, plan=plan)
    if plan.kernel is not None:
        k = plan.kernel
        exp.kernel = k.family
        exp.choice = plan.origin
        exp.parameters = dict(k.macros)
        exp.parameters.update(dict(k.details))
        if plan.swap_ab:
            exp.parameters["computed as"] = ("C^T = B^T A^T (the kernel's A is B^T, fed from registers; its B is A^T; "
                                             "C written transposed): the parameters are in those terms")
        for which, text in plan.staged_descriptions():
            exp.parameters[f"staged {which.upper()}"] = text
        exp.launch = {"grid": k.grid, "block": k.block_dims, "dynamic_smem_bytes": k.smem, "tile": k.tile,
                      "launches": len(offsets)}
        if plan.head is not None:
            exp.launch["first"] = plan.head.describe()
        if plan.reduce is not None:
            exp.launch["then"] = plan.reduce.describe()
        exp.cache = cache_state(plan)
        exp.prediction = cost.predict(plan)
    return exp


def cache_state(plan: Plan) -> str:
    from .runtime import launcher
    from .runtime.cache import default_cache

    key = launcher.key_for(plan.kernel, plan.device.arch)
    slot = launcher._modules.get(launcher.module_slot(plan.device, plan.kernel))
    cache = default_cache()
    target = plan.kernel.target(plan.device.arch)
    path = cache.path_for(plan.kernel.family + "-" + target, key)
    memory_only = cache.memory_only_reason()  # e.g. an untrusted folder (fastmm/runtime/cache.py)
    if slot is not None:
        origin = {"compiled": "compiled by this process", "disk": "loaded from the disk cache"}[slot[1]]
        where = slot[2] or (f"(memory-only cache: {memory_only})" if memory_only else "(memory-only cache)")
        return f"in memory ({origin}); file {where}"
    if cache.read(path, target, key) is not None:  # (None for an entry or folder the trust policy refuses)
        return f"on disk, not loaded yet: {path}"
    if memory_only:
        return f"not compiled yet: the first call compiles it and keeps it in memory only ({memory_only})"
    return f"not compiled yet: the first call compiles it into {path}"
