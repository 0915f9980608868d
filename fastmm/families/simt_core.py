"""What the two SIMT families share (cuda_src/simt_core.cuh): register-blocked fp32 FFMA tiles,
their load modes, and the tile choice with split-K and stream-K.

:mod:`.simt_float4` and :mod:`.simt_cp_async` are this class with their own source, stages and
work splitting."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from ..problem import EPILOGUE_BIAS_N, DeviceFacts, Problem
from .base import (LOAD_ELEM_FAST, LOAD_ELEM_K, LOAD_NAMES, LOAD_VEC_FAST, LOAD_VEC_K, PAD_SLACK, Family,
                   KernelConfig, blocks_by_smem, covered_area, grid_of, k_dominant, pick_tile, round4, tiles_of,
                   vec_ok, with_split_flags)
from .simt_split_model import MARGIN as MODEL_MARGIN, in_domain as modelled_domain, plan_us as modelled_us
from .work_split import MIN_KTILES_PER_SPLIT, effective_split, split_k_for, stream_k_for

#: The K splits :meth:`SimtCore.modelled_choice` weighs for each tile.
MODEL_SPLITS = (1, 2, 3, 4, 5, 6, 8)
#: Stage an operand only when the product does at least this many FLOP per byte the copy moves
#: (a read and a write of the operand): then the copy costs < ~1% next to the product.
STAGE_MIN_FLOP_PER_BYTE = 256
#: A K-contiguous B (``x @ W.t()``) is copied row-major first (stage_kmajor transposes it) for
#: SIMT products of at least this many rows: the tile then loads B with 16-byte cp.async along N,
#: where in place it copies single floats along K. H200 (RESULTS run 17): 2048x14336x4096 ran at
#: 46.2 TFLOP/s on W^T and 51.6 on a row-major W. The copy reads and writes W once (8 bytes an
#: element, ~2.3 ps at 3.5 TB/s); the ~10% it saves is 2 x M FLOP an element at 46 TFLOP/s, so it
#: pays from M ~ 550. Measured (RESULTS run 18, the 128 x 256 tile): 512 rows 0.98-1.02x, 768
#: rows 1.01-1.05x, 2048 1.04-1.10x, 8192 1.05-1.13x of B read in place; hence 768.
TRANSPOSE_B_MIN_M = 768
#: Split-K plans of at most this many slices sum them in their own last block per tile
#: (SPLIT_FUSED): that block reads every slice of its tile, one L2 round trip per slice and 8
#: rows of its thread tile, where splitk_reduce spreads the sum over the whole GPU but costs a
#: launch (host time a call, and a gap on the GPU). The training products of a 1024-token model
#: split 2-4 ways (NOTES.md, run 20).
FUSED_SPLIT_MAX = 4


def fused_split_spills(tile: tuple[int, int, int], a: int, b: int, out_vec: bool, epilogue: bool) -> bool:
    """Whether simt_cp_async's fused split (SPLIT_FUSED) spills with these load modes: a
    k-contiguous A copied in single floats, with single-float B copies along N on any tile, with
    B read along N on the 16 x 8 thread tiles (at the 255-register cap), or, on the 64 x 64 tile
    (2 warps, 168 registers), with B copied along k, single-float C stores and the epilogue
    (NVRTC 13.0 only). ptxas -v over every tile, load-mode pair, store mode, epilogue and slice
    count, NVRTC 13.0 and 13.5, sm_80 and sm_90: 4-8 bytes of spills in those, none elsewhere
    (NOTES.md run 20). Such plans keep the reduce pass."""
    wm, wn, tm = tile
    if a != LOAD_ELEM_K:
        return False
    if b == LOAD_ELEM_FAST or (tm == 16 and b == LOAD_VEC_FAST):
        return True
    return (wm, wn, tm) == (1, 2, 8) and b == LOAD_ELEM_K and epilogue and not out_vec


def staged_c_spills(tile: tuple[int, int, int], a: int, b: int) -> bool:
    """Whether simt_cp_async keeps single-float C stores from the registers on a tile where its
    staged store (C_STAGED) spilled and the register one does not: the 128 x 128 tile (4 warps of
    16 x 8, at the 255-register cap) with a k-contiguous A in single floats and B in float4 units
    along n (32 bytes), and the 32-row tiles (4 outputs a thread along m, 128 registers: 4 bytes
    with A in single floats along m beside B's along k, split; their other staged builds fit, but
    staging them is unmeasured, so none is staged). ptxas -v (sm_90) over every staged build the
    planner made on a grid of odd widths, layouts, alignments, batches, splits and biases: under
    NVRTC 13.5 those alone, under 13.0 and 13.2 none (NOTES.md run 50)."""
    return tile[2] == 4 or (tile == (2, 2, 16) and a == LOAD_ELEM_K and b == LOAD_VEC_FAST)


def pads_no_more(n: int, wide: int, narrow: int) -> bool:
    """Whether tiles ``wide`` columns wide cover ``n`` columns with no more padding than tiles
    ``narrow`` wide do (the wider tile computes no extra columns past N)."""
    return -(-n // wide) * wide <= -(-n // narrow) * narrow


def copies_fit(opt: tuple[int, int, int], tile: tuple[int, int], bk: int, a_mode: int, b_mode: int) -> bool:
    """Whether both operand tiles of ``opt`` (BM x BN = ``tile``) split evenly over its threads
    in these load modes: simt_core.cuh's TileMap static_asserts, so that no plan names a kernel
    that does not build. The 32-row tiles fail with a 16-byte A (64 float4 along m a k-tile,
    against 128-256 threads)."""
    threads = opt[0] * opt[1] * 32
    for mode, extent in ((a_mode, tile[0]), (b_mode, tile[1])):
        unit = 4 if mode in (LOAD_VEC_FAST, LOAD_VEC_K) else 1
        row_units = extent // unit if mode in (LOAD_VEC_FAST, LOAD_ELEM_FAST) else bk // unit
        if (bk * extent // unit) % threads or threads % row_units:
            return False
    return True


def padded_copies(p: Problem, copy_a: bool, transpose_b: bool = False):
    """Copy plan for operands that are contiguous along their row but cannot be read with 16-byte
    vectors (N or K not a multiple of 4, odd row pitch or pointer): a zero-padded aligned copy
    turns 4-byte copies into 16-byte ones. Batch 1 only. B always; A only where ``copy_a`` (the
    SIMT families read a k-contiguous A with 4-byte copies anyway: they transpose it). With
    ``transpose_b`` (the caller checked :func:`transposes_b`), B is copied row-major whatever its
    alignment: a K-contiguous B (nn.Linear's weight in ``x @ W.t()``) transposed."""
    if p.batch_total != 1:
        return p, (), False
    flop = 2 * p.M * p.N * p.K
    staged = []
    sBk, sBn = p.b_strides
    if transpose_b or (
            sBn == 1 and p.N > 1 and not vec_ok(p.N, sBk, (0, 0), p.b_align)
            and flop >= STAGE_MIN_FLOP_PER_BYTE * 8 * p.K * p.N):
        n4 = -(-p.N // 4) * 4
        p = replace(p, b_strides=(n4, 1), b_align=16, b_batch_strides=(0, 0), b_padded=True)
        staged.append(("b", p.K, n4))
    sAm, sAk = p.a_strides
    if (copy_a and sAk == 1 and p.K > 1 and not vec_ok(p.K, sAm, (0, 0), p.a_align)
            and flop >= STAGE_MIN_FLOP_PER_BYTE * 8 * p.M * p.K):
        k4 = -(-p.K // 4) * 4
        p = replace(p, a_strides=(k4, 1), a_align=16, a_batch_strides=(0, 0), a_padded=True)
        staged.append(("a", p.M, k4))
    return p, tuple(staged), False


def transposes_b(p: Problem) -> bool:
    """Whether the SIMT tile reads ``p``'s B from a row-major copy instead of in place: B
    K-contiguous (one matrix) and at least TRANSPOSE_B_MIN_M rows to amortise the copy."""
    sBk, sBn = p.b_strides
    return p.batch_total == 1 and sBk == 1 and sBn != 1 and p.N > 1 and p.K > 1 and p.M >= TRANSPOSE_B_MIN_M


@dataclass(frozen=True)
class SimtCore(Family):
    """fp32 FFMA outer products in registers. ``stream_k``: whether plans may use stream-K where
    the family has it (a variant switch for benchmarks; the default is the measured choice)."""

    stream_k: bool = True
    #: Whether split-K plans of at most FUSED_SPLIT_MAX slices sum their own slices (the last
    #: block of each tile, SPLIT_FUSED) instead of launching splitk_reduce; a variant switch too.
    fuse_split: bool = True
    #: The most slices a fused split sums (FUSED_SPLIT_MAX; more for probes: the kernel sums any
    #: count, and SPLIT_FUSED = 8 builds without spills on the 64 x 64 tile, 168 registers).
    fused_split_max: int = FUSED_SPLIT_MAX
    #: K slices of a plan that may split (a variant for probes: benchmarks/probes/simt_split_probe.py);
    #: None: the wave model's choice.
    split: int | None = None
    #: Tiles (BM, BN) that copy an m-contiguous A in single floats along m (LOAD_ELEM_FAST)
    #: where it could go in float4 units, when B goes in float4 units too, from
    #: ``a_single_floats_cc`` (see SimtCpAsync); a variant switch for probes.
    a_single_float_tiles: tuple[tuple[int, int], ...] = ()
    #: ... and how much longer that build (A in single floats along m, B in float4 units, on
    #: those tiles and arches) takes per k-tile in the stream-K kernel than in the plain one
    #: (work_split.stream_k_for's iter_penalty; see SimtCpAsync), whether the rule above chose
    #: single floats or A's alignment left no other way (M % 4 != 0: the same macros, the same
    #: kernel; 30522 x 1024 x 8192 A^T, NOTES run 36).
    a_single_floats_stream_k_penalty: float = 0.0
    a_single_floats_cc = (9, 0)
    #: Whether a stream-K plan may take the head form (its whole waves in the plain kernel's own
    #: launch first, work_split.stream_k_for), where the model has it cheaper; a variant switch.
    stream_k_head: bool = True
    #: Whether a mid-size product (:func:`.simt_split_model.in_domain`) takes the tile and split
    #: that :mod:`.simt_split_model` has fastest, where it beats the rules' plan by its MARGIN
    #: (:meth:`modelled_choice`); a variant switch (the plans before NOTES run 54: False).
    split_model: bool = True

    precisions = ("ieee", "tf32", "tf32x3")  # full fp32; serves tf32 requests where no TF32 path can
    # (WARPS_M, WARPS_N, THREAD_M), largest tile first: 128x256, 128x128, 128x64, 64x64.
    tile_options = ((2, 4, 16), (2, 2, 16), (2, 2, 8), (1, 2, 8))
    bk = 8
    a_transpose_mode = LOAD_VEC_K  # how a k-contiguous, vector-able A is loaded
    can_split = False
    can_stream_k = False
    can_fuse_split = False
    pair_split = False
    #: Whether the kernel can store single-float C tiles through shared memory (C_STAGED), and
    #: from which compute capability the planner asks it to (measured there only): for the
    #: largest tile (one block an SM: nothing hides its store), where its buffers hold the tile.
    stage_c = False
    stage_c_cc = (9, 0)
    #: ... on every tile, not the largest alone, with shared memory grown to hold the tile where
    #: the pipeline's buffers do not (C_STAGE_FLOATS), as long as the SM still holds as many
    #: blocks (no planned tile reaches that bound on the H100 and H200), and not where the staged
    #: build spills (staged_c_spills).
    stage_c_all_tiles = False
    #: ... and whether it does so for a C of any width the GEMM finishes with a bias over its
    #: columns (F.linear's; EPILOGUE_FORM 1 in cuda_src/common.cuh), where stage_c holds.
    stage_biased_c = False
    #: Least K per slice, and least M, for the largest tile to be split instead of taking a
    #: smaller tile (the range measured: M 77 .. 4096, slices 438 .. 2048; at 341 a slice,
    #: 1024 x 2816 x 1024 in 3, the 128 x 128 tile ran 10% ahead). Above 64 rows every tile pads
    #: M to 128 rows alike (77 x 9216 x 3072 W^T: 128 x 256 in 7 slices 189 us, the 128 x 64
    #: tile's 205, 64 x 64 212; NOTES run 26).
    big_tile_min_k_per_split = 384
    #: Split plans of one matrix take the 64 x 64 tile where the rules above pick the 128 x 64 one
    #: (both 8 x 8 outputs a thread) and would split K this many ways or more (0: never): twice the
    #: tiles need fewer, longer slices, and 6 blocks an SM against 3 hide each other's fill and
    #: drain. Measured on the H200 (probes/candidates.py on probes/mid_rows.json, NOTES run 32, GPU
    #: us, 64 x 64 against 128 x 64, torch): 700 x 2304 x 768 W^T 74.5 (2 slices) / 100.4 (6) (68.8),
    #: grad_W 768 x 2304 x 4096 310.1 (3) / 338.1 (6) (319.9). Where the 128 x 64 plan splits in 2
    #: the 64 x 64 tile won 3 of 7 and lost 4 (1000^3 59.2 / 64.1, but 1024^3 W^T 73.1 / 69.0).
    #: Only with operands copied as measured (float4 along m / n, or single floats along k): with A
    #: in single floats along m and B along k the 64 x 64 build spills 4 bytes (NVRTC 13.0, sm_86).
    small_tile_from_split: int = 4
    big_tile_min_m = 65
    #: Batched products with K up to this take no 128 x 256 tile: two blocks an SM hide each
    #: other's fill and store, which weigh most where a tile's K loop is short (H200, the
    #: candidates probe, NOTES run 26: Q @ K^T at K = 64 / 128, 128 x 256 6-9% behind the
    #: 128 x 128 or 128 x 64 tile on 4 of 4 attention products; at 197 tokens a tie).
    batched_short_k = 128
    #: ... and with K up to this neither 16 x 8 tile of tile_options (128 x 256, 128 x 128; the
    #: narrow and short tiles keep their own rules): the 8 x 8 ones
    #: (128 x 64, 64 x 64), twice the blocks of half the outputs, overlap the fill and store that
    #: an 8-step K loop leaves exposed. H100, probes/candidates.py on attention's Q @ K^T
    #: (probes/thin_k_rows.json, NOTES run 52; GPU us, 128 x 128 -> the new plan, torch): faster
    #: on 11 of 12, 4 of them held out (96 x 197 x 197 x 64 48.7 -> 39.7 (34.5), 64 x 300 x 300 x
    #: 64 56.7 -> 39.1 (39.8)); 1024 x 128 x 128 x 64 3% slower (89.7 -> 92.6).
    batched_thin_k = 64

    @staticmethod
    def tile_of(opt):
        """(BM, BN) of a (WARPS_M, WARPS_N, THREAD_M) option, as simt_core.cuh lays out the lanes:
        8 x 4 of them for THREAD_M 8 (a 64 x 32 warp tile), else 4 x 8 (16: 64 x 64; 4: 16 x 64)."""
        wm, wn, tm = opt
        lanes_m = 8 if tm == 8 else 4
        return wm * lanes_m * tm, wn * (32 // lanes_m) * 8

    def load_modes(self, p: Problem):
        sAm, sAk = p.a_strides
        sBk, sBn = p.b_strides
        if sAm == 1 and vec_ok(p.M, sAk, p.a_batch_strides, p.a_align):
            a = LOAD_VEC_FAST
        elif sAk == 1 and vec_ok(round4(p.K, p.a_padded), sAm, p.a_batch_strides, p.a_align):
            a = self.a_transpose_mode
        elif sAm == 1 and sAk != 1:
            a = LOAD_ELEM_FAST
        else:
            a = LOAD_ELEM_K
        if sBn == 1 and vec_ok(round4(p.N, p.b_padded), sBk, p.b_batch_strides, p.b_align):
            b = LOAD_VEC_FAST
        elif sBk == 1 and vec_ok(p.K, sBn, p.b_batch_strides, p.b_align):
            b = self.a_transpose_mode
        elif sBk == 1 and sBn != 1:
            b = LOAD_ELEM_K
        else:
            b = LOAD_ELEM_FAST
        c_vec = p.c_strides[1] == 1 and vec_ok(p.N, p.c_strides[0], p.c_batch_strides, p.c_align)
        return a, b, c_vec

    def smem_bytes(self, bm, bn, stages):
        return 0

    @staticmethod
    def pair_region_bytes(threads, thread_m):
        """Shared memory past the pipeline's where a cluster-pair block receives its partner's
        half tile: half of each thread's thread_m x 8 sums (SPLIT_PAIR in simt_cp_async.cu)."""
        return threads * thread_m * 8 // 2 * 4

    def extra_macros(self, p, dev, bm, bn, split=1, reserve=0):
        return ()

    def _big_tile_split_fills(self, p: Problem, dev: DeviceFacts) -> bool:
        """Whether the largest tile, split along K, fills (90% of) a wave with slices of at least
        ``big_tile_min_k_per_split``: its 16x8 thread tiles run ~15% faster than the 8x8 ones of
        the smaller tiles (8192x4096x6144: 49.7 against 43.2 TFLOP/s, NOTES run 11), and its 8
        warps split over K beat the 4-warp 128 x 128 tile split less (H200, NOTES run 26:
        4096 x 768 x 3072 429 against 475 us, 2048 x 1024 x 4096 W^T 377 against 402), which
        beats the reduction pass when K is long (decode128: 128 x 11008 x 4096 took 128 x 64
        tiles and ran at 0.77x cuBLAS, 1.12x so). Not with an m-contiguous A (grad_W's x^T):
        there the 128 x 256 tile ran 2-14% behind the smaller ones on 4 of 4 products (768 x
        2304 x 4096: 353 us in 7 slices against 310 for 64 x 64 tiles, NOTES run 26)."""
        if p.M < self.big_tile_min_m or p.a_strides[0] == 1:
            return False
        bm, bn = self.tile_of(self.tile_options[0])
        tiles = tiles_of(p, bm, bn)
        split = split_k_for(p, dev, tiles, self.bk)
        return split > 1 and tiles * split >= 0.9 * dev.sm_count and p.K // split >= self.big_tile_min_k_per_split

    def short_tiles(self, p: Problem) -> tuple[tuple[int, int, int], ...]:
        """The tiles of fewer rows this family offers ``p`` besides ``tile_options`` (none here:
        :class:`.simt_cp_async.SimtCpAsync` has 32-row ones)."""
        return ()

    def short_tile(self, p: Problem):
        """The heuristic's short tile for ``p``, or None: the ``tile_options`` rules decide."""
        return None

    def narrow_tile(self, p: Problem, dev: DeviceFacts):
        """The heuristic's narrow tile for ``p``, or None (none here)."""
        return None

    def half_tile(self, p: Problem, dev: DeviceFacts, opt):
        """The heuristic's tile for a split plan of ``p`` given the rules' choice ``opt``: ``opt``
        here (:class:`.simt_cp_async.SimtCpAsync` may take a 64-row tile instead)."""
        return opt

    def narrow_tiles(self, p: Problem) -> tuple[tuple[int, int, int], ...]:
        """The 64-wide tiles of 16 x 8 outputs a thread this family offers ``p`` besides
        ``tile_options`` (none here: :class:`.simt_cp_async.SimtCpAsync` has them)."""
        return ()

    def half_tiles(self, p: Problem) -> tuple[tuple[int, int, int], ...]:
        """The 64-row tiles of 16 x 8 outputs a thread this family offers ``p`` besides
        ``tile_options`` (none here: :class:`.simt_cp_async.SimtCpAsync` has them)."""
        return ()

    @staticmethod
    def default_blocks_per_sm(opt) -> int:
        """Blocks of tile ``opt`` an SM holds as its kernel is built by default."""
        return 2 if opt[0] * opt[1] <= 4 else 1

    def blocks_per_sm(self, opt, p: Problem, dev: DeviceFacts) -> int:
        """Blocks of tile ``opt`` an SM is planned to hold for ``p`` (the split-K wave model's
        slots); a split plan planned for more than the default is built for that many
        (CP_MIN_BLOCKS: __launch_bounds__ keeps the registers of that many blocks)."""
        return self.default_blocks_per_sm(opt)

    def options(self, p, dev):
        """Every tile; for a family that splits K, each with split-K allowed or not."""
        tiles = self.tile_options + self.short_tiles(p) + self.narrow_tiles(p) + self.half_tiles(p)
        return with_split_flags(tiles) if self.can_split else tiles

    def relaunch_option(self, p: Problem, dev: DeviceFacts, chosen: KernelConfig) -> tuple[int, ...] | None:
        """A modelled plan's tile with its split flag: the model weighed B's copy with the tile it
        chose, and on the copied problem (no copy to pay, other sums fused) it could choose another
        tile, leaving the copy paid for a tile that reads B in place (NOTES run 54, review). The
        split is modelled again for the layout that runs."""
        if not self.modelled(p, dev):
            return None
        m = dict(chosen.macros)
        return (m["WARPS_M"], m["WARPS_N"], m["THREAD_M"], 1)

    def staged_b_floats(self, p: Problem, in_place: KernelConfig) -> int:
        """Floats of B the plan whose in-place kernel is ``in_place`` copies first for its tile
        (none here: :class:`.simt_cp_async.SimtCpAsync` transposes a K-contiguous B)."""
        return 0

    def modelled(self, p: Problem, dev: DeviceFacts) -> bool:
        """Whether ``p``'s tile and split are chosen by :mod:`.simt_split_model` (see split_model)."""
        return (self.split_model and self.can_split and self.split is None and not k_dominant(p)
                and modelled_domain(p, dev))

    # (cached: a plan configures its problem up to three times, and each tile weighs 7 splits;
    # families, problems and devices are frozen dataclasses, so the keys are their values)
    @functools.lru_cache(maxsize=4096)
    def modelled_split(self, p: Problem, dev: DeviceFacts, opt) -> tuple[KernelConfig, float]:
        """Tile ``opt`` with the K split (1 to 8 slices, MODEL_SPLITS, each of at least
        MIN_KTILES_PER_SPLIT k-tiles as split_k_for keeps them) :mod:`.simt_split_model` has
        fastest for it, and that modelled time: what the option ``opt`` + (1,) means for a product
        the model serves (flag 1: split as the family's rule says)."""
        best, best_us = None, 0.0
        most = max(1, -(-p.K // self.bk) // MIN_KTILES_PER_SPLIT)
        weighed = tuple(s for s in MODEL_SPLITS if s <= most)
        for split in weighed:
            cfg = replace(self, split=split, split_model=False, stream_k=False).configure(p, dev, tuple(opt) + (1,))
            us = modelled_us(cfg, p, dev, self.staged_b_floats(p, cfg))
            if best is None or us < best_us:
                best, best_us = cfg, us
        why = (f"{best.split_k} slice{'s' if best.split_k > 1 else ''} of K: this tile's fastest of "
               f"{', '.join(map(str, weighed))} by simt_split_model ({best_us:.0f} us modelled; a mid-size "
               "product on sm_90)")
        return replace(best, details=best.details + (("tile and split", why),)), best_us

    @functools.lru_cache(maxsize=4096)
    def modelled_choice(self, p: Problem, dev: DeviceFacts) -> KernelConfig:
        """The heuristic plan of a product the model serves: of the tiles of ``tile_options`` and
        ``half_tiles``, each with its modelled split (:meth:`modelled_split`), the fastest
        modelled; the rules' tile (their plan's, :meth:`configure` without the model) unless
        another is modelled MARGIN faster."""
        rules = replace(self, split_model=False).configure(p, dev)
        macros = dict(rules.macros)
        rules_opt = (macros["WARPS_M"], macros["WARPS_N"], macros["THREAD_M"])
        options = self.tile_options + self.half_tiles(p)
        if rules_opt not in options:
            return rules
        timed = {opt: self.modelled_split(p, dev, opt) for opt in options}
        fastest = min(options, key=lambda opt: timed[opt][1])
        keep = timed[fastest][1] >= (1 - MODEL_MARGIN) * timed[rules_opt][1]
        return timed[rules_opt if keep else fastest][0]

    def configure(self, p, dev, option=None):
        if self.modelled(p, dev) and (option is None or option[3]):
            return self.modelled_choice(p, dev) if option is None else self.modelled_split(p, dev, tuple(option[:3]))[0]
        short = (self.short_tile(p) or self.narrow_tile(p, dev)) if option is None else None
        if option is not None:
            opt, may_split = tuple(option[:3]), self.can_split and bool(option[3])
        elif short is not None:
            opt, may_split = short, self.can_split
        elif self.can_split and k_dominant(p):
            # splits supply the parallelism; the largest tile where it pads N no more than the
            # 128x128 one (largeK 256x256x65536 on the H200: 128x256 x 66 splits 184.4 us,
            # 128x128 x 66 186.9, NOTES run 12), else 128x128 (N = 64: a 256-wide tile would do
            # twice the FFMAs)
            big, small = self.tile_of(self.tile_options[0])[1], self.tile_of(self.tile_options[1])[1]
            opt = self.tile_options[0] if pads_no_more(p.N, big, small) else self.tile_options[1]
            may_split = True
        else:
            options = self.tile_options
            if p.batch_total > 1 and p.K <= self.batched_thin_k:
                options = tuple(o for o in options if o[2] == 8)  # (see batched_thin_k)
            elif p.batch_total > 1 and p.K <= self.batched_short_k:
                options = options[1:]  # (see batched_short_k)
            opt, may_split = pick_tile(p, dev, options, self.tile_of), self.can_split
            if may_split and opt != self.tile_options[0] and self._big_tile_split_fills(p, dev):
                # (over a 128 x 128 choice only where the wider tile pads N no more: so measured;
                # over the 8 x 8 tiles where it covers at most PAD_SLACK times their area: at N = 64
                # it computed 4x the outputs, 8192 x 64 x 1024 W^T 104.4 us against 41.8 for the
                # 64 x 64 tile split 2, NOTES run 30)
                big = self.tile_of(self.tile_options[0])
                if opt[2] == 8 and covered_area(p, big) <= PAD_SLACK * covered_area(p, self.tile_of(opt)) \
                        or pads_no_more(p.N, big[1], self.tile_of(opt)[1]):
                    opt = self.tile_options[0]
        if option is None and short is None and may_split:
            opt = self.half_tile(p, dev, opt)
            if opt == self.tile_options[2] and p.batch_total == 1 and self.small_tile_from_split \
                    and set(self.load_modes(p)[:2]) <= {LOAD_VEC_FAST, LOAD_ELEM_K}:
                tiles = tiles_of(p, *self.tile_of(opt))
                if split_k_for(p, dev, tiles, self.bk, self.blocks_per_sm(opt, p, dev)) >= self.small_tile_from_split:
                    opt = self.tile_options[3]  # (see small_tile_from_split)
        wm, wn, tm = opt
        bm, bn = self.tile_of(opt)
        per_sm = self.blocks_per_sm(opt, p, dev)
        split = split_k_for(p, dev, tiles_of(p, bm, bn), self.bk, per_sm) if may_split else 1
        if may_split and self.split is not None and p.batch_total == 1:
            split = effective_split(-(-p.K // self.bk), self.split)
        a, b, c_vec = self.load_modes(p)
        single_tile = (bm, bn) in self.a_single_float_tiles and dev.cc >= self.a_single_floats_cc
        a_single = (a, b) == (LOAD_VEC_FAST, LOAD_VEC_FAST) and single_tile
        if a_single:
            a = LOAD_ELEM_FAST
        # stream-K where the model has it beat split-K as well, for the 8-warp tile (one block
        # per SM; the 4-warp 128x128 one spills with the stream-K loop), except with an
        # m-contiguous A and single-float B copies along k, which spill (sm_80 .. sm_89) at 255
        # registers
        sk = None
        spills = (a, b) == (LOAD_VEC_FAST, LOAD_ELEM_K)
        if may_split and self.can_stream_k and self.stream_k and opt == self.tile_options[0] and not spills:
            single_build = (a, b) == (LOAD_ELEM_FAST, LOAD_VEC_FAST) and single_tile  # (a_single or A's alignment)
            penalty = self.a_single_floats_stream_k_penalty if single_build else 0.0
            sk = stream_k_for(p, dev, tiles_of(p, bm, bn), self.bk, bm, bn, per_sm, split, penalty,
                              head=self.stream_k_head)
            split = 1 if sk is not None else split
        out_vec = c_vec
        if split > 1:
            c_vec = p.N % 4 == 0  # partials go to a fresh contiguous workspace
        # cluster pairs: an even split of the one-block-per-SM tile, on sm_90 (clusters); not for
        # the load modes that spill (12 bytes there, with single-float C stores)
        pair = split > 1 and split % 2 == 0 and self.pair_split and per_sm == 1 and dev.cc >= (9, 0) and not spills
        fused = (1 < split <= self.fused_split_max and not pair and self.can_fuse_split and self.fuse_split
                 and not fused_split_spills(opt, a, b, out_vec, bool(p.epilogue)))
        threads = wm * wn * 32
        region = self.pair_region_bytes(threads, tm) if pair else 0
        extra = self.extra_macros(p, dev, bm, bn, split, region) + ((("SPLIT_PAIR", 1),) if pair else ())
        if split > 1 and per_sm > self.default_blocks_per_sm(opt):  # (see blocks_per_sm)
            extra += (("CP_MIN_BLOCKS", per_sm),)
        if fused:  # (OUT_VEC: C itself, where C_VEC describes the workspace)
            extra += (("SPLIT_FUSED", split), ("OUT_VEC", int(out_vec)))
        # single-float stores of contiguous rows (C's, or a split slice's workspace) through shared
        # memory, where the family has it (see stage_c); not the fused and paired splits' own stores.
        # So too any C the GEMM finishes with a bias over its columns (see stage_biased_c).
        pipeline = self.smem_bytes(bm, bn, dict(extra).get("STAGES", 2))
        bias_over_columns = p.epilogue == EPILOGUE_BIAS_N and split == 1  # (this GEMM finishes C)
        c_floats = bm * (bn + (16 if tm == 8 else 0))  # (C_PITCH in simt_cp_async.cu: 4 lanes along n pad 16)
        grown = max(pipeline, 4 * c_floats)
        staged_c = (self.stage_c and dev.cc >= self.stage_c_cc and not fused and not pair
                    and (split > 1 or p.c_strides[1] == 1)
                    and ((opt == self.tile_options[0] and pipeline >= 4 * c_floats
                          and (not c_vec or (self.stage_biased_c and bias_over_columns)))
                         or (self.stage_c_all_tiles and not c_vec and not staged_c_spills(opt, a, b)
                             and blocks_by_smem(grown, dev) >= min(per_sm, blocks_by_smem(pipeline, dev)))))
        if staged_c:
            extra += (("C_STAGED", 1),)
            if pipeline < 4 * c_floats:
                extra += (("C_STAGE_FLOATS", c_floats),)
                pipeline = grown
        # (a bias the GEMM adds, one value a column: each thread reads its column's once, where
        # the threads tile whole rows; the kernel's EPILOGUE comes with the plan's epilogue,
        # plan.with_epilogue)
        staged_bias = staged_c and bias_over_columns and (wm * wn * 32) % bn == 0
        if staged_bias:
            extra += (("EPILOGUE_FORM", 1),)
        macros = (("WARPS_M", wm), ("WARPS_N", wn), ("THREAD_M", tm), ("BK", self.bk), ("A_MODE", a),
                  ("B_MODE", b), ("C_VEC", int(c_vec))) + extra
        smem = pipeline + region
        details = (("A loads", LOAD_NAMES[a]), ("B loads", LOAD_NAMES[b]),
                   ("C stores", "single floats, a warp's row at a time through shared memory (coalesced)"
                    + (", the bias read once a thread" if staged_bias else "")
                    if staged_c else "float4" if c_vec else "single floats"),
                   ("math", f"fp32 FFMA, {tm}x8 outputs per thread"))
        if a_single:
            details += (("A copy choice", "single floats where float4 units fit: beside B's float4 units this "
                                          "tile's main loop runs faster (see SimtCpAsync.a_single_float_tiles)"),)
        if fused:
            details += (("split-K", f"{split} slices of K, summed in slice order by the last block of each tile "
                                    f"(no second launch); C stores {'float4' if out_vec else 'single floats'}"),)
        elif split > 1:
            pairs = f"added in cluster pairs (distributed shared memory) into {split // 2} partial tiles, "
            details += (("split-K", f"{split} slices of K, {pairs if pair else ''}reduced by splitk_reduce"),)
        if sk is not None:
            first = (f"after a plain launch over the first {sk.head_rows} rows ({sk.head_tiles} tiles), "
                     if sk.head_rows else
                     f"{sk.whole_tiles} tiles whole ({sk.whole_tiles // (dev.sm_count * per_sm)} waves), then ")
            details += (("stream-K", first + f"{sk.blocks} blocks of {sk.iters} k-tiles each over the other "
                                             f"{sk.pieced_tiles} tiles ({sk.k_tiles} k-tiles each), completed by "
                                             "stream_k_fixup"),)
            return KernelConfig(self.name, self.source, self.entry + "_stream_k", macros + (("STREAM_K", 1),),
                                threads, (threads, 1, 1), (sk.whole_tiles + sk.blocks, 1, 1), smem,
                                (bm, bn, self.bk), details, stream_k=sk)
        return KernelConfig(self.name, self.source, self.entry, macros, threads, (threads, 1, 1),
                            grid_of(tiles_of(p, bm, bn), p.batch_total, split), smem, (bm, bn, self.bk), details,
                            split_pair=pair, split_fused=fused)
