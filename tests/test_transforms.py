"""fastmm under torch.func transforms (vmap, grad, vjp, jvp, jacrev; per-sample gradients with
functional_call): torch serves the call, at the precision asked for, and the result is torch's.
The transforms' wrapped tensors have no data pointer for fastmm's kernels, and fastmm's autograd
Functions carry no functorch rules: these calls raised before (a data pointer error, or
"must override the setup_context staticmethod"). Checked on the emulated GPU, where a call
fastmm serves records its launches: inside a transform none is made; outside, the same calls
launch fastmm's kernels again."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, jacrev, jvp, vmap

import fastmm

# jvp scripts its decompositions (torch.jit) on its first use, reading torch's factory functions,
# which the emulated GPU wraps: a first use here, before any test wraps them
jvp(lambda a: a * 2, (torch.ones(1),), (torch.ones(1),))


def close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_vmap_of_the_products_is_torchs(emulated_gpu):
    x, w, b, c = torch.randn(6, 3, 4), torch.randn(5, 4), torch.randn(5), torch.randn(3, 5)
    close(vmap(lambda a: fastmm.matmul(a, w.t(), precision="ieee"))(x), x @ w.t())
    close(vmap(lambda a: fastmm.linear(a, w, b, precision="tf32x3"))(x), x @ w.t() + b)
    close(vmap(lambda a: fastmm.addmm(c, a, w.t(), beta=0.5, alpha=2.0, precision="ieee"))(x),
          0.5 * c + 2.0 * (x @ w.t()))
    assert emulated_gpu.launches == []
    fastmm.matmul(x[0], w.t(), precision="ieee")  # outside the transform: fastmm's kernel again
    assert len(emulated_gpu.launches) == 1


def test_gradients_jacobians_and_tangents_through_the_products_are_torchs(emulated_gpu):
    x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    close(grad(lambda a: fastmm.linear(a, w, b, precision="ieee").square().sum())(x),
          grad(lambda a: F.linear(a, w, b).square().sum())(x))
    close(jacrev(lambda a: fastmm.matmul(a, w.t(), precision="ieee"))(x), jacrev(lambda a: a @ w.t())(x))
    t = torch.randn(3, 4)
    close(jvp(lambda a: fastmm.linear(a, w, b, precision="ieee"), (x,), (t,))[1], t @ w.t())
    close(vmap(grad(lambda a: fastmm.matmul(a, w.t(), precision="ieee").sum()))(torch.randn(6, 3, 4)),
          (torch.ones(3, 5) @ w).expand(6, 3, 4))
    assert emulated_gpu.launches == []


def test_per_sample_gradients_of_a_patched_model(emulated_gpu):
    """vmap(grad(...)) over functional_call: the per-sample gradients recipe, on a patched model
    (fastmm.nn.Linear layers), equals the unpatched model's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    patched = fastmm.patch(torch.nn.Sequential(*[m for m in model]), precision="ieee")
    assert isinstance(patched[0], fastmm.nn.Linear)
    params = {k: v.detach() for k, v in model.named_parameters()}
    xs, ys = torch.randn(10, 8), torch.randn(10, 3)

    def per_sample(m):
        def loss(p, x, y):
            return (functional_call(m, p, (x.unsqueeze(0),)) - y).square().sum()
        return vmap(grad(loss), in_dims=(None, 0, 0))(params, xs, ys)

    want, got = per_sample(model), per_sample(patched)
    for name in want:
        close(got[name], want[name])
    assert emulated_gpu.launches == []


def test_the_functional_routing_under_a_transform_does_not_route_torchs_call_back():
    """use_fastmm() routes torch.matmul to fastmm; fastmm hands a transform's call to torch with
    function modes off, so the call does not come back (no recursion)."""
    x, w = torch.randn(6, 3, 4), torch.randn(4, 5)
    with fastmm.use_fastmm(devices=("cpu",)):
        got = vmap(lambda a: torch.matmul(a, w))(x)
    close(got, x @ w)


@pytest.mark.parametrize("precision", ["ieee", "tf32", "tf32x3"])
def test_explain_inside_a_transform_says_torch_serves_it(emulated_gpu, precision):
    seen = []

    def f(a):
        seen.append(fastmm.explain(a, a.t(), precision=precision))
        return a.sum()

    vmap(f)(torch.randn(2, 3, 4))
    assert seen[0].kernel is None and "torch.func transform" in str(seen[0].fallback)
    assert fastmm.explain(torch.randn(3, 4), torch.randn(4, 3), precision=precision).kernel is not None
