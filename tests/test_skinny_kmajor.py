"""The skinny_kmajor family's decisions (fastmm/families/skinny_kmajor.py) on simulated devices,
and its launches on the emulated GPU: ``x @ W.t()`` with W stored ``[N, K]``, M <= 32."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import fastmm
from fastmm.families import FAMILIES, SkinnyKmajor
from fastmm.families.simt_cp_async import SHORT_ROWS_MIN_K, SHORT_ROWS_MIN_N
from fastmm.plan import TINY_K, TINY_OUTPUTS, select
from fastmm.problem import DeviceFacts, Problem
from conftest import relative_error

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
DEV = {arch: DeviceFacts.simulated_device(arch) for arch in ARCHS + ("sm_75",)}
FAMILY = "skinny_kmajor"


def linear(M, N, K, **kw) -> Problem:
    """x @ W.t(): B K-contiguous (W's rows)."""
    return Problem.dense(M, N, K, b_t=True, **kw)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision", ["ieee", "tf32", "tf32x3"])
def test_weight_layout_with_m_up_to_32_picks_the_family(arch, precision):
    for M in (1, 2, 3, 8, 9, 16, 17, 31, 32):
        for N, K in ((4096, 4096), (1024, 4096), (14336, 4096), (1001, 1999), (50257, 768)):
            plan = select(linear(M, N, K, precision=precision), DEV[arch])
            if precision == "tf32" and arch == "sm_90" and M >= 17 and N >= 4096 and K >= 2048:
                # (wgmma's 64-row tile from 17 rows: test_plan's decode test)
                assert plan.kernel.family == "wgmma_tf32" and plan.kernel.tile[0] == 64, (M, N, K, plan.describe())
                continue
            if precision == "tf32" and 8 <= M <= 32:  # tensor cores where FFMAs fall behind W's bytes
                assert plan.kernel.family == "kmajor_mma", (M, N, K, plan.describe())
                assert dict(plan.rejected)[FAMILY] == "kmajor_mma is preferred"
                continue
            if 16 < M and K >= SHORT_ROWS_MIN_K and N >= SHORT_ROWS_MIN_N:  # fp32 at 17-32 rows: the 32-row SIMT tile
                assert plan.kernel.family == "simt_cp_async", (M, N, K, plan.describe())
                assert dict(plan.rejected)[FAMILY] == "simt_cp_async is preferred"
                continue
            assert plan.kernel.family == FAMILY, (M, N, K, plan.describe())
            assert plan.precision_used == "ieee"  # fp32 FMA for every request
            assert dict(plan.rejected)["skinny"] == "skinny_kmajor is preferred"


def test_other_layouts_and_archs_keep_their_families():
    sm90 = DEV["sm_90"]
    row_major = select(Problem.dense(8, 4096, 4096), sm90)
    assert row_major.kernel.family == "skinny"
    assert dict(row_major.rejected)[FAMILY] == "B is not K-contiguous (its rows along N are the skinny family's)"
    m33 = select(linear(33, 4096, 4096), sm90)
    assert dict(m33.rejected)[FAMILY] == "M = 33 > 32: not skinny"
    one_row = select(linear(16, 4096, 1), sm90)  # K = 1: B is one row, contiguous along N too
    assert one_row.kernel.family == "skinny"
    assert dict(one_row.rejected)[FAMILY] == "B is N-contiguous too (K = 1): the skinny family reads it along N"
    column = select(dataclasses.replace(linear(16, 1, 4096), b_strides=(1, 1)), sm90, force=FAMILY)  # N = 1: a dot
    assert column.kernel.family == FAMILY  # product per row, W's one row read along K
    old = select(linear(8, 4096, 4096), DEV["sm_75"])
    assert old.kernel.family == "skinny" and dict(old.rejected)[FAMILY] == "needs sm80+, device is sm_75"


def test_tiny_means_few_outputs_and_a_short_k():
    """A 1 x 1024 x 4096 decode product has few outputs but reads 16 MiB of W: not tiny."""
    sm90 = DEV["sm_90"]
    assert 1 * 1024 <= TINY_OUTPUTS
    assert select(linear(1, 1024, TINY_K), sm90).kernel.family == "scalar"
    assert select(linear(1, 1024, TINY_K + 1), sm90).kernel.family == FAMILY
    assert select(linear(1, 1024, 4096), sm90).kernel.family == FAMILY


@pytest.mark.parametrize("arch", ARCHS)
def test_geometry_follows_the_kernels_definitions(arch):
    """Hand-checked facts of skinny_kmajor.cu: MT = M rounded up to a power of two; a block of 8
    warps owns 8 / KR_KW x 4 x KR_R rows of W (KR_KW = 8 warps along K up to 4 rows with W read as
    float4, else 1); K split into slices of KR_KS (a multiple of 32 x KR_U) whose A rows, and the
    warps' sums where KR_KW > 1, fit the shared memory of the blocks per SM; the split fused
    (KR_FUSED) exactly when there is more than one slice, with one arrival counter per row tile."""
    dev = DEV[arch]
    for M, mt in ((1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (16, 16), (17, 32), (32, 32)):
        for N, K in ((4096, 4096), (14336, 4096), (1001, 999), (4096, 14336), (128, 1 << 17)):
            cfg = select(linear(M, N, K), dev, force=FAMILY).kernel
            m = dict(cfg.macros)
            assert m["MT"] == mt and m["KR_WARPS"] == 8 and m["KR_G"] == 1
            assert m["KR_MINB"] == (1 if mt == 32 else 2)
            kw = 8 if mt <= 4 and K % 4 == 0 else 1  # (linear(): W rows 16-byte aligned where K % 4 == 0)
            assert m["KR_KW"] == kw
            rows = 8 // kw * 4 * m["KR_R"]
            assert cfg.tile == (mt, rows, m["KR_KS"]) and cfg.block_dims == (256, 1, 1)
            assert cfg.grid[0] == -(-N // rows) and cfg.grid[2] == 1
            assert m["KR_KS"] % (32 * m["KR_U"]) == 0
            red = kw * mt * rows if kw > 1 else 0
            assert cfg.smem == (mt * m["KR_KS"] + red) * 4 <= min(96 * 1024, dev.smem_per_sm // m["KR_MINB"] - 1024)
            slices = cfg.grid[1]
            assert (slices - 1) * m["KR_KS"] < K <= slices * m["KR_KS"]  # every slice has k to do
            if kw > 1:  # split over blocks only as far as A's slice must be: one slice fewer would not fit
                room = min(96 * 1024, dev.smem_per_sm // 2 - 1024) - red * 4 - 4 * mt * 32 * m["KR_U"]
                assert slices == 1 or mt * 4 * (K // (slices - 1)) > room
            assert slices <= 64 or slices == -(-K // (cfg.smem // (4 * mt)))  # capped, unless A forces more
            assert cfg.split_fused == (slices > 1) == bool(m["KR_FUSED"])
            assert cfg.arrival_counters == (cfg.grid[0] if slices > 1 else 0)
            # sums and loads within the registers (ptxas -v: spill-free in tests/test_compile.py)
            assert mt * m["KR_R"] <= 64 and m["KR_U"] * m["KR_R"] <= 16


def test_the_decode_gemv_splits_k_over_the_warps_of_a_block_not_over_blocks():
    """Up to 4 rows all 8 warps of a block share its 16 rows of W (4 lane rows x KR_R 4), each
    a run of K: 1 x 4096 x 4096 takes 4096 / 16 = 256 blocks (2 an SM on the H200's 132) and no
    split (A's 16 KiB fits), so no arrivals and no last-block sum; 1 x 14336 x 4096 896 blocks.
    4 x 1024 x 14336: A's slice is 4 x 14336 floats (224 KiB) against 96 KiB less the warps' 2 KiB
    of sums: 3 slices. 8 rows keep the split over blocks (1 x 4096 x 4096's old plan, 32 tiles x
    8 slices, measured 21.4 us against 17.7)."""
    sm90 = DEV["sm_90"]
    gemv = select(linear(1, 4096, 4096), sm90).kernel
    assert gemv.grid == (256, 1, 1) and gemv.tile == (1, 16, 4096) and not gemv.split_fused
    assert gemv.arrival_counters == 0 and gemv.smem == (4096 + 8 * 16) * 4
    up = select(linear(1, 14336, 4096), sm90).kernel
    assert up.grid == (896, 1, 1) and up.tile == (1, 16, 4096)
    down = select(linear(4, 1024, 14336), sm90).kernel
    assert down.family == FAMILY and down.grid == (64, 3, 1) and down.split_fused
    eight = select(linear(8, 4096, 14336), sm90).kernel
    assert dict(eight.macros)["KR_KW"] == 1 and eight.grid[0] == 4096 // 128 and eight.grid[1] > 1


def test_vectors_only_where_the_rows_allow_them():
    sm90 = DEV["sm_90"]

    def vec(p):
        m = dict(select(p, sm90, force=FAMILY).kernel.macros)
        return m["B_VEC"], m["A_VEC"]

    assert vec(linear(4, 4096, 4096)) == (1, 1)
    assert vec(linear(4, 4096, 4095)) == (0, 0)  # K % 4 != 0: rows not 16-byte aligned
    assert vec(linear(4, 4096, 4096, align=4)) == (0, 0)  # storage offset of one float
    assert vec(dataclasses.replace(linear(4, 4096, 4096), b_align=8)) == (0, 1)
    assert vec(linear(4, 4096, 4096, a_t=True)) == (1, 0)  # A K-major: 4-byte copies
    assert vec(dataclasses.replace(linear(4, 4096, 4096), b_strides=(1, 4098))) == (0, 1)  # W = w[:, :K]
    assert vec(dataclasses.replace(linear(4, 4096, 4096), b_strides=(1, 4100))) == (1, 1)


def test_a_batch_is_never_split_and_one_needing_a_split_is_refused():
    sm90 = DEV["sm_90"]
    fam = FAMILIES[FAMILY]
    cap = fam.slice_cap(linear(16, 4096, 4096), sm90)
    ok = select(linear(16, 1024, cap, batch=3), sm90).kernel
    assert ok.family == FAMILY and ok.grid[1] == 1 and ok.grid[2] == 3
    too_long = select(linear(16, 1024, cap + 1, batch=3), sm90)
    assert too_long.kernel.family == "skinny"
    assert dict(too_long.rejected)[FAMILY].startswith(f"batched with K = {cap + 1} > {cap}")


def test_sm90_plans_are_dependent_launches_and_older_ones_are_not():
    for arch in ARCHS:
        cfg = select(linear(1, 4096, 4096), DEV[arch]).kernel
        assert cfg.dependent_launch is (arch == "sm_90")


SHAPES = [(1, 4096, 4096), (3, 1001, 999), (16, 1024, 14336), (32, 300, 700), (5, 330, 257), (2, 1100, 5)]


@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_emulated_launches_compute_x_at_w_transposed(emulated_gpu, M, N, K):
    """fastmm.matmul(x, W.t()) on the emulated GPU: this family's launch (one; a fused split sums
    its own slices), with the arguments fastmm passes computing float64-accurate results, into a
    fresh result and a NaN-filled out; inputs unchanged."""
    x, w = torch.randn(M, K), torch.randn(N, K)
    x0, w0 = x.clone(), w.clone()
    ref = x.double() @ w.double().t()
    for precision in ("ieee", "tf32x3"):  # (tf32 at 8-32 rows: kmajor_mma's)
        emulated_gpu.clear()
        got = fastmm.matmul(x, w.t(), precision=precision)
        assert emulated_gpu.families == [FAMILY]
        assert relative_error(got, ref) <= 1e-6
        out = torch.full((M, N), float("nan"))
        assert fastmm.matmul(x, w.t(), out=out, precision=precision) is out
        assert relative_error(out, ref) <= 1e-6
    assert torch.equal(x, x0) and torch.equal(w, w0)


def test_emulated_linear_layer_decodes_on_the_family(emulated_gpu):
    """fastmm.nn.Linear on one token (batch 1, sequence 1): its forward is this family's launch."""
    layer = fastmm.nn.Linear(2048, 1024)
    x = torch.randn(1, 1, 2048)
    with torch.no_grad():
        y = layer(x)
    assert FAMILY in emulated_gpu.families
    ref = x.double() @ layer.weight.double().t() + layer.bias.double()
    assert relative_error(y, ref) <= 1e-6


def test_the_family_is_registered_with_its_source():
    fam = FAMILIES[FAMILY]
    assert isinstance(fam, SkinnyKmajor) and fam.source == "skinny_kmajor.cu" and fam.min_cc == (8, 0)


def test_a_k_needing_more_slices_than_the_grid_allows_is_refused():
    """One block row per K slice, and slices are at least what A's shared memory needs: a K that
    would take more than 65535 of them (grid.y's limit) goes to the skinny family instead."""
    sm90 = DEV["sm_90"]
    fam = FAMILIES[FAMILY]
    p = linear(16, 128, 4096)
    cap = fam.slice_cap(p, sm90)
    fits = linear(16, 128, 65535 * cap)
    assert fam.reject(fits, sm90) is None
    assert select(fits, sm90, force=FAMILY).kernel.grid[1] == 65535
    over = linear(16, 128, 65535 * cap + 1)
    plan = select(over, sm90)
    assert plan.kernel.family == "skinny"
    assert dict(plan.rejected)[FAMILY] == f"K = {over.K} would need more than 65535 slices of {cap} (the grid's y limit)"
