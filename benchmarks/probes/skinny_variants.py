"""Skinny-M kernel variants (issue 4): correctness, then timing against torch.matmul, on the GPU.

    python benchmarks/probes/skinny_variants.py [--no-rotate] [--only NAME[,NAME...]]

For every variant in VARIANTS, a Skinny family instance handed to the planner ("base" is run 6's
v1 kernel, SK_V2 = 0; the others skinny.cu's SK_V2 design with the geometry given to
Skinny.configure_v2; see benchmarks/NOTES.md "skinny v2"), launched as fastmm launches the plan
(split-K summed by the kernel or by splitk_reduce, a dependent launch on sm_90):

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

import argparse
import itertools
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]  # the repo (ahead of any installed fastmm), this folder

import torch  # noqa: E402

from fastmm import dispatch  # noqa: E402
from fastmm.families import Skinny  # noqa: E402
from fastmm.plan import select  # noqa: E402
from fastmm.runtime import launcher, runners  # noqa: E402
from fastmm.shapes import analyse, build_problem  # noqa: E402
from probe_util import need_gpu, rel_err, time_us  # noqa: E402

#: (name, the Skinny family instance handed to the planner): variant "v1" is the v1 kernel
#: (SK_V2 = 0); a dict, Skinny.configure_v2's keywords. The sm_90 default is "v2 bn128 c8".
VARIANTS = [
    ("base", Skinny(variant="v1")),
    ("v2 bn32 c8", Skinny(variant=dict(bn=32, cpt=8))),  # 128 column tiles at N=4096 (no split), 3-4 stages x 32 KB of B
    ("v2 bn64 c8", Skinny(variant=dict(bn=64, cpt=8))),  # 64 tiles x split 2
    ("v2 bn128 c8", Skinny(variant=dict(bn=128, cpt=8))),  # 32 tiles x split 4; A read 4x less than bn32
    ("v2 bn128 c8 2-pass", Skinny(variant=dict(bn=128, cpt=8), fuse_split=False)),  # the split summed by splitk_reduce
    ("v2 bn128 c4 q2", Skinny(variant=dict(bn=128, cpt=4, qpt=2))),  # run 6's lane mapping (warp = one k-group), pipelined
    ("v2 bn32 c4 q2", Skinny(variant=dict(bn=32, cpt=4, qpt=2))),  # half the accumulators of c8
    ("v2 bn128 c4 t512", Skinny(variant=dict(bn=128, cpt=4, threads=512))),  # 16 warps per SM, <= 128 registers
    ("v2 regs bn32 c4 q2", Skinny(variant=dict(pipe=0, bn=32, cpt=4, qpt=2))),  # B to registers one stage ahead (no cp.async)
    ("v2 regs bn64 c8", Skinny(variant=dict(pipe=0, bn=64, cpt=8))),
    ("v2 bn256 c8", Skinny(variant=dict(bn=256, cpt=8))),  # 16 tiles x split 8: 1 KB of each B row per block, no shuffles
    ("v2 bn128 c8 q2", Skinny(variant=dict(bn=128, cpt=8, qpt=2))),  # 128-row stages: 128 KB of B in flight, half the barriers
    ("v2 bn128 c8 s3", Skinny(variant=dict(bn=128, cpt=8, stages=3))),  # 64 KB in flight: is depth the limit?
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
    """One variant's plan for one problem (the planner's, with the variant forced), launched as
    fastmm.dispatch.launch_plan launches a plan: through its runner (split-K, fused split), else
    one plain launch per launch offset."""

    def __init__(self, fam, a, b, c, dev):
        s = analyse(a, b)
        self.p, self.offsets = build_problem(s, c, "ieee")
        self.plan = select(self.p, dev, "skinny", variants=(fam,))  # ValueError: the variant cannot run here
        if self.plan.kernel is None:
            raise ValueError(self.plan.fallback)
        self.cfg, self.rcfg = self.plan.kernel, self.plan.reduce
        self.dev = dev
        self.ptrs = (s.a.data_ptr(), s.b.data_ptr(), c.data_ptr())
        self.k = None

    def configs(self):
        return [x for x in (self.cfg, self.rcfg) if x is not None]

    def load(self):
        if self.k is None:
            self.k = launcher.load(self.dev, self.cfg)
            r = launcher.load(self.dev, self.rcfg) if self.rcfg is not None else None
            device = torch.device("cuda", self.dev.index)
            self.run = runners.runner_for(self.plan, self.k, r, self.plan.launch_problem or self.p, device)
            self.tail = runners.gemm_args(self.plan.launch_problem or self.p)
            self.stream = dispatch.current_stream(self.dev.index)
        return self

    def __call__(self, ptrs=None):
        pa, pb, pc = ptrs or self.ptrs
        if self.run is not None:
            self.run(pa, pb, pc, self.stream)
            return
        for oa, ob, oc in self.offsets:
            launcher.launch(self.k, self.stream, (pa + 4 * oa, pb + 4 * ob, pc + 4 * oc) + self.tail)


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="skinny_variants.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-rotate", action="store_true", help="time on one copy of B (it may sit in L2)")
    ap.add_argument("--only", metavar="NAME[,NAME...]", help="only these variants: " + ", ".join(n for n, _ in VARIANTS))
    o = ap.parse_args(argv)
    rotate = not o.no_rotate
    variants = VARIANTS
    if o.only:
        names = o.only.split(",")
        unknown = set(names) - {n for n, _ in VARIANTS}
        if unknown:
            ap.error(f"no variant {', '.join(sorted(unknown))}")
        variants = [v for v in VARIANTS if v[0] in names]
    if not need_gpu(ap.prog):
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    t0 = time.time()
    dev = dispatch.device_facts(torch.cuda.current_device())
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
    for name, fam in variants:
        for case, (a, b, c) in operands.items():
            try:
                plans[(name, case)] = Runner(fam, a, b, c, dev)
            except ValueError as exc:  # a geometry this device cannot host: not a failure
                plans[(name, case)] = f"n/a: {exc}"
    precompile([cfg for r in plans.values() if isinstance(r, Runner) for cfg in r.configs()], dev.arch)

    # 1. correctness
    for name, _ in variants:
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
        b_next = itertools.cycle(bs).__next__
        t_torch = time_us(lambda: torch.matmul(a, b_next(), out=c), samples=25, sleep_cycles=2_000_000, warmup=3)
        rows.append(("torch", f"{M}x{N}x{K}", t_torch, flop / t_torch / 1e6, bbytes / t_torch / 1e3, 1.0))
        for name, _ in variants:
            r = plans[(name, ("timed", M, N, K))]
            if isinstance(r, str):
                rows.append((name, f"{M}x{N}x{K}", r))
                continue
            try:
                r.load()
                ptrs_next = itertools.cycle([(a.data_ptr(), x.data_ptr(), c.data_ptr()) for x in bs]).__next__
                t = time_us(lambda: r(ptrs_next()), samples=25, sleep_cycles=2_000_000, warmup=3)
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
