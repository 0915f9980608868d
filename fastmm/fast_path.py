"""The steady-state path of ``fastmm.matmul``: after a first call of a layout has planned and
loaded its kernels (:mod:`fastmm.dispatch`), the next identical call is one dict lookup, (an
allocation,) and one launch (split-K, stream-K: two; a staged plan: its copies and the GEMM).

The key holds everything the plan depends on that can be read cheaply: shapes, strides, dtypes,
devices, pointer alignment, precision and the environment switches. A layout that never takes
this path (several launch offsets, an out= whose rows are folded by a copy) is remembered as
such too, so it is analysed once, not on every call; rows folded by a copy without out= are
copied, then the copy's own entry serves. ``F.linear``'s product (every Linear layer's forward) has
a key of its own, read from x, the weight and the bias as they are (:func:`compute_linear`):
the same information, without making the transposed weight's view per call; and a Linear
layer's backward (grad_x and grad_W, :func:`linear_backward`) one key for both products, read
from g, x and the weight, without the flattened and transposed views the formula makes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import config, dispatch
from .runtime import launcher, runners
from .runtime.launcher import LaunchError
from .runtime.tensor_map import TensorMapError
from .shapes import (analyse, build_problem, check_linear, extent, flat_rows, fold_needs_copy, linear_shape, overlaps,
                     result_matrix, rows_copy)


@dataclass(frozen=True, slots=True)
class FastEntry:
    """What a repeat call needs: the shape of the C it allocates (as matmul returns it), the
    kernel and its arguments after the (a, b, c) pointers, or a runner for plans of more than one
    launch; and, for ``out=``, the byte extents of (a, b, out) for the overlap test."""

    out_shape: tuple[int, ...]
    kernel: object
    tail: tuple
    device: torch.device
    index: int
    extents: tuple[int, int, int] | None
    runner: object  # runner(pa, pb, pc, stream, epi) or None for one plain launch
    # A fused epilogue's arguments after D's pointer (runners.epilogue_tail), or None
    epi_tail: tuple | None = None


#: key -> FastEntry, or NOT_FAST for a key that never takes this path (a missing key: not known
#: yet), or (for a fused key, :func:`compute_fused`) UNFUSED: the product and its epilogue are
#: computed apart for this key, or FOLD_BY_COPY (A's rows copied first, then the copy's entry).
NOT_FAST = False
UNFUSED = "unfused"
#: (a linear key, :func:`compute_linear`, or a product's, :func:`compute`) x's (A's) leading dims
#: merge into rows only by a copy.
FOLD_BY_COPY = "fold by copy"
ENTRIES: dict[tuple, FastEntry | bool | str] = {}


def key_of(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, precision: str) -> tuple:
    return key_at(a, b, out, precision, a.data_ptr(), b.data_ptr(), 0 if out is None else out.data_ptr())


def key_at(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, precision: str, pa: int, pb: int,
           po: int) -> tuple:
    """:func:`key_of` from the operands' data pointers, read once by the caller: a repeat call
    needs them again for the overlap test and the launch (each read ~0.07 us)."""
    key = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device, b.device,
           pa & 15, pb & 15, precision, _switches())
    if out is not None:
        key += (out.shape, out.stride(), out.dtype, out.device, po & 15)
    return key


_switches = config.switches  # (a module global: one lookup less a key)


def _keep(key: tuple, value) -> None:
    """``ENTRIES[key] = value`` within the bound: a full table is emptied first (the entries of
    the layouts still in use come back on their next call)."""
    if len(ENTRIES) >= dispatch.MAX_CACHED_SHAPES:
        ENTRIES.clear()
    ENTRIES[key] = value


def forget_plans() -> None:
    """Drop every cached plan and fast-path entry, so the next call of each shape plans again (a
    tuned choice was stored). Loaded kernels stay loaded."""
    dispatch.PLANS.clear()
    ENTRIES.clear()


def ranges_overlap(entry: FastEntry, pa: int, pb: int, po: int) -> bool:
    """Whether ``out`` at ``po`` overlaps ``a`` at ``pa`` or ``b`` at ``pb`` (the byte extents the
    entry keeps: the same for every call of its key)."""
    ea, eb, eo = entry.extents
    return (po < pa + ea and pa < po + eo) or (po < pb + eb and pb < po + eo)


def remember(key: tuple, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, precision: str,
             epilogue: tuple | None = None) -> None:
    """After a first call has planned and loaded the kernel: keep what the next identical call
    needs. Only for one launch offset, K > 0, A's rows not folded by a copy, and an ``out`` (if
    any) that already had the right shape and is written directly (staged plans too: their
    runner makes the copies each call). ``epilogue``: (d, alpha, beta) of a call launched fused
    (:func:`compute_fused`)."""
    s = analyse(a, b)
    if s.K == 0 or any(n == 0 for n in s.batch + (s.M, s.N)):
        return
    if s.copied:
        # A's rows merge only by a copy, made per call: a repeat call copies them and takes the
        # copy's own entry (:func:`compute`; remembered here only after fastmm served the call);
        # with an out=, the full path
        _keep(key, FOLD_BY_COPY if out is None and epilogue is None else NOT_FAST)
        return
    view_shape = s.batch + (s.M, s.N)
    if out is None:
        c = result_matrix(view_shape, "meta")  # the layout matmul allocates, no memory
    else:
        if tuple(out.shape) != s.out_shape or overlaps(out, a) or overlaps(out, b):
            return
        c = s.matrix_view(out)
        if c is None:  # computed aside and copied: the full path's job
            return
    problem, offsets = build_problem(s, c, precision)
    epi = None
    if epilogue is not None:  # (as dispatch.matmul_fused describes it: the form from D's strides)
        d, alpha, beta = epilogue
        epi = dispatch.Epilogue(d.expand(s.M, s.N), alpha, beta)
        problem = replace(problem, epilogue=epi.form)
    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    hit = dispatch.PLANS.prepared.get((index, problem, config.forced_kernel(), ()))
    if hit is None:
        return
    plan = hit.plan
    if len(offsets) != 1 or plan.kernel is None:
        # Never fast for this key (these depend on the problem only): remember that too, so the
        # next call does not analyse the problem a third time just to find out again.
        _keep(key, NOT_FAST)
        return
    p = plan.launch_problem or problem  # (as in dispatch.launch_plan)
    runner = runners.runner_for(plan, hit.kernel, hit.second, p, a.device)
    tail = runners.gemm_args(p) if runner is None else ()
    extents = (extent(a), extent(b), extent(out)) if out is not None else None
    epi_tail = None if epi is None else epi.args(plan.swap_ab)[1:]  # (D's pointer: per call)
    _keep(key, FastEntry(s.out_shape, hit.kernel, tail, a.device, index, extents, runner, epi_tail))


def launch(entry: FastEntry, pa: int, pb: int, out: torch.Tensor | None, po: int,
           d: torch.Tensor | None = None) -> torch.Tensor:
    """Queue ``entry``'s work on the operands at ``pa``, ``pb`` (and a fused epilogue's ``d``)
    into ``out`` (at ``po``) or a fresh C."""
    if out is None:
        # C allocated in matmul's result shape at once: the same contiguous memory as the batch +
        # (M, N) matrix the kernel writes (a view from one to the other costs ~1.5 us a call)
        out = result_matrix(entry.out_shape, entry.device)
        po = out.data_ptr()
    epi = () if d is None else (d.data_ptr(),) + entry.epi_tail
    index = entry.index
    if (_cuda_device() if _cuda_device is not None else torch.cuda.current_device()) != index:
        with torch.cuda.device(index):  # (dispatch.on_device: a kernel runs in the current context)
            _enqueue(entry, pa, pb, po, epi)
    else:
        _enqueue(entry, pa, pb, po, epi)
    return out


#: torch's C getter of the current device, without torch.cuda.current_device()'s lazy-init test
#: (~0.3 us): a remembered call runs only after a first call initialised CUDA
_cuda_device = getattr(torch._C, "_cuda_getDevice", None)


def _enqueue(entry: FastEntry, pa: int, pb: int, pc: int, epi: tuple) -> None:
    if entry.runner is None:
        launcher.launch(entry.kernel, dispatch.current_stream(entry.index), (pa, pb, pc) + entry.tail + epi)
    else:
        entry.runner(pa, pb, pc, dispatch.current_stream(entry.index), epi)


def serve(key: tuple, pa: int, pb: int, out: torch.Tensor | None, po: int,
          d: torch.Tensor | None = None) -> torch.Tensor | None:
    """The steady-state call: ``key``'s entry launched on the operands at ``pa``, ``pb`` into
    ``out`` at ``po`` or a fresh C (:func:`launch`), or None where it has no FastEntry, the entry
    may not serve (an ``out`` overlapping an input), or its launch failed (not expected: the first
    call did the same; the key is then NOT_FAST, so the full path decides, falling back if it
    must)."""
    entry = ENTRIES.get(key)
    if type(entry) is FastEntry and (out is None or not ranges_overlap(entry, pa, pb, po)):
        try:
            return launch(entry, pa, pb, out, po, d)
        except (TensorMapError, LaunchError):
            ENTRIES[key] = NOT_FAST
    return None


def compute(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, precision: str) -> torch.Tensor:
    """The product without autograd, for operands torch's type rules already accepted: the
    steady-state entry where a first call left one, else the full path (which leaves one)."""
    pa, pb, po = a.data_ptr(), b.data_ptr(), 0 if out is None else out.data_ptr()
    key = key_at(a, b, out, precision, pa, pb, po)
    c = serve(key, pa, pb, out, po)
    if c is not None:
        return c
    if out is None and ENTRIES.get(key) is FOLD_BY_COPY:
        # rows that no view merges (a transposed batch view; a compiled backward's seq-first
        # gradient), served by fastmm on a first call (:func:`remember`): copied into one
        # (rows, K) matrix, as the full path does, whose own entry then serves. The full path
        # planned the product again on every call (~100-250 us of host time on the H100
        # machine; 4 calls a step of a compiled ViT's backward). A call fastmm does not serve
        # (torch's, on the caller's own tensors: its bits and errors) never gets this entry.
        return compute(rows_copy(a), b, None, precision).view(a.shape[:-1] + b.shape[1:])
    return _compute_full(key, a, b, out, precision)


def _compute_full(key: tuple, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None,
                  precision: str) -> torch.Tensor:
    """:func:`compute` where ``key``'s entry did not serve: the full path, remembered under
    ``key`` if there was no entry yet."""
    entry = ENTRIES.get(key)
    out_shape = None if out is None else tuple(out.shape)
    result, plan, reason = dispatch.matmul_fastmm(a, b, out, precision)
    # (an out that was resized no longer matches the key, which holds its old shape: the next
    # call with an out of that old shape must be resized again, so it is not remembered)
    if plan is not None and reason is None and entry is None and (out is None or tuple(out.shape) == out_shape):
        remember(key, a, b, out, precision)
    return result


# ---------------------------------------------------------------------------------------------
# products with a fused epilogue: alpha * (a @ b) + beta * d

def fused_key(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, alpha, beta, precision: str) -> tuple:
    return key_of(a, b, None, precision) + ("epilogue", d.shape, d.stride(), d.dtype, d.device, type(d),
                                           d.data_ptr() & 3, alpha, beta)


def compute_fused(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, alpha, beta, precision: str) -> torch.Tensor:
    """``alpha * (a @ b) + beta * d`` without autograd (``d`` broadcastable to the product; beta = 0
    ignores it, NaN included, as torch.addmm does), for operands torch's type rules already
    accepted: one launch whose stores apply the epilogue (``F.linear``'s bias, ``addmm``'s
    input) where the plan allows (:func:`fastmm.dispatch.fused_reason`), else the product and
    then the epilogue in place on it. A fresh result either way."""
    key = fused_key(a, b, d, alpha, beta, precision)
    c = serve(key, a.data_ptr(), b.data_ptr(), None, 0, d)
    return c if c is not None else _fused_full(key, a, b, d, alpha, beta, precision)


def _fused_full(key: tuple, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, alpha, beta,
                precision: str) -> torch.Tensor:
    """:func:`compute_fused` where ``key``'s entry did not serve: the fused full path (remembered
    under ``key`` if there was no entry yet), or the product and then the epilogue."""
    entry = ENTRIES.get(key)
    if entry is not UNFUSED:
        result, plan, reason = dispatch.matmul_fused(a, b, d, alpha, beta, precision)
        if result is not None:
            if entry is None:
                remember(key, a, b, None, precision, (d, alpha, beta))
            return result
        if plan is None or plan.kernel is None:  # (shapes, layouts or the device: the same next time)
            _keep(key, UNFUSED)
    return add_epilogue(compute(a, b, None, precision), d, alpha, beta)


def add_epilogue(prod: torch.Tensor, d: torch.Tensor, alpha, beta) -> torch.Tensor:
    """beta * d + alpha * prod, written into ``prod`` (fresh). beta = 0 ignores d (NaN in d does
    not propagate), as torch.addmm does."""
    if alpha != 1:
        prod.mul_(alpha)
    if beta != 0:
        prod.add_(d, alpha=beta)
    return prod


# ---------------------------------------------------------------------------------------------
# F.linear: x @ w.t() (+ bias), keyed on (x, w, bias) themselves

def linear_key(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, precision: str,
               px: int | None = None, pw: int | None = None) -> tuple:
    """The key of ``x @ w.t()`` (+ ``bias``, alpha = beta = 1): what :func:`key_of` (no bias) or
    :func:`fused_key` hold for ``(x, w.t(), bias)``, read from ``w`` itself (w.t()'s shape and
    strides are w's reversed, its pointer is w's). It starts with "linear", where theirs start
    with a shape, so the two kinds of key never meet."""
    if px is None:
        px, pw = x.data_ptr(), w.data_ptr()
    key = ("linear", x.shape, x.stride(), w.shape, w.stride(), x.dtype, w.dtype, x.device, w.device,
           px & 15, pw & 15, precision, _switches())
    if bias is not None:
        key += (bias.shape, bias.stride(), bias.dtype, bias.device, type(bias), bias.data_ptr() & 3)
    return key


def compute_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, precision: str) -> torch.Tensor:
    """``F.linear(x, w, bias)`` without autograd: :func:`compute` of ``x @ w.t()``, or with a bias
    :func:`compute_fused` (the bias added in the kernel's stores where the plan allows), with
    the entry under :func:`linear_key`. A repeat call so makes neither the transposed view
    (~1.3 us) nor the generic key; its launch reads w.t()'s pointer from ``w`` (the same)."""
    px, pw = x.data_ptr(), w.data_ptr()
    key = linear_key(x, w, bias, precision, px, pw)
    c = serve(key, px, pw, None, 0, bias)
    if c is not None:
        return c
    check_linear(x, w, bias)  # (F.linear's words for its K rule, not matmul's: they differ)
    if bias is not None and bias.dim() > 1:
        # A bias of more than one dim: F.linear's result depends on its path (x's rows folded
        # and the bias added as addmm adds it, or the product then an in-place add), which
        # torch picks by x's layout and the bias's shape, from release to release: a (1, N) bias
        # on a 1-D x gives (N,) (2.13-2.15), a (1, 1, N) one on a contiguous 3-D x is refused.
        # torch decides on meta tensors of the same layouts; fastmm follows (rare: biases are (N,)).
        shape = _f_linear_shape(x, w, bias)
        if shape != _broadcast_or_none(x.shape[:-1] + (w.shape[0],), bias.shape):
            # (torch folded x's rows: its bias was added to the (rows, N) product, as addmm adds it)
            return compute_linear(x.reshape(-1, x.shape[-1]), w, bias, precision).view(shape)
    if x.dim() > 2 and (ENTRIES.get(key) is FOLD_BY_COPY or (w.dim() == 2 and (bias is None or bias.dim() <= 1)
                                                             and fold_needs_copy(x))):
        # rows that no view merges (a seq-first view of a batch-first activation): copied into
        # one (rows, K) matrix, as torch.matmul's reshape does, whose own entry then serves (a
        # 1-D weight, or a bias over the leading dims too, take the full path, which copies)
        _keep(key, FOLD_BY_COPY)
        return compute_linear(rows_copy(x), w, bias, precision).view(x.shape[:-1] + (w.shape[0],))
    if bias is None:
        return _compute_full(key, x, w.t(), None, precision)
    return _fused_full(key, x, w.t(), bias, 1, 1, precision)


def _f_linear_shape(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Size:
    """:func:`fastmm.shapes.linear_shape` (asking torch on meta tensors costs ~0.6 ms, and such a
    call may repeat every step), remembered among the entries (:func:`_keep`'s bound) by the
    shapes and strides it depends on; an error is not remembered: torch words it again on the
    real tensors."""
    key = ("F.linear shape", x.shape, x.stride(), w.shape, w.stride(), bias.shape, bias.stride())
    shape = ENTRIES.get(key)
    if shape is None:
        shape = linear_shape(x, w, bias)
        _keep(key, shape)
    return shape


def _broadcast_or_none(*shapes) -> torch.Size | None:
    try:
        return torch.broadcast_shapes(*shapes)
    except RuntimeError:  # (a bias that broadcasts only over x's folded rows: (rows, 1))
        return None


# ---------------------------------------------------------------------------------------------
# a Linear layer's backward: grad_x = g @ w and grad_w = g^T @ x (rows flattened), one key for both
# (a layer of w stored [in, out], ``in_out``: grad_x = g @ w^T and grad_w = x^T @ g)

@dataclass(frozen=True, slots=True)
class LinearGradsEntry:
    """The two products of ``x @ w.t()``'s backward as remembered entries: ``grad_x`` launched on
    (g, w), ``grad_w`` on (g, x) read in place (g^T and x's rows flattened are views at the
    same pointers); None for a gradient not asked for. (``in_out``, ``x @ w`` with w stored [in,
    out]: grad_x on (g, w), grad_w = x^T g on (x, g), in w's own layout.)"""

    grad_x: FastEntry | None
    grad_w: FastEntry | None


def linear_grads_key(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, precision: str, need_x: bool,
                     need_w: bool, pg: int, px: int, pw: int, in_out: bool = False) -> tuple:
    """What both products' :func:`key_of` keys hold, read from (g, x, w) as they are: the views
    (g's and x's rows flattened, one of them transposed; w^T for ``in_out``) and a key a product
    are made once, on the first call of a layout. ``in_out`` tells the two forms apart where K = N
    would give them the same layouts."""
    return ("linear grads", g.shape, g.stride(), x.shape, x.stride(), w.shape, w.stride(), g.dtype, x.dtype,
            w.dtype, g.device, x.device, w.device, pg & 15, px & 15, pw & 15, precision, _switches(), need_x, need_w,
            in_out)


def linear_backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, precision: str, need_x: bool,
                    need_w: bool, formula, in_out: bool = False) -> tuple:
    """(grad_x, grad_w) of ``x @ w.t()`` (``in_out``: of ``x @ w``) for the output gradient ``g``
    (None for one not asked for): from the entry a first call of this layout left, else
    ``formula()`` (the products one by one, each through :func:`compute`, which remembers its own
    entry), after which both products' entries are kept under one key
    (:func:`_remember_linear_grads`)."""
    pg, px, pw = g.data_ptr(), x.data_ptr(), w.data_ptr()
    key = linear_grads_key(g, x, w, precision, need_x, need_w, pg, px, pw, in_out)
    entry = ENTRIES.get(key)
    if type(entry) is LinearGradsEntry:
        try:
            return (None if entry.grad_x is None else launch(entry.grad_x, pg, pw, None, 0),
                    None if entry.grad_w is None else
                    launch(entry.grad_w, px, pg, None, 0) if in_out else launch(entry.grad_w, pg, px, None, 0))
        except (TensorMapError, LaunchError):  # (not expected: the products' own calls launched the same)
            ENTRIES[key] = entry = NOT_FAST
    grads = formula()
    if entry is None:
        _remember_linear_grads(key, g, x, w, precision, need_x, need_w, in_out)
    return grads


def _remember_linear_grads(key: tuple, g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, precision: str,
                           need_x: bool, need_w: bool, in_out: bool) -> None:
    """Both products' entries under ``key``, where both are single launches reading g and x in
    place; the key never fast where a product is known not to be (NOT_FAST) or reads a copy. A
    product with no entry leaves the key unknown: its entry may have been dropped between the two
    products (the entries' bound, a tuned bucket's forget_plans) and be there next time. (The
    products as the formulas make them: fastmm.ops.linear_grads, in_out_grads.)"""
    grad_x = grad_w = None
    in_place = True
    if need_x:
        grad_x = ENTRIES.get(key_of(g, w.t() if in_out else w, None, precision))
    if need_w:
        g_rows, x_rows = flat_rows(g), flat_rows(x)
        # (views at g's and x's own pointers: a reshape that copied reads another memory)
        in_place = g_rows.data_ptr() == g.data_ptr() and x_rows.data_ptr() == x.data_ptr()
        grad_w = ENTRIES.get(key_of(*((x_rows.t(), g_rows) if in_out else (g_rows.t(), x_rows)), None, precision))
    found = [e for e, needed in ((grad_x, need_x), (grad_w, need_w)) if needed]
    if None in found:
        return
    fast = in_place and all(type(e) is FastEntry for e in found)
    _keep(key, LinearGradsEntry(grad_x, grad_w) if fast else NOT_FAST)
