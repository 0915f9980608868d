"""Skinny-M kernel variants (issue 4): correctness, then timing against torch.matmul, on the GPU.

    PYTHONPATH=. python3 benchmarks/skinny_variants.py [--no-rotate] [--only NAME[,NAME...]]

For every variant in VARIANTS ("base" is today's default kernel, the others skinny.cu's SK_V2
design with the geometry given to Skinny.configure_v2; see benchmarks/NOTES.md "skinny v2"):

1. correctness: rel. Frobenius error vs a float64 product <= 1e-5 for M in {1,3,8,16,17,32} x
   (N, K) in {(4096,4096), (4095,4093), (1000,333)}, plus a batched product (B broadcast), a
   transposed B (4-byte loads) and a transposed A; outputs pre-filled with NaN, fresh randn
   inputs; decode16 run twice must give the same bits (deterministic split-K).
2. timing (TF32 off): decode16 16x4096x4096, 1x4096x4096, 32x4096x4096 and 16x8192x8192, with
   torch.matmul in the same run; CUDA events around 10 back-to-back calls, 3 warm-up samples,
   median of 25 samples (each sample queued behind a sleep kernel, so host launch overhead is not
   timed). B is rotated among copies that together overflow L2 three times (64 MiB B at N=K=4096:
   3 copies; --no-rotate: one copy, like bench.py), so neither library reads B from L2.

Kernels are compiled up front in parallel processes into fastmm's disk cache. Prints a table
last and "FAILURES: n"; exit status 1 on any failure.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, ".")
from fastmm import api  # noqa: E402
from fastmm.families import FAMILIES, splitk_reduce_config  # noqa: E402
from fastmm.runtime import launcher, runners  # noqa: E402

#: (name, configure_v2 keywords); None: the v1 skinny kernel (SK_V2 = 0).
VARIANTS = [
    ("base", None),
    ("v2 bn32 c8", dict(bn=32, cpt=8)),  # 128 column tiles at N=4096 (no split), 3-4 stages x 32 KB of B
    ("v2 bn64 c8", dict(bn=64, cpt=8)),  # 64 tiles x split 2
    ("v2 bn128 c8", dict(bn=128, cpt=8)),  # 32 tiles x split 4; A read 4x less than bn32
    ("v2 bn128 c8 2-pass", dict(bn=128, cpt=8, fuse=False)),  # the split summed by splitk_reduce
    ("v2 bn128 c4 q2", dict(bn=128, cpt=4, qpt=2)),  # today's lane mapping (warp = one k-group), pipelined
    ("v2 bn32 c4 q2", dict(bn=32, cpt=4, qpt=2)),  # half the accumulators of c8
    ("v2 bn128 c4 t512", dict(bn=128, cpt=4, threads=512)),  # 16 warps per SM, <= 128 registers
    ("v2 regs bn32 c4 q2", dict(pipe=0, bn=32, cpt=4, qpt=2)),  # B to registers one stage ahead (no cp.async)
    ("v2 regs bn64 c8", dict(pipe=0, bn=64, cpt=8)),
    ("v2 bn256 c8", dict(bn=256, cpt=8)),  # 16 tiles x split 8: 1 KB of each B row per block, no shuffles
    ("v2 bn128 c8 q2", dict(bn=128, cpt=8, qpt=2)),  # 128-row stages: 128 KB of B in flight, half the barriers
    ("v2 bn128 c8 s3", dict(bn=128, cpt=8, stages=3)),  # 64 KB in flight: is depth the limit?
]
CHECK_MS = (1, 3, 8, 16, 17, 32)
CHECK_NK = ((4096, 4096), (4095, 4093), (1000, 333))
TIMED = ((16, 4096, 4096), (1, 4096, 4096), (32, 4096, 4096), (16, 8192, 8192))
TOL = 1e-5


def _make(case):
    """Fresh operands of a check case: (a, b) on the GPU."""
    kind, M, N, K = case
    if kind == "batch":  # (3, M, K) @ (K, N): B broadcast over the batch
        return torch.randn(3, M, K, device="cuda"), torch.randn(K, N, device="cuda")
    if kind == "bt":  # B a transposed view: 4-byte loads of B (B_VEC 0)
        return torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda").t()
    if kind == "at":  # A a transposed view: strided A (A_VEC 0)
        return torch.randn(K, M, device="cuda").t(), torch.randn(K, N, device="cuda")
    return torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda")


CASES = [("plain", M, N, K) for M in CHECK_MS for N, K in CHECK_NK] + [
    ("batch", 16, 1000, 333), ("batch", 5, 4096, 1024), ("bt", 16, 1000, 333), ("at", 17, 4096, 4096)]


class Runner:
    """One variant's kernel(s) for one problem, launched as fastmm.api._launch_plan does."""

    def __init__(self, kw, a, b, c, dev):
        s = api.analyse(a, b)
        self.p, self.offsets = api.build_problem(s, c, "ieee")
        sk = FAMILIES["skinny"]
        cfg = sk.configure_v1(self.p, dev) if kw is None else sk.configure_v2(self.p, dev, **kw)
        self.cfg = sk.with_launch_mode(cfg, dev)  # (a dependent launch on sm_90, as planned kernels)
        split = self.cfg.split_k
        self.rcfg = splitk_reduce_config(self.p, dev, split) if split > 1 and not self.cfg.split_fused else None
        self.dev = dev
        self.ptrs = (s.a.data_ptr(), s.b.data_ptr(), c.data_ptr())

    def configs(self):
        return [x for x in (self.cfg, self.rcfg) if x is not None]

    def load(self):
        self.k = launcher.load(self.dev, self.cfg)
        self.r = launcher.load(self.dev, self.rcfg) if self.rcfg is not None else None
        self.stream = torch.cuda.current_stream().cuda_stream
        if self.r is not None:
            self.work = torch.empty(self.cfg.split_k * self.p.M * self.p.N, device="cuda")
        return self

    def __call__(self, ptrs=None):
        p = self.p
        pa, pb, pc = ptrs or self.ptrs
        if self.cfg.split_fused:  # one launch that sums its own slices (arrival counters)
            if not hasattr(self, "fused"):
                self.fused = runners.fused_split_runner(self.k, self.cfg, p, torch.device("cuda", torch.cuda.current_device()))
            self.fused(pa, pb, pc, self.stream)
            return
        if self.r is not None:
            launcher.launch(self.k, self.stream, (pa, pb, self.work.data_ptr()) + runners.split_gemm_args(p))
            launcher.launch(self.r, self.stream, (self.work.data_ptr(), pc, p.M, p.N, self.cfg.split_k, *p.c_strides))
            return
        for oa, ob, oc in self.offsets:
            launcher.launch(self.k, self.stream, (pa + 4 * oa, pb + 4 * ob, pc + 4 * oc) + runners.gemm_args(p))


