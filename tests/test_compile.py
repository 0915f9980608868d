"""NVRTC compiles every kernel family for every supported arch (fastmm.runtime.compiler,
fastmm.runtime.sources), with the macros the planner really produces.

The configurations come from ``fastmm.plan.select(problem, device, force=family)`` over a set of
problems chosen to reach every load mode, shared-memory layout, tile option and precision; a
coverage test proves they do. They are reduced to a set that still covers every macro value
and tile per (arch, family, precision), and compiled once each, in parallel.
"""
from __future__ import annotations

import dataclasses
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest

from fastmm.families import FAMILIES, Skinny, WgmmaTf32
from fastmm.families.wgmma_tf32 import STAGED_TURNS_160
from fastmm.families.simt_core import copies_fit
from fastmm.families.simt_cp_async import HALF_TILE_OPTIONS, NARROW_TILE_OPTIONS, SHORT_TILE_OPTIONS
from fastmm.plan import select
from fastmm.problem import EPILOGUE_BIAS_M, EPILOGUE_BIAS_N, EPILOGUE_D, EPILOGUE_NONE, DeviceFacts, Problem
from fastmm.runtime.compiler import CompileError, compile_cubin
from fastmm.runtime.sources import kernel_sources, source_dir
from fastmm.tuned import TunedChoice

SM80_PLUS = ("sm_80", "sm_86", "sm_89", "sm_90")
FAMILIES_FOR = {arch: tuple(f for f in FAMILIES if f != "wgmma_tf32") for arch in SM80_PLUS}
FAMILIES_FOR["sm_90"] += ("wgmma_tf32",)  # built for sm_90a: cc 9.0 only (its stage_kmajor pass: sm_90)
FAMILIES_FOR["sm_75"] = ("scalar", "simt_float4", "skinny")
EM_CUDA = 190


def _problems() -> list[Problem]:
    out = []
    for precision in ("ieee", "tf32", "tf32x3"):
        dense = [
            (8192, 8192, 4096, {}),  # aligned, largest tile
            (1000, 1001, 1003, {}),  # N and K not multiples of 4
            (1024, 1022, 1024, {}),  # N even, not a multiple of 4 (tf32 float2 stores)
            (4096, 4095, 1024, {}),  # N odd on the largest SIMT tile: C through shared memory (sm_90) ...
            (8192, 8191, 2048, {}),  # ... on the stream-K entry too
            (1024, 1024, 1024, {"align": 4}),  # storage offset 1
            (1024, 1024, 1024, {"align": 8}),  # storage offset 2
            (1024, 1024, 1024, {"a_t": True}),  # transposed A
            (4096, 1024, 8192, {"a_t": True}),  # grad_W on the largest SIMT tile (sm_90: A in single floats) ...
            (1024, 1024, 8192, {"a_t": True}),  # ... split in cluster pairs
            (17024, 1024, 1024, {"a_t": True}),  # ... stream-K's head form (sm_90: a plain launch first)
            (1024, 1024, 1024, {"b_t": True}),  # transposed B
            (1024, 1024, 1024, {"a_t": True, "b_t": True}),
            (1023, 1024, 1023, {"a_t": True, "b_t": True}),  # transposed, odd extents
            (1024, 2048, 512, {}),  # mid sizes: with 512^2 and 8192^2 they reach every tile option
            (1536, 1536, 512, {}),
            (1024, 768, 1024, {}),  # tf32x3's 128 x 32 tile on sm_80, sm_89, sm_90 ...
            (768, 640, 1024, {}),  # ... and on sm_86 (the area rule keeps the larger products off it)
            (512, 512, 512, {}),  # small: small tile options
            (64, 64, 64, {}),
            (3, 5, 4, {}),
            (256, 256, 512, {"batch": 64}),  # batched
            (197, 64, 197, {"batch": 96}),  # attention's P @ V, 64 wide, rows of P unaligned: tf32's 128 x 64 tile
            (256, 256, 65536, {}),  # long K: split-K plus the reduce pass
            (16, 4096, 4096, {}),  # skinny M
            # the skinny family: MT 8 / 16 / 32, B as float4 or single floats, split-K or not
            (1, 4096, 4096, {}),  # MT 8, float4 B, split-K
            (32, 4096, 16384, {}),  # MT 32 (KCHUNK 128), float4 B, split-K
            (8, 1001, 300, {}),  # MT 8, N % 4 != 0: single floats
            (9, 2048, 512, {"b_t": True}),  # MT 16, transposed B: single floats
            (31, 1024, 1024, {"align": 4}),  # MT 32, misaligned B: single floats
            (16, 4096, 1024, {"batch": 3}),  # MT 16, batched: no split
        ]
        out += [Problem.dense(M, N, K, precision=precision, **kw) for M, N, K, kw in dense]
        # no unit stride on A or B (every other element of a wider tensor)
        out.append(Problem(1024, 1024, 1024, (2048, 2), (2048, 2), (1024, 1), precision=precision))
        # row-strided slice x[:, :K] with an odd row pitch
        out.append(Problem(1024, 1024, 1020, (1021, 1), (1029, 1), (1024, 1), precision=precision))
    return out


def _kmajor_problems() -> list[Problem]:
    """skinny_kmajor's (x @ W.t(): B K-contiguous, M <= 32): MT 1 / 2 / 4 / 8 / 16 / 32, float4 or
    single-float W rows, A staged with 16- or 4-byte copies, fused split or one slice. Planned for
    that family only, so the other families' covers (a subset of their planned configs) stay as
    they are (one such change once picked a tf32x3 build that spilled under NVRTC 13.0, fixed
    since: benchmarks/NOTES.md runs 16-17)."""
    dense = [(1, 4096, 4096, {}), (2, 14336, 4096, {}), (3, 1001, 4099, {}),  # K % 4 != 0: single floats, split
             (8, 4096, 4096, {}), (16, 4096, 4096, {}), (32, 4096, 16384, {}),
             (5, 1024, 1024, {"a_t": True}),  # A K-major: 4-byte copies
             (4, 4096, 512, {"batch": 3}),  # batched: one slice
             (4, 1024, 14336, {})]  # 8 warps along K, and 3 slices for A's shared memory
    return [Problem.dense(M, N, K, b_t=True, **kw) for M, N, K, kw in dense]


def _kmajor_mma_problems() -> list[Problem]:
    """kmajor_mma's (x @ W.t() on tensor cores, M <= 32), tf32 and tf32x3: one, two and four
    B-role fragments, float4 or single-float loads, a fused split or one slice, a batch, the epilogue.
    Planned for that family only (as skinny_kmajor's)."""
    dense = [(1, 4096, 4096, {}), (8, 14336, 4096, {}), (16, 4096, 4096, {}), (16, 14336, 4096, {}),
             (3, 1001, 4099, {}),  # K % 4 != 0: single floats, split
             (13, 1024, 1024, {"a_t": True}),  # A K-major: single floats
             (16, 4096, 512, {"batch": 3}),  # batched: one slice
             (32, 3584, 18944, {}), (17, 1001, 4099, {})]  # four fragments: float4 and single floats
    out = [Problem.dense(M, N, K, precision=precision, b_t=True, **kw)
           for precision in ("tf32", "tf32x3") for M, N, K, kw in dense]
    return out + [dataclasses.replace(p, epilogue=EPILOGUE_D) for p in out[:3] + out[9:12] + [out[7], out[16]]]


def _fused_split_problems() -> list[Problem]:
    """simt_cp_async's split-K plans that sum their own slices (SPLIT_FUSED): the 1024-token
    products of a small model (2, 3 and 4 slices on the H200), odd extents (single-float
    workspace and C), a transposed C, the epilogue. Planned for that family only."""
    dense = [(1024, 1024, 1024, {"b_t": True}), (1024, 2816, 1024, {"b_t": True}), (2816, 1024, 1024, {"a_t": True}),
             (1024, 256, 1024, {"b_t": True}), (999, 1001, 1100, {"a_t": True}), (999, 1001, 4100, {"a_t": True}),
             (683, 2048, 768, {"b_t": True}), (1000, 1000, 1024, {"c_t": True})]
    out = [Problem.dense(M, N, K, **{k: v for k, v in kw.items() if k != "c_t"}) for M, N, K, kw in dense]
    out[-1] = dataclasses.replace(out[-1], c_strides=(1, 1000))  # C column-major: single-float stores
    return out + [dataclasses.replace(p, epilogue=EPILOGUE_D) for p in out[::2]]


def _narrow_problems() -> list[Problem]:
    """simt_cp_async's 64-wide tiles of 16 x 8 outputs a thread (NARROW_TILE_OPTIONS), which the
    heuristic takes for one of them and the tuner may take for either: m-contiguous A (attention's
    dV) and k-contiguous A (P.V, dQ; with B^T too), B read as float4 or single floats, unsplit,
    split with a fused sum or a reduce pass."""
    dense = [(512, 64, 512, {"batch": 128}), (1024, 61, 1024, {}), (128, 64, 4096, {}), (384, 48, 100, {"batch": 3}),
             (1024, 64, 2048, {}), (197, 64, 197, {"batch": 12})]
    out = [Problem.dense(M, N, K, a_t=a_t, **kw) for a_t in (True, False) for M, N, K, kw in dense]
    out += [Problem.dense(512, 64, 512, batch=4, b_t=True), Problem.dense(1000, 63, 999, b_t=True)]
    return out + [dataclasses.replace(p, epilogue=EPILOGUE_D) for p in out[:3] + out[6:9]]


