"""The kmajor_mma family (cuda_src/kmajor_mma.cu): M <= 32 against a K-contiguous B (``x @ W.t()``
with W stored ``[N, K]``: decode) on tensor cores, for tf32 and tf32x3 requests. It streams W
once along its rows as skinny_kmajor does; its math is TF32 mma.sync, which takes A from
registers, where skinny_kmajor's FFMAs read every A value from shared memory once per few W rows
(at M = 16 that, not W's bytes, set its time: NOTES.md). A block's warps share 16 rows of W
and deal out its K range; K is split over blocks where the rows alone do not fill the GPU, the
last block of each row tile summing the slices in slice order (no second launch)."""
from __future__ import annotations

from dataclasses import dataclass

from .base import Family, KernelConfig, as_dependent_launch, grid_of, vec_ok
from .work_split import MAX_SPLIT, SPLIT_COST

WARPS = 4
BLOCKS_PER_SM = 4  # __launch_bounds__ minimum: 128 registers a thread
ROWS_PER_BLOCK = 16  # one A-role fragment of W rows per warp (KM_NF = 1)
#: Four B-role fragments of 8 rows. 17-32 rows were skinny_kmajor's until run 21: its FFMAs took
#: 251 us at 32 x 3584 x 18944 on the H200 where cuBLAS's TF32 took 71 (W's bytes: 64 us).
MAX_M = 32
#: From this many rows the planner prefers this family to skinny_kmajor for tf32 (below, the
#: FFMAs keep up with W's bytes; at 16 rows they take 1.3-1.5x longer: NOTES.md).
MIN_M = 8
#: No K split from this many waves of row tiles on: 16 x 14336 x 4096 (896 tiles, 1.7 waves of
#: 528 blocks) ran 68 us unsplit against 76 at the wave model's 4 slices; 16 x 11008 x 4096
#: (1.3 waves) ran 58 us at 2 slices against 62 unsplit (H200, NOTES.md).
NO_SPLIT_WAVES = 1.5
#: The least k a K slice takes when the wave model splits: each slice costs a block's fixed
#: work (the warps' sums in shared memory, one more partial for the last block to add).
MIN_SLICE_K = 512


