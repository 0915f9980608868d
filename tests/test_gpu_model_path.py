"""The model path and the failure paths on a real GPU (skipped without CUDA): folded products,
linear / addmm with their epilogues and gradients against float64, patched attention, coverage
of a patched model, a kernel the driver refuses to launch, and a workspace that does not fit.
Tolerances as tests/test_gpu.py: relative Frobenius error vs float64."""
from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import fastmm
from fastmm import dispatch, fast_path
from fastmm.families import SimtCpAsync
from fastmm.precision import torch_precision

pytestmark = pytest.mark.cuda

TOL = {"ieee": 1e-5, "tf32": 1e-3, "tf32x3": 1e-6}
PRECISIONS = ("ieee", "tf32", "tf32x3")
NAN = float("nan")


def randn(*shape):
    return torch.randn(*shape, device="cuda")


def rel(x, ref) -> float:
    ref = ref.double()
    return ((x.double() - ref).norm() / ref.norm()).item()


def tol(precision: str, k: int) -> float:
    return TOL[precision] + math.sqrt(k) * 2.0 ** -24


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", [(4, 256, 1024, 2816), (3, 17, 64, 33), (2, 1, 4096, 4096), (5, 7, 129, 3)])
def test_an_nd_input_times_a_linear_weight_is_one_folded_product(shape, precision):
    B, S, K, N = shape
    x, w = randn(B, S, K), randn(N, K)
    plan = fastmm.explain(x, w.t(), precision=precision)
    assert plan.kernel is not None and plan.shapes["M"] == B * S and plan.shapes["batch"] == ()
    y = fastmm.matmul(x, w.t(), precision=precision)
    assert y.shape == (B, S, N) and not torch.isnan(y).any()
    assert rel(y, x.double() @ w.double().t()) <= tol(precision, K)
    again = fastmm.matmul(x, w.t(), precision=precision)  # the steady-state path
    assert torch.equal(again, y)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", [(4, 197, 1024, 1024), (3, 50, 192, 160), (2, 7, 129, 3)])
@pytest.mark.parametrize("weight", ["row_major", "w_t"])
def test_rows_no_view_merges_are_copied_then_the_copys_entry_serves_every_call(shape, precision, weight):
    """A seq-first view (a compiled backward hands attention's gradients over so) times a weight,
    row-major (grad_x's form) or nn.Linear's W^T: one product of all rows on a copy, the copy's
    own entry from the second call on; fresh values in the same buffers each call, the result
    right against float64 every time and a never written."""
    B, S, K, N = shape
    a_sf, w = randn(S, B, K), randn(N, K) if weight == "w_t" else randn(K, N)
    a = a_sf.transpose(0, 1)  # (B, S, K): rows merge only by a copy
    b = w.t() if weight == "w_t" else w
    for call in range(3):
        with torch.no_grad():
            a_sf.normal_(), w.normal_()
        a0 = a.clone()
        y = fastmm.matmul(a, b, precision=precision)
        assert y.shape == (B, S, N) and y.is_contiguous() and not torch.isnan(y).any()
        assert rel(y, a0.double() @ b.double()) <= tol(precision, K)
        assert torch.equal(a, a0)
    assert fast_path.ENTRIES.get(fast_path.key_of(a, b, None, precision)) is fast_path.FOLD_BY_COPY


def test_a_folded_product_into_an_out_it_cannot_view_is_computed_aside():
    a, b = randn(4, 6, 32), randn(32, 48)
    out = torch.full((6, 4, 48), NAN, device="cuda").transpose(0, 1)
    assert fastmm.matmul(a, b, out=out, precision="ieee") is out
    assert rel(out, a.double() @ b.double()) <= tol("ieee", 32)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_forward_and_gradients_match_float64(precision, bias):
    torch.manual_seed(1)
    x = randn(4, 64, 256).requires_grad_()
    w = randn(384, 256).requires_grad_()
    b = randn(384).requires_grad_() if bias else None
    g = randn(4, 64, 384)
    y = fastmm.linear(x, w, b, precision=precision)
    y.backward(g)
    refs = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b)]
    want = F.linear(*refs)
    want.backward(g.double())
    assert rel(y, want) <= tol(precision, 256)
    assert rel(x.grad, refs[0].grad) <= tol(precision, 384)
    assert rel(w.grad, refs[1].grad) <= tol(precision, 4 * 64)
    if bias:
        assert rel(b.grad, refs[2].grad) <= 1e-6


