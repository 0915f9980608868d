"""Zeroed arrival counters for kernels that finish their own split-K sums (``split_fused``
plans; ``split_arrive_last`` in cuda_src/common.cuh).

A launch counts each tile's finished blocks in a 32-bit counter; the last block of a tile sums
the tile's slices and puts the counter back to 0. So a counter is zero between launches, as
long as two launches never use it at the same time:

- eagerly, each (device, stream) has its own buffer: launches on one stream run one after
  another, and launches on different streams never share counters;
- while a stream is being captured into a CUDA graph, each launch gets a fresh buffer, zeroed
  by a fill captured just before it. A graph may be replayed on any stream, alongside eager
  work, so it must not hold a stream's eager buffer.

A CUDA device's eager buffers are the driver's memory (``cuMemAllocAsync``), not PyTorch's. A
buffer outlives the call that made it, and PyTorch may be routing this thread's allocations to
a CUDA graph's private pool when it is made: torch.compile's CUDA graphs
(``mode="reduce-overhead"``) run each compiled step eagerly first with the graph's pool current,
then refuse to record while memory of that pool is held by something other than the step's
outputs ("Detected 1 tensor(s) in the cudagraph pool not tracked as outputs"). A buffer is zeroed
on its stream before the launch that uses it. One that a larger launch outgrows is retired, not
freed: another thread may hold it for a launch it has not queued yet (a tensor's reference kept
PyTorch's memory alive for that launch; the driver's memory has no such tie), so it is freed by
:func:`forget` only. Buffers at least double when they grow, so few are ever retired. If the
driver refuses a buffer, that buffer is PyTorch's, as before, with a warning. Other devices (the
CPU tensors of fastmm's emulated GPU in the CPU tests) keep tensors. The buffers are tiny: 4
bytes a tile.
"""
from __future__ import annotations

import threading

import torch

from ..errors import warn_once

_INT32 = torch.int32
#: (device type, index, stream) -> the stream's eager counters: a tensor, or a DriverCounters
_buffers: dict[tuple[str, int | None, int], object] = {}
_grow = threading.Lock()
#: The least counters a new eager buffer holds (one launch of up to 1024 tiles).
MIN_COUNTERS = 1024
#: Buffers outgrown by a larger launch, freed by forget() (see the module's docstring).
_retired: list = []
#: Why the driver refused a buffer, each time it did (that buffer was then PyTorch's memory).
driver_refused: list[str] = []


def _driver():
    from cuda.bindings import driver

    return driver


def _check(result, what: str):
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"fastmm: {what} failed for the split-K arrival counters: {err}")
    return result[1] if len(result) > 1 else None


class DriverCounters:
    """``n`` int32 counters in the driver's memory, zeroed on ``stream`` when made: what a launch
    needs of a tensor (:meth:`data_ptr`, :meth:`numel`), and a copy to the host for checks."""

    __slots__ = ("ptr", "n", "index", "stream")

    def __init__(self, n: int, index: int, stream: int):
        d = _driver()
        self.n, self.index, self.stream = n, index, stream
        try:  # stream-ordered, as PyTorch's allocator is
            self.ptr = int(_check(d.cuMemAllocAsync(4 * n, stream), "cuMemAllocAsync"))
        except RuntimeError:  # (a platform without the stream-ordered allocator)
            self.ptr = int(_check(d.cuMemAlloc(4 * n), "cuMemAlloc"))
        try:
            _check(d.cuMemsetD32Async(self.ptr, 0, n, stream), "cuMemsetD32Async")
        except Exception:
            d.cuMemFree(self.ptr)  # (nothing was queued on it)
            raise

    def data_ptr(self) -> int:
        return self.ptr

    def numel(self) -> int:
        return self.n

    def freed(self) -> None:
        """Free the buffer once the device is idle (its stream may be gone)."""
        with torch.cuda.device(self.index):
            torch.cuda.synchronize()
            _check(_driver().cuMemFree(self.ptr), "cuMemFree")

    def values(self) -> torch.Tensor:
        """The counters on the host, after the work queued on the device (for checks)."""
        with torch.cuda.device(self.index):
            torch.cuda.synchronize()
            host = torch.empty(self.n, dtype=_INT32)
            _check(_driver().cuMemcpyDtoH(host.data_ptr(), self.ptr, 4 * self.n), "cuMemcpyDtoH")
        return host


def counters(device: torch.device, stream: int, n: int):
    """At least ``n`` zeroed int32 counters for a launch on ``stream`` (the current stream of
    ``device``), valid until the next launch on that stream: a tensor, or on a CUDA device
    outside capture a :class:`DriverCounters`; either way its ``data_ptr()`` is what the launch
    takes. Keep it referenced until the launch is queued."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=_INT32, device=device)
    index = device.index
    if index is None and device.type == "cuda":  # torch.device("cuda"): the current device
        index = torch.cuda.current_device()
    key = (device.type, index, stream)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < n:
        with _grow:
            buf = _buffers.get(key)
            if buf is None or buf.numel() < n:
                old, buf = buf, None
                size = max(n, MIN_COUNTERS, 2 * old.numel() if old is not None else 0)
                if device.type == "cuda":  # (the launch's device is current)
                    try:
                        buf = DriverCounters(size, index, stream)
                    except Exception as exc:  # (not expected: then PyTorch's memory, as before)
                        driver_refused.append(f"{type(exc).__name__}: {exc}")
                        warn_once(f"fastmm: split-K arrival counters in PyTorch's memory ({driver_refused[-1]}); "
                                  "torch.compile's CUDA graphs may then refuse to record")
                if buf is None:  # zeroed on this stream, before the launch that will use it
                    buf = torch.zeros(size, dtype=_INT32,
                                      device=torch.device(device.type, index) if index is not None else device)
                if isinstance(old, DriverCounters):
                    _retired.append(old)  # (not freed: see the module's docstring)
                _buffers[key] = buf
    return buf


def values(buf) -> torch.Tensor:
    """A buffer's counters as a CPU tensor (after the launches queued before: for checks)."""
    if isinstance(buf, DriverCounters):
        return buf.values()
    if buf.is_cuda:
        torch.cuda.synchronize(buf.device)
    return buf.cpu()


def forget() -> None:
    """Drop every eager buffer (tests; a process that is done with fastmm, with no launch of its
    own still to be queued): the driver's are freed once their devices are idle, or left (a
    device in an error state keeps them; the process is past using it)."""
    with _grow:
        for buf in [*_buffers.values(), *_retired]:
            if isinstance(buf, DriverCounters):
                try:
                    buf.freed()
                except Exception:  # (see above)
                    pass
        _buffers.clear()
        _retired.clear()
