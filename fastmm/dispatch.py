"""The full path of one call: fastmm's kernels or torch, the plan, loading, launching.

``matmul_fastmm`` takes operands already checked for torch's type rules, decides whether fastmm
can serve them at all (:func:`not_served_reason`), turns them into a problem
(:mod:`fastmm.shapes`), plans it (:mod:`fastmm.plan`), loads the kernels once per problem and
queues them (:mod:`fastmm.runtime`). What it cannot serve goes to ``torch.matmul``, at the
precision asked for. The steady-state path (:mod:`fastmm.fast_path`) replays what this path
prepared.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from dataclasses import dataclass

import torch

from . import config
from .errors import warn_once
from .families import Family, KernelConfig
from .plan import FamilyCannotRun, Plan, select
from .precision import autocast_half_active, torch_precision
from .problem import EPILOGUE_NONE, DeviceFacts, Problem, epilogue_form
from .runtime import launcher, runners
from .runtime.launcher import LaunchError
from .runtime.compiler import CompileError, nvrtc_unavailable_reason
from .runtime.device import device_facts as _device_facts
from .runtime.sources import source_dir
from .runtime.tensor_map import TensorMapError
from .runtime.tuning_store import store_for
from .shapes import (FLOAT32, PLAIN_TYPES, Shapes, analyse, build_problem, has_internal_overlap, overlaps, resize_out,
                     result_matrix)
from .tuned import TunedChoice, bucket_of

# ---------------------------------------------------------------------------------------------
# the decision: fastmm kernel or torch


#: Whether a torch.func transform (vmap, grad, vjp, jvp, jacrev, ...) is active (torch's C test)
transform_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def not_served_reason(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why fastmm's kernels cannot take these operands at all (None: they can)."""
    if config.disabled():
        return f"{config.DISABLE_ENV}=1 routes every call to torch.matmul"
    if transform_active():
        return ("a torch.func transform (vmap, grad, jvp, jacrev, ...) is active: its tensors have no data pointer "
                "for fastmm's kernels, and torch's ops carry its rules")
    if a.device.type != "cuda" or b.device.type != "cuda":
        return f"operands are on {a.device} and {b.device}; fastmm kernels run on CUDA devices"
    if a.device != b.device:
        return f"operands are on different devices ({a.device}, {b.device})"
    if a.dtype != FLOAT32 or b.dtype != FLOAT32:
        return f"dtypes are {a.dtype} and {b.dtype}; fastmm kernels compute float32"
    if autocast_half_active(a.device.type):
        return "torch.autocast is on with a half dtype: autocast's rules send this matmul to torch in that dtype"
    if a.is_sparse or b.is_sparse or a.layout != torch.strided or b.layout != torch.strided:
        return "sparse or non-strided layout"
    if a.is_nested or b.is_nested:
        return "nested tensor: its rows are ragged, torch.matmul takes it"
    if a.is_complex() or b.is_complex():
        return "complex dtype"
    return runtime_reason()


@functools.lru_cache(maxsize=None)
def runtime_reason() -> str | None:
    """Why no kernel can be built in this process (no NVRTC, no kernel sources), or None. Asked
    once: neither changes while the process runs."""
    reason = nvrtc_unavailable_reason()
    if reason is None:
        try:
            source_dir()
        except FileNotFoundError as exc:
            reason = str(exc)
    return reason


# ---------------------------------------------------------------------------------------------
# plans, and the kernels loaded for them

#: Bound on the per-shape caches (here and in fast_path): a workload with ever-new shapes
#: (dynamic sequence lengths) must not grow them without end; past it they are emptied and refilled.
MAX_CACHED_SHAPES = 8192


@dataclass(frozen=True, slots=True)
class Prepared:
    """A problem's plan with its kernels loaded: what every later call of the problem launches."""

    plan: Plan
    kernel: object = None  # launcher.LoadedKernel of plan.kernel
    second: object = None  # of plan.reduce (split-K's reduce, stream-K's fixup)


