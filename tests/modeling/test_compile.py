"""torch.compile: both families train in one graph with every built-in gate (dropless and with capacity), compiled
training equals eager, and the static-cache decode step of `generate` compiles in one graph and decodes the same
tokens as eager greedy search."""

import pytest
import torch
import torch._dynamo
from helpers import GPT2_STYLE, tiny_gpt_config, tiny_seq2seq_config
from transformers import CompileConfig

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration

GATES = {
    "topk": dict(router_type="topk"),
    "topk-capacity": dict(router_type="topk", capacity_factor=0.5),
    "switch-jitter-capacity": dict(router_type="switch", num_experts_per_tok=1, capacity_factor=1.0, router_jitter_noise=0.1),
    "gshard": dict(router_type="gshard", capacity_factor=1.0, router_num_groups=2),
    "gshard-dropless": dict(router_type="gshard"),
    "prototype": dict(router_type="prototype"),
    "prototype-capacity": dict(router_type="prototype", capacity_factor=0.75),
}
ONE_LAYER = dict(num_hidden_layers=1)  # every layer traces alike; one keeps compile time down
FAMILIES = {
    "gpt": lambda **kw: GPTMoEForCausalLM(tiny_gpt_config(**ONE_LAYER, qk_norm=True, **kw)),  # Llama + Qwen3's q/k norms
    "gpt2-style": lambda **kw: GPTMoEForCausalLM(tiny_gpt_config(**GPT2_STYLE, **ONE_LAYER, **kw)),
    "seq2seq": lambda **kw: Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config(num_decoder_layers=1, **ONE_LAYER, **kw)),
}


def batch():
    ids = torch.randint(3, 97, (2, 8))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # padding: routed nowhere, left out of the router losses
    return dict(input_ids=ids, attention_mask=mask, labels=ids)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("family", ["gpt", "seq2seq"])
def test_training_forward_is_one_graph(family, gate):
    torch.manual_seed(0)
    model = FAMILIES[family](**GATES[gate]).train()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(**batch())
    assert explanation.graph_break_count == 0, [str(r.reason) for r in explanation.break_reasons]
    assert explanation.graph_count == 1


