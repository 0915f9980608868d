#!/usr/bin/env python3
"""Every fastmm kernel over edge shapes: the workload benchmarks/sanitize.sh runs under
compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

    PYTHONPATH=. python benchmarks/sanitize.py            # full set (a few hundred launches)
    PYTHONPATH=. python benchmarks/sanitize.py --quick    # a small set, for the slow tools
    PYTHONPATH=. python benchmarks/sanitize.py --dry-run  # no GPU needed: list the cases and
                                                          # the plans a simulated device gets
    PYTHONPATH=. python benchmarks/sanitize.py --epilogue # the 2-D cases again with a fused
                                                          # epilogue: 2 * A @ B + D

What runs: each kernel family forced through ``fastmm.dispatch.matmul_fastmm(..., force=family)`` at
each distinct precision it computes (the SIMT, scalar and skinny kernels build the same cubin for
every precision, so they run once, at "ieee"; tf32_mma runs at "tf32" and "tf32x3"), plus the
dispatcher's own choice, including split-K plans (a GEMM writing K slices to a workspace, then
the splitk_reduce pass), over:
  - sizes 1, tile-1, tile, tile+1 in M, N and K around the tile each family uses (read from the
    plan's KernelConfig.tile), K around the pipeline depth (BK * (STAGES + 1) +- 1), for the
    smallest tile and (full set) every larger tile the planner can pick (reached with a batch);
  - the CUTLASS-style sizes of DESIGN.md: M in {a, 512-3a}, N in {a, 512-2a},
    K in {a, BK*(STAGES+1)-a}, alignment a in {1, 4};
  - transposed operands and output, storage offsets (4- and 8-byte aligned pointers), padded rows,
    batch 3 (also with a broadcast B), a batch past the grid.z limit, a partial last wave;
  - split-K counts, including splits that get no k-tile at all (their slice must still be written);
  - stream-K plans (whole waves of tiles, the rest in pieces, then the fixup pass).
  - staged operands (copied by fastmm into a zero-padded, 16-byte aligned buffer before the launch;
    for simt_cp_async also a K-contiguous B of a large product, transposed into a row-major copy).
The driver itself runs no torch kernel on the GPU: operands and outputs are built on the CPU and
copied over, references are computed on the CPU in float64. (fastmm's own staging copies are its
stage_kmajor kernel.) So what the sanitizer reports comes from fastmm's calls.

Checks: inputs are small integers, exact in TF32 and summed exactly in fp32, so every kernel must
reproduce the float64 product bit for bit (plus a few randn cases within the precision's
tolerance); the output lives inside a guard zone of canary values, which must survive; each input
buffer ends at the operand's last element (so memcheck sees any read past it) and must be
unchanged. --epilogue: every case without batch dims runs ``dispatch.matmul_fused(a, b, d, 2, 1)`` instead:
the family's kernels and second passes built with EPILOGUE = 1, D an (M, N) matrix of small
integers (transposed where C would be) in a buffer that ends at its last element, so memcheck
sees any read past it; the result must be exactly 2 * A @ B + D, and D unchanged.
Prints one summary line (--verbose: a line per case); exits 1 if any case was wrong.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a source checkout without install

from fastmm import dispatch  # noqa: E402
from fastmm.families import FAMILIES, WgmmaTf32  # noqa: E402
from fastmm.families.wgmma_tf32 import STAGED_TURNS_160  # noqa: E402
from fastmm.plan import select  # noqa: E402
from fastmm.problem import DeviceFacts, Problem  # noqa: E402
from fastmm.shapes import analyse, build_problem  # noqa: E402

GUARD = 64  # canary floats on each side of the output
CANARY = -7777.0
TOL = {"ieee": 1e-5, "tf32": 1e-3, "tf32x3": 1e-5}  # randn cases: ||C - ref|| / || |A| |B| ||
#: (family, precision) pairs with distinct kernels: precision does not enter the macros of the
#: fp32 families, so one precision covers them; tf32_mma builds different code for tf32 / tf32x3.
FORCED = [("scalar", "ieee"), ("simt_float4", "ieee"), ("simt_cp_async", "ieee"), ("skinny", "ieee"),
          ("skinny_kmajor", "ieee"), ("kmajor_mma", "tf32"), ("kmajor_mma", "tf32x3"),
          ("tf32_mma", "tf32"), ("tf32_mma", "tf32x3"), ("wgmma_tf32", "tf32"), ("wgmma_tf32", "tf32x3")]


@dataclass(frozen=True)
class Case:
    group: str
    family: str | None  # forced family, or None for the dispatcher's choice
    precision: str
    M: int
    N: int
    K: int
    batch: int = 0  # 0: 2-D operands; n > 0: A, B and C have a leading batch dim of n
    b_broadcast: bool = False  # with a batch: B has a batch dim of 1 (broadcast, batch stride 0)
    a_t: bool = False  # A is a transposed view (column-major)
    b_t: bool = False
    c_t: bool = False  # out is a transposed view
    offsets: tuple[int, int, int] = (0, 0, 0)  # storage offsets of A, B, C in floats
    pad: int = 0  # extra floats per row (leading dimension) of A, B and C
    alloc: bool = False  # no out=: fastmm allocates the result
    values: str = "int"  # "int": small integers (exact); "randn": within the tolerance
    variants: tuple = ()  # family instances in place of the registry's (dispatch's ``variants``)

    def label(self) -> str:
        bits = [f"{self.M}x{self.N}x{self.K}"]
        if self.batch:
            bits.append(f"batch{self.batch}" + ("(B bcast)" if self.b_broadcast else ""))
        lay = "".join(x for x, t in (("At", self.a_t), ("Bt", self.b_t), ("Ct", self.c_t)) if t)
        if lay:
            bits.append(lay)
        if any(self.offsets):
            bits.append("off" + ",".join(map(str, self.offsets)))
        if self.pad:
            bits.append(f"pad{self.pad}")
        if self.alloc:
            bits.append("alloc")
        if self.values != "int":
            bits.append(self.values)
        for v in self.variants:  # a variant by the fields it sets
            bits.append(f"{v.name}(" + ",".join(f"{f.name}={getattr(v, f.name)!r}" for f in fields(v)
                                                 if getattr(v, f.name) != f.default) + ")")
        return f"{self.group}:{self.family or 'dispatch'}@{self.precision}:" + "-".join(bits)

    @property
    def work(self) -> int:
        return max(self.batch, 1) * self.M * self.N * self.K


# ---------------------------------------------------------------------------------------------
# operands: a flat buffer (with guard zones for the output) and a strided view into it

@dataclass
class Operand:
    base: torch.Tensor  # flat CPU buffer (values; for the output NaN, and canaries around it)
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def view(self, base: torch.Tensor) -> torch.Tensor:
        return base.as_strided(self.size, self.stride, self.offset)


def layout(batch: int, rows: int, cols: int, transposed: bool, pad: int, offset: int, guard: int):
    """(size, stride, storage offset, buffer length) of a rows x cols matrix (or a batch of them)
    stored row-major with leading dimension cols + pad, or as the transposed view of a cols x rows
    row-major matrix with leading dimension rows + pad; ``guard`` floats before and after."""
    if transposed:
        inner, outer = rows + pad, cols
        stride = (1, inner)
    else:
        inner, outer = cols + pad, rows
        stride = (inner, 1)
    per = inner * outer
    size = (rows, cols)
    if batch:
        size, stride = (batch,) + size, (per,) + stride
    start = guard + offset
    last = start + sum((n - 1) * st for n, st in zip(size, stride))
    return size, stride, start, last + 1 + guard


def make_operand(batch, rows, cols, transposed, pad, offset, gen, values) -> Operand:
    """An input: its buffer ends right after its last element (and starts at most 3 floats
    before its first), so memcheck sees any read past either end of the operand; writes into it
    are caught by comparing the whole buffer before and after."""
    size, stride, start, length = layout(batch, rows, cols, transposed, pad, offset, guard=0)
    if values == "int":  # +-1..3: no zeros, so a 1 x 1 x 1 product is not zero either
        base = torch.randint(1, 4, (length,), generator=gen).float()
        base *= torch.randint(0, 2, (length,), generator=gen).float() * 2 - 1
    else:
        base = torch.randn(length, generator=gen)
    return Operand(base, size, stride, start)


def make_out(case: Case) -> Operand:
    """Every element NaN where C goes (all must be overwritten), CANARY everywhere else."""
    size, stride, start, length = layout(case.batch, case.M, case.N, case.c_t, case.pad, case.offsets[2], GUARD)
    base = torch.full((length,), CANARY)
    base.as_strided(size, stride, start).fill_(float("nan"))
    return Operand(base, size, stride, start)


def operands(case: Case, seed: int):
    gen = torch.Generator().manual_seed(seed)
    a = make_operand(case.batch, case.M, case.K, case.a_t, case.pad, case.offsets[0], gen, case.values)
    # a broadcast B has a batch dim of 1 (a plain matrix would be folded into one product with A's
    # rows, as torch.matmul does: then no batch stride of 0 would reach the kernels)
    b = make_operand(1 if case.b_broadcast else case.batch, case.K, case.N, case.b_t, case.pad, case.offsets[1],
                     gen, case.values)
    return a, b, (None if case.alloc else make_out(case))


# ---------------------------------------------------------------------------------------------
# plans (from the same functions matmul uses)

def plan_of(case: Case, dev_facts: DeviceFacts, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None):
    """The plan fastmm makes for this call on ``dev_facts`` (a CPU stand-in works: only shapes,
    strides and pointer alignment matter, and storage offsets set the alignment the same way)."""
    s = analyse(a, b)
    if c is None:
        c = torch.empty(s.batch + (s.M, s.N))
    problem, _ = build_problem(s, c, case.precision)
    return select(problem, dev_facts, case.family, variants=case.variants)


def empty_splits(K: int, bk: int, split: int) -> int:
    """Splits that get no k-tile (common.cuh split_range): they must still write zeros."""
    total = -(-K // bk)
    per = -(-total // split)
    return sum(1 for y in range(split) if min(total, y * per) >= min(total, y * per + per))


# ---------------------------------------------------------------------------------------------
# the case list

def edges(t: int) -> list[int]:
    return sorted({x for x in (1, t - 1, t, t + 1) if x >= 1})


def probe(dev: DeviceFacts, family, precision, M, N, K, batch=0):
    """(tile, STAGES, plan) the planner gives ``family`` for dense, aligned operands (tile choice
    and split-K depend on the sizes, the batch and the device; the layout only changes load modes)."""
    batch = max(batch, 1)
    p = Problem(M, N, K, (K, 1), (N, 1), (N, 1), batch, batch, (0, M * K), (0, K * N), (0, M * N),
                16, 16, 16, precision)
    plan = select(p, dev, family)
    return plan.kernel.tile, dict(plan.kernel.macros).get("STAGES", 1), plan


def batch_for_tile(dev, family, precision, M, N, K, tile) -> int | None:
    """A batch count for which the planner picks ``tile`` for M x N x K (the tile choice follows
    the number of blocks, which a batch multiplies)."""
    for batch in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128):
        if probe(dev, family, precision, M, N, K, batch if batch > 1 else 0)[0] == tile:
            return batch
    return None


def family_cases(dev: DeviceFacts, family: str, precision: str, quick: bool) -> list[Case]:
    out: list[Case] = []

    def add(group, M, N, K, **kw):
        out.append(Case(group, family, precision, M, N, K, **kw))

    if family == "skinny":
        # tile = (rows per thread MT, 128 columns, KCHUNK): MT is 8, 16 or 32 depending on M
        Ms = [1, 7, 8, 9, 16, 17, 32] if quick else [1, 2, 7, 8, 9, 15, 16, 17, 31, 32]
        cols, kchunk = probe(dev, family, precision, 8, 256, 256)[0][1:]
        Ns = edges(cols) + [cols * 2 + 4]
        Ks = edges(kchunk) if quick else edges(kchunk) + [2 * kchunk + 1]
        for i, M in enumerate(Ms):
            add("edge", M, Ns[i % len(Ns)], Ks[i % len(Ks)], batch=3)  # batch: no split-K
        for N in Ns:
            add("edge", 5, N, kchunk + 1, batch=3)
        for K in Ks:
            add("edge", 17, cols + 1, K, batch=3)
        add("layout", 9, 132, 300, a_t=True, batch=3)
        add("layout", 9, 132, 300, b_t=True, c_t=True, batch=3)
        add("offset", 16, 256, 257, offsets=(1, 2, 3), batch=3)
        add("offset", 16, 256, 257, offsets=(1, 0, 1), pad=3, batch=3)
        add("batch", 12, 130, 70, batch=3, b_broadcast=True)
        add("split", 16, 2 * cols, 4 * kchunk + 3)  # batch 1: split-K over k chunks
        add("split", 3, 3 * cols + 1, 2 * kchunk, b_t=True)
        if not quick:
            for a in (1, 4):
                for M in (a, 32 - 3 * a if a == 4 else 29):
                    for N in (a, 512 - 2 * a):
                        for K in (a, kchunk * 2 - a):
                            add("cutlass", M, N, K)
            add("randn", 32, 384, 1000, values="randn")
        return out

    if family in ("skinny_kmajor", "kmajor_mma"):  # B = W^T (K-contiguous) in every case
        cap = 32  # (rows: both take M <= 32)
        Ms = [1, 3, 17, 32] if quick else [1, 2, 3, 5, 8, 9, 16, 17, 31, 32]
        Ms = sorted({min(M, cap) for M in Ms})
        Ns = [1, 127, 128, 129, 257]
        Ks = [2, 3, 31, 129, 999] if quick else [2, 3, 31, 32, 129, 999, 4099]  # (K = 1 is skinny's)
        for i, M in enumerate(Ms):
            add("edge", M, Ns[i % len(Ns)], Ks[i % len(Ks)], b_t=True)
        for N in Ns:
            add("edge", 5, N, 257, b_t=True)
        for K in Ks:
            add("edge", min(17, cap), 129, K, b_t=True)
        add("layout", 9, 132, 300, a_t=True, b_t=True)
        add("layout", 9, 132, 300, b_t=True, c_t=True)
        add("offset", 16, 256, 257, b_t=True, offsets=(1, 2, 3))
        add("offset", 3, 256, 260, b_t=True, offsets=(1, 0, 1), pad=3)
        add("batch", 12, 130, 70, b_t=True, batch=3)
        add("batch", 1, 300, 64, b_t=True, batch=3, b_broadcast=True)  # batch stride 0 on W
        add("split", 1, 300, 20000, b_t=True)  # slices summed by the last block of each row tile
        add("split", min(17, cap), 129, 9999, b_t=True, offsets=(0, 1, 0))
        if not quick:
            add("randn", cap, 384, 5000, b_t=True, values="randn")
        return out

    if family == "wgmma_tf32":
        return out + wgmma_cases(dev, precision, quick)
    tile, stages, _ = probe(dev, family, precision, 32, 32, 32)
    bm, bn, bk = tile
    deep = bk * (stages + 1)  # K that wraps the software pipeline
    Ms, Ns = edges(bm), edges(bn)
    Ks = sorted(set(edges(bk) + [deep - 1, deep + 1]))
    if quick:  # each value of each dim once, not the product
        for i in range(max(len(Ms), len(Ns))):
            add("edge", Ms[i % len(Ms)], Ns[(i + 1) % len(Ns)], Ks[i % len(Ks)])
        for K in Ks:
            add("edge", bm + 1, bn - 1, K)
    else:
        for M in Ms:
            for N in Ns:
                add("edge", M, N, bk + 1)
        for K in Ks:
            add("edge", bm + 1, bn - 1, K)
    for a_t, b_t, c_t in ((True, False, False), (False, True, True), (True, True, False)):
        add("layout", bm + 1, bn + 1, deep - 1, a_t=a_t, b_t=b_t, c_t=c_t)
    add("offset", bm - 1, bn + 4, deep + 1, offsets=(1, 2, 3))  # 4- and 8-byte aligned pointers
    add("offset", bm + 4, bn + 4, deep, offsets=(0, 0, 2), pad=1)  # rows not 16-byte multiples
    add("batch", bm + 1, bn - 1, bk + 3, batch=3)
    add("batch", bm - 1, bn + 1, bk + 3, batch=3, b_broadcast=True, b_t=True)
    add("alloc", bm + 1, bn + 1, deep + 1, alloc=True)
    if family == "scalar":
        add("grid_z", 4, 5, 9, batch=70_000, b_broadcast=True)  # grid.z is capped: kernels loop over z
    if family in ("simt_cp_async", "tf32_mma"):
        # staging: an operand that 16-byte loads cannot read in place (N or K not a multiple of 4,
        # a 4-byte aligned pointer) is copied into a zero-padded buffer first, when the product is
        # big enough next to the copy (plan.STAGE_MIN_FLOP_PER_BYTE: M >= 1024 for B, N >= 1024 for A)
        add("staging", 1024, 5, 7)  # B staged
        add("staging", 1030, 130, 65, b_t=False, offsets=(0, 1, 2))
        if family == "simt_cp_async":
            # a K-contiguous B (x @ W.t()) of TRANSPOSE_B_MIN_M rows or more on the 128 x 256
            # tile: copied row-major (stage_kmajor transposes it through shared memory); float4
            # reads of W, and single floats (K odd; a 4-byte aligned W; padded rows)
            add("staging_wt", 769, 8191, 36, b_t=True)
            if not quick:
                add("staging_wt", 800, 6000, 67, b_t=True, offsets=(0, 1, 0))
                add("staging_wt", 777, 8192, 40, b_t=True, c_t=True, pad=3)
            # split-K of a few slices summed by the last block of each tile (SPLIT_FUSED): a
            # 1024-token product; odd extents (single-float workspace and C), C transposed, offsets
            fused = [(512, 512, 1024, {"b_t": True}), (999, 1001, 1100, {"a_t": True, "c_t": True, "offsets": (1, 2, 3)})]
            if not quick:
                fused.append((1024, 1024, 1024, {"b_t": True}))
            for M, N, K, kw in fused:
                p = Problem.dense(M, N, K, precision, a_t=kw.get("a_t", False), b_t=kw.get("b_t", False))
                if select(p, dev, family).kernel.split_fused:  # (the layout sets the load modes it needs)
                    add("split_fused", M, N, K, **kw)
            # the 32-row tiles (THREAD_M 4) of products of at most 32 rows: x @ W.t() (split along
            # K, summed by splitk_reduce), odd K and N, unaligned rows, a broadcast batch stride of 0
            add("short", 17, 1531, 1100, b_t=True)
            add("short", 32, 4096, 8192, b_t=True)
            add("short", 3, 700, 2053, offsets=(1, 2, 3))
            add("short", 1, 257, 333, batch=4, b_broadcast=True, b_t=True)
            add("short", 29, 999, 1030, c_t=True, pad=1)
        if family == "tf32_mma":
            add("staging", 5, 1024, 7)  # A staged
            add("staging", 1030, 1030, 7)  # both
            if not quick:
                add("staging", 40, 1030, 67, offsets=(3, 0, 0))
            # attention's P @ V and dV = P^T @ dO at 197 tokens (P's rows copied in single floats):
            # tf32's 128 x 64 tile of four 64 x 32 warps, M and K past a tile, N one short of it
            add("attention", 197, 64, 197, batch=64)
            add("attention", 197, 63, 197, batch=64, a_t=True)
    if not quick:
        for a in (1, 4):  # DESIGN.md: CUTLASS sizes for alignment a
            for M in (a, 512 - 3 * a):
                for N in (a, 512 - 2 * a):
                    for K in (a, deep - a):
                        add("cutlass", M, N, K)
        add("randn", 300, 257, 129, values="randn")
        add("randn", bm + 1, bn + 1, 1, values="randn")
        # every larger tile the planner can pick, reached with a batch
        seen = {tile}
        for batch in (2, 4, 8, 16, 32, 64, 128):
            t2, st2, _ = probe(dev, family, precision, bm + 1, bn + 1, bk + 1, batch)
            if t2 in seen:
                continue
            seen.add(t2)
            m2, n2, k2 = t2
            for M, N in ((m2 + 1, n2 - 1), (m2 - 1, n2 + 1), (m2, n2)):
                for K in (k2 + 1, k2 * (st2 + 1) - 1):
                    b = batch_for_tile(dev, family, precision, M, N, K, t2)
                    if b is not None:
                        add("tile", M, N, K, batch=b if b > 1 else 0)
        # a partial last wave: one block more than the SMs, on the largest tile
        big = max(seen, key=lambda t: t[0] * t[1])
        m2, n2, k2 = big
        rows, cols = _factor(dev.sm_count + 1)
        if probe(dev, family, precision, m2 * rows, n2 * cols, k2 + 1)[0] == big:
            add("wave", m2 * rows, n2 * cols, k2 + 1)
    return out


def _factor(n: int) -> tuple[int, int]:
    """n = r * c with r <= c as close as possible (n = 133 -> 7 x 19)."""
    r = int(math.isqrt(n))
    while n % r:
        r -= 1
    return r, n // r


def split_cases(dev: DeviceFacts, quick: bool) -> list[Case]:
    """The dispatcher's split-K plans, on the shapes the brief names and on small ones; plus, per
    splitting family and precision, the cheapest shape found where some splits get no k-tile."""
    out = []
    # (on the H200: 8x256x1024 the skinny kernel's own slice sums, 256x256x2048 SIMT cluster pairs)
    named = [(64, 64, 1024), (8, 256, 1024), (256, 256, 2048)] if quick else [
        (16, 4096, 512), (128, 1024, 8192), (256, 256, 16384), (64, 64, 1024), (8, 256, 1024), (33, 72, 4097),
        (256, 256, 2048)]
    for M, N, K in named:
        for precision in ("ieee", "tf32", "tf32x3"):
            out.append(Case("split", None, precision, M, N, K))
    # empty splits: scan K for a few small outputs
    found = {}
    for precision in ("ieee", "tf32", "tf32x3"):
        for M, N in ((64, 64), (8, 128 * 40), (8, 128 * 66)):
            for K in range(256, 40_000, 8):
                case = Case("split_empty", None, precision, M, N, K)
                _, _, plan = probe(dev, None, precision, M, N, K)
                cfg = plan.kernel
                if cfg.split_k > 1 and empty_splits(K, cfg.tile[2], cfg.split_k):
                    key = (cfg.family, precision)
                    if key not in found or case.work < found[key].work:
                        found[key] = case
                    break
    out += sorted(found.values(), key=lambda c: c.work)[: (2 if quick else len(found))]
    return out


def stream_k_cases(dev: DeviceFacts, quick: bool) -> list[Case]:
    """The dispatcher's stream-K plans (whole waves of 128x256 tiles, then the rest in pieces and
    the fixup pass): a wave plus one tile, odd extents with transposed views and offsets, and
    one and a half waves; only the shapes the planner does take stream-K for on ``dev``."""
    rows, cols = _factor(dev.sm_count + 1)
    half = (dev.sm_count * 3) // 2 + 1
    shapes = [(128 * rows, 256 * cols, 136, {}),
              (128 * rows - 3, 256 * cols - 5, 131, {"a_t": True, "c_t": True, "offsets": (1, 2, 3)}),
              (128 * half, 256, 2048, {"b_t": True})]
    out = []
    for M, N, K, kw in shapes[:2] if quick else shapes:
        case = Case("stream_k", None, "ieee", M, N, K, **kw)
        if probe(dev, None, "ieee", M, N, K)[2].kernel.stream_k is not None:
            out.append(case)
    return out


def dispatch_cases(quick: bool) -> list[Case]:
    """The dispatcher's own choice (what users get) on a few awkward shapes at every precision."""
    shapes = [(1, 1, 1), (3, 5, 4), (40, 24, 33), (67, 65, 63)] if quick else \
        [(1, 1, 1), (3, 5, 4), (17, 19, 23), (40, 24, 33), (67, 65, 63), (129, 96, 132), (257, 129, 193)]
    out = []
    for precision in ("ieee", "tf32", "tf32x3"):
        for M, N, K in shapes:
            out.append(Case("dispatch", None, precision, M, N, K))
        out.append(Case("dispatch", None, precision, 70, 33, 45, a_t=True, offsets=(1, 3, 2)))
    return out


