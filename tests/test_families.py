"""fastmm.families: the registry, the interface every family answers (the planner asks them all
the same questions by name), variants as new frozen instances, and the shared helpers of
families/base.py on hand-computed cases. (Which family the planner picks: tests/test_plan.py;
the work-split models: tests/test_work_split.py.)"""
from __future__ import annotations

import dataclasses

import pytest

from fastmm.families import FAMILIES, SimtCpAsync, SimtFloat4, Skinny, WgmmaTf32
from fastmm.families.base import (LAUNCH_FORMS, grid_of, k_dominant, pick_tile, round4, tiles_of, vec_ok,
                                  with_split_flags)
from fastmm.plan import PREFERENCE, family_of, select
from fastmm.problem import PRECISIONS, DeviceFacts, Problem

H200 = DeviceFacts.simulated_device("sm_90")


def test_the_registry_holds_every_family_the_planner_prefers_under_its_own_name():
    assert {name for order in PREFERENCE.values() for name in order} == set(FAMILIES)
    for name, fam in FAMILIES.items():
        assert fam.name == name and fam.source == f"{name}.cu" and fam.entry == f"fastmm_{name}"
        assert fam.launch_form in LAUNCH_FORMS
        assert set(fam.precisions) <= set(PRECISIONS)
        assert all(name in PREFERENCE[p] for p in fam.precisions)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_answers_the_planners_questions(name):
    fam = FAMILIES[name]
    # the skinny families' own problems: 16 rows, and B read along K (x @ W.t()) for the K-major ones
    p = Problem.dense(16 if name in ("skinny", "skinny_kmajor", "kmajor_mma") else 1024, 1024, 1024,
                      precision=fam.precisions[-1], b_t=name in ("skinny_kmajor", "kmajor_mma"))
    assert fam.reject(p, H200) is None
    reason = fam.heuristic_reason(p, H200)
    assert reason is None or isinstance(reason, str)
    options = fam.options(p, H200)
    assert options and all(isinstance(o, tuple) for o in options)
    cfg = fam.configure(p, H200)
    assert cfg.family == name and cfg.source == fam.source and cfg.entry.startswith(fam.entry)
    launch_p, staged, swap = fam.staging(p, H200)
    assert (launch_p is p and not staged and not swap) or name == "wgmma_tf32"  # dense and aligned: nothing to copy
    assert fam.stagers(p, ()) == ()
    assert fam.precision_computed(p) in PRECISIONS


def test_only_the_tensor_core_families_compute_below_fp32_and_only_wgmma_launches_with_tensor_maps():
    for name, fam in FAMILIES.items():
        for precision in fam.precisions:
            computed = fam.precision_computed(Problem.dense(256, 256, 256, precision=precision))
            assert computed == (precision if name in ("tf32_mma", "wgmma_tf32", "kmajor_mma") else "ieee"), (name, precision)
        assert (fam.launch_form == "tensor_maps") == (name == "wgmma_tf32")


def test_a_variant_is_a_new_instance_the_registry_never_sees():
    fam = SimtCpAsync(stream_k=False)
    assert fam != FAMILIES["simt_cp_async"] and FAMILIES["simt_cp_async"].stream_k
    with pytest.raises(dataclasses.FrozenInstanceError):
        fam.stream_k = True
    assert family_of("simt_cp_async", (fam,)) is fam and family_of("simt_cp_async") is FAMILIES["simt_cp_async"]
    assert family_of("skinny", (fam,)) is FAMILIES["skinny"]  # a variant replaces its own name only
    p = Problem.dense(8192, 4096, 6144)  # stream-K where it may (the headline shape on the H200)
    assert select(p, H200).kernel.stream_k is not None
    plan = select(p, H200, variants=(fam,))
    assert plan.kernel.stream_k is None and plan.variants == (fam,)
    assert select(p, H200).kernel.stream_k is not None  # the registry's family is unchanged
    assert SimtFloat4(stream_k=False) != SimtCpAsync(stream_k=False)  # (another family, same knobs)
    assert hash(Skinny(fuse_split=False)) == hash(Skinny(fuse_split=False))


def test_describe_staging_says_what_each_family_copies():
    p = Problem.dense(4097, 4095, 4093, precision="tf32")
    simt = FAMILIES["simt_cp_async"].describe_staging(p, "b", 4093, 4096)
    assert simt.startswith("B copied into a zero-padded 4093x4096 buffer")
    assert "B transposed copied K-major (4095x4096" in WgmmaTf32().describe_staging(p, "bt", 4095, 4096)
    x3 = dataclasses.replace(p, precision="tf32x3")
    assert "split into big and small TF32 halves" in WgmmaTf32().describe_staging(x3, "a", 4097, 4096)


# --- the helpers of families/base.py ------------------------------------------------------------------

@pytest.mark.parametrize("extent,other,batch,align,ok", [
    (1024, 1024, (0, 0), 16, True),
    (1023, 1024, (0, 0), 16, False),  # the vectors would run past a row's end
    (1024, 1025, (0, 0), 16, False),  # the next row starts off 16 bytes
    (1024, 1024, (0, 1024 * 1024 + 2), 16, False),  # so does the next matrix
    (1024, 1024, (0, 0), 8, False),  # the base pointer
    (4, 0, (0, 0), 16, True),  # a zero stride (an expanded operand) is a multiple of 4
])
def test_vec_ok_needs_whole_aligned_vectors_in_every_row_and_matrix(extent, other, batch, align, ok):
    assert vec_ok(extent, other, batch, align) is ok


def test_round4_counts_padded_rows_as_whole_vectors():
    assert [round4(n, True) for n in (1, 4, 5, 4095)] == [4, 4, 8, 4096]
    assert round4(4095, False) == 4095


def test_tiles_grid_and_the_90_percent_wave_rule():
    p = Problem.dense(1408, 1408, 64)
    assert tiles_of(p, 128, 128) == 121 and tiles_of(p, 128, 256) == 66  # 11 x 11; 11 x 6
    assert grid_of(0, 1) == (1, 1, 1) and grid_of(5, 70_000, 3) == (5, 3, 65535)
    sizes = {"big": (128, 256), "mid": (128, 128), "small": (64, 64)}
    # 66 big tiles < 0.9 x 132 = 118.8; 121 mid tiles >= it: the largest that fills 90% of a wave
    assert pick_tile(p, H200, ("big", "mid", "small"), sizes.get) == "mid"
    none_fill = Problem.dense(64, 64, 64)
    assert pick_tile(none_fill, H200, ("big", "mid", "small"), sizes.get) == "small"  # none fills it: the smallest


def test_k_dominant_is_long_k_with_a_small_output_and_a_batch_of_1():
    assert k_dominant(Problem.dense(256, 256, 1024))
    assert not k_dominant(Problem.dense(256, 256, 1023))
    assert not k_dominant(Problem.dense(256, 256, 65536, batch=2))


def test_split_flags_double_every_tile_option():
    assert with_split_flags(((1, 2), (3, 4))) == ((1, 2, 1), (1, 2, 0), (3, 4, 1), (3, 4, 0))
    assert with_split_flags(((),)) == ((1,), (0,))
