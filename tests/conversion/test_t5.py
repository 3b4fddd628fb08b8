"""T5 v1.0 and v1.1 are held exactly: the renamed weights give T5's logits and T5's generations."""

import pytest
import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration

from hf_ppmoe.conversion.t5 import config_from_t5, config_to_t5, from_t5, state_dict_from_t5, state_dict_to_t5

T5_VERSIONS = {
    # v1.0: ReLU FFN, head tied to the embeddings and fed decoder_output * d_model**-0.5
    "v1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
    # v1.1: gated GELU, untied head, no rescaling
    "v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}


def tiny_t5(version, attn="sdpa", **overrides):
    kwargs = dict(
        vocab_size=101, d_model=32, d_kv=12, d_ff=56, num_layers=3, num_decoder_layers=2, num_heads=3,
        relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.1,
        decoder_start_token_id=0, **T5_VERSIONS[version],
    )
    kwargs.update(overrides)
    model = T5ForConditionalGeneration(T5Config(**kwargs))
    model.set_attn_implementation(attn)
    with torch.no_grad():  # T5's init keeps activations tiny; widen it so that every weight matters in the logits
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.2) if "layer_norm" in name else p.normal_(0.0, 1.0 if name == "shared.weight" else 0.5)
        if version == "v1.1":
            # Transformers 5 ties T5's head even for v1.1 configs (real v1.1 checkpoints load untied): untie it
            model.lm_head.weight = nn.Parameter(torch.randn_like(model.shared.weight) * 0.5)
    return model.eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("version", T5_VERSIONS)
def test_logits_and_generation_equal_t5(version, attn):
    t5 = tiny_t5(version, attn)
    assert (t5.lm_head.weight is t5.shared.weight) == (version == "v1.0")
    ours = from_t5(t5)
    ours.set_attn_implementation(attn)
    assert ours.config.scale_decoder_outputs == (version == "v1.0")
    assert (ours.lm_head.weight is ours.model.shared.weight) == (version == "v1.0")
    assert ours.model.encoder.num_moe_layers == ours.model.decoder.num_moe_layers == 0

    # left and right padding in the encoder, a padded decoder batch, sequences longer than max_distance
    ids = torch.randint(2, 101, (3, 24))
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0
    mask[1, :3] = 0
    labels = torch.randint(2, 101, (3, 22))
    labels[2, -4:] = -100
    expected, got = t5(ids, attention_mask=mask, labels=labels), ours(ids, attention_mask=mask, labels=labels)
    assert expected.logits.abs().max() > 1.0  # not a degenerate model
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.encoder_last_hidden_state, expected.encoder_last_hidden_state, atol=1e-5, rtol=1e-5)

    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(ours.generate(ids, **kw), t5.generate(ids, **kw))
    assert torch.equal(ours.generate(ids, num_beams=3, **kw), t5.generate(ids, num_beams=3, **kw))


@pytest.mark.parametrize("version", T5_VERSIONS)
def test_weight_map_is_reversible(version):
    t5 = tiny_t5(version)
    ours = from_t5(t5)
    back = state_dict_to_t5(ours.state_dict(), ours.config)
    original = {k: v for k, v in t5.state_dict().items() if "embed_tokens" not in k and "EncDecAttention.relative" not in k}
    assert back.keys() == original.keys()
    for name in original:
        assert torch.equal(back[name], original[name]), name

    # a T5 built from the mapped-back config and weights computes what ours computes
    rebuilt = T5ForConditionalGeneration(config_to_t5(ours.config)).eval()
    if version == "v1.1":
        rebuilt.lm_head.weight = nn.Parameter(torch.empty_like(rebuilt.shared.weight))
    missing, unexpected = rebuilt.load_state_dict(back, strict=False)
    assert not unexpected and set(missing) <= {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
    ids = torch.randint(2, 101, (2, 9))
    labels = torch.randint(2, 101, (2, 7))
    torch.testing.assert_close(rebuilt(ids, labels=labels).logits, ours(ids, labels=labels).logits, atol=1e-5, rtol=1e-5)
    assert config_from_t5(rebuilt.config).to_diff_dict() == ours.config.to_diff_dict()


def test_unknown_weights_and_non_t5_configs_are_refused():
    t5 = tiny_t5("v1.0")
    with pytest.raises(ValueError, match="no mapping for weight 'encoder.block.0.layer.0.SelfAttention.q.bias'"):
        state_dict_from_t5({"encoder.block.0.layer.0.SelfAttention.q.bias": torch.zeros(3)}, config_from_t5(t5.config))
    config = config_from_t5(t5.config)
    config.encoder_moe_layers = [1]
    config.norm_type = "layernorm"
    with pytest.raises(ValueError, match="norm_type must be 'rmsnorm'; the encoder has MoE layers"):
        config_to_t5(config)
