"""The GPU time of a mid-size simt_cp_async plan on sm_90: what chooses such a product's tile and
its K split together (:meth:`.simt_core.SimtCore.modelled_choice`).

Why a second model beside the wave model of :func:`.work_split.split_k_for`: that one counts whole
waves of equal blocks and charges a split 2% a slice. On mid-size products (a few hundred tiles,
K up to a few thousand) it split 128 x 128 tiles 3-7 ways where 8 x 8-output tiles unsplit ran
15-40% faster (H100, NOTES run 54, GPU us: 1500 x 2048 x 512 W^T 117.9 planned, 82.2 on 128 x 64
tiles unsplit; 450 x 3333 x 800 W^T 123.1 against 91.5). What it leaves out, as measured there:

- **An SM's blocks.** The busiest SM gets ``n = ceil(blocks / SMs)`` blocks and runs them in rounds
  of at most ``resident`` at once. A round of ``c`` blocks takes the longer of one block alone
  (``TileRate.alone``: a block of two warps cannot keep an SM busy) and ``c`` blocks sharing the
  SM (``TileRate.full``), plus a fixed cost (``TileRate.round_us``: the pipeline's fill, the
  tile's store). More blocks than SMs pay a second round on some SMs, where the wave model saw
  slots to spare.
- **A split's traffic.** Each slice is written and read back: ``SLICE_MB_PER_US`` in float4 rows,
  27 times slower in single floats (an odd width). Slices summed by their tile's last block
  (SPLIT_FUSED) cost ``FUSED_SLICE_COST`` times that (the sum runs at the end of the tile, one
  block reading every slice, where splitk_reduce spreads it over the GPU), and that build's
  blocks run longer (``TileRate.fused``: 21% on the 128 x 256 tile).
- **A transposed B** (stage_kmajor) costs its copy: read and write the weight once, from DRAM.

Fitted by least squares on log time to 18 products x 28 (tile, split) plans measured on the H100
(``benchmarks/probes/midsize_wt_rows.json``; probes/simt_split_probe.py --tiles all); on 19 other
products (``probes/midsize_wt_holdout.json``: other model dims, odd sizes, grad_x and grad_W forms)
its error was 7.6% rms (6.7% on the fitted ones), and the plans it chooses ran within 3% of the
fastest swept plan on geometric mean (the rules': 13% behind; on the fitted products 1.4% and
9%). The H200 has the same SMs at the same clock; its copy bandwidth is
higher, which this model (compute-bound products) leaves out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..problem import DeviceFacts, Problem
from .base import KernelConfig, blocks_by_smem

#: Registers a thread of the SIMT families takes, by its thread tile's rows (ptxas -v, NOTES run
#: 20: the 16 x 8 tiles at the 255 cap, the 8 x 8 ones ~168; the 4 x 8 ones 154-160 unbound, sm_90,
#: run 26), or fewer where the kernel is built for more blocks an SM (CP_MIN_BLOCKS).
SIMT_REGISTERS = {16: 255, 8: 168, 4: 160}
REGISTERS_PER_SM = 65536


def simt_resident_blocks(cfg: KernelConfig, dev: DeviceFacts) -> int:
    """Blocks of a SIMT kernel one SM holds at once: by threads, shared memory and registers."""
    threads = max(1, math.prod(cfg.block_dims))
    macros = dict(cfg.macros)
    regs = SIMT_REGISTERS.get(macros.get("THREAD_M", 8), SIMT_REGISTERS[8])
    if "CP_MIN_BLOCKS" in macros:  # (__launch_bounds__: ptxas keeps to this many blocks' registers)
        regs = min(regs, REGISTERS_PER_SM // (threads * macros["CP_MIN_BLOCKS"]))
    by_smem = max(1, blocks_by_smem(cfg.smem, dev)) if cfg.smem else 32
    return max(1, min(2048 // threads, by_smem, REGISTERS_PER_SM // (threads * regs), 32))


@dataclass(frozen=True)
class TileRate:
    """One SIMT tile's pace on an sm_90 SM: MFLOP per us of a block alone and of an SM full of
    its blocks, the fixed us of each round of blocks, and how much longer its blocks take where
    they sum their tile's slices themselves (SPLIT_FUSED: the sum's code and registers)."""

    alone: float
    full: float
    round_us: float
    fused: float


#: By (BM, BN). Fitted (see the module's docstring). The 8 x 8-output tiles: a 4-warp 128 x 64
#: block alone already runs at the SM's pace, a 2-warp 64 x 64 one at 60% of it. The 8-warp
#: 128 x 256 block's fused split costs it most (a 255-register thread, 16 x 8 sums to add).
TILE_RATES = {
    (128, 256): TileRate(0.385, 0.400, 10.4, 1.21),
    (128, 128): TileRate(0.348, 0.352, 11.9, 1.03),
    (128, 64): TileRate(0.390, 0.317, 6.5, 1.00),
    (64, 64): TileRate(0.185, 0.297, 6.9, 0.99),
    (64, 256): TileRate(0.327, 0.370, 12.3, 1.11),
    (64, 128): TileRate(0.175, 0.308, 12.1, 1.07),
}
#: MB per us at which split slices are written and read back (L2-resident) in float4 rows, and in
#: single floats (C's width not a multiple of 4: the workspace rows are then written a float at
#: a time, SimtCore.configure's c_vec): 27x slower, the one cost that set the odd-width products
#: apart (733 x 1999 x 517 W^T: every split plan 20-40% behind the unsplit one, NOTES run 54).
SLICE_MB_PER_US = 106.0
SINGLE_FLOAT_SLICE_MB_PER_US = 3.85
#: Slices summed by the tile's last block cost this many times their traffic (see above).
FUSED_SLICE_COST = 3.87
#: A stage_kmajor copy of B moves its bytes at this share of the device's DRAM bandwidth (the
#: copy's measured share on the H100 and H200, cost.copy_bandwidth; not fitted here).
COPY_SHARE_OF_DRAM = 0.87
#: Each plan's fixed us (a launch's ramp and drain), and each extra launch's.
BASE_US = 3.1
EXTRA_LAUNCH_US = 0.04
#: The products it was fitted on and is used for (:meth:`.simt_core.SimtCore.modelled_choice`):
#: at least MIN_SIDE rows and columns, K from MIN_K to MAX_K, fewer 128 x 128 tiles than
#: MAX_TILES_PER_SM x SMs (beyond that the tiles fill the GPU and the rules' plans stand), at
#: least one 64 x 64 tile an SM (below that the split alone fills the GPU, with 2-warp blocks
#: too few to keep an SM busy, which the model's rates do not see: 300 x 700 x 1100 W^T ran 16%
#: slower on its choice than on the rules', 700^3 2%; the rules' splits there were swept on the
#: H200, NOTES run 33), an A
#: contiguous along K (x, not grad_W's x^T: the rules for an m-contiguous A were measured on their
#: own, and of the two such products held out the model's choice lost 7% on one).
MIN_SIDE = 256
MIN_K = 256
MAX_K = 2560
MAX_TILES_PER_SM = 2
#: Its choice replaces the rules' tile where it is modelled faster by this share (5% kept the
#: rules' 128 x 64 tile unsplit on 1024^3 W^T, 68.6 us, where the 128 x 256 tile in cluster pairs
#: ran 61.0: NOTES run 54).
MARGIN = 0.02


def in_domain(p: Problem, dev: DeviceFacts) -> bool:
    """Whether ``p`` on ``dev`` is a product the model was fitted for (see MIN_SIDE)."""
    return (dev.cc == (9, 0) and p.batch_total == 1 and min(p.M, p.N) >= MIN_SIDE and MIN_K <= p.K <= MAX_K
            and p.a_strides[1] == 1 and p.a_strides[0] != 1
            and -(-p.M // 128) * -(-p.N // 128) < MAX_TILES_PER_SM * dev.sm_count
            and -(-p.M // 64) * -(-p.N // 64) >= dev.sm_count)


def plan_us(cfg: KernelConfig, p: Problem, dev: DeviceFacts, staged_floats: int = 0) -> float | None:
    """Modelled GPU us of ``cfg`` (a simt_cp_async plan of ``p``, one launch plus its second pass)
    with ``staged_floats`` of B copied first; None for a tile the model has no rate for or a
    stream-K plan."""
    tile = TILE_RATES.get(tuple(cfg.tile[:2]))
    if tile is None or cfg.stream_k is not None:
        return None
    bm, bn, bk = cfg.tile
    split = cfg.split_k
    blocks = cfg.grid[0] * cfg.grid[1] * cfg.grid[2]
    per_sm = -(-blocks // dev.sm_count)
    resident = simt_resident_blocks(cfg, dev)
    k_slice = -(-p.K // split)  # (a slice's K, padded to whole k-tiles: what each block runs)
    mflop = 2.0 * bm * bn * (-(-k_slice // bk) * bk) / 1e6

    def round_us(c: int) -> float:
        return max(mflop / tile.alone, c * mflop / tile.full) + tile.round_us

    rounds, rest = divmod(per_sm, resident)
    us = rounds * round_us(resident) + (round_us(rest) if rest else 0.0)
    us = BASE_US + us * (tile.fused if cfg.split_fused else 1.0)
    if split > 1:
        rate = SLICE_MB_PER_US if p.N % 4 == 0 else SINGLE_FLOAT_SLICE_MB_PER_US
        traffic = 2 * 4 * p.M * p.N * cfg.split_slices / 1e6 / rate
        us += traffic * FUSED_SLICE_COST if cfg.split_fused else traffic + EXTRA_LAUNCH_US
    if staged_floats:  # (TB/s = MB/us)
        us += 8 * staged_floats / 1e6 / (COPY_SHARE_OF_DRAM * dev.dram_tbps) + EXTRA_LAUNCH_US
    return us
