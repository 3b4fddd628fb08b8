"""The Megatron-LM checkpoint mapping carries the aux-loss-free balancing bias (`gate.expert_bias` <->
Megatron-core's `router.expert_bias`), replicated over tensor-parallel ranks, bit-exact both ways."""

import pytest
import torch
from helpers import tiny_gpt_config

from hf_ppmoe import GPTMoEForCausalLM
from hf_ppmoe.megatron.weights import from_megatron, to_megatron


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_expert_bias_round_trips_through_megatron_shards(tp, pp):
    torch.manual_seed(0)
    model = GPTMoEForCausalLM(tiny_gpt_config(num_hidden_layers=4, router_expert_bias=True,
                                              router_score_function="sigmoid"))
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.expert_bias.copy_(torch.arange(4.0) * 0.01 * (i + 1))
    sd = model.state_dict()
    shards = to_megatron(sd, model.config, tp=tp, pp=pp)
    names = {name for shard in shards.values() for name in shard}
    assert any(name.endswith("mlp.router.expert_bias") for name in names)
    if tp == 2:  # replicated: both tensor-parallel ranks of a stage hold the whole bias
        by_name = {}
        for (t, p), shard in shards.items():
            for n in shard:
                if n.endswith("router.expert_bias"):
                    by_name.setdefault((p, n), []).append(shard[n])
        assert by_name and all(len(b) == 2 and torch.equal(b[0], b[1]) for b in by_name.values())
    back = from_megatron(shards, model.config, tp=tp, pp=pp)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_megatron_config_takes_sigmoid_bias_scaling_and_groups():
    from hf_ppmoe.megatron.plugin import transformer_config_kwargs

    config = tiny_gpt_config(num_experts=8, num_experts_per_tok=4, router_score_function="sigmoid",
                             router_expert_bias=True, router_bias_update_rate=0.01, routed_scaling_factor=2.5,
                             num_expert_groups=4, topk_expert_groups=2)
    kw = transformer_config_kwargs(config)
    assert (kw["moe_router_score_function"], kw["moe_router_enable_expert_bias"], kw["moe_router_bias_update_rate"],
            kw["moe_router_topk_scaling_factor"], kw["moe_router_num_groups"], kw["moe_router_group_topk"]) == (
        "sigmoid", True, 0.01, 2.5, 4, 2)
    for overrides, message in [
        (dict(router_expert_bias=True), "expert bias needs"),
        (dict(router_score_function="sigmoid", norm_topk_prob=False), "renormalises sigmoid"),
        (dict(num_experts=8, num_experts_per_tok=2, num_expert_groups=4, topk_expert_groups=2), "top k / topk_groups"),
        (dict(router_aux_loss_scope="sequence"), "router_aux_loss_scope='sequence'"),
    ]:
        with pytest.raises(ValueError, match=message):
            transformer_config_kwargs(tiny_gpt_config(**overrides))
