"""``fastmm.nn.Linear``: a ``torch.nn.Linear`` whose matmul runs on fastmm.

It is a subclass of ``torch.nn.Linear`` with the same constructor, parameters and state_dict keys,
so checkpoints load both ways and ``isinstance(m, torch.nn.Linear)`` still holds. The forward is
``torch.ops.fastmm.matmul(x, weight.t(), precision)`` (the transposed weight is a view: fastmm
reads it column-major, nothing is copied) followed by the bias add.

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

from .api import autocast_half_active, resolve_precision

__all__ = ["Linear", "plain_tensor"]

_OP_DEVICES = ("cuda", "cpu")


def plain_tensor(t) -> bool:
    """A strided float32 ``torch.Tensor`` (or Parameter), not a tensor subclass: what the fastmm
    op takes. Subclasses (DTensor, nested, ...) keep their own matmul semantics."""
    return (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and t.dtype == torch.float32 \
        and t.layout == torch.strided


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
        weight, bias = self.weight, self.bias
        if not (plain_tensor(input) and plain_tensor(weight) and (bias is None or plain_tensor(bias))) \
                or input.dim() == 0 or input.device.type not in _OP_DEVICES \
                or autocast_half_active(input.device.type):
            return F.linear(input, weight, bias)
        out = torch.ops.fastmm.matmul(input, weight.t(), resolve_precision(self.precision))
        if bias is not None:
            # Out of place, so autograd and torch.compile see plain functional ops (torch.compile
            # fuses the add into one pointwise kernel; eager pays one more output-sized buffer).
            out = out + bias
        return out

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
