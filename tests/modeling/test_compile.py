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
