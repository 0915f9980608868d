"""fastmm.shapes on CPU tensors: how a call becomes a Problem for the planner (matmul's shape
rules, batch dims collapsed, strides and pointer alignment read off the tensors, launch offsets),
and what ``out=`` needs (torch's resize rule and its warning, overlap tests, byte extents)."""
from __future__ import annotations

import warnings

import pytest
import torch

from fastmm.families import LOAD_ELEM_FAST, LOAD_ELEM_K, LOAD_VEC_FAST, LOAD_VEC_K, Skinny
from fastmm.plan import select
from fastmm.problem import DeviceFacts
from fastmm.shapes import (analyse, build_problem, collapse_batch, extent, has_internal_overlap, overlaps,
                           pointer_align, resize_out, result_matrix)

SM90 = DeviceFacts.simulated_device("sm_90")
V1 = (Skinny(variant="v1"),)  # the v1 skinny kernel, whose macros are just MT and B_VEC


def _align_of(t: torch.Tensor) -> int:
    return next(n for n in (16, 8, 4, 1) if t.data_ptr() % n == 0)


def _problem(a, b, c=None, precision="ieee"):
    s = analyse(a, b)
    if c is None:
        c = torch.empty(s.batch + (s.M, s.N))
    return build_problem(s, c, precision)


# --- matmul's shape rules -------------------------------------------------------------------------

@pytest.mark.parametrize("sa,sb,batch,mnk,out_shape", [
    ((4,), (4,), (), (1, 1, 4), ()),
    ((4,), (4, 5), (), (1, 5, 4), (5,)),
    ((3, 4), (4,), (), (3, 1, 4), (3,)),
    ((2, 3, 4), (4,), (), (6, 1, 4), (2, 3)),  # N-D @ a vector: folded into one product
    ((4,), (2, 4, 5), (2,), (1, 5, 4), (2, 5)),
    ((2, 1, 3, 4), (5, 4, 6), (2, 5), (3, 6, 4), (2, 5, 3, 6)),
    ((0, 3, 4), (4, 5), (), (0, 5, 4), (0, 3, 5)),  # N-D @ a matrix: folded, here to no rows
])
def test_analyse_reduces_a_call_to_batched_matrices_with_matmuls_result_shape(sa, sb, batch, mnk, out_shape):
    a, b = torch.randn(sa), torch.randn(sb)
    s = analyse(a, b)
    assert (s.batch, (s.M, s.N, s.K), s.out_shape) == (batch, mnk, out_shape)
    assert s.out_shape == tuple(torch.matmul(a, b).shape)
    assert s.a.shape == batch + (s.M, s.K) and s.b.shape == batch + (s.K, s.N)
    assert (s.squeeze_m, s.squeeze_n) == (len(sa) == 1, len(sb) == 1)
    out = torch.empty(out_shape)
    assert s.matrix_view(out).shape == batch + (s.M, s.N)  # the squeezed dims restored (0-d too)


@pytest.mark.parametrize("sa,sb", [((3, 4), (5, 6)), ((2, 3, 4), (3, 4, 5)), ((4,), (5, 6)), ((2, 3, 4), (5, 6))],
                         ids=["2d", "batch dims that do not broadcast", "1d@2d", "3d@2d"])
def test_analyse_lets_torch_word_a_shape_error(sa, sb):
    """The installed torch's own words (they change between releases: torch 2.15 says "mm: mat1
    and mat2 shapes cannot be multiplied (3x4 and 5x6)" where 2.14 said it without "mm: ")."""
    a, b = torch.randn(sa), torch.randn(sb)
    with pytest.raises(RuntimeError) as ours:
        analyse(a, b)
    with pytest.raises(RuntimeError) as theirs:
        torch.matmul(a, b)
    assert str(ours.value) == str(theirs.value)


# --- how a call becomes a Problem (the CUDA path's bookkeeping, checked on CPU tensors) ---------

@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_storage_offset_sets_alignment_and_vector_loads(offset):
    base = torch.randn(64 * 64 + 8)
    a = base[offset:offset + 64 * 64].view(64, 64)
    b = torch.randn(64, 64)
    p, offsets = _problem(a, b)
    assert offsets == [(0, 0, 0)]
    assert p.a_align == _align_of(a) and p.b_align == _align_of(b)
    assert (p.a_align == 16) == (a.data_ptr() % 16 == 0)
    m = dict(select(p, SM90, force="simt_float4").kernel.macros)
    if p.a_align < 16:
        assert m["A_MODE"] in (LOAD_ELEM_K, LOAD_ELEM_FAST)
    else:
        assert m["A_MODE"] == LOAD_VEC_K


