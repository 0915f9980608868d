"""The cost model (fastmm/cost.py) and the planner's use of it, on simulated devices.

The predictions are checked against H200 measurements recorded in benchmarks/RESULTS.md (GPU
time of rows long enough not to be host-bound), and against what any time model of a GEMM must
do (scale with the work, pay for waves, for split-K's workspace, for the bytes of a GEMV);
the planner's choice against the predictions it was given.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fastmm
from fastmm import cost, plan as planner
from fastmm.families import FAMILIES
from fastmm.plan import select
from fastmm.problem import DeviceFacts, Problem, dram_tbps
from fastmm.tuned import TunedChoice

H200 = DeviceFacts.simulated_device("sm_90")
A100 = DeviceFacts.simulated_device("sm_80")

# (M, N, K, batch, a transposed, b transposed, precision, family planned, measured us on the
# H200): RESULTS.md run 16 (model section) and run 14 (headline shapes), TFLOP/s -> us
MEASURED = [
    (4096, 4096, 4096, 1, False, False, "ieee", "simt_cp_async", 2666.1),  # square4k
    (4096, 4096, 4096, 1, False, False, "tf32", "wgmma_tf32", 390.7),
    (4096, 4096, 4096, 1, False, False, "tf32x3", "wgmma_tf32", 1188.5),
    (2048, 4096, 4096, 1, False, True, "ieee", "simt_cp_async", 1470.6),  # llama3_prefill_qo, W^T
    (2048, 14336, 4096, 1, False, True, "tf32", "wgmma_tf32", 700.0),  # llama3_prefill_up
    (14336, 4096, 2048, 1, True, False, "tf32x3", "wgmma_tf32", 2549.2),  # llama3_grad_w_up, A^T
    (4096, 768, 3072, 1, False, False, "ieee", "simt_cp_async", 475.3),  # gpt2_mlp_down
    (1, 14336, 4096, 1, False, True, "ieee", "skinny_kmajor", 58.1),  # llama3_decode1_up
    (8, 4096, 14336, 1, False, True, "ieee", "skinny_kmajor", 62.1),  # llama3_decode8_down
    (16, 14336, 4096, 1, False, True, "tf32", "kmajor_mma", 66.7),  # llama3_decode16_up
    (64, 14336, 4096, 1, False, True, "ieee", "simt_cp_async", 213.3),  # llama3_decode64_up
    (256, 256, 65536, 1, False, False, "ieee", "simt_cp_async", 178.9),  # largeK
    (512, 64, 512, 128, False, False, "tf32", "wgmma_tf32", 53.2),  # attn_pv_512
    (2048, 128, 2048, 32, False, False, "ieee", "simt_cp_async", 770.9),  # attn_pv_2k
]


@pytest.mark.parametrize("row", MEASURED, ids=lambda r: f"{r[0]}x{r[1]}x{r[2]}x{r[3]}-{r[6]}")
def test_predictions_are_within_a_quarter_of_the_h200_measurements(row):
    M, N, K, batch, a_t, b_t, precision, family, measured = row
    plan = select(Problem.dense(M, N, K, precision, batch, a_t=a_t, b_t=b_t), H200)
    assert plan.kernel.family == family  # (the plan that was measured)
    predicted = cost.predict(plan).total_us
    assert 0.75 * measured <= predicted <= 1.25 * measured, (predicted, measured)


def test_a_compute_bound_product_takes_twice_as_long_with_twice_the_rows():
    small = cost.predict(select(Problem.dense(4096, 4096, 4096), H200))
    big = cost.predict(select(Problem.dense(8192, 4096, 4096), H200))
    assert small.bound == big.bound == "compute"
    assert 1.9 <= big.total_us / small.total_us <= 2.1


def test_a_gemv_is_memory_bound_and_costs_its_weight_bytes_at_the_copy_rate():
    pred = cost.predict(select(Problem.dense(1, 14336, 4096, b_t=True), H200))
    assert pred.bound == "memory"
    weights_us = 14336 * 4096 * 4 / 4.27e6  # 235 MB at the H200's measured copy rate
    assert weights_us <= pred.total_us <= weights_us + 3 * cost.LAUNCH_US


def test_tensor_cores_are_predicted_faster_than_fp32_where_the_work_is_large():
    p32 = cost.predict(select(Problem.dense(4096, 4096, 4096, "ieee"), H200))
    tf32 = cost.predict(select(Problem.dense(4096, 4096, 4096, "tf32"), H200))
    x3 = cost.predict(select(Problem.dense(4096, 4096, 4096, "tf32x3"), H200))
    assert tf32.total_us < x3.total_us < p32.total_us


def test_a_partial_wave_costs_a_whole_wave():
    """132 SMs, one 128 x 256 block each: one more row of tiles than a wave (4 x 33 tiles, then
    5 x 33) costs a second round of tiles on the SMs that get one."""
    big_tile = TunedChoice("simt_cp_async", (2, 4, 16, 0))  # (no split: the tile count is the point)
    p_full = Problem.dense(128 * 4, 256 * 33, 1024)
    p_more = Problem.dense(128 * 4 + 1, 256 * 33, 1024)
    full, more = (cost.predict(select(p, H200, tuned=big_tile)) for p in (p_full, p_more))
    assert (full.waves, more.waves) == (1.0, 1.25)
    assert 1.8 * full.compute_us < more.compute_us < 2.2 * full.compute_us


def test_blocks_of_the_16x8_thread_tiles_take_a_whole_sm_each():
    """128 x 256 x 4096 split in three over 43 column tiles: 129 blocks of 256 threads at the
    255-register cap, one an SM (H200: 244 us measured, RESULTS run 17; the model said 490 when it
    let two share an SM, as their shared memory would)."""
    plan = select(Problem.dense(128, 11008, 4096), H200)
    assert plan.kernel.grid[:2] == (43, 3) and cost.resident_blocks(plan.kernel, H200) == 1
    small = select(Problem.dense(4096, 64, 64, batch=1), H200, force="simt_cp_async").kernel
    assert dict(small.macros)["THREAD_M"] == 8 and cost.resident_blocks(small, H200) > 1  # (fewer registers)
    assert 0.8 * 244.1 <= cost.predict(plan).total_us <= 1.25 * 244.1


def test_tf32_mma_blocks_per_sm_follow_their_threads_and_registers():
    """One warp a block (the 64 x 64 tile: 55296 bytes of stages, 32 threads) fits four an SM by
    shared memory (228 KiB, 1 KiB a block kept by the driver), its registers eight; four warps
    of 64 x 64 (128 threads at ptxas's ~244-255 registers) two by registers."""
    one = select(Problem.dense(64, 64, 64, "tf32", batch=4096), H200, force="tf32_mma").kernel
    assert one.block_dims[0] == 32 and one.smem == 55296
    assert cost.resident_blocks(one, H200) == (228 * 1024) // (55296 + 1024) == 4
    four = FAMILIES["tf32_mma"].configure(Problem.dense(4096, 4096, 4096, "tf32"), H200, (2, 2, 64, False))
    assert math.prod(four.block_dims) == 128 and cost.resident_blocks(four, H200) == 65536 // (128 * 256) == 2


#: Batched tf32 products on wgmma's persistent tiles, GPU us measured on an H100 (candidates
#: probe, NOTES run 57): (batch, M, N, K, B transposed, us).
PERSISTENT_H100 = [(4096, 64, 64, 64, False, 77.4), (4096, 64, 64, 128, False, 123.1),
                   (4096, 128, 64, 64, True, 124.1), (4096, 128, 128, 64, False, 195.3),
                   (512, 64, 64, 64, False, 15.1)]


@pytest.mark.parametrize("batch,M,N,K,bt,measured", PERSISTENT_H100,
                         ids=[f"{b}x{m}x{n}x{k}" for b, m, n, k, _, _ in PERSISTENT_H100])
def test_persistent_wgmma_plans_pay_a_waves_fixed_cost_once(batch, M, N, K, bt, measured):
    """A block an SM walking 4-31 waves of tiles: predicted within 20% of the H100's times (with
    the fixed cost paid every wave, 4096 x 64^3 was predicted at 158.6 us)."""
    h100 = DeviceFacts.simulated_h100()
    plan = select(Problem.dense(M, N, K, "tf32", batch=batch, b_t=bt), h100, force="wgmma_tf32")
    assert plan.kernel.work_items > plan.kernel.grid[0] and not plan.staging  # (persistent, no copies)
    assert 0.8 * measured <= cost.predict(plan).total_us <= 1.2 * measured


def test_a_small_batched_tf32_product_stays_on_wgmma_where_it_beats_fp32():
    """4096 x (64 x 64 x 64) tf32 (model_dims_extra's bmm64_short) ran the fp32 SIMT plan, 86.7 us
    on the H100, where wgmma takes 77.4 (NOTES run 57): with the wave's cost paid once, fp32 is
    no longer predicted 25% faster, on either Hopper part."""
    p = Problem.dense(64, 64, 64, "tf32", batch=4096)
    for dev in (H200, DeviceFacts.simulated_h100()):
        plan = select(p, dev)
        assert plan.kernel.family == "wgmma_tf32" and plan.origin == "heuristic" and plan.precision_used == "tf32"
        fp32 = select(Problem.dense(64, 64, 64, "ieee", batch=4096), dev)
        assert cost.predict(plan).total_us < cost.predict(fp32).total_us


def test_a_second_pass_adds_a_launch():
    plan = select(Problem.dense(128, 4096, 16384, "tf32"), H200, force="tf32_mma")
    assert plan.reduce is not None
    assert cost.predict(plan).launches == 2


def test_stream_k_in_the_head_form_counts_its_plain_launch_and_all_its_tiles():
    # 32000 x 1024 x 8192 A^T on the H200: 924 tiles in a plain launch, 76 in the stream-K launch,
    # then the fixup: three launches, (924 + 76) / 132 waves of tiles, within a quarter of the
    # 10231 us measured (NOTES run 36)
    plan = select(Problem.dense(32000, 1024, 8192, a_t=True), H200)
    assert plan.head is not None
    pred = cost.predict(plan)
    assert pred.launches == 3 and pred.waves == pytest.approx(1000 / 132)
    assert 0.75 * 10231 <= pred.total_us <= 1.25 * 10231


def test_a_torch_fallback_has_no_prediction():
    old = DeviceFacts(0, "simulated P100", (6, 0), 56, 48 * 1024, 64 * 1024, 4 << 20, simulated=True)
    plan = select(Problem.dense(64, 64, 64), old)  # older than fastmm supports: torch.matmul
    assert plan.kernel is None and plan.fallback
    assert cost.predict(plan) is None


@pytest.mark.parametrize("clock_khz, bus_bits, datasheet_tbps", [
    (2_619_000, 5120, 3.35),  # H100 80GB SXM (its driver's figures, NOTES run 46)
    (1_215_000, 5120, 1.555),  # A100 40GB
    (3_201_000, 6144, 4.8),  # H200 (the datasheet rounds down: 4.92 by the clock)
])
def test_the_drivers_memory_clock_and_bus_width_give_the_datasheet_bandwidth(clock_khz, bus_bits, datasheet_tbps):
    assert dram_tbps(clock_khz, bus_bits) == pytest.approx(datasheet_tbps, rel=0.03)


def test_device_facts_read_the_memory_clock_and_bus_width_from_the_driver(monkeypatch):
    import cuda.core

    from fastmm.runtime import device as runtime_device

    class Props:
        multiprocessor_count, max_shared_memory_per_block_optin = 132, 227 * 1024
        max_shared_memory_per_multiprocessor, l2_cache_size = 228 * 1024, 50 << 20
        memory_clock_rate, global_memory_bus_width = 2_619_000, 5120

    class FakeDevice:
        def __init__(self, index):
            self.properties, self.compute_capability, self.name = Props(), (9, 0), "NVIDIA H100 80GB HBM3"

    monkeypatch.setattr(cuda.core, "Device", FakeDevice)
    runtime_device.device_facts.cache_clear()
    try:
        facts = runtime_device.device_facts(0)
    finally:
        runtime_device.device_facts.cache_clear()
    assert facts.dram_tbps == pytest.approx(3.352, abs=1e-3)
    # the same facts as the simulated H100 the planner's tests use, but for the name
    assert facts == dataclasses.replace(DeviceFacts.simulated_h100(), name=facts.name, simulated=False)


def test_copies_on_another_part_of_an_arch_move_at_its_own_bandwidth():
    h100 = DeviceFacts.simulated_h100()
    assert cost.copy_bandwidth(H200) == cost.PEAKS[(9, 0)].bandwidth  # the part it was measured on
    # H100: the H200's measured 4.27 TB/s scaled by the peaks (3.35 / 4.92): 2.91, about the 3.0 a
    # copy moved on one (device/KINDS.md)
    assert cost.copy_bandwidth(h100) == pytest.approx(2.91, abs=0.01)
    # a part whose bandwidth the driver did not give keeps the arch's figure
    assert cost.copy_bandwidth(dataclasses.replace(h100, dram_tbps=0.0)) == cost.PEAKS[(9, 0)].bandwidth
    # a memory-bound GEMV (the weights streamed once) takes the bandwidths' ratio longer
    gemv = Problem.dense(1, 14336, 4096, b_t=True)
    fast, slow = cost.predict(select(gemv, H200)), cost.predict(select(gemv, h100))
    assert fast.bound == slow.bound == "memory"
    assert slow.total_us - cost.LAUNCH_US == pytest.approx((fast.total_us - cost.LAUNCH_US) * 4.917 / 3.352, rel=0.02)


def test_unknown_newer_arches_use_the_newest_known_peaks():
    future = DeviceFacts(0, "future", (10, 0), 148, 227 * 1024, 228 * 1024, 100 << 20, simulated=True)
    assert cost.peaks(future) == cost.PEAKS[(9, 0)]
    assert not cost.calibrated(future)


# ---------------------------------------------------------------------------------------------
# the planner's use of the model

# tf32x3 with K = 32: one k-step per tile. (At K = 64, run 22's example, tf32x3's 64-wide wgmma tile
# of run 23 is predicted at 13.2 us against 9.9 for fp32: within the margin, so it stays.)
SHORT_K = Problem.dense(1024, 700, 32, "tf32x3")


def test_a_tf32x3_request_runs_fp32_where_the_model_predicts_it_clearly_faster():
    plan = select(SHORT_K, H200)
    fp32 = select(Problem.dense(1024, 700, 32, "ieee"), H200)
    tc = planner._select_in_order(SHORT_K, H200, None, ())
    assert tc.kernel.family == "wgmma_tf32"  # what the preference order alone picks
    assert plan.kernel == fp32.kernel and plan.precision_used == "ieee"
    assert plan.problem == SHORT_K  # (the request's problem: the cache key it is stored under)
    assert cost.faster_by(cost.predict(fp32), cost.predict(tc), planner.COST_MARGIN)
    assert "cost model" in plan.origin and "more accurate" in plan.origin
    reason = dict(plan.rejected)["wgmma_tf32"]
    assert "predicts" in reason and "full-fp32" in reason


#: Host us a call, measured back to back on the H200 machine (NOTES runs 10, 16 and RESULTS run 21):
#: a plain SIMT / skinny launch through the fast path; wgmma without copies; tf32x3 on wgmma with
#: two staging copies (1024 x 700 x 64: 40.7 us a call for ~13 us of GPU work).
HOST_MEASURED = [(Problem.dense(16, 4096, 4096, "ieee", b_t=True), 16.7), (Problem.dense(1000, 1000, 1000, "tf32"), 24.7),
                 (Problem.dense(1024, 700, 64, "tf32x3"), 40.7)]


@pytest.mark.parametrize("p,measured", HOST_MEASURED, ids=["plain", "wgmma", "wgmma-two-copies"])
def test_the_host_time_a_call_is_within_a_quarter_of_the_h200_measurements(p, measured):
    plan = planner._select_in_order(p, H200, None, ())  # (the preference order's plan: what was timed)
    pred = cost.predict(plan)
    assert 0.75 * measured <= pred.host_us <= 1.25 * measured, (plan.kernel.family, pred.describe())


def test_a_request_the_host_would_pace_runs_the_plan_with_fewer_launches():
    """1024 x 700 x 64 tf32x3: wgmma's plan (two staging copies, three launches) is ahead on GPU
    time, but a call of it is host-bound; the fp32 SIMT plan (one launch) is faster a call."""
    p = Problem.dense(1024, 700, 64, "tf32x3")
    tc = planner._select_in_order(p, H200, None, ())
    assert tc.kernel.family == "wgmma_tf32" and len(tc.staging) == 2
    plan = select(p, H200)
    assert plan.kernel.family == "simt_cp_async" and plan.precision_used == "ieee"
    mine, theirs = cost.predict(tc), cost.predict(plan)
    assert mine.host_us > mine.total_us and mine.per_call_us == mine.host_us  # host-bound
    assert theirs.per_call_us < mine.per_call_us and "host" in dict(plan.rejected)["wgmma_tf32"]


def test_the_tf32_plan_stays_where_the_model_does_not_predict_fp32_clearly_faster():
    for p in (Problem.dense(4096, 4096, 4096, "tf32"), Problem.dense(1024, 2816, 1024, "tf32x3"),
              Problem.dense(512, 64, 512, "tf32", batch=128)):
        plan = select(p, H200)
        assert plan.precision_used == p.precision and plan.origin == "heuristic"
        alt = select(Problem.dense(p.M, p.N, p.K, "ieee", p.batch_total), H200)
        assert not cost.faster_by(cost.predict(alt), cost.predict(plan), planner.COST_MARGIN)


@pytest.mark.parametrize("arch", ["sm_86"])
def test_the_model_moves_no_plan_on_an_arch_it_was_not_calibrated_on(arch, monkeypatch):
    """256 x 64 x 4096 tf32: predicted faster in fp32 on the RTX A6000 too (its published peaks,
    the H200's shares), but measured there never: the plan stays on tensor cores until the arch
    is calibrated. (On the L40S, TF32 at 2x its fp32 peak, no product is predicted faster in
    fp32 a call once the host's time counts.)"""
    dev, p = DeviceFacts.simulated_device(arch), Problem.dense(256, 64, 4096, "tf32")
    plan = select(p, dev)
    assert plan.kernel.family == "tf32_mma" and plan.origin == "heuristic"
    monkeypatch.setattr(cost, "CALIBRATED", cost.CALIBRATED + (dev.cc,))
    assert "cost model: ran full fp32" in select(p, dev).origin  # (what the gate holds back)


def test_a_forced_or_tuned_family_is_not_second_guessed():
    forced = select(SHORT_K, H200, force="wgmma_tf32")
    assert forced.kernel.family == "wgmma_tf32" and forced.origin == "forced: wgmma_tf32"
    option = FAMILIES["wgmma_tf32"].options(SHORT_K, H200)[0]
    tuned = select(SHORT_K, H200, tuned=TunedChoice("wgmma_tf32", tuple(option), "measured"))
    assert tuned.kernel.family == "wgmma_tf32" and tuned.origin.startswith("tuned")


def test_the_other_families_reasons_name_the_fp32_family_as_preferred():
    plan = select(SHORT_K, H200)
    reasons = dict(plan.rejected)
    assert reasons["simt_float4"] == reasons["scalar"] == "simt_cp_async is preferred"
    assert "simt_cp_async" not in reasons and not any(r == "wgmma_tf32 is preferred" for r in reasons.values())


def test_an_ignored_tuned_choice_keeps_the_cost_models_reason(monkeypatch):
    stale = TunedChoice("no_such_family", (), "measured")
    plan = select(SHORT_K, H200, tuned=stale)
    assert "cost model: ran full fp32" in plan.origin and "tuned choice" in plan.origin and "ignored" in plan.origin


def test_explain_prints_the_prediction(emulated_gpu):
    a, b = torch.randn(256, 512), torch.randn(512, 384)
    exp = fastmm.explain(a, b, precision="ieee")
    assert exp.prediction == cost.predict(exp.plan)
    assert f"predicted: {exp.prediction.describe()}" in str(exp) and "us predicted" in str(exp)


def test_launch_bound_requests_keep_the_preference_order():
    """Where both plans take about a launch, the predictions differ by the model's constants, not
    by the kernels: decode-sized tf32 requests stay on the tensor-core family that serves them."""
    for M, N, K in ((8, 1, 4096), (17, 5, 4096), (16, 100, 999), (32, 17, 4096), (24, 1001, 257)):
        for b_t in (True, False):
            plan = select(Problem.dense(M, N, K, "tf32", b_t=b_t), H200)
            assert "cost model" not in plan.origin, (M, N, K, b_t, plan.origin)


def test_the_one_warp_tf32_tile_is_rated_by_how_its_block_copies_the_operands():
    """tf32_mma's one-warp 64 x 64 block issues all of its own copies: in single floats it ran at
    ~0.4 of the multi-warp tiles' rate, with 16-byte copies of both operands at 0.62-0.71
    (NOTES runs 49 and 56); the model counts it so, and the other tiles at the family's rate."""
    from fastmm.families.tf32_mma import ONE_WARP_RATE, ONE_WARP_RATE_VEC

    efficiency = cost.efficiency
    fam, dev = FAMILIES["tf32_mma"], DeviceFacts.simulated_device("sm_90")
    aligned = Problem.dense(64, 64, 64, precision="tf32", batch=4096)
    odd = Problem.dense(77, 64, 77, precision="tf32", batch=4096)  # K = 77: A in single floats
    full = efficiency(fam.configure(aligned, dev, (2, 2, 64, 1)), aligned, dev.cc)
    assert efficiency(fam.configure(aligned, dev, (1, 1, 64, 1)), aligned, dev.cc) == pytest.approx(full * ONE_WARP_RATE_VEC)
    assert efficiency(fam.configure(odd, dev, (1, 1, 64, 1)), odd, dev.cc) == pytest.approx(full * ONE_WARP_RATE)
    assert efficiency(fam.configure(odd, dev, (2, 2, 32, 1)), odd, dev.cc) == pytest.approx(full)
