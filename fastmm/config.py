"""Every environment variable fastmm reads, read in one place.

Values are read when asked for (not at import), so tests and users can change them at run time.
"""
from __future__ import annotations

import os
from pathlib import Path

#: Folder of the on-disk kernel cache (default: ``$XDG_CACHE_HOME/fastmm`` or ``~/.cache/fastmm``).
CACHE_DIR_ENV = "FASTMM_CACHE_DIR"
#: ``1`` routes every call to ``torch.matmul`` (an escape hatch; ``explain`` says so).
DISABLE_ENV = "FASTMM_DISABLE"
#: Force one kernel family (a name of ``fastmm.families.FAMILIES``: ``skinny``, ``wgmma_tf32``,
#: ``tf32_mma``, ``simt_cp_async``, ``simt_float4``, ``scalar``) where it can run; for debugging
#: and benchmarks.
FORCE_KERNEL_ENV = "FASTMM_KERNEL"
#: ``1``: the first call of a shape bucket that has no tuned choice yet times the candidate
#: kernels (as ``fastmm.tune`` does) and stores the fastest, then proceeds.
TUNE_ENV = "FASTMM_TUNE"


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def disabled() -> bool:
    return _flag(DISABLE_ENV)


def forced_kernel() -> str | None:
    value = os.environ.get(FORCE_KERNEL_ENV, "").strip()
    return value or None


def tune_on_first_use() -> bool:
    return _flag(TUNE_ENV)


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_DIR_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base).expanduser() if base else Path.home() / ".cache") / "fastmm"


def tuning_dir() -> Path:
    """Where tuned choices are stored: one JSON file per device key, next to the kernel cache."""
    return cache_dir() / "tuning"
