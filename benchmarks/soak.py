"""Soak test: minutes of mixed fastmm calls from several threads, each on its own CUDA stream,
checked against float64 and watched for memory growth.

    PYTHONPATH=. python3 benchmarks/soak.py --minutes 10 [--threads 4] [--json PATH]

Every worker thread loops over randomly chosen calls, through the public API only:

- ``random``: ``fastmm.matmul`` on sizes 1..3000 (odd ones included), operands sometimes given
  transposed (column-major views);
- ``linear``: model shapes ``x @ W.t()`` with ``W`` of ``[N, K]`` and ``x`` of ``[B, S, K]``;
- ``decode``: the same with M = 1..64 rows;
- ``bmm``: batched products (sometimes a broadcast B);
- ``long_k``: 256 x 256 x 65536 (split-K);
- ``unaligned``: odd N / K and operands at a storage offset of one float (staged copies);
- ``op_grad``: ``torch.ops.fastmm.matmul`` with autograd, forward and backward;
- ``nn_linear``: ``fastmm.nn.Linear`` forward and backward;
- ``graph``: a warmed-up call (and its ``out=`` form) captured into a CUDA graph, then replayed
  with new input values.

Precision is drawn from ieee / tf32 / tf32x3 / None (PyTorch's setting) per call. Inputs are fresh
random values every call; ``out=`` (a third of the plain calls) is filled with NaN first, so an
element the kernel does not write shows up. One call in ``--check-every`` (and every graph replay)
is compared with a float64 product: relative Frobenius error within ieee 1e-5, tf32 1e-3, tf32x3
1e-5, each widened to sqrt(K) * 2^-24 for long sums (tests/test_gpu.py's rule, with tf32x3 given
some room; outputs under 64 elements measured against |A||B| where the sums cancel). A NaN fails.

CUDA graphs: a capture is made while the other workers wait between calls (torch's capture
checks would otherwise trip on their work; the replays then run alongside them).

Every ``--report-every`` seconds (30) it prints the elapsed time, calls, failures, PyTorch's
allocated and peak CUDA memory, the process RSS (/proc/self/statm) and the sizes of fastmm's
internal caches it can find (read-only, by name; absent names are skipped). Memory "at rest" is
measured with every worker paused between calls and the device synchronised: at the end of the
warm-up (the first ``--warmup-fraction`` of the time, 20%) and at the end. The exit status is 1
if any check failed or a call raised, or if memory at rest grew after the warm-up by more than
``--max-growth-mib`` (CUDA, allocated) or ``--max-rss-growth-mib`` (RSS); 2 where there is no
CUDA GPU; 0 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import sys
import threading
import time
import traceback

PRECISIONS = ("ieee", "tf32", "tf32x3", None)
#: relative Frobenius error vs float64 allowed per precision (before widening for long sums)
TOL = {"ieee": 1e-5, "tf32": 1e-3, "tf32x3": 1e-5}
#: call kinds and their weights in the mix
KINDS = {"random": 6, "linear": 4, "decode": 4, "bmm": 3, "long_k": 1, "unaligned": 2, "op_grad": 2, "nn_linear": 2,
         "graph": 1}
MODEL_DIMS = (256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096)
MIB = 1 << 20
#: fastmm's internal caches, by module and attribute path, looked up by name (the modules are being
#: reorganised: whatever is not there is skipped) and only measured with len()
CACHE_PLACES = (
    ("fastmm.api", "_fast"), ("fastmm.api", "_prepared"), ("fastmm.api", "_failed"),
    ("fastmm.fast_path", "ENTRIES"), ("fastmm.dispatch", "PLANS.prepared"), ("fastmm.dispatch", "PLANS.failed"),
    ("fastmm.runtime.arrivals", "_buffers"), ("fastmm.runtime.launcher", "_modules"),
    ("fastmm.runtime.launcher", "_streams"), ("fastmm.runtime.tensor_map", "_recent"),
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Soak test of fastmm: mixed calls from several threads and streams, "
                                            "checked against float64, with memory watched.")
    p.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    p.add_argument("--threads", type=int, default=4, help="worker threads, each on its own CUDA stream (default 4)")
    p.add_argument("--check-every", type=int, default=8,
                   help="compare one call in this many with float64 (default 8; graph replays always)")
    p.add_argument("--report-every", type=float, default=30.0, help="seconds between progress lines (default 30)")
    p.add_argument("--warmup-fraction", type=float, default=0.2,
                   help="share of the time before the memory baseline is taken (default 0.2)")
    p.add_argument("--max-growth-mib", type=float, default=64.0,
                   help="allowed growth of allocated CUDA memory at rest after the warm-up (default 64)")
    p.add_argument("--max-rss-growth-mib", type=float, default=512.0,
                   help="allowed growth of the process RSS at rest after the warm-up (default 512)")
    p.add_argument("--max-size", type=int, default=3000, help="largest M, N, K of the random shapes (default 3000)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated call kinds to mix (default: all: "
                                                               f"{','.join(KINDS)})")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    p.add_argument("--seed", type=int, default=0, help="random seed (worker i uses seed + i)")
    p.add_argument("--json", metavar="PATH", help="also write the summary and the progress reports as JSON")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.threads < 1 or args.check_every < 1 or args.report_every <= 0 or args.max_size < 1:
        p.error("--minutes, --report-every must be > 0; --threads, --check-every, --max-size >= 1")
    if not 0 <= args.warmup_fraction < 1:
        p.error("--warmup-fraction must be in [0, 1)")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        p.error(f"unknown call kinds {unknown}; choose from {','.join(KINDS)}")
    args.kinds = kinds
    return args


def tolerance(precision: str, k: int) -> float:
    """The allowed relative error: TOL, widened for long sums (fp32 rounding grows like sqrt(K) * 2^-24)."""
    return max(TOL[precision], math.sqrt(max(k, 1)) * 2.0 ** -24)


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def cache_sizes() -> dict[str, int]:
    """len() of each of fastmm's internal caches that can be found (read-only)."""
    out = {}
    for module_name, path in CACHE_PLACES:
        obj = sys.modules.get(module_name)
        for part in path.split("."):
            obj = getattr(obj, part, None) if obj is not None else None
        if obj is None:
            continue
        try:
            out[f"{module_name}.{path}"] = len(obj)
        except TypeError:
            pass
    return out