def wgmma_cases(dev: DeviceFacts, precision: str, quick: bool) -> list[Case]:
    """The TMA family: tile edges (the copy engine zero-fills past M, N, K), the staging pass
    (transposed, unaligned, split into halves for tf32x3), batches in place (tf32) and copied."""
    out: list[Case] = []

    def add(group, M, N, K, **kw):
        out.append(Case(group, "wgmma_tf32", precision, M, N, K, **kw))

    bm, bn, bk = probe(dev, "wgmma_tf32", precision, 300, 300, 64)[0]
    stages = dict(probe(dev, "wgmma_tf32", precision, 300, 300, 64)[2].kernel.macros)["STAGES"]
    deep = bk * (stages + 1)  # K that wraps the ring of slots
    Ms, Ns, Ks = edges(bm), edges(bn), sorted(set(edges(bk) + [deep - 1, deep + 1]))
    for i in range(max(len(Ms), len(Ns), len(Ks))):
        add("edge", Ms[i % len(Ms)], Ns[(i + 1) % len(Ns)], Ks[i % len(Ks)], b_t=bool(i % 2))
    for a_t, b_t, c_t in ((True, False, False), (False, True, True), (True, True, False)):
        add("layout", bm + 1, bn + 1, deep - 1, a_t=a_t, b_t=b_t, c_t=c_t)
    add("offset", bm - 1, bn + 4, deep + 1, offsets=(1, 2, 3))  # staged: pointers not 16-byte aligned
    add("offset", bm + 4, bn + 4, deep, offsets=(0, 0, 2), pad=1, b_t=True)  # rows not 16-byte multiples
    add("staging", 1030, 1030, 7)
    # every tile width the wave rule picks, persistent blocks walking several tiles (planned on the
    # H200: tf32 1409x2817 -> 96 wide, 360 tiles; 4097x2817 -> 256, 396; 2049x2305 -> 64, 629;
    # 2049x1153 -> 192, 119 (a block a tile); tf32x3 2049x1153 -> 96, 221; 1025x2817 -> 128, 207)
    if precision == "tf32":
        add("width", 1409, 2817, 40, b_t=True)
        if not quick:
            add("width", 4097, 2817, 40, b_t=True)
            add("width", 2049, 2305, 40, b_t=True)
            add("width", 2049, 1153, 40, b_t=True)
    else:
        add("width", 2049, 1153, 40, b_t=True)
        if not quick:
            add("width", 1025, 2817, 40, b_t=True)
    # the consumers taking turns on whole tiles (tf32, K >= 512; planned on the H200: 1409x2817 ->
    # 96 wide, 360 tiles; 2300x2400 -> 128, 342 (float2 stores); 2049x2305 -> 64, 629; 4097x2817 ->
    # 192, 495): odd and even numbers of tiles a block, edges in M, N and K. Forced ("always"):
    # the planner takes turns on the H200's memory only (PINGPONG_MIN_DRAM_TBPS); C from registers,
    # and through the copy engine (a staging region each consumer warpgroup)
    if precision == "tf32":
        turns = (WgmmaTf32(pingpong="always"),)
        staged = (WgmmaTf32(pingpong="always", pingpong_tma_store=True),)
        add("pingpong", 1409, 2817, 520, b_t=True, variants=turns)
        add("pingpong", 2300, 2400, 600, b_t=True, variants=turns)
        add("pingpong", 1409, 2816, 520, b_t=True, variants=staged)
        add("pingpong", 1409, 2816, 520, b_t=True, variants=(WgmmaTf32(pingpong="always", pingpong_tma_store=True,
                                                                        force_bn=128),))
        add("pingpong", 2300, 2400, 600, b_t=True, batch=2, variants=staged)
        # 160 wide (the staged turns' width where its waves fill better: STAGED_TURNS_160), edges
        # in M, N (2816 = 17 tiles of 160 and 96 columns) and K (1036 = 32 k-tiles and 12)
        add("pingpong", 1409, 2816, 1036, b_t=True, variants=(WgmmaTf32(
            pingpong="always", pingpong_tma_store=True, extra_widths=(STAGED_TURNS_160,), force_bn=160),))
        if not quick:
            add("pingpong", 2049, 2305, 520, b_t=True, variants=turns)
            add("pingpong", 4097, 2817, 515, b_t=True, variants=turns)
            add("pingpong", 4097, 2820, 515, b_t=True, variants=staged)
    # K split over blocks, each tile's last block summing the slices (tf32, M <= 64, K >= 2048, few
    # tiles; M <= 64 on 64-row tiles (NOTES run 37): see the planner's own plans, python -m fastmm
    # explain; 2100x40x6000 (row-major B: C^T, 40 rows) on 128-row tiles)
    if precision == "tf32":
        add("split", 3, 2304, 4100, b_t=True)
        add("split", 17, 4096, 4101, b_t=True, c_t=True)
        # more than 64 rows, few 128-wide tiles (80x4096x4100 -> 32 x 4, a W^T beyond the mid-size
        # rule's L2 bound; 700x300x6000, row-major B: C^T, 18 x 5)
        add("split", 80, 4096, 4100, b_t=True)
        add("split", 700, 300, 6000, offsets=(1, 0, 0))
        if not quick:
            add("split", 2100, 40, 6000, offsets=(0, 0, 1))
            add("split", 1, 4096, 8192, b_t=True)
    # 64-row tiles (M <= 64; NOTES run 37): split, and persistent blocks walking several tiles; tf32x3
    # there splits B in the kernel (the next slot while a step's wgmmas run, across tiles too)
    add("rows64", 17, 4096, 4100, b_t=True)
    add("rows64", 64, 40000, 100, b_t=True)
    if precision == "tf32":
        # mid-size products on 64-row tiles (ROWS64_MID_WIDTHS; NOTES run 40): M and K past the tile's
        # edges, 64 and 128 wide, split from K = 3072, both operands staged (rows not 16-byte multiples);
        # and 128-row tiles at their row edges where they fill a wave (the mid-size rule leaves them)
        add("rows64", 300, 700, 1100, b_t=True)
        add("rows64", 999, 1001, 1004, b_t=True)
        add("rows64", 197, 768, 3100, b_t=True)
        add("rows64", 77, 1531, 2053, b_t=True)
        add("rows64", 129, 4289, 99, b_t=True)
        if not quick:
            add("rows64", 257, 4161, 257, b_t=True)
        # A fed from registers on 64-row tiles (rows64_a_mn: fragments loaded a k-step ahead; NOTES
        # runs 41-42): row-major B (C^T) at the mid-size rule's sizes (the planner's own plans,
        # unsplit), split (asked for), odd k-steps; an m-contiguous A (asked for: the rule leaves it
        # on 128 rows); persistent blocks walking many tiles (C^T of 40000 rows)
        always = (WgmmaTf32(rows64="always"),)
        add("rows64", 300, 700, 1100)
        add("rows64", 197, 768, 3100)
        add("rows64", 197, 768, 3100, variants=(WgmmaTf32(rows64="always", split=4),))
        add("rows64", 130, 452, 970)
        add("rows64", 1000, 700, 1100, a_t=True, b_t=True, variants=always)
        add("rows64", 40, 40000, 100, variants=always)
        # the planner's A_MN split below ROWS64_MID_SPLIT_MIN_K (ROWS64_A_MN_SPLIT_MIN_K; NOTES run
        # 45): C^T 256 x 384 in 4 uneven slices (rows of 2081 floats: copied K-major first), and
        # g.t() @ x (C^T 256 x 65)
        add("rows64", 384, 256, 2081)
        add("rows64", 65, 256, 2050, a_t=True)
        # over more than 2048 lines (the bound lifted in NOTES run 46): C^T 3000 x 50 in 2 slices
        add("rows64", 50, 3000, 4100)
    if precision == "tf32x3":
        add("rows64", 40, 4100, 4100, b_t=True)
        # A split in registers on 128-row tiles (x3_a_regs: X3_A_REGS; NOTES run 41): A in place at
        # the tile's edges, copied K-major in fp32 (m-contiguous; rows not 16-byte multiples), a
        # batch, persistent blocks walking several tiles
        regs = (WgmmaTf32(x3_a_regs=True),)
        add("x3regs", bm + 1, bn - 1, deep + 4, b_t=True, variants=regs)
        add("x3regs", bm - 1, bn + 1, deep + 4, a_t=True, b_t=True, variants=regs)
        add("x3regs", bm + 4, bn + 4, deep + 3, variants=regs)
        add("x3regs", bm + 1, bn + 1, bk + 4, batch=3, b_t=True, variants=regs)
        if not quick:
            add("x3regs", 2049, 1153, 40, b_t=True, variants=regs)
    # batches: in place where the layout allows (tf32), else copied per matrix (tf32x3 always)
    add("batch", bm - 1, bn + 1, bk + 3, batch=3, b_broadcast=True)  # K % 4 != 0: copies of both
    if precision == "tf32":
        add("batch", bm + 1, bn - 1, bk + 4, batch=3, b_t=True)  # (K % 4 == 0: 16-byte row pitches)
        add("batch", bm - 1, bn + 1, bk + 4, batch=3, b_broadcast=True, b_t=True)
        # in place without K-major copies: row-major B (C^T = B^T A^T), m-contiguous A (registers)
        add("batch", bm + 1, bn + 4, bk + 4, batch=3)
        add("batch", bm + 4, bn - 1, bk + 4, batch=3, a_t=True, b_t=True)
        add("batch", bm + 1, bn + 4, deep + 4, batch=3, b_broadcast=True, c_t=True)
    add("alloc", bm + 1, bn + 1, deep + 1, alloc=True)
    if not quick:
        add("randn", 300, 257, 129, values="randn")
        add("edge", 2 * bm + 1, 2 * bn - 1, 4 * deep + 5)
    return out