def test_backward_products_run_on_fastmm_kernels(monkeypatch):
    """Every product of a Linear layer's forward and backward is planned onto a fastmm kernel:
    recorded where the full path plans (first calls) and checked for a kernel."""
    plans = []
    real = dispatch.run

    def recording(*args, **kwargs):
        plan = real(*args, **kwargs)
        plans.append(plan)
        return plan

    monkeypatch.setattr(dispatch, "run", recording)
    fast_path.forget_plans()
    layer = fastmm.nn.Linear(96, 80).cuda()
    x = randn(3, 40, 96).requires_grad_()
    layer(x).sum().backward()
    assert len(plans) == 3 and all(p.kernel is not None for p in plans), [p.fallback for p in plans]
    assert plans[2].problem.K == 3 * 40  # grad_W: one product over every token


@pytest.mark.parametrize("beta,alpha", [(1, 1), (0, 2.0), (0.5, -1.0)])
def test_addmm_matches_float64_and_beta_zero_ignores_nan(beta, alpha):
    a, b = randn(300, 200), randn(200, 500)
    c = torch.full((500,), NAN, device="cuda") if beta == 0 else randn(500)
    got = fastmm.addmm(c, a, b, beta=beta, alpha=alpha, precision="ieee")
    want = alpha * (a.double() @ b.double()) + (0 if beta == 0 else beta * c.double())
    assert not torch.isnan(got).any() and rel(got, want) <= tol("ieee", 200)


@pytest.mark.parametrize("need_weights", [True, False])
def test_patched_multihead_attention_matches_torch(need_weights):
    torch.manual_seed(2)
    ref = torch.nn.MultiheadAttention(256, 8, batch_first=True).cuda()
    mha = torch.nn.MultiheadAttention(256, 8, batch_first=True).cuda()
    mha.load_state_dict(ref.state_dict())
    fastmm.patch(mha, precision="ieee")
    q, kv = randn(4, 50, 256), randn(4, 70, 256)
    pad = torch.zeros(4, 70, dtype=torch.bool, device="cuda")
    pad[0, -5:] = True
    got, got_w = mha(q, kv, kv, key_padding_mask=pad, need_weights=need_weights)
    want, want_w = ref(q, kv, kv, key_padding_mask=pad, need_weights=need_weights)
    assert rel(got, want) <= 1e-5
    if need_weights:
        assert rel(got_w, want_w) <= 1e-5


def test_a_patched_encoder_runs_every_product_on_fastmm():
    layer = torch.nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True)
    model = fastmm.patch(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).cuda())
    report = fastmm.coverage(model, randn(4, 64, 256))
    assert report.counts()["fastmm"] > 0 and not report.on_torch(), str(report)


# --- failures: a refused launch, a workspace that does not fit -----------------------------------

@dataclasses.dataclass(frozen=True)
class _TooManyThreads(SimtCpAsync):
    """The cp.async family with a launch geometry no GPU takes (2048 threads a block), standing
    for a bad tuned entry."""

    def configure(self, p, dev, option=None):
        cfg = super().configure(p, dev, option)
        return dataclasses.replace(cfg, block=2048, block_dims=(2048, 1, 1))


def test_a_launch_the_driver_refuses_falls_back_to_torch_with_a_warning():
    a, b = randn(512, 384), randn(384, 640)
    bad = (_TooManyThreads(),)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, plan, reason = dispatch.matmul_fastmm(a, b, None, "ieee", variants=bad)
    assert reason is not None and "could not be" in reason and plan.kernel is None
    assert any(issubclass(w.category, fastmm.FastmmWarning) for w in caught)
    assert rel(result, a.double() @ b.double()) <= tol("ieee", 384)
    again, plan2, reason2 = dispatch.matmul_fastmm(a, b, None, "ieee", variants=bad)  # remembered
    assert reason2 == reason and rel(again, a.double() @ b.double()) <= tol("ieee", 384)
    good = fastmm.matmul(a, b, precision="ieee")  # the registry's family is untouched
    assert fastmm.explain(a, b, precision="ieee").kernel == "simt_cp_async"
    assert rel(good, a.double() @ b.double()) <= tol("ieee", 384)


def _free_large_blocks() -> list[int]:
    """Sizes of the free blocks the caching allocator holds in its large pool, where a workspace
    of 1 MiB or more comes from."""
    return [blk["size"] for seg in torch.cuda.memory_snapshot() if seg["segment_type"] == "large"
            for blk in seg["blocks"] if blk["state"] == "inactive"]


def _fill_free_blocks() -> list[torch.Tensor]:
    """Tensors that take every free block of the large pool: ``empty_cache`` releases only whole
    free segments, and a block of 1-10 MiB comes out of a 20 MiB segment that a tensor kept alive
    by an earlier test may share. Each filler asks for a free block's exact size, which the
    allocator's best fit serves from that block. (Free blocks of the small pool's 2 MiB segments
    are left alone: a filler of their size would come from the large pool, in a new segment with
    room to spare.)"""
    return [torch.empty(size, dtype=torch.uint8, device="cuda") for size in sorted(_free_large_blocks())]


