"""The dispatcher (fastmm.plan, fastmm.families, fastmm.problem) on simulated devices: which kernel
each problem gets, with which load modes and launch geometry, and why the others were rejected.

Geometry checks use the definitions in cuda_src/ (tile sizes, shared-memory layouts), so a
mismatch between the Python side and the kernels shows up here, on a CPU.
"""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastmm.families import (FAMILIES, LOAD_ELEM_FAST, LOAD_ELEM_K, LOAD_NAMES, LOAD_VEC_FAST, LOAD_VEC_K,
                             MAX_GRID_Z)
from fastmm.plan import INT32_MAX, TINY_OUTPUTS, select
from fastmm.problem import DeviceFacts, Problem

ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
SM80_PLUS = ARCHS[1:]
DEV = {arch: DeviceFacts.simulated_device(arch) for arch in ARCHS}
VEC_MODES = (LOAD_VEC_FAST, LOAD_VEC_K)
ELEM_MODES = (LOAD_ELEM_K, LOAD_ELEM_FAST)
SIMT = ("simt_float4", "simt_cp_async")
BIG = (2048, 2048, 2048)


def macros(plan) -> dict:
    return dict(plan.kernel.macros)


def rejected(plan) -> dict:
    return dict(plan.rejected)


def forced(p: Problem, arch: str, family: str):
    plan = select(p, DEV[arch], force=family)
    assert plan.kernel is not None and plan.kernel.family == family
    return plan


def with_precision(p: Problem, precision: str) -> Problem:
    return dataclasses.replace(p, precision=precision)


# --- geometry as cuda_src/ defines it ------------------------------------------------------------

