"""What serving engines that load Transformers models through Transformers' modeling code (vLLM's and SGLang's
"Transformers backend") rely on, checked as an engine would use it:

- every attention layer of both families runs the attention function the config names, looked up in Transformers'
  `AttentionInterface`, and passes it every keyword its caller gave the model (`_supports_attention_backend`);
- the `experts` module answers Transformers' experts interface: `forward(hidden_states, top_k_index, top_k_weights)`
  with 3-D expert weights, the same output as the MoE layer for the same routes and as Transformers' own Qwen3-MoE
  experts holding the same weights; `set_experts_implementation` switches kernels with equal outputs;
- the config keys they read.
"""

import pytest
import torch
from helpers import tiny_gpt_config, tiny_seq2seq_config
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.moe import MoELayer
from hf_ppmoe.moe.experts import Experts

CALLS = []
ENGINE_STATE = object()  # what an engine hands its attention function through the model (block tables, metadata, ...)


def recording_attention(module, query, key, value, attention_mask, **kwargs):
    CALLS.append((module, kwargs))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("recording_engine", recording_attention)


def attention_modules(model):
    return [m for name, m in model.named_modules() if name.endswith(("self_attn", "cross_attn"))]


@pytest.mark.parametrize("family", ["gpt", "seq2seq"])
def test_every_attention_layer_calls_the_registered_function_with_the_callers_keywords(family):
    torch.manual_seed(0)
    if family == "gpt":
        model = GPTMoEForCausalLM(tiny_gpt_config()).eval()
        inputs = dict(input_ids=torch.randint(3, 90, (2, 6)))
    else:
        model = Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config()).eval()
        inputs = dict(input_ids=torch.randint(3, 90, (2, 6)), decoder_input_ids=torch.randint(3, 90, (2, 4)))
    assert model._supports_attention_backend
    reference = model(**inputs).logits
    model.set_attn_implementation("recording_engine")
    CALLS.clear()
    logits = model(**inputs, engine_state=ENGINE_STATE).logits
    torch.testing.assert_close(logits, reference)  # the same kernel underneath
    called = {id(module) for module, kwargs in CALLS if kwargs.get("engine_state") is ENGINE_STATE}
    missing = [m for m in attention_modules(model) if id(m) not in called]
    assert not missing and len(CALLS) == len(attention_modules(model)), missing


def layer_and_routes(**overrides):
    torch.manual_seed(0)
    layer = MoELayer(tiny_gpt_config(**overrides)).eval()
    x = torch.randn(10, 32)
    routing = layer.gate(x, None)
    return layer, x, routing


@pytest.mark.parametrize("gate", [dict(router_type="topk"), dict(router_type="gshard", eval_capacity_factor=0.5)])
def test_experts_answer_transformers_experts_interface(gate):
    """`experts(hidden_states, top_k_index, top_k_weights)` (keywords as Transformers names them) equals the layer's
    output for the same routes, dropped routes (sentinel id, weight 0) included; the weights are 3-D."""
    layer, x, routing = layer_and_routes(**gate)
    experts = layer.experts
    assert experts.gate_up_proj.dim() == 3 and experts.down_proj.dim() == 3
    with torch.no_grad():
        out = experts(hidden_states=x, top_k_index=routing.expert_ids, top_k_weights=routing.weights)
        torch.testing.assert_close(out, layer(x)[0])


def test_experts_equal_transformers_qwen3_moe_experts_on_the_same_weights():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    layer, x, routing = layer_and_routes(moe_intermediate_size=24)
    theirs = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=4, hidden_act="silu"))
    theirs.config._experts_implementation = "eager"
    with torch.no_grad():
        theirs.gate_up_proj.copy_(layer.experts.gate_up_proj)
        theirs.down_proj.copy_(layer.experts.down_proj)
        torch.testing.assert_close(theirs(x, routing.expert_ids, routing.weights), layer.experts(x, routing.expert_ids, routing.weights))


@pytest.mark.parametrize("family", ["gpt", "seq2seq"])
def test_set_experts_implementation_switches_kernels_with_equal_outputs(family, tmp_path):
    torch.manual_seed(0)
    if family == "gpt":
        model, inputs = GPTMoEForCausalLM(tiny_gpt_config()).eval(), dict(input_ids=torch.randint(3, 90, (2, 7)))
    else:
        model = Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config()).eval()
        inputs = dict(input_ids=torch.randint(3, 90, (2, 6)), decoder_input_ids=torch.randint(3, 90, (2, 4)))
    assert model.config._experts_implementation == "index"  # ours by default, not Transformers' grouped_mm
    reference = model(**inputs).logits
    seen = []
    for name in ("einsum", "grouped_mm", "batched_mm", "index"):
        model.set_experts_implementation(name)
        experts = next(m for m in model.modules() if isinstance(m, Experts))
        seen.append(experts.experts_implementation)
        torch.testing.assert_close(model(**inputs).logits, reference, atol=1e-5, rtol=1e-5)
    assert seen == ["einsum", "grouped_mm", "batched_mm", "index"]
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, experts_implementation="einsum")
    assert loaded.config._experts_implementation == "einsum"
    torch.testing.assert_close(loaded(**inputs).logits, reference, atol=1e-5, rtol=1e-5)


def test_a_config_saved_with_dispatch_still_loads(caplog):
    config = tiny_gpt_config(dispatch="einsum")
    assert config._experts_implementation == "einsum" and "dispatch" not in config.to_dict()


@pytest.mark.parametrize("family", ["gpt", "seq2seq"])
def test_config_keys_engines_read(family):
    config = tiny_gpt_config() if family == "gpt" else tiny_seq2seq_config()
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "hidden_size",
                "num_attention_heads", "head_dim", "vocab_size", "num_hidden_layers", "hidden_act"):
        assert hasattr(config, key), key
    assert config.to_dict()["num_experts"] == config.num_experts
