"""The staging pass of the wgmma family (cuda_src/stage_kmajor.cu): an operand copied into dense
K-major buffers (one per matrix of its batch), split into big and small TF32 halves for tf32x3.
Not a GEMM family: the wgmma family names it as its stager."""
from __future__ import annotations

from ..problem import Problem
from .base import KernelConfig, grid_of, vec_ok


def kmajor_source(p: Problem, which: str) -> tuple[int, int, int, int]:
    """(rows, row stride, k stride, pointer alignment) of the operand the staging pass reads:
    A as it is (rows = M), or B read as B^T (rows = N). The kernel's arguments and its macros
    both come from here."""
    if which == "a":
        return p.M, p.a_strides[0], p.a_strides[1], p.a_align
    return p.N, p.b_strides[1], p.b_strides[0], p.b_align


def kmajor_batch(p: Problem, which: str) -> tuple[int, int, int, int]:
    """(batch_inner, batch_total, s0, s1) of the matrices the staging pass copies for operand
    ``which``: the problem's batch dims that this operand has (a broadcast dim, stride 0, is
    copied once, so it has size 1 here), with the operand's strides for them."""
    s0, s1 = p.a_batch_strides if which == "a" else p.b_batch_strides
    outer = p.batch_total // p.batch_inner if p.batch_inner else 0
    n1 = p.batch_inner if s1 and p.batch_inner > 1 else 1
    n0 = outer if s0 and outer > 1 else 1
    return n1, n0 * n1, s0 if n0 > 1 else 0, s1 if n1 > 1 else 0


def stage_kmajor_config(p: Problem, which: str, split: bool) -> KernelConfig:
    """The staging pass of the wgmma family (cuda_src/stage_kmajor.cu): operand ``which`` ("a", or
    "bt" for B transposed) copied into a dense K-major buffer (one per matrix of its batch), split
    into TF32 halves for tf32x3."""
    rows, s_rows, s_k, align = kmajor_source(p, which)
    _, copies, s0, s1 = kmajor_batch(p, which)
    r_contig = s_rows == 1 and s_k != 1
    # float4 reads along the contiguous dim: the other stride, the batch strides and the pointer
    # 16-byte aligned
    vec = vec_ok(4, s_k if r_contig else s_rows, (s0, s1), align) and (s_rows == 1 if r_contig else s_k == 1)
    tiles = -(-rows // 64) * -(-p.K // 64)
    what = "split into big and small TF32 halves" if split else "copied"
    return KernelConfig("stage_kmajor", "stage_kmajor.cu", "fastmm_stage_kmajor",
                        (("SRC_R_CONTIG", int(r_contig)), ("SRC_VEC", int(vec)), ("SPLIT", int(split))), 256,
                        (256, 1, 1), grid_of(tiles, copies), 0, (64, 64, 0),
                        (("what", f"{'B^T' if which == 'bt' else 'A'} {what}, K-major, "
                                  + ("transposed through shared memory" if r_contig else "row by row")),))
