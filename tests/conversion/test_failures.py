"""Failures name what is wrong and leave no output folder behind."""

import json
import os
import shutil
import stat

import pytest
import torch
from converters import read_tensors
from safetensors.torch import save_file

from hf_ppmoe.conversion import ConversionError, import_moe, merge_experts, upcycle
from hf_ppmoe.conversion.mapping import MappedSource


def _copy(folder, tmp_path, name="src"):
    return shutil.copytree(folder, tmp_path / name)


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    model = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    model.save_pretrained(tmp_path / "bert")
    for src in (model, tmp_path / "bert"):
        with pytest.raises(ConversionError, match=r"Unsupported architecture 'bert'.*gpt2 \(GPT2LMHeadModel\), llama.*mistral.*qwen2"
                                                  r".*t5 \(T5ForConditionalGeneration\).*mixtral.*switch_transformers"):
            upcycle(src, num_experts=4, save_directory=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_moe_and_dense_sources_point_to_the_right_function(dense):
    mixtral, _ = dense("mixtral")
    llama, _ = dense("llama")
    with pytest.raises(ConversionError, match="use import_moe"):
        upcycle(mixtral, num_experts=4)
    with pytest.raises(ConversionError, match="use upcycle"):
        import_moe(llama)


@pytest.mark.parametrize("arch", ["llama", "t5-v1.1"])
def test_corrupt_safetensors_file_is_named(dense, tmp_path, arch):
    src = _copy(dense(arch)[1], tmp_path)
    (src / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ConversionError, match=r"src/model.safetensors is not a complete safetensors file"):
        upcycle(src, num_experts=4, save_directory=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_truncated_shard_is_named(dense, tmp_path):
    src = _copy(dense("gpt2")[1], tmp_path)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match="model.safetensors"):
        upcycle(src, num_experts=4, save_directory=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _rewrite(src, change):
    tensors = {k: v.contiguous() for k, v in read_tensors(src).items()}
    change(tensors)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("arch, name", [("qwen2", "model.layers.1.self_attn.k_proj.bias"),
                                        ("t5-v1.1", "decoder.block.1.layer.1.EncDecAttention.k.weight")])
def test_missing_tensor_is_named_never_reinitialized(dense, tmp_path, arch, name):
    src = _copy(dense(arch)[1], tmp_path)
    _rewrite(src, lambda t: t.pop(name))
    with pytest.raises(ConversionError, match=rf"1 tensor\(s\) are missing .*: {name}"):
        upcycle(src, num_experts=4, save_directory=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unexpected_tensor_is_named(dense, tmp_path):
    src = _copy(dense("mistral")[1], tmp_path)
    _rewrite(src, lambda t: t.update({"value_head.weight": torch.zeros(1, 32)}))
    with pytest.raises(ConversionError, match="no place for: value_head.weight"):
        upcycle(src, num_experts=4)


def test_mismatched_shape_is_named_with_its_file(dense, tmp_path):
    src = _copy(dense("gpt2")[1], tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"n_inner": 64}))  # the weights have 4 * 32 = 128
    with pytest.raises(ConversionError, match=r"model.layers.0.mlp.up_proj.weight would be \[128, 32\] but must be \[64, 32\] "
                                              r"\(from transformer.h.0.mlp.c_fc.weight \[32, 128\] in .*src/model.safetensors\)"):
        upcycle(src, num_experts=4, moe_layers=[1], save_directory=tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch", ["llama", "t5-v1.0"])
def test_interrupted_conversion_leaves_no_output_folder(dense, tmp_path, monkeypatch, arch):
    _, folder = dense(arch)
    calls, real_get = [], MappedSource.get

    def get_then_fail(self, name):
        calls.append(name)
        if len(calls) == 12:  # several shards are already on disk by now
            raise KeyboardInterrupt
        return real_get(self, name)

    monkeypatch.setattr(MappedSource, "get", get_then_fail)
    with pytest.raises(KeyboardInterrupt):
        upcycle(folder, num_experts=4, save_directory=tmp_path / "out", max_shard_size=5_000, progress=True)
    assert len(calls) == 12
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_existing_output_needs_overwrite(dense, tmp_path):
    _, folder = dense("gpt2")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists"):
        upcycle(folder, num_experts=4, save_directory=tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    upcycle(folder, num_experts=4, save_directory=tmp_path / "out", overwrite=True)
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "config.json").is_file()
    assert _leftovers(tmp_path) == []


def test_output_folder_has_normal_permissions(dense, tmp_path):
    """The output is written in a private temporary folder and renamed; it must not stay private (0700)."""
    _, folder = dense("gpt2")
    umask = os.umask(0o022)
    try:
        upcycle(folder, num_experts=4, save_directory=tmp_path / "out")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755


def test_folder_without_safetensors(tmp_path, dense):
    src = _copy(dense("gpt2")[1], tmp_path)
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="no model.safetensors"):
        upcycle(src, num_experts=4)


def test_missing_source_folder(tmp_path):
    with pytest.raises(ConversionError, match="no such folder: .*nowhere"):
        upcycle(tmp_path / "nowhere", num_experts=4)
    with pytest.raises(ConversionError, match="neither a local folder nor a Hub repository"):
        upcycle("no-such-org/no-such-model", num_experts=4)  # offline in the tests


def test_merge_rejects_other_model_types(dense):
    for arch in ("llama", "t5-v1.0"):
        with pytest.raises(ConversionError, match="merge_experts\\) reads GPT-MoE and Seq2Seq-MoE checkpoints"):
            merge_experts(dense(arch)[1])


def test_unknown_config_field_is_rejected(dense):
    with pytest.raises(TypeError, match="capacity_factr"):
        upcycle(dense("gpt2")[0], num_experts=4, capacity_factr=1.0)
