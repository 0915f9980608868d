"""benchmarks/probes/default_variant.py: the pytest plugin that runs the suite as if a family variant
were fastmm's default. Run in a pytest of its own (the plugin changes process-wide defaults), over
a generated test file that asserts what the run sees."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

INNER = '''
import dataclasses

from fastmm.families import FAMILIES, WgmmaTf32
from fastmm.plan import select
from fastmm.problem import DeviceFacts, Problem


def test_the_variant_is_the_default_everywhere_a_default_lives():
    assert FAMILIES["wgmma_tf32"].pingpong_tma_store is True  # the planner's own plans
    assert WgmmaTf32().pingpong_tma_store is True  # a variant a test builds
    assert WgmmaTf32(force_bn=128).pingpong_tma_store is True
    assert WgmmaTf32(pingpong_tma_store=False).pingpong_tma_store is False  # named: kept
    assert dataclasses.replace(WgmmaTf32(pingpong_tma_store=None), force_bn=64).pingpong_tma_store is None
    assert WgmmaTf32().tma_store is True and WgmmaTf32().split == WgmmaTf32.__dataclass_fields__["split"].default


def test_the_planner_takes_it_on_a_simulated_h200():  # (where the default takes turns from registers)
    kernel = select(Problem.dense(4728, 3072, 768, "tf32", b_t=True), DeviceFacts.simulated_device("sm_90")).kernel
    macros = dict(kernel.macros)
    assert (macros.get("PINGPONG"), macros.get("TMA_STORE"), macros["BN"]) == (1, 1, 192)
'''


def run_inner(tmp_path, *options):
    (tmp_path / "test_inner.py").write_text(INNER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "benchmarks" / "probes")]))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "default_variant", *options,
                           str(tmp_path / "test_inner.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_default_variant_changes_the_registry_and_the_class_defaults_and_says_so(tmp_path):
    res = run_inner(tmp_path, "--default-variant", "wgmma_tf32:pingpong_tma_store=True")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "default variant: wgmma_tf32: {'pingpong_tma_store': True}" in res.stdout
    assert "2 passed" in res.stdout


def test_without_the_option_the_defaults_are_fastmms_own(tmp_path):
    res = run_inner(tmp_path)
    assert res.returncode == 1 and "2 failed" in res.stdout, res.stdout + res.stderr
    assert "default variant" not in res.stdout


def test_a_field_the_family_does_not_have_is_a_usage_error(tmp_path):
    res = run_inner(tmp_path, "--default-variant", "wgmma_tf32:no_such_field=1")
    assert res.returncode == 4, res.stdout + res.stderr  # pytest's usage-error status
    assert "no_such_field=1" in res.stderr and "pingpong_tma_store" in res.stderr
