"""The skinny family (cuda_src/skinny.cu): M <= 32, GEMV-like, every element of B read once
(memory-bound); split-K where the columns alone do not fill the GPU, summed in a fixed order
(by the kernel itself or by splitk_reduce)."""
from __future__ import annotations

from dataclasses import dataclass

from .base import DEFAULT_SMEM, Family, KernelConfig, as_dependent_launch, grid_of, vec_ok, with_split_flags
from .work_split import MAX_SPLIT, SPLIT_COST, effective_split


@dataclass(frozen=True)
class Skinny(Family):
    """M <= 32: a GEMV-like kernel that reads every element of B exactly once (memory-bound)."""

    name, source, entry = "skinny", "skinny.cu", "fastmm_skinny"
    min_cc = (7, 5)
    precisions = ("ieee", "tf32", "tf32x3")  # fp32 FMA: as accurate as any; B's bytes set the speed
    max_m = 32
    cols = 128
    #: Skinny v2 (SK_V2 = 1 in skinny.cu; benchmarks/NOTES.md "skinny v2") where it was measured
    #: faster: on the H200, 128 columns x 8 per thread beat the v1 kernel at every M (decode16
    #: 25.8 us vs 58.0, 3.1x cuBLAS; M = 1 1.6x, M = 32 2.3x, 16 x 8192^2 2.7x faster than v1;
    #: NOTES run 9). Other archs keep v1 until measured there.
    V2_BY_CC = {(9, 0): {"bn": 128, "cpt": 8}}
    #: Split-K plans of the v2 kernel with up to 8 outputs per thread sum their slices in the
    #: kernel (the last block of a column tile to finish), not in a second launch. On the H200
    #: (NOTES run 14): M = 1 21.3 us against 22.2, 16 x 8192^2 71.0 against 72.8, decode16 25.7
    #: against 25.9; M = 32 (16 outputs per thread) 42.7 against 40.9, so it keeps the second
    #: pass. False: splitk_reduce everywhere, as before.
    fuse_split: bool = True
    #: The kernel: None follows V2_BY_CC; "v1" the v1 kernel; :meth:`configure_v2` keywords
    #: (e.g. ``{"bn": 64}``, kept as sorted pairs so the family stays hashable) that v2 geometry.
    variant: str | tuple | None = None

    def __post_init__(self):
        if isinstance(self.variant, dict):  # frozen: set once, here
            object.__setattr__(self, "variant", tuple(sorted(self.variant.items())))

    def reject(self, p, dev):
        reason = super().reject(p, dev)
        if reason is None and p.M > self.max_m:
            reason = f"M = {p.M} > {self.max_m}: not skinny"
        return reason

    def options(self, p, dev):
        """One tile (set by M); split-K allowed or not."""
        return with_split_flags(((),))

    #: From this compute capability the kernel is launched with programmatic dependent launch
    #: (KernelConfig.dependent_launch): back-to-back calls then overlap one's launch with the
    #: other's last blocks. On the H200, decode16 3.09 -> 3.15x torch (NOTES run 15). Only this
    #: family: its ~150 KB blocks cannot sit next to the running kernel's blocks, while with
    #: every kernel launched that way the next kernel's early blocks slowed the running GEMM on
    #: the SMs they shared (largeK GEMM 170.6 -> 174.6 us, square1000 0.92 -> 0.74x torch).
    dependent_launch_cc = (9, 0)

    def configure(self, p, dev, option=None):
        v2 = self.V2_BY_CC.get(dev.cc) if self.variant is None else self.variant
        if isinstance(v2, tuple):
            v2 = dict(v2)
        if isinstance(v2, dict):
            cfg = self.configure_v2(p, dev, option, **v2)
        else:
            cfg = self.configure_v1(p, dev, option)
        return as_dependent_launch(cfg, dev, self.dependent_launch_cc)

    def configure_v1(self, p, dev, option=None):
        """The v1 kernel (SK_V2 = 0): one 256-thread block per SM, lanes own 4 columns each."""
        mt = 8 if p.M <= 8 else 16 if p.M <= 16 else 32
        kchunk = 128 if mt == 32 else 256
        sBk, sBn = p.b_strides
        b_vec = sBn == 1 and vec_ok(p.N, sBk, p.b_batch_strides, p.b_align)
        tiles = max(1, -(-p.N // self.cols))
        split = 1
        if p.batch_total == 1 and (option is None or option[0]):  # one block per SM; aim for about two waves
            chunks = -(-p.K // kchunk)
            split = effective_split(chunks, max(1, min(chunks, -(-2 * dev.sm_count // tiles), MAX_SPLIT)))
        details = (("rows per thread", f"{mt} (M = {p.M})"),
                   ("B loads", "float4, each element once" if b_vec else "single floats, each element once"),
                   ("math", "fp32 FFMA; warps' partials summed in a fixed order"))
        if split > 1:
            details += (("split-K", f"{split} slices of K, reduced by splitk_reduce"),)
        return KernelConfig(self.name, self.source, self.entry, (("MT", mt), ("B_VEC", int(b_vec))), 256,
                            (256, 1, 1), grid_of(tiles, p.batch_total, split), 0, (mt, self.cols, kchunk), details)

    @staticmethod
    def v2_geometry(M, *, bn=32, cpt=8, threads=256, qpt=1):
        """(mt, lanes_n, k-groups, k rows per stage) of skinny.cu v2, checked as its static_asserts
        check them; ValueError for a geometry the kernel rejects."""
        lanes_n = bn // cpt if cpt in (4, 8) and bn % cpt == 0 else 0
        if lanes_n not in (4, 8, 16, 32) or threads % 32 or not 32 <= threads <= 1024 or qpt < 1:
            raise ValueError(f"skinny v2: no geometry bn={bn} cpt={cpt} threads={threads} qpt={qpt}")
        mt = -(-M // 4) * 4  # A is read as float4 along m; MT*CPT >= 16 >= GPW, as the exchange needs
        kg = threads // lanes_n
        return mt, lanes_n, kg, 4 * kg * qpt

    def configure_v2(self, p, dev, option=None, *, pipe=None, bn=32, cpt=8, threads=256, qpt=1, stages=None,
                     split=None, minb=1, runroll=None, fuse=None):
        """Skinny v2 (SK_V2 = 1): ``bn`` columns per block, ``cpt`` (4 or 8) per thread,
        ``threads`` per block, ``qpt`` quads of k per thread per stage. ``pipe`` 1: a cp.async ring
        of ``stages`` (sm80+; default the deepest of 4..2 that fits), 0: B through registers one
        stage ahead (any arch); default 1 on sm80+. ``split``: K splits (None: a wave model over
        ``minb`` blocks per SM; option (0,) forbids splitting, as for configure). ``runroll``: k rows
        unrolled in the FMA loop (default 4; 1 where registers are tight). Where the sums and
        operands would not fit the register budget (M rounded up x cpt accumulators) or a stage
        the shared memory, qpt, then cpt, then threads are reduced (the details say so).
        ``fuse``: a split's slices summed by the kernel itself (default :attr:`fuse_split`)."""
        pipe = int(dev.cc >= (8, 0)) if pipe is None else int(pipe)
        if pipe and dev.cc < (8, 0):
            raise ValueError("skinny v2 pipe=1 needs cp.async (sm80+)")
        sAm, sAk = p.a_strides
        sBk, sBn = p.b_strides
        a_vec = sAk == 1 and vec_ok(p.K, sAm if p.M > 1 else 0, p.a_batch_strides, p.a_align)
        b_vec = sBn == 1 and vec_ok(p.N, sBk, p.b_batch_strides, p.b_align)
        asked = (cpt, threads, qpt)
        limit = dev.smem_per_block_optin
        while True:  # shrink the per-thread tile until registers (no spills) and shared memory fit
            mt, lanes_n, kg, ks = self.v2_geometry(max(p.M, 1), bn=bn, cpt=cpt, threads=threads, qpt=qpt)
            budget = min(255, 65536 // (threads * minb) // 8 * 8)
            # sums, operands, addresses and loads hoisted ahead: calibrated with ptxas -v on
            # sm_75..sm_90 (benchmarks/probes/skinny_v2_ptxas.py), where these keep every kernel spill-free
            one_row = runroll == 1 or (runroll is None and budget <= 128)  # FMA loop one k row at a time
            if pipe:
                need = mt * cpt + (64 if one_row else 96)
            else:  # + the next stage's share of B (4-byte loads: and their addresses) and of A
                need = mt * cpt + 4 * qpt * cpt * (1 if b_vec else 2) + mt * ks // threads + 64
            a_pitch = mt + 4 if mt % 8 == 0 else mt  # skinny.cu AP, BNP, STAGE_FLOATS
            stage_floats = ks * (bn + (4 if lanes_n == 4 else 0)) + ks * a_pitch
            if not pipe:
                n_stages = 2  # two slots, filled from registers
            elif stages is None:  # the deepest ring that fits
                n_stages = next((s for s in (4, 3) if s * stage_floats * 4 <= limit), 2)
            else:
                n_stages = stages
            ring = n_stages * stage_floats
            red = threads // 32  # reduction slots: one per warp unless that alone needs more smem
            while red > 1 and red * mt * bn * 4 > max(ring * 4, DEFAULT_SMEM):
                red //= 2
            smem = max(ring, red * mt * bn) * 4
            if need <= budget and smem <= limit:
                break
            if qpt > 1 and (not pipe or smem > limit):
                qpt //= 2
            elif cpt == 8 and bn // 4 <= 32:
                cpt = 4
            elif threads > 256 or (smem > limit and threads > 64):
                threads //= 2
            elif smem > limit:
                raise ValueError(f"skinny v2 needs {smem} B of shared memory per block, the device allows {limit}")
            else:
                raise ValueError(f"skinny v2: M = {p.M} needs ~{need} registers per thread, {budget} available")
        stages = n_stages
        if runroll is None:  # one row at a time where registers are tight (ptxas hoists less)
            runroll = 1 if budget <= 128 or need > budget - (24 if pipe else 40) else 4
        tiles = max(1, -(-p.N // bn))
        units = max(1, -(-p.K // ks))  # (K = 0: nothing to split; fastmm.dispatch writes zeros)
        if p.batch_total != 1 or (option is not None and not option[0]):
            s = 1
        elif split is not None:
            s = effective_split(units, max(1, min(split, units, MAX_SPLIT)))
        else:  # waves of blocks, as split_k_for, but a split may hold a single stage
            slots = dev.sm_count * minb
            s = min(range(1, min(units, MAX_SPLIT) + 1),
                    key=lambda n: (-(-tiles * n // slots) / n * (1 + SPLIT_COST * (n - 1)), n))
            s = effective_split(units, s)
        a_vec = a_vec and not pipe  # float4 A loads: the register path only (cp.async transposes A)
        macros = (("SK_V2", 1), ("MT", mt), ("B_VEC", int(b_vec)), ("A_VEC", int(a_vec)),
                  ("A_KFAST", int(sAk == 1 or sAm != 1)), ("SK_PIPE", pipe),
                  ("SK_THREADS", threads), ("SK_BN", bn), ("SK_CPT", cpt), ("SK_QPT", qpt), ("SK_STAGES", stages),
                  ("SK_RED", red), ("SK_MINB", minb), ("SK_RUNROLL", runroll))
        # (the register path, SK_PIPE 0, is at its register limit already: the extra state of
        # the fused sums spilled there; it keeps the second pass. More than 8 outputs per thread
        # (M = 32: 16) take the last block two rounds of loads: slower than the second pass)
        fused = (s > 1 and bool(pipe) and mt * bn <= 8 * threads
                 and (self.fuse_split if fuse is None else bool(fuse)))
        if fused:
            macros += (("SK_FUSED", 1),)
        details = (("rows per thread", f"{mt} (M = {p.M})"),
                   ("B loads", ("cp.async ring, %d stages of %d k" % (stages, ks) if pipe else
                                "to registers one stage (%d k) ahead, then to shared memory" % ks)
                    + (", 16-byte" if b_vec else ", 4-byte")),
                   ("math", f"fp32 FFMA, {cpt} columns x {mt} rows per thread; k-groups summed in a fixed tree"))
        if (cpt, threads, qpt) != asked:
            details += (("fitted", "cpt %d, threads %d, qpt %d (asked %d, %d, %d): the asked tile needs more "
                                   "registers or shared memory than there are" % (cpt, threads, qpt, *asked)),)
        if s > 1:
            details += (("split-K", f"{s} slices of K, " + (
                "summed in slice order by the last block of each column tile (no second launch)" if fused
                else "reduced by splitk_reduce")),)
        return KernelConfig(self.name, self.source, self.entry, macros, threads, (threads, 1, 1),
                            grid_of(tiles, p.batch_total, s), smem, (mt, bn, ks), details,
                            split_fused=fused)
