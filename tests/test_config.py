"""fastmm.config: the environment switches read on every call follow os.environ at run time."""
from __future__ import annotations

import os
from unittest import mock

from fastmm import config


def test_switches_follow_os_environ_changes_at_run_time(monkeypatch):
    monkeypatch.delenv("FASTMM_DISABLE", raising=False)
    monkeypatch.delenv("FASTMM_KERNEL", raising=False)
    assert config.disabled() is False and config.forced_kernel() is None
    for value, on in ((" Yes ", True), ("1", True), ("on", True), ("0", False), ("", False), ("no", False)):
        monkeypatch.setenv("FASTMM_DISABLE", value)
        assert config.disabled() is on, value
    monkeypatch.setenv("FASTMM_KERNEL", " skinny ")
    assert config.forced_kernel() == "skinny"
    os.environ["FASTMM_KERNEL"] = "scalar"  # plain assignment, not only monkeypatch
    assert config.forced_kernel() == "scalar"
    monkeypatch.setenv("FASTMM_KERNEL", "   ")
    assert config.forced_kernel() is None
    monkeypatch.delenv("FASTMM_KERNEL")
    monkeypatch.delenv("FASTMM_DISABLE")
    assert config.disabled() is False and config.forced_kernel() is None


def test_switch_reads_agree_with_os_environ_get(monkeypatch):
    for name, read in ((config.DISABLE_ENV, config._read_disable), (config.FORCE_KERNEL_ENV, config._read_force)):
        monkeypatch.setenv(name, "x\u00e9y")  # non-ASCII survives the decode
        assert read() == os.environ.get(name)
        monkeypatch.delenv(name)
        assert read() is None


def test_switches_follow_an_os_environ_replaced_wholesale(monkeypatch):
    monkeypatch.setenv("FASTMM_KERNEL", "scalar")
    with mock.patch.object(os, "environ", {"FASTMM_KERNEL": "skinny", "FASTMM_DISABLE": "1"}):
        assert config.forced_kernel() == "skinny" and config.disabled() is True
    assert config.forced_kernel() == "scalar" and config.disabled() is False


def test_the_switches_of_the_keys_change_with_either_variable(monkeypatch):
    """config.switches() (part of every fast-path key) differs whenever FASTMM_DISABLE or
    FASTMM_KERNEL does, however set, and is equal while neither changes."""
    monkeypatch.delenv("FASTMM_DISABLE", raising=False)
    monkeypatch.delenv("FASTMM_KERNEL", raising=False)
    seen = [config.switches()]
    for name, value in (("FASTMM_KERNEL", "scalar"), ("FASTMM_DISABLE", "1"), ("FASTMM_KERNEL", "skinny"),
                        ("FASTMM_DISABLE", "0")):
        monkeypatch.setenv(name, value)
        assert config.switches() == config.switches()
        seen.append(config.switches())
    os.environ["FASTMM_DISABLE"] = "true"  # plain assignment, not only monkeypatch
    seen.append(config.switches())
    with mock.patch.object(os, "environ", {"FASTMM_KERNEL": "scalar", "FASTMM_DISABLE": "yes"}):
        seen.append(config.switches())
    assert len(set(seen)) == len(seen)


def test_dependent_launch_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("FASTMM_PDL", raising=False)
    assert config.dependent_launch_enabled() is True
    for value, on in (("1", True), ("", True), (" on ", True), ("0", False), ("OFF", False), ("no", False),
                      ("false", False)):
        monkeypatch.setenv("FASTMM_PDL", value)
        assert config.dependent_launch_enabled() is on, value