@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_skinny_b_vec_follows_the_real_tensors_layout(offset):
    """What skinny's B_VEC sees for real operands: B's storage offset, a transposed B view, a
    row-strided slice of B, and a vector A (M = 1). (On the v1 kernel, whose macros are just
    these two; v2 decides B_VEC by the same rule, checked in test_plan's random problems.)"""
    K, N = 96, 2048
    base = torch.randn(K * N + 8)
    b = base[offset:offset + K * N].view(K, N)
    p, _ = _problem(torch.randn(8, K), b)
    plan = select(p, SM90, variants=V1)
    assert plan.kernel.family == "skinny" and p.b_align == _align_of(b)
    assert dict(plan.kernel.macros)["B_VEC"] == int(b.data_ptr() % 16 == 0)
    p, _ = _problem(torch.randn(K), b)  # 1-D a: M = 1
    assert p.M == 1
    assert dict(select(p, SM90, variants=V1).kernel.macros) == {"MT": 8, "B_VEC": int(b.data_ptr() % 16 == 0)}
    if offset == 0:
        p, _ = _problem(torch.randn(24, K), torch.randn(N, K).T)  # B^T view: k-contiguous
        assert p.b_strides == (1, K) and select(p, SM90, variants=V1).kernel.family == "skinny_kmajor"  # its layout
        assert dict(select(p, SM90, force="skinny", variants=V1).kernel.macros) == {"MT": 32, "B_VEC": 0}
        p, _ = _problem(torch.randn(9, K), torch.randn(K, N + 4)[:, :N])  # rows N + 4 apart: still float4
        assert dict(select(p, SM90, variants=V1).kernel.macros) == {"MT": 16, "B_VEC": 1}
        p, _ = _problem(torch.randn(9, K), torch.randn(K, N + 1)[:, :N])  # rows N + 1 apart: not
        assert dict(select(p, SM90, variants=V1).kernel.macros) == {"MT": 16, "B_VEC": 0}


def test_transposed_and_sliced_views_become_strides():
    a, b = torch.randn(40, 24).T, torch.randn(32, 40).T  # (24, 40) m-contiguous, (40, 32) k-contiguous
    p, _ = _problem(a, b)
    assert (p.M, p.N, p.K) == (24, 32, 40)
    assert p.a_strides == (1, 24) and p.b_strides == (1, 40) and p.c_strides == (32, 1)
    m = dict(select(p, SM90, force="simt_float4").kernel.macros)
    assert m["A_MODE"] == LOAD_VEC_FAST and m["B_MODE"] == LOAD_VEC_K
    wide = torch.randn(24, 45)
    p, _ = _problem(wide[:, :40], torch.randn(40, 32))  # row-strided slice
    assert p.a_strides == (45, 1)
    assert dict(select(p, SM90, force="simt_float4").kernel.macros)["A_MODE"] == LOAD_ELEM_K


def test_vectors_and_size_one_dims_get_normalized_strides():
    p, _ = _problem(torch.randn(7), torch.randn(7, 9))  # 1-D a: M = 1
    assert (p.M, p.N, p.K) == (1, 9, 7) and p.a_strides == (1, 1)
    p, _ = _problem(torch.randn(5, 7), torch.randn(7))  # 1-D b: N = 1
    assert (p.M, p.N, p.K) == (5, 1, 7) and p.b_strides == (1, 1) and p.c_strides == (1, 1)


def test_broadcast_batch_gets_zero_batch_strides():
    M, N, K = 5, 6, 7
    a, b = torch.randn(2, 1, M, K), torch.randn(3, K, N)
    p, offsets = _problem(a, b)
    assert (p.batch_inner, p.batch_total) == (3, 6) and offsets == [(0, 0, 0)]
    assert p.a_batch_strides == (M * K, 0) and p.b_batch_strides == (0, K * N)
    assert p.c_batch_strides == (3 * M * N, M * N)


def test_contiguous_batch_dims_merge_into_one():
    M, N, K = 5, 6, 7
    p, offsets = _problem(torch.randn(2, 3, M, K), torch.randn(2, 3, K, N))
    assert (p.batch_inner, p.batch_total) == (6, 6) and offsets == [(0, 0, 0)]
    assert p.a_batch_strides[1] == M * K and p.b_batch_strides[1] == K * N


