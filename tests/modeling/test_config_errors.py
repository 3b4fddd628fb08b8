"""Every config that cannot work is refused when the config is built, with a message naming the field and the fix."""

import pytest
from helpers import tiny_gpt_config

BAD_CONFIGS = [
    (dict(num_experts_per_tok=5, num_experts=4), "num_experts_per_tok=5 must be between 1 and num_experts=4"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok=0 must be between 1"),
    (dict(num_experts=0, num_experts_per_tok=1), "num_experts must be >= 1"),
    (dict(capacity_factor=0.0), r"capacity_factor=0.0 must be > 0, or None for dropless"),
    (dict(eval_capacity_factor=-1.0), r"eval_capacity_factor=-1.0 must be > 0"),
    (dict(hidden_size=30), "hidden_size=30 is not divisible by num_attention_heads=4"),
    (dict(num_key_value_heads=3), "num_attention_heads=4 is not divisible by num_key_value_heads=3"),
    (dict(router_type="hash"), "Unknown router_type 'hash'. Known gates: gshard, prototype, switch, topk"),
    (dict(experts_implementation="alltoall"), "Unknown experts_implementation 'alltoall'; use one of index, einsum"),
    (dict(hidden_act="swish2"), "Unknown hidden_act 'swish2'"),
    (dict(router_type="prototype", num_experts=6, num_experts_per_tok=4), "which must divide it evenly"),
    (dict(router_type="gshard", num_experts_per_tok=1), "router_type='gshard' is GShard's top-2 gating"),
    (dict(router_type="switch", num_experts_per_tok=2), "router_type='switch' routes each token to 1 expert"),
    (dict(moe_layer_frequency=0), "moe_layer_frequency must be >= 1"),
    (dict(moe_layers=[0, 5]), r"moe_layers \[5\] are outside 0..1"),
    (dict(router_num_groups=0), "router_num_groups must be >= 1"),
    (dict(router_jitter_noise=1.5), "router_jitter_noise=1.5 must be in"),
    (dict(position_embedding_type="alibi"), "Unknown position_embedding_type 'alibi'"),
    (dict(norm_type="batchnorm"), "Unknown norm_type 'batchnorm'"),
    (dict(hidden_dropout=1.0), "hidden_dropout must be in"),
    (dict(sliding_window=0), "sliding_window must be a positive number"),
    (dict(router_aux_loss_coef=-0.1), "router_aux_loss_coef must be >= 0"),
    # types and non-finite numbers, refused before any arithmetic on them
    (dict(num_experts=4.5), r"num_experts must be an integer, got 4.5 \(float\)"),
    (dict(num_experts="4"), r"num_experts must be an integer, got '4' \(str\)"),
    (dict(num_experts=None), r"num_experts must be an integer, got None"),
    (dict(hidden_size="32"), r"hidden_size must be an integer, got '32'"),
    (dict(num_attention_heads=0), "num_attention_heads must be >= 1, got 0"),
    (dict(num_hidden_layers=-1), "num_hidden_layers must be >= 1, got -1"),
    (dict(head_dim=0), "head_dim must be >= 1, got 0"),
    (dict(capacity_factor=float("inf")), "capacity_factor must be a finite number, got inf"),
    (dict(router_aux_loss_coef=float("inf")), "router_aux_loss_coef must be a finite number, got inf"),
    (dict(layer_norm_eps=-1e-5), "layer_norm_eps must be > 0"),
]


@pytest.mark.parametrize("overrides, message", BAD_CONFIGS, ids=[next(iter(o)) + str(i) for i, (o, _) in enumerate(BAD_CONFIGS)])
def test_bad_config_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_gpt_config(**overrides)


def test_good_configs_are_accepted():
    tiny_gpt_config(hidden_size=30, head_dim=8)  # explicit head_dim lifts the divisibility rule
    tiny_gpt_config(capacity_factor=None, eval_capacity_factor=2.0, experts_implementation="einsum", moe_layers=[1])