def _compile_one(job):
    """In a worker process: put one kernel into fastmm's disk cache (no GPU needed)."""
    cfg, arch = job
    from fastmm.runtime.cache import default_cache
    from fastmm.runtime.compiler import compile_cubin
    from fastmm.runtime.launcher import key_for

    target = cfg.target(arch)
    t = time.time()
    try:
        default_cache().get_or_compile(cfg.family + "-" + target, key_for(cfg, arch), target,
                                       lambda: compile_cubin(cfg.source, cfg.macros, target))
    except Exception as exc:  # reported by the main process when it loads
        return f"{dict(cfg.macros)}: {str(exc)[:300]}"
    return time.time() - t


def precompile(configs, arch):
    jobs = {}
    for cfg in configs:
        jobs.setdefault(cfg.macros + ((cfg.source, 0),), cfg)
    t = time.time()
    workers = max(1, min(len(jobs), (os.cpu_count() or 2)))
    with mp.get_context("spawn").Pool(workers) as pool:
        out = pool.map(_compile_one, [(cfg, arch) for cfg in jobs.values()])
    errors = [o for o in out if isinstance(o, str)]
    print(f"compiled/cached {len(jobs)} kernels in {time.time() - t:.1f} s ({workers} processes)", flush=True)
    for e in errors:
        print("COMPILE ERROR", e, flush=True)