def mib(n: int | None) -> str:
    return "?" if n is None else f"{n / MIB:.1f} MiB"


class Gate:
    """Many holders of ``shared()`` at once, or one of ``exclusive()`` (which waits for the shared
    ones to leave and keeps new ones out): a worker's call runs under ``shared``, a graph capture and
    the memory measurements under ``exclusive``."""

    def __init__(self):
        self._cond = threading.Condition()
        self._active = 0
        self._exclusive = False
        self._waiting = 0

    @contextlib.contextmanager
    def shared(self):
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if self._active == 0:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        with self._cond:
            self._waiting += 1
            while self._exclusive or self._active:
                self._cond.wait()
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.calls = 0
        self.checks = 0
        self.failures = 0
        self.by_kind: dict[str, int] = {}
        self.samples: list[dict] = []  # the first failures, in detail

    def count(self, kind: str, calls: int = 1) -> None:
        with self.lock:
            self.calls += calls
            self.by_kind[kind] = self.by_kind.get(kind, 0) + calls

    def checked(self) -> None:
        with self.lock:
            self.checks += 1

    def fail(self, detail: dict) -> None:
        with self.lock:
            self.failures += 1
            if len(self.samples) < 20:
                self.samples.append(detail)
        print(f"FAILURE: {json.dumps(detail, default=str)}", flush=True)