class PlanCache:
    """Prepared plans per (device, problem, forced family, variants), and the kernels that failed
    to build (per device, source and macros: whatever their launch geometry, they fail again).
    One lock: two threads that meet a new problem at once both plan it, one entry is kept."""

    def __init__(self):
        self.prepared: dict[tuple, Prepared] = {}
        self.failed: dict[tuple, str] = {}
        self.lock = threading.Lock()

    @staticmethod
    def failure_key(device_index: int, cfg: KernelConfig) -> tuple:
        return (device_index, cfg.source, cfg.macros)

    @staticmethod
    def launch_failure_key(device_index: int, cfg: KernelConfig) -> tuple:
        """A launch the driver refused: the same kernel may launch with another geometry."""
        return (device_index, cfg.source, cfg.macros, cfg.block_dims, cfg.grid, cfg.smem)

    def failure(self, device_index: int, cfg: KernelConfig) -> str | None:
        return self.failed.get(self.failure_key(device_index, cfg)) or \
            self.failed.get(self.launch_failure_key(device_index, cfg))

    def put(self, key: tuple, entry: Prepared) -> Prepared:
        with self.lock:
            if len(self.prepared) >= MAX_CACHED_SHAPES:
                self.prepared.clear()
            self.prepared[key] = entry
        return entry

    def clear(self) -> None:
        with self.lock:
            self.prepared.clear()


PLANS = PlanCache()

#: Called as ``first_use_tuner(shapes, c, problem, device_index)`` before the first plan of a
#: problem when FASTMM_TUNE=1. Set by :mod:`fastmm.tuning`, which imports this module (this
#: module does not import it: no import cycle).
first_use_tuner = None


def device_facts(index: int) -> DeviceFacts:
    return _device_facts(index)


def tuned_choice(problem: Problem, dev: DeviceFacts) -> TunedChoice | None:
    """The tuned choice stored for the problem's shape bucket on this device, if any. Never
    raises: where the store cannot be read the heuristics choose (with one warning)."""
    if dev.simulated:
        return None
    try:
        record = store_for(dev.index).get(bucket_of(problem))
    except Exception as exc:  # the driver or NVRTC cannot say what the device key is
        warn_once(f"fastmm: tuned choices are not available ({type(exc).__name__}: {exc}); the heuristics choose")
        return None
    return TunedChoice.from_record(record) if record is not None else None


def plan_for(problem: Problem, device_index: int, force: str | None = None,
             variants: tuple[Family, ...] = ()) -> Plan:
    forced = force or config.forced_kernel()
    dev = device_facts(device_index)
    tuned = None if forced or variants else tuned_choice(problem, dev)
    try:
        plan = select(problem, dev, forced, tuned, variants)
    except FamilyCannotRun:
        # FASTMM_KERNEL forces its family where that family can run the problem (a name no
        # family has still raises): elsewhere the planner chooses, and explain says why
        if force:
            raise
        plan = select(problem, dev, None, None if variants else tuned_choice(problem, dev), variants)
        plan = dataclasses.replace(plan, rejected=tuple(
            (name, f"{reason} (FASTMM_KERNEL={forced} is set; the planner chose here)" if name == forced else reason)
            for name, reason in plan.rejected))
    failed = None
    if plan.kernel is not None:  # (a second pass or stager that failed counts for the plans that need it)
        failed = next(filter(None, (PLANS.failure(device_index, k) for k in plan.kernels())), None)
    if failed is not None:  # this kernel (or a copy it needs) failed to build earlier in this process
        plan = dataclasses.replace(plan, kernel=None, reduce=None, head=None, fallback=failed)
    return plan


