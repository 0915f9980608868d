"""The cp.async SIMT family (cuda_src/simt_cp_async.cu, sm80+): a multi-stage cp.async pipeline
under the shared SIMT tiles, with split-K (in cluster pairs on sm_90) and stream-K."""
from __future__ import annotations

from dataclasses import dataclass

from ..problem import Problem
from .base import LOAD_ELEM_K, LOAD_VEC_FAST, tiles_of
from .simt_core import SimtCore, copies_fit, padded_copies, pads_no_more, transposes_b
from .stage_kmajor import stage_rows_config
from .work_split import split_k_for

#: The 32-row tiles, (WARPS_M, WARPS_N, THREAD_M): 32 x 256 and 32 x 128, 4 x 8 outputs a thread
#: (simt_core.cuh: lanes 4 x 8, a warp 16 x 64). For products of at most SHORT_ROWS rows (decode
#: with a batch of 17-32 sequences), where the smallest 64-row tile computes half its rows or
#: more on padding.
SHORT_TILE_OPTIONS = ((2, 4, 4), (2, 2, 4))
SHORT_ROWS = 32
#: The 64-wide tiles of 16 x 8 outputs a thread, (WARPS_M, WARPS_N, THREAD_M): 256 x 64 (4 warps)
#: and 128 x 64 (2 warps); one warp column, a 64 x 64 warp tile (simt_core.cuh: lanes 4 x 8).
#: For products of at most NARROW_COLS columns (attention's P.V and dQ, A's rows k-contiguous;
#: dV = P^T dO and dK = dS^T Q, A m-contiguous; heads of 64), where the 128-wide tiles compute
#: half their columns on padding and the 128 x 64 tile of ``tile_options`` runs 8 x 8 outputs a
#: thread (a third more shared-memory reads per FFMA). A copied as float4 along m, or in single
#: floats along k: those 16 copies a thread a k-tile are chained from one pointer
#: (simt_cp_async.cu, ROW_CHAIN; with a pointer each both builds spilled 16-136 bytes at the
#: 255-register cap, NOTES runs 30-31).
NARROW_TILE_OPTIONS = ((4, 1, 16), (2, 1, 16))
NARROW_COLS = 64
#: The heuristic takes the 128 x 64 one (2 warps, up to 4 blocks an SM) where its tiles number at
#: least NARROW_MIN_TILES_PER_SM per SM and pad M no more than 64-row tiles. Measured on the H200
#: (probes/candidates.py on probes/narrow_rows.json, NOTES run 30; GPU us, the 8 x 8 128 x 64 tile
#: -> the narrow one): dV 128 x (512 x 64 x 512) 125.6 -> 97.2 (torch 106.4), 128 x (1024 x 64 x
#: 1024) 376.0 -> 354.6 (torch 379.8); the 256 x 64 tile 102.1 / 374.7. At 128 tiles (64 x (256 x
#: 64 x 256), P.V) it lost 50%, at 197 rows (ViT, 768 x (197 x 64 x 197)) 4%.
#: With A's rows k-contiguous (chained single-float copies), only where M is a multiple of the
#: tile's 128 rows (call 3 of NOTES run 31, GPU us, narrow against the tile the heuristic took
#: before, torch): P.V 128 x (512 x 64 x 512) 116.7 against 145.2 (115.7), 128 x (1024 x 64 x 1024)
#: 419.6 against 416.2 for the 64 x 64 tile (430.3), but ViT's 768 x (197 x 64 x 197), its second
#: tile of rows an edge tile, 169.2 against 135.4 (140.8).
NARROW_MIN_TILES_PER_SM = 3
#: ... where K and N are at least these (the least measured; below them skinny_kmajor keeps them).
SHORT_ROWS_MIN_K = 768
SHORT_ROWS_MIN_N = 1024


