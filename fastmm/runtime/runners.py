"""What one launch of a multi-kernel plan queues, prepared once per plan: a ``run(pa, pb, pc,
stream, epi=())`` closure over everything that does not change between calls, so the full path (fastmm.dispatch,
once per launch offset) and the steady-state path (fastmm.fast_path) queue the same work.

- split-K: the GEMM into a workspace, then the fixed-order reduce pass; or, for a fused plan,
  the GEMM alone, whose last block per tile does that sum (with the stream's arrival counters);
- stream-K: whole tiles into C, the rest in pieces into a workspace, then the fixup pass (in the
  head form the whole tiles in a plain launch of their own first, over C's first rows);
- wgmma: its K-major copies (stage_kmajor), the tensor maps, the GEMM (through
  ``launcher.maps_launcher``);
- a pointer family's staged plan: its row-major copies (stage_kmajor), then any of the above.

``epi`` is a fused epilogue's arguments (D's pointer, then :func:`epilogue_tail`; empty for a plan
without one),
passed to the launches that finish outputs: those built with EPILOGUE = 1 (``plan.with_epilogue``).

Module attributes (``launcher.launch``, ``tensor_map.encode``) are looked up per call, so tests
can replace them.
"""
from __future__ import annotations

import struct
from dataclasses import replace

import torch

from ..families import FAMILIES, kmajor_batch, kmajor_source, row_copy_source
from ..problem import Problem
from . import arrivals, launcher, tensor_map


def gemm_args(p: Problem) -> tuple:
    """The arguments after the A, B and C pointers of every GEMM family's kernel (FASTMM_PARAMS
    in cuda_src/common.cuh) for launch problem ``p``."""
    return (p.M, p.N, p.K, *p.a_strides, *p.b_strides, *p.c_strides, p.batch_inner, p.batch_total,
            *p.a_batch_strides, *p.b_batch_strides, *p.c_batch_strides)


def float_bits(x: float) -> int:
    """The bits of ``x`` as a float32, as the kernels read alpha and beta (the launcher passes
    64-bit integers only)."""
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def epilogue_tail(d_strides: tuple[int, int], alpha, beta, swap_ab: bool) -> tuple:
    """The fused epilogue's kernel arguments after D's pointer (FASTMM_EPILOGUE_PARAMS in
    cuda_src/common.cuh), for D with strides (along M, along N) of the requested product; a plan
    computing C^T (``swap_ab``) sees D transposed as well."""
    sm, sn = d_strides
    if swap_ab:
        sm, sn = sn, sm
    return (sm, sn, float_bits(alpha), float_bits(beta))


def split_gemm_args(p: Problem) -> tuple:
    """:func:`gemm_args` for the GEMM of a split-K plan: C is a workspace of contiguous M x N
    slices, the slice stride passed as C's batch stride (the kernel adds blockIdx.y of them, or
    blockIdx.y / 2 for cluster pairs)."""
    return (p.M, p.N, p.K, *p.a_strides, *p.b_strides, p.N, 1,
            1, 1, *p.a_batch_strides, *p.b_batch_strides, p.M * p.N, 0)


def split_runner(loaded, reduce, split: int, p: Problem, device):
    """Split-K over ``split`` slices of K for launch problem ``p`` (a batch of 1): the partial
    products go into ``split`` contiguous M x N slices of a workspace, then the reduce pass sums
    them into C in a fixed order. The workspace may be dropped on return: the caching allocator
    is stream-ordered."""
    tail = split_gemm_args(p)
    reduce_tail = (p.M, p.N, split, *p.c_strides)
    work_floats = split * p.M * p.N

    def run(pa: int, pb: int, pc: int, stream: int, epi: tuple = ()) -> None:
        work = torch.empty(work_floats, dtype=torch.float32, device=device)
        launcher.launch(loaded, stream, (pa, pb, work.data_ptr()) + tail)
        launcher.launch(reduce, stream, (work.data_ptr(), pc) + reduce_tail + epi)
    return run


def fused_split_runner(loaded, cfg, p: Problem, device):
    """A split-K plan that sums its own slices (``cfg.split_fused``): one launch, which writes
    the workspace slices and then, per tile, the sum into C; it also takes C's strides and the
    stream's zeroed arrival counters."""
    tail = split_gemm_args(p)
    out_strides = tuple(p.c_strides)
    work_floats, n_counters = cfg.split_k * p.M * p.N, cfg.arrival_counters

    def run(pa: int, pb: int, pc: int, stream: int, epi: tuple = ()) -> None:
        work = torch.empty(work_floats, dtype=torch.float32, device=device)
        count = arrivals.counters(device, stream, n_counters)
        launcher.launch(loaded, stream, (pa, pb, work.data_ptr()) + tail + (pc,) + out_strides + (count.data_ptr(),) + epi)
    return run


