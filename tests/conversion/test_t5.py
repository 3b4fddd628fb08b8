"""T5 v1.0 and v1.1 are held exactly by the dense Seq2Seq-MoE: renamed weights give T5's logits, loss and generations;
configs translate both ways; what T5 cannot express is refused."""

import pytest
import torch
from converters import T5_VERSIONS, tiny_t5
from transformers import T5ForConditionalGeneration

from hf_ppmoe.conversion import ARCHITECTURES, ConversionError
from hf_ppmoe.conversion.io import model_tensors
from hf_ppmoe.conversion.mapping import DictSource, materialize
from hf_ppmoe.conversion.t5 import config_from_t5, config_to_t5, from_t5


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
def test_a_t5_built_from_the_translated_config_computes_the_same(version):
    t5 = tiny_t5(version)
    ours = from_t5(t5)
    rebuilt = T5ForConditionalGeneration(config_to_t5(ours.config)).eval()
    tensors = model_tensors(t5)
    names = frozenset(tensors.keys())
    # the table, inverted, gives back T5's weights under T5's names (the head only where it is untied)
    mapping = ARCHITECTURES["t5"].mapping(t5.config, names)
    back = materialize(mapping.inverse().apply(mapping.apply(tensors)))
    assert back.keys() == names and ("lm_head.weight" in names) == (version == "v1.1")
    if version == "v1.1":  # Transformers 5's T5 ties its head in memory; a stored lm_head.weight unties it on loading
        rebuilt.lm_head.weight = torch.nn.Parameter(torch.empty_like(rebuilt.shared.weight))
    missing, unexpected = rebuilt.load_state_dict(back, strict=False)
    assert not unexpected and set(missing) <= {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}
    ids = torch.randint(2, 101, (2, 9))
    labels = torch.randint(2, 101, (2, 7))
    torch.testing.assert_close(rebuilt(ids, labels=labels).logits, ours(ids, labels=labels).logits, atol=1e-5, rtol=1e-5)
    assert config_from_t5(rebuilt.config).to_diff_dict() == ours.config.to_diff_dict()


def test_a_v1_1_with_a_tied_head_stays_tied():
    """Transformers 5 builds a fresh v1.1 with its head tied (unscaled): the head is the embedding, and stays so."""
    t5 = tiny_t5("v1.1")
    t5.lm_head.weight = t5.shared.weight
    ours = from_t5(t5)
    assert ours.config.tie_word_embeddings and not ours.config.scale_decoder_outputs
    ids = torch.randint(2, 101, (2, 9))
    torch.testing.assert_close(ours(ids, decoder_input_ids=ids).logits, t5(ids, decoder_input_ids=ids).logits, atol=1e-5, rtol=0)


def test_stored_embedding_copies_must_equal_the_shared_embedding():
    t5 = tiny_t5("v1.0")
    tensors = {k: v for k, v in t5.state_dict().items() if k != "lm_head.weight"}  # with both stacks' copies
    mapping = ARCHITECTURES["t5"].mapping(t5.config, frozenset(tensors))
    assert torch.equal(mapping.apply(DictSource(tensors)).get("model.shared.weight"), t5.shared.weight)
    tensors["decoder.embed_tokens.weight"] = tensors["decoder.embed_tokens.weight"] + 1
    with pytest.raises(ConversionError, match=r"decoder.embed_tokens.weight .* into model.shared.weight: tensor 2 differs"):
        mapping.apply(DictSource(tensors)).get("model.shared.weight")


def test_configs_t5_cannot_express_are_refused():
    config = from_t5(tiny_t5("v1.0")).config
    config.encoder_moe_layers = [1]
    config.norm_type = "layernorm"
    with pytest.raises(ConversionError, match="norm_type must be 'rmsnorm'; the encoder has MoE layers"):
        config_to_t5(config)
