"""`config.head_dim` is the real head dimension of both families (Transformers' tests and tools read it), and a
GPT-MoE config whose heads cannot be rotated (odd head_dim with rotary positions) is refused when it is built."""

import pytest
import torch
from helpers import tiny_gpt_config, tiny_seq2seq_config

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM, Seq2SeqMoEConfig, Seq2SeqMoEForConditionalGeneration


def test_head_dim_is_stated():
    assert GPTMoEConfig().head_dim == 768 // 12
    assert tiny_gpt_config().head_dim == 32 // 4
    assert tiny_gpt_config(hidden_size=30, head_dim=8).head_dim == 8  # an explicit one is kept
    assert Seq2SeqMoEConfig().head_dim == Seq2SeqMoEConfig().hidden_size // Seq2SeqMoEConfig().num_attention_heads


def test_a_saved_config_without_head_dim_loads_with_it():
    """Configs written before head_dim was stated hold `"head_dim": null`."""
    saved = tiny_gpt_config().to_dict() | {"head_dim": None}
    assert GPTMoEConfig.from_dict(saved).head_dim == 8


@pytest.mark.parametrize("overrides", [dict(hidden_size=30, num_attention_heads=2), dict(head_dim=7)])
def test_odd_head_dim_with_rotary_positions_is_refused(overrides):
    head_dim = overrides.get("head_dim", 15)
    with pytest.raises(ValueError, match=rf"head_dim={head_dim} is odd .* rotary position embeddings .* even head_dim"):
        GPTMoEConfig(**overrides)


def test_odd_head_dim_without_rotary_positions_works():
    """Learned positions (GPT-2) and T5's relative bias do not rotate head dimensions: an odd head_dim is fine."""
    ids = torch.randint(3, 97, (2, 5))
    gpt = GPTMoEForCausalLM(tiny_gpt_config(hidden_size=30, num_attention_heads=2, num_key_value_heads=2,
                                            position_embedding_type="learned"))
    assert gpt.config.head_dim == 15 and gpt(ids, labels=ids).loss.isfinite()
    seq2seq = Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config(hidden_size=30, num_attention_heads=2))
    assert seq2seq.config.head_dim == 15 and seq2seq(ids, labels=ids).loss.isfinite()
