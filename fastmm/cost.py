"""A first-order model of a plan's GPU time: what the planner weighs when two families could
serve a request and the preference order alone may pick the slower one, and what ``explain``
and the benchmark print beside the measured time.

Pure Python (no torch, no CUDA), like the planner: every prediction can be checked on a CPU.

The model, per launch of the plan:

- **compute**: the grid's blocks run in waves. A block does the FLOPs of its whole (padded) tile
  over its share of K; ``resident`` blocks share an SM (threads, shared memory and the family's
  register use decide how many); a wave takes as long as one SM needs for its resident blocks at
  the family's sustained rate, ``peak x efficiency``, plus a fixed cost per wave (``WAVE_US``:
  filling the pipeline, storing the tile). The peaks are the arch's published per-SM numbers;
  the efficiencies and fixed costs were fitted to the H200's measured rows (RESULTS.md);
- **memory**: A, B and C moved once at the device's copy bandwidth (broadcast operands once), plus
  a split-K workspace written and read again, and staged copies; the skinny families (decode)
  are this alone: they stream the weights;
- a launch costs ``LAUNCH_US`` of GPU time beyond its work (the ramp-up and drain of a grid,
  the gap to the next kernel); a second pass (split-K's reduce, stream-K's fixup) and staging
  copies are launches of their own.

time = the larger of compute and memory, plus ``OVERLAP_LOSS`` of the smaller, plus the launches.

Beside the GPU time, the host time to enqueue one call on the steady-state path (``host_us``:
the call's own cost, each launch, the tensor-map launch of wgmma, each buffer a staging copy or
split needs). Calls back to back go at the pace of the larger of the two (``per_call_us``), which
is what the planner compares: a tf32x3 product of 1024 x 700 x 64 ran 40.7 us a call on wgmma,
its two staging copies and three launches setting the pace, against 13.0 on the fp32 SIMT path
(H200, RESULTS run 21), where the GPU times alone had the wgmma plan ahead.

It is a first-order model: its job is to order two plans whose times differ by more than its
error (``explain`` prints the predictions; RESULTS.md holds them against measured times), not to
replace measuring: a tuned choice (``fastmm.tune``) always wins over it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .families.base import LOAD_ELEM_K, blocks_by_smem
from .families.simt_split_model import REGISTERS_PER_SM, simt_resident_blocks
from .families.tf32_mma import one_warp_rate
from .families.wgmma_tf32 import BN_RATE
from .problem import H200_DRAM_TBPS, DeviceFacts, Problem

#: Published dense peaks per SM in TFLOP/s at the boost clock, and the DRAM bandwidth in TB/s
#: usable by a copy (the H200's was measured: 4.27 TB/s, DESIGN.md), per compute capability.
#: fp32: FFMA; tf32: tensor cores (mma.sync on sm_80-89, wgmma on sm_90). ``part_dram_tbps``: the
#: driver's peak bandwidth (:func:`fastmm.problem.dram_tbps`) of the part ``bandwidth`` is for, so
#: that another part of the arch scales it by its own (:func:`copy_bandwidth`); 0.0: not scaled.
@dataclass(frozen=True)
class ArchPeaks:
    fp32_per_sm: float
    tf32_per_sm: float
    bandwidth: float
    part_dram_tbps: float = 0.0


PEAKS = {
    (7, 5): ArchPeaks(8.1 / 40, 0.0, 0.30),  # T4 (no TF32)
    (8, 0): ArchPeaks(19.5 / 108, 156.0 / 108, 1.70),  # A100 40GB
    (8, 6): ArchPeaks(38.7 / 84, 77.4 / 84, 0.70),  # RTX A6000
    (8, 9): ArchPeaks(91.6 / 142, 183.0 / 142, 0.80),  # L40S
    (9, 0): ArchPeaks(66.9 / 132, 494.7 / 132, 4.27, H200_DRAM_TBPS),  # H100/H200 SXM (4.27: the H200's)
}

#: GPU time a launch costs beyond its work, us: set below the GPU time of the smallest calls
#: measured back to back on the H200 (64^3: 5.2-7.1 us a call, its own work included; RESULTS
#: run 17).
LAUNCH_US = 2.5
#: Host us to enqueue a call on the steady-state path (fastmm.fast_path), on the H200 machine's host
#: (NOTES runs 10, 16, 19-20): the call itself (its key, the lookup, the result's allocation), each
#: launch (cuda.core's launch: 6.55 us), the extra of wgmma's launch through ctypes with its tensor
#: maps (cuLaunchKernel 8.9 us, the maps' lookups), each buffer a call allocates (torch.empty: 3.5
#: us; staging copies, split workspaces). A plain SIMT call: 17 us (16.7 measured); wgmma without
#: copies 22 (20-24.7); tf32x3 on wgmma with two copies 44 (40.7).
HOST_US_CALL = 10.0
HOST_US_PER_LAUNCH = 7.0
HOST_US_TENSOR_MAPS = 5.0
HOST_US_PER_BUFFER = 3.0
#: The share of the copy bandwidth a kernel's operand traffic gets (fitted: it gets all of it).
MEMORY_EFFICIENCY = 1.0
#: GPU time each wave of blocks costs beyond its FLOPs, us: filling the pipeline before the
#: first multiply and storing the tile after the last; it dominates short-K batched products
#: (attention's Q @ K^T: K = 64).
WAVE_US = {"simt_cp_async": 4.0, "simt_float4": 4.0, "wgmma_tf32": 4.0, "tf32_mma": 4.0,
           "kmajor_mma": 0.0}  # (kmajor_mma streams W with no tile to fill or store: as the skinny ones)
#: The share of the shorter of compute and memory time that does not hide under the longer.
OVERLAP_LOSS = 0.3

#: Sustained share of the peak per family, for a full SM of its blocks: (family, what) ->
#: efficiency, ``what`` being the thread tile's rows (the SIMT families), the precision (the
#: tensor-core families; keyed (family, compute capability) where one arch differs). Fitted to
#: the H200's rows (RESULTS.md runs 13-16, the model section and the headline shapes); the other
#: arches use the same shares of their own peaks (shown by explain, not acted on: CALIBRATED).
EFFICIENCY = {
    ("simt_cp_async", 16): 0.80,  # 16 x 8 outputs a thread (128 x 256, 128 x 128 tiles)
    ("simt_cp_async", 8): 0.68,  # 8 x 8 (128 x 64, 64 x 64)
    ("simt_cp_async", 4): 0.51,  # 4 x 8 (the 32-row tiles: six decode products, NOTES run 26)
    ("simt_float4", 16): 0.55,
    ("simt_float4", 8): 0.50,
    ("wgmma_tf32", "tf32"): 0.80,
    ("wgmma_tf32", "tf32x3"): 0.22,  # three MMAs a product, and the split of each input
    # mma.sync on sm_80-89 (not measured here: the share a tuned mma.sync GEMM reaches there),
    # and on sm_90, where wgmma sets the peak (H200: 208 TFLOP/s at 8192x4096x6144, NOTES run 12;
    # tf32x3 29 TFLOP/s at 2048^3, NOTES run 17)
    ("tf32_mma", "tf32"): 0.70,
    ("tf32_mma", "tf32x3"): 0.70 / 4,  # three MMAs, the split of each input, the promotion
    (("tf32_mma", (9, 0)), "tf32"): 0.42,
    (("tf32_mma", (9, 0)), "tf32x3"): 0.06,
    ("kmajor_mma", "tf32"): 0.42,
    ("kmajor_mma", "tf32x3"): 0.42 / 4,
    ("scalar", None): 0.04,
}
#: The skinny families stream the weights: their share of the bandwidth.
SKINNY_MEMORY_EFFICIENCY = 1.0
#: Single-float copies of a k-contiguous operand into the SIMT tile (4-byte cp.async, the
#: operand transposed in shared memory) cost this share of the rate for each such operand
#: (x @ W.t() with both read so: 46 against 51 TFLOP/s, RESULTS run 16).
SIMT_ELEM_K_PENALTY = 0.95
#: Blocks per SM that registers allow, by family (threads and shared memory are checked too):
#: wgmma's block (384 threads, 256 on 64-row tiles) takes a whole SM; the SIMT families by their registers a thread
#: (``simt_split_model.SIMT_REGISTERS``).
REGISTER_RESIDENT = {"simt_cp_async": 2, "simt_float4": 2, "wgmma_tf32": 1, "kmajor_mma": 2,
                     "skinny": 4, "skinny_kmajor": 4, "scalar": 8}
#: tf32_mma's registers a thread, by precision, whatever its block's warps (ptxas -v, NVRTC 13.0,
#: every tile option on sm_80 and sm_90: tf32 194-255, tf32x3 162-166): its blocks per SM are
#: counted from these and its threads, since its blocks range from one warp (the 64 x 64 tile:
#: four an SM by shared memory, where a count of 4-warp blocks had two, doubling its waves and
#: their fixed cost) to eight.
TF32_MMA_REGISTERS = {"tf32": 256, "tf32x3": 168}
SKINNY_FAMILIES = ("skinny", "skinny_kmajor")
#: The arches whose efficiencies were measured: the planner acts on the model's predictions only
#: there (elsewhere they are shown, not used).
CALIBRATED = ((9, 0),)


def peaks(dev: DeviceFacts) -> ArchPeaks:
    """The peaks of ``dev``'s arch, or of the newest listed arch older than it."""
    known = [cc for cc in PEAKS if cc <= dev.cc]
    return PEAKS[max(known)] if known else PEAKS[min(PEAKS)]


