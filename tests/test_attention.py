"""fastmm.attention: SDPA's math path with fastmm's products, and when the functional routing takes it.

The numbers come from the emulated GPU (conftest.emulated_gpu: fastmm's own plans and launch
arguments compute the products on the CPU) against a float64 softmax written out here, not
against torch's SDPA; the routing tests check fastmm's decisions (which calls became fastmm
launches), not torch against torch.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastmm import attention, patching
from fastmm.attention import math_attention, takes_math_path
from fastmm.patching import FastmmMode


@pytest.fixture
def gpu(emulated_gpu, monkeypatch):
    """The emulated GPU, its memory check off: the products' operands are made by torch's own
    elementwise ops (the scaled q and k^T, the softmax), which the emulation does not track."""
    import emulation

    monkeypatch.setattr(emulation, "CHECK_MEMORY", False)
    return emulated_gpu


def reference(q, k, v, mask=None, causal=False, scale=None, gqa=False):
    """softmax(q k^T * scale + mask) v in float64, rows with nothing to attend giving 0."""
    q, k, v = q.double(), k.double(), v.double()
    if gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    s = torch.einsum("...le,...se->...ls", q, k) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    L, S = s.shape[-2:]
    keep = torch.ones(L, S, dtype=torch.bool)
    if causal:
        keep = torch.arange(S)[None, :] <= torch.arange(L)[:, None]
    if mask is not None and mask.dtype == torch.bool:
        keep = keep & mask
    elif mask is not None:
        s = s + mask.double()
    s = s.masked_fill(~keep, float("-inf"))
    top = s.amax(-1, keepdim=True)
    w = torch.where(keep, torch.exp(s - torch.where(torch.isinf(top), 0.0, top)), 0.0)
    total = w.sum(-1, keepdim=True)
    p = torch.where(total > 0, w / torch.where(total > 0, total, 1.0), 0.0)
    return torch.einsum("...ls,...se->...le", p, v)


def inputs(gqa: bool, L=37, S=45, E=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, L, E, generator=g)
    k = torch.randn(2, 2 if gqa else 4, S, E, generator=g)
    v = torch.randn(2, 2 if gqa else 4, S, E, generator=g)
    return q, k, v


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "float"])
@pytest.mark.parametrize("scale", [None, 0.3, -0.2])
def test_the_math_path_on_fastmm_products_matches_a_float64_softmax(gpu, gqa, mask_kind, scale):
    q, k, v = inputs(gqa, seed=hash((gqa, mask_kind, scale)) % 1000)
    g = torch.Generator().manual_seed(1)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(37, 45, generator=g) > 0.3
        mask[3] = False  # a row with nothing to attend: zeros, as _safe_softmax gives
    elif mask_kind == "float":
        mask = torch.randn(2, 1, 37, 45, generator=g)
    causal = mask_kind == "causal"
    before = [t.clone() for t in (q, k, v)]
    got = math_attention(q, k, v, mask, 0.0, causal, scale, gqa)
    assert len(gpu.launches) >= 2  # q @ k^T and p @ v ran fastmm's plans
    want = reference(q, k, v, mask, causal, scale, gqa)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)
    if mask_kind == "bool":
        assert torch.count_nonzero(got[:, :, 3]) == 0
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), before))  # inputs untouched


def test_gradients_of_the_math_path_match_float64(gpu):
    q, k, v = (t.requires_grad_() for t in inputs(gqa=True, L=19, S=23))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = torch.randn(2, 4, 19, 16, generator=torch.Generator().manual_seed(3))
    math_attention(q, k, v, None, 0.0, True, None, True).backward(g)
    reference(q64, k64, v64, causal=True, gqa=True).backward(g.double())
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=5e-5)


def test_key_and_value_heads_each_serve_their_own_share_of_the_query_heads(gpu):
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 8, 9, 16, generator=g), torch.randn(2, 2, 11, 16, generator=g), \
        torch.randn(2, 4, 11, 16, generator=g)
    want = torch.einsum("bhls,bhse->bhle", torch.softmax(torch.einsum(
        "bhle,bhse->bhls", q.double(), k.double().repeat_interleave(4, dim=1)) / 4.0, -1),
        v.double().repeat_interleave(2, dim=1))
    torch.testing.assert_close(math_attention(q, k, v, enable_gqa=True).double(), want, rtol=0, atol=2e-5)
    # heads that do not divide the query heads: torch's error (never a broadcast or an empty result)
    for hq, hk, hv in ((1, 2, 2), (6, 4, 4), (8, 8, 3)):
        with pytest.raises(RuntimeError, match="Number of heads in key and value must divide"):
            math_attention(torch.randn(1, hq, 5, 8), torch.randn(1, hk, 5, 8), torch.randn(1, hv, 5, 8),
                           enable_gqa=True)


def test_a_mask_that_would_grow_the_scores_is_torchs_error(gpu):
    q, k, v = (torch.randn(2, 4, 5, 7) for _ in range(3))
    with pytest.raises(RuntimeError, match=r"output with shape \[2, 4, 5, 5\] doesn't match the broadcast shape "
                                           r"\[3, 2, 4, 5, 5\]"):
        math_attention(q, k, v, torch.randn(3, 2, 4, 5, 5))


def test_dropout_keeps_torchs_draws_and_scale(gpu):
    q, k, v = inputs(gqa=False, L=9, S=12)
    torch.manual_seed(7)
    got = math_attention(q, k, v, dropout_p=0.4)
    torch.manual_seed(7)
    want, _ = torch.ops.aten._scaled_dot_product_attention_math(q.double(), k.double(), v.double(), dropout_p=0.4)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)


def test_a_mask_with_is_causal_is_torchs_error():
    q, k, v = inputs(gqa=False)
    with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set when is_causal=True"):
        math_attention(q, k, v, torch.ones(37, 45, dtype=torch.bool), 0.0, True)


def test_dropout_of_every_weight_gives_zeros(gpu):
    q, k, v = inputs(gqa=False)
    assert torch.count_nonzero(math_attention(q, k, v, dropout_p=1.0)) == 0


def test_the_math_path_is_never_claimed_off_cuda():
    q, k, v = inputs(gqa=True)  # (the CPU's SDPA has a fused float32 kernel)
    assert not takes_math_path(q, k, v, None, 0.0, False, True)


# ---------------------------------------------------------------------------------------------
# the functional routing


@pytest.fixture
def math_path(monkeypatch):
    """torch 'would take its math path' for every call (on the CPU, where it would not)."""
    calls = []

    def says(q, k, v, mask, dropout_p, is_causal, gqa):
        calls.append((q.shape, k.shape, mask is None, dropout_p, is_causal, gqa))
        return True

    monkeypatch.setattr(patching, "takes_math_path", says)
    return calls


@pytest.mark.parametrize("form", ["positional", "keywords"])
def test_sdpa_on_the_math_path_runs_fastmms_products(gpu, math_path, form):
    q, k, v = inputs(gqa=True)
    mask = torch.rand(37, 45, generator=torch.Generator().manual_seed(2)) > 0.2
    with FastmmMode("tf32x3", devices=("cpu",)):  # (a precision torch's math path does not compute)
        if form == "positional":
            got = F.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=0.3, enable_gqa=True)
        else:
            got = F.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert math_path == [(q.shape, k.shape, False, 0.0, False, True)]
    assert len(gpu.launches) >= 2
    torch.testing.assert_close(got.double(), reference(q, k, v, mask, scale=0.3, gqa=True), rtol=0, atol=2e-5)


def test_sdpa_stays_torchs_where_a_fused_kernel_takes_it_or_the_inputs_are_not_fastmms(gpu, monkeypatch):
    q, k, v = inputs(gqa=False)
    monkeypatch.setattr(patching, "takes_math_path", lambda *a: False)  # a fused kernel applies
    with FastmmMode("tf32x3", devices=("cpu",)):
        F.scaled_dot_product_attention(q, k, v)
    assert gpu.launches == []
    monkeypatch.setattr(patching, "takes_math_path", lambda *a: True)
    with FastmmMode("tf32x3", devices=("cpu",)):
        F.scaled_dot_product_attention(q.double(), k.double(), v.double())  # not float32
        with pytest.raises(RuntimeError, match="Expected attn_mask dtype to be bool or float"):  # torch's own error
            F.scaled_dot_product_attention(q, k, v, torch.ones(37, 45, dtype=torch.int32))
    assert gpu.launches == []
    with FastmmMode("tf32x3"):  # the mode's devices: CUDA only
        F.scaled_dot_product_attention(q, k, v)
    assert gpu.launches == []


@pytest.mark.parametrize("torch_setting", ["ieee", "tf32"])
def test_the_math_path_is_routed_only_where_fastmm_computes_other_than_torchs_own_products(
        gpu, math_path, torch_setting):
    """At the precision torch's float32 setting names (and with precision None, which follows
    it) fastmm's products compute what torch's math path does: the call stays torch's (less
    host time); tf32x3, and the precision torch is not set to, are routed."""
    from fastmm.attention import computes_as_torch
    from fastmm.precision import torch_precision

    q, k, v = inputs(gqa=True)
    other = "tf32" if torch_setting == "ieee" else "ieee"
    with torch_precision(torch_setting):
        assert computes_as_torch(None) and computes_as_torch(torch_setting)
        assert not computes_as_torch(other) and not computes_as_torch("tf32x3")
        for precision, routed in ((None, False), (torch_setting, False), (other, True), ("tf32x3", True)):
            before = len(gpu.launches)
            with FastmmMode(precision, devices=("cpu",)):
                got = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            assert (len(gpu.launches) > before) == routed, precision
            if routed:
                torch.testing.assert_close(got.double(), reference(q, k, v, gqa=True), rtol=0, atol=1e-3)


def test_the_route_passes_the_modes_precision_and_leaves_compile_and_nested_calls_to_torch(gpu, math_path, monkeypatch):
    seen = []
    monkeypatch.setattr(patching, "math_attention", lambda *args, precision: seen.append(precision) or args[0])
    q, k, v = inputs(gqa=False)
    mode = FastmmMode("tf32x3", devices=("cpu",))
    assert mode._sdpa((q, k, v), {"enable_gqa": True}) is q and seen == ["tf32x3"]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert mode._sdpa((q, k, v), {}) is NotImplemented  # (inductor has its own SDPA patterns)
    monkeypatch.undo()
    monkeypatch.setattr(patching, "takes_math_path", lambda *a: True)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (torch: nested tensors are a prototype)
        nested = torch.nested.nested_tensor([torch.randn(4, 3, 16), torch.randn(4, 5, 16)])
    assert mode._sdpa((nested, nested, nested), {}) is NotImplemented
    assert seen == ["tf32x3"]


@pytest.mark.parametrize("precision", ["tf32x3", None])
def test_a_patched_sdpa_llama_keeps_its_attention_routed_where_torch_takes_the_math_path(math_path, precision):
    """tf32x3: the attention modules keep their hooks and SDPA's products run on fastmm. At
    torch's own precision (None) the math path stays torch's (reported as attention) and the
    attention modules lose their hooks (no mode around their other torch calls)."""
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=50)
    model = tf.LlamaForCausalLM(cfg)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    ref = tf.LlamaForCausalLM(cfg)
    ref.load_state_dict(model.state_dict())
    import fastmm

    model = fastmm.patch(model, precision=precision)
    report = fastmm.coverage(model, input_ids=ids, labels=ids, loss=lambda out: out.loss)
    sdpa_products = [e for e in report.entries if e.op == "fastmm::matmul" and e.phase == "forward"
                     and len(e.shapes[0]) == 4]
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)  # (the eval-mode probe: a module that routed in neither loses its hooks)
    model.train()
    hooked = [n for n, m in model.named_modules()
              if any(isinstance(h, patching._Enter) for h in m._forward_pre_hooks.values())]
    if precision == "tf32x3":
        assert math_path, "the SDPA calls were not offered to the route"
        assert report.counts()["attention"] == 0  # no attention core left on torch
        assert len(sdpa_products) == 2 * 2  # q @ k^T and p @ v in each layer
        assert "model.layers.0.self_attn" in hooked and "model.layers.1.self_attn" in hooked
    else:
        assert report.counts()["attention"] > 0 and not sdpa_products  # torch's math path, reported
        assert not any("self_attn" in n for n in hooked), hooked
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_the_module_reads_no_environment_and_imports_no_cuda_at_import():
    assert "os" not in vars(attention) and "cuda" not in vars(attention)


@pytest.mark.parametrize("layout", ["contiguous", "seq_first", "seq_first_one_row"])
def test_grouped_query_heads_become_rows_of_one_product_where_the_layout_allows(gpu, layout, monkeypatch):
    """Each key (value) head's share of the query heads is stacked as rows of one product, with
    no copy of k or v per query head, where q's (the probabilities') strides allow a view: a
    contiguous q, and decode's single query row in the [B, L, H, E] layout Hugging Face
    transposes; other layouts repeat k as torch's math path does. The values match float64."""
    L = 1 if layout == "seq_first_one_row" else 9
    g = torch.Generator().manual_seed(11)
    if layout == "contiguous":
        q = torch.randn(2, 8, L, 16, generator=g)
    else:
        q = torch.randn(2, L, 8, 16, generator=g).transpose(1, 2)
    k, v = torch.randn(2, 2, 13, 16, generator=g), torch.randn(2, 4, 13, 24, generator=g)
    p = torch.softmax(torch.einsum("bhle,bhse->bhls", q.double(), k.double().repeat_interleave(4, dim=1)) / 4.0, -1)
    want = torch.einsum("bhls,bhse->bhle", p, v.double().repeat_interleave(2, dim=1))
    shapes = []
    real = attention._matmul

    def spy(a, b, **kw):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, **kw)

    monkeypatch.setattr(attention, "_matmul", spy)
    repeats = []
    real_repeat = torch.Tensor.repeat_interleave
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda t, *a, **kw: repeats.append(t.shape) or real_repeat(t, *a, **kw))
    got = math_attention(q, k, v, enable_gqa=True)
    assert got.shape == (2, 8, L, 24)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)
    if layout == "seq_first":
        assert shapes[0] == ((2, 8, L, 16), (2, 8, 16, 13)) and repeats == [k.shape]  # k repeated per query head
    else:
        assert shapes[0] == ((2, 2, 4 * L, 16), (2, 2, 16, 13)) and repeats == []
    assert shapes[1] == ((2, 4, 2 * L, 13), (2, 4, 13, 24))  # (the probabilities are contiguous)


