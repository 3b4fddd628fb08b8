"""`return_dict=False` (argument or config) gives Transformers' tuple form for all four classes: the ModelOutput's
fields in order, without the None ones."""

import pytest
import torch
from helpers import tiny_gpt_config, tiny_seq2seq_config

from hf_ppmoe import GPTMoEForCausalLM, GPTMoEModel, Seq2SeqMoEForConditionalGeneration, Seq2SeqMoEModel


@pytest.mark.parametrize(
    "cls, config",
    [
        (GPTMoEModel, tiny_gpt_config),
        (GPTMoEForCausalLM, tiny_gpt_config),
        (Seq2SeqMoEModel, tiny_seq2seq_config),
        (Seq2SeqMoEForConditionalGeneration, tiny_seq2seq_config),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_return_dict_false_gives_the_tuple_form(cls, config):
    model = cls(config()).eval()
    ids = torch.randint(3, 97, (2, 5))
    inputs = dict(input_ids=ids, decoder_input_ids=ids) if "Seq2Seq" in cls.__name__ else dict(input_ids=ids)
    if "ForC" in cls.__name__:
        inputs["labels"] = ids
    with torch.no_grad():
        expected = model(**inputs).to_tuple()
        as_argument = model(**inputs, return_dict=False)
        model.config.return_dict = False
        from_config = model(**inputs)
    for out in (as_argument, from_config):
        assert type(out) is tuple and len(out) == len(expected)
        torch.testing.assert_close(out[0], expected[0])
