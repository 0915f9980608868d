"""The Hopper family (cuda_src/wgmma_tf32.cu, sm_90a): TF32 wgmma fed by TMA, warp-specialised;
also tf32x3 from operands split into big and small TF32 halves by the staging pass
(:mod:`.stage_kmajor`). Everything the planner and the runner ask of it lives here: what it
reads in place, which operand it copies first (and when that costs too much), the tensor maps."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..problem import DeviceFacts, Problem, transposed
from .base import Family, KernelConfig, grid_of, pick_tile, tiles_of
from .stage_kmajor import kmajor_batch, stage_kmajor_config


#: The wgmma family does not split K: each block walks all of K. tf32_mma, slower per SM but
#: with K split over every SM, is faster when wgmma's tiles fill less than this share of the
#: SMs: about its relative speed (H200: TF32 120 vs 350 TFLOP/s; tf32x3 24-28 vs 115).
WGMMA_MIN_SM_FRACTION = {"tf32": 1 / 3, "tf32x3": 1 / 4}
#: wgmma takes a problem whose operands it must copy first when the product does at least this
#: many FLOP per byte the copies move (see heuristic_reason).
WGMMA_COPY_MIN_FLOP_PER_BYTE = {"tf32": 128, "tf32x3": 20}


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
#: short K (1.4e-7 at K = 64), so K up to X3_SHORT_K promotes every step, longer K every 2.
X3_SHORT_K = 2048


@dataclass(frozen=True)
class WgmmaTf32(Family):
    """Hopper tensor cores: wgmma m64nNk8 TF32 fed by TMA, warp-specialised (sm_90a only); also
    tf32x3 from operands split into big and small TF32 halves by the staging pass.

    TF32 wgmma reads K-major tiles from shared memory only. An MN-major A (m contiguous) is fed
    from registers instead (A_MN); a row-major B is handled by computing C^T = B^T A^T, where B^T
    is that MN-major A (the planner's swap). Only what neither covers is copied."""

    #: Whether tf32 products of N <= 128 take the 128-wide tile whatever the fill rule says: a
    #: 256-wide one computes at least as many padded columns as real ones. H200 (RESULTS run 18):
    #: 1024 x (128x128x64) B^T 51.8 -> 44.8 us, 256 x (128x128x128) 21.5 -> 19.3, the same bits.
    #: False (the fill rule alone) is a variant for benchmarks.
    narrow_n_tile: bool = True

    name, source, entry = "wgmma_tf32", "wgmma_tf32.cu", "fastmm_wgmma_tf32"
    min_cc = (9, 0)
    precisions = ("tf32", "tf32x3")
    launch_form = "tensor_maps"
    bm, bk = 128, 32
    threads = 384  # producer warpgroup + two consumer warpgroups

    @staticmethod
    def tile_options(x3: bool):
        """(BN, STAGES), largest first: a 192 KiB ring either way. tf32x3 keeps three sets of
        accumulators and four tiles a slot, so 128 columns and 3 x 64 KiB."""
        return ((128, 3),) if x3 else ((256, 4), (128, 6))

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

    def smem_bytes(self, bn: int, stages: int, x3: bool = False) -> int:
        # ring + mbarriers, plus 1 KiB so the kernel can align the ring to 1024 bytes (swizzle)
        return stages * (2 if x3 else 1) * (self.bm + bn) * self.bk * 4 + 16 * stages + 1024

    def configure(self, p, dev):
        x3 = p.precision == "tf32x3"
        options = self.tile_options(x3)
        if self.narrow_n_tile and p.N <= 128:
            options = options[-1:]
        # (no area test beyond that: it took 128-wide tiles for N = 300 (1.05x) and 384 (0.96x);
        # the fill rule's choices were measured)
        bn, stages = pick_tile(p, dev, options, lambda o: (self.bm, o[0]), pad_slack=None)
        while stages > 2 and self.smem_bytes(bn, stages, x3) > dev.smem_per_block_optin:
            stages -= 1
        a_mn = not x3 and not self.a_ready(p) and self.a_mn_ready(p)
        sCm, sCn = p.c_strides
        pairs_ok = p.c_align >= 8 and all(s % 2 == 0 for s in p.c_batch_strides)
        # float2 stores: along n (any A), or along m over the adjacent row pairs of A_MN (C^T)
        if sCn == 1 and p.N % 2 == 0 and sCm % 2 == 0 and pairs_ok:
            c_vec = 1
        elif a_mn and sCm == 1 and sCn % 2 == 0 and pairs_ok:
            c_vec = 2
        else:
            c_vec = 0
        macros = (("BN", bn), ("STAGES", stages), ("C_VEC", c_vec), ("PRECISION_X3", int(x3)), ("A_MN", int(a_mn)))
        if x3:  # see X3_SHORT_K
            macros += (("PROMOTE_EVERY", 1 if p.K <= X3_SHORT_K else 2), ("COMPENSATE", 1))
        loads = ("TMA tiles of the big and small halves (K-major, 128-byte swizzle)" if x3 else
                 "TMA tiles (128-byte swizzle), rounded to TF32 by the copy engine; "
                 + ("the kernel's A operand m-contiguous, fed to wgmma from registers (8-byte shared loads), "
                    "its B K-major" if a_mn else "both K-major"))
        details = (("A, B loads", loads),
                   ("pipeline", f"{stages} stages, 1 producer + 2 consumer warpgroups, mbarriers"),
                   ("C stores", ("single floats", "float2 along n", "float2 along m")[c_vec]),
                   ("math", f"3xTF32 wgmma m64n{bn}k8: big*big promoted to fp32 (compensated) every "
                            f"{'k-step' if p.K <= X3_SHORT_K else '2 k-steps'}, small cross terms in their own "
                            "accumulator" if x3 else f"TF32 wgmma m64n{bn}k8, fp32 accumulate"))
        return KernelConfig(self.name, self.source, self.entry, macros, self.threads, (self.threads, 1, 1),
                            grid_of(tiles_of(p, self.bm, bn), p.batch_total), self.smem_bytes(bn, stages, x3),
                            (self.bm, bn, self.bk), details, arch_suffix="a")

    def map_specs(self, p: Problem, cfg: KernelConfig):
        """Tensor-map geometry of A and B for launch problem ``p``: dims (K, rows, batch_inner,
        batch_outer) for a K-major operand, (rows, K, ...) with 32-row boxes for the m-contiguous
        A of A_MN; a broadcast batch dim collapsed to size 1; and the kernel's broadcast bits (bit
        set: that operand walks that batch dim)."""
        outer = max(1, p.batch_total // max(p.batch_inner, 1))
        a_mn = dict(cfg.macros).get("A_MN", 0) == 1
        bits = 0
        specs = []
        for i, (rows, pitch, (s0, s1), box_rows, mn) in enumerate((
                (p.M, p.a_strides[1] if a_mn else p.a_strides[0], p.a_batch_strides, self.bm, a_mn),
                (p.N, p.b_strides[1], p.b_batch_strides, cfg.tile[1], False))):
            extent = max((p.K if mn else rows) * pitch * 4, 16)
            inner_n, inner_s = (p.batch_inner, s1 * 4) if s1 and p.batch_inner > 1 else (1, extent)
            outer_n, outer_s = (outer, s0 * 4) if s0 and outer > 1 else (1, extent)
            bits |= (1 if inner_n > 1 else 0) << (2 * i)
            bits |= (1 if outer_n > 1 else 0) << (2 * i + 1)
            dims, box = ((rows, p.K), (32, self.bk)) if mn else ((p.K, rows), (self.bk, box_rows))
            specs.append(MapSpec(dims + (inner_n, outer_n), (pitch * 4, inner_s, outer_s), box + (1, 1)))
        return specs[0], specs[1], bits

    def staging(self, p: Problem, dev: DeviceFacts, option: tuple[int, ...] | None = None
                ) -> tuple[Problem, tuple[tuple[str, int, int], ...], bool]:
        """How the wgmma family reads ``p``: (launch problem, K-major copies to make first, swap).

        tf32 reads in place a K-major or m-contiguous A with a K-major B, and an n-contiguous B with
        a K-major A by swapping (:meth:`in_place_form`). Otherwise it copies one
        operand into K-major buffers (one per matrix of its batch: stage_kmajor.kmajor_batch), A as
        M x K4 or B as its transpose N x K4, and both only when neither can be read in place. tf32x3
        always copies both: the copy makes the big and small halves. Rows are padded to 16 bytes; the
        maps still say K, so the padding is never read."""
        k4 = -(-p.K // 4) * 4
        split = p.precision == "tf32x3"
        form = None if split else self.in_place_form(p)
        if form is not None:
            return (transposed(p), (), True) if form == "swap" else (p, (), False)

        original = p

        def dense_batch(which, rows):  # batch strides of the copies: matrix after matrix
            n1, _, s0, s1 = kmajor_batch(original, which)
            return (n1 * rows * k4 if s0 else 0, rows * k4 if s1 else 0)

        def copy_a(q):
            return replace(q, a_strides=(k4, 1), a_align=16, a_batch_strides=dense_batch("a", q.M)), ("a", q.M, k4)

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
        if split or not self.a_ready(p):
            p, entry = copy_a(p)
            staged.append(entry)
        if split or not self.b_ready(p):
            p, entry = copy_bt(p)
            staged.append(entry)
        return p, tuple(staged), False

    def heuristic_reason(self, p: Problem, dev: DeviceFacts) -> str | None:
        """Why the wgmma family should not take ``p`` although it could (heuristics, not limits):
        too few tiles for the SMs, or copies that would cost too much next to the product."""
        blocks = -(-p.M // 128) * -(-p.N // 128) * p.batch_total
        share = WGMMA_MIN_SM_FRACTION[p.precision]
        if blocks < share * dev.sm_count:
            return (f"{blocks} tiles of 128x128 fill under 1/{round(1 / share)} of the {dev.sm_count} SMs, and this "
                    "family does not split K")
        _, staged, _ = self.staging(p, dev)
        x3 = p.precision == "tf32x3"
        per_element = 12 if x3 else 8  # read, write (twice when split)
        moved = sum(per_element * rows * cols * kmajor_batch(p, which)[1] for which, rows, cols in staged)
        # The alternative, tf32_mma, is much slower (H200: TF32 120 vs 350 TFLOP/s; tf32x3 24-28 vs
        # 115): with copies at ~3 TB/s, wgmma + copies is faster above ~60 FLOP per copied byte for
        # tf32 and ~10 for tf32x3. Asked: about twice that.
        need = WGMMA_COPY_MIN_FLOP_PER_BYTE["tf32x3" if x3 else "tf32"]
        if staged and 2 * p.M * p.N * p.K * p.batch_total < need * moved:
            names = " and ".join("B (transposed)" if w == "bt" else "A" for w, _, _ in staged)
            return f"needs a K-major copy of {names}, too costly next to a product this small"
        return None

    def stagers(self, p, staging):
        return tuple(stage_kmajor_config(p, which, p.precision == "tf32x3") for which, _, _ in staging)

    def describe_staging(self, p, which, rows, cols):
        what = "B transposed" if which == "bt" else which.upper()
        copies = kmajor_batch(p, which)[1]
        each = f"{copies} x {rows}x{cols}" if copies > 1 else f"{rows}x{cols}"
        if p.precision == "tf32x3":
            return f"{what} split into big and small TF32 halves, K-major ({each} each; stage_kmajor)"
        return (f"{what} copied K-major ({each}, 16-byte aligned rows; stage_kmajor): TF32 wgmma needs one "
                "operand K-major in shared memory (the other may come through registers), and a tensor map "
                "cannot read this one that way")

    def precision_computed(self, p):
        return p.precision
