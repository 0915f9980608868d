"""``fastmm.patch(model, functional=...)``: the functional matmuls of a patched model's forward
(``torch.matmul`` / ``@`` / ``F.linear`` ... called by the model's own code, not by a module patch
converts) routed to fastmm, and the hooks that do it.

On a CPU fastmm's kernels do not run (its ops hand the product to torch), so these tests check
fastmm's decisions: which calls became fastmm ops (``fastmm.coverage`` names them ``fastmm::*``;
torch's own products are ``aten::*``), with which precision, which modules carry hooks, what is
on the torch function mode stack where; not torch-vs-torch numbers.
"""
from __future__ import annotations

import copy
import io
import math
import threading
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import fastmm
import fastmm.api
import fastmm.ops
from fastmm import patching
from fastmm.patching import FastmmMode


# ---------------------------------------------------------------------------------------------
# helpers

def fastmm_modes() -> list:
    return [m for m in torch.overrides._get_current_function_mode_stack() if isinstance(m, FastmmMode)]


def assert_clean() -> None:
    """No mode left on the stack, nothing left on the hooks' per-thread record."""
    assert torch._C._len_torch_function_stack() == 0
    assert patching._entries() == []


def hooked(model, kind) -> list[str]:
    """Names of the modules of ``model`` carrying a pre-hook of this kind."""
    return [n for n, m in model.named_modules() if any(isinstance(h, kind) for h in m._forward_pre_hooks.values())]


def ops_of(report, phase=None) -> Counter:
    return Counter(e.op for e in report.entries if phase is None or e.phase == phase)


def aten_products(report) -> list:
    """torch's own float32 products (not fastmm ops, not SDPA's attention core)."""
    return [e for e in report.entries if e.op.startswith("aten::") and e.where == "torch"]


@pytest.fixture(autouse=True)
def _clean_after():
    old = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(old)
    assert_clean()


def functional(products) -> list[str]:
    """The precisions of the batched products (the functional ones of these models)."""
    return [p for a, b, p in products if len(a) == 3 and len(b) == 3]


@pytest.fixture
def products(monkeypatch):
    """Every product fastmm's eager route computes: (a shape, b shape, precision)."""
    seen = []
    real = fastmm.ops.compute

    def compute(a, b, out, precision):
        seen.append((tuple(a.shape), tuple(b.shape), precision))
        return real(a, b, out, precision)

    for module in (fastmm.api, fastmm.ops):
        monkeypatch.setattr(module, "compute", compute)
    return seen


class Attention(torch.nn.Module):
    """Projections (nn.Linear: converted) around a functional core, as Hugging Face's eager
    attention: a module-level function doing ``torch.matmul`` and ``@``."""

    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.o = torch.nn.Linear(d, d)
        self.stack_seen = []  # FastmmModes on the stack after the projections, per call

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        self.stack_seen.append(len(fastmm_modes()))
        return self.o(core(q, k, v))


def core(q, k, v):
    weights = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v


class Block(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.attn = Attention(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class Net(torch.nn.Module):
    def __init__(self, d=16, layers=2):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.head = torch.nn.Linear(d, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_net(seed=0, **kw):
    torch.manual_seed(seed)
    return Net(**kw)


def x_in(seed=1):
    torch.manual_seed(seed)
    return torch.randn(2, 5, 16)


def tiny_llama(attn=None, layers=2):
    """A 2-layer LlamaForCausalLM, hidden size 16; ``attn=None``: transformers' default (SDPA)."""
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=50, attn_implementation=attn)
    return tf.LlamaForCausalLM(cfg)


IDS = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))


def rotary_matmul(model) -> bool:
    """Whether this transformers' LlamaRotaryEmbedding computes ``inv_freq @ positions`` (5.17
    does; 5.24 multiplies elementwise)."""
    return patching._makes_routed_calls(model.model.rotary_emb)


def llama_loss(out):
    return out.loss


# ---------------------------------------------------------------------------------------------
# the option

def test_functional_is_on_by_default_and_validated():
    model = fastmm.patch(make_net())
    assert hooked(model, patching._Enter) == ["blocks.0.attn", "blocks.1.attn"]  # the candidates
    off = fastmm.patch(make_net(), functional=False)
    assert hooked(off, patching._HOOKS) == []
    with pytest.raises(ValueError):
        fastmm.patch(make_net(), functional="yes")