class Worker:
    """One thread: its own stream, generator and random choices."""

    def __init__(self, index: int, args, torch, fastmm, gate: Gate, stats: Stats, stop: threading.Event):
        self.index, self.args, self.torch, self.fastmm = index, args, torch, fastmm
        self.gate, self.stats, self.stop = gate, stats, stop
        self.device = torch.device("cuda", args.device)
        self.rng = random.Random(args.seed + index)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(args.seed * 1000 + index)
        self.stream = torch.cuda.Stream(self.device)
        self.capture_stream = torch.cuda.Stream(self.device)
        self.n = 0
        self.kinds = args.kinds
        self.weights = [KINDS[k] for k in self.kinds]

    # --- helpers ---
    def randn(self, *shape):
        return self.torch.randn(*shape, device=self.device, generator=self.gen)

    def size(self, hi: int | None = None) -> int:
        return self.rng.randint(1, hi or self.args.max_size)

    def precision(self):
        return self.rng.choice(PRECISIONS)

    def resolved(self, precision) -> str:
        resolve = getattr(self.fastmm, "resolve_precision", None)
        if resolve is not None:
            return resolve(precision)
        if precision is not None:
            return precision
        return "ieee" if self.torch.get_float32_matmul_precision() == "highest" else "tf32"

    def nan_like_out(self, shape):
        return self.torch.full(shape, float("nan"), device=self.device)

    def check(self, what: str, got, ref64, precision: str, k: int, scale=None, detail: dict | None = None) -> bool:
        """``got`` against the float64 ``ref64``; ``scale()`` (the norm of |A||B|) stands in for
        |ref| on small outputs whose sums cancel. Records a failure; returns whether it passed."""
        torch = self.torch
        self.stats.checked()
        detail = detail or {}
        tol = tolerance(precision, k)
        if tuple(got.shape) != tuple(ref64.shape):
            self.stats.fail(dict(detail, what=what, precision=precision, error="shape",
                                 got=tuple(got.shape), want=tuple(ref64.shape)))
            return False
        diff, den = torch.stack([(got.double() - ref64).norm(), ref64.norm()]).tolist()
        err = diff / den if den > 0 else diff
        if not err <= tol and got.numel() < 64 and scale is not None:
            s = scale()
            err = diff / s if s > 0 else diff
        if err <= tol:  # (False for NaN)
            return True
        self.stats.fail(dict(detail, what=what, precision=precision, k=k, error=err, tol=tol,
                             nan=bool(torch.isnan(got).any().item())))
        return False

    def check_product(self, what: str, got, a, b, precision: str, detail: dict | None = None) -> bool:
        a64, b64 = a.detach().double(), b.detach().double()
        ref = self.torch.matmul(a64, b64)
        k = a.shape[-1]
        return self.check(what, got, ref, precision, k,
                          scale=lambda: self.torch.matmul(a64.abs(), b64.abs()).norm().item(), detail=detail)

    # --- the calls ---
    def plain(self, kind: str, a, b, precision, detail) -> None:
        """``fastmm.matmul(a, b)``, with a NaN-filled ``out=`` a third of the time; checked on a sample."""
        torch, fastmm = self.torch, self.fastmm
        use_out = self.rng.random() < 1 / 3
        if use_out:
            shape = torch.matmul(torch.empty(a.shape, device="meta"), torch.empty(b.shape, device="meta")).shape
            out = self.nan_like_out(shape)
            c = fastmm.matmul(a, b, precision=precision, out=out)
            if c is not out:
                self.stats.fail(dict(detail, what="out= did not return out"))
        else:
            c = fastmm.matmul(a, b, precision=precision)
        self.stats.count(kind)
        if self.n % self.args.check_every == 0:
            self.check_product(kind, c, a, b, self.resolved(precision), dict(detail, out=use_out))

    def call_random(self, precision):
        m, n, k = self.size(), self.size(), self.size()
        a = self.randn(k, m).t() if self.rng.random() < 0.25 else self.randn(m, k)
        b = self.randn(n, k).t() if self.rng.random() < 0.25 else self.randn(k, n)
        self.plain("random", a, b, precision, dict(shape=(m, n, k), a_t=not a.is_contiguous(),
                                                   b_t=not b.is_contiguous()))

    def call_linear(self, precision, decode=False):
        k, n = self.rng.choice(MODEL_DIMS), self.rng.choice(MODEL_DIMS)
        if decode:
            x = self.randn(self.rng.randint(1, 64), k)
        else:
            x = self.randn(self.rng.randint(1, 8), self.rng.randint(1, 512), k)
        w = self.randn(n, k)
        self.plain("decode" if decode else "linear", x, w.t(), precision, dict(x=tuple(x.shape), w=(n, k)))

    def call_bmm(self, precision):
        batch, m, n, k = self.rng.randint(1, 16), self.size(512), self.size(512), self.size(512)
        a = self.randn(batch, m, k)
        b = self.randn(k, n) if self.rng.random() < 0.25 else self.randn(batch, k, n)
        self.plain("bmm", a, b, precision, dict(a=tuple(a.shape), b=tuple(b.shape)))

    def call_long_k(self, precision):
        self.plain("long_k", self.randn(256, 65536), self.randn(65536, 256), precision, dict(shape=(256, 256, 65536)))

    def call_unaligned(self, precision):
        m, n, k = self.rng.randint(1025, 2049), self.rng.randint(1025, 2049), self.rng.randint(1025, 2049)
        if self.rng.random() < 0.5:
            n |= 1
            k |= 1
        offset_a, offset_b = self.rng.randint(0, 3), self.rng.randint(0, 3)
        a = self.randn(m * k + offset_a)[offset_a:].view(m, k)
        b = self.randn(k * n + offset_b)[offset_b:].view(k, n)
        self.plain("unaligned", a, b, precision, dict(shape=(m, n, k), offsets=(offset_a, offset_b)))

    def call_op_grad(self, precision):
        torch = self.torch
        p = self.resolved(precision)
        m, n, k = self.size(1024), self.size(1024), self.size(1024)
        a = self.randn(m, k).requires_grad_()
        b = self.randn(k, n).requires_grad_()
        y = torch.ops.fastmm.matmul(a, b, p)
        g = self.randn(m, n)
        y.backward(g)
        self.stats.count("op_grad", 3)
        if self.n % self.args.check_every:
            return
        a64, b64, g64 = a.detach().double(), b.detach().double(), g.double()
        detail = dict(shape=(m, n, k))
        self.check_product("op_grad forward", y.detach(), a, b, p, detail=detail)
        self.check("op_grad grad_a", a.grad, g64 @ b64.t(), p, max(k, n),
                   scale=lambda: (g64.abs() @ b64.abs().t()).norm().item(), detail=detail)
        self.check("op_grad grad_b", b.grad, a64.t() @ g64, p, max(k, m),
                   scale=lambda: (a64.abs().t() @ g64.abs()).norm().item(), detail=detail)

    def call_nn_linear(self, precision):
        torch = self.torch
        k, n = self.rng.choice(MODEL_DIMS), self.rng.choice(MODEL_DIMS)
        tokens = (self.rng.randint(1, 4), self.rng.randint(1, 256))
        p = self.resolved(precision)
        layer = self.fastmm.nn.Linear(k, n, device=self.device, precision=precision)
        x = self.randn(*tokens, k).requires_grad_()
        y = layer(x)
        g = self.randn(*y.shape)
        y.backward(g)
        self.stats.count("nn_linear", 3)
        if self.n % self.args.check_every:
            return
        x64, w64, g64 = x.detach().double(), layer.weight.detach().double(), g.double()
        rows = tokens[0] * tokens[1]
        detail = dict(x=tuple(x.shape), w=(n, k))
        self.check("nn_linear forward", y.detach(), x64 @ w64.t() + layer.bias.detach().double(), p, k, detail=detail)
        self.check("nn_linear grad_x", x.grad, g64 @ w64, p, max(k, n), detail=detail)
        self.check("nn_linear grad_w", layer.weight.grad, g64.reshape(rows, n).t() @ x64.reshape(rows, k), p,
                   max(k, rows), detail=detail)
        self.check("nn_linear grad_bias", layer.bias.grad, g64.reshape(rows, n).sum(0), p, rows, detail=detail)

    def call_graph(self, precision):
        """Warm up, capture (the other workers wait between calls), replay with new values."""
        torch, fastmm = self.torch, self.fastmm
        p = self.resolved(precision)
        m, n, k = self.size(1024), self.size(1024), self.size(4096)
        with self.gate.shared():
            a, b = self.randn(m, k), self.randn(k, n)
            out = self.nan_like_out((m, n))
            fastmm.warmup(a, b, precision=precision)
            fastmm.warmup(a, b, precision=precision, out=out)
        with self.gate.exclusive():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.capture_stream, capture_error_mode="thread_local"):
                c = fastmm.matmul(a, b, precision=precision)
                fastmm.matmul(a, b, precision=precision, out=out)
        with self.gate.shared():
            for replay in range(2):
                a.copy_(self.randn(m, k))
                b.copy_(self.randn(k, n))
                out.fill_(float("nan"))
                graph.replay()
                self.stats.count("graph", 2)
                detail = dict(shape=(m, n, k), replay=replay)
                self.check_product("graph", c, a, b, p, detail=detail)
                self.check_product("graph out=", out, a, b, p, detail=detail)
            del graph, c

    def one(self) -> None:
        kind = self.rng.choices(self.kinds, self.weights)[0]
        precision = self.precision()
        call = {"random": self.call_random, "linear": self.call_linear, "decode": lambda p: self.call_linear(p, True),
                "bmm": self.call_bmm, "long_k": self.call_long_k, "unaligned": self.call_unaligned,
                "op_grad": self.call_op_grad, "nn_linear": self.call_nn_linear, "graph": self.call_graph}[kind]
        try:
            if kind == "graph":
                call(precision)  # (takes the gate itself)
            else:
                with self.gate.shared():
                    call(precision)
        except Exception as exc:
            self.stats.fail(dict(what=kind, precision=precision, exception=repr(exc),
                                 traceback=traceback.format_exc(limit=8)))

    def run(self) -> None:
        torch = self.torch
        try:
            torch.cuda.set_device(self.args.device)
            with torch.cuda.stream(self.stream):
                while not self.stop.is_set():
                    self.n += 1
                    self.one()
        except BaseException as exc:  # the worker itself broke (not one call): recorded, the others go on
            self.stats.fail(dict(what=f"worker {self.index} stopped", exception=repr(exc),
                                 traceback=traceback.format_exc(limit=8)))


