"""Loaded kernels and their launch.

One loaded module per (device, kernel key), kept for the life of the process, so the steady-state
call is a dict lookup plus one launch. Launches go on the stream PyTorch considers current for the
device; nothing here synchronizes. Compiling or loading while a CUDA graph is being captured is
refused by the caller (fastmm.dispatch), since both would break the capture.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path

from .. import config
from ..families import DEFAULT_SMEM, KernelConfig
from ..problem import DeviceFacts
from .cache import default_cache, kernel_key
from .compiler import compile_cubin, nvrtc_version
from .sources import source_digest


class LaunchError(RuntimeError):
    """The driver refused to load or launch a kernel (an illegal launch configuration: too many
    threads or too much shared memory for the device, say). Not a sticky error: the context is
    fine, and the caller can let torch compute instead."""


@dataclass
class LoadedKernel:
    kernel: object  # cuda.core Kernel
    launch_config: object  # cuda.core LaunchConfig (grid/block/smem of the plan; dependent launch or not)
    key: str
    state: str  # how it got here: "compiled", "disk"; "memory" once reused
    path: Path | None


_modules: dict[tuple[int, str, str], tuple[object, str, Path | None]] = {}
_guard = threading.Lock()
_streams: dict[int, object] = {}


def key_for(cfg: KernelConfig, arch: str) -> str:
    """Cache key of ``cfg`` built for a device of ``arch`` (the kernel may refine the target)."""
    return kernel_key(source_digest(cfg.source), cfg.macros, cfg.target(arch), nvrtc_version())


def module_slot(dev: DeviceFacts, cfg: KernelConfig) -> tuple[int, str, str]:
    """A loaded kernel's identity: the module (one cubin per key) and the entry point in it."""
    return dev.index, key_for(cfg, dev.arch), cfg.entry


def is_loaded(dev: DeviceFacts, cfg: KernelConfig) -> bool:
    return module_slot(dev, cfg) in _modules


def load(dev: DeviceFacts, cfg: KernelConfig) -> LoadedKernel:
    """Compile (or fetch from the disk cache) and load ``cfg`` for ``dev``; cached per process."""
    from .compiler import _cuda_core

    core = _cuda_core()
    Device, LaunchConfig, ObjectCode = core.Device, core.LaunchConfig, core.ObjectCode
    slot = module_slot(dev, cfg)
    key = slot[1]
    entry = _modules.get(slot)
    state = "memory"
    if entry is None:
        with _guard:
            entry = _modules.get(slot)
            if entry is None:
                target = cfg.target(dev.arch)
                res = default_cache().get_or_compile(
                    cfg.family + "-" + target, key, target, lambda: compile_cubin(cfg.source, cfg.macros, target))
                with _on_device(Device, dev.index):
                    try:
                        kernel = ObjectCode.from_cubin(res.cubin, name=cfg.entry).get_kernel(cfg.entry)
                        if cfg.smem > DEFAULT_SMEM:
                            _allow_dynamic_smem(kernel, cfg.smem, dev.index)
                    except Exception as exc:
                        raise LaunchError(f"{cfg.entry} could not be loaded: {exc}") from exc
                entry = (kernel, res.state, res.path)
                _modules[slot] = entry
                state = res.state
    kernel, _, path = entry
    try:
        lc = launch_config(LaunchConfig, cfg)
    except (ValueError, RuntimeError) as exc:  # cuda.core checks the geometry it is given
        raise LaunchError(f"{cfg.entry}: launch configuration refused ({exc})") from exc
    return LoadedKernel(kernel, lc, key, state, path)


_pdl_supported = []  # whether this cuda.core's LaunchConfig takes the PDL option, found once


def launch_config(LaunchConfig, cfg: KernelConfig):
    """cuda.core's LaunchConfig of ``cfg``: grid, block, dynamic shared memory, and programmatic
    dependent launch where the plan asks for it (``cfg.dependent_launch``: the kernel waits on
    the GPU for the kernel ahead, cuda_src/ptx.cuh) unless FASTMM_PDL=0, or where this cuda.core
    lacks the option. The kernel is then scheduled while the kernel ahead on the stream
    finishes: the launch gap between back-to-back kernels is hidden."""
    if cfg.dependent_launch and config.dependent_launch_enabled() and _pdl_supported != [False]:
        try:
            lc = LaunchConfig(grid=cfg.grid, block=cfg.block_dims, shmem_size=cfg.smem,
                              programmatic_stream_serialization=True)
            _pdl_supported[:] = [True]
            return lc
        except TypeError:  # an older cuda.core: plain launches
            _pdl_supported[:] = [False]
    return LaunchConfig(grid=cfg.grid, block=cfg.block_dims, shmem_size=cfg.smem)


@contextlib.contextmanager
def _on_device(Device, index: int):
    """Make ``index``'s primary context current for a load, then put the caller's context back:
    PyTorch reads its current device from it, so a load for cuda:1 must not leave cuda:1 current."""
    from cuda.bindings import driver

    err, previous = driver.cuCtxGetCurrent()
    Device(index).set_current()
    try:
        yield
    finally:
        if int(err) == 0 and previous is not None and int(previous) != 0:
            driver.cuCtxSetCurrent(previous)


