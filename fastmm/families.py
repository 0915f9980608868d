"""Kernel families: for each, its source file, entry point, what it can serve, and how to launch it.

Pure Python (no torch, no CUDA): a family looks at a :class:`~fastmm.problem.Problem` and the
:class:`~fastmm.problem.DeviceFacts` and either rejects it with a reason a user can read, or
returns a :class:`KernelConfig` - the compile-time macros and the launch geometry. The choice
between families lives in :mod:`fastmm.plan`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .problem import DeviceFacts, Problem

# Load modes of the SIMT families (must match simt_core.cuh).
LOAD_VEC_FAST, LOAD_VEC_K, LOAD_ELEM_K, LOAD_ELEM_FAST = 0, 1, 2, 3
LOAD_NAMES = {
    LOAD_VEC_FAST: "float4 along the contiguous dim",
    LOAD_VEC_K: "float4 along K, transposed into shared memory",
    LOAD_ELEM_K: "single floats, lanes along K",
    LOAD_ELEM_FAST: "single floats, lanes along M/N",
}
DEFAULT_SMEM = 48 * 1024  # what a block gets without the opt-in attribute
MAX_GRID_Z = 65535


@dataclass(frozen=True)
class KernelConfig:
    """Everything needed to build and launch one kernel for one problem."""

    family: str
    source: str  # file under cuda_src/
    entry: str  # extern "C" name
    macros: tuple[tuple[str, int], ...]
    block: int  # threads per block (1-D) or (x, y) for the scalar kernel
    block_dims: tuple[int, int, int]
    grid: tuple[int, int, int]
    smem: int  # dynamic shared memory, bytes
    tile: tuple[int, int, int]  # BM, BN, BK
    details: tuple[tuple[str, str], ...] = field(default=())

    @property
    def split_k(self) -> int:
        """K is split over grid.y blocks; partial products go to a workspace, then splitk_reduce."""
        return self.grid[1]

    def describe(self) -> str:
        bm, bn, bk = self.tile
        text = (f"{self.family} ({self.entry} in cuda_src/{self.source}): tile {bm}x{bn}x{bk}, "
                f"block {self.block_dims[0]}x{self.block_dims[1]}, grid {self.grid[0]}x{self.grid[1]}x{self.grid[2]}, "
                f"dynamic smem {self.smem} B")
        return text


def _vec_ok(contig_extent: int, other_stride: int, batch_strides: tuple[int, int], align: int) -> bool:
    """16-byte vectors along a contiguous dim need: its extent, the other stride and the batch
    strides all multiples of 4 floats, and a 16-byte aligned base pointer."""
    return (contig_extent % 4 == 0 and other_stride % 4 == 0 and align >= 16
            and all(s % 4 == 0 for s in batch_strides))


def _round4(n: int, padded: bool) -> int:
    """A contiguous extent as the vector check should see it: padded rows count as whole."""
    return -(-n // 4) * 4 if padded else n


def _grid(tiles: int, batch: int, split: int = 1) -> tuple[int, int, int]:
    return (max(tiles, 1), split, max(1, min(batch, MAX_GRID_Z)))


#: Split K only while every split keeps at least this many k-tiles of work.
MIN_KTILES_PER_SPLIT = 16
MAX_SPLIT = 64
#: Estimated cost of each extra split (workspace traffic, reduction), relative to the GEMM.
SPLIT_COST = 0.02


def split_k_for(p: Problem, dev: DeviceFacts, tiles: int, bk: int, blocks_per_sm: int = 1) -> int:
    """How many ways to split K. Time is modelled as waves of blocks: ceil(tiles * S / slots) / S,
    times a small cost per extra split; S = 1 unless splitting fills the GPU better (skinny M or
    N, long K, or a last wave that would leave most SMs idle). Only for a batch of 1 (the
    workspace holds one slice per split) and for fewer than two waves of tiles: beyond that the
    gain is a fraction of the last wave while the workspace grows with M x N."""
    slots = dev.sm_count * blocks_per_sm
    if p.batch_total != 1 or tiles >= 2 * slots:
        return 1
    k_tiles = -(-p.K // bk)
    limit = max(1, min(MAX_SPLIT, k_tiles // MIN_KTILES_PER_SPLIT))

    def cost(split: int) -> float:
        return -(-tiles * split // slots) / split * (1 + SPLIT_COST * (split - 1))

    return effective_split(k_tiles, min(range(1, limit + 1), key=lambda split: (cost(split), split)))


def effective_split(units: int, split: int) -> int:
    """The number of block rows that get work when ``units`` k-tiles (or chunks) are dealt out
    ``ceil(units / split)`` at a time, as split_range() in common.cuh does: asking for more
    would only add all-zero workspace slices."""
    if split <= 1 or units <= 0:
        return 1
    per = -(-units // split)
    return -(-units // per)


def k_dominant(p: Problem) -> bool:
    """Long K with a small output: big tiles + split-K beat small tiles."""
    return p.batch_total == 1 and p.K >= 4 * max(p.M, p.N)


def splitk_reduce_config(p: Problem, dev: DeviceFacts, split: int) -> KernelConfig:
    """The second pass of a split-K plan (cuda_src/splitk_reduce.cu)."""
    blocks = min(-(-p.M * p.N // 256), 4 * dev.sm_count)
    return KernelConfig("splitk_reduce", "splitk_reduce.cu", "fastmm_splitk_reduce", (), 256, (256, 1, 1),
                        (max(blocks, 1), 1, 1), 0, (0, 0, 0),
                        (("order", f"sums the {split} partial slices in a fixed order (deterministic)"),))


def _tiles(p: Problem, bm: int, bn: int) -> int:
    return -(-p.M // bm) * -(-p.N // bn)


def _pick_tile(p: Problem, dev: DeviceFacts, options, tile_of):
    """First (largest) option whose tiles fill (90% of) a wave of blocks; else the smallest."""
    for opt in options:
        bm, bn = tile_of(opt)
        if _tiles(p, bm, bn) * p.batch_total >= 0.9 * dev.sm_count:
            return opt
    return options[-1]


class Family:
    name = ""
    source = ""
    entry = ""
    min_cc = (7, 0)
    precisions: tuple[str, ...] = ()

    def reject(self, p: Problem, dev: DeviceFacts) -> str | None:
        if dev.cc < self.min_cc:
            return f"needs sm{self.min_cc[0]}{self.min_cc[1]}+, device is {dev.arch}"
        if p.precision not in self.precisions:
            return f"does not compute precision '{p.precision}'"
        return None

    def configure(self, p: Problem, dev: DeviceFacts) -> KernelConfig:  # pragma: no cover
        raise NotImplementedError


class Scalar(Family):
    """One output per thread, 16x16 shared tiles, any strides: the last resort."""

    name, source, entry = "scalar", "scalar.cu", "fastmm_scalar"
    precisions = ("ieee", "tf32", "tf32x3")  # fp32 FMA is at least as accurate as any of them

    def configure(self, p, dev):
        tiles = _tiles(p, 16, 16)
        return KernelConfig(self.name, self.source, self.entry, (), 256, (16, 16, 1),
                            _grid(min(tiles, 2**31 - 1), p.batch_total), 0, (16, 16, 16),
                            (("loads", "single floats, any stride"), ("math", "fp32 FMA")))


class _Simt(Family):
    precisions = ("ieee", "tf32", "tf32x3")  # full fp32; serves tf32 requests where no TF32 path can
    # (WARPS_M, WARPS_N, THREAD_M), largest tile first: 128x256, 128x128, 128x64, 64x64.
    tile_options = ((2, 4, 16), (2, 2, 16), (2, 2, 8), (1, 2, 8))
    bk = 8
    a_transpose_mode = LOAD_VEC_K  # how a k-contiguous, vector-able A is loaded

    @staticmethod
    def tile_of(opt):
        wm, wn, tm = opt
        return wm * 64, wn * (32 if tm == 8 else 64)

    def load_modes(self, p: Problem):
        sAm, sAk = p.a_strides
        sBk, sBn = p.b_strides
        if sAm == 1 and _vec_ok(p.M, sAk, p.a_batch_strides, p.a_align):
            a = LOAD_VEC_FAST
        elif sAk == 1 and _vec_ok(_round4(p.K, p.a_padded), sAm, p.a_batch_strides, p.a_align):
            a = self.a_transpose_mode
        elif sAm == 1 and sAk != 1:
            a = LOAD_ELEM_FAST
        else:
            a = LOAD_ELEM_K
        if sBn == 1 and _vec_ok(_round4(p.N, p.b_padded), sBk, p.b_batch_strides, p.b_align):
            b = LOAD_VEC_FAST
        elif sBk == 1 and _vec_ok(p.K, sBn, p.b_batch_strides, p.b_align):
            b = self.a_transpose_mode
        elif sBk == 1 and sBn != 1:
            b = LOAD_ELEM_K
        else:
            b = LOAD_ELEM_FAST
        c_vec = p.c_strides[1] == 1 and _vec_ok(p.N, p.c_strides[0], p.c_batch_strides, p.c_align)
        return a, b, c_vec

    def smem_bytes(self, bm, bn, stages):
        return 0

    def extra_macros(self, p, dev, bm, bn):
        return ()

    can_split = False

    def configure(self, p, dev):
        if self.can_split and k_dominant(p):
            opt = self.tile_options[1]  # 128x128: splits supply the parallelism
        else:
            opt = _pick_tile(p, dev, self.tile_options, self.tile_of)
        wm, wn, tm = opt
        bm, bn = self.tile_of(opt)
        split = split_k_for(p, dev, _tiles(p, bm, bn), self.bk, 2 if wm * wn <= 4 else 1) if self.can_split else 1
        a, b, c_vec = self.load_modes(p)
        if split > 1:
            c_vec = p.N % 4 == 0  # partials go to a fresh contiguous workspace
        extra = self.extra_macros(p, dev, bm, bn)
        macros = (("WARPS_M", wm), ("WARPS_N", wn), ("THREAD_M", tm), ("BK", self.bk), ("A_MODE", a),
                  ("B_MODE", b), ("C_VEC", int(c_vec))) + extra
        smem = self.smem_bytes(bm, bn, dict(extra).get("STAGES", 2))
        threads = wm * wn * 32
        details = (("A loads", LOAD_NAMES[a]), ("B loads", LOAD_NAMES[b]),
                   ("C stores", "float4" if c_vec else "single floats"),
                   ("math", f"fp32 FFMA, {tm}x8 outputs per thread"))
        if split > 1:
            details += (("split-K", f"{split} slices of K, reduced by splitk_reduce"),)
        return KernelConfig(self.name, self.source, self.entry, macros, threads, (threads, 1, 1),
                            _grid(_tiles(p, bm, bn), p.batch_total, split), smem, (bm, bn, self.bk), details)


class SimtFloat4(_Simt):
    """Register-staged SIMT: float4 global loads where the layout allows, any arch."""

    name, source, entry = "simt_float4", "simt_float4.cu", "fastmm_simt_float4"


class SimtCpAsync(_Simt):
    """cp.async multi-stage SIMT (sm80+)."""

    name, source, entry = "simt_cp_async", "simt_cp_async.cu", "fastmm_simt_cp_async"
    min_cc = (8, 0)
    a_transpose_mode = LOAD_ELEM_K  # cp.async cannot transpose a vector
    can_split = True
    bk = 8
    stages = 6  # measured best on the H200 (benchmarks/NOTES.md); fewer where shared memory is short

    def smem_bytes(self, bm, bn, stages):
        return stages * self.bk * ((bm + 4) + (bn + 4)) * 4

    def extra_macros(self, p, dev, bm, bn):
        stages = self.stages
        while stages > 2 and self.smem_bytes(bm, bn, stages) > dev.smem_per_block_optin:
            stages -= 1
        return (("STAGES", stages),)


class Tf32Mma(Family):
    """Tensor cores through mma.sync m16n8k8 TF32 (sm80+); also tf32x3 (3 products per step)."""

    name, source, entry = "tf32_mma", "tf32_mma.cu", "fastmm_tf32_mma"
    min_cc = (8, 0)
    precisions = ("tf32", "tf32x3")
    bk = 32
    max_stages = 3  # 3 x 35 KiB: two 128x128 blocks fit in an H100/H200 SM

    @staticmethod
    def tile_options(x3: bool):
        """(WARPS_M, WARPS_N, WARP_N), largest tile first. Warps are 64 x 64 for tf32; 64 x 32
        for tf32x3, which holds three accumulator sets."""
        if x3:
            return ((2, 4, 32), (2, 2, 32), (1, 2, 32))
        return ((2, 2, 64), (1, 2, 64), (1, 1, 64))

    def configure(self, p, dev):
        x3 = p.precision == "tf32x3"
        options = self.tile_options(x3)
        opt = options[0] if k_dominant(p) else _pick_tile(p, dev, options, lambda o: (o[0] * 64, o[1] * o[2]))
        wm, wn, warp_n = opt
        bm, bn = wm * 64, wn * warp_n
        split = split_k_for(p, dev, _tiles(p, bm, bn), self.bk, 2 if wm * wn <= 4 else 1)
        sAm, sAk = p.a_strides
        sBk, sBn = p.b_strides
        a_mk = sAk == 1 or sAm != 1
        b_kn = sBn == 1 or sBk != 1
        a_vec = (_vec_ok(_round4(p.K, p.a_padded), sAm, p.a_batch_strides, p.a_align) if a_mk and sAk == 1 else
                 (not a_mk) and _vec_ok(p.M, sAk, p.a_batch_strides, p.a_align))
        b_vec = (_vec_ok(_round4(p.N, p.b_padded), sBk, p.b_batch_strides, p.b_align) if b_kn and sBn == 1 else
                 (not b_kn) and _vec_ok(p.K, sBn, p.b_batch_strides, p.b_align))
        sCm, sCn = p.c_strides
        c_vec = (sCn == 1 and p.N % 2 == 0 and sCm % 2 == 0 and p.c_align >= 8
                 and all(s % 2 == 0 for s in p.c_batch_strides))
        if split > 1:
            c_vec = p.N % 2 == 0  # partials go to a fresh contiguous workspace
        a_floats = bm * (self.bk + 4) if a_mk else self.bk * (bm + 8)
        b_floats = self.bk * (bn + 8) if b_kn else bn * (self.bk + 4)
        per_stage = (a_floats + b_floats) * 4
        stages = max(2, min(self.max_stages, dev.smem_per_block_optin // per_stage))
        macros = (("WARPS_M", wm), ("WARPS_N", wn), ("WARP_N", warp_n), ("STAGES", stages), ("A_SMEM_MK", int(a_mk)),
                  ("A_VEC", int(a_vec)), ("B_SMEM_KN", int(b_kn)), ("B_VEC", int(b_vec)),
                  ("C_VEC", int(c_vec)), ("PRECISION_X3", int(x3)))
        threads = wm * wn * 32
        details = (
            ("A in smem", "[m][k]" if a_mk else "[k][m]"), ("A loads", "16-byte cp.async" if a_vec else "4-byte cp.async"),
            ("B in smem", "[k][n]" if b_kn else "[n][k]"), ("B loads", "16-byte cp.async" if b_vec else "4-byte cp.async"),
            ("C stores", "float2" if c_vec else "single floats"),
            ("math", "3xTF32 mma.sync (big*big + separate small cross terms)" if x3 else
             "TF32 mma.sync m16n8k8, inputs rounded with cvt.rna, fp32 accumulate"))
        if split > 1:
            details += (("split-K", f"{split} slices of K, reduced by splitk_reduce"),)
        return KernelConfig(self.name, self.source, self.entry, macros, threads, (threads, 1, 1),
                            _grid(_tiles(p, bm, bn), p.batch_total, split), per_stage * stages, (bm, bn, self.bk), details)


class Skinny(Family):
    """M <= 32: a GEMV-like kernel that reads every element of B exactly once (memory-bound)."""

    name, source, entry = "skinny", "skinny.cu", "fastmm_skinny"
    min_cc = (7, 5)
    precisions = ("ieee", "tf32", "tf32x3")  # fp32 FMA: as accurate as any; B's bytes set the speed
    max_m = 32
    cols = 128

    def reject(self, p, dev):
        reason = super().reject(p, dev)
        if reason is None and p.M > self.max_m:
            reason = f"M = {p.M} > {self.max_m}: not skinny"
        return reason

    def configure(self, p, dev):
        mt = 8 if p.M <= 8 else 16 if p.M <= 16 else 32
        kchunk = 128 if mt == 32 else 256
        sBk, sBn = p.b_strides
        b_vec = sBn == 1 and _vec_ok(p.N, sBk, p.b_batch_strides, p.b_align)
        tiles = max(1, -(-p.N // self.cols))
        split = 1
        if p.batch_total == 1:  # one 256-thread block per SM; aim for about two waves
            chunks = -(-p.K // kchunk)
            split = effective_split(chunks, max(1, min(chunks, -(-2 * dev.sm_count // tiles), MAX_SPLIT)))
        details = (("rows per thread", f"{mt} (M = {p.M})"),
                   ("B loads", "float4, each element once" if b_vec else "single floats, each element once"),
                   ("math", "fp32 FFMA; warps' partials summed in a fixed order"))
        if split > 1:
            details += (("split-K", f"{split} slices of K, reduced by splitk_reduce"),)
        return KernelConfig(self.name, self.source, self.entry, (("MT", mt), ("B_VEC", int(b_vec))), 256,
                            (256, 1, 1), _grid(tiles, p.batch_total, split), 0, (mt, self.cols, kchunk), details)


#: Families in order of preference within a precision (first that accepts wins).
FAMILIES: dict[str, Family] = {f.name: f for f in (Skinny(), Tf32Mma(), SimtCpAsync(), SimtFloat4(), Scalar())}
