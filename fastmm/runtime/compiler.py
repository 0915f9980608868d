"""NVRTC, through cuda.core: kernel source + macros + arch -> cubin bytes.

Always to cubin for the device's exact arch, never PTX: a cubin from a newer NVRTC (pip) loads on
an older driver, PTX from it would need the driver to be at least as new (DESIGN.md).
"""
from __future__ import annotations

import functools
import io
import threading

from .sources import read_source, source_dir

_import_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _cuda_core():
    """cuda.core, imported once under a lock: its first import from several threads at once has
    failed ("cannot import name 'Program' from 'cuda.core.cu13'") while the package was only
    half initialised."""
    with _import_lock:
        import cuda.core

        return cuda.core


class CompileError(RuntimeError):
    """NVRTC rejected a kernel; the message carries its log."""


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library; raises if it cannot be loaded."""
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if int(err) != 0:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return int(major), int(minor)


def nvrtc_unavailable_reason() -> str | None:
    """None when NVRTC and cuda.core can compile; otherwise why not (for explain)."""
    try:
        _cuda_core()
        nvrtc_version()
    except Exception as exc:  # ImportError, missing libnvrtc.so, ...
        return f"NVRTC is not usable ({type(exc).__name__}: {exc})"
    return None


def compile_cubin(source: str, macros: tuple[tuple[str, int], ...], arch: str) -> bytes:
    core = _cuda_core()
    Program, ProgramOptions = core.Program, core.ProgramOptions
    options = ProgramOptions(
        name=source, arch=arch, std="c++17", include_path=[str(source_dir())],
        define_macro=[(k, str(v)) for k, v in macros] or None,
    )
    log = io.StringIO()
    try:
        obj = Program(read_source(source), "c++", options).compile("cubin", logs=log)
    except Exception as exc:
        raise CompileError(f"NVRTC failed on {source} for {arch} with {dict(macros)}: {exc}\n{log.getvalue()}") from exc
    code = obj.code
    return bytes(code) if not isinstance(code, bytes) else code
