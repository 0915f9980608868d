"""The dispatcher: a pure function from (device facts, problem) to a plan.

No torch, no CUDA: every decision can be tested on a CPU with a simulated device. A plan names
the chosen kernel with its macros and launch geometry, and for every other family the reason it
was not chosen, so :func:`fastmm.explain` can show the whole decision.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .families import FAMILIES, KernelConfig, _vec_ok, kmajor_batch, second_pass_config, stage_kmajor_config
from .problem import DeviceFacts, Problem
from .tuned import TunedChoice

INT32_MAX = 2**31 - 1
MIN_CC = (7, 5)  # NVRTC 13 builds nothing older than sm_75
#: Problems with at most this many outputs go to the scalar kernel: a 64x64 tile would leave
#: most of its threads idle, and the call is launch-bound anyway.
TINY_OUTPUTS = 1024

PREFERENCE = {
    "tf32": ("skinny", "wgmma_tf32", "tf32_mma", "simt_cp_async", "simt_float4", "scalar"),
    "tf32x3": ("skinny", "wgmma_tf32", "tf32_mma", "simt_cp_async", "simt_float4", "scalar"),
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
    reduce: KernelConfig | None = None  # second pass: split-K's reduce or stream-K's fixup
    # Operands copied into padded, 16-byte aligned buffers before the launch: (operand, rows,
    # padded columns), and the problem as the kernel then sees it. Operand "bt" is B transposed
    # (N rows of K), the K-major copy the wgmma family reads.
    staging: tuple[tuple[str, int, int], ...] = ()
    launch_problem: Problem | None = None
    # The kernels that make the staged copies, one per staging entry; empty where torch copies.
    stagers: tuple[KernelConfig, ...] = ()
    # Where the choice came from: "heuristic", "tuned: <measurements>", "forced: <family>", or
    # "heuristic (tuned choice ... ignored: <why>)".
    origin: str = "heuristic"
    # The kernel computes C^T = B^T A^T: launch_problem is the transposed problem, whose A is B
    # (and B is A, or its staged copy); runtime.runners.wgmma_runner passes the operands exchanged.
    swap_ab: bool = False

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
            if self.reduce is not None:
                lines.append(f"then: {self.reduce.describe()}")
            lines += [f"  staged: {text}" for _, text in self.staged_descriptions()]
            lines.append(f"choice: {self.origin}")
        for name, reason in self.rejected:
            lines.append(f"rejected {name}: {reason}")
        return "\n".join(lines)

    def staged_descriptions(self) -> list[tuple[str, str]]:
        """(operand, what is done to it) for each staged copy, as describe() and explain() say it."""
        out = []
        x3 = self.kernel.family == "wgmma_tf32" and self.precision_used == "tf32x3"
        for which, rows, cols in self.staging:
            what = "B transposed" if which == "bt" else which.upper()
            if self.kernel.family == "wgmma_tf32":
                copies = kmajor_batch(self.problem, which)[1]
                each = f"{copies} x {rows}x{cols}" if copies > 1 else f"{rows}x{cols}"
                if x3:
                    out.append((which, f"{what} split into big and small TF32 halves, K-major ({each} each; "
                                       "stage_kmajor)"))
                else:
                    out.append((which, f"{what} copied K-major ({each}, 16-byte aligned rows; stage_kmajor): TF32 "
                                       "wgmma needs one operand K-major in shared memory (the other may come "
                                       "through registers), and a tensor map cannot read this one that way"))
            else:
                out.append((which, f"{what} copied into a zero-padded {rows}x{cols} buffer with 16-byte aligned rows, "
                                   "so the kernel loads it with 16-byte copies"))
        return out


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


def transposed(p: Problem) -> Problem:
    """The problem C^T = B^T A^T: the same memory, with the roles of A and B exchanged."""
    return replace(p, M=p.N, N=p.M, a_strides=p.b_strides[::-1], b_strides=p.a_strides[::-1],
                   c_strides=p.c_strides[::-1], a_batch_strides=p.b_batch_strides, b_batch_strides=p.a_batch_strides,
                   a_align=p.b_align, b_align=p.a_align, a_padded=p.b_padded, b_padded=p.a_padded)


def _wgmma_copies(p: Problem) -> tuple[Problem, tuple[tuple[str, int, int], ...], bool]:
    """How the wgmma family reads ``p``: (launch problem, K-major copies to make first, swap).

    tf32 reads in place a K-major or m-contiguous A with a K-major B, and an n-contiguous B with
    a K-major A by swapping (FAMILIES["wgmma_tf32"].in_place_form). Otherwise it copies one
    operand into K-major buffers (one per matrix of its batch: families.kmajor_batch), A as
    M x K4 or B as its transpose N x K4, and both only when neither can be read in place. tf32x3
    always copies both: the copy makes the big and small halves. Rows are padded to 16 bytes; the
    maps still say K, so the padding is never read."""
    wg = FAMILIES["wgmma_tf32"]
    k4 = -(-p.K // 4) * 4
    split = p.precision == "tf32x3"
    form = None if split else wg.in_place_form(p)
    if form is not None:
        return (transposed(p), (), True) if form == "swap" else (p, (), False)

    original = p

    def dense_batch(which, rows):  # batch strides of the copies: matrix after matrix
        n1, _, s0, s1 = kmajor_batch(original, which)
        return (n1 * rows * k4 if s0 else 0, rows * k4 if s1 else 0)

    def copy_a(q):
        return replace(q, a_strides=(k4, 1), a_align=16, a_batch_strides=dense_batch("a", q.M)), ("a", q.M, k4)

    def copy_bt(q):
        return replace(q, b_strides=(1, k4), b_align=16, b_batch_strides=dense_batch("bt", q.N)), ("bt", q.N, k4)

    if not split and (wg.a_mn_ready(p) or wg.b_mn_ready(p)):
        # One copy: of A (then swap, B fed from registers) or of B^T (A fed from registers);
        # where both would do, of the operand with fewer elements to copy (over its own batch).
        a_size, b_size = p.M * kmajor_batch(p, "a")[1], p.N * kmajor_batch(p, "bt")[1]
        if wg.b_mn_ready(p) and not (wg.a_mn_ready(p) and b_size < a_size):
            q, entry = copy_a(p)
            return transposed(q), (entry,), True
        q, entry = copy_bt(p)
        return q, (entry,), False
    staged = []
    if split or not wg.a_ready(p):
        p, entry = copy_a(p)
        staged.append(entry)
    if split or not wg.b_ready(p):
        p, entry = copy_bt(p)
        staged.append(entry)
    return p, tuple(staged), False


#: The wgmma family does not split K: each block walks all of K. tf32_mma, slower per SM but
#: with K split over every SM, is faster when wgmma's tiles fill less than this share of the
#: SMs: about its relative speed (H200: TF32 120 vs 350 TFLOP/s; tf32x3 24-28 vs 115).
WGMMA_MIN_SM_FRACTION = {"tf32": 1 / 3, "tf32x3": 1 / 4}
#: wgmma takes a problem whose operands it must copy first when the product does at least this
#: many FLOP per byte the copies move (see _wgmma_reason).
WGMMA_COPY_MIN_FLOP_PER_BYTE = {"tf32": 128, "tf32x3": 20}


def _wgmma_reason(p: Problem, dev: DeviceFacts) -> str | None:
    """Why the wgmma family should not take ``p`` although it could (heuristics, not limits):
    too few tiles for the SMs, or copies that would cost too much next to the product."""
    blocks = -(-p.M // 128) * -(-p.N // 128) * p.batch_total
    share = WGMMA_MIN_SM_FRACTION[p.precision]
    if blocks < share * dev.sm_count:
        return (f"{blocks} tiles of 128x128 fill under 1/{round(1 / share)} of the {dev.sm_count} SMs, and this "
                "family does not split K")
    _, staged, _ = _wgmma_copies(p)
    x3 = p.precision == "tf32x3"
    per_element = 12 if x3 else 8  # read, write (twice when split)
    moved = sum(per_element * rows * cols * kmajor_batch(p, which)[1] for which, rows, cols in staged)
    # The alternative, tf32_mma, is much slower (H200: TF32 120 vs 350 TFLOP/s; tf32x3 24-28 vs
    # 115): with copies at ~3 TB/s, wgmma + copies is faster above ~60 FLOP per copied byte for
    # tf32 and ~10 for tf32x3. Asked: about twice that.
    need = WGMMA_COPY_MIN_FLOP_PER_BYTE["tf32x3" if x3 else "tf32"]
    if staged and 2 * p.M * p.N * p.K * p.batch_total < need * moved:
        names = " and ".join("B (transposed)" if w == "bt" else "A" for w, _, _ in staged)
        return f"needs a K-major copy of {names}, too costly next to a product this small"
    return None


def _staging(p: Problem, family: str) -> tuple[Problem, tuple[tuple[str, int, int], ...], bool]:
    """Copy plan for operands that are contiguous along their row but cannot be read with 16-byte
    vectors (N or K not a multiple of 4, odd row pitch or pointer): a zero-padded aligned copy
    turns 4-byte copies into 16-byte ones. Batch 1 only. (wgmma: see _wgmma_copies; the third
    value says the launch problem is the transposed one.)"""
    if family == "wgmma_tf32":
        return _wgmma_copies(p)
    return _simt_staging(p, family) + (False,)


def _simt_staging(p: Problem, family: str) -> tuple[Problem, tuple[tuple[str, int, int], ...]]:
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


def _select(p: Problem, dev: DeviceFacts, force: str | None = None) -> Plan:
    """The heuristic choice for ``p`` on ``dev``; ``force`` names a family to use where it can run."""
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
        if reason is None and name == "wgmma_tf32" and force != name:
            reason = _wgmma_reason(p, dev)
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
    used = p.precision if chosen.family in ("tf32_mma", "wgmma_tf32") else "ieee"
    launch_p, staging, swap = _staging(p, chosen.family)
    if staging or swap:
        chosen = FAMILIES[chosen.family].configure(launch_p, dev)
    reduce = second_pass_config(p, dev, chosen)
    stagers = ()
    if staging and chosen.family == "wgmma_tf32":
        stagers = tuple(stage_kmajor_config(p, which, p.precision == "tf32x3") for which, _, _ in staging)
    return Plan(p, dev, chosen, used, tuple(rejected), None, reduce, staging, launch_p if staging or swap else None,
                stagers, swap_ab=swap)


def select(p: Problem, dev: DeviceFacts, force: str | None = None, tuned: TunedChoice | None = None) -> Plan:
    """Choose the kernel for ``p`` on ``dev``: ``force`` names a family to use where it can run;
    else ``tuned`` (a measured choice stored for p's shape bucket) where it still applies; else
    the heuristics. ``Plan.origin`` says which."""
    if force is not None:
        plan = _select(p, dev, force)
        return replace(plan, origin=f"forced: {force}") if plan.kernel is not None else plan
    if tuned is None:
        return _select(p, dev)
    why_not = tuned_reject_reason(p, dev, tuned)
    if why_not is not None:
        plan = _select(p, dev)
        return replace(plan, origin=f"heuristic (tuned choice {tuned.label()} ignored: {why_not})")
    plan = _select(p, dev, tuned.family)  # the family with its staging; the others' reasons
    if plan.kernel is None:
        return plan
    chosen = _configure(tuned.family, plan.launch_problem or p, dev, tuned.option)
    reduce = second_pass_config(p, dev, chosen)
    rejected = tuple((name, reason.replace(" (forced)", " (tuned)")) for name, reason in plan.rejected)
    origin = "tuned" + (f": {tuned.provenance}" if tuned.provenance else "")
    return replace(plan, kernel=chosen, reduce=reduce, rejected=rejected, origin=origin)


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


def _configure(name: str, p: Problem, dev: DeviceFacts, option: tuple[int, ...]) -> KernelConfig:
    """A family's kernel for ``option``; the empty option of a family with nothing to choose is
    its own choice."""
    fam = FAMILIES[name]
    return fam.configure(p, dev, tuple(option)) if option else fam.configure(p, dev)
