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


#: NVRTC major versions fastmm supports: what pyproject.toml allows (nvidia-cuda-nvrtc>=13,<14).
#: Tested: 13.0.88 (pinned by torch 2.14's CUDA wheels; the H200 image's, torch 2.11), 13.2.86 (torch
#: 2.15's) and the newest 13.x on PyPI (.ci/run). Another major version may compile the
#: kernels differently or not at all (ptxas allocates registers its own way: spills, a stack
#: frame) and is untested, so fastmm leaves such a process to torch.matmul (warned once).
SUPPORTED_NVRTC_MAJOR = (13,)
SUPPORTED_NVRTC_TEXT = "13.x (nvidia-cuda-nvrtc>=13,<14)"


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library; raises if it cannot be loaded."""
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if int(err) != 0:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return int(major), int(minor)


def nvrtc_unavailable_reason() -> str | None:
    """None when NVRTC and cuda.core can compile and NVRTC's version is one fastmm supports;
    otherwise why not (for explain, and the one warning when a CUDA call goes to torch)."""
    try:
        _cuda_core()
        major, minor = nvrtc_version()
    except Exception as exc:  # ImportError, missing libnvrtc.so, ...
        return f"NVRTC is not usable ({type(exc).__name__}: {exc})"
    if major not in SUPPORTED_NVRTC_MAJOR:
        return (f"NVRTC {major}.{minor} is outside the versions fastmm supports, {SUPPORTED_NVRTC_TEXT}; "
                f"install one with: pip install 'nvidia-cuda-nvrtc>=13,<14'")
    return None


def compile_cubin(source: str, macros: tuple[tuple[str, int], ...], arch: str, *,
                  ptxas_log: io.StringIO | None = None) -> bytes:
    """``source`` built with ``macros`` for ``arch`` (sm_XX / sm_90a) to cubin. ``ptxas_log``:
    also run ptxas verbosely (-v, the same code) and write NVRTC's log there: per entry the
    registers, stack frame, spill stores and loads (tests read them; cuda.core 1.2.0 writes
    nothing)."""
    core = _cuda_core()
    Program, ProgramOptions = core.Program, core.ProgramOptions
    options = ProgramOptions(
        name=source, arch=arch, std="c++17", include_path=[str(source_dir())],
        define_macro=[(k, str(v)) for k, v in macros] or None,
        ptxas_options=["-v"] if ptxas_log is not None else None,
    )
    log = io.StringIO()
    try:
        obj = Program(read_source(source), "c++", options).compile("cubin", logs=log)
    except Exception as exc:
        raise CompileError(f"NVRTC failed on {source} for {arch} with {dict(macros)}: {exc}\n{log.getvalue()}") from exc
    if ptxas_log is not None:
        ptxas_log.write(log.getvalue().replace("\0", ""))
    code = obj.code
    return bytes(code) if not isinstance(code, bytes) else code
