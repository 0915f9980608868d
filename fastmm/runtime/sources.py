"""Where the kernel sources live, in a source checkout and in an installed wheel."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path


@functools.lru_cache(maxsize=1)
def source_dir() -> Path:
    """``cuda_src/``: packaged inside the wheel as ``fastmm/cuda_src`` (see pyproject.toml), or
    beside the package in a source checkout (``PYTHONPATH=.`` or an editable install)."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if (candidate / "ptx.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"fastmm kernel sources (cuda_src/) not found next to {here}")


@functools.lru_cache(maxsize=None)
def read_source(name: str) -> str:
    return (source_dir() / name).read_text()


@functools.lru_cache(maxsize=None)
def source_digest(name: str) -> str:
    """Hash of a kernel file and every header beside it: a change to any of them must change the
    cache key (headers are few and small, so hashing all of them is simpler than parsing
    #include lines)."""
    h = hashlib.sha256()
    h.update(name.encode() + b"\0" + read_source(name).encode())
    for header in sorted(source_dir().glob("*.cuh")):
        h.update(header.name.encode() + b"\0" + header.read_bytes())
    return h.hexdigest()


def kernel_sources() -> list[str]:
    return sorted(p.name for p in source_dir().glob("*.cu"))
