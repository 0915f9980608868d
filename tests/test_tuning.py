"""Autotuning: shape buckets, the families' options, select() with a tuned choice, the tuning
store on disk, and fastmm.tune / FASTMM_TUNE.

CPU: everything but the timing itself (buckets, options vs the heuristics on every problem of the
planner's zoo, tuned and stale choices, store round trip / key mismatch / corruption / unwritable
folder / concurrent writers, fastmm.dispatch's use of a stored choice through a simulated device, plan
cache invalidation, tune()'s refusals, the first-use hook).
GPU (marked ``cuda``): tune() on real shapes at every precision (every candidate must match
float64), the stored choice used by the next fastmm.matmul, FASTMM_TUNE=1.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import multiprocessing
import os
import warnings

import pytest
import torch

import fastmm
from fastmm import dispatch, errors, fast_path, tuning
from fastmm.families import FAMILIES, SPLIT_FLAGS
from fastmm.plan import candidate_choices, select, tuned_reject_reason
from fastmm.problem import DeviceFacts, Problem
from fastmm.shapes import analyse, build_problem
from fastmm.runtime import tuning_store
from fastmm.runtime.compiler import CompileError
from fastmm.runtime.tuning_store import FORMAT, DeviceKey, TuningStore, TuningWarning
from fastmm.tuned import TunedChoice, bucket_of, size_bucket
from test_plan import ZOO, check_geometry

ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
DEV = {arch: DeviceFacts.simulated_device(arch) for arch in ARCHS}
SM90 = DEV["sm_90"]
#: Families whose geometry tests/test_plan.py checks against cuda_src/.
GEOMETRY_KNOWN = ("scalar", "simt_float4", "simt_cp_async", "tf32_mma", "skinny", "skinny_kmajor")
explain_module = importlib.import_module("fastmm.explain")  # (fastmm.explain is the function)
KEY = DeviceKey("NVIDIA Test GPU", (9, 0), 13000, (13, 0), fastmm.__version__)


def _precisions(p: Problem):
    return [dataclasses.replace(p, precision=prec) for prec in ("ieee", "tf32", "tf32x3")]


# --- buckets -------------------------------------------------------------------------------------

def test_size_bucket_is_the_power_of_two_at_or_above():
    assert [size_bucket(n) for n in (0, 1, 2, 3, 4, 5, 31, 32, 33, 4096, 4097)] == [1, 1, 2, 4, 4, 8, 32, 32, 64, 4096,
                                                                                     8192]


def test_sizes_within_a_factor_of_two_share_a_bucket_and_each_part_of_the_key_splits_it():
    base = bucket_of(Problem.dense(4096, 4096, 4096))
    assert bucket_of(Problem.dense(3000, 2052, 4000)) == base
    assert bucket_of(Problem.dense(4097, 4096, 4096)) != base
    assert bucket_of(Problem.dense(4096, 4096, 2048)) != base
    # precision, layouts, vector class, batched or not each change it; the batch size does not
    assert bucket_of(Problem.dense(4096, 4096, 4096, "tf32")) != base
    assert bucket_of(Problem.dense(4096, 4096, 4096, a_t=True)) != base
    assert bucket_of(Problem.dense(4096, 4096, 4096, b_t=True)) != bucket_of(Problem.dense(4096, 4096, 4096, a_t=True))
    assert bucket_of(Problem.dense(4096, 4096, 4096, align=4)) != base
    assert bucket_of(Problem.dense(4096, 4095, 4096)) != base  # N % 4 != 0: B and C lose 16-byte vectors
    assert bucket_of(Problem.dense(4096, 4096, 4096, batch=2)) != base
    assert bucket_of(Problem.dense(4096, 4096, 4096, batch=2)) == bucket_of(Problem.dense(4096, 4096, 4096, batch=64))
    assert base == "ieee|a=r,b=r,c=r|vec=vvv|single|M4096|N4096|K4096"


def test_skinny_boundary_is_a_bucket_boundary():
    """The skinny family takes M <= 32 (8/16/32-row variants): no bucket mixes skinny and not."""
    for m in range(1, 65):
        same = [k for k in range(1, 65) if bucket_of(Problem.dense(k, 4096, 4096)) == bucket_of(Problem.dense(m, 4096, 4096))]
        assert all((k <= 32) == (m <= 32) for k in same)
        assert all((k <= 8) == (m <= 8) and (k <= 16) == (m <= 16) for k in same)


def test_strided_operands_read_as_strided_and_scalar():
    p = Problem(300, 200, 100, (2 * 100, 2), (2 * 200, 2), (200, 1))
    assert bucket_of(p).startswith("ieee|a=s,b=s,c=r|vec=ssv|")


# --- the families' options ---------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_the_heuristic_choice_is_one_of_the_options_and_every_option_is_a_valid_kernel(arch):
    dev = DEV[arch]
    for base in ZOO:
        for p in _precisions(base):
            for name, fam in FAMILIES.items():
                if fam.reject(p, dev) is not None:
                    continue
                options = fam.options(p, dev)
                assert options and len(set(options)) == len(options)
                assert all(isinstance(o, tuple) and all(type(x) is int for x in o) for o in options)
                if options == ((),):
                    continue  # nothing to choose: configure(p, dev) is the only configuration
                # (explain's lines aside: a heuristic rule says why it took a tile the option names plainly)
                configs = [dataclasses.replace(fam.configure(p, dev, o), details=()) for o in options]
                assert dataclasses.replace(fam.configure(p, dev), details=()) in configs, (name, p)
                assert all(c.family == name for c in configs)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_candidate_plan_keeps_the_planner_invariants(arch):
    dev = DEV[arch]
    for base in ZOO[::3]:
        for p in _precisions(base):
            for choice in candidate_choices(p, dev):
                plan = select(p, dev, tuned=choice)
                assert plan.kernel.family == choice.family and plan.origin.startswith("tuned")
                if choice.family in GEOMETRY_KNOWN:
                    check_geometry(plan)


def test_split_flags_switch_split_k_off():
    p = Problem.dense(256, 256, 65536)
    heuristic = select(p, SM90)
    assert heuristic.kernel.family == "simt_cp_async" and heuristic.kernel.split_k > 1
    tile = tuple(v for k, v in heuristic.kernel.macros if k in ("WARPS_M", "WARPS_N", "THREAD_M"))
    on = select(p, SM90, tuned=TunedChoice("simt_cp_async", tile + (1,)))
    off = select(p, SM90, tuned=TunedChoice("simt_cp_async", tile + (0,)))
    assert on.kernel == heuristic.kernel and on.reduce == heuristic.reduce
    assert off.kernel.split_k == 1 and off.reduce is None
    skinny = Problem.dense(16, 4096, 4096)
    assert select(skinny, SM90).kernel.split_k > 1
    assert select(skinny, SM90, tuned=TunedChoice("skinny", (0,))).kernel.split_k == 1
    assert SPLIT_FLAGS == (1, 0)


def test_candidates_are_every_family_and_option_that_can_run_the_problem():
    p = Problem.dense(2048, 2048, 2048)
    found = candidate_choices(p, SM90)
    expected = [TunedChoice(n, o) for n in ("simt_cp_async", "simt_float4", "scalar") for o in FAMILIES[n].options(p, SM90)]
    assert found == expected and len(found) == 8 + 4 + 1
    assert {c.family for c in candidate_choices(p, DEV["sm_75"])} == {"simt_float4", "scalar"}
    tf32 = {c.family for c in candidate_choices(dataclasses.replace(p, precision="tf32"), SM90)}
    assert {"tf32_mma", "simt_cp_async", "simt_float4", "scalar"} <= tf32 and "skinny" not in tf32
    skinny = {c.family for c in candidate_choices(Problem.dense(8, 4096, 4096), SM90)}
    assert "skinny" in skinny
    too_old = DeviceFacts(0, "simulated sm_70", (7, 0), 80, 96 << 10, 96 << 10, 6 << 20, simulated=True)
    assert candidate_choices(Problem.dense(8, 8, 8), too_old) == []  # below MIN_CC: nothing runs


# --- select() with a tuned choice ----------------------------------------------------------------

def test_select_uses_a_tuned_choice_and_says_so():
    p = Problem.dense(2048, 2048, 2048)
    heuristic = select(p, SM90)
    assert heuristic.origin == "heuristic" and "choice: heuristic" in heuristic.describe()
    choice = TunedChoice("simt_float4", (1, 2, 8), "1.1 ms vs 1.3 ms for the heuristic choice")
    plan = select(p, SM90, tuned=choice)
    m = dict(plan.kernel.macros)
    assert plan.kernel.family == "simt_float4" and (m["WARPS_M"], m["WARPS_N"], m["THREAD_M"]) == (1, 2, 8)
    assert plan.kernel.tile[:2] == (64, 64)
    assert plan.origin == "tuned: 1.1 ms vs 1.3 ms for the heuristic choice"
    assert "choice: tuned: 1.1 ms" in plan.describe()
    assert dict(plan.rejected)["simt_cp_async"] == "simt_float4 is preferred (tuned)"
    assert plan.precision_used == "ieee"


def test_a_tuned_choice_overrides_the_tiny_problem_rule():
    p = Problem.dense(16, 16, 16)
    assert select(p, SM90).kernel.family == "scalar"
    plan = select(p, SM90, tuned=TunedChoice("simt_cp_async", (1, 2, 8, 0)))
    assert plan.kernel.family == "simt_cp_async"


def test_a_tuned_choice_keeps_the_staging_of_its_family():
    p = Problem.dense(4097, 4095, 4093)
    heuristic = select(p, SM90)
    plan = select(p, SM90, tuned=TunedChoice("simt_cp_async", (1, 2, 8, 1)))
    assert plan.staging == heuristic.staging == (("b", 4093, 4096),)
    assert plan.launch_problem == heuristic.launch_problem
    assert dict(plan.kernel.macros)["WARPS_M"] == 1 and dict(plan.kernel.macros)["B_MODE"] == 0  # float4 from the copy
    check_geometry(plan)


@pytest.mark.parametrize("choice,why", [
    (TunedChoice("skinny", (1,)), "M = 2048 > 32: not skinny"),
    (TunedChoice("tf32_mma", (2, 2, 64, 1)), "does not compute precision 'ieee'"),
    (TunedChoice("warp_magic", ()), "no kernel family is named 'warp_magic'"),
    (TunedChoice("simt_cp_async", (4, 4, 16, 1)), "has no option (4, 4, 16, 1)"),
    (TunedChoice("simt_float4", (2, 2, 16, 1)), "has no option (2, 2, 16, 1)"),  # a split flag it does not have
])
def test_a_stale_tuned_choice_is_ignored_with_the_reason(choice, why):
    p = Problem.dense(2048, 2048, 2048)
    heuristic = select(p, SM90)
    plan = select(p, SM90, tuned=choice)
    assert plan.kernel == heuristic.kernel and plan.rejected == heuristic.rejected
    assert why in tuned_reject_reason(p, SM90, choice)
    assert plan.origin.startswith(f"heuristic (tuned choice {choice.label()} ignored: ") and why in plan.origin
    assert why in plan.describe()


def test_a_tuned_choice_for_an_sm80_family_on_sm75_is_ignored():
    p = Problem.dense(2048, 2048, 2048)
    plan = select(p, DEV["sm_75"], tuned=TunedChoice("simt_cp_async", (2, 2, 16, 1)))
    assert plan.kernel.family == "simt_float4" and "needs sm80+" in plan.origin


def test_force_wins_over_a_tuned_choice():
    p = Problem.dense(2048, 2048, 2048)
    plan = select(p, SM90, force="scalar", tuned=TunedChoice("simt_float4", (1, 2, 8)))
    assert plan.kernel.family == "scalar" and plan.origin == "forced: scalar"


def test_record_parsing():
    rec = {"family": "simt_cp_async", "option": [2, 2, 16, 0], "time_ms": 1.25, "heuristic_ms": 1.5,
           "tuned_at": "2026-12-01 10:00 UTC", "shape": "4096x4096x4096"}
    ch = TunedChoice.from_record(rec)
    assert ch == TunedChoice("simt_cp_async", (2, 2, 16, 0), ch.provenance)
    assert ch.provenance == "1.25 ms vs 1.5 ms for the heuristic choice; tuned 2026-12-01 10:00 UTC on 4096x4096x4096"
    for bad in ({}, {"family": 3, "option": []}, {"family": "scalar", "option": ["x"]},
                {"family": "scalar", "option": [True]}, {"family": "scalar", "option": 5}):
        assert TunedChoice.from_record(bad) is None
    assert TunedChoice.from_record({"family": "scalar", "option": []}) == TunedChoice("scalar", ())


# --- the store -------------------------------------------------------------------------------------

def _record(family="simt_float4", option=(1, 2, 8), ms=1.0):
    return {"family": family, "option": list(option), "time_ms": ms}


def test_store_round_trip_and_file_format(tmp_path):
    store = TuningStore(tmp_path / "tuning", KEY)
    assert store.get("b1") is None and store.records() == {}
    path = store.put("b1", _record())
    assert path == store.path and path.parent == tmp_path / "tuning"
    assert path.name.startswith("nvidia-test-gpu-sm90-") and path.suffix == ".json"
    store.put("b2", _record("scalar", (), 2.0))
    again = TuningStore(tmp_path / "tuning", KEY)  # a new process, in effect
    assert again.records() == {"b1": _record(), "b2": _record("scalar", (), 2.0)}
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["device"] == KEY.as_json()
    assert not [f for f in path.parent.iterdir() if f.name.endswith(".tmp")]  # no temporary left behind


def test_each_device_key_has_its_own_file(tmp_path):
    keys = [KEY, dataclasses.replace(KEY, driver=12080), dataclasses.replace(KEY, fastmm="9.9.9"),
            dataclasses.replace(KEY, nvrtc=(13, 5)), dataclasses.replace(KEY, name="NVIDIA Other"),
            dataclasses.replace(KEY, capability=(8, 0))]
    assert len({k.file_name() for k in keys}) == len(keys)
    TuningStore(tmp_path, KEY).put("b", _record())
    assert TuningStore(tmp_path, keys[1]).get("b") is None


def test_a_file_written_for_another_key_is_ignored_with_a_warning(tmp_path):
    other = dataclasses.replace(KEY, driver=12080)
    TuningStore(tmp_path, other).put("b", _record())
    # the same file name (a copy from another machine), another key inside
    (tmp_path / KEY.file_name()).write_text((tmp_path / other.file_name()).read_text())
    store = TuningStore(tmp_path, KEY)
    with pytest.warns(TuningWarning, match="was written for"):
        assert store.get("b") is None


@pytest.mark.parametrize("content", [b"", b"{not json", b"\xff\xfe\x00", b"[1, 2]", b'{"format": 99, "records": {}}',
                                     b'{"format": 1, "device": {}, "records": []}'])
def test_a_corrupt_file_warns_once_is_ignored_and_replaced_by_the_next_write(tmp_path, content):
    store = TuningStore(tmp_path, KEY)
    store.path.write_bytes(content)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert store.get("b") is None
        assert store.records() == {}
        store.put("b", _record())
    found = [w for w in seen if issubclass(w.category, TuningWarning)]
    assert len(found) == 1 and str(store.path) in str(found[0].message)
    assert TuningStore(tmp_path, KEY).records() == {"b": _record()}


def test_an_unwritable_folder_keeps_records_in_memory_with_one_warning(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    store = TuningStore(blocker / "tuning", KEY)
    with pytest.warns(TuningWarning, match="keeping them in memory"):
        assert store.put("b1", _record()) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.put("b2", _record(ms=2.0)) is None  # no second warning
    assert store.get("b1") == _record() and store.get("b2") == _record(ms=2.0)


def _put_many(folder, worker, count):
    store = TuningStore(folder, KEY)
    for i in range(count):
        store.put(f"w{worker}-b{i}", _record(ms=float(i)))


def test_concurrent_writers_in_several_processes_lose_nothing(tmp_path):
    try:
        ctx = multiprocessing.get_context("fork")
    except ValueError:
        pytest.skip("no fork on this platform")
    procs = [ctx.Process(target=_put_many, args=(tmp_path, w, 15)) for w in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    records = TuningStore(tmp_path, KEY).records()
    assert set(records) == {f"w{w}-b{i}" for w in range(6) for i in range(15)}
    assert [f.name for f in tmp_path.iterdir() if f.name.endswith(".tmp")] == []


def test_store_for_follows_the_cache_folder(tmp_cache, monkeypatch):
    monkeypatch.setattr(tuning_store, "_device_key", lambda index: KEY)
    monkeypatch.setattr(tuning_store, "_stores", {})
    store = tuning_store.store_for(0)
    assert store.folder == tmp_cache / "tuning" and tuning_store.store_for(0) is store
    monkeypatch.setenv("FASTMM_CACHE_DIR", str(tmp_cache / "elsewhere"))
    assert tuning_store.store_for(0).folder == tmp_cache / "elsewhere" / "tuning"


# --- fastmm.dispatch with a stored choice (simulated device, CPU tensors) -------------------------------------

@pytest.fixture
def tuned_gpu(tmp_cache, monkeypatch):
    """CPU tensors pass for CUDA ones on an H200 that is not marked simulated (so plan_for looks
    up tuned choices), with a fixed device key and an empty store; no plan cached."""
    monkeypatch.setattr(dispatch, "not_served_reason", lambda a, b: None)
    monkeypatch.setattr(explain_module, "not_served_reason", lambda a, b: None)
    dev = dataclasses.replace(SM90, simulated=False)
    monkeypatch.setattr(dispatch, "device_facts", lambda index: dataclasses.replace(dev, index=index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tuning_store, "_device_key", lambda index: KEY)
    monkeypatch.setattr(tuning_store, "_stores", {})
    monkeypatch.setattr(dispatch, "PLANS", dispatch.PlanCache())
    monkeypatch.setattr(fast_path, "ENTRIES", {})
    monkeypatch.setattr(errors, "_warned", set())
    monkeypatch.setattr(tuning, "_tried", set())
    return dev


def test_plan_for_and_explain_use_a_stored_choice(tuned_gpu):
    a, b = torch.randn(300, 200), torch.randn(200, 100)
    exp = fastmm.explain(a, b, precision="ieee")
    assert exp.choice == "heuristic" and "  choice: heuristic" in str(exp)
    heuristic_family = exp.kernel
    problem = exp.plan.problem
    record = {"family": "simt_float4", "option": [1, 2, 8], "time_ms": 0.01, "heuristic_ms": 0.02,
              "tuned_at": "2026-12-01 10:00 UTC", "shape": "300x100x200"}
    tuning_store.store_for(0).put(bucket_of(problem), record)
    exp = fastmm.explain(a, b, precision="ieee")
    assert exp.kernel == "simt_float4" != heuristic_family
    assert exp.choice.startswith("tuned: 0.01 ms vs 0.02 ms") and "  choice: tuned: " in str(exp)
    assert dispatch.plan_for(problem, 0).origin == exp.choice
    # forcing (FASTMM_KERNEL) still wins
    assert dispatch.plan_for(problem, 0, "scalar").kernel.family == "scalar"
    # a choice for another bucket (tf32) does not touch this one
    assert fastmm.explain(a, b, precision="tf32").choice == "heuristic"


def test_a_stale_stored_choice_is_reported_by_explain(tuned_gpu):
    a, b = torch.randn(300, 200), torch.randn(200, 100)
    problem = fastmm.explain(a, b, precision="ieee").plan.problem
    tuning_store.store_for(0).put(bucket_of(problem), {"family": "skinny", "option": [1]})
    exp = fastmm.explain(a, b, precision="ieee")
    assert exp.kernel == "simt_cp_async"
    assert "tuned choice skinny (1,) ignored" in exp.choice and "not skinny" in str(exp)


def test_simulated_devices_never_read_the_store(tmp_cache, monkeypatch):
    def boom(index):
        raise AssertionError("the store was read")
    monkeypatch.setattr(dispatch, "store_for", boom)  # (the name fastmm.dispatch imported)
    assert dispatch.tuned_choice(Problem.dense(64, 64, 64), SM90) is None
    monkeypatch.setattr(errors, "_warned", set())
    with pytest.warns(fastmm.FastmmWarning, match="the store was read"):  # a real device does read it
        dispatch.tuned_choice(Problem.dense(64, 64, 64), dataclasses.replace(SM90, simulated=False))


def test_an_unreadable_device_key_warns_once_and_the_heuristics_choose(tuned_gpu, monkeypatch):
    def no_driver(index):
        raise RuntimeError("CUDA driver call failed")
    monkeypatch.setattr(tuning_store, "_device_key", no_driver)
    with pytest.warns(fastmm.FastmmWarning, match="tuned choices are not available"):
        assert dispatch.tuned_choice(Problem.dense(64, 64, 64), tuned_gpu) is None
    assert dispatch.plan_for(Problem.dense(512, 512, 512), 0).origin == "heuristic"


def test_storing_a_choice_drops_every_cached_plan(tuned_gpu):
    dispatch.PLANS.prepared[("k",)] = dispatch.Prepared("plan")
    fast_path.ENTRIES[("k",)] = fast_path.NOT_FAST
    best = tuning.CandidateResult(TunedChoice("scalar", ()), "tile 16x16x16", False, 1.0, 0.1, 0.0, True)
    path = tuning._store(0, "bucket", Problem.dense(64, 64, 64), best, None, 5, 3)
    assert path is not None and path.exists()
    assert dispatch.PLANS.prepared == {} and fast_path.ENTRIES == {}
    assert tuning_store.store_for(0).get("bucket")["family"] == "scalar"


# --- tune(): refusals and the first-use hook -------------------------------------------------------

def test_tune_refuses_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA GPU.*is_available"):
        fastmm.tune(torch.randn(64, 64), torch.randn(64, 64))


def test_tune_refuses_cpu_tensors_and_other_dtypes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dispatch, "runtime_reason", lambda: None)
    with pytest.raises(ValueError, match="cannot serve these operands: operands are on cpu and cpu"):
        fastmm.tune(torch.randn(64, 64), torch.randn(64, 64))
    with pytest.raises(TypeError):
        fastmm.tune([[1.0]], torch.randn(1, 1))
    with pytest.raises(ValueError, match="repeats"):
        fastmm.tune(torch.randn(64, 64), torch.randn(64, 64), repeats=0)


def test_tune_refuses_during_cuda_graph_capture(tuned_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA graph is being captured"):
        fastmm.tune(torch.randn(64, 64), torch.randn(64, 64))


def test_first_use_tunes_each_bucket_once_and_never_while_capturing(tuned_gpu, monkeypatch):
    calls = []

    def fake_tune(s, c, precision, index, repeats, warmup, only, persist):
        calls.append((s.M, s.N, s.K, precision))

    monkeypatch.setattr(tuning, "_tune", fake_tune)
    s = analyse(torch.randn(300, 200), torch.randn(200, 100))
    c = torch.empty(300, 100)
    p, _ = build_problem(s, c, "ieee")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    tuning.tune_on_first_use(s, c, p, 0)
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    tuning.tune_on_first_use(s, c, p, 0)
    tuning.tune_on_first_use(s, c, p, 0)  # the same bucket again: not retried
    assert calls == [(300, 100, 200, "ieee")]
    # a bucket with a stored choice is not tuned again
    s2 = analyse(torch.randn(1000, 200), torch.randn(200, 100))
    p2, _ = build_problem(s2, torch.empty(1000, 100), "ieee")
    tuning_store.store_for(0).put(bucket_of(p2), {"family": "scalar", "option": []})
    tuning.tune_on_first_use(s2, torch.empty(1000, 100), p2, 0)
    assert len(calls) == 1


def test_a_failed_first_use_tuning_warns_once_and_the_call_goes_on(tuned_gpu, monkeypatch):
    def failing(*args):
        raise torch.cuda.OutOfMemoryError("simulated")

    monkeypatch.setattr(tuning, "_tune", failing)
    s = analyse(torch.randn(300, 200), torch.randn(200, 100))
    c = torch.empty(300, 100)
    p, _ = build_problem(s, c, "ieee")
    with pytest.warns(fastmm.FastmmWarning, match="tuning .* failed .*OutOfMemoryError.*heuristic choice serves it"):
        tuning.tune_on_first_use(s, c, p, 0)


def test_the_full_path_calls_the_first_use_tuner_only_when_fastmm_tune_is_set(tuned_gpu, monkeypatch):
    seen = []
    monkeypatch.setattr(dispatch, "first_use_tuner", lambda s, c, problem, index: seen.append(bucket_of(problem)))

    def no_load(dev, cfg):  # stop right after planning: no GPU to load on
        raise CompileError("no GPU in this test")

    from fastmm.runtime import launcher
    monkeypatch.setattr(launcher, "load", no_load)
    a, b = torch.randn(300, 200), torch.randn(200, 100)
    monkeypatch.delenv("FASTMM_TUNE", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fastmm.matmul(a, b, precision="ieee")
        assert seen == []
        monkeypatch.setenv("FASTMM_TUNE", "1")
        monkeypatch.setattr(dispatch, "PLANS", dispatch.PlanCache())
        fastmm.matmul(a, b, precision="tf32")
        assert len(seen) == 1 and seen[0].startswith("tf32|")
        monkeypatch.setenv("FASTMM_KERNEL", "scalar")  # forced: nothing to tune
        fastmm.matmul(a, b, precision="tf32x3")
        assert len(seen) == 1


def test_fresh_like_keeps_shape_strides_and_alignment():
    base = torch.randn(1000)
    for t in (base[1:401].view(20, 20), base[2:402].view(20, 20).t(), base[:5].expand(3, 5),
              base[3:3 + 60].view(3, 4, 5)[:, :, ::2]):
        f = tuning._fresh_like(t, True)
        assert f.shape == t.shape and f.stride() == t.stride() and f.data_ptr() % 16 == t.data_ptr() % 16
        assert f.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert torch.isnan(tuning._fresh_like(base[:8].view(2, 4), False)).all()


def test_tolerance_is_the_test_suites_widened_for_long_sums():
    assert tuning.tolerance("ieee", 256) == 1e-5 and tuning.tolerance("tf32", 4096) == 1e-3
    assert tuning.tolerance("tf32x3", 64) == 1e-6
    assert 1e-6 < tuning.tolerance("tf32x3", 65536) < 3e-5  # still far below plain TF32's ~3e-4


def test_tune_result_table_lists_every_candidate_and_the_best():
    ok = tuning.CandidateResult(TunedChoice("simt_cp_async", (2, 2, 16, 1)), "tile 128x128x8", True, 2.0, 50.0, 1e-7, True)
    fast = tuning.CandidateResult(TunedChoice("simt_float4", (1, 2, 8)), "tile 64x64x8", False, 1.0, 100.0, 2e-7, True)
    bad = tuning.CandidateResult(TunedChoice("scalar", ()), "tile 16x16x16", False, None, None, 0.5, False,
                                 "rel. error 5.00e-01 > 1.0e-05: not timed")
    res = tuning.TuneResult(Problem.dense(512, 512, 512), "b", "GPU (sm_90)", [ok, fast, bad], fast, None, 5)
    text = str(res)
    assert res.heuristic is ok and res.speedup == 2.0
    assert "simt_cp_async (2, 2, 16, 1)" in text and "heuristic" in text and "not timed" in text and " NO" in text
    assert "best: simt_float4 (1, 2, 8), 1.0000 ms, 2.00x the heuristic choice; not stored" in text
    assert [line[0] for line in text.splitlines()[2:5]] == [" ", "*", " "]


class _FakeClock:
    """Stands in for the GPU in the tuner's loop: a 'launch' computes the product on the CPU
    (wrongly for one family) and advances a clock by a time set per family; events read it."""

    def __init__(self, times, wrong_family):
        self.now, self.times, self.wrong, self.launches = 0.0, times, wrong_family, []

    def launch(self, hit, s, c, problem, offsets, index, epilogue=None):
        plan = hit.plan
        self.launches.append(plan.kernel.family)
        c.copy_(torch.matmul(s.a, s.b) * (1.5 if plan.kernel.family == self.wrong else 1.0))
        m = dict(plan.kernel.macros)  # larger tiles run faster here
        self.now += self.times[plan.kernel.family] * (1 - 0.01 * m.get("WARPS_M", 0) * m.get("WARPS_N", 0))

    def event(self, enable_timing=True):
        clock = self

        class Event:
            def record(self):
                self.t = clock.now

            def elapsed_time(self, end):
                return end.t - self.t

        return Event()


def test_the_tuner_checks_times_picks_and_stores_with_a_fake_gpu(fake_gpu):
    clock = fake_gpu
    a, b = torch.randn(300, 200), torch.randn(200, 100)
    s, c = analyse(a, b), torch.empty(300, 100)
    result = tuning._tune(s, c, "ieee", 0, 5, 2, None, True)
    by_family = {}
    for cand in result.candidates:
        by_family.setdefault(cand.choice.family, []).append(cand)
    # every option once (split on/off make the same kernel at this size: deduplicated): the four
    # tiles of every product and the 64 x 256 one (300 rows: 64-row tiles pad M less; its 64 x 128
    # sibling is not offered with A in single floats along k and a row-major B)
    assert len(by_family["simt_cp_async"]) == 5 and len(by_family["simt_float4"]) == 4 and len(by_family["scalar"]) == 1
    assert result.candidates[0].heuristic and result.candidates[0].choice.family == "simt_cp_async"
    for cand in by_family["simt_float4"]:  # wrong results: never timed, never chosen
        assert not cand.ok and cand.time_ms is None and "not timed" in cand.note and cand.error > 0.1
    scalar = by_family["scalar"][0]
    assert scalar.ok and "one timed call" in scalar.note and scalar.time_ms == pytest.approx(50.0)  # pruned
    assert all(c.ok and c.error < 1e-6 for c in by_family["simt_cp_async"])
    assert result.heuristic.choice == TunedChoice("simt_cp_async", (1, 2, 8, 1))  # the smallest tile, no split
    assert result.best.choice == TunedChoice("simt_cp_async", (2, 4, 16, 1))  # the fastest correct one
    assert result.best.time_ms == pytest.approx(1.84) and result.speedup == pytest.approx(1.96 / 1.84)
    assert result.best.tflops == pytest.approx(2 * 300 * 100 * 200 / 1.84e-3 / 1e12)
    # launches: 1 check + 2 warm-up + 5 timed per timed candidate; the wrong ones only checked
    assert clock.launches.count("simt_float4") == 4 and clock.launches.count("scalar") == 1 + 2 + 1
    record = tuning_store.store_for(0).get(result.bucket)
    assert record["family"] == "simt_cp_async" and record["option"] == [2, 4, 16, 1] and record["repeats"] == 5
    assert record["heuristic_ms"] == pytest.approx(1.96) and record["shape"] == "300x100x200"
    assert result.stored == tuning_store.store_for(0).path
    exp = fastmm.explain(a, b, precision="ieee")
    m = dict(exp.plan.kernel.macros)
    assert exp.kernel == "simt_cp_async" and (m["WARPS_M"], m["WARPS_N"], m["THREAD_M"]) == (2, 4, 16)
    assert exp.choice.startswith("tuned: 1.84 ms vs 1.96 ms for the heuristic choice") and "on 300x100x200" in exp.choice
    # candidates= restricts the search, the heuristic is always timed
    only = tuning._tune(s, c, "ieee", 0, 2, 0, tuning._only(["scalar", ("simt_cp_async", (2, 2, 8, 0))]), False)
    assert [(x.choice.family, x.heuristic) for x in only.candidates] == [
        ("simt_cp_async", True), ("simt_cp_async", False), ("scalar", False)]
    assert only.stored is None


@pytest.fixture
def fake_gpu(tuned_gpu, monkeypatch):
    """tuned_gpu plus the _FakeClock standing in for launches, events and synchronisation."""
    from fastmm.runtime import launcher

    clock = _FakeClock({"simt_cp_async": 2.0, "simt_float4": 1.0, "scalar": 50.0}, wrong_family="simt_float4")
    monkeypatch.setattr(dispatch, "device_facts", lambda index: dataclasses.replace(tuned_gpu, l2_bytes=1 << 20))
    monkeypatch.setattr(launcher, "load", lambda dev, cfg: ("loaded", cfg.family))
    monkeypatch.setattr(dispatch, "launch_plan", clock.launch)
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return clock


def test_public_tune_and_first_use_tuning_with_a_fake_gpu(fake_gpu, monkeypatch):
    a, b = torch.randn(2, 300, 200), torch.randn(1, 200, 100)  # batched, B broadcast (a batch dim of 1)
    result = fastmm.tune(a, b, precision="ieee", repeats=2, warmup=0, persist=False)
    assert result.problem.batch_total == 2 and result.bucket.split("|")[3] == "batched" and result.stored is None
    assert result.best.choice.family == "simt_cp_async" and fastmm.explain(a, b, precision="ieee").choice == "heuristic"
    with pytest.raises(ValueError, match="out must be a float32 tensor of shape"):
        fastmm.tune(a, b, out=torch.empty(3, 3))
    with pytest.raises(ValueError, match="empty"):
        fastmm.tune(torch.randn(4, 0), torch.randn(0, 4))
    # FASTMM_TUNE=1: the first call of a bucket tunes it, stores the winner, and is served by it
    monkeypatch.setenv("FASTMM_TUNE", "1")
    x, w = torch.randn(300, 200), torch.randn(200, 100)
    before = len(fake_gpu.launches)
    y = fastmm.matmul(x, w, precision="ieee")
    assert torch.allclose(y, x @ w, atol=1e-4) and len(fake_gpu.launches) > before + 9  # every candidate ran
    exp = fastmm.explain(x, w, precision="ieee")
    assert exp.choice.startswith("tuned: ") and dict(exp.plan.kernel.macros)["WARPS_N"] == 4
    assert fake_gpu.launches[-1] == "simt_cp_async"  # the call itself ran on the tuned kernel


def test_cli_tune_parses_and_refuses_without_a_gpu(monkeypatch, capsys):
    from fastmm import cli

    args = cli.build_parser().parse_args(["tune", "4096", "1024", "512", "--precision", "tf32", "--a-transposed",
                                          "--repeats", "7", "--no-save"])
    assert (args.M, args.N, args.K, args.precision, args.a_transposed, args.repeats, args.no_save) == (
        4096, 1024, 512, "tf32", True, 7, True)
    monkeypatch.setattr(cli, "gpu_reason", lambda: "no CUDA device")
    assert cli.main(["tune", "64", "64", "64"]) == 2
    assert "tuning times kernels on a GPU" in capsys.readouterr().err


# =============================================================================================
# GPU

TOL = {"ieee": 1e-5, "tf32": 1e-3, "tf32x3": 1e-6}


@pytest.fixture
def tuning_state(tmp_cache, monkeypatch):
    """An empty tuning folder and no cached plans (restored after), so nothing leaks into the
    user's cache or other tests."""
    monkeypatch.setattr(tuning_store, "_stores", {})
    monkeypatch.setattr(dispatch, "PLANS", dispatch.PlanCache())
    monkeypatch.setattr(fast_path, "ENTRIES", {})
    monkeypatch.setattr(tuning, "_tried", set())
    monkeypatch.delenv("FASTMM_KERNEL", raising=False)
    yield tmp_cache


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["ieee", "tf32", "tf32x3"])
@pytest.mark.parametrize("M,N,K", [(512, 384, 256), (96, 80, 16384), (16, 4096, 2048), (257, 129, 193)])
def test_tune_checks_every_candidate_and_the_next_matmul_uses_the_winner(tuning_state, precision, M, N, K, rel_err):
    a, b = torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda")
    a0, b0 = a.clone(), b.clone()
    result = fastmm.tune(a, b, precision=precision, repeats=3, warmup=1)
    print(result)
    assert torch.equal(a, a0) and torch.equal(b, b0)  # inputs only describe the problem
    assert result.candidates and result.heuristic is not None
    for cand in result.candidates:  # every option of every family is a correct kernel
        assert cand.ok, str(result)
        assert cand.time_ms is not None and cand.time_ms > 0
    assert result.best is min(result.candidates, key=lambda c: c.time_ms)
    assert result.stored is not None and result.stored.exists()
    record = json.loads(result.stored.read_text())["records"][result.bucket]
    assert (record["family"], tuple(record["option"])) == (result.best.choice.family, result.best.choice.option)
    exp = fastmm.explain(a, b, precision=precision)
    assert exp.choice.startswith("tuned: ") and exp.kernel == result.best.choice.family, str(exp)
    c = fastmm.matmul(a, b, precision=precision)
    assert rel_err(c, a, b) <= tuning.tolerance(precision, K)
    # the same bucket, another size: the stored choice serves it too
    a2, b2 = torch.randn(M - 1, K, device="cuda"), torch.randn(K, N, device="cuda")
    if bucket_of(fastmm.explain(a2, b2, precision=precision).plan.problem) == result.bucket:
        assert fastmm.explain(a2, b2, precision=precision).choice.startswith("tuned")
        assert rel_err(fastmm.matmul(a2, b2, precision=precision), a2, b2) <= tuning.tolerance(precision, K)