def _prepare(key: tuple, s: Shapes, c: torch.Tensor, problem: Problem, force, variants) -> Prepared:
    """Plan a problem met for the first time and load its kernels (never during graph capture)."""
    dev_index = key[0]
    if first_use_tuner is not None and key[2] is None and not variants and config.tune_on_first_use():
        # (the tuner times the product alone: its choice is per shape, whatever the epilogue)
        first_use_tuner(s, c, dataclasses.replace(problem, epilogue=EPILOGUE_NONE), dev_index)
    plan = plan_for(problem, dev_index, force, variants)
    if plan.kernel is None:
        return Prepared(plan)
    if torch.cuda.is_current_stream_capturing() and not all(launcher.is_loaded(plan.device, k) for k in plan.kernels()):
        raise RuntimeError(
            f"fastmm: kernel {plan.kernel.family} for this shape is not loaded yet, and compiling or loading it "
            "would break the CUDA graph being captured. Run the same call once before capturing, or call "
            "fastmm.warmup(a, b) first.")
    try:
        for cfg in plan.kernels():  # (the GEMM first; the others looked up again, a dict hit, when used)
            launcher.load(plan.device, cfg)
        loaded = launcher.load(plan.device, plan.kernel)
        second = launcher.load(plan.device, plan.reduce) if plan.reduce is not None else None
    except (CompileError, LaunchError) as exc:
        # A kernel NVRTC rejects or the driver will not load must not take the model down:
        # remember it, warn once, and let torch.matmul serve this problem (explain says why).
        compile_error = isinstance(exc, CompileError)
        what = "failed to compile" if compile_error else "could not be loaded"
        return _give_up(key, plan, f"kernel {cfg.family} {what} ({str(exc).splitlines()[0]})",
                        launch=not compile_error, failed=cfg)
    return PLANS.put(key, Prepared(plan, loaded, second))


def _give_up(key: tuple, plan: Plan, reason: str, launch: bool = False, failed: KernelConfig | None = None
             ) -> Prepared:
    """Remember that kernel ``failed`` (default: ``plan``'s GEMM; a stager or second pass that
    failed is remembered as itself, so plans that do not need it still run) cannot serve, for
    this problem and any other that would build the same kernel (a refused launch: with the same
    geometry); warn once, and hand the problem to torch.matmul from now on."""
    failed = failed or plan.kernel
    fkey = (PlanCache.launch_failure_key if launch else PlanCache.failure_key)(plan.device.index, failed)
    PLANS.failed[fkey] = reason
    warn_once(f"fastmm: {reason}; torch.matmul serves these calls instead")
    return PLANS.put(key, Prepared(dataclasses.replace(plan, kernel=None, reduce=None, head=None, fallback=reason)))


# ---------------------------------------------------------------------------------------------
# running a plan

def on_device(index: int):
    """The device whose kernels we launch must be the current one: a loaded kernel is launched in
    the current context (a tensor on cuda:1 with cuda:0 current ran the cuda:0 module on cuda:1's
    pointers: illegal address). A no-op context in the common case."""
    return contextlib.nullcontext() if torch.cuda.current_device() == index else torch.cuda.device(index)


