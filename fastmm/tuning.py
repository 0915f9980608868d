"""``fastmm.tune``: time every candidate kernel for a problem on this GPU and keep the fastest
correct one for the problem's shape bucket.

The heuristics in :mod:`fastmm.families` choose well for the shapes they were measured on; tuning
is for the rest (and for GPUs they were not measured on). A candidate is a (family, option) pair
that can run the problem at its precision (:func:`fastmm.plan.candidate_choices`). Each one is
planned by :func:`fastmm.plan.select` exactly as a tuned call would be, launched through the
same path :func:`fastmm.matmul` uses (staging, split-K and all), and

- checked first: its output on random inputs against a float64 product, with the tolerances of
  the test suite (relative Frobenius error; see :func:`tolerance`); a wrong or failing candidate
  is never timed and never chosen;
- then timed with CUDA events around each call, after a few warm-up calls, median of
  ``repeats``; before every timed call a buffer of twice the L2 size is written, so the operands
  come from memory, not from a cache warmed by the previous call (as in a real model, where
  other work runs between two products of the same shape).

The winner is stored per (device key, shape bucket) by :mod:`fastmm.runtime.tuning_store`, and
every cached plan is dropped, so the next call of a shape in that bucket uses it.
``FASTMM_TUNE=1`` tunes a bucket the first time a call meets it. Tuning never runs while a
CUDA graph is being captured.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import statistics
import threading
from pathlib import Path

import torch

from . import dispatch, fast_path
from .errors import warn_once
from .precision import resolve_precision
from .shapes import Shapes, analyse, build_problem, result_matrix
from .plan import Plan, candidate_choices, select
from .problem import Problem
from .runtime.compiler import CompileError
from .tuned import TunedChoice, bucket_of

#: Largest relative Frobenius error vs float64 a candidate may have: those of tests/test_gpu.py.
TOLERANCE = {"ieee": 1e-5, "tf32": 1e-3, "tf32x3": 1e-6}
#: A candidate whose first timed call is this many times slower than the fastest so far is not
#: timed further (a scalar kernel on a large product would take seconds).
PRUNE_FACTOR = 3.0
DEFAULT_REPEATS = 20
DEFAULT_WARMUP = 3
#: At most this many batch entries are compared with the float64 product (memory stays bounded).
CHECKED_BATCH_ENTRIES = 4


def tolerance(precision: str, K: int) -> float:
    """The test suite's tolerance, widened for long sums: the rounding error of a K-term fp32 sum
    grows like sqrt(K) * 2^-24, which passes 1e-6 (tf32x3) from K of about 300 on. A kernel with
    a real defect (plain TF32 where 3xTF32 was asked: ~3e-4) still fails it."""
    return max(TOLERANCE[precision], math.sqrt(max(K, 1)) * 2.0 ** -24)


@dataclasses.dataclass
class CandidateResult:
    """One candidate's outcome. ``time_ms`` is None where it was not timed (see ``note``)."""

    choice: TunedChoice
    kernel: str  # short description: tile, split, staging
    heuristic: bool  # the plan the heuristics pick
    time_ms: float | None = None
    tflops: float | None = None
    error: float | None = None
    ok: bool = False  # ran and matched float64
    note: str = ""


