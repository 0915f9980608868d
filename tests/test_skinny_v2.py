"""Skinny v2 (cuda_src/skinny.cu with SK_V2=1, Skinny.configure_v2): the default on sm_90, where
it was measured (Skinny.V2_BY_CC). Its geometry on every arch, the switch that selects it, a
spill-free build of a few kernels, and (on a GPU) results against float64."""
from __future__ import annotations

import io

import pytest
import torch

from fastmm.families import FAMILIES, MAX_GRID_Z, MAX_SPLIT, Skinny
from fastmm.plan import select
from fastmm.problem import DeviceFacts, Problem
from fastmm.runtime.sources import read_source, source_dir

ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
DEV = {arch: DeviceFacts.simulated_device(arch) for arch in ARCHS}
#: The geometries benchmarks/probes/skinny_variants.py times (keywords of configure_v2).
GEOMETRIES = [dict(bn=32, cpt=8), dict(bn=64, cpt=8), dict(bn=128, cpt=8), dict(bn=128, cpt=4, qpt=2),
              dict(bn=32, cpt=4, qpt=2), dict(bn=128, cpt=4, threads=512), dict(pipe=0, bn=32, cpt=4, qpt=2),
              dict(pipe=0, bn=64, cpt=8)]
SK = FAMILIES["skinny"]