def test_three_unmergeable_batch_dims_loop_over_the_outer_one():
    M, N, K = 5, 6, 7
    a, b = torch.randn(2, 1, 4, M, K), torch.randn(1, 3, 4, K, N)
    p, offsets = _problem(a, b)
    assert (p.batch_inner, p.batch_total) == (4, 12)
    assert offsets == [(0, 0, 0), (4 * M * K, 0, 12 * M * N)]  # element offsets of A, B, C per launch


def test_the_alignment_of_a_looped_operand_is_the_worst_over_its_launch_offsets():
    """A batch dim the kernel cannot walk is a loop of launches at offsets: an operand's
    alignment must hold at every one of them (an odd batch stride leaves later launches
    4-byte aligned although the first is 16-byte aligned)."""
    M, N, K = 4, 8, 8
    odd = torch.randn(2 * (3 * M * K + 1)).as_strided((2, 1, 3, M, K), (3 * M * K + 1, 0, M * K, K, 1))
    assert odd.data_ptr() % 16 == 0
    p, offsets = _problem(odd, torch.randn(1, 5, 3, K, N))
    assert [o[0] for o in offsets] == [0, 3 * M * K + 1] and p.a_align == 4 and p.b_align == 16


def test_collapse_batch_drops_size_one_dims_and_fuses_neighbours_contiguous_in_all_three():
    # (size, a stride, b stride, c stride) of each batch dim, outermost first
    assert collapse_batch((2, 3), (3 * 20, 20), (3 * 30, 30), (3 * 6, 6)) == [(6, 20, 30, 6)]
    assert collapse_batch((2, 1, 3), (60, 999, 20), (90, 7, 30), (18, 5, 6)) == [(6, 20, 30, 6)]
    # B broadcast over the outer dim only: not one stride pattern, two dims
    assert collapse_batch((2, 3), (60, 20), (0, 30), (18, 6)) == [(2, 60, 0, 18), (3, 20, 30, 6)]
    assert collapse_batch((1, 1), (5, 5), (5, 5), (5, 5)) == []


def test_pointer_align_is_the_largest_of_16_8_4_1_dividing_the_address():
    assert [pointer_align(p) for p in (0, 4, 8, 12, 16, 32, 2, 1, 6, 24)] == [16, 4, 8, 4, 16, 16, 1, 1, 1, 8]


def test_result_matrix_is_a_fresh_contiguous_float32_tensor():
    c = result_matrix((2, 3, 4), "cpu")
    assert c.dtype == torch.float32 and c.is_contiguous() and c.shape == (2, 3, 4)
    meta = result_matrix((2, 3, 4), "meta")  # the layout planned ahead, with no memory
    assert meta.device.type == "meta" and meta.stride() == c.stride()


def test_outer_batch_dim_of_size_zero_has_no_launch_and_does_not_crash():
    M, N, K = 5, 6, 7
    a, b = torch.randn(0, 1, 4, M, K), torch.randn(1, 3, 4, K, N)
    p, offsets = _problem(a, b)
    assert offsets == [] and (p.M, p.N, p.K) == (M, N, K)


# --- out= ------------------------------------------------------------------------------------------

def test_resize_out_applies_torchs_rule_with_torchs_warning():
    """fastmm.matmul's CUDA path resizes ``out`` itself: the warning's text must be torch's."""
    with warnings.catch_warnings(record=True) as theirs:
        warnings.simplefilter("always")
        torch.matmul(torch.randn(3, 4), torch.randn(4, 5), out=torch.empty(2, 2))
    out = torch.empty(2, 2)
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        resize_out(out, (3, 5))
    assert len(ours) == 1 and ours[0].category is UserWarning
    assert str(theirs[0].message).startswith(str(ours[0].message))
    assert out.shape == (3, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resize_out(torch.empty(0), (3, 5))  # zero elements: silent
        resize_out(out, (3, 5))  # already right: nothing to do


def test_overlap_helpers():
    x = torch.randn(8, 8)
    assert overlaps(x, x) and overlaps(x[2:], x[:, 3]) and overlaps(x.T, x)
    assert not overlaps(x, torch.randn(8, 8)) and not overlaps(x[:0], x)
    assert has_internal_overlap(torch.randn(1, 4).expand(3, 4))
    assert not has_internal_overlap(x.T) and not has_internal_overlap(torch.randn(1, 4).expand(1, 4))


def test_extent_is_the_bytes_from_the_first_element_to_past_the_last():
    x = torch.randn(8, 10)
    assert extent(x) == 4 * 80 and extent(x[:, :3]) == 4 * (7 * 10 + 3) and extent(x.T) == 4 * 80
    assert extent(x[:0]) == 0 and extent(torch.randn(1, 4).expand(3, 4)) == 16