def _allow_dynamic_smem(kernel, nbytes: int, device_index: int) -> None:
    """Opt in to more than 48 KiB of dynamic shared memory (a per-kernel attribute)."""
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    handle = kernel.handle
    if isinstance(handle, driver.CUkernel):
        err, dev = driver.cuDeviceGet(device_index)
        (err,) = driver.cuKernelSetAttribute(attr, nbytes, handle, dev)
    else:
        (err,) = driver.cuFuncSetAttribute(handle, attr, nbytes)
    if int(err) != 0:
        raise RuntimeError(f"could not allow {nbytes} B of dynamic shared memory: {err}")


def stream_for(handle: int):
    """A cuda.core view of a foreign (PyTorch) stream, made once per handle."""
    s = _streams.get(handle)
    if s is None:
        from cuda.core import Stream

        s = _streams[handle] = Stream.from_handle(handle)
    return s


_launch_fn = []  # cuda.core.launch, looked up once: this is the per-call hot path


def launch(loaded: LoadedKernel, stream_handle: int, args: tuple) -> None:
    if not _launch_fn:
        from cuda.core import launch as cc_launch

        _launch_fn.append(cc_launch)
    stream = _streams.get(stream_handle) or stream_for(stream_handle)
    try:
        _launch_fn[0](stream, loaded.launch_config, loaded.kernel, *args)
    except Exception as exc:  # (free when nothing is raised: this is the per-call hot path)
        raise LaunchError(f"launching {loaded.key} failed: {exc}") from exc


def launch_with_maps(loaded: LoadedKernel, stream_handle: int, maps: tuple, args: tuple) -> None:
    """Launch a kernel whose leading parameters are tensor maps (128-byte structs by value),
    followed by 64-bit integers: :func:`maps_launcher` for one call."""
    maps_launcher(loaded)(stream_handle, maps, args)


def maps_launcher(loaded: LoadedKernel):
    """``launch(stream_handle, maps, args)`` for ``loaded``, with everything that does not change
    between calls looked up once. cuda.core's argument packer takes scalars and pointers only, so
    this builds the parameter array itself and calls the driver's cuLaunchKernel through ctypes
    (the Python bindings' wrapper cost about 10 us more per call). A CUkernel handle may be
    passed as the function: the stream supplies the context. Always a plain launch, never a
    programmatic dependent one: the wgmma kernel does not wait for the kernel ahead.

    The two ctypes arrays (the int64 argument values, and the parameter pointers: the maps', then
    the values') are built once per launcher and thread, and refilled per call (building them
    cost ~2 us a call). Per thread: ctypes releases the GIL during cuLaunchKernel, and Python may
    switch threads between the refill and the call, so arrays shared by two threads could be
    rewritten under a launch that is reading them. The driver copies the parameters when the
    launch is queued, so a thread may refill its arrays as soon as the call returns."""
    cfg = loaded.launch_config
    # (ctypes values of cuLaunchKernel's argument types: ctypes then converts only the stream,
    # 0.6 us a call less than from Python ints)
    head = (ctypes.c_void_p(int(loaded.kernel.handle)),
            *map(ctypes.c_uint, (*cfg.grid, *cfg.block, cfg.shmem_size)))
    cu_launch = _cu_launch_kernel()
    per_thread = threading.local()  # .arrays: (number of maps, values, params)

    def launch(stream_handle: int, maps: tuple, args: tuple) -> None:
        n_maps = len(maps)
        arrays = getattr(per_thread, "arrays", None)
        if arrays is None or arrays[0] != n_maps or len(arrays[1]) != len(args):
            arrays = per_thread.arrays = _parameter_arrays(n_maps, len(args))
        _, values, params = arrays
        values[:] = args  # int64: the bits of any argument, negative too
        for i, m in enumerate(maps):
            params[i] = m.getPtr()
        err = cu_launch(*head, stream_handle, params, None)
        if err != 0:
            raise LaunchError(f"cuLaunchKernel failed: CUresult {err}")
    return launch


def _parameter_arrays(n_maps: int, n: int) -> tuple[int, ctypes.Array, ctypes.Array]:
    """(n_maps, values, params) for :func:`maps_launcher`: ``n`` int64 values and the
    cuLaunchKernel parameter array, whose first ``n_maps`` slots are filled per call and whose
    others point at the values."""
    values = _array_type(ctypes.c_int64, n)()
    base = ctypes.addressof(values)
    params = _array_type(ctypes.c_void_p, n_maps + n)(*[None] * n_maps, *range(base, base + 8 * n, 8))
    return n_maps, values, params


_array_types: dict[tuple, type] = {}


def _array_type(element, n: int) -> type:
    """``element * n``, made once: building a ctypes array type costs microseconds per call."""
    t = _array_types.get((element, n))
    if t is None:
        t = _array_types[(element, n)] = element * n
    return t


_driver_launch = []  # libcuda's cuLaunchKernel with its signature, looked up once


def _cu_launch_kernel():
    if not _driver_launch:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
        u32 = ctypes.c_uint
        fn.argtypes = [ctypes.c_void_p, u32, u32, u32, u32, u32, u32, u32, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _driver_launch.append(fn)
    return _driver_launch[0]
