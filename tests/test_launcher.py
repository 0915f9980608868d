"""fastmm.runtime.launcher on the CPU: the launch configuration (programmatic dependent launch is
asked for only by the plans that want it, and FASTMM_PDL=0 or an older cuda.core turns it off),
and the tensor-map launcher's parameter arrays (what cuLaunchKernel reads, per call and per
thread), with the driver's cuLaunchKernel replaced by a function that reads them."""
from __future__ import annotations

import ctypes
import dataclasses
import threading
from types import SimpleNamespace

import pytest

from fastmm.families import FAMILIES
from fastmm.problem import DeviceFacts, Problem
from fastmm.runtime import launcher


class RecordingLaunchConfig:
    """Stands in for cuda.core's LaunchConfig: keeps the keywords it was built with."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs


class OldLaunchConfig(RecordingLaunchConfig):
    """A cuda.core from before the programmatic_stream_serialization option."""

    def __init__(self, grid, block, shmem_size):
        super().__init__(grid=grid, block=block, shmem_size=shmem_size)


def _skinny_cfg(arch="sm_90"):
    return FAMILIES["skinny"].configure(Problem.dense(16, 4096, 4096), DeviceFacts.simulated_device(arch))


@pytest.fixture(autouse=True)
def fresh_support_probe(monkeypatch):
    monkeypatch.setattr(launcher, "_pdl_supported", [])
    monkeypatch.delenv("FASTMM_PDL", raising=False)


def test_a_dependent_plan_gets_programmatic_stream_serialization():
    cfg = _skinny_cfg()
    assert cfg.dependent_launch
    lc = launcher.launch_config(RecordingLaunchConfig, cfg)
    assert lc.kwargs == {"grid": cfg.grid, "block": cfg.block_dims, "shmem_size": cfg.smem,
                         "programmatic_stream_serialization": True}


def test_other_plans_get_a_plain_launch():
    cfg = dataclasses.replace(_skinny_cfg(), dependent_launch=False)
    lc = launcher.launch_config(RecordingLaunchConfig, cfg)
    assert "programmatic_stream_serialization" not in lc.kwargs and lc.kwargs["grid"] == cfg.grid


@pytest.mark.parametrize("value", ["0", "off", " False ", "no"])
def test_fastmm_pdl_off_gives_plain_launches(monkeypatch, value):
    monkeypatch.setenv("FASTMM_PDL", value)
    lc = launcher.launch_config(RecordingLaunchConfig, _skinny_cfg())
    assert "programmatic_stream_serialization" not in lc.kwargs


def test_a_cuda_core_without_the_option_gives_plain_launches_and_is_asked_once():
    cfg = _skinny_cfg()
    lc = launcher.launch_config(OldLaunchConfig, cfg)
    assert lc.kwargs == {"grid": cfg.grid, "block": cfg.block_dims, "shmem_size": cfg.smem}
    assert launcher._pdl_supported == [False]
    assert "programmatic_stream_serialization" not in launcher.launch_config(RecordingLaunchConfig, cfg).kwargs


def test_the_installed_cuda_core_accepts_the_option():
    core = pytest.importorskip("cuda.core")
    from cuda.pathfinder import DynamicLibNotFoundError

    cfg = _skinny_cfg()
    try:
        lc = launcher.launch_config(core.LaunchConfig, cfg)
    except DynamicLibNotFoundError as exc:  # a LaunchConfig asks the driver (libcuda) about the device
        pytest.skip(f"needs the CUDA driver: {exc}")
    assert lc.programmatic_stream_serialization is True
    assert tuple(lc.grid) == cfg.grid and tuple(lc.block) == cfg.block_dims and lc.shmem_size == cfg.smem


# --- maps_launcher: the parameter arrays cuLaunchKernel reads -----------------------------------

class FakeMap:
    """A tensor map's 128 bytes, where cuda.bindings' CUtensorMap would keep them."""

    def __init__(self):
        self.buf = ctypes.create_string_buffer(128)

    def getPtr(self):
        return ctypes.addressof(self.buf)


def _read_params(params, n_maps: int, n: int):
    """What the driver reads from the parameter array: the maps' addresses, then the int64 each
    other slot points at."""
    return [params[i] for i in range(n_maps)], [ctypes.c_int64.from_address(params[n_maps + i]).value
                                                for i in range(n)]


def _maps_launcher(monkeypatch, on_launch):
    """launcher.maps_launcher of a stand-in kernel (handle 11, grid (3, 2, 1), 128 threads, 4 KiB);
    cuLaunchKernel is ``on_launch(head, params)``, returning its CUresult."""
    monkeypatch.setattr(launcher, "_driver_launch", [lambda *a: on_launch(a[:9], a[9])])
    loaded = launcher.LoadedKernel(SimpleNamespace(handle=11),
                                   SimpleNamespace(grid=(3, 2, 1), block=(128, 1, 1), shmem_size=4096),
                                   "stand-in", "memory", None)
    return launcher.maps_launcher(loaded)


def test_the_maps_launcher_passes_each_calls_maps_and_arguments(monkeypatch):
    """The arrays are kept between calls and refilled: every call passes its own maps and
    arguments (negative ones and 64-bit ones too), and a call with more arguments (a fused
    epilogue's) gets arrays of its length."""
    seen = []
    launch = _maps_launcher(monkeypatch, lambda head, params: seen.append((head, params)) or 0)
    calls = [((FakeMap(), FakeMap()), (1, -2, 2**40 + 3)),
             ((FakeMap(), FakeMap()), (7, 8, -(2**62))),
             ((FakeMap(), FakeMap()), (1, 2, 3, 4, 5, -6, 7, 8))]
    for stream, (maps, args) in enumerate(calls, start=5):
        launch(stream, maps, args)
        head, params = seen[-1]
        assert tuple(getattr(v, "value", v) for v in head) == (11, 3, 2, 1, 128, 1, 1, 4096, stream)  # (ctypes or int)
        assert _read_params(params, 2, len(args)) == ([m.getPtr() for m in maps], list(args))
        assert len(params) == 2 + len(args)


def test_a_refused_maps_launch_raises_launch_error(monkeypatch):
    launch = _maps_launcher(monkeypatch, lambda head, params: 1)  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(launcher.LaunchError, match="CUresult 1"):
        launch(0, (FakeMap(),), (1, 2))


def test_threads_do_not_share_the_maps_launchers_arrays(monkeypatch):
    """ctypes releases the GIL during cuLaunchKernel: while one thread is inside its launch,
    another thread's launch of the same kernel must not rewrite the arguments the first one's
    driver call is reading (with one set of arrays per launcher, it would)."""
    inside, release = threading.Event(), threading.Event()
    seen = {}

    def on_launch(head, params):
        if threading.current_thread().name == "first":
            inside.set()
            release.wait(10)  # the main thread launches meanwhile
        seen[threading.current_thread().name] = (_read_params(params, 1, 3), ctypes.addressof(params))
        return 0

    launch = _maps_launcher(monkeypatch, on_launch)
    first_map, main_map = FakeMap(), FakeMap()
    first = threading.Thread(target=launch, args=(1, (first_map,), (10, 11, 12)), name="first")
    first.start()
    try:
        assert inside.wait(10)
        launch(1, (main_map,), (20, 21, 22))
    finally:
        release.set()
        first.join(10)
    assert seen["first"][0] == ([first_map.getPtr()], [10, 11, 12])
    assert seen["MainThread"][0] == ([main_map.getPtr()], [20, 21, 22])
    assert seen["first"][1] != seen["MainThread"][1]