def _split_model_problems() -> list[Problem]:
    """Mid-size products whose simt_cp_async tile and split the split model chooses on sm_90
    (SimtCore.modelled_choice): W^T aligned and odd, a row-major W (grad_x), F.linear's bias and
    the general epilogue. Every tile with its modelled split, as the tuner may take each."""
    dense = [(1500, 2048, 512, {"b_t": True}), (733, 1999, 517, {"b_t": True}), (1023, 1537, 769, {"b_t": True}),
             (394, 3072, 768, {"b_t": True}), (1100, 512, 2048, {"b_t": True}), (1576, 768, 2304, {}),
             (640, 1024, 1536, {}), (1234, 517, 2222, {}), (1000, 3072, 1024, {"b_t": True}), (999, 1001, 1003, {})]
    out = [Problem.dense(M, N, K, **kw) for M, N, K, kw in dense]
    return out + [dataclasses.replace(p, epilogue=form) for p in out for form in (EPILOGUE_BIAS_N, EPILOGUE_D)]


def _half_problems() -> list[Problem]:
    """simt_cp_async's 64-row tiles of 16 x 8 outputs a thread (HALF_TILE_OPTIONS), which the
    heuristic takes for split plans of products whose last row tile is at most 64 rows and the
    tuner may take for either: x @ W.t() (A and B in single floats along k), a row-major B, an
    m-contiguous A (grad_W), unaligned rows, unsplit, split with a fused sum or a reduce pass, a
    fused epilogue."""
    dense = [(64, 4096, 4096, {"b_t": True}), (300, 700, 1100, {"b_t": True}), (64, 4096, 4096, {}),
             (320, 768, 3072, {"a_t": True}), (48, 1001, 999, {"b_t": True}), (300, 100, 200, {}),
             (40, 3072, 1024, {"b_t": True, "batch": 3}), (33, 257, 63, {"a_t": True})]
    out = [Problem.dense(M, N, K, **kw) for M, N, K, kw in dense]
    return out + [dataclasses.replace(p, epilogue=EPILOGUE_D) for p in out[:4]]


def _wgmma_problems() -> list[Problem]:
    """TF32 wgmma's tile widths (the wave rule: 256, 192, 128, 96, 64 for tf32; 128, 96, 64 for
    tf32x3 on the H200), each with C through the copy engine (TMA_STORE) and, for odd N or a
    transposed C, from registers, and (tf32, 64-192 wide) with the consumers taking turns; the
    fused epilogue on all. Planned for that family only."""
    dense = [(4096, 4096, 4096, {"b_t": True}), (4096, 3072, 1024, {"b_t": True}), (4096, 2304, 768, {"b_t": True}), (2048, 1024, 4096, {"b_t": True}),
             (1409, 2817, 40, {"b_t": True}), (1024, 1024, 1024, {"b_t": True}), (1025, 1023, 1024, {"b_t": True}),
             (2049, 1153, 40, {"b_t": True}), (4096, 2303, 768, {"b_t": True}), (257, 3000, 40, {"b_t": True}),
             (513, 2815, 40, {"b_t": True}), (4728, 3072, 768, {"b_t": True}), (4728, 3071, 768, {"b_t": True}),
             (1409, 2817, 520, {"b_t": True}), (2049, 2305, 520, {"b_t": True}), (4097, 2817, 515, {"b_t": True}),
             (1024, 1022, 1024, {"a_t": True, "b_t": True}), (1024, 1024, 1024, {"a_t": True, "b_t": True})]  # A_MN
    out = [Problem.dense(M, N, K, precision=precision, **kw) for precision in ("tf32", "tf32x3") for M, N, K, kw in dense]
    # tf32 products whose tiles leave SMs idle: K split over blocks (SPLIT), A K-major or
    # m-contiguous, N even or odd
    split = [(48, 4096, 11008, {"b_t": True}), (33, 2001, 8200, {"b_t": True}), (17, 4096, 4101, {"b_t": True}),
             (64, 4096, 8192, {"a_t": True, "b_t": True}), (64, 4095, 8192, {"a_t": True, "b_t": True})]
    out += [Problem.dense(M, N, K, precision="tf32", **kw) for M, N, K, kw in split]
    # a bias added as C is stored (EPILOGUE_VECTOR): over C's columns, over its rows (a row-major
    # B: C^T computed, so the bias runs along the kernel's rows)
    swapped = [Problem.dense(M, N, K, precision="tf32") for M, N, K in ((4096, 4096, 1024), (1025, 1023, 520))]
    biased = [dataclasses.replace(p, epilogue=EPILOGUE_BIAS_N) for p in out[:2 * len(dense)] + swapped]
    along_m = [0, 6, 8, 9, 12, len(dense), len(dense) + 6]  # (tf32 and tf32x3; C staged, or odd N: from registers)
    biased += [dataclasses.replace(out[i], epilogue=EPILOGUE_BIAS_M) for i in along_m]
    return out + [dataclasses.replace(p, epilogue=EPILOGUE_D) for p in out] + biased


def _epilogue_problems() -> list[Problem]:
    """Products with a fused epilogue (a bias, addmm's input): every family's final store with it,
    a split's reduce, a fused split's last block, stream-K's whole tiles and fixup."""
    dense = [(1024, 1024, 1024, {}), (1024, 1024, 1024, {"b_t": True}), (256, 256, 65536, {}),
             (8192, 8192, 4096, {}), (16, 4096, 4096, {}), (3, 5, 4, {})]
    out = [dataclasses.replace(Problem.dense(M, N, K, precision=precision, **kw), epilogue=EPILOGUE_D)
           for precision in ("ieee", "tf32", "tf32x3") for M, N, K, kw in dense]
    # a bias over C's columns or rows: on sm_90 the largest SIMT tile stores C through shared
    # memory with a bias over its columns (EPILOGUE_FORM 1), float4-able or not, plain and stream-K
    biased = [(8192, 1024, 1024, {"b_t": True}), (8192, 8192, 4096, {}), (4096, 4095, 1024, {}),
              (1024, 1024, 1024, {"b_t": True}), (1000, 1001, 1003, {})]
    out += [dataclasses.replace(Problem.dense(M, N, K, **kw), epilogue=form)
            for M, N, K, kw in biased for form in (EPILOGUE_BIAS_N, EPILOGUE_BIAS_M)]
    return out + [dataclasses.replace(p, epilogue=EPILOGUE_D) for p in _kmajor_problems()[:2]]


def _configs():
    """Unique (arch, KernelConfig) pairs, in a stable order."""
    seen, out = set(), []
    for arch, families in FAMILIES_FOR.items():
        dev = DeviceFacts.simulated_device(arch)
        work = [(p, families) for p in _problems()]
        work += [(p, ("skinny_kmajor",)) for p in _kmajor_problems() if "skinny_kmajor" in families]
        work += [(p, ("kmajor_mma",)) for p in _kmajor_mma_problems() if "kmajor_mma" in families]
        work += [(p, ("simt_cp_async",)) for p in _fused_split_problems() if "simt_cp_async" in families]
        work += [(p, families) for p in _epilogue_problems()]
        work += [(p, ("wgmma_tf32",)) for p in _wgmma_problems() if "wgmma_tf32" in families]
        if "simt_cp_async" in families:  # every narrow and half option, as the tuner may pick it
            fam = FAMILIES["simt_cp_async"]
            for p in (p for p in _split_model_problems() if fam.modelled(p, dev)):
                for opt in fam.options(p, dev):  # (with the epilogue, the reduce pass, B's copy)
                    for cfg in select(p, dev, tuned=TunedChoice("simt_cp_async", opt)).kernels():
                        key = (arch, cfg.source, cfg.macros)
                        if key not in seen:
                            seen.add(key)
                            out.append((arch, cfg))
            for p in _narrow_problems() + _half_problems():
                for opt in fam.options(p, dev):
                    if opt[:3] in fam.narrow_tiles(p) + fam.half_tiles(p):
                        cfg = fam.configure(p, dev, opt)
                        key = (arch, cfg.source, cfg.macros)
                        if key not in seen:
                            seen.add(key)
                            out.append((arch, cfg))
        for p, names in work:
            for family in names:
                # wgmma's planned configs with its consumers taking turns (the default where that
                # pays) and sharing tiles (copy-engine stores) at each width
                forms = ((), (WgmmaTf32(pingpong=False),)) if family == "wgmma_tf32" else ((),)
                try:
                    plans = [select(p, dev, force=family, variants=v) for v in forms]
                except ValueError:  # e.g. tf32_mma with precision "ieee"
                    continue
                for cfg in (c for plan in plans for c in plan.kernels()):
                    key = (arch, cfg.source, cfg.macros)
                    if key not in seen:
                        seen.add(key)
                        out.append((arch, cfg))
    return out


def _features(cfg) -> set:
    """What a config exercises: each macro value and its tile, per precision (tf32 vs tf32x3);
    for skinny, whose two macros change the code together (MT rows of accumulators, B_VEC the
    load path), every combination."""
    x3 = dict(cfg.macros).get("PRECISION_X3", 0)
    tile = tuple(v for k, v in cfg.macros if k in ("WARPS_M", "WARPS_N", "THREAD_M", "WARP_N"))
    out = {(x3, k, v) for k, v in cfg.macros} | {(x3, "tile", tile)}
    if cfg.family in ("skinny", "skinny_kmajor", "kmajor_mma", "stage_kmajor") or (cfg.family == "wgmma_tf32"):
        out.add(("combination", cfg.macros))
    if cfg.family == "simt_cp_async":  # the staged C store in each entry, with each form of a fused epilogue
        m = dict(cfg.macros)
        out.add(("C_STAGED x STREAM_K", m.get("C_STAGED", 0), m.get("STREAM_K", 0)))
        # grad_W's A in single floats beside a float4 B: the largest tile's own build on sm_90
        # (SimtCpAsync.a_single_float_tiles), unsplit and in cluster pairs, per tile
        if (m["A_MODE"], m["B_MODE"]) == (3, 0):
            out.add(("A single floats, B float4", tile, m.get("SPLIT_PAIR", 0), m.get("SPLIT_FUSED", 0)))
        if m.get("EPILOGUE_FORM"):
            out.add(("EPILOGUE_FORM x C_VEC x STREAM_K", m["EPILOGUE_FORM"], m["C_VEC"], m.get("STREAM_K", 0)))
    return out


