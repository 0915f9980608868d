"""fastmm.runtime.launcher's launch configuration (CPU): programmatic dependent launch is asked
for only by the plans that want it, and FASTMM_PDL=0 or an older cuda.core turns it off."""
from __future__ import annotations

import dataclasses

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
