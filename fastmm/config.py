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
#: Force one kernel family (a name of ``fastmm.families.FAMILIES``: ``wgmma_tf32``, ``tf32_mma``,
#: ``kmajor_mma``, ``simt_cp_async``, ``simt_float4``, ``skinny``, ``skinny_kmajor``, ``scalar``)
#: where it can run; elsewhere the planner chooses (fastmm.dispatch.plan_for). For debugging and
#: benchmarks.
FORCE_KERNEL_ENV = "FASTMM_KERNEL"
#: ``1``: the first call of a shape bucket that has no tuned choice yet times the candidate
#: kernels (as ``fastmm.tune`` does) and stores the fastest, then proceeds.
TUNE_ENV = "FASTMM_TUNE"
#: ``0`` turns off programmatic dependent launch on sm_90+ (fastmm/runtime/launcher.py): kernels
#: are then launched plainly, each scheduled only after the kernel ahead on the stream ended.
#: Read when a plan is prepared (set it before the first call).
PDL_ENV = "FASTMM_PDL"
#: ``1``: trust a kernel cache folder (and its ``tuning/`` folder) that is shared: writable by
#: group or others, or owned by another user. By default fastmm loads nothing from such a folder
#: (fastmm/runtime/cache.py: the cubins it holds run in this process). With it set, entries and
#: tuning files are also written readable by all (0o644), so the other users can load them.
CACHE_TRUST_SHARED_ENV = "FASTMM_CACHE_TRUST_SHARED"


def _reader(name: str):
    """A function returning ``os.environ.get(name)``, made cheap for the two switches read on
    every matmul call. ``os.environ`` keeps its values in a dict keyed by the encoded name and
    encodes the key on every ``get`` (0.6 us a read, about a tenth of fastmm's host time per
    call at 64^3); the key is encoded once here and the dict read directly, which sees every
    change made through ``os.environ`` (the dict is what it updates). Where that internal dict is
    not there, the public ``get`` is used."""
    data, encodekey, decodevalue = (getattr(os.environ, attr, None) for attr in ("_data", "encodekey", "decodevalue"))
    if not isinstance(data, dict) or encodekey is None or decodevalue is None:
        return lambda: os.environ.get(name)
    key = encodekey(name)
    environ = os.environ

    def read():
        if os.environ is not environ:  # replaced wholesale (e.g. mock.patch.object(os, "environ", ...))
            return os.environ.get(name)
        raw = data.get(key)
        return None if raw is None else decodevalue(raw)

    return read


_read_disable = _reader(DISABLE_ENV)
_read_force = _reader(FORCE_KERNEL_ENV)


def _switches_reader():
    """:func:`switches`: both variables in one function, as ``os.environ`` stores them (encoded
    bytes, not decoded: a key only needs values that differ when the variables do), with the
    public ``get`` where ``os.environ`` has no internal dict or has been replaced wholesale."""
    data, encodekey = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or encodekey is None:
        return lambda: (os.environ.get(DISABLE_ENV), os.environ.get(FORCE_KERNEL_ENV))
    k_disable, k_force = encodekey(DISABLE_ENV), encodekey(FORCE_KERNEL_ENV)
    environ = os.environ

    def read():
        if os.environ is not environ:
            return "replaced", os.environ.get(DISABLE_ENV), os.environ.get(FORCE_KERNEL_ENV)
        return data.get(k_disable), data.get(k_force)

    return read


def _is_on(value: str | None) -> bool:
    return value is not None and value.strip().lower() in {"1", "true", "yes", "on"}


def _flag(name: str) -> bool:
    return _is_on(os.environ.get(name))


def disabled() -> bool:
    return _is_on(_read_disable())


def forced_kernel() -> str | None:
    value = _read_force()
    return (value.strip() or None) if value is not None else None


#: ``switches()``: (FASTMM_DISABLE, FASTMM_KERNEL) as they are set now, unparsed: part of the key of
#: every remembered call (fastmm.fast_path), which must change whenever either does. Read per
#: product, so read raw (one call, no decoding: ~0.5 us less a product than two decoded reads):
#: values that parse alike ("1" and "true") give keys that differ, which costs a second entry,
#: never a wrong one.
switches = _switches_reader()


def tune_on_first_use() -> bool:
    return _flag(TUNE_ENV)


def dependent_launch_enabled() -> bool:
    value = os.environ.get(PDL_ENV)
    return value is None or value.strip().lower() not in {"0", "false", "no", "off"}


def cache_trust_shared() -> bool:
    """Whether the user vouches for a shared cache folder (``FASTMM_CACHE_TRUST_SHARED=1``)."""
    return _flag(CACHE_TRUST_SHARED_ENV)


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_DIR_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base).expanduser() if base else Path.home() / ".cache") / "fastmm"


def tuning_dir() -> Path:
    """Where tuned choices are stored: one JSON file per device key, next to the kernel cache."""
    return cache_dir() / "tuning"
