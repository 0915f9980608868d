"""GPU tests of the wgmma family (tests/test_gpu.py) run here on the emulated GPU
(conftest.emulated_gpu, tests/emulation.py) with CPU tensors in place of CUDA ones: those of the
forms behind variants or newer rules (A fed from registers on 64-row tiles, tf32x3 splitting A in
registers, forced and by the planner's rule), and those of the 64-row tiles and split-K, whose
plans the newest rules changed. The kernels' arithmetic is emulated, so what this proves is the tests' own
assertions on fastmm's side: the plans each variant gets (tile rows, A_MN, X3_A_REGS, splits,
staging), the launches' maps and arguments, nothing written outside C, the fused epilogues, and
that the GPU tests run to their end; the kernels themselves are checked by the same tests on the
GPU."""
from __future__ import annotations

import pytest
import torch

import conftest
import test_gpu
import test_gpu_epilogue


def _on_cpu(make):
    """``make`` (torch.full, torch.empty, ...) with device="cuda" made on the CPU instead."""
    def made(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return make(*args, **kwargs)
    return made


@pytest.fixture
def gpu_test_on_cpu(emulated_gpu, monkeypatch):
    monkeypatch.setattr(test_gpu, "needs_sm90", lambda: None)
    monkeypatch.setattr(test_gpu, "randn", lambda *shape: torch.randn(*shape))
    for name in ("full", "empty"):
        monkeypatch.setattr(torch, name, _on_cpu(getattr(torch, name)))
    guarded = conftest.guarded_outputs
    monkeypatch.setattr(test_gpu, "guarded_outputs", lambda M, N, device="cuda", guard=4096: guarded(M, N, "cpu", guard))
    return emulated_gpu


@pytest.mark.parametrize("case", sorted(test_gpu.WGMMA_X3_A_REGS_CASES))
def test_tf32x3_splitting_a_in_registers_gpu_test_runs_on_the_emulated_gpu(gpu_test_on_cpu, case, rel_err):
    test_gpu.test_wgmma_tf32x3_splitting_a_in_registers_gives_the_staged_bits(case, rel_err)
    assert any(dict(x.cfg.macros).get("X3_A_REGS") for x in gpu_test_on_cpu.launches)


@pytest.mark.parametrize("case", sorted(test_gpu.PLANNER_X3_A_REGS_CASES))
def test_tf32x3_planner_splitting_a_in_registers_gpu_test_runs_on_the_emulated_gpu(gpu_test_on_cpu, case, rel_err):
    test_gpu.test_tf32x3_planner_splits_a_in_registers_on_narrow_tall_products(case, rel_err)
    assert any(dict(x.cfg.macros).get("X3_A_REGS") for x in gpu_test_on_cpu.launches)


@pytest.mark.parametrize("case", sorted(test_gpu.WGMMA_ROWS64_CASES) + sorted(test_gpu.WGMMA_A_MN_ROWS64_CASES))
def test_64_row_tiles_gpu_test_runs_on_the_emulated_gpu(gpu_test_on_cpu, case, rel_err):
    test_gpu.test_wgmma_64_row_tiles_compute_every_output(case, rel_err)
    if case in test_gpu.WGMMA_A_MN_ROWS64_CASES:
        assert any(dict(x.cfg.macros).get("BM") == 64 and dict(x.cfg.macros)["A_MN"] for x in gpu_test_on_cpu.launches)


@pytest.mark.parametrize("case", sorted(test_gpu.WGMMA_X3_SPLIT_B_CASES))
def test_tf32x3_splitting_b_on_64_row_tiles_gpu_test_runs_on_the_emulated_gpu(gpu_test_on_cpu, case, rel_err):
    test_gpu.test_wgmma_tf32x3_on_64_row_tiles_splits_b_in_the_kernel(case, rel_err)


@pytest.mark.parametrize("case", sorted(test_gpu.WGMMA_SPLIT_CASES))
def test_split_k_gpu_test_runs_on_the_emulated_gpu(gpu_test_on_cpu, case, rel_err):
    test_gpu.test_wgmma_split_k_sums_every_tiles_slices_in_order(case, rel_err)


@pytest.mark.parametrize("bn", [64, 96, 128, 160, 192])
@pytest.mark.parametrize("case", sorted(test_gpu.WGMMA_WIDTH_CASES) + ["odd-items-per-block"])
def test_pingpong_gpu_test_runs_on_the_emulated_gpu(gpu_test_on_cpu, case, bn, rel_err):
    """The consumers taking turns, C from registers and through the copy engine (a staging region
    each consumer warpgroup): the GPU test's plans, maps and launch arguments for both forms."""
    test_gpu.test_wgmma_pingpong_consumers_compute_every_tile(case, bn, rel_err)
    staged = [x for x in gpu_test_on_cpu.launches
              if dict(x.cfg.macros).get("PINGPONG") and dict(x.cfg.macros).get("TMA_STORE")]
    if case in ("b-k-major", "many-tiles-k-major", "broadcast-b", "odd-items-per-block"):
        assert staged, [x.cfg.macros for x in gpu_test_on_cpu.launches]


@pytest.mark.parametrize("bn", [64, 96, 128, 160, 192])
@pytest.mark.parametrize("case", sorted(test_gpu_epilogue.WGMMA_EPILOGUE_CASES))
def test_epilogue_store_forms_gpu_test_runs_on_the_emulated_gpu(gpu_test_on_cpu, monkeypatch, case, bn):
    """wgmma's epilogue in every store form, the consumers taking turns with C staged among them
    (a bias added as each consumer stages its tile): the GPU test's plans, maps and arguments."""
    monkeypatch.setattr(test_gpu_epilogue, "randn", lambda *shape: torch.randn(*shape))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # (the emulated H200's)
    test_gpu_epilogue.test_wgmma_applies_the_epilogue_at_every_width_and_store_form(case, bn, "tf32")
