"""The cp.async SIMT family (cuda_src/simt_cp_async.cu, sm80+): a multi-stage cp.async pipeline
under the shared SIMT tiles, with split-K (in cluster pairs on sm_90) and stream-K."""
from __future__ import annotations

from dataclasses import dataclass

from ..problem import Problem
from .base import LOAD_ELEM_K
from .simt_core import SimtCore, padded_copies, transposes_b
from .stage_kmajor import stage_rows_config


@dataclass(frozen=True)
class SimtCpAsync(SimtCore):
    """``transpose_b``: whether a K-contiguous B of a large product is copied row-major first
    (:func:`.simt_core.transposes_b`); ``transpose_big_tile_only``: only where the in-place plan
    takes the largest tile without a fused split (see :meth:`staging`). Variant switches for
    benchmarks; the defaults are the measured choice."""

    transpose_b: bool = True
    transpose_big_tile_only: bool = True

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
