"""Every candidate kernel of every row of the benchmark suite's ``model`` section, per precision,
timed beside the dispatcher's choice and torch.matmul: where the heuristics do not pick the
fastest plan, and by how much.

    PYTHONPATH=. python benchmarks/probes/candidates.py [--rows NAME,...] [--precisions ieee,tf32,tf32x3]
        [--repeats 10] [--max-candidates N] [--budget-s 120] [--json PATH] [--only-losing] [--detail]
    python benchmarks/probes/candidates.py --dry-run [--quiet] [--measure-compile 20]   # no GPU needed

Rows and operands are the benchmark's (``fastmm.benchmark``: the suite file, ``Inputs`` with each
row's layout: nn.Linear's ``x @ W.t()``, A as a transposed view, batched bmm with B^T, ...).
Candidates and their timing are the tuner's (``fastmm.tuning.tune`` with ``persist=False``: the
(family, option) pairs of ``fastmm.plan.candidate_choices``, one per distinct launch, each checked
against float64 first and timed with CUDA events around one call after an L2 flush, median of
``--repeats``, a candidate 3x slower than the fastest so far timed once). torch.matmul and the
public call ``fastmm.matmul`` (what the dispatcher really runs, tuned choices included) are timed
with the same timer, torch at the same precision (TF32 only for tf32; tf32x3 against torch's fp32).

One change to the tuner's timer, on by default (``--tuner-timer`` turns it off): a sleep kernel
of ``--guard-us`` (150) after each flush, so that the host's launch time (the tuner launches
through the full path, ``dispatch.launch_plan``: up to ~100 us for a staged wgmma plan, more than
the ~30 us flush hides) cannot show up as idle GPU time inside the events of a short call.

Phases: (1) plan every row x precision and list its candidates (``--dry-run`` stops here, on a
simulated H200, and estimates the GPU run); (2) compile every kernel those candidates need with
NVRTC on all CPU cores into fastmm's disk cache, then load them, so the timing is not held up by
the compiler; (3) time row by row, stopping cleanly before ``--budget-s`` would be passed (an
estimate per row, calibrated as it goes), printing one line per row x precision:

    row  layout  MxNxK  batch  precision  torch us | chosen (family option) us | best (family option) us
    | torch/chosen  torch/best | best ieee-computing candidate us (tf32 and tf32x3 rows) | flags

Flags: ``BEST+N%`` where the best candidate beats the chosen one by more than 5%, ``<TORCH`` where
the chosen plan is slower than torch, ``IEEE`` where a full-fp32 kernel beats the chosen tf32 /
tf32x3 one, ``CALL`` where fastmm.matmul runs something else than the heuristic choice (a tuned
choice, FASTMM_KERNEL). ``--json`` gets every candidate of every row (written after each row).

The scalar kernel (one thread per output) is timed only on products of at most
``--scalar-max-gflop`` (default 2): on the big rows it takes tens of ms a call and never wins.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

T0 = time.perf_counter()  # the budget counts from here, before torch is imported
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import benchmark as bench  # noqa: E402
from fastmm import tuning  # noqa: E402
from fastmm.plan import Plan, candidate_choices, select  # noqa: E402
from fastmm.problem import PRECISIONS, DeviceFacts, Problem  # noqa: E402
from fastmm.shapes import analyse, build_problem, result_matrix  # noqa: E402
from fastmm.tuned import TunedChoice  # noqa: E402

BEST_MARGIN = 1.05  # flag a row where the best candidate is this much faster than the chosen one
GHZ = 1.98  # H200 SM clock under load (KINDS.md): converts --guard-us to sleep cycles

# ---------------------------------------------------------------------------------------------
# rows, operands, problems


def model_rows(names: str | None, shapes_file: str | None) -> tuple[list[dict], Path]:
    suite, path = bench.load_suite(shapes_file)
    rows = bench.selected_shapes(suite, [names] if names else None, "model")
    return rows, path


def operands(s: dict, device: torch.device, seed: int = 0):
    """(a, b, c) of row ``s`` as bench.py lays them out (``benchmark.Inputs``, one set). On the
    meta device (planning without a GPU, or before allocating) the same shapes and strides are made
    from ``benchmark.LAYOUTS`` without data, since ``Inputs`` draws random values there; both
    start 16-byte aligned (a fresh allocation; a meta pointer reads as 0), so both plan alike."""
    if device.type != "meta":
        x = bench.Inputs(s, 1, device, seed=seed)
        return x.a[0], x.b[0], x.c[0]
    batch = (s["batch"],) if s.get("batch", 1) != 1 else ()
    M, N, K = s["M"], s["N"], s["K"]
    a_t, b_t = bench.LAYOUTS[bench.layout_of(s)]
    a = torch.empty(batch + ((K, M) if a_t else (M, K)), device=device)
    b = torch.empty(batch + ((N, K) if b_t else (K, N)), device=device)
    c = torch.empty(batch + (M, N), device=device)
    return (a.transpose(-1, -2) if a_t else a), (b.transpose(-1, -2) if b_t else b), c


def problem_of(a, b, c, precision: str) -> Problem:
    """The problem fastmm.matmul(a, b, out=c) plans (fastmm.shapes, as the tuner builds it)."""
    s = analyse(a, b)
    view = s.matrix_view(c) if tuple(c.shape) == s.out_shape else None
    if view is None:
        view = result_matrix(s.batch + (s.M, s.N), c.device)
    return build_problem(s, view, precision)[0]


@dataclasses.dataclass
class Candidate:
    choice: TunedChoice
    plan: Plan
    heuristic: bool
    skipped: str = ""  # why it is listed but not timed

    @property
    def computes(self) -> str:
        return self.plan.precision_used

    def label(self) -> str:
        return choice_label(self.choice)


def choice_label(ch: TunedChoice) -> str:
    return ch.family + (" " + ",".join(map(str, ch.option)) if ch.option else "")


def _ident(plan: Plan) -> tuple:
    """What a plan launches: its kernels (explain's lines aside: a heuristic rule may say why it
    took a tile the tuner names plainly) and its staging."""
    return tuple(dataclasses.replace(k, details=()) for k in plan.kernels()), plan.staging


def candidates_of(problem: Problem, dev: DeviceFacts) -> tuple[Plan, list[Candidate]]:
    """The heuristic plan and the tuner's candidates, as fastmm.tuning._tune enumerates them: one
    per distinct (kernel, second pass, staging), in preference order."""
    heuristic = select(problem, dev)
    out, seen = [], set()
    h_ident = _ident(heuristic)
    for choice in candidate_choices(problem, dev):
        plan = select(problem, dev, tuned=choice)
        ident = _ident(plan)
        if plan.kernel is None or ident in seen:
            continue
        seen.add(ident)
        out.append(Candidate(choice, plan, ident == h_ident))
    return heuristic, out


def trim(cands: list[Candidate], max_n: int | None, scalar_max_gflop: float, gflop: float) -> None:
    """Mark what is not timed: the scalar kernel on big products, and past ``max_n`` candidates
    (the heuristic choice always stays; the others are kept round-robin over the families, in
    preference order, so every family keeps its first options)."""
    for c in cands:
        if c.choice.family == "scalar" and not c.heuristic and gflop > scalar_max_gflop:
            c.skipped = f"scalar on {gflop:.1f} GFLOP (> --scalar-max-gflop {scalar_max_gflop:g})"
    if max_n is None:
        return
    live = [c for c in cands if not c.skipped]
    keep = [c for c in live if c.heuristic][:1]
    by_family: dict[str, list[Candidate]] = collections.OrderedDict()
    for c in live:
        if not c.heuristic:
            by_family.setdefault(c.choice.family, []).append(c)
    while len(keep) < max_n and any(by_family.values()):
        for fam in list(by_family):
            if by_family[fam] and len(keep) < max_n:
                keep.append(by_family[fam].pop(0))
    kept = {id(c) for c in keep}
    for c in live:
        if id(c) not in kept:
            c.skipped = f"past --max-candidates {max_n}"


def kernels_of(plan: Plan):
    return list(plan.kernels())


def kernel_ident(cfg, arch: str) -> tuple:
    """What makes a cubin (with the NVRTC and fastmm versions, fixed within a run)."""
    return cfg.source, cfg.macros, cfg.target(arch)


@dataclasses.dataclass
class Item:
    """One row at one precision, planned."""

    row: dict
    precision: str
    problem: Problem
    heuristic: Plan
    cands: list[Candidate]

    @property
    def timed(self) -> list[Candidate]:
        return [c for c in self.cands if not c.skipped]


def plan_items(rows, precisions, dev: DeviceFacts, max_n, scalar_max_gflop) -> list[Item]:
    items = []
    for s in rows:
        a, b, c = operands(s, torch.device("meta"))
        for prec in precisions:
            p = problem_of(a, b, c, prec)
            heuristic, cands = candidates_of(p, dev)
            trim(cands, max_n, scalar_max_gflop, bench.flop_count(s) / 1e9)
            items.append(Item(s, prec, p, heuristic, cands))
    return items


def head(it: Item) -> str:
    s = it.row
    dims = f"{s['M']}x{s['N']}x{s['K']}"
    return f"{s['name']:<20} {bench.layout_of(s):<10} {dims:<15} b{s.get('batch', 1):<4} {it.precision:<6}"


# ---------------------------------------------------------------------------------------------
# estimates (dry run, and the budget of the GPU run)

#: Rough H200 TFLOP/s of each family at the precision it computes, at the suite's large shapes
#: (RESULTS.md); small shapes are slower, which the memory and launch floors only partly cover.
RATE_TFLOPS = {("simt_cp_async", "ieee"): 45, ("simt_float4", "ieee"): 25, ("scalar", "ieee"): 2,
               ("skinny", "ieee"): 30, ("skinny_kmajor", "ieee"): 30,
               ("tf32_mma", "tf32"): 200, ("tf32_mma", "tf32x3"): 60,
               ("wgmma_tf32", "tf32"): 330, ("wgmma_tf32", "tf32x3"): 100}
TORCH_TFLOPS = {"ieee": 50, "tf32": 330, "tf32x3": 50}
HBM_BPS = 3.0e12
#: NVRTC CPU seconds per kernel for sm_90 (measured with --measure-compile 20 on the CPU machine,
#: NVRTC 13.5, one at a time): the SIMT and mma.sync kernels are the slow ones.
COMPILE_S = {"simt_cp_async": 1.18, "simt_float4": 0.79, "tf32_mma": 1.24, "wgmma_tf32": 0.53, "skinny": 0.32,
             "skinny_kmajor": 0.28, "scalar": 0.08, "stage_kmajor": 0.09, "splitk_reduce": 0.11,
             "stream_k_fixup": 0.15}
HOST_CALL_S = 150e-6  # host time of one tuner call (launch_plan, events, flush): the floor per call
CANDIDATE_S = 5e-3  # host work per candidate besides its calls: planning, loading, the error's syncs
ITEM_S = 0.2  # per row x precision: fresh operands, float64 reference, plan_for, records
STARTUP_S = 15.0  # python, torch, CUDA context, cuBLAS, fastmm's first use


def kernel_ms(row: dict, rate_tflops: float, extra_bytes: int = 0) -> float:
    compute = bench.flop_count(row) / (rate_tflops * 1e12)
    memory = (bench.byte_floor(row) + extra_bytes) / HBM_BPS
    return 1e3 * (max(compute, memory) + 5e-6)


def candidate_ms(it: Item, c: Candidate) -> float:
    staged = sum(rows * cols * 4 * 2 for _, rows, cols in c.plan.staging)  # read + write of each copy
    return kernel_ms(it.row, RATE_TFLOPS.get((c.choice.family, c.computes), 20), staged)


def call_s(kernel: float, flush_s: float, guard_s: float) -> float:
    return max(HOST_CALL_S, flush_s + guard_s + kernel / 1e3)


def item_estimate_s(it: Item, repeats: int, warmup: int, flush_s: float, guard_s: float) -> float:
    """Seconds the GPU run spends on one row x precision: the tuner's calls of each candidate
    (check, warm-up, timed; one timed call past 3x the fastest), its float64 reference and error
    checks, torch's and fastmm.matmul's timing."""
    ests = [candidate_ms(it, c) for c in it.timed]
    best = min(ests, default=0.0)
    out_bytes = 4 * it.row.get("batch", 1) * it.row["M"] * it.row["N"]
    checked = min(it.row.get("batch", 1), tuning.CHECKED_BATCH_ENTRIES) / it.row.get("batch", 1)
    check_s = 1e-3 + 4 * 2 * out_bytes * checked / HBM_BPS  # float64 copy, difference, norms
    total = ITEM_S + 2 * bench.flop_count(it.row) * checked / 50e12  # fresh operands, float64 reference
    for est in ests:
        timed = repeats if est <= tuning.PRUNE_FACTOR * best else 1
        total += CANDIDATE_S + check_s + (1 + warmup + timed) * call_s(est, flush_s, guard_s)
    torch_ms = kernel_ms(it.row, TORCH_TFLOPS[it.precision])
    total += 2 * (1 + warmup + repeats) * call_s(min(best, torch_ms), flush_s, guard_s)
    return total


def compile_estimate_s(idents: dict, cores: int, per_family: dict) -> tuple[float, float]:
    """(serial seconds, seconds on ``cores`` threads) to compile the distinct kernels."""
    serial = sum(per_family.get(cfg.family, 1.0) for cfg in idents.values())
    longest = max((per_family.get(cfg.family, 1.0) for cfg in idents.values()), default=0.0)
    return serial, max(longest, serial / max(1, min(cores, len(idents))) / 0.8)


def measure_compile(idents: dict, arch: str, n: int) -> tuple[dict, dict]:
    """NVRTC seconds per kernel by family, wall clock and CPU time of this process, from up to
    ``n`` kernels spread over the families, compiled one at a time (NVRTC runs without the GIL,
    so on idle cores the threads of the GPU run each take about the CPU time; the wall clock is
    longer where this machine's cores are shared)."""
    from fastmm.runtime.compiler import compile_cubin

    by_family = collections.defaultdict(list)
    for cfg in idents.values():
        by_family[cfg.family].append(cfg)
    order = []
    while len(order) < n and any(by_family.values()):
        for fam in list(by_family):
            if by_family[fam] and len(order) < n:
                order.append(by_family[fam].pop(0))
    wall, cpu = collections.defaultdict(list), collections.defaultdict(list)
    for cfg in order:
        t0, c0 = time.perf_counter(), time.process_time()
        compile_cubin(cfg.source, cfg.macros, cfg.target(arch))
        wall[cfg.family].append(time.perf_counter() - t0)
        cpu[cfg.family].append(time.process_time() - c0)
    return ({fam: statistics.mean(ts) for fam, ts in wall.items()},
            {fam: statistics.mean(ts) for fam, ts in cpu.items()})


# ---------------------------------------------------------------------------------------------
# dry run


def dry_run(o, rows, precisions, suite_path) -> int:
    dev = DeviceFacts.simulated_device("sm_90")
    t0 = time.perf_counter()
    items = plan_items(rows, precisions, dev, o.max_candidates, o.scalar_max_gflop)
    print(f"dry run on a {dev.name} ({dev.arch}, {dev.sm_count} SMs, {dev.l2_bytes >> 20} MiB L2); suite {suite_path}; "
          f"{len(rows)} model rows x {len(precisions)} precisions; planned in {time.perf_counter() - t0:.1f} s\n")
    idents: dict = {}
    for it in items:
        for c in it.timed:
            for cfg in kernels_of(c.plan):
                idents.setdefault(kernel_ident(cfg, dev.arch), cfg)
        h = next((c for c in it.cands if c.heuristic), None)
        chosen = h.label() if h else f"{it.heuristic.kernel.family} (not among the candidates!)"
        print(f"{head(it)} chosen {chosen} [{tuning._describe(it.heuristic)}]; "
              f"{len(it.timed)} to time" + (f", {n_skip} skipped" if (n_skip := len(it.cands) - len(it.timed)) else ""))
        if not o.quiet:
            labels = [("*" if c.heuristic else "") + c.label() + ("(ieee)" if c.computes != it.precision else "")
                      + ("(skip)" if c.skipped else "") for c in it.cands]
            line = "    "
            for lab in labels:
                if len(line) + len(lab) > 118:
                    print(line.rstrip())
                    line = "    "
                line += lab + "  "
            print(line.rstrip())

    # counts
    print("\ncandidates to time per row (ieee / tf32 / tf32x3), distinct launches as the tuner counts them:")
    per_row = collections.OrderedDict()
    for it in items:
        per_row.setdefault(it.row["name"], {})[it.precision] = len(it.timed)
    for name, d in per_row.items():
        print(f"  {name:<22} " + " / ".join(f"{d.get(p, '-'):>3}" for p in precisions))
    total = sum(len(it.timed) for it in items)
    skipped = sum(len(it.cands) - len(it.timed) for it in items)
    print(f"  total: {len(items)} row x precision items, {total} candidates to time ({skipped} skipped); "
          + ", ".join(f"{p} {sum(len(it.timed) for it in items if it.precision == p)}" for p in precisions))
    fams = collections.Counter(cfg.family for cfg in idents.values())
    print(f"kernels to compile (distinct source + macros + target): {len(idents)}: "
          + ", ".join(f"{f} {n}" for f, n in fams.most_common()))

    # estimates
    per_family = dict(COMPILE_S)
    if o.measure_compile:
        print(f"\nmeasuring NVRTC here: {o.measure_compile} kernels for sm_90, one at a time ...", flush=True)
        t1 = time.perf_counter()
        wall, cpu = measure_compile(idents, dev.arch, o.measure_compile)
        print(f"  {time.perf_counter() - t1:.1f} s (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
              "here); seconds per kernel, wall / CPU: "
              + ", ".join(f"{f} {wall[f]:.2f} / {cpu[f]:.2f}" for f in sorted(wall)))
        per_family.update(cpu)
    serial, parallel = compile_estimate_s(idents, o.gpu_cores, per_family)
    flush_s = max(2 * dev.l2_bytes, 16 << 20) / HBM_BPS
    guard_s = 0.0 if o.tuner_timer else o.guard_us * 1e-6
    est = {id(it): item_estimate_s(it, o.repeats, o.warmup, flush_s, guard_s) for it in items}
    timing = sum(est.values())
    print(f"\nestimated GPU run (H200, {o.gpu_cores} cores; coarse: family rates from RESULTS.md, memory and "
          f"launch floors, {HOST_CALL_S * 1e6:.0f} us host per call):")
    print(f"  startup ~{STARTUP_S:.0f} s; compile {len(idents)} kernels: {serial:.0f} s of NVRTC, ~{parallel:.0f} s on "
          f"{o.gpu_cores} threads, + ~{0.01 * len(idents):.0f} s to load them")
    print(f"  timing (--repeats {o.repeats}, --warmup {o.warmup}): ~{timing:.0f} s; "
          + ", ".join(f"{p} {sum(est[id(it)] for it in items if it.precision == p):.0f} s" for p in precisions))
    heavy = sorted(per_row, key=lambda n: -sum(est[id(it)] for it in items if it.row["name"] == n))
    print("  heaviest rows: " + ", ".join(
        f"{n} {sum(est[id(it)] for it in items if it.row['name'] == n):.1f} s" for n in heavy[:8]))
    whole = STARTUP_S + parallel + 0.01 * len(idents) + timing
    print(f"  total ~{whole:.0f} s (the budget stops the timing at --budget-s {o.budget_s:g}, counted from the start)")
    if whole > o.limit_s:
        fixed = STARTUP_S + parallel + 0.01 * len(idents)
        keep, spent = [], fixed
        for name in reversed(heavy):  # the lightest rows first
            cost = sum(est[id(it)] for it in items if it.row["name"] == name)
            if spent + cost <= o.limit_s:
                keep.append(name)
                spent += cost
        print(f"  over {o.limit_s:g} s: these rows fit (~{spent:.0f} s): --rows {','.join(keep)}")
    return 0


# ---------------------------------------------------------------------------------------------
# the GPU run


class GuardedFlush:
    """The tuner's L2 flush buffer, followed by a sleep kernel: ``tuning._timed`` calls
    ``flush.zero_()`` then records the start event and calls the candidate, so the sleep keeps the
    GPU busy while the host queues the call."""

    def __init__(self, flush: torch.Tensor, cycles: int):
        self.flush, self.cycles = flush, cycles

    def zero_(self):
        self.flush.zero_()
        if self.cycles:
            torch.cuda._sleep(self.cycles)
        return self.flush


_tuner_timed = tuning._timed


def timed(call, flush, n: int, index: int, cycles: int) -> list[float]:
    """fastmm.tuning's timer (ms of ``n`` calls, each after an L2 flush), with the guard."""
    if isinstance(flush, GuardedFlush):
        flush = flush.flush
    return _tuner_timed(call, GuardedFlush(flush, cycles), n, index)


@contextlib.contextmanager
def tuner_with_guard(cycles: int):
    """fastmm.tuning.tune with the guarded timer (restored on the way out)."""
    if not cycles:
        yield
        return
    tuning._timed = lambda call, flush, n, index: timed(call, flush, n, index, cycles)
    try:
        yield
    finally:
        tuning._timed = _tuner_timed


def precompile(items, dev, index: int, o, clock) -> tuple[set, dict]:
    """Compile every kernel the items' candidates need (NVRTC on all cores, into fastmm's disk
    cache, where launcher.load then finds it), in item order, then load them. Returns the idents
    compiled and loaded, and a note per ident that failed."""
    from fastmm.runtime import launcher
    from fastmm.runtime.cache import default_cache
    from fastmm.runtime.compiler import compile_cubin

    cache = default_cache()
    if not cache.usable():  # a memory-only cache would forget what the threads compile
        folder = tempfile.mkdtemp(prefix="fastmm-cand-cache-")
        os.environ["FASTMM_CACHE_DIR"] = folder
        cache = default_cache()
        print(f"  the kernel cache is not usable; compiling into {folder}")
    idents: dict = {}
    for it in items:
        for c in it.timed:
            for cfg in kernels_of(c.plan):
                idents.setdefault(kernel_ident(cfg, dev.arch), cfg)
    states = collections.Counter()
    failed: dict = {}
    deadline = o.compile_share * o.budget_s

    def build(item):
        ident, cfg = item
        if clock() > deadline:
            return ident, "skipped", None
        target = cfg.target(dev.arch)
        try:
            res = cache.get_or_compile(cfg.family + "-" + target, launcher.key_for(cfg, dev.arch), target,
                                       lambda: compile_cubin(cfg.source, cfg.macros, target))
            return ident, res.state, None
        except Exception as exc:
            return ident, "failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"

    t0 = clock()
    workers = o.jobs or os.cpu_count() or 4
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for ident, state, err in pool.map(build, list(idents.items())):
            states[state] += 1
            if err:
                failed[ident] = err
    t1 = clock()
    ready = set()
    for ident, cfg in idents.items():
        if ident in failed or states["skipped"] and not _in_cache(cache, cfg, dev):
            continue
        try:
            launcher.load(dev, cfg)
            ready.add(ident)
        except Exception as exc:
            failed[ident] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    print(f"[{clock():6.1f}s] compiled {len(idents)} kernels on {workers} threads in {t1 - t0:.1f} s "
          f"({states['compiled']} compiled, {states['disk']} from the disk cache {cache.folder}"
          + (f", {states['skipped']} skipped: past --compile-share of the budget" if states['skipped'] else "")
          + (f", {len(failed)} failed" if failed else "") + f"); loaded {len(ready)} in {clock() - t1:.1f} s",
          flush=True)
    for ident, err in failed.items():
        print(f"  FAILED {idents[ident].family} {dict(idents[ident].macros)}: {err}")
    return ready, failed


def _in_cache(cache, cfg, dev) -> bool:
    from fastmm.runtime import launcher

    target = cfg.target(dev.arch)
    key = launcher.key_for(cfg, dev.arch)
    return cache.read(cache.path_for(cfg.family + "-" + target, key), target, key) is not None


def us(ms):
    return None if ms is None else 1e3 * ms


def fmt_us(v) -> str:
    return "-" if v is None else (f"{v:.1f}" if v < 1000 else f"{v:.0f}")


def fmt_err(v) -> str:
    return "-" if v is None else f"{v:.1e}"


def ratio(a, b):
    return a / b if a and b else None


def measure_item(it: Item, x, dev, index: int, o, cycles: int) -> dict:
    """One row x precision on the GPU: the tuner over its candidates, torch.matmul and
    fastmm.matmul with the same timer."""
    import fastmm
    from fastmm import dispatch

    a, b, c = x
    only = [(cd.choice.family, cd.choice.option) for cd in it.timed]
    with tuner_with_guard(cycles):
        res = tuning.tune(a, b, it.precision, out=c, repeats=o.repeats, warmup=o.warmup,
                          candidates=None if len(it.timed) == len(it.cands) else only, persist=False)
    p = res.problem
    flush = torch.empty(max(2 * dev.l2_bytes, 16 << 20) // 4, dtype=torch.float32, device=a.device)

    def time_fn(fn) -> float:
        for _ in range(1 + o.warmup):
            fn()
        return statistics.median(timed(fn, flush, o.repeats, index, cycles))

    with torch.no_grad(), bench.TorchPrecision(it.precision):
        torch_ms = time_fn(lambda: torch.matmul(a, b, out=c))
        call_ms = time_fn(lambda: fastmm.matmul(a, b, out=c, precision=it.precision))
    del flush
    dispatched = dispatch.plan_for(p, index)
    computes = {}
    cands = []
    for r in res.candidates:
        plan = select(p, dev, tuned=r.choice)
        computes[id(r)] = plan.precision_used
        cands.append({"family": r.choice.family, "option": list(r.choice.option), "label": choice_label(r.choice),
                      "kernel": r.kernel, "computes": plan.precision_used, "heuristic": r.heuristic,
                      "us": us(r.time_ms), "tflops": r.tflops, "rel_err": r.error, "ok": r.ok, "note": r.note})
    for cd in it.cands:
        if cd.skipped:
            cands.append({"family": cd.choice.family, "option": list(cd.choice.option), "label": cd.label(),
                          "kernel": tuning._describe(cd.plan), "computes": cd.computes, "heuristic": False,
                          "us": None, "note": "not timed: " + cd.skipped})
    timed_ok = [r for r in res.candidates if r.ok and r.time_ms is not None]
    h = res.heuristic
    best = min(timed_ok, key=lambda r: r.time_ms, default=None)
    ieee = min((r for r in timed_ok if computes[id(r)] == "ieee"), key=lambda r: r.time_ms, default=None)
    s = it.row
    rec = {"name": s["name"], "layout": bench.layout_of(s), "shape": bench.shape_label(s), "M": s["M"], "N": s["N"],
           "K": s["K"], "batch": s.get("batch", 1), "precision": it.precision, "flop": bench.flop_count(s),
           "torch_us": us(torch_ms), "call_us": us(call_ms),
           "chosen": None if h is None else {"label": choice_label(h.choice), "kernel": h.kernel, "us": us(h.time_ms),
                                             "ok": h.ok, "note": h.note},
           "best": None if best is None else {"label": choice_label(best.choice), "kernel": best.kernel,
                                              "us": us(best.time_ms)},
           "best_ieee": None if ieee is None or it.precision == "ieee" else {
               "label": choice_label(ieee.choice), "kernel": ieee.kernel, "us": us(ieee.time_ms)},
           "dispatch_origin": dispatched.origin,
           "dispatch_kernel": dispatched.kernel.family if dispatched.kernel is not None else None,
           "candidates": cands, "timer": "tuner" if not cycles else f"tuner + {o.guard_us:g} us guard"}
    ch_us = rec["chosen"]["us"] if rec["chosen"] else None
    rec["torch_over_chosen"] = ratio(rec["torch_us"], ch_us)
    rec["torch_over_best"] = ratio(rec["torch_us"], rec["best"]["us"] if best else None)
    flags = []
    if ch_us and best and ch_us > BEST_MARGIN * rec["best"]["us"]:
        flags.append(f"BEST+{100 * (ch_us / rec['best']['us'] - 1):.0f}%")
    if ch_us and rec["torch_us"] and ch_us > rec["torch_us"]:
        flags.append("<TORCH")
    if ch_us and rec["best_ieee"] and ch_us > BEST_MARGIN * rec["best_ieee"]["us"]:
        flags.append("IEEE")
    if h is None or not h.ok:
        flags.append("CHOSEN-FAILED")
    if dispatched.origin != "heuristic":
        flags.append("CALL")
    rec["flags"] = flags
    rec["losing"] = bool(set(f.split("+")[0] for f in flags) & {"BEST", "<TORCH", "CHOSEN-FAILED"})
    return rec


def line_of(rec: dict) -> str:
    ch, best, ieee = rec["chosen"], rec["best"], rec["best_ieee"]

    def r(v):
        return "-" if v is None else f"{v:.2f}"
    dims = f"{rec['M']}x{rec['N']}x{rec['K']}"
    head_ = f"{rec['name']:<20} {rec['layout']:<10} {dims:<15} b{rec['batch']:<4} {rec['precision']:<6}"
    return (f"{head_} torch {fmt_us(rec['torch_us']):>7} | chosen {ch['label'] if ch else '-':<26} "
            f"{fmt_us(ch['us'] if ch else None):>7} | best {best['label'] if best else '-':<26} "
            f"{fmt_us(best['us'] if best else None):>7} | t/c {r(rec['torch_over_chosen'])} "
            f"t/b {r(rec['torch_over_best'])}"
            f" | ieee {fmt_us(ieee['us'] if ieee else None):>7} | call {fmt_us(rec['call_us'])}"
            + ("  " + " ".join(rec["flags"]) if rec["flags"] else ""))


def gpu_run(o, rows, precisions, suite_path) -> int:
    from probe_util import need_gpu

    def clock() -> float:
        return time.perf_counter() - T0 + o.started_s

    if not need_gpu("candidates.py"):
        return 2
    import fastmm
    from fastmm import dispatch

    index = torch.cuda.current_device()
    dev = dispatch.device_facts(index)
    reason = dispatch.runtime_reason()
    if reason is not None:
        print(f"candidates.py: fastmm cannot build kernels here: {reason}", file=sys.stderr)
        return 2
    cycles = 0 if o.tuner_timer else int(o.guard_us * 1e3 * GHZ)
    items = plan_items(rows, precisions, dev, o.max_candidates, o.scalar_max_gflop)
    n_timed = sum(len(it.timed) for it in items)
    print(f"fastmm {fastmm.__version__}, torch {torch.__version__} on {dev.name} ({dev.arch}); suite {suite_path}; "
          f"{len(rows)} rows x {len(precisions)} precisions = {len(items)} items, {n_timed} candidates to time; "
          f"repeats {o.repeats}, warm-up {o.warmup}, timer: tuner's"
          + ("" if not cycles else f" + {o.guard_us:g} us guard") + f"; budget {o.budget_s:g} s", flush=True)
    ready, failed = precompile(items, dev, index, o, clock)

    flush_s = max(2 * dev.l2_bytes, 16 << 20) / HBM_BPS
    guard_s = cycles / (GHZ * 1e9)
    est = {id(it): item_estimate_s(it, o.repeats, o.warmup, flush_s, guard_s) for it in items}
    est_done = spent = 0.0
    records, shown = [], 0
    stopped = None
    x = x_row = None
    t_loop = clock()
    print(f"[{clock():6.1f}s] timing; estimated {sum(est.values()):.0f} s for all items (coarse)", flush=True)
    for it in items:
        need = [kernel_ident(cfg, dev.arch) for c in it.timed for cfg in kernels_of(c.plan)]
        missing = [i for i in need if i not in ready and i not in failed]
        if missing:
            stopped = stopped or f"{len(missing)} kernels of {it.row['name']} {it.precision} were not compiled in time"
            continue
        factor = min(4.0, max(0.5, spent / est_done)) if est_done > 5 else 1.0
        if clock() + factor * est[id(it)] > o.budget_s:
            stopped = (f"budget: {it.row['name']} {it.precision} needs ~{factor * est[id(it)]:.1f} s, "
                       f"{o.budget_s - clock():.1f} s left")
            break
        t0 = clock()
        if x_row is not it.row:
            x = None
            torch.cuda.empty_cache()
            x, x_row = operands(it.row, torch.device("cuda", index), o.seed), it.row
        try:
            rec = measure_item(it, x, dev, index, o, cycles)
        except Exception as exc:  # one broken row must not hide the others
            rec = {"name": it.row["name"], "precision": it.precision, "error": f"{type(exc).__name__}: {exc}",
                   "losing": True, "flags": ["ERROR"]}
        rec["seconds"] = clock() - t0
        spent += rec["seconds"]
        est_done += est[id(it)]
        records.append(rec)
        if not o.only_losing or rec["losing"]:
            shown += 1
            print(f"[{clock():6.1f}s] " + (line_of(rec) if "error" not in rec else
                                           f"{head(it)} ERROR {rec['error'][:200]}"), flush=True)
            if o.detail and "error" not in rec:
                for cd in sorted(rec["candidates"], key=lambda d: (d["us"] is None, d["us"] or 0)):
                    mark = "*" if cd["heuristic"] else " "
                    print(f"      {mark} {cd['label']:<28} {cd['kernel']:<40} {fmt_us(cd['us']):>8} us "
                          f"{cd['computes']:<6} err {fmt_err(cd.get('rel_err'))} {cd['note']}")
        if o.json:
            write_json(o.json, records, o, dev, suite_path, stopped=None, elapsed=clock())
    if o.json:
        write_json(o.json, records, o, dev, suite_path, stopped=stopped, elapsed=clock())
    summary(records, len(items), shown, o, stopped, clock() - t_loop, clock())
    return 1 if any("error" in r for r in records) else 0


def write_json(path, records, o, dev, suite_path, stopped, elapsed) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    env = {"device": dev.name, "arch": dev.arch, "torch": torch.__version__}
    try:
        import fastmm

        env["fastmm"] = fastmm.__version__
    except Exception:
        pass
    Path(path).write_text(json.dumps({"environment": env, "suite": str(suite_path), "options": vars(o),
                                      "stopped": stopped, "elapsed_s": elapsed, "rows": records}, indent=1,
                                     default=str))


def summary(records, n_items, shown, o, stopped, loop_s, total_s) -> None:
    ok = [r for r in records if "error" not in r]
    print(f"\n{len(records)} of {n_items} items timed in {loop_s:.1f} s ({total_s:.1f} s in all)"
          + (f"; stopped: {stopped}" if stopped else "")
          + (f"; {shown} shown (--only-losing)" if o.only_losing else ""))
    for flag in ("BEST", "<TORCH", "IEEE", "CALL", "CHOSEN-FAILED"):
        hits = [r for r in ok if any(f.split("+")[0] == flag for f in r["flags"])]
        if hits:
            print(f"  {flag}: {len(hits)}: " + ", ".join(f"{r['name']} {r['precision']}" for r in hits))
    for prec in PRECISIONS:
        tc = [r["torch_over_chosen"] for r in ok if r["precision"] == prec and r.get("torch_over_chosen")]
        tb = [r["torch_over_best"] for r in ok if r["precision"] == prec and r.get("torch_over_best")]
        if tc:
            g = lambda v: math.exp(sum(map(math.log, v)) / len(v))  # noqa: E731
            print(f"  {prec}: geomean torch/chosen {g(tc):.3f}, torch/best {g(tb):.3f} ({len(tc)} rows)")
    if o.json:
        print(f"JSON: {o.json}")


# ---------------------------------------------------------------------------------------------
# command line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="candidates.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", help="comma-separated model rows (default: every row of the model section)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated (default ieee,tf32,tf32x3)")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per candidate, median (default 10; the "
                    "tuner's own default is 20)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls after the checked one (default 1)")
    ap.add_argument("--max-candidates", type=int, help="time at most this many per row x precision: the chosen one, "
                    "then round-robin over the families")
    ap.add_argument("--scalar-max-gflop", type=float, default=2.0,
                    help="time the scalar kernel only on products of at most this many GFLOP (default 2)")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="stop before a row would end past this many seconds from the start (default 120)")
    ap.add_argument("--compile-share", type=float, default=0.5,
                    help="compile no kernel past this share of the budget (default 0.5)")
    ap.add_argument("--started-s", type=float, default=0.0, help="seconds already spent before this script "
                    "(counted into the budget; e.g. a command's earlier steps)")
    ap.add_argument("--jobs", type=int, help="compile threads (default: every CPU core)")
    ap.add_argument("--guard-us", type=float, default=150.0, help="sleep after each L2 flush, before the timed call, "
                    "longer than the host's launch time of a call (default 150)")
    ap.add_argument("--tuner-timer", action="store_true", help="the tuner's timer exactly (no guard)")
    ap.add_argument("--json", metavar="PATH", help="write every row and candidate (after each row)")
    ap.add_argument("--only-losing", action="store_true",
                    help="print only rows whose chosen plan is slower than torch or >5%% slower than the best "
                    "candidate (the JSON keeps every row)")
    ap.add_argument("--detail", action="store_true", help="print every candidate under its row")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shapes", metavar="JSON", help="suite file (default: as bench.py finds it)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: plan on a simulated H200, list candidates, "
                    "count kernels and estimate the GPU run")
    ap.add_argument("--quiet", action="store_true", help="dry run: no candidate lists")
    ap.add_argument("--measure-compile", type=int, default=0, metavar="N",
                    help="dry run: time NVRTC on N kernels here (spread over the families)")
    ap.add_argument("--gpu-cores", type=int, default=16, help="dry run: CPU cores of the GPU machine (default 16)")
    ap.add_argument("--limit-s", type=float, default=150.0,
                    help="dry run: if the estimate passes this, suggest rows that fit (default 150)")
    o = ap.parse_args(argv)
    precisions = [p.strip() for p in o.precisions.split(",") if p.strip()]
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad:
        ap.error(f"unknown precision(s) {bad}; expected a subset of {list(PRECISIONS)}")
    rows, suite_path = model_rows(o.rows, o.shapes)
    if o.dry_run:
        return dry_run(o, rows, precisions, suite_path)
    return gpu_run(o, rows, precisions, suite_path)


if __name__ == "__main__":
    raise SystemExit(main())