def at_rest(torch, gate: Gate, device: int) -> dict:
    """Memory with every worker paused between calls and the device idle."""
    with gate.exclusive():
        torch.cuda.synchronize(device)
        gc.collect()
        return {"allocated": torch.cuda.memory_allocated(device), "peak": torch.cuda.max_memory_allocated(device),
                "reserved": torch.cuda.memory_reserved(device), "rss": rss_bytes(), "caches": cache_sizes()}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError as exc:
        print(f"soak: PyTorch is not installed here ({exc}); the soak test needs it and a CUDA GPU. Nothing was run.",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("soak: no CUDA GPU here (torch.cuda.is_available() is False); the soak test needs one. Nothing was run.",
              file=sys.stderr)
        return 2
    if args.device >= torch.cuda.device_count():
        print(f"soak: no CUDA device {args.device} (there are {torch.cuda.device_count()})", file=sys.stderr)
        return 2
    import fastmm

    torch.cuda.set_device(args.device)
    duration = args.minutes * 60.0
    gate, stats, stop = Gate(), Stats(), threading.Event()
    print(f"soak: {args.minutes:g} min, {args.threads} threads on {torch.cuda.get_device_name(args.device)}, "
          f"fastmm {fastmm.__version__}, torch {torch.__version__}; kinds {','.join(args.kinds)}; "
          f"a check every {args.check_every} calls; warm-up {args.warmup_fraction:.0%}", flush=True)
    workers = [Worker(i, args, torch, fastmm, gate, stats, stop) for i in range(args.threads)]
    threads = [threading.Thread(target=w.run, name=f"soak-{i}", daemon=True) for i, w in enumerate(workers)]
    start = time.monotonic()
    for t in threads:
        t.start()
    reports, warm = [], None
    warm_at = start + duration * args.warmup_fraction
    next_report = start + args.report_every
    while True:
        now = time.monotonic()
        if warm is None and now >= warm_at:
            warm = at_rest(torch, gate, args.device)
            warm["elapsed_s"] = round(time.monotonic() - start, 1)
            print(f"[{warm['elapsed_s']:7.1f} s] warm-up over: at rest {mib(warm['allocated'])} allocated, "
                  f"RSS {mib(warm['rss'])}; caches {warm['caches']}", flush=True)
        if now >= next_report:
            with stats.lock:
                calls, checks, failures = stats.calls, stats.checks, stats.failures
            rep = {"elapsed_s": round(now - start, 1), "calls": calls, "checks": checks, "failures": failures,
                   "allocated": torch.cuda.memory_allocated(args.device),
                   "peak": torch.cuda.max_memory_allocated(args.device), "rss": rss_bytes(), "caches": cache_sizes(),
                   "alive": sum(t.is_alive() for t in threads)}
            reports.append(rep)
            print(f"[{rep['elapsed_s']:7.1f} s] calls {calls}, checked {checks}, failures {failures}; "
                  f"allocated {mib(rep['allocated'])}, peak {mib(rep['peak'])}, RSS {mib(rep['rss'])}; "
                  f"caches {rep['caches']}", flush=True)
            next_report += args.report_every
        if now - start >= duration:
            break
        time.sleep(max(0.05, min(1.0, next_report - now, (warm_at - now) if warm is None else 1.0)))
    stop.set()
    stuck = []
    for t in threads:
        t.join(timeout=300)
        if t.is_alive():
            stuck.append(t.name)
    elapsed = time.monotonic() - start
    if stuck:  # a call that never returned: memory cannot be measured at rest
        stats.fail({"what": "worker did not stop within 300 s", "threads": stuck})
        end = {"allocated": torch.cuda.memory_allocated(args.device), "rss": rss_bytes(), "caches": cache_sizes(),
               "peak": torch.cuda.max_memory_allocated(args.device), "reserved": None}
    else:
        end = at_rest(torch, gate, args.device)
    if warm is None:  # (a run too short to reach the baseline)
        warm = end
    growth = end["allocated"] - warm["allocated"]
    rss_growth = (end["rss"] - warm["rss"]) if end["rss"] is not None and warm["rss"] is not None else 0
    problems = []
    if stats.failures:
        problems.append(f"{stats.failures} failures")
    if growth > args.max_growth_mib * MIB:
        problems.append(f"CUDA memory at rest grew {mib(growth)} after the warm-up (> {args.max_growth_mib:g} MiB)")
    if rss_growth > args.max_rss_growth_mib * MIB:
        problems.append(f"RSS at rest grew {mib(rss_growth)} after the warm-up (> {args.max_rss_growth_mib:g} MiB)")
    summary = {
        "minutes": round(elapsed / 60, 2), "threads": args.threads, "calls": stats.calls, "checks": stats.checks,
        "failures": stats.failures, "calls_by_kind": dict(sorted(stats.by_kind.items())),
        "memory_at_warmup_end": warm, "memory_at_end": end, "allocated_growth_bytes": growth,
        "rss_growth_bytes": rss_growth, "failure_samples": stats.samples, "problems": problems,
        "ok": not problems, "args": {k: v for k, v in vars(args).items()},
    }
    print(f"\nsoak summary: {elapsed / 60:.1f} min, {args.threads} threads: {stats.calls} calls "
          f"({', '.join(f'{k} {v}' for k, v in summary['calls_by_kind'].items())}), {stats.checks} checked, "
          f"{stats.failures} failures")
    print(f"  CUDA allocated at rest: {mib(warm['allocated'])} after warm-up -> {mib(end['allocated'])} at the end "
          f"(growth {mib(growth)}); peak {mib(end['peak'])}")
    print(f"  RSS at rest: {mib(warm['rss'])} after warm-up -> {mib(end['rss'])} at the end (growth {mib(rss_growth)})")
    print(f"  fastmm caches: {warm['caches']} after warm-up -> {end['caches']} at the end")
    print("  result: " + ("OK" if not problems else "FAILED: " + "; ".join(problems)), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"summary": summary, "reports": reports}, fh, indent=1, default=str)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
