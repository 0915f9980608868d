"""The cp.async SIMT family (cuda_src/simt_cp_async.cu, sm80+): a multi-stage cp.async pipeline
under the shared SIMT tiles, with split-K (in cluster pairs on sm_90) and stream-K."""
from __future__ import annotations

from dataclasses import dataclass

from .base import LOAD_ELEM_K
from .simt_core import SimtCore, padded_copies


@dataclass(frozen=True)
class SimtCpAsync(SimtCore):
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

    def staging(self, p):
        return padded_copies(p, copy_a=False)
