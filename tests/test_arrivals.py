"""fastmm/runtime/arrivals.py: the zeroed arrival counters of fused split-K launches, on the CPU
(CPU tensors stand in for a device's; the capture state is simulated)."""
from __future__ import annotations

import pytest
import torch

from fastmm.runtime import arrivals

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh():
    arrivals.forget()
    yield
    arrivals.forget()


def test_each_stream_has_its_own_zeroed_counters_kept_between_launches(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    a = arrivals.counters(CPU, 7, 40)
    b = arrivals.counters(CPU, 8, 40)
    assert a.dtype == torch.int32 and a.numel() >= 40 and not a.any() and not b.any()
    assert a.data_ptr() != b.data_ptr()  # concurrent streams never share a counter
    assert arrivals.counters(CPU, 7, 12) is a  # the same stream: the same buffer (its launches run in turn)


def test_a_larger_launch_gets_a_new_zeroed_buffer(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    small = arrivals.counters(CPU, 7, 10)
    big = arrivals.counters(CPU, 7, small.numel() + 1)
    assert big.numel() >= small.numel() + 1 and not big.any() and big is not small
    assert arrivals.counters(CPU, 7, 10) is big


def test_a_captured_launch_gets_a_fresh_buffer_not_the_streams(monkeypatch):
    """Under capture the zeroing is part of the graph and the buffer belongs to that launch:
    a replay on another stream must not share a stream's eager counters."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    eager = arrivals.counters(CPU, 7, 16)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    first, second = arrivals.counters(CPU, 7, 16), arrivals.counters(CPU, 7, 16)
    assert first.numel() == second.numel() == 16 and not first.any() and not second.any()
    assert len({eager.data_ptr(), first.data_ptr(), second.data_ptr()}) == 3
    assert arrivals._buffers == {("cpu", None, 7): eager}  # nothing captured was kept


def test_a_device_without_an_index_means_the_current_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    made = []
    real = torch.zeros

    def zeros(*args, device=None, **kwargs):
        made.append(device)
        return real(*args, **kwargs)  # (on the CPU)

    monkeypatch.setattr(torch, "zeros", zeros)
    arrivals.counters(torch.device("cuda"), 7, 4)
    assert made == [torch.device("cuda", 3)] and ("cuda", 3, 7) in arrivals._buffers