def _cover(configs):
    """Per (arch, family), a few configs that together exercise every feature any of them does
    (greedy set cover): compiling all ~190 distinct ones would take minutes on a CI machine."""
    groups: dict[tuple[str, str], list] = {}
    for arch, cfg in configs:
        groups.setdefault((arch, cfg.family), []).append(cfg)
    out = []
    for (arch, _), cfgs in groups.items():
        need = set().union(*(_features(c) for c in cfgs))
        while need:
            best = max(cfgs, key=lambda c: len(_features(c) & need))
            need -= _features(best)
            out.append((arch, best))
    return out


CANDIDATES = _configs()
CONFIGS = _cover(CANDIDATES)


def _id(item) -> str:
    arch, cfg = item
    return f"{arch}-{cfg.family}-" + "-".join(f"{k}{v}" for k, v in cfg.macros)


def _elf_arch(cubin: bytes) -> set[int]:
    """SM numbers a cubin's ELF header may name (the field moved between cubin ABI versions)."""
    flags = struct.unpack_from("<I", cubin, 48)[0]
    return {flags & 0xFF, (flags >> 8) & 0xFF}


@pytest.fixture(scope="module")
def cubins() -> dict:
    """Every configuration compiled once, in parallel (NVRTC runs without the GIL):
    (arch, source, macros) -> (cubin bytes, ptxas -v report), or the exception compiling raised."""
    from io import StringIO

    def build(item):
        arch, cfg = item
        try:
            log = StringIO()
            return compile_cubin(cfg.source, cfg.macros, cfg.target(arch), ptxas_log=log), log.getvalue()
        except Exception as exc:  # reported by the test of that configuration
            return exc

    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        results = list(pool.map(build, CONFIGS))
    return {(arch, cfg.source, cfg.macros): res for (arch, cfg), res in zip(CONFIGS, results)}


def _built(cubins, arch, cfg) -> tuple[bytes, str]:
    res = cubins[(arch, cfg.source, cfg.macros)]
    if isinstance(res, Exception):
        raise res
    return res


@pytest.mark.parametrize("arch,cfg", CONFIGS, ids=[_id(c) for c in CONFIGS])
def test_planned_config_compiles_to_a_cubin_for_its_arch(cubins, arch, cfg):
    cubin, _ = _built(cubins, arch, cfg)
    assert cubin[:4] == b"\x7fELF"
    assert struct.unpack_from("<H", cubin, 18)[0] == EM_CUDA
    assert int(arch[3:]) in _elf_arch(cubin)
    assert cfg.entry.encode() in cubin  # the entry point the launcher looks up by name


def test_configs_cover_every_family_arch_and_macro_value():
    seen: dict[tuple[str, str], set] = {}
    for arch, cfg in CONFIGS:
        seen.setdefault((arch, cfg.family), set()).add(cfg.macros)
    for arch, families in FAMILIES_FOR.items():
        for family in families:
            assert (arch, family) in seen, (arch, family)
    for arch in FAMILIES_FOR:
        skinny = [dict(m) for m in seen[(arch, "skinny")]]
        if DeviceFacts.simulated_device(arch).cc in Skinny.V2_BY_CC:  # v2: M rounded up to 4
            assert all(m["SK_V2"] == 1 for m in skinny) and {m["B_VEC"] for m in skinny} == {0, 1}, arch
            assert {m["MT"] for m in skinny} >= {4, 8, 16, 32}, arch
            continue
        # skinny v1: each rows-per-thread option with float4 and with single-float B
        assert {m["MT"] for m in skinny} == {8, 16, 32}, arch
        assert {(m["MT"], m["B_VEC"]) for m in skinny} == {(mt, vec) for mt in (8, 16, 32) for vec in (0, 1)}, arch
        assert (arch, "splitk_reduce") in seen  # skinny splits K on sm_75 too
    # stream-K (8192^2 x 4096 leaves a partial last wave on the H200): its entry and its fixup
    assert ("sm_90", "stream_k_fixup") in seen
    assert any(dict(m).get("STREAM_K") == 1 for m in seen[("sm_90", "simt_cp_async")])
    # skinny_kmajor on sm_80+: every rows-per-thread value, both W load paths, both A copies,
    # fused and unsplit
    for arch in SM80_PLUS:
        kmajor = [dict(m) for m in seen[(arch, "skinny_kmajor")]]
        assert {m["MT"] for m in kmajor} == {1, 2, 4, 8, 16, 32}, arch
        for key in ("B_VEC", "A_VEC", "KR_FUSED"):
            assert {m[key] for m in kmajor} == {0, 1}, (arch, key)
    # kmajor_mma on sm_80+: one, two and four B fragments, both load paths, fused and unsplit,
    # tf32 and tf32x3, with and without the epilogue
    for arch in SM80_PLUS:
        mma = [dict(m) for m in seen[(arch, "kmajor_mma")]]
        for key in ("KM_MF", "B_VEC", "KM_FUSED", "X3", "EPILOGUE"):
            assert {m.get(key, 0) for m in mma} == ({1, 2, 4} if key == "KM_MF" else {0, 1}), (arch, key)
    # simt_cp_async's split-K summed by its own last block per tile (no reduce pass): float4 and
    # single-float C stores, and on the H200 each slice count the planner fuses
    for arch in SM80_PLUS:
        fused = [dict(m) for m in seen[(arch, "simt_cp_async")] if dict(m).get("SPLIT_FUSED")]
        assert fused and {m["OUT_VEC"] for m in fused} <= {0, 1}, arch
        if arch == "sm_90":
            assert {m["OUT_VEC"] for m in fused} == {0, 1} and {m["C_VEC"] for m in fused} == {0, 1}
            assert {m["SPLIT_FUSED"] for m in fused} == {2, 3, 4}
    # single-float C through shared memory (C_STAGED), sm_90 only, in the plain and stream-K entries,
    # on the largest tile and others (their shared memory grown to the tile where the buffers are
    # smaller: C_STAGE_FLOATS; every staged build: test_c_staged_through_shared_memory_adds_no_spills...)
    staged = [dict(m) for m in seen[("sm_90", "simt_cp_async")] if dict(m).get("C_STAGED")]
    assert {m.get("STREAM_K", 0) for m in staged} == {0, 1}
    largest = FAMILIES["simt_cp_async"].tile_options[0]
    assert largest in {(m["WARPS_M"], m["WARPS_N"], m["THREAD_M"]) for m in staged}
    assert any((m["WARPS_M"], m["WARPS_N"], m["THREAD_M"]) != largest and m.get("C_STAGE_FLOATS") for m in staged)
    assert all(m["C_VEC"] == 0 or m.get("EPILOGUE_FORM") == 1 for m in staged)  # (float4-able C: with a bias)
    assert all(m["C_VEC"] == 0 for m in staged if (m["WARPS_M"], m["WARPS_N"], m["THREAD_M"]) != largest)
    assert not any(dict(m).get("C_STAGED") for arch in ("sm_80", "sm_86", "sm_89") for m in seen[(arch, "simt_cp_async")])
    # a bias over C's columns stored through shared memory (EPILOGUE_FORM 1 with C_STAGED), sm_90
    # only: float4-able C and not, the plain and stream-K entries
    biased = {(m["C_VEC"], m.get("STREAM_K", 0)) for m in map(dict, seen[("sm_90", "simt_cp_async")])
              if m.get("EPILOGUE_FORM")}
    assert biased == {(0, 0), (1, 0), (1, 1)}, biased
    assert all(m.get("C_STAGED") and m.get("EPILOGUE") for m in map(dict, seen[("sm_90", "simt_cp_async")])
               if m.get("EPILOGUE_FORM"))
    assert not any(dict(m).get("EPILOGUE_FORM") for (arch, _), ms in seen.items() if arch != "sm_90" for m in ms)
    # the skinny kernel's own slice sums (decode16 on the H200)
    assert any(dict(m).get("SK_FUSED") == 1 for m in seen[("sm_90", "skinny")])
    # split-K in cluster pairs (largeK on the H200), sm_90 only
    assert any(dict(m).get("SPLIT_PAIR") == 1 for m in seen[("sm_90", "simt_cp_async")])
    assert not any(dict(m).get("SPLIT_PAIR") for arch in ("sm_80", "sm_86", "sm_89") for m in seen[(arch, "simt_cp_async")])
    for arch in SM80_PLUS:
        assert (arch, "splitk_reduce") in seen
        for family, wanted in [
            ("simt_float4", {"A_MODE": {0, 1, 2, 3}, "B_MODE": {0, 1, 2, 3}, "C_VEC": {0, 1}}),
            ("simt_cp_async", {"A_MODE": {0, 2, 3}, "B_MODE": {0, 2, 3}, "C_VEC": {0, 1}}),
            ("tf32_mma", {"A_SMEM_MK": {0, 1}, "A_VEC": {0, 1}, "B_SMEM_KN": {0, 1}, "B_VEC": {0, 1},
                          "C_VEC": {0, 1}, "PRECISION_X3": {0, 1}}),
        ]:
            values: dict[str, set] = {}
            for macros in seen[(arch, family)]:
                for k, v in macros:
                    values.setdefault(k, set()).add(v)
            for k, want in wanted.items():
                assert want <= values[k], (arch, family, k, values[k])
        # every tile option of each tiled family (simt_cp_async's 32-row tiles too)
        for family in ("simt_float4", "simt_cp_async"):
            tiles = {tuple(v for k, v in m if k in ("WARPS_M", "WARPS_N", "THREAD_M")) for m in seen[(arch, family)]}
            want = set(FAMILIES[family].tile_options) | (set(SHORT_TILE_OPTIONS) if family == "simt_cp_async" else set())
            assert tiles >= want, (arch, family, tiles)
        for x3 in (False, True):
            tiles = {tuple(v for k, v in m if k in ("WARPS_M", "WARPS_N", "WARP_N"))
                     for m in seen[(arch, "tf32_mma")] if dict(m)["PRECISION_X3"] == int(x3)}
            assert tiles >= set(FAMILIES["tf32_mma"].tile_options(x3, DeviceFacts.simulated_device(arch))), (arch, x3, tiles)


