"""The staging pass (cuda_src/stage_kmajor.cu): an operand copied into dense rows of a 16-byte
pitch. For the wgmma family, K-major buffers (one per matrix of its batch), split into big and
small TF32 halves for tf32x3; for the pointer families, a row-major copy of one matrix (B^T of a
K-contiguous B, or rows that 16-byte copies cannot read in place). Not a GEMM family: the
families name it as their stager."""
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


def _stage_config(rows: int, cols: int, s_rows: int, s_cols: int, align: int, copies: int, s0: int, s1: int,
                  split: bool, what: str) -> KernelConfig:
    """stage_kmajor.cu copying ``copies`` matrices of ``rows`` x ``cols`` (strides s_rows, s_cols;
    batch strides s0, s1) into dense rows of a 4-float pitch."""
    r_contig = s_rows == 1 and s_cols != 1
    # float4 reads along the contiguous dim: the other stride, the batch strides and the pointer
    # 16-byte aligned
    vec = vec_ok(4, s_cols if r_contig else s_rows, (s0, s1), align) and (s_rows == 1 if r_contig else s_cols == 1)
    tiles = -(-rows // 64) * -(-cols // 64)
    return KernelConfig("stage_kmajor", "stage_kmajor.cu", "fastmm_stage_kmajor",
                        (("SRC_R_CONTIG", int(r_contig)), ("SRC_VEC", int(vec)), ("SPLIT", int(split))), 256,
                        (256, 1, 1), grid_of(tiles, copies), 0, (64, 64, 0),
                        (("what", what + (", transposed through shared memory" if r_contig else ", row by row")),))


def stage_kmajor_config(p: Problem, which: str, split: bool) -> KernelConfig:
    """The staging pass of the wgmma family (cuda_src/stage_kmajor.cu): operand ``which`` ("a", or
    "bt" for B transposed) copied into a dense K-major buffer (one per matrix of its batch), split
    into TF32 halves for tf32x3."""
    rows, s_rows, s_k, align = kmajor_source(p, which)
    _, copies, s0, s1 = kmajor_batch(p, which)
    what = "split into big and small TF32 halves" if split else "copied"
    return _stage_config(rows, p.K, s_rows, s_k, align, copies, s0, s1, split,
                         f"{'B^T' if which == 'bt' else 'A'} {what}, K-major")


def row_copy_source(p: Problem, which: str) -> tuple[int, int, int, int, int]:
    """(rows, columns, row stride, column stride, pointer alignment) of operand ``which`` as a
    row-major copy of it reads it: A as M rows of K, B as K rows of N. The copy's kernel
    arguments and its macros both come from here."""
    if which == "a":
        return p.M, p.K, p.a_strides[0], p.a_strides[1], p.a_align
    return p.K, p.N, p.b_strides[0], p.b_strides[1], p.b_align


def stage_rows_config(p: Problem, which: str) -> KernelConfig:
    """A row-major copy of operand ``which`` ("a" or "b", one matrix) into rows of a pitch rounded
    up to 4 floats, zero-padded: the stager of the pointer families (simt_cp_async, tf32_mma),
    whose 16-byte cp.async reads rows along their contiguous dim. The same kernel as the wgmma
    family's K-major copies: a row-major B is "K-major" with N in K's place. From a K-contiguous B
    (nn.Linear's weight) it is a transpose, through shared memory."""
    rows, cols, s_rows, s_cols, align = row_copy_source(p, which)
    return _stage_config(rows, cols, s_rows, s_cols, align, 1, 0, 0, False,
                         f"{which.upper()} copied row-major ({rows} rows of {cols})")