def tile_from_macros(family: str, m: dict) -> tuple[int, int]:
    """(BM, BN) from the macros, by the kernels' own definitions."""
    if family == "scalar":
        return 16, 16  # scalar.cu: TILE 16
    if family == "tf32_mma":
        return m["WARPS_M"] * 64, m["WARPS_N"] * m["WARP_N"]  # tf32_mma.cu: WARP_M 64
    lanes_m = 8 if m["THREAD_M"] == 8 else 4  # simt_core.cuh: LANES_M, LANES_N = 32 / LANES_M
    return m["WARPS_M"] * lanes_m * m["THREAD_M"], m["WARPS_N"] * (32 // lanes_m) * 8


def dynamic_smem_from_macros(family: str, m: dict) -> int:
    """Bytes of dynamic shared memory each kernel indexes (STAGES x (A tile + B tile))."""
    bm, bn = tile_from_macros(family, m)
    if family == "simt_cp_async":  # simt_core.cuh: A_TILE_FLOATS = BK * (BM + 4), B likewise
        return m["STAGES"] * m["BK"] * ((bm + 4) + (bn + 4)) * 4
    if family == "tf32_mma":  # tf32_mma.cu: [m][k] rows BM x (32 + 4), [k][m] rows 32 x (BM + 8), ...
        a = bm * (32 + 4) if m["A_SMEM_MK"] else 32 * (bm + 8)
        b = 32 * (bn + 8) if m["B_SMEM_KN"] else bn * (32 + 4)
        return m["STAGES"] * (a + b) * 4
    return 0  # scalar and simt_float4 use static shared memory only


def check_geometry(plan) -> None:
    p, dev, cfg = plan.problem, plan.device, plan.kernel
    m = dict(cfg.macros)
    assert cfg.smem <= dev.smem_per_block_optin, f"{cfg.family} asks {cfg.smem} B > {dev.smem_per_block_optin}"
    assert cfg.smem == dynamic_smem_from_macros(cfg.family, m)
    if cfg.family == "scalar":
        assert cfg.block_dims == (16, 16, 1) and cfg.block == 256
    else:
        threads = m["WARPS_M"] * m["WARPS_N"] * 32
        assert cfg.block_dims == (threads, 1, 1) and cfg.block == threads
    assert cfg.block_dims[0] * cfg.block_dims[1] * cfg.block_dims[2] <= 1024
    bm, bn = tile_from_macros(cfg.family, m)
    assert cfg.tile[:2] == (bm, bn)
    if cfg.family == "simt_cp_async":
        assert m["STAGES"] >= 2
    tiles = -(-p.M // bm) * -(-p.N // bn)
    gx, gy, gz = cfg.grid
    assert 1 <= gx <= INT32_MAX and (gx == tiles or (cfg.family == "scalar" and gx == min(tiles, INT32_MAX)))
    assert 1 <= gz <= MAX_GRID_Z and gz == min(p.batch_total, MAX_GRID_Z)
    # grid.y = number of K splits (common.cuh split_range); > 1 needs the reduce pass
    assert gy >= 1
    if gy == 1:
        assert plan.reduce is None
    else:
        assert cfg.family in ("simt_cp_async", "tf32_mma") and p.batch_total == 1
        assert gy <= -(-p.K // cfg.tile[2]), "a split with no k-tile to compute"
        r = plan.reduce
        assert r is not None and r.family == "splitk_reduce" and r.source == "splitk_reduce.cu"
        assert r.block_dims == (256, 1, 1) and r.grid[1:] == (1, 1) and r.grid[0] >= 1 and r.smem == 0


# --- a zoo of problems every invariant is checked on ---------------------------------------------

def _zoo() -> list[Problem]:
    out = []
    for M, N, K in [(1, 1, 1), (3, 5, 4), (17, 19, 23), (32, 32, 64), (33, 32, 64), (129, 96, 132),
                    (257, 129, 193), (1000, 1000, 1000), (4097, 4095, 4093), (8192, 4096, 6144), (16, 4096, 4096),
                    (256, 256, 65536)]:
        for a_t, b_t in [(False, False), (True, False), (False, True), (True, True)]:
            for align in (16, 8, 4):
                out.append(Problem.dense(M, N, K, a_t=a_t, b_t=b_t, align=align))
    out.append(Problem.dense(64, 64, 64, batch=100_000))
    out.append(Problem.dense(300, 200, 100, batch=7))
    # no unit stride anywhere (every other element of a wider tensor)
    out.append(Problem(300, 200, 100, (2 * 100, 2), (2 * 200, 2), (200, 1)))
    # row-strided slices x[:, :K] of wider tensors, widths multiple of 4 and not
    out.append(Problem(512, 512, 500, (512, 1), (516, 1), (512, 1)))
    out.append(Problem(512, 512, 500, (503, 1), (517, 1), (513, 1)))
    return out


ZOO = _zoo()
PRECISIONS = ("ieee", "tf32", "tf32x3")


def _zoo_id(p: Problem) -> str:
    return f"{p.M}x{p.N}x{p.K}-a{p.a_strides}-b{p.b_strides}-al{p.a_align}-z{p.batch_total}".replace(" ", "")


# --- which family is chosen ---------------------------------------------------------------------

@pytest.mark.parametrize("precision", PRECISIONS)
def test_sm75_never_gets_cp_async_or_tensor_cores(precision):
    for p in ZOO:
        plan = select(with_precision(p, precision), DEV["sm_75"])
        assert plan.kernel is not None
        assert plan.kernel.family in ("simt_float4", "scalar"), _zoo_id(p)
        assert "sm80" in rejected(plan)["simt_cp_async"]
        if precision != "ieee":
            assert "sm80" in rejected(plan)["tf32_mma"]


def test_sm75_large_ieee_problem_gets_simt_float4():
    plan = select(Problem.dense(*BIG), DEV["sm_75"])
    assert plan.kernel.family == "simt_float4"
    assert plan.precision_used == "ieee"


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
def test_sm75_tf32_request_runs_fp32_simt_and_reports_ieee(precision):
    plan = select(Problem.dense(*BIG, precision=precision), DEV["sm_75"])
    assert plan.kernel.family == "simt_float4"
    assert plan.precision_used == "ieee"
    assert rejected(plan)["tf32_mma"] == "needs sm80+, device is sm_75"


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("family", ["tf32_mma", "simt_cp_async"])
def test_forcing_an_sm80_family_on_sm75_raises(family, precision):
    with pytest.raises(ValueError, match="needs sm80"):
        select(Problem.dense(*BIG, precision=precision), DEV["sm_75"], force=family)


@pytest.mark.parametrize("arch", SM80_PLUS)
def test_sm80_plus_ieee_gets_cp_async_simt(arch):
    plan = select(Problem.dense(*BIG), DEV[arch])
    assert plan.kernel.family == "simt_cp_async"
    assert plan.precision_used == "ieee"
    assert rejected(plan)["tf32_mma"] == "does not compute precision 'ieee'"


@pytest.mark.parametrize("arch", ARCHS)
def test_ieee_never_gets_tensor_cores(arch):
    for p in ZOO:
        plan = select(p, DEV[arch])
        assert plan.kernel.family != "tf32_mma", _zoo_id(p)
        assert plan.precision_used == "ieee"
    with pytest.raises(ValueError, match="needs sm80" if arch == "sm_75" else "precision 'ieee'"):
        select(Problem.dense(*BIG), DEV[arch], force="tf32_mma")


@pytest.mark.parametrize("arch", SM80_PLUS)
@pytest.mark.parametrize("precision,x3", [("tf32", 0), ("tf32x3", 1)])
def test_tf32_on_sm80_plus_gets_tensor_cores_with_the_right_x3_macro(arch, precision, x3):
    plan = select(Problem.dense(*BIG, precision=precision), DEV[arch])
    assert plan.kernel.family == "tf32_mma"
    assert macros(plan)["PRECISION_X3"] == x3
    assert plan.precision_used == precision
    assert "simt_cp_async" in rejected(plan) and "tf32_mma is preferred" in rejected(plan)["simt_cp_async"]


@pytest.mark.parametrize("arch", SM80_PLUS)
@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
def test_tf32_requests_get_tensor_cores_for_every_non_tiny_shape(arch, precision):
    for p in ZOO:
        p = with_precision(p, precision)
        plan = select(p, DEV[arch])
        if p.M * p.N > TINY_OUTPUTS:
            assert plan.kernel.family == "tf32_mma", _zoo_id(p)
            assert plan.precision_used == precision


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("mnk", [(1, 1, 1), (3, 5, 4), (17, 19, 23), (32, 32, 4096), (8, 8, 1_000_000), (1, 1024, 7)])
def test_tiny_problems_pick_scalar(arch, precision, mnk):
    plan = select(Problem.dense(*mnk, precision=precision), DEV[arch])
    assert plan.kernel.family == "scalar"
    assert plan.precision_used == "ieee"
    for name, reason in plan.rejected:
        assert "is tiny" in reason or "needs sm80+" in reason or "does not compute precision" in reason, (name, reason)
    if arch != "sm_75":
        assert "is tiny" in rejected(plan)["simt_cp_async"]


@pytest.mark.parametrize("arch", ARCHS)
def test_just_above_the_tiny_limit_gets_a_tiled_kernel(arch):
    assert 32 * 33 > TINY_OUTPUTS
    plan = select(Problem.dense(32, 33, 64), DEV[arch])
    assert plan.kernel.family in SIMT


# --- load modes: no vector access where the layout or alignment forbids it ----------------------

@pytest.mark.parametrize("arch", SM80_PLUS)
@pytest.mark.parametrize("family", SIMT)
@pytest.mark.parametrize("N", [1021, 1022, 1023])
def test_n_not_multiple_of_4_gets_no_float4_on_b_or_c(arch, family, N):
    plan = forced(Problem.dense(1024, N, 1024), arch, family)
    m = macros(plan)
    assert m["B_MODE"] not in VEC_MODES
    assert m["C_VEC"] == 0
    assert m["A_MODE"] == (LOAD_VEC_K if family == "simt_float4" else LOAD_ELEM_K)  # A is still aligned


@pytest.mark.parametrize("N", [1021, 1022, 1023])
def test_n_not_multiple_of_4_on_sm75_default_path(N):
    plan = select(Problem.dense(1024, N, 1024), DEV["sm_75"])
    assert plan.kernel.family == "simt_float4"
    assert macros(plan)["B_MODE"] not in VEC_MODES and macros(plan)["C_VEC"] == 0


@pytest.mark.parametrize("arch", SM80_PLUS)
@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("N,c_vec", [(1021, 0), (1022, 1), (1023, 0)])
def test_tf32_n_not_multiple_of_4_gets_4_byte_b_copies(arch, precision, N, c_vec):
    m = macros(forced(Problem.dense(1024, N, 1024, precision=precision), arch, "tf32_mma"))
    assert m["B_VEC"] == 0 and m["A_VEC"] == 1
    assert m["C_VEC"] == c_vec  # float2 stores need an even N only


@pytest.mark.parametrize("arch", SM80_PLUS)
@pytest.mark.parametrize("K", [1021, 1022, 1023])
def test_k_not_multiple_of_4_gets_no_vectors_along_k(arch, K):
    for family in SIMT:
        m = macros(forced(Problem.dense(1024, 1024, K), arch, family))
        assert m["A_MODE"] == LOAD_ELEM_K  # row-major A: rows K apart
        assert m["B_MODE"] == LOAD_VEC_FAST  # row-major B is unaffected
        m = macros(forced(Problem.dense(1024, 1024, K, b_t=True), arch, family))
        assert m["B_MODE"] == LOAD_ELEM_K
    m = macros(forced(Problem.dense(1024, 1024, K, precision="tf32"), arch, "tf32_mma"))
    assert m["A_VEC"] == 0 and m["B_VEC"] == 1


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("align", [4, 8])
def test_misaligned_storage_offset_gets_no_float4_anywhere(arch, align):
    # offset 1 or 3 floats -> 4-byte aligned pointers; offset 2 -> 8-byte aligned
    for a_t in (False, True):
        for b_t in (False, True):
            p = Problem.dense(1024, 1024, 1024, a_t=a_t, b_t=b_t, align=align)
            for family in (SIMT if arch != "sm_75" else ("simt_float4",)):
                m = macros(forced(p, arch, family))
                assert m["A_MODE"] in ELEM_MODES and m["B_MODE"] in ELEM_MODES and m["C_VEC"] == 0, (family, a_t, b_t)
            if arch != "sm_75":
                for precision in ("tf32", "tf32x3"):
                    m = macros(forced(with_precision(p, precision), arch, "tf32_mma"))
                    assert m["A_VEC"] == 0 and m["B_VEC"] == 0
                    assert m["C_VEC"] == (1 if align == 8 else 0)  # float2 stores need 8 bytes


@pytest.mark.parametrize("which", ["a", "b", "c"])
def test_one_misaligned_operand_loses_vectors_only_there(which):
    p = dataclasses.replace(Problem.dense(1024, 1024, 1024), **{which + "_align": 4})
    m = macros(forced(p, "sm_90", "simt_float4"))
    assert (m["A_MODE"] in ELEM_MODES) == (which == "a")
    assert (m["B_MODE"] in ELEM_MODES) == (which == "b")
    assert (m["C_VEC"] == 0) == (which == "c")
    m = macros(forced(with_precision(p, "tf32"), "sm_90", "tf32_mma"))
    assert m["A_VEC"] == int(which != "a") and m["B_VEC"] == int(which != "b") and m["C_VEC"] == int(which != "c")


@pytest.mark.parametrize("arch", SM80_PLUS)
def test_transposed_views_get_matching_load_modes_and_smem_layouts(arch):
    row = Problem.dense(1024, 1024, 1024)
    at = Problem.dense(1024, 1024, 1024, a_t=True)
    bt = Problem.dense(1024, 1024, 1024, b_t=True)
    f4 = {name: macros(forced(p, arch, "simt_float4")) for name, p in (("row", row), ("at", at), ("bt", bt))}
    cp = {name: macros(forced(p, arch, "simt_cp_async")) for name, p in (("row", row), ("at", at), ("bt", bt))}
    # A row-major (k-contiguous): float4 along k transposed by the register path; cp.async cannot transpose
    assert f4["row"]["A_MODE"] == LOAD_VEC_K and cp["row"]["A_MODE"] == LOAD_ELEM_K
    # A transposed view (m-contiguous): float4 straight into the k-major tile
    assert f4["at"]["A_MODE"] == LOAD_VEC_FAST and cp["at"]["A_MODE"] == LOAD_VEC_FAST
    assert f4["row"]["B_MODE"] == LOAD_VEC_FAST and cp["row"]["B_MODE"] == LOAD_VEC_FAST
    assert f4["bt"]["B_MODE"] == LOAD_VEC_K and cp["bt"]["B_MODE"] == LOAD_ELEM_K
    for precision in ("tf32", "tf32x3"):
        tf = {name: macros(forced(with_precision(p, precision), arch, "tf32_mma"))
              for name, p in (("row", row), ("at", at), ("bt", bt))}
        assert (tf["row"]["A_SMEM_MK"], tf["row"]["B_SMEM_KN"]) == (1, 1)
        assert (tf["at"]["A_SMEM_MK"], tf["at"]["B_SMEM_KN"]) == (0, 1)
        assert (tf["bt"]["A_SMEM_MK"], tf["bt"]["B_SMEM_KN"]) == (1, 0)
        assert all(t["A_VEC"] == 1 and t["B_VEC"] == 1 for t in tf.values())


@pytest.mark.parametrize("arch", SM80_PLUS)
def test_transposed_views_with_odd_extent_use_single_floats(arch):
    # A^T view is m-contiguous: M = 1023 forbids float4 along m
    m = macros(forced(Problem.dense(1023, 1024, 1024, a_t=True), arch, "simt_float4"))
    assert m["A_MODE"] == LOAD_ELEM_FAST
    m = macros(forced(Problem.dense(1023, 1024, 1024, a_t=True, precision="tf32"), arch, "tf32_mma"))
    assert m["A_SMEM_MK"] == 0 and m["A_VEC"] == 0
    # B^T view is k-contiguous: K = 1023 forbids float4 along k
    m = macros(forced(Problem.dense(1024, 1024, 1023, b_t=True), arch, "simt_float4"))
    assert m["B_MODE"] == LOAD_ELEM_K
    m = macros(forced(Problem.dense(1024, 1024, 1023, b_t=True, precision="tf32"), arch, "tf32_mma"))
    assert m["B_SMEM_KN"] == 0 and m["B_VEC"] == 0


def test_operands_with_no_unit_stride_use_single_floats():
    p = Problem(1024, 1024, 1024, (2 * 1024, 2), (2 * 1024, 2), (1024, 1))
    for family in SIMT:
        m = macros(forced(p, "sm_90", family))
        assert m["A_MODE"] == LOAD_ELEM_K and m["B_MODE"] == LOAD_ELEM_FAST
        assert m["C_VEC"] == 1
    m = macros(forced(with_precision(p, "tf32"), "sm_90", "tf32_mma"))
    assert m["A_VEC"] == 0 and m["B_VEC"] == 0


@pytest.mark.parametrize("width,vec", [(1028, True), (1025, False), (1030, False)])
def test_row_strided_slices_vectorize_only_when_the_row_stride_allows(width, vec):
    # x[:, :1024] of an (R, width) tensor: unit stride along the row, rows `width` apart
    p = Problem(1024, 1024, 1024, (width, 1), (width, 1), (width, 1))
    m = macros(forced(p, "sm_90", "simt_float4"))
    assert (m["A_MODE"] == LOAD_VEC_K) == vec and (m["B_MODE"] == LOAD_VEC_FAST) == vec and m["C_VEC"] == int(vec)
    m = macros(forced(with_precision(p, "tf32"), "sm_90", "tf32_mma"))
    assert m["A_VEC"] == int(vec) and m["B_VEC"] == int(vec)


def test_batch_strides_not_multiple_of_4_forbid_vectors():
    base = Problem.dense(512, 512, 512, batch=4)
    p = dataclasses.replace(base, a_batch_strides=(0, 512 * 512 + 1), b_batch_strides=(0, 512 * 512 + 2))
    m = macros(forced(p, "sm_90", "simt_float4"))
    assert m["A_MODE"] in ELEM_MODES and m["B_MODE"] in ELEM_MODES and m["C_VEC"] == 1
    m0 = macros(forced(base, "sm_90", "simt_float4"))
    assert m0["A_MODE"] in VEC_MODES and m0["B_MODE"] in VEC_MODES


def test_details_name_the_load_modes_in_the_macros():
    for p in ZOO[:40]:
        for family in SIMT:
            cfg = forced(p, "sm_90", family).kernel
            m, d = dict(cfg.macros), dict(cfg.details)
            assert d["A loads"] == LOAD_NAMES[m["A_MODE"]] and d["B loads"] == LOAD_NAMES[m["B_MODE"]]
            assert d["C stores"] == ("float4" if m["C_VEC"] else "single floats")


# --- falling back to torch ----------------------------------------------------------------------

@pytest.mark.parametrize("which", ["a", "b", "c"])
@pytest.mark.parametrize("align", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_pointers_not_4_byte_aligned_fall_back_to_torch(which, align, arch):
    p = dataclasses.replace(Problem.dense(256, 256, 256, precision="tf32"), **{which + "_align": align})
    plan = select(p, DEV[arch])
    assert plan.kernel is None and plan.precision_used is None
    assert plan.fallback == f"{which.upper()}'s data pointer is not 4-byte aligned, which no float kernel can read"
    assert plan.describe().startswith("torch.matmul fallback: ")


@pytest.mark.parametrize("dims", [dict(M=2**31), dict(N=2**31), dict(K=2**31), dict(batch_total=2**31)])
def test_dimensions_past_int32_fall_back_to_torch(dims):
    p = dataclasses.replace(Problem.dense(64, 64, 64), **dims)
    plan = select(p, DEV["sm_90"])
    assert plan.kernel is None
    assert "2^31-1" in plan.fallback and "32-bit" in plan.fallback


def test_largest_int32_dimension_still_runs():
    plan = select(Problem(INT32_MAX, 1, 1, (1, 1), (1, 1), (1, 1)), DEV["sm_90"])
    assert plan.kernel is not None


def test_too_many_output_tiles_fall_back_to_torch():
    plan = select(Problem(2**20, 2**20, 1, (1, 1), (2**20, 1), (2**20, 1)), DEV["sm_90"])
    assert plan.kernel is None and "tiles" in plan.fallback


def test_devices_older_than_sm70_fall_back_to_torch():
    old = dataclasses.replace(DEV["sm_75"], cc=(6, 1), name="simulated P100")
    plan = select(Problem.dense(*BIG), old)
    assert plan.kernel is None and "sm_61" in plan.fallback and "older" in plan.fallback


# --- force= -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", SM80_PLUS)
@pytest.mark.parametrize("family,precision", [("scalar", "ieee"), ("simt_float4", "ieee"), ("simt_cp_async", "ieee"),
                                              ("scalar", "tf32"), ("simt_cp_async", "tf32x3"), ("tf32_mma", "tf32")])
def test_force_picks_the_named_family(arch, family, precision):
    plan = select(Problem.dense(*BIG, precision=precision), DEV[arch], force=family)
    assert plan.kernel.family == family
    assert plan.precision_used == (precision if family == "tf32_mma" else "ieee")
    reasons = rejected(plan)
    assert family not in reasons
    for name, reason in reasons.items():
        assert reason in (f"{family} is preferred (forced)", f"does not compute precision '{precision}'"), (name, reason)


@pytest.mark.parametrize("family", ["simt_float4", "simt_cp_async"])
def test_force_overrides_the_tiny_rule(family):
    plan = select(Problem.dense(3, 5, 4), DEV["sm_90"], force=family)
    assert plan.kernel.family == family
    check_geometry(plan)


def test_force_unknown_family_raises_listing_the_families():
    with pytest.raises(ValueError, match="unknown kernel family 'cublas'") as exc:
        select(Problem.dense(*BIG), DEV["sm_90"], force="cublas")
    for name in FAMILIES:
        assert name in str(exc.value)


# --- every plan accounts for every family; geometry fits the device -------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_family_is_chosen_or_rejected_with_a_reason(arch, precision):
    for p in ZOO:
        plan = select(with_precision(p, precision), DEV[arch])
        names = [plan.kernel.family] + [name for name, _ in plan.rejected]
        assert sorted(names) == sorted(FAMILIES), _zoo_id(p)
        for name, reason in plan.rejected:
            assert isinstance(reason, str) and len(reason) > 10, (name, reason)
            assert f"rejected {name}: {reason}" in plan.describe()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_launch_geometry_fits_the_device_and_matches_the_kernels(arch, precision):
    for p in ZOO:
        p = with_precision(p, precision)
        check_geometry(select(p, DEV[arch]))
        for family in FAMILIES:
            try:
                plan = select(p, DEV[arch], force=family)
            except ValueError:
                continue
            check_geometry(plan)


def test_cp_async_drops_stages_on_a_device_with_little_shared_memory():
    small = dataclasses.replace(DEV["sm_80"], smem_per_block_optin=64 * 1024, name="simulated sm80, 64 KiB")
    big_plan = forced(Problem.dense(8192, 8192, 4096), "sm_90", "simt_cp_async")
    small_plan = select(Problem.dense(8192, 8192, 4096), small, force="simt_cp_async")
    assert 2 <= macros(small_plan)["STAGES"] < macros(big_plan)["STAGES"]
    check_geometry(small_plan)


def test_huge_batch_is_capped_at_the_grid_z_limit():
    plan = select(Problem.dense(64, 64, 64, batch=100_000), DEV["sm_90"])
    assert plan.kernel.grid[2] == MAX_GRID_Z
    assert select(Problem.dense(64, 64, 64, batch=7), DEV["sm_90"]).kernel.grid[2] == 7


@pytest.mark.parametrize("precision", PRECISIONS)
def test_long_k_with_a_small_output_splits_k_with_a_deterministic_reduce(precision):
    plan = select(Problem.dense(256, 256, 65536, precision=precision), DEV["sm_90"])
    assert plan.kernel.split_k > 1
    assert plan.reduce is not None and "fixed order" in dict(plan.reduce.details)["order"]
    assert "then: splitk_reduce" in plan.describe()
    check_geometry(plan)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_batched_and_large_problems_never_split_k(arch, precision):
    for p in (Problem.dense(256, 256, 65536, batch=2, precision=precision),
              Problem.dense(8192, 8192, 8192, precision=precision)):
        plan = select(p, DEV[arch])
        assert plan.kernel.split_k == 1 and plan.reduce is None


def test_simt_float4_and_scalar_never_split_k():
    p = Problem.dense(256, 256, 65536)
    for arch in ARCHS:
        for family in ("simt_float4", "scalar"):
            plan = select(p, DEV[arch], force=family)
            assert plan.kernel.split_k == 1 and plan.reduce is None


def test_large_problems_get_the_largest_tile_and_small_ones_a_small_tile():
    big = select(Problem.dense(8192, 8192, 4096), DEV["sm_90"]).kernel
    small = select(Problem.dense(256, 256, 512), DEV["sm_90"]).kernel
    assert big.tile[0] * big.tile[1] > small.tile[0] * small.tile[1]
    assert big.tile[:2] == (128, 256)
    # a batch fills the device just as more tiles do
    batched = select(Problem.dense(256, 256, 512, batch=64), DEV["sm_90"]).kernel
    assert batched.tile[0] * batched.tile[1] > small.tile[0] * small.tile[1]
    tbig = select(Problem.dense(8192, 8192, 4096, precision="tf32"), DEV["sm_90"]).kernel
    tsmall = select(Problem.dense(256, 256, 512, precision="tf32"), DEV["sm_90"]).kernel
    assert tbig.tile[0] * tbig.tile[1] > tsmall.tile[0] * tsmall.tile[1]


def test_select_is_pure():
    p = Problem.dense(1000, 1000, 1000, precision="tf32")
    assert select(p, DEV["sm_90"]) == select(p, DEV["sm_90"])
    assert hash(p) == hash(Problem.dense(1000, 1000, 1000, precision="tf32"))


def test_simulated_devices_report_their_arch():
    for arch in ARCHS:
        assert DEV[arch].arch == arch and DEV[arch].simulated
    with pytest.raises(KeyError):
        DeviceFacts.simulated_device("sm_100")


def test_problem_layouts_read_as_expected():
    p = Problem.dense(8, 16, 32, a_t=True)
    assert p.a_strides == (1, 8) and p.layout_of("a") == "column-major"
    assert p.b_strides == (16, 1) and p.layout_of("b") == "row-major"
    assert Problem(8, 16, 32, (64, 2), (16, 1), (16, 1)).layout_of("a") == "strided"


# --- property test: invariants on random problems -------------------------------------------------

def _vector_ok(extent: int, other_stride: int, batch_strides, align: int) -> bool:
    return align == 16 and extent % 4 == 0 and other_stride % 4 == 0 and all(s % 4 == 0 for s in batch_strides)


@st.composite
def problems(draw):
    M, N, K = (draw(st.integers(1, 3000)) for _ in range(3))

    def operand(rows, cols):
        kind = draw(st.sampled_from(["row", "col", "rowpad", "colpad", "none"]))
        pad = draw(st.integers(1, 7))
        return {"row": (cols, 1), "col": (1, rows), "rowpad": (cols + pad, 1), "colpad": (1, rows + pad),
                "none": (2 * cols, 2)}[kind]

    batch = draw(st.sampled_from([1, 1, 3, 200, 70_000]))
    inner = draw(st.sampled_from([1, batch]))
    align = [draw(st.sampled_from([4, 8, 16])) for _ in range(3)]
    bstride = [draw(st.sampled_from([0, M * K, M * K + 1])), draw(st.sampled_from([0, K * N, K * N + 2]))]
    return Problem(M, N, K, operand(M, K), operand(K, N), (N, 1), inner, batch, (0, bstride[0]), (0, bstride[1]),
                   (0, M * N), *align, draw(st.sampled_from(PRECISIONS)))


@settings(max_examples=400, deadline=None)
@given(p=problems(), arch=st.sampled_from(ARCHS), force=st.sampled_from([None, *FAMILIES]))
def test_random_problems_keep_every_invariant(p, arch, force):
    dev = DEV[arch]
    try:
        plan = select(p, dev, force=force)
    except ValueError as exc:
        assert force is not None and force in str(exc)
        return
    cfg = plan.kernel
    assert cfg is not None
    assert force is None or cfg.family == force
    if dev.cc < (8, 0):
        assert cfg.family in ("scalar", "simt_float4")
    if p.precision == "ieee":
        assert cfg.family != "tf32_mma"
    assert plan.precision_used == (p.precision if cfg.family == "tf32_mma" else "ieee")
    check_geometry(plan)
    m = dict(cfg.macros)
    (sAm, sAk), (sBk, sBn), (sCm, sCn) = p.a_strides, p.b_strides, p.c_strides
    if cfg.family in SIMT:
        if m["A_MODE"] == LOAD_VEC_FAST:
            assert sAm == 1 and _vector_ok(p.M, sAk, p.a_batch_strides, p.a_align)
        if m["A_MODE"] == LOAD_VEC_K:
            assert cfg.family == "simt_float4" and sAk == 1 and _vector_ok(p.K, sAm, p.a_batch_strides, p.a_align)
        if m["B_MODE"] == LOAD_VEC_FAST:
            assert sBn == 1 and _vector_ok(p.N, sBk, p.b_batch_strides, p.b_align)
        if m["B_MODE"] == LOAD_VEC_K:
            assert cfg.family == "simt_float4" and sBk == 1 and _vector_ok(p.K, sBn, p.b_batch_strides, p.b_align)
        if m["A_MODE"] == LOAD_ELEM_FAST:
            assert sAm == 1
        if m["B_MODE"] == LOAD_ELEM_K:
            assert sBk == 1
        if m["C_VEC"] and cfg.split_k == 1:
            assert sCn == 1 and _vector_ok(p.N, sCm, p.c_batch_strides, p.c_align)
        if m["C_VEC"]:  # split-K partials go to a contiguous workspace of M x N slices
            assert p.N % 4 == 0
    elif cfg.family == "tf32_mma":
        if m["A_VEC"]:
            assert (sAk == 1 and _vector_ok(p.K, sAm, p.a_batch_strides, p.a_align)) or (
                sAm == 1 and _vector_ok(p.M, sAk, p.a_batch_strides, p.a_align))
            assert m["A_SMEM_MK"] == int(sAk == 1)
        if m["B_VEC"]:
            assert (sBn == 1 and _vector_ok(p.N, sBk, p.b_batch_strides, p.b_align)) or (
                sBk == 1 and _vector_ok(p.K, sBn, p.b_batch_strides, p.b_align))
            assert m["B_SMEM_KN"] == int(sBn == 1)
        if m["C_VEC"] and cfg.split_k == 1:
            assert sCn == 1 and p.N % 2 == 0 and sCm % 2 == 0 and p.c_align >= 8
        if m["C_VEC"]:
            assert p.N % 2 == 0
        assert m["PRECISION_X3"] == int(p.precision == "tf32x3")


def test_describe_names_the_kernel_its_macros_and_every_rejection():
    plan = select(Problem.dense(2048, 2048, 2048, precision="tf32"), DEV["sm_90"])
    text = plan.describe()
    cfg = plan.kernel
    assert text.startswith(f"kernel: tf32_mma ({cfg.entry} in cuda_src/{cfg.source}): tile ")
    assert "  macros: " + ", ".join(f"{k}={v}" for k, v in cfg.macros) in text
    assert "PRECISION_X3=0" in text
    for name, reason in plan.rejected:
        assert f"rejected {name}: {reason}" in text
