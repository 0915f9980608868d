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
#: ... and where its blocks fill their last wave to at least NARROW_MIN_WAVE_FILL (blocks over
#: waves x slots, NARROW_BLOCKS_PER_SM an SM: two warps at up to 255 registers). Measured on the
#: H200 (probes/variant_rows.py and candidates.py on probes/low_rows.json, NOTES run 33, GPU us):
#: BERT's P.V 192 x (384 x 64 x 384), 576 blocks on 528 slots (a second wave of 48), 162.0 on the
#: narrow tile against 102.8 on the 64 x 64 one (torch 98.2); the runs-30/31 wins fill one or two
#: waves to 0.97 (512 and 1024 blocks).
NARROW_BLOCKS_PER_SM = 4
NARROW_MIN_WAVE_FILL = 0.9
#: The 8 x 8 tiles' kernels are built for this many warps an SM (simt_cp_async.cu: CP_MIN_BLOCKS
#: = 384 / THREADS: 6 blocks of the 64 x 64 tile, 3 of the 128 x 64 one). On sm_90 the split-K
#: wave model counts their slots so, up to SMALL_TILE_MAX_SLOTS blocks an SM (it counted 2, as
#: for any 4-warp tile). Past 4 blocks of the 2-warp tile an SM's FFMA issue is shared: a block
#: no longer finishes its slice in one slice's time, so counting all 6 over-splits. Measured on
#: the H200 (probes/simt_split_probe.py, 11 splits each, NOTES run 33): time at the planned split
#: over the best split's, geomean (worst), on probes/split_rows.json (21 products) / on
#: probes/split_holdout.json (24 random ones): 2 and 2 blocks (the old count) 1.068 (1.20) /
#: 1.068 (1.35), 6 and 3 1.045 / 1.079, 4 and 2 1.038 / 1.060, 4 and 3 1.030 (1.18) / 1.055 (1.32);
#: back to back against the old count, 0.973x / 0.978x the time (the worst rows: 768 x 2304 x
#: 4096 grad_W 325.7 us in 6 slices against 302.2 in 3; 337 x 2048 x 768 W^T 52.2 against 41.9).
#: Not on sm_80-sm_89 (not measured there; at 100 KB of shared memory an SM, sm_86 and sm_89 hold
#: 3 blocks of the 64 x 64 tile's 6 stages).
SMALL_TILE_WARPS = 12
SMALL_TILE_MAX_SLOTS = 4
#: ... where K and N are at least these (the least measured; below them skinny_kmajor keeps them).
SHORT_ROWS_MIN_K = 768
SHORT_ROWS_MIN_N = 1024
#: The 64-row tiles of 16 x 8 outputs a thread, (WARPS_M, WARPS_N, THREAD_M): 64 x 256 (4 warps)
#: and 64 x 128 (2 warps); one warp row, 64 x 64 warp tiles. For products whose last tile of rows
#: is at most 64 rows (M % 128 in 1..64: decode with a batch of 33-64 sequences, 300 tokens),
#: where the 128-row tiles compute up to half their rows on padding and the 64 x 64 tile runs 8 x 8
#: outputs a thread (a third more shared-memory reads per FFMA). The 64 x 128 one is not offered
#: with A in single floats along k and B as float4 along n: it spills 4-8 bytes there (ptxas -v,
#: sm_80 / sm_90, NVRTC 13.5).
HALF_TILE_OPTIONS = ((1, 4, 16), (1, 2, 16))
#: The heuristic's split plans of one matrix of more than SHORT_ROWS rows (measured: 40-576) take
#: the 64 x 256 one (:meth:`SimtCpAsync.half_tile`) over a 128-row tile of 16 x 8 outputs a
#: thread, and over the 64 x 64 tile of 8 x 8 where B is read as float4 along n or A is not in
#: single floats along k, or where its K slices are at least HALF_MIN_K_PER_SPLIT long (with both
#: operands in single floats along k, nn.Linear's x @ W.t(), its 16 copies of B a thread a k-tile
#: and two fragment sets, not three, cost it the 16 x 8 tile's gain on short slices). Measured on
#: the H200 (probes/candidates.py, NOTES run 32, GPU us, the rule's tile against the old choice,
#: torch): on probes/half_rows.json 64 x 1024 x 4096 W^T 29.0 / 39.3 (30.6), 576 x 4096^2 W^T 514 /
#: 608 (427), 64 x 4096 x 14336 W^T 206.7 / 225.1 (188.1), 64 x 4096^2 row-major W 60.3 / 66.9
#: (59.0), 300 x 1024 x 4096 row-major W 72.2 / 79.2 (72.1), grad_W 320 x 768 x 3072 47.5 / 52.7
#: (62.9); kept off x @ W.t() at short slices: 40 x 3072 x 1024 27.1 against 23.5, 300 x 700 x 1100
#: 33.7 / 28.1, 320 x 3072 x 768 57.0 / 53.0, 64 x 14336 x 4096 222.9 / 222.0 (455 k a slice). On
#: the held-out probes/half_holdout.json (dims the rule was not fitted on) 7 of the 8 products it
#: changes ran 1.07-1.52x faster (64 x 2560 x 10240 W^T 161.3 -> 106.0), one 2% slower (448 x
#: 2048 x 8192 W^T 388.9 -> 397.2).
HALF_MIN_K_PER_SPLIT = 600
#: ... and only where 128-row tiles would compute at least this many times the rows 64-row ones
#: do (576 rows: 640 against 576, 1.11; the largest measured), not on large products whose last
#: tile of rows alone is short.
HALF_MIN_ROWS_SAVED = 1.1


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
    #: Whether the split-K wave model counts the 8 x 8 tiles' blocks an SM as they are built, up to
    #: SMALL_TILE_MAX_SLOTS (see there), from this compute capability, or as 2 (False: the plans
    #: before NOTES run 33, a switch for probes).
    small_tile_slots: bool = True
    small_tile_slots_cc = (9, 0)
    #: grad_W's A (G^T: contiguous along m) in single floats along m, not float4 units, on the
    #: 128 x 256 tile with a row-major B: the same kernel with both operands in float4 units ran
    #: 2.7-2.8% slower, with both in single floats 6.5-6.6% (ptxas schedules the main loop
    #: around the copies; the SASS loops differ little in length). H200 (NOTES run 35,
    #: probes/copy_unit_probe.py, GPU us, A float4 / A single floats / both single floats,
    #: torch): 4096 x 1024 x 8192 1381.3 / 1345.0 / 1431.8 (1311.2), 32000 x 1024 x 8192 11019.3
    #: / 10722.5 / 11435.0 (10114.7); with a row-major A (single floats along k), a B in single
    #: floats ran 4.0-4.8% slower: B keeps its float4 units. On the smaller tiles single floats
    #: did not pay (128 x 128 in its planned split plans: 141.8 against 141.0 us; 128 x 64 and
    #: 64 x 64: 6-8% slower). Batched products (measured: none) run the same build: the batch is
    #: a launch argument.
    a_single_float_tiles: tuple[tuple[int, int], ...] = ((128, 256),)
    #: That build's stream-K kernel does not share the plain kernel's gain: per k-tile it took
    #: ~4.5% longer (H200, NOTES run 35, GPU us, plain / stream-K: 14336 x 4096 x 2048, 13.58
    #: waves of tiles, 4745.8 / 4830.1; 32000 x 1024 x 8192, 7.58 waves, 10722.9 / 10608.4; with
    #: float4 units ~2%: 4870.0 / 4834.9, 11013.2 / 10668.4). So its stream-K plans take the head
    #: form (the whole waves in the plain kernel's launch first: 32000 x 1024 x 8192 10614.4 ->
    #: 10231.3 us, 14336 x 4096 x 2048 4739.5 (plain) -> 4663.2, NOTES run 36), and stream-K is
    #: taken only where the last wave's idle SMs cost more than the penalty on the stretches.
    a_single_floats_stream_k_penalty: float = 0.045
    #: Single-float C staged through shared memory on every tile (see SimtCore.stage_c_all_tiles).
    #: Attention's scores at L = 197 or 77 (C 197 or 77 wide) store a 128 x 128 or 128 x 64 tile
    #: for 64 k of work, so the store is most of the block's time: from the registers 4 bytes a
    #: lane 16 bytes apart, staged in rows of consecutive floats a warp. H100 (NOTES run 49,
    #: GPU us, registers / staged, torch): 768 x 197 x 197 x 64 278.6 / 255.4 (198.7), at a batch
    #: of 64 35.4 / 24.8 (19.1), 96 x 77 x 77 x 64 15.0 / 13.8 (9.3), 300 x 701 x 1100 W^T split
    #: 31.4 / 28.4 (21.0). False: the largest tile alone (a switch for probes).
    stage_c_all_tiles: bool = True

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
    #: Single-float C (N % 4 != 0, contiguous rows) stored through the idle pipeline buffers in
    #: whole rows a warp (C_STAGED in simt_cp_async.cu): from registers a warp's store touched 16
    #: sectors, and at one block an SM the 128 x 256 tile's store is not hidden. H200 (NOTES run
    #: 33, bench.py on probes/vocab_rows.json, TFLOP/s, torch 50.9 / 50.1 / 48.7): 4096 x 50257 x 768
    #: W^T 45.1 -> 47.2, 4096 x 32001 x 768 W^T 44.4 -> 46.6, 4096 x 50257 x 768 row-major W 45.1
    #: -> 47.2 (at N = 50256, float4 stores: 49.3); 4097 x 4095 x 4093 47.6-47.8 -> 48.8.
    stage_c = True
    #: A bias in float4 stores from the registers cost the 128 x 256 tile 3.2-3.4% of the whole
    #: product (the main loop's registers are allocated around the epilogue's reads, and it came
    #: out slower; reading the bias once per column before the stores: 4.8-5.8%). Staged, each
    #: thread reads one value (H200, NOTES run 34, GPU us, no bias / in the float4 stores /
    #: staged): 8192 x 1024 x 1024 354.8 / 366.1 / 359.9, 8192 x 3072 x 1024 1049.2 / 1085.1 /
    #: 1065.1, 8192 x 1024 x 4096 1363.5 / 1408.3 / 1349.9.
    stage_biased_c = True

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

    def half_tiles(self, p):
        """The 64-row tiles of HALF_TILE_OPTIONS, for products whose 64-row tiles pad M less than
        128-row ones (M % 128 in 1..64), whose copies fit ``p``'s load modes, and that do not
        spill there (see HALF_TILE_OPTIONS)."""
        if -(-p.M // 64) * 64 >= -(-p.M // 128) * 128:
            return ()
        a, b, _ = self.load_modes(p)
        return tuple(opt for opt in HALF_TILE_OPTIONS if copies_fit(opt, self.tile_of(opt), self.bk, a, b)
                     and not (opt == (1, 2, 16) and (a, b) == (LOAD_ELEM_K, LOAD_VEC_FAST)))

    def half_tile(self, p, dev, opt):
        """The 64 x 256 tile in place of the rules' choice ``opt`` for a split plan of ``p``, where
        the last tile of rows is at most 64 rows (see HALF_MIN_K_PER_SPLIT), else ``opt``."""
        half = HALF_TILE_OPTIONS[0]
        if p.M <= SHORT_ROWS or p.batch_total > 1 or half not in self.half_tiles(p):
            return opt
        if not pads_no_more(p.N, self.tile_of(half)[1], self.tile_of(opt)[1]):
            return opt  # (no wider columns of padding for its shorter rows)
        if -(-p.M // 128) * 128 < HALF_MIN_ROWS_SAVED * (-(-p.M // 64) * 64):
            return opt  # (a large product: the 128-row tiles pad it little)
        if opt[2] == 16 and self.tile_of(opt)[0] == 128:
            return half
        if opt != self.tile_options[3]:
            return opt
        a, b, _ = self.load_modes(p)
        if b == LOAD_VEC_FAST or a != LOAD_ELEM_K:
            return half
        split = split_k_for(p, dev, tiles_of(p, *self.tile_of(half)), self.bk, self.blocks_per_sm(half, p, dev))
        return half if p.K // split >= HALF_MIN_K_PER_SPLIT else opt

    def narrow_tile(self, p, dev):
        """The heuristic's narrow tile for ``p`` (the 128 x 64 one, see NARROW_MIN_TILES_PER_SM and
        NARROW_MIN_WAVE_FILL), or None."""
        opt = NARROW_TILE_OPTIONS[1]
        if opt not in self.narrow_tiles(p) or -(-p.M // 128) * 128 > -(-p.M // 64) * 64:
            return None
        if self.load_modes(p)[0] == LOAD_ELEM_K and p.M % 128:
            return None
        blocks = tiles_of(p, *self.tile_of(opt)) * p.batch_total
        if blocks < NARROW_MIN_TILES_PER_SM * dev.sm_count:
            return None
        slots = NARROW_BLOCKS_PER_SM * dev.sm_count
        return opt if blocks >= NARROW_MIN_WAVE_FILL * -(-blocks // slots) * slots else None

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

    @staticmethod
    def default_blocks_per_sm(opt):
        """Blocks of tile ``opt`` an SM holds as its kernel is built by default: the 8 x 8 tiles
        (THREAD_M 8) SMALL_TILE_WARPS warps' worth (CP_MIN_BLOCKS), the others as any SIMT tile."""
        if opt[2] == 8:
            return max(1, SMALL_TILE_WARPS // (opt[0] * opt[1]))
        return SimtCore.default_blocks_per_sm(opt)

    def blocks_per_sm(self, opt, p, dev):
        """The 32 x 128 tile: ``short_min_blocks`` where its tiles leave SMs idle and planning that
        many blocks doubles the slices (at 393 tiles, 50257 x 768, twice the slices lost 6-10%);
        only a split plan is built for them (an unsplit one pays the register cap for nothing,
        and one such build spilled). The 8 x 8 tiles: as built, at most SMALL_TILE_MAX_SLOTS, on
        ``small_tile_slots_cc`` (see SMALL_TILE_WARPS), else 2 as any 4-warp tile."""
        if opt[2] == 8:
            if self.small_tile_slots and dev.cc >= self.small_tile_slots_cc:
                return min(self.default_blocks_per_sm(opt), SMALL_TILE_MAX_SLOTS)
            return SimtCore.default_blocks_per_sm(opt)
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
            transpose = self.staged_b_floats(p, self.configure(p, dev, option) if option else self.configure(p, dev)) > 0
        return padded_copies(p, copy_a=False, transpose_b=transpose)

    def staged_b_floats(self, p, in_place):
        """K x N where B is transposed first for the plan whose in-place kernel is ``in_place``
        (see :meth:`staging`), else 0."""
        big = in_place.tile[:2] == self.tile_of(self.tile_options[0])
        if self.transpose_b and transposes_b(p) and (not self.transpose_big_tile_only or big and not in_place.split_fused):
            return p.K * p.N
        return 0

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