def test_wgmma_configs_cover_both_tiles_and_store_modes():
    macros = [dict(m) for (arch, fam), ms in _seen().items() if fam == "wgmma_tf32" for m in ms]
    for x3 in (0, 1):
        widths = {bn for bn, _ in FAMILIES["wgmma_tf32"].tile_options(bool(x3))}
        # every width with C stored by the copy engine, staged and written by the consumers
        # (C_COPY_OUT: rows the copy engine cannot take) and (tf32) from registers; tf32x3's
        # register stores at every width: test_wgmma_tf32x3_register_stores_build_at_every_width...
        for store in ("TMA_STORE", "C_COPY_OUT", None):
            def stored(m):
                return m.get(store, 0) == 1 if store else not (m.get("TMA_STORE") or m.get("C_COPY_OUT"))
            got = [m for m in macros if m["PRECISION_X3"] == x3 and stored(m)]
            assert {m["BN"] for m in got} >= (widths if store or not x3 else {64}), (x3, store, {m["BN"] for m in got})
            assert {m.get("EPILOGUE", 0) for m in got} == {0, 1}, (x3, store)
        assert {m["C_VEC"] for m in macros if m["PRECISION_X3"] == x3} == ({0, 1} if x3 else {0, 1, 2}), x3
    # K split over blocks: A K-major and fed from registers, with and without the epilogue; the
    # partial tiles in float2 pairs along the workspace's padded lines (along C's contiguous dim:
    # n, or m for A_MN's C^T)
    split_forms = {(m["A_MN"], m["C_VEC"], m.get("EPILOGUE", 0)) for m in macros if m.get("SPLIT")}
    # (C^T's split, A_MN with C_VEC 2: test_wgmma_64_row_tile_builds_every_width_and_form_without_spills)
    assert split_forms >= {(a, 1, e) for a in (0, 1) for e in (0, 1)}, split_forms
    assert {c for _, c, _ in split_forms} <= {1, 2}, split_forms
    # the consumers taking turns (tf32 only, no fused epilogue but a bias) at every width they take
    assert {m["BN"] for m in macros if m.get("PINGPONG")} == {64, 96, 128, 192}
    taking_turns = {(m.get("EPILOGUE", 0), m.get("EPILOGUE_VECTOR", 0), m["C_VEC"]) for m in macros if m.get("PINGPONG")}
    assert taking_turns >= {(0, 0, 0), (0, 0, 1), (1, 1, 0), (1, 1, 1), (1, 2, 0)}
    assert all(vector for epilogue, vector, _ in taking_turns if epilogue), taking_turns  # (never a D read per output)
    # a bias added as C is stored, along n and along m: staged for the copy engine and from registers
    # (tf32, tf32x3), fed from registers (float2 along n or along m), taking turns
    vectors = {(m["EPILOGUE_VECTOR"], m.get("TMA_STORE", 0), m["A_MN"], m["C_VEC"], m.get("PINGPONG", 0), m["PRECISION_X3"])
               for m in macros if m.get("EPILOGUE_VECTOR")}
    assert {(v, tma, x3) for v, tma, _, _, _, x3 in vectors} == {(v, t, x) for v in (1, 2) for t in (0, 1) for x in (0, 1)}
    assert {(1, 0, 1, 1, 0, 0), (1, 1, 1, 0, 0, 0), (2, 0, 1, 2, 0, 0), (1, 0, 0, 1, 1, 0)} <= vectors
    # A fed from registers (an m-contiguous A, or B^T of a row-major B) with each store mode it takes
    assert {(m["A_MN"], m["C_VEC"]) for m in macros if m["PRECISION_X3"] == 0} >= {(0, 0), (0, 1), (1, 1), (1, 2)}
    assert {(m["A_MN"], m.get("EPILOGUE", 0)) for m in macros if m.get("TMA_STORE")} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    stagers = {m for (arch, fam), ms in _seen().items() if fam == "stage_kmajor" for m in ms}
    assert {(dict(m)["SRC_R_CONTIG"], dict(m)["SPLIT"]) for m in stagers} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    assert {dict(m)["SRC_VEC"] for m in stagers} == {0, 1}


def test_wgmma_builds_for_sm_90a_only():
    cfg = select(Problem.dense(2048, 2048, 2048, "tf32"), DeviceFacts.simulated_device("sm_90")).kernel
    assert cfg.family == "wgmma_tf32" and cfg.target("sm_90") == "sm_90a"
    for arch in ("sm_90", "sm_80"):  # without the "a" features: the source says why it stops
        with pytest.raises(CompileError, match="sm_90a only"):
            compile_cubin(cfg.source, cfg.macros, arch)


def _seen() -> dict:
    seen: dict[tuple[str, str], set] = {}
    for arch, cfg in CONFIGS:
        seen.setdefault((arch, cfg.family), set()).add(cfg.macros)
    return seen


def test_every_kernel_source_is_planned():
    planned = {cfg.source for _, cfg in CONFIGS}
    assert set(kernel_sources()) == planned


def test_kernel_sources_include_no_toolkit_headers():
    files = sorted(p for p in source_dir().iterdir() if p.suffix in (".cu", ".cuh"))
    assert files
    local = {p.name for p in files}
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.strip()
            assert not re.match(r"#\s*include\s*<", stripped), f"{path.name}:{n}: {stripped}"
            m = re.match(r'#\s*include\s*"([^"]+)"', stripped)
            if m:
                assert m.group(1) in local, f"{path.name}:{n} includes {m.group(1)}, not in cuda_src/"


def test_a_kernel_that_does_not_compile_raises_compile_error_with_the_log():
    # 3 x 2 warps cannot split the tile copies evenly: a static_assert in simt_core.cuh fires
    macros = (("WARPS_M", 3), ("WARPS_N", 2), ("THREAD_M", 8), ("BK", 8), ("A_MODE", 0), ("B_MODE", 0), ("C_VEC", 0))
    with pytest.raises(CompileError) as exc:
        compile_cubin("simt_float4.cu", macros, "sm_80")
    text = str(exc.value)
    assert "simt_float4.cu" in text and "sm_80" in text
    assert "split evenly" in text  # NVRTC's log names the failed static_assert


def _ptxas_report(source: str, arch: str, macros) -> str:
    from io import StringIO

    from fastmm.runtime.compiler import _cuda_core
    from fastmm.runtime.sources import read_source

    core = _cuda_core()
    opts = core.ProgramOptions(name=source, arch=arch, std="c++17", include_path=[str(source_dir())],
                               define_macro=[(k, str(v)) for k, v in macros] or None, ptxas_options=["-v"])
    log = StringIO()
    core.Program(read_source(source), "c++", opts).compile("cubin", logs=log)
    return log.getvalue()


_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_CUMULATIVE = re.compile(r"(\d+) bytes cumulative stack size")


def _spills_or_stack(text: str) -> list[str]:
    """What ptxas -v reports of local memory in a build: every function's stack frame and spill
    bytes, and an entry's cumulative stack size (its frame plus its callees'), where not 0.
    A kernel here needs none: its values fit the registers (a spill is a local load in the
    loop; an 8-byte frame under NVRTC 13.0 marked a kernel at its register cap, issue 16).
    Should a frame ever be needed, its measured reason goes next to the test that allows it."""
    assert _FRAME.search(text), text  # the report names every function's frame
    out = [m.group(0) for m in _FRAME.finditer(text) if any(int(x) for x in m.groups())]
    return out + [m.group(0) for m in _CUMULATIVE.finditer(text) if int(m.group(1))]


def _ptxas_summary(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.startswith("ptxas") and "Compile time" not in line)


@pytest.mark.parametrize("arch,cfg", CONFIGS, ids=[_id(c) for c in CONFIGS])
def test_planned_config_builds_without_spills_or_stack(cubins, arch, cfg):
    """Every planned configuration (all families and archs) fits its registers: no spill bytes,
    no stack frame, under whichever NVRTC 13.x is installed (.ci/run: 13.0.88, torch's pin and the newest)."""
    _, text = _built(cubins, arch, cfg)
    if "registers" not in text:
        pytest.skip("this cuda.core returns no ptxas report to read")
    assert not _spills_or_stack(text), (dict(cfg.macros), _nvrtc(), _ptxas_summary(text))


def _nvrtc() -> str:
    from fastmm.runtime.compiler import nvrtc_version

    return "NVRTC %d.%d" % nvrtc_version()


def _assert_no_spills(source: str, arch: str, macro_sets) -> None:
    """ptxas -v of ``source`` built with each macro set, in parallel: no spill bytes and no stack
    frame in any (skips where cuda.core hands back no ptxas log, as 1.2.0 on the GPU machine does)."""
    macro_sets = list(macro_sets)
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        reports = list(pool.map(lambda m: _ptxas_report(source, arch, m), macro_sets))
    for m, text in zip(macro_sets, reports):
        if "registers" not in text:
            pytest.skip("this cuda.core returns no ptxas report to read")
        assert not _spills_or_stack(text), (dict(m), _nvrtc(), _ptxas_summary(text))


def test_wgmma_tf32x3_register_stores_build_at_every_width_without_spills():
    """tf32x3 with C stored from registers (float2 where C's rows are 8- but not 16-byte
    aligned, e.g. N = 4k + 2; single floats where C is not n-contiguous) at every width, with
    no epilogue, a D and a bias: the planned grid builds only the 64-wide one since C_COPY_OUT
    took the odd widths, so these are built here (NVRTC, ptxas -v: no spills, no stack)."""
    sets = []
    for bn, stages in FAMILIES["wgmma_tf32"].tile_options(True):
        for c_vec in (0, 1):
            for epi in ((), (("EPILOGUE", 1),), (("EPILOGUE", 1), ("EPILOGUE_VECTOR", 1))):
                sets.append((("BN", bn), ("STAGES", stages), ("C_VEC", c_vec), ("PRECISION_X3", 1), ("A_MN", 0),
                             ("PROMOTE_EVERY", 2), ("COMPENSATE", 1)) + epi)
    _assert_no_spills("wgmma_tf32.cu", "sm_90a", sets)


