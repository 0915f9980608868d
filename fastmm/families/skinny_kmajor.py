"""The skinny_kmajor family (cuda_src/skinny_kmajor.cu): M <= 32 against a K-contiguous B, the
layout of ``x @ W.t()`` with W stored ``[N, K]`` as nn.Linear keeps it (decode's GEMV). W is read
once, along its rows (whole cache lines per warp load); A's slice of K is staged in shared
memory once per block. Up to 4 rows, a block's 8 warps share its rows and split its K range,
their sums added in shared memory; else K is split over blocks where the rows alone do not fill
the GPU, and the last block of each row tile sums the slices in slice order (no second launch)."""
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
#: Products of at most this many rows (rounded up to a power of two) put all 8 warps of a block
#: on its 16 rows of W along K (KR_KW = 8, :meth:`SkinnyKmajor.warps_along_k`) and split K over
#: blocks only as far as A's shared memory needs. Measured on the H200 (probes/kmajor_split_probe.py,
#: NOTES run 30; GPU us, CUDA graph replay, the best split over blocks at KW 1 -> KW 8 unsplit):
#: 1 x 4096 x 4096 21.4 -> 17.7, 2 x 4096^2 21.7 -> 17.9, 4 x 4096^2 22.8 -> 18.9, 1 x 14336 x 4096
#: 56.9 -> 55.0, 1 x 4096 x 14336 59.0 -> 55.8, 1 x 1024 x 4096 6.9 -> 4.7, 4 x 1024 x 4096 9.2 ->
#: 6.2: the split's arrivals and last-block sums cost 2-4 us at the end of the kernel, and KW 8
#: with a split over blocks was slower than without on every one. At 16 rows (16 x 4096^2: 32.9 at
#: KW 1 S 4, 39.0 at KW 4, 49.4 at KW 8) and 8 (8 x 4096 x 14336: 64.1 against 74.6) it lost.
KW_MAX_M = 4


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
    #: Warps of a block sharing its rows, each a part of its K range (KR_KW; a variant for
    #: probes); None: the rule of :meth:`warps_along_k`.
    kw: int | None = None

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
        mt, r, u, minb = self.geometry(max(p.M, 1))
        unit = 32 * u
        red = WARPS * mt * 4 * r * 4 if mt <= KW_MAX_M else 0  # (the warps' sums at KR_KW = 8, at most)
        budget = min(A_SMEM_CAP, dev.smem_per_sm // minb - 1024 - red, dev.smem_per_block_optin - red)
        return budget // (4 * mt) // unit * unit

    @staticmethod
    def w_vec(p) -> bool:
        """Whether W's rows are read as float4 (B_VEC: K % 4 == 0, row stride and pointer aligned)."""
        return vec_ok(p.K, p.b_strides[1] if p.N > 1 else 0, p.b_batch_strides, p.b_align)

    def warps_along_k(self, p, dev) -> int:
        """KR_KW: how many warps of a block share its rows, each taking a part of its K range,
        their sums added in shared memory: all 8 for products of at most KW_MAX_M rows with W
        read as float4 (see KW_MAX_M), else 1."""
        if self.kw is not None:
            return self.kw
        mt = self.geometry(max(p.M, 1))[0]
        if mt > KW_MAX_M or not self.w_vec(p):
            return 1  # (with 4-byte W loads one build spilled: sm_80, 2 rows, a split and an epilogue)
        return WARPS

    def configure(self, p, dev, option=None):
        mt, r, u, minb = self.geometry(max(p.M, 1))
        unit = 32 * u
        kw = self.warps_along_k(p, dev)
        bn = WARPS // kw * 4 * r
        tiles = max(1, -(-p.N // bn))
        cap = self.slice_cap(p, dev)
        k = max(p.K, 1)
        least = -(-k // cap)
        slots = dev.sm_count * minb
        if p.batch_total > 1:
            split = 1
        elif self.split is None and kw > 1:
            split = least  # (see KW_MAX_M: split over blocks only as A's shared memory needs)
        elif self.split is not None:
            split = max(least, min(self.split, -(-k // unit)))
        else:  # waves of blocks, as the skinny family, but at least the slices A's shared memory needs
            top = max(least, min(MAX_SPLIT, -(-k // unit), k // MIN_SLICE_K))
            split = min(range(least, top + 1),
                        key=lambda n: (-(-tiles * n // slots) / n * (1 + SPLIT_COST * (n - 1)), n))
        ks = -(-(-(-k // split)) // unit) * unit  # k per block, a multiple of the unit
        split = -(-k // ks)
        sAm, sAk = p.a_strides
        b_vec = self.w_vec(p)
        a_vec = sAk == 1 and vec_ok(p.K, sAm if p.M > 1 else 0, p.a_batch_strides, p.a_align)
        fused = split > 1
        macros = (("MT", mt), ("KR_R", r), ("KR_U", u), ("KR_WARPS", WARPS), ("KR_G", 1), ("KR_KS", ks),
                  ("B_VEC", int(b_vec)), ("A_VEC", int(a_vec)), ("KR_FUSED", int(fused)),
                  ("KR_MINB", minb), ("KR_KW", kw))
        details = (("rows per thread", f"{mt} (M = {p.M})"),
                   ("W loads", f"along K, {'16-byte' if b_vec else '4-byte'}: a warp reads 128 contiguous bytes "
                               f"of each of 4 rows per load; {4 * r} rows per warp, {u} k steps ahead"),
                   ("A", f"{ks} k per block staged in shared memory ({'16' if a_vec else '4'}-byte cp.async)"),
                   ("math", f"fp32 FFMA, {mt} x {r} sums per lane; 8 lanes per row summed in a fixed tree"))
        if kw > 1:
            details += (("warps along K", f"{kw} warps share each {bn // (WARPS // kw)}-row group of W, each a run of "
                                          f"the block's k steps; their sums added in shared memory in warp order"),)
        if fused:
            details += (("split-K", f"{split} slices of K, summed in slice order by the last block of each row "
                                    "tile (no second launch)"),)
        smem = (mt * ks + (kw * mt * bn if kw > 1 else 0)) * 4  # A's slice, the warps' sums
        cfg = KernelConfig(self.name, self.source, self.entry, macros, WARPS * 32, (WARPS * 32, 1, 1),
                           grid_of(tiles, p.batch_total, split), smem, (mt, bn, ks), details,
                           split_fused=fused)
        return as_dependent_launch(cfg, dev, self.dependent_launch_cc)
