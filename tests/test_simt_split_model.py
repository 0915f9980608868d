"""fastmm.families.simt_split_model and the plans it chooses (SimtCore.modelled_choice): mid-size
simt_cp_async products on sm_90 take the tile and K split the model has fastest. CPU only: the
model's orderings are checked against plans timed on the H100 (NOTES run 54), not against itself."""
from __future__ import annotations

import dataclasses

import pytest

from fastmm.families import SimtCpAsync
from fastmm.families import simt_split_model as model
from fastmm.families.work_split import MIN_KTILES_PER_SPLIT
from fastmm.plan import select
from fastmm.problem import DeviceFacts, Problem
from fastmm.tuned import TunedChoice

H100 = DeviceFacts.simulated_h100()
H200 = DeviceFacts.simulated_device("sm_90")
RULES = SimtCpAsync(split_model=False)


def plan_of(p: Problem, opt: tuple[int, int, int], split: int):
    """simt_cp_async's plan of ``p`` on tile ``opt`` with K split ``split`` ways, as the probe built
    it (probes/simt_split_probe.py --tiles all: probe_util.SimtOption)."""
    fam = dataclasses.replace(RULES, split=split, stream_k=False)
    return fam.configure(p, H100, opt + (1,))


def modelled(p: Problem, opt, split) -> float:
    cfg = plan_of(p, opt, split)
    return model.plan_us(cfg, p, H100, SimtCpAsync().staged_b_floats(p, cfg))


#: (M, N, K, B^T, faster plan, its us, slower plan, its us): plans = (tile option, K split asked
#: for); H100 GPU us by CUDA graph replay, each checked against float64 (NOTES run 54). Pairs a
#: quarter or more apart, from the rows the model was fitted on and from the held-out ones.
MEASURED = [
    (1500, 2048, 512, True, ((2, 2, 8), 1), 82.2, ((2, 2, 16), 4), 117.7),  # held out
    (450, 3333, 800, True, ((2, 2, 8), 1), 91.5, ((1, 2, 8), 6), 123.2),  # held out
    (1200, 2304, 768, True, ((2, 2, 8), 1), 118.5, ((2, 2, 16), 4), 147.5),  # held out
    (1536, 1536, 384, True, ((2, 2, 8), 1), 62.2, ((2, 2, 16), 3), 77.5),  # held out
    (1200, 768, 2304, False, ((2, 4, 16), 4), 110.1, ((2, 2, 16), 3), 155.1),  # held out: grad_x (pairs)
    (733, 1999, 517, True, ((1, 2, 8), 1), 59.5, ((2, 2, 8), 2), 75.3),
    (900, 3000, 1000, True, ((2, 2, 8), 1), 150.7, ((2, 2, 16), 4), 181.0),
    (1500, 1500, 640, True, ((1, 2, 8), 2), 98.2, ((2, 2, 16), 5), 121.5),
]


@pytest.mark.parametrize("M,N,K,b_t,fast,fast_us,slow,slow_us", MEASURED)
def test_the_model_orders_plans_as_they_were_measured(M, N, K, b_t, fast, fast_us, slow, slow_us):
    p = Problem.dense(M, N, K, b_t=b_t)
    assert model.in_domain(p, H100)
    assert modelled(p, *fast) < modelled(p, *slow)
    # and within the model's error (9% rms held out) of each time
    for plan, us in ((fast, fast_us), (slow, slow_us)):
        assert 0.75 < modelled(p, *plan) / us < 1.33, (plan, modelled(p, *plan), us)


def test_the_fused_sum_of_the_largest_tile_is_modelled_at_its_measured_cost():
    """1024 x 2816 x 1024 W^T (H100): the 128 x 128 tile in 3 slices 159.4 us, the 128 x 256 one in
    3 (summed by its last blocks) 178.1; on the H200, 10% apart the same way (NOTES run 26). Before
    TileRate.fused the model had them the other way round."""
    p = Problem.dense(1024, 2816, 1024, b_t=True)
    big = plan_of(p, (2, 4, 16), 3)
    assert big.split_fused and big.tile[:2] == (128, 256)
    assert modelled(p, (2, 2, 16), 3) < modelled(p, (2, 4, 16), 3)
    plan = select(p, H200)
    assert plan.kernel.tile[:2] != (128, 256), plan.describe()


@pytest.mark.parametrize("dev", [H100, H200], ids=["h100", "h200"])
def test_mid_size_products_take_the_modelled_tile_and_split_and_explain_it(dev):
    p = Problem.dense(1500, 2048, 512, b_t=True)  # rules: 128 x 128 in 4 slices, 117.7 us on the H100
    rules = select(p, dev, variants=(RULES,)).kernel
    assert rules.tile[:2] == (128, 128) and rules.split_k == 4
    plan = select(p, dev)
    assert plan.kernel.tile[:2] == (128, 64) and plan.kernel.split_k == 1  # 82.2 us
    why = dict(plan.kernel.details)["tile and split"]
    assert "simt_split_model" in why and "1 slice of K" in why
    assert "simt_split_model" in plan.describe()