@pytest.mark.cuda
def test_a_stored_non_heuristic_choice_runs_correctly_through_every_path(tuning_state, rel_err):
    a, b = torch.randn(1000, 700, device="cuda"), torch.randn(700, 600, device="cuda")
    problem = fastmm.explain(a, b, precision="ieee").plan.problem
    assert fastmm.explain(a, b, precision="ieee").kernel != "simt_float4"
    fastmm.matmul(a, b, precision="ieee")  # a cached plan and fast-path entry from the heuristics
    tuning_store.store_for(a.device.index or 0).put(bucket_of(problem), {"family": "simt_float4", "option": [1, 2, 8]})
    fast_path.forget_plans()
    exp = fastmm.explain(a, b, precision="ieee")
    assert exp.kernel == "simt_float4" and exp.choice == "tuned"
    for _ in range(2):  # the first call plans, the second takes the fast path
        c = fastmm.matmul(a, b, precision="ieee")
        assert rel_err(c, a, b) <= TOL["ieee"]
    out = torch.full((1000, 600), float("nan"), device="cuda")
    fastmm.matmul(a, b, precision="ieee", out=out)
    assert rel_err(out, a, b) <= TOL["ieee"]


@pytest.mark.cuda
def test_tune_with_restricted_candidates_still_times_the_heuristic(tuning_state):
    a, b = torch.randn(512, 512, device="cuda"), torch.randn(512, 512, device="cuda")
    result = fastmm.tune(a, b, precision="ieee", repeats=3, warmup=1, candidates=["scalar"], persist=False)
    assert {c.choice.family for c in result.candidates} == {"scalar", fastmm.explain(a, b, precision="ieee").kernel}
    assert result.stored is None and fastmm.explain(a, b, precision="ieee").choice == "heuristic"