@pytest.mark.parametrize("arch", SM80_PLUS)
def test_tf32_mma_with_two_fragment_sets_builds_without_spills(arch):
    """The second fragment set (FRAG_PIPE) takes ~30 registers on top of the accumulators: every
    tile option the planner may give it (heuristic or tuned), in every layout it serves with
    16-byte copies, must still fit without spills (the one-warp 64x64 block did not on sm_80)."""
    from fastmm.runtime.compiler import nvrtc_unavailable_reason

    if nvrtc_unavailable_reason():
        pytest.skip(nvrtc_unavailable_reason())
    dev = DeviceFacts.simulated_device(arch)
    fam = FAMILIES["tf32_mma"]
    configs = {}
    for a_t, b_t in ((False, False), (True, False), (False, True)):
        p = Problem.dense(2048, 2048, 2048, a_t=a_t, b_t=b_t, precision="tf32")
        for option in fam.options(p, dev):
            cfg = fam.configure(p, dev, option)
            if dict(cfg.macros)["FRAG_PIPE"]:
                configs[cfg.macros] = cfg
    assert configs
    _assert_no_spills("tf32_mma.cu", arch, configs)


def _epilogue_alternating(macro_sets) -> list:
    """The macro sets in a stable order, every other one built with the fused epilogue
    (EPILOGUE = 1, common.cuh: alpha, beta and D's address live through the final store). Both
    variants of every set were measured clean under NVRTC 13.0.88 and 13.5 (benchmarks/NOTES.md,
    fused epilogues); alternating keeps this file's build time as it was."""
    return [tuple(m) + ((("EPILOGUE", 1),) if i % 2 else ()) for i, m in enumerate(sorted(macro_sets))]


def _tf32x3_macro_sets(arch: str) -> set:
    """Every tf32x3 build of tf32_mma the planner can give ``arch``: each tile option, with and
    without split-K, over the operand layouts (A and B each row-major, transposed, aligned or not)
    and C's store modes, for a few problem sizes (stage counts follow the tile and layout)."""
    dev = DeviceFacts.simulated_device(arch)
    fam = FAMILIES["tf32_mma"]
    sets = set()
    for M, N, K in ((4096, 4096, 4096), (333, 517, 4099), (96, 64, 64)):
        for a_t in (False, True):
            for b_t in (False, True):
                for a_align, b_align in ((16, 16), (16, 4), (4, 16), (4, 4)):
                    p = Problem.dense(M, N, K, a_t=a_t, b_t=b_t, precision="tf32x3")
                    p = dataclasses.replace(p, a_align=a_align, b_align=b_align, c_align=min(a_align, b_align))
                    for option in fam.options(p, dev):
                        sets.add(fam.configure(p, dev, option).macros)
    return sets


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tf32x3_builds_the_planner_can_choose_fit_their_registers(arch):
    """tf32x3 on mma.sync holds two accumulator sets; its 64 x 32 warp tiles sat at the
    255-register cap and spilled 4-40 bytes in 56 of 192 builds under NVRTC 13.0 (none under
    13.5), which a cover of planned configs did not catch (issue 16). Every build the planner can
    give it, no spill bytes and no stack frame (sm_86/89 build the same code as sm_80)."""
    from fastmm.runtime.compiler import nvrtc_unavailable_reason

    if nvrtc_unavailable_reason():
        pytest.skip(nvrtc_unavailable_reason())
    sets = _tf32x3_macro_sets(arch)
    layouts = {(m["A_SMEM_MK"], m["A_VEC"], m["B_SMEM_KN"], m["B_VEC"]) for m in map(dict, sets)}
    assert len(layouts) == 16 and {dict(m)["C_VEC"] for m in sets} == {0, 1}, layouts  # the sample covers them
    _assert_no_spills("tf32_mma.cu", arch, _epilogue_alternating(sets))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_stream_k_entries_the_planner_can_choose_build_without_spills(arch):
    """The stream-K entry, with and without the fused epilogue (its whole tiles apply it), of
    every load-mode combination the planner may give it (the 128x256
    tile; not an m-contiguous A with single-float B copies along k, which the planner leaves out:
    it spilled up to 72 bytes, and since issue 16 fits in 250-254 registers on sm_80-89), no
    spill bytes and no stack frame: the stream-K loop keeps a few values live next to the
    pipeline's ~210-250 registers (single-float A and B: at the 255 cap, where NVRTC 13.0 put one
    on an 8-byte stack until the ring stopped holding its stage-0 addresses, issue 16)."""
    from fastmm.runtime.compiler import nvrtc_unavailable_reason

    if nvrtc_unavailable_reason():
        pytest.skip(nvrtc_unavailable_reason())
    fam = FAMILIES["simt_cp_async"]
    base = dict(zip(("WARPS_M", "WARPS_N", "THREAD_M"), fam.tile_options[0]))
    combos = [(a, b) for a in (0, 2, 3) for b in (0, 2, 3) if (a, b) != (0, 2)]  # load modes, simt_core.cuh
    stages = dict(fam.extra_macros(None, DeviceFacts.simulated_device(arch), *fam.tile_of(fam.tile_options[0])))["STAGES"]
    macros = [tuple({**base, "BK": fam.bk, "A_MODE": a, "B_MODE": b, "C_VEC": c, "STAGES": stages,
                     "STREAM_K": 1, "EPILOGUE": e}.items()) for a, b in combos for c in (0, 1) for e in (0, 1)]
    if arch == "sm_90":  # a third of those with the epilogue: C through shared memory with a bias (sm_90 only)
        with_epi = [i for i, m in enumerate(macros) if dict(m)["EPILOGUE"]]
        for i in with_epi[::3]:
            macros[i] += (("C_STAGED", 1), ("EPILOGUE_FORM", 1))
        assert {dict(macros[i])["C_VEC"] for i in with_epi[::3]} == {0, 1}
    _assert_no_spills("simt_cp_async.cu", arch, macros)


def _staged_c_macro_sets() -> list[tuple]:
    """Every simt_cp_async build with C stored through shared memory (C_STAGED) that the sm_90
    planner makes over a grid of products: odd and float4 widths, every operand layout, a batch,
    16- and 4-byte alignment, a bias over columns or rows, C written with an odd row pitch (out=), K from
    64 to 20001 (splits, stream-K), rows from 1 to 4099 (every tile)."""
    import itertools

    dev = DeviceFacts.simulated_device("sm_90")
    found = {}
    for (M, N, K), a_t, b_t, batch, epilogue, align, pitched in itertools.product(
            itertools.product((1, 17, 33, 64, 77, 197, 300, 640, 999, 2047, 4099),
                              (3, 64, 77, 197, 701, 1001, 1024, 4095, 50257), (64, 197, 1100, 4096, 4097, 20001)),
            (False, True), (False, True), (1, 16), (EPILOGUE_NONE, EPILOGUE_BIAS_N, EPILOGUE_BIAS_M), (16, 4),
            (False, True)):
        p = dataclasses.replace(Problem.dense(M, N, K, batch=batch, a_t=a_t, b_t=b_t, align=align), epilogue=epilogue)
        if pitched:
            p = dataclasses.replace(p, c_strides=(N + 1, 1), c_batch_strides=(0, M * (N + 1)), c_align=4)
        for k in select(p, dev).kernels():
            if k.family == "simt_cp_async" and dict(k.macros).get("C_STAGED"):
                found[k.macros] = None
    return list(found)


def _local_bytes(text: str) -> int:
    return sum(int(x) for m in _FRAME.finditer(text) for x in m.groups()) + \
        sum(int(m.group(1)) for m in _CUMULATIVE.finditer(text))


def test_c_staged_through_shared_memory_adds_no_spills_to_any_build_the_planner_stages():
    """sm_90 stages single-float C on every SIMT tile (SimtCpAsync.stage_c_all_tiles): each such
    build fits its registers as well as the same build storing C from the registers: no spill
    bytes and no stack frame, or, where the register-store build itself has some, no more.
    (One has some: the 64 x 64 tile with both operands in single floats along k, 8 bytes under
    NVRTC 13.5 in the prologue, with or without staging; none under 13.0 and 13.2, NOTES.md
    run 50.) The staged store re-reads the thread index (opaque to the compiler), so the store's
    addresses are not hoisted out of the tile loop to live across the main loop: before, 14 of
    70 such builds spilled 4-136 bytes (13.5); the builds that still did (the 32-row tiles, and
    the 128 x 128 tile with A in single floats along k beside B in float4 units) keep the
    register stores (staged_c_spills)."""
    from fastmm.runtime.compiler import nvrtc_unavailable_reason

    if nvrtc_unavailable_reason():
        pytest.skip(nvrtc_unavailable_reason())
    sets = _staged_c_macro_sets()
    tiles = {(m["WARPS_M"], m["WARPS_N"], m["THREAD_M"]) for m in map(dict, sets)}
    assert tiles >= set(FAMILIES["simt_cp_async"].tile_options) | {HALF_TILE_OPTIONS[0]}, tiles
    assert any(dict(m).get("C_STAGE_FLOATS") for m in sets) and any(dict(m).get("STREAM_K") for m in sets)
    assert any(dict(m).get("EPILOGUE_FORM") for m in sets)
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        reports = list(pool.map(lambda m: _ptxas_report("simt_cp_async.cu", "sm_90", m), sets))
    for m, text in zip(sets, reports):
        if "registers" not in text:
            pytest.skip("this cuda.core returns no ptxas report to read")
        if not _spills_or_stack(text):
            continue
        plain = tuple(kv for kv in m if kv[0] not in ("C_STAGED", "C_STAGE_FLOATS", "EPILOGUE_FORM"))
        unstaged = _ptxas_report("simt_cp_async.cu", "sm_90", plain)
        assert _local_bytes(text) <= _local_bytes(unstaged), (dict(m), _nvrtc(), _ptxas_summary(text),
                                                             _ptxas_summary(unstaged))


