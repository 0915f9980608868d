"""torch.matmul semantics on top of the planner and the runtime.

This module owns everything about tensors: shapes and broadcasting, dtype/device rules, ``out=``
(resize, overlap), precision defaults, and the decision to hand a call to ``torch.matmul``. It
turns a call into a :class:`~fastmm.problem.Problem`, asks :mod:`fastmm.plan` for a plan, and
asks :mod:`fastmm.runtime` to run it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import warnings
from dataclasses import dataclass

import torch

from . import config
from .plan import Plan, select
from .problem import PRECISIONS, DeviceFacts, Problem
from .runtime.compiler import CompileError
from .runtime.tensor_map import TensorMapError
from .tuned import TunedChoice, bucket_of

_FLOAT32 = torch.float32


class FastmmWarning(UserWarning):
    """fastmm could not run its own kernels and used torch.matmul instead."""


# ---------------------------------------------------------------------------------------------
# precision

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
        return "tf32" if _torch_allows_tf32() else "ieee"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))} or None, got {precision!r}")
    return precision


_HALF = (torch.float16, torch.bfloat16)


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


def _torch_allows_tf32() -> bool:
    """Whether torch.matmul on CUDA may use TF32 now. Read from ``fp32_precision`` (torch >= 2.9),
    which both the old and the new precision APIs set: torch 2.13's old getters
    (``get_float32_matmul_precision``, ``allow_tf32``) raise once a program has mixed the two APIs,
    e.g. ``set_float32_matmul_precision("high")`` then ``allow_tf32 = False``."""
    matmul = torch.backends.cuda.matmul
    try:
        value = matmul.fp32_precision
    except AttributeError:  # older torch: only the old API exists
        return torch.get_float32_matmul_precision() != "highest" or matmul.allow_tf32
    if value == "none":  # inherits the generic setting
        value = getattr(torch.backends, "fp32_precision", "none")
    return value == "tf32"


@contextlib.contextmanager
def _torch_precision(precision: str | None):
    """Run torch.matmul at the precision the caller asked fastmm for (tf32x3 -> full fp32)."""
    if precision is None or _torch_allows_tf32() == (precision == "tf32"):
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


# ---------------------------------------------------------------------------------------------
# shapes

def _raise_torch_shape_error(a: torch.Tensor, b: torch.Tensor) -> None:
    """Let torch word the error on the operands themselves: which check fails first (mv, mm or
    bmm) depends on their strides, so stand-ins with other strides can get other messages
    (zero-stride views said "size mismatch" where torch says "Expected size for first two
    dimensions of batch2 tensor" for (4,) @ (2, 5, 6)). torch checks shapes before computing."""
    torch.matmul(a, b)
    raise RuntimeError(f"matmul shapes are incompatible: {tuple(a.shape)} and {tuple(b.shape)}")  # not reached


@dataclass
class Shapes:
    """A call reduced to batched 3-operand form: A (batch, M, K) @ B (batch, K, N) -> C."""

    a: torch.Tensor  # expanded to batch + (M, K)
    b: torch.Tensor  # expanded to batch + (K, N)
    batch: tuple[int, ...]
    M: int
    N: int
    K: int
    out_shape: tuple[int, ...]  # what torch.matmul returns
    squeeze_m: bool  # a was 1-D
    squeeze_n: bool  # b was 1-D

    def matrix_view(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` (shaped as torch.matmul returns) viewed as batch + (M, N): the squeezed dims
        restored, N first (for 1-D @ 1-D out is 0-d, and only that order works)."""
        c = out.unsqueeze(-1) if self.squeeze_n else out
        return c.unsqueeze(-2) if self.squeeze_m else c


def analyse(a: torch.Tensor, b: torch.Tensor) -> Shapes:
    da, db = a.dim(), b.dim()
    if da == 0 or db == 0:
        _raise_torch_shape_error(a, b)
    a2 = a.unsqueeze(0) if da == 1 else a
    b2 = b.unsqueeze(-1) if db == 1 else b
    M, K = a2.shape[-2], a2.shape[-1]
    K2, N = b2.shape[-2], b2.shape[-1]
    if K != K2:
        if da == 2 and db == 2:
            raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({M}x{K} and {K2}x{N})")
        _raise_torch_shape_error(a, b)
    try:
        batch = tuple(torch.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]))
    except RuntimeError:
        _raise_torch_shape_error(a, b)
    out_shape = batch + ((M,) if da >= 2 else ()) + ((N,) if db >= 2 else ())
    return Shapes(a2.expand(batch + (M, K)), b2.expand(batch + (K, N)), batch, M, N, K,
                  out_shape, da == 1, db == 1)


def _collapse_batch(batch, sa, sb, sc):
    """Merge batch dims into as few as possible: drop size-1 dims, fuse neighbours that are
    contiguous with each other in all three operands. Returns a list of (size, sa, sb, sc)."""
    dims = [(n, x, y, z) for n, x, y, z in zip(batch, sa, sb, sc) if n != 1]
    merged: list[tuple[int, int, int, int]] = []
    for d in dims:
        if merged:
            n0, x0, y0, z0 = merged[-1]
            n1, x1, y1, z1 = d
            if x0 == x1 * n1 and y0 == y1 * n1 and z0 == z1 * n1:
                merged[-1] = (n0 * n1, x1, y1, z1)
                continue
        merged.append(d)
    return merged


def _align(ptr: int) -> int:
    for n in (16, 8, 4):
        if ptr % n == 0:
            return n
    return 1


def _norm(size: int, stride: int) -> int:
    """A stride of a size-1 dim is meaningless; call it 1 so layouts read as contiguous."""
    return 1 if size == 1 else stride


# ---------------------------------------------------------------------------------------------
# the decision: fastmm kernel or torch

def _not_served_reason(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why fastmm's kernels cannot take these operands at all (None: they can)."""
    if config.disabled():
        return f"{config.DISABLE_ENV}=1 routes every call to torch.matmul"
    if a.device.type != "cuda" or b.device.type != "cuda":
        return f"operands are on {a.device} and {b.device}; fastmm kernels run on CUDA devices"
    if a.device != b.device:
        return f"operands are on different devices ({a.device}, {b.device})"
    if a.dtype != _FLOAT32 or b.dtype != _FLOAT32:
        return f"dtypes are {a.dtype} and {b.dtype}; fastmm kernels compute float32"
    if autocast_half_active(a.device.type):
        return "torch.autocast is on with a half dtype: autocast's rules send this matmul to torch in that dtype"
    if a.is_sparse or b.is_sparse or a.layout != torch.strided or b.layout != torch.strided:
        return "sparse or non-strided layout"
    if a.is_complex() or b.is_complex():
        return "complex dtype"
    return _runtime_reason()


_runtime_reason_cache: list[str | None] = []


def _runtime_reason() -> str | None:
    if not _runtime_reason_cache:
        from .runtime.compiler import nvrtc_unavailable_reason

        reason = nvrtc_unavailable_reason()
        if reason is None:
            try:
                from .runtime.sources import source_dir

                source_dir()
            except FileNotFoundError as exc:
                reason = str(exc)
        _runtime_reason_cache.append(reason)
    return _runtime_reason_cache[0]


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, FastmmWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------
# running a plan

#: Bound on the per-shape caches (_fast, _prepared): a workload with ever-new shapes (dynamic
#: sequence lengths) must not grow them without end; past it they are emptied and refilled.
MAX_CACHED_SHAPES = 8192
_prepared: dict[tuple, tuple] = {}  # (device, problem, forced family) -> (plan, kernel, reduce kernel)
_failed: dict[tuple, str] = {}  # (device, source, macros) -> why that kernel could not be built


def _failure_key(device_index: int, cfg) -> tuple:
    """What decides whether a kernel builds: its source and macros, not its launch geometry."""
    return (device_index, cfg.source, cfg.macros)


_prepared_guard = threading.Lock()

#: Called as ``first_use_tuner(shapes, c, problem, device_index)`` before the first plan of a
#: problem when FASTMM_TUNE=1. Set by :mod:`fastmm.tuning`, which imports this module (this
#: module does not import it: no import cycle).
first_use_tuner = None


def device_facts(index: int) -> DeviceFacts:
    from .runtime.device import device_facts as _facts

    return _facts(index)


def build_problem(s: Shapes, c: torch.Tensor, precision: str):
    """Problem for the first launch, plus (a, b, c) element offsets of every launch."""
    sa, sb, sc = s.a.stride(), s.b.stride(), c.stride()
    nb = len(s.batch)
    dims = _collapse_batch(s.batch, sa[:nb], sb[:nb], sc[:nb])
    inner = dims[-2:]  # the kernel walks two batch dims; a Python loop walks any others
    outer = dims[:-2]
    while len(inner) < 2:
        inner.insert(0, (1, 0, 0, 0))
    (n0, a0, b0, c0), (n1, a1, b1, c1) = inner
    M, N, K = s.M, s.N, s.K
    # One launch per index of the outer dims; product() of no dims yields one empty index, so a
    # call with at most two batch dims is exactly one launch at offset 0.
    offsets = [tuple(sum(i * d[j] for i, d in zip(idx, outer)) for j in (1, 2, 3))
               for idx in itertools.product(*(range(d[0]) for d in outer))]
    pa, pb, pc = s.a.data_ptr(), s.b.data_ptr(), c.data_ptr()
    # (an outer dim of size 0 leaves no launch at all; explain still describes the problem)
    aligns = [min((_align(p + 4 * o[i]) for o in offsets), default=_align(p)) for i, p in enumerate((pa, pb, pc))]
    problem = Problem(
        M, N, K,
        (_norm(M, sa[-2]), _norm(K, sa[-1])), (_norm(K, sb[-2]), _norm(N, sb[-1])), (_norm(M, sc[-2]), _norm(N, sc[-1])),
        n1, n0 * n1, (a0, a1), (b0, b1), (c0, c1), aligns[0], aligns[1], aligns[2], precision)
    return problem, offsets


def tuned_choice(problem: Problem, dev: DeviceFacts) -> TunedChoice | None:
    """The tuned choice stored for the problem's shape bucket on this device, if any. Never
    raises: where the store cannot be read the heuristics choose (with one warning)."""
    if dev.simulated:
        return None
    from .runtime.tuning_store import store_for

    try:
        record = store_for(dev.index).get(bucket_of(problem))
    except Exception as exc:  # the driver or NVRTC cannot say what the device key is
        _warn_once(f"fastmm: tuned choices are not available ({type(exc).__name__}: {exc}); the heuristics choose")
        return None
    return TunedChoice.from_record(record) if record is not None else None


def plan_for(problem: Problem, device_index: int, force: str | None = None) -> Plan:
    forced = force or config.forced_kernel()
    dev = device_facts(device_index)
    plan = select(problem, dev, forced, None if forced else tuned_choice(problem, dev))
    failed = _failed.get(_failure_key(device_index, plan.kernel)) if plan.kernel is not None else None
    if failed is not None:  # this kernel failed to build earlier in this process
        plan = dataclasses.replace(plan, kernel=None, reduce=None, fallback=failed)
    return plan


def _run(s: Shapes, c: torch.Tensor, precision: str, force: str | None) -> Plan:
    """Launch the planned kernel(s) writing C = A @ B into ``c`` (shape batch + (M, N))."""
    from .runtime import launcher

    dev_index = c.device.index if c.device.index is not None else torch.cuda.current_device()
    problem, offsets = build_problem(s, c, precision)
    key = (dev_index, problem, force or config.forced_kernel())
    hit = _prepared.get(key)
    if hit is None:
        if first_use_tuner is not None and key[2] is None and config.tune_on_first_use():
            first_use_tuner(s, c, problem, dev_index)
        plan = plan_for(problem, dev_index, force)
        if plan.kernel is None:
            return plan
        needed = [k for k in (plan.kernel, plan.reduce, *plan.stagers) if k is not None]
        if torch.cuda.is_current_stream_capturing() and not all(launcher.is_loaded(plan.device, k) for k in needed):
            raise RuntimeError(
                f"fastmm: kernel {plan.kernel.family} for this shape is not loaded yet, and compiling or loading it "
                "would break the CUDA graph being captured. Run the same call once before capturing, or call "
                "fastmm.warmup(a, b) first.")
        try:
            loaded = launcher.load(plan.device, plan.kernel)
            reduce = launcher.load(plan.device, plan.reduce) if plan.reduce is not None else None
            for stager in plan.stagers:  # loaded now; looked up again (a dict hit) at each launch
                launcher.load(plan.device, stager)
        except CompileError as exc:
            # A kernel NVRTC rejects must not take the model down: remember it, warn once, and
            # let torch.matmul serve this problem (explain reports the same reason).
            reason = f"kernel {plan.kernel.family} failed to compile ({str(exc).splitlines()[0]})"
            _failed[_failure_key(plan.device.index, plan.kernel)] = reason
            _warn_once(f"fastmm: {reason}; torch.matmul serves these calls instead")
            plan = dataclasses.replace(plan, kernel=None, reduce=None, fallback=reason)
            loaded = reduce = None
        with _prepared_guard:
            if len(_prepared) >= MAX_CACHED_SHAPES:
                _prepared.clear()
            _prepared[key] = hit = (plan, loaded, reduce)
    plan, loaded, reduce = hit
    if plan.kernel is None:
        return plan
    if s.K == 0:
        c.zero_()
        return plan
    with _on_device(dev_index):
        try:
            _launch_plan(plan, loaded, reduce, s, c, problem, offsets, dev_index)
        except TensorMapError as exc:
            # The driver refused a tensor map the planner thought valid: torch.matmul computes
            # this call (all of C again) and every later one of this problem.
            reason = f"kernel {plan.kernel.family} could not describe an operand to the copy engine ({exc})"
            _warn_once(f"fastmm: {reason}; torch.matmul serves this problem instead")
            plan = dataclasses.replace(plan, kernel=None, reduce=None, fallback=reason)
            with _prepared_guard:
                _prepared[key] = (plan, None, None)
    return plan


def _launch_plan(plan, loaded, reduce, s: Shapes, c: torch.Tensor, problem: Problem, offsets, dev_index: int) -> None:
    """Stage operands if the plan says so, then queue the kernel(s) on the current stream."""
    from .runtime import launcher, runners

    stream = _current_stream(dev_index)
    p = plan.launch_problem or problem
    if plan.kernel.family == "wgmma_tf32":
        _launch_wgmma(plan, loaded, stream, s, c, p, offsets)
        return
    pa, pb, pc = s.a.data_ptr(), s.b.data_ptr(), c.data_ptr()
    staged = []  # every staging buffer stays referenced until its kernel is queued
    for which, rows, cols in plan.staging:
        # Zero-padded aligned copy of an operand that 16-byte loads could not read in place. The
        # buffers may be freed on return: PyTorch's allocator is stream-ordered, so they are not
        # handed out again before the kernel queued below has run. (Dropping the first buffer
        # before the second is allocated let the second reuse its memory: caught by memcheck.)
        src = s.a.reshape(s.M, s.K) if which == "a" else s.b.reshape(s.K, s.N)
        buf = torch.empty(rows, cols, dtype=_FLOAT32, device=c.device)
        staged.append(buf)
        buf[:, src.shape[1]:].zero_()
        buf[:, :src.shape[1]].copy_(src)
        if which == "a":
            pa = buf.data_ptr()
        else:
            pb = buf.data_ptr()
    run = runners.plan_runner(loaded, reduce, plan.kernel, p, c.device)
    if run is not None:  # split-K or stream-K: the GEMM, then its fixed-order second pass (or fused)
        run(pa, pb, pc, stream)
        return
    tail = runners.gemm_args(p)
    for oa, ob, oc in offsets:
        launcher.launch(loaded, stream, (pa + 4 * oa, pb + 4 * ob, pc + 4 * oc) + tail)


def _launch_wgmma(plan, loaded, stream: int, s: Shapes, c: torch.Tensor, p: Problem, offsets) -> None:
    """The wgmma family: one call of its runner (runtime/runners.py) per launch offset."""
    from .runtime import runners

    run = runners.wgmma_runner(plan, loaded, p, c.device)
    pa, pb, pc = s.a.data_ptr(), s.b.data_ptr(), c.data_ptr()
    for oa, ob, oc in offsets:
        run(pa + 4 * oa, pb + 4 * ob, pc + 4 * oc, stream)


def _overlaps(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Conservative: any shared storage counts (exact interval tests miss strided interleaving)."""
    if x.numel() == 0 or y.numel() == 0:
        return False
    return x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def _has_internal_overlap(t: torch.Tensor) -> bool:
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))


def _resize_out(out: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(out.shape) == shape:
        return
    if out.numel() != 0:
        warnings.warn(
            f"An output with one or more elements was resized since it had shape {list(out.shape)}, which does not "
            f"match the required output shape {list(shape)}. This behavior is deprecated, and in a future PyTorch "
            "release outputs will not be resized unless they have zero elements. You can explicitly reuse an out "
            "tensor t by resizing it, inplace, to zero elements with t.resize_(0).", UserWarning, stacklevel=4)
    out.resize_(shape)


def matmul_fastmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, precision: str,
                  force: str | None = None) -> tuple[torch.Tensor, Plan | None, str | None]:
    """Compute with fastmm kernels where possible. Returns (result, plan, fallback reason)."""
    s = analyse(a, b)
    reason = _not_served_reason(a, b)
    if reason is None and out is not None and (out.dtype != _FLOAT32 or out.device != a.device):
        reason = "out has another dtype or device"  # torch raises its own error below
    if reason is None and out is not None and _has_internal_overlap(out):
        reason = "out has internally overlapping memory"  # torch raises its own error below
    if reason is not None:
        if reason == _runtime_reason() and a.is_cuda:
            _warn_once(f"fastmm: {reason}; torch.matmul serves every call")
        return _fallback(a, b, out, precision, reason), None, reason

    if out is not None:
        _resize_out(out, s.out_shape)
    target_out = out
    direct = out is not None and not (_overlaps(out, a) or _overlaps(out, b))
    if direct:
        c = s.matrix_view(out)
    else:
        c = torch.empty(s.batch + (s.M, s.N), dtype=_FLOAT32, device=a.device)
    if c.numel() != 0:
        plan = _run(s, c, precision, force)
        if plan.kernel is None:
            return _fallback(a, b, out, precision, plan.fallback), plan, plan.fallback
    else:
        plan = None
    result = c.view(s.out_shape) if not direct else out
    if target_out is not None and not direct:
        target_out.copy_(result)  # out overlapped an input: computed aside, then copied
        result = target_out
    return result, plan, None


def _torch_matmul(a, b, out):
    return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)


def _fallback(a, b, out, precision, reason):
    with _torch_precision(precision if a.is_cuda else None):
        if out is None:
            return _torch_matmul(a, b, None)
        if (out.dtype == a.dtype == b.dtype and out.device == a.device == b.device
                and (_overlaps(out, a) or _overlaps(out, b))):
            # torch.matmul(a, b, out=a) reads what it has already overwritten (silently wrong):
            # compute aside, then apply torch's out= rules and copy
            result = torch.matmul(a, b)
            _resize_out(out, tuple(result.shape))
            return out.copy_(result)
        return _torch_matmul(a, b, out)


def matmul(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None,
           precision: str | None = None) -> torch.Tensor:
    """``torch.matmul(a, b, out=out)`` on fastmm's kernels.

    ``precision``: ``None`` follows ``torch.get_float32_matmul_precision()``; ``"ieee"`` full fp32;
    ``"tf32"`` tensor cores with inputs rounded to TF32; ``"tf32x3"`` tensor cores with fp32-level
    accuracy. Inputs fastmm's kernels cannot serve (CPU tensors, other dtypes, no NVRTC, ...) go to
    ``torch.matmul``; :func:`explain` says which and why.
    """
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or (
            out is not None and not isinstance(out, torch.Tensor)):
        return _torch_matmul(a, b, out)  # torch words the type error
    precision = resolve_precision(precision)
    if autocast_half_active(a.device.type):  # autocast decides the dtype; fastmm is float32 only
        return _torch_matmul(a, b, out)
    needs_grad = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    if needs_grad:
        if out is not None:  # torch refuses this itself, with its own message
            return _torch_matmul(a, b, out)
        from .ops import matmul_autograd

        return matmul_autograd(a, b, precision)
    if torch.compiler.is_compiling():
        # Let torch.compile see one opaque custom op (shapes from its fake) instead of tracing
        # into the launch path, which reads data pointers that fake tensors do not have.
        if out is None:
            return torch.ops.fastmm.matmul(a, b, precision)
        _resize_out(out, analyse(a, b).out_shape)
        torch.ops.fastmm.matmul_out(a, b, precision, out)
        return out
    key = _fast_key(a, b, out, precision)
    entry = _fast.get(key)
    if entry and (out is None or not _ranges_overlap(entry, a, b, out)):
        try:
            return _launch_fast(entry, a, b, out)
        except TensorMapError:  # (not expected: the first call encoded the same geometry)
            _fast[key] = ()  # the full path decides, and falls back to torch if it must
            entry = ()
    out_shape = None if out is None else tuple(out.shape)
    result, plan, reason = matmul_fastmm(a, b, out, precision)
    # (an out that was resized no longer matches the key, which holds its old shape: the next
    # call with an out of that old shape must be resized again, so it is not remembered)
    if plan is not None and reason is None and entry is None and (out is None or tuple(out.shape) == out_shape):
        _remember_fast(key, a, b, out, precision)
    return result


# ---------------------------------------------------------------------------------------------
# the steady-state path: one dict lookup, (an allocation,) one launch (split-K, stream-K: two)

#: _fast_key(...) -> () for a key that never takes this path, else the plain tuple
#: (view_shape, out_shape, loaded, tail, device, index, extents, runner) (a NamedTuple unpacks
#: ~35 ns slower): the loaded kernel and its arguments after the (a, b, c) pointers; the device
#: and its index; extents, the bytes of (a, b, out) or None, at [6] (read by _ranges_overlap);
#: runner None (one plain launch), or runner(pa, pb, pc, stream) queues a plan that takes more
#: than that: split-K or stream-K (the GEMM, then its second pass) or wgmma (tensor maps).
_fast: dict[tuple, tuple] = {}


def forget_plans() -> None:
    """Drop every cached plan and fast-path entry, so the next call of each shape plans again (a
    tuned choice was stored). Loaded kernels stay loaded."""
    with _prepared_guard:
        _prepared.clear()
    _fast.clear()


def _fast_key(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, precision: str) -> tuple:
    """Everything the plan depends on, read cheaply: shapes, strides, dtypes, devices, pointer
    alignment, precision and the environment switches."""
    key = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device, b.device,
           a.data_ptr() & 15, b.data_ptr() & 15, precision, config.disabled(), config.forced_kernel())
    if out is not None:
        key += (out.shape, out.stride(), out.dtype, out.device, out.data_ptr() & 15)
    return key


def _on_device(index: int):
    """The device whose kernels we launch must be the current one: a loaded kernel is launched in
    the current context (a tensor on cuda:1 with cuda:0 current ran the cuda:0 module on cuda:1's
    pointers: illegal address). A no-op context in the common case."""
    return contextlib.nullcontext() if torch.cuda.current_device() == index else torch.cuda.device(index)


def _current_stream(index: int) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(index)
    return torch.cuda.current_stream(index).cuda_stream


def _extent(t: torch.Tensor) -> int:
    """Bytes from t's first element to just past its last (non-negative strides)."""
    return 4 * (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) if t.numel() else 0


def _ranges_overlap(entry: tuple, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    ea, eb, eo = entry[6]
    o = out.data_ptr()
    return (o < a.data_ptr() + ea and a.data_ptr() < o + eo) or (o < b.data_ptr() + eb and b.data_ptr() < o + eo)


def _remember_fast(key: tuple, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, precision: str) -> None:
    """After a first call has planned and loaded the kernel: keep what the next identical call
    needs. Only for one launch offset (split-K and stream-K plans: the GEMM and its second pass;
    wgmma: its copies and the GEMM), no operands staged by torch (the SIMT and mma.sync families'
    padded copies), K > 0, and an ``out`` (if any) that already had the right shape and is
    written directly."""
    s = analyse(a, b)
    if s.K == 0 or any(n == 0 for n in s.batch + (s.M, s.N)):
        return
    view_shape = s.batch + (s.M, s.N)
    if out is None:
        c = torch.empty(view_shape, device="meta")  # what matmul allocates: contiguous, aligned
    else:
        if tuple(out.shape) != s.out_shape or _overlaps(out, a) or _overlaps(out, b):
            return
        c = s.matrix_view(out)
    problem, offsets = build_problem(s, c, precision)
    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    hit = _prepared.get((index, problem, config.forced_kernel()))
    if hit is None:
        return
    plan, loaded, reduce = hit
    if len(offsets) != 1 or plan.kernel is None or (plan.staging and plan.kernel.family != "wgmma_tf32"):
        # Never fast for this key (these depend on the problem only): remember that too, so the
        # next call does not analyse the problem a third time just to find out again.
        if len(_fast) >= MAX_CACHED_SHAPES:
            _fast.clear()
        _fast[key] = ()
        return
    from .runtime import runners

    p = plan.launch_problem or problem  # (as _launch_plan; None without staging or swap)
    runner = None
    if plan.kernel.family == "wgmma_tf32":
        tail, runner = (), runners.wgmma_runner(plan, loaded, p, a.device)
    else:  # the same runner as _launch_plan's, or one plain launch
        runner = runners.plan_runner(loaded, reduce, plan.kernel, p, a.device)
        tail = runners.gemm_args(p) if runner is None else ()
    extents = (_extent(a), _extent(b), _extent(out)) if out is not None else None
    if len(_fast) >= MAX_CACHED_SHAPES:
        _fast.clear()
    _fast[key] = (view_shape, s.out_shape, loaded, tail, a.device, index, extents, runner)


def _launch_fast(entry: tuple, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    from .runtime.launcher import launch

    view_shape, out_shape, loaded, tail, device, index, _, runner = entry
    c = torch.empty(view_shape, dtype=_FLOAT32, device=device) if out is None else out
    with _on_device(index):
        if runner is None:
            launch(loaded, _current_stream(index), (a.data_ptr(), b.data_ptr(), c.data_ptr()) + tail)
        else:
            runner(a.data_ptr(), b.data_ptr(), c.data_ptr(), _current_stream(index))
    if out is not None:
        return out
    return c if view_shape == out_shape else c.view(out_shape)