def rel_err(c, a, b):
    ref = torch.matmul(a.double(), b.double())
    if not torch.isfinite(c).all():
        return float("inf")
    return ((c.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def time_us(fn, inner=10, samples=25):
    """Median GPU time per call. Each sample queues a ~1 ms sleep kernel first, so the host has
    queued all ``inner`` calls before the GPU reaches the start event: Python launch overhead
    (a few us per launch) cannot show up as GPU idle time between the calls."""
    sleep = getattr(torch.cuda, "_sleep", None)
    for _ in range(3):
        for i in range(inner):
            fn(i)
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
    for s, e in ev:
        if sleep is not None:
            sleep(2_000_000)
        s.record()
        for i in range(inner):
            fn(i)
        e.record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) for s, e in ev)
    return 1000.0 * t[len(t) // 2] / inner


def main():
    if not torch.cuda.is_available():
        print("FAILURES: 1 (no CUDA device)")
        return 1
    rotate = "--no-rotate" not in sys.argv
    variants = VARIANTS
    if "--only" in sys.argv:
        names = sys.argv[sys.argv.index("--only") + 1].split(",")
        variants = [v for v in VARIANTS if v[0] in names]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    t0 = time.time()
    dev = api.device_facts(torch.cuda.current_device())
    print(f"device {dev.name} ({dev.arch}, {dev.sm_count} SMs, {dev.l2_bytes >> 20} MiB L2); rotate B: {rotate}")
    fails = []

    # Plan every (variant, problem) first, so all kernels compile in parallel.
    plans = {}  # (variant, case) -> Runner or reason it is not available
    operands = {}
    for case in CASES:
        a, b = _make(case)
        c = torch.empty(torch.matmul(a[..., :1, :1], b[:1, :1]).shape[:-2] + (case[1], case[2]), device="cuda")
        operands[case] = (a, b, c)
    for M, N, K in TIMED:
        operands[("timed", M, N, K)] = (torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda"),
                                        torch.empty(M, N, device="cuda"))
    for name, kw in variants:
        for case, (a, b, c) in operands.items():
            try:
                plans[(name, case)] = Runner(kw, a, b, c, dev)
            except ValueError as exc:  # a geometry this device cannot host: not a failure
                plans[(name, case)] = f"n/a: {exc}"
    precompile([cfg for r in plans.values() if isinstance(r, Runner) for cfg in r.configs()], dev.arch)

    # 1. correctness
    for name, kw in variants:
        worst, n_ok, na = 0.0, 0, 0
        for case in CASES:
            r = plans[(name, case)]
            if isinstance(r, str):
                na += 1
                continue
            a, b, c = operands[case]
            try:
                a.normal_()
                b.normal_()
                c.fill_(float("nan"))
                r.load()()
                torch.cuda.synchronize()
                err = rel_err(c, a, b)
            except Exception as exc:
                err = float("nan")
                print(f"ERROR {name} {case}: {exc}")
                traceback.print_exc()
            if not err <= TOL:
                fails.append(f"{name} {case}: rel err {err:.3g}")
                print(f"FAIL {name} {case} rel err {err:.3g} grid {r.cfg.grid} macros {dict(r.cfg.macros)}", flush=True)
            else:
                n_ok += 1
                worst = max(worst, err)
        # determinism: decode16 twice, same bits
        r = plans[(name, ("timed", 16, 4096, 4096))]
        if isinstance(r, Runner):
            try:
                a, b, c = operands[("timed", 16, 4096, 4096)]
                r.load()()
                first = c.clone()
                c.fill_(float("nan"))
                r()
                torch.cuda.synchronize()
                if not torch.equal(first, c):
                    fails.append(f"{name}: decode16 not bitwise reproducible")
                    print(f"FAIL {name}: decode16 differs between two runs", flush=True)
            except Exception as exc:
                fails.append(f"{name}: determinism run raised {exc}")
                print(f"ERROR {name} determinism: {exc}", flush=True)
        print(f"checked {name:<20} {n_ok} ok, worst rel err {worst:.2e}" + (f", {na} n/a" if na else ""), flush=True)
    t_check = time.time() - t0

    # 2. timing
    rows = []
    for M, N, K in TIMED:
        a, b, c = operands[("timed", M, N, K)]
        copies = min(4, -(-3 * dev.l2_bytes // (K * N * 4))) if rotate else 1
        bs = [b] + [b.clone() for _ in range(copies - 1)]
        flop, bbytes = 2.0 * M * N * K, 4.0 * K * N
        t_torch = time_us(lambda i: torch.matmul(a, bs[i % len(bs)], out=c))
        rows.append(("torch", f"{M}x{N}x{K}", t_torch, flop / t_torch / 1e6, bbytes / t_torch / 1e3, 1.0))
        for name, _ in variants:
            r = plans[(name, ("timed", M, N, K))]
            if isinstance(r, str):
                rows.append((name, f"{M}x{N}x{K}", r))
                continue
            try:
                r.load()
                ptrs = [(a.data_ptr(), x.data_ptr(), c.data_ptr()) for x in bs]
                t = time_us(lambda i: r(ptrs[i % len(ptrs)]))
                geo = f"grid {r.cfg.grid[0]}x{r.cfg.grid[1]}, {r.cfg.block} thr, smem {r.cfg.smem // 1024} KiB"
                rows.append((name, f"{M}x{N}x{K}", t, flop / t / 1e6, bbytes / t / 1e3, t_torch / t, geo))
            except Exception as exc:
                fails.append(f"{name} timing {M}x{N}x{K}: {exc}")
                rows.append((name, f"{M}x{N}x{K}", f"ERROR {exc}"[:150]))
    print(f"\ncorrectness {t_check:.1f} s, total {time.time() - t0:.1f} s; torch TF32 off; B rotated: {rotate}; "
          "GB/s B = K*N*4 bytes / time; x torch = torch time / variant time")
    print(f"{'variant':<20} {'shape':<15} {'us':>8} {'TFLOP/s':>8} {'GB/s B':>8} {'x torch':>8}  geometry")
    for row in rows:
        if len(row) == 3:
            print(f"{row[0]:<20} {row[1]:<15} {row[2]}")
        else:
            print(f"{row[0]:<20} {row[1]:<15} {row[2]:8.1f} {row[3]:8.2f} {row[4]:8.0f} {row[5]:8.2f}  {row[6] if len(row) > 6 else ''}")
    print(f"FAILURES: {len(fails)}")
    for f in fails:
        print("  " + f)
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
