"""The dispatcher (fastmm.plan, fastmm.families, fastmm.problem) on simulated devices: which kernel
each problem gets, with which load modes and launch geometry, and why the others were rejected.
(The split-K and stream-K wave models on their own: tests/test_work_split.py; skinny v2's geometry:
tests/test_skinny_v2.py.)

Geometry checks use the definitions in cuda_src/ (tile sizes, shared-memory layouts), so a
mismatch between the Python side and the kernels shows up here, on a CPU.
"""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastmm.families.simt_core as simt_core
from fastmm.families import (FAMILIES, LOAD_ELEM_FAST, LOAD_ELEM_K, LOAD_NAMES, LOAD_VEC_FAST, LOAD_VEC_K,
                             MAX_GRID_Z, MAX_SPLIT, SimtCpAsync, Skinny, WgmmaTf32, second_pass_config, split_cap,
                             split_k_for, stream_k_head_config)
from fastmm.families.simt_core import FUSED_SPLIT_MAX, STAGE_MIN_FLOP_PER_BYTE
from fastmm.families.simt_cp_async import short_rows_first
from fastmm.families.wgmma_tf32 import (PINGPONG_MIN_DRAM_TBPS, ROWS64_A_MN_SPLIT_MAX_K, ROWS64_A_MN_SPLIT_MIN_K,
                                        ROWS64_A_MN_SPLIT_OLD_MAX_LINES, STAGED_TURNS_160_GAIN,
                                        ROWS64_MID_SPLIT_MIN_K, X3_A_REGS_MAX_N, X3_A_REGS_MIN_K, X3_A_REGS_MIN_N,
                                        X3_A_REGS_MIN_ROWS_PER_COLUMN, X3_A_REGS_MIN_TILES, X3_SHORT_K, tiles_of,
                                        wave_cost)
from fastmm.families.work_split import MIN_KTILES_PER_SPLIT, split_time
from fastmm.plan import INT32_MAX, MIN_CC, TINY_K, TINY_OUTPUTS, Plan, select
from fastmm.problem import EPILOGUE_BIAS_N, EPILOGUE_D, DeviceFacts, Problem
from fastmm.tuned import TunedChoice
from test_skinny_v2 import check_v2 as check_skinny_v2
from test_skinny_v2 import stage_floats as v2_stage_floats

ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
SM80_PLUS = ARCHS[1:]
DEV = {arch: DeviceFacts.simulated_device(arch) for arch in ARCHS}
VEC_MODES = (LOAD_VEC_FAST, LOAD_VEC_K)
ELEM_MODES = (LOAD_ELEM_K, LOAD_ELEM_FAST)
SIMT = ("simt_float4", "simt_cp_async")
BIG = (2048, 2048, 2048)
SKINNY_MAX_M = 32  # skinny.cu: MT is at most 32 rows


def macros(plan) -> dict:
    return dict(plan.kernel.macros)


def rejected(plan) -> dict:
    return dict(plan.rejected)


#: simt_cp_async planned by its rules alone, without the mid-size split model that decides on sm_90
#: since NOTES run 54 (SimtCore.modelled_choice): the tests of the rules themselves, each a product
#: measured on the H200 when the rule was written.
RULES = (SimtCpAsync(split_model=False),)


def forced(p: Problem, arch: str, family: str, variants=()):
    plan = select(p, DEV[arch], force=family, variants=variants)
    assert plan.kernel is not None and plan.kernel.family == family
    return plan


def with_precision(p: Problem, precision: str) -> Problem:
    return dataclasses.replace(p, precision=precision)


def is_tiny(p: Problem) -> bool:
    """plan._shape_reason's rule: few outputs and a short K (a long K is a long serial sum)."""
    return p.M * p.N <= TINY_OUTPUTS and p.K <= TINY_K


def skinny_family(p: Problem, dev: DeviceFacts) -> str:
    """The skinny family that takes a non-tiny problem of M <= 32: for B read along K on sm80+,
    kmajor_mma for tf32 requests of 8 to 32 rows (tensor cores; K = 1 excepted, where B is
    N-contiguous too), else skinny_kmajor (unless a batch needs a split of K, which it does not
    make); every other layout, skinny."""
    kmajor = FAMILIES["skinny_kmajor"]
    if dev.cc >= kmajor.min_cc and p.b_strides[0] == 1 and not (p.b_strides[1] == 1 and p.N > 1):
        if p.precision == "tf32" and 8 <= p.M <= 32:
            return "kmajor_mma"
        if short_rows_first(p, FAMILIES["simt_cp_async"]):  # fp32 at 17-32 rows, long K: the 32-row SIMT tile
            return "simt_cp_async"
        if p.batch_total == 1 or p.K <= kmajor.slice_cap(p, dev):
            return "skinny_kmajor"
    return "skinny"


def x3_goes_to_fp32(p: Problem, dev: DeviceFacts) -> bool:
    """Tf32Mma.x3_to_fp32_cc: on the H200's arch a tf32x3 request that wgmma declines runs fp32
    SIMT, not mma.sync."""
    return p.precision == "tf32x3" and dev.cc == (9, 0)


def not_chosen_reason(name: str, p: Problem, dev: DeviceFacts, chosen: str, forced_: bool = False) -> str:
    """What a plan says of family ``name`` that could run ``p`` but was not chosen: its own
    heuristic reason where it has one for ``p``, else that ``chosen`` is preferred."""
    fam = FAMILIES[name]
    own = fam.heuristic_reason(p, dev) if p.precision in fam.precisions and fam.reject(p, dev) is None else None
    return own if own is not None else f"{chosen} is preferred" + (" (forced)" if forced_ else "")


# --- geometry as cuda_src/ defines it ------------------------------------------------------------