def test_functional_matmuls_are_routed_forward_and_backward():
    ours, ref = fastmm.patch(make_net()), fastmm.patch(make_net(), functional=False)
    report = fastmm.coverage(ours, x_in())
    assert not aten_products(report)  # every float32 product of the step is a fastmm op
    assert ops_of(report, "forward") == {"fastmm::linear": 2 * 6 + 1, "fastmm::matmul": 2 * 2}
    # fastmm's own autograd: each Linear's two gradient products from one linear_grads call (both
    # needed: the input is made from earlier layers), the attention products' one by one
    backward = ops_of(report, "backward")
    assert backward == {"fastmm::linear_grads": (2 * 6 + 1) * 2, "fastmm::matmul": 2 * 2 * 2}, backward
    untouched = fastmm.coverage(ref, x_in())
    assert ops_of(untouched, "forward")["aten::bmm"] == 2 * 2  # functional=False: torch's
    torch.testing.assert_close(ours(x_in()), ref(x_in()))


def test_the_mode_is_scoped_to_the_modules_that_need_it_and_the_converted_ones_are_shielded(products):
    model = fastmm.patch(make_net())
    model(x_in())  # probe
    assert hooked(model, patching._Enter) == ["blocks.0.attn", "blocks.1.attn"]
    assert hooked(model, patching._ShieldEnter) == [f"blocks.{i}.attn.{p}" for i in range(2) for p in "qkvo"]
    stacks = {}

    def record(name):
        def pre(module, args):
            stacks[name] = len(fastmm_modes())
        return pre

    model.blocks[0].attn.q.register_forward_pre_hook(record("q (shielded)"))
    model.blocks[0].mlp[0].register_forward_pre_hook(record("mlp (outside)"))
    model.blocks[0].attn.stack_seen.clear()
    products.clear()
    model(x_in())
    assert stacks == {"q (shielded)": 0, "mlp (outside)": 0}
    assert model.blocks[0].attn.stack_seen == [1]  # the mode is back after the shielded projections
    assert len(functional(products)) == 2 * 2  # each functional product once, on fastmm's op


def test_whole_forward_option(products):
    model = fastmm.patch(make_net(), functional="forward")
    assert hooked(model, patching._Enter) == [""]
    assert len(hooked(model, patching._ShieldEnter)) == 2 * 6 + 1
    model(x_in())
    assert len(functional(products)) == 2 * 2
    assert model.blocks[0].attn.stack_seen == [1]


def test_precision_reaches_the_functional_products(products):
    model = fastmm.patch(make_net(), precision="tf32x3")
    model(x_in())
    assert functional(products) == ["tf32x3"] * 4
    products.clear()
    torch.set_float32_matmul_precision("high")
    fastmm.patch(model)  # patched again without a precision: keeps tf32x3
    model(x_in())
    assert functional(products) == ["tf32x3"] * 4
    products.clear()
    plain = fastmm.patch(make_net())  # None: follows torch's setting at call time
    plain(x_in())
    assert functional(products) == ["tf32"] * 4


def test_a_candidate_that_routes_nothing_loses_its_hooks_after_a_train_and_an_eval_forward(products):
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)
            self.use_matmul = False

        def forward(self, x):
            return x @ x.transpose(-1, -2) if self.use_matmul else self.lin(x) * 2

    model = fastmm.patch(torch.nn.Sequential(Scaled()))
    assert hooked(model, patching._Enter) == ["0"]
    model(x_in())
    assert hooked(model, patching._Enter) == ["0"]  # probed in training mode only
    model.eval()
    model(x_in())
    assert hooked(model, patching._HOOKS) == []  # no cost from now on
    model[0].use_matmul = True  # (a branch neither probe saw: left to torch, as coverage shows)
    products.clear()
    model(x_in())
    assert functional(products) == []


