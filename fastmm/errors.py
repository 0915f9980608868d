"""What fastmm says when it cannot do what was asked: the warning category, warned once per text."""
from __future__ import annotations

import warnings


class FastmmWarning(UserWarning):
    """fastmm could not run its own kernels and used torch.matmul instead."""


_warned: set[str] = set()


def warn_once(message: str, stacklevel: int = 3) -> None:
    """Warn with ``message`` the first time it comes up in this process: a fallback that repeats
    on every call of a training loop must not flood the log."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, FastmmWarning, stacklevel=stacklevel)