def test_wgmma_pingpong_builds_every_width_it_takes_without_spills():
    """The consumers taking turns on whole tiles (PINGPONG: two 64-row accumulator sets a thread,
    BN registers) at every width the planner gives it (64-192, and 160 staged), with C stored
    as float2 or single floats, or staged for the copy engine (a region each consumer warpgroup),
    plain or with a bias: no spills, no stack frame; and the combinations it does not serve (the
    planner never asks: a fused epilogue goes to the cooperative form) stop at the source's own
    check."""
    from fastmm.runtime.compiler import nvrtc_unavailable_reason

    if nvrtc_unavailable_reason():
        pytest.skip(nvrtc_unavailable_reason())
    dev = DeviceFacts.simulated_device("sm_90")
    macros = set()
    for bn in (64, 96, 128, 160, 192):  # (160: the staged turns' width where its waves fill better)
        fam = WgmmaTf32(pingpong="always", extra_widths=(STAGED_TURNS_160,) if bn == 160 else ())
        for n in (4096, 4095):  # C_VEC 1, 0
            p = Problem.dense(4096, n, 1024, "tf32", b_t=True)
            plan = select(p, dev, force="wgmma_tf32", variants=(dataclasses.replace(fam, force_bn=bn),))
            m = dict(plan.kernel.macros)
            assert m["PINGPONG"] == 1 and m["BN"] == bn and "TMA_STORE" not in m, m
            macros.add(plan.kernel.macros)
            fused = select(dataclasses.replace(p, epilogue=EPILOGUE_D), dev, force="wgmma_tf32",
                           variants=(dataclasses.replace(fam, force_bn=bn),))
            assert "PINGPONG" not in dict(fused.kernel.macros)
            for form, vector in ((EPILOGUE_BIAS_N, 1), (EPILOGUE_BIAS_M, 2)):  # a bias: added as C is stored
                biased = select(dataclasses.replace(p, epilogue=form), dev, force="wgmma_tf32",
                                variants=(dataclasses.replace(fam, force_bn=bn),))
                m = dict(biased.kernel.macros)
                assert m["PINGPONG"] == 1 and m["EPILOGUE"] == 1 and m["EPILOGUE_VECTOR"] == vector, m
                macros.add(biased.kernel.macros)
        for form in (EPILOGUE_NONE, EPILOGUE_BIAS_N, EPILOGUE_BIAS_M):  # C through the copy engine
            p = dataclasses.replace(Problem.dense(4096, 4096, 1024, "tf32", b_t=True), epilogue=form)
            staged = select(p, dev, force="wgmma_tf32",
                            variants=(dataclasses.replace(fam, force_bn=bn, pingpong_tma_store=True),))
            m = dict(staged.kernel.macros)
            assert m["PINGPONG"] == 1 and m["TMA_STORE"] == 1 and m["C_BOXES"] == 2 and m["BN"] == bn, m
            macros.add(staged.kernel.macros)
    assert len(macros) == 45
    _assert_no_spills("wgmma_tf32.cu", "sm_90a", sorted(macros))
    base = {"BN": 128, "STAGES": 4, "C_VEC": 0, "PRECISION_X3": 0, "A_MN": 0, "PINGPONG": 1}
    for bad in ({"PRECISION_X3": 1}, {"A_MN": 1}, {"C_COPY_OUT": 1}, {"BN": 256}, {"EPILOGUE": 1},
                {"EPILOGUE": 1, "EPILOGUE_VECTOR": 1, "A_MN": 1}):
        with pytest.raises(CompileError, match="PINGPONG"):
            compile_cubin("wgmma_tf32.cu", tuple({**base, **bad}.items()), "sm_90a")


def test_wgmma_split_builds_every_width_and_form_without_spills():
    """K split over blocks (SPLIT: slices stored from registers into a workspace, the last block's
    sum) at every tile width, tf32 with A K-major or fed from registers, tf32x3 (taken when asked
    for: WgmmaTf32(split=n)), float2 or single-float stores, with and without the fused epilogue:
    no spills, no stack frame; and what it does not serve stops at the source's own check."""
    from fastmm.runtime.compiler import nvrtc_unavailable_reason

    if nvrtc_unavailable_reason():
        pytest.skip(nvrtc_unavailable_reason())
    dev = DeviceFacts.simulated_device("sm_90")
    macros = set()
    for precision, widths in (("tf32", (64, 96, 128, 192, 256)), ("tf32x3", (64, 96, 128))):
        for bn in widths:
            for n, kw in ((4096, {"b_t": True}), (4095, {"a_t": True, "b_t": True})):  # (tf32x3: both copied K-major)
                p = Problem.dense(64, n, 8192, precision, **kw)
                fam = WgmmaTf32(split=4, force_bn=bn)
                for epi in (EPILOGUE_NONE, EPILOGUE_BIAS_N):  # (a bias too through split_finish's general epilogue)
                    plan = select(dataclasses.replace(p, epilogue=epi), dev, force="wgmma_tf32", variants=(fam,))
                    m = dict(plan.kernel.macros)
                    assert m["SPLIT"] == 1 and m["BN"] == bn and plan.kernel.grid[1] == 4, m
                    # (float2 pairs along the workspace's padded lines at any N: along C's
                    # contiguous dim, m where A_MN writes C^T)
                    c_m = (plan.launch_problem or plan.problem).c_strides[0] == 1
                    assert m["C_VEC"] == (2 if m["A_MN"] and c_m else 1) and m.get("EPILOGUE", 0) == int(bool(epi))
                    assert "EPILOGUE_VECTOR" not in m
                    macros.add(plan.kernel.macros)
    assert {(dict(m)["A_MN"], dict(m)["PRECISION_X3"]) for m in macros} == {(0, 0), (1, 0), (0, 1)}
    _assert_no_spills("wgmma_tf32.cu", "sm_90a", sorted(macros))
    base = {"BN": 128, "STAGES": 4, "C_VEC": 0, "PRECISION_X3": 0, "A_MN": 0, "SPLIT": 1}
    for bad in ({"PINGPONG": 1}, {"TMA_STORE": 1}, {"EPILOGUE": 1, "EPILOGUE_VECTOR": 1}):
        with pytest.raises(CompileError, match="SPLIT"):
            compile_cubin("wgmma_tf32.cu", tuple({**base, **bad}.items()), "sm_90a")


def test_wgmma_tf32x3_splitting_a_in_registers_builds_every_form_it_takes_without_spills():
    """tf32x3 with A split in registers (X3_A_REGS, ``WgmmaTf32(x3_a_regs=True)``) at every tf32x3
    width, with C through the copy engine and from registers (float2 and single floats), a bias
    over columns or rows, A in place and copied: no spills, no stack frame; where it does not
    go (a D of any strides, a forced split: 128 wide they spilled beside the fragments) A is
    staged in halves as before; and a build outside 128-row tf32x3 stops at the source's check."""
    from fastmm.runtime.compiler import nvrtc_unavailable_reason

    if nvrtc_unavailable_reason():
        pytest.skip(nvrtc_unavailable_reason())
    dev = DeviceFacts.simulated_device("sm_90")
    macros, forms = set(), set()
    for bn in (64, 96, 128):
        for p in (Problem.dense(1000, 1000, 600, "tf32x3", b_t=True),
                  Problem.dense(1000, 1001, 600, "tf32x3", b_t=True),
                  Problem.dense(1000, 1002, 600, "tf32x3", a_t=True, b_t=True)):
            for epi in (EPILOGUE_NONE, EPILOGUE_BIAS_N, EPILOGUE_BIAS_M, EPILOGUE_D):
                for tma in (True, False):
                    fam = WgmmaTf32(force_bn=bn, tma_store=tma, x3_a_regs=True)
                    plan = select(dataclasses.replace(p, epilogue=epi), dev, force="wgmma_tf32", variants=(fam,))
                    m = dict(plan.kernel.macros)
                    assert m.get("X3_A_REGS", 0) == int(epi != EPILOGUE_D) and m["BN"] == bn, m
                    assert [dict(s.macros)["SPLIT"] for s in plan.stagers] == (
                        [1, 1] if epi == EPILOGUE_D else [0, 1] if p.a_strides[0] == 1 else [1]), plan.describe()
                    macros.add(plan.kernel.macros)
                    forms.add((m.get("TMA_STORE", 0), m["C_VEC"], m.get("EPILOGUE_VECTOR", 0)))
    forced = select(Problem.dense(1000, 1000, 4096, "tf32x3", b_t=True), dev, force="wgmma_tf32",
                    variants=(WgmmaTf32(split=3, x3_a_regs=True),))
    assert "X3_A_REGS" not in dict(forced.kernel.macros) and forced.kernel.split_k == 3
    assert forms >= {(1, 0, 0), (1, 0, 1), (1, 0, 2), (0, 1, 0), (0, 0, 0), (0, 1, 1), (0, 0, 2)}, forms
    _assert_no_spills("wgmma_tf32.cu", "sm_90a", sorted(m for m in macros if dict(m).get("X3_A_REGS")))
    base = {"BN": 128, "STAGES": 3, "C_VEC": 0, "PRECISION_X3": 1, "A_MN": 0, "X3_A_REGS": 1}
    for bad in ({"PRECISION_X3": 0}, {"BM": 64, "X3_SPLIT_B": 1}):
        with pytest.raises(CompileError, match="X3_A_REGS"):
            compile_cubin("wgmma_tf32.cu", tuple({**base, **bad}.items()), "sm_90a")