def test_a_workspace_that_does_not_fit_raises_torchs_oom_and_the_next_call_works():
    torch.cuda.empty_cache()
    a, b = randn(256, 65536), randn(65536, 256)
    plan = fastmm.explain(a, b, precision="ieee").plan
    assert plan.kernel.split_k > 1  # a split-K plan: its workspace is allocated per call
    fast_path.forget_plans()
    out = torch.empty(256, 256, device="cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no cached free block the workspace could reuse ...
    fillers = _fill_free_blocks()  # ... nor one left in a segment that earlier tests still use
    free = _free_large_blocks()
    assert not free, f"free large-pool blocks the workspace could take: {sorted(free)[-4:]}"
    allowed = torch.cuda.memory_reserved() + (1 << 20)  # 1 MiB more than held now: no 8 MiB workspace
    torch.cuda.set_per_process_memory_fraction(allowed / total)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            fastmm.matmul(a, b, out=out, precision="ieee")
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    del fillers
    prepared = [h for h in dispatch.PLANS.prepared.values() if h.plan.problem.K == 65536]
    assert prepared and all(h.plan.kernel is not None and h.kernel is not None for h in prepared)
    out.fill_(NAN)
    fastmm.matmul(a, b, out=out, precision="ieee")
    assert rel(out, a.double() @ b.double()) <= tol("ieee", 65536)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("layout", ["2d", "3d", "seq_first", "frozen_weight", "frozen_input_g_seq_first"])
def test_a_repeat_linear_backward_gives_the_first_backwards_gradients(precision, layout):
    """From the second backward of a layout on, a Linear's two products come from one remembered
    entry (fast_path.LinearGradsEntry; the formula where x's or g's rows merge only by a copy): on
    the same inputs, the same gradients as the first backward bit for bit, and float64's."""
    fast_path.forget_plans()
    torch.manual_seed(3)
    layer = fastmm.nn.Linear(192, 160, precision=precision).cuda()
    if layout == "frozen_weight":
        layer.requires_grad_(False)
    need_x, need_w = layout != "frozen_input_g_seq_first", layout != "frozen_weight"
    shape = (150, 192) if layout == "2d" else (50, 3, 192) if layout == "seq_first" else (3, 50, 192)
    x0 = randn(3, 50, 192).transpose(0, 1) if layout == "seq_first" else randn(*shape)
    g = randn(50, 3, 160).transpose(0, 1) if layout == "frozen_input_g_seq_first" else randn(*shape[:-1], 160)
    results = []
    for _ in range(3):
        x = x0.detach().requires_grad_(need_x)
        layer.zero_grad(set_to_none=True)
        layer(x).backward(g)
        results.append((x.grad, layer.weight.grad, layer.bias.grad))
    key = fast_path.linear_grads_key(g, x0, layer.weight, precision, need_x, need_w,
                                     g.data_ptr(), x0.data_ptr(), layer.weight.data_ptr())
    in_place = layout not in ("seq_first", "frozen_input_g_seq_first")
    got_entry = fast_path.ENTRIES.get(key)
    assert type(got_entry) is fast_path.LinearGradsEntry if in_place else got_entry is fast_path.NOT_FAST
    for later in results[1:]:
        for got, first in zip(later, results[0]):
            assert (got is None) == (first is None)
            assert got is None or torch.equal(got, first)
    x64, w64, g64 = x0.double(), layer.weight.detach().double(), g.double()
    gx, gw, gb = results[-1]
    if need_x:
        assert rel(gx, g64 @ w64) <= tol(precision, 160)
    else:
        assert gx is None
    if need_w:
        assert rel(gw, g64.reshape(-1, 160).t() @ x64.reshape(-1, 192)) <= tol(precision, 150)
        assert rel(gb, g64.reshape(-1, 160).sum(0)) <= 1e-6
    else:
        assert gw is None and gb is None


class _InOut(torch.nn.Module):
    """x @ W + b with W stored [in, out] (GPT-2's Conv1D form)."""

    def __init__(self, k, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(k, n))
        self.bias = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        return x @ self.weight + self.bias


@pytest.mark.parametrize("precision", PRECISIONS)
def test_an_in_out_layer_matches_float64_and_repeats_its_gradients(precision):
    """A registered [in, out] layer on the GPU: forward without gradients (F.linear's path on
    W^T's view), and forward + backward three times (the repeats from one remembered entry): the
    gradients bit-equal to the first backward's, the weight gradient in W's own layout, all
    within the precision's tolerance of float64."""
    fast_path.forget_plans()
    torch.manual_seed(4)
    fastmm.register_linear_like(_InOut, layout="in_out")
    layer = fastmm.patch(torch.nn.Sequential(_InOut(192, 160)).cuda(), precision=precision)[0]
    x0, g = randn(3, 50, 192), randn(3, 50, 160)
    w64, b64, x64, g64 = (t.detach().double() for t in (layer.weight, layer.bias, x0, g))
    with torch.no_grad():
        assert rel(layer(x0), x64 @ w64 + b64) <= tol(precision, 192)
    grads = []
    for _ in range(3):
        x = x0.detach().requires_grad_()
        layer.zero_grad(set_to_none=True)
        layer(x).backward(g)
        grads.append((x.grad, layer.weight.grad, layer.bias.grad))
    for later in grads[1:]:
        assert all(torch.equal(a, c) for a, c in zip(later, grads[0]))
    gx, gw, gb = grads[-1]
    assert gw.stride() == (160, 1)
    assert rel(gx, g64 @ w64.t()) <= tol(precision, 160)
    assert rel(gw, x64.reshape(150, 192).t() @ g64.reshape(150, 160)) <= tol(precision, 150)
    assert rel(gb, g64.reshape(150, 160).sum(0)) <= 1e-6


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("rows", [1, 77], ids=["decode", "prefill"])
def test_grouped_query_sdpa_in_hugging_faces_layout_matches_float64(precision, rows):
    """q, k, v as a Hugging Face attention hands them over ([B, L, H, E] transposed to
    [B, H, L, E]): decode's single query row folds each key head's query heads into the rows of
    one product; a longer q repeats k per query head. Both products and the four of the backward
    on fastmm; output and gradients within the precision's tolerance of float64."""
    torch.manual_seed(6)
    q = randn(2, rows, 16, 64).transpose(1, 2).requires_grad_()
    k, v = (randn(2, 93, 4, 64).transpose(1, 2).requires_grad_() for _ in range(2))
    g = randn(2, 16, rows, 64)
    from fastmm.coverage import coverage

    def run():  # (torch set to another precision: the route takes only what torch would not compute)
        with fastmm.use_fastmm(precision), torch_precision("tf32" if precision == "ieee" else "ieee"):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    report = coverage(run, backward=True, loss=lambda out: (out * g).sum())
    assert report.counts()["fastmm"] == 2 + 4 and report.counts()["attention"] == 0, report.entries
    q.grad = k.grad = v.grad = None
    out = run()
    assert out.shape == (2, 16, rows, 64) and out.grad_fn is not None
    out.backward(g)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q64, k64, v64, enable_gqa=True)
    want.backward(g.double())
    bound = tol(precision, 93)
    assert rel(out, want) <= bound
    for got, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert rel(got, ref) <= 4 * bound


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("mask_kind", ["causal", "bool", "none"])
def test_grouped_query_sdpa_on_the_math_path_runs_fastmm_and_matches_float64(precision, mask_kind):
    """Float32 SDPA with enable_gqa (torch's math path on CUDA) under the functional routing:
    both products and the four of the backward on fastmm (a dispatch mode sees fastmm ops, no
    aten product), output and gradients within the precision's tolerance of float64; without
    grouped queries torch's fused kernel keeps the call."""
    from fastmm import attention
    from fastmm.coverage import coverage

    torch.manual_seed(5)
    q = randn(2, 8, 200, 64).requires_grad_()
    k, v = (randn(2, 2, 230, 64).requires_grad_() for _ in range(2))
    mask = (torch.rand(200, 230, device="cuda") > 0.2) if mask_kind == "bool" else None
    causal = mask_kind == "causal"
    assert attention.takes_math_path(q, k, v, mask, 0.0, causal, True)
    g = randn(2, 8, 200, 64)

    def run():  # (torch set to another precision: the route takes only what torch would not compute)
        with fastmm.use_fastmm(precision), torch_precision("tf32" if precision == "ieee" else "ieee"):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)

    report = coverage(run, backward=True, loss=lambda out: (out * g).sum())
    places = {e.op: e.where for e in report.entries}
    assert report.counts()["fastmm"] == 2 + 4 and report.counts()["attention"] == 0, report.entries
    assert all(where == "fastmm" for op, where in places.items() if op.startswith("fastmm::")), places
    out = run()
    q.grad = k.grad = v.grad = None
    out.backward(g)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    m64 = None if mask is None else torch.zeros(200, 230, dtype=torch.float64, device="cuda").masked_fill(~mask, -math.inf)
    want = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=m64, is_causal=causal, enable_gqa=True)
    want.backward(g.double())
    bound = tol(precision, 230)
    assert rel(out, want) <= bound
    for got, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert rel(got, ref) <= 4 * bound
    if mask_kind == "none":  # without grouped queries memory-efficient attention takes float32: torch's
        kk, vv = (randn(2, 8, 230, 64) for _ in range(2))
        assert not attention.takes_math_path(q, kk, vv, None, 0.0, False, False)
