"""The mma.sync TF32 family (cuda_src/tf32_mma.cu, sm80+): m16n8k8 tensor-core products with
inputs rounded by cvt.rna and fp32 accumulation; tf32x3 adds the small cross terms in their own
accumulator. Multi-stage cp.async, split-K where tiles leave SMs idle."""
from __future__ import annotations

from dataclasses import dataclass

from ..problem import DeviceFacts
from .base import (Family, KernelConfig, covered_area, fills_wave, grid_of, k_dominant, pick_tile, round4, tiles_of,
                   vec_ok, with_split_flags)
from .simt_core import padded_copies
from .stage_kmajor import stage_rows_config
from .work_split import split_k_for


#: The one-warp 64 x 64 block sustains this share of the family's rate (one warp an SM hides
#: little latency; H200, `probes/small_tf32_probe.py`, NOTES run 23: 300 x 700 x 1100 27.0 us
#: against 12.6 predicted without it, 512^3 17.6 against 9.4). The tile choice counts its area
#: at this rate where an operand is copied in single floats: attention's P @ V at L = 197 and 77
#: (K not a multiple of 4; N = 64, batches of 768 and 96) ran 171.9 and 16.7 us on it, 139.1
#: and 12.6 on the 4-warp 128 x 128 and 2-warp 64 x 128 tiles that pad twice its area; with
#: 16-byte copies it kept up (64 x 64 x 64, a batch of 4096: 75.4 against 93.3 for 64 x 128;
#: H100, `probes/candidates.py`, NOTES run 49). Only that choice moves (Tf32Mma.off_one_warp).
#: (Since run 56 the 4-warp 128 x 64 tile, which pads no more than the one-warp tile, takes the
#: first of them where its blocks fill a wave: 97.4 us. The second's 96 blocks of it do not.)
ONE_WARP_RATE = 0.4
#: The same with 16-byte copies of both operands: 0.62 (64 x 64 x 64 in a batch of 4096 against
#: 64 x 128, NOTES run 49) and 0.71 (attention's dV with 32-wide heads, 256 x (300 x 32 x 300),
#: against 128 x 64: 66.0 against 56.6 us; H100, NOTES run 56).
ONE_WARP_RATE_VEC = 0.65


def one_warp_rate(vec: bool) -> float:
    """The one-warp block's share of the multi-warp tiles' rate (its tile choice and the cost
    model): ONE_WARP_RATE_VEC with 16-byte copies of both operands (``vec``), else ONE_WARP_RATE."""
    return ONE_WARP_RATE_VEC if vec else ONE_WARP_RATE


