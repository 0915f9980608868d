"""Tensor maps (CUtensorMap) for the bulk tensor copy engine (TMA) of sm_90.

A tensor map describes one operand in global memory - base pointer, sizes, byte strides - and the
box one copy moves into shared memory. The driver encodes it on the host (cuTensorMapEncodeTiled);
the kernel receives it by value as a ``__grid_constant__`` parameter. It embeds the data pointer,
so a map is made per call, never cached with the plan.
"""
from __future__ import annotations

from ..families import MapSpec


class TensorMapError(RuntimeError):
    """The driver refused to encode a tensor map (the planner should have prevented it)."""


#: Encoded maps by (pointer, geometry, element type). Encoding through the Python bindings costs
#: tens of microseconds; the same buffers come back call after call (weights, the allocator's
#: staging blocks), so a bounded dict of recent maps makes that a lookup.
_recent: dict[tuple, object] = {}
MAX_RECENT = 512


def encode(ptr: int, spec: MapSpec, *, tf32: bool = True):
    """:func:`encode_new`, remembered for the next call with the same pointer and geometry."""
    # (keyed by the spec's fields: a dataclass hashes and compares in Python, ~0.5 us a lookup)
    key = (ptr, spec.dims, spec.strides, spec.box, tf32)
    tmap = _recent.get(key)
    if tmap is None:
        if len(_recent) >= MAX_RECENT:
            _recent.clear()
        tmap = _recent[key] = encode_new(ptr, spec, tf32=tf32)
    return tmap


def encode_new(ptr: int, spec: MapSpec, *, tf32: bool = True):
    """A CUtensorMap for fp32 data at ``ptr`` with 128-byte swizzle and zero fill out of range.

    ``tf32=True`` gives the TFLOAT32 element type: the copy engine rounds each fp32 element to
    TF32 as it copies (the tensor core alone would truncate the low mantissa bits)."""
    from cuda.bindings import driver as d

    rank = len(spec.dims)
    dtype = (d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_TFLOAT32 if tf32
             else d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32)
    err, tmap = d.cuTensorMapEncodeTiled(
        dtype, rank, ptr, [d.cuuint64_t(x) for x in spec.dims], [d.cuuint64_t(x) for x in spec.strides],
        [d.cuuint32_t(x) for x in spec.box], [d.cuuint32_t(1)] * rank,
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if int(err) != 0:
        raise TensorMapError(f"cuTensorMapEncodeTiled failed ({err}) for dims {spec.dims}, strides {spec.strides}, "
                             f"box {spec.box} at {ptr:#x}")
    return tmap
