"""The issue's bar on a GPU (skipped without CUDA): in a patched model's forward and backward no
float32 CUDA product is left on torch, the attention core inside a fused SDPA kernel excepted (and
reported); functional products (eager attention, SDPA's math path, a rotary embedding's
``inv_freq @ positions``) included."""
from __future__ import annotations

import pytest
import torch

import fastmm
from test_patching_functional import RotaryEmbedding

pytestmark = pytest.mark.cuda


def llama(attn, kv_heads=1):
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=kv_heads, vocab_size=1000, attn_implementation=attn)
    return tf.LlamaForCausalLM(cfg).cuda()


@pytest.mark.parametrize("precision", [None, "tf32x3"])
@pytest.mark.parametrize("attn, kv_heads", [("eager", 1), ("sdpa", 1), ("sdpa", 4)])
def test_patched_llama_leaves_no_float32_product_on_torch(attn, kv_heads, precision):
    """Grouped-query SDPA in float32 takes torch's math path, which fastmm routes at a precision
    torch does not compute at (tf32x3: its products on fastmm) and leaves torch's at torch's own
    (None), reported as attention; with as many key heads as query heads a fused kernel takes
    the call and stays torch's, reported as attention."""
    model = fastmm.patch(llama(attn, kv_heads), precision=precision)
    ids = torch.randint(0, 1000, (2, 64), device="cuda")
    for _ in range(2):  # the probe forward, then the routed modules
        report = fastmm.coverage(model, input_ids=ids, labels=ids, loss=lambda out: out.loss)
        model.zero_grad(set_to_none=True)
        assert not report.on_torch(), str(report)
        counts = report.counts()
        assert counts["fastmm"] > 0
        torchs = attn == "sdpa" and (kv_heads == 4 or precision is None)
        assert (counts["attention"] > 0) == torchs  # SDPA's core on torch: the one exception, reported
    assert torch._C._len_torch_function_stack() == 0


def test_a_rotary_embedding_product_runs_on_fastmm():
    rotary = fastmm.patch(RotaryEmbedding(64).cuda())
    x = torch.randn(2, 128, 64, device="cuda")
    report = fastmm.coverage(rotary, x, torch.arange(128, device="cuda")[None].expand(2, -1),
                             backward=False)
    assert [e.op for e in report.entries] == ["fastmm::matmul"]
    assert not report.on_torch(), str(report)
