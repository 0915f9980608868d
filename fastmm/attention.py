"""``F.scaled_dot_product_attention`` on fastmm's products, where torch would take its math path.

For float32 on CUDA torch has no flash kernel, and its memory-efficient kernel does not take
``enable_gqa``: a grouped-query model's attention (Llama's, in float32) runs SDPA's math path,
which is two batched products, ``q @ k^T`` and ``p @ v``, around a softmax, and four more
products in the backward, on cuBLAS. In a patched Llama training step those were 11 ms of torch
products (H100, 8192 tokens, NOTES run 47). :func:`math_attention` computes the same path, step
for step (the scale split over q and k^T, the causal and boolean masks as -inf, the softmax that
gives 0 to a row with nothing to attend, dropout), with the products on :func:`fastmm.matmul`
(and so their backward on fastmm too). :func:`takes_math_path` says whether torch would take the
math path for a call: only there is fastmm's version used, since a fused kernel (where one applies)
never writes the L x S scores to memory and fastmm's version does, as the math path does; and
:func:`computes_as_torch` says whether fastmm's products would compute anything torch's do not
(tf32x3; a precision other than torch's float32 setting): where not, the route only costs host time.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .api import matmul as _matmul
from .precision import resolve_precision_eager, torch_allows_tf32


def computes_as_torch(precision: str | None) -> bool:
    """Whether fastmm's products at ``precision`` compute what torch's math path would compute
    now (its cuBLAS products at torch's float32 setting): ``None``, and the precision that
    setting names ("ieee" under "highest", "tf32" under "high" or "medium"). There the route
    buys nothing: fastmm's ieee and tf32 products run at cuBLAS's pace on attention's shapes,
    while the path written in Python, with fastmm's autograd, costs host time: on an H100 host,
    0.7-1.4 ms a 1024-token Llama training step and 0.75 ms a decoded token (NOTES run 53). So
    the route takes tf32x3, and a precision other than torch's setting, only."""
    if precision is None:
        return True
    return resolve_precision_eager(precision) == ("tf32" if torch_allows_tf32() else "ieee")


def takes_math_path(q, k, v, attn_mask, dropout_p: float, is_causal: bool, enable_gqa: bool) -> bool:
    """Whether torch's SDPA would run its math path for these arguments on CUDA: the math backend
    is enabled and no enabled fused backend (flash, memory-efficient, cuDNN) can take the call.
    False on other devices (the CPU has a fused kernel for float32) and where torch cannot say
    (an older torch without these checks)."""
    if q.device.type != "cuda":
        return False
    cuda = torch.backends.cuda
    try:
        if not cuda.math_sdp_enabled():
            return False
        params = cuda.SDPAParams(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
        fused = ((cuda.flash_sdp_enabled(), cuda.can_use_flash_attention),
                 (cuda.mem_efficient_sdp_enabled(), cuda.can_use_efficient_attention),
                 (cuda.cudnn_sdp_enabled(), cuda.can_use_cudnn_attention))
        return not any(enabled and can_use(params, False) for enabled, can_use in fused)
    except Exception:  # (a torch whose checks differ: leave the call to torch)
        return False


def math_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False, *, precision: str | None = None):
    """SDPA's math path with the products on fastmm: softmax(q k^T * scale + mask) v.

    As torch's math path: the scale's square root multiplies q and k^T each (the scores stay in
    range for large head sizes), a negative scale's sign goes with q; ``is_causal`` is a lower
    triangular mask of L x S aligned at the top left; a boolean mask keeps the True positions; a
    float mask is added; rows with no position to attend give zeros (``_safe_softmax``); with
    ``enable_gqa`` each key head serves ``q_heads / k_heads`` query heads in turn, each value head
    ``q_heads / v_heads``. Those query heads are rows of one product with their key (value) head
    where their strides allow a view (decode's single query row; the probabilities, always),
    instead of k (v) repeated per query head as torch's math path does: the same sums, without
    the copy, in fewer and taller products."""
    if is_causal and attn_mask is not None:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    size = 1.0 / math.sqrt(query.size(-1)) if scale is None else abs(scale)
    root = math.sqrt(size)
    q = query * (-root if scale is not None and scale < 0 else root)
    hq = hk = hv = None  # (heads are read only for grouped queries: SDPA takes 2-D q, k, v too)
    if enable_gqa:  # (key and value heads each divide the query heads; torch's check and words)
        hq, hk, hv = query.size(-3), key.size(-3), value.size(-3)
        if hq % hk or hq % hv:
            raise RuntimeError("Number of heads in key and value must divide the number of heads in ")
    # grouped-query heads: the query heads a key head serves become rows of one product (a view
    # where the layout allows: decode's single query row, a contiguous q), not k repeated per head
    folded = _heads_as_rows(q, hk)
    k = key if folded is not None else key.repeat_interleave(hq // hk, dim=-3)
    scores = _matmul(q if folded is None else folded, k.transpose(-2, -1) * root, precision=precision)
    if folded is not None and folded is not q:  # (back to [..., q heads, L, S])
        scores = scores.reshape(scores.shape[:-3] + q.shape[-3:-1] + scores.shape[-1:])
    if is_causal:
        L, S = query.size(-2), key.size(-2)
        attn_mask = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=scores.dtype).masked_fill_(~attn_mask, float("-inf"))
        # torch adds the mask in place: a mask that would broadcast the scores to a larger shape
        # is an error there (here out of place: fastmm's product may be a view autograd guards)
        grown = torch.broadcast_shapes(scores.shape, attn_mask.shape)
        if grown != scores.shape:
            raise RuntimeError(f"output with shape {list(scores.shape)} doesn't match the broadcast shape {list(grown)}")
        scores = scores + attn_mask
    probs = torch.ops.aten._safe_softmax(scores, -1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p, training=True)
    folded = _heads_as_rows(probs, hv)
    if folded is None:
        return _matmul(probs, value.repeat_interleave(hq // hv, dim=-3), precision=precision)
    out = _matmul(folded, value, precision=precision)
    return out if folded is probs else out.reshape(out.shape[:-3] + probs.shape[-3:-1] + out.shape[-1:])


def _heads_as_rows(t: torch.Tensor, heads: int | None) -> torch.Tensor | None:
    """``t`` of shape [..., H, L, E] as [..., heads, (H / heads) * L, E] (the H / heads
    consecutive heads that share a key or value head stacked as rows), a view of ``t``; ``t``
    itself where ``heads`` is H or None (no grouped queries); None where its strides allow no
    such view (those heads' rows are not one evenly strided run)."""
    if heads is None or heads == t.size(-3):
        return t
    H, L, E = t.shape[-3:]
    if L != 1 and t.stride(-3) != L * t.stride(-2):
        return None
    return t.view(t.shape[:-3] + (heads, (H // heads) * L, E))
