"""How work is dealt out over the SMs: split-K and stream-K (the wave models), and the second
passes that complete such plans (``splitk_reduce.cu``, ``stream_k_fixup.cu``).

Used by the GEMM families; imports only :mod:`.base`.
"""
from __future__ import annotations

from dataclasses import replace

from ..problem import DeviceFacts, Problem
from .base import KernelConfig, StreamK

#: Split K only while every split keeps at least this many k-tiles of work.
MIN_KTILES_PER_SPLIT = 16
MAX_SPLIT = 64
#: Estimated cost of each extra split (workspace traffic, reduction), relative to the GEMM.
SPLIT_COST = 0.02


def split_cap(tiles: int, slots: int) -> int:
    """Most K splits for ``tiles`` tiles on ``slots`` block slots: MAX_SPLIT, or as many as one
    wave holds (largeK on the H200, 2 tiles of 128x256 on 132 slots: 66 splits fill all 132 SMs
    where 64 left 4 idle)."""
    return max(MAX_SPLIT, slots // max(tiles, 1))


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
    limit = max(1, min(split_cap(tiles, slots), k_tiles // MIN_KTILES_PER_SPLIT))

    best = min(range(1, limit + 1), key=lambda split: (split_time(tiles, split, slots), split))
    return effective_split(k_tiles, best)


def split_time(tiles: int, split: int, slots: int) -> float:
    """The wave model of split-K, in units of one whole tile's time: ``split`` slices per tile,
    ``slots`` blocks at a time, a small cost per extra split."""
    return -(-tiles * split // slots) / split * (1 + SPLIT_COST * (split - 1))


def effective_split(units: int, split: int) -> int:
    """The number of block rows that get work when ``units`` k-tiles (or chunks) are dealt out
    ``ceil(units / split)`` at a time, as split_range() in common.cuh does: asking for more
    would only add all-zero workspace slices."""
    if split <= 1 or units <= 0:
        return 1
    per = -(-units // split)
    return -(-units // per)


#: Stream-K is taken where the model below says it saves at least this share of the time.
STREAM_K_MIN_GAIN = 0.015
#: A piece's fixed cost (pipeline fill, its partial tile stored), in k-tiles of work: ~2-3 us
#: against ~1.1 us per 128x256x8 k-tile on the H200.
STREAM_K_PIECE_ITERS = 3
#: Workspace traffic (pieces written, then read by the fixup pass; L2-resident) that costs as
#: much as one k-tile of work: ~6 TB/s x ~1.1 us.
STREAM_K_BYTES_PER_ITER = 6e6


#: The head form's cost at the seam of its two launches, in k-tiles of work per k-tile of a tile:
#: the stream-K launch starts when the plain launch's last block ends (a wave's blocks end at
#: different times). H200 (NOTES run 36), products whose stream-K kernel costs no more a k-tile
#: than the plain one (row-major A): the two launches 0.6-0.9% slower than one over 5.3 waves
#: (8192 x 2816 x 1024 958.2 -> 963.8 us, x 4096 3617.9 -> 3648.6), 0.01-0.05 of a tile.
STREAM_K_HEAD_SEAM = 0.05


def stream_k_for(p: Problem, dev: DeviceFacts, tiles: int, bk: int, bm: int, bn: int,
                 blocks_per_sm: int = 1, split: int = 1, iter_penalty: float = 0.0,
                 head: bool = True) -> StreamK | None:
    """A stream-K plan where the last wave of tiles would leave SMs idle, else None. ``split``:
    the split-K alternative (1: none) it must beat. ``iter_penalty``: how much longer a k-tile
    takes in the stream-K kernel than in the plain one, where measured; then the plan is taken
    wherever the model has it faster, else only where it saves STREAM_K_MIN_GAIN.

    Blocks of equal tiles run in waves of ``slots``: 1024 tiles of 128x256 (8192x4096x6144) on
    132 SMs take 8 waves of time for 7.76 waves of work (measured on the H200: 8448x4096, exactly
    8 waves, runs 3.0% faster per FLOP, NOTES run 13). With stream-K the whole waves run as
    they are and the k-tiles of the remaining tiles are dealt out evenly, one stretch per block
    of one more wave: time = whole waves + the stretch, plus a fixed cost per piece and the
    workspace traffic of the fixup pass (all in k-tiles of one block). (Keeping a whole wave
    fewer would lengthen every stretch by exactly a tile's k-tiles and add pieces: never better.)
    The pieced tiles are fewer than the blocks, so a stretch is shorter than a tile and spans at
    most two. Only for a batch of 1 and at least one wave of tiles (below that split-K deals out
    K).

    Two forms: one launch, whose blocks take the whole tiles first (one loop serves both, so
    the penalty applies to every k-tile), or the head form (``StreamK.head_rows``): the whole
    waves, rounded down to whole rows of tiles, in the plain kernel's own launch, then the
    stream-K launch over the rows after them (the penalty on the stretches only, plus
    STREAM_K_HEAD_SEAM). The cheaper one by the model (``head``: whether the head form may be
    taken); without a penalty that is the one launch, unless its k-tile counts would pass 2^31
    (the head form's stream-K launch counts only the tiles after the head)."""
    slots = dev.sm_count * blocks_per_sm
    k_tiles = -(-p.K // bk)
    if p.batch_total != 1 or tiles < slots or tiles % slots == 0:
        return None
    waves = tiles // slots
    tiles_n = -(-p.N // bn)

    def dealt(rest: int) -> tuple[int, int]:  # (blocks, iters): the rest's k-tiles over one wave
        work = rest * k_tiles
        iters = -(-work // slots)
        return -(-work // iters), iters

    def extra(sk: StreamK) -> float:  # pieces' fixed cost and the fixup's workspace traffic
        pieces = sk.pieced_tiles + sk.blocks  # each block's stretch starts one piece more, at most
        return STREAM_K_PIECE_ITERS * sk.segments + 2 * pieces * bm * bn * 4 / STREAM_K_BYTES_PER_ITER

    forms = []  # (modelled cost, plan)
    blocks, iters = dealt(tiles - waves * slots)
    one = StreamK(waves * slots, blocks, iters, k_tiles, tiles)
    if one.whole_tiles * k_tiles + blocks * iters < 2**31:  # the kernel counts k-tiles in 32 bits
        forms.append(((waves * k_tiles + iters) * (1 + iter_penalty) + extra(one), one))
    head_tiles = waves * slots // tiles_n * tiles_n
    if head and head_tiles and tiles - head_tiles < slots:  # (else a stretch would span more than two tiles)
        rest = tiles - head_tiles
        blocks, iters = dealt(rest)
        two = StreamK(0, blocks, iters, k_tiles, rest, head_tiles // tiles_n * bm, head_tiles)
        if blocks * iters < 2**31:
            cost = -(-head_tiles // slots) * k_tiles + iters * (1 + iter_penalty) + STREAM_K_HEAD_SEAM * k_tiles
            forms.append((cost + extra(two), two))
    if not forms:
        return None
    cost, sk = min(forms, key=lambda f: f[0])  # (ties: the one launch, listed first)
    plain = split_time(tiles, split, slots) * k_tiles
    # (the margin stands in for the stream-K kernel's own cost per k-tile where that is not
    # measured; where it is, the model has it)
    margin = STREAM_K_MIN_GAIN if iter_penalty == 0 else 0.0
    return sk if cost <= (1 - margin) * plain else None


def splitk_reduce_config(p: Problem, dev: DeviceFacts, split: int) -> KernelConfig:
    """The second pass of a split-K plan (cuda_src/splitk_reduce.cu)."""
    blocks = min(-(-p.M * p.N // 256), 4 * dev.sm_count)
    return KernelConfig("splitk_reduce", "splitk_reduce.cu", "fastmm_splitk_reduce", (), 256, (256, 1, 1),
                        (max(blocks, 1), 1, 1), 0, (0, 0, 0),
                        (("order", f"sums the {split} partial slices in a fixed order (deterministic)"),))


def stream_k_head_config(cfg: KernelConfig) -> KernelConfig | None:
    """The first launch of a stream-K plan in the head form (``StreamK.head_rows``): the same
    build's plain kernel (no STREAM_K; an epilogue as ``cfg`` has it: these tiles finish C) over
    C's first ``head_rows`` rows, one block a tile. None for any other plan."""
    sk = cfg.stream_k
    if sk is None or not sk.head_rows:
        return None
    what = (f"the first {sk.head_rows} rows of C, {sk.head_tiles} tiles (whole waves, whole rows of tiles), "
            "in the plain kernel's launch before the stream-K launch over the rows after them (see "
            "work_split.stream_k_for)")
    return replace(cfg, entry=cfg.entry.removesuffix("_stream_k"), macros=tuple(m for m in cfg.macros if m[0] != "STREAM_K"),
                   grid=(sk.head_tiles, 1, 1), stream_k=None,
                   details=tuple(d for d in cfg.details if d[0] != "stream-K") + (("stream-K head", what),))


def stream_k_fixup_config(cfg: KernelConfig) -> KernelConfig:
    """The second pass of a stream-K plan (cuda_src/stream_k_fixup.cu): one block row per pieced
    tile, 4 elements per thread."""
    sk, (bm, bn, _) = cfg.stream_k, cfg.tile
    return KernelConfig("stream_k_fixup", "stream_k_fixup.cu", "fastmm_stream_k_fixup", (), 256, (256, 1, 1),
                        (-(-bm * bn // 1024), sk.pieced_tiles, 1), 0, (bm, bn, 0),
                        (("order", f"sums each of the {sk.pieced_tiles} pieced tiles' pieces in block order "
                                   "(deterministic)"),))


def second_pass_config(p: Problem, dev: DeviceFacts, cfg: KernelConfig) -> KernelConfig | None:
    """The kernel that completes ``cfg``'s work, if it needs one: split-K's reduce or stream-K's
    fixup."""
    if cfg.stream_k is not None:
        return stream_k_fixup_config(cfg)
    return splitk_reduce_config(p, dev, cfg.split_slices) if cfg.split_k > 1 and not cfg.split_fused else None