def stage_floats(m: dict) -> int:
    """skinny.cu v2: STAGE_FLOATS = KS * BNP + KS * AP."""
    lanes_n = m["SK_BN"] // m["SK_CPT"]
    ks = 4 * (m["SK_THREADS"] // lanes_n) * m["SK_QPT"]
    bnp = m["SK_BN"] + (4 if lanes_n == 4 else 0)
    ap = m["MT"] + 4 if m["MT"] % 8 == 0 else m["MT"]
    return ks * (bnp + ap)


def check_v2(cfg, p: Problem, dev: DeviceFacts) -> None:
    """The v2 geometry as skinny.cu defines it (also used by test_plan's geometry checks)."""
    m = dict(cfg.macros)
    assert m["SK_V2"] == 1 and m["MT"] % 4 == 0 and p.M <= m["MT"] <= 32
    lanes_n = m["SK_BN"] // m["SK_CPT"]
    assert m["SK_CPT"] in (4, 8) and lanes_n in (4, 8, 16, 32)
    assert m["MT"] * m["SK_CPT"] % (32 // lanes_n) == 0  # the in-warp exchange halves evenly
    assert cfg.block == m["SK_THREADS"] and cfg.block_dims == (cfg.block, 1, 1)
    assert (m["SK_THREADS"] // 32) % m["SK_RED"] == 0
    ks = 4 * (m["SK_THREADS"] // lanes_n) * m["SK_QPT"]
    assert cfg.tile == (m["MT"], m["SK_BN"], ks)
    assert m["SK_PIPE"] in (0, 1) and (dev.cc >= (8, 0) or m["SK_PIPE"] == 0)
    assert m["SK_STAGES"] >= 2 and (m["SK_PIPE"] or m["SK_STAGES"] == 2)
    assert cfg.smem == 4 * max(m["SK_STAGES"] * stage_floats(m), m["SK_RED"] * m["MT"] * m["SK_BN"])
    assert cfg.smem <= dev.smem_per_block_optin
    gx, gy, gz = cfg.grid
    assert gx == -(-p.N // m["SK_BN"]) and gz == min(p.batch_total, MAX_GRID_Z)
    units = -(-p.K // ks)
    assert 1 <= gy <= min(units, MAX_SPLIT)
    per = -(-units // gy)
    assert (gy - 1) * per < units  # every block row gets k work
    assert gy == 1 or p.batch_total == 1


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kw", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
def test_v2_geometry_is_consistent_for_every_m_and_fits_the_device(arch, kw):
    dev = DEV[arch]
    for M in range(1, 33):
        for N, K, extra in [(4096, 4096, {}), (4095, 4093, {}), (1000, 333, {"b_t": True}), (77, 5000, {}),
                            (4096, 1024, {"batch": 3})]:
            p = Problem.dense(M, N, K, **extra)
            cfg = SK.configure_v2(p, dev, **kw)  # shrinks the tile rather than fail
            check_v2(cfg, p, dev)
            assert SK.configure_v2(p, dev, (0,), **kw).grid[1] == 1  # option (0,): no split


def test_v2_empty_problems_still_get_a_kernel_that_builds():
    """M = 0 or K = 0 (the api writes zeros or nothing, but plans and loads first): MT stays in
    skinny.cu's 4..32 and the split model has a unit to split."""
    for p in (Problem.dense(0, 64, 64), Problem.dense(8, 64, 0), Problem.dense(0, 0, 0)):
        m = dict(SK.configure_v2(p, DEV["sm_90"]).macros)
        assert 4 <= m["MT"] <= 32 and m["MT"] % 4 == 0


def test_v2_decode16_on_sm90_is_one_wave_without_a_split():
    cfg = SK.configure_v2(Problem.dense(16, 4096, 4096), DEV["sm_90"])
    assert cfg.grid == (128, 1, 1) and dict(cfg.macros)["SK_STAGES"] == 4 and dict(cfg.macros)["SK_PIPE"] == 1


def test_default_is_v2_where_measured_and_a_variant_overrides_it():
    p = Problem.dense(16, 4096, 4096)
    assert SK.variant is None and SK.fuse_split
    default = select(p, DEV["sm_90"]).kernel  # measured there: 128 columns x 8 per thread
    m = dict(default.macros)
    assert (m["SK_V2"], m["SK_BN"], m["SK_CPT"], m["SK_PIPE"]) == (1, 128, 8, 1)
    check_v2(default, p, DEV["sm_90"])
    for arch in ("sm_75", "sm_80", "sm_86", "sm_89"):  # not measured there: v1
        assert "SK_V2" not in dict(select(p, DEV[arch]).kernel.macros), arch
    v1 = select(p, DEV["sm_90"], variants=(Skinny(variant="v1"),)).kernel
    assert "SK_V2" not in dict(v1.macros) and v1.block == 256 and v1.smem == 0
    plan = select(p, DEV["sm_90"], variants=(Skinny(variant={"bn": 64}),))
    assert plan.kernel.family == "skinny" and dict(plan.kernel.macros)["SK_V2"] == 1
    assert plan.kernel.grid == (64, 2, 1) and plan.reduce is None  # 64 tiles x 2 splits, summed in the kernel
    assert plan.kernel.split_fused and dict(plan.kernel.macros)["SK_FUSED"] == 1
    unfused = select(p, DEV["sm_90"], variants=(Skinny(variant={"bn": 64}, fuse_split=False),))  # the second pass
    assert unfused.kernel.grid == (64, 2, 1) and unfused.reduce is not None and not unfused.kernel.split_fused
    assert "SK_FUSED" not in dict(unfused.kernel.macros)
    check_v2(plan.kernel, p, DEV["sm_90"])
    plan = select(Problem.dense(16, 4096, 1024, batch=3), DEV["sm_75"], variants=(Skinny(variant={"bn": 64}),))
    # (v2 on sm_75: through registers, no cp.async; a batch: no split)
    assert dict(plan.kernel.macros)["SK_PIPE"] == 0 and plan.kernel.grid[1:] == (1, 3) and plan.reduce is None
    assert select(p, DEV["sm_90"]).kernel == default  # the registry's family is untouched by the variants


def test_a_variant_is_a_new_frozen_family_that_compares_by_its_knobs():
    """A dict variant is kept as sorted pairs, so variants are hashable (plan cache keys) and
    equal whatever order their keywords came in."""
    one, two = Skinny(variant={"bn": 64, "cpt": 4}), Skinny(variant={"cpt": 4, "bn": 64})
    assert one == two and hash(one) == hash(two) and one.variant == (("bn", 64), ("cpt", 4))
    assert one != Skinny(variant={"bn": 64}) and Skinny(fuse_split=False) != SK
    cfg = one.configure(Problem.dense(16, 4096, 4096), DEV["sm_90"])
    assert (dict(cfg.macros)["SK_BN"], dict(cfg.macros)["SK_CPT"]) == (64, 4)


@pytest.mark.parametrize("arch,M,kw,extra", [
    ("sm_90", 16, dict(bn=32, cpt=8), {}),
    ("sm_90", 17, dict(bn=128, cpt=4, threads=512), {"b_t": True}),
    ("sm_80", 32, dict(pipe=0, bn=32, cpt=4, qpt=2), {"align": 4}),
    ("sm_75", 3, dict(bn=64, cpt=8), {}),
])
def test_v2_kernels_build_without_spills(arch, M, kw, extra):
    from fastmm.runtime.compiler import _cuda_core, nvrtc_unavailable_reason

    if nvrtc_unavailable_reason():
        pytest.skip(nvrtc_unavailable_reason())
    cfg = SK.configure_v2(Problem.dense(M, 4096, 4096, **extra), DEV[arch], **kw)
    core = _cuda_core()
    opts = core.ProgramOptions(name="skinny.cu", arch=arch, std="c++17", include_path=[str(source_dir())],
                               define_macro=[(k, str(v)) for k, v in cfg.macros], ptxas_options=["-v"])
    log = io.StringIO()
    core.Program(read_source("skinny.cu"), "c++", opts).compile("cubin", logs=log)
    text = log.getvalue()
    if "registers" not in text:  # (cuda.core 1.2.0, on the GPU machine, hands back no ptxas log)
        pytest.skip("this cuda.core returns no ptxas report to read")
    assert "0 bytes spill stores, 0 bytes spill loads" in text, text
    assert "0 bytes stack frame" in text, text


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [dict(bn=32, cpt=8), dict(bn=128, cpt=4, qpt=2), dict(pipe=0, bn=32, cpt=4, qpt=2)],
                         ids=["bn32c8", "bn128c4q2", "regs"])
def test_v2_matches_float64_on_the_gpu(rel_err, kw):
    from conftest import run_forced

    if kw.get("pipe", 1) and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("cp.async needs sm80+")
    variants = (Skinny(variant=kw),)  # planned and cached apart from the registry's skinny
    for M, N, K in [(1, 4096, 4096), (16, 4095, 4093), (17, 1000, 333), (32, 4096, 1024)]:
        a, b = torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda")
        out = torch.full((M, N), float("nan"), device="cuda")
        c, plan = run_forced(a, b, "skinny", "ieee", out=out, variants=variants)
        m = dict(plan.kernel.macros)
        assert m["SK_V2"] == 1 and m["SK_BN"] == kw["bn"] and plan.variants == variants
        assert rel_err(c, a, b) <= 1e-5, (M, N, K)
    # a batch of skinny products (a matrix B would be folded into one product of M = 48)
    a, b = torch.randn(3, 16, 1000, device="cuda"), torch.randn(3, 1000, 4096, device="cuda")
    c, _ = run_forced(a, b, "skinny", "ieee", variants=variants)
    assert rel_err(c, a, b) <= 1e-5
