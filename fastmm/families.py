"""Kernel families: for each, its source file, entry point, what it can serve, and how to launch it.

Pure Python (no torch, no CUDA): a family looks at a :class:`~fastmm.problem.Problem` and the
:class:`~fastmm.problem.DeviceFacts` and either rejects it with a reason a user can read, or
returns a :class:`KernelConfig` - the compile-time macros and the launch geometry. The choice
between families lives in :mod:`fastmm.plan`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

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
class StreamK:
    """How a stream-K launch deals out its work (see ``fastmm_simt_cp_async_stream_k``): the first
    ``whole_tiles`` tiles (in tile order; whole waves) one per block, then ``blocks`` blocks that
    each take ``iters`` consecutive k-tiles of the remaining tiles' k-tiles in tile-major order
    (``k_tiles`` per tile), each piece into its own workspace slot for ``stream_k_fixup``."""

    whole_tiles: int
    blocks: int
    iters: int
    k_tiles: int
    tiles: int  # all tiles of the problem

    @property
    def pieced_tiles(self) -> int:
        return self.tiles - self.whole_tiles

    @property
    def segments(self) -> int:
        """Workspace slots per block: the most tiles a stretch of ``iters`` k-tiles can touch
        (as stream_k_segments() in common.cuh)."""
        return -(-self.iters // self.k_tiles) + 1

    def workspace_floats(self, bm: int, bn: int) -> int:
        return self.blocks * self.segments * bm * bn


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
    # "a" for kernels that use arch-specific instructions (sm_90a: wgmma, setmaxnreg): such a
    # cubin runs on that exact compute capability only.
    arch_suffix: str = ""
    # Set for a stream-K launch (its kernel takes the workspace and this plan's numbers too).
    stream_k: StreamK | None = None
    # Split-K finished inside the GEMM (no second pass): the last block of a tile to arrive sums
    # its slices (split_arrive_last in common.cuh). Its kernel also takes the output, its strides
    # and zeroed arrival counters, one per tile (fastmm/runtime/arrivals.py).
    split_fused: bool = False
    # Split-K blocks in thread-block cluster pairs that add their partial tiles before storing
    # them (SPLIT_PAIR in simt_cp_async.cu, sm_90): the workspace holds split / 2 slices.
    split_pair: bool = False
    # Launched with programmatic dependent launch (sm_90+; its kernel calls grid_dependency_sync
    # in cuda_src/ptx.cuh first): scheduled while the kernel ahead on the stream finishes.
    dependent_launch: bool = False

    def target(self, device_arch: str) -> str:
        """The NVRTC target of this kernel on a device of ``device_arch`` (e.g. sm_90 -> sm_90a)."""
        return device_arch + self.arch_suffix

    @property
    def split_k(self) -> int:
        """K is split over grid.y blocks; partial products go to a workspace (split_slices of
        them), summed by splitk_reduce or, for a fused plan, by the kernel itself."""
        return self.grid[1]

    @property
    def split_slices(self) -> int:
        """Partial slices in the workspace of a split-K launch (the reduce pass sums them)."""
        return self.grid[1] // 2 if self.split_pair else self.grid[1]

    @property
    def arrival_counters(self) -> int:
        """How many arrival counters a fused split-K launch uses: one per column tile (grid.x)."""
        return self.grid[0] if self.split_fused else 0

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


def stream_k_for(p: Problem, dev: DeviceFacts, tiles: int, bk: int, bm: int, bn: int,
                 blocks_per_sm: int = 1, split: int = 1) -> StreamK | None:
    """A stream-K plan where the last wave of tiles would leave SMs idle, else None. ``split``:
    the split-K alternative (1: none) it must beat.

    Blocks of equal tiles run in waves of ``slots``: 1024 tiles of 128x256 (8192x4096x6144) on
    132 SMs take 8 waves of time for 7.76 waves of work (measured on the H200: 8448x4096, exactly
    8 waves, runs 3.0% faster per FLOP, NOTES run 13). With stream-K the whole waves run as
    they are and the k-tiles of the remaining tiles are dealt out evenly, one stretch per block
    of one more wave: time = whole waves + the stretch, plus a fixed cost per piece and the
    workspace traffic of the fixup pass (all in k-tiles of one block). (Keeping a whole wave
    fewer would lengthen every stretch by exactly a tile's k-tiles and add pieces: never better.)
    The pieced tiles are fewer than the blocks, so a stretch is shorter than a tile and spans at
    most two. Only for a batch of 1 and at least one wave of tiles (below that split-K deals out
    K)."""
    slots = dev.sm_count * blocks_per_sm
    k_tiles = -(-p.K // bk)
    if p.batch_total != 1 or tiles < slots or tiles % slots == 0:
        return None
    waves = tiles // slots
    rest = tiles - waves * slots
    work = rest * k_tiles
    iters = -(-work // slots)
    blocks = -(-work // iters)
    sk = StreamK(waves * slots, blocks, iters, k_tiles, tiles)
    if sk.whole_tiles * k_tiles + blocks * iters >= 2**31:
        return None  # the kernel counts k-tiles in 32 bits, up to the last block's stretch end
    pieces = rest + blocks  # each block's stretch starts one piece more, at most
    cost = (waves * k_tiles + iters + STREAM_K_PIECE_ITERS * sk.segments
            + 2 * pieces * bm * bn * 4 / STREAM_K_BYTES_PER_ITER)
    plain = split_time(tiles, split, slots) * k_tiles
    return sk if cost <= (1 - STREAM_K_MIN_GAIN) * plain else None


def k_dominant(p: Problem) -> bool:
    """Long K with a small output: big tiles + split-K beat small tiles."""
    return p.batch_total == 1 and p.K >= 4 * max(p.M, p.N)


def splitk_reduce_config(p: Problem, dev: DeviceFacts, split: int) -> KernelConfig:
    """The second pass of a split-K plan (cuda_src/splitk_reduce.cu)."""
    blocks = min(-(-p.M * p.N // 256), 4 * dev.sm_count)
    return KernelConfig("splitk_reduce", "splitk_reduce.cu", "fastmm_splitk_reduce", (), 256, (256, 1, 1),
                        (max(blocks, 1), 1, 1), 0, (0, 0, 0),
                        (("order", f"sums the {split} partial slices in a fixed order (deterministic)"),))


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


def _tiles(p: Problem, bm: int, bn: int) -> int:
    return -(-p.M // bm) * -(-p.N // bn)


def _pick_tile(p: Problem, dev: DeviceFacts, options, tile_of):
    """First (largest) option whose tiles fill (90% of) a wave of blocks; else the smallest."""
    for opt in options:
        bm, bn = tile_of(opt)
        if _tiles(p, bm, bn) * p.batch_total >= 0.9 * dev.sm_count:
            return opt
    return options[-1]


#: The last element of the option of a family that splits K: split as :func:`split_k_for` (or the
#: family's own rule) says (1), or never (0). A flag, not a count, so that one tuned option fits
#: every size of its shape bucket.
SPLIT_FLAGS = (1, 0)


def _with_split_flags(tile_options) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(opt) + (flag,) for opt in tile_options for flag in SPLIT_FLAGS)


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

    def options(self, p: Problem, dev: DeviceFacts) -> tuple[tuple[int, ...], ...]:
        """The configurations this family could run ``p`` with, for the tuner to time: tuples of
        ints (they are stored as JSON), each accepted by ``configure(p, dev, option)``. A family
        with nothing to choose has the single option ``()``: its own choice."""
        return ((),)

    def configure(self, p: Problem, dev: DeviceFacts, option: tuple[int, ...] | None = None) -> KernelConfig:
        """The kernel for ``p``: with ``option`` None the family's heuristic choice, else that
        option (one of :meth:`options`)."""
        raise NotImplementedError  # pragma: no cover


class Scalar(Family):
    """One output per thread, 16x16 shared tiles, any strides: the last resort."""

    name, source, entry = "scalar", "scalar.cu", "fastmm_scalar"
    precisions = ("ieee", "tf32", "tf32x3")  # fp32 FMA is at least as accurate as any of them

    def configure(self, p, dev, option=None):
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

    @staticmethod
    def pair_region_bytes(threads, thread_m):
        """Shared memory past the pipeline's where a cluster-pair block receives its partner's
        half tile: half of each thread's thread_m x 8 sums (SPLIT_PAIR in simt_cp_async.cu)."""
        return threads * thread_m * 8 // 2 * 4

    def extra_macros(self, p, dev, bm, bn, split=1, reserve=0):
        return ()

    can_split = False
    can_stream_k = False
    pair_split = False
    #: Least K per slice, and least M, for the largest tile to be split instead of taking a tile
    #: with 8x8 outputs per thread (the range measured: M 96 .. 256, slices 512 .. 1365).
    big_tile_min_k_per_split = 512
    big_tile_min_m = 96

    def _big_tile_split_fills(self, p: Problem, dev: DeviceFacts) -> bool:
        """Whether the largest tile, split along K, fills (90% of) a wave with slices of at least
        ``big_tile_min_k_per_split``: its 16x8 thread tiles run ~15% faster than the 8x8 ones of
        the smaller tiles (8192x4096x6144: 49.7 against 43.2 TFLOP/s, NOTES run 11), which beats
        the reduction pass when K is long (decode128: 128 x 11008 x 4096 took 128 x 64 tiles
        and ran at 0.77x cuBLAS, 1.12x so). Below M = 96 most of a 128-row tile would be
        padding: not measured, so not taken."""
        if p.M < self.big_tile_min_m:
            return False
        bm, bn = self.tile_of(self.tile_options[0])
        tiles = _tiles(p, bm, bn)
        split = split_k_for(p, dev, tiles, self.bk)
        return split > 1 and tiles * split >= 0.9 * dev.sm_count and p.K // split >= self.big_tile_min_k_per_split

    def options(self, p, dev):
        """Every tile; for a family that splits K, each with split-K allowed or not."""
        return _with_split_flags(self.tile_options) if self.can_split else self.tile_options

    def configure(self, p, dev, option=None):
        if option is not None:
            opt, may_split = tuple(option[:3]), self.can_split and bool(option[3])
        elif self.can_split and k_dominant(p):
            # splits supply the parallelism; the largest tile where it pads N no more than the
            # 128x128 one (largeK 256x256x65536 on the H200: 128x256 x 66 splits 184.4 us,
            # 128x128 x 66 186.9, NOTES run 12), else 128x128 (N = 64: a 256-wide tile would do
            # twice the FFMAs)
            big, small = self.tile_of(self.tile_options[0])[1], self.tile_of(self.tile_options[1])[1]
            opt = self.tile_options[0] if -(-p.N // big) * big <= -(-p.N // small) * small else self.tile_options[1]
            may_split = True
        else:
            opt, may_split = _pick_tile(p, dev, self.tile_options, self.tile_of), self.can_split
            if may_split and opt[2] == 8 and self._big_tile_split_fills(p, dev):
                opt = self.tile_options[0]
        wm, wn, tm = opt
        bm, bn = self.tile_of(opt)
        per_sm = 2 if wm * wn <= 4 else 1
        split = split_k_for(p, dev, _tiles(p, bm, bn), self.bk, per_sm) if may_split else 1
        a, b, c_vec = self.load_modes(p)
        # stream-K where the model has it beat split-K as well, for the 8-warp tile (one block
        # per SM; the 4-warp 128x128 one spills with the stream-K loop), except with an
        # m-contiguous A and single-float B copies along k, which spill (sm_80 .. sm_89) at 255
        # registers
        sk = None
        spills = (a, b) == (LOAD_VEC_FAST, LOAD_ELEM_K)
        if may_split and self.can_stream_k and opt == self.tile_options[0] and not spills:
            sk = stream_k_for(p, dev, _tiles(p, bm, bn), self.bk, bm, bn, per_sm, split)
            split = 1 if sk is not None else split
        if split > 1:
            c_vec = p.N % 4 == 0  # partials go to a fresh contiguous workspace
        # cluster pairs: an even split of the one-block-per-SM tile, on sm_90 (clusters); not for
        # the load modes that spill (12 bytes there, with single-float C stores)
        pair = split > 1 and split % 2 == 0 and self.pair_split and per_sm == 1 and dev.cc >= (9, 0) and not spills
        threads = wm * wn * 32
        region = self.pair_region_bytes(threads, tm) if pair else 0
        extra = self.extra_macros(p, dev, bm, bn, split, region) + ((("SPLIT_PAIR", 1),) if pair else ())
        macros = (("WARPS_M", wm), ("WARPS_N", wn), ("THREAD_M", tm), ("BK", self.bk), ("A_MODE", a),
                  ("B_MODE", b), ("C_VEC", int(c_vec))) + extra
        smem = self.smem_bytes(bm, bn, dict(extra).get("STAGES", 2)) + region
        details = (("A loads", LOAD_NAMES[a]), ("B loads", LOAD_NAMES[b]),
                   ("C stores", "float4" if c_vec else "single floats"),
                   ("math", f"fp32 FFMA, {tm}x8 outputs per thread"))
        if split > 1:
            pairs = f"added in cluster pairs (distributed shared memory) into {split // 2} partial tiles, "
            details += (("split-K", f"{split} slices of K, {pairs if pair else ''}reduced by splitk_reduce"),)
        if sk is not None:
            details += (("stream-K", f"{sk.whole_tiles} tiles whole ({sk.whole_tiles // (dev.sm_count * per_sm)} "
                                     f"waves), then {sk.blocks} blocks of {sk.iters} k-tiles each over the other "
                                     f"{sk.pieced_tiles} tiles ({sk.k_tiles} k-tiles each), completed by "
                                     "stream_k_fixup"),)
            return KernelConfig(self.name, self.source, self.entry + "_stream_k", macros + (("STREAM_K", 1),),
                                threads, (threads, 1, 1), (sk.whole_tiles + sk.blocks, 1, 1), smem,
                                (bm, bn, self.bk), details, stream_k=sk)
        return KernelConfig(self.name, self.source, self.entry, macros, threads, (threads, 1, 1),
                            _grid(_tiles(p, bm, bn), p.batch_total, split), smem, (bm, bn, self.bk), details,
                            split_pair=pair)


class SimtFloat4(_Simt):
    """Register-staged SIMT: float4 global loads where the layout allows, any arch."""

    name, source, entry = "simt_float4", "simt_float4.cu", "fastmm_simt_float4"


class SimtCpAsync(_Simt):
    """cp.async multi-stage SIMT (sm80+)."""

    name, source, entry = "simt_cp_async", "simt_cp_async.cu", "fastmm_simt_cp_async"
    min_cc = (8, 0)
    a_transpose_mode = LOAD_ELEM_K  # cp.async cannot transpose a vector
    can_split = True
    can_stream_k = True
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


class Tf32Mma(Family):
    """Tensor cores through mma.sync m16n8k8 TF32 (sm80+); also tf32x3 (3 products per step)."""

    name, source, entry = "tf32_mma", "tf32_mma.cu", "fastmm_tf32_mma"
    min_cc = (8, 0)
    precisions = ("tf32", "tf32x3")
    bk = 32
    #: Stages where they fit: 4 for tf32's blocks of 8 warps (one per SM anyway; 128x256 at
    #: 8192x4096x6144 on the H200: 208.0 TFLOP/s against 204.4 with 3, NOTES run 12), 3 for the
    #: others (3 x 35 KiB: two 128x128 blocks fit in an H100/H200 SM).
    max_stages = 4
    max_stages_small = 3

    #: tf32 with 16-byte copies of both operands and at least 2 warps keeps two fragment sets
    #: (FRAG_PIPE in tf32_mma.cu); with 4-byte copies ptxas spills (8-776 bytes), as it does for
    #: the one-warp 64x64 block on sm_80/86/89 (12-28 bytes); tf32x3 has no room.
    frag_pipe = True

    #: The tf32 tile of split-K plans (k_dominant problems; tf32x3 takes its largest): measured
    #: there (largeK, NOTES run 10).
    k_dominant_tile = (2, 2, 64)

    def reject(self, p, dev):
        reason = super().reject(p, dev)
        if reason is None and not self.tile_options(p.precision == "tf32x3", dev):
            reason = f"no tile fits {dev.smem_per_block_optin // 1024} KiB of shared memory per block"
        return reason

    def tile_options(self, x3: bool, dev: DeviceFacts | None = None):
        """(WARPS_M, WARPS_N, WARP_N), largest tile first, those whose two stages fit the device's
        shared memory in any layout. Warps are 64 x 64 for tf32 (with two fragment sets, 128 x 256
        blocks: 204-208 TFLOP/s against 189-198 for 128 x 128 at 8192x4096x6144 on the H200,
        NOTES run 12); 64 x 32 for tf32x3, which holds three accumulator sets."""
        opts = ((2, 4, 32), (2, 2, 32), (1, 2, 32)) if x3 else ((2, 4, 64), (2, 2, 64), (1, 2, 64), (1, 1, 64))
        if dev is None:
            return opts
        return tuple(o for o in opts if 2 * self.stage_bytes_max(o[0] * 64, o[1] * o[2]) <= dev.smem_per_block_optin)

    def stage_bytes(self, bm: int, bn: int, a_mk: bool, b_kn: bool) -> int:
        """One stage of the A and B tiles in tf32_mma.cu's padded layouts."""
        a_floats = bm * (self.bk + 4) if a_mk else self.bk * (bm + 8)
        b_floats = self.bk * (bn + 8) if b_kn else bn * (self.bk + 4)
        return (a_floats + b_floats) * 4

    def stage_bytes_max(self, bm: int, bn: int) -> int:
        return max(self.stage_bytes(bm, bn, a_mk, b_kn) for a_mk in (True, False) for b_kn in (True, False))

    def options(self, p, dev):
        """Every tile of p's precision that fits the device, each with split-K allowed or not."""
        return _with_split_flags(self.tile_options(p.precision == "tf32x3", dev))

    def configure(self, p, dev, option=None):
        x3 = p.precision == "tf32x3"
        options = self.tile_options(x3, dev)
        if option is not None:
            opt, may_split = tuple(option[:3]), bool(option[3])
        elif k_dominant(p):
            preferred = options[0] if x3 else self.k_dominant_tile
            # the preferred tile, or the largest that fits and is no larger
            fits = [o for o in options if o[0] * o[1] * o[2] <= preferred[0] * preferred[1] * preferred[2]]
            opt, may_split = (fits[0] if fits else options[-1]), True
        else:
            opt = _pick_tile(p, dev, options, lambda o: (o[0] * 64, o[1] * o[2]))
            may_split = True
        wm, wn, warp_n = opt
        bm, bn = wm * 64, wn * warp_n
        sAm, sAk = p.a_strides
        sBk, sBn = p.b_strides
        a_mk = sAk == 1 or sAm != 1
        b_kn = sBn == 1 or sBk != 1
        per_stage = self.stage_bytes(bm, bn, a_mk, b_kn)
        # 4 stages were measured for tf32's 8-warp block only
        most = self.max_stages if wm * wn >= 8 and not x3 else self.max_stages_small
        stages = max(2, min(most, dev.smem_per_block_optin // per_stage))
        # two blocks per SM where registers (<= 4 warps) and shared memory allow (H100/H200: yes;
        # an A100's 164 KiB hold one 128x128 block of 3 stages)
        two_fit = wm * wn <= 4 and 2 * (per_stage * stages + 1024) <= dev.smem_per_sm
        split = split_k_for(p, dev, _tiles(p, bm, bn), self.bk, 2 if two_fit else 1) if may_split else 1
        a_vec = (_vec_ok(_round4(p.K, p.a_padded), sAm, p.a_batch_strides, p.a_align) if a_mk and sAk == 1 else
                 (not a_mk) and _vec_ok(p.M, sAk, p.a_batch_strides, p.a_align))
        b_vec = (_vec_ok(_round4(p.N, p.b_padded), sBk, p.b_batch_strides, p.b_align) if b_kn and sBn == 1 else
                 (not b_kn) and _vec_ok(p.K, sBn, p.b_batch_strides, p.b_align))
        sCm, sCn = p.c_strides
        c_vec = (sCn == 1 and p.N % 2 == 0 and sCm % 2 == 0 and p.c_align >= 8
                 and all(s % 2 == 0 for s in p.c_batch_strides))
        if split > 1:
            c_vec = p.N % 2 == 0  # partials go to a fresh contiguous workspace
        frag_pipe = self.frag_pipe and not x3 and a_vec and b_vec and wm * wn >= 2
        macros = (("WARPS_M", wm), ("WARPS_N", wn), ("WARP_N", warp_n), ("STAGES", stages), ("A_SMEM_MK", int(a_mk)),
                  ("A_VEC", int(a_vec)), ("B_SMEM_KN", int(b_kn)), ("B_VEC", int(b_vec)),
                  ("C_VEC", int(c_vec)), ("PRECISION_X3", int(x3)), ("FRAG_PIPE", int(frag_pipe)))
        threads = wm * wn * 32
        details = (
            ("A in smem", "[m][k]" if a_mk else "[k][m]"), ("A loads", "16-byte cp.async" if a_vec else "4-byte cp.async"),
            ("B in smem", "[k][n]" if b_kn else "[n][k]"), ("B loads", "16-byte cp.async" if b_vec else "4-byte cp.async"),
            ("C stores", "float2" if c_vec else "single floats"),
            ("fragments", ("B^T in the mma's A role (8-byte loads), A by " + ("ldmatrix" if a_mk else "4-byte loads"))
             if b_kn else ("A by " + ("ldmatrix" if a_mk else "8-byte loads") + ", B by ldmatrix")),
            ("fragment registers", "two sets: k-step s + 1 loaded while k-step s multiplies" if frag_pipe else "one set"),
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
    #: Skinny v2 (SK_V2 = 1 in skinny.cu; benchmarks/NOTES.md "skinny v2") where it was measured
    #: faster: on the H200, 128 columns x 8 per thread beat the v1 kernel at every M (decode16
    #: 25.8 us vs 58.0, 3.1x cuBLAS; M = 1 1.6x, M = 32 2.3x, 16 x 8192^2 2.7x faster than v1;
    #: NOTES run 9). Other archs keep v1 until measured there.
    V2_BY_CC = {(9, 0): {"bn": 128, "cpt": 8}}
    #: Split-K plans of the v2 kernel with up to 8 outputs per thread sum their slices in the
    #: kernel (the last block of a column tile to finish), not in a second launch. On the H200
    #: (NOTES run 14): M = 1 21.3 us against 22.2, 16 x 8192^2 71.0 against 72.8, decode16 25.7
    #: against 25.9; M = 32 (16 outputs per thread) 42.7 against 40.9, so it keeps the second
    #: pass. False: splitk_reduce everywhere, as before.
    fuse_split = True
    #: Override for experiments and tests: None follows V2_BY_CC; "v1" forces the v1 kernel; a
    #: dict of :meth:`configure_v2` keywords (e.g. ``{"bn": 64}``) forces that v2 geometry.
    variant: dict | str | None = None

    def reject(self, p, dev):
        reason = super().reject(p, dev)
        if reason is None and p.M > self.max_m:
            reason = f"M = {p.M} > {self.max_m}: not skinny"
        return reason

    def options(self, p, dev):
        """One tile (set by M); split-K allowed or not."""
        return _with_split_flags(((),))

    #: From this compute capability the kernel is launched with programmatic dependent launch
    #: (KernelConfig.dependent_launch): back-to-back calls then overlap one's launch with the
    #: other's last blocks. On the H200, decode16 3.09 -> 3.15x torch (NOTES run 15). Only this
    #: family: its ~150 KB blocks cannot sit next to the running kernel's blocks, while with
    #: every kernel launched that way the next kernel's early blocks slowed the running GEMM on
    #: the SMs they shared (largeK GEMM 170.6 -> 174.6 us, square1000 0.92 -> 0.74x torch).
    dependent_launch_cc = (9, 0)

    def configure(self, p, dev, option=None):
        v2 = self.V2_BY_CC.get(dev.cc) if self.variant is None else self.variant
        if isinstance(v2, dict):
            cfg = self.configure_v2(p, dev, option, **v2)
        else:
            cfg = self.configure_v1(p, dev, option)
        return self.with_launch_mode(cfg, dev)

    def with_launch_mode(self, cfg, dev):
        """``cfg`` (from configure_v1 / configure_v2) launched as this family launches on ``dev``:
        as a programmatic dependent launch from :attr:`dependent_launch_cc` on."""
        if dev.cc < self.dependent_launch_cc:
            return cfg
        return replace(cfg, dependent_launch=True, details=cfg.details + (
            ("launch", "programmatic dependent launch unless FASTMM_PDL=0: scheduled while the kernel "
                       "ahead on the stream finishes"),))

    def configure_v1(self, p, dev, option=None):
        """The v1 kernel (SK_V2 = 0): one 256-thread block per SM, lanes own 4 columns each."""
        mt = 8 if p.M <= 8 else 16 if p.M <= 16 else 32
        kchunk = 128 if mt == 32 else 256
        sBk, sBn = p.b_strides
        b_vec = sBn == 1 and _vec_ok(p.N, sBk, p.b_batch_strides, p.b_align)
        tiles = max(1, -(-p.N // self.cols))
        split = 1
        if p.batch_total == 1 and (option is None or option[0]):  # one block per SM; aim for about two waves
            chunks = -(-p.K // kchunk)
            split = effective_split(chunks, max(1, min(chunks, -(-2 * dev.sm_count // tiles), MAX_SPLIT)))
        details = (("rows per thread", f"{mt} (M = {p.M})"),
                   ("B loads", "float4, each element once" if b_vec else "single floats, each element once"),
                   ("math", "fp32 FFMA; warps' partials summed in a fixed order"))
        if split > 1:
            details += (("split-K", f"{split} slices of K, reduced by splitk_reduce"),)
        return KernelConfig(self.name, self.source, self.entry, (("MT", mt), ("B_VEC", int(b_vec))), 256,
                            (256, 1, 1), _grid(tiles, p.batch_total, split), 0, (mt, self.cols, kchunk), details)

    @staticmethod
    def v2_geometry(M, *, bn=32, cpt=8, threads=256, qpt=1):
        """(mt, lanes_n, k-groups, k rows per stage) of skinny.cu v2, checked as its static_asserts
        check them; ValueError for a geometry the kernel rejects."""
        lanes_n = bn // cpt if cpt in (4, 8) and bn % cpt == 0 else 0
        if lanes_n not in (4, 8, 16, 32) or threads % 32 or not 32 <= threads <= 1024 or qpt < 1:
            raise ValueError(f"skinny v2: no geometry bn={bn} cpt={cpt} threads={threads} qpt={qpt}")
        mt = -(-M // 4) * 4  # A is read as float4 along m; MT*CPT >= 16 >= GPW, as the exchange needs
        kg = threads // lanes_n
        return mt, lanes_n, kg, 4 * kg * qpt

    def configure_v2(self, p, dev, option=None, *, pipe=None, bn=32, cpt=8, threads=256, qpt=1, stages=None,
                     split=None, minb=1, runroll=None, fuse=None):
        """Skinny v2 (SK_V2 = 1): ``bn`` columns per block, ``cpt`` (4 or 8) per thread,
        ``threads`` per block, ``qpt`` quads of k per thread per stage. ``pipe`` 1: a cp.async ring
        of ``stages`` (sm80+; default the deepest of 4..2 that fits), 0: B through registers one
        stage ahead (any arch); default 1 on sm80+. ``split``: K splits (None: a wave model over
        ``minb`` blocks per SM; option (0,) forbids splitting, as for configure). ``runroll``: k rows
        unrolled in the FMA loop (default 4; 1 where registers are tight). Where the sums and
        operands would not fit the register budget (M rounded up x cpt accumulators) or a stage
        the shared memory, qpt, then cpt, then threads are reduced (the details say so).
        ``fuse``: a split's slices summed by the kernel itself (default :attr:`fuse_split`)."""
        pipe = int(dev.cc >= (8, 0)) if pipe is None else int(pipe)
        if pipe and dev.cc < (8, 0):
            raise ValueError("skinny v2 pipe=1 needs cp.async (sm80+)")
        sAm, sAk = p.a_strides
        sBk, sBn = p.b_strides
        a_vec = sAk == 1 and _vec_ok(p.K, sAm if p.M > 1 else 0, p.a_batch_strides, p.a_align)
        b_vec = sBn == 1 and _vec_ok(p.N, sBk, p.b_batch_strides, p.b_align)
        asked = (cpt, threads, qpt)
        limit = dev.smem_per_block_optin
        while True:  # shrink the per-thread tile until registers (no spills) and shared memory fit
            mt, lanes_n, kg, ks = self.v2_geometry(max(p.M, 1), bn=bn, cpt=cpt, threads=threads, qpt=qpt)
            budget = min(255, 65536 // (threads * minb) // 8 * 8)
            # sums, operands, addresses and loads hoisted ahead: calibrated with ptxas -v on
            # sm_75..sm_90 (benchmarks/skinny_v2_ptxas.py), where these keep every kernel spill-free
            one_row = runroll == 1 or (runroll is None and budget <= 128)  # FMA loop one k row at a time
            if pipe:
                need = mt * cpt + (64 if one_row else 96)
            else:  # + the next stage's share of B (4-byte loads: and their addresses) and of A
                need = mt * cpt + 4 * qpt * cpt * (1 if b_vec else 2) + mt * ks // threads + 64
            a_pitch = mt + 4 if mt % 8 == 0 else mt  # skinny.cu AP, BNP, STAGE_FLOATS
            stage_floats = ks * (bn + (4 if lanes_n == 4 else 0)) + ks * a_pitch
            if not pipe:
                n_stages = 2  # two slots, filled from registers
            elif stages is None:  # the deepest ring that fits
                n_stages = next((s for s in (4, 3) if s * stage_floats * 4 <= limit), 2)
            else:
                n_stages = stages
            ring = n_stages * stage_floats
            red = threads // 32  # reduction slots: one per warp unless that alone needs more smem
            while red > 1 and red * mt * bn * 4 > max(ring * 4, DEFAULT_SMEM):
                red //= 2
            smem = max(ring, red * mt * bn) * 4
            if need <= budget and smem <= limit:
                break
            if qpt > 1 and (not pipe or smem > limit):
                qpt //= 2
            elif cpt == 8 and bn // 4 <= 32:
                cpt = 4
            elif threads > 256 or (smem > limit and threads > 64):
                threads //= 2
            elif smem > limit:
                raise ValueError(f"skinny v2 needs {smem} B of shared memory per block, the device allows {limit}")
            else:
                raise ValueError(f"skinny v2: M = {p.M} needs ~{need} registers per thread, {budget} available")
        stages = n_stages
        if runroll is None:  # one row at a time where registers are tight (ptxas hoists less)
            runroll = 1 if budget <= 128 or need > budget - (24 if pipe else 40) else 4
        tiles = max(1, -(-p.N // bn))
        units = max(1, -(-p.K // ks))  # (K = 0: nothing to split; the api writes zeros)
        if p.batch_total != 1 or (option is not None and not option[0]):
            s = 1
        elif split is not None:
            s = effective_split(units, max(1, min(split, units, MAX_SPLIT)))
        else:  # waves of blocks, as split_k_for, but a split may hold a single stage
            slots = dev.sm_count * minb
            s = min(range(1, min(units, MAX_SPLIT) + 1),
                    key=lambda n: (-(-tiles * n // slots) / n * (1 + SPLIT_COST * (n - 1)), n))
            s = effective_split(units, s)
        a_vec = a_vec and not pipe  # float4 A loads: the register path only (cp.async transposes A)
        macros = (("SK_V2", 1), ("MT", mt), ("B_VEC", int(b_vec)), ("A_VEC", int(a_vec)),
                  ("A_KFAST", int(sAk == 1 or sAm != 1)), ("SK_PIPE", pipe),
                  ("SK_THREADS", threads), ("SK_BN", bn), ("SK_CPT", cpt), ("SK_QPT", qpt), ("SK_STAGES", stages),
                  ("SK_RED", red), ("SK_MINB", minb), ("SK_RUNROLL", runroll))
        # (the register path, SK_PIPE 0, is at its register limit already: the extra state of
        # the fused sums spilled there; it keeps the second pass. More than 8 outputs per thread
        # (M = 32: 16) take the last block two rounds of loads: slower than the second pass)
        fused = (s > 1 and bool(pipe) and mt * bn <= 8 * threads
                 and (self.fuse_split if fuse is None else bool(fuse)))
        if fused:
            macros += (("SK_FUSED", 1),)
        details = (("rows per thread", f"{mt} (M = {p.M})"),
                   ("B loads", ("cp.async ring, %d stages of %d k" % (stages, ks) if pipe else
                                "to registers one stage (%d k) ahead, then to shared memory" % ks)
                    + (", 16-byte" if b_vec else ", 4-byte")),
                   ("math", f"fp32 FFMA, {cpt} columns x {mt} rows per thread; k-groups summed in a fixed tree"))
        if (cpt, threads, qpt) != asked:
            details += (("fitted", "cpt %d, threads %d, qpt %d (asked %d, %d, %d): the asked tile needs more "
                                   "registers or shared memory than there are" % (cpt, threads, qpt, *asked)),)
        if s > 1:
            details += (("split-K", f"{s} slices of K, " + (
                "summed in slice order by the last block of each column tile (no second launch)" if fused
                else "reduced by splitk_reduce")),)
        return KernelConfig(self.name, self.source, self.entry, macros, threads, (threads, 1, 1),
                            _grid(tiles, p.batch_total, s), smem, (mt, bn, ks), details,
                            split_fused=fused)


@dataclass(frozen=True)
class MapSpec:
    """A tensor map's geometry before there is a pointer (innermost dim first): sizes in
    elements, byte strides of dims[1:], and the box one copy moves into shared memory."""

    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]


def _tma_ready(rows_stride: int, k_stride: int, batch_strides: tuple[int, int], align: int) -> bool:
    """An operand the copy engine reads in place as a K-major tile: k contiguous, and the row
    pitch, batch strides and base pointer all 16-byte aligned (a tensor map's requirements)."""
    return (k_stride == 1 and rows_stride > 0 and rows_stride % 4 == 0 and align >= 16
            and all(s % 4 == 0 for s in batch_strides))  # (a 0 row stride, e.g. x.expand(M, K): copied)


#: tf32x3 on wgmma keeps the big products in the tensor core for PROMOTE_EVERY k-steps of 32, then
#: adds them to fp32 registers with a compensated add. The tensor core's accumulation truncates:
#: measured on the H200 (benchmarks/NOTES.md), 1 k-step gives 1.3e-7 relative error at 90 TFLOP/s
#: and 2 give 2.0e-7 at 104 TFLOP/s, at any K. cuBLAS fp32 is more accurate than 2.0e-7 only for
#: short K (1.4e-7 at K = 64), so K up to X3_SHORT_K promotes every step, longer K every 2.
X3_SHORT_K = 2048


class WgmmaTf32(Family):
    """Hopper tensor cores: wgmma m64nNk8 TF32 fed by TMA, warp-specialised (sm_90a only); also
    tf32x3 from operands split into big and small TF32 halves by the staging pass.

    TF32 wgmma reads K-major tiles from shared memory only. An MN-major A (m contiguous) is fed
    from registers instead (A_MN); a row-major B is handled by computing C^T = B^T A^T, where B^T
    is that MN-major A (the planner's swap). Only what neither covers is copied."""

    name, source, entry = "wgmma_tf32", "wgmma_tf32.cu", "fastmm_wgmma_tf32"
    min_cc = (9, 0)
    precisions = ("tf32", "tf32x3")
    bm, bk = 128, 32
    threads = 384  # producer warpgroup + two consumer warpgroups

    @staticmethod
    def tile_options(x3: bool):
        """(BN, STAGES), largest first: a 192 KiB ring either way. tf32x3 keeps three sets of
        accumulators and four tiles a slot, so 128 columns and 3 x 64 KiB."""
        return ((128, 3),) if x3 else ((256, 4), (128, 6))

    def reject(self, p, dev):
        reason = super().reject(p, dev)
        if reason is None and dev.cc != (9, 0):
            reason = f"wgmma is an sm_90a instruction (compute capability 9.0 only); device is {dev.arch}"
        return reason

    def in_place_form(self, p: Problem) -> str | None:
        """How the kernel reads both operands where they are (tf32): "kmajor" (both K-major),
        "a_regs" (A m-contiguous, fed from registers), "swap" (B n-contiguous: C^T = B^T A^T with
        B^T as the register-fed operand); None when some operand needs a copy."""
        if self.b_ready(p):
            if self.a_ready(p):
                return "kmajor"
            if self.a_mn_ready(p):
                return "a_regs"
        elif self.b_mn_ready(p) and self.a_ready(p):
            return "swap"
        return None

    @staticmethod
    def a_ready(p: Problem) -> bool:
        return _tma_ready(p.a_strides[0], p.a_strides[1], p.a_batch_strides, p.a_align)

    @staticmethod
    def b_ready(p: Problem) -> bool:
        return _tma_ready(p.b_strides[1], p.b_strides[0], p.b_batch_strides, p.b_align)

    # MN-major: the same requirements with the roles of the two strides exchanged
    @staticmethod
    def a_mn_ready(p: Problem) -> bool:
        return _tma_ready(p.a_strides[1], p.a_strides[0], p.a_batch_strides, p.a_align)

    @staticmethod
    def b_mn_ready(p: Problem) -> bool:
        return _tma_ready(p.b_strides[0], p.b_strides[1], p.b_batch_strides, p.b_align)

    def smem_bytes(self, bn: int, stages: int, x3: bool = False) -> int:
        # ring + mbarriers, plus 1 KiB so the kernel can align the ring to 1024 bytes (swizzle)
        return stages * (2 if x3 else 1) * (self.bm + bn) * self.bk * 4 + 16 * stages + 1024

    def configure(self, p, dev):
        x3 = p.precision == "tf32x3"
        bn, stages = _pick_tile(p, dev, self.tile_options(x3), lambda o: (self.bm, o[0]))
        while stages > 2 and self.smem_bytes(bn, stages, x3) > dev.smem_per_block_optin:
            stages -= 1
        a_mn = not x3 and not self.a_ready(p) and self.a_mn_ready(p)
        sCm, sCn = p.c_strides
        pairs_ok = p.c_align >= 8 and all(s % 2 == 0 for s in p.c_batch_strides)
        # float2 stores: along n (any A), or along m over the adjacent row pairs of A_MN (C^T)
        if sCn == 1 and p.N % 2 == 0 and sCm % 2 == 0 and pairs_ok:
            c_vec = 1
        elif a_mn and sCm == 1 and sCn % 2 == 0 and pairs_ok:
            c_vec = 2
        else:
            c_vec = 0
        macros = (("BN", bn), ("STAGES", stages), ("C_VEC", c_vec), ("PRECISION_X3", int(x3)), ("A_MN", int(a_mn)))
        if x3:  # see X3_SHORT_K
            macros += (("PROMOTE_EVERY", 1 if p.K <= X3_SHORT_K else 2), ("COMPENSATE", 1))
        loads = ("TMA tiles of the big and small halves (K-major, 128-byte swizzle)" if x3 else
                 "TMA tiles (128-byte swizzle), rounded to TF32 by the copy engine; "
                 + ("the kernel's A operand m-contiguous, fed to wgmma from registers (8-byte shared loads), "
                    "its B K-major" if a_mn else "both K-major"))
        details = (("A, B loads", loads),
                   ("pipeline", f"{stages} stages, 1 producer + 2 consumer warpgroups, mbarriers"),
                   ("C stores", ("single floats", "float2 along n", "float2 along m")[c_vec]),
                   ("math", f"3xTF32 wgmma m64n{bn}k8: big*big promoted to fp32 (compensated) every "
                            f"{'k-step' if p.K <= X3_SHORT_K else '2 k-steps'}, small cross terms in their own "
                            "accumulator" if x3 else f"TF32 wgmma m64n{bn}k8, fp32 accumulate"))
        return KernelConfig(self.name, self.source, self.entry, macros, self.threads, (self.threads, 1, 1),
                            _grid(_tiles(p, self.bm, bn), p.batch_total), self.smem_bytes(bn, stages, x3),
                            (self.bm, bn, self.bk), details, arch_suffix="a")

    def map_specs(self, p: Problem, cfg: KernelConfig):
        """Tensor-map geometry of A and B for launch problem ``p``: dims (K, rows, batch_inner,
        batch_outer) for a K-major operand, (rows, K, ...) with 32-row boxes for the m-contiguous
        A of A_MN; a broadcast batch dim collapsed to size 1; and the kernel's broadcast bits (bit
        set: that operand walks that batch dim)."""
        outer = max(1, p.batch_total // max(p.batch_inner, 1))
        a_mn = dict(cfg.macros).get("A_MN", 0) == 1
        bits = 0
        specs = []
        for i, (rows, pitch, (s0, s1), box_rows, mn) in enumerate((
                (p.M, p.a_strides[1] if a_mn else p.a_strides[0], p.a_batch_strides, self.bm, a_mn),
                (p.N, p.b_strides[1], p.b_batch_strides, cfg.tile[1], False))):
            extent = max((p.K if mn else rows) * pitch * 4, 16)
            inner_n, inner_s = (p.batch_inner, s1 * 4) if s1 and p.batch_inner > 1 else (1, extent)
            outer_n, outer_s = (outer, s0 * 4) if s0 and outer > 1 else (1, extent)
            bits |= (1 if inner_n > 1 else 0) << (2 * i)
            bits |= (1 if outer_n > 1 else 0) << (2 * i + 1)
            dims, box = ((rows, p.K), (32, self.bk)) if mn else ((p.K, rows), (self.bk, box_rows))
            specs.append(MapSpec(dims + (inner_n, outer_n), (pitch * 4, inner_s, outer_s), box + (1, 1)))
        return specs[0], specs[1], bits


def kmajor_source(p: Problem, which: str) -> tuple[int, int, int, int]:
    """(rows, row stride, k stride, pointer alignment) of the operand the staging pass reads:
    A as it is (rows = M), or B read as B^T (rows = N). The kernel's arguments and its macros
    both come from here."""
    if which == "a":
        return p.M, p.a_strides[0], p.a_strides[1], p.a_align
    return p.N, p.b_strides[1], p.b_strides[0], p.b_align


def kmajor_batch(p: Problem, which: str) -> tuple[int, int, int, int]:
    """(batch_inner, batch_total, s0, s1) of the matrices the staging pass copies for operand
    ``which``: the problem's batch dims that this operand has (a broadcast dim, stride 0, is
    copied once, so it has size 1 here), with the operand's strides for them."""
    s0, s1 = p.a_batch_strides if which == "a" else p.b_batch_strides
    outer = p.batch_total // p.batch_inner if p.batch_inner else 0
    n1 = p.batch_inner if s1 and p.batch_inner > 1 else 1
    n0 = outer if s0 and outer > 1 else 1
    return n1, n0 * n1, s0 if n0 > 1 else 0, s1 if n1 > 1 else 0


def stage_kmajor_config(p: Problem, which: str, split: bool) -> KernelConfig:
    """The staging pass of the wgmma family (cuda_src/stage_kmajor.cu): operand ``which`` ("a", or
    "bt" for B transposed) copied into a dense K-major buffer (one per matrix of its batch), split
    into TF32 halves for tf32x3."""
    rows, s_rows, s_k, align = kmajor_source(p, which)
    _, copies, s0, s1 = kmajor_batch(p, which)
    r_contig = s_rows == 1 and s_k != 1
    # float4 reads along the contiguous dim: the other stride, the batch strides and the pointer
    # 16-byte aligned
    vec = _vec_ok(4, s_k if r_contig else s_rows, (s0, s1), align) and (s_rows == 1 if r_contig else s_k == 1)
    tiles = -(-rows // 64) * -(-p.K // 64)
    what = "split into big and small TF32 halves" if split else "copied"
    return KernelConfig("stage_kmajor", "stage_kmajor.cu", "fastmm_stage_kmajor",
                        (("SRC_R_CONTIG", int(r_contig)), ("SRC_VEC", int(vec)), ("SPLIT", int(split))), 256,
                        (256, 1, 1), _grid(tiles, copies), 0, (64, 64, 0),
                        (("what", f"{'B^T' if which == 'bt' else 'A'} {what}, K-major, "
                                  + ("transposed through shared memory" if r_contig else "row by row")),))


#: Families in order of preference within a precision (first that accepts wins).
FAMILIES: dict[str, Family] = {f.name: f for f in (Skinny(), WgmmaTf32(), Tf32Mma(), SimtCpAsync(), SimtFloat4(),
                                                   Scalar())}
