"""Every Seq2Seq-MoE config that cannot work is refused when it is built, with a message naming the field and the fix."""

import pytest
from helpers import tiny_seq2seq_config

BAD_CONFIGS = [
    (dict(hidden_size=30), "hidden_size=30 is not divisible by num_attention_heads=4"),
    (dict(num_hidden_layers=0), "num_hidden_layers must be >= 1"),
    (dict(num_decoder_layers=0), "num_decoder_layers must be >= 1"),
    (dict(norm_type="batchnorm"), "Unknown norm_type 'batchnorm'"),
    (dict(hidden_dropout=1.0), "hidden_dropout must be in"),
    (dict(attention_dropout=-0.1), "attention_dropout must be in"),
    (dict(attention_scaling=0.0), "attention_scaling must be > 0"),
    (dict(relative_attention_num_buckets=2), "relative_attention_num_buckets must be >= 4"),
    (dict(relative_attention_max_distance=4), "relative_attention_max_distance=4 must exceed"),
    (dict(moe_layers=[1]), r"moe_layers=\[1\] does not say which stack"),
    (dict(encoder_moe_layers=[0, 2]), r"encoder_moe_layers \[2\] are outside 0..1"),
    (dict(decoder_moe_layers=[-1]), r"decoder_moe_layers \[-1\] are outside 0..1"),
    (dict(encoder_moe_layer_frequency=0), "encoder_moe_layer_frequency must be >= 1"),
    (dict(decoder_moe_layer_frequency=0), "decoder_moe_layer_frequency must be >= 1"),
    # the shared MoE checks run for this family too
    (dict(num_experts_per_tok=5, num_experts=4), "num_experts_per_tok=5 must be between 1 and num_experts=4"),
    (dict(router_type="gshard", num_experts_per_tok=1), "router_type='gshard' is GShard's top-2 gating"),
    (dict(router_type="hash"), "Unknown router_type 'hash'"),
    (dict(experts_implementation="alltoall"), "Unknown experts_implementation 'alltoall'"),
    (dict(hidden_act="swish2"), "Unknown hidden_act 'swish2'"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0 must be > 0"),
    (dict(moe_layer_frequency=0), "moe_layer_frequency must be >= 1"),
]


@pytest.mark.parametrize("overrides, message", BAD_CONFIGS, ids=[next(iter(o)) + str(i) for i, (o, _) in enumerate(BAD_CONFIGS)])
def test_bad_config_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_seq2seq_config(**overrides)


def test_good_configs_are_accepted_and_place_moe_layers_per_stack():
    config = tiny_seq2seq_config(hidden_size=30, head_dim=8)  # explicit head_dim lifts the divisibility rule
    config = tiny_seq2seq_config(num_hidden_layers=4, num_decoder_layers=6, moe_layer_frequency=2)
    assert [config.is_encoder_moe_layer(i) for i in range(4)] == [False, True, False, True]  # GShard M4: every other
    assert [config.is_decoder_moe_layer(i) for i in range(6)] == [False, True] * 3
    config = tiny_seq2seq_config(
        num_hidden_layers=4, num_decoder_layers=6, encoder_moe_layers=[], decoder_moe_layer_frequency=3
    )
    assert not any(config.is_encoder_moe_layer(i) for i in range(4))
    assert [config.is_decoder_moe_layer(i) for i in range(6)] == [False, False, True, False, False, True]
    assert tiny_seq2seq_config(num_decoder_layers=None, num_hidden_layers=3).num_decoder_layers == 3
