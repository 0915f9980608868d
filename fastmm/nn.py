"""``fastmm.nn.Linear``: a ``torch.nn.Linear`` whose matmul runs on fastmm.

It is a subclass of ``torch.nn.Linear`` with the same constructor, parameters and state_dict keys,
so checkpoints load both ways and ``isinstance(m, torch.nn.Linear)`` still holds. The forward is
:func:`fastmm.ops.linear`: ``x @ weight.t()`` (the transposed weight is a view: fastmm reads it
K-contiguous, nothing is copied), x's leading dims folded into one product, the bias added in
place on the fresh result; in eager mode through an autograd.Function (no custom-op dispatch
per call), under torch.compile as the registered op ``fastmm::linear``.

Cases fastmm does not compute go to ``torch.nn.functional.linear`` unchanged:
- inputs or parameters that are not plain float32 tensors (fastmm computes float32 only), or that
  are on a device type other than CUDA and CPU (meta, mps, ...; on CPU the fastmm op itself hands
  the product to ``torch.matmul``, so CPU runs take the same op, autograd and compile path);
- ``torch.autocast`` with a half dtype (float16/bfloat16) active for the input's device type:
  autocast's rules say such a matmul runs in half precision, and torch does that.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import ops
from .api import matmul as fastmm_matmul
from .precision import autocast_any_half_active, autocast_half_active, resolve_precision, resolve_precision_eager

__all__ = ["Linear", "MultiheadAttention", "plain_tensor"]

_OP_DEVICES = ("cuda", "cpu")
_PLAIN_TYPES, _FLOAT32, _STRIDED = (torch.Tensor, torch.nn.Parameter), torch.float32, torch.strided


def plain_tensor(t) -> bool:
    """A strided float32 ``torch.Tensor`` (or Parameter), not a tensor subclass and not nested:
    what the fastmm op takes. Subclasses (DTensor, ...) and nested tensors (ragged rows) keep
    their own matmul semantics. (Three calls per Linear forward: the module's constants spare
    the lookups through ``torch``.)"""
    return type(t) in _PLAIN_TYPES and t.dtype == _FLOAT32 and t.layout == _STRIDED and not t.is_nested


class Linear(torch.nn.Linear):
    """``torch.nn.Linear(in_features, out_features, bias=True, device=None, dtype=None)`` computed
    by fastmm.

    ``precision``: ``None`` (default) resolves at every call through
    :func:`fastmm.resolve_precision`, so ``torch.set_float32_matmul_precision`` /
    ``torch.backends.cuda.matmul.allow_tf32`` are honoured as they are when the call runs;
    ``"ieee"``, ``"tf32"`` or ``"tf32x3"`` fix it for this layer. It is a plain attribute (not
    saved in the state_dict).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 precision: str | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if precision is not None:
            resolve_precision(precision)  # validates the name
        self.precision = precision

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # The Parameters straight from their dict where they are there (Module.__getattr__ costs
        # ~1 us a lookup, on every call of every layer); a parametrized weight or bias is not
        # (a property computes it): read as attributes then.
        params = self._parameters
        weight = params["weight"] if "weight" in params else self.weight
        bias = params["bias"] if "bias" in params else self.bias
        if not (plain_tensor(input) and plain_tensor(weight) and (bias is None or plain_tensor(bias))) \
                or input.dim() == 0 or not (input.is_cuda or input.is_cpu):
            return F.linear(input, weight, bias)
        if ops.tracing_or_in_dispatch_mode():  # (plain tensors checked above)
            if autocast_half_active("cuda" if input.is_cuda else "cpu"):
                return F.linear(input, weight, bias)
            return torch.ops.fastmm.linear(input, weight, bias, resolve_precision(self.precision))
        # eager, every call of every layer: torch's C test of "any autocast on" first
        if autocast_any_half_active(input):
            return F.linear(input, weight, bias)
        return ops.linear_eager(input, weight, bias, resolve_precision_eager(self.precision))

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", precision={self.precision!r}" if self.precision is not None else "")

    # -----------------------------------------------------------------------------------------
    # conversion, sharing the Parameter objects (no copies)

    @classmethod
    def from_linear(cls, module: torch.nn.Linear, *, precision: str | None = None) -> "Linear":
        """A fastmm ``Linear`` that uses ``module``'s own Parameters (the same objects: optimizers,
        tied weights and hooks on the parameters keep working). The module's attributes, mode
        (train/eval) and module hooks are carried over; ``module`` itself is not changed."""
        if not isinstance(module, torch.nn.Linear):
            raise TypeError(f"from_linear expects a torch.nn.Linear, got {type(module).__name__}")
        if precision is not None:
            resolve_precision(precision)
        new = cls.__new__(cls)
        _share_state(module, new)
        new.precision = precision
        return new

    def to_linear(self) -> torch.nn.Linear:
        """A plain ``torch.nn.Linear`` using this module's Parameters (the same objects)."""
        new = torch.nn.Linear.__new__(torch.nn.Linear)
        _share_state(self, new)
        new.__dict__.pop("precision", None)
        return new


