"""The skinny_kmajor family (cuda_src/skinny_kmajor.cu): M <= 32 against a K-contiguous B, the
layout of ``x @ W.t()`` with W stored ``[N, K]`` as nn.Linear keeps it (decode's GEMV). W is read
once, along its rows (whole cache lines per warp load); A's slice of K is staged in shared
memory once per block. K is split over blocks where the rows alone do not fill the GPU, and the
last block of each row tile sums the slices in slice order (no second launch)."""
from __future__ import annotations

from dataclasses import dataclass

from .base import Family, KernelConfig, as_dependent_launch, grid_of, vec_ok
from .work_split import MAX_SPLIT, SPLIT_COST

WARPS = 8
MAX_GRID_Y = 65535  # a launch's grid.y limit: one block row per K slice
#: Shared memory for A per block, at most: the blocks per SM (and the opt-in limit) must fit.
A_SMEM_CAP = 96 * 1024
#: The least k a K slice takes when the wave model splits: each slice costs a block's fixed work
#: (staging A, the arrival, one more partial for the last block to sum) that the model does not
#: count. Measured on the H200 (NOTES run 16): 1 x 1024 x 4096 at 8 slices of 512 7.2 us, at 16
#: 7.6, at 32 (the model's choice) 8.2; the larger decode products were best at >= 512 a slice.
MIN_SLICE_K = 512


@dataclass(frozen=True)
class SkinnyKmajor(Family):
    """M <= 32 with B read along K (B's K stride 1): a GEMV-like kernel over W's rows."""

    name, source, entry = "skinny_kmajor", "skinny_kmajor.cu", "fastmm_skinny_kmajor"
    min_cc = (8, 0)  # cp.async staging of A
    precisions = ("ieee", "tf32", "tf32x3")  # fp32 FMA: as accurate as any; W's bytes set the speed
    max_m = 32
    #: From this compute capability launched as a programmatic dependent launch, as the skinny
    #: family is (decode runs these back to back).
    dependent_launch_cc = (9, 0)
    #: K slices asked for (a variant for probes: benchmarks/probes/kmajor_split_probe.py); None:
    #: the wave model's choice. Never fewer than A's shared memory needs; a batch is never split.
    split: int | None = None

    def reject(self, p, dev):
        reason = super().reject(p, dev)
        if reason is None and p.M > self.max_m:
            reason = f"M = {p.M} > {self.max_m}: not skinny"
        if reason is None and p.b_strides[0] != 1:
            reason = "B is not K-contiguous (its rows along N are the skinny family's)"
        if reason is None and p.b_strides[1] == 1 and p.N > 1:  # K = 1: B is one row, read along N
            reason = "B is N-contiguous too (K = 1): the skinny family reads it along N"
        if reason is not None:
            return reason
        cap = self.slice_cap(p, dev)
        if -(-p.K // cap) > MAX_GRID_Y:
            return f"K = {p.K} would need more than {MAX_GRID_Y} slices of {cap} (the grid's y limit)"
        if p.batch_total > 1 and p.K > cap:
            return f"batched with K = {p.K} > {cap}: one block holds A's whole K when there is a batch (no split)"
        return None

    @staticmethod
    def geometry(m: int) -> tuple[int, int, int, int]:
        """(MT, R, U, blocks per SM) for M rows: A rows per thread (a power of two >= M), rows of
        W per lane group, k steps loaded ahead, and the __launch_bounds__ minimum (2: 128
        registers). The sums (MT * R), the loads in flight (U * R float4) and the A values
        (MT float4, hoisted by ptxas) fit without spills: ptxas -v spills at MT 4 with U 4, MT 16
        with R 4, and at MT 32 under 128 registers (sm_80..sm_90, NVRTC 13.5), so MT 32 runs one
        block per SM (153 registers) with W loads of 8 rows x 2 steps per warp in flight."""
        mt = 1
        while mt < m:
            mt *= 2
        if mt == 32:
            return mt, 2, 2, 1
        return mt, 4 if mt <= 8 else 2, 4 if mt <= 2 else 2, 2

    def slice_cap(self, p, dev) -> int:
        """The most k one block can take (A's slice of MT rows in shared memory)."""
        mt, _, u, minb = self.geometry(max(p.M, 1))
        unit = 32 * u
        budget = min(A_SMEM_CAP, dev.smem_per_sm // minb - 1024, dev.smem_per_block_optin)
        return budget // (4 * mt) // unit * unit

    def configure(self, p, dev, option=None):
        mt, r, u, minb = self.geometry(max(p.M, 1))
        unit = 32 * u
        bn = WARPS * 4 * r
        tiles = max(1, -(-p.N // bn))
        cap = self.slice_cap(p, dev)
        k = max(p.K, 1)
        least = -(-k // cap)
        slots = dev.sm_count * minb
        if p.batch_total > 1:
            split = 1
        elif self.split is not None:
            split = max(least, min(self.split, -(-k // unit)))
        else:  # waves of blocks, as the skinny family, but at least the slices A's shared memory needs
            top = max(least, min(MAX_SPLIT, -(-k // unit), k // MIN_SLICE_K))
            split = min(range(least, top + 1),
                        key=lambda n: (-(-tiles * n // slots) / n * (1 + SPLIT_COST * (n - 1)), n))
        ks = -(-(-(-k // split)) // unit) * unit  # k per block, a multiple of the unit
        split = -(-k // ks)
        sAm, sAk = p.a_strides
        sBk, sBn = p.b_strides
        b_vec = vec_ok(p.K, sBn if p.N > 1 else 0, p.b_batch_strides, p.b_align)
        a_vec = sAk == 1 and vec_ok(p.K, sAm if p.M > 1 else 0, p.a_batch_strides, p.a_align)
        fused = split > 1
        macros = (("MT", mt), ("KR_R", r), ("KR_U", u), ("KR_WARPS", WARPS), ("KR_G", 1), ("KR_KS", ks),
                  ("B_VEC", int(b_vec)), ("A_VEC", int(a_vec)), ("KR_FUSED", int(fused)),
                  ("KR_MINB", minb))
        details = (("rows per thread", f"{mt} (M = {p.M})"),
                   ("W loads", f"along K, {'16-byte' if b_vec else '4-byte'}: a warp reads 128 contiguous bytes "
                               f"of each of 4 rows per load; {4 * r} rows per warp, {u} k steps ahead"),
                   ("A", f"{ks} k per block staged in shared memory ({'16' if a_vec else '4'}-byte cp.async)"),
                   ("math", f"fp32 FFMA, {mt} x {r} sums per lane; 8 lanes per row summed in a fixed tree"))
        if fused:
            details += (("split-K", f"{split} slices of K, summed in slice order by the last block of each row "
                                    "tile (no second launch)"),)
        cfg = KernelConfig(self.name, self.source, self.entry, macros, WARPS * 32, (WARPS * 32, 1, 1),
                           grid_of(tiles, p.batch_total, split), mt * ks * 4, (mt, bn, ks), details,
                           split_fused=fused)
        return as_dependent_launch(cfg, dev, self.dependent_launch_cc)
