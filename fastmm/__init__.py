"""fastmm: float32 matrix multiply for PyTorch on fastmm's own CUDA kernels, compiled at run time
with NVRTC, chosen by a dispatcher that can explain itself.

    fastmm.matmul(a, b, out=None, precision=None)   # torch.matmul semantics
    fastmm.explain(a, b, precision=None)            # what would run, and why
    fastmm.tune(a, b, precision=None)               # time the candidate kernels, store the fastest
    fastmm.linear(x, w, bias), fastmm.addmm(c, a, b, beta=1, alpha=1)   # F.linear, torch.addmm
    torch.ops.fastmm.matmul(a, b, precision=None)   # the custom ops (torch.compile; also linear, addmm)
    fastmm.coverage(model, *inputs)                 # which matmuls of a step ran on fastmm, and why
    fastmm.nn.Linear, fastmm.patch(model), fastmm.unpatch(model)   # nn.Linear on fastmm
    with fastmm.use_fastmm(): ...                   # route matmul / @ / mm / bmm / F.linear
"""
from ._version import __version__
from .api import matmul
from .errors import FastmmWarning
from .precision import resolve_precision
from .explain import Explanation, explain
from .problem import PRECISIONS
from . import ops  # noqa: F401  (registers torch.ops.fastmm.*)
from . import nn  # noqa: F401  (fastmm.nn.Linear)
from .patching import FastmmMode, patch, register, register_linear_like, unpatch, use_fastmm
from .coverage import CoverageReport, coverage
from .ops import addmm, linear
from .tuning import TuneResult, tune

__all__ = ["__version__", "matmul", "explain", "Explanation", "FastmmWarning", "PRECISIONS", "resolve_precision", "warmup",
           "tune", "TuneResult",
           "nn", "ops", "patch", "unpatch", "register", "register_linear_like", "use_fastmm", "FastmmMode",
           "coverage", "CoverageReport", "linear", "addmm"]


def warmup(a, b, *, precision=None, out=None):
    """Compile and load the kernel ``matmul(a, b)`` needs (e.g. before CUDA graph capture)."""
    import torch

    with torch.no_grad():
        matmul(a, b, precision=precision, out=out)
    return explain(a, b, precision=precision, out=out)