def test_wgmma_64_row_tile_builds_every_width_and_form_without_spills():
    """The 64-row tile (BM = 64: one consumer warpgroup, 256 threads) at every tf32 width, with A
    K-major and fed from registers (A_MN, its two fragment sets: a row-major B as C^T, and an
    m-contiguous A), and every tf32x3 width (B split by the kernel: X3_SPLIT_B), with C through
    the copy engine and from registers (float2 along n and along m, single floats), K split over
    blocks, a fused D and a bias: no spills, no stack frame; and the forms it does not serve
    (taking turns, tf32x3 with B staged, X3_SPLIT_B elsewhere) stop at the source's own check."""
    from fastmm.runtime.compiler import nvrtc_unavailable_reason

    if nvrtc_unavailable_reason():
        pytest.skip(nvrtc_unavailable_reason())
    dev = DeviceFacts.simulated_device("sm_90")
    macros = set()
    for bn in (64, 96, 128, 192, 256):
        for n, split in ((4096, False), (4095, False), (4096, 3), (4095, 3)):
            p = Problem.dense(48, n, 4096, "tf32", b_t=True)
            for epi in (EPILOGUE_NONE, EPILOGUE_BIAS_N, EPILOGUE_D):
                for tma in (True, False):
                    fam = WgmmaTf32(force_bn=bn, split=split, tma_store=tma)
                    plan = select(dataclasses.replace(p, epilogue=epi), dev, force="wgmma_tf32", variants=(fam,))
                    m = dict(plan.kernel.macros)
                    assert m["BM"] == 64 and m["BN"] == bn and plan.kernel.block == 256, m
                    # (the 256-wide tile keeps its ring's slots at K > 1024: C from registers)
                    assert m.get("TMA_STORE", 0) == int(tma and not split and n % 4 == 0 and bn < 256)
                    macros.add(plan.kernel.macros)
    a_mn = set()  # A fed from registers: B row-major (C^T: float2 along m), an m-contiguous A (single floats, TMA)
    for bn in (64, 128, 256):
        for p, split in ((Problem.dense(300, 1000, 1100, "tf32"), False),
                         (Problem.dense(1000, 1001, 700, "tf32", a_t=True, b_t=True), False),
                         (Problem.dense(300, 1000, 3000, "tf32"), 3),
                         (Problem.dense(1000, 1000, 700, "tf32", a_t=True, b_t=True), False)):
            for epi in (EPILOGUE_NONE, EPILOGUE_BIAS_N, EPILOGUE_D):
                plan = select(dataclasses.replace(p, epilogue=epi), dev, force="wgmma_tf32",
                              variants=(WgmmaTf32(force_bn=bn, split=split, rows64="always"),))
                m = dict(plan.kernel.macros)
                assert m["BM"] == 64 and m["A_MN"] == 1 and m["BN"] == bn, m
                a_mn.add((m["C_VEC"], m.get("TMA_STORE", 0), m.get("SPLIT", 0), m.get("EPILOGUE_VECTOR", 0)))
                macros.add(plan.kernel.macros)
    assert a_mn >= {(2, 0, 0, 0), (0, 0, 0, 0), (2, 0, 0, 2), (2, 0, 1, 0), (0, 1, 0, 0), (0, 1, 0, 1)}, a_mn
    for bn in (64, 96, 128):  # tf32x3 on 64-row tiles: B split into its halves by the kernel
        for n, split in ((4096, False), (4095, False), (4096, 3), (4095, 3)):
            p = Problem.dense(48, n, 4096, "tf32x3", b_t=True)
            for epi in (EPILOGUE_NONE, EPILOGUE_BIAS_N, EPILOGUE_D):
                plan = select(dataclasses.replace(p, epilogue=epi), dev, force="wgmma_tf32",
                              variants=(WgmmaTf32(force_bn=bn, split=split, rows64="always"),))
                m = dict(plan.kernel.macros)
                assert m["BM"] == 64 and m["X3_SPLIT_B"] == 1 and m["PRECISION_X3"] == 1 and m["BN"] == bn, m
                macros.add(plan.kernel.macros)
    forms = {(dict(m).get("TMA_STORE", 0), dict(m).get("SPLIT", 0), dict(m).get("EPILOGUE_VECTOR", 0), dict(m)["C_VEC"])
             for m in macros}
    # (a split's partial tiles: float2 pairs along n, or along m for A_MN)
    assert forms >= {(1, 0, 0, 0), (1, 0, 1, 0), (0, 0, 0, 1), (0, 0, 1, 1), (0, 0, 0, 0), (0, 1, 0, 1), (0, 1, 0, 2)}
    _assert_no_spills("wgmma_tf32.cu", "sm_90a", sorted(macros))
    base = {"BN": 128, "STAGES": 4, "C_VEC": 0, "PRECISION_X3": 0, "A_MN": 0, "BM": 64}
    for bad in ({"PINGPONG": 1}, {"PINGPONG": 1, "A_MN": 1}, {"PRECISION_X3": 1}, {"BM": 96}):
        with pytest.raises(CompileError, match="BM"):
            compile_cubin("wgmma_tf32.cu", tuple({**base, **bad}.items()), "sm_90a")
    for bad in ({"X3_SPLIT_B": 1}, {"X3_SPLIT_B": 1, "PRECISION_X3": 1, "BM": 128}):  # (tf32x3 on 64-row tiles only)
        with pytest.raises(CompileError, match="X3_SPLIT_B"):
            compile_cubin("wgmma_tf32.cu", tuple({**base, **bad}.items()), "sm_90a")