@dataclasses.dataclass
class TuneResult:
    problem: Problem
    bucket: str
    device: str
    candidates: list[CandidateResult]
    best: CandidateResult | None
    stored: Path | None  # the tuning file, or None (not saved: persist=False, nothing correct, unwritable)
    repeats: int

    @property
    def heuristic(self) -> CandidateResult | None:
        return next((c for c in self.candidates if c.heuristic), None)

    @property
    def speedup(self) -> float | None:
        """Heuristic time / best time (1.0 when the heuristic choice won)."""
        h = self.heuristic
        if self.best is None or h is None or h.time_ms is None or not self.best.time_ms:
            return None
        return h.time_ms / self.best.time_ms

    def table(self) -> str:
        p = self.problem
        shape = f"{p.M}x{p.N}x{p.K}" + (f", batch {p.batch_total}" if p.batch_total > 1 else "")
        lines = [f"fastmm.tune: {shape}, {p.precision}, on {self.device}; bucket {self.bucket}",
                 f"  {'candidate':<34} {'kernel':<34} {'ms':>9} {'TFLOP/s':>8} {'rel.err':>8}  ok"]
        for c in self.candidates:
            mark = "*" if c is self.best else " "
            ms = f"{c.time_ms:.4f}" if c.time_ms is not None else "-"
            tf = f"{c.tflops:.2f}" if c.tflops is not None else "-"
            err = f"{c.error:.1e}" if c.error is not None else "-"
            tail = ("  heuristic" if c.heuristic else "") + (f"  ({c.note})" if c.note else "")
            lines.append(f"{mark} {c.choice.label():<34} {c.kernel:<34} {ms:>9} {tf:>8} {err:>8}  "
                         f"{'yes' if c.ok else 'NO'}{tail}")
        if self.best is None:
            lines.append("no candidate ran correctly: nothing stored")
        else:
            speed = f", {self.speedup:.2f}x the heuristic choice" if self.speedup is not None else ""
            where = f"stored in {self.stored}" if self.stored is not None else "not stored"
            lines.append(f"best: {self.best.choice.label()}, {self.best.time_ms:.4f} ms{speed}; {where}")
        return "\n".join(lines)

    __str__ = table


def tune(a: torch.Tensor, b: torch.Tensor, precision: str | None = None, *, out: torch.Tensor | None = None,
         repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP, candidates=None,
         persist: bool = True) -> TuneResult:
    """Time every candidate kernel for ``matmul(a, b)`` on the operands' GPU, pick the fastest
    that is correct, and (``persist``) store it for the shape bucket of this call, so later calls
    in the bucket use it (``fastmm.explain`` then says "tuned").

    The operands only describe the problem (shape, strides, alignment, device): the timing runs on
    fresh random tensors laid out the same way, so ``a`` and ``b`` are neither read for values nor
    modified. ``precision`` as in :func:`fastmm.matmul`. ``candidates``: family names and/or
    ``(family, option)`` pairs to restrict the search to (the heuristic choice is always timed,
    for comparison). Raises for operands fastmm's kernels cannot serve, without CUDA, and during
    CUDA graph capture.
    """
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError("fastmm.tune expects two tensors")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    if not torch.cuda.is_available():
        raise RuntimeError("fastmm.tune times kernels on a CUDA GPU, and there is none "
                           "(torch.cuda.is_available() is False)")
    reason = dispatch.not_served_reason(a, b)
    if reason is not None:
        raise ValueError(f"fastmm.tune: fastmm's kernels cannot serve these operands: {reason}")
    _refuse_while_capturing()
    precision = resolve_precision(precision)
    s = analyse(a, b).materialized(a)
    if out is None:
        c = result_matrix(s.batch + (s.M, s.N), a.device)
    elif tuple(out.shape) != s.out_shape or out.dtype != torch.float32 or out.device != a.device:
        raise ValueError(f"out must be a float32 tensor of shape {s.out_shape} on {a.device}")
    else:
        c = s.matrix_view(out)
        if c is None:  # rows that cannot be one view of out: time on a buffer of its own
            c = result_matrix(s.batch + (s.M, s.N), a.device)
    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    return _tune(s, c, precision, index, repeats, warmup, _only(candidates), persist)


def _refuse_while_capturing() -> None:
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("fastmm.tune cannot run while a CUDA graph is being captured (it compiles, allocates "
                           "and synchronizes); tune before capturing")
    if torch.compiler.is_compiling():
        raise RuntimeError("fastmm.tune cannot be traced by torch.compile; call it outside the compiled function")


def _only(candidates):
    """``candidates`` as a predicate on TunedChoice (None: every candidate)."""
    if candidates is None:
        return None
    names, pairs = set(), set()
    for item in candidates:
        if isinstance(item, str):
            names.add(item)
        else:
            family, option = item
            pairs.add((family, tuple(option)))
    return lambda ch: ch.family in names or (ch.family, ch.option) in pairs


