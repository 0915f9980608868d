"""What every kernel family shares: the kernel configuration a plan carries, the family
interface the planner asks, and the small tile helpers.

Pure Python (no torch, no CUDA), so every decision can be tested on a CPU with a simulated
device. Families are frozen: a variant (a benchmark's or a test's other geometry) is a new
instance made with :func:`dataclasses.replace`, handed to the planner, never a flipped switch on
the shared registry (the plan caches could not tell the two apart).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..problem import DeviceFacts, Problem

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
    (``k_tiles`` per tile), each piece into its own workspace slot for ``stream_k_fixup``.

    With ``head_rows`` > 0 the whole waves run in a launch of their own first, the family's plain
    kernel over C's first ``head_rows`` rows (``head_tiles`` tiles, whole tile rows), and the
    stream-K launch covers only the rows after them: its ``tiles`` are those rows' tiles, and it
    takes no whole tiles (``whole_tiles`` 0). For a build whose stream-K kernel runs slower a
    k-tile than its plain one, or where one launch would count past 2^31 k-tiles
    (work_split.stream_k_for)."""

    whole_tiles: int
    blocks: int
    iters: int
    k_tiles: int
    tiles: int  # all tiles of the stream-K launch's problem (the rows after the head, if any)
    head_rows: int = 0
    head_tiles: int = 0

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
    # Tiles (times batch entries) the grid walks, where a block takes more than one (a persistent
    # kernel: wgmma_tf32); 0: one block a tile, as the grid says.
    work_items: int = 0

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
        return (f"{self.family} ({self.entry} in cuda_src/{self.source}): tile {bm}x{bn}x{bk}, "
                f"block {self.block_dims[0]}x{self.block_dims[1]}, grid {self.grid[0]}x{self.grid[1]}x{self.grid[2]}, "
                f"dynamic smem {self.smem} B")


#: A family's staging answer: (the problem as the kernel then sees it, the copies to make first as
#: (operand, rows, padded columns), whether the kernel computes C^T = B^T A^T).
Staging = tuple[Problem, tuple[tuple[str, int, int], ...], bool]

#: How a family's plans are queued (fastmm/runtime/runners.py keeps one runner per form):
#: "pointers", the GEMM takes A, B and C pointers (with split-K / stream-K second passes);
#: "tensor_maps", the GEMM reads A and B through TMA descriptors made per call.
LAUNCH_FORMS = ("pointers", "tensor_maps")


@dataclass(frozen=True)
class Family:
    """A kernel family: one source under cuda_src/, what it can serve, and how it is launched.

    The planner asks every family the same questions by name: :meth:`reject` (cannot run p),
    :meth:`heuristic_reason` (could, but should not), :meth:`configure` (the kernel),
    :meth:`staging` (copies to make first), :meth:`stagers` (the kernels that make them),
    :meth:`precision_computed` (what the kernel really computes), and :attr:`launch_form` (which
    runner queues it)."""

    name = ""
    source = ""
    entry = ""
    min_cc = (7, 0)
    precisions = ()  # (class attributes, not dataclass fields: they say what the family is)
    launch_form = "pointers"

    def reject(self, p: Problem, dev: DeviceFacts) -> str | None:
        if dev.cc < self.min_cc:
            return f"needs sm{self.min_cc[0]}{self.min_cc[1]}+, device is {dev.arch}"
        if p.precision not in self.precisions:
            return f"does not compute precision '{p.precision}'"
        return None

    def heuristic_reason(self, p: Problem, dev: DeviceFacts) -> str | None:
        """Why the family should not take ``p`` although it could (a heuristic, skipped when the
        family is forced or tuned)."""
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

    def staging(self, p: Problem, dev: DeviceFacts, option: tuple[int, ...] | None = None) -> Staging:
        """Operands to copy before the launch, and the problem the kernel then sees, for the
        family's own choice or (``option``) a tuned one. None here."""
        return p, (), False

    def relaunch_option(self, p: Problem, dev: DeviceFacts, chosen: KernelConfig) -> tuple[int, ...] | None:
        """The option under which the family configures the staged launch problem after choosing
        ``chosen`` for ``p``: None, its heuristic decides again (a choice that weighs the
        copy itself must keep the tile the copy was made for: SimtCore)."""
        return None

    def stagers(self, p: Problem, staging: tuple[tuple[str, int, int], ...]) -> tuple[KernelConfig, ...]:
        """The kernels that make the staged copies, one per entry (a family that stages must make
        its copies: the planner checks it)."""
        return ()

    def describe_staging(self, p: Problem, which: str, rows: int, cols: int) -> str:
        what = "B transposed" if which == "bt" else which.upper()
        return (f"{what} copied into a zero-padded {rows}x{cols} buffer with 16-byte aligned rows, "
                "so the kernel loads it with 16-byte copies")

    def precision_computed(self, p: Problem) -> str:
        """The precision the kernel really computes for a request of ``p.precision``: full fp32
        ("ieee") unless the family rounds to TF32."""
        return "ieee"


