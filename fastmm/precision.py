"""Precision rules, as PyTorch has them: what ``precision=None`` means, when autocast owns a
matmul, and how to run torch.matmul at the precision a caller asked fastmm for."""
from __future__ import annotations

import contextlib

import torch

from .problem import PRECISIONS


def resolve_precision(precision: str | None) -> str:
    """``None`` follows PyTorch's float32 matmul setting ("highest" -> ieee, else tf32).

    Inside ``torch.compile`` dynamo cannot trace ``torch.get_float32_matmul_precision()`` (it
    returns a str), so there ``None`` reads the cuBLAS TF32 flag instead: the same setting
    (``set_float32_matmul_precision("high")`` sets it, "highest" clears it), folded to a constant
    and guarded by dynamo, so changing the setting recompiles.
    """
    if precision is None:
        if torch.compiler.is_compiling():
            return "tf32" if torch._C._get_cublas_allow_tf32() else "ieee"
        return "tf32" if torch_allows_tf32() else "ieee"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))} or None, got {precision!r}")
    return precision


def resolve_precision_eager(precision: str | None) -> str:
    """:func:`resolve_precision` for a caller that knows it is not being traced by torch.compile
    (one test of that less a call)."""
    if precision is None:
        return "tf32" if torch_allows_tf32() else "ieee"
    if precision not in PRECISIONS:
        return resolve_precision(precision)  # (its error)
    return precision


_HALF = (torch.float16, torch.bfloat16)
#: torch's C test of "is autocast on for any device type", where this torch has it (~0.14 us)
_any_autocast_enabled = getattr(torch._C, "_is_any_autocast_enabled", None)


def autocast_half_active_on(t: torch.Tensor) -> bool:
    """:func:`autocast_half_active` for ``t``'s device type, without reading ``t.device`` (a device
    object, ~0.3 us on every call) when autocast is off for every device type. Not under
    torch.compile: dynamo folds that C test to its value when tracing without guarding on it,
    so a graph traced outside autocast would skip the check inside it."""
    if _any_autocast_enabled is not None and not torch.compiler.is_compiling() and not _any_autocast_enabled():
        return False
    return autocast_half_active(t.device.type)


def autocast_any_half_active(t: torch.Tensor) -> bool:
    """:func:`autocast_half_active_on` for a caller that knows it is not being traced by
    torch.compile (one test of that less a call)."""
    if _any_autocast_enabled is not None and not _any_autocast_enabled():
        return False
    return autocast_half_active(t.device.type)


def autocast_half_active(device_type: str) -> bool:
    """Is ``torch.autocast`` on with a half dtype for ``device_type``? Then matmuls belong to
    torch (autocast casts them to that dtype; fastmm computes float32 only)."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return False
        dtype = torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know (meta, ...)
        return False
    except (TypeError, AttributeError):  # torch < 2.4: no device argument
        if device_type == "cuda":
            enabled, get = torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype
        elif device_type == "cpu":
            enabled, get = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype
        else:
            return False
        if not enabled:
            return False
        dtype = get()
    return dtype in _HALF


#: torch's C getter behind ``torch.backends.cuda.matmul.fp32_precision`` (torch >= 2.9), called
#: directly: the property resolves through a chain of string compares (~3 us, every call that
#: follows torch's setting pays it) where the getter costs ~0.2 us.
_fp32_precision_of = getattr(torch._C, "_get_fp32_precision_getter", None)


def torch_allows_tf32() -> bool:
    """Whether torch.matmul on CUDA may use TF32 now. Read from ``fp32_precision`` (torch >= 2.9),
    which both the old and the new precision APIs set: torch 2.13's old getters
    (``get_float32_matmul_precision``, ``allow_tf32``) raise once a program has mixed the two APIs,
    e.g. ``set_float32_matmul_precision("high")`` then ``allow_tf32 = False``."""
    if _fp32_precision_of is not None:
        value = _fp32_precision_of("cuda", "matmul")
        if value == "none":  # inherits the generic setting
            value = _fp32_precision_of("generic", "all")
        return value == "tf32"
    matmul = torch.backends.cuda.matmul  # older torch: only the old API exists
    return torch.get_float32_matmul_precision() != "highest" or matmul.allow_tf32


@contextlib.contextmanager
def torch_precision(precision: str | None):
    """Run torch.matmul at the precision the caller asked fastmm for (tf32x3 -> full fp32)."""
    if precision is None or torch_allows_tf32() == (precision == "tf32"):
        yield  # already so: leave torch's global setting alone (toggling it can leave it mixed)
        return
    try:
        old_setting = torch.get_float32_matmul_precision()
    except RuntimeError:  # torch 2.13 after a program mixed its precision APIs
        old_setting = None
    if old_setting is not None:
        # set and restore through one API: restoring allow_tf32 alone turned "medium" into the
        # mixed state in which get_float32_matmul_precision() raises
        torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(old_setting)
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