@pytest.mark.parametrize("what,p,dev", [
    ("an sm_80 device", Problem.dense(1500, 2048, 512, b_t=True), DeviceFacts.simulated_device("sm_80")),
    ("a batch", Problem.dense(1500, 2048, 512, b_t=True, batch=2), H200),
    ("long K, a small output", Problem.dense(512, 512, 2048, b_t=True), H200),
    ("K past MAX_K", Problem.dense(1024, 1024, model.MAX_K + 8, b_t=True), H200),
    ("grad_W's m-contiguous A", Problem.dense(1024, 512, 1000, a_t=True), H200),
    ("fewer than MIN_SIDE rows", Problem.dense(model.MIN_SIDE - 1, 4096, 1024, b_t=True), H200),
    ("tiles that fill the GPU", Problem.dense(4096, 4096, 1024, b_t=True), H200),
    ("fewer 64 x 64 tiles than SMs", Problem.dense(300, 700, 1100, b_t=True), H200),  # (the suite's odd_small)
])
def test_products_outside_the_fitted_range_keep_the_rules_plan(what, p, dev):
    fam = SimtCpAsync()
    assert not fam.modelled(p, dev), what
    assert select(p, dev).kernel == select(p, dev, variants=(RULES,)).kernel, what


def test_a_tuned_option_with_its_split_flag_means_the_modelled_split_for_that_tile():
    """The tuner's options stay (tile, split flag): for a product the model serves, flag 1 is the
    model's split for that tile, so the heuristic plan is one of the options and a stored choice
    keeps its meaning at every size of its bucket."""
    p = Problem.dense(1500, 1500, 640, b_t=True)
    fam = SimtCpAsync()
    heuristic = fam.configure(p, H200)
    configs = [fam.configure(p, H200, opt) for opt in fam.options(p, H200)]
    assert heuristic in configs
    for opt in fam.tile_options:
        cfg, us = fam.modelled_split(p, H200, opt)
        assert fam.configure(p, H200, opt + (1,)) == cfg
        assert fam.configure(p, H200, opt + (0,)).split_k == 1
        others = [modelled_split_of(fam, p, opt, s) for s in (1, 2, 3, 4, 5, 6, 8)
                  if s <= -(-p.K // fam.bk) // MIN_KTILES_PER_SPLIT]
        assert us == pytest.approx(min(others))


def modelled_split_of(fam, p, opt, split):
    cfg = dataclasses.replace(fam, split=split, split_model=False, stream_k=False).configure(p, H200, opt + (1,))
    return model.plan_us(cfg, p, H200, fam.staged_b_floats(p, cfg))


@pytest.mark.parametrize("dev", [H100, H200], ids=["h100", "h200"])
def test_a_transposed_b_goes_with_the_largest_tile_and_the_tuner_can_time_every_heuristic_plan(dev):
    """simt_cp_async copies W^T row-major for the 128 x 256 tile without a fused split (staging),
    then plans the copied problem again: that plan keeps the tile the copy was made for
    (relaunch_option; 1536 x 2048 x 1280 once launched 128 x 128 on a copied B), and some tuned
    option rebuilds the heuristic plan, copy included, so the tuner times it (a scan of W^T
    products in the model's range)."""
    fam = SimtCpAsync()
    seen = 0
    shapes = [(M, N, K) for M in (768, 1024, 1536, 1792, 2333) for N in (512, 1280, 1520, 2048, 2816)
              for K in (512, 1280, 2066, 2488)]
    # (the review's: a copy paid for a 128 x 128 launch on one of these devices or both)
    shapes += [(1536, 2048, 1280), (2333, 1520, 2488), (2048, 1792, 2560), (1148, 2208, 2066), (1280, 2816, 1536),
               (1536, 2304, 1792), (2304, 1536, 1536)]
    for M, N, K in shapes:
        p = Problem.dense(M, N, K, b_t=True)
        if not fam.modelled(p, dev):
            continue
        plan = select(p, dev)
        staged = any(which == "b" for which, _, _ in plan.staging)
        in_place = fam.configure(p, dev)
        assert staged == (in_place.tile[:2] == (128, 256) and not in_place.split_fused), (M, N, K)
        assert not staged or plan.kernel.tile[:2] == (128, 256), plan.describe()
        seen += staged
        tuned = [select(p, dev, tuned=TunedChoice("simt_cp_async", opt)) for opt in fam.options(p, dev)]
        assert any((t.kernel.macros, t.kernel.grid, t.staging) == (plan.kernel.macros, plan.kernel.grid,
                                                                   plan.staging) for t in tuned), (M, N, K)
    assert seen >= 5  # (the copy is taken somewhere in the scan)


def test_resident_blocks_follow_threads_registers_and_the_launch_bound():
    p = Problem.dense(1000, 1000, 1000, b_t=True)
    blocks = {opt: model.simt_resident_blocks(plan_of(p, opt, 1), H200) for opt in RULES.tile_options}
    # 255 registers a thread on the 16 x 8 tiles: one 256-thread block, two 128-thread ones; 168 on
    # the 8 x 8 ones: three 128-thread blocks, six 64-thread ones
    assert blocks == {(2, 4, 16): 1, (2, 2, 16): 2, (2, 2, 8): 3, (1, 2, 8): 6}
