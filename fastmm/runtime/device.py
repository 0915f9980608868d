"""Facts about a real GPU, read once per device through cuda.core (the driver API)."""
from __future__ import annotations

import functools

from ..problem import DeviceFacts


@functools.lru_cache(maxsize=None)
def device_facts(index: int) -> DeviceFacts:
    from cuda.core import Device

    dev = Device(index)
    props = dev.properties
    major, minor = dev.compute_capability
    return DeviceFacts(
        index=index,
        name=dev.name,
        cc=(int(major), int(minor)),
        sm_count=int(props.multiprocessor_count),
        smem_per_block_optin=int(props.max_shared_memory_per_block_optin),
        smem_per_sm=int(props.max_shared_memory_per_multiprocessor),
        l2_bytes=int(props.l2_cache_size),
    )
