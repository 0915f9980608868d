"""Facts about a real GPU, read once per device through cuda.core (the driver API)."""
from __future__ import annotations

import functools

from ..problem import DeviceFacts, dram_tbps


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
        dram_tbps=dram_tbps(int(props.memory_clock_rate), int(props.global_memory_bus_width)),
    )


@functools.lru_cache(maxsize=None)
def device_identity(index: int) -> tuple[str, tuple[int, int], int]:
    """(name, compute capability, driver version) of a device, through the driver API: what a
    tuned choice was measured on, and so what it is valid for (another GPU model, or another
    driver with other code generation, may prefer other kernels)."""
    from cuda.bindings import driver

    def check(result):
        err, *values = result
        if int(err) != 0:
            raise RuntimeError(f"CUDA driver call failed: {err}")
        return values[0] if len(values) == 1 else values

    check(driver.cuInit(0))
    dev = check(driver.cuDeviceGet(index))
    raw = check(driver.cuDeviceGetName(256, dev))
    name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace").strip()
    attr = driver.CUdevice_attribute
    major = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
    minor = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
    return name, (int(major), int(minor)), int(check(driver.cuDriverGetVersion()))
