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


class FakeDriverCounters:
    """arrivals.DriverCounters without a driver: records what was made and freed."""

    made: list = []
    freed_ones: list = []

    def __init__(self, n, index, stream):
        self.n, self.index, self.stream = n, index, stream
        FakeDriverCounters.made.append(self)

    def numel(self):
        return self.n

    def data_ptr(self):
        return id(self)

    def freed(self):
        FakeDriverCounters.freed_ones.append(self)


@pytest.fixture
def fake_driver(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(arrivals, "DriverCounters", FakeDriverCounters)
    FakeDriverCounters.made, FakeDriverCounters.freed_ones = [], []

    def no_torch_memory(*args, device=None, **kwargs):
        raise AssertionError(f"a CUDA device's eager counters came from PyTorch's allocator ({device})")

    monkeypatch.setattr(torch, "zeros", no_torch_memory)
    return FakeDriverCounters


def test_a_device_without_an_index_means_the_current_one(fake_driver, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    buf = arrivals.counters(torch.device("cuda"), 7, 4)
    assert [(b.index, b.stream) for b in fake_driver.made] == [(3, 7)] and arrivals._buffers == {("cuda", 3, 7): buf}


def test_a_cuda_streams_counters_are_the_drivers_memory_not_a_torch_pools(fake_driver):
    """Eager counters outlive the call that made them, and PyTorch may be routing this thread's
    allocations to a CUDA graph's private pool when they are made (torch.compile's CUDA graphs
    warm a step up that way, then refuse to record while pool memory is held elsewhere): so on a
    CUDA device they are the driver's, one buffer a stream, kept while it is large enough."""
    dev = torch.device("cuda", 0)
    a = arrivals.counters(dev, 7, 40)
    assert isinstance(a, fake_driver) and a.numel() >= 40 and a.stream == 7 and a.index == 0
    assert arrivals.counters(dev, 7, 12) is a
    b = arrivals.counters(dev, 8, 12)
    assert b is not a and b.stream == 8


def test_an_outgrown_cuda_buffer_is_retired_not_freed_until_forget(fake_driver):
    """Another thread may hold the outgrown buffer for a launch it has not queued yet (nothing
    ties the driver's memory to that reference, as a tensor's did): it is freed by forget only.
    Buffers double as they grow, so few are retired."""
    dev = torch.device("cuda", 0)
    small = arrivals.counters(dev, 7, 10)
    big = arrivals.counters(dev, 7, small.numel() + 1)
    assert big.numel() == 2 * small.numel() and fake_driver.freed_ones == []
    assert arrivals.counters(dev, 7, 10) is big and arrivals._retired == [small]
    arrivals.forget()
    assert fake_driver.freed_ones == [big, small] and arrivals._buffers == {} and arrivals._retired == []


class FakeDriver:
    """cuda.bindings.driver's calls that DriverCounters makes, recorded; ``fail`` names the ones
    that return an error."""

    def __init__(self, fail=()):
        self.calls, self.fail, self.next_ptr = [], set(fail), 0x1000

    def _result(self, name, *value):
        self.calls.append(name)
        return (1 if name in self.fail else 0, *value)

    def cuMemAllocAsync(self, nbytes, stream):
        self.next_ptr += 0x1000
        return self._result(f"cuMemAllocAsync({nbytes}, stream {stream})", self.next_ptr)

    def cuMemAlloc(self, nbytes):
        self.next_ptr += 0x1000
        return self._result(f"cuMemAlloc({nbytes})", self.next_ptr)

    def cuMemsetD32Async(self, ptr, value, n, stream):
        return self._result(f"cuMemsetD32Async({ptr:#x}, {value}, {n}, stream {stream})")

    def cuMemFree(self, ptr):
        return self._result(f"cuMemFree({ptr:#x})")


def test_driver_counters_are_allocated_and_zeroed_on_their_stream(monkeypatch):
    d = FakeDriver()
    monkeypatch.setattr(arrivals, "_driver", lambda: d)
    buf = arrivals.DriverCounters(1024, 0, 7)
    assert (buf.data_ptr(), buf.numel()) == (0x2000, 1024)
    assert d.calls == ["cuMemAllocAsync(4096, stream 7)", "cuMemsetD32Async(0x2000, 0, 1024, stream 7)"]


def test_driver_counters_without_the_stream_ordered_allocator_use_cumemalloc(monkeypatch):
    d = FakeDriver(fail={"cuMemAllocAsync(4096, stream 7)"})
    monkeypatch.setattr(arrivals, "_driver", lambda: d)
    assert arrivals.DriverCounters(1024, 0, 7).data_ptr() == 0x3000
    assert d.calls[1:] == ["cuMemAlloc(4096)", "cuMemsetD32Async(0x3000, 0, 1024, stream 7)"]


def test_driver_counters_that_cannot_be_zeroed_are_freed_and_refused(monkeypatch):
    d = FakeDriver(fail={"cuMemsetD32Async(0x2000, 0, 1024, stream 7)"})
    monkeypatch.setattr(arrivals, "_driver", lambda: d)
    with pytest.raises(RuntimeError, match="cuMemsetD32Async failed"):
        arrivals.DriverCounters(1024, 0, 7)
    assert d.calls[-1] == "cuMemFree(0x2000)"


def test_a_driver_that_refuses_leaves_the_counters_in_torch_memory_and_says_so(monkeypatch):
    """A refusal costs that buffer alone (the next one asks the driver again: a refusal may be
    passing, e.g. out of memory for a moment), with one warning."""
    import fastmm.errors

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(arrivals, "driver_refused", [])
    monkeypatch.setattr(fastmm.errors, "_warned", set())

    class Refused:
        def __init__(self, n, index, stream):
            raise RuntimeError("no driver here")

    monkeypatch.setattr(arrivals, "DriverCounters", Refused)
    made = []
    real = torch.zeros

    def zeros(*args, device=None, **kwargs):
        made.append(device)
        return real(*args, **kwargs)  # (on the CPU)

    monkeypatch.setattr(torch, "zeros", zeros)
    with pytest.warns(UserWarning, match="no driver here"):
        buf = arrivals.counters(torch.device("cuda", 0), 7, 4)
    assert made == [torch.device("cuda", 0)] and not buf.any()
    assert arrivals.counters(torch.device("cuda", 0), 8, 4) is not buf and len(made) == 2
    assert arrivals.driver_refused == ["RuntimeError: no driver here"] * 2
