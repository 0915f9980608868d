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

The buffers are tiny (4 bytes a tile) and come from PyTorch's stream-ordered allocator, so one
that grows can be dropped at once: no later launch gets its memory before the earlier ones ran.
"""
from __future__ import annotations

import threading

import torch

_INT32 = torch.int32
_buffers: dict[tuple[str, int | None, int], torch.Tensor] = {}  # (device type, index, stream)
_grow = threading.Lock()


def counters(device: torch.device, stream: int, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 counters for a launch on ``stream`` (the current stream of
    ``device``), valid until the next launch on that stream. Keep the tensor referenced until
    the launch is queued."""
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
                # zeroed on this stream, before the launch that will use it
                buf = _buffers[key] = torch.zeros(max(n, 1024), dtype=_INT32,
                                                  device=torch.device(device.type, index) if index is not None else device)
    return buf


def forget() -> None:
    """Drop every eager buffer (tests; a process that is done with fastmm)."""
    _buffers.clear()