@dataclass(frozen=True)
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

    #: Compute capabilities where tf32x3 requests go to the fp32 SIMT path instead of this family
    #: (wgmma still takes what it takes first). Measured on the H200: tf32x3 here runs 20-28
    #: TFLOP/s (8192x4096x6144 24.4, 1024x2816x1024 21, 1000^3 20.6; the suites' rows it took
    #: 11-28) where fp32 SIMT runs 35-50 at the same shapes, and every suite row it took ran
    #: faster in ieee (1.15-1.7x: NOTES.md runs 17 and 20). fp32 meets tf32x3's promise of
    #: fp32-level accuracy. Not on sm_80-89: there FP32 peaks at an eighth of TF32, unmeasured.
    x3_to_fp32_cc = ((9, 0),)

    def heuristic_reason(self, p, dev):
        if p.precision == "tf32x3" and dev.cc in self.x3_to_fp32_cc:
            return ("tf32x3 on mma.sync is slower than the fp32 SIMT path on this GPU (H200: 20-28 against "
                    "35-50 TFLOP/s at the same shapes), which computes full fp32")
        return None

    def tile_options(self, x3: bool, dev: DeviceFacts | None = None):
        """(WARPS_M, WARPS_N, WARP_N), largest tile first, those whose two stages fit the device's
        shared memory in any layout. Warps are 64 x 64 for tf32 (with two fragment sets, 128 x 256
        blocks: 204-208 TFLOP/s against 189-198 for 128 x 128 at 8192x4096x6144 on the H200,
        NOTES run 12); 64 x 16 for tf32x3, which holds two accumulator sets: its 64 x 32 warps sat
        at the 255-register cap and spilled 4-40 bytes in 56 of 192 builds under NVRTC 13.0
        (issue 16); 64 x 16 takes ~160 registers. With Dekker's add in the promotion (COMPENSATE
        in tf32_mma.cu) it runs 2048^3 at 29.0 TFLOP/s on the H200, against 28.0 for the old tile;
        1000^3 and 1024x2816x1024 1.4-1.7x faster (twice the blocks), 512^3 0.8-1.3x (NOTES run
        17). tf32 also has 128 x 64 blocks of four 64 x 32 warps, for products 64 wide or less:
        attention's P @ V at L = 197 (P's rows copied in single floats) ran on it at 97.4 us, against
        140.0 on 128 x 128 (half of it padding) and 172.6 on the one-warp 64 x 64 tile (H100, a batch
        of 768; torch 99.6); with 16-byte copies, 3-8% ahead of the one-warp tile (NOTES run 56)."""
        opts = ((2, 4, 16), (2, 2, 16), (1, 2, 16)) if x3 else ((2, 4, 64), (2, 2, 64), (1, 2, 64), (2, 2, 32), (1, 1, 64))
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

    @staticmethod
    def tile_dims(opt) -> tuple[int, int]:
        """(BM, BN) of tile option ``opt`` (WARPS_M, WARPS_N, WARP_N): warps are 64 rows tall."""
        return opt[0] * 64, opt[1] * opt[2]

    def off_one_warp(self, p, dev, options, one_warp, rate):
        """The tile to take instead of ``one_warp`` (the one-warp tile the area rule chose, whose
        block issues all of its copies itself): among the multi-warp tiles that pad less than the
        one-warp tile's area over its ``rate`` (:func:`one_warp_rate`) and fill 90% of a wave, the
        area rule's choice; else
        ``one_warp`` (fewer blocks than SMs are better spread one warp a block). Only a one-warp
        choice moves."""
        bound = covered_area(p, self.tile_dims(one_warp)) / rate
        fits = tuple(o for o in options if o != one_warp and covered_area(p, self.tile_dims(o)) < bound
                     and fills_wave(p, dev, self.tile_dims(o)))
        return pick_tile(p, dev, fits, self.tile_dims) if fits else one_warp

    def options(self, p, dev):
        """Every tile of p's precision that fits the device, each with split-K allowed or not."""
        return with_split_flags(self.tile_options(p.precision == "tf32x3", dev))

    def configure(self, p, dev, option=None):
        x3 = p.precision == "tf32x3"
        options = self.tile_options(x3, dev)
        moved_off = None  # (the one-warp tile the area rule chose, where off_one_warp looked past it)
        sAm, sAk = p.a_strides
        sBk, sBn = p.b_strides
        a_mk = sAk == 1 or sAm != 1
        b_kn = sBn == 1 or sBk != 1
        a_vec = (vec_ok(round4(p.K, p.a_padded), sAm, p.a_batch_strides, p.a_align) if a_mk and sAk == 1 else
                 (not a_mk) and vec_ok(p.M, sAk, p.a_batch_strides, p.a_align))
        b_vec = (vec_ok(round4(p.N, p.b_padded), sBk, p.b_batch_strides, p.b_align) if b_kn and sBn == 1 else
                 (not b_kn) and vec_ok(p.K, sBn, p.b_batch_strides, p.b_align))
        if option is not None:
            opt, may_split = tuple(option[:3]), bool(option[3])
        elif k_dominant(p):
            preferred = options[0] if x3 else self.k_dominant_tile
            # the preferred tile, or the largest that fits and is no larger
            fits = [o for o in options if o[0] * o[1] * o[2] <= preferred[0] * preferred[1] * preferred[2]]
            opt, may_split = (fits[0] if fits else options[-1]), True
        else:
            opt = pick_tile(p, dev, options, self.tile_dims)
            if opt[0] * opt[1] == 1:
                moved_off = opt
                opt = self.off_one_warp(p, dev, options, opt, one_warp_rate(a_vec and b_vec))
            may_split = True
        wm, wn, warp_n = opt
        bm, bn = wm * 64, wn * warp_n
        per_stage = self.stage_bytes(bm, bn, a_mk, b_kn)
        # 4 stages were measured for tf32's 8-warp block only
        most = self.max_stages if wm * wn >= 8 and not x3 else self.max_stages_small
        stages = max(2, min(most, dev.smem_per_block_optin // per_stage))
        # two blocks per SM where registers (<= 4 warps) and shared memory allow (H100/H200: yes;
        # an A100's 164 KiB hold one 128x128 block of 3 stages)
        two_fit = wm * wn <= 4 and 2 * (per_stage * stages + 1024) <= dev.smem_per_sm
        split = split_k_for(p, dev, tiles_of(p, bm, bn), self.bk, 2 if two_fit else 1) if may_split else 1
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
        if moved_off is not None and opt != moved_off:
            copies = "" if a_vec and b_vec else "with an operand copied in single floats "
            details += (("tile", f"{bm}x{bn}, not the one-warp 64x64 tile that pads less: {copies}one warp a block "
                                 f"runs at ~{one_warp_rate(a_vec and b_vec):g} of this rate"),)
        if split > 1:
            details += (("split-K", f"{split} slices of K, reduced by splitk_reduce"),)
        return KernelConfig(self.name, self.source, self.entry, macros, threads, (threads, 1, 1),
                            grid_of(tiles_of(p, bm, bn), p.batch_total, split), per_stage * stages, (bm, bn, self.bk), details)

    def staging(self, p, dev, option=None):
        return padded_copies(p, copy_a=True)

    def stagers(self, p, staging):
        return tuple(stage_rows_config(p, which) for which, _, _ in staging)

    def describe_staging(self, p, which, rows, cols):
        return super().describe_staging(p, which, rows, cols) + " (stage_kmajor)"

    def precision_computed(self, p):
        return p.precision
