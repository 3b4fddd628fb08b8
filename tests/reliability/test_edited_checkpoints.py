"""Issue 25, checkpoints changed after they were written: `checksums.sha256` still refuses a torn or damaged weight
file, but a complete safetensors file written anew (other tensors: Transformers' common test
`test_model_weights_reload_no_missing_tied_weights`, tools that rewrite or re-shard the weights) loads with a warning;
and converters refuse a dense checkpoint whose weights are integers, naming the tensor."""

import collections
import logging
import re
import shutil
import subprocess

import pytest
import torch
from helpers import tiny_gpt_config, tiny_seq2seq_config
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.pytorch_utils import id_tensor_storage

from hf_ppmoe import (
    GPTMoEForCausalLM,
    GPTMoEModel,
    Seq2SeqMoEForConditionalGeneration,
    Seq2SeqMoEModel,
)
from hf_ppmoe_cli import main as cli
from hf_ppmoe.conversion import upcycle
from hf_ppmoe.conversion.mapping import ConversionError
from hf_ppmoe.utils.integrity import CHECKSUMS_FILE, CheckpointError

CLASSES = [(GPTMoEModel, tiny_gpt_config), (GPTMoEForCausalLM, tiny_gpt_config),
           (Seq2SeqMoEModel, tiny_seq2seq_config), (Seq2SeqMoEForConditionalGeneration, tiny_seq2seq_config)]


@pytest.mark.parametrize("model_class, config", CLASSES, ids=lambda c: getattr(c, "__name__", ""))
def test_transformers_common_test_model_weights_reload_no_missing_tied_weights(model_class, config, tmp_path):
    """The steps and checks of Transformers' ModelTesterMixin test of that name (tests/test_modeling_common.py), on
    each class of both families: every weight file is replaced by a placeholder, and loading must report exactly the
    model's parameters as missing."""
    model = model_class(config())
    model.save_pretrained(tmp_path)
    save_file({"tensor": torch.tensor([1, 2])}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reloaded, infos = model_class.from_pretrained(tmp_path, output_loading_info=True)

    params = dict(reloaded.named_parameters())
    params.update(dict(reloaded.named_buffers()))
    param_names, missing = set(params), set(infos["missing_keys"])
    extra_missing = missing - param_names
    pointers = collections.defaultdict(list)
    for name, tensor in reloaded.state_dict().items():
        pointers[id_tensor_storage(tensor)].append(name)
    for group in (names for names in pointers.values() if len(names) > 1):
        if set(group) - extra_missing:
            extra_missing -= set(group)
    assert extra_missing == set()
    missed_missing = param_names - missing
    nonpersistent = {n for n, _ in reloaded.named_buffers() if n not in reloaded.state_dict()}
    expected = set()
    for pattern in reloaded._keys_to_ignore_on_load_missing or []:
        expected |= {k for k in param_names if re.search(pattern, k)}
    assert missed_missing - nonpersistent == expected


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = GPTMoEForCausalLM(tiny_gpt_config()).eval()
    model.save_pretrained(tmp_path / "model")
    return tmp_path / "model", model


def test_the_manifest_still_reads_with_sha256sum(saved):
    if shutil.which("sha256sum") is None:
        pytest.skip("no sha256sum")
    result = subprocess.run(["sha256sum", "--strict", "-c", CHECKSUMS_FILE], cwd=saved[0], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "model.safetensors: OK", result


def test_a_complete_rewrite_loads_with_a_warning(saved, caplog):
    folder, model = saved
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.gate.weight"
    tensors[name] = torch.ones_like(tensors[name])
    tensors["extra.note"] = torch.zeros(1)  # a tool adds a tensor: another header
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="hf_ppmoe.utils.integrity"):
        loaded = GPTMoEForCausalLM.from_pretrained(folder)
    assert torch.equal(loaded.state_dict()[name], torch.ones_like(tensors[name]))
    assert any("was written anew after" in r.getMessage() for r in caplog.records)


def test_torn_and_damaged_files_are_still_refused(saved):
    folder, _ = saved
    weights = folder / "model.safetensors"
    original = weights.read_bytes()
    # the same tensors with other values: the header is unchanged, so it is damage, not a new file
    tensors = load_file(weights)
    name = "model.layers.1.mlp.gate.weight"
    tensors[name] = tensors[name] + 1
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="is not the file that was saved"):
        GPTMoEForCausalLM.from_pretrained(folder)
    # a file cut short, and one whose header was cut short: never a complete rewrite
    for torn in (original[:-100], original[:50]):
        weights.write_bytes(torn)
        with pytest.raises((CheckpointError, OSError)) as error:
            GPTMoEForCausalLM.from_pretrained(folder)
        assert isinstance(error.value, CheckpointError) and "is not the file that was saved" in str(error.value)
    # a rewrite with a new header but a torn end: incomplete, refused
    save_file({"other": torch.ones(64)}, weights, metadata={"format": "pt"})
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="is not the file that was saved"):
        GPTMoEForCausalLM.from_pretrained(folder)


def test_an_old_manifest_without_headers_stays_strict(saved):
    folder, _ = saved
    manifest = folder / CHECKSUMS_FILE
    manifest.write_text("".join(line + "\n" for line in manifest.read_text().splitlines() if not line.startswith("#")))
    save_file({"tensor": torch.tensor([1, 2])}, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="is not the file that was saved"):
        GPTMoEForCausalLM.from_pretrained(folder)


def _int32_dense(folder):
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    name = "transformer.h.1.mlp.c_fc.weight"
    tensors[name] = (tensors[name] * 100).to(torch.int32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("router_init", ["zeros", "random"])
def test_integer_dense_weights_are_refused_by_name(tmp_path, router_init):
    name = _int32_dense(tmp_path / "dense")
    with pytest.raises(ConversionError) as error:
        upcycle(tmp_path / "dense", num_experts=2, router_init=router_init, save_directory=tmp_path / "out")
    message = str(error.value)
    assert f"from {name} [32, 128] in {tmp_path / 'dense' / 'model.safetensors'}" in message
    assert "would be torch.int32" in message and "convert the floating-point original" in message
    assert not (tmp_path / "out").exists()


def test_integer_dense_weights_from_the_cli(tmp_path, capsys):
    name = _int32_dense(tmp_path / "dense")
    capsys.readouterr()
    assert cli(["upcycle", str(tmp_path / "dense"), str(tmp_path / "out"), "--num_experts", "2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("hf-ppmoe upcycle: error: ") and name in err
    assert not (tmp_path / "out").exists()