def test_q_k_v_without_a_heads_dimension_are_taken_as_torch_takes_them(gpu):
    """SDPA takes 2-D q, k, v (no heads, no batch): the math path reads heads only for grouped
    queries."""
    g = torch.Generator().manual_seed(12)
    q, k, v = torch.randn(7, 16, generator=g), torch.randn(9, 16, generator=g), torch.randn(9, 8, generator=g)
    got = math_attention(q, k, v)
    assert got.shape == (7, 8) and len(gpu.launches) >= 2
    torch.testing.assert_close(got.double(), reference(q, k, v), rtol=0, atol=2e-5)


@pytest.mark.parametrize("precision, other", [("ieee", "tf32"), ("tf32", "ieee")])
def test_a_patch_at_torchs_own_precision_routes_once_torchs_setting_changes(math_path, precision, other):
    """patch(model, precision) probed while torch computes at that precision leaves SDPA's math
    path to torch, with the attention modules' hooks dormant (no mode around their calls); set
    torch to another precision later and the same model routes it, at the precision asked for
    (the probe's choice must not outlive torch's setting)."""
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    import fastmm
    from fastmm.precision import torch_precision

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=50)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    model = fastmm.patch(tf.LlamaForCausalLM(cfg), precision=precision)

    def sdpa_on_fastmm():
        report = fastmm.coverage(model, input_ids=ids, labels=ids, loss=lambda out: out.loss)
        products = [e for e in report.entries if e.op == "fastmm::matmul" and e.phase == "forward"
                    and len(e.shapes[0]) == 4]
        return len(products), report.counts()["attention"]

    with torch_precision(precision):
        for training in (True, False):  # (the probes)
            model.train(training)
            with torch.no_grad():
                model(input_ids=ids)
        model.train()
        assert sdpa_on_fastmm() == (0, 4)  # torch's math path: each layer's core, forward and backward
        # dormant, the attention modules' hooks are parked on the model's watch: no hooks on
        # their calls (Module._call_impl's slow path), one check a forward of the model
        attention = [m for n, m in model.named_modules() if n.endswith("self_attn")]
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in attention)
        watch = next(h for h in model._forward_pre_hooks.values() if isinstance(h, patching._Watch))
        assert [m for m, _ in watch.parked] == attention
        hooks = [h for _, h in watch.parked]
        assert all(h.dormant and not h.routes for h in hooks)
    with torch_precision(other):
        assert sdpa_on_fastmm() == (2 * 2, 0)  # q @ k^T and p @ v of each layer on fastmm
        assert all(h.routes for h in hooks)  # (routed modules from then on)
    with torch_precision(precision):  # set back: the route declines, torch's math path again
        assert sdpa_on_fastmm() == (0, 4)
