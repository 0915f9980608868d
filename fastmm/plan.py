"""The dispatcher: a pure function from (device facts, problem) to a plan.

No torch, no CUDA: every decision can be tested on a CPU with a simulated device. A plan names
the chosen kernel with its macros and launch geometry, and for every other family the reason it
was not chosen, so :func:`fastmm.explain` can show the whole decision.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from . import cost
from .families import FAMILIES, Family, KernelConfig, second_pass_config, stream_k_head_config
from .families.simt_cp_async import short_rows_first
from .families.wgmma_tf32 import wgmma_ahead
from .problem import DeviceFacts, Problem
from .tuned import TunedChoice

INT32_MAX = 2**31 - 1
MIN_CC = (7, 5)  # NVRTC 13 builds nothing older than sm_75
#: Problems with at most this many outputs go to the scalar kernel: a 64x64 tile would leave
#: most of its threads idle, and the call is launch-bound anyway.
TINY_OUTPUTS = 1024
#: ... and at most this K: beyond it one thread per output runs a long serial sum, while the
#: skinny kernels spread K over a warp and over blocks. H200 (`probes/model_products.py --decode`,
#: NOTES run 28): at K = 1024 the scalar kernel took 33.0 us for a decode step's 1 x 1024 x 1024
#: x @ W^T and 32.6 for 1 x 256 x 1024 (cuBLAS 3.9 and 3.2; skinny_kmajor 5.7 and 5.2): ~30 ns a
#: k step. Up to K = 256 it stays near 10 us, about what the others' two launches (a split and
#: its reduce, or a copy and the product) cost for so few outputs (not measured).
TINY_K = 256

PREFERENCE = {
    "tf32": ("kmajor_mma", "skinny_kmajor", "skinny", "wgmma_tf32", "tf32_mma", "simt_cp_async", "simt_float4", "scalar"),
    "tf32x3": ("kmajor_mma", "skinny_kmajor", "skinny", "wgmma_tf32", "tf32_mma", "simt_cp_async", "simt_float4", "scalar"),
    "ieee": ("skinny_kmajor", "skinny", "simt_cp_async", "simt_float4", "scalar"),
}


class FamilyCannotRun(ValueError):
    """A forced family cannot run the problem (its precision, shape, layout or arch): raised by
    :func:`select`, so that callers forcing a family "where it can run" (FASTMM_KERNEL,
    fastmm.dispatch.plan_for; the CLI's checks) tell it from a name that is no family."""


@dataclass(frozen=True)
class Plan:
    problem: Problem
    device: DeviceFacts
    kernel: KernelConfig | None
    precision_used: str | None
    rejected: tuple[tuple[str, str], ...] = field(default=())
    fallback: str | None = None  # why torch.matmul runs instead (kernel is None)
    reduce: KernelConfig | None = None  # second pass: split-K's reduce or stream-K's fixup
    # Operands copied into padded, 16-byte aligned buffers before the launch: (operand, rows,
    # padded columns), and the problem as the kernel then sees it. Operand "bt" is B transposed
    # (N rows of K), the K-major copy the wgmma family reads.
    staging: tuple[tuple[str, int, int], ...] = ()
    launch_problem: Problem | None = None
    # The kernels that make the staged copies, one per staging entry.
    stagers: tuple[KernelConfig, ...] = ()
    # Where the choice came from: "heuristic", "tuned: <measurements>", "forced: <family>", or
    # "heuristic (tuned choice ... ignored: <why>)".
    origin: str = "heuristic"
    # The kernel computes C^T = B^T A^T: launch_problem is the transposed problem, whose A is B
    # (and B is A, or its staged copy); runtime.runners.wgmma_runner passes the operands exchanged.
    swap_ab: bool = False
    # Families that replace the registry's defaults by name (a benchmark's or a test's variant,
    # e.g. ``Skinny(fuse_split=False)``); empty for every call through the public API.
    variants: tuple[Family, ...] = ()
    # First launch of a stream-K plan in the head form: the plain kernel over C's first rows
    # (work_split.stream_k_head_config), before ``kernel`` covers the rows after them.
    head: KernelConfig | None = None

    def kernels(self) -> tuple[KernelConfig, ...]:
        """Every kernel the plan launches (what must be built and loaded before it runs): the
        GEMM, the head launch, the second pass, the stagers."""
        return tuple(k for k in (self.kernel, self.head, self.reduce, *self.stagers) if k is not None)

    def describe(self) -> str:
        lines = []
        if self.kernel is None:
            lines.append(f"torch.matmul fallback: {self.fallback}")
        else:
            lines.append(f"kernel: {self.kernel.describe()}")
            if self.swap_ab:
                lines.append("  computed as C^T = B^T A^T: the kernel's A operand is B^T (B n-contiguous, fed from "
                             "registers), its B operand is A^T (A read K-major), and C is written transposed; the "
                             "tile, loads and stores below are in those terms")
            lines.append("  macros: " + ", ".join(f"{k}={v}" for k, v in self.kernel.macros))
            for key, value in self.kernel.details:
                lines.append(f"  {key}: {value}")
            if self.head is not None:
                lines.append(f"first: {self.head.describe()}")
            if self.reduce is not None:
                lines.append(f"then: {self.reduce.describe()}")
            lines += [f"  staged: {text}" for _, text in self.staged_descriptions()]
            lines.append(f"choice: {self.origin}")
            for fam in self.variants:
                lines.append(f"  variant: {fam!r}")
        for name, reason in self.rejected:
            lines.append(f"rejected {name}: {reason}")
        return "\n".join(lines)

    def staged_descriptions(self) -> list[tuple[str, str]]:
        """(operand, what is done to it) for each staged copy, as describe() and explain() say it."""
        fam = family_of(self.kernel.family, self.variants)
        return [(which, fam.describe_staging(self.problem, which, rows, cols)) for which, rows, cols in self.staging]


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


def _shape_reason(name: str, p: Problem) -> str | None:
    if name != "scalar" and p.M * p.N <= TINY_OUTPUTS and p.K <= TINY_K:
        return (f"problem is tiny (M*N = {p.M * p.N} <= {TINY_OUTPUTS}, K = {p.K} <= {TINY_K}): the scalar "
                "kernel wastes fewer threads")
    return None


def family_of(name: str, variants: tuple[Family, ...] = ()) -> Family:
    """The family called ``name``: a variant handed in, else the registry's."""
    for fam in variants:
        if fam.name == name:
            return fam
    return FAMILIES[name]


#: A TF32 request runs its full-fp32 plan instead where the cost model (:mod:`fastmm.cost`)
#: predicts that plan faster by more than this share of the TF32 plan's time: beyond the
#: model's error on the ratio of two plans' times (log error: median 0.10, 90th percentile 0.20
#: over 76 pairs measured on the H200, RESULTS.md run 17), so that a choice the preference order
#: got from measurements is left only on a clear prediction. Only on the arches the model was
#: calibrated on (``cost.CALIBRATED``).
COST_MARGIN = 0.25


def _select(p: Problem, dev: DeviceFacts, force: str | None = None, variants: tuple[Family, ...] = ()) -> Plan:
    """The heuristic choice for ``p`` on ``dev``; ``force`` names a family to use where it can run."""
    plan = _select_in_order(p, dev, force, variants)
    if force is None and plan.kernel is not None and plan.precision_used not in (None, "ieee") and cost.calibrated(dev):
        return _fp32_if_faster(plan, dev, variants)
    return plan


def _fp32_if_faster(plan: Plan, dev: DeviceFacts, variants: tuple[Family, ...]) -> Plan:
    """``plan`` (a TF32 plan for a tf32 or tf32x3 request), or the request's full-fp32 plan where
    the cost model predicts it faster by more than ``COST_MARGIN``: full fp32 is at least as
    accurate as what was asked for, so the faster of the two serves it."""
    p = plan.problem
    alt = _select_in_order(replace(p, precision="ieee"), dev, None, variants)
    if alt.kernel is None:
        return plan
    mine, theirs = cost.predict(plan), cost.predict(alt)
    if not cost.faster_by(theirs, mine, COST_MARGIN):
        return plan
    why = (f"the cost model predicts {theirs.per_call_us:.1f} us a call for the full-fp32 {alt.kernel.family} plan "
           f"against {mine.per_call_us:.1f} us for this one (the larger of GPU and host time): the fp32 plan is "
           "faster here, and more accurate")
    tc = plan.kernel.family  # (the others' reasons as the TF32 plan gave them, the fp32 family now preferred)
    rejected = ((tc, why),) + tuple((name, f"{alt.kernel.family} is preferred" if reason == f"{tc} is preferred" else reason)
                                    for name, reason in plan.rejected if name != alt.kernel.family)
    return replace(alt, problem=p, rejected=rejected,
                   origin=f"heuristic, cost model: ran full fp32 ({alt.kernel.family}), predicted "
                          f"{theirs.per_call_us:.1f} us against {mine.per_call_us:.1f} us for {plan.kernel.family} "
                          f"({p.precision}): faster here, and more accurate")


def _select_in_order(p: Problem, dev: DeviceFacts, force: str | None, variants: tuple[Family, ...]) -> Plan:
    """The first family of ``p``'s preference order that accepts it (``force`` first)."""
    why_not = _problem_fallback(p, dev)
    if why_not:
        return Plan(p, dev, None, None, (), why_not, variants=variants)
    if force is not None and force not in FAMILIES:
        raise ValueError(f"unknown kernel family {force!r}; expected one of {sorted(FAMILIES)}")

    rejected: list[tuple[str, str]] = []
    chosen: KernelConfig | None = None
    order = PREFERENCE[p.precision]
    if force is None and wgmma_ahead(p, dev, family_of("wgmma_tf32", variants)):
        # (tf32 from 17 rows: wgmma on 64-row tiles, or splitting K, beats the decode families)
        order = ("wgmma_tf32",) + tuple(n for n in order if n != "wgmma_tf32")
    elif force is None and short_rows_first(p, family_of("simt_cp_async", variants)):
        # (fp32 at 17-32 rows on x @ W.t(): the 32-row SIMT tile beats skinny_kmajor's)
        order = ("simt_cp_async",) + tuple(n for n in order if n != "simt_cp_async")
    if force is not None:
        order = (force,) + tuple(n for n in order if n != force)
    for name in order:
        fam = family_of(name, variants)
        reason = fam.reject(p, dev)
        if reason is None and force is None:
            reason = _shape_reason(name, p)
        if reason is None and force != name:
            reason = fam.heuristic_reason(p, dev)
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
        raise FamilyCannotRun(f"kernel family {force!r} cannot run this problem: {dict(rejected)[force]}")
    assert chosen is not None  # scalar accepts everything that passed _problem_fallback
    fam = family_of(chosen.family, variants)
    used = fam.precision_computed(p)
    launch_p, staging, swap = fam.staging(p, dev)
    if staging or swap:
        again = fam.relaunch_option(p, dev, chosen)
        chosen = fam.configure(launch_p, dev) if again is None else fam.configure(launch_p, dev, again)
    chosen, reduce = with_epilogue(p, chosen, second_pass_config(p, dev, chosen))
    stagers = _stagers(fam, p, staging)
    return Plan(p, dev, chosen, used, tuple(rejected), None, reduce, staging, launch_p if staging or swap else None,
                stagers, swap_ab=swap, variants=variants, head=stream_k_head_config(chosen))


EPILOGUE_MACRO = ("EPILOGUE", 1)


def with_epilogue(p: Problem, kernel: KernelConfig, second: KernelConfig | None):
    """``(kernel, second)`` built to apply ``p``'s fused epilogue (``p.epilogue``) in the stores
    that finish outputs: the GEMM's own where it writes C (no split, a split summed by its last
    block, stream-K's whole tiles), the second pass's where there is one (split-K's reduce,
    stream-K's fixup). A GEMM that writes only partial slices is built without it."""
    if not p.epilogue:
        return kernel, second
    what = ("epilogue", "alpha * product + beta * D (a bias, addmm's input) in the store that finishes each "
                        "output: no second pass over C")
    if second is not None:
        second = replace(second, macros=second.macros + (EPILOGUE_MACRO,), details=second.details + (what,))
    if second is None or kernel.stream_k is not None:
        kernel = replace(kernel, macros=kernel.macros + (EPILOGUE_MACRO,), details=kernel.details + (what,))
    return kernel, second


def select(p: Problem, dev: DeviceFacts, force: str | None = None, tuned: TunedChoice | None = None,
           variants: tuple[Family, ...] = ()) -> Plan:
    """Choose the kernel for ``p`` on ``dev``: ``force`` names a family to use where it can run;
    else ``tuned`` (a measured choice stored for p's shape bucket) where it still applies; else
    the heuristics. ``Plan.origin`` says which. ``variants``: family instances that replace the
    registry's by name (benchmarks and tests; they are part of the plan and of every cache key)."""
    if force is not None:
        plan = _select(p, dev, force, variants)
        return replace(plan, origin=f"forced: {force}") if plan.kernel is not None else plan
    if tuned is None:
        return _select(p, dev, None, variants)
    why_not = tuned_reject_reason(p, dev, tuned)
    if why_not is not None:
        plan = _select(p, dev, None, variants)
        return replace(plan, origin=f"{plan.origin} (tuned choice {tuned.label()} ignored: {why_not})")
    plan = _select(p, dev, tuned.family, variants)  # the family and the others' reasons
    if plan.kernel is None:
        return plan
    fam = family_of(tuned.family, variants)
    # the copies for the tuned option's own tile (simt_cp_async transposes W^T for its largest
    # tile only), so the tuner times each option as it would run
    launch_p, staging, swap = fam.staging(p, dev, tuple(tuned.option) or None)
    stagers = _stagers(fam, p, staging)
    chosen = _configure(fam, launch_p, dev, tuned.option)
    chosen, reduce = with_epilogue(p, chosen, second_pass_config(p, dev, chosen))
    rejected = tuple((name, reason.replace(" (forced)", " (tuned)")) for name, reason in plan.rejected)
    origin = "tuned" + (f": {tuned.provenance}" if tuned.provenance else "")
    return replace(plan, kernel=chosen, reduce=reduce, rejected=rejected, origin=origin, staging=staging,
                   stagers=stagers, launch_problem=launch_p if staging or swap else None, swap_ab=swap,
                   head=stream_k_head_config(chosen))


def _stagers(fam: Family, p: Problem, staging) -> tuple[KernelConfig, ...]:
    """The kernels that make ``staging``'s copies: one per copy (every copy is a fastmm kernel;
    a runner launches the GEMM on the copies only where it made them)."""
    stagers = fam.stagers(p, staging) if staging else ()
    if len(stagers) != len(staging):
        raise AssertionError(f"family {fam.name} stages {len(staging)} operand(s) with {len(stagers)} kernel(s)")
    return stagers


def tuned_reject_reason(p: Problem, dev: DeviceFacts, tuned: TunedChoice) -> str | None:
    """Why a tuned choice cannot serve ``p`` (None: it can). A choice is stored per shape bucket,
    so it can meet a problem of its bucket that its family or option does not take, and a record
    can outlive the families it names (another fastmm version, a hand-edited file)."""
    fam = FAMILIES.get(tuned.family)
    if fam is None:
        return f"no kernel family is named {tuned.family!r}"
    if tuned.family not in PREFERENCE[p.precision]:
        return f"{tuned.family} does not compute precision '{p.precision}'"
    reason = fam.reject(p, dev)
    if reason is not None:
        return f"{tuned.family} cannot run this problem: {reason}"
    options = fam.options(p, dev)
    if tuple(tuned.option) not in options:
        return f"{tuned.family} has no option {tuple(tuned.option)} for this problem (it has {list(options)})"
    return None


def candidate_choices(p: Problem, dev: DeviceFacts) -> list[TunedChoice]:
    """Every (family, option) that can run ``p`` on ``dev`` at its precision, in preference order:
    what the tuner times."""
    if _problem_fallback(p, dev):
        return []
    return [TunedChoice(name, tuple(option)) for name in PREFERENCE[p.precision]
            if FAMILIES[name].reject(p, dev) is None for option in FAMILIES[name].options(p, dev)]


def _configure(fam: Family, p: Problem, dev: DeviceFacts, option: tuple[int, ...]) -> KernelConfig:
    """A family's kernel for ``option``; the empty option of a family with nothing to choose is
    its own choice."""
    return fam.configure(p, dev, tuple(option)) if option else fam.configure(p, dev)
