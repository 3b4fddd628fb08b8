"""Issue 31 item 9: Transformers' conventions where its own tests look for them. Forwards take
`**kwargs: Unpack[TransformersKwargs]`, which Transformers' eager-vs-SDPA test (tests/test_modeling_common.py,
`_can_output_attn`) inspects to decide whether a model returns attentions; a decoder attention mask of the wrong
length is one clear error naming both lengths."""

import inspect

import pytest
import torch
from helpers import tiny_gpt_config, tiny_seq2seq_config

from hf_ppmoe import GPTMoEForCausalLM, GPTMoEModel, Seq2SeqMoEForConditionalGeneration, Seq2SeqMoEModel

CLASSES = [(GPTMoEModel, tiny_gpt_config), (GPTMoEForCausalLM, tiny_gpt_config),
           (Seq2SeqMoEModel, tiny_seq2seq_config), (Seq2SeqMoEForConditionalGeneration, tiny_seq2seq_config)]


def can_output_attentions(model) -> bool:
    """Transformers' check, step by step: `output_attentions` in the signature, or in the TypedDict of `**kwargs`."""
    parameters = inspect.signature(model.forward).parameters
    if "output_attentions" in parameters:
        return True
    kwargs = parameters.get("kwargs")
    try:
        return "output_attentions" in kwargs.annotation.__args__[0].__annotations__
    except AttributeError:
        return False


@pytest.mark.parametrize("model_class, config", CLASSES, ids=lambda c: getattr(c, "__name__", ""))
def test_attentions_are_announced_and_eager_equals_sdpa(model_class, config):
    torch.manual_seed(0)
    eager = model_class(config()).eval()
    eager.set_attn_implementation("eager")
    sdpa = model_class(config()).eval()
    sdpa.load_state_dict(eager.state_dict())
    sdpa.set_attn_implementation("sdpa")
    assert can_output_attentions(eager) and can_output_attentions(sdpa)
    ids = torch.randint(3, 60, (2, 5))
    inputs = {"input_ids": ids, "attention_mask": torch.tensor([[1] * 5, [0, 1, 1, 1, 1]])}
    if eager.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = ids[:, :4]
    with torch.no_grad():
        a, b = eager(**inputs, output_attentions=True), sdpa(**inputs, output_attentions=True)
    first = a.logits if hasattr(a, "logits") else a.last_hidden_state
    second = b.logits if hasattr(b, "logits") else b.last_hidden_state
    torch.testing.assert_close(first[0], second[0], atol=1e-5, rtol=1e-4)  # the row without padding
    attentions = a.decoder_attentions if eager.config.is_encoder_decoder else a.attentions
    assert attentions and attentions[0].shape[-1] == inputs.get("decoder_input_ids", ids).shape[1]


@pytest.mark.parametrize("model_class", [Seq2SeqMoEModel, Seq2SeqMoEForConditionalGeneration])
def test_a_decoder_mask_of_another_length_names_both_lengths(model_class):
    model = model_class(tiny_seq2seq_config()).eval()
    ids = torch.randint(3, 60, (2, 6))
    with pytest.raises(ValueError, match=r"decoder_attention_mask has length 3, but the decoder input has 4 tokens"):
        model(input_ids=ids, decoder_input_ids=ids[:, :4], decoder_attention_mask=torch.ones(2, 3, dtype=torch.long))