#: torch's C getter of the current stream's handle (0.17 us, against 9.4 for torch.cuda.current_stream())
_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(index: int) -> int:
    if _raw_current_stream is not None:
        return _raw_current_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def run(s: Shapes, c: torch.Tensor, precision: str, force: str | None = None,
        variants: tuple[Family, ...] = (), epilogue: "Epilogue | None" = None) -> Plan:
    """Launch the planned kernel(s) writing C = A @ B into ``c`` (shape batch + (M, N)); with an
    ``epilogue`` (a problem without batch dims, K > 0), C = alpha * A @ B + beta * D."""
    dev_index = c.device.index if c.device.index is not None else torch.cuda.current_device()
    problem, offsets = build_problem(s, c, precision)
    if epilogue is not None:
        problem = dataclasses.replace(problem, epilogue=epilogue.form)
    key = (dev_index, problem, force or config.forced_kernel(), variants)
    hit = PLANS.prepared.get(key)
    if hit is None:
        hit = _prepare(key, s, c, problem, force, variants)
    plan = hit.plan
    if plan.kernel is None:
        return plan
    if s.K == 0:
        c.zero_()
        return plan
    with on_device(dev_index):
        try:
            launch_plan(hit, s, c, problem, offsets, dev_index, epilogue)
        except TensorMapError as exc:
            # The driver refused a tensor map the planner thought valid: torch.matmul computes
            # this call (all of C again) and every later one of this problem.
            reason = f"kernel {plan.kernel.family} could not describe an operand to the copy engine ({exc})"
            warn_once(f"fastmm: {reason}; torch.matmul serves this problem instead")
            plan = dataclasses.replace(plan, kernel=None, reduce=None, head=None, fallback=reason)
            PLANS.put(key, Prepared(plan))
        except LaunchError as exc:
            # The driver refused the launch (an illegal configuration): nothing ran that torch
            # will not overwrite, since the fallback computes all of C.
            plan = _give_up(key, plan, f"kernel {plan.kernel.family} could not be launched ({exc})", launch=True).plan
    return plan


def launch_plan(hit: Prepared, s: Shapes, c: torch.Tensor, problem: Problem, offsets, dev_index: int,
                epilogue: "Epilogue | None" = None) -> None:
    """Queue the plan's kernel(s) on the current stream, once per launch offset (batch dims the
    kernel cannot walk; a problem with an epilogue has one). Staged operands are copied by the
    plan's stagers, in its runner."""
    plan = hit.plan
    epi = epilogue.args(plan.swap_ab) if epilogue is not None else ()
    stream = current_stream(dev_index)
    p = plan.launch_problem or problem
    pa, pb, pc = s.a.data_ptr(), s.b.data_ptr(), c.data_ptr()
    runner = runners.runner_for(plan, hit.kernel, hit.second, p, c.device)
    if runner is not None:
        for oa, ob, oc in offsets:
            runner(pa + 4 * oa, pb + 4 * ob, pc + 4 * oc, stream, epi)
        return
    tail = runners.gemm_args(p) + epi
    for oa, ob, oc in offsets:
        launcher.launch(hit.kernel, stream, (pa + 4 * oa, pb + 4 * ob, pc + 4 * oc) + tail)


# ---------------------------------------------------------------------------------------------
# one call

def matmul_fastmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, precision: str,
                  force: str | None = None, variants: tuple[Family, ...] = ()
                  ) -> tuple[torch.Tensor, Plan | None, str | None]:
    """Compute with fastmm kernels where possible. Returns (result, plan, fallback reason)."""
    s = analyse(a, b, out)  # (torch's shape errors first; A's rows folded by a copy are copied below)
    reason = not_served_reason(a, b)
    if reason is None and out is not None and (out.dtype != FLOAT32 or out.device != a.device):
        reason = "out has another dtype or device"  # torch raises its own error below
    if reason is None and out is not None and has_internal_overlap(out):
        reason = "out has internally overlapping memory"  # torch raises its own error below
    if reason is not None:
        if reason == runtime_reason() and a.is_cuda:
            warn_once(f"fastmm: {reason}; torch.matmul serves every call")
        return fallback(a, b, out, precision, reason), None, reason

    s = s.materialized(a)
    if out is not None:
        resize_out(out, s.out_shape)
    c = s.matrix_view(out) if out is not None and not (overlaps(out, a) or overlaps(out, b)) else None
    direct = c is not None  # else computed aside: out overlaps an input, or cannot be one view
    if c is None:
        c = result_matrix(s.batch + (s.M, s.N), a.device)
    plan = None
    if c.numel() != 0:
        plan = run(s, c, precision, force, variants)
        if plan.kernel is None:
            return fallback(a, b, out, precision, plan.fallback), plan, plan.fallback
    if direct:
        return out, plan, None
    result = c.view(s.out_shape)
    if out is not None:
        out.copy_(result)  # computed aside, then copied
        result = out
    return result, plan, None


