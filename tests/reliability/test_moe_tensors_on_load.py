"""Issue 31 item 7: loading an MoE checkpoint that lacks a router or expert tensor, or holds one the model does not
have, is an error naming the tensors (Transformers would re-initialise or drop it, with a load report only: another
model); `strict_moe=False`, or asking for the report (`output_loading_info=True`), keeps Transformers' behaviour."""

import pytest
import torch
from helpers import tiny_gpt_config, tiny_seq2seq_config
from safetensors.torch import load_file, save_file

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration

FAMILIES = {"gpt": (GPTMoEForCausalLM, tiny_gpt_config), "seq2seq": (Seq2SeqMoEForConditionalGeneration, tiny_seq2seq_config)}


def _saved(tmp_path, family):
    model_class, config = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config()).eval()
    model.save_pretrained(tmp_path / "model")
    return tmp_path / "model", model_class


def _edit(folder, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _router(tensors) -> str:
    return next(name for name in sorted(tensors) if name.endswith("mlp.gate.weight"))


def _experts(tensors) -> str:
    return next(name for name in sorted(tensors) if ".experts." in name)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("which", ["router", "experts"])
def test_a_missing_router_or_expert_tensor_is_an_error_naming_it(tmp_path, family, which):
    folder, model_class = _saved(tmp_path, family)
    removed = []
    _edit(folder, lambda t: removed.append(_router(t) if which == "router" else _experts(t)) or t.pop(removed[0]))
    with pytest.raises(ValueError, match="strict_moe=False") as error:
        model_class.from_pretrained(folder)
    assert f"missing from the checkpoint: {removed[0]}" in str(error.value)
    # the opt-outs: Transformers' behaviour (the tensor initialised anew) with its load report
    model = model_class.from_pretrained(folder, strict_moe=False)
    assert removed[0] in model.state_dict()
    _, info = model_class.from_pretrained(folder, output_loading_info=True)
    assert removed[0] in info["missing_keys"]


@pytest.mark.parametrize("family", FAMILIES)
def test_an_extra_expert_tensor_is_an_error_naming_it(tmp_path, family):
    folder, model_class = _saved(tmp_path, family)
    extra = {}

    def add(tensors):
        name = _experts(tensors).rsplit(".", 1)[0] + ".extra_proj"
        tensors[name] = extra[name] = torch.zeros(2, 2)

    _edit(folder, add)
    (name,) = extra
    with pytest.raises(ValueError, match=f"not in the model: {name}"):
        model_class.from_pretrained(folder)
    assert name not in model_class.from_pretrained(folder, strict_moe=False).state_dict()


def test_a_complete_checkpoint_loads_the_same_logits(tmp_path):
    folder, model_class = _saved(tmp_path, "gpt")
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.manual_seed(0)
    expected = model_class(tiny_gpt_config()).eval()(ids).logits
    assert torch.equal(model_class.from_pretrained(folder).eval()(ids).logits, expected)