def test_a_candidate_waiting_for_its_other_probe_is_parked_off_its_calls_and_woken_by_the_model(products):
    """Inference only (decode): a candidate probed in eval mode that routed nothing keeps waiting
    for a training-mode probe. Its hooks would do nothing on every call but cost Module's slow
    path, so they are parked on the model's watch; a training forward of the model puts them back
    in time for the probe, which then finds the branch that routes."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            return x @ x.transpose(-1, -2) if self.training else self.lin(x) * 2

    model = fastmm.patch(torch.nn.Sequential(Scaled())).eval()
    model(x_in())  # the eval probe: nothing routed
    assert hooked(model, patching._Enter) == ["0"] and hooked(model, patching._Watch) == []
    model(x_in())  # nothing to do: parked
    assert hooked(model, patching._Enter) == [] and hooked(model, patching._Watch) == [""]
    assert not model[0]._forward_hooks and not model[0]._forward_hooks_always_called
    assert_clean()
    model(x_in())
    assert hooked(model, patching._Enter) == []  # (still parked: eval was probed)
    products.clear()
    model.train()
    model(x_in())  # woken by the watch, probed in training mode: its product routed
    assert functional(products) == ["ieee"]
    assert hooked(model, patching._Enter) == ["0"] and model[0]._forward_pre_hooks
    assert_clean()


# ---------------------------------------------------------------------------------------------
# Hugging Face models

def test_llama_eager_attention_products_are_routed():
    model = fastmm.patch(tiny_llama("eager"))
    rotary = rotary_matmul(model)
    report = fastmm.coverage(model, input_ids=IDS, labels=IDS, loss=llama_loss)
    assert not aten_products(report), aten_products(report)
    # q @ k^T and attn @ v in two layers (and the rotary embedding's product, where it has one)
    assert ops_of(report, "forward")["fastmm::matmul"] == 2 * 2 + rotary
    assert hooked(model, patching._Enter) == ["model.layers.0.self_attn", "model.layers.1.self_attn"] \
        + ["model.rotary_emb"] * rotary
    off = fastmm.patch(tiny_llama("eager"), functional=False)
    left = aten_products(fastmm.coverage(off, input_ids=IDS, labels=IDS, loss=llama_loss))
    assert {e.module.split()[0] for e in left if e.phase == "forward"} == \
        {"LlamaAttention"} | ({"LlamaRotaryEmbedding"} if rotary else set())
    ref = tiny_llama("eager")
    torch.testing.assert_close(model(input_ids=IDS).logits, ref(input_ids=IDS).logits)


def test_llama_default_attention_keeps_no_mode_once_probed():
    model = fastmm.patch(tiny_llama())  # SDPA: the attention core is SDPA's, nothing functional
    assert model.config._attn_implementation == "sdpa"
    report = fastmm.coverage(model, input_ids=IDS, labels=IDS, loss=llama_loss)
    assert not aten_products(report)
    assert report.counts()["attention"] > 0  # the one exception, reported
    model.eval()
    with torch.no_grad():
        model(input_ids=IDS)
    assert hooked(model, patching._HOOKS) == ["model.rotary_emb"] * rotary_matmul(model)


class RotaryEmbedding(torch.nn.Module):
    """transformers' LlamaRotaryEmbedding as it was (5.17, the GPU machine's version, too):
    ``inv_freq_expanded @ position_ids_expanded`` in float32 with autocast off, under no_grad."""

    def __init__(self, dim=8):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        with torch.autocast(device_type=x.device.type, enabled=False):
            freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def test_a_rotary_embedding_matmul_is_routed():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rotary = RotaryEmbedding()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            cos, sin = self.rotary(x, torch.arange(x.shape[1])[None].expand(x.shape[0], -1))
            return self.proj(x * cos + x * sin)

    model = fastmm.patch(Model())
    assert hooked(model, patching._Enter) == ["rotary"]  # (found through its decorator)
    report = fastmm.coverage(model, torch.randn(2, 5, 8))
    assert ops_of(report, "forward") == {"fastmm::matmul": 1, "fastmm::linear": 1}
    assert not aten_products(report)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_gpt2_and_bert_eager_attention_products_are_routed(name):
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
        model, loss = tf.GPT2LMHeadModel(cfg), llama_loss
        kwargs = {"input_ids": IDS, "labels": IDS}
    else:
        cfg = tf.BertConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                            vocab_size=50, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                            attn_implementation="eager")
        model, loss = tf.BertModel(cfg), None
        kwargs = {"input_ids": IDS}
    fastmm.patch(model)
    report = fastmm.coverage(model, loss=loss, **kwargs)
    assert not aten_products(report), aten_products(report)
    assert ops_of(report, "forward")["fastmm::matmul"] == 2


# ---------------------------------------------------------------------------------------------
# unpatch, exceptions, nesting, threads, copies

def test_unpatch_removes_every_hook():
    model = fastmm.patch(make_net())
    model(x_in())
    assert hooked(model, patching._HOOKS)
    fastmm.unpatch(model)
    assert hooked(model, patching._HOOKS) == []
    assert all(not m._forward_hooks and not m._forward_hooks_always_called for m in model.modules())
    report = fastmm.coverage(model, x_in())
    assert not [e for e in report.entries if e.op.startswith("fastmm::")]


def test_patching_again_probes_again_without_doubling_hooks():
    model = fastmm.patch(make_net())
    model(x_in())
    fastmm.patch(model)
    fastmm.patch(model)
    for m in model.modules():
        assert len(m._forward_pre_hooks) == len(m._forward_hooks) <= 1
    assert all(not h.routes and not h.probed for m in model.modules() for h in m._forward_pre_hooks.values()
               if isinstance(h, patching._Enter))


class Boom(Exception):
    pass


@pytest.mark.parametrize("probed", [False, True])
@pytest.mark.parametrize("where", ["functional", "shielded"])
def test_an_exception_in_the_forward_leaves_no_mode_on_the_stack(probed, where):
    model = fastmm.patch(make_net())
    if probed:
        model(x_in())
    attn = model.blocks[1].attn
    if where == "functional":
        def raise_after(module, args, out):
            raise Boom()
        hook = attn.v.register_forward_hook(raise_after)  # inside the routed module
    else:
        def raise_inside(module, args):
            raise Boom()
        hook = attn.o.register_forward_pre_hook(raise_inside)  # inside a shielded projection
    with pytest.raises(Boom):
        model(x_in())
    assert_clean()
    hook.remove()
    model(x_in())  # and it works after
    assert_clean()


def test_a_pre_hook_that_raises_before_ours_leaves_the_stack_alone():
    model = fastmm.patch(make_net())
    model(x_in())
    attn = model.blocks[0].attn

    def fail(module, args):
        raise Boom()

    attn.register_forward_pre_hook(fail, prepend=True)  # runs before fastmm's
    with pytest.raises(Boom):
        model(x_in())
    assert_clean()


def test_inside_use_fastmm_the_users_mode_decides(products):
    model = fastmm.patch(make_net())
    model(x_in())
    products.clear()
    with fastmm.use_fastmm("tf32x3", devices=("cpu",)) as mode:
        model(x_in())
        assert fastmm_modes() == [mode]
    assert model.blocks[0].attn.stack_seen[-1] == 1  # no second mode stacked
    assert functional(products) == ["tf32x3"] * 4


def test_nested_patched_models_and_a_model_called_inside_itself_stack_one_mode():
    class Recursive(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 16))
            self.depths = []

        def forward(self, x, depth=2):
            self.depths.append(len(fastmm_modes()))
            y = torch.matmul(x, self.w)
            if depth:
                y = self(y, depth - 1)
            self.depths.append(len(fastmm_modes()))
            return y

    rec = fastmm.patch(Recursive())
    for _ in range(2):  # the probe, then the routed module
        rec.depths.clear()
        report = fastmm.coverage(rec, x_in())
        assert rec.depths == [1] * 6
        assert ops_of(report, "forward") == {"fastmm::matmul": 3}
    net = make_net()
    fastmm.patch(net.blocks[0])
    fastmm.patch(net)  # the outer patch replaces the inner one's hooks: one pair per module
    for m in net.modules():
        assert len(m._forward_pre_hooks) == len(m._forward_hooks) <= 1
    for _ in range(2):
        net(x_in())
        net.blocks[0](x_in())
    assert set(net.blocks[0].attn.stack_seen) == {1}


def test_threads_keep_their_own_stack():
    model = fastmm.patch(make_net())
    errors = []
    barrier = threading.Barrier(4)

    def run():
        try:
            barrier.wait()
            for _ in range(5):
                model(x_in())
            assert torch._C._len_torch_function_stack() == 0 and patching._entries() == []
        except Exception as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert set(model.blocks[0].attn.stack_seen) == {1}


def test_deepcopy_and_torch_save_keep_the_routing():
    model = fastmm.patch(make_net())
    model(x_in())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert hooked(other, patching._Enter) == hooked(model, patching._Enter)
        hook = next(h for h in other.blocks[0].attn._forward_pre_hooks.values() if isinstance(h, patching._Enter))
        assert hook.routes
        report = fastmm.coverage(other, x_in())
        assert not aten_products(report)
        torch.testing.assert_close(other(x_in()), model(x_in()))


def test_the_inference_fast_path_of_a_transformer_encoder_is_kept():
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = fastmm.patch(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)).eval()
    assert hooked(model, patching._HOOKS) == []  # nothing inside the converted attention is a candidate


# ---------------------------------------------------------------------------------------------
# torch.compile

def graph_ops(graphs) -> Counter:
    return Counter(str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"
                   and "fastmm" in str(n.target))


@pytest.mark.parametrize("probe_first", [False, True])
def test_compiled_patched_model_has_the_functional_products_as_fastmm_ops(probe_first):
    torch._dynamo.reset()
    model = fastmm.patch(make_net())
    if probe_first:
        model(x_in())
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = x_in().requires_grad_()
    y = compiled(x)
    y.sum().backward()
    assert_clean()
    assert graph_ops(graphs) == {"fastmm.linear": 2 * 6 + 1, "fastmm.matmul": 2 * 2}
    torch.testing.assert_close(y, model(x_in()))
    with fastmm.use_fastmm(devices=("cpu",)) as mode:  # an outer mode: the compiled call leaves it be
        compiled(x_in())
        assert fastmm_modes() == [mode]
    compiled(x_in())
    assert_clean()


def test_compiled_llama_eager_backend():
    torch._dynamo.reset()
    model = fastmm.patch(tiny_llama("eager"))
    ref = tiny_llama("eager")
    compiled = torch.compile(model, backend="eager")
    out = compiled(input_ids=IDS, labels=IDS)
    out.loss.backward()
    torch.testing.assert_close(out.logits, ref(input_ids=IDS).logits)
    explanation = torch._dynamo.explain(model)(input_ids=IDS)
    assert explanation.graph_break_count == 0
    code = "".join(g.code for g in explanation.graphs)
    assert code.count("fastmm.matmul") == 2 * 2 + rotary_matmul(model) and "torch.matmul" not in code


# ---------------------------------------------------------------------------------------------
# which modules are candidates (read from their code)

def helper(a, b):
    return torch.bmm(a, b)


def deeper(a, b):
    return helper(a, b)


class _Cases:
    class At(torch.nn.Module):
        def forward(self, a, b):
            return a @ b

    class InPlaceAt(torch.nn.Module):
        def forward(self, a, b):
            a @= b
            return a

    class Linear(torch.nn.Module):
        def forward(self, x, w):
            return F.linear(x, w)

    class Helper(torch.nn.Module):
        def forward(self, a, b):
            return deeper(a, b)

    class Method(torch.nn.Module):
        def forward(self, a, b):
            return self._scores(a, b).softmax(-1)

        def _scores(self, a, b):
            return a.matmul(b)

    class Lambda(torch.nn.Module):
        def forward(self, a, b):
            return (lambda: torch.mm(a, b))()

    class Attention(torch.nn.Module):  # (SDPA: routed where torch would take its math path)
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    class Elementwise(torch.nn.Module):
        def forward(self, a, b):
            return torch.relu(a * b + a).sum(-1)

    class Submodule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.ReLU()

        def forward(self, x):
            return self.inner(x) + 1


@pytest.mark.parametrize("name,expected", [("At", True), ("InPlaceAt", True), ("Linear", True), ("Helper", True),
                                           ("Method", True), ("Lambda", True), ("Attention", True), ("Elementwise", False),
                                           ("Submodule", False)])
def test_candidates_are_read_from_the_code(name, expected):
    assert patching._makes_routed_calls(getattr(_Cases, name)()) is expected


def test_a_module_found_by_the_probe_but_not_read_from_the_code_gets_hooks():
    class Hidden(torch.nn.Module):  # the product hides behind getattr: no candidate
        def forward(self, a):
            return getattr(torch, "mat" + "mul")(a, a.transpose(-1, -2))

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden = Hidden()
            self.w = torch.nn.Parameter(torch.randn(16, 16))

        def forward(self, x):
            return self.hidden(x @ self.w)

    model = fastmm.patch(Outer())
    assert hooked(model, patching._Enter) == [""]
    report = fastmm.coverage(model, x_in())
    assert ops_of(report, "forward") == {"fastmm::matmul": 2}
    assert hooked(model, patching._Enter) == ["", "hidden"]  # found inside the probe of the outer one