def _share_state(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Give ``dst`` the instance state of ``src``: the same Parameters, buffers, children and
    attributes, in containers of its own (so registering a parameter or hook on one later does not
    change the other)."""
    for key, value in src.__dict__.items():
        if isinstance(value, (dict, set)):  # _parameters, _buffers, _modules, hook tables, ...
            value = type(value)(value)
        dst.__dict__[key] = value
    # Module.compile() stores a compiled call bound to src; dst must not run src's forward
    if dst.__dict__.get("_compiled_call_impl") is not None:
        dst.__dict__["_compiled_call_impl"] = None


# ---------------------------------------------------------------------------------------------
# nn.MultiheadAttention with its projections on fastmm

class MultiheadAttention(torch.nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` whose projections run on fastmm (:func:`fastmm.ops.linear`)
    and whose attention core is ``F.scaled_dot_product_attention`` (its own kernels); with
    ``need_weights=True`` the scores and the weighted sum are fastmm products too, since the
    weights must be returned. Same parameters and state_dict as the module it was made from
    (:func:`fastmm.patch` turns one into the other in place). Options fastmm does not implement
    (``bias_k`` / ``bias_v``, ``add_zero_attn``, non-float32 tensors, autocast to a half dtype)
    run torch's own forward."""

    precision: str | None = None

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        tensors = (query, key, value)
        if self.bias_k is not None or self.add_zero_attn or not all(plain_tensor(t) for t in tensors) \
                or query.device.type not in _OP_DEVICES or autocast_half_active(query.device.type) \
                or not all(plain_tensor(p) for p in self.parameters()):
            return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                                   attn_mask=attn_mask, average_attn_weights=average_attn_weights,
                                   is_causal=is_causal)
        batched = query.dim() == 3
        self_attention = query is key and key is value  # (one in_proj product for all three)
        if not batched:
            query, key, value = (t.unsqueeze(1) for t in tensors)
            key_padding_mask = key_padding_mask.unsqueeze(0) if key_padding_mask is not None else None
        # The projections run on the inputs as they are laid out (batch-first rows stay rows): a
        # transposed view's rows do not fold into one matrix, so its product and its weight
        # gradient would each read a copy (and miss the remembered steady-state entries).
        seq_first = not (batched and self.batch_first)
        if seq_first:
            L, N, E = query.shape
            S = key.shape[0]
        else:
            N, L, E = query.shape
            S = key.shape[1]
        H, D = self.num_heads, self.head_dim
        if self._qkv_same_embed_dim:
            wq, wk, wv = self.in_proj_weight.chunk(3)
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        bq = bk = bv = None
        if self.in_proj_bias is not None:
            bq, bk, bv = self.in_proj_bias.chunk(3)
        prec = self.precision
        if self._qkv_same_embed_dim and self_attention:
            q, k, v = ops.linear(query, self.in_proj_weight, self.in_proj_bias, prec).chunk(3, dim=-1)
        else:
            q, k, v = ops.linear(query, wq, bq, prec), ops.linear(key, wk, bk, prec), ops.linear(value, wv, bv, prec)
        def heads(t, length):  # (length, N, H*D) or (N, length, H*D) -> (N, H, length, D)
            return (t.reshape(length, N, H, D).permute(1, 2, 0, 3) if seq_first
                    else t.reshape(N, length, H, D).transpose(1, 2))

        q, k, v = heads(q, L), heads(k, S), heads(v, S)
        mask = _additive_mask(attn_mask, key_padding_mask, N, H, L, S, q.dtype)
        dropout = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = fastmm_matmul(q, k.transpose(-1, -2), precision=prec) * (D ** -0.5)
            if mask is not None:
                scores = scores + mask
            elif is_causal:
                scores = scores.masked_fill(torch.ones(L, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
            weights = torch.softmax(scores, dim=-1)
            probs = F.dropout(weights, dropout) if dropout > 0 else weights
            out = fastmm_matmul(probs, v, precision=prec)
            weights = weights.mean(dim=1) if average_attn_weights else weights
            if not batched:
                weights = weights.squeeze(0)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 is_causal=is_causal and mask is None)
        if seq_first:
            out = out.permute(2, 0, 1, 3).reshape(L, N, E)
        else:
            out = out.transpose(1, 2).reshape(N, L, E)
        out = ops.linear(out, self.out_proj.weight, self.out_proj.bias, prec)
        if not batched:
            out = out.squeeze(1)
        return out, weights


def _additive_mask(attn_mask, key_padding_mask, N, H, L, S, dtype):
    """torch MHA's two masks as one float mask broadcastable to (N, H, L, S): True (bool) means
    "may not attend" there, as in nn.MultiheadAttention; float masks are added."""
    mask = None
    if attn_mask is not None:
        m = attn_mask
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
        mask = m.reshape(N, H, L, S) if m.dim() == 3 else m
    if key_padding_mask is not None:
        kp = key_padding_mask
        if kp.dtype == torch.bool:
            kp = torch.zeros(kp.shape, dtype=dtype, device=kp.device).masked_fill(kp, float("-inf"))
        kp = kp.reshape(N, 1, 1, S)
        mask = kp if mask is None else mask + kp
    return mask

