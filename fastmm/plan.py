"""The dispatcher: a pure function from (device facts, problem) to a plan.

No torch, no CUDA: every decision can be tested on a CPU with a simulated device. A plan names
the chosen kernel with its macros and launch geometry, and for every other family the reason it
was not chosen, so :func:`fastmm.explain` can show the whole decision.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .families import FAMILIES, KernelConfig, _vec_ok, splitk_reduce_config
from .problem import DeviceFacts, Problem

INT32_MAX = 2**31 - 1
MIN_CC = (7, 5)  # NVRTC 13 builds nothing older than sm_75
#: Problems with at most this many outputs go to the scalar kernel: a 64x64 tile would leave
#: most of its threads idle, and the call is launch-bound anyway.
TINY_OUTPUTS = 1024

PREFERENCE = {
    "tf32": ("skinny", "tf32_mma", "simt_cp_async", "simt_float4", "scalar"),
    "tf32x3": ("skinny", "tf32_mma", "simt_cp_async", "simt_float4", "scalar"),
    "ieee": ("skinny", "simt_cp_async", "simt_float4", "scalar"),
}


@dataclass(frozen=True)
class Plan:
    problem: Problem
    device: DeviceFacts
    kernel: KernelConfig | None
    precision_used: str | None
    rejected: tuple[tuple[str, str], ...] = field(default=())
    fallback: str | None = None  # why torch.matmul runs instead (kernel is None)
    reduce: KernelConfig | None = None  # second pass of a split-K kernel
    # Operands copied into padded, 16-byte aligned buffers before the launch: (operand, rows,
    # padded columns), and the problem as the kernel then sees it.
    staging: tuple[tuple[str, int, int], ...] = ()
    launch_problem: Problem | None = None

    def describe(self) -> str:
        lines = []
        if self.kernel is None:
            lines.append(f"torch.matmul fallback: {self.fallback}")
        else:
            lines.append(f"kernel: {self.kernel.describe()}")
            lines.append("  macros: " + ", ".join(f"{k}={v}" for k, v in self.kernel.macros))
            for key, value in self.kernel.details:
                lines.append(f"  {key}: {value}")
            if self.reduce is not None:
                lines.append(f"then: {self.reduce.describe()}")
            for which, rows, cols in self.staging:
                lines.append(f"  staged: {which.upper()} copied into a zero-padded {rows}x{cols} buffer with 16-byte "
                             "aligned rows, so the kernel loads it with 16-byte copies")
        for name, reason in self.rejected:
            lines.append(f"rejected {name}: {reason}")
        return "\n".join(lines)


def _problem_fallback(p: Problem, dev: DeviceFacts) -> str | None:
    if dev.cc < MIN_CC:
        return f"device {dev.arch} is older than sm_{MIN_CC[0]}{MIN_CC[1]}, the oldest fastmm supports"
    if max(p.M, p.N, p.K, p.batch_total) > INT32_MAX:
        return "a dimension exceeds 2^31-1 (kernels index sizes with 32-bit ints)"
    if -(-p.M // 16) * -(-p.N // 16) > INT32_MAX:
        return "more than 2^31-1 output tiles"
    for name, align in (("A", p.a_align), ("B", p.b_align), ("C", p.c_align)):
        if align < 4:
            return f"{name}'s data pointer is not 4-byte aligned, which no float kernel can read"
    return None


#: Stage an operand only when the product does at least this many FLOP per byte the copy moves
#: (a read and a write of the operand): then the copy costs < ~1% next to the product.
STAGE_MIN_FLOP_PER_BYTE = 256
STAGED_FAMILIES = ("simt_cp_async", "tf32_mma")


def _staging(p: Problem, family: str) -> tuple[Problem, tuple[tuple[str, int, int], ...]]:
    """Copy plan for operands that are contiguous along their row but cannot be read with 16-byte
    vectors (N or K not a multiple of 4, odd row pitch or pointer): a zero-padded aligned copy
    turns 4-byte copies into 16-byte ones. Batch 1 only."""
    if family not in STAGED_FAMILIES or p.batch_total != 1:
        return p, ()
    flop = 2 * p.M * p.N * p.K
    staged = []
    sBk, sBn = p.b_strides
    if sBn == 1 and p.N > 1 and not _vec_ok(p.N, sBk, (0, 0), p.b_align) and flop >= STAGE_MIN_FLOP_PER_BYTE * 8 * p.K * p.N:
        n4 = -(-p.N // 4) * 4
        p = replace(p, b_strides=(n4, 1), b_align=16, b_batch_strides=(0, 0), b_padded=True)
        staged.append(("b", p.K, n4))
    sAm, sAk = p.a_strides
    # The SIMT families read a k-contiguous A with 4-byte copies anyway (they transpose it).
    if (family == "tf32_mma" and sAk == 1 and p.K > 1 and not _vec_ok(p.K, sAm, (0, 0), p.a_align)
            and flop >= STAGE_MIN_FLOP_PER_BYTE * 8 * p.M * p.K):
        k4 = -(-p.K // 4) * 4
        p = replace(p, a_strides=(k4, 1), a_align=16, a_batch_strides=(0, 0), a_padded=True)
        staged.append(("a", p.M, k4))
    return p, tuple(staged)


def _shape_reason(name: str, p: Problem) -> str | None:
    if name != "scalar" and p.M * p.N <= TINY_OUTPUTS:
        return f"problem is tiny (M*N = {p.M * p.N} <= {TINY_OUTPUTS}): the scalar kernel wastes fewer threads"
    return None


def select(p: Problem, dev: DeviceFacts, force: str | None = None) -> Plan:
    """Choose the kernel for ``p`` on ``dev``; ``force`` names a family to use where it can run."""
    why_not = _problem_fallback(p, dev)
    if why_not:
        return Plan(p, dev, None, None, (), why_not)
    if force is not None and force not in FAMILIES:
        raise ValueError(f"unknown kernel family {force!r}; expected one of {sorted(FAMILIES)}")

    rejected: list[tuple[str, str]] = []
    chosen: KernelConfig | None = None
    order = PREFERENCE[p.precision]
    if force is not None:
        order = (force,) + tuple(n for n in order if n != force)
    for name in order:
        fam = FAMILIES[name]
        reason = fam.reject(p, dev)
        if reason is None and force is None:
            reason = _shape_reason(name, p)
        if reason is None and chosen is None:
            chosen = fam.configure(p, dev)
            continue
        if chosen is not None and reason is None:
            reason = f"{chosen.family} is preferred" + (" (forced)" if force == chosen.family else "")
        rejected.append((name, reason))
    for name in FAMILIES:
        if name not in order:
            rejected.append((name, f"does not compute precision '{p.precision}'"))
    if force is not None and (chosen is None or chosen.family != force):
        raise ValueError(f"kernel family {force!r} cannot run this problem: {dict(rejected)[force]}")
    assert chosen is not None  # scalar accepts everything that passed _problem_fallback
    used = p.precision if chosen.family == "tf32_mma" else "ieee"
    launch_p, staging = _staging(p, chosen.family)
    if staging:
        chosen = FAMILIES[chosen.family].configure(launch_p, dev)
    reduce = splitk_reduce_config(p, dev, chosen.split_k) if chosen.split_k > 1 else None
    return Plan(p, dev, chosen, used, tuple(rejected), None, reduce, staging, launch_p if staging else None)