@dataclass(frozen=True)
class KmajorMma(Family):
    """M <= 32 with B read along K (B's K stride 1) on TF32 tensor cores."""

    name, source, entry = "kmajor_mma", "kmajor_mma.cu", "fastmm_kmajor_mma"
    min_cc = (8, 0)  # mma.sync with TF32 inputs
    precisions = ("tf32", "tf32x3")
    #: From this compute capability launched as a programmatic dependent launch, as the skinny
    #: families are (decode runs these back to back).
    dependent_launch_cc = (9, 0)
    #: K slices asked for (a variant for probes); None: the wave model's choice.
    split: int | None = None
    #: Chunks loaded ahead, a variant for probes (None: :meth:`geometry`'s).
    u: int | None = None
    #: A-role fragments of 16 W rows a warp (KM_NF), a variant for probes (None: 1).
    nf: int | None = None
    #: Blocks an SM the registers are bounded for (KM_MINB), a variant for probes (None: the rule's).
    minb: int | None = None

    def reject(self, p, dev):
        reason = super().reject(p, dev)
        if reason is None and p.M > MAX_M:
            reason = f"M = {p.M} > {MAX_M}: at most four mma fragments of 8 rows"
        if reason is None and p.b_strides[0] != 1:
            reason = "B is not K-contiguous (W's rows along K are what this family streams)"
        if reason is None and p.b_strides[1] == 1 and p.N > 1:
            reason = "B is N-contiguous too (K = 1): the skinny family reads it along N"
        return reason

    def heuristic_reason(self, p, dev):
        # Measured on the H200 (benchmarks/probes/kmajor_mma_probe.py, NOTES.md): skinny_kmajor's
        # FFMAs stream W as fast below 8 rows, and for tf32x3 (whose promotion adds cost here)
        # they match or beat it while computing full fp32.
        if p.precision == "tf32x3":
            return "skinny_kmajor computes full fp32 as fast here (tf32x3 on this family: same speed or slower)"
        if p.M < MIN_M:
            return f"M = {p.M} < {MIN_M}: skinny_kmajor's FFMAs stream W as fast"
        return None

    def precision_computed(self, p):
        return p.precision  # TF32 products (tf32x3: three of them per product, fp32-level)

    @staticmethod
    def geometry(p) -> tuple[int, int, bool]:
        """(B-role fragments, chunks loaded ahead, float4 loads) for ``p``. Two chunks ahead
        where the registers allow it: ptxas -v spills (4-16 bytes, sm_80..sm_89, NVRTC 13.5)
        with tf32x3 at two fragments, and with the scalar loads; four fragments (17-32 rows)
        hold twice the A values of two, so they load one chunk ahead."""
        mf = 1 if p.M <= 8 else 2 if p.M <= 16 else 4
        sAm, sAk = p.a_strides
        sBk, sBn = p.b_strides
        vec = (vec_ok(p.K, sBn if p.N > 1 else 0, p.b_batch_strides, p.b_align)
               and sAk == 1 and vec_ok(p.K, sAm if p.M > 1 else 0, p.a_batch_strides, p.a_align))
        u = 2 if vec and mf <= 2 and not (p.precision == "tf32x3" and mf == 2) else 1
        return mf, u, vec

    @staticmethod
    def slice_k(p, split: int) -> int:
        """k per block for ``split`` slices: a multiple of 32."""
        k = max(p.K, 1)
        return -(-(-(-k // split)) // 32) * 32

    def configure(self, p, dev, option=None):
        mf, u, vec = self.geometry(p)
        u = self.u or u
        nf = self.nf or 1
        minb = BLOCKS_PER_SM if u <= 2 else 3  # (4 chunks ahead: up to 168 registers)
        if mf == 4 and p.precision == "tf32x3":  # (two accumulator sets of four fragments: 12-36
            minb = 2                             # bytes of spills under 128 registers, ptxas -v)
        minb = self.minb or minb
        tiles = max(1, -(-p.N // (ROWS_PER_BLOCK * nf)))
        k = max(p.K, 1)
        slots = dev.sm_count * minb
        if p.batch_total > 1:
            split = 1
        elif self.split is not None:  # (a probe's variant: asked for, within the grid's y limit)
            split = max(1, min(self.split, -(-k // 32), 65535))
        elif tiles >= NO_SPLIT_WAVES * slots:
            split = 1
        else:  # waves of blocks, as skinny_kmajor: more slices only while they fill the GPU
            top = max(1, min(MAX_SPLIT, k // MIN_SLICE_K))
            split = min(range(1, top + 1), key=lambda n: (-(-tiles * n // slots) / n * (1 + SPLIT_COST * (n - 1)), n))
        ks = self.slice_k(p, split)
        split = -(-k // ks)
        fused = split > 1
        x3 = p.precision == "tf32x3"
        macros = (("KM_MF", mf), ("KM_NF", nf), ("KM_U", u), ("KM_WARPS", WARPS), ("KM_KS", ks), ("X3", int(x3)),
                  ("B_VEC", int(vec)), ("A_VEC", int(vec)), ("KM_FUSED", int(fused)), ("KM_MINB", minb))
        details = (("math", "TF32 mma.sync m16n8k8 as C^T = W A^T: 16 rows of W by 8 rows of A per mma"
                            + (", each operand split into TF32 big + small parts, three mmas, the big product "
                               "promoted per step with Dekker's add (tf32x3)" if x3 else "")),
                   ("W loads", f"along K, {'16-byte' if vec else '4-byte'}: each warp load covers 64 contiguous bytes "
                               f"of 8 rows; {u} chunk(s) of 32 k ahead; A's rows read from L1/L2"),
                   ("block", f"{WARPS} warps share {ROWS_PER_BLOCK * nf} rows of W and deal out {ks} k in chunks of 32; "
                             "their sums added in warp order"))
        if fused:
            details += (("split-K", f"{split} slices of K, summed in slice order by the last block of each row "
                                    "tile (no second launch)"),)
        cfg = KernelConfig(self.name, self.source, self.entry, macros, WARPS * 32, (WARPS * 32, 1, 1),
                           grid_of(tiles, p.batch_total, split), 0, (8 * mf, ROWS_PER_BLOCK * nf, ks), details,
                           split_fused=fused)
        return as_dependent_launch(cfg, dev, self.dependent_launch_cc)