def _fresh_like(t: torch.Tensor, random: bool) -> torch.Tensor:
    """A new tensor with ``t``'s shape and strides, whose data pointer has the same alignment
    modulo 16 bytes (so the same plan), holding random values (else NaN)."""
    shift = (t.data_ptr() % 16) // 4 if t.data_ptr() % 4 == 0 else 0
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    size = shift + extent
    base = (torch.randn(size, device=t.device) if random
            else torch.full((size,), float("nan"), device=t.device))
    return base.as_strided(t.shape, t.stride(), shift)


def _describe(plan: Plan) -> str:
    k = plan.kernel
    text = f"tile {k.tile[0]}x{k.tile[1]}x{k.tile[2]}"
    if k.split_k > 1:
        text += f", split-K {k.split_k}"
    if k.stream_k is not None:
        text += f", stream-K {k.stream_k.whole_tiles}+{k.stream_k.blocks}x{k.stream_k.iters}"
    if plan.staging:
        text += ", staged " + "+".join(w.upper() for w, _, _ in plan.staging)
    return text


class _Reference:
    """float64 products of a few batch entries, and the error of a result against them."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, batch: tuple[int, ...]):
        total = math.prod(batch)
        flat = sorted({0, total // 3, (2 * total) // 3, total - 1})[:CHECKED_BATCH_ENTRIES] if total else []
        self.entries = [self._unravel(i, batch) for i in flat]
        self.refs = [torch.matmul(a[e].double(), b[e].double()) for e in self.entries]

    @staticmethod
    def _unravel(i: int, batch: tuple[int, ...]) -> tuple[int, ...]:
        idx = []
        for n in reversed(batch):
            idx.append(i % n)
            i //= n
        return tuple(reversed(idx))

    def error(self, c: torch.Tensor) -> float:
        num = den = 0.0
        for e, ref in zip(self.entries, self.refs):
            num += (c[e].double() - ref).square().sum().item()
            den += ref.square().sum().item()
        return math.sqrt(num / den) if den else math.sqrt(num)


def _tune(s: Shapes, c: torch.Tensor, precision: str, index: int, repeats: int, warmup: int,
          only, persist: bool) -> TuneResult:
    from .runtime import launcher

    with torch.no_grad(), torch.cuda.device(index):
        dev = dispatch.device_facts(index)
        s = dataclasses.replace(s, a=_fresh_like(s.a, True), b=_fresh_like(s.b, True))
        c = _fresh_like(c, False)
        problem, offsets = build_problem(s, c, precision)
        bucket = bucket_of(problem)
        heuristic = select(problem, dev)
        if heuristic.kernel is None:
            raise ValueError(f"fastmm.tune: no fastmm kernel can run this problem: {heuristic.fallback}")
        if s.K == 0 or c.numel() == 0:
            raise ValueError("fastmm.tune: the product is empty (M, N, K or the batch is 0): nothing to time")

        # candidates, one per distinct launch (two options can make the same kernel)
        runs: list[tuple[CandidateResult, Plan]] = []
        seen: set = set()
        for choice in candidate_choices(problem, dev):
            plan = select(problem, dev, tuned=choice)
            ident = (plan.kernels(), plan.staging)
            is_heuristic = ident == (heuristic.kernels(), heuristic.staging)
            if plan.kernel is None or ident in seen or (only is not None and not only(choice) and not is_heuristic):
                continue
            seen.add(ident)
            runs.append((CandidateResult(choice, _describe(plan), is_heuristic), plan))
        runs.sort(key=lambda r: not r[0].heuristic)  # the heuristic first: a baseline for pruning

        reference = _Reference(s.a, s.b, s.batch)
        tol = tolerance(precision, problem.K)
        flop = 2 * problem.M * problem.N * problem.K * max(1, math.prod(s.batch))
        flush = torch.empty(max(2 * dev.l2_bytes, 16 << 20) // 4, dtype=torch.float32, device=c.device)
        best: CandidateResult | None = None
        for result, plan in runs:
            try:
                loaded = launcher.load(dev, plan.kernel)
                reduce = launcher.load(dev, plan.reduce) if plan.reduce is not None else None
                for cfg in plan.kernels():  # (the head launch, the stagers: loaded when the plan runs)
                    launcher.load(dev, cfg)
            except CompileError as exc:
                result.note = f"failed to compile: {str(exc).splitlines()[0]}"
                continue

            def call(hit=dispatch.Prepared(plan, loaded, reduce)):
                dispatch.launch_plan(hit, s, c, problem, offsets, index)

            c.fill_(float("nan"))
            call()
            torch.cuda.synchronize(index)
            result.error = reference.error(c)
            if not result.error <= tol:  # NaN fails too
                result.note = f"rel. error {result.error:.2e} > {tol:.1e}: not timed"
                continue
            result.ok = True
            for _ in range(warmup):
                call()
            times = _timed(call, flush, 1, index)
            if best is not None and times[0] > PRUNE_FACTOR * best.time_ms:
                result.note = f"one timed call: over {PRUNE_FACTOR:g}x the fastest so far"
            else:
                times += _timed(call, flush, repeats - 1, index)
            result.time_ms = statistics.median(times)
            result.tflops = flop / (result.time_ms * 1e-3) / 1e12
            if best is None or result.time_ms < best.time_ms:
                best = result
        del flush

    stored = None
    if persist and best is not None:
        stored = _store(index, bucket, problem, best, next((r for r, _ in runs if r.heuristic), None), repeats,
                        len(runs))
    return TuneResult(problem, bucket, f"{dev.name} ({dev.arch})", [r for r, _ in runs], best, stored, repeats)


def _timed(call, flush: torch.Tensor, n: int, index: int) -> list[float]:
    """Milliseconds of ``n`` calls, each after overwriting L2 with ``flush``."""
    events = []
    for _ in range(n):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize(index)
    return [start.elapsed_time(end) for start, end in events]


def _store(index: int, bucket: str, problem: Problem, best: CandidateResult, heuristic: CandidateResult | None,
           repeats: int, count: int) -> Path | None:
    from .runtime.tuning_store import store_for

    shape = f"{problem.M}x{problem.N}x{problem.K}" + (f"x{problem.batch_total}" if problem.batch_total > 1 else "")
    record = {
        "family": best.choice.family, "option": list(best.choice.option), "time_ms": best.time_ms,
        "tflops": best.tflops, "shape": shape, "candidates": count, "repeats": repeats,
        "tuned_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if heuristic is not None and heuristic.time_ms is not None:
        record.update(heuristic_family=heuristic.choice.family, heuristic_option=list(heuristic.choice.option),
                      heuristic_ms=heuristic.time_ms)
    path = store_for(index).put(bucket, record)
    fast_path.forget_plans()  # cached plans of this bucket were made without the record
    return path


# ---------------------------------------------------------------------------------------------
# FASTMM_TUNE=1: tune on first use

_tried: set[tuple[int, str]] = set()
_tried_guard = threading.Lock()


def tune_on_first_use(s: Shapes, c: torch.Tensor, problem: Problem, index: int) -> None:
    """Tune the bucket of a call's problem the first time this process meets it, unless a tuned
    choice is stored already; then the call proceeds (with the new choice). Never while a CUDA
    graph is captured or torch.compile traces; a failure warns once and leaves the heuristics."""
    if torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling():
        return
    if s.K == 0 or c.numel() == 0:
        return
    dev = dispatch.device_facts(index)
    if dev.simulated:
        return
    bucket = bucket_of(problem)
    with _tried_guard:
        if (index, bucket) in _tried:
            return
        _tried.add((index, bucket))
    if dispatch.tuned_choice(problem, dev) is not None:
        return
    try:
        _tune(s, c, problem.precision, index, DEFAULT_REPEATS, DEFAULT_WARMUP, None, True)
    except Exception as exc:  # e.g. out of memory for the float64 reference: the heuristics serve
        warn_once(f"fastmm: tuning {bucket} on first use failed ({type(exc).__name__}: {exc}); "
                       "the heuristic choice serves it")


dispatch.first_use_tuner = tune_on_first_use