@dataclass(frozen=True)
class SimtCpAsync(SimtCore):
    """``transpose_b``: whether a K-contiguous B of a large product is copied row-major first
    (:func:`.simt_core.transposes_b`); ``transpose_big_tile_only``: only where the in-place plan
    takes the largest tile without a fused split (see :meth:`staging`). Variant switches for
    benchmarks; the defaults are the measured choice."""

    transpose_b: bool = True
    transpose_big_tile_only: bool = True
    #: Products of at most this many rows take a 32-row tile (0: never); ``short_bn`` forces its
    #: width (None: the rule of :meth:`short_tile`). Variant switches for probes.
    short_rows: int = SHORT_ROWS
    short_bn: int | None = None
    #: Blocks an SM the 32 x 128 tile is built for (__launch_bounds__: CP_MIN_BLOCKS, i.e. at
    #: most 128 registers at 4) and split for, where that doubles its slices and its tiles leave
    #: SMs idle (else, and with 0, no bound and split as any 4-warp tile: 2). Measured on the
    #: H200 (NOTES run 26): with twice the slices 5-11% faster (4096 x 4096, 4096 x 14336,
    #: 3584 x 18944 weights at 17-32 rows); with the same slices the register cap cost 3%
    #: (14336 x 4096), and at 393 tiles (50257 x 768) twice the slices lost 6-10%. sm_90 only:
    #: measured there, and at 128 registers ptxas spills some load-mode pairs for sm_86.
    short_min_blocks: int = 4
    short_min_blocks_cc = (9, 0)

    name, source, entry = "simt_cp_async", "simt_cp_async.cu", "fastmm_simt_cp_async"
    min_cc = (8, 0)
    a_transpose_mode = LOAD_ELEM_K  # cp.async cannot transpose a vector
    can_split = True
    can_stream_k = True
    can_fuse_split = True
    bk = 8
    stages = 6  # fewer where shared memory is short
    #: Stages of the 128x256 tile (one block per SM, so shared memory is its own) per compute
    #: capability, where measured: on the H200 8192x4096x6144 runs at 48.6 / 51.1 / 50.1 / 49.5 /
    #: 51.2 / 51.5 / 51.5 TFLOP/s with 4 / 5 / 6 / 7 / 8 / 10 / 12 stages (NOTES.md run 13).
    big_tile_stages = {(9, 0): 12}
    #: ... and for its split-K plans, one wave of blocks that each compute one tile, where the
    #: pipeline's fill and drain weigh more: largeK's GEMM took 174.0 us with 8 stages, 175.5
    #: with 12, 174.6 with 10 (NOTES run 14).
    big_tile_split_stages = {(9, 0): 8}
    #: Even split-K plans of the 8-warp tile on sm_90 run in cluster pairs that add their partial
    #: tiles through distributed shared memory before storing them: largeK stored 17.3 MB of
    #: partials in ~3.9 us, and its reduce took 5.3 us for 66 slices, 4.1 for 33; paired, the
    #: plan took 177.2 us against 180.1 (torch 179.1; NOTES run 14).
    pair_split = True

    def smem_bytes(self, bm, bn, stages):
        return stages * self.bk * ((bm + 4) + (bn + 4)) * 4

    def short_tiles(self, p):
        """The 32-row tiles, for products of at most 64 rows (the smallest other tile's height:
        beyond it they cannot save padding), whose copies fit ``p``'s load modes
        (:func:`.simt_core.copies_fit`: not with an m-contiguous, 16-byte A; decode's x is
        k-contiguous)."""
        if p.M > 64:
            return ()
        a, b, _ = self.load_modes(p)
        return tuple(opt for opt in SHORT_TILE_OPTIONS if copies_fit(opt, self.tile_of(opt), self.bk, a, b))

    def narrow_tiles(self, p):
        """The 64-wide tiles of NARROW_TILE_OPTIONS, for products of at most NARROW_COLS columns
        whose A is copied as float4 along m or in single floats along k (see NARROW_TILE_OPTIONS;
        not single floats along m, an unaligned A^T), and whose copies fit ``p``'s load modes."""
        if p.N > NARROW_COLS:
            return ()
        a, b, _ = self.load_modes(p)
        if a not in (LOAD_VEC_FAST, LOAD_ELEM_K):
            return ()
        return tuple(opt for opt in NARROW_TILE_OPTIONS if copies_fit(opt, self.tile_of(opt), self.bk, a, b))

    def narrow_tile(self, p, dev):
        """The heuristic's narrow tile for ``p`` (the 128 x 64 one, see NARROW_MIN_TILES_PER_SM),
        or None."""
        opt = NARROW_TILE_OPTIONS[1]
        if opt not in self.narrow_tiles(p) or -(-p.M // 128) * 128 > -(-p.M // 64) * 64:
            return None
        if self.load_modes(p)[0] == LOAD_ELEM_K and p.M % 128:
            return None
        return opt if tiles_of(p, *self.tile_of(opt)) * p.batch_total >= NARROW_MIN_TILES_PER_SM * dev.sm_count else None

    def short_tile(self, p):
        """A 32-row tile for products of at most ``short_rows`` rows: 128 wide against a
        K-contiguous B (x @ W.t(): on the H200 ahead of the 256-wide tile on 5 of 6 weights at
        M = 17-32, by up to 12%, NOTES run 26), else the 256-wide one where it pads N no more
        (row-major W: 1-5% ahead)."""
        if p.M > self.short_rows:
            return None
        fits = {self.tile_of(opt)[1]: opt for opt in self.short_tiles(p)}
        if self.short_bn is not None:
            return fits.get(self.short_bn)
        k_contiguous_b = p.b_strides[0] == 1 and p.b_strides[1] != 1
        if 256 in fits and not (128 in fits and (k_contiguous_b or not pads_no_more(p.N, 256, 128))):
            return fits[256]
        return fits.get(128)

    def extra_macros(self, p, dev, bm, bn, split=1, reserve=0):
        """STAGES: as measured for the tile and plan, fewer where they and ``reserve`` bytes of
        other shared memory (the cluster pairs' exchange region) would not fit."""
        big = (bm, bn) == self.tile_of(self.tile_options[0])
        stages = self.stages
        if big:
            stages = self.big_tile_stages.get(dev.cc, stages)
            if split > 1:
                stages = self.big_tile_split_stages.get(dev.cc, stages)
        while stages > 2 and self.smem_bytes(bm, bn, stages) + reserve > dev.smem_per_block_optin:
            stages -= 1
        return (("STAGES", stages),)

    def blocks_per_sm(self, opt, p, dev):
        """The 32 x 128 tile: ``short_min_blocks`` where its tiles leave SMs idle and planning that
        many blocks doubles the slices (at 393 tiles, 50257 x 768, twice the slices lost 6-10%);
        only a split plan is built for them (an unsplit one pays the register cap for nothing,
        and one such build spilled)."""
        per_sm = super().blocks_per_sm(opt, p, dev)
        if self.tile_of(opt) == (32, 128) and self.short_min_blocks > per_sm and dev.cc >= self.short_min_blocks_cc:
            tiles = tiles_of(p, 32, 128)
            if tiles < dev.sm_count and (split_k_for(p, dev, tiles, self.bk, self.short_min_blocks)
                                         >= 2 * split_k_for(p, dev, tiles, self.bk, per_sm)):
                return self.short_min_blocks
        return per_sm

    def staging(self, p, dev, option=None):
        """B copied first where it is unaligned (:func:`.simt_core.padded_copies`), or, with
        ``transpose_b``, K-contiguous in a large product (:func:`.simt_core.transposes_b`) whose
        in-place plan (its own choice, or the tuned ``option``) takes the 128 x 256 tile and no
        fused split. Measured on the H200
        (probes/transpose_b_probe.py; RESULTS run 18, NOTES run 22): that tile (16 x 8 outputs a
        thread at 255 registers) runs 7-12% faster on a row-major B; the smaller tiles gain at most
        2% from it, less than the copy costs (staged: 0.90-1.01x of in place at 512-2048 rows). A
        fused split would also be lost: with a K-contiguous A (x) and B read as float4 its sum spills
        (:func:`.simt_core.fused_split_spills`), so the copy would bring a reduce pass as well."""
        transpose = self.transpose_b and transposes_b(p)
        if transpose and self.transpose_big_tile_only:
            in_place = self.configure(p, dev, option) if option else self.configure(p, dev)
            transpose = in_place.tile[:2] == self.tile_of(self.tile_options[0]) and not in_place.split_fused
        return padded_copies(p, copy_a=False, transpose_b=transpose)

    def stagers(self, p, staging):
        return tuple(stage_rows_config(p, which) for which, _, _ in staging)

    def describe_staging(self, p: Problem, which: str, rows: int, cols: int) -> str:
        if which == "b" and p.b_strides[0] == 1 and p.b_strides[1] != 1:
            return (f"B (K-contiguous, as nn.Linear stores its weight) transposed into a row-major {rows}x{cols} "
                    "buffer (stage_kmajor), so the tile loads it with 16-byte cp.async along N, not single floats "
                    "along K")
        return super().describe_staging(p, which, rows, cols) + " (stage_kmajor)"


def short_rows_first(p: Problem, fam: SimtCpAsync) -> bool:
    """Whether the planner tries simt_cp_async's 32-row tile ahead of skinny_kmajor: a full-fp32
    request (ieee, or tf32x3, which skinny_kmajor serves in fp32 too) of 17-32 rows against a
    K-contiguous B, one matrix, K >= SHORT_ROWS_MIN_K and N >= SHORT_ROWS_MIN_N. There
    skinny_kmajor's 32-row form takes twice its 16-row time (its rows per thread double), and the
    tile ran 1.1-1.5x faster on all six weights measured (H200, probes/short_rows_probe.py, NOTES
    run 26: 32 x 3584 x 18944 240 -> 182 us, 162 at 4 blocks an SM; 24 x 14336 x 4096 208 ->
    148). Against a row-major W the skinny family stays ahead to 24 rows and ties at 32: it keeps
    them."""
    sBk, sBn = p.b_strides
    return (p.precision in ("ieee", "tf32x3") and 16 < p.M <= fam.short_rows and p.batch_total == 1
            and p.K >= SHORT_ROWS_MIN_K and p.N >= SHORT_ROWS_MIN_N and sBk == 1 and sBn != 1
            and fam.short_tile(p) is not None)