def tile_from_macros(family: str, m: dict) -> tuple[int, int]:
    """(BM, BN) from the macros, by the kernels' own definitions."""
    if family == "scalar":
        return 16, 16  # scalar.cu: TILE 16
    if family == "skinny":
        return m["MT"], m.get("SK_BN", 128)  # skinny.cu: MT rows, COLS 128 (v1) or SK_BN (v2)
    if family == "skinny_kmajor":  # skinny_kmajor.cu: KR_BN = KR_G x (KR_WARPS / KR_KW) x 4 rows x KR_R
        return m["MT"], m["KR_G"] * m["KR_WARPS"] // m.get("KR_KW", 1) * 4 * m["KR_R"]
    if family == "kmajor_mma":  # kmajor_mma.cu: 8 rows of A per B-role fragment, KM_BN = 16 x KM_NF
        return 8 * m["KM_MF"], 16 * m["KM_NF"]
    if family == "tf32_mma":
        return m["WARPS_M"] * 64, m["WARPS_N"] * m["WARP_N"]  # tf32_mma.cu: WARP_M 64
    if family == "wgmma_tf32":
        return m.get("BM", 128), m["BN"]  # wgmma_tf32.cu: BM 128 (two consumer warpgroups of 64 rows) or 64 (one)
    lanes_m = 8 if m["THREAD_M"] == 8 else 4  # simt_core.cuh: LANES_M, LANES_N = 32 / LANES_M
    return m["WARPS_M"] * lanes_m * m["THREAD_M"], m["WARPS_N"] * (32 // lanes_m) * 8


def dynamic_smem_from_macros(family: str, m: dict) -> int:
    """Bytes of dynamic shared memory each kernel indexes (STAGES x (A tile + B tile))."""
    bm, bn = tile_from_macros(family, m)
    if family == "simt_cp_async":  # simt_core.cuh: A_TILE_FLOATS = BK * (BM + 4), B likewise
        pair = m.get("SPLIT_PAIR", 0) * m["WARPS_M"] * m["WARPS_N"] * 32 * m["THREAD_M"] * 8 // 2  # partner's half
        # (C staged on a tile whose buffers are smaller: C_STAGE_FLOATS, simt_cp_async.cu)
        return (max(m["STAGES"] * m["BK"] * ((bm + 4) + (bn + 4)), m.get("C_STAGE_FLOATS", 0)) + pair) * 4
    if family == "tf32_mma":  # tf32_mma.cu: [m][k] rows BM x (32 + 4), [k][m] rows 32 x (BM + 8), ...
        a = bm * (32 + 4) if m["A_SMEM_MK"] else 32 * (bm + 8)
        b = 32 * (bn + 8) if m["B_SMEM_KN"] else bn * (32 + 4)
        return m["STAGES"] * (a + b) * 4
    if family == "skinny" and m.get("SK_V2"):  # skinny.cu v2: the ring, or the reduction slots
        return 4 * max(m["SK_STAGES"] * v2_stage_floats(m), m["SK_RED"] * m["MT"] * m["SK_BN"])
    if family == "skinny_kmajor":  # skinny_kmajor.cu: As[MT][KR_KS], then (KR_KW > 1) the warps' sums
        kw = m.get("KR_KW", 1)  # red[KR_KW][MT][rows of a group: KR_WARPS / KR_KW warps x 4 x KR_R]
        red = kw * m["MT"] * (m["KR_WARPS"] // kw) * 4 * m["KR_R"] if kw > 1 else 0
        return (m["MT"] * m["KR_KS"] + red) * 4
    if family == "wgmma_tf32":  # wgmma_tf32.cu: STAGES x (A + B tiles of 32 floats a row, twice for
        parts = 2 if m["PRECISION_X3"] else 1  # tf32x3's halves, A in fp32 under X3_A_REGS), the mbarriers,
        a_parts = 1 if m.get("X3_A_REGS") else parts  # 1 KiB to align the ring, and C_STAGE_BYTES
        staged = m.get("TMA_STORE", 0) or m.get("C_COPY_OUT", 0)  # (C_STAGED: C's boxes in shared memory)
        c_stage = staged * m.get("C_BOXES", 4) * bm * 32 * 4
        return m["STAGES"] * ((a_parts * bm + parts * bn) * 32 * 4 + 16) + 1024 + c_stage
    return 0  # scalar, simt_float4, skinny and kmajor_mma use static shared memory only


def skinny_kchunk(m: dict) -> int:
    """skinny.cu: KCHUNK (MT == 32 ? 128 : 256), the k-granule of its split-K."""
    return 128 if m["MT"] == 32 else 256


def skinny_static_smem(m: dict) -> int:
    """skinny.cu: As[KCHUNK * (MT + 1)] + red[MT * COLS] floats."""
    return (skinny_kchunk(m) * (m["MT"] + 1) + m["MT"] * 128) * 4


def check_geometry(plan) -> None:
    p, dev, cfg = plan.problem, plan.device, plan.kernel
    if plan.swap_ab:  # the kernel computes C^T = B^T A^T: its tiles and grid are the launch problem's
        p = plan.launch_problem
    m = dict(cfg.macros)
    assert cfg.smem <= dev.smem_per_block_optin, f"{cfg.family} asks {cfg.smem} B > {dev.smem_per_block_optin}"
    assert cfg.smem == dynamic_smem_from_macros(cfg.family, m)
    if cfg.family == "scalar":
        assert cfg.block_dims == (16, 16, 1) and cfg.block == 256
    elif cfg.family == "skinny" and m.get("SK_V2"):
        check_skinny_v2(cfg, p, dev)
    elif cfg.family == "skinny":
        assert cfg.block_dims == (256, 1, 1) and cfg.block == 256  # skinny.cu: THREADS 256
        assert m["MT"] in (8, 16, 32) and p.M <= m["MT"] and m["B_VEC"] in (0, 1)
        assert cfg.tile[2] == skinny_kchunk(m)
        assert skinny_static_smem(m) <= 48 * 1024  # static shared memory cannot opt in to more
    elif cfg.family == "skinny_kmajor":
        assert cfg.block_dims == (m["KR_WARPS"] * 32, 1, 1) and cfg.block == m["KR_WARPS"] * 32
        assert p.M <= m["MT"] <= 32 and m["MT"] & (m["MT"] - 1) == 0 and (m["MT"] < 2 * p.M or m["MT"] == 1)
        assert cfg.tile[2] == m["KR_KS"] and m["KR_KS"] % (32 * m["KR_U"]) == 0
        assert p.b_strides[0] == 1 and dev.cc >= (8, 0)
        assert m["KR_FUSED"] == int(cfg.grid[1] > 1) == int(cfg.split_fused)
        assert cfg.grid[1] == -(-max(p.K, 1) // m["KR_KS"])  # one slice of KR_KS per block row, none idle
    elif cfg.family == "kmajor_mma":
        assert cfg.block_dims == (m["KM_WARPS"] * 32, 1, 1) and cfg.block == m["KM_WARPS"] * 32
        assert p.M <= 8 * m["KM_MF"] <= 32 and m["KM_MF"] == (1 if p.M <= 8 else 2 if p.M <= 16 else 4)
        assert cfg.tile[2] == m["KM_KS"] and m["KM_KS"] % 32 == 0
        assert p.b_strides[0] == 1 and dev.cc >= (8, 0) and p.precision in ("tf32", "tf32x3")
        assert m["X3"] == int(p.precision == "tf32x3")
        assert m["KM_FUSED"] == int(cfg.grid[1] > 1) == int(cfg.split_fused)
        assert cfg.grid[1] == -(-max(p.K, 1) // m["KM_KS"])  # one slice of KM_KS per block row, none idle
        # kmajor_mma.cu: red[KM_WARPS][4 KM_MF KM_NF][32] floats of static shared memory
        assert m["KM_WARPS"] * 4 * m["KM_MF"] * m["KM_NF"] * 32 * 4 <= 48 * 1024
    elif cfg.family == "wgmma_tf32":  # wgmma_tf32.cu: THREADS 128 + 128 a consumer warpgroup (BM / 64)
        threads = 128 * (1 + m.get("BM", 128) // 64)
        assert cfg.block_dims == (threads, 1, 1) and cfg.block == threads
        assert cfg.arch_suffix == "a" and plan.device.cc == (9, 0)
        if m.get("BM", 128) == 64:  # (the kernel's #error lines; tf32x3 splits B itself there)
            assert not m.get("PINGPONG") and m.get("X3_SPLIT_B", 0) == m["PRECISION_X3"], m
        else:
            assert "X3_SPLIT_B" not in m, m
        assert cfg.tile[2] == 32
    else:
        threads = m["WARPS_M"] * m["WARPS_N"] * 32
        assert cfg.block_dims == (threads, 1, 1) and cfg.block == threads
    assert cfg.block_dims[0] * cfg.block_dims[1] * cfg.block_dims[2] <= 1024
    bm, bn = tile_from_macros(cfg.family, m)
    assert cfg.tile[:2] == (bm, bn)
    if cfg.family == "simt_cp_async":
        assert m["STAGES"] >= 2
    tiles = -(-p.M // bm) * -(-p.N // bn)
    gx, gy, gz = cfg.grid
    if cfg.stream_k is not None:
        check_stream_k(plan, tiles)
        return
    if cfg.family == "wgmma_tf32" and cfg.split_fused:
        # SPLIT: one block a (tile, slice), a batch of 1, every slice a run of k-tiles (split_range)
        k_tiles = -(-p.K // 32)
        per = -(-k_tiles // gy)
        assert m["SPLIT"] == 1 and p.batch_total == 1 and gx == tiles and gz == 1 and cfg.work_items == tiles * gy
        assert 2 <= gy <= 16 and (gy - 1) * per < k_tiles and per * 32 >= 512 and "TMA_STORE" not in m
        assert "PINGPONG" not in m and plan.reduce is None
        return
    if cfg.family == "wgmma_tf32":
        # one block per (tile, batch entry), or persistent: one an SM walking them all (wgmma_tf32.cu)
        work = tiles * p.batch_total
        assert cfg.work_items == work and (gy, gz) == (1, 1) and "SPLIT" not in m
        assert gx in (min(work, dev.sm_count), min(work, INT32_MAX))  # (the variant persistent=False: the latter)
        return
    assert cfg.work_items == 0
    assert 1 <= gx <= INT32_MAX and (gx == tiles or (cfg.family == "scalar" and gx == min(tiles, INT32_MAX)))
    assert 1 <= gz <= MAX_GRID_Z and gz == min(p.batch_total, MAX_GRID_Z)
    # grid.y = number of K splits (common.cuh split_range); > 1 needs the reduce pass
    assert gy >= 1
    if gy == 1:
        assert plan.reduce is None
    else:
        assert cfg.family in ("simt_cp_async", "tf32_mma", "skinny", "skinny_kmajor", "kmajor_mma") and p.batch_total == 1
        assert gy <= -(-p.K // cfg.tile[2]), "a split with no k-tile to compute"
        assert gy <= 65535  # gridDim.y's limit
        if cfg.family == "skinny_kmajor":  # at most a wave's worth, unless A's slices in shared memory need more
            assert gy <= max(MAX_SPLIT, 2 * dev.sm_count, -(-p.K // FAMILIES["skinny_kmajor"].slice_cap(p, dev)))
        else:
            assert gy <= max(MAX_SPLIT, 2 * dev.sm_count)  # families.split_cap: at most one wave's worth
        if cfg.family not in ("skinny", "skinny_kmajor", "kmajor_mma"):  # the tiled families keep >= MIN_KTILES_PER_SPLIT k-tiles per split
            assert gy <= -(-p.K // cfg.tile[2]) // MIN_KTILES_PER_SPLIT
        r = plan.reduce
        if cfg.split_fused:  # the last block per tile sums the slices: no second pass
            if cfg.family == "simt_cp_async":  # (the macro names the slice count its sum unrolls)
                assert m["SPLIT_FUSED"] == gy <= FUSED_SPLIT_MAX and not cfg.split_pair and "SPLIT_PAIR" not in m
            else:
                assert dict(cfg.macros).get("SK_FUSED", cfg.family in ("skinny_kmajor", "kmajor_mma")) == 1
            assert r is None and cfg.arrival_counters == gx
            return
        assert "SPLIT_FUSED" not in m
        assert "SK_FUSED" not in m
        assert cfg.split_pair == (m.get("SPLIT_PAIR", 0) == 1)
        if cfg.split_pair:  # cluster pairs add their partial tiles: half the slices to reduce
            assert cfg.family == "simt_cp_async" and m["WARPS_M"] * m["WARPS_N"] == 8 and dev.cc >= (9, 0)
            assert (m["A_MODE"], m["B_MODE"]) != (LOAD_VEC_FAST, LOAD_ELEM_K)  # (spills)
            assert gy % 2 == 0 and cfg.split_slices == gy // 2
        assert r is not None and r.family == "splitk_reduce" and r.source == "splitk_reduce.cu"
        assert f"sums the {cfg.split_slices} partial slices" in dict(r.details)["order"]
        assert r.block_dims == (256, 1, 1) and r.grid[1:] == (1, 1) and r.grid[0] >= 1 and r.smem == 0


def stream_k_pieces(sk) -> dict:
    """The pieces a stream-K launch computes, dealt as fastmm_simt_cp_async_stream_k deals them:
    {(tile, block, j): (first k-tile, end k-tile)}; ``tile`` counts from 0, ``j`` is the piece's
    workspace slot within its block."""
    k, pieces = sk.k_tiles, {}
    for b in range(sk.blocks):
        g = sk.whole_tiles * k + b * sk.iters
        g_end = min(g + sk.iters, sk.tiles * k)
        j = 0
        while g < g_end:
            t = g // k
            pieces[(t, b, j)] = (g - t * k, min(k, g_end - t * k))
            g, j = (t + 1) * k, j + 1
    return pieces


def fixup_slots(sk, t: int) -> list[tuple[int, int]]:
    """The (block, slot) pairs stream_k_fixup.cu sums, in order, for pieced tile ``t`` (counted
    from whole_tiles)."""
    k, it = sk.k_tiles, sk.iters
    return [(c, t - c * it // k) for c in range(t * k // it, (t * k + k - 1) // it + 1)]


def check_stream_k(plan, tiles: int) -> None:
    """A stream-K plan: whole waves of tiles, then one wave of blocks whose stretches cover every
    k-tile of the other tiles exactly once, each piece in a slot of its own block, and a fixup
    pass that sums exactly those slots, in block order."""
    p, dev, cfg = plan.problem, plan.device, plan.kernel
    sk = cfg.stream_k
    m = dict(cfg.macros)
    assert cfg.family == "simt_cp_async" and cfg.entry == "fastmm_simt_cp_async_stream_k" and m["STREAM_K"] == 1
    assert (m["WARPS_M"], m["WARPS_N"], m["THREAD_M"]) == (2, 4, 16) and p.batch_total == 1
    assert (m["A_MODE"], m["B_MODE"]) != (LOAD_VEC_FAST, LOAD_ELEM_K)
    assert sk.whole_tiles * sk.k_tiles + sk.blocks * sk.iters < 2**31  # the kernel counts in 32 bits
    slots = dev.sm_count  # one 8-warp block per SM
    if sk.head_rows:
        # the head form: the same build's plain kernel over C's first rows, whole rows of tiles (the
        # whole waves rounded down), then the stream-K launch over the rows after them, no whole tiles
        bm, bn = cfg.tile[:2]
        tiles_n = -(-p.N // bn)
        assert sk.whole_tiles == 0 and sk.head_rows % bm == 0 and sk.head_tiles == sk.head_rows // bm * tiles_n
        assert sk.head_tiles + sk.tiles == tiles and 0 < sk.tiles < slots
        assert tiles // slots * slots - tiles_n < sk.head_tiles <= tiles // slots * slots
        head = plan.head
        assert head is not None and head.entry == "fastmm_simt_cp_async" and head.stream_k is None
        assert head.grid == (sk.head_tiles, 1, 1) and dict(head.macros) == {k: v for k, v in m.items() if k != "STREAM_K"}
        assert (head.smem, head.block_dims, head.tile) == (cfg.smem, cfg.block_dims, cfg.tile)
        assert plan.kernels()[:2] == (cfg, head)
        tiles = sk.tiles  # (the stream-K launch's problem: the rows after the head)
    else:
        assert plan.head is None
    assert sk.tiles == tiles and sk.k_tiles == -(-p.K // cfg.tile[2])
    assert sk.whole_tiles % slots == 0 and 0 < sk.pieced_tiles and 0 < sk.blocks <= slots
    assert cfg.grid == (sk.whole_tiles + sk.blocks, 1, 1)
    pieces = stream_k_pieces(sk)
    assert {b for _, b, _ in pieces} == set(range(sk.blocks))  # every block has work
    assert all(j < sk.segments for _, _, j in pieces)  # each block's slots suffice
    for t in range(sk.pieced_tiles):
        mine = sorted((b, j, kb, ke) for (tt, b, j), (kb, ke) in pieces.items() if tt == sk.whole_tiles + t)
        ranges = [(kb, ke) for _, _, kb, ke in mine]
        assert ranges[0][0] == 0 and ranges[-1][1] == sk.k_tiles, ranges
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:] + [(sk.k_tiles, None)])), ranges
        assert fixup_slots(sk, t) == [(b, j) for b, j, _, _ in mine]
    assert sk.workspace_floats(*cfg.tile[:2]) == sk.blocks * sk.segments * cfg.tile[0] * cfg.tile[1]
    r = plan.reduce
    assert r is not None and r.family == "stream_k_fixup" and r.source == "stream_k_fixup.cu"
    # stream_k_fixup.cu: 256 threads of 4 elements (bn % 4 == 0) per block, a block row per tile
    assert cfg.tile[1] % 4 == 0
    assert r.grid == (-(-cfg.tile[0] * cfg.tile[1] // 1024), sk.pieced_tiles, 1) and sk.pieced_tiles <= 65535
    assert r.block_dims == (256, 1, 1) and r.smem == 0


# --- a zoo of problems every invariant is checked on ---------------------------------------------

def _zoo() -> list[Problem]:
    out = []
    for M, N, K in [(1, 1, 1), (3, 5, 4), (17, 19, 23), (32, 32, 64), (33, 32, 64), (129, 96, 132),
                    (257, 129, 193), (1000, 1000, 1000), (4097, 4095, 4093), (8192, 4096, 6144), (16, 4096, 4096),
                    (256, 256, 65536)]:
        for a_t, b_t in [(False, False), (True, False), (False, True), (True, True)]:
            for align in (16, 8, 4):
                out.append(Problem.dense(M, N, K, a_t=a_t, b_t=b_t, align=align))
    out.append(Problem.dense(64, 64, 64, batch=100_000))
    out.append(Problem.dense(300, 200, 100, batch=7))
    # no unit stride anywhere (every other element of a wider tensor)
    out.append(Problem(300, 200, 100, (2 * 100, 2), (2 * 200, 2), (200, 1)))
    # row-strided slices x[:, :K] of wider tensors, widths multiple of 4 and not
    out.append(Problem(512, 512, 500, (512, 1), (516, 1), (512, 1)))
    out.append(Problem(512, 512, 500, (503, 1), (517, 1), (513, 1)))
    return out


ZOO = _zoo()
PRECISIONS = ("ieee", "tf32", "tf32x3")


def _zoo_id(p: Problem) -> str:
    return f"{p.M}x{p.N}x{p.K}-a{p.a_strides}-b{p.b_strides}-al{p.a_align}-z{p.batch_total}".replace(" ", "")


# --- which family is chosen ---------------------------------------------------------------------

@pytest.mark.parametrize("precision", PRECISIONS)
def test_sm75_never_gets_cp_async_or_tensor_cores(precision):
    for p in ZOO:
        plan = select(with_precision(p, precision), DEV["sm_75"])
        assert plan.kernel is not None
        assert plan.kernel.family in ("simt_float4", "scalar", "skinny"), _zoo_id(p)
        # skinny (sm75+) takes every non-tiny problem of at most 32 rows, and only those; B read
        # along K too, as skinny_kmajor needs sm80
        assert (plan.kernel.family == "skinny") == (p.M <= SKINNY_MAX_M and not is_tiny(p)), _zoo_id(p)
        assert plan.precision_used == "ieee"
        assert "sm80" in rejected(plan)["simt_cp_async"]
        assert rejected(plan)["skinny_kmajor"] == "needs sm80+, device is sm_75"
        if precision != "ieee":
            assert "sm80" in rejected(plan)["tf32_mma"]


def test_sm75_large_ieee_problem_gets_simt_float4():
    plan = select(Problem.dense(*BIG), DEV["sm_75"])
    assert plan.kernel.family == "simt_float4"
    assert plan.precision_used == "ieee"


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
def test_sm75_tf32_request_runs_fp32_simt_and_reports_ieee(precision):
    plan = select(Problem.dense(*BIG, precision=precision), DEV["sm_75"])
    assert plan.kernel.family == "simt_float4"
    assert plan.precision_used == "ieee"
    assert rejected(plan)["tf32_mma"] == "needs sm80+, device is sm_75"


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("family", ["tf32_mma", "simt_cp_async"])
def test_forcing_an_sm80_family_on_sm75_raises(family, precision):
    with pytest.raises(ValueError, match="needs sm80"):
        select(Problem.dense(*BIG, precision=precision), DEV["sm_75"], force=family)


@pytest.mark.parametrize("arch", SM80_PLUS)
def test_sm80_plus_ieee_gets_cp_async_simt(arch):
    plan = select(Problem.dense(*BIG), DEV[arch])
    assert plan.kernel.family == "simt_cp_async"
    assert plan.precision_used == "ieee"
    assert rejected(plan)["tf32_mma"] == "does not compute precision 'ieee'"


@pytest.mark.parametrize("arch", ARCHS)
def test_ieee_never_gets_tensor_cores(arch):
    for p in ZOO:
        plan = select(p, DEV[arch])
        assert plan.kernel.family != "tf32_mma", _zoo_id(p)
        assert plan.precision_used == "ieee"
    with pytest.raises(ValueError, match="needs sm80" if arch == "sm_75" else "precision 'ieee'"):
        select(Problem.dense(*BIG), DEV[arch], force="tf32_mma")


@pytest.mark.parametrize("arch", SM80_PLUS)
def test_tf32x3_that_wgmma_declines_runs_fp32_simt_on_sm90_and_mma_sync_before(arch):
    """Where no wgmma plan takes a tf32x3 request (few tiles, long K, small or odd products), the
    H200 ran it faster on the fp32 SIMT path than on mma.sync (Tf32Mma.x3_to_fp32_cc): there the
    plan computes ieee and says why; on sm_80-89, where TF32 peaks at 8x FP32, mma.sync keeps it.
    A request forced onto tf32_mma still gets it."""
    for M, N, K, kw in ((256, 256, 65536, {}), (300, 700, 1100, {"b_t": True}), (64, 1024, 4096, {"b_t": True})):
        p = Problem.dense(M, N, K, precision="tf32x3", **kw)
        plan = select(p, DEV[arch])
        if arch == "sm_90":
            assert plan.kernel.family == "simt_cp_async" and plan.precision_used == "ieee", plan.describe()
            assert "slower than the fp32 SIMT path" in rejected(plan)["tf32_mma"]
            assert "wgmma_tf32" in rejected(plan) and "is preferred" not in rejected(plan)["wgmma_tf32"]
        else:
            assert plan.kernel.family == "tf32_mma" and plan.precision_used == "tf32x3", plan.describe()
        forced = select(p, DEV[arch], force="tf32_mma")
        assert forced.kernel.family == "tf32_mma" and forced.precision_used == "tf32x3"
    big = select(Problem.dense(*BIG, precision="tf32x3"), DEV[arch])  # what wgmma takes stays on tensor cores
    assert big.kernel.family == ("wgmma_tf32" if arch == "sm_90" else "tf32_mma")


def test_tf32x3_decode_of_33_to_64_rows_runs_wgmma_splitting_b_in_the_kernel():
    """tf32x3 x @ W.t() of 33-64 rows with N >= 4096 on sm_90: wgmma's 64-row tiles with only A's
    halves staged, B split in shared memory (X3_SPLIT_B), split over K by the 64-row rule; fewer
    rows or a narrower W keep the fp32 SIMT / skinny plans. H200 (NOTES run 37, GPU us, this plan
    / fp32 SIMT / torch fp32): 64 x 14336 x 4096 164.7 / 213.7 / 197.0, 48 x 4096 x 11008 124.7 /
    155.2 / 146.5; 64 x 1024 x 4096 36.4 / 24.9; 32 x 4096 x 14336 163.9 / 143.4."""
    dev = DEV["sm_90"]
    for (M, N, K), want in (((64, 14336, 4096), (1, 128)), ((48, 4096, 11008), (4, 128)), ((40, 4096, 8192), (4, 128))):
        plan = select(Problem.dense(M, N, K, "tf32x3", b_t=True), dev)
        m = macros(plan)
        assert plan.kernel.family == "wgmma_tf32" and m["BM"] == 64 and m["X3_SPLIT_B"] == 1, plan.describe()
        assert (plan.kernel.split_k, plan.kernel.tile[1]) == want and plan.precision_used == "tf32x3"
        assert [w for w, _, _ in plan.staging] == ["a"] and len(plan.stagers) == 1
        assert dict(plan.stagers[0].macros)["SPLIT"] == 1  # (A's halves)
        assert "split into big and small TF32 halves in shared memory" in dict(plan.kernel.details)["A, B loads"]
        check_geometry(plan)
    for M, N, K in ((64, 1024, 4096), (64, 2048, 4096), (32, 4096, 14336), (24, 4096, 4096), (16, 14336, 4096)):
        plan = select(Problem.dense(M, N, K, "tf32x3", b_t=True), dev)
        assert plan.kernel.family in ("simt_cp_async", "skinny_kmajor"), plan.describe()
    # a row-major W (x @ W): B copied K-major in fp32 (not split: the kernel splits it) where wgmma takes it
    forced = select(Problem.dense(64, 4096, 4096, "tf32x3"), dev, force="wgmma_tf32")
    assert macros(forced)["X3_SPLIT_B"] == 1 and [w for w, _, _ in forced.staging] == ["a", "bt"]
    assert [dict(s.macros)["SPLIT"] for s in forced.stagers] == [1, 0]
    assert "copied K-major in fp32" in dict(forced.staged_descriptions())["bt"]


@pytest.mark.parametrize("arch", SM80_PLUS)
@pytest.mark.parametrize("precision,x3", [("tf32", 0), ("tf32x3", 1)])
def test_tf32_on_sm80_plus_gets_tensor_cores_with_the_right_x3_macro(arch, precision, x3):
    plan = select(Problem.dense(*BIG, precision=precision), DEV[arch])
    wgmma = arch == "sm_90"  # Hopper: wgmma
    assert plan.kernel.family == ("wgmma_tf32" if wgmma else "tf32_mma")
    assert macros(plan)["PRECISION_X3"] == x3
    if wgmma and precision == "tf32":
        assert rejected(plan)["tf32_mma"] == "wgmma_tf32 is preferred"
    elif wgmma:  # (tf32x3 on mma.sync loses to fp32 SIMT there: the reason that stands first)
        assert rejected(plan)["tf32_mma"].startswith("tf32x3 on mma.sync is slower than the fp32 SIMT path")
    assert plan.precision_used == precision
    assert "simt_cp_async" in rejected(plan) and f"{plan.kernel.family} is preferred" in rejected(plan)["simt_cp_async"]


def assert_cost_model_chose_fp32(plan, dev):
    """``plan`` is the full-fp32 plan a TF32 request got from the cost model (fastmm.cost): on an
    arch the model was calibrated on, where it predicts that plan faster than the tensor-core
    plan of the preference order by more than the margin, with the reason in explain's terms."""
    from fastmm import cost
    from fastmm.plan import COST_MARGIN, _select_in_order

    p = plan.problem
    tc = _select_in_order(p, dev, None, ())
    assert cost.calibrated(dev) and plan.precision_used == "ieee", _zoo_id(p)
    assert cost.faster_by(cost.predict(plan), cost.predict(tc), COST_MARGIN), _zoo_id(p)
    assert "the fp32 plan is faster here" in rejected(plan)[tc.kernel.family]


@pytest.mark.parametrize("arch", SM80_PLUS)
@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
def test_tf32_requests_get_tensor_cores_for_every_non_tiny_shape(arch, precision):
    for p in ZOO:
        p = with_precision(p, precision)
        plan = select(p, DEV[arch])
        if not is_tiny(p) and p.M > SKINNY_MAX_M:
            if plan.kernel.family == "wgmma_tf32":  # Hopper only
                assert arch == "sm_90", _zoo_id(p)
                assert plan.precision_used == precision
            elif x3_goes_to_fp32(p, DEV[arch]):  # wgmma said why not: then fp32 SIMT, not mma.sync
                assert plan.kernel.family == "simt_cp_async" and plan.precision_used == "ieee", _zoo_id(p)
                assert "wgmma_tf32" in rejected(plan) and "fp32 SIMT" in rejected(plan)["tf32_mma"]
            elif "cost model: ran full fp32" in plan.origin:  # fp32 predicted clearly faster
                assert_cost_model_chose_fp32(plan, DEV[arch])
            else:  # elsewhere, or where wgmma said why not (e.g. a copy too costly)
                assert plan.kernel.family == "tf32_mma", _zoo_id(p)
                assert arch != "sm_90" or "wgmma_tf32" in rejected(plan)
                assert plan.precision_used == precision
        elif not is_tiny(p):  # M <= 32: a memory-bound skinny kernel (for B^T: skinny_kmajor, fp32 FMA, or
            family = skinny_family(p, DEV[arch])  # kmajor_mma's tensor cores for tf32 at 8-32 rows)
            assert plan.kernel.family == family, _zoo_id(p)
            assert plan.precision_used == (precision if family == "kmajor_mma" else "ieee")
            assert rejected(plan)["tf32_mma"] == not_chosen_reason("tf32_mma", p, DEV[arch], family)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("mnk,b_t", [((1, 1024, 1024), True), ((1, 256, 1024), True), ((1, 1024, 1024), False),
                                     ((8, 8, TINY_K + 1), False), ((32, 32, 4096), True)])
def test_few_outputs_over_a_long_k_are_not_tiny(precision, mnk, b_t):
    """A decode step's K/V projection (1 x 256 x 1024 x @ W^T) has few outputs but reads all of W:
    one thread an output summing K = 1024 terms in turn took 33 us on the H200 against 6 for a
    skinny kernel spreading K (NOTES run 28). Past TINY_K the skinny kernels take it."""
    M, N, K = mnk
    plan = select(Problem.dense(M, N, K, precision=precision, b_t=b_t), DEV["sm_90"])
    # W's rows along K (x @ W^T): streamed by skinny_kmajor (kmajor_mma's tensor cores from 8 rows
    # in tf32); a row-major B by skinny
    wanted = ("skinny_kmajor", "kmajor_mma") if b_t else ("skinny",)
    assert K > TINY_K and plan.kernel.family in wanted, plan.describe()
    assert not any("is tiny" in reason for _, reason in plan.rejected)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("mnk", [(1, 1, 1), (3, 5, 4), (17, 19, 23), (32, 32, TINY_K), (8, 8, 100), (1, 1024, 7)])
def test_tiny_problems_pick_scalar(arch, precision, mnk):
    plan = select(Problem.dense(*mnk, precision=precision), DEV[arch])
    assert plan.kernel.family == "scalar"
    assert plan.precision_used == "ieee"
    for name, reason in plan.rejected:
        assert ("is tiny" in reason or "needs sm80+" in reason or "needs sm90+" in reason
                or "does not compute precision" in reason
                or (name in ("skinny_kmajor", "kmajor_mma") and reason.startswith("B is not K-contiguous"))
                or (name == "kmajor_mma" and reason == f"M = {mnk[0]} > 32: at most four mma fragments of 8 rows")), (name, reason)
    assert "is tiny" in rejected(plan)["skinny"]  # even where M <= 32 (sm75+: skinny runs on every arch)
    if arch != "sm_75":
        assert "is tiny" in rejected(plan)["simt_cp_async"]
        # B read along K: skinny_kmajor could run it, and is turned down as tiny too
        bt = select(Problem.dense(*mnk, precision=precision, b_t=True), DEV[arch])
        assert bt.kernel.family == "scalar" and "is tiny" in rejected(bt)["skinny_kmajor"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mnk", [(32, 32, 4096), (8, 8, 1_000_000), (1, 1024, TINY_K + 1), (64, 16, 4096)])
def test_few_outputs_with_a_long_k_are_not_tiny(arch, mnk):
    """M*N <= TINY_OUTPUTS but K > TINY_K: one scalar thread per output would run a K-long serial
    sum; the skinny kernels (M <= 32) or the tiled ones spread K over lanes and blocks."""
    M, N, K = mnk
    assert M * N <= TINY_OUTPUTS and K > TINY_K
    for b_t in (False, True):
        p = Problem.dense(M, N, K, b_t=b_t)
        plan = select(p, DEV[arch])
        assert not any("is tiny" in reason for _, reason in plan.rejected), plan.describe()
        if arch != "sm_75" and short_rows_first(p, FAMILIES["simt_cp_async"]):  # (the 32-row SIMT tile)
            assert plan.kernel.family == "simt_cp_async" and macros(plan)["THREAD_M"] == 4
        elif M <= SKINNY_MAX_M:
            assert plan.kernel.family == ("skinny_kmajor" if b_t and arch != "sm_75" else "skinny")
        else:
            assert plan.kernel.family in SIMT
        assert rejected(plan)["scalar"] == f"{plan.kernel.family} is preferred"
        check_geometry(plan)


@pytest.mark.parametrize("arch", ARCHS)
def test_just_above_the_tiny_limit_gets_a_tiled_kernel(arch):
    assert 32 * 33 > TINY_OUTPUTS
    plan = select(Problem.dense(33, 32, 64), DEV[arch])  # 33 rows: too many for skinny
    assert plan.kernel.family in SIMT
    assert rejected(plan)["skinny"] == "M = 33 > 32: not skinny"
    plan = select(Problem.dense(32, 33, 64), DEV[arch])  # 32 rows: skinny's
    assert plan.kernel.family == "skinny"
    assert rejected(plan)["scalar"] == "skinny is preferred"



@pytest.fixture
def no_staging(monkeypatch):
    """Plans that read every operand in place, so the tests below check the kernels' own load
    modes on misaligned memory (staging, which copies such operands first, is tested apart)."""
    monkeypatch.setattr(simt_core, "STAGE_MIN_FLOP_PER_BYTE", float("inf"))
    monkeypatch.setattr(simt_core, "TRANSPOSE_B_MIN_M", float("inf"))

# --- load modes: no vector access where the layout or alignment forbids it ----------------------

@pytest.mark.parametrize("arch", SM80_PLUS)
@pytest.mark.parametrize("family", SIMT)
@pytest.mark.parametrize("N", [1021, 1022, 1023])
def test_n_not_multiple_of_4_gets_no_float4_on_b_or_c(arch, family, N, no_staging):
    plan = forced(Problem.dense(1024, N, 1024), arch, family)
    m = macros(plan)
    assert m["B_MODE"] not in VEC_MODES
    assert m["C_VEC"] == 0
    assert m["A_MODE"] == (LOAD_VEC_K if family == "simt_float4" else LOAD_ELEM_K)  # A is still aligned


@pytest.mark.parametrize("N", [1021, 1022, 1023])
def test_n_not_multiple_of_4_on_sm75_default_path(N):
    plan = select(Problem.dense(1024, N, 1024), DEV["sm_75"])
    assert plan.kernel.family == "simt_float4"
    assert macros(plan)["B_MODE"] not in VEC_MODES and macros(plan)["C_VEC"] == 0


@pytest.mark.parametrize("arch", SM80_PLUS)
@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("N,c_vec", [(1021, 0), (1022, 1), (1023, 0)])
def test_tf32_n_not_multiple_of_4_gets_4_byte_b_copies(arch, precision, N, c_vec, no_staging):
    m = macros(forced(Problem.dense(1024, N, 1024, precision=precision), arch, "tf32_mma"))
    assert m["B_VEC"] == 0 and m["A_VEC"] == 1
    assert m["C_VEC"] == c_vec  # float2 stores need an even N only


@pytest.mark.parametrize("arch", SM80_PLUS)
@pytest.mark.parametrize("K", [1021, 1022, 1023])
def test_k_not_multiple_of_4_gets_no_vectors_along_k(arch, K, no_staging):
    for family in SIMT:
        m = macros(forced(Problem.dense(1024, 1024, K), arch, family))
        assert m["A_MODE"] == LOAD_ELEM_K  # row-major A: rows K apart
        assert m["B_MODE"] == LOAD_VEC_FAST  # row-major B is unaffected
        m = macros(forced(Problem.dense(1024, 1024, K, b_t=True), arch, family))
        assert m["B_MODE"] == LOAD_ELEM_K
    m = macros(forced(Problem.dense(1024, 1024, K, precision="tf32"), arch, "tf32_mma"))
    assert m["A_VEC"] == 0 and m["B_VEC"] == 1


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("align", [4, 8])
def test_misaligned_storage_offset_gets_no_float4_anywhere(arch, align, no_staging):
    # offset 1 or 3 floats -> 4-byte aligned pointers; offset 2 -> 8-byte aligned.
    # A batch of 2 never splits K, so C is stored directly by the kernel; with a batch of 1 the
    # planner may split K, and then the kernel stores into a fresh (aligned, contiguous) workspace
    # and only splitk_reduce (single floats) writes C.
    for batch in (2, 1):
        for a_t in (False, True):
            for b_t in (False, True):
                p = Problem.dense(1024, 1024, 1024, a_t=a_t, b_t=b_t, align=align, batch=batch)
                for family in (SIMT if arch != "sm_75" else ("simt_float4",)):
                    plan = forced(p, arch, family)
                    m = macros(plan)
                    assert m["A_MODE"] in ELEM_MODES and m["B_MODE"] in ELEM_MODES, (family, a_t, b_t)
                    if plan.kernel.split_k == 1:
                        assert m["C_VEC"] == 0, (family, a_t, b_t, batch)
                    else:
                        assert batch == 1 and m["C_VEC"] == 1  # N % 4 == 0 workspace
                        # C itself: splitk_reduce's single floats, or the fused sum's
                        assert plan.reduce is not None or (plan.kernel.split_fused and m["OUT_VEC"] == 0)
                if arch != "sm_75":
                    for precision in ("tf32", "tf32x3"):
                        plan = forced(with_precision(p, precision), arch, "tf32_mma")
                        m = macros(plan)
                        assert m["A_VEC"] == 0 and m["B_VEC"] == 0
                        if plan.kernel.split_k == 1:
                            assert m["C_VEC"] == (1 if align == 8 else 0)  # float2 stores need 8 bytes
                        else:
                            assert batch == 1 and m["C_VEC"] == 1 and plan.reduce is not None
                # skinny (every arch): B loses its float4 loads with a misaligned B
                skinny = Problem.dense(16, 1024, 1024, a_t=a_t, b_t=b_t, align=align, batch=batch)
                assert macros(forced(skinny, arch, "skinny"))["B_VEC"] == 0, (a_t, b_t, batch)


@pytest.mark.parametrize("which", ["a", "b", "c"])
def test_one_misaligned_operand_loses_vectors_only_there(which, no_staging):
    p = dataclasses.replace(Problem.dense(1024, 1024, 1024), **{which + "_align": 4})
    m = macros(forced(p, "sm_90", "simt_float4"))
    assert (m["A_MODE"] in ELEM_MODES) == (which == "a")
    assert (m["B_MODE"] in ELEM_MODES) == (which == "b")
    assert (m["C_VEC"] == 0) == (which == "c")
    plan = forced(with_precision(p, "tf32"), "sm_90", "tf32_mma")
    m = macros(plan)
    assert m["A_VEC"] == int(which != "a") and m["B_VEC"] == int(which != "b")
    # 1024^3 splits K on sm_90: the kernel stores into the (aligned) workspace, splitk_reduce into C
    assert plan.kernel.split_k > 1 and m["C_VEC"] == 1
    batched = dataclasses.replace(p, batch_total=2, batch_inner=2, precision="tf32")  # never split: direct stores
    m = macros(forced(batched, "sm_90", "tf32_mma"))
    assert m["A_VEC"] == int(which != "a") and m["B_VEC"] == int(which != "b") and m["C_VEC"] == int(which != "c")
    # skinny: only B's alignment matters (A is staged through shared memory, C stored as floats)
    m = macros(forced(dataclasses.replace(p, M=16), "sm_90", "skinny"))
    assert m["B_VEC"] == int(which != "b")


@pytest.mark.parametrize("arch", SM80_PLUS)
def test_transposed_views_get_matching_load_modes_and_smem_layouts(arch, no_staging):
    row = Problem.dense(1024, 1024, 1024)
    at = Problem.dense(1024, 1024, 1024, a_t=True)
    bt = Problem.dense(1024, 1024, 1024, b_t=True)
    f4 = {name: macros(forced(p, arch, "simt_float4")) for name, p in (("row", row), ("at", at), ("bt", bt))}
    cp = {name: macros(forced(p, arch, "simt_cp_async")) for name, p in (("row", row), ("at", at), ("bt", bt))}
    # A row-major (k-contiguous): float4 along k transposed by the register path; cp.async cannot transpose
    assert f4["row"]["A_MODE"] == LOAD_VEC_K and cp["row"]["A_MODE"] == LOAD_ELEM_K
    # A transposed view (m-contiguous): float4 straight into the k-major tile
    assert f4["at"]["A_MODE"] == LOAD_VEC_FAST and cp["at"]["A_MODE"] == LOAD_VEC_FAST
    assert f4["row"]["B_MODE"] == LOAD_VEC_FAST and cp["row"]["B_MODE"] == LOAD_VEC_FAST
    assert f4["bt"]["B_MODE"] == LOAD_VEC_K and cp["bt"]["B_MODE"] == LOAD_ELEM_K
    for precision in ("tf32", "tf32x3"):
        tf = {name: macros(forced(with_precision(p, precision), arch, "tf32_mma"))
              for name, p in (("row", row), ("at", at), ("bt", bt))}
        assert (tf["row"]["A_SMEM_MK"], tf["row"]["B_SMEM_KN"]) == (1, 1)
        assert (tf["at"]["A_SMEM_MK"], tf["at"]["B_SMEM_KN"]) == (0, 1)
        assert (tf["bt"]["A_SMEM_MK"], tf["bt"]["B_SMEM_KN"]) == (1, 0)
        assert all(t["A_VEC"] == 1 and t["B_VEC"] == 1 for t in tf.values())


@pytest.mark.parametrize("arch", SM80_PLUS)
def test_grad_w_copies_its_m_contiguous_a_in_single_floats_on_the_largest_tile_of_sm90(arch, no_staging):
    # G^T @ X (grad_W: A contiguous along m, B row-major) in every plan form of the 128 x 256 tile:
    # one launch, split-K in cluster pairs, split-K, stream-K
    sm90 = arch == "sm_90"
    for M, N, K in ((4096, 1024, 8192), (1024, 1024, 8192), (768, 768, 4096), (32000, 1024, 8192)):
        plan = forced(Problem.dense(M, N, K, a_t=True), arch, "simt_cp_async")
        m = macros(plan)
        if sm90:
            assert plan.kernel.tile[:2] == (128, 256)
        want = LOAD_ELEM_FAST if sm90 and plan.kernel.tile[:2] == (128, 256) else LOAD_VEC_FAST
        assert m["A_MODE"] == want and m["B_MODE"] == LOAD_VEC_FAST
        assert dict(plan.kernel.details)["A loads"] == LOAD_NAMES[want]
        assert ("A copy choice" in dict(plan.kernel.details)) == (want == LOAD_ELEM_FAST)  # explain says why
    if not sm90:
        return
    forms = [(k.split_k > 1, k.split_pair, k.stream_k is not None) for k in
             (forced(Problem.dense(*s, a_t=True), arch, "simt_cp_async").kernel
              for s in ((4096, 1024, 8192), (1024, 1024, 8192), (768, 768, 4096), (32000, 1024, 8192)))]
    assert forms == [(False, False, False), (True, True, False), (True, False, False), (False, False, True)]
    # that build's stream-K kernel is ~4.5% slower a k-tile than its plain one: its whole waves go
    # in the plain kernel's own launch first (the head form), over whole rows of tiles
    # (13.58 waves: 1712 of 1792 tiles, 107 rows of 16; 7.58 waves: 924 of 1000, 231 rows of 4)
    for (M, N, K), rows, rest in (((14336, 4096, 2048), 107, 80), ((32000, 1024, 8192), 231, 76)):
        plan = forced(Problem.dense(M, N, K, a_t=True), arch, "simt_cp_async")
        sk, head = plan.kernel.stream_k, plan.head
        assert (sk.head_rows, sk.head_tiles, sk.whole_tiles, sk.tiles) == (rows * 128, rows * N // 256, 0, rest)
        assert head.entry == "fastmm_simt_cp_async" and head.grid == (sk.head_tiles, 1, 1) and head.stream_k is None
        assert dict(head.macros) == {k: v for k, v in plan.kernel.macros if k != "STREAM_K"}
        assert plan.kernels() == (plan.kernel, head, plan.reduce) and "first: simt_cp_async" in plan.describe()
    # the same build where A's alignment leaves single floats the only way (M % 4 != 0): the same kernel
    bert = forced(Problem.dense(30522, 1024, 8192, a_t=True), arch, "simt_cp_async")
    assert macros(bert)["A_MODE"] == LOAD_ELEM_FAST and bert.kernel.stream_k.head_rows == 231 * 128
    # without the head form (a variant switch) the same build keeps one launch or none
    one = dataclasses.replace(FAMILIES["simt_cp_async"], stream_k_head=False)
    up = forced(Problem.dense(14336, 4096, 2048, a_t=True), arch, "simt_cp_async", variants=(one,))
    assert up.kernel.stream_k is None and up.head is None and up.kernel.split_k == 1
    # a row-major A's build has no penalty: one launch
    nn = forced(Problem.dense(32000, 1024, 8192), arch, "simt_cp_async")
    assert nn.kernel.stream_k.whole_tiles == 924 and nn.kernel.stream_k.head_rows == 0 and nn.head is None
    # a B in single floats (its rows not float4-aligned, read in place) keeps A's float4 units: both operands
    # in single floats ran slower; so do the smaller tiles (not measured) and the variant switch
    odd_b = forced(Problem.dense(4096, 1022, 8192, a_t=True), arch, "simt_cp_async")
    assert odd_b.kernel.tile[:2] == (128, 256) and macros(odd_b)["B_MODE"] == LOAD_ELEM_FAST
    assert macros(odd_b)["A_MODE"] == LOAD_VEC_FAST
    small = forced(Problem.dense(2816, 1024, 1024, a_t=True), arch, "simt_cp_async")
    assert small.kernel.tile[:2] == (128, 128) and macros(small)["A_MODE"] == LOAD_VEC_FAST
    switched_off = dataclasses.replace(FAMILIES["simt_cp_async"], a_single_float_tiles=())
    plan = forced(Problem.dense(4096, 1024, 8192, a_t=True), arch, "simt_cp_async", variants=(switched_off,))
    assert macros(plan)["A_MODE"] == LOAD_VEC_FAST


@pytest.mark.parametrize("arch", SM80_PLUS)
def test_transposed_views_with_odd_extent_use_single_floats(arch):
    # A^T view is m-contiguous: M = 1023 forbids float4 along m
    m = macros(forced(Problem.dense(1023, 1024, 1024, a_t=True), arch, "simt_float4"))
    assert m["A_MODE"] == LOAD_ELEM_FAST
    m = macros(forced(Problem.dense(1023, 1024, 1024, a_t=True, precision="tf32"), arch, "tf32_mma"))
    assert m["A_SMEM_MK"] == 0 and m["A_VEC"] == 0
    # B^T view is k-contiguous: K = 1023 forbids float4 along k
    m = macros(forced(Problem.dense(1024, 1024, 1023, b_t=True), arch, "simt_float4"))
    assert m["B_MODE"] == LOAD_ELEM_K
    m = macros(forced(Problem.dense(1024, 1024, 1023, b_t=True, precision="tf32"), arch, "tf32_mma"))
    assert m["B_SMEM_KN"] == 0 and m["B_VEC"] == 0


def test_operands_with_no_unit_stride_use_single_floats():
    p = Problem(1024, 1024, 1024, (2 * 1024, 2), (2 * 1024, 2), (1024, 1))
    for family in SIMT:
        m = macros(forced(p, "sm_90", family))
        assert m["A_MODE"] == LOAD_ELEM_K and m["B_MODE"] == LOAD_ELEM_FAST
        assert m["C_VEC"] == 1
    m = macros(forced(with_precision(p, "tf32"), "sm_90", "tf32_mma"))
    assert m["A_VEC"] == 0 and m["B_VEC"] == 0


@pytest.mark.parametrize("width,vec", [(1028, True), (1025, False), (1030, False)])
def test_row_strided_slices_vectorize_only_when_the_row_stride_allows(width, vec, no_staging):
    # x[:, :1024] of an (R, width) tensor: unit stride along the row, rows `width` apart
    p = Problem(1024, 1024, 1024, (width, 1), (width, 1), (width, 1))
    m = macros(forced(p, "sm_90", "simt_float4"))
    assert (m["A_MODE"] == LOAD_VEC_K) == vec and (m["B_MODE"] == LOAD_VEC_FAST) == vec and m["C_VEC"] == int(vec)
    m = macros(forced(with_precision(p, "tf32"), "sm_90", "tf32_mma"))
    assert m["A_VEC"] == int(vec) and m["B_VEC"] == int(vec)


def test_batch_strides_not_multiple_of_4_forbid_vectors():
    base = Problem.dense(512, 512, 512, batch=4)
    p = dataclasses.replace(base, a_batch_strides=(0, 512 * 512 + 1), b_batch_strides=(0, 512 * 512 + 2))
    m = macros(forced(p, "sm_90", "simt_float4"))
    assert m["A_MODE"] in ELEM_MODES and m["B_MODE"] in ELEM_MODES and m["C_VEC"] == 1
    m0 = macros(forced(base, "sm_90", "simt_float4"))
    assert m0["A_MODE"] in VEC_MODES and m0["B_MODE"] in VEC_MODES


def test_details_name_the_load_modes_in_the_macros():
    for p in ZOO[:40]:
        for family in SIMT:
            cfg = forced(p, "sm_90", family).kernel
            m, d = dict(cfg.macros), dict(cfg.details)
            assert d["A loads"] == LOAD_NAMES[m["A_MODE"]] and d["B loads"] == LOAD_NAMES[m["B_MODE"]]
            assert d["C stores"] == ("float4" if m["C_VEC"] else "single floats")


# --- falling back to torch ----------------------------------------------------------------------

@pytest.mark.parametrize("which", ["a", "b", "c"])
@pytest.mark.parametrize("align", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_pointers_not_4_byte_aligned_fall_back_to_torch(which, align, arch):
    p = dataclasses.replace(Problem.dense(256, 256, 256, precision="tf32"), **{which + "_align": align})
    plan = select(p, DEV[arch])
    assert plan.kernel is None and plan.precision_used is None
    assert plan.fallback == f"{which.upper()}'s data pointer is not 4-byte aligned, which no float kernel can read"
    assert plan.describe().startswith("torch.matmul fallback: ")


@pytest.mark.parametrize("dims", [dict(M=2**31), dict(N=2**31), dict(K=2**31), dict(batch_total=2**31)])
def test_dimensions_past_int32_fall_back_to_torch(dims):
    p = dataclasses.replace(Problem.dense(64, 64, 64), **dims)
    plan = select(p, DEV["sm_90"])
    assert plan.kernel is None
    assert "2^31-1" in plan.fallback and "32-bit" in plan.fallback


def test_largest_int32_dimension_still_runs():
    plan = select(Problem(INT32_MAX, 1, 1, (1, 1), (1, 1), (1, 1)), DEV["sm_90"])
    assert plan.kernel is not None


def test_too_many_output_tiles_fall_back_to_torch():
    plan = select(Problem(2**20, 2**20, 1, (1, 1), (2**20, 1), (2**20, 1)), DEV["sm_90"])
    assert plan.kernel is None and "tiles" in plan.fallback


def test_devices_older_than_sm70_fall_back_to_torch():
    old = dataclasses.replace(DEV["sm_75"], cc=(6, 1), name="simulated P100")
    plan = select(Problem.dense(*BIG), old)
    assert plan.kernel is None and "sm_61" in plan.fallback and "older" in plan.fallback


@pytest.mark.parametrize("cc", [(7, 0), (7, 2)])
@pytest.mark.parametrize("mnk", [BIG, (16, 4096, 4096), (3, 5, 4)])
def test_devices_older_than_sm75_fall_back_to_torch(cc, mnk):
    assert MIN_CC == (7, 5)
    old = dataclasses.replace(DEV["sm_75"], cc=cc, name="simulated V100")
    for precision in PRECISIONS:
        plan = select(Problem.dense(*mnk, precision=precision), old)
        assert plan.kernel is None and plan.precision_used is None
        assert plan.fallback == f"device sm_{cc[0]}{cc[1]} is older than sm_75, the oldest fastmm supports"


# --- force= -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", SM80_PLUS)
@pytest.mark.parametrize("family,precision", [("scalar", "ieee"), ("simt_float4", "ieee"), ("simt_cp_async", "ieee"),
                                              ("scalar", "tf32"), ("simt_cp_async", "tf32x3"), ("tf32_mma", "tf32")])
def test_force_picks_the_named_family(arch, family, precision):
    plan = select(Problem.dense(*BIG, precision=precision), DEV[arch], force=family)
    assert plan.kernel.family == family
    assert plan.precision_used == (precision if family == "tf32_mma" else "ieee")
    reasons = rejected(plan)
    assert family not in reasons
    for name in ("skinny_kmajor", "skinny"):  # the families that cannot take 2048 rows
        assert reasons.pop(name) == "M = 2048 > 32: not skinny"
    if precision != "ieee":
        assert reasons.pop("kmajor_mma") == ("needs sm80+, device is sm_75" if arch == "sm_75"
                                             else "M = 2048 > 32: at most four mma fragments of 8 rows")
    if arch != "sm_90" and precision != "ieee":
        assert reasons.pop("wgmma_tf32") == f"needs sm90+, device is {arch}"
    p = Problem.dense(2048, 2048, 2048, precision=precision)
    for name, reason in reasons.items():
        assert reason in (not_chosen_reason(name, p, DEV[arch], family, forced_=True),
                          f"does not compute precision '{precision}'"), (name, reason)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("b_t", [False, True])  # B^T: skinny_kmajor's own layout, where it can run
def test_force_skinny_picks_it_and_the_rest_are_rejected_as_forced(arch, precision, b_t):
    plan = select(Problem.dense(16, 2048, 2048, precision=precision, b_t=b_t), DEV[arch], force="skinny")
    assert plan.kernel.family == "skinny" and plan.precision_used == "ieee"
    for name, reason in rejected(plan).items():
        if name in ("tf32_mma", "wgmma_tf32", "kmajor_mma") and precision == "ieee":
            assert reason == f"does not compute precision '{precision}'"
        elif name == "wgmma_tf32" and arch != "sm_90":
            assert reason == f"needs sm90+, device is {arch}", (name, reason)
        elif name == "wgmma_tf32" and precision == "tf32x3":  # 16 rows: 16 tiles for 132 SMs, and no split-K
            assert "fill under 1/4 of the 132 SMs" in reason, (name, reason)
        elif name == "wgmma_tf32":  # tf32: 32 tiles of 128 x 64 at K = 2048 beat tf32_mma's split (NOTES run 23)
            assert reason == "skinny is preferred (forced)", (name, reason)
        elif arch == "sm_75" and name in ("simt_cp_async", "tf32_mma", "skinny_kmajor", "kmajor_mma"):
            assert reason == "needs sm80+, device is sm_75", (name, reason)
        elif name == "skinny_kmajor" and not b_t:  # B row-major: read along N, skinny's layout
            assert reason == "B is not K-contiguous (its rows along N are the skinny family's)", (name, reason)
        elif name == "kmajor_mma" and not b_t:
            assert reason == "B is not K-contiguous (W's rows along K are what this family streams)", (name, reason)
        elif name == "kmajor_mma" and precision == "tf32x3":  # (a heuristic: skinny_kmajor is as fast)
            assert reason.startswith("skinny_kmajor computes full fp32 as fast here"), (name, reason)
        else:
            p = Problem.dense(16, 2048, 2048, precision=precision, b_t=b_t)
            assert reason in (not_chosen_reason(name, p, DEV[arch], "skinny", forced_=True),
                              f"does not compute precision '{precision}'"), (name, reason)

@pytest.mark.parametrize("family", ["simt_float4", "simt_cp_async", "skinny", "skinny_kmajor"])
def test_force_overrides_the_tiny_rule(family):
    plan = select(Problem.dense(3, 5, 4, b_t=family == "skinny_kmajor"), DEV["sm_90"], force=family)  # (its B layout)
    assert plan.kernel.family == family
    check_geometry(plan)


def test_force_unknown_family_raises_listing_the_families():
    with pytest.raises(ValueError, match="unknown kernel family 'cublas'") as exc:
        select(Problem.dense(*BIG), DEV["sm_90"], force="cublas")
    for name in FAMILIES:
        assert name in str(exc.value)


# --- every plan accounts for every family; geometry fits the device -------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_family_is_chosen_or_rejected_with_a_reason(arch, precision):
    for p in ZOO:
        plan = select(with_precision(p, precision), DEV[arch])
        names = [plan.kernel.family] + [name for name, _ in plan.rejected]
        assert sorted(names) == sorted(FAMILIES), _zoo_id(p)
        for name, reason in plan.rejected:
            assert isinstance(reason, str) and len(reason) > 10, (name, reason)
            assert f"rejected {name}: {reason}" in plan.describe()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_launch_geometry_fits_the_device_and_matches_the_kernels(arch, precision):
    for p in ZOO:
        p = with_precision(p, precision)
        check_geometry(select(p, DEV[arch]))
        for family in FAMILIES:
            try:
                plan = select(p, DEV[arch], force=family)
            except ValueError:
                continue
            check_geometry(plan)


def test_cp_async_drops_stages_on_a_device_with_little_shared_memory():
    small = dataclasses.replace(DEV["sm_80"], smem_per_block_optin=64 * 1024, name="simulated sm80, 64 KiB")
    big_plan = forced(Problem.dense(8192, 8192, 4096), "sm_90", "simt_cp_async")
    small_plan = select(Problem.dense(8192, 8192, 4096), small, force="simt_cp_async")
    assert 2 <= macros(small_plan)["STAGES"] < macros(big_plan)["STAGES"]
    check_geometry(small_plan)


def test_huge_batch_is_capped_at_the_grid_z_limit():
    plan = select(Problem.dense(64, 64, 64, batch=100_000), DEV["sm_90"])
    assert plan.kernel.grid[2] == MAX_GRID_Z
    assert select(Problem.dense(64, 64, 64, batch=7), DEV["sm_90"]).kernel.grid[2] == 7


@pytest.mark.parametrize("precision", PRECISIONS)
def test_long_k_with_a_small_output_splits_k_with_a_deterministic_reduce(precision):
    plan = select(Problem.dense(256, 256, 65536, precision=precision), DEV["sm_90"])
    assert plan.kernel.split_k > 1
    assert plan.reduce is not None and "fixed order" in dict(plan.reduce.details)["order"]
    assert "then: splitk_reduce" in plan.describe()
    check_geometry(plan)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_batched_problems_never_split_k(arch, precision):
    """The split-K workspace holds one M x N slice per split of a single product."""
    broadcast_a = dataclasses.replace(Problem.dense(8, 4096, 16384, batch=3, precision=precision),
                                      a_batch_strides=(0, 0))
    for p in (Problem.dense(256, 256, 65536, batch=2, precision=precision),
              Problem.dense(16, 4096, 4096, batch=2, precision=precision), broadcast_a):
        for force in (None, *FAMILIES):
            try:
                plan = select(p, DEV[arch], force=force)
            except ValueError:  # the family cannot run here
                continue
            assert plan.kernel.split_k == 1 and plan.reduce is None, (force, plan.kernel.family)


#: (M, N, K, arch, precision) where the wave model of families.split_k_for now splits K of a
#: problem that fills the GPU for many waves (reported to the lead, see _LARGE_SPLIT_REASON).


def _large_params():
    for M, N, K in ((8192, 8192, 8192), (8192, 4096, 6144)):
        for arch in ARCHS:
            for precision in PRECISIONS:
                yield pytest.param(M, N, K, arch, precision, id=f"{M}x{N}x{K}-{arch}-{precision}")


@pytest.mark.parametrize("M,N,K,arch,precision", list(_large_params()))
def test_large_problems_never_split_k(M, N, K, arch, precision):
    """(Stream-K may still share out a partial last wave: its second pass is the fixup.)"""
    plan = select(Problem.dense(M, N, K, precision=precision), DEV[arch])
    assert plan.kernel.split_k == 1, (plan.kernel.family, plan.kernel.split_k)
    assert plan.reduce is None or (plan.kernel.stream_k is not None and plan.reduce.family == "stream_k_fixup")


def test_simt_float4_and_scalar_never_split_k():
    p = Problem.dense(256, 256, 65536)
    for arch in ARCHS:
        for family in ("simt_float4", "scalar"):
            plan = select(p, DEV[arch], force=family)
            assert plan.kernel.split_k == 1 and plan.reduce is None

# --- split-K in the tiled families (the wave model itself: tests/test_work_split.py) ----------------

@pytest.mark.parametrize("arch", SM80_PLUS)
@pytest.mark.parametrize("family,precision", [("simt_cp_async", "ieee"), ("tf32_mma", "tf32"), ("tf32_mma", "tf32x3")])
def test_skinny_or_long_k_problems_split_k_on_the_tiled_families(arch, family, precision):
    # (16 x 2048: 32-64 column tiles, under half a wave in every family's tile; 16 x 4096 makes
    # 128 tiles of tf32x3's 128 x 32 blocks, a whole wave on an sm_89's 128 SMs: no split there)
    for M, N, K in ((16, 2048, 4096), (256, 256, 65536)):
        plan = forced(Problem.dense(M, N, K, precision=precision), arch, family)
        bk = plan.kernel.tile[2]
        slots = 2 * DEV[arch].sm_count
        assert 1 < plan.kernel.split_k <= min(max(MAX_SPLIT, slots), -(-K // bk) // MIN_KTILES_PER_SPLIT), (M, N, K)
        assert plan.reduce is not None and dict(plan.kernel.details)["split-K"].startswith(f"{plan.kernel.split_k} slices")
        check_geometry(plan)
        batched = forced(Problem.dense(M, N, K, precision=precision, batch=2), arch, family)
        assert batched.kernel.split_k == 1 and batched.reduce is None


@pytest.mark.parametrize("family,precision", [("tf32_mma", "tf32"), ("tf32_mma", "tf32x3")])
def test_a_wave_of_tiles_with_a_ragged_end_now_splits_k(family, precision):
    """128 x 11008 x 4096 on sm_90 has more tiles than SMs, yet splits 3 ways (the last wave of
    one split would leave most slots idle)."""
    plan = forced(Problem.dense(128, 11008, 4096, precision=precision), "sm_90", family)
    assert plan.kernel.split_k == 3
    bm, bn, _ = plan.kernel.tile
    assert -(-128 // bm) * -(-11008 // bn) >= DEV["sm_90"].sm_count
    check_geometry(plan)


def test_simt_takes_its_largest_tile_split_along_k_where_that_fills_a_wave():
    """decode128 (128 x 11008 x 4096): 43 tiles of 128 x 256 split 3 ways fill a wave with K
    slices of 1365, and ran at 1.12x cuBLAS against 0.76x for 172 tiles of 128 x 64 split 3
    (NOTES run 11). Short K keeps the smaller tile, and so does a full wave of big tiles. (The
    rules: 1000^3 is a product the mid-size split model decides on sm_90, see RULES.)"""
    plan = forced(Problem.dense(128, 11008, 4096), "sm_90", "simt_cp_async")
    assert plan.kernel.tile[:2] == (128, 256) and plan.kernel.split_k == 3
    check_geometry(plan)
    short_k = forced(Problem.dense(1000, 1000, 1000), "sm_90", "simt_cp_async", RULES)
    assert short_k.kernel.tile[:2] == (128, 64)
    full_wave = forced(Problem.dense(2048, 4096, 11008), "sm_90", "simt_cp_async")
    assert full_wave.kernel.tile[:2] == (128, 256) and full_wave.kernel.split_k == 1


@pytest.mark.parametrize("M,N,K,tile", [
    (64, 4096, 4096, (64, 256)),    # M <= 64: a 64-row tile pads nothing, a 128-row one half
    (40, 4096, 4096, (64, 256)),    # (of 16 x 8 outputs a thread: B row-major, see the next test)
    (128, 2048, 1024, (64, 64)),    # 128 x 256 slices would be shorter than 384
])
def test_simt_split_rule_leaves_what_it_was_not_measured_on(M, N, K, tile):
    plan = forced(Problem.dense(M, N, K), "sm_90", "simt_cp_async")
    assert plan.kernel.tile[:2] == tile
    check_geometry(plan)


@pytest.mark.parametrize("M,N,K,a_t,b_t,tile,split", [
    (700, 2304, 768, False, True, (64, 64), 4),     # 128 x 64 in 6 slices: 100.4 us, 64 x 64 in 2: 74.5
    # grad_W: 338.1 us on 128 x 64 in 6 slices; 64 x 64 in 6 slices 325.7, in 3 302.2 (the split
    # model's 4 slots an SM over-split this one, NOTES run 33)
    (768, 2304, 4096, True, False, (64, 64), 6),
    (1024, 1024, 1024, False, True, (128, 64), 3),  # 128 x 64 kept: 3 slices 64.6 us, 2 65.3
    (1000, 1000, 1000, False, False, (128, 64), 3),  # 60.2 against 61.9 in 2
    (683, 2048, 768, False, True, (128, 64), 2),    # 71.3 against 81.2 for 64 x 64 in 3 (run 33)
])
def test_simt_takes_the_64x64_tile_where_the_128x64_one_would_split_k_four_ways(M, N, K, a_t, b_t, tile, split):
    """SimtCore.small_tile_from_split, as measured on the H200 (NOTES run 32, probes/mid_rows.json);
    the rules alone (see RULES)."""
    plan = forced(Problem.dense(M, N, K, a_t=a_t, b_t=b_t), "sm_90", "simt_cp_async", RULES)
    assert plan.kernel.tile[:2] == tile, plan.describe()
    assert max(plan.kernel.split_k, plan.kernel.split_slices) == split, plan.describe()
    check_geometry(plan)


@pytest.mark.parametrize("M,N,K,a_t,b_t,tile", [
    (64, 1024, 4096, False, True, (64, 256)),    # over 128 x 256 (K-dominant): 39.1 -> 28.6 us
    (576, 4096, 4096, False, True, (64, 256)),   # 4.5 tiles of 128 rows: 610 -> 514 us
    (64, 4096, 14336, False, True, (64, 256)),   # x @ W.t(), slices of 896 k: 226.7 -> 208.5 us
    (64, 4096, 4096, False, False, (64, 256)),   # row-major W (grad_x): 67.3 -> 59.9 us
    (320, 768, 3072, True, False, (64, 256)),    # grad_W, A m-contiguous: 52.8 -> 46.8 us
    (40, 3072, 1024, False, True, (64, 64)),     # x @ W.t(), slices of 128 k: 24.0 against 27.1
    (300, 700, 1100, False, True, (64, 64)),     # 27.8 against 33.7
    (64, 14336, 4096, False, True, (64, 64)),    # slices of 455 k: a tie (220.3 / 222.9)
    (200, 4096, 4096, False, True, None),        # M % 128 = 72: no 64-row tile of 16 x 8
    (256, 4096, 4096, False, True, None),
])
def test_simt_takes_the_64_row_tile_of_16x8_where_the_last_row_tile_is_half_empty(M, N, K, a_t, b_t, tile):
    """HALF_TILE_OPTIONS' 64 x 256 tile for split plans of products whose last tile of rows is at
    most 64 rows, as measured on the H200 (NOTES run 32; the rows of probes/half_rows.json)."""
    plan = forced(Problem.dense(M, N, K, a_t=a_t, b_t=b_t), "sm_90", "simt_cp_async")
    m = dict(plan.kernel.macros)
    if tile is None:
        assert (m["WARPS_M"], m["THREAD_M"]) != (1, 16), plan.describe()
    else:
        assert plan.kernel.tile[:2] == tile, plan.describe()
        assert m["THREAD_M"] == (16 if tile[1] == 256 else 8)
        assert plan.kernel.split_k > 1 or plan.kernel.split_fused
    check_geometry(plan)


@pytest.mark.parametrize("M,N,K,layout,tile,split", [
    (2048, 1024, 4096, "b_t", (128, 256), 2),  # 128 x 128 tiles fill the wave: 8 warps split 2 ways 7% ahead
    (4096, 768, 3072, "", (128, 256), 4),  # gpt2's MLP down (row-major W): 11% ahead
    (77, 9216, 3072, "b_t", (128, 256), 7),  # 77 rows pad to 128 on every tile; 438 k a slice: 8% ahead
    (768, 2304, 4096, "a_t", (64, 64), 6),  # grad_W, x^T m-contiguous: the 128 x 256 tile ran 4-14% behind
    # (and 128 x 64 in 6 slices 9% behind 64 x 64 in 3: SimtCore.small_tile_from_split; 6 slices
    # since run 33's slot count, see test_simt_takes_the_64x64_tile_...)
    (1024, 2816, 1024, "b_t", (128, 128), 3),  # 341 k a slice: the 128 x 128 tile 10% ahead
])
def test_simt_splits_its_largest_tile_where_that_was_measured_faster(M, N, K, layout, tile, split):
    """The largest SIMT tile split along K where its blocks fill a wave, in place of the 128 x 128
    tile too (not only the 8 x 8 ones), from 65 rows and 384 k a slice, never with an m-contiguous
    A: each case is a product timed with every candidate on the H200 (NOTES run 26); the rules alone
    (see RULES)."""
    kw = {layout: True} if layout else {}
    plan = select(Problem.dense(M, N, K, "ieee", **kw), DEV["sm_90"], variants=RULES)
    assert plan.kernel.family == "simt_cp_async", plan.describe()
    assert plan.kernel.tile[:2] == tile and plan.kernel.split_k == split, plan.describe()
    check_geometry(plan)


@pytest.mark.parametrize("M,N,K,batch,tile", [
    (2048, 2048, 128, 32, (128, 128)),  # 128-wide heads: 128 x 256 ran 6% behind
    (1024, 1024, 128, 64, (128, 128)),  # 7% behind
    (2048, 2048, 256, 32, (128, 256)),  # K = 256: the rule stops at 128
    (4096, 4096, 64, 1, (128, 256)),  # one matrix: not measured, not taken
    # K <= 64 (batched_thin_k): 8 x 8 tiles only; 128 x 128 ran 16-23% behind 128 x 64 (H100)
    (197, 197, 64, 96, (128, 64)),
    (256, 256, 64, 42, (128, 64)),
    (512, 512, 64, 128, (128, 64)),
    (512, 512, 32, 64, (128, 64)),
])
def test_batched_short_k_products_take_no_128x256_simt_tile(M, N, K, batch, tile):
    """Batched products with a short K (attention's Q @ K^T) take no 128 x 256 SIMT tile, and
    with K <= 64 none of the 16 x 8 tiles (SimtCore.batched_short_k, batched_thin_k)."""
    plan = select(Problem.dense(M, N, K, "ieee", batch=batch, b_t=True), DEV["sm_90"])
    assert plan.kernel.family == "simt_cp_async" and plan.kernel.tile[:2] == tile, plan.describe()
    check_geometry(plan)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fp32_products_of_17_to_32_rows_on_w_t_run_the_32_row_simt_tile(arch):
    """ieee and tf32x3 (which these kernels serve in fp32) at 17-32 rows of x @ W.t(): the 32 x 128
    SIMT tile (4 x 8 outputs a thread) split along K, ahead of skinny_kmajor, whose rows per
    thread double past 16 (H200: 1.1-1.5x on six weights, NOTES run 26). 16 rows, a row-major W,
    a batch, 33 rows and tf32 requests keep their families."""
    dev = DEV[arch]
    for M in (17, 24, 32):
        for precision in ("ieee", "tf32x3"):
            plan = select(Problem.dense(M, 3584, 18944, precision, b_t=True), dev)
            m = macros(plan)
            assert plan.kernel.family == "simt_cp_async" and plan.precision_used == "ieee", plan.describe()
            assert m["THREAD_M"] == 4 and plan.kernel.tile[:2] == (32, 128) and plan.kernel.split_k > 1
            assert "4x8 outputs per thread" in plan.describe()
            check_geometry(plan)
    assert select(Problem.dense(16, 3584, 18944, "ieee", b_t=True), dev).kernel.family == "skinny_kmajor"
    assert select(Problem.dense(32, 3584, 18944, "ieee"), dev).kernel.family == "skinny"
    assert select(Problem.dense(32, 512, 2048, "ieee", batch=3, b_t=True), dev).kernel.family in ("skinny_kmajor", "skinny")
    over = select(Problem.dense(33, 3584, 18944, "ieee", b_t=True), dev)
    assert over.kernel.family == "simt_cp_async" and macros(over)["THREAD_M"] != 4
    assert select(Problem.dense(32, 3584, 512, "ieee", b_t=True), dev).kernel.family == "skinny_kmajor"  # short K
    assert select(Problem.dense(32, 1001, 8192, "ieee", b_t=True), dev).kernel.family == "skinny_kmajor"  # narrow W
    assert select(Problem.dense(32, 3584, 18944, "tf32", b_t=True), dev).precision_used == "tf32"


@pytest.mark.parametrize("M,N,K,layout,want", [
    (80, 4096, 4096, "b_t", (128, 4)),  # 39.8 -> 31.6 us on the H200
    (200, 2048, 16384, "b_t", (128, 4)),  # 112.3 -> 66.0
    (96, 4096, 4096, "b_t", (128, 4)),  # 33.7 -> 32.5
    (512, 4096, 4096, "b_t", None),  # 128 tiles of 128 x 128: unsplit 51.4, 2 slices 68.9
    (333, 4096, 4096, "b_t", None),  # 96 tiles: unsplit 49.0, 256/2 62.9
    (511, 1536, 8960, "", None),  # swapped: 48 tiles; every split 17-60% slower
    (1024, 768, 3072, "", None),
    (768, 2304, 4096, "a_t", None),
    (256, 256, 65536, "", None),  # 4 tiles x 16 slices: too few blocks, tf32_mma's deeper split
    (32, 4096, 16384, "", None),  # row-major W at 32 rows: C^T is 4096 x 32, decode: the skinny family's
])
def test_tf32_products_of_more_than_64_rows_split_k_on_wgmma_only_where_few_tiles_run(M, N, K, layout, want):
    """Above 64 rows the wgmma split takes the 128-wide tile only, where its tiles fill at most a
    quarter of the SMs (and the (tile, slice) blocks half), and N >= M, N >= 128 in the kernel's
    terms: measured faster there, and slower by 8-60% on every product whose 48-128 tiles already
    ran (NOTES run 26); a row-major W's decode product (tall and narrow as C^T) stays skinny's."""
    kw = {layout: True} if layout else {}
    plan = select(Problem.dense(M, N, K, "tf32", **kw), DEV["sm_90"])
    if want is None:
        assert plan.kernel.split_k == 1 or plan.kernel.family != "wgmma_tf32", plan.describe()
        if M <= 32:
            assert plan.kernel.family == "skinny", plan.describe()
    else:
        assert plan.kernel.family == "wgmma_tf32" and (plan.kernel.tile[1], plan.kernel.split_k) == want, plan.describe()
        assert plan.kernel.split_fused and plan.reduce is None
    check_geometry(plan)


def test_the_32x128_tile_runs_4_blocks_an_sm_where_that_doubles_the_slices_of_few_tiles():
    """Built for 4 blocks an SM (CP_MIN_BLOCKS 4: 128 registers) and split for them where its tiles
    leave SMs idle and that doubles the slices (H200: 5-11% faster); elsewhere no bound (the cap
    cost 3% where the slices stayed, and at 393 tiles twice the slices lost 6-10%), nor for an
    unsplit (tuned) plan."""
    dev = DEV["sm_90"]
    for N, K, bound, split in ((3584, 18944, 4, 18), (4096, 4096, 4, 16), (14336, 4096, None, 7), (50257, 768, None, 2)):
        plan = select(Problem.dense(32, N, K, "ieee", b_t=True), dev)
        assert plan.kernel.tile[:2] == (32, 128), plan.describe()
        assert macros(plan).get("CP_MIN_BLOCKS") == bound and plan.kernel.split_k == split, (N, K, plan.describe())
        check_geometry(plan)
    assert select(Problem.dense(32, 3584, 18944, "ieee", b_t=True), dev,
                  variants=(SimtCpAsync(short_min_blocks=0),)).kernel.split_k == 9
    unsplit = select(Problem.dense(32, 3584, 18944, "ieee", b_t=True), dev, tuned=TunedChoice("simt_cp_async", (2, 2, 4, 0)))
    assert unsplit.kernel.split_k == 1 and "CP_MIN_BLOCKS" not in macros(unsplit)
    # measured on the H200 only (and at 128 registers ptxas spills some load modes for sm_86)
    for arch in ("sm_80", "sm_86", "sm_89"):
        assert "CP_MIN_BLOCKS" not in macros(select(Problem.dense(32, 3584, 18944, "ieee", b_t=True), DEV[arch]))


@pytest.mark.parametrize("M, N, K, batch, a_t, want", [
    (512, 64, 512, 128, True, (2, 1, 16)),  # attention's dV = P^T dO, heads of 64: 512 tiles
    (1024, 64, 1024, 128, True, (2, 1, 16)),
    (512, 48, 512, 128, True, (2, 1, 16)),  # narrower heads too
    (512, 64, 512, 128, False, (2, 1, 16)),  # P.V: A's rows k-contiguous (single-float copies, chained)
    (1024, 64, 1024, 128, False, (2, 1, 16)),
    (197, 64, 197, 768, False, None),  # k-contiguous A with an edge tile of rows (ViT's P.V): it lost 25%
    (384, 64, 512, 256, False, None),  # k-contiguous A, M a multiple of 128, but 768 blocks: their
    # second wave of 528 slots 45% full (NARROW_MIN_WAVE_FILL)
    (384, 64, 384, 192, False, None),  # BERT's P.V, 576 blocks: 162.0 us narrow, 102.8 on 64 x 64 (run 33)
    (384, 64, 512, 176, False, (2, 1, 16)),  # 528 blocks: one whole wave
    (256, 64, 256, 64, True, None),  # 128 tiles, under 3 an SM: it lost 50% there
    (197, 64, 197, 768, True, None),  # M % 4 != 0: A is not read as float4, so no narrow tile
    (384, 64, 512, 176, True, (2, 1, 16)),  # 384 rows: 128-row tiles pad no more than 64-row ones
    (448, 64, 512, 132, True, None),  # 448 rows: they would (512 against 448)
    (512, 65, 512, 128, True, None),  # more than 64 columns
])
def test_narrow_simt_tiles_take_products_of_at_most_64_columns(M, N, K, batch, a_t, want):
    """The 128 x 64 tile of 16 x 8 outputs a thread (2 warps, one warp column) where N <= 64, A is
    copied as float4 along m or in single floats along k (not single floats along m), its tiles
    number 3 an SM or more and pad M no more than 64-row tiles, with single-float copies along
    k, M is a multiple of 128 (NARROW_* in families/simt_cp_async.py, measured on the H200: NOTES
    runs 30-31), and its blocks fill their last wave of 4 an SM to 90% (NOTES run 33). The tuner
    is offered both narrow tiles either way."""
    p = Problem.dense(M, N, K, "ieee", batch=batch, a_t=a_t)
    plan = select(p, DEV["sm_90"])
    assert plan.kernel.family == "simt_cp_async", plan.describe()
    m = macros(plan)
    if want is not None:
        assert (m["WARPS_M"], m["WARPS_N"], m["THREAD_M"]) == want, plan.describe()
    else:  # a tile of tile_options (more than one warp column)
        assert m["WARPS_N"] > 1, plan.describe()
    fam = FAMILIES["simt_cp_async"]
    offered = {o[:3] for o in fam.options(p, DEV["sm_90"])}
    narrow = N <= 64 and fam.load_modes(p)[0] in (LOAD_VEC_FAST, LOAD_ELEM_K)
    assert ({(4, 1, 16), (2, 1, 16)} <= offered) == narrow and ({(4, 1, 16), (2, 1, 16)} & offered == set()) == (not narrow)
    check_geometry(plan)


@pytest.mark.parametrize("M,N,K,kw,tile,split", [
    (300, 700, 1100, {"b_t": True}, (64, 64), 8),   # 22.6 us, the best of 11 splits (4 slices: 26.1)
    (60, 2048, 2048, {"b_t": True}, (64, 64), 16),  # 21.6, the best (8: 22.9)
    (1000, 256, 1024, {"b_t": True}, (64, 64), 8),  # 22.4, the best (4: 26.0)
    (64, 4096, 4096, {"b_t": True}, (64, 64), 8),   # 65.0, the best (4: 71.4)
    (1000, 1000, 1000, {}, (128, 64), 3),           # 60.6, the best (2: 62.3)
])
def test_the_split_model_counts_the_8x8_tiles_blocks_an_sm_as_built_up_to_four_on_sm90(M, N, K, kw, tile, split):
    """simt_cp_async's split-K wave model counts the 64 x 64 tile 4 blocks an SM (built for 6) and
    the 128 x 64 one 3 (built for 3) on sm_90, where it counted 2 for both; each case a product
    swept over 1-16 slices on the H200 (probes/simt_split_probe.py, NOTES run 33). Elsewhere, and
    with small_tile_slots off, the plans are as before; the kernels are built as before (no
    CP_MIN_BLOCKS). The rules alone (see RULES)."""
    fam = RULES[0]
    p = Problem.dense(M, N, K, "ieee", **kw)
    assert [fam.default_blocks_per_sm(o) for o in ((1, 2, 8), (2, 2, 8))] == [6, 3]
    assert [fam.blocks_per_sm(o, p, DEV["sm_90"]) for o in ((1, 2, 8), (2, 2, 8))] == [4, 3]
    plan = select(p, DEV["sm_90"], variants=RULES)
    assert plan.kernel.family == "simt_cp_async" and plan.kernel.tile[:2] == tile, plan.describe()
    assert max(plan.kernel.split_k, plan.kernel.split_slices) == split, plan.describe()
    assert "CP_MIN_BLOCKS" not in macros(plan)
    check_geometry(plan)
    old = dataclasses.replace(fam, small_tile_slots=False)
    before = select(p, DEV["sm_90"], variants=(old,))
    assert before.kernel.split_slices < split or before.kernel.tile[:2] != tile, before.describe()
    for arch in ("sm_80", "sm_86", "sm_89"):
        assert [fam.blocks_per_sm(o, p, DEV[arch]) for o in ((1, 2, 8), (2, 2, 8))] == [2, 2]
        now, then = select(p, DEV[arch]).kernel, select(p, DEV[arch], variants=(old,)).kernel
        assert (now.macros, now.grid, now.split_k) == (then.macros, then.grid, then.split_k)


def test_the_largest_simt_tile_split_never_computes_four_times_the_columns():
    """8192 x 64 x 1024 on W^T (a 64-wide projection): the 128 x 256 tile split along K covered 4x
    the outputs of the 64 x 64 tile (104.4 us against 41.8 on the H200, NOTES run 30); the
    largest tile replaces an 8 x 8 tile's choice only where it covers at most PAD_SLACK x its
    area. 128 x 11008 x 4096 (decode128, where it was measured 12% faster) still takes it."""
    narrow = select(Problem.dense(8192, 64, 1024, "ieee", b_t=True), DEV["sm_90"])
    assert narrow.kernel.family == "simt_cp_async" and narrow.kernel.tile[:2] == (64, 64), narrow.describe()
    assert narrow.kernel.split_k == 4  # (2 before run 33's slot count: 42.3 us, 4 slices 39.7)
    wide = select(Problem.dense(128, 11008, 4096, "ieee", b_t=True), DEV["sm_90"])
    assert wide.kernel.tile[:2] == (128, 256) and wide.kernel.split_k > 1, wide.describe()


def test_simt_short_tiles_are_offered_only_where_their_copies_fit():
    """The 32-row tiles split their operand copies over 128-256 threads: an m-contiguous A read
    as float4 (64 units a k-tile) cannot be, so neither the heuristic nor the tuner gets them there
    (tests/test_compile.py checks copies_fit against the compiler); nor above 64 rows."""
    fam = FAMILIES["simt_cp_async"]
    x = Problem.dense(24, 4096, 4096, "ieee", b_t=True)
    assert {(2, 4, 4, 1), (2, 2, 4, 1)} <= set(fam.options(x, DEV["sm_90"]))
    x_t = Problem.dense(24, 4096, 4096, "ieee", a_t=True)  # A m-contiguous, M % 4 == 0: float4 along m
    assert fam.load_modes(x_t)[0] == LOAD_VEC_FAST
    assert not fam.short_tiles(x_t) and fam.short_tile(x_t) is None
    assert macros(forced(x_t, "sm_90", "simt_cp_async"))["THREAD_M"] == 8
    assert not fam.short_tiles(Problem.dense(65, 4096, 4096, "ieee", b_t=True))


def test_tf32_mma_tiles_fit_each_device_and_a_device_too_small_is_refused_with_the_reason():
    fam = FAMILIES["tf32_mma"]
    for arch in SM80_PLUS:
        dev = DEV[arch]
        for x3 in (False, True):
            options = fam.tile_options(x3, dev)
            assert options and all(2 * fam.stage_bytes_max(o[0] * 64, o[1] * o[2]) <= dev.smem_per_block_optin
                                   for o in options), (arch, x3)
    assert (2, 4, 64) in fam.tile_options(False, DEV["sm_90"]) and (2, 4, 64) not in fam.tile_options(False, DEV["sm_86"])
    tiny = dataclasses.replace(DEV["sm_90"], smem_per_block_optin=32 * 1024)
    plan = select(Problem.dense(1024, 1024, 1024, precision="tf32"), tiny)
    assert rejected(plan)["tf32_mma"] == "no tile fits 32 KiB of shared memory per block"
    # split-K (k_dominant) prefers 128 x 128; where that does not fit, the largest that does
    small = dataclasses.replace(DEV["sm_80"], smem_per_block_optin=64 * 1024)
    m = macros(select(Problem.dense(256, 256, 65536, precision="tf32"), small, force="tf32_mma"))
    assert (m["WARPS_M"], m["WARPS_N"], m["WARP_N"]) == (1, 2, 64)
    m = macros(forced(Problem.dense(256, 256, 65536, precision="tf32"), "sm_90", "tf32_mma"))
    assert (m["WARPS_M"], m["WARPS_N"], m["WARP_N"]) == (2, 2, 64)


@pytest.mark.parametrize("arch", SM80_PLUS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_long_k_with_a_small_output_splits_on_every_sm80_plus_arch(arch, precision):
    p = Problem.dense(256, 256, 65536, precision=precision)
    plan = select(p, DEV[arch])
    fp32 = precision == "ieee" or x3_goes_to_fp32(p, DEV[arch])
    assert plan.kernel.family == ("simt_cp_async" if fp32 else "tf32_mma")
    assert plan.kernel.split_k > 1 and plan.reduce is not None


def test_tile_choice_takes_a_tile_whose_blocks_fill_90_percent_of_a_wave():
    dev = DEV["sm_90"]  # 132 SMs: 0.9 x 132 = 118.8 blocks
    # tf32x3 on mma.sync (tiles of 128 x 64 at most): 11 x 11 = 121 tiles reach 90% of a wave,
    # 11 x 10 = 110 do not
    assert select(Problem.dense(1408, 704, 1408, precision="tf32x3"), dev, force="tf32_mma").kernel.tile[:2] == (128, 64)
    smaller = select(Problem.dense(1408, 640, 1408, precision="tf32x3"), dev, force="tf32_mma").kernel.tile
    assert smaller[0] * smaller[1] < 128 * 64
    # tf32 on wgmma under run 18's rule (the variant tile_rule="fill"): 128 x 256 tiles, then 128 x 128
    fill = (WgmmaTf32(tile_rule="fill"),)
    assert select(Problem.dense(1408, 2816, 1408, precision="tf32"), dev, variants=fill).kernel.tile[:2] == (128, 256)
    assert select(Problem.dense(1280, 2816, 1408, precision="tf32"), dev, variants=fill).kernel.tile[:2] == (128, 128)
    # SIMT's rules (RULES: without the mid-size split model): 128 x 256 tiles; 11 x 11 = 121 of
    # them, then 10 x 11 = 110
    assert select(Problem.dense(1408, 2816, 1024), dev, variants=RULES).kernel.tile[:2] == (128, 256)
    smaller = select(Problem.dense(1280, 2816, 1024), dev, variants=RULES).kernel.tile
    assert smaller[0] * smaller[1] < 128 * 256


def _idle_splits(plan) -> int:
    """Block rows of a split-K launch that common.cuh's split_range gives no k-tile at all."""
    total = -(-plan.problem.K // plan.kernel.tile[2])
    split = plan.kernel.split_k
    per = -(-total // split)
    return sum(1 for y in range(split) if y * per >= total)




@pytest.mark.parametrize("family", ["skinny", "skinny_kmajor", "simt_cp_async", "tf32_mma"])
def test_every_planned_k_split_gets_k_work(family):
    idle = []
    for arch in ARCHS:
        for M in (1, 8, 16, 32, 64, 256):
            for N in (1000, 1024, 4096, 11008):
                for K in (1000, 4096, 8192, 65536, 100_003):
                    for precision in PRECISIONS:
                        try:
                            plan = select(Problem.dense(M, N, K, precision=precision, b_t=family == "skinny_kmajor"),
                                          DEV[arch], force=family)  # (skinny_kmajor: B^T, its layout)
                        except ValueError:
                            continue
                        if _idle_splits(plan):
                            idle.append((arch, M, N, K, precision, plan.kernel.split_k, _idle_splits(plan)))
    assert not idle, f"{len(idle)} plans with idle splits, e.g. {idle[:4]}"


# --- the skinny family: M <= 32 ------------------------------------------------------------------

SKINNY_MS = (1, 2, 3, 8, 9, 16, 17, 31, 32)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("M", SKINNY_MS)
def test_m_up_to_32_picks_skinny_on_every_arch_and_precision(arch, precision, M):
    for N, K, kw in ((4096, 4096, {}), (1025, 7, {}), (1100, 1, {}), (11008, 4096, {"b_t": True}),
                     (2000, 300, {"a_t": True, "align": 4}), (4096, 4096, {"batch": 3})):
        p = Problem.dense(M, N, K, precision=precision, **kw)
        assert M * N > TINY_OUTPUTS
        plan = select(p, DEV[arch])
        if short_rows_first(p, FAMILIES["simt_cp_async"]) and arch != "sm_75":
            # (fp32 x @ W.t() at 17-32 rows: the 32-row SIMT tile, its own test below)
            assert plan.kernel.family == "simt_cp_async" and macros(plan)["THREAD_M"] == 4, (N, K, kw)
            continue
        if arch == "sm_90" and precision == "tf32" and kw.get("b_t") and M >= 17 and N >= 4096 and K >= 2048:
            # (tf32 x @ W.t() from 17 rows: wgmma's 64-row tile, its own test)
            assert plan.kernel.family == "wgmma_tf32" and plan.kernel.tile[0] == 64, (N, K, kw)
            continue
        # B^T (x @ W.t()) is skinny_kmajor's on sm80+ (kmajor_mma's for tf32 at 8-32 rows); every
        # other layout, and sm75, skinny's
        family = skinny_family(p, DEV[arch])
        assert family == ("skinny" if not kw.get("b_t") or arch == "sm_75" else
                          "kmajor_mma" if precision == "tf32" and 8 <= M <= 32 else "skinny_kmajor")
        assert plan.kernel.family == family, (N, K, kw)
        assert plan.precision_used == ("tf32" if family == "kmajor_mma" else "ieee")  # else fp32 FFMA
        assert plan.describe().startswith(f"kernel: {family} (fastmm_{family} in cuda_src/{family}.cu): tile ")
        reasons = rejected(plan)
        assert reasons["scalar"] == reasons["simt_float4"] == f"{family} is preferred"
        for name in ("simt_cp_async", "tf32_mma"):
            if arch == "sm_75" and not (name == "tf32_mma" and precision == "ieee"):
                assert reasons[name] == "needs sm80+, device is sm_75"
            elif name == "tf32_mma" and precision == "ieee":
                assert reasons[name] == "does not compute precision 'ieee'"
            else:
                assert reasons[name] == not_chosen_reason(name, p, DEV[arch], family)
        if arch == "sm_75":
            assert reasons["skinny_kmajor"] == "needs sm80+, device is sm_75"
        elif family == "kmajor_mma":
            assert reasons["skinny"] == reasons["skinny_kmajor"] == "kmajor_mma is preferred"
        elif family == "skinny_kmajor":
            assert reasons["skinny"] == "skinny_kmajor is preferred"
        else:
            assert reasons["skinny_kmajor"] == "B is not K-contiguous (its rows along N are the skinny family's)"
        check_geometry(plan)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_m_33_does_not_pick_skinny(arch, precision):
    p = Problem.dense(33, 4096, 4096, precision=precision)
    plan = select(p, DEV[arch])
    assert plan.kernel.family not in ("skinny", "skinny_kmajor")
    assert rejected(plan)["skinny"] == "M = 33 > 32: not skinny"
    # B^T: skinny_kmajor's layout, but 33 rows are too many for it too
    bt = select(Problem.dense(33, 4096, 4096, precision=precision, b_t=True), DEV[arch])
    assert bt.kernel.family not in ("skinny", "skinny_kmajor")
    assert rejected(bt)["skinny_kmajor"] == ("needs sm80+, device is sm_75" if arch == "sm_75"
                                             else "M = 33 > 32: not skinny")
    with pytest.raises(ValueError, match="kernel family 'skinny' cannot run this problem: M = 33 > 32: not skinny"):
        select(p, DEV[arch], force="skinny")


#: The v1 skinny kernel on every arch, as a variant handed to the planner (v2, sm_90's default,
#: has its own tests in test_skinny_v2.py, and test_random_problems_keep_every_invariant covers both).
SKINNY_V1 = (Skinny(variant="v1"),)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("M,mt", [(1, 8), (3, 8), (8, 8), (9, 16), (16, 16), (17, 32), (31, 32), (32, 32)])
def test_skinny_rows_per_thread_macro_is_m_rounded_up(arch, M, mt):
    for N in (1100, 4096, 4099):
        plan = forced(Problem.dense(M, N, 4096), arch, "skinny", SKINNY_V1)
        m, cfg = macros(plan), plan.kernel
        assert m["MT"] == mt
        assert cfg.tile == (mt, 128, 128 if mt == 32 else 256)  # skinny.cu: COLS 128, KCHUNK
        assert cfg.block_dims == (256, 1, 1) and cfg.smem == 0
        assert cfg.grid[0] == -(-N // 128)
        assert dict(cfg.details)["rows per thread"] == f"{mt} (M = {M})"


@pytest.mark.parametrize("arch", ARCHS)
def test_skinny_b_vec_only_for_aligned_n_contiguous_b(arch):
    def b_vec(p):
        plan = forced(p, arch, "skinny", SKINNY_V1)
        m, d = macros(plan), dict(plan.kernel.details)
        assert d["B loads"] == ("float4, each element once" if m["B_VEC"] else "single floats, each element once")
        return m["B_VEC"]

    assert b_vec(Problem.dense(16, 4096, 4096)) == 1
    assert b_vec(Problem.dense(16, 4096, 4095)) == 1  # K plays no part: B is read along N
    for N in (4097, 4098, 4099):  # N % 4 != 0
        assert b_vec(Problem.dense(16, N, 4096)) == 0, N
    for align in (4, 8):  # storage offsets 1, 2, 3 floats
        assert b_vec(Problem.dense(16, 4096, 4096, align=align)) == 0, align
    base = Problem.dense(16, 4096, 4096)
    assert b_vec(dataclasses.replace(base, a_align=4, c_align=4)) == 1  # only B's pointer matters
    assert b_vec(Problem.dense(16, 4096, 4096, b_t=True)) == 0  # k-contiguous B: no float4 along N
    assert b_vec(Problem.dense(16, 4096, 4096, a_t=True)) == 1
    for pad, vec in ((4, 1), (1, 0), (2, 0)):  # B = x[:, :N] of a wider tensor
        assert b_vec(dataclasses.replace(base, b_strides=(4096 + pad, 1))) == vec, pad
    assert b_vec(dataclasses.replace(base, b_strides=(2 * 4096, 2))) == 0  # no unit stride
    batched = Problem.dense(16, 4096, 4096, batch=3)
    assert b_vec(batched) == 1
    assert b_vec(dataclasses.replace(batched, b_batch_strides=(0, 4096 * 4096 + 2))) == 0
    assert b_vec(dataclasses.replace(batched, b_batch_strides=(0, 0))) == 1  # broadcast B


#: v1 skinny splits of 4096 columns (32 tiles of 128) for K of 16 chunks (K = 4096, 256-k chunks)
#: and of 128 chunks (M = 32: 16384 in 128-k chunks), per arch: about two waves of one-per-SM
#: blocks, ceil(2 x SMs / 32), reduced to the rows that get chunks (hand-computed: sm_90 has
#: 132 SMs, 264 / 32 -> 9 splits; 16 chunks dealt 2 a row fill 8 rows; 128 dealt 15 a row fill 9).
SKINNY_V1_SPLITS = {"sm_75": (3, 3), "sm_80": (6, 7), "sm_86": (6, 6), "sm_89": (8, 9), "sm_90": (8, 9)}


@pytest.mark.parametrize("arch", ARCHS)
def test_skinny_splits_k_for_a_batch_of_1_with_long_k(arch):
    dev = DEV[arch]
    for M, K, kchunk, split in ((1, 4096, 256, SKINNY_V1_SPLITS[arch][0]), (16, 4096, 256, SKINNY_V1_SPLITS[arch][0]),
                                (32, 16384, 128, SKINNY_V1_SPLITS[arch][1])):
        plan = select(Problem.dense(M, 4096, K), dev, variants=SKINNY_V1)
        cfg = plan.kernel
        assert cfg.family == "skinny" and cfg.tile[2] == kchunk
        tiles = 4096 // 128
        assert cfg.split_k == split and cfg.grid == (tiles, split, 1)
        assert plan.reduce is not None and plan.reduce.family == "splitk_reduce"
        assert dict(cfg.details)["split-K"] == f"{cfg.split_k} slices of K, reduced by splitk_reduce"
        assert f"then: {plan.reduce.describe()}" in plan.describe()
        check_geometry(plan)
        # not for a batch, broadcast or not
        for p in (Problem.dense(M, 4096, K, batch=2),
                  dataclasses.replace(Problem.dense(M, 4096, K, batch=3), a_batch_strides=(0, 0))):
            plan = select(p, dev, variants=SKINNY_V1)
            assert plan.kernel.family == "skinny" and plan.kernel.split_k == 1 and plan.reduce is None
            assert plan.kernel.grid == (tiles, 1, p.batch_total)
    # one k-chunk: nothing to split
    assert select(Problem.dense(16, 4096, 256), dev, variants=SKINNY_V1).kernel.split_k == 1
    assert select(Problem.dense(32, 4096, 128), dev, variants=SKINNY_V1).kernel.split_k == 1
    assert select(Problem.dense(32, 4096, 129), dev, variants=SKINNY_V1).kernel.split_k == 2
    # columns enough for two waves of 256-thread blocks on their own: no split
    wide = select(Problem.dense(16, 2 * dev.sm_count * 128, 65536), dev, variants=SKINNY_V1).kernel
    assert wide.family == "skinny" and wide.split_k == 1
    # one tile of columns, very long K: capped at MAX_SPLIT
    assert select(Problem.dense(16, 128 * 9, 1 << 20), dev, variants=SKINNY_V1).kernel.split_k <= MAX_SPLIT
    assert forced(Problem.dense(16, 128, 1 << 20), arch, "skinny", SKINNY_V1).kernel.split_k == MAX_SPLIT


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
def test_skinny_serves_tf32_requests_at_fp32(precision):
    plan = select(Problem.dense(8, 4096, 4096, precision=precision), DEV["sm_90"])
    assert plan.kernel.family == "skinny" and plan.precision_used == "ieee"
    assert "fp32 FFMA" in dict(plan.kernel.details)["math"]
    # the tensor-core family still runs it when forced, at the precision asked for
    plan = select(Problem.dense(8, 4096, 4096, precision=precision), DEV["sm_90"], force="tf32_mma")
    assert plan.precision_used == precision


def _empty_params():
    for mnk in ((0, 64, 64), (16, 0, 64), (16, 64, 0), (0, 0, 0)):
        for family in sorted(FAMILIES):
            yield pytest.param(mnk, family, id=f"{'x'.join(map(str, mnk))}-{family}")


@pytest.mark.parametrize("mnk,family", list(_empty_params()))
def test_problems_with_no_elements_get_a_plan_or_a_value_error(mnk, family):
    """explain() plans problems whose result is empty (api launches nothing for them): the
    dispatcher and every forced family must give a valid plan or refuse with ValueError."""
    for arch in ARCHS:
        for precision in PRECISIONS:
            p = Problem.dense(*mnk, precision=precision)
            assert select(p, DEV[arch]).kernel.family == "scalar"  # tiny: M * N = 0
            try:
                plan = select(p, DEV[arch], force=family)
            except ValueError:
                continue
            assert plan.kernel.family == family and all(g >= 1 for g in plan.kernel.grid)


def test_skinny_needs_sm75():
    assert FAMILIES["skinny"].min_cc == (7, 5) == MIN_CC
    sm72 = dataclasses.replace(DEV["sm_75"], cc=(7, 2), name="simulated Xavier")
    assert FAMILIES["skinny"].reject(Problem.dense(16, 4096, 4096), sm72) == "needs sm75+, device is sm_72"



def test_large_problems_get_the_largest_tile_and_small_ones_a_small_tile():
    big = select(Problem.dense(8192, 8192, 4096), DEV["sm_90"]).kernel
    small = select(Problem.dense(256, 256, 512), DEV["sm_90"]).kernel
    assert big.tile[0] * big.tile[1] > small.tile[0] * small.tile[1]
    assert big.tile[:2] == (128, 256)
    # a batch fills the device just as more tiles do
    batched = select(Problem.dense(256, 256, 512, batch=64), DEV["sm_90"]).kernel
    assert batched.tile[0] * batched.tile[1] > small.tile[0] * small.tile[1]
    tbig = select(Problem.dense(8192, 8192, 4096, precision="tf32"), DEV["sm_90"]).kernel
    tsmall = select(Problem.dense(256, 256, 512, precision="tf32"), DEV["sm_90"]).kernel
    assert tbig.tile[0] * tbig.tile[1] > tsmall.tile[0] * tsmall.tile[1]


def test_select_is_pure():
    p = Problem.dense(1000, 1000, 1000, precision="tf32")
    assert select(p, DEV["sm_90"]) == select(p, DEV["sm_90"])
    assert hash(p) == hash(Problem.dense(1000, 1000, 1000, precision="tf32"))


def test_simulated_devices_report_their_arch():
    for arch in ARCHS:
        assert DEV[arch].arch == arch and DEV[arch].simulated
    with pytest.raises(KeyError):
        DeviceFacts.simulated_device("sm_100")


def test_problem_layouts_read_as_expected():
    p = Problem.dense(8, 16, 32, a_t=True)
    assert p.a_strides == (1, 8) and p.layout_of("a") == "column-major"
    assert p.b_strides == (16, 1) and p.layout_of("b") == "row-major"
    assert Problem(8, 16, 32, (64, 2), (16, 1), (16, 1)).layout_of("a") == "strided"


# --- property test: invariants on random problems -------------------------------------------------

def _vector_ok(extent: int, other_stride: int, batch_strides, align: int) -> bool:
    return align == 16 and extent % 4 == 0 and other_stride % 4 == 0 and all(s % 4 == 0 for s in batch_strides)


@st.composite
def problems(draw):
    M = draw(st.one_of(st.integers(1, 40), st.integers(1, 3000)))  # often skinny (M <= 32), or just above
    N, K = (draw(st.integers(1, 3000)) for _ in range(2))

    def operand(rows, cols):
        kind = draw(st.sampled_from(["row", "col", "rowpad", "colpad", "none"]))
        pad = draw(st.integers(1, 7))
        return {"row": (cols, 1), "col": (1, rows), "rowpad": (cols + pad, 1), "colpad": (1, rows + pad),
                "none": (2 * cols, 2)}[kind]

    batch = draw(st.sampled_from([1, 1, 3, 200, 70_000]))
    inner = draw(st.sampled_from([1, batch]))
    align = [draw(st.sampled_from([4, 8, 16])) for _ in range(3)]
    bstride = [draw(st.sampled_from([0, M * K, M * K + 1])), draw(st.sampled_from([0, K * N, K * N + 2]))]
    return Problem(M, N, K, operand(M, K), operand(K, N), (N, 1), inner, batch, (0, bstride[0]), (0, bstride[1]),
                   (0, M * N), *align, draw(st.sampled_from(PRECISIONS)))


@settings(max_examples=400, deadline=None)
@given(p=problems(), arch=st.sampled_from(ARCHS), force=st.sampled_from([None, *FAMILIES]))
def test_random_problems_keep_every_invariant(p, arch, force):
    dev = DEV[arch]
    try:
        plan = select(p, dev, force=force)
    except ValueError as exc:
        assert force is not None and force in str(exc)
        return
    asked = p  # (the family is chosen for the problem asked; p becomes the launch problem below)
    if plan.kernel.family == "wgmma_tf32" and plan.launch_problem is not None:
        # K-major copies for the tensor maps: A as M x K4, B transposed as N x K4
        # (one per matrix of the operand's batch), or one copy and the other operand in place
        k4 = -(-p.K // 4) * 4
        assert set(plan.staging) <= {("a", p.M, k4), ("bt", p.N, k4)}
        lp, wg = plan.launch_problem, FAMILIES["wgmma_tf32"]
        assert wg.b_ready(lp) and (wg.a_ready(lp) or (wg.a_mn_ready(lp) and p.precision == "tf32"))
        assert (lp.M, lp.N) == ((p.N, p.M) if plan.swap_ab else (p.M, p.N))
        p = lp
    elif plan.staging:
        # the kernel reads the padded, aligned copies: its load modes are checked against them
        assert plan.kernel.family in ("simt_cp_async", "tf32_mma") and p.batch_total == 1
        staged = plan.launch_problem
        assert (staged.M, staged.N, staged.K, staged.c_strides) == (p.M, p.N, p.K, p.c_strides)
        for which, rows, cols in plan.staging:
            n = p.N if which == "b" else p.K
            assert cols == -(-n // 4) * 4 and rows == (p.K if which == "b" else p.M)
        p = dataclasses.replace(staged, N=-(-p.N // 4) * 4 if staged.b_padded else p.N)
        if staged.a_padded:
            p = dataclasses.replace(p, K=-(-p.K // 4) * 4)
    cfg = plan.kernel
    assert cfg is not None
    assert force is None or cfg.family == force
    if dev.cc < (8, 0):
        assert cfg.family in ("scalar", "simt_float4", "skinny")
    if p.precision == "ieee":
        assert cfg.family != "tf32_mma"
    if force is None and is_tiny(asked):
        assert cfg.family == "scalar"
    elif force is None and asked.M <= SKINNY_MAX_M:  # a skinny family takes every non-tiny problem of at most 32 rows
        assert cfg.family == skinny_family(asked, dev)
    elif force is None:
        assert cfg.family not in ("skinny", "skinny_kmajor")
    assert plan.precision_used == (p.precision if cfg.family in ("tf32_mma", "wgmma_tf32", "kmajor_mma") else "ieee")
    check_geometry(plan)
    m = dict(cfg.macros)
    if cfg.family == "wgmma_tf32":  # reads its operands through tensor maps (p: the launch problem)
        assert p.precision in ("tf32", "tf32x3") and dev.cc == (9, 0)
        assert m["PRECISION_X3"] == int(p.precision == "tf32x3")
        if m["A_MN"]:  # m-contiguous A, fed from registers (tf32 only)
            assert p.precision == "tf32" and p.a_strides[0] == 1 and p.a_strides[1] % 4 == 0 and p.a_align >= 16
        else:
            assert p.a_strides[1] == 1 and p.a_strides[0] % 4 == 0 and p.a_align >= 16
        assert p.b_strides[0] == 1 and p.b_strides[1] % 4 == 0 and p.b_align >= 16
        assert all(s % 4 == 0 for s in p.a_batch_strides + p.b_batch_strides)
        if m["C_VEC"] == 1:  # float2 along n
            assert p.c_strides[1] == 1 and p.N % 2 == 0 and p.c_strides[0] % 2 == 0 and p.c_align >= 8
        elif m["C_VEC"] == 2:  # float2 over A_MN's adjacent row pairs
            assert m["A_MN"] and p.c_strides[0] == 1 and p.c_strides[1] % 2 == 0 and p.c_align >= 8
    (sAm, sAk), (sBk, sBn), (sCm, sCn) = p.a_strides, p.b_strides, p.c_strides
    if cfg.split_k > 1:
        assert p.batch_total == 1
    if cfg.family == "skinny_kmajor":  # float4 along K: rows (W's and A's) 16 bytes apart, unless one
        assert p.M <= SKINNY_MAX_M and sBk == 1
        assert m["B_VEC"] == int(_vector_ok(p.K, sBn if p.N > 1 else 0, p.b_batch_strides, p.b_align))
        assert m["A_VEC"] == int(sAk == 1 and _vector_ok(p.K, sAm if p.M > 1 else 0, p.a_batch_strides, p.a_align))
    elif cfg.family == "kmajor_mma":  # float4 along K for both, or for neither
        a_vec = sAk == 1 and _vector_ok(p.K, sAm if p.M > 1 else 0, p.a_batch_strides, p.a_align)
        b_vec = _vector_ok(p.K, sBn if p.N > 1 else 0, p.b_batch_strides, p.b_align)
        assert p.M <= 32 and sBk == 1 and m["B_VEC"] == m["A_VEC"] == int(a_vec and b_vec)
    elif cfg.family == "skinny" and m.get("SK_V2"):
        assert dev.cc in Skinny.V2_BY_CC
        assert p.M <= SKINNY_MAX_M and m["MT"] == max(4, -(-p.M // 4) * 4)  # (M = 0 too: skinny.cu needs 4..32)
        assert m["B_VEC"] == int(sBn == 1 and _vector_ok(p.N, sBk, p.b_batch_strides, p.b_align))
    elif cfg.family == "skinny":
        assert p.M <= SKINNY_MAX_M and m["MT"] == min(mt for mt in (8, 16, 32) if mt >= p.M)
        assert m["B_VEC"] == int(sBn == 1 and _vector_ok(p.N, sBk, p.b_batch_strides, p.b_align))
        assert cfg.split_k <= min(MAX_SPLIT, -(-p.K // skinny_kchunk(m)))
        assert cfg.grid[0] == -(-p.N // 128)
    elif cfg.family in SIMT:
        if m["A_MODE"] == LOAD_VEC_FAST:
            assert sAm == 1 and _vector_ok(p.M, sAk, p.a_batch_strides, p.a_align)
        if m["A_MODE"] == LOAD_VEC_K:
            assert cfg.family == "simt_float4" and sAk == 1 and _vector_ok(p.K, sAm, p.a_batch_strides, p.a_align)
        if m["B_MODE"] == LOAD_VEC_FAST:
            assert sBn == 1 and _vector_ok(p.N, sBk, p.b_batch_strides, p.b_align)
        if m["B_MODE"] == LOAD_VEC_K:
            assert cfg.family == "simt_float4" and sBk == 1 and _vector_ok(p.K, sBn, p.b_batch_strides, p.b_align)
        if m["A_MODE"] == LOAD_ELEM_FAST:
            assert sAm == 1
        if m["B_MODE"] == LOAD_ELEM_K:
            assert sBk == 1
        if m["C_VEC"] and cfg.split_k == 1:
            assert sCn == 1 and _vector_ok(p.N, sCm, p.c_batch_strides, p.c_align)
        if m["C_VEC"]:  # split-K partials go to a contiguous workspace of M x N slices
            assert p.N % 4 == 0
    elif cfg.family == "tf32_mma":
        if m["A_VEC"]:
            assert (sAk == 1 and _vector_ok(p.K, sAm, p.a_batch_strides, p.a_align)) or (
                sAm == 1 and _vector_ok(p.M, sAk, p.a_batch_strides, p.a_align))
            assert m["A_SMEM_MK"] == int(sAk == 1)
        if m["B_VEC"]:
            assert (sBn == 1 and _vector_ok(p.N, sBk, p.b_batch_strides, p.b_align)) or (
                sBk == 1 and _vector_ok(p.K, sBn, p.b_batch_strides, p.b_align))
            assert m["B_SMEM_KN"] == int(sBn == 1)
        if m["C_VEC"] and cfg.split_k == 1:
            assert sCn == 1 and p.N % 2 == 0 and sCm % 2 == 0 and p.c_align >= 8
        if m["C_VEC"]:
            assert p.N % 2 == 0
        assert m["PRECISION_X3"] == int(p.precision == "tf32x3")


def test_describe_names_the_kernel_its_macros_and_every_rejection():
    plan = select(Problem.dense(2048, 2048, 2048, precision="tf32"), DEV["sm_89"])
    text = plan.describe()
    cfg = plan.kernel
    assert text.startswith(f"kernel: tf32_mma ({cfg.entry} in cuda_src/{cfg.source}): tile ")
    assert "  macros: " + ", ".join(f"{k}={v}" for k, v in cfg.macros) in text
    assert "PRECISION_X3=0" in text
    for name, reason in plan.rejected:
        assert f"rejected {name}: {reason}" in text


# --- staging: unaligned row-contiguous operands copied into padded aligned buffers --------------

@pytest.mark.parametrize("arch", SM80_PLUS)
def test_large_unaligned_problems_stage_b_for_simt_and_a_and_b_for_tf32(arch):
    p = Problem.dense(4097, 4095, 4093)
    plan = select(p, DEV[arch])
    assert plan.kernel.family == "simt_cp_async"
    assert plan.staging == (("b", 4093, 4096),)  # SIMT transposes A with 4-byte copies anyway
    assert macros(plan)["B_MODE"] == LOAD_VEC_FAST and macros(plan)["A_MODE"] == LOAD_ELEM_K
    lp = plan.launch_problem
    assert lp.b_strides == (4096, 1) and lp.b_align == 16 and lp.b_padded and not lp.a_padded
    assert (lp.M, lp.N, lp.K) == (p.M, p.N, p.K) and plan.problem == p  # sizes unchanged, problem as asked
    assert macros(plan)["C_VEC"] == 0  # C is written in place: N % 4 != 0
    assert "staged: B copied into a zero-padded 4093x4096 buffer" in plan.describe()
    plan = select(dataclasses.replace(p, precision="tf32"), DEV[arch], force="tf32_mma")
    assert plan.kernel.family == "tf32_mma"
    assert plan.staging == (("b", 4093, 4096), ("a", 4097, 4096))
    assert macros(plan)["A_VEC"] == 1 and macros(plan)["B_VEC"] == 1
    if arch == "sm_90":  # tf32 on wgmma: K-major copies, B transposed; the maps stop at K
        plan = select(dataclasses.replace(p, precision="tf32"), DEV[arch])
        assert plan.kernel.family == "wgmma_tf32"
        assert plan.staging == (("a", 4097, 4096), ("bt", 4095, 4096))
        lp = plan.launch_problem
        assert lp.a_strides == (4096, 1) and lp.b_strides == (1, 4096) and (lp.M, lp.N, lp.K) == (4097, 4095, 4093)
        assert "staged: B transposed copied K-major (4095x4096, 16-byte aligned rows" in plan.describe()


def test_a_tuned_simt_option_gets_the_copy_its_own_tile_calls_for():
    """W^T is transposed for the 128 x 256 tile only: a tuned smaller tile reads W in place (the
    copy would cost more than it gains there), a tuned 128 x 256 tile at 768 rows (whose own
    choice is a split 128 x 128 plan, read in place) gets the copy; so the tuner times each
    option as it would run."""
    dev = DEV["sm_90"]
    p = Problem.dense(2048, 4096, 4096, b_t=True)
    assert select(p, dev).staging == (("b", 4096, 4096),)
    small = select(p, dev, tuned=TunedChoice("simt_cp_async", (2, 2, 16, 0)))
    assert small.origin.startswith("tuned") and small.kernel.tile[:2] == (128, 128)
    assert small.staging == () and small.launch_problem is None and macros(small)["B_MODE"] == LOAD_ELEM_K
    p = Problem.dense(1024, 2816, 1024, b_t=True)
    assert select(p, dev).staging == () and select(p, dev).kernel.tile[:2] == (128, 128)
    big = select(p, dev, tuned=TunedChoice("simt_cp_async", (2, 4, 16, 0)))
    assert big.kernel.tile[:2] == (128, 256) and big.staging == (("b", 1024, 2816),)
    assert macros(big)["B_MODE"] == LOAD_VEC_FAST and [k.family for k in big.stagers] == ["stage_kmajor"]


def test_a_family_that_stages_without_a_copy_kernel_is_refused():
    """Every copy is a fastmm kernel: a plan listing a copy without the kernel that makes it
    would launch the GEMM on the operand itself with the copy's pitch."""
    class NoStagers(SimtCpAsync):
        def stagers(self, p, staging):
            return ()
    with pytest.raises(AssertionError, match="stages 1 operand"):
        select(Problem.dense(2048, 4096, 4096, b_t=True), DEV["sm_90"], variants=(NoStagers(),))


def test_wgmma_takes_the_tile_width_whose_whole_waves_take_least_time():
    """Tiles are dealt to the 132 SMs in whole waves: the width is the one whose waves of tiles
    take least time (a narrower tile is shorter but sustains less, BN_RATE). The counts here are
    the geometry's, checked by hand."""
    dev = DEV["sm_90"]
    bn = lambda p, *v: macros(select(p, dev, variants=v))["BN"]  # noqa: E731
    # gpt2's qkv: 32 x 9 = 288 tiles of 256 (3 waves) against 32 x 12 = 384 of 192 (3 waves of
    # tiles 3/4 as long): 192 (H200: 62.3 -> 50.8 us, NOTES run 23)
    assert bn(Problem.dense(4096, 2304, 768, "tf32", b_t=True)) == 192
    # 4096^3: 512 tiles of 256 (4 waves) against 704 of 192 (6 waves of 3/4): 256
    assert bn(Problem.dense(4096, 4096, 4096, "tf32")) == 256
    # llama's kv projection: 16 x 8 = 128 tiles of 128 are one wave, as are 64 of 256 (twice as long)
    assert bn(Problem.dense(2048, 1024, 4096, "tf32", b_t=True)) == 128
    # attention at 64 keys: a 64-wide tile, no padded columns
    assert bn(Problem.dense(128, 64, 64, "tf32", batch=1024, b_t=True)) == 64
    # tf32x3 holds three accumulator sets: 128 wide at most, 96 where it fills the waves better
    assert bn(Problem.dense(4096, 4096, 4096, "tf32x3")) == 128
    assert bn(Problem.dense(4096, 2304, 768, "tf32x3", b_t=True)) == 96
    # run 18's rule as the variant: 128 wide for N <= 128, else the widest that fills 90% of a wave
    fill = WgmmaTf32(tile_rule="fill")
    assert bn(Problem.dense(128, 128, 64, "tf32", batch=1024, b_t=True), fill) == 128
    assert bn(Problem.dense(128, 129, 64, "tf32", batch=1024, b_t=True), fill) == 256
    assert bn(Problem.dense(4096, 2304, 768, "tf32", b_t=True), fill) == 256
    for width in (64, 96, 128, 192, 256):
        assert bn(Problem.dense(4096, 2304, 768, "tf32", b_t=True), WgmmaTf32(force_bn=width)) == width


def test_wgmma_takes_at_most_128_wide_at_k_65_to_128_with_both_operands_k_major():
    """SHORT_K_NARROW_*: at 3-4 k-steps a tile, with both operands K-major where they are and C
    stored by the copy engine, the 128-wide tile (the wave model had 256): attention's Q @ K^T at
    head dims 96-128 and x @ W^T at K = 128 ran 2-16% faster (NOTES run 36). Not at K = 64 or 256,
    not for a row-major B (C^T from registers), not where C is stored from registers."""
    dev = DEV["sm_90"]
    coop = WgmmaTf32(pingpong=False)

    def plan(p, v=coop):
        return select(p, dev, variants=(v,), force="wgmma_tf32")
    for p in (Problem.dense(2048, 2048, 128, "tf32", batch=32, b_t=True), Problem.dense(8192, 8192, 128, "tf32", b_t=True),
              Problem.dense(2048, 2048, 96, "tf32", batch=32, b_t=True), Problem.dense(16384, 4096, 100, "tf32", b_t=True),
              Problem.dense(16384, 4096, 65, "tf32", b_t=True)):  # (K = 65: both operands copied K-major first)
        k = plan(p).kernel
        assert dict(k.macros)["BN"] == 128 and dict(k.macros)["TMA_STORE"] == 1, (p, k.macros)
        assert "width rule" in dict(k.details)
    for p in (Problem.dense(2048, 2048, 64, "tf32", batch=32, b_t=True), Problem.dense(8192, 4096, 256, "tf32", b_t=True),
              Problem.dense(8192, 8192, 128, "tf32")):  # (K = 64, K = 256, a row-major B)
        k = plan(p).kernel
        assert dict(k.macros)["BN"] == 256 and "width rule" not in dict(k.details), (p, k.macros)
    short = Problem.dense(8192, 8192, 128, "tf32", b_t=True)
    assert macros(plan(short, WgmmaTf32(pingpong=False, tma_store=False)))["BN"] == 256  # C from registers
    assert macros(plan(short, WgmmaTf32(pingpong=False, force_bn=256)))["BN"] == 256
    assert macros(plan(short, WgmmaTf32(pingpong=False, tile_rule="fill")))["BN"] == 256
    assert macros(plan(dataclasses.replace(short, precision="tf32x3")))["BN"] == 128  # (tf32x3: 128 at most anyway)


def test_wgmma_runs_persistent_up_to_16_waves_or_at_short_k():
    """One block an SM walking the tiles up to 16 waves of them (or any number where K <= 256);
    one block a tile beyond, where the hardware's scheduler evens out slow SMs (gpt2's lm_head:
    48 waves at K = 768 ran 0.92x persistent)."""
    dev = DEV["sm_90"]
    def grid(p, *v):  # (the consumers sharing tiles: taking turns is always persistent)
        k = select(p, dev, variants=v or (WgmmaTf32(pingpong=False),), force="wgmma_tf32").kernel
        return k.grid[0], k.work_items
    assert grid(Problem.dense(4096, 4096, 4096, "tf32")) == (132, 512)
    assert grid(Problem.dense(2048, 2048, 128, "tf32", batch=32, b_t=True)) == (132, 8192)  # K = 128 (128 wide)
    assert grid(Problem.dense(4096, 50257, 768, "tf32", b_t=True)) == (6304, 6304)  # 48 waves
    assert grid(Problem.dense(4096, 4096, 4096, "tf32"), WgmmaTf32(persistent=False)) == (512, 512)
    assert grid(Problem.dense(4096, 50257, 768, "tf32", b_t=True), WgmmaTf32(persistent="always", pingpong=False)) == (132, 6304)
    assert grid(Problem.dense(64, 64, 64, "tf32", batch=5)) == (5, 5)  # fewer tiles than SMs: a block each


def test_wgmma_consumers_take_turns_only_where_the_kernel_allows_and_each_block_has_two_tiles():
    """PINGPONG (the consumer warpgroups on alternate whole tiles): tf32 with a K-major A only (not
    tf32x3's three accumulator sets, not A fed from registers), C from registers without a fused
    epilogue, 192 wide at most,
    persistent blocks of two tiles or more, K >= 512; and where taking turns is predicted to beat
    sharing the tiles (wave_cost: every epilogue but the last hidden)."""
    dev = DEV["sm_90"]
    pp = WgmmaTf32(pingpong=True)
    plan = lambda p, *v: select(p, dev, variants=v, force="wgmma_tf32")  # noqa: E731
    vit = Problem.dense(4728, 3072, 768, "tf32", b_t=True)  # 888 tiles of 128 x 128: 6.7 a block
    k = plan(vit, pp).kernel
    m = dict(k.macros)
    assert m["PINGPONG"] == 1 and "TMA_STORE" not in m and m["BN"] <= 192 and k.grid[0] == 132
    assert "take turns" in dict(k.details)["pipeline"]
    assert wave_cost(vit, dev, m["BN"], pingpong=True) < min(wave_cost(vit, dev, bn) for bn, _ in pp.tile_options(False))
    assert plan(vit).kernel == k  # (the default)
    assert "PINGPONG" not in dict(plan(vit, WgmmaTf32(pingpong=False)).kernel.macros)
    assert "PINGPONG" not in dict(plan(dataclasses.replace(vit, precision="tf32x3"), pp).kernel.macros)
    # a fused epilogue (a bias): the cooperative form applies it to C staged for the copy engine
    fused = dict(plan(dataclasses.replace(vit, epilogue=EPILOGUE_D), pp).kernel.macros)
    assert "PINGPONG" not in fused and fused["TMA_STORE"] == 1
    assert dict(plan(Problem.dense(4728, 3072, 768, "tf32"), pp).kernel.macros)["A_MN"] == 1  # row-major B: C^T
    assert "PINGPONG" not in dict(plan(Problem.dense(4728, 3072, 768, "tf32"), pp).kernel.macros)
    assert "PINGPONG" not in dict(plan(Problem.dense(2048, 1024, 4096, "tf32", b_t=True), pp).kernel.macros)  # 1 wave
    # 48 waves at K = 768: taking turns persistent (the cooperative form would not be: measured)
    lm_head = plan(Problem.dense(4096, 50257, 768, "tf32", b_t=True), pp).kernel
    assert dict(lm_head.macros)["PINGPONG"] == 1 and lm_head.grid[0] == 132
    # a short K: the stores would outlast the other consumer's main loop (PINGPONG_MIN_K)
    for k in (64, 128, 511):
        assert "PINGPONG" not in dict(plan(Problem.dense(128 * 16, 512, k, "tf32", batch=128, b_t=True), pp).kernel.macros)
    # a long K where the 256-wide tile's rate outweighs the hidden epilogues: shared tiles
    assert dict(plan(Problem.dense(2048, 14336, 4096, "tf32", b_t=True), pp).kernel.macros)["BN"] == 256
    # "always": wherever the kernel allows it, even a block with one tile; a forced width keeps its turns
    small = plan(Problem.dense(1000, 1000, 128, "tf32", b_t=True), WgmmaTf32(pingpong="always", rows64=False)).kernel
    assert dict(small.macros)["PINGPONG"] == 1 and small.grid[0] == small.work_items < 132
    forced = dict(plan(vit, WgmmaTf32(pingpong="always", force_bn=64)).kernel.macros)
    assert (forced["BN"], forced["PINGPONG"]) == (64, 1)
    assert "PINGPONG" not in dict(plan(vit, WgmmaTf32(pingpong="always", force_bn=256)).kernel.macros)
    check_geometry(plan(vit, pp))


def test_wgmma_consumers_take_turns_by_the_parts_memory():
    """Taking turns (PINGPONG) with C stored from registers was measured 4-50% slower than both
    consumers on each tile on an H100 80GB (3.35 TB/s) and 4-8% faster on the H200 (4.92); with C
    through the copy engine (a staging region each consumer) 2-14% faster on the H100 (NOTES runs
    59, 62). So from PINGPONG_MIN_DRAM_TBPS the consumers take turns storing from registers, below
    it (a part of unknown bandwidth too) through the copy engine, 192 wide; where the copy engine
    cannot write C they share tiles there, and explain says why. "always" still forces taking
    turns (the probes' variant)."""
    h200, h100 = DEV["sm_90"], DeviceFacts.simulated_h100()
    assert h100.dram_tbps < PINGPONG_MIN_DRAM_TBPS <= h200.dram_tbps
    rows = [(4728, 3072, 768), (8192, 2816, 1024), (1000, 18944, 3584), (3152, 4096, 1024)]
    for M, N, K in rows:
        p = Problem.dense(M, N, K, "tf32", b_t=True)
        on_h200 = dict(select(p, h200).kernel.macros)
        assert on_h200.get("PINGPONG") == 1 and "TMA_STORE" not in on_h200, (M, N, K)
        on_h100 = select(p, h100).kernel
        m = dict(on_h100.macros)
        width = 160 if (M, N, K) in ((8192, 2816, 1024), (3152, 4096, 1024)) else 192  # (STAGED_TURNS_160)
        assert (m.get("PINGPONG"), m.get("TMA_STORE"), m.get("C_BOXES"), m["BN"]) == (1, 1, 2, width), (M, N, K)
        assert "a region each consumer warpgroup" in dict(on_h100.details)["C stores"]
        assert "consumers" not in dict(on_h100.details)
        # the H100's default is the staged variant's plan; the H200's the registers' variant's
        staged = select(p, h100, variants=(WgmmaTf32(pingpong_tma_store=True),)).kernel
        assert dataclasses.replace(on_h100, details=()) == dataclasses.replace(staged, details=())
        regs = select(p, h200, variants=(WgmmaTf32(pingpong_tma_store=False),)).kernel
        assert dataclasses.replace(select(p, h200).kernel, details=()) == dataclasses.replace(regs, details=())
        # a bias keeps the product's form, applied as C is staged
        fused = dict(select(dataclasses.replace(p, epilogue=EPILOGUE_BIAS_N), h100).kernel.macros)
        assert fused["PINGPONG"] == 1 and fused["TMA_STORE"] == 1 and fused["EPILOGUE"] == 1
    # C with an odd width: no tensor map, so on the H100 the consumers share each tile (the
    # cooperative form's own plan), and explain says why; on the H200 they take turns
    head = Problem.dense(4096, 50257, 768, "tf32", b_t=True)
    assert dict(select(head, h200).kernel.macros).get("PINGPONG") == 1
    on_h100 = select(head, h100).kernel
    assert "PINGPONG" not in dict(on_h100.macros)
    coop = select(head, h100, variants=(WgmmaTf32(pingpong=False),), force="wgmma_tf32").kernel
    assert dataclasses.replace(on_h100, details=()) == dataclasses.replace(coop, details=())
    why = dict(on_h100.details)["consumers"]
    assert "copy engine cannot write this C" in why and "3.35 TB/s" in why, why
    forced = select(head, h100, variants=(WgmmaTf32(pingpong="always"),), force="wgmma_tf32").kernel
    assert dict(forced.macros).get("PINGPONG") == 1 and "consumers" not in dict(forced.details)
    # the bandwidth decides how C leaves, not whether turns are taken
    vit = Problem.dense(4728, 3072, 768, "tf32", b_t=True)
    for tbps, tma in ((0.0, True), (PINGPONG_MIN_DRAM_TBPS - 0.01, True), (PINGPONG_MIN_DRAM_TBPS, False)):
        m = dict(select(vit, dataclasses.replace(h100, dram_tbps=tbps)).kernel.macros)
        assert m.get("PINGPONG") == 1 and bool(m.get("TMA_STORE")) == tma, tbps
    # where taking turns is not weighed at all (K < PINGPONG_MIN_K, one wave), explain says nothing of it
    for p in (Problem.dense(2048, 2048, 256, "tf32", b_t=True), Problem.dense(1024, 1024, 1024, "tf32", b_t=True),
              Problem.dense(2048, 2051, 256, "tf32", b_t=True)):
        k = select(p, h100).kernel
        assert "consumers" not in dict(k.details) and "PINGPONG" not in dict(k.macros)


def test_wgmma_staged_turns_take_160_wide_tiles_where_their_waves_fill_the_sms_better():
    """Taking turns with C staged (the H100's form), the 160-wide tile replaces the 192-wide one
    where its whole waves fill the SMs enough better (STAGED_TURNS_160_GAIN) at K >=
    STAGED_TURNS_160_MIN_K: 3152 x 4096 x 1024 (192 wide: 550 tiles, 5 waves for 4.17; 160 wide:
    650, 5 for 4.92) measured 91.4 -> 80.4 us on an H100; not where 160's waves fill no better
    (4728 x 3072 x 768), not at K = 512 even where they do (4096 x 11008 x 512, measured slower),
    not where the product shares tiles, and never from registers (the H200's turns)."""
    h200, h100 = DEV["sm_90"], DeviceFacts.simulated_h100()
    def macros(M, N, K, dev=h100, **kw):
        return dict(select(Problem.dense(M, N, K, "tf32", b_t=True, **kw), dev).kernel.macros)
    for M, N, K in [(3152, 4096, 1024), (8192, 2816, 1024)]:
        m = macros(M, N, K)
        assert (m["BN"], m["PINGPONG"], m["TMA_STORE"]) == (160, 1, 1), (M, N, K)
        assert wave_cost(Problem.dense(M, N, K, "tf32", b_t=True), h100, 160, pingpong=True) < \
            STAGED_TURNS_160_GAIN * wave_cost(Problem.dense(M, N, K, "tf32", b_t=True), h100, 192, pingpong=True)
        assert macros(M, N, K, h200)["BN"] != 160  # (turns from registers: 160 is not offered)
        why = dict(select(Problem.dense(M, N, K, "tf32", b_t=True), h100).kernel.details)["width rule"]
        assert why.startswith("160 wide, not 192: taking turns with C staged"), why
        # with a bias, 192 wide until the bias form at 160 has run on a GPU
        k = select(dataclasses.replace(Problem.dense(M, N, K, "tf32", b_t=True), epilogue=EPILOGUE_BIAS_N), h100).kernel
        assert dict(k.macros)["BN"] == 192 and dict(k.macros)["EPILOGUE_VECTOR"] == 1
    for M, N, K in [(4728, 3072, 768), (1000, 18944, 3584), (4096, 11008, 512)]:
        assert macros(M, N, K)["BN"] == 192, (M, N, K)
    assert macros(4096, 3072, 1024)["BN"] == 192  # (K = 1024, but 160's waves fill worse: 93% against 97%)
    # (the width is asked of the staged turns only: shared tiles and tf32x3 never take it)
    assert 160 not in {w for x3 in (False, True) for w, _ in WgmmaTf32.tile_options(x3)}
    assert macros(2048, 1024, 4096)["BN"] != 160 and "PINGPONG" not in macros(2048, 1024, 4096)
    # the ring and C's two staging regions fit beside each other at 160 wide
    k = select(Problem.dense(3152, 4096, 1024, "tf32", b_t=True), h100).kernel
    m = dict(k.macros)
    ring = m["STAGES"] * (128 + 160) * 32 * 4
    assert k.smem == 1024 + ring + 2 * m["C_BOXES"] * 128 * 32 * 4 + 16 * m["STAGES"] <= h100.smem_per_block_optin


def test_wgmma_consumers_take_turns_with_c_through_the_copy_engine_where_the_variant_asks():
    """``pingpong_tma_store=True`` (measured 2-14% ahead of sharing tiles on an H100, NOTES run
    59; the default below PINGPONG_MIN_DRAM_TBPS since run 62): taking turns on any part, 192 wide
    (160 where its waves fill the SMs better: STAGED_TURNS_160), C staged for the copy engine in
    a region each consumer warpgroup (2 boxes at a time, beside a ring that still fits), a bias
    added as C is staged; where C allows no tensor map, no turns
    (from registers they lost on the H100); False: taking turns from registers on any part."""
    staged, regs = WgmmaTf32(pingpong_tma_store=True), WgmmaTf32(pingpong_tma_store=False)
    for dev in (DEV["sm_90"], DeviceFacts.simulated_h100()):
        for M, N, K in [(4728, 3072, 768), (8192, 2816, 1024), (1000, 18944, 3584), (4096, 3072, 1024)]:
            p = Problem.dense(M, N, K, "tf32", b_t=True)
            k = select(p, dev, variants=(staged,)).kernel
            m = dict(k.macros)
            width = 160 if (M, N, K) == (8192, 2816, 1024) else 192  # (STAGED_TURNS_160)
            assert (m.get("PINGPONG"), m.get("TMA_STORE"), m.get("C_BOXES"), m["BN"]) == (1, 1, 2, width), (dev.name, M, N, K)
            assert "a region each consumer warpgroup" in dict(k.details)["C stores"]
            # the kernel's layout: 1 KiB of alignment slack, the ring, two regions of 2 boxes of
            # 128 x 32 floats (one each consumer), the ring's two mbarriers a slot; and it fits
            ring = m["STAGES"] * (128 + width) * 32 * 4
            assert k.smem == 1024 + ring + 2 * 2 * 128 * 32 * 4 + 16 * m["STAGES"] <= dev.smem_per_block_optin, k.smem
            # a c_boxes asked beyond what fits beside two slots: as many as fit
            big = select(p, dev, variants=(dataclasses.replace(staged, c_boxes=6),)).kernel
            assert dict(big.macros)["C_BOXES"] < 6 and big.smem <= dev.smem_per_block_optin
            fused = dict(select(dataclasses.replace(p, epilogue=EPILOGUE_BIAS_N), dev, variants=(staged,)).kernel.macros)
            assert fused.pop("EPILOGUE") == 1 and fused.pop("EPILOGUE_VECTOR") == 1
            if width == 160:  # (a bias stays 192 wide: STAGED_TURNS_160)
                assert fused.pop("BN") == 192 and fused.pop("STAGES") == 4
                m = {k: v for k, v in m.items() if k not in ("BN", "STAGES")}
            assert fused == m
            r = dict(select(p, dev, variants=(regs,)).kernel.macros)
            assert r.get("PINGPONG") == 1 and "TMA_STORE" not in r, (dev.name, M, N, K)
        head = Problem.dense(4096, 50257, 768, "tf32", b_t=True)  # an odd width: no tensor map for C
        k = select(head, dev, variants=(staged,)).kernel
        assert "PINGPONG" not in dict(k.macros) and "consumers" not in dict(k.details)
        # K = 4096: the shared 256-wide tile's rate still wins in the wave model
        assert dict(select(Problem.dense(2048, 14336, 4096, "tf32", b_t=True), dev, variants=(staged,)).kernel.macros)["BN"] == 256


def test_wgmma_stores_c_through_the_copy_engine_where_a_tensor_map_can_describe_it():
    """C rows of 16-byte multiples, n contiguous: staged in shared memory and written by TMA
    (boxes of 32 columns; the ring gives up a slot where both do not fit). Not for an odd row
    pitch, an m-contiguous C (a row-major B's C^T), or the 256-wide tile past K = 1024, where the
    lost slot cost more than the overlap gave (NOTES run 23). The 256-wide tile stages 2 boxes at
    a time from K = 512, 4 below: 2 fit beside its 4 slots (NOTES run 29)."""
    dev = DEV["sm_90"]
    coop = WgmmaTf32(pingpong=False)  # (the consumers sharing tiles; taking turns stores from registers)
    m = lambda p, v=coop: macros(select(p, dev, variants=(v,), force="wgmma_tf32"))  # noqa: E731
    tma = m(Problem.dense(4728, 3072, 768, "tf32", b_t=True))  # 128 wide
    assert (tma["BN"], tma["TMA_STORE"], tma["C_BOXES"], tma["STAGES"]) == (128, 1, 4, 5)
    assert "TMA_STORE" not in m(Problem.dense(4728, 3072, 768, "tf32", b_t=True), WgmmaTf32(tma_store=False, pingpong=False))
    assert "TMA_STORE" not in m(Problem.dense(4728, 3072, 768, "tf32", b_t=True), WgmmaTf32())  # taking turns
    assert "TMA_STORE" not in m(Problem.dense(4728, 3070, 768, "tf32", b_t=True))  # row pitch 3070 floats
    assert "TMA_STORE" not in m(Problem.dense(4096, 4096, 4096, "tf32"))  # row-major B: C^T, m-contiguous
    assert "TMA_STORE" not in m(dataclasses.replace(Problem.dense(4728, 3072, 768, "tf32", b_t=True), c_align=8))
    # a batch dim whose C stride is 0 (no real output has one): a map of that dim could not walk it
    unwalked = dataclasses.replace(Problem.dense(512, 512, 512, "tf32", batch=3, b_t=True), batch_inner=1)
    assert unwalked.c_batch_strides == (0, 512 * 512) and "TMA_STORE" not in m(unwalked)
    assert m(Problem.dense(512, 512, 512, "tf32", batch=3, b_t=True))["TMA_STORE"] == 1
    wide = m(Problem.dense(4096, 3072, 1024, "tf32", b_t=True))
    assert (wide["BN"], wide["TMA_STORE"], wide["C_BOXES"], wide["STAGES"]) == (256, 1, 2, 4)
    short_k = m(Problem.dense(128 * 512, 512, 64, "tf32", b_t=True))  # (attention's Q @ K^T, K = 64)
    assert (short_k["BN"], short_k["TMA_STORE"], short_k["C_BOXES"], short_k["STAGES"]) == (256, 1, 4, 3)
    wide256 = WgmmaTf32(pingpong=False, force_bn=256)
    for k, boxes, stages in ((511, 4, 3), (512, 2, 4)):  # (the rule's edge)
        edge = m(Problem.dense(8192, 1024, k, "tf32", b_t=True), wide256)
        assert (edge["BN"], edge["TMA_STORE"], edge["C_BOXES"], edge["STAGES"]) == (256, 1, boxes, stages), k
    long_k = m(Problem.dense(4096, 1024, 4096, "tf32", b_t=True))
    assert (long_k["BN"], long_k["STAGES"]) == (256, 4) and "TMA_STORE" not in long_k
    x3 = m(Problem.dense(4096, 4096, 4096, "tf32x3"))  # (copied K-major halves: C as given)
    assert (x3["TMA_STORE"], x3["C_BOXES"], x3["STAGES"]) == (1, 2, 3)
    for p in (Problem.dense(4728, 3072, 768, "tf32", b_t=True), Problem.dense(4096, 4096, 4096, "tf32x3"),
              Problem.dense(4096, 3072, 1024, "tf32", b_t=True)):
        check_geometry(select(p, dev, force="wgmma_tf32", variants=(coop,)))  # (the staging boxes fit beside the ring)


def test_small_tf32_products_run_on_wgmma_unless_k_is_long_enough_for_a_split_to_win():
    """Fewer 128 x 64 tiles than SMs: wgmma walks all of K in one tile per SM, tf32_mma splits K
    over every SM. Measured on the H200 (probes/small_tf32_probe.py, NOTES run 23): wgmma 14.5 us
    against 27.0 at 300 x 700 x 1100 (33 tiles), 28.1 against 70.6 at 77 x 1531 x 2053 (with its
    copies: K % 4 != 0); tf32_mma 24.7 against 29.1 at 200 x 1000 x 4096 (32 tiles) and 22.8
    against 53.9 at 100 x 300 x 8192 (5 tiles). wgmma's own split (SPLIT) on 128-row tiles is
    taken up to 64 rows only: above, it was mixed against tf32_mma's (100 x 300 x 8192: 19.1
    against 23.0 us; 256 x 256 x 65536: 94.1 against 59.4; probes/wgmma_split_probe.py, NOTES run
    25). On 64-row tiles (the mid-size rule) 200 x 1000 x 4096 splits in 4: 19.3 us against
    tf32_mma's 24.5 (NOTES run 40).
    77 x 1531 x 2053 (A and B^T copied K-major) is faster on wgmma's GPU time, but its two copies
    and three launches make the call host-bound (~42 us to enqueue, cost.HOST_US_*): the fp32
    SIMT plan (33.3 us GPU, one launch) is faster a call."""
    dev = DEV["sm_90"]
    family = lambda *a, **k: select(Problem.dense(*a, "tf32", **k), dev).kernel.family  # noqa: E731
    assert family(300, 700, 1100, b_t=True) == "wgmma_tf32"
    assert family(512, 512, 512) == "wgmma_tf32"
    issue = select(Problem.dense(77, 1531, 2053, "tf32"), dev)
    assert issue.kernel.family == "simt_cp_async" and issue.precision_used == "ieee"
    assert "cost model: ran full fp32" in issue.origin and "host" in dict(issue.rejected)["wgmma_tf32"]
    assert family(77, 1531, 2056) == "wgmma_tf32"  # (K % 4 == 0: B^T alone copied, one copy)
    mid = select(Problem.dense(200, 1000, 4096, "tf32", b_t=True), dev).kernel
    assert (mid.family, mid.tile[:2], mid.split_k) == ("wgmma_tf32", (64, 128), 4)
    plan = select(Problem.dense(100, 300, 8192, "tf32", b_t=True), dev)
    assert plan.kernel.family == "tf32_mma"
    assert "5 tiles of 128x64 for 132 SMs at K = 8192" in dict(plan.rejected)["wgmma_tf32"]
    # a full wave of tiles: wgmma whatever K
    assert family(1024, 8448, 16384, b_t=True) == "wgmma_tf32"


def test_decode_products_up_to_64_rows_run_64_row_wgmma_tiles_split_where_they_leave_sms_idle():
    """tf32 x @ W.t() with M <= 64: wgmma on 64-row tiles (one consumer warpgroup); where its
    128-wide tiles fill under half the SMs and K >= 2048, K split over blocks into 132 // tiles
    slices (2 at least, 4 and K / 512 at most), the last blocks summing them; 64 wide where 128
    wide still leaves half the SMs idle and 64 wide makes more blocks; only where those blocks fill
    a fifth of the SMs (else tf32_mma). From 17 rows, one matrix, N >= 4096 and K >= 2048 ahead of
    kmajor_mma. H200 (probes/wgmma_rows_probe.py, NOTES run 37, GPU us): 64 x 14336 x
    4096 unsplit 62.7 (2 slices 76.0), 48 x 4096 x 11008 4 slices 55.0 (unsplit 72.4), 24 x 16384 x
    2048 38.3 against kmajor_mma's 55.1, 64 x 1024 x 4096 64 wide in 4 slices 13.0 (128 wide 17.4,
    tf32_mma 20.9); 16 rows stay kmajor_mma's."""
    dev = DEV["sm_90"]
    for (M, N, K), (family, tile, split) in (
            ((48, 4096, 11008), ("wgmma_tf32", 128, 4)), ((32, 3584, 18944), ("wgmma_tf32", 128, 4)),
            ((32, 4096, 14336), ("wgmma_tf32", 128, 4)), ((64, 4096, 4096), ("wgmma_tf32", 128, 4)),
            ((17, 4096, 8192), ("wgmma_tf32", 128, 4)), ((64, 14336, 4096), ("wgmma_tf32", 128, 1)),
            ((64, 1024, 4096), ("wgmma_tf32", 64, 4)), ((24, 4096, 4096), ("wgmma_tf32", 128, 4)),
            ((24, 16384, 2048), ("wgmma_tf32", 128, 1)), ((40, 7680, 4096), ("wgmma_tf32", 128, 2)),
            ((64, 4096, 1536), ("wgmma_tf32", None, 1)),  # (K < 2048: no split)
            ((64, 512, 8192), ("wgmma_tf32", 64, 4)), ((33, 2001, 8200), ("wgmma_tf32", 64, 4)),
            # too few (tile, slice) blocks for a fifth of the SMs: tf32_mma's split over every SM
            ((48, 128, 65536), ("tf32_mma", None, None)),
            ((1, 256, 8192), ("skinny_kmajor", None, None)), ((16, 4096, 4096), ("kmajor_mma", None, None)),
            ((24, 1024, 4096), ("kmajor_mma", None, None)), ((16, 4096, 14336), ("kmajor_mma", None, None)),
            ((17, 5, 14336), ("kmajor_mma", None, None)), ((65, 4096, 4096), ("wgmma_tf32", 128, 4)),
            ((64, 4096, 1024), ("wgmma_tf32", None, 1)), ((64, 50257, 4096), ("wgmma_tf32", None, 1))):
        plan = select(Problem.dense(M, N, K, "tf32", b_t=True), dev)
        assert plan.kernel.family == family, ((M, N, K), plan.describe())
        if family == "wgmma_tf32":
            assert plan.kernel.split_k == split and plan.kernel.split_fused == (split > 1), ((M, N, K), plan.describe())
            assert plan.kernel.tile[0] == (64 if M <= 64 else 128) and plan.kernel.block == (256 if M <= 64 else 384)
            if tile:
                assert plan.kernel.tile[1] == tile and plan.reduce is None
            check_geometry(plan)
    # tf32x3 on 128-row tiles (both operands' halves staged) is never split by the rule
    x3 = select(Problem.dense(96, 4096, 11008, "tf32x3", b_t=True), dev, force="wgmma_tf32")
    assert x3.kernel.tile[0] == 128 and not x3.kernel.split_fused
    # a forced count: 0 and 1 mean unsplit; capped by K / 512 and the grid's y limit
    p = Problem.dense(64, 512, 8192, "tf32", b_t=True)
    for n, want in ((0, 1), (1, 1), (5, 5), (100, 16)):
        assert select(p, dev, force="wgmma_tf32", variants=(WgmmaTf32(split=n),)).kernel.split_k == want, n
    huge = Problem.dense(8, 8, 2**26, "tf32", b_t=True)
    assert select(huge, dev, force="wgmma_tf32", variants=(WgmmaTf32(split=10**6),)).kernel.split_k <= 65535


def test_wgmma_copies_an_operand_with_a_zero_row_stride():
    """x.expand(M, K) has row stride 0: no tensor map for it (the copy engine's strides are
    positive), so the staging pass copies it; a K-major B^T expanded likewise."""
    dev = DEV["sm_90"]
    p = Problem(2048, 2048, 2048, (0, 1), (1, 2048), (2048, 1), precision="tf32")
    plan = select(p, dev)
    assert plan.kernel.family == "wgmma_tf32" and plan.staging == (("a", 2048, 2048),)
    p = Problem(2048, 2048, 2048, (2048, 1), (1, 0), (2048, 1), precision="tf32")
    assert select(p, dev).staging == (("bt", 2048, 2048),)


def test_wgmma_copies_the_operand_with_fewer_elements_over_its_own_batch():
    """A^T with a row-major B: one of them must be copied K-major. A broadcast A^T (one matrix) is
    cheaper to copy than a batched B^T (one per matrix) even where B^T has fewer rows, and the
    other way round when both are batched."""
    dev = DEV["sm_90"]
    M, N, K, batch = 384, 256, 512, 32
    b_batched = (0, K * N)
    p = Problem(M, N, K, (1, M), (N, 1), (N, 1), batch, batch, (0, 0), b_batched, (0, M * N), precision="tf32")
    plan = select(p, dev)
    assert plan.kernel.family == "wgmma_tf32" and plan.staging == (("a", M, K),) and plan.swap_ab
    assert "staged: A copied K-major (384x512," in plan.describe()
    p = dataclasses.replace(p, M=1024, a_strides=(1, 1024), a_batch_strides=(0, K * 1024), c_batch_strides=(0, 1024 * N))
    plan = select(p, dev)
    assert plan.staging == (("bt", N, K),) and not plan.swap_ab  # 32 x 256 rows < 32 x 1024
    assert f"staged: B transposed copied K-major ({batch} x {N}x{K}," in plan.describe()


@pytest.mark.parametrize("arch", SM80_PLUS)
def test_staging_only_when_the_copy_is_cheap_and_the_layout_allows(arch):
    dev = DEV[arch]
    # small: the copy would cost more than it saves (M / 4 < STAGE_MIN_FLOP_PER_BYTE for B)
    assert select(Problem.dense(1000, 1001, 1000), dev).staging == ()
    assert STAGE_MIN_FLOP_PER_BYTE * 4 > 1000
    # aligned: nothing to stage
    assert select(Problem.dense(4096, 4096, 4096), dev).staging == ()
    assert select(Problem.dense(4096, 4096, 4096, precision="tf32x3"), dev, force="tf32_mma").staging == ()
    if arch == "sm_90":  # wgmma: a row-major B is read in place (C^T = B^T A^T); A^T as well
        plan = select(Problem.dense(4096, 4096, 4096, precision="tf32"), dev)
        assert plan.staging == () and plan.swap_ab
        assert select(Problem.dense(4096, 4096, 4096, precision="tf32", b_t=True), dev).staging == ()
        assert select(Problem.dense(4096, 4096, 4096, precision="tf32", a_t=True, b_t=True), dev).staging == ()
        # A^T with a row-major B: one of them is copied K-major (A where M <= N, then swapped)
        plan = select(Problem.dense(4096, 4096, 4096, precision="tf32", a_t=True), dev)
        assert plan.staging == (("a", 4096, 4096),) and plan.swap_ab
        plan = select(Problem.dense(4096, 2048, 4096, precision="tf32", a_t=True), dev)
        assert plan.staging == (("bt", 2048, 4096),) and not plan.swap_ab
        # tf32x3: both operands always, split into TF32 halves by the stage_kmajor kernels
        plan = select(Problem.dense(4096, 4096, 4096, precision="tf32x3", b_t=True), dev)
        assert plan.staging == (("a", 4096, 4096), ("bt", 4096, 4096))
        assert [dict(k.macros)["SPLIT"] for k in plan.stagers] == [1, 1]
        assert select(Problem.dense(1024, 1024, 1024, precision="tf32x3"), dev).kernel.family == "wgmma_tf32"
        # (512^3: too few tiles for wgmma; tf32x3 then runs fp32 SIMT, faster than mma.sync here)
        assert select(Problem.dense(512, 512, 512, precision="tf32x3"), dev).kernel.family == "simt_cp_async"
    else:
        assert select(Problem.dense(4096, 4096, 4096, precision="tf32"), dev).staging == ()
    # batched: no staging (one buffer per launch)
    assert select(Problem.dense(2048, 2047, 2047, batch=2), dev).staging == ()
    # transposed B (k-contiguous): copied row-major for SIMT products of TRANSPOSE_B_MIN_M rows
    # or more (a transpose by stage_kmajor, through shared memory), read in place below that
    # and when batched
    plan = select(Problem.dense(4097, 4095, 4093, b_t=True), dev)
    assert plan.staging == (("b", 4093, 4096),) and macros(plan)["B_MODE"] == LOAD_VEC_FAST
    assert dict(plan.stagers[0].macros)["SRC_R_CONTIG"] == 1
    assert "B (K-contiguous, as nn.Linear stores its weight) transposed into a row-major 4093x4096" in plan.describe()
    m = simt_core.TRANSPOSE_B_MIN_M
    assert select(Problem.dense(m, 16384, 1024, b_t=True), dev).staging == (("b", 1024, 16384),)
    plan = select(Problem.dense(m - 1, 16384, 1024, b_t=True), dev)
    assert plan.staging == () and macros(plan)["B_MODE"] == LOAD_ELEM_K
    # only where the in-place plan takes the 128 x 256 tile and no fused split (the smaller tiles
    # gain at most 2% from a row-major B; a fused split's sum would spill with it); the rules'
    # plans (RULES: the mid-size split model weighs the copy itself, test_simt_split_model.py)
    bigs = []
    for p in (Problem.dense(m, 4096, 4096, b_t=True), Problem.dense(m, 3072, 1024, b_t=True)):
        in_place = select(p, dev, variants=(SimtCpAsync(transpose_b=False, split_model=False),)).kernel
        big = in_place.tile[:2] == (128, 256) and not in_place.split_fused
        assert select(p, dev, variants=RULES).staging == ((("b", p.K, p.N),) if big else ())
        bigs.append(big)
    if arch == "sm_90":  # (768 x 4096 x 4096: 128 x 256 tiles split in cluster pairs; 768 x 3072 x 1024:
        assert bigs == [True, False]  # 128 x 128 tiles, as the big tile's slices would be under 384)
    assert select(Problem.dense(2048, 4096, 4096, b_t=True, batch=2), dev).staging == ()
    variant = (SimtCpAsync(transpose_b=False),)
    assert select(Problem.dense(4096, 4096, 4096, b_t=True), dev, variants=variant).staging == ()
    # a misaligned pointer alone (N % 4 == 0) is staged too
    plan = select(Problem.dense(4096, 4096, 4096, align=4), dev)
    assert ("b", 4096, 4096) in plan.staging and macros(plan)["B_MODE"] == LOAD_VEC_FAST
    # families that are not staged
    assert select(Problem.dense(4097, 4095, 4093), dev, force="scalar").staging == ()
    assert select(Problem.dense(16, 4095, 4093), dev).staging == ()  # skinny reads B once in place


def test_tf32x3s_copy_bound_on_wgmma_scales_with_the_devices_memory_bandwidth():
    h200, h100 = DEV["sm_90"], DeviceFacts.simulated_h100()
    # attn_pv_2k's shape with both operands' halves staged (P^T @ dO: an m-contiguous A, which the
    # kernel cannot read in place), 20.1 FLOP per copied byte. On the H200 wgmma with its copies
    # tied the fp32 SIMT plan (P @ V, then staged too: the bound, 20, is set there); on the H100 its
    # copies take 1.47x as long and the SIMT plan ran 1.27x faster (NOTES run 46)
    pv = Problem.dense(2048, 128, 2048, "tf32x3", batch=32, a_t=True)
    on_h200 = select(pv, h200)
    assert on_h200.kernel.family == "wgmma_tf32" and on_h200.staging == (("a", 2048, 2048), ("bt", 128, 2048))
    on_h100 = select(pv, h100)
    assert on_h100.kernel.family == "simt_cp_async" and on_h100.kernel == select(dataclasses.replace(pv, precision="ieee"), h100).kernel
    reason = dict(on_h100.rejected)["wgmma_tf32"]
    assert "20.1 FLOP per copied byte, under 29.3 at 3.35 TB/s" in reason, reason
    # (FLOP per copied byte here is M N / (6 (M + N)), whatever K: twice the columns make 37.9,
    # over the H100's bound, and the product stays on wgmma there)
    wide = Problem.dense(2048, 256, 2048, "tf32x3", batch=32, a_t=True)
    assert select(wide, h100).kernel.family == "wgmma_tf32" and select(wide, h100).staging
    # tf32's bound is not scaled (its alternative, tf32_mma, runs 2-4x slower): 77 x 1531 x 2053
    # (18 FLOP per copied byte, both operands copied: K % 4 != 0) runs wgmma on either part
    odd = Problem.dense(77, 1531, 2053, "tf32", b_t=True)
    for dev in (h200, h100):
        plan = select(odd, dev, force="wgmma_tf32")
        assert plan.staging and plan.kernel.family == "wgmma_tf32"
        assert "too costly" not in dict(select(odd, dev).rejected).get("wgmma_tf32", "")


def test_tf32_mma_keeps_two_fragment_sets_only_for_tf32_with_16_byte_copies_of_both_operands():
    for arch in SM80_PLUS:
        m = macros(forced(Problem.dense(4096, 4096, 4096, precision="tf32"), arch, "tf32_mma"))
        assert m["A_VEC"] == m["B_VEC"] == 1 and m["FRAG_PIPE"] == 1, arch
        m = macros(forced(Problem.dense(4096, 4096, 4096, precision="tf32x3"), arch, "tf32_mma"))
        assert m["FRAG_PIPE"] == 0  # tf32x3: no registers for a second set
    # 4-byte copies of B (N odd, too small to stage): ptxas spilled with two sets
    m = macros(forced(Problem.dense(512, 511, 512, precision="tf32"), "sm_90", "tf32_mma"))
    assert m["B_VEC"] == 0 and m["FRAG_PIPE"] == 0
    plan = forced(Problem.dense(4096, 4096, 4096, precision="tf32"), "sm_90", "tf32_mma")
    assert "fragment registers: two sets" in plan.describe()


def test_tf32_mma_gives_8_warp_blocks_4_stages_and_smaller_blocks_3():
    m = macros(forced(Problem.dense(8192, 4096, 6144, precision="tf32"), "sm_90", "tf32_mma"))
    assert (m["WARPS_M"], m["WARPS_N"], m["WARP_N"], m["STAGES"]) == (2, 4, 64, 4)
    m = macros(forced(Problem.dense(256, 256, 65536, precision="tf32"), "sm_90", "tf32_mma"))
    assert (m["WARPS_M"] * m["WARPS_N"], m["STAGES"]) == (4, 3)  # two such blocks per H200 SM
    m = macros(forced(Problem.dense(8192, 4096, 6144, precision="tf32"), "sm_80", "tf32_mma"))
    assert m["STAGES"] == 3  # 4 stages of 128 x 256 do not fit the A100's 163 KiB


def test_split_k_may_fill_a_whole_wave_beyond_max_split():
    """largeK on the H200: 2 tiles of 128 x 256 split 66 ways fill all 132 SMs (64, the old cap,
    left 4 idle); below one wave's worth, MAX_SPLIT still caps."""
    plan = select(Problem.dense(256, 256, 65536), DEV["sm_90"])
    assert plan.kernel.family == "simt_cp_async" and plan.kernel.tile[:2] == (128, 256)  # k-dominant: largest tile
    assert plan.kernel.split_k == 66 and plan.kernel.grid[:2] == (2, 66)
    assert split_cap(2, 132) == 66 and split_cap(4, 264) == 66 and split_cap(64, 132) == MAX_SPLIT


# --- stream-K: whole waves, then the rest of the tiles in pieces ---------------------------------

@pytest.mark.parametrize("M,N,K,whole,blocks,iters", [(8192, 4096, 6144, 924, 132, 582),
                                                       (8192, 8192, 4096, 1980, 132, 264),
                                                       (4096, 4096, 4096, 396, 132, 450),
                                                       (4096, 11008, 4096, 1320, 132, 218)])
def test_a_partial_last_wave_of_simt_tiles_runs_stream_k_on_the_h200(M, N, K, whole, blocks, iters):
    """The headline shapes: 7.76, 15.5, 3.88 and 10.4 waves of 128x256 tiles on 132 SMs. The whole
    waves run as they are, one more wave of blocks shares the other tiles' k-tiles evenly
    (hand-computed: 8192x4096x6144 leaves 100 tiles of 768 k-tiles, 76800 dealt 582 a block)."""
    plan = select(Problem.dense(M, N, K), DEV["sm_90"])
    sk = plan.kernel.stream_k
    assert sk is not None and (sk.whole_tiles, sk.blocks, sk.iters) == (whole, blocks, iters), plan.describe()
    assert "stream-K" in plan.describe() and "then: stream_k_fixup" in plan.describe()
    check_geometry(plan)


@pytest.mark.parametrize("problem,why", [
    (Problem.dense(8448, 4096, 6144), "whole waves: 1056 tiles = 8 x 132"),
    (Problem.dense(4097, 4095, 4093), "whole waves: 528 tiles = 4 x 132"),
    (Problem.dense(4096, 4096, 1024), "short K: the pieces' fixed costs eat the gain"),
    (Problem.dense(2048, 2048, 2048), "under one wave (128 tiles)"),
    (Problem.dense(2048, 2048, 2048, batch=8), "batched"),
    (Problem.dense(256, 256, 65536), "split-K's ground (2 tiles)"),
])
def test_no_stream_k_where_it_cannot_pay(problem, why):
    plan = select(problem, DEV["sm_90"])
    assert plan.kernel.stream_k is None, why
    assert plan.reduce is None or plan.reduce.family == "splitk_reduce"


def test_stream_k_follows_the_split_flag_the_tile_and_the_load_modes():
    """Option flag 0 (never split K) rules stream-K out as well; only the 8-warp 128x256 tile
    takes it (one block per SM; the 128x128 one spills with the stream-K loop); an m-contiguous
    A with single-float B copies along k (spills on sm_80 .. sm_89) does not."""
    fam, dev = FAMILIES["simt_cp_async"], DEV["sm_90"]
    p = Problem.dense(8192, 4096, 6144)
    assert fam.configure(p, dev, fam.tile_options[0] + (0,)).stream_k is None
    assert fam.configure(p, dev, fam.tile_options[0] + (1,)).stream_k is not None
    for opt in fam.tile_options[1:]:
        assert fam.configure(p, dev, opt + (1,)).stream_k is None
    a_m_b_k = Problem(8192, 4096, 6141, (1, 8192), (1, 6141), (4096, 1))  # A^T; B^T, K % 4 != 0
    cfg = fam.configure(a_m_b_k, dev)
    m = dict(cfg.macros)
    assert (m["A_MODE"], m["B_MODE"]) == (LOAD_VEC_FAST, LOAD_ELEM_K) and cfg.stream_k is None


def test_stream_k_beats_split_k_where_the_model_says_so():
    """199 tiles of 128x256 (1.5 waves) of 256 k-tiles on 132 SMs. Split-K's best, 5 ways, models
    ceil(995 / 132) = 8 waves of fifths plus 8% = 1.73 waves; stream-K runs one whole wave, then
    67 x 256 k-tiles dealt 130 a block over 132 blocks, plus 3 k-tiles a piece and the fixup's
    traffic: 400.7 k-tiles = 1.56 waves (hand-computed). So stream-K, and no split."""
    dev = DEV["sm_90"]
    p = Problem.dense(128 * 199, 256, 2048)
    assert split_k_for(p, dev, 199, 8) == 5 and split_time(199, 5, 132) == pytest.approx(1.728)
    plan = select(p, dev)
    sk = plan.kernel.stream_k
    assert sk is not None and plan.kernel.split_k == 1
    assert (sk.whole_tiles, sk.blocks, sk.iters, sk.k_tiles) == (132, 132, 130, 256)
    check_geometry(plan)


def test_stream_k_stays_within_32_bit_k_tile_counts():
    """A long K over broadcast (stride-0) operands: in one launch the last block's stretch would
    end past 2^31 k-tiles (the kernel's counters are 32-bit), so not in one launch; the head form's
    stream-K launch counts only the 2 tiles after the head's 132."""
    p = Problem(17152, 256, 128207976, (0, 1), (1, 0), (256, 1))
    plan = select(p, DEV["sm_90"])
    sk = plan.kernel.stream_k
    assert sk.head_tiles == 132 and sk.whole_tiles == 0 and sk.blocks * sk.iters < 2**31
    tiles, k_tiles = 134, -(-p.K // 8)
    assert tiles * k_tiles < 2**31  # the bound that was checked before, which this case passes
    assert (tiles // 132 * 132) * k_tiles + sk.blocks * sk.iters > 2**31  # one launch's last stretch end
    one = dataclasses.replace(FAMILIES["simt_cp_async"], stream_k_head=False)
    assert select(p, DEV["sm_90"], variants=(one,)).kernel.stream_k is None


@settings(max_examples=300, deadline=None)
@given(M=st.integers(1, 40_000), N=st.integers(1, 20_000), K=st.integers(1, 1 << 17), arch=st.sampled_from(SM80_PLUS),
       tile=st.sampled_from([0, 1]), sms=st.integers(1, 160), a_t=st.booleans())
def test_stream_k_deals_every_k_tile_once_and_the_fixup_sums_each_piece(M, N, K, arch, tile, sms, a_t):
    """Whatever the SM count and shape: where the planner takes stream-K, the deal and the fixup
    agree (check_stream_k), in one launch or (A^T on sm_90) in the head form; where it does not,
    the plan is the plain or split-K one."""
    fam = FAMILIES["simt_cp_async"]
    dev = dataclasses.replace(DEV[arch], sm_count=sms)
    p = Problem.dense(M, N, K, a_t=a_t)
    cfg = fam.configure(p, dev, fam.tile_options[tile] + (1,))
    plan = Plan(p, dev, cfg, "ieee", reduce=second_pass_config(p, dev, cfg), head=stream_k_head_config(cfg))
    check_geometry(plan)


@pytest.mark.parametrize("N,tile_n", [(256, 256), (512, 256), (400, 256), (64, 128), (100, 128), (300, 128)])
def test_simt_long_k_takes_the_largest_tile_only_where_it_pads_n_no_more(N, tile_n):
    """k-dominant SIMT plans: 128x256 measured best at largeK; where a 256-wide tile would pad N
    more than a 128-wide one (N = 64: twice the FFMAs), the 128x128 tile."""
    plan = forced(Problem.dense(512, N, 65536), "sm_90", "simt_cp_async")
    assert plan.kernel.tile[:2] == (128, tile_n) and plan.kernel.split_k > 1
    check_geometry(plan)


def test_tf32_mma_counts_two_blocks_per_sm_only_where_shared_memory_holds_them():
    """A single long-K tile: on the H200 two 128x128 blocks fit an SM (264 slots); on an A100 one
    (108 slots), so the split stops at one wave there instead of asking for 216 slices."""
    p = Problem.dense(128, 128, 1 << 20, precision="tf32")
    h200 = forced(p, "sm_90", "tf32_mma").kernel
    a100 = forced(p, "sm_80", "tf32_mma").kernel
    assert (h200.tile[:2], a100.tile[:2]) == ((128, 128), (128, 128))
    assert DEV["sm_90"].sm_count < h200.split_k <= 2 * DEV["sm_90"].sm_count  # (effective_split: 263)
    assert MAX_SPLIT < a100.split_k <= DEV["sm_80"].sm_count


def test_single_float_c_staged_on_any_tile_in_shared_memory_that_keeps_the_blocks():
    """On sm_90 single-float C is staged on every SIMT tile, growing the shared memory past the
    pipeline's buffers (C_STAGE_FLOATS: the tile's rows at C_PITCH) only where the SM still holds
    as many blocks; the bias form that reads one value a thread (EPILOGUE_FORM 1) only where the
    threads tile whole rows (its static_assert); not the tiles whose staged build spills
    (staged_c_spills); SimtCpAsync(stage_c_all_tiles=False) stages the largest tile alone."""
    dev = DEV["sm_90"]
    largest_only = (SimtCpAsync(stage_c_all_tiles=False),)
    scores = Problem.dense(197, 197, 128, batch=64, b_t=True)  # 128 x 128: 2 blocks an SM either way
    assert "C_STAGED" not in macros(select(scores, dev, variants=largest_only))
    k = select(scores, dev).kernel
    m = dict(k.macros)
    assert k.tile[:2] == (128, 128) and m["C_STAGED"] == 1 and m["C_STAGE_FLOATS"] == 128 * 128
    assert k.smem == 4 * 128 * 128 > SimtCpAsync().smem_bytes(128, 128, m["STAGES"])
    assert 2 * (k.smem + 1024) <= dev.smem_per_sm
    assert "through shared memory" in dict(k.details)["C stores"]
    # an SM whose shared memory holds two blocks of the pipeline's size, not two of the tile's:
    # not grown (on the H100 and H200 no planned tile reaches that bound)
    small = dataclasses.replace(dev, smem_per_sm=110 * 1024)
    k = select(scores, small).kernel
    assert k.tile[:2] == (128, 128) and "C_STAGED" not in dict(k.macros)
    assert 2 * (k.smem + 1024) <= small.smem_per_sm < 2 * (4 * 128 * 128 + 1024)
    eight = dataclasses.replace(Problem.dense(77, 77, 64, batch=96, b_t=True), epilogue=EPILOGUE_BIAS_N)
    k = select(eight, dev).kernel  # 128 x 64 of 8 x 8 threads: rows pitched by 64 + 16
    m = dict(k.macros)
    assert k.tile[:2] == (128, 64) and m["C_STAGED"] == 1 and m["C_STAGE_FLOATS"] == 128 * 80
    assert m["EPILOGUE_FORM"] == 1  # (128 threads: two whole rows of 64 columns)
    wide = dataclasses.replace(Problem.dense(33, 1001, 197, a_t=True, b_t=True), epilogue=EPILOGUE_BIAS_N)
    k = select(wide, dev).kernel  # 64 x 256 of 128 threads: half a row each
    m = dict(k.macros)
    assert k.tile[:2] == (64, 256) and m["C_STAGED"] == 1 and m["EPILOGUE"] == 1 and "EPILOGUE_FORM" not in m
    aligned = Problem.dense(197, 196, 64, batch=64, b_t=True)  # float4 stores: nothing staged
    assert "C_STAGED" not in macros(select(aligned, dev))
    assert "C_STAGED" not in macros(select(scores, DEV["sm_80"]))  # (measured on sm_90 only)
    # the tiles whose staged build spills keep the stores from the registers: the 32-row tiles,
    # and the 128 x 128 tile with A in single floats along k beside B's float4 units along n
    short = Problem.dense(17, 4095, 1100, b_t=True)  # (decode-like rows: the 32 x 128 tile)
    k = select(short, dev).kernel
    assert k.family == "simt_cp_async" and k.tile[0] == 32 and "C_STAGED" not in dict(k.macros)
    capped = dataclasses.replace(Problem.dense(2047, 1001, 197), b_strides=(1004, 1))  # (B's rows padded)
    k = select(capped, dev, variants=RULES).kernel  # (the rules' 128 x 128 tile)
    m = dict(k.macros)
    assert k.tile[:2] == (128, 128) and (m["A_MODE"], m["B_MODE"]) == (LOAD_ELEM_K, LOAD_VEC_FAST)
    assert "C_STAGED" not in m


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tf32_mma_counts_the_one_warp_tile_at_its_rate_where_an_operand_is_copied_in_single_floats(arch):
    """Attention's P @ V at L = 197 (K = 197: P's rows are copied in single floats) takes the
    4-warp 128 x 64 tile, which pads no more than the one-warp 64 x 64 tile (H100: 97.4 us against
    172.6 one-warp and 140.0 on 128 x 128; torch 99.6). Where the area rule still picks the
    one-warp tile, it computes at ONE_WARP_RATE: a multi-warp tile that pads less than its area over
    that rate is taken instead; with 16-byte copies of both operands the one-warp tile keeps
    products it covers tightest (64 x 64 x 64: 75.4 against 93.3 us for 64 x 128)."""
    from fastmm.families.tf32_mma import ONE_WARP_RATE

    assert ONE_WARP_RATE < 0.5  # (else the 4-warp tile's twice the area would not win below)
    pv = Problem.dense(197, 64, 197, precision="tf32", batch=768)
    m = macros(forced(pv, arch, "tf32_mma"))
    assert forced(pv, arch, "tf32_mma").kernel.tile[:2] == (128, 64) and m["A_VEC"] == 0
    assert (m["WARPS_M"], m["WARPS_N"], m["WARP_N"]) == (2, 2, 32)  # four warps of 64 x 32
    small = Problem.dense(77, 64, 77, precision="tf32", batch=96)  # 96 blocks of 128 x 64 fill no wave
    k = forced(small, arch, "tf32_mma").kernel
    assert "not the one-warp 64x64 tile" in dict(k.details)["tile"]  # (what explain prints)
    assert forced(small, arch, "tf32_mma").kernel.tile[:2] == (64, 128)
    aligned = Problem.dense(64, 64, 64, precision="tf32", batch=4096)
    m = macros(forced(aligned, arch, "tf32_mma"))
    assert "tile" not in dict(forced(aligned, arch, "tf32_mma").kernel.details)
    assert forced(aligned, arch, "tf32_mma").kernel.tile[:2] == (64, 64) and m["A_VEC"] == m["B_VEC"] == 1
    # only a one-warp choice moves: the area rule's multi-warp choices stay (a rate inside the
    # area rule once raised the tightest area all options are held to: 128 x 256 here)
    multi = Problem.dense(661, 661, 197, precision="tf32", batch=16, b_t=True)
    assert forced(multi, arch, "tf32_mma").kernel.tile[:2] == (64, 128)


def test_tf32_attention_dv_reads_both_operands_in_place_on_tf32_mma_up_to_128_wide():
    """dV = P^T @ dO: A m-contiguous (wgmma would feed it from registers) and B row-major (wgmma
    would copy it K-major first). Up to N = 128 tf32_mma reading both in place was faster on eight
    of nine such products (H100, NOTES run 56); wider, and P @ V itself, stay on wgmma."""
    dev = DEV["sm_90"]
    dv = Problem.dense(512, 64, 512, a_t=True, precision="tf32", batch=384)
    plan = select(dv, dev)
    m = macros(plan)
    assert plan.kernel.family == "tf32_mma" and plan.kernel.tile[:2] == (128, 64) and m["A_SMEM_MK"] == 0
    assert m["A_VEC"] == m["B_VEC"] == 1 and not plan.staging  # (both read in place, 16 bytes at a time)
    assert "fed from registers" in rejected(plan)["wgmma_tf32"]
    head128 = select(Problem.dense(1024, 128, 1024, a_t=True, precision="tf32", batch=64), dev)
    assert head128.kernel.family == "tf32_mma" and head128.kernel.tile[:2] == (128, 128)
    wide = select(Problem.dense(1024, 256, 1024, a_t=True, precision="tf32", batch=16), dev)
    assert wide.kernel.family == "wgmma_tf32"
    pv = select(Problem.dense(512, 64, 512, precision="tf32", batch=128), dev)  # A K-major: no copy
    assert pv.kernel.family == "wgmma_tf32" and not pv.staging
    x3 = select(Problem.dense(512, 64, 512, a_t=True, precision="tf32x3", batch=384), dev)
    assert x3.kernel.family != "tf32_mma"  # (tf32x3 on mma.sync is slower than fp32 SIMT here)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tf32_mma_counts_the_one_warp_tile_at_its_16_byte_rate_too(arch):
    """With 16-byte copies of both operands the one-warp tile runs at ONE_WARP_RATE_VEC of the
    multi-warp tiles' rate (0.62 and 0.71 measured): 32-wide heads' dV over 300 tokens takes the
    4-warp 128 x 64 tile that pads 1.2x its area (H100: 56.6 against 66.0 us); 64 x 64 x 64
    products, where any other tile pads twice the area, keep it."""
    from fastmm.families.tf32_mma import ONE_WARP_RATE, ONE_WARP_RATE_VEC

    assert ONE_WARP_RATE < ONE_WARP_RATE_VEC < 1 / 1.2
    dv = Problem.dense(300, 32, 300, a_t=True, precision="tf32", batch=256)
    k = forced(dv, arch, "tf32_mma").kernel
    assert k.tile[:2] == (128, 64) and macros(forced(dv, arch, "tf32_mma"))["A_VEC"] == 1
    assert "one warp a block runs at ~0.65" in dict(k.details)["tile"]
    small = Problem.dense(64, 64, 64, precision="tf32", batch=4096)
    assert forced(small, arch, "tf32_mma").kernel.tile[:2] == (64, 64)


def test_tf32x3_blocks_keep_3_stages_and_one_warp_blocks_one_fragment_set():
    m = macros(forced(Problem.dense(8192, 4096, 6144, precision="tf32x3"), "sm_90", "tf32_mma"))
    assert m["WARPS_M"] * m["WARPS_N"] == 8 and m["STAGES"] == 3  # 4 stages measured for tf32 only
    fam = FAMILIES["tf32_mma"]
    p = Problem.dense(2048, 2048, 2048, precision="tf32")
    m = dict(fam.configure(p, DEV["sm_80"], (1, 1, 64, 0)).macros)
    assert m["A_VEC"] == m["B_VEC"] == 1 and m["FRAG_PIPE"] == 0  # ptxas spilled 12-28 bytes on sm_80


def test_long_k_splits_run_in_cluster_pairs_on_sm90_only():
    """An even split of the 8-warp SIMT tile runs in cluster pairs on sm_90 (the pair adds its
    partial tiles through distributed shared memory: half the workspace slices for the reduce),
    with 8 stages; elsewhere, or for an odd split, every split row has its own slice."""
    h200 = select(Problem.dense(256, 256, 65536), DEV["sm_90"])
    k = h200.kernel
    assert k.family == "simt_cp_async" and k.grid[:2] == (2, 66) and k.split_pair and k.split_slices == 33
    assert dict(k.macros)["SPLIT_PAIR"] == 1 and dict(k.macros)["STAGES"] == SimtCpAsync.big_tile_split_stages[(9, 0)]
    assert "cluster pairs" in dict(k.details)["split-K"] and "33 partial tiles" in dict(k.details)["split-K"]
    assert dict(h200.reduce.details)["order"].startswith("sums the 33 partial slices")
    check_geometry(h200)
    for arch in ("sm_80", "sm_86", "sm_89"):  # no clusters before sm_90
        plan = select(Problem.dense(256, 256, 65536), DEV[arch])
        assert plan.kernel.split_k > 1 and not plan.kernel.split_pair and "SPLIT_PAIR" not in dict(plan.kernel.macros)
        assert plan.kernel.split_slices == plan.kernel.split_k
        check_geometry(plan)
    odd = select(Problem.dense(128, 11008, 4096), DEV["sm_90"])  # decode128: 43 tiles x 3 splits
    assert odd.kernel.split_k == 3 and not odd.kernel.split_pair and odd.kernel.split_slices == 3
    assert dict(odd.kernel.macros)["STAGES"] == SimtCpAsync.big_tile_split_stages[(9, 0)]
    whole = select(Problem.dense(8448, 4096, 6144), DEV["sm_90"])  # whole waves: no split, 12 stages
    assert whole.kernel.split_k == 1 and dict(whole.kernel.macros)["STAGES"] == SimtCpAsync.big_tile_stages[(9, 0)]


@pytest.mark.parametrize("arch", ARCHS)
def test_only_skinny_plans_on_sm90_ask_for_dependent_launch(arch):
    """Programmatic dependent launch (KernelConfig.dependent_launch) was measured faster for the
    skinny kernel on the H200 and slower for split-K GEMMs (their reduce's waiting blocks share
    the SMs): the flag is set for plans of the skinny families (skinny, and skinny_kmajor for
    B^T) on sm_90+ only, and explain shows it."""
    dev = DEV[arch]
    for M, N, K in ((1, 4096, 4096), (16, 4096, 4096), (32, 4096, 16384), (256, 256, 65536), (4096, 4096, 4096)):
        for precision, b_t in (("ieee", False), ("tf32", False), ("ieee", True), ("tf32", True)):
            plan = select(Problem.dense(M, N, K, precision=precision, b_t=b_t), dev)
            for cfg in (plan.kernel, plan.reduce, *plan.stagers):
                if cfg is None:
                    continue
                want = cfg.family in ("skinny", "skinny_kmajor", "kmajor_mma") and dev.cc >= (9, 0)
                assert cfg.dependent_launch is want, (arch, M, N, K, precision, cfg.family)
                assert any(k == "launch" for k, _ in cfg.details) is want


@pytest.mark.parametrize("M,N,K,batch,b_t,tile", [
    (512, 64, 512, 128, False, (128, 64)),  # attention's P.V: N = 64
    (2048, 128, 2048, 32, False, (128, 128)),  # P.V with 128-wide heads
    (128, 128, 64, 1024, True, (128, 64)),  # many small heads (K = 64: 8 x 8 tiles, batched_thin_k)
    (64, 14336, 4096, 1, True, (64, 64)),  # decode with 64 rows
])
def test_simt_tiles_do_not_pad_the_output_far_beyond_a_smaller_tile(M, N, K, batch, b_t, tile):
    """The 128 x 256 tile filled the wave on these too, at 2-4x the FFMAs of the output (rows and
    columns past M and N are computed like real ones): 360 us against 145 for P.V on the H200."""
    plan = select(Problem.dense(M, N, K, "ieee", batch=batch, b_t=b_t), DeviceFacts.simulated_device("sm_90"))
    assert plan.kernel.family == "simt_cp_async" and plan.kernel.tile[:2] == tile, plan.describe()


def test_a_simt_split_variant_sets_the_slices_of_plans_that_may_split():
    """SimtCpAsync(split=S) (a probe's variant): S slices (as split_range deals k-tiles out: never
    an empty slice), fused up to FUSED_SPLIT_MAX (or ``fused_split_max``) with no second launch, a
    reduce pass above; a batch is never split; without the variant the wave model's choice stands."""
    dev = DEV["sm_90"]
    p = Problem.dense(300, 700, 1100, "ieee", b_t=True)
    planned = select(p, dev, force="simt_cp_async")
    assert select(p, dev, force="simt_cp_async", variants=(SimtCpAsync(),)).kernel.grid == planned.kernel.grid
    for S, fused in ((1, False), (3, True), (4, True), (8, False), (16, False)):
        plan = select(p, dev, force="simt_cp_async", variants=(SimtCpAsync(split=S, stream_k=False),))
        assert plan.kernel.grid[1] == S
        assert ("SPLIT_FUSED" in macros(plan)) == fused and (plan.reduce is not None) == (S > 1 and not fused)
    k_tiles = -(-1100 // 8)  # 138: 100 slices would deal 2 k-tiles each, so 69 get work
    assert select(p, dev, force="simt_cp_async", variants=(SimtCpAsync(split=100, stream_k=False),)).kernel.grid[1] == 69 \
        == -(-k_tiles // -(-k_tiles // 100))
    batched = Problem.dense(300, 700, 1100, "ieee", b_t=True, batch=3)
    assert select(batched, dev, force="simt_cp_async", variants=(SimtCpAsync(split=8),)).kernel.grid[1] == 1
    # fused_split_max (a probe's variant): the last blocks sum up to that many slices, one launch
    assert SimtCpAsync().fused_split_max == FUSED_SPLIT_MAX
    for S, most, fused in ((8, 8, True), (8, 16, True), (8, 6, False), (5, 5, True)):
        plan = select(p, dev, force="simt_cp_async", variants=(SimtCpAsync(split=S, stream_k=False, fused_split_max=most),))
        assert macros(plan).get("SPLIT_FUSED", 0) == (S if fused else 0) and (plan.reduce is None) == fused, (S, most)


@pytest.mark.parametrize("M,N,K,want", [
    # (rows, width, slices) measured faster on the H200 than the 128-row plan (NOTES run 40, GPU us)
    (300, 700, 1100, (64, 64, 1)),  # 14.4 -> 10.4 (33 tiles of 128 x 64; 55 of 64 x 64)
    (384, 768, 768, (64, 64, 1)),  # 8.8 -> 7.1
    (128, 4096, 4096, (64, 64, 1)),  # 35.4 (128-row split) -> 26.5: full rows of tiles
    (192, 4096, 4096, (64, 128, 1)),  # 52.3 -> 29.4
    (1000, 1000, 1000, (64, 128, 1)),  # 13.7 -> 13.4: as many tiles, fewer rows past M
    (197, 768, 3072, (64, 128, 4)),  # 24.0 (tf32_mma) -> 16.6: K >= 3072 and under half the SMs filled
    (512, 512, 2048, (64, 64, 1)),  # 16.5 -> 13.0: K = 2048, every split slower
    (145, 2560, 1536, (64, 64, 1)),  # 21.1 -> 11.8: a partial row of tiles, B of 15 MiB
    # stays on 128-row tiles
    (700, 2304, 768, (128, 128, 1)),  # 216 tiles of 128 x 64: a wave filled
    (65, 4096, 4096, (128, 128, 4)),  # partial row, B of 64 MiB: 45.1 on 64 rows against 31.0
    (80, 4096, 4096, (128, 128, 4)),  # 37.4 against 31.2
    (200, 2048, 16384, (128, 128, 4)),  # K >= 8192
    (128, 4096, 11008, (128, 128, 4)),  # full rows, K >= 8192: 63.1 either way
    # the rule's edges (plans, not measurements)
    (135, 4171, 1024, (128, 64, 1)),  # exactly 132 tiles of 128 x 64: a wave filled
    (1157, 804, 1024, (128, 64, 1)),  # 130 tiles of 128 x 64, but 64-row tiles fit no width in one wave
    (80, 4096, 2560, (128, 64, 1)),  # a partial row of tiles, B of 40 MiB: over half of L2
    (128, 4096, 2560, (64, 64, 1)),  # the same B under full rows
])
def test_mid_size_tf32_products_take_64_row_tiles_where_128_row_tiles_leave_a_wave_unfilled(M, N, K, want):
    """Above 64 rows, a tf32 x @ W.t() whose 128 x 64 tiles fill under one wave of SMs runs on
    64-row tiles where they load no more per SM ((BM + BN) x waves), K < 8192, and a partial last
    row of tiles does not make B (beyond half of L2) come from memory once a row; split only from
    K = 3072 where 64 x 64 tiles fill under half the SMs. Explain says why."""
    plan = select(Problem.dense(M, N, K, "tf32", b_t=True), DEV["sm_90"])
    k = plan.kernel
    assert k.family == "wgmma_tf32" and (k.tile[0], k.tile[1], k.split_k) == want, plan.describe()
    if want[0] == 64:
        assert "fill under one wave of 132 SMs" in dict(k.details)["tile rows"]
        assert k.block == 256  # (one consumer warpgroup and the producer)
    check_geometry(plan)


def test_the_mid_size_rule_leaves_batches_tf32x3_row_major_b_and_a_disabled_rows64_alone():
    """The rule was measured on batch-1 tf32 products with A K-major, and with A fed from registers
    as C^T (a row-major B; run 42): a batch, tf32x3 (B split by the kernel on 64-row tiles only up
    to 64 rows), an m-contiguous A read in place (C along n), ``rows64_a_mn=False`` for the C^T
    form and ``rows64=False`` keep 128-row tiles."""
    dev = DEV["sm_90"]
    rows = lambda p, *v: select(p, dev, force="wgmma_tf32", variants=v).kernel.tile[0]  # noqa: E731
    assert rows(Problem.dense(300, 700, 1100, "tf32", b_t=True)) == 64
    assert rows(Problem.dense(300, 700, 1100, "tf32", b_t=True), WgmmaTf32(rows64=False)) == 128
    assert rows(Problem.dense(300, 700, 1100, "tf32", batch=2, b_t=True)) == 128
    assert rows(Problem.dense(300, 700, 1100, "tf32x3", b_t=True)) == 128
    assert rows(Problem.dense(300, 700, 1100, "tf32")) == 64  # (row-major B: computed as C^T, A_MN)
    assert rows(Problem.dense(300, 700, 1100, "tf32"), WgmmaTf32(rows64_a_mn=False)) == 128
    assert rows(Problem.dense(300, 700, 1100, "tf32", a_t=True, b_t=True)) == 128  # (A_MN, C along n)
    # a forced width wins over the rule's, and explain says it was forced
    forced = select(Problem.dense(300, 700, 1100, "tf32", b_t=True), dev, force="wgmma_tf32",
                    variants=(WgmmaTf32(force_bn=128),)).kernel
    assert forced.tile[:2] == (64, 128) and "(the width forced)" in dict(forced.details)["tile rows"]
    # rows64="always" is not the rule: its width is the wave rule's, and explain says it was asked for
    mid = Problem.dense(512, 512, 2048, "tf32", b_t=True)
    always = select(mid, dev, force="wgmma_tf32", variants=(WgmmaTf32(rows64="always"),)).kernel
    assert always.tile[:2] == (64, 128) and select(mid, dev).kernel.tile[:2] == (64, 64)  # (13.0 us, 64 wide: measured)
    assert "asked for (rows64='always')" in dict(always.details)["tile rows"]
    wide = select(Problem.dense(700, 2304, 768, "tf32", b_t=True), dev, force="wgmma_tf32",
                  variants=(WgmmaTf32(rows64="always"),)).kernel
    assert wide.tile[0] == 64 and "asked for (rows64='always')" in dict(wide.details)["tile rows"]
    # the rule does not change which family takes a product: tf32_mma's split estimate counts 128 x 64 tiles
    assert select(Problem.dense(200, 512, 3000, "tf32", b_t=True), dev).kernel.family == "tf32_mma"


def test_a_fed_from_registers_takes_64_row_tiles_as_c_transposed():
    """A_MN on 64-row tiles (fragments loaded a k-step ahead, a_mn_step) where C is written along
    m: a row-major B into a row-major C, as C^T (each Linear's grad_x). The K-major A's rules
    (ROWS64_MAX_M, the mid-size rule's widths, 128 rows where the tiles fill the SMs) without the
    mid-size rule's K bound; these products' tiles fill half the SMs or their K is
    short, so they run unsplit (splits: the next test); an m-contiguous A read in place (C along
    n) keeps 128 rows; ``rows64_a_mn=False`` gives 128 rows, ``rows64="always"`` 64; explain says
    how the fragments are loaded; without ``rows64_a_mn_split`` the 128-row tile's own split
    stays and explain says why the 64-row tile is unsplit."""
    dev = DEV["sm_90"]
    off = WgmmaTf32(rows64_a_mn=False)

    def plan_of(p, *variants, force="wgmma_tf32"):
        return select(p, dev, force=force, variants=variants)

    # (M, N, K) of g @ W (W row-major) -> the kernel's 64-row tile width; C^T: the kernel's M is N
    for (M, N, K), width in (((1024, 768, 3072), 128), ((1024, 1024, 2816), 128), ((300, 1100, 700), 64),
                             ((512, 1024, 4096), 64), ((511, 1536, 8960), 128), ((1500, 384, 1536), 128)):
        p = Problem.dense(M, N, K, "tf32")
        rule, without = plan_of(p), plan_of(p, off)
        assert rule.swap_ab and dict(rule.kernel.macros)["A_MN"] == dict(without.kernel.macros)["A_MN"] == 1
        assert rule.kernel.tile[:2] == (64, width) and dict(rule.kernel.macros)["BM"] == 64, rule.kernel.details
        assert rule.kernel.split_k == 1 and "SPLIT" not in dict(rule.kernel.macros), (M, N, K)
        assert "during the step before" in dict(rule.kernel.details)["A, B loads"]
        assert "A fed from registers: at any K, unsplit" not in dict(rule.kernel.details)["tile rows"]
        if M > 64 and N > 64:  # (the mid-size rule without the split: explain says why unsplit)
            unsplit = plan_of(p, WgmmaTf32(rows64_a_mn_split=False)).kernel
            assert "A fed from registers: at any K, unsplit" in dict(unsplit.details)["tile rows"]
        assert without.kernel.tile[0] == 128 and "during the step before" not in dict(without.kernel.details)["A, B loads"]
    # without rows64_a_mn_split, where the 128-row tile's own rule splits it (few tiles over a long
    # K) that plan stays: 48 rows as C^T (SPLIT_MAX_M's rule), few tall tiles (SPLIT_TALL_*); so do
    # forced splits (with it, a forced split runs on 64-row tiles)
    for M, N, K in ((4096, 48, 8192), (700, 300, 6000)):
        kept = plan_of(Problem.dense(M, N, K, "tf32"), WgmmaTf32(rows64_a_mn_split=False))
        assert kept.kernel.tile[0] == 128 and dict(kept.kernel.macros)["A_MN"] == 1 and kept.kernel.split_k > 1
        assert kept.kernel.macros == plan_of(Problem.dense(M, N, K, "tf32"), off).kernel.macros
    for split_field, rows in ((False, 128), (True, 64)):
        forced = plan_of(Problem.dense(300, 1100, 2000, "tf32"), WgmmaTf32(split=2, rows64_a_mn_split=split_field))
        assert forced.kernel.tile[0] == rows and forced.kernel.split_k == 2
    # the K-major A keeps its K bound and its split (ROWS64_MID_MAX_K, ROWS64_MID_SPLIT_MIN_K)
    assert plan_of(Problem.dense(511, 1536, 8960, "tf32", b_t=True)).kernel.tile[0] == 128
    assert plan_of(Problem.dense(197, 768, 3100, "tf32", b_t=True)).kernel.split_k > 1
    # tiles that fill the SMs keep 128 rows; rows64="always" takes 64 there
    big = Problem.dense(4096, 4096, 4096, "tf32")
    assert plan_of(big).kernel.tile[0] == 128 and plan_of(big, WgmmaTf32(rows64="always")).kernel.tile[0] == 64
    # an m-contiguous A read in place (no swap: C along n) keeps 128 rows unless asked for
    mn = Problem.dense(1000, 700, 1100, "tf32", a_t=True, b_t=True)
    for variants, rows in (((), 128), ((WgmmaTf32(rows64="always"),), 64)):
        plan = plan_of(mn, *variants)
        assert not plan.swap_ab and dict(plan.kernel.macros)["A_MN"] == 1 and plan.kernel.tile[0] == rows
    # a split asked for still splits A_MN on 64-row tiles
    forced = plan_of(Problem.dense(197, 768, 3100, "tf32"), WgmmaTf32(rows64="always", split=3)).kernel
    assert forced.tile[0] == 64 and forced.split_k == 3 and "unsplit" not in dict(forced.details)["tile rows"]
    # 256 wide, a D of any strides is applied to C from registers there (staged for the copy engine it spilled)
    p = Problem.dense(1000, 1000, 700, "tf32", a_t=True, b_t=True)
    for epilogue, staged in ((EPILOGUE_D, False), ("bias_n", True)):
        for rows64, want in (("always", staged), (False, True)):
            k = plan_of(dataclasses.replace(p, epilogue=epilogue), WgmmaTf32(rows64=rows64, force_bn=256)).kernel
            assert dict(k.macros)["A_MN"] == 1 and bool(dict(k.macros).get("TMA_STORE")) == want, (epilogue, rows64)


def test_a_fed_from_registers_splits_on_64_row_tiles_over_any_number_of_lines():
    """``rows64_a_mn_split`` (on: ROWS64_A_MN_SPLIT): A_MN's 64-row tiles take the 64-row split
    rule as a K-major A's do, over any launch M + N (the bound of 2048 lines, measured wrong on
    the H200 and mostly wrong on the H100, is only a probe variant now), with K under
    ROWS64_A_MN_SPLIT_MAX_K (largeK stays with tf32_mma's deep split). Where they split they
    replace the 128-row tile's split; where they do not, that split stays. With the old bound
    set, explain says when the lines alone keep the tile unsplit. Off, the 64-row tile runs
    unsplit above ROWS64_MAX_M rows and every 128-row split stays."""
    dev = DEV["sm_90"]
    off = WgmmaTf32(rows64_a_mn_split=False)
    bounded = WgmmaTf32(rows64_a_mn_split_max_lines=ROWS64_A_MN_SPLIT_OLD_MAX_LINES)
    plan_of = lambda p, *v: select(p, dev, force="wgmma_tf32", variants=v).kernel  # noqa: E731
    assert WgmmaTf32().rows64_a_mn_split and WgmmaTf32().rows64_a_mn_split_max_lines is None
    cases = (  # (M, N, K) of g @ W (W row-major, C^T: the launch is N x M) or of g.t() @ x (a_t) -> (tile, slices)
        ((197, 768, 3072, False), ((64, 128), 4)), ((700, 300, 6000, False), ((64, 128), 4)),
        ((320, 768, 3072, True), ((64, 128), 3)),
        # 4000+ lines above ROWS64_MAX_M rows as launched (C^T 4096 x 48-64): split as well (H200:
        # 68.9 -> 52.7 and 28.9 -> 25.8 us in 2 slices, NOTES run 45)
        ((48, 4096, 11008, False), ((64, 64), 2)), ((64, 4096, 4096, False), ((64, 64), 2)),
        ((65, 1984, 3072, False), ((64, 128), 4)),
        # at most ROWS64_MAX_M rows as launched (C^T 48 x 4096): the 64-row rule's split, at any K
        ((4096, 48, 8192, False), ((64, 128), 4)), ((4096, 48, 14336, False), ((64, 128), 4)),
        ((511, 8, 16384, False), ((64, 64), 4)),
        # tiles that fill half the SMs: unsplit
        ((511, 1536, 8960, False), ((64, 128), 1)), ((1024, 768, 3072, False), ((64, 128), 1)),
        ((192, 1984, 4096, False), ((64, 64), 1)))
    plans = {}
    for (M, N, K, a_t), want in cases:
        p = Problem.dense(M, N, K, "tf32", a_t=a_t)
        k, unsplit = plan_of(p), plan_of(p, off)
        assert dict(k.macros)["A_MN"] == 1 and (k.tile[:2], k.split_k) == want, (M, N, K, k.tile, k.split_k)
        assert "at any K, unsplit" not in dict(k.details)["tile rows"] and "lines of K" not in dict(k.details)["tile rows"]
        launch_rows = select(p, dev, force="wgmma_tf32").launch_problem.M
        # (off: no 64-row split above ROWS64_MAX_M rows as launched)
        assert unsplit.split_k == 1 or unsplit.tile[0] == 128 or launch_rows <= 64, (M, N, K)
        plans[(M, N, K, a_t)] = k
    # the old bound (a variant): unsplit over more than 2048 lines above ROWS64_MAX_M rows as
    # launched, and explain names the lines exactly where the bound is what keeps the tile unsplit
    for (M, N, K, a_t), k in plans.items():
        p = Problem.dense(M, N, K, "tf32", a_t=a_t)
        old = plan_of(p, bounded)
        launch = select(p, dev, force="wgmma_tf32").launch_problem
        over = launch.M > 64 and launch.M + launch.N > ROWS64_A_MN_SPLIT_OLD_MAX_LINES
        assert (old.split_k, old.tile) == ((1, (64, 64, 32)) if over and k.split_k > 1 and k.tile[0] == 64
                                           else (k.split_k, k.tile)), (M, N, K)
        said = "lines of K (> 2048): unsplit" in dict(old.details)["tile rows"]
        assert said == (old.split_k == 1 and k.split_k > 1), (M, N, K, dict(old.details)["tile rows"])
    assert "lines of K" in dict(plan_of(Problem.dense(48, 4096, 11008, "tf32"), bounded).details)["tile rows"]
    # with a forced width the 64-row rule cannot split (256 wide is not one of its widths): not the lines' doing
    forced = plan_of(Problem.dense(128, 2048, 4096, "tf32"), WgmmaTf32(force_bn=256, rows64_a_mn_split_max_lines=2048))
    assert forced.split_k == 1 and "lines of K" not in dict(forced.details)["tile rows"]
    # the old bound's edge: C^T 1984 x 64 splits (31 tiles), 1984 x 65 (62 tiles, one line more) did not
    assert plan_of(Problem.dense(64, 1984, 3072, "tf32"), bounded).split_k == 4
    assert plan_of(Problem.dense(65, 1984, 3072, "tf32"), bounded).split_k == 1
    # where the 64-row tile does not split, a 128-row split stays (64 x 64 tiles would fill half the
    # SMs: 700 x 384); where it splits, it replaces one (C^T 128 x 2048, 2176 lines: 128 x 128 in 8
    # before, and under the old bound)
    p = Problem.dense(700, 384, 5120, "tf32")
    k = plan_of(p)
    assert k.tile[0] == 128 and k.split_k > 1 and k.macros == plan_of(p, off).macros
    p = Problem.dense(2048, 128, 8192, "tf32")
    k, before = plan_of(p), plan_of(p, bounded)
    assert (k.tile[:2], k.split_k) == ((64, 128), 4) and dict(k.macros)["A_MN"] == 1
    assert before.tile[0] == 128 and before.split_k == 8 and before.macros == plan_of(p, off).macros
    # largeK as given (row-major B, A_MN): K past ROWS64_A_MN_SPLIT_MAX_K, no 64-row split; the planner: tf32_mma
    large = Problem.dense(256, 256, 65536, "tf32")
    assert 65536 >= ROWS64_A_MN_SPLIT_MAX_K and plan_of(large).macros == plan_of(large, off).macros
    assert select(large, dev).kernel.family == "tf32_mma"


def test_a_fed_from_registers_splits_its_64_row_tiles_from_a_shorter_k_than_a_k_major_a():
    """ROWS64_A_MN_SPLIT_MIN_K: above ROWS64_MAX_M rows, A_MN's 64-row tiles split from K = 2048
    (its k-steps run slower, so a split of few tiles pays sooner), a K-major A's from
    ROWS64_MID_SPLIT_MIN_K; below that, only where the split is on 64-wide tiles (where the
    128-wide split would be taken, the 64 x 64 tile unsplit measured faster). The guard on 64 x
    64 tiles filling half the SMs holds for both. The planner then takes wgmma's split over
    tf32_mma's (384 x 256 x 2816 g @ W, measured 1.75x)."""
    dev = DEV["sm_90"]
    plan_of = lambda p, *v: select(p, dev, force="wgmma_tf32", variants=v).kernel  # noqa: E731
    old = WgmmaTf32(rows64_a_mn_split_min_k=ROWS64_MID_SPLIT_MIN_K)
    assert ROWS64_A_MN_SPLIT_MIN_K == 2048 < ROWS64_MID_SPLIT_MIN_K == 3072
    # g @ W (W row-major: C^T, A_MN) and g.t() @ x at K = 2048-3071 with few 64 x 64 tiles: 64 wide in
    # 4 slices; the old bound: unsplit
    for M, N, K, a_t in ((384, 256, 2816, False), (66, 768, 2048, False), (1000, 96, 2304, False),
                         (197, 300, 2816, True), (65, 256, 2048, True)):
        p = Problem.dense(M, N, K, "tf32", a_t=a_t)
        k, before = plan_of(p), plan_of(p, old)
        assert dict(k.macros)["A_MN"] == 1 and (k.tile[:2], k.split_k) == ((64, 64), 4), (M, N, K, k.tile, k.split_k)
        assert before.tile[0] == 64 and before.split_k == 1, (M, N, K)
    # where the 64-row rule would split 128 wide (the 128-wide tiles in slices fill half the SMs):
    # unsplit below ROWS64_MID_SPLIT_MIN_K, split from it
    for M, N, K, a_t in ((192, 700, 2304, False), (512, 512, 2048, False), (197, 1000, 2048, True)):
        k = plan_of(Problem.dense(M, N, K, "tf32", a_t=a_t))
        assert dict(k.macros)["A_MN"] == 1 and (k.tile[:2], k.split_k) == ((64, 64), 1), (M, N, K, k.tile, k.split_k)
        longer = plan_of(Problem.dense(M, N, ROWS64_MID_SPLIT_MIN_K, "tf32", a_t=a_t))
        assert longer.tile[:2] == (64, 128) and longer.split_k > 1, (M, N, longer.tile, longer.split_k)
    assert select(Problem.dense(384, 256, 2816, "tf32"), dev).kernel.family == "wgmma_tf32"
    assert select(Problem.dense(384, 256, 2816, "tf32"), dev, variants=(old,)).kernel.family == "tf32_mma"
    # at most ROWS64_MAX_M rows as launched (C^T 48 x 4096), and rows64="always": the 64-row rule as before
    k = plan_of(Problem.dense(4096, 48, 2048, "tf32"))
    assert dict(k.macros)["A_MN"] == 1 and (k.tile[:2], k.split_k) == ((64, 128), 4), (k.tile, k.split_k)
    k = plan_of(Problem.dense(192, 700, 2304, "tf32"), WgmmaTf32(rows64="always"))
    assert (k.tile[:2], k.split_k) == ((64, 128), 4), (k.tile, k.split_k)
    # a forced width is judged by the rule's own width: 64 wide forced where the rule would split 128
    # wide stays unsplit (65 x 1536 x 2048: 33 tiles of 64 x 64), and 128 wide forced where it splits 64 wide splits
    assert plan_of(Problem.dense(65, 1536, 2048, "tf32"), WgmmaTf32(force_bn=64)).split_k == 1
    k = plan_of(Problem.dense(384, 256, 2816, "tf32"), WgmmaTf32(force_bn=128))
    assert (k.tile[:2], k.split_k) == ((64, 128), 4), (k.tile, k.split_k)
    # the K-major twin of the launch (x @ W.t(), 256 x 384 x 2816): unsplit below ROWS64_MID_SPLIT_MIN_K
    k = plan_of(Problem.dense(256, 384, 2816, "tf32", b_t=True))
    assert dict(k.macros)["A_MN"] == 0 and k.tile[0] == 64 and k.split_k == 1
    # 64 x 64 tiles filling half the SMs: unsplit for A_MN too (C^T 768 x 511: 96 of them)
    k = plan_of(Problem.dense(511, 768, 11008, "tf32"))
    assert dict(k.macros)["A_MN"] == 1 and tiles_of(select(Problem.dense(511, 768, 11008, "tf32"), dev,
                                                           force="wgmma_tf32").launch_problem, 64, 64) >= 66
    assert k.tile[0] == 64 and k.split_k == 1


def test_64_row_split_of_a_fed_from_registers_takes_the_narrow_width_where_n_fits_it():
    """_rows64_split's ``skip_padded`` (A_MN only, where it was measured): where N fits 64
    columns, the 128-wide tile gives as many tiles with half of each padding, so the split takes
    64 wide; a K-major A keeps the rule's 128-wide preference."""
    dev = DEV["sm_90"]
    options = WgmmaTf32().tile_options(False)
    launch = Problem.dense(1984, 64, 3072, "tf32")  # 31 tiles at either width
    assert tiles_of(launch, 64, 128) == tiles_of(launch, 64, 64) == 31
    assert WgmmaTf32._rows64_split(launch, dev, options)[0][0] == 128
    assert WgmmaTf32._rows64_split(launch, dev, options, skip_padded=True)[0][0] == 64
    # the planner: C^T 1984 x 64 of g @ W (A_MN) 64 wide; x @ W.t() with N = 64 (K-major) 128 wide
    k = select(Problem.dense(64, 1984, 3072, "tf32"), dev, force="wgmma_tf32").kernel
    assert dict(k.macros)["A_MN"] == 1 and k.tile[:2] == (64, 64) and k.split_k == 4
    k = select(Problem.dense(511, 64, 3072, "tf32", b_t=True), dev, force="wgmma_tf32").kernel
    assert dict(k.macros)["A_MN"] == 0 and k.tile[:2] == (64, 128) and k.split_k > 1


def test_tf32x3_splits_an_in_place_a_in_registers_on_narrow_tall_products():
    """Attention's P @ V and dS @ K (A the L x S scores, K-major; N the head size): staging A's halves
    moved 12 bytes an element for 2N FLOP, most of the call (H100: 1007 us staged, 341 with A split
    in registers, 404 on the fp32 SIMT plan that the copy bound chose before). By default the
    kernel splits A in registers (X3_A_REGS) where the copy engine reads A in place, N <=
    X3_A_REGS_MAX_N (from X3_A_REGS_MIN_N), K >= X3_A_REGS_MIN_K, M >= X3_A_REGS_MIN_ROWS_PER_COLUMN x N
    and there are X3_A_REGS_MIN_TILES 128 x 128 tiles, on either part: only B's halves are staged,
    and the copy bound passes."""
    def staged(plan):
        return {w for w, _, _ in plan.staging}

    rows = X3_A_REGS_MIN_ROWS_PER_COLUMN * X3_A_REGS_MAX_N
    tall = X3_A_REGS_MIN_TILES * 128 // 2  # (two 128 x 128 tiles a row of tiles at N = 256)
    for dev in (DEV["sm_90"], DeviceFacts.simulated_h100()):
        for p in (Problem.dense(1024, 64, 1024, "tf32x3", batch=128), Problem.dense(2048, 128, 2048, "tf32x3", batch=32),
                  Problem.dense(512, 64, 512, "tf32x3", batch=128),
                  Problem.dense(max(rows, tall), X3_A_REGS_MAX_N, 1024, "tf32x3", b_t=True)):
            plan = select(p, dev)
            assert plan.kernel.family == "wgmma_tf32", (p, dict(plan.rejected))
            assert dict(plan.kernel.macros).get("X3_A_REGS") == 1 and staged(plan) == {"bt"}, p
            assert "split into big and small TF32 halves in registers" in plan.describe()
            assert f"{p.N} columns (at most {X3_A_REGS_MAX_N})" in dict(plan.kernel.details)["A split"]
        # wider, narrower, shorter; B not much smaller than A (q @ k^T at L = 128); too few tiles; an A the copy engine
        # cannot read K-major (P^T @ dO, a misaligned A): A's halves staged as before
        for p in (Problem.dense(8192, X3_A_REGS_MAX_N + 4, 1024, "tf32x3", b_t=True),
                  Problem.dense(8192, X3_A_REGS_MIN_N - 16, 1024, "tf32x3", b_t=True),
                  Problem.dense(1024, 64, X3_A_REGS_MIN_K - 8, "tf32x3", batch=128),
                  Problem.dense(128, 128, 64, "tf32x3", batch=1024, b_t=True),
                  Problem.dense(rows - 4, X3_A_REGS_MAX_N, 1024, "tf32x3", b_t=True),
                  Problem.dense(rows - 4, X3_A_REGS_MAX_N, 1024, "tf32x3", batch=8, b_t=True),  # (M < 4N alone)
                  Problem.dense(2048, 256, 4096, "tf32x3", b_t=True),
                  Problem.dense(2048, 128, 2048, "tf32x3", batch=32, a_t=True),
                  Problem.dense(4096, 128, 4096, "tf32x3", align=4)):
            plan = select(p, dev, force="wgmma_tf32")
            assert "X3_A_REGS" not in dict(plan.kernel.macros) and "a" in staged(plan), p
        plan = select(Problem.dense(1024, 64, 1024, "tf32", batch=128), dev, force="wgmma_tf32")
        assert "X3_A_REGS" not in dict(plan.kernel.macros)
        # the switch still forces either way
        p = Problem.dense(1024, 64, 1024, "tf32x3", batch=128)
        off = select(p, dev, force="wgmma_tf32", variants=(WgmmaTf32(x3_a_regs=False),))
        assert "X3_A_REGS" not in dict(off.kernel.macros) and staged(off) == {"a", "bt"}
        on = select(Problem.dense(2048, 256, 4096, "tf32x3", b_t=True), dev, force="wgmma_tf32",
                    variants=(WgmmaTf32(x3_a_regs=True),))
        assert dict(on.kernel.macros)["X3_A_REGS"] == 1


def test_tf32x3_splitting_a_in_registers_128_wide_with_c_from_registers_promotes_every_k_step():
    """The one X3_A_REGS build NVRTC 13.0 spilled in (a register: 8 bytes of stack): 128 wide, C
    stored from registers, the big products promoted every 2 k-steps. That form promotes every
    k-step instead (as accurate or more); with C through the copy engine, or narrower, every 2 as
    X3_SHORT_K says; a forced ``promote_every`` still wins."""
    dev = DEV["sm_90"]
    p = Problem.dense(1000, 1000, 600, "tf32x3", b_t=True)

    def every(**fields):
        plan = select(p, dev, force="wgmma_tf32", variants=(WgmmaTf32(x3_a_regs=True, **fields),))
        m = dict(plan.kernel.macros)
        assert m["X3_A_REGS"] == 1 and m["BN"] == fields["force_bn"]
        assert ("every k-step" if m["PROMOTE_EVERY"] == 1 else "every 2 k-steps") in dict(plan.kernel.details)["math"]
        return m["PROMOTE_EVERY"]

    assert every(force_bn=128, tma_store=False) == 1
    assert every(force_bn=128, tma_store=True) == 2 and every(force_bn=96, tma_store=False) == 2
    assert every(force_bn=128, tma_store=False, promote_every=2) == 2


def test_tf32x3_splits_a_in_registers_under_x3_a_regs_and_then_stages_b_alone():
    """tf32x3 on 128-row tiles stages both operands' halves on wide products; under ``x3_a_regs`` the
    kernel splits A in registers (X3_A_REGS): A read in place, or copied K-major in fp32 (not
    split) where a map cannot read it; not with a D of any strides nor a forced split (their
    128-wide builds spilled), nor on 64-row tiles (B split by the kernel there). The slot holds A
    once, so the ring takes less shared memory; explain says where A is split."""
    dev = DEV["sm_90"]
    on = WgmmaTf32(x3_a_regs=True)

    def staged(plan):
        return {w: dict(s.macros)["SPLIT"] for (w, _, _), s in zip(plan.staging, plan.stagers)}

    p = Problem.dense(8192, 1024, 1024, "tf32x3", b_t=True)
    default, regs = select(p, dev), select(p, dev, variants=(on,))
    assert staged(default) == {"a": 1, "bt": 1} and "X3_A_REGS" not in dict(default.kernel.macros)
    assert staged(regs) == {"bt": 1} and dict(regs.kernel.macros)["X3_A_REGS"] == 1
    assert regs.kernel.tile == default.kernel.tile and regs.kernel.smem < default.kernel.smem
    assert "split into big and small TF32 halves in registers" in dict(regs.kernel.details)["A, B loads"]
    copied = select(Problem.dense(1024, 1024, 8192, "tf32x3", a_t=True), dev, variants=(on,))
    assert staged(copied) == {"a": 0, "bt": 1} and dict(copied.kernel.macros)["X3_A_REGS"] == 1
    assert "copied K-major in fp32" in copied.describe()
    for q, variant in ((dataclasses.replace(p, epilogue=EPILOGUE_D), on),
                       (Problem.dense(1000, 1000, 4096, "tf32x3", b_t=True), WgmmaTf32(x3_a_regs=True, split=3))):
        plan = select(q, dev, force="wgmma_tf32", variants=(variant,))
        assert staged(plan) == {"a": 1, "bt": 1} and "X3_A_REGS" not in dict(plan.kernel.macros)
    decode = select(Problem.dense(40, 4096, 4096, "tf32x3", b_t=True), dev, force="wgmma_tf32", variants=(on,))
    m = dict(decode.kernel.macros)
    assert m["BM"] == 64 and m["X3_SPLIT_B"] == 1 and "X3_A_REGS" not in m and staged(decode) == {"a": 1}
    assert "X3_A_REGS" not in dict(select(with_precision(p, "tf32"), dev, variants=(on,)).kernel.macros)


def test_tf32x3_on_wgmma_promotes_every_k_step_up_to_x3_short_k_unless_a_variant_says_how_often():
    """The tensor core truncates as it accumulates, so the big products leave it every k-step up
    to K = X3_SHORT_K (1.3e-7 relative error on the H200) and every 2 beyond (2.0e-7, ~15% faster),
    both under cuBLAS fp32's error at their K;
    ``WgmmaTf32(promote_every=n)`` fixes the interval (probes: x3_bias_probe.py); explain says it."""
    dev = DEV["sm_90"]
    kernel = lambda K, *v: select(Problem.dense(4096, 4096, K, "tf32x3", b_t=True), dev,  # noqa: E731
                                  force="wgmma_tf32", variants=v).kernel
    assert X3_SHORT_K == 256  # (where cuBLAS fp32's own error passes 2.0e-7: RESULTS run 3)
    assert dict(kernel(256).macros)["PROMOTE_EVERY"] == 1 and "every k-step" in dict(kernel(256).details)["math"]
    assert dict(kernel(288).macros)["PROMOTE_EVERY"] == 2 and "every 2 k-steps" in dict(kernel(288).details)["math"]
    assert dict(kernel(64).macros)["PROMOTE_EVERY"] == 1 and dict(kernel(1024).macros)["PROMOTE_EVERY"] == 2
    forced = kernel(8192, WgmmaTf32(promote_every=1))
    assert dict(forced.macros)["PROMOTE_EVERY"] == 1 and "every k-step" in dict(forced.details)["math"]
    assert dict(kernel(256, WgmmaTf32(promote_every=2)).macros)["PROMOTE_EVERY"] == 2
    # the split form too (tf32x3 on 64-row tiles, B split by the kernel, K in 4 slices)
    split = select(Problem.dense(48, 4096, 4096, "tf32x3", b_t=True), dev, force="wgmma_tf32",
                   variants=(WgmmaTf32(promote_every=1),)).kernel
    assert split.split_k == 4 and dict(split.macros)["PROMOTE_EVERY"] == 1
    with pytest.raises(ValueError, match="promote_every must be at least 1"):
        kernel(8192, WgmmaTf32(promote_every=0))
