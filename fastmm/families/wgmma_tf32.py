"""The Hopper family (cuda_src/wgmma_tf32.cu, sm_90a): TF32 wgmma fed by TMA, warp-specialised;
also tf32x3 from operands split into big and small TF32 halves by the staging pass
(:mod:`.stage_kmajor`), or on 64-row tiles A by the staging pass and B by the kernel itself, or on
narrow, tall products B by the staging pass and A in registers by the kernel.
Everything the planner and the runner ask of it lives here: what it
reads in place, which operand it copies first (and when that costs too much), the tensor maps."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..problem import EPILOGUE_BIAS_M, EPILOGUE_BIAS_N, EPILOGUE_D, H200_DRAM_TBPS, DeviceFacts, Problem, transposed
from .base import Family, KernelConfig, pick_tile, tiles_of
from .stage_kmajor import kmajor_batch, stage_kmajor_config


#: Where the wgmma family does not split K (:meth:`WgmmaTf32.split_choice` finds no split that
#: pays), each block walks all of K. tf32x3: tf32_mma, slower per SM but with K split over every
#: SM, is faster when wgmma's 128 x 128 tiles fill less than this share of the SMs (H200: tf32x3
#: 24-28 vs 115 TFLOP/s).
WGMMA_MIN_SM_FRACTION = {"tf32x3": 1 / 4}
#: tf32, a product of fewer 128 x 64 tiles than SMs: wgmma takes about WGMMA_SOLO_US_PER_K us per
#: k of one tile; tf32_mma splitting K over the SMs about MMA_SPLIT_US plus MMA_SPLIT_US_PER_K us
#: per k of each 128 x 64 tile's share of an SM. Fitted to `probes/small_tf32_probe.py` (NOTES run
#: 23): wgmma 1.9-2.8x faster at K <= 2053 (300 x 700 x 1100: 14.5 against 27.0 us), tf32_mma
#: 1.2-2.4x at 32 tiles and K = 4096 and at 5 tiles and K = 8192, even at 64 tiles and K = 4096.
WGMMA_SOLO_US_PER_K = 0.0064
MMA_SPLIT_US = 12.0
MMA_SPLIT_US_PER_K = 0.0128
#: wgmma takes a problem whose operands it must copy first when the product does at least this
#: many FLOP per byte the copies move (see heuristic_reason).
#: (tf32 was 128 until run 23: 77 x 1531 x 2053, whose A and B^T need copies (K % 4 != 0), makes
#: 18 FLOP per copied byte and ran 28.1 us on wgmma with its copies, 70.6 on tf32_mma.)
WGMMA_COPY_MIN_FLOP_PER_BYTE = {"tf32": 16, "tf32x3": 20}
#: tf32 with A m-contiguous (fed from registers, A_MN) and B row-major (copied K-major first):
#: attention's dV = P^T @ dO. Up to this N, tf32_mma reading both in place is faster (H100,
#: `probes/candidates.py --shapes probes/dv_rows.json` and narrow_rows.json, NOTES run 56: wgmma
#: took 10-32% longer on eight of nine such products, 384 x (512 x 64 x 512) 220.7 -> 185.7 us,
#: 64 x (1024 x 128 x 1024) 158.3 -> 133.5; 8 x (4096 x 128 x 4096) 219.6 against 220.8, a tie).
A_MN_COPIED_B_MAX_N = 128
#: tf32x3's bound is where wgmma plus its copies ties the fp32 SIMT plan (attn_pv_2k, 20.1 FLOP per
#: copied byte: 1.070 against 1.065 x torch on the H200, RESULTS run 35). The copies are
#: memory-bound and the two kernels' rates are the same on every Hopper part, so the tie moves
#: with the DRAM bandwidth: the bound is the H200's scaled by its bandwidth over the device's (an
#: H100's 3.35 TB/s: 29; there attn_pv_2k ran 0.836 on wgmma against 1.063 on SIMT, NOTES run 46).
#: tf32's is not scaled: its alternative, tf32_mma, runs 2-4x slower, far from a tie.


def copy_min_flop_per_byte(precision: str, dev: DeviceFacts) -> float:
    """FLOP per copied byte a product must do for wgmma to take it with staging copies on ``dev``."""
    need = WGMMA_COPY_MIN_FLOP_PER_BYTE[precision]
    return need / dev.dram_over(H200_DRAM_TBPS) if precision == "tf32x3" else need


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
#: short K: 1.4e-7 at K = 64, 2.9e-7 at 256, 5.7e-7 at 1024 (M = N = 1024, randn; RESULTS run 3's
#: accuracy table), so K up to X3_SHORT_K promotes every step, longer K every 2: either way below
#: cuBLAS fp32 at every K. (2048 until NOTES run 48, where every k-step cost ~15% of the speed at
#: K = 288-2048 for an error cuBLAS fp32 is already 1.4-2.9x above.)
X3_SHORT_K = 256


#: The grid's x limit (the kernel walks any tiles beyond it).
MAX_GRID_X = 2**31 - 1
#: Sustained rate of a 128 x BN tile's main loop, per precision, relative to the widest tile's.
#: Narrower tiles move more bytes per FLOP (each k-step loads 128 rows of A and BN of B), and
#: the H200's SMs together pull ~12 TB/s from L2 (measured: the 64-wide tile at 12.1, the 96-wide at
#: 11.5, against 9.2 for the 256-wide one at 2.98 TFLOP/s an SM). tf32: the rates that picked the
#: fastest width (or one within 1%) on 22 of 25 products in `probes/wgmma_waves_probe.py` (NOTES run
#: 23); tf32x3 (three wgmmas a k-step: compute-bound): fitted there.
#: 160 (taken only by the staged turns: STAGED_TURNS_160) against 192, both taking turns with C
#: staged, H100 (NOTES run 62): 0.95-0.97 of 192's rate at K >= 1024, 0.91 at K = 512.
BN_RATE = {"tf32": {256: 1.0, 192: 0.97, 160: 0.94, 128: 0.92, 96: 0.86, 64: 0.76},
           "tf32x3": {128: 1.0, 96: 0.96, 64: 0.915}}
#: us a tile costs beyond its main loop (its stores, the mbarrier hand-offs), per column of width.
TILE_US_PER_COLUMN = 1.5 / 256
#: TF32 wgmma's sustained FLOP per us on one SM at the widest tile (H200: ~3.0 TFLOP/s an SM at
#: BN = 256; tf32x3, three wgmmas a product, 0.72 at BN = 128).
SM_RATE = {"tf32": 3.0e6, "tf32x3": 0.72e6}
#: Persistent blocks (one an SM, each walking every 132nd tile) beat one block a tile by refilling
#: the ring during the epilogue: 1.04-1.16x on products of 4-60 waves of tiles (up to 1.18x where K
#: is 64-128 and fill and epilogue weigh most). But a static walk cannot even out SMs that run
#: slower than others, which the hardware's block scheduler does: over 48 waves of K = 768
#: (gpt2's lm_head, 4096 x 50257) persistent ran 0.92x. So: persistent up to this many waves, or
#: where K is at most PERSISTENT_ANY_WAVES_K.
PERSISTENT_MAX_WAVES = 16
PERSISTENT_ANY_WAVES_K = 256


#: The 256-wide tile stores C through the copy engine only up to this K: its staging boxes cost
#: the ring a slot (4 -> 3), which lost 2-5% at K = 4096 (4096 x 1024 x 4096: 87.4 -> 92.1 us) and
#: gained nothing at K = 1024, against 1.12-1.20x at K = 64-128 (attention's Q @ K^T), where the
#: epilogue weighs most (NOTES run 23).
TMA_STORE_256_MAX_K = 1024

#: From this K up (to TMA_STORE_256_MAX_K) the 256-wide tile stages 2 boxes of C at a time, not 4:
#: they fit beside the ring's 4 slots (4 boxes took one: 4 -> 3), and where the main loop weighs
#: most a slot is worth more than fewer rounds of boxes. H200, K = 1024 (NOTES run 29): 8192 x 1024
#: x 1024 x @ W^T 54.6 -> 52.2 us, 8192 x 4096 x 1024 195.7 -> 191.9 (K of 512-1023 not measured).
#: Below it (attention's Q @ K^T, K = 64-128, where the stores weigh most) 4 boxes, as in run 23.
TMA_STORE_256_TWO_BOXES_MIN_K = 512


#: Short K (SHORT_K_NARROW_MIN_K < K <= SHORT_K_NARROW_MAX_K: 3-4 k-steps of 32 a tile), both
#: operands K-major as the kernel reads them (measured in place; a staged copy is read the same
#: way) and C stored by the copy engine: tiles at most 128 wide. The wave
#: model has the 256-wide tile ahead there (C's stores weigh most and are the same bytes at every
#: width), but on the H200 the 128-wide tile ran 2-16% faster on all eight products measured (NOTES
#: run 36, `probes/wgmma_waves_probe.py`, GPU us, planned 256 -> 128): attention's Q @ K^T at head
#: dims 96-128 (32 x 2048^2 x 128 205.4 -> 178.7, 64 x 1024^2 x 128 108.7 -> 98.1, 16 x 4096^2 x 128
#: 389.9 -> 351.0, 8 x 3072^2 x 128 116.8 -> 101.3, 8 x 2048^2 x 128 54.8 -> 50.2, 32 x 2048^2 x 96
#: 177.2 -> 173.7) and x @ W^T at K = 128 (8192 x 8192 112.7 -> 94.8, 16384 x 4096 102.5 -> 90.0); the 192-wide tile was as slow as the 256 one. Not where B is row-major (C^T
#: computed, stored from registers: 32 x 2048^2 x 128 192.2 at 256 wide, 215.8 at 128; 8192^2 x 128
#: 99.8 / 112.4), nor at K = 64 (within 2% either way) or K = 256 (256 wide ahead).
SHORT_K_NARROW_MIN_K = 64
SHORT_K_NARROW_MAX_K = 128
SHORT_K_NARROW_MAX_BN = 128


#: Tiles of 64 rows (BM = 64 in the kernel: one consumer warpgroup) for a tf32 product of at most
#: ROWS64_MAX_M rows with a K-major A, in the cooperative form: the 128-row tile runs half its
#: wgmmas on rows past M there. Decode's x @ W.t() at M = 16-64 streams W once; measured on the
#: H200 (`probes/wgmma_rows_probe.py`, NOTES run 37, GPU us, the 128-row plan -> 64 rows, 128
#: wide): 64 x 14336 x 4096 77.1 (256 wide, 2 slices) -> 62.7 unsplit (3.75 TB/s of W; torch 63.9),
#: 48 x 4096 x 11008 67.8 -> 55.0-55.9 (4 slices; torch 61.1), 24 x 16384 x 2048 55.1 (kmajor_mma)
#: -> 38.3 (torch 41.2), 128 x 64 x 512 x 64 B^T 12.0 -> 9.5-9.7 (torch 10.5).
ROWS64_MAX_M = 64
#: The 64-row tile splits K only where its 128-wide tiles fill fewer than SMs / ROWS64_SPLIT_FILL
#: blocks: into SMs // tiles slices (2 at least, at most ROWS64_MAX_SLICES and K /
#: ROWS64_SLICE_K); where those (tile, slice) blocks still fill under SMs / ROWS64_SPLIT_FILL, on
#: 64-wide tiles if they make more blocks; and only where the blocks fill SMs / ROWS64_MIN_FILL at
#: least (else tf32_mma's split over every SM, as for the 128-row tile's SPLIT_MIN_FILL). One SM pulls W at
#: ~75-85 GB/s, so about half the SMs reach the memory's rate; more slices add workspace traffic.
#: H200 (NOTES run 37, GPU us, 1 / 2 / 3 / 4 / 8 / 16 slices): 48 x 4096 x 11008 (32 tiles) 72.4 /
#: 55.5 / 57.3 / **55.0** / 62.6 / 74.6; 32 x 3584 x 18944 (28) 131.4 / 81.4 / 77.5 / **76.6** / 81.5 /
#: 89.2; 24 x 4096 x 4096 32.3 / 27.8 / 26.6 / **26.2** / 32.4 (kmajor_mma 30.7); 64 x 1024 x 4096 (8)
#: 24.7 / 22.2 / 18.6 / **17.4** / 18.2 (tf32_mma 20.9); 64 x 14336 x 4096 (112 tiles) unsplit 62.7,
#: 2 slices 76.0; 64 x 512 x 8192 128 wide in 4 slices (16 blocks) 23.0, 64 wide in 4 slices (32
#: blocks, the plan) 18.4, tf32_mma 20.8.
#: 128 wide was the fastest of 128 and 256 at every split (256 wide: 66.8-109 unsplit); where even
#: 4 slices leave SMs idle, more tiles beat more slices: 64 x 1024 x 4096 in 64-wide tiles and 4
#: slices (64 blocks) 13.0, 128 wide in 8 slices (64 blocks) 18.2.
ROWS64_SPLIT_WIDTHS = (128, 64)
ROWS64_SPLIT_FILL = 2
ROWS64_MAX_SLICES = 4
ROWS64_SLICE_K = 512
ROWS64_MIN_FILL = 5
#: tf32x3 on 64-row tiles (X3_SPLIT_B, :meth:`WgmmaTf32.x3_splits_b`) from ROWS64_X3_MIN_M rows and
#: N >= ROWS64_X3_MIN_N. H200 (NOTES run 37, GPU us, x3 on 64-row tiles / the fp32 SIMT plan / torch
#: fp32): 64 x 14336 x 4096 W^T 164.7 / 213.7 / 197.0, 48 x 4096 x 11008 124.7 / 155.2 / 146.5; but
#: 64 x 1024 x 4096 36.4 / 24.9 / 25.4, and at 17-32 rows the 32-row SIMT tile stays ahead (32 x
#: 4096 x 14336 163.9 / 143.4, 24 x 4096 x 4096 57.1 / 47.9, before the split of B overlapped the
#: wgmmas: ~7% off). (The 128-row tiles with both operands' halves staged: 2-3x slower than either.)
#: N = 2048 was not measured: from 4096, where it won.
ROWS64_X3_MIN_M = 33
ROWS64_X3_MIN_N = 4096
#: tf32x3 on 128-row tiles splits A into its halves in registers (X3_A_REGS) where the copy engine
#: reads A in place, X3_A_REGS_MIN_N <= N <= X3_A_REGS_MAX_N, K >= X3_A_REGS_MIN_K, A has at
#: least X3_A_REGS_MIN_ROWS_PER_COLUMN times N rows (so A's halves are most of the staging), and
#: there are at least X3_A_REGS_MIN_TILES 128 x 128 tiles. Staging A writes and reads back 12
#: bytes an element besides the kernel's 4, for 2N FLOP an element: at N = 64-128 (attention's
#: P @ V and dS @ K, A the L x S scores) that is most of the call; the fragment loads and splits
#: ahead of each step's wgmmas cost per FLOP.
#: H100, `probes/x3_a_regs_probe.py` (NOTES run 48, GPU us, staged / A in registers / the fp32
#: SIMT plan the copy bound chose / torch fp32): 128 x 1024 x 64 x 1024 1007 / 341 / 404 / 419,
#: 32 x 2048 x 128 x 2048 1001 / 500 / 771 / 822, 128 x 512 x 64 x 512 281 / 103 / - / 113;
#: staged / in registers: 8192 x 256 x 1024 W^T 92.9 / 68.4, x 384 116.7 / 109.2, x 512 138.5 /
#: 128.0, 4096 x 768 x 4096 316.6 / 339.8 (0.93x), and run 42's N = 1024-11008 0.80-0.93x.
#: Not where few tiles leave the loads on every block's critical path (2048 x 256 x 4096, 32
#: tiles: 121.7 / 137.2) or where B is as large as A (1024 x 128 x 128 x 64 B^T, attention's
#: q @ k^T at L = 128: 157.8 / 108.9 against 87.8 on SIMT). N stops at 256: the gain at 384-512
#: (7-8% on the H100) is the pass's bytes, ~1.47x cheaper at the H200's bandwidth.
X3_A_REGS_MAX_N = 256
#: ... and from N = 64 and K = 512, the smallest measured (below: products of a few us, or whose
#: 64-wide tile is mostly padding, where the fp32 SIMT plan's single launch was not timed against it)
X3_A_REGS_MIN_N = 64
X3_A_REGS_MIN_K = 512
X3_A_REGS_MIN_ROWS_PER_COLUMN = 4
X3_A_REGS_MIN_TILES = 64  # (half of an H100's or H200's 132 SMs)
#: Mid-size tf32 products (more than ROWS64_MAX_M rows, a batch of 1) whose 128-row tiles fill
#: under one wave of SMs even at their narrowest width (64): 64-row tiles there, where they load
#: no more per SM than the 128-row plan (:func:`mid_rows64_width`). A block of a few tiles an SM is
#: not compute-bound: its time follows the operand bytes it loads a k-step, BM + BN, and the waves
#: (H200, one wave, 300 x 700 x 1100 W^T: 64 x 64 10.3 us, 64 x 128 14.2, 128 x 64 14.3, 128 x
#: 128 18.7). Measured (`probes/wgmma_rows_probe.py`, NOTES run 40, GPU us, the 128-row plan ->
#: 64 rows; torch tf32): 300 x 700 x 1100 14.3 -> 10.3 (torch 10.3), 384 x 768 x 768 8.9 -> 7.1
#: (7.5), 512 x 512 x 2048 16.5 -> 13.0 (10.4), 128 x 4096 x 4096 35.7 -> 26.6 (24.7), 1000^3
#: 13.9 -> 12.9 (64 x 128; 14.5), 96 x 3072 x 768 8.9 -> 7.5 (8.6), 77 x 1531 x 2053 36.5 (fp32
#: SIMT) -> 23.3 (23.7), 200 x 1024 x 1024 10.5 -> 8.3 (9.8), 128 x 4096 x 11008 63.4 -> 62.2
#: (68.4); 700 x 2304 x 768 (216 tiles of 128 x 64) stays on 128-row tiles: 13.6 against 13.7.
ROWS64_MID_WIDTHS = (128, 64)
#: ... and K split on them (ROWS64_SPLIT_*'s rule) only from this K on: at 2048-2053 every split
#: was slower than one block a tile (512 x 512 x 2048 13.0 unsplit, 14.5-16.6 split; 77 x 1531 x
#: 2053 23.3, 26.6-31.1), from 3072 it paid where the 64-wide tiles fill under half the SMs (197 x
#: 768 x 3072 17.6 -> 16.4 at 128 wide in 4 slices, 256 x 1024 x 4096 22.5 -> 18.3), and where
#: they fill more it did not (128 x 4096 x 4096: 26.6 unsplit, 29.6-43.1 split).
ROWS64_MID_SPLIT_MIN_K = 3072
#: ... and only below this K: at K = 4096 64-row tiles unsplit beat the 128-row split (128 x 4096
#: x 4096 26.6 against 35.7 us), at 11008 they tied (62.2 against 63.4), and the longer K the more
#: a 64-row block loads per SM than a split's blocks do: over few tiles and a long K the 128-row
#: split or tf32_mma's deeper one (over every SM; 256 x 256 x 65536 59.4 us against 94.1 for
#: wgmma's split, NOTES run 25) stay.
ROWS64_MID_MAX_K = 8192
#: ... and, where the last 64-row tile is partial (M % 64 != 0), only while B fits in this share
#: of L2: every row of tiles reads all of B, and a partial row's blocks drift off the full rows'
#: pace, so B is fetched from memory once for each row instead of once from L2 (H200, B = 64 MiB,
#: W^T at 4096 x 4096, 64-row tiles against the 128-row split: M = 65 45.1 against 31.0 us, 80
#: 37.4 / 31.2, 96 33.7 / 32.5, where M = 128 and 192 (full rows) ran 26.5 / 35.4 and 29.4 /
#: 52.3; with B of 2-16 MiB partial rows ran 1.1-1.8x faster: 145 x 2560 x 1536, 197 x 768 x 3072).
ROWS64_MID_PARTIAL_L2_SHARE = 0.5
#: A fed from registers (A_MN) on 64-row tiles (``rows64_a_mn``, a_mn_step: each k-step's fragments
#: loaded during the step before) where the kernel writes C along m: a row-major B into a
#: row-major C is launched so, as C^T (each Linear's grad_x g @ W). Measured (H100,
#: `probes/wgmma_rows_probe.py --a-mn`, NOTES run 42, GPU us, the 128-row plan -> 64 rows unsplit;
#: torch tf32): 1024 x 768 x 3072 32.0 -> 25.6 (25.0), 1500 x 384 x 1536 17.8 -> 14.6 (16.4), 1024 x
#: 1024 x 2816 30.0 -> 24.5 (30.4), 1024^3 13.8 -> 11.6 (14.8), 512 x 1024 x 4096 41.3 -> 28.1
#: (29.1), 197 x 3072 x 768 12.2 -> 11.1 (11.7), 511 x 1536 x 8960 86.2 -> 65.6 (59.6), 300 x 1100 x
#: 700 10.8 -> 10.8: at the same tile count too (the 128-row A_MN tile waits for each step's wgmmas
#: before loading the next fragments), so the mid-size rule's width, without its bound on K (at
#: K = 8960 no split beat the 64-row tile unsplit).
#: Not where the kernel writes C along n (an m-contiguous A read in place into a row-major C):
#: 1000 x 700 x 1100 ran 19.0 on 64 x 128 against 17.8 on 128 x 64, the one such product measured.
#: (The launch's strides decide, not the operands' story: a transposed ``out`` turns either case
#: into the other, and the kernel then runs exactly the measured form of the other.)
#: ``rows64_a_mn_split`` (ROWS64_A_MN_SPLIT): A_MN's 64-row tiles split by the K-major A's rule
#: (_rows64_split), and where they split the 128-row plans that split before are left behind
#: (where they do not, those stay: unmeasured against 64 rows unsplit). Off until the split's
#: workspace ran along C's contiguous dim (split_workspace; before, an A_MN split stored single
#: floats with C^T's odd row stride and ran 1.3-3.3x slower than unsplit, NOTES run 42-43). With
#: it (H100, NOTES run 44, the planner before -> with the split; torch tf32): 197 x 768 x 3072
#: 22.5 (tf32_mma 128 x 128 in 6) -> 17.5 (64 x 128 in 4; 15.5), 700 x 300 x 6000 41.1 (128 x
#: 128 in 5) -> 33.1 (64 x 128 in 4; 36.7), 4096 x 48 x 8192 90.0 (128 x 256 in 8) -> 62.4 (64 x
#: 128 in 4; 60.5); ncu, 511 x 1536 x 8960 in 2 slices: L2 write sectors 1.20M -> 0.44M, 123.9 ->
#: 114.9 us (unsplit 111.1: the rule leaves it unsplit).
ROWS64_A_MN_SPLIT = True
#: A bound on the launch's M + N (the lines of K both operands stream) above which A_MN's 64-row
#: tiles above ROWS64_MAX_M rows stayed unsplit until NOTES run 46 (2048; now only the variant
#: ``rows64_a_mn_split_max_lines``, for probes). Its reason, measured on the H100 (NOTES run 44:
#: unsplit / in 2 slices, 64 x 4096 x 4096 29.9 / 32.1, 48 x 4096 x 11008 68.4 / 68.9): with 4000+
#: lines a product streams its operands at memory speed unsplit. It was wrong on the H200 (NOTES
#: run 45: 28.9 -> 25.8 and 68.9 -> 52.7 in 2 slices; torch 28.4, 53.2), and on the H100 for most
#: of what it held (NOTES run 46, `wgmma_rows_probe.py --a-mn-lines`, GPU us, the bound / without
#: it; torch tf32): g @ W 48 x 2816 x 8192 58.6 (tf32_mma) -> 40.0 (42.8), 65 x 2048 x 4096 44.7
#: (tf32_mma) -> 22.0 (19.8), 32 x 2048 x 11008 50.0 (skinny) -> 39.6 (40.7), 48 x 3584 x 14336 88.8
#: (tf32_mma) -> 75.1 (78.5), 48 x 2048 x 8192 36.9 (tf32_mma) -> 32.4, 48 x 3072 x 2816 19.9 -> 17.8,
#: 24 x 4096 x 8192 56.3 (skinny) -> 52.8; 48 x 4096 x 11008 68.2 -> 68.4; the one loss 64 x 4096 x
#: 4096 29.6 -> 31.8 (the H200's 1.12x gain).
ROWS64_A_MN_SPLIT_OLD_MAX_LINES = 2048
#: A_MN's 64-row tiles above ROWS64_MAX_M rows split only below this K (measured paying at K =
#: 3072-6000 there, and at 8192-14336 with at most ROWS64_MAX_M rows, which this bound leaves
#: alone): over few tiles and a far longer K (256 x 256 x 65536: 16 tiles, 4 slices at most, 64
#: blocks of 16384 k) the 128-row plan (there tf32_mma's deep split over every SM) stays
#: (ROWS64_MID_MAX_K's note).
ROWS64_A_MN_SPLIT_MAX_K = 16384
#: A_MN's 64-row tiles above ROWS64_MAX_M rows split from this K on (no split is planned below
#: SPLIT_MIN_K, 2048, anyway), not from ROWS64_MID_SPLIT_MIN_K as a K-major A's do: A fed from
#: registers walks its chain of k-steps slower (~0.22 us a step), so a split of few tiles pays at
#: shorter K. Below ROWS64_MID_SPLIT_MIN_K only where the split is on 64-wide tiles (the 128-wide
#: tiles in slices would leave half the SMs idle: at most ~32 tiles of 64 x 64); where the 128-wide
#: split would be taken, the 64 x 64 tile unsplit ran faster. H100 (NOTES run 45, GPU us, the plan
#: before -> the 64 x 64 tile in 4 slices; torch tf32): g @ W (A_MN as C^T) 384 x 256 x 2816 tf32_mma
#: 23.3 -> 13.3 (11.6), 128 x 320 x 2048 21.3 -> 11.5 (8.8), 768 x 96 x 2816 28.8 -> 14.3 (11.1),
#: 66 x 768 x 2048 unsplit 15.5 -> 12.4 (10.3), 320 x 320 x 2304 16.8 -> 12.2 (11.5), 1000 x 96 x
#: 2304 16.9 -> 13.6 (11.1); g.t() @ x (A staged) 256 x 384 x 2816 tf32_mma 23.2 -> 17.0 (11.9),
#: 128 x 512 x 2304 22.8 -> 15.3, 197 x 300 x 2816 39.7 -> 18.4, 65 x 256 x 2048 34.5 -> 15.0. The
#: 128-wide splits, not taken: 192 x 700 x 2304 unsplit 17.1 against 20.1 in 4 slices, 197 x 1000 x
#: 2048 (g.t() @ x) 19.1 / 23.0, 300 x 768 x 2816 19.9 / 20.5 in 3, 512 x 512 x 2048 15.6 / 15.8.
#: The other guard, 64 x 64 tiles filling half the SMs, stays for A_MN: dropping it too was
#: measured mixed (511 x 768 x 11008 g @ W tf32_mma 66.1 -> 53.5 in 2, but 300 x 1024 x 4096 27.1 ->
#: 27.9, and g.t() @ x 512 x 768 x 11008, A staged, 61.5 -> 69.8).
ROWS64_A_MN_SPLIT_MIN_K = 2048
#: tf32x3 on 64-row tiles: how explain words its loads.
X3_SPLIT_B_LOADS = ("A: TMA tiles of its staged big and small TF32 halves; B: fp32 TMA tiles (of B where the copy "
                    "engine reads it, else of its fp32 K-major copy), split into big and small TF32 halves in shared "
                    "memory by the consumer threads")
#: The 64-row tile's ring: as many slots as this many bytes hold (tile_options' rings are 192-200
#: KiB), at most MAX_STAGES.
RING_MAX_BYTES = 200 * 1024
MAX_STAGES = 8


def wave_cost(p: Problem, dev: DeviceFacts, bn: int, pingpong: bool = False, bm: int = 128) -> float:
    """us the busiest SM needs for ``p``'s tiles of width ``bn``: tiles are dealt to the SMs in
    whole waves, so 288 tiles of 128 x 256 on 132 SMs take 3 tile times where 384 of 128 x 192 take
    3 of a 25% shorter one (4096 x 2304 x 768: gpt2's qkv). Padding columns cost like real ones.
    ``pingpong``: the consumers take turns (PINGPONG), so every tile's epilogue but the last runs
    under the other consumer's main loop; its main loops run at the same rate as the cooperative
    form's at a width (H200: 128 wide 74.8 / 71.9 us, 192 wide 76.5 / 74.2, NOTES run 24)."""
    tiles = tiles_of(p, bm, bn) * p.batch_total
    per_sm = -(-tiles // max(dev.sm_count, 1))
    k = -(-max(p.K, 1) // 32) * 32
    rate = SM_RATE[p.precision] * BN_RATE[p.precision][bn]
    return per_sm * 2.0 * bm * bn * k / rate + (1 if pingpong else per_sm) * TILE_US_PER_COLUMN * bn


#: SPLIT (the kernel's K over gridDim.y blocks a tile, each tile's last block summing the
#: slices). The rule takes it for tf32, a batch of 1, M <= SPLIT_MAX_M (decode's x @ W.t(): one row
#: of tiles, streaming W; above it see SPLIT_TALL_*) and K >= SPLIT_MIN_K: of the widths SPLIT_WIDTHS whose tiles fill at most
#: SMs / SPLIT_TILE_SHARE (and whose blocks fill at least SMs / SPLIT_MIN_FILL), the one whose (tile, slice) blocks fill the most SMs (ties: the one
#: computing fewer columns past N, then the wider),
#: each with as many slices as fill the SMs once (SMs // tiles), 2 at least, at most SPLIT_MAX and
#: K / SPLIT_SLICE_K. Measured on the H200 (probes/wgmma_split_probe.py, NOTES run 25, GPU us,
#: unsplit -> the rule's split): 48 x 4096 x 11008 115.6 -> 63.1 (256 wide, 8 slices), 32 x 3584 x
#: 18944 192 -> 81.6 (256/8; kmajor_mma 116.5), 32 x 4096 x 14336 152 -> 73.0 (256/8; kmajor_mma
#: 99), 64 x 4096 x 4096 47.3 -> 30.7 (128/4; 256/4 36.7: half the SMs), 64 x 14336 x 4096 82.5 ->
#: 75.3 (256/2). Slices under 1024 of K lost (64 x 4096 x 4096 at 256/8: 39.6). (Run 25 had every
#: split slower than the unsplit 64-wide tile at M = 96-128 with the first form of the sum, and
#: mixed against tf32_mma's split at M = 100-256 with few, narrow tiles: 100 x 300 x 8192 19.1
#: against 23.0, 256 x 256 x 65536 94.1 against 59.4; run 26's measurements above 64 rows set
#: SPLIT_TALL_*, whose fill bound leaves those two to tf32_mma.)
SPLIT_MAX = 16
SPLIT_MAX_M = 64
SPLIT_MIN_K = 2048
SPLIT_SLICE_K = 1024
SPLIT_TILE_SHARE = 2
SPLIT_WIDTHS = (256, 128)
#: ... and only where its (tile, slice) blocks fill at least SMs / SPLIT_MIN_FILL (every measured
#: decode split filled 112-128 of 132): a product of one or two narrow tiles over a very long K
#: gets at most SPLIT_MAX blocks here, where tf32_mma splits it over every SM.
SPLIT_MIN_FILL = 2
#: Above SPLIT_MAX_M rows the rule splits only the 128-wide tile, only where N >= 128 and N >= M in
#: the kernel's terms (the products measured; a row-major B's product of a few rows, computed as
#: C^T = B^T A^T, is tall and narrow there: decode, which stays the skinny family's; the first GPU
#: run of this rule failed a test on exactly that), and where its tiles fill at most
#: SMs / SPLIT_TALL_TILE_SHARE (the same slices and fill bound): measured on the H200
#: (probes/wgmma_split_probe.py, NOTES run 26, GPU us, unsplit at the wave rule's width -> split):
#: 80 x 4096 x 4096 39.8 -> 31.6 (128/4), 200 x 2048 x 16384 112.3 -> 66.0 (128/4), 96 x 4096 x
#: 4096 33.7 -> 32.5; where 48-128 tiles of 128 x 128 already run (512 x 4096 x 4096, 333 x 4096 x
#: 4096, 1024 x 1024 x 2816, 511 x 1536 x 8960, 1024 x 768 x 3072, 768 x 2304 x 4096) every split
#: was slower, by 8-60%.
SPLIT_TALL_WIDTH = 128
SPLIT_TALL_TILE_SHARE = 4
#: A launch's grid.y limit (one block row per slice).
MAX_GRID_Y = 65535
#: A forced number of slices (``WgmmaTf32(split=n)``) is capped so a slice keeps this much of K.
SPLIT_FORCED_SLICE_K = 512


#: From this many rows on, the planner tries wgmma ahead of the decode families (kmajor_mma,
#: skinny_kmajor, skinny; all take at most 32 rows) for a tf32 product (:func:`wgmma_ahead`) with
#: N of at least AHEAD_MIN_N (a narrow W is the decode families' to stream) that it splits with K
#: >= SPLIT_AHEAD_MIN_K, or that it reads in place on 64-row tiles, one matrix, with N >=
#: AHEAD_ROWS64_MIN_N and K >= AHEAD_ROWS64_MIN_K (the products measured; kmajor_mma kept 24 x 1024
#: x 4096, 11.7 against 14.2 us, and batches and N = 2048 were not measured).
#: Measured (H200, GPU us, wgmma against kmajor_mma): 24 x 16384 x 2048 38.3 against 55.1 on
#: 64-row tiles (NOTES run 37); with 128-row tiles split, 32 x 3584 x 18944 104 against 116 and 32
#: x 4096 x 14336 85 against 98 (run 25), but slower at 16 rows and K = 4096 (34.0 against 24.0).
AHEAD_FROM_M = 17
AHEAD_MIN_N = 2048
AHEAD_ROWS64_MIN_N = 4096
AHEAD_ROWS64_MIN_K = 2048
SPLIT_AHEAD_MIN_K = 8192


def wgmma_ahead(p: Problem, dev: DeviceFacts, fam: "WgmmaTf32 | None" = None) -> bool:
    """Whether the planner tries the wgmma family ``fam`` (default: the registry's) first for a
    tf32 request ``p`` on ``dev`` (see AHEAD_FROM_M), on the problem the kernel would see; wgmma's
    own checks (e.g. the cost of copies) may still decline it."""
    if p.precision != "tf32" or p.M < AHEAD_FROM_M or p.N < AHEAD_MIN_N or dev.cc != (9, 0):
        return False
    fam = fam or WgmmaTf32()
    launch_p, staged, swap = fam.staging(p, dev)
    if (not staged and not swap and p.batch_total == 1 and p.N >= AHEAD_ROWS64_MIN_N and p.K >= AHEAD_ROWS64_MIN_K
            and fam.tile_rows(launch_p, False, fam.reads_a_mn(launch_p), dev) == 64):
        return True
    return p.K >= SPLIT_AHEAD_MIN_K and fam.split_choice(launch_p, dev, fam.tile_options(False)) is not None


def mid_rows64_width(p: Problem, dev: DeviceFacts, a_mn: bool = False) -> int | None:
    """The width of 64-row tiles for a mid-size tf32 product (ROWS64_MID_WIDTHS), or None where
    128-row tiles serve it: they fill a wave of SMs at width 64, K is long, B outgrows L2 under a
    partial row of tiles, or no 64-row width fits in one wave. A block of so few tiles an SM loads
    (waves) x (BM + BN) floats a k-step: the 128-row plan's least is one wave of 128 x 64 (192),
    so 64-row tiles go as wide as keeps them to one wave, 64 (128 a k-step) where that fits,
    else 128 (192, a tie that goes to 64 rows: 1000^3 ran 12.9 us on 64 x 128 against 13.8 on 128
    x 64); beyond one wave they would load more than the 128-row plan. ``a_mn``: an A fed from
    registers, which has no bound on K (a bound on its split instead: ROWS64_A_MN_SPLIT_MAX_K)."""
    if p.batch_total != 1 or p.M <= ROWS64_MAX_M or (not a_mn and p.K >= ROWS64_MID_MAX_K) \
            or tiles_of(p, 128, 64) >= dev.sm_count:
        return None
    if p.M % 64 and 4 * p.N * p.K > ROWS64_MID_PARTIAL_L2_SHARE * dev.l2_bytes:
        return None
    return next((bn for bn in sorted(ROWS64_MID_WIDTHS) if tiles_of(p, 64, bn) <= dev.sm_count), None)


def slice_k_tiles(p: Problem, split: int) -> int:
    """k-tiles of 32 a slice takes when K is split ``split`` ways (``split_range`` in common.cuh:
    equal runs, the last one shorter)."""
    return -(-(-(-max(p.K, 1) // 32)) // split)


def split_slices(p: Problem, split: int) -> int:
    """The slices ``split`` becomes under ``split_range``: as many runs of :func:`slice_k_tiles` as
    K has, so none is empty."""
    return -(-(-(-max(p.K, 1) // 32)) // slice_k_tiles(p, split))


def _batch_dims(p: Problem, strides: tuple[int, int], extent: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """A tensor map's two batch dims for an operand of ``p`` with batch ``strides`` (s0, s1):
    sizes (batch_inner, batch_outer) and byte strides, a dim the operand does not walk (stride 0,
    or size 1) collapsed to size 1 with ``extent`` (the matrix's bytes) as its stride."""
    s0, s1 = strides
    outer = max(1, p.batch_total // max(p.batch_inner, 1))
    inner_n, inner_s = (p.batch_inner, s1 * 4) if s1 and p.batch_inner > 1 else (1, extent)
    outer_n, outer_s = (outer, s0 * 4) if s0 and outer > 1 else (1, extent)
    return (inner_n, outer_n), (inner_s, outer_s)


#: The kernel's EPILOGUE_VECTOR for an epilogue whose D is one vector (a bias): added to the
#: accumulators as they are stored or staged, with a value or two a thread loaded ahead, instead
#: of a sweep over C after the store (a D of any strides). 8192 x 1024 x 1024 x @ W^T + bias on the
#: H200: NOTES run 28.
EPILOGUE_VECTOR = {EPILOGUE_BIAS_N: 1, EPILOGUE_BIAS_M: 2}


#: PINGPONG holds a whole 128 x BN tile in each consumer warpgroup's registers (BN a thread).
PINGPONG_MAX_BN = 192


#: PINGPONG only where K is at least this: a tile's main loop must outlast the other consumer's
#: epilogue (128 x BN outputs stored from registers). H200 (`probes/wgmma_waves_probe.py --pingpong`,
#: NOTES run 24): 1.04-1.08x at K = 768-1024 (4728 x 3072 x 768 74.9 -> 70.9 us, 4096 x 3072 x 1024
#: 77.7 -> 74.2), even at 48 waves (gpt2's lm_head 1604 -> 1531, where persistent blocks sharing
#: tiles lost); 0.95x at K = 512 with the 192-wide tile, 0.78-0.83x at K = 64-128 (attention's
#: Q @ K^T: 128 x 512 x 512 x 64 50.1 -> 61.0 us), where the stores outlast the main loops.
PINGPONG_MIN_K = 512

#: PINGPONG with C stored from registers only on parts of at least this DRAM bandwidth (TB/s,
#: ``DeviceFacts.dram_tbps``; a part whose bandwidth is not known counts as below); below it, C
#: of a plan taking turns goes through the copy engine. On an H100 80GB HBM3 (3.35 TB/s; NOTES
#: run 59, `probes/wgmma_waves_probe.py --pingpong`, 20 x @ W^T products at K >= 512) every plan
#: taking turns with C from registers ran behind the same product with both consumers on each
#: tile and C written by the copy engine: 4728 x 3072 x 768 84.6 against 76.1-77.1 us, 8192 x
#: 2816 x 1024 171.8 against 148.3-150.8, 1000 x 18944 x 3584 401.1 against 348.6-350.8, gpt2's
#: 50257-wide head 1861 against 1235 (4-50%), where on the H200 (4.92 TB/s) taking turns won by
#: 4-8% (run 24). The two are the same GH100 chip at the same clocks; the memory is what differs,
#: so the rule is keyed on it. Taking turns with C through the copy engine instead (each consumer
#: its own staging region) ran 2-14% ahead of sharing tiles on the H100, 192 wide (4728 x 3072 x
#: 768 69.3 against 77.4 us, torch 68.0; 4096 x 3072 x 1024 72.1 against 76.0; 1000 x 18944 x
#: 3584 332.8 against 341.1; run 59 measured it ahead of taking turns from registers at every
#: width, run 62 at 192 wide alike where C allows a tensor map), so below this bandwidth plans
#: take turns that way, and where C allows no tensor map they share tiles (from registers, turns
#: lost 1.5x there: gpt2's head; NOTES runs 59 and 62). Parts between (H100 NVL 3.9, GH200 4.0)
#: were not measured: they get the H100's form.
PINGPONG_MIN_DRAM_TBPS = 4.5

#: Taking turns with C staged, the 160-wide tile instead of the 192-wide one where its whole waves
#: fill the SMs enough better: at K >= STAGED_TURNS_160_MIN_K, where :func:`wave_cost` puts it
#: under STAGED_TURNS_160_GAIN of 192's. H100 (NOTES run 62, `probes/wgmma_waves_probe.py
#: --pingpong`, 12 x @ W^T products): 3152 x 4096 x 1024 (192 wide: 550 tiles, 5 waves for 4.17)
#: 91.4 -> 80.4 us (torch 82.7), 8192 x 2816 x 1024 139.9 -> 135.4; where 160's waves fill no
#: better it ran 2-13% behind (4728 x 3072 x 768 74.1 against 70.4, 1000 x 18944 x 3584 378.9
#: against 340.4), and at K = 512 behind even with waves 5% fuller (4096 x 11008 x 512 154.0
#: against 148.4). Not offered elsewhere (tile_options): measured only taking turns, staged; and
#: not with a fused bias yet (built without spills, its GPU test not run: NOTES run 62).
STAGED_TURNS_160 = (160, 5)
STAGED_TURNS_160_MIN_K = 1024
STAGED_TURNS_160_GAIN = 0.98


def pingpong_memory_ok(dev: DeviceFacts) -> bool:
    """Whether ``dev``'s memory is what taking turns with C stored from registers was measured
    faster on (PINGPONG_MIN_DRAM_TBPS)."""
    return dev.dram_tbps >= PINGPONG_MIN_DRAM_TBPS


def pingpong_pays(p: Problem, dev: DeviceFacts, work: int) -> bool:
    """Whether ``work`` tiles of ``p`` may run with the consumers taking turns (PINGPONG): each
    block needs two tiles at least for one's epilogue to hide under the other's main loop, and a
    main loop long enough to hide it (PINGPONG_MIN_K). The blocks are persistent whatever the
    number of waves (unlike the cooperative form's, see PERSISTENT_MAX_WAVES: measured faster).
    How C leaves decides the rest (:meth:`WgmmaTf32.configure`, PINGPONG_MIN_DRAM_TBPS)."""
    return work >= 2 * dev.sm_count and p.K >= PINGPONG_MIN_K


def persistent_pays(p: Problem, dev: DeviceFacts, work: int) -> bool:
    """Whether ``work`` tiles of ``p`` run persistent (see PERSISTENT_MAX_WAVES)."""
    return work <= PERSISTENT_MAX_WAVES * dev.sm_count or p.K <= PERSISTENT_ANY_WAVES_K


@dataclass(frozen=True)
class WgmmaTf32(Family):
    """Hopper tensor cores: wgmma m64nNk8 TF32 fed by TMA, warp-specialised (sm_90a only); also
    tf32x3 from operands split into big and small TF32 halves by the staging pass (B by the
    kernel on 64-row tiles: :meth:`x3_splits_b`; A in registers on narrow, tall products:
    :meth:`x3_splits_a`).

    TF32 wgmma reads K-major tiles from shared memory only. An MN-major A (m contiguous) is fed
    from registers instead (A_MN); a row-major B is handled by computing C^T = B^T A^T, where B^T
    is that MN-major A (the planner's swap). Only what neither covers is copied."""

    #: How the tile width is chosen: "waves" (the default: the width whose whole waves of tiles
    #: take least time, :func:`wave_cost`), or "fill" (run 18's rule, for benchmarks: the widest
    #: tile that fills 90% of the SMs, 128 wide where N <= 128).
    tile_rule: str = "waves"
    #: One block an SM walking its share of the tiles (the ring is refilled during each epilogue)
    #: where that pays (:func:`persistent_pays`); False: one block a tile always (a variant for
    #: benchmarks), "always": persistent whatever the size (ditto).
    persistent: bool | str = True
    #: A tile width to take whatever the rule says (0: the rule's): for probes.
    force_bn: int = 0
    #: (BN, STAGES) options beside :meth:`tile_options`' (the kernel also builds BN = 160, tf32
    #: only): for probes, e.g. ``WgmmaTf32(extra_widths=((160, 5),), force_bn=160)``.
    extra_widths: tuple = ()
    #: C stored through shared memory by the copy engine where C allows a tensor map
    #: (:meth:`c_tma_ready`), so the stores drain under the next tile's main loop. False: from
    #: registers (a variant for benchmarks).
    tma_store: bool = True
    #: C that the copy engine cannot take but whose rows are contiguous (an odd width, a pitch or
    #: base not 16-byte aligned: stores from registers would be single floats) staged the same way
    #: and written by the consumer threads, a warp 32 adjacent floats of a row at a time
    #: (C_COPY_OUT). False: single floats from registers (a variant for benchmarks).
    c_copy_out: bool = True
    #: 32-column boxes of C staged at once (0: the rule in :meth:`configure`): for probes.
    c_boxes: int = 0
    #: The two consumer warpgroups take turns on whole tiles (PINGPONG in the kernel: one's main
    #: loop runs while the other stores its tile) where the kernel allows it (tf32, a K-major A, no
    #: fused epilogue but a bias, BN <= 192), C's store form allows it (``pingpong_tma_store``:
    #: by default from registers on the H200's memory, through the copy engine below it), each
    #: block has two tiles at least (:func:`pingpong_pays`), and
    #: :func:`wave_cost` says taking turns beats sharing tiles (the forced width of ``force_bn``:
    #: wherever the first two hold); False: never (the cooperative form, both warpgroups on each
    #: tile), "always": wherever the kernel allows it.
    pingpong: bool | str = True
    #: Where the consumers take turns, how C leaves: None (the default) by the part's memory
    #: (PINGPONG_MIN_DRAM_TBPS): from registers on the H200's, through the copy engine below it (a
    #: staging region each consumer warpgroup, 2 boxes at a time, 192 wide or 160 where its waves
    #: fill better: STAGED_TURNS_160), where C allows no tensor map no turns there; True: through
    #: the copy engine on any part (where C allows no tensor map, or ``tma_store`` is off, no
    #: turns, unless ``pingpong="always"``); False: from registers on any part. (True and False
    #: are variants for probes and tests.)
    pingpong_tma_store: bool | None = None
    #: K split over blocks (SPLIT in the kernel: each tile's last block sums the slices) where
    #: the rule of SPLIT_MAX_M says (tf32 decode-like products whose tiles leave most SMs idle);
    #: False: never; a number: that many slices wherever a batch-1 product may split, tf32x3 too
    #: (for probes and tests). (tf32x3 on 128-row tiles is left unsplit by the rule: its copies of
    #: both operands weigh most on exactly the long-K products a split is for, where the planner
    #: sends it to the fp32 SIMT path, measured 1.9x faster at 256 x 256 x 65536 in issue 18; on
    #: 64-row tiles, B split by the kernel, the 64-row rule splits it as it does tf32.)
    split: bool | int = True
    #: 64-row tiles where the rule of ROWS64_MAX_M says; False: 128 rows always, "always": 64 rows
    #: wherever the kernel allows them (tf32 with either A form, the cooperative form): for probes.
    rows64: bool | str = True
    #: The same rule for an m-contiguous A fed from registers (A_MN) where the kernel writes C
    #: along m (a row-major B into a row-major C, as C^T), on
    #: the 64-row tile that loads each k-step's fragments during the step before (a_mn_step in the
    #: kernel), without the K bound, and not where the 128-row tile would split and the 64-row one
    #: would not (:meth:`a_mn_rows64`). False: A_MN takes 128-row tiles (a variant for probes).
    rows64_a_mn: bool = True
    #: A_MN's 64-row tiles split by the 64-row rule, as K-major ones are (ROWS64_SPLIT_*, the
    #: mid-size rule's fill guard; from ROWS64_A_MN_SPLIT_MIN_K, below ROWS64_MID_SPLIT_MIN_K on
    #: 64-wide tiles only), below ROWS64_A_MN_SPLIT_MAX_K, and taken where the 128-row tile's rule
    #: would split too if they split (those products move from 128-row splits to 64-row ones;
    #: ROWS64_A_MN_SPLIT has the numbers). False: unsplit above ROWS64_MAX_M rows, and every
    #: 128-row plan that splits kept (a variant for probes).
    rows64_a_mn_split: bool = ROWS64_A_MN_SPLIT
    #: The K from which A_MN's 64-row tiles above ROWS64_MAX_M rows split (ROWS64_A_MN_SPLIT_MIN_K;
    #: ROWS64_MID_SPLIT_MIN_K: the rule before NOTES run 45, a variant for probes).
    rows64_a_mn_split_min_k: int = ROWS64_A_MN_SPLIT_MIN_K
    #: The most M + N lines over which A_MN's 64-row tiles above ROWS64_MAX_M rows split; None: no
    #: bound (the rule since NOTES run 46); ROWS64_A_MN_SPLIT_OLD_MAX_LINES: the rule before, a
    #: variant for probes.
    rows64_a_mn_split_max_lines: int | None = None
    #: tf32x3: k-steps between promotions of the big products (PROMOTE_EVERY); None: X3_SHORT_K's
    #: rule (for probes: the accuracy and speed of each)
    promote_every: int | None = None
    #: tf32x3 on 128-row tiles with A read in fp32 and split into its TF32 halves in registers by
    #: the kernel (X3_A_REGS: :meth:`x3_splits_a`), so A is not staged. None: the rule
    #: (X3_A_REGS_MAX_N: narrow products whose A the copy engine reads in place); True / False:
    #: wherever the kernel allows it / never (variants for probes).
    x3_a_regs: bool | None = None

    name, source, entry = "wgmma_tf32", "wgmma_tf32.cu", "fastmm_wgmma_tf32"
    min_cc = (9, 0)
    precisions = ("tf32", "tf32x3")
    launch_form = "tensor_maps"
    bk = 32  # a k-step: one 128-byte box row (the tile rows: tile_rows)

    @staticmethod
    def tile_options(x3: bool):
        """(BN, STAGES), widest first. tf32: a ring of 192-200 KiB whatever the width. tf32x3
        keeps three sets of accumulators (BN <= 128) and four tiles a slot."""
        return ((128, 3), (96, 4), (64, 4)) if x3 else ((256, 4), (192, 5), (128, 6), (96, 7), (64, 8))

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

    def smem_bytes(self, bn: int, stages: int, x3: bool = False, c_boxes: int = 0, bm: int = 128,
                   a_regs: bool = False) -> int:
        # ring + C's staging boxes (TMA_STORE) + mbarriers, plus 1 KiB so the kernel can align the
        # ring to 1024 bytes (swizzle); a slot holds A and B, both in halves for tf32x3 but A
        # under X3_A_REGS (``a_regs``: A in fp32)
        a_parts = 1 if a_regs or not x3 else 2
        return (stages * (a_parts * bm + (2 if x3 else 1) * bn) * self.bk * 4 + c_boxes * bm * 32 * 4
                + 16 * stages + 1024)

    @staticmethod
    def threads_for(bm: int) -> int:
        """A block's threads: the producer warpgroup and one consumer warpgroup a 64 rows."""
        return 128 * (1 + bm // 64)

    @staticmethod
    def writes_c_along_m(p: Problem) -> bool:
        """Whether launch problem ``p``'s C is m-contiguous (a row-major C launched as C^T): where
        A_MN's adjacent row pairs go out along m."""
        return p.c_strides[0] == 1 and p.c_strides[1] != 1

    def reads_a_mn(self, p: Problem) -> bool:
        """tf32 feeds an m-contiguous A from registers (A_MN) where it cannot read it K-major."""
        return p.precision == "tf32" and not self.a_ready(p) and self.a_mn_ready(p)

    def tile_rows(self, p: Problem, x3: bool, a_mn: bool, dev: DeviceFacts) -> int:
        """The tile's rows for ``p`` on ``dev``: 64 where ROWS64_MAX_M's rule, the mid-size rule
        (:func:`mid_rows64_width`) or ``rows64="always"`` says and the kernel allows it (tf32, the
        consumers sharing tiles: an A read K-major, or an A_MN one where :meth:`a_mn_rows64` or
        ``rows64="always"`` says; tf32x3 where it splits B itself), else 128."""
        if x3:
            return 64 if self.x3_splits_b(p) else 128
        if self.rows64 is False or (a_mn and self.rows64 is True and not self.a_mn_rows64(p, dev)):
            return 128
        if self.rows64 == "always" or p.M <= ROWS64_MAX_M:
            return 64
        return 64 if mid_rows64_width(p, dev, a_mn) is not None else 128

    def a_mn_rows64(self, p: Problem, dev: DeviceFacts) -> bool:
        """Whether the rules of 64-row tiles apply to an A fed from registers (A_MN): under
        ``rows64_a_mn``, where the kernel writes C along m (a row-major B into a row-major C is
        launched so, as C^T: each Linear's grad_x), except where the 128-row tile would be split and
        the 64-row one would not (under ``rows64_a_mn_split``; without it, wherever the 128-row
        tile would be split): those 128-row splits stay, unmeasured against 64 rows
        (ROWS64_A_MN_SPLIT)."""
        if not (self.rows64_a_mn and self.writes_c_along_m(p)):
            return False
        options = self.tile_options(False)
        return (self.split_choice(p, dev, options, bm=128) is None
                or (self.rows64_a_mn_split and self.split_choice(p, dev, options, bm=64) is not None))

    def x3_splits_b(self, p: Problem) -> bool:
        """tf32x3 on 64-row tiles, B read as fp32 and split into its TF32 halves by the kernel
        (X3_SPLIT_B): ROWS64_X3_MIN_M to ROWS64_MAX_M rows and N >= ROWS64_X3_MIN_N (or
        ``rows64="always"``). A is staged in its halves; B is read in place where the copy engine
        can (else copied K-major in fp32 first, not split). For decode's x @ W.t() this reads W
        once, where staging W wrote both halves and read them back."""
        return p.precision == "tf32x3" and (self.rows64 == "always" or (
            self.rows64 is not False and ROWS64_X3_MIN_M <= p.M <= ROWS64_MAX_M and p.N >= ROWS64_X3_MIN_N))

    def x3_splits_a(self, p: Problem) -> bool:
        """tf32x3 on 128-row tiles with A split into its halves in registers (X3_A_REGS): by
        default where the copy engine reads A in place and the product is narrow and tall enough
        (X3_A_REGS_MAX_N and the bounds beside it); under ``x3_a_regs=True`` wherever the kernel
        allows it, A read as fp32 in place where the copy engine can (else copied K-major in fp32
        first, not split). Not with a D of any strides nor a forced split: their 128-wide builds
        spill beside the fragments (a bias does not)."""
        # (the rule on a launch problem: A read in place there, not a copy made for it)
        wanted = self.x3_a_regs if self.x3_a_regs is not None else (
            X3_A_REGS_MIN_N <= p.N <= X3_A_REGS_MAX_N and p.K >= X3_A_REGS_MIN_K
            and p.M >= X3_A_REGS_MIN_ROWS_PER_COLUMN * p.N
            and tiles_of(p, 128, 128) * p.batch_total >= X3_A_REGS_MIN_TILES and self.a_ready(p) and not p.a_padded)
        return (p.precision == "tf32x3" and wanted and not self.x3_splits_b(p) and p.epilogue != EPILOGUE_D
                and (self.split is True or self.split is False or int(self.split) <= 1))

    def splits_staged(self, p: Problem, which: str) -> bool:
        """Whether the staging copy of operand ``which`` of ``p`` makes tf32x3's two halves (not
        an fp32 copy of B or A where the kernel splits that operand itself)."""
        return p.precision == "tf32x3" and not (which == "bt" and self.x3_splits_b(p)) and not (
            which == "a" and self.x3_splits_a(p))

    @staticmethod
    def c_tma_ready(p: Problem) -> bool:
        """C can be written by the copy engine: n contiguous, and the row pitch, batch strides and
        base pointer 16-byte aligned (a tensor map's requirements)."""
        sCm, sCn = p.c_strides
        # every batch dim walked: a dim collapsed to size 1 (stride 0) would drop the other entries' stores
        sizes, _ = _batch_dims(p, p.c_batch_strides, 16)
        walked = sizes == (max(p.batch_inner, 1), max(1, p.batch_total // max(p.batch_inner, 1)))
        return (sCn == 1 and sCm > 0 and sCm % 4 == 0 and p.c_align >= 16 and walked
                and all(s % 4 == 0 for s in p.c_batch_strides))

    def configure(self, p, dev):
        x3 = p.precision == "tf32x3"
        options = self.tile_options(x3)
        if self.extra_widths and not x3:
            options = tuple(sorted(options + tuple(self.extra_widths), reverse=True))
        a_mn = self.reads_a_mn(p)
        bm = self.tile_rows(p, x3, a_mn, dev)
        mid_width = (mid_rows64_width(p, dev, a_mn) if bm == 64 and not x3 and p.M > ROWS64_MAX_M  # (the mid-size rule)
                     and self.rows64 is True and not self.force_bn else None)
        vector = EPILOGUE_VECTOR.get(p.epilogue, 0)  # a bias: applied as C is stored, PINGPONG allowed
        may_pingpong = bool(self.pingpong) and not x3 and not a_mn and bm == 128 and (not p.epilogue or vector)
        # taking turns, C through the copy engine (see pingpong_tma_store, PINGPONG_MIN_DRAM_TBPS)
        registers_fast = pingpong_memory_ok(dev)
        staged_turns = ((self.pingpong_tma_store is True or (self.pingpong_tma_store is None and not registers_fast))
                        and self.tma_store and self.c_tma_ready(p))
        turns_store_ok = (staged_turns or self.pingpong_tma_store is False
                          or (self.pingpong_tma_store is None and registers_fast))

        def takes_turns(width: int) -> bool:  # PINGPONG allowed (and paying, unless "always") at this width
            return may_pingpong and width <= PINGPONG_MAX_BN and (self.pingpong == "always" or (
                turns_store_ok and pingpong_pays(p, dev, tiles_of(p, bm, width) * p.batch_total)))

        split = self.split_choice(p, dev, options, bm)
        if split is not None:
            (bn, stages), slices = split
            return self._split_config(p, dev, bn, stages, slices, x3, a_mn, bm)
        narrow_turns = False  # (the staged turns' 160-wide tile taken: STAGED_TURNS_160)
        # (see SHORT_K_NARROW_MIN_K; the copy engine stores C at every width there)
        short_k = (not x3 and not a_mn and self.tma_store and self.c_tma_ready(p)
                   and SHORT_K_NARROW_MIN_K < p.K <= SHORT_K_NARROW_MAX_K)
        short_k = short_k and self.tile_rule == "waves" and not self.force_bn
        if short_k:
            options = tuple(o for o in options if o[0] <= SHORT_K_NARROW_MAX_BN)
        if self.force_bn:
            bn, stages = next(o for o in options if o[0] == self.force_bn)
            pingpong = takes_turns(bn)
        elif mid_width is not None:  # (the mid-size rule's width: see ROWS64_MID_WIDTHS)
            bn, stages = next(o for o in options if o[0] == mid_width)
            pingpong = False
        elif self.tile_rule == "fill":
            if p.N <= 128:
                options = tuple(o for o in options if o[0] == 128)
            options = tuple(o for o in options if o[0] in (256, 128))
            bn, stages = pick_tile(p, dev, options, lambda o: (bm, o[0]), pad_slack=None)
            pingpong = takes_turns(bn)
        else:
            bn, stages = min(options, key=lambda o: wave_cost(p, dev, o[0], bm=bm))  # (ties: the wider)
            turns = [o for o in options if takes_turns(o[0])]
            pingpong = False
            if turns:  # the fastest width taking turns, where it beats the fastest sharing tiles
                # (C through the copy engine: the widest, 192, ran ahead of 128 on all 10 products
                # measured, by 1-30%, NOTES run 59; from registers, the wave model's width)
                pp = max(turns) if staged_turns else min(turns, key=lambda o: wave_cost(p, dev, o[0], pingpong=True))
                turns_cost = wave_cost(p, dev, pp[0], pingpong=True)
                if self.pingpong == "always" or turns_cost < wave_cost(p, dev, bn, bm=bm):
                    (bn, stages), pingpong = pp, True
                    if (staged_turns and self.pingpong is True and bn == 192 and p.K >= STAGED_TURNS_160_MIN_K
                            and not p.epilogue and takes_turns(160)
                            and wave_cost(p, dev, 160, pingpong=True) < STAGED_TURNS_160_GAIN * turns_cost):
                        bn, stages = STAGED_TURNS_160  # (fuller waves: see STAGED_TURNS_160)
                        narrow_turns = True
        work = tiles_of(p, bm, bn) * p.batch_total
        # TMA_STORE stages 4 boxes of C at once (2 for tf32x3, whose ring slots are twice as big,
        # and for the 256-wide tile from TMA_STORE_256_TWO_BOXES_MIN_K), taken from the ring where
        # both do not fit (H200: 128 wide, 6 slots -> 5; 256 wide, 4 -> 3; see TMA_STORE_256_MAX_K)
        # (A_MN on a 64-row tile 256 wide holds 128 accumulators and two fragment sets a thread: a D
        # of any strides applied to C staged for the copy engine spilled there, NVRTC 13.0 and 13.5;
        # from registers it does not)
        stageable = (not pingpong and (bn < 256 or self.c_boxes or p.K <= TMA_STORE_256_MAX_K)
                     and not (a_mn and bm == 64 and bn == 256 and p.epilogue == EPILOGUE_D))
        tma = self.tma_store and (stageable or (pingpong and staged_turns)) and self.c_tma_ready(p)
        sCm, sCn = p.c_strides
        pairs_ok = p.c_align >= 8 and all(s % 2 == 0 for s in p.c_batch_strides)
        # float2 stores: along n (any A), or along m over the adjacent row pairs of A_MN (C^T)
        if sCn == 1 and p.N % 2 == 0 and sCm % 2 == 0 and pairs_ok:
            c_vec = 1
        elif a_mn and sCm == 1 and sCn % 2 == 0 and pairs_ok:
            c_vec = 2
        else:
            c_vec = 0
        # (rows of C contiguous, but stores from registers would be single floats: see c_copy_out)
        copy_out = not tma and self.c_copy_out and stageable and c_vec == 0 and sCn == 1
        two_boxes = x3 or pingpong or (bn == 256 and p.K >= TMA_STORE_256_TWO_BOXES_MIN_K)
        c_boxes = (min(self.c_boxes or (2 if two_boxes else 4), bn // 32)) if tma or copy_out else 0
        staged_boxes = c_boxes * (2 if pingpong else 1)  # (taking turns: a staging region each consumer)
        a_regs = x3 and self.x3_splits_a(p)
        stages = self.fit_stages(dev, bn, stages, x3, staged_boxes, bm, a_regs)
        while c_boxes > 1 and self.smem_bytes(bn, stages, x3, staged_boxes, bm, a_regs) > dev.smem_per_block_optin:
            # (a c_boxes asked for beyond what fits beside two slots: taking turns stages two regions)
            c_boxes -= 1
            staged_boxes = c_boxes * (2 if pingpong else 1)
        if tma or copy_out:
            c_vec = 0  # (unused: C goes out from shared memory)
        macros = (("BN", bn), ("STAGES", stages), ("C_VEC", c_vec), ("PRECISION_X3", int(x3)), ("A_MN", int(a_mn)))
        if tma:
            macros += (("TMA_STORE", 1), ("C_BOXES", c_boxes))
        elif copy_out:
            macros += (("C_COPY_OUT", 1), ("C_BOXES", c_boxes))
        macros += self.row_macros(bm, x3)
        if pingpong:
            macros += (("PINGPONG", 1),)
        if vector:
            macros += (("EPILOGUE_VECTOR", vector),)
        every = self.promote_every_for(p, tight=a_regs and bn == 128 and not tma) if x3 else 1
        if x3:  # see X3_SHORT_K
            macros += (("PROMOTE_EVERY", every), ("COMPENSATE", 1))
        if a_regs:
            macros += (("X3_A_REGS", 1),)
        details = (("A, B loads", self.loads_detail(x3, a_mn, bm, a_regs)),
                   ("pipeline", f"{stages} stages, 1 producer + {bm // 64} consumer warpgroup"
                                f"{'s' if bm > 64 else ''}, mbarriers"
                                + (": the consumers take turns on whole tiles (one's main loop runs while the "
                                   "other stores its tile)" if pingpong else "")),
                   ("C stores", f"staged in shared memory {c_boxes} boxes of {bm}x32 at a time"
                                + (" (a region each consumer warpgroup)" if pingpong else "") + ", written by the copy "
                                "engine (TMA) while " + ("the other consumer's" if pingpong else "the next tile's")
                                + " main loop runs" if tma else
                    f"staged in shared memory {c_boxes} boxes of {bm}x32 at a time, written by the consumer threads "
                    "a warp 32 adjacent floats of a row at a time (the copy engine cannot write this C: its pitch, "
                    "base or batch strides; from registers it would go out in single floats)" if copy_out else
                    ("single floats", "float2 along n", "float2 along m")[c_vec]),
                   ("math", f"3xTF32 wgmma m64n{bn}k8: big*big promoted to fp32 (compensated) every "
                            f"{'k-step' if every == 1 else f'{every} k-steps'}, small cross terms in their own "
                            "accumulator" if x3 else f"TF32 wgmma m64n{bn}k8, fp32 accumulate"))
        if (may_pingpong and self.pingpong is True and self.pingpong_tma_store is None and not turns_store_ok
                and pingpong_pays(p, dev, tiles_of(p, bm, 128) * p.batch_total)):  # (where it would be weighed)
            why = "the copy engine cannot write this C" if self.tma_store else "C is not staged (tma_store off)"
            details += (("consumers", f"both warpgroups on each tile, not taking turns: {why}, and taking turns "
                                      f"with C stored from registers ran 4-50% slower on an H100's 3.35 TB/s of "
                                      f"memory (taken from {PINGPONG_MIN_DRAM_TBPS:g} TB/s; this part: "
                                      f"{dev.dram_tbps:.2f})"),)
        if vector:
            details += (("bias", "added to the accumulators as they are stored (D is one "
                                 + ("row: a value a column" if vector == 1 else "column: a value a row") + ")"),)
        if a_regs and self.x3_a_regs is None:
            details += (("A split", f"in registers, not staged: {p.N} columns (at most {X3_A_REGS_MAX_N}), so A's "
                                    f"staged halves would move 12 bytes an element for its {2 * p.N} FLOP"),)
        if bm == 64:
            details += (self.rows64_detail(p, dev),)
        if narrow_turns:
            tiles = {w: tiles_of(p, bm, w) * p.batch_total for w in (160, 192)}
            waves = {w: -(-n // dev.sm_count) for w, n in tiles.items()}
            details += (("width rule", f"160 wide, not 192: taking turns with C staged, its {tiles[160]} tiles fill "
                                       f"{tiles[160] / (waves[160] * dev.sm_count):.0%} of the {waves[160]} waves they "
                                       f"take, 192's {tiles[192]} {tiles[192] / (waves[192] * dev.sm_count):.0%} of "
                                       f"{waves[192]} (see STAGED_TURNS_160)"),)
        if short_k:
            details += (("width rule", f"at most {SHORT_K_NARROW_MAX_BN} wide at K = {SHORT_K_NARROW_MIN_K + 1}-"
                                       f"{SHORT_K_NARROW_MAX_K} with both operands K-major: measured faster than the "
                                       "wider tiles there (see SHORT_K_NARROW_MIN_K)"),)
        persistent = pingpong or self.persistent == "always" or (self.persistent and persistent_pays(p, dev, work))
        details += (("schedule", f"persistent: {min(work, dev.sm_count)} blocks (one an SM) walk {work} tiles"
                                 if persistent else f"one block a tile ({work} tiles)"),)
        threads = self.threads_for(bm)
        return KernelConfig(self.name, self.source, self.entry, macros, threads, (threads, 1, 1),
                            (max(1, min(work, dev.sm_count if persistent else MAX_GRID_X)), 1, 1),
                            self.smem_bytes(bn, stages, x3, staged_boxes, bm, a_regs), (bm, bn, self.bk), details,
                            arch_suffix="a", work_items=work)

    @staticmethod
    def loads_detail(x3: bool, a_mn: bool, bm: int, a_regs: bool = False) -> str:
        """Explain's words for how a plan's operands reach the tensor core."""
        if a_regs:
            return ("A: fp32 TMA tiles (of A where the copy engine can read it, else of its K-major fp32 copy), "
                    "each thread's wgmma fragments split into big and small TF32 halves in registers and fed "
                    "from there; B: TMA tiles of its staged big and small halves (K-major, 128-byte swizzle)")
        if x3:
            return X3_SPLIT_B_LOADS if bm == 64 else "TMA tiles of the big and small halves (K-major, 128-byte swizzle)"
        return "TMA tiles (128-byte swizzle), rounded to TF32 by the copy engine; " + (
            "the kernel's A operand m-contiguous, fed to wgmma from registers (8-byte shared loads"
            + (", each k-step's during the step before" if bm == 64 else "") + "), its B K-major"
            if a_mn else "both K-major")

    def promote_every_for(self, p: Problem, tight: bool = False) -> int:
        """tf32x3's k-steps between promotions (see X3_SHORT_K), or ``promote_every`` where set.
        ``tight``: the build with A split in registers, 128 wide, C stored from registers, which
        promotes every k-step: NVRTC 13.0 spilled a register there beside the three accumulator
        sets and 32 fragment registers when a group of 2 k-steps was written out."""
        if self.promote_every is None:
            return 1 if tight or p.K <= X3_SHORT_K else 2
        if self.promote_every < 1:
            raise ValueError(f"promote_every must be at least 1 k-step, got {self.promote_every}")
        return self.promote_every

    def fit_stages(self, dev: DeviceFacts, bn: int, stages: int, x3: bool, c_boxes: int, bm: int,
                   a_regs: bool = False) -> int:
        """``stages`` slots of the width's ring where they fit in a block's shared memory; fewer
        where not (two at least). A 64-row tile's slots are smaller: a ring of up to
        RING_MAX_BYTES, at most MAX_STAGES slots, as tile_options' rings are."""
        if bm != 128:
            stages = max(2, min(MAX_STAGES, RING_MAX_BYTES // ((2 if x3 else 1) * (bm + bn) * self.bk * 4)))
        while stages > 2 and self.smem_bytes(bn, stages, x3, c_boxes, bm, a_regs) > dev.smem_per_block_optin:
            stages -= 1
        return stages

    @staticmethod
    def row_macros(bm: int, x3: bool) -> tuple[tuple[str, int], ...]:
        """BM where it is not the kernel's default (128); on 64-row tiles tf32x3 splits B itself."""
        return () if bm == 128 else (("BM", bm),) + ((("X3_SPLIT_B", 1),) if x3 else ())

    def rows64_detail(self, p: Problem, dev: DeviceFacts) -> tuple[str, str]:
        a_mn = self.reads_a_mn(p)
        if p.M <= ROWS64_MAX_M:
            why = f"M = {p.M} <= {ROWS64_MAX_M}, where a 128-row tile runs half its wgmmas or more on rows past M"
        elif self.rows64 is True and mid_rows64_width(p, dev, a_mn) is not None:
            why = (f"{tiles_of(p, 128, 64)} tiles of 128x64 fill under one wave of {dev.sm_count} SMs; 64-row "
                   "tiles load no more a k-step per SM ((BM + BN) x waves), and a block of so few tiles an SM "
                   "runs at the rate it loads" + (" (the width forced)" if self.force_bn else ""))
            if a_mn and not self.rows64_a_mn_split and self.split is True:
                why += ("; A fed from registers: at any K, unsplit (no split of such a tile was measured faster "
                        "than the 64-row tile unsplit)")
            elif a_mn and self.split is True and self.split_kept_by_lines(p, dev):
                why += (f"; A fed from registers over M + N = {p.M + p.N} lines of K (> {self.rows64_a_mn_split_max_lines}): "
                        "unsplit, as its tiles' k-steps take about as long as streaming the operands once, which a "
                        "split would not shorten")
        else:
            why = "asked for (rows64='always')"
        return ("tile rows", f"64 (one consumer warpgroup): {why}")

    def split_kept_by_lines(self, p: Problem, dev: DeviceFacts) -> bool:
        """Whether the 64-row rule would split A_MN launch problem ``p`` but for its M + N lines
        (``rows64_a_mn_split_max_lines``, where set): for explain."""
        bound = self.rows64_a_mn_split_max_lines
        return (bound is not None and p.M > ROWS64_MAX_M and p.M + p.N > bound
                and self.split_choice(p, dev, self.tile_options(False), bm=64, lines_bound=False) is not None)

    def split_choice(self, p: Problem, dev: DeviceFacts, options, bm: int | None = None, lines_bound: bool = True
                     ) -> tuple[tuple[int, int], int] | None:
        """((BN, STAGES), slices) of a split plan for ``p``, or None for an unsplit one: the rule
        of SPLIT_MAX_M and the constants beside it (on 64-row tiles, ROWS64_SPLIT_*), or a forced
        number of slices (``split``, with ``force_bn``'s width or the widest) wherever the batch is
        1. ``bm``: the tile's rows (default: :meth:`tile_rows`'s). ``lines_bound=False``: without
        ``rows64_a_mn_split_max_lines`` (for explain: :meth:`split_kept_by_lines`)."""
        if bm is None:
            bm = self.tile_rows(p, p.precision == "tf32x3", self.reads_a_mn(p), dev)
        if self.split is False or p.batch_total != 1 or (self.split is not True and int(self.split) <= 1):
            return None
        every_width = options
        if self.force_bn:
            options = tuple(o for o in options if o[0] == self.force_bn)
        if not options:
            return None
        if self.split is not True:  # a forced count
            n = split_slices(p, min(int(self.split), max(p.K // SPLIT_FORCED_SLICE_K, 1), MAX_GRID_Y))
            return (options[0], n) if n > 1 else None
        if p.K < SPLIT_MIN_K or (p.precision != "tf32" and bm != 64):  # (tf32x3: on 64-row tiles only)
            return None
        if bm == 64:
            a_mn = self.reads_a_mn(p)
            if self.rows64 is not True or p.M <= ROWS64_MAX_M:  # (the 64-row rule alone)
                return self._rows64_split(p, dev, options, skip_padded=a_mn)
            # mid-size tiles (more than ROWS64_MAX_M rows): the guards of ROWS64_MID_SPLIT_MIN_K, and for
            # A_MN those of ROWS64_A_MN_SPLIT, ROWS64_A_MN_SPLIT_MAX_K and _MIN_K (and a lines bound where set)
            bound = self.rows64_a_mn_split_max_lines if lines_bound else None
            if a_mn and (not self.rows64_a_mn_split or (bound is not None and p.M + p.N > bound)
                         or p.K >= ROWS64_A_MN_SPLIT_MAX_K):
                return None
            if p.K < (self.rows64_a_mn_split_min_k if a_mn else ROWS64_MID_SPLIT_MIN_K) or \
                    tiles_of(p, 64, 64) >= dev.sm_count // 2:
                return None
            # (after the guards: the rule's split is asked only where one may be taken)
            choice = self._rows64_split(p, dev, options, skip_padded=a_mn)
            if a_mn and p.K < ROWS64_MID_SPLIT_MIN_K:  # (the narrow tile's split only, judged on every width)
                rule = choice if options is every_width else self._rows64_split(p, dev, every_width, skip_padded=True)
                if rule is None or rule[0][0] != min(ROWS64_SPLIT_WIDTHS):
                    return None
            return choice
        tall = p.M > SPLIT_MAX_M
        if tall and (p.N < SPLIT_TALL_WIDTH or p.N < p.M):  # (see SPLIT_TALL_WIDTH)
            return None
        widths, share = ((SPLIT_TALL_WIDTH,), SPLIT_TALL_TILE_SHARE) if tall else (SPLIT_WIDTHS, SPLIT_TILE_SHARE)
        best = None
        for option in (o for o in options if o[0] in widths):
            tiles = tiles_of(p, bm, option[0])
            if tiles > dev.sm_count // share:
                continue
            n = split_slices(p, max(2, min(dev.sm_count // tiles, SPLIT_MAX, p.K // SPLIT_SLICE_K)))
            if tiles * n < dev.sm_count // SPLIT_MIN_FILL:  # (too few blocks: tf32_mma's deeper split)
                continue
            padding = -(-p.N // option[0]) * option[0] - p.N  # (columns computed past N)
            key = (tiles * n, -padding, option[0])
            if n > 1 and (best is None or key > best[0]):
                best = (key, option, n)
        return None if best is None else (best[1], best[2])

    @staticmethod
    def _rows64_split(p: Problem, dev: DeviceFacts, options, skip_padded: bool = False
                      ) -> tuple[tuple[int, int], int] | None:
        """The 64-row tile's split (ROWS64_SPLIT_*): unsplit where the 128-wide tiles fill half the
        SMs; else 128 wide in slices, or 64 wide where those (tile, slice) blocks still fill under
        half the SMs and the 64-wide ones are more. ``skip_padded`` (A_MN, where it was measured):
        not 128 wide where N fits 64 (as many tiles, half of each computing padding: C^T 4096 x
        48 ran 86.0 us in 2 slices 128 wide, 68.9 64 wide; NOTES run 44)."""
        want = dev.sm_count // ROWS64_SPLIT_FILL
        best = None
        narrowest = min((o[0] for o in options if o[0] in ROWS64_SPLIT_WIDTHS), default=None)
        for width in ROWS64_SPLIT_WIDTHS:
            option = next((o for o in options if o[0] == width), None)
            if option is None:
                continue
            tiles = tiles_of(p, 64, width)
            if skip_padded and width != narrowest and tiles == tiles_of(p, 64, narrowest):
                continue  # (N within the narrow width: the wide tile computes padding for nothing)
            if tiles >= want:  # (the 128-wide tiles fill half the SMs: unsplit)
                if best is None:
                    return None
                continue
            n = split_slices(p, max(2, min(dev.sm_count // tiles, ROWS64_MAX_SLICES, p.K // ROWS64_SLICE_K)))
            if n > 1 and (best is None or (best[2] < want and tiles * n > best[2])):
                best = (option, n, tiles * n)
        if best is None or best[2] < dev.sm_count // ROWS64_MIN_FILL:
            return None
        return best[0], best[1]

    @staticmethod
    def split_workspace(p: Problem, cfg: KernelConfig) -> tuple[int, int, int]:
        """(sWm, sWn, slice): the SPLIT kernel's workspace for launch problem ``p``, in floats.
        Each slice is contiguous along C's contiguous dim: m where the kernel stores the adjacent
        row pairs of A_MN along m (C_VEC = 2: C^T), else n; its lines padded to a multiple of 4
        floats so that the partial tiles go out as float2 pairs and the last block sums float4
        units and stores them along C's contiguous dim whatever M and N are (single floats at an
        odd width, and C^T written across its rows, ran an A_MN split slower than no split:
        NOTES run 43)."""
        if dict(cfg.macros)["C_VEC"] == 2:
            ld = -(-p.M // 4) * 4
            return 1, ld, ld * p.N
        ld = -(-p.N // 4) * 4
        return ld, 1, ld * p.M

    def _split_config(self, p, dev, bn: int, stages: int, split: int, x3: bool, a_mn: bool, bm: int) -> KernelConfig:
        """The SPLIT kernel: one block a (tile, slice), slices stored from registers as float2
        pairs into a workspace contiguous along n, or along m for A_MN (:meth:`split_workspace`),
        the last block's sum into C."""
        tiles = tiles_of(p, bm, bn)
        # (split_range gives each slice a run of k-tiles: the kernel relies on none being empty)
        assert 1 < split <= MAX_GRID_Y and split_slices(p, split) == split, (split, p.K)
        a_regs = x3 and self.x3_splits_a(p)
        stages = self.fit_stages(dev, bn, stages, x3, 0, bm, a_regs)
        # (float2 pairs along the workspace's padded lines at any M, N: along m where A_MN writes
        # an m-contiguous C, else along n; split_workspace)
        c_vec = 2 if a_mn and self.writes_c_along_m(p) else 1
        macros = (("BN", bn), ("STAGES", stages), ("C_VEC", c_vec), ("PRECISION_X3", int(x3)), ("A_MN", int(a_mn)),
                  ("SPLIT", 1)) + self.row_macros(bm, x3)
        if x3:
            macros += (("PROMOTE_EVERY", self.promote_every_for(p)), ("COMPENSATE", 1))
        if a_regs:
            macros += (("X3_A_REGS", 1),)
        per = slice_k_tiles(p, split) * self.bk
        consumers = "1 consumer warpgroup" if bm == 64 else "2 consumer warpgroups sharing each tile"
        details = (("A, B loads", self.loads_detail(x3, a_mn, bm, a_regs)),
                   ("pipeline", f"{stages} stages, 1 producer + {consumers}, mbarriers"),
                   ("split-K", f"{split} slices of {per} k, one block a (tile, slice); each stores its partial tile "
                               "into a workspace slice and the tile's last block sums the slices in slice order "
                               "(no second launch)"),
                   ("math", f"3xTF32 wgmma m64n{bn}k8 (big*big promoted to fp32, small cross terms apart)" if x3
                    else f"TF32 wgmma m64n{bn}k8, fp32 accumulate"),
                   ("schedule", f"{tiles * split} blocks: {tiles} tiles x {split} slices"))
        if bm == 64:
            details += (self.rows64_detail(p, dev),)
        threads = self.threads_for(bm)
        return KernelConfig(self.name, self.source, self.entry, macros, threads, (threads, 1, 1),
                            (tiles, split, 1), self.smem_bytes(bn, stages, x3, 0, bm, a_regs), (bm, bn, self.bk),
                            details, arch_suffix="a", split_fused=True, work_items=tiles * split)

    def map_specs(self, p: Problem, cfg: KernelConfig):
        """Tensor-map geometry of A and B for launch problem ``p``: dims (K, rows, batch_inner,
        batch_outer) for a K-major operand, (rows, K, ...) with 32-row boxes for the m-contiguous
        A of A_MN; a broadcast batch dim collapsed to size 1; and the kernel's broadcast bits (bit
        set: that operand walks that batch dim)."""
        a_mn = dict(cfg.macros).get("A_MN", 0) == 1
        bits = 0
        specs = []
        for i, (rows, pitch, batch_strides, box_rows, mn) in enumerate((
                (p.M, p.a_strides[1] if a_mn else p.a_strides[0], p.a_batch_strides, cfg.tile[0], a_mn),
                (p.N, p.b_strides[1], p.b_batch_strides, cfg.tile[1], False))):
            extent = max((p.K if mn else rows) * pitch * 4, 16)
            (inner_n, outer_n), (inner_s, outer_s) = _batch_dims(p, batch_strides, extent)
            bits |= (1 if inner_n > 1 else 0) << (2 * i)
            bits |= (1 if outer_n > 1 else 0) << (2 * i + 1)
            dims, box = ((rows, p.K), (32, self.bk)) if mn else ((p.K, rows), (self.bk, box_rows))
            specs.append(MapSpec(dims + (inner_n, outer_n), (pitch * 4, inner_s, outer_s), box + (1, 1)))
        return specs[0], specs[1], bits

    def c_map_spec(self, p: Problem, cfg: KernelConfig) -> MapSpec | None:
        """C's tensor map where the kernel stores through the copy engine (TMA_STORE): dims (N, M,
        batch_inner, batch_outer), boxes of 32 columns by the tile's rows; None otherwise."""
        if not dict(cfg.macros).get("TMA_STORE"):
            return None
        pitch = p.c_strides[0]
        sizes, strides = _batch_dims(p, p.c_batch_strides, max(p.M * pitch * 4, 16))
        return MapSpec((p.N, p.M) + sizes, (pitch * 4,) + strides, (32, cfg.tile[0], 1, 1))

    def staging(self, p: Problem, dev: DeviceFacts, option: tuple[int, ...] | None = None
                ) -> tuple[Problem, tuple[tuple[str, int, int], ...], bool]:
        """How the wgmma family reads ``p``: (launch problem, K-major copies to make first, swap).

        tf32 reads in place a K-major or m-contiguous A with a K-major B, and an n-contiguous B with
        a K-major A by swapping (:meth:`in_place_form`). Otherwise it copies one
        operand into K-major buffers (one per matrix of its batch: stage_kmajor.kmajor_batch), A as
        M x K4 or B as its transpose N x K4, and both only when neither can be read in place. tf32x3
        copies both (the copy makes the big and small halves), but A alone where the kernel splits
        B itself (:meth:`x3_splits_b`) and B alone where it splits an A read in place in registers
        (:meth:`x3_splits_a`). Rows are padded to 16 bytes; the maps still say K, so the
        padding is never read."""
        k4 = -(-p.K // 4) * 4
        split = p.precision == "tf32x3"
        form = None if split else self.in_place_form(p)
        if form is not None:
            return (transposed(p), (), True) if form == "swap" else (p, (), False)

        original = p

        def dense_batch(which, rows):  # batch strides of the copies: matrix after matrix
            n1, _, s0, s1 = kmajor_batch(original, which)
            return (n1 * rows * k4 if s0 else 0, rows * k4 if s1 else 0)

        def copy_a(q):  # (a_padded: the launch problem's A is the copy, which x3_splits_a's rule reads)
            return (replace(q, a_strides=(k4, 1), a_align=16, a_batch_strides=dense_batch("a", q.M), a_padded=True),
                    ("a", q.M, k4))

        def copy_bt(q):
            return replace(q, b_strides=(1, k4), b_align=16, b_batch_strides=dense_batch("bt", q.N)), ("bt", q.N, k4)

        if not split and (self.a_mn_ready(p) or self.b_mn_ready(p)):
            # One copy: of A (then swap, B fed from registers) or of B^T (A fed from registers);
            # where both would do, of the operand with fewer elements to copy (over its own batch).
            a_size, b_size = p.M * kmajor_batch(p, "a")[1], p.N * kmajor_batch(p, "bt")[1]
            if self.b_mn_ready(p) and not (self.a_mn_ready(p) and b_size < a_size):
                q, entry = copy_a(p)
                return transposed(q), (entry,), True
            q, entry = copy_bt(p)
            return q, (entry,), False
        staged = []
        if (split and not self.x3_splits_a(original)) or not self.a_ready(p):
            p, entry = copy_a(p)  # (tf32x3 under X3_A_REGS: an fp32 copy, split by the kernel)
            staged.append(entry)
        if (split and not self.x3_splits_b(original)) or not self.b_ready(p):
            p, entry = copy_bt(p)  # (tf32x3 on 64-row tiles: an fp32 copy, split by the kernel)
            staged.append(entry)
        return p, tuple(staged), False

    def heuristic_reason(self, p: Problem, dev: DeviceFacts) -> str | None:
        """Why the wgmma family should not take ``p`` although it could (heuristics, not limits):
        too few tiles for the SMs (unless a split of K fills them: :meth:`split_choice`), or copies
        that would cost too much next to the product."""
        launch_p, staged, _ = self.staging(p, dev)
        x3 = p.precision == "tf32x3"
        splits = self.split_choice(launch_p, dev, self.tile_options(x3)) is not None  # (then tiles are no reason)
        if not splits and p.precision == "tf32":
            blocks = tiles_of(p, 128, 64) * p.batch_total  # (the narrowest tile the wave rule takes)
            solo = WGMMA_SOLO_US_PER_K * p.K
            split = MMA_SPLIT_US + MMA_SPLIT_US_PER_K * p.K * blocks / dev.sm_count
            if blocks < dev.sm_count and solo > split:
                return (f"{blocks} tiles of 128x64 for {dev.sm_count} SMs at K = {p.K}: walking all of K a tile "
                        f"(~{solo:.0f} us) takes longer than tf32_mma's K split over the SMs (~{split:.0f} us)")
        elif not splits:  # tf32x3
            blocks = -(-p.M // 128) * -(-p.N // 128) * p.batch_total
            share = WGMMA_MIN_SM_FRACTION[p.precision]
            if blocks < share * dev.sm_count:
                return (f"{blocks} tiles of 128x128 fill under 1/{round(1 / share)} of the {dev.sm_count} SMs, and "
                        "splitting K does not pay here")
        if (p.precision == "tf32" and p.N <= A_MN_COPIED_B_MAX_N and [w for w, _, _ in staged] == ["bt"]
                and self.reads_a_mn(launch_p)):
            return (f"A is m-contiguous (fed from registers) and B needs a K-major copy: at N = {p.N} "
                    f"(<= {A_MN_COPIED_B_MAX_N}) tf32_mma, reading both in place, is faster")
        # read, write (twice when split)
        moved = sum((12 if self.splits_staged(p, which) else 8) * rows * cols * kmajor_batch(p, which)[1]
                    for which, rows, cols in staged)
        # The alternative, tf32_mma, is much slower (H200: TF32 120 vs 350 TFLOP/s; tf32x3 24-28 vs
        # 115), and slower still on small products (blocks of one warp: 2-4x under its large-product
        # rate): with copies at ~3 TB/s, wgmma + copies is faster above ~10 FLOP per copied byte.
        # Asked: 16 for tf32 (measured, above), 20 for tf32x3 on the H200 (copy_min_flop_per_byte).
        need = copy_min_flop_per_byte(p.precision if x3 else "tf32", dev)
        if staged and 2 * p.M * p.N * p.K * p.batch_total < need * moved:
            names = " and ".join("B (transposed)" if w == "bt" else "A" for w, _, _ in staged)
            per_byte = 2 * p.M * p.N * p.K * p.batch_total / moved
            where = f" at {dev.dram_tbps:.2f} TB/s" if x3 and dev.dram_tbps else ""
            return (f"needs a K-major copy of {names}, too costly next to a product this small ({per_byte:.1f} "
                    f"FLOP per copied byte, under {need:.1f}{where})")
        return None

    def stagers(self, p, staging):
        return tuple(stage_kmajor_config(p, which, self.splits_staged(p, which)) for which, _, _ in staging)

    def describe_staging(self, p, which, rows, cols):
        what = "B transposed" if which == "bt" else which.upper()
        copies = kmajor_batch(p, which)[1]
        each = f"{copies} x {rows}x{cols}" if copies > 1 else f"{rows}x{cols}"
        if self.splits_staged(p, which):
            return f"{what} split into big and small TF32 halves, K-major ({each} each; stage_kmajor)"
        if p.precision == "tf32x3":
            return (f"{what} copied K-major in fp32 ({each}; stage_kmajor): a tensor map cannot read it, and "
                    "the kernel splits it into TF32 halves as it arrives")
        return (f"{what} copied K-major ({each}, 16-byte aligned rows; stage_kmajor): TF32 wgmma needs one "
                "operand K-major in shared memory (the other may come through registers), and a tensor map "
                "cannot read this one that way")

    def precision_computed(self, p):
        return p.precision
