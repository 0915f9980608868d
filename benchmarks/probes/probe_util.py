"""What the probes beside this file share: the GPU check, the error against float64, four
ways to time a call on the GPU, compiling many plans' kernels at once, and a simt_cp_async variant
planned with one tile option and extra macros (``SimtOption``). Import it after putting the repo and this folder on sys.path:

    HERE = Path(__file__).resolve().parent
    sys.path[:0] = [str(HERE.parents[1]), str(HERE)]
    from probe_util import need_gpu, rel_err, time_ms
"""
from __future__ import annotations

import dataclasses
import statistics
import sys

import torch

from fastmm.families import SimtCpAsync


@dataclasses.dataclass(frozen=True)
class SimtOption(SimtCpAsync):
    """simt_cp_async planned with ``option`` (tile + split flag, as a tuned choice gives it; None:
    its own choice), ``warps_sm`` warps an SM in its split model (8 x 8 tiles), and ``extra``
    macros added to or replacing its own in every kernel it plans: a variant for
    ``fastmm.dispatch.matmul_fastmm(..., force="simt_cp_async", variants=(v,))``."""

    option: tuple | None = None
    extra: tuple[tuple[str, int], ...] = ()
    #: warps an SM the split-K wave model plans the 8 x 8 tiles for (None: the family's own
    #: count; 12 = 6 blocks of 64 x 64, 3 of 128 x 64, as those kernels are built); a split plan
    #: planned for more blocks than the tile's default is built for that many (CP_MIN_BLOCKS)
    warps_sm: int | None = None

    def configure(self, p, dev, option=None):
        return super().configure(p, dev, self.option if option is None else option)

    def blocks_per_sm(self, opt, p, dev):
        if self.warps_sm is None or opt[2] != 8:
            return super().blocks_per_sm(opt, p, dev)
        return max(1, self.warps_sm // (opt[0] * opt[1]))

    def extra_macros(self, p, dev, bm, bn, split=1, reserve=0):
        return tuple({**dict(super().extra_macros(p, dev, bm, bn, split, reserve)), **dict(self.extra)}.items())


def need_gpu(prog: str) -> bool:
    """True where a CUDA device is there; else say so on stderr (the caller exits 2)."""
    if torch.cuda.is_available():
        return True
    print(f"{prog}: needs a CUDA GPU (torch sees none)", file=sys.stderr)
    return False


def rel_err(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``c`` against the float64 product of ``a`` and ``b``; inf
    where ``c`` holds a NaN or an Inf (an output left unwritten in a NaN-filled buffer)."""
    if not torch.isfinite(c).all():
        return float("inf")
    ref = torch.matmul(a.double(), b.double())
    return ((c.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def enqueue_us(fn, calls: int) -> float:
    """Host us per call of ``calls`` back-to-back calls queued behind ~0.1 s of GPU sleep, so the
    host never waits on the GPU: only enqueue time counts. Keep calls x (their GPU time) well
    under 0.1 s (and calls under the ~1000 launches a stream queues before the host waits)."""
    import time

    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def time_ms(fn, reps: int = 20) -> float:
    """Median of ``reps`` CUDA-event samples of one call each, in ms (3 calls of warm-up). For
    calls long enough that host launch time cannot leave the GPU idle."""
    for _ in range(3):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) for s, e in ev)
    return t[len(t) // 2]


def time_us(fn, inner: int = 10, samples: int = 15, sleep_cycles: int = 5_000_000, warmup: int = 1) -> float:
    """Median GPU time per call in us: each sample is ``inner`` back-to-back calls queued behind a
    sleep kernel, so the host has queued them all before the GPU reaches the start event and its
    launch time cannot show up as idle GPU time (short kernels too). ``warmup`` rounds of
    ``inner`` calls first. To rotate inputs, let ``fn`` step through them itself."""
    for _ in range(warmup * inner):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
    for s, e in ev:
        torch.cuda._sleep(sleep_cycles)
        s.record()
        for _ in range(inner):
            fn()
        e.record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) for s, e in ev)
    return 1000.0 * t[len(t) // 2] / inner


def timing_line(label: str, rounds: list[float], flop: float, err: float, base: float | None = None,
                width: int = 9) -> str:
    """A probe's row for one variant timed over alternating rounds: the median GPU us, its TFLOP/s
    (``flop`` a call), its ratio to ``base`` us where given, the error and the rounds."""
    t = statistics.median(rounds)
    rel = f"  x{t / base:.3f}" if base else ""
    return (f"   {label:{width}s} {t:9.1f} us  {flop / t / 1e6:6.2f} TFLOP/s{rel}  err {err:.1e}  "
            f"rounds {' '.join(f'{x:.1f}' for x in rounds)}")


def graph_us(fn, calls: int = 20, reps: int = 15) -> float:
    """GPU us per call with no host in the way: ``calls`` calls captured in a CUDA graph once
    (after 3 warm-up calls on a side stream), the graph replayed ``reps`` times; the median."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / calls * 1e3)
    return statistics.median(ts)


def compile_plans(plans, arch: str) -> int:
    """Compile every kernel of ``plans`` (GEMM, second pass, staging copies) for ``arch`` into
    fastmm's disk cache with NVRTC on all cores, so that a probe's timing is not held up by the
    compiler one kernel at a time. Returns how many distinct kernels there were."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from fastmm.runtime import launcher
    from fastmm.runtime.cache import default_cache
    from fastmm.runtime.compiler import compile_cubin

    cfgs = {}
    for plan in plans:
        for cfg in plan.kernels():
            cfgs[(cfg.source, cfg.macros, cfg.entry, cfg.target(arch))] = cfg
    cache = default_cache()

    def build(cfg):
        target = cfg.target(arch)
        cache.get_or_compile(cfg.family + "-" + target, launcher.key_for(cfg, arch), target,
                             lambda: compile_cubin(cfg.source, cfg.macros, target))

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        list(pool.map(build, cfgs.values()))
    return len(cfgs)


def own_time_by_group(stats) -> dict[str, float]:
    """A cProfile ``pstats.Stats``'s own time (s) by where the code lives: fastmm's modules by
    file, cuda.core, torch's Python autograd, each C builtin by name, inductor's generated code,
    torch's private packages (``torch/_dynamo``, ``_functorch``...), transformers' packages; the
    rest is left out."""
    import collections

    groups = collections.Counter()
    for (path, _, func), (_, _, own, _, _) in stats.stats.items():
        if "/fastmm/" in path:
            group = "fastmm/" + path.split("/fastmm/")[-1]
        elif "cuda/core" in path or "cuda.core" in path:
            group = "cuda.core"
        elif "autograd" in path:
            group = "torch.autograd (python)"
        elif path == "~":
            group = "builtin: " + func[:70]
        elif "torchinductor" in path:
            group = "inductor's generated code"
        elif "/torch/_" in path:  # torch._dynamo, _functorch (AOT's runtime), _inductor, _library, _ops
            group = "torch/_" + path.split("/torch/_")[-1].split("/")[0]
        elif "/transformers/" in path:
            group = "transformers/" + path.split("/transformers/")[-1].split("/")[0]
        else:
            continue
        groups[group] += own
    return groups
