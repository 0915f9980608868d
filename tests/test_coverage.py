"""``fastmm.coverage``: what it records and how it names a product left on torch (CPU: fastmm's
ops are recorded as ``fastmm::*`` with the reason the CPU fell back; torch's products as
``aten::*``), and that it works with the function mode ``patch`` puts around modules."""
from __future__ import annotations

from collections import Counter

import torch

import fastmm


class Scores(torch.nn.Module):
    def forward(self, q, k):
        return torch.matmul(q, k.transpose(-1, -2))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.scores = Scores()

    def forward(self, x):
        h = self.proj(x)
        return self.scores(h, h)


def test_a_product_left_on_torch_names_the_module_that_made_it():
    torch.manual_seed(0)
    model = fastmm.patch(Model(), functional=False)
    report = fastmm.coverage(model, torch.randn(2, 3, 8))
    left = [e for e in report.on_torch() if e.op.startswith("aten::")]
    forward = [e for e in left if e.phase == "forward"]
    assert [e.module for e in forward] == ["Scores scores"]
    assert forward[0].detail == "not routed through fastmm (in Scores.forward)"
    assert all(e.module == "" for e in left if e.phase == "backward")  # (no module runs the backward)
    assert "in Scores.forward" in str(report)


def test_with_the_functional_routing_nothing_is_left_and_a_dispatch_mode_sees_fastmm_ops():
    torch.manual_seed(0)
    model = fastmm.patch(Model())
    for _ in range(2):  # the probe forward, then the routed module
        report = fastmm.coverage(model, torch.randn(2, 3, 8))
        assert {e.op for e in report.entries} == {"fastmm::linear", "fastmm::matmul"}
        assert torch._C._len_torch_function_stack() == 0


def test_a_plain_function_can_be_covered():
    a = torch.randn(3, 4, requires_grad=True)
    report = fastmm.coverage(lambda t: t @ t.t(), a)
    assert [e.module for e in report.entries if e.phase == "forward"] == [""]


def test_the_products_of_sdpas_math_path_are_its_attention_core_forward_and_backward():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return out @ k.transpose(-1, -2)  # (a product of its own after it: torch's)

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8)
    for t in (q, k, v):
        t.requires_grad_()
    with sdpa_kernel(SDPBackend.MATH):  # decomposed: bmm, softmax, bmm
        report = fastmm.coverage(Attention(), q, k, v)
    where = Counter((e.phase, e.where) for e in report.entries)
    assert where[("forward", "attention")] == 2 and where[("backward", "attention")] == 4
    assert where[("forward", "torch")] == 1 and where[("backward", "torch")] == 2  # out @ k^T and its grads
    assert all("math path" in e.detail for e in report.entries if e.where == "attention")
