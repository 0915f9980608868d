"""torch.matmul's shape rules, and the problem a call is: operands reduced to batched matrices,
their batch dims collapsed, strides and pointer alignment read into a
:class:`~fastmm.problem.Problem`. Also what ``out=`` needs: resize rules and overlap tests."""
from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass, replace
from typing import NoReturn

import torch

from .problem import Problem

FLOAT32 = torch.float32
#: The tensor types whose data pointers fastmm's eager route reads (subclasses keep their own semantics).
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def raise_torch_error(op, *args, **kwargs) -> NoReturn:
    """Let torch word the error of a call that fastmm's own (fast) shape rules refuse:
    ``op(*args, **kwargs)`` on the operands themselves, so the words are the installed torch's
    (they change between releases: a 2-D product's mismatch is "mat1 and mat2 shapes cannot be
    multiplied" up to 2.14, "mm: mat1 and mat2 ..." in 2.15, addmm's "addmm: ...") and the
    device's (a CUDA tensor is a "torch.cuda.FloatTensor" in expand's message); which check fails
    first can depend on the strides, so stand-ins with other strides could get other messages
    (zero-stride views said "size mismatch" where torch says "Expected size for first two
    dimensions of batch2 tensor" for (4,) @ (2, 5, 6)). torch checks shapes before computing.
    Where that call passes (meta and fake tensors follow looser rules in some releases: torch
    2.13's meta addmm takes a C of 3 dims), CPU stand-ins of the same shapes (zero-stride views,
    no memory) get the error real tensors get."""
    op(*args, **kwargs)
    stand_ins = [torch.zeros((), dtype=t.dtype).expand(t.shape) if isinstance(t, torch.Tensor) else t for t in args]
    op(*stand_ins, **{k: v for k, v in kwargs.items() if k != "out"})
    shapes = ", ".join(str(tuple(t.shape)) for t in args if isinstance(t, torch.Tensor))
    raise RuntimeError(f"{getattr(op, '__name__', op)}: the operands' shapes do not combine: {shapes}")


def addmm_bias_fits(c: torch.Tensor, m: int, n: int) -> bool:
    """Whether torch.addmm expands ``c`` to the (m, n) product: at most 2 dims, each equal to the
    product's or 1."""
    return c.dim() <= 2 and all(x == y or x == 1 for x, y in zip(reversed(c.shape), (n, m)))


def check_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """F.linear's K rule (x's last dim is the weight's), in F.linear's own words where it fails:
    with a bias torch words it as addmm does, without one as matmul, per release."""
    if x.dim() == 0 or w.dim() == 0 or x.shape[-1] != w.shape[-1]:
        raise_torch_error(torch.nn.functional.linear, x, w, bias)