def test_cluster_pair_entries_build_without_spills():
    """The split-K epilogue of cluster pairs (SPLIT_PAIR: half of each thread's rows handed to
    the partner through distributed shared memory) for every load-mode combination and C store
    mode the planner may give the 128x256 tile on sm_90, at the split plans' stages: no spills and
    no stack frame (not an m-contiguous A with single-float B copies along k, which the planner
    does not pair: it spilled 12 bytes under NVRTC 13.5 before issue 16)."""
    from fastmm.runtime.compiler import nvrtc_unavailable_reason

    if nvrtc_unavailable_reason():
        pytest.skip(nvrtc_unavailable_reason())
    fam = FAMILIES["simt_cp_async"]
    dev = DeviceFacts.simulated_device("sm_90")
    base = dict(zip(("WARPS_M", "WARPS_N", "THREAD_M"), fam.tile_options[0]))
    stages = dict(fam.extra_macros(None, dev, *fam.tile_of(fam.tile_options[0]), split=2))["STAGES"]
    macros = [tuple({**base, "BK": fam.bk, "A_MODE": a, "B_MODE": b, "C_VEC": c, "STAGES": stages,
                     "SPLIT_PAIR": 1}.items()) for a in (0, 2, 3) for b in (0, 2, 3) for c in (0, 1) if (a, b) != (0, 2)]
    _assert_no_spills("simt_cp_async.cu", "sm_90", macros)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_simt_split_entries_that_sum_their_own_slices_build_without_spills(arch):
    """simt_cp_async's fused split (SPLIT_FUSED: the last block of each tile sums the slices)
    for every tile and every load-mode pair the planner fuses (simt_core.fused_split_spills
    leaves out what spilled), each with one of the C store modes, epilogue and slice counts it
    fuses, in turn: no spill bytes and no stack frame (the 16 x 8 thread tiles sit at the
    255-register cap, the 8 x 8 ones at their 168)."""
    from fastmm.families.simt_core import FUSED_SPLIT_MAX, fused_split_spills
    from fastmm.runtime.compiler import nvrtc_unavailable_reason

    if nvrtc_unavailable_reason():
        pytest.skip(nvrtc_unavailable_reason())
    fam = FAMILIES["simt_cp_async"]
    dev = DeviceFacts.simulated_device(arch)
    variants = [(1, 1, 0, 2), (0, 0, 1, FUSED_SPLIT_MAX), (1, 0, 1, 3), (0, 1, 0, 2)]  # (C_VEC, OUT_VEC, EPILOGUE, S)
    macros, i = [], 0
    for opt in fam.tile_options:
        bm, bn = fam.tile_of(opt)
        stages = dict(fam.extra_macros(None, dev, bm, bn, split=2))["STAGES"]
        for a in (0, 2, 3):
            for b in (0, 2, 3):
                allowed = [v for v in variants if not fused_split_spills(opt, a, b, bool(v[1]), bool(v[2]))]
                if not allowed:
                    continue
                c, o, e, split = allowed[i % len(allowed)]
                i += 1
                macros.append(tuple({"WARPS_M": opt[0], "WARPS_N": opt[1], "THREAD_M": opt[2], "BK": fam.bk,
                                     "A_MODE": a, "B_MODE": b, "C_VEC": c, "STAGES": stages, "SPLIT_FUSED": split,
                                     "OUT_VEC": o, "EPILOGUE": e}.items()))
    assert len(macros) == 4 * 9 - 4 - 2  # (the two 16-row tiles leave out two pairs each, the 8-row ones one)
    _assert_no_spills("simt_cp_async.cu", arch, macros)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_simt_short_tiles_build_exactly_where_their_copies_fit_and_without_spills(arch):
    """simt_cp_async's 32-row tiles (THREAD_M 4) in every load-mode pair cp.async has: where
    ``copies_fit`` (what the planner checks before it offers them) says an operand tile splits
    evenly over the threads, the kernel builds without spills, with a fused split, cluster pairs
    (sm_90) or neither, and the epilogue (on sm_90 the 32 x 128 tile's split builds also at its
    4-blocks-an-SM bound); where it says not, the compiler refuses it with
    simt_core.cuh's static_assert (a 16-byte A: 64 float4 a k-tile over 128-256 threads)."""
    from fastmm.runtime.compiler import nvrtc_unavailable_reason

    if nvrtc_unavailable_reason():
        pytest.skip(nvrtc_unavailable_reason())
    fam = FAMILIES["simt_cp_async"]
    splits = [(("SPLIT_FUSED", 2), ("OUT_VEC", 1)), (), (("SPLIT_FUSED", 4), ("OUT_VEC", 0))]
    if arch == "sm_90":
        splits.append((("SPLIT_PAIR", 1),))
    fitting, refused, i = [], 0, 0
    for opt in SHORT_TILE_OPTIONS:
        for a in (0, 2, 3):
            for b in (0, 2, 3):
                base = (("WARPS_M", opt[0]), ("WARPS_N", opt[1]), ("THREAD_M", opt[2]), ("BK", fam.bk),
                        ("A_MODE", a), ("B_MODE", b), ("C_VEC", i % 2), ("STAGES", 6))
                macros = base + (("EPILOGUE", (i // 2) % 2),) + splits[i % len(splits)]
                i += 1
                if copies_fit(opt, fam.tile_of(opt), fam.bk, a, b):
                    fitting.append(macros)
                    if fam.tile_of(opt) == (32, 128) and arch == "sm_90":
                        # built for 4 blocks an SM where planned so (sm_90, split plans only): slices
                        # summed by the last block (with the epilogue or not), or by splitk_reduce
                        bound = (("CP_MIN_BLOCKS", fam.short_min_blocks),)
                        fitting += [base + bound + (("EPILOGUE", e), ("SPLIT_FUSED", 2 + 2 * e), ("OUT_VEC", e))
                                    for e in (0, 1)]
                        fitting.append(base + bound)
                    continue
                with pytest.raises(CompileError, match="split evenly"):
                    compile_cubin("simt_cp_async.cu", macros, arch)
                refused += 1
    assert refused == 2 * 3  # (A as float4 along m: every B mode, both tiles)
    assert len(fitting) == 2 * 6 + (3 * 6 if arch == "sm_90" else 0)
    _assert_no_spills("simt_cp_async.cu", arch, fitting)


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
def test_simt_narrow_tiles_with_a_k_contiguous_a_build_without_spills(arch):
    """simt_cp_async's 64-wide tiles (NARROW_TILE_OPTIONS) with A's rows k-contiguous (A_MODE 2:
    16 single-float copies of A a thread a k-tile), every B mode, C_VEC, the epilogue and a fused
    split: no spills. Their A copies are row-chained (AsyncTile::ROW_CHAIN): with a pointer and a
    row bit per copy held across the main loop, 25 of these 36 builds per arch spilled 16-136
    bytes at the 255-register cap (NVRTC 13.5; NOTES run 30)."""
    from fastmm.runtime.compiler import nvrtc_unavailable_reason

    if nvrtc_unavailable_reason():
        pytest.skip(nvrtc_unavailable_reason())
    fam = FAMILIES["simt_cp_async"]
    sets = []
    for opt in NARROW_TILE_OPTIONS:
        for b in (0, 2, 3):
            for i, (c_vec, epilogue, fused) in enumerate(((0, 0, 0), (1, 1, 0), (0, 1, 2), (1, 0, 2), (0, 1, 0), (1, 0, 0))):
                m = (("WARPS_M", opt[0]), ("WARPS_N", opt[1]), ("THREAD_M", opt[2]), ("BK", fam.bk), ("A_MODE", 2),
                     ("B_MODE", b), ("C_VEC", c_vec), ("STAGES", 6), ("EPILOGUE", epilogue))
                sets.append(m + ((("SPLIT_FUSED", fused), ("OUT_VEC", c_vec)) if fused else ()))
    _assert_no_spills("simt_cp_async.cu", arch, sets)


def test_skinny_kernels_that_sum_their_own_slices_build_without_spills():
    """SK_FUSED (the last block of a column tile sums the slices) for every M the planner fuses
    on sm_90 (up to 8 outputs per thread), float4 and single-float B, k- and m-contiguous A:
    the sums' registers come on top of the ring's, and must not spill."""
    from fastmm.runtime.compiler import nvrtc_unavailable_reason

    if nvrtc_unavailable_reason():
        pytest.skip(nvrtc_unavailable_reason())
    dev = DeviceFacts.simulated_device("sm_90")
    configs = {}
    for M in range(1, 17):
        for a_t, b_t in ((False, False), (True, False), (False, True)):
            cfg = FAMILIES["skinny"].configure(Problem.dense(M, 4096, 4096, a_t=a_t, b_t=b_t), dev)
            if cfg.split_fused:
                configs[cfg.macros] = cfg
    assert len({dict(m)["MT"] for m in configs}) == 4  # M rounded up to 4, 8, 12, 16
    _assert_no_spills("skinny.cu", "sm_90", _epilogue_alternating(configs))


#: A PTX instruction that may touch global memory: any load, store, copy, atomic, reduction or
#: prefetch not in the param, shared, local or const space (generic and volatile forms included);
#: not cp.async's commit / wait, which touch no memory.
_GLOBAL_ACCESS = re.compile(r"\b(?:ld|st|atom|red|cp|prefetch)\.(?!param|shared|local|const|async\.(?:commit|wait))\S*")


def _ptx(source: str, macros, arch: str) -> str:
    """The PTX NVRTC makes of ``source`` (straight from cuda.bindings.nvrtc: cuda.core asks the
    driver whether it could load PTX, and a CI machine has no driver)."""
    from cuda.bindings import nvrtc

    def check(result):
        err, *rest = result
        assert int(err) == 0, err
        return rest[0] if rest else None

    prog = check(nvrtc.nvrtcCreateProgram((source_dir() / source).read_bytes(), source.encode(), 0, [], []))
    opts = [f"--gpu-architecture={arch.replace('sm_', 'compute_')}", "-std=c++17", f"-I{source_dir()}"]
    opts += [f"-D{k}={v}" for k, v in macros]
    try:
        err, = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        if int(err) != 0:
            size = check(nvrtc.nvrtcGetProgramLogSize(prog))
            log = b" " * size
            check(nvrtc.nvrtcGetProgramLog(prog, log))
            raise AssertionError(log.decode())
        size = check(nvrtc.nvrtcGetPTXSize(prog))
        ptx = b" " * size
        check(nvrtc.nvrtcGetPTX(prog, ptx))
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return ptx.decode()


def test_kernels_launched_as_dependent_launches_wait_before_any_global_access():
    """A plan with ``dependent_launch`` is scheduled before the kernel ahead on its stream has
    finished: its kernel must wait (griddepcontrol.wait) before its first global load, store,
    copy or atomic, or it would read inputs still being written. One config per planned sm_90
    kernel (source, entry, variant), the PTX read in order; and no kernel that lacks the wait
    is launched that way."""
    from fastmm.runtime.compiler import nvrtc_unavailable_reason

    if nvrtc_unavailable_reason():
        pytest.skip(nvrtc_unavailable_reason())
    picked = {}  # one config per kernel and per skinny variant that changes its first accesses
    variant = ("SK_V2", "SK_FUSED", "SK_PIPE", "B_VEC", "A_KFAST", "A_VEC", "KR_FUSED", "KM_FUSED", "X3")
    for arch, cfg in CANDIDATES:
        if arch == "sm_90":
            m = dict(cfg.macros)
            picked.setdefault((cfg.source, cfg.entry, tuple(m.get(k) for k in variant), cfg.dependent_launch), cfg)
    # variants not planned on sm_90 but reachable through Skinny.variant: v1, and the register path
    dev = DeviceFacts.simulated_device("sm_90")
    for forced in ("v1", {"bn": 128, "cpt": 8, "pipe": 0}):
        fam = Skinny(variant=forced)  # a variant instance (families are frozen)
        for M, a_t in ((16, False), (16, True), (4, False)):
            cfg = fam.configure(Problem.dense(M, 4096, 4096, a_t=a_t), dev)
            picked.setdefault((cfg.source, cfg.entry, tuple(dict(cfg.macros).get(k) for k in variant), True), cfg)
    dependent = [c for c in picked.values() if c.dependent_launch]
    assert {c.family for c in dependent} == {"skinny", "skinny_kmajor", "kmajor_mma"}
    kmajor = {(m["B_VEC"], m["A_VEC"], m["KR_FUSED"]) for m in (dict(c.macros) for c in dependent)
              if "KR_FUSED" in m}
    assert {(1, 1, 1), (1, 1, 0), (0, 0, 1)} <= kmajor, kmajor  # fused or not, both load paths
    mma = {(m["B_VEC"], m["KM_FUSED"], m["X3"]) for m in (dict(c.macros) for c in dependent) if "KM_FUSED" in m}
    assert {(1, 1, 0), (1, 0, 0), (0, 1, 0), (1, 1, 1)} <= mma, mma
    seen = {(m.get("SK_V2", 0), m.get("SK_FUSED", 0), m.get("SK_PIPE", 0)) for m in (dict(c.macros) for c in dependent)
            if "KR_FUSED" not in m and "KM_FUSED" not in m}
    assert {(0, 0, 0), (1, 0, 1), (1, 1, 1), (1, 0, 0)} <= seen, seen  # v1, v2 plain / fused, register path
    for cfg in picked.values():
        ptx = _ptx(cfg.source, cfg.macros, cfg.target("sm_90"))
        body = ptx[ptx.index(f".entry {cfg.entry}"):]
        wait = body.find("griddepcontrol.wait")
        first = _GLOBAL_ACCESS.search(body)
        assert first is not None, cfg.macros
        if cfg.dependent_launch:
            assert 0 <= wait < first.start(), (cfg.family, cfg.macros, body[:first.start() + 200])
            assert "griddepcontrol.launch_dependents" in body[wait:first.start()]
    # below sm_90 the instructions are not there at all (the launch is never dependent there)
    cfg = Skinny().configure(Problem.dense(16, 4096, 4096), DeviceFacts.simulated_device("sm_80"))
    assert not cfg.dependent_launch
    assert "griddepcontrol" not in _ptx(cfg.source, cfg.macros, "sm_80")