def as_dependent_launch(cfg: KernelConfig, dev: DeviceFacts, from_cc: tuple[int, int]) -> KernelConfig:
    """``cfg`` launched as a programmatic dependent launch where ``dev`` is ``from_cc`` or newer
    (its kernel calls grid_dependency_sync first): back-to-back calls then overlap one's launch
    with the other's last blocks."""
    if dev.cc < from_cc:
        return cfg
    return replace(cfg, dependent_launch=True, details=cfg.details + (
        ("launch", "programmatic dependent launch unless FASTMM_PDL=0: scheduled while the kernel "
                   "ahead on the stream finishes"),))


def blocks_by_smem(smem: int, dev: DeviceFacts) -> int:
    """Blocks of ``smem`` bytes of dynamic shared memory one SM of ``dev`` holds (the driver keeps
    1 KiB a block besides); 0 where a block may not have that much."""
    return dev.smem_per_sm // (smem + 1024) if smem <= dev.smem_per_block_optin else 0


def vec_ok(contig_extent: int, other_stride: int, batch_strides: tuple[int, int], align: int) -> bool:
    """16-byte vectors along a contiguous dim need: its extent, the other stride and the batch
    strides all multiples of 4 floats, and a 16-byte aligned base pointer."""
    return (contig_extent % 4 == 0 and other_stride % 4 == 0 and align >= 16
            and all(s % 4 == 0 for s in batch_strides))


def round4(n: int, padded: bool) -> int:
    """A contiguous extent as the vector check should see it: padded rows count as whole."""
    return -(-n // 4) * 4 if padded else n


def grid_of(tiles: int, batch: int, split: int = 1) -> tuple[int, int, int]:
    return (max(tiles, 1), split, max(1, min(batch, MAX_GRID_Z)))


def tiles_of(p: Problem, bm: int, bn: int) -> int:
    return -(-p.M // bm) * -(-p.N // bn)


#: A tile may pad the output by this much more than the tightest option (padded rows and columns
#: are computed like real ones).
PAD_SLACK = 1.1


def covered_area(p: Problem, tile: tuple[int, int]) -> int:
    """Outputs the tiles of ``tile`` (BM, BN) compute over ``p``'s M x N, padding included."""
    return tiles_of(p, *tile) * tile[0] * tile[1]


def fills_wave(p: Problem, dev: DeviceFacts, tile: tuple[int, int]) -> bool:
    """Whether ``p``'s blocks of ``tile`` (BM, BN), over the whole batch, fill 90% of a wave of
    one block an SM."""
    return tiles_of(p, *tile) * p.batch_total >= 0.9 * dev.sm_count


def pick_tile(p: Problem, dev: DeviceFacts, options, tile_of, pad_slack: float | None = PAD_SLACK):
    """First (largest) option whose tiles fill (90% of) a wave of blocks and cover no more than
    ``PAD_SLACK`` times the area the tightest option covers; else the smallest. Without the area
    test a 128 x 256 tile took attention's P.V (N = 64, a batch of 128): 4x the FFMAs, 360 us
    against 145 for 128 x 64 tiles on the H200 (and decode64's M = 64: 381 against 222 us;
    benchmarks/NOTES.md, the candidates probe). ``pad_slack`` None: no area test."""
    areas = [covered_area(p, tile_of(opt)) for opt in options]
    least = min(areas)
    for opt, area in zip(options, areas):
        if (pad_slack is None or area <= pad_slack * least) and fills_wave(p, dev, tile_of(opt)):
            return opt
    return options[-1]


def k_dominant(p: Problem) -> bool:
    """Long K with a small output: big tiles + split-K beat small tiles."""
    return p.batch_total == 1 and p.K >= 4 * max(p.M, p.N)


#: The last element of the option of a family that splits K: split as ``split_k_for`` (or the
#: family's own rule) says (1), or never (0). A flag, not a count, so that one tuned option fits
#: every size of its shape bucket.
SPLIT_FLAGS = (1, 0)


def with_split_flags(tile_options) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(opt) + (flag,) for opt in tile_options for flag in SPLIT_FLAGS)