def linear_shape(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Size:
    """The shape of ``F.linear(x, w, bias)`` as the installed torch computes it, from meta tensors
    of the same shapes and strides (its path depends on x's layout); where torch refuses the
    call, its error for the real tensors."""
    def meta(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    try:
        return torch.nn.functional.linear(meta(x), meta(w), meta(bias)).shape
    except RuntimeError:
        raise_torch_error(torch.nn.functional.linear, x, w, bias)


@dataclass
class Shapes:
    """A call reduced to batched 3-operand form: A (batch, M, K) @ B (batch, K, N) -> C.

    As torch.matmul does, an N-D A times a matrix is folded into one product: A's leading dims
    merged into M, so B is read once and the tiles see one tall problem instead of a batch of
    short ones with a broadcast B. A view where A's strides allow it; else, as torch.matmul's
    reshape does, a contiguous copy of A (``copied``): a batch of short products re-reads B once
    per batch entry (nn.MultiheadAttention's seq-first projections of a batch-first input: 1024
    products of 8 rows, each reading the whole weight)."""

    a: torch.Tensor  # expanded to batch + (M, K)
    b: torch.Tensor  # expanded to batch + (K, N)
    batch: tuple[int, ...]
    M: int
    N: int
    K: int
    out_shape: tuple[int, ...]  # what torch.matmul returns
    squeeze_m: bool  # a was 1-D
    squeeze_n: bool  # b was 1-D
    folded: bool = False  # a's leading dims are merged into M
    copied: bool = False  # ... into a copy of a (its strides allow no view): ``a`` is that copy

    def materialized(self, a: torch.Tensor) -> "Shapes":
        """These shapes for a call that launches on them: where A's rows are folded by a copy
        (``copied``; ``a`` the caller's A, whose meta stand-in ``self.a`` is), with that copy made;
        else ``self``."""
        return replace(self, a=rows_copy(a)) if self.copied else self

    def matrix_view(self, out: torch.Tensor) -> torch.Tensor | None:
        """``out`` (shaped as torch.matmul returns) viewed as batch + (M, N): the squeezed dims
        restored, N first (for 1-D @ 1-D out is 0-d, and only that order works). None where a
        folded problem's rows cannot be one view of ``out`` (its strides do not merge): the
        result is then computed aside and copied."""
        c = out.unsqueeze(-1) if self.squeeze_n else out
        if self.folded:
            try:
                return c.view(self.M, self.N)
            except (RuntimeError, ValueError):  # (fake tensors raise ValueError)
                return None
        return c.unsqueeze(-2) if self.squeeze_m else c


def _fold_rows(a: torch.Tensor, K: int) -> torch.Tensor | None:
    """``a`` (..., M, K) as one (rows, K) matrix without a copy, or None where its strides do not
    allow a view (a transposed batch view, say)."""
    rows = 1
    for n in a.shape[:-1]:
        rows *= n
    try:
        return a.view(rows, K)
    except (RuntimeError, ValueError):  # (fake tensors raise ValueError)
        return None


def rows_copy(a: torch.Tensor) -> torch.Tensor:
    """``a`` (..., K) copied into one contiguous (rows, K) matrix: torch.matmul's reshape of an A
    whose strides allow no view (a fresh tensor, allocated as every other buffer fastmm makes)."""
    return torch.empty(a.shape, dtype=a.dtype, device=a.device).copy_(a).view(-1, a.shape[-1])


def fold_needs_copy(a: torch.Tensor) -> bool:
    """Whether ``a``'s leading dims (all but the last) merge into rows only by a copy."""
    return _fold_rows(a, a.shape[-1]) is None


def analyse(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> Shapes:
    """``a @ b`` (torch.matmul's rules and errors) in batched 3-operand form. Where A's rows are
    folded by a copy, a meta tensor of its layout stands in for it (planning, explain, shape
    checks: nothing allocated); :meth:`Shapes.materialized` makes it for a call that launches.
    ``out``: the call's out=, for torch's words of a shape error (they name out's size for a
    matrix @ vector)."""
    da, db = a.dim(), b.dim()
    if da == 0 or db == 0:
        raise_torch_error(torch.matmul, a, b, out=out)
    a2 = a.unsqueeze(0) if da == 1 else a
    b2 = b.unsqueeze(-1) if db == 1 else b
    M, K = a2.shape[-2], a2.shape[-1]
    K2, N = b2.shape[-2], b2.shape[-1]
    if K != K2:
        raise_torch_error(torch.matmul, a, b, out=out)
    if db <= 2:  # the common cases (2-D @ 2-D, N-D @ a matrix) need no broadcasting rule
        batch = tuple(a2.shape[:-2])
        if batch:
            rows = _fold_rows(a2, K)
            copied = rows is None
            if copied:  # (as torch.matmul: a contiguous copy, one product)
                n = math.prod(a2.shape[:-1])
                rows = torch.empty((n, K), dtype=a2.dtype, device="meta")
            out_shape = batch + (M,) + ((N,) if db >= 2 else ())
            return Shapes(rows, b2, (), rows.shape[0], N, K, out_shape, False, db == 1, True, copied)
    else:
        try:
            batch = tuple(torch.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]))
        except RuntimeError:
            raise_torch_error(torch.matmul, a, b, out=out)
    out_shape = batch + ((M,) if da >= 2 else ()) + ((N,) if db >= 2 else ())
    return Shapes(a2.expand(batch + (M, K)), b2.expand(batch + (K, N)), batch, M, N, K,
                  out_shape, da == 1, db == 1)


def collapse_batch(batch, sa, sb, sc):
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


def pointer_align(ptr: int) -> int:
    for n in (16, 8, 4):
        if ptr % n == 0:
            return n
    return 1


def _norm(size: int, stride: int) -> int:
    """A stride of a size-1 dim is meaningless; call it 1 so layouts read as contiguous."""
    return 1 if size == 1 else stride


def flat_rows(t: torch.Tensor) -> torch.Tensor:
    """``t``'s leading dims flattened into rows, (rows, last dim): ``t.reshape(-1, n)``, also where
    n = 0 (there -1 has no single meaning, and torch refuses it). A view where the layout allows
    one, else a copy (reshape's rule)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def result_matrix(view_shape: tuple[int, ...], device) -> torch.Tensor:
    """C as matmul allocates it: a fresh contiguous float32 tensor of batch + (M, N) (on the
    meta device: its layout, with no memory, for planning ahead)."""
    return torch.empty(view_shape, dtype=FLOAT32, device=device)


def build_problem(s: Shapes, c: torch.Tensor, precision: str):
    """Problem for the first launch, plus (a, b, c) element offsets of every launch."""
    sa, sb, sc = s.a.stride(), s.b.stride(), c.stride()
    nb = len(s.batch)
    dims = collapse_batch(s.batch, sa[:nb], sb[:nb], sc[:nb])
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
    aligns = [min((pointer_align(p + 4 * o[i]) for o in offsets), default=pointer_align(p)) for i, p in enumerate((pa, pb, pc))]
    problem = Problem(
        M, N, K,
        (_norm(M, sa[-2]), _norm(K, sa[-1])), (_norm(K, sb[-2]), _norm(N, sb[-1])), (_norm(M, sc[-2]), _norm(N, sc[-1])),
        n1, n0 * n1, (a0, a1), (b0, b1), (c0, c1), aligns[0], aligns[1], aligns[2], precision)
    return problem, offsets


def overlaps(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Conservative: any shared storage counts (exact interval tests miss strided interleaving)."""
    if x.numel() == 0 or y.numel() == 0:
        return False
    return x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def has_internal_overlap(t: torch.Tensor) -> bool:
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))


def resize_out(out: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(out.shape) == shape:
        return
    if out.numel() != 0:
        warnings.warn(
            f"An output with one or more elements was resized since it had shape {list(out.shape)}, which does not "
            f"match the required output shape {list(shape)}. This behavior is deprecated, and in a future PyTorch "
            "release outputs will not be resized unless they have zero elements. You can explicitly reuse an out "
            "tensor t by resizing it, inplace, to zero elements with t.resize_(0).", UserWarning, stacklevel=4)
    out.resize_(shape)


def extent(t: torch.Tensor) -> int:
    """Bytes from t's first element to just past its last (non-negative strides)."""
    return 4 * (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) if t.numel() else 0