def copy_bandwidth(dev: DeviceFacts) -> float:
    """TB/s a copy moves on ``dev`` (bytes read plus written): the arch's measured figure, scaled
    by ``dev``'s peak over the measured part's where both are known. The copy reached the same
    share of the peak on the two Hopper parts measured here (H200 4.27 of 4.92 TB/s, H100 ~3.0 of
    3.35: 0.87 and 0.90), so the peak carries the difference between parts of one arch."""
    pk = peaks(dev)
    return pk.bandwidth * dev.dram_over(pk.part_dram_tbps)


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted GPU time and what it is made of (us)."""

    total_us: float  # GPU time
    compute_us: float
    memory_us: float
    launches: int
    waves: float
    bound: str  # "compute", "memory" or "launch"
    host_us: float = 0.0  # host time to enqueue the call (steady state)

    @property
    def per_call_us(self) -> float:
        """The pace of calls back to back: the larger of the GPU's time and the host's."""
        return max(self.total_us, self.host_us)

    def describe(self) -> str:
        return (f"{self.total_us:.1f} us predicted ({self.bound}-bound: compute {self.compute_us:.1f}, memory "
                f"{self.memory_us:.1f}, {self.launches} launch{'es' if self.launches > 1 else ''}, "
                f"{self.waves:.2f} waves; host {self.host_us:.0f} us to enqueue)")


def efficiency(kernel, p: Problem, cc: tuple[int, int] = (0, 0)) -> float:
    """The family's sustained share of its peak for this kernel on an arch of compute
    capability ``cc`` (see ``EFFICIENCY``: an entry for the arch wins)."""
    fam, macros = kernel.family, dict(kernel.macros)
    if fam in ("simt_cp_async", "simt_float4"):
        eff = EFFICIENCY.get((fam, macros.get("THREAD_M", 8))) or EFFICIENCY[(fam, 8)]
        for op in ("A_MODE", "B_MODE"):
            if macros.get(op) == LOAD_ELEM_K:
                eff *= SIMT_ELEM_K_PENALTY
        return eff
    if fam == "scalar":
        return EFFICIENCY[("scalar", None)]
    eff = EFFICIENCY.get(((fam, cc), p.precision)) or EFFICIENCY.get((fam, p.precision), 0.3)
    if fam == "tf32_mma" and p.precision == "tf32" and macros.get("WARPS_M", 1) * macros.get("WARPS_N", 1) == 1:
        # tf32_mma's blocks of a single warp (its 64 x 64 tile) sustain a share of the family's
        # rate that depends on their copies: the family's figures (NOTES runs 49, 56; tf32 only)
        eff *= one_warp_rate(bool(macros.get("A_VEC") and macros.get("B_VEC")))
    if fam == "wgmma_tf32":  # fitted at the widest tile; narrower ones sustain less (BN_RATE)
        eff *= BN_RATE.get(p.precision, {}).get(kernel.tile[1], 1.0)
    return eff


def resident_blocks(kernel, dev: DeviceFacts) -> int:
    """Blocks of ``kernel`` one SM holds at once: threads, shared memory (1 KiB a block kept by
    the driver) and the family's registers."""
    if kernel.family in ("simt_cp_async", "simt_float4"):
        return simt_resident_blocks(kernel, dev)
    threads = max(1, math.prod(kernel.block_dims))
    by_threads = max(1, 2048 // threads)
    by_smem = max(1, blocks_by_smem(kernel.smem, dev)) if kernel.smem else 32
    by_regs = REGISTER_RESIDENT.get(kernel.family, 2)
    if kernel.family == "tf32_mma":
        x3 = dict(kernel.macros).get("PRECISION_X3", 0)
        by_regs = REGISTERS_PER_SM // (threads * TF32_MMA_REGISTERS["tf32x3" if x3 else "tf32"])
    return max(1, min(by_threads, by_smem, by_regs, 32))


def _rate_per_sm(kernel, p: Problem, dev: DeviceFacts) -> float:
    """FLOP per us one SM sustains on ``kernel`` (1 TFLOP/s = 1e6 FLOP per us)."""
    pk = peaks(dev)
    tensor = p.precision in ("tf32", "tf32x3") and kernel.family in ("wgmma_tf32", "tf32_mma", "kmajor_mma")
    peak = pk.tf32_per_sm if tensor and pk.tf32_per_sm else pk.fp32_per_sm
    return peak * efficiency(kernel, p, dev.cc) * 1e6


def _operand_bytes(p: Problem) -> float:
    """A, B and C once each (a broadcast operand, batch stride 0, once)."""
    a_batches = p.batch_total if any(p.a_batch_strides) else 1
    b_batches = p.batch_total if any(p.b_batch_strides) else 1
    return 4.0 * (p.M * p.K * a_batches + p.K * p.N * b_batches + p.M * p.N * p.batch_total)


def predict(plan) -> Prediction | None:
    """The predicted GPU time of ``plan`` (a :class:`fastmm.plan.Plan`), or None for a plan that
    runs torch.matmul."""
    kernel = plan.kernel
    if kernel is None:
        return None
    p = plan.launch_problem or plan.problem
    dev = plan.device
    bw = copy_bandwidth(dev) * 1e6 * MEMORY_EFFICIENCY  # bytes per us
    launches = 1 + (plan.reduce is not None) + (plan.head is not None) + len(plan.staging)
    flops = 2.0 * p.M * p.N * p.K * p.batch_total
    memory = _operand_bytes(p) / bw
    for _, rows, cols in plan.staging:  # each copy reads and writes its operand
        memory += 2 * 4.0 * rows * cols / bw
    if kernel.family in SKINNY_FAMILIES:
        compute = flops / (dev.sm_count * peaks(dev).fp32_per_sm * 0.5 * 1e6)
        memory = _operand_bytes(p) / (copy_bandwidth(dev) * 1e6 * SKINNY_MEMORY_EFFICIENCY)
        if kernel.split_k > 1 and not kernel.split_fused:
            memory += 2 * 4.0 * kernel.split_k * p.M * p.N / bw
        waves = kernel.grid[0] * kernel.grid[1] / (dev.sm_count * resident_blocks(kernel, dev))
    else:
        bm, bn, bk = kernel.tile
        rate = _rate_per_sm(kernel, p, dev)
        resident = resident_blocks(kernel, dev)
        slots = dev.sm_count * resident
        if kernel.stream_k is not None:  # whole waves, then the rest dealt out evenly
            sk = kernel.stream_k
            tile_flops = 2.0 * bm * bn * sk.k_tiles * bk
            waves = (sk.head_tiles + sk.tiles) / slots
            # (the head form's in a launch of their own: whole waves of it, its last one part-full)
            whole = sk.whole_tiles + math.ceil(sk.head_tiles / slots) * slots
            compute = (whole / slots + (sk.blocks * sk.iters / sk.k_tiles) / slots) * resident * tile_flops / rate
            compute *= p.batch_total
            memory += 2 * 4.0 * sk.workspace_floats(bm, bn) / bw
        else:
            split = kernel.split_k
            k_per_block = math.ceil(math.ceil(p.K / split) / bk) * bk
            tile_flops = 2.0 * bm * bn * k_per_block
            blocks = kernel.work_items or kernel.grid[0] * split * p.batch_total
            waves = blocks / slots
            # whole waves of ``resident`` blocks an SM, then the rest spread one per SM first:
            # the SM with the most blocks sets the last wave's time
            full, rest = divmod(blocks, slots)
            tile_us = tile_flops / rate
            compute = full * resident * tile_us + math.ceil(rest / dev.sm_count) * tile_us
            # A wave's fixed cost (the pipeline filled, the tile stored) is paid wave after wave by
            # one-tile blocks, once by wgmma's persistent ones in tf32 (a block an SM walking its
            # tiles: the next tile's loads run under the last one's math and store). 9 batched
            # tf32 products of 512-4096 such tiles measured 0-17% over this (H100, NOTES run 57;
            # 4096 x (64 x 64 x 64): 77.4 us, 158.6 predicted with a cost a wave).
            # Not tf32x3, whose persistent plans at K = 64 already run slower than predicted
            # (64 x (577 x 577 x 64): 196.6 us, NOTES run 52).
            persistent = kernel.work_items > kernel.grid[0] * kernel.grid[1] and p.precision == "tf32"
            compute += (1 if persistent else math.ceil(waves)) * WAVE_US.get(kernel.family, 4.0)
            if split > 1:
                memory += 2 * 4.0 * kernel.split_slices * p.M * p.N / bw  # slices written, read back
    total = max(compute, memory) + OVERLAP_LOSS * min(compute, memory) + LAUNCH_US * launches
    bound = "compute" if compute >= memory else "memory"
    if LAUNCH_US * launches > max(compute, memory):
        bound = "launch"
    buffers = len(plan.staging) + int(kernel.split_k > 1 or kernel.stream_k is not None)  # (+ a workspace)
    host = (HOST_US_CALL + HOST_US_PER_LAUNCH * launches + HOST_US_PER_BUFFER * buffers
            + (HOST_US_TENSOR_MAPS if kernel.family == "wgmma_tf32" else 0.0))
    return Prediction(total, compute, memory, launches, waves, bound, host)


def calibrated(dev: DeviceFacts) -> bool:
    """Whether the model's efficiencies were measured on ``dev``'s arch (``CALIBRATED``)."""
    return dev.cc in CALIBRATED


def faster_by(fast: Prediction, slow: Prediction, margin: float) -> bool:
    """Whether ``fast`` is predicted faster than ``slow`` a call (:attr:`Prediction.per_call_us`:
    GPU or host, whichever sets the pace) by more than ``margin`` (a share of ``slow``'s time) and
    by more than a launch's cost: the bar for leaving the preference order, which was set by
    measurement. (Below a launch's cost the two are launch-bound, where the model's differences
    are its own constants, not the kernels'.)"""
    f, s = fast.per_call_us, slow.per_call_us
    return f < (1.0 - margin) * s and s - f > LAUNCH_US