def build_cases(dev: DeviceFacts, quick: bool, families=None) -> list[Case]:
    cases = []
    for family, precision in FORCED:
        if families and family not in families:
            continue
        if FAMILIES[family].reject(_dummy_problem(precision, family), dev) is not None:
            continue  # e.g. cp.async / tensor cores on sm75
        cases += family_cases(dev, family, precision, quick)
    if not families:
        cases += split_cases(dev, quick) + stream_k_cases(dev, quick) + dispatch_cases(quick)
    return cases


def _dummy_problem(precision, family=None):
    # M <= 16: the skinny families take it too (the K-major ones with B K-contiguous)
    return Problem.dense(16, 64, 64, precision, b_t=family in ("skinny_kmajor", "kmajor_mma"))


# ---------------------------------------------------------------------------------------------
# running a case

@dataclass
class Result:
    case: Case
    family: str | None = None
    tile: tuple | None = None
    split: int = 1
    empty: int = 0
    macros: tuple = ()
    staged: tuple = ()  # operands copied into padded buffers first (plan.staging)
    error: str | None = None  # what went wrong; None: correct


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a.double(), b.double())


def check(case: Case, got: torch.Tensor, ref: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> str | None:
    if tuple(got.shape) != tuple(ref.shape):
        return f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if torch.isnan(got).any():
        return f"{int(torch.isnan(got).sum())} NaN outputs (elements never written?)"
    if case.values == "int":
        if not torch.equal(got.double(), ref):
            bad = (got.double() != ref).nonzero()
            return f"{bad.shape[0]} of {ref.numel()} elements differ from the exact product, first at {bad[0].tolist()}"
        if ref.numel() and ref.abs().sum() == 0:
            return "reference is all zeros: the check proves nothing"
        return None
    scale = torch.matmul(a.double().abs(), b.double().abs()).norm().item()
    err = (got.double() - ref).norm().item() / scale if scale else (got.double() - ref).norm().item()
    return None if err <= TOL[case.precision] else f"error {err:.2e} > {TOL[case.precision]:.0e}"


def torch_stand_in(a, b, out, precision, force, variants=()):
    """torch.matmul in fastmm's place: checks the driver itself on a CPU (--harness-check)."""
    return (torch.matmul(a, b, out=out) if out is not None else torch.matmul(a, b)), None, None


#: --epilogue's forms of D: all of (M, N) read per output; a bias over C's columns (1, N) and one
#: over its rows (M, 1), which wgmma adds to its accumulators as it stores them (EPILOGUE_VECTOR)
EPILOGUE_FORMS = ("d", "row", "column")


def epilogue_operand(case: Case, gen, form: str = "d") -> Operand:
    """D for --epilogue: (M, N) transposed like C, or the bias ``form`` (EPILOGUE_FORMS); small
    integers, no slack after it (a read past its end is memcheck's to find)."""
    rows, cols = {"d": (case.M, case.N), "row": (1, case.N), "column": (case.M, 1)}[form]
    return make_operand(0, rows, cols, case.c_t and form == "d", 0, 0, gen, case.values)


def run_epilogue_case(case: Case, device: torch.device, seed: int, form: str = "d") -> Result:
    """``2 * A @ B + D`` in one fused plan (``dispatch.matmul_fused``), checked exactly; D of
    ``form`` (EPILOGUE_FORMS)."""
    res = Result(case)
    gen = torch.Generator().manual_seed(seed)
    a_op = make_operand(0, case.M, case.K, case.a_t, case.pad, case.offsets[0], gen, case.values)
    b_op = make_operand(0, case.K, case.N, case.b_t, case.pad, case.offsets[1], gen, case.values)
    d_op = epilogue_operand(case, gen, form)
    a_cpu, b_cpu, d_cpu = a_op.view(a_op.base), b_op.view(b_op.base), d_op.view(d_op.base)
    ref = 2 * reference(a_cpu, b_cpu) + d_cpu.double()
    bases = [op.base.to(device, copy=True) for op in (a_op, b_op, d_op)]
    a, b, d = (op.view(base) for op, base in zip((a_op, b_op, d_op), bases))
    with torch.no_grad():
        result, plan, reason = dispatch.matmul_fused(a, b, d, 2.0, 1.0, case.precision, case.family,
                                                     variants=case.variants)
    torch.cuda.synchronize(device)
    if reason is not None:
        res.error = f"not fused: {reason}"
        return res
    cfg = plan.kernel
    res.family, res.tile, res.split, res.macros = cfg.family, cfg.tile, cfg.split_k, cfg.macros
    if not any(("EPILOGUE", 1) in k.macros for k in (cfg, plan.reduce) if k is not None):
        res.error = "no launch of the plan applies the epilogue"
        return res
    if not all(torch.equal(base.cpu(), op.base) for op, base in zip((a_op, b_op, d_op), bases)):
        res.error = "an input buffer changed"
        return res
    got = result.cpu()
    if case.values == "int":
        res.error = None if torch.equal(got.double(), ref) else (
            f"D {form}: {int((got.double() != ref).sum())} of {ref.numel()} elements differ from 2 * A @ B + D")
    else:
        scale = (2 * torch.matmul(a_cpu.double().abs(), b_cpu.double().abs()) + d_cpu.double().abs()).norm().item()
        err = (got.double() - ref).norm().item() / scale
        res.error = None if err <= TOL[case.precision] else f"D {form}: error {err:.2e} > {TOL[case.precision]:.0e}"
    return res


def run_case(case: Case, device: torch.device | None, dev_facts: DeviceFacts, seed: int, mm=None) -> Result:
    """Plan ``case``; unless ``device`` is None, run it (on fastmm, or on ``mm`` standing in for
    ``dispatch.matmul_fastmm``) and check the result, the guard zone and the inputs."""
    for attempt in range(20):  # integer sums can cancel to an all-zero product: draw again
        a_op, b_op, c_op = operands(case, seed + 100_003 * attempt)
        a_cpu, b_cpu = a_op.view(a_op.base), b_op.view(b_op.base)
        ref = reference(a_cpu, b_cpu) if device is not None else None
        if ref is None or ref.numel() == 0 or ref.abs().sum() > 0:
            break
    res = Result(case)
    plan = plan_of(case, dev_facts, a_cpu, b_cpu, c_op.view(c_op.base) if c_op else None)
    cfg = plan.kernel
    res.family, res.tile, res.split, res.macros = cfg.family, cfg.tile, cfg.split_k, cfg.macros
    res.staged = tuple(which for which, _, _ in plan.staging)
    res.empty = empty_splits(case.K, cfg.tile[2], cfg.split_k) if cfg.split_k > 1 else 0
    if device is None:  # --dry-run: plans only
        return res
    a_base, b_base = a_op.base.to(device, copy=True), b_op.base.to(device, copy=True)
    c_base = c_op.base.to(device, copy=True) if c_op else None
    a, b = a_op.view(a_base), b_op.view(b_base)
    out = c_op.view(c_base) if c_op else None
    with torch.no_grad():
        result, used, reason = (mm or dispatch.matmul_fastmm)(a, b, out, case.precision, case.family,
                                                             variants=case.variants)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if reason is not None:
        res.error = f"ran torch.matmul instead: {reason}"
        return res
    if mm is None and (used.kernel.family != cfg.family or used.kernel.macros != cfg.macros):
        res.error = f"ran {used.kernel.family} {dict(used.kernel.macros)}, planned {cfg.family} {dict(cfg.macros)}"
        return res
    # everything back to the CPU as whole buffers (plain copies, no torch kernel on the GPU)
    if c_op is None:
        got = result.cpu()
    else:
        c_after = c_base.cpu()
        got = c_op.view(c_after)
        outside = torch.ones_like(c_after, dtype=torch.bool)
        c_op.view(outside).fill_(False)
        if not torch.all(c_after[outside] == CANARY):
            n = int((c_after[outside] != CANARY).sum())
            res.error = f"{n} floats outside the output were written"
            return res
    if not (torch.equal(a_base.cpu(), a_op.base) and torch.equal(b_base.cpu(), b_op.base)):
        res.error = "an input buffer changed"
        return res
    res.error = check(case, got, ref, a_cpu, b_cpu)
    return res


# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small shape set (for racecheck and synccheck)")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: list the cases with the plans of a simulated device (--arch)")
    ap.add_argument("--arch", default="sm_90", help="simulated device for --dry-run (default sm_90)")
    ap.add_argument("--harness-check", action="store_true",
                    help="no GPU: run every case on the CPU with torch.matmul standing in for fastmm (checks "
                    "this script's own buffers, guards and references)")
    ap.add_argument("--family", action="append", help="only these forced families (repeatable)")
    ap.add_argument("--group", action="append", help="only cases of these groups, e.g. pingpong (repeatable)")
    ap.add_argument("--epilogue", action="store_true",
                    help="the cases without batch dims, each as 2 * A @ B + D with a fused epilogue")
    ap.add_argument("--max-work", type=float, default=None,
                    help="skip cases with more than this many multiply-adds (batch*M*N*K)")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per case")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    mm = None
    if args.dry_run or args.harness_check:
        facts = DeviceFacts.simulated_device(args.arch)
        device = torch.device("cpu") if args.harness_check else None
        mm = torch_stand_in if args.harness_check else None
    else:
        if not torch.cuda.is_available():
            print("sanitize: no CUDA device (use --dry-run to list the cases)", file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
        facts = dispatch.device_facts(device.index)
        why = dispatch.runtime_reason()
        if why is not None:
            print(f"sanitize: fastmm cannot run its kernels here: {why}", file=sys.stderr)
            return 2
    cases = build_cases(facts, args.quick, args.family)
    if args.group:
        cases = [c for c in cases if c.group in args.group]
    if args.max_work:
        cases = [c for c in cases if c.work <= args.max_work]
    if args.epilogue:
        if device is None or mm is not None:
            print("sanitize: --epilogue runs on a GPU only", file=sys.stderr)
            return 2
        cases = [c for c in cases if not c.batch]
    results, wrong = [], []
    for i, case in enumerate(cases):
        try:
            # (--epilogue: D's forms in turn, one a case)
            r = (run_epilogue_case(case, device, i, EPILOGUE_FORMS[i % len(EPILOGUE_FORMS)]) if args.epilogue
                 else run_case(case, device, facts, seed=i, mm=mm))
        except Exception as exc:  # a crash is a finding too; keep going
            r = Result(case, error=f"{type(exc).__name__}: {exc}")
        results.append(r)
        if r.error:
            wrong.append(r)
            print(f"WRONG {case.label()}: {r.error}", flush=True)
        elif args.verbose:
            print(f"ok    {case.label()} -> {r.family} tile {r.tile} split {r.split}"
                  + (f" ({r.empty} empty)" if r.empty else "") + (f" staged {'+'.join(r.staged)}" if r.staged else ""),
                  flush=True)
        if not args.verbose and device is not None and (i + 1) % 50 == 0:
            print(f"... {i + 1}/{len(cases)} cases, {len(wrong)} wrong, {time.perf_counter() - t0:.1f} s", flush=True)
    elapsed = time.perf_counter() - t0

    ran = [r for r in results if r.family is not None]
    by_family = Counter(r.family for r in ran)
    configs = {(r.family, r.macros) for r in ran}
    splits = [r for r in ran if r.split > 1]
    tiles = sorted({(r.family, r.tile[:2]) for r in ran})
    mode = (f"on {facts.name} ({facts.arch})" if mm is None and device is not None else
            ("harness check (torch.matmul on the CPU), plans for a simulated " if mm else "dry run on a simulated ")
            + facts.arch)
    if args.verbose or device is None:
        print("tiles covered: " + ", ".join(f"{f} {t[0]}x{t[1]}" for f, t in tiles))
    print(f"sanitize: {len(results)} cases{' (quick)' if args.quick else ''} {mode}: "
          f"{len(results) - len(wrong)} correct, {len(wrong)} WRONG; "
          + ", ".join(f"{f} {n}" for f, n in sorted(by_family.items()))
          + f"; {len(configs)} kernel configs; split-K {len(splits)} "
          f"({sum(1 for r in splits if r.empty)} with empty splits, up to {max((r.split for r in splits), default=1)}); "
          f"staged operands in {sum(1 for r in ran if r.staged)}; {elapsed:.1f} s", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
