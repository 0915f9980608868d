"""The JIT runtime: find kernel sources, compile them with NVRTC, cache the cubins on disk, load
them once per device and launch them on PyTorch's current stream. Knows nothing of torch
semantics (that is :mod:`fastmm.api`, :mod:`fastmm.shapes`, :mod:`fastmm.dispatch`) nor of which kernel to pick (:mod:`fastmm.plan`)."""