@pytest.mark.parametrize("family, gate", [("gpt2-style", "gshard"), ("seq2seq", "switch-jitter-capacity")])
def test_compiled_training_step_equals_eager(family, gate):
    """Forward and backward traced together (aot_eager: the backward graph too), fullgraph, against eager: same loss,
    router losses and gradients, with the same random routing draws."""
    torch.manual_seed(0)
    model = FAMILIES[family](**GATES[gate]).train()
    inputs = batch()

    def step(fn):
        model.zero_grad()
        torch.manual_seed(1)
        out = fn(**inputs)
        out.loss.backward()
        return out.loss.detach(), out.aux_loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, aux, grads = step(model)
    torch._dynamo.reset()
    c_loss, c_aux, c_grads = step(torch.compile(model, backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(c_loss, loss)
    torch.testing.assert_close(c_aux, aux)
    for g, ref in zip(c_grads, grads):
        torch.testing.assert_close(g, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", ["gpt", "seq2seq"])
def test_static_cache_decode_step_compiles_in_one_graph_and_equals_eager(family):
    """Transformers' compile path of generate (static cache + compile_config; fullgraph=True makes any graph break an
    error): the same tokens as eager greedy decoding with a dynamic cache, left padding included."""
    torch.manual_seed(0)
    model = FAMILIES[family](**GATES["gshard"]).eval()
    inputs = batch()
    inputs.pop("labels")
    reference = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    config = CompileConfig(fullgraph=True, backend="aot_eager", dynamic=False)
    config._compile_all_devices = True  # Transformers compiles the decode step on accelerators only by default
    torch._dynamo.reset()
    compiled_calls = []
    original = model.get_compiled_call
    model.get_compiled_call = lambda cfg: compiled_calls.append(cfg) or original(cfg)
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False, cache_implementation="static", compile_config=config)
    assert compiled_calls, "generate did not take its compiled decoding path"
    assert torch.equal(out, reference)


class GraphRecorder:
    """A torch.compile backend that keeps every graph it is given (one call = one compilation) and runs it eagerly."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def sdpa_calls(self):
        """(attn_mask, is_causal) of every scaled_dot_product_attention in the recorded graphs."""
        sdpa = torch._C._nn.scaled_dot_product_attention
        return [(n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None), n.kwargs.get("is_causal"))
                for g in self.graphs for n in g.graph.nodes if n.target is sdpa]


@pytest.fixture
def untraceable_autocast_query(monkeypatch):
    """torch 2.11's Dynamo cannot trace `torch.amp.is_autocast_available` (a builtin that 2.13 traces): a call to it
    from the traced path broke the graph in every MoE layer on the GPU. Here such a call fails under any torch."""
    real = torch.amp.is_autocast_available

    def refuse(device_type):
        if torch.compiler.is_compiling():
            raise RuntimeError("torch.amp.is_autocast_available called while tracing (a graph break on torch 2.11)")
        return real(device_type)

    monkeypatch.setattr(torch.amp, "is_autocast_available", refuse)


@pytest.mark.parametrize("family", ["gpt", "gpt2-style", "seq2seq"])
def test_whole_training_step_is_one_graph_without_padding(family, untraceable_autocast_query):
    """fullgraph=True over forward and backward (aot_eager traces the backward too) of a batch without a padding mask:
    one forward graph, no query that an older Dynamo cannot trace, the same loss and gradients as eager, and the
    decoder's self-attention on the causal kernel (no mask tensor, is_causal=True) rather than a materialised mask."""
    torch.manual_seed(0)
    model = FAMILIES[family](**GATES["topk"]).train()
    ids = torch.randint(3, 97, (2, 8))

    def step(fn):
        model.zero_grad()
        out = fn(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = step(model)
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    c_loss, c_grads = step(torch.compile(model, backend="aot_eager", fullgraph=True))
    assert counts["stats"]["unique_graphs"] == 1, dict(counts["stats"])
    torch.testing.assert_close(c_loss, loss)
    for g, ref in zip(c_grads, grads):
        torch.testing.assert_close(g, ref, atol=1e-6, rtol=1e-5)
    if family == "gpt":  # rotary GPT: nothing but causality in the self-attention's mask
        torch._dynamo.reset()
        dynamo_graphs = GraphRecorder()
        torch.compile(model, backend=dynamo_graphs, fullgraph=True)(input_ids=ids, labels=ids)
        calls = dynamo_graphs.sdpa_calls()
        assert calls and all(mask is None and causal for mask, causal in calls), calls


@pytest.mark.parametrize("families", [("gpt", "seq2seq"), ("gpt", "gpt")], ids=["gpt-then-seq2seq", "two-gpt"])
def test_static_cache_decoding_compiles_once_per_model_and_never_again(families, untraceable_autocast_query):
    """Transformers' compiled decode step (static cache, fullgraph=True) over 16 new tokens compiles one graph per
    architecture: no recompile from one step to the next, from one layer's cache to the next, or when a second model
    decodes in the same process and the first one decodes again."""
    config = CompileConfig(fullgraph=True, backend="eager", dynamic=False)
    config._compile_all_devices = True  # Transformers compiles the decode step on accelerators only by default
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    models = []
    for seed, family in enumerate(families):
        torch.manual_seed(seed)
        make_config = tiny_gpt_config if family == "gpt" else tiny_seq2seq_config
        model_class = GPTMoEForCausalLM if family == "gpt" else Seq2SeqMoEForConditionalGeneration
        models.append(model_class(make_config(num_hidden_layers=2, **GATES["topk"])).eval())
    ids = torch.randint(3, 97, (2, 6))

    def decode(model):
        before = counts["stats"]["unique_graphs"]
        model.generate(input_ids=ids, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                       cache_implementation="static", compile_config=config)
        return counts["stats"]["unique_graphs"] - before

    # a second model of the same architecture reuses the first one's graph (its weights are graph inputs)
    assert [decode(m) for m in models] == [1, int(families[1] != families[0])], dict(counts["recompiles"] or {})
    assert decode(models[0]) == 0, dict(counts["recompiles"] or {})