@dataclass(frozen=True)
class Epilogue:
    """What a fused epilogue adds to a product: C = alpha * A @ B + beta * D, with ``d`` the
    (M, N) view of D (broadcast strides allowed). beta = 0 never reads D."""

    d: torch.Tensor
    alpha: float
    beta: float

    @property
    def form(self) -> str:
        """The problem's epilogue form (fastmm.problem.EPILOGUE_*), from D's strides."""
        return epilogue_form(self.d.stride())

    def args(self, swap_ab: bool) -> tuple:
        return (self.d.data_ptr(),) + runners.epilogue_tail(self.d.stride(), self.alpha, self.beta, swap_ab)


def fused_reason(s: Shapes, d: torch.Tensor, alpha) -> str | None:
    """Why ``alpha * (a @ b) + beta * d`` cannot be one fused launch (None: it can). The reasons
    depend on shapes, strides, dtypes and devices only: the steady-state path remembers them."""
    if s.batch or s.squeeze_m or s.squeeze_n:
        return "the fused epilogue takes products without batch dims"
    if s.K == 0 or s.M == 0 or s.N == 0:
        return "an empty product"
    if type(d) not in PLAIN_TYPES or d.dtype != FLOAT32 or d.device != s.a.device or d.data_ptr() % 4:
        return "the added tensor is not a 4-byte aligned float32 tensor on the operands' device"
    if alpha == 0 or d.dim() > 2:
        return "alpha is 0, or the added tensor has more than 2 dims"
    return None


def matmul_fused(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, alpha, beta, precision: str,
                 force: str | None = None, variants: tuple[Family, ...] = ()
                 ) -> tuple[torch.Tensor | None, Plan | None, str | None]:
    """``alpha * (a @ b) + beta * d`` (``d`` broadcastable to the product; beta = 0 ignores it)
    in one fused launch, for operands torch's type rules already accepted. Returns (result, plan,
    None), or (None, plan or None, why not) where the caller must compute it another way (the
    product, then the epilogue). ``force`` and ``variants`` as for :func:`matmul_fastmm`."""
    reason = not_served_reason(a, b)
    if reason is not None:
        return None, None, reason
    s = analyse(a, b)
    reason = fused_reason(s, d, alpha)
    if reason is not None:
        return None, None, reason
    try:
        d2 = d.expand(s.M, s.N)
    except RuntimeError:  # (the caller's unfused add raises torch's own error)
        return None, None, "the added tensor does not broadcast to the product's shape"
    c = result_matrix((s.M, s.N), a.device)
    plan = run(s.materialized(a), c, precision, force, variants, epilogue=Epilogue(d2, alpha, beta))
    if plan.kernel is None:
        return None, plan, plan.fallback
    return c.view(s.out_shape), plan, None


def torch_matmul(a, b, out):
    return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)


def fallback(a, b, out, precision, reason):
    """torch.matmul at the precision asked for, with fastmm's out= guarantees. Torch function
    modes are off for plain tensors: this call is fastmm's own, and a ``use_fastmm`` block around
    it must not route it back to fastmm (as it would in an eager backward, or inside a layer's
    forward)."""
    plain = type(a) in PLAIN_TYPES and type(b) in PLAIN_TYPES and (out is None or type(out) in PLAIN_TYPES)
    with torch_precision(precision if a.is_cuda else None), \
            (torch._C.DisableTorchFunction() if plain else contextlib.nullcontext()):
        if out is None:
            return torch_matmul(a, b, None)
        if (out.dtype == a.dtype == b.dtype and out.device == a.device == b.device
                and (overlaps(out, a) or overlaps(out, b))):
            # torch.matmul(a, b, out=a) reads what it has already overwritten (silently wrong):
            # compute aside, then apply torch's out= rules and copy
            result = torch.matmul(a, b)
            resize_out(out, tuple(result.shape))
            return out.copy_(result)
        return torch_matmul(a, b, out)