def stream_k_runner(loaded, fixup, cfg, p: Problem, device, head=None):
    """A stream-K launch (``cfg.stream_k``) of launch problem ``p`` (a batch of 1): whole tiles
    straight into C, the other tiles' pieces into a workspace (one dense tile per slot), then the
    fixup pass sums each tile's pieces in a fixed order into C. The workspace may be dropped on
    return: the caching allocator is stream-ordered.

    In the head form (``StreamK.head_rows``) ``head``, the plain kernel, first computes C's first
    rows; the stream-K launch and its fixup then see the problem of the rows after them: A, C
    and a fused epilogue's D moved down by those rows (D's row stride may be 0: a bias)."""
    sk, (bm, bn, _) = cfg.stream_k, cfg.tile
    rows = sk.head_rows
    assert head is not None or not rows, "a stream-K plan in the head form needs its plain kernel"
    head_tail = gemm_args(replace(p, M=rows)) if rows else ()
    rest = replace(p, M=p.M - rows) if rows else p
    a_down, c_down = 4 * rows * p.a_strides[0], 4 * rows * p.c_strides[0]  # bytes
    tail = gemm_args(rest)
    numbers = (sk.whole_tiles, sk.iters)
    fixup_tail = (rest.M, rest.N, *rest.c_strides, bm, bn, sk.k_tiles, sk.whole_tiles, sk.iters)
    work_floats = sk.workspace_floats(bm, bn)

    def run(pa: int, pb: int, pc: int, stream: int, epi: tuple = ()) -> None:
        work = torch.empty(work_floats, dtype=torch.float32, device=device)
        if rows:
            launcher.launch(head, stream, (pa, pb, pc) + head_tail + epi)
            pa, pc = pa + a_down, pc + c_down
            if epi:
                epi = (epi[0] + 4 * rows * epi[1],) + epi[1:]
        launcher.launch(loaded, stream, (pa, pb, pc) + tail + (work.data_ptr(),) + numbers + epi)
        launcher.launch(fixup, stream, (work.data_ptr(), pc) + fixup_tail + epi)
    return run


def plan_runner(loaded, second, cfg, p: Problem, device, head=None):
    """The runner of a SIMT-style plan (not wgmma) that is more than one plain launch: a fused
    split-K, stream-K with its fixup ``second`` (and in the head form its plain launch ``head``
    first), or split-K with its reduce ``second``. None for a single plain launch."""
    if cfg.split_fused:
        return fused_split_runner(loaded, cfg, p, device)
    if cfg.stream_k is not None:
        return stream_k_runner(loaded, second, cfg, p, device, head)
    if second is not None:
        return split_runner(loaded, second, cfg.split_slices, p, device)
    return None


def runner_for(plan, loaded, second, p: Problem, device):
    """The runner of ``plan`` (launch problem ``p``) by its family's launch form: the tensor-map
    runner, or for pointer families :func:`plan_runner` (None: one plain launch)."""
    if FAMILIES[plan.kernel.family].launch_form == "tensor_maps":
        return wgmma_runner(plan, loaded, p, device)
    head = launcher.load(plan.device, plan.head) if plan.head is not None else None  # (loaded with the plan)
    inner = plan_runner(loaded, second, plan.kernel, p, device, head)
    if plan.stagers:
        return rows_staging_runner(plan, inner, loaded, p, device)
    return inner


def rows_staging_runner(plan, inner, loaded, p: Problem, device):
    """A pointer-family plan whose operands are first copied row-major by their stagers
    (stage_kmajor.cu; one matrix each, the planner stages batch-1 problems only): each copy into
    a fresh zero-padded buffer, then the GEMM (``inner``, or one plain launch) on the copies. The
    buffers may be dropped on return: the caching allocator is stream-ordered, so their memory
    is not handed out again before the GEMM queued after them has run."""
    copies = []  # (copies A?, buffer floats, loaded stager, its arguments after (src, dst, dst2))
    for (which, rows, pitch), stager in zip(plan.staging, plan.stagers):
        _, cols, s_rows, s_cols, _ = row_copy_source(plan.problem, which)
        copies.append((which == "a", rows * pitch, launcher.load(plan.device, stager),
                       (rows, cols, s_rows, s_cols, pitch, 1, 1, 0, 0)))
    tail = gemm_args(p)

    def run(pa: int, pb: int, pc: int, stream: int, epi: tuple = ()) -> None:
        staged = []  # referenced until the GEMM is queued
        for is_a, floats, stager, args in copies:
            buf = torch.empty(floats, dtype=torch.float32, device=device)
            staged.append(buf)
            dst = buf.data_ptr()
            launcher.launch(stager, stream, (pa if is_a else pb, dst, dst) + args)
            if is_a:
                pa = dst
            else:
                pb = dst
        if inner is not None:
            inner(pa, pb, pc, stream, epi)
        else:
            launcher.launch(loaded, stream, (pa, pb, pc) + tail + epi)
    return run


