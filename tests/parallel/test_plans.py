"""The parallel plans our models hand to Transformers (single process)."""

import pytest
from helpers import GPT2_STYLE, tiny_gpt_config

from hf_ppmoe import GPTMoEForCausalLM


@pytest.mark.parametrize("style", [dict(), dict(GPT2_STYLE, shared_expert_intermediate_size=16)], ids=["llama", "gpt2"])
def test_plans_name_only_what_the_model_has(style):
    model = GPTMoEForCausalLM(tiny_gpt_config(moe_layer_frequency=2, **style))
    names = {n for n, _ in [*model.named_modules(), *model.named_parameters()]}
    generic = {n.replace(".0.", ".*.").replace(".1.", ".*.") for n in names}
    for plan in (model.tp_plan, model.ep_plan):
        assert plan and set(plan) <= generic
    experts = "model.layers.*.mlp.experts"
    assert model.tp_plan[experts] == "ppmoe_experts" and model.ep_plan[experts] == "ep_dispatch_experts"
    assert model.tp_plan["model.layers.*.mlp"] == "ppmoe_ffn"
    split = {k.rsplit(".", 1)[1] for k, v in model.ep_plan.items() if v == "grouped_gemm"}
    expected = {"gate_up_proj", "down_proj"} if not style else {"up_proj", "down_proj", "up_proj_bias", "down_proj_bias"}
    assert split == expected  # every expert weight is split on the expert dim, nothing else