@pytest.mark.cuda
def test_fastmm_tune_1_tunes_on_first_use(tuning_state, monkeypatch, rel_err):
    monkeypatch.setenv("FASTMM_TUNE", "1")
    a, b = torch.randn(640, 320, device="cuda"), torch.randn(320, 480, device="cuda")
    c = fastmm.matmul(a, b, precision="tf32")
    assert rel_err(c, a, b) <= TOL["tf32"]
    exp = fastmm.explain(a, b, precision="tf32")
    assert exp.choice.startswith("tuned: "), str(exp)
    files = list((tuning_state / "tuning").glob("*.json"))
    assert len(files) == 1 and bucket_of(exp.plan.problem) in json.loads(files[0].read_text())["records"]


@pytest.mark.cuda
def test_tune_refuses_cleanly_during_graph_capture(tuning_state):
    a, b = torch.randn(256, 256, device="cuda"), torch.randn(256, 256, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin()
        try:
            with pytest.raises(RuntimeError, match="captured"):
                fastmm.tune(a, b)
        finally:
            graph.capture_end()


@pytest.mark.cuda
def test_device_key_names_the_real_gpu():
    key = DeviceKey.for_device(torch.cuda.current_device())
    assert key.name == torch.cuda.get_device_name() and key.capability == torch.cuda.get_device_capability()
    assert key.driver >= 11000 and key.fastmm == fastmm.__version__
    assert os.path.basename(key.file_name()).endswith(".json")