def wgmma_runner(plan, loaded, p: Problem, device: torch.device):
    """``run(pa, pb, pc, stream)`` queues one launch of a wgmma plan (launch problem ``p``) on
    operands at pa, pb and C at pc: first the staging kernels, if any (K-major copies into
    buffers on ``device``; for tf32x3 the big and small halves), then the GEMM, which reads A and
    B through tensor maps. The maps hold the data pointers, so they are looked up (or encoded,
    ~3 us) per call. A split plan (SPLIT) writes its slices into a fresh workspace and takes the
    stream's zeroed arrival counters, as :func:`fused_split_runner` does."""
    x3 = plan.precision_used == "tf32x3"
    spec_a, spec_b, bits = FAMILIES["wgmma_tf32"].map_specs(p, plan.kernel)
    spec_c = FAMILIES["wgmma_tf32"].c_map_spec(p, plan.kernel)  # (None: C stored from registers)
    split = plan.kernel.split_k if plan.kernel.split_fused else 1
    if split > 1:  # (SPLIT: C is a workspace of M x N slices; then C itself, its strides, counters)
        s_wm, s_wn, slice_floats = FAMILIES["wgmma_tf32"].split_workspace(p, plan.kernel)
        tail = (p.M, p.N, p.K, s_wm, s_wn, 1, 1, slice_floats, 0, bits)
        out_strides = tuple(p.c_strides)
        work_floats, n_counters = split * slice_floats, plan.kernel.arrival_counters
    else:
        tail = (p.M, p.N, p.K, *p.c_strides, p.batch_inner, p.batch_total, *p.c_batch_strides, bits)
    swap, gemm = plan.swap_ab, launcher.maps_launcher(loaded)
    copies = []  # (copies A?, buffer shape, loaded stager, its arguments after (src, big, small))
    for (which, rows, cols), stager in zip(plan.staging, plan.stagers):
        _, s_rows, s_k, _ = kmajor_source(plan.problem, which)
        inner, total, s0, s1 = kmajor_batch(plan.problem, which)
        halves = dict(stager.macros)["SPLIT"] == 1  # (tf32x3's halves; B's fp32 copy where the kernel splits it)
        copies.append((which == "a", halves, (2 if halves else 1, total, rows, cols), launcher.load(plan.device, stager),
                       (rows, plan.problem.K, s_rows, s_k, cols, inner, total, s0, s1)))

    def run(pa: int, pb: int, pc: int, stream: int, epi: tuple = ()) -> None:
        a_parts, b_parts = (pa,), (pb,)
        staged = []  # referenced until the GEMM is queued (the allocator is stream-ordered)
        for is_a, halves, shape, stager, args in copies:
            buf = torch.empty(shape, dtype=torch.float32, device=device)
            staged.append(buf)
            big = buf.data_ptr()
            parts = (big, big + buf.stride(0) * 4) if halves else (big,)
            launcher.launch(stager, stream, ((a_parts if is_a else b_parts)[0], parts[0], parts[-1]) + args)
            if is_a:
                a_parts = parts
            else:
                b_parts = parts
        if swap:  # the kernel's A is B (its B is A, or A's copy): C^T = B^T A^T
            a_parts, b_parts = b_parts, a_parts
        encode = tensor_map.encode
        if x3:  # two halves of each operand, TF32 already (B alone in fp32 where the kernel splits it): fp32 maps
            maps = tuple([encode(ptr, spec_a, tf32=False) for ptr in a_parts]
                         + [encode(ptr, spec_b, tf32=False) for ptr in b_parts])
        else:  # one part each (the operand or its copy); the copy engine rounds to TF32
            maps = (encode(a_parts[0], spec_a, tf32=True), encode(b_parts[0], spec_b, tf32=True))
        if spec_c is not None:  # fp32: the copy engine must not round C to TF32
            maps += (encode(pc, spec_c, tf32=False),)
        if split > 1:
            work = torch.empty(work_floats, dtype=torch.float32, device=device)
            staged.append(work)
            count = arrivals.counters(device, stream, n_counters)
            gemm(stream, maps, (work.data_ptr(),) + tail + (pc,) + out_strides + (count.data_ptr(),) + epi)
        else:
            gemm(stream, maps, (pc,) + tail + epi)
    return run
