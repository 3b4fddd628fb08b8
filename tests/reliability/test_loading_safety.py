"""Loading reads only the checkpoint's own files and only what was saved: shard indexes that lead out of the folder,
symlinked side files from elsewhere, overwritten bytes, NaN and integer tensors where the model has floating-point
ones are refused with a message naming the file (and tensor), both by `from_pretrained` and by the converters."""

import json
import os
import shutil
import subprocess

import pytest
import torch
from helpers import tiny_gpt_config
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config

from hf_ppmoe import GPTMoEForCausalLM
from hf_ppmoe.conversion import ConversionError, merge_experts, upcycle
from hf_ppmoe.conversion.io import SafetensorsSource
from hf_ppmoe.utils.integrity import CHECKSUMS_FILE, WEIGHT_FILE, CheckpointError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A GPT-MoE saved in 3+ shards, and its weights."""
    torch.manual_seed(0)
    model = GPTMoEForCausalLM(tiny_gpt_config()).eval()
    folder = tmp_path_factory.mktemp("saved") / "model"
    model.save_pretrained(folder, max_shard_size="20KB")
    return folder, {k: v.clone() for k, v in model.state_dict().items()}


def _copy(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "model", symlinks=True)


def _index(folder):
    return json.loads((folder / "model.safetensors.index.json").read_text())


def _readers(folder):
    """Both ways a checkpoint is read: our from_pretrained (through the Auto class) and the converters' reader."""
    return [lambda: AutoModelForCausalLM.from_pretrained(folder), lambda: SafetensorsSource(folder)]


def _shard_name(folder):
    return sorted(set(_index(folder)["weight_map"].values()))[1]


def _point_shard_at(folder, shard, name):
    index = _index(folder)
    index["weight_map"] = {k: (name if v == shard else v) for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_weight_files_outside_the_folder_are_refused(saved, tmp_path, how):
    folder = _copy(saved[0], tmp_path)
    shard = _shard_name(folder)
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(folder / shard, outside)  # the same tensors, so only the location can be wrong
    if how == "dotdot":
        _point_shard_at(folder, shard, "../elsewhere.safetensors")
    elif how == "absolute":
        _point_shard_at(folder, shard, str(outside))
    else:
        (folder / shard).unlink()
        (folder / shard).symlink_to(outside)
    for read in _readers(folder):
        with pytest.raises((CheckpointError, ConversionError), match="leads outside the checkpoint folder"):
            read()


def test_links_inside_the_folder_and_the_hub_cache_layout_load(saved, tmp_path):
    """A Hub cache snapshot is all symlinks into ../../blobs; a link to a file in the folder itself is fine too."""
    snapshot = tmp_path / "models--me--tiny" / "snapshots" / "abc123"
    blobs = tmp_path / "models--me--tiny" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, path in enumerate(sorted(saved[0].iterdir())):
        if path.is_file():
            shutil.copy(path, blobs / f"blob{i}")
            (snapshot / path.name).symlink_to(f"../../blobs/blob{i}")
    shard = _shard_name(snapshot)
    (snapshot / "renamed.safetensors").symlink_to(shard)
    _point_shard_at(snapshot, shard, "renamed.safetensors")
    (snapshot / CHECKSUMS_FILE).unlink()  # it does not list the renamed file
    loaded = AutoModelForCausalLM.from_pretrained(snapshot)
    assert all(torch.equal(saved[1][k], v) for k, v in loaded.state_dict().items())
    assert len(SafetensorsSource(snapshot).keys()) == len(_index(snapshot)["weight_map"])


def _dense(tmp_path):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=1)
    source = tmp_path / "dense"
    AutoModelForCausalLM.from_config(config).save_pretrained(source)
    return source


def test_side_files_linked_from_outside_are_not_copied(tmp_path):
    source = _dense(tmp_path)
    (source / "LICENSE").write_text("Apache-2.0")
    secret = tmp_path / "secret.txt"
    secret.write_text("do not copy")
    (source / "README.md").symlink_to(secret)
    with pytest.raises(ConversionError, match=r"'README.md' leads outside the checkpoint folder"):
        upcycle(source, num_experts=4, save_directory=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (source / "README.md").unlink()
    (source / "README.md").symlink_to("LICENSE")  # inside the folder: read as a file, kept in the new model card
    upcycle(source, num_experts=4, save_directory=tmp_path / "out")
    card = tmp_path / "out" / "README.md"
    assert "Apache-2.0" in card.read_text() and "- hf_ppmoe" in card.read_text() and not card.is_symlink()


def test_checksums_are_written_and_overwritten_bytes_are_refused(saved, tmp_path):
    folder = _copy(saved[0], tmp_path)
    listed = {line.split("  ")[1] for line in (folder / CHECKSUMS_FILE).read_text().splitlines()}
    assert listed == {p.name for p in folder.iterdir() if WEIGHT_FILE.match(p.name)} and len(listed) > 3
    if shutil.which("sha256sum"):  # the standard tool reads the same file
        assert subprocess.run(["sha256sum", "--quiet", "-c", CHECKSUMS_FILE], cwd=folder).returncode == 0
    shard = folder / _shard_name(folder)
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40  # one bit of one weight: the file still parses and loads, with a different value
    shard.write_bytes(bytes(data))
    for read in _readers(folder):
        with pytest.raises((CheckpointError, ConversionError), match=f"{shard.name} is not the file that was saved"):
            read()
    loaded = GPTMoEForCausalLM.from_pretrained(folder, verify_checksums=False)  # the opt-out reads it as it is
    assert any(not torch.equal(saved[1][k], v) for k, v in loaded.state_dict().items())


def test_conversion_output_carries_checksums_and_merging_checks_them(tmp_path):
    moe = upcycle(_dense(tmp_path), num_experts=4, save_directory=tmp_path / "moe", max_shard_size="20KB")
    assert (moe / CHECKSUMS_FILE).is_file()
    if shutil.which("sha256sum"):
        assert subprocess.run(["sha256sum", "--quiet", "-c", CHECKSUMS_FILE], cwd=moe).returncode == 0
    shard = moe / _shard_name(moe)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ConversionError, match=f"{shard.name} is not the file that was saved"):
        merge_experts(moe, save_directory=tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def _rewrite(folder, change):
    """Apply `change` to the tensors of the shard holding the router of layer 0, as a tool other than ours would
    (the checksums file then no longer matches, so it goes too)."""
    name = "model.layers.0.mlp.gate.weight"
    shard = folder / _index(folder)["weight_map"][name]
    tensors = load_file(shard)
    change(tensors, name)
    save_file(tensors, shard, metadata={"format": "pt"})
    (folder / CHECKSUMS_FILE).unlink()
    return shard, name


def test_nan_in_a_stored_tensor_is_refused(saved, tmp_path):
    folder = _copy(saved[0], tmp_path)
    shard, name = _rewrite(folder, lambda t, n: t[n].view(-1).__setitem__(0, float("nan")))
    with pytest.raises(CheckpointError, match=f"{shard.name}: tensor {name} holds NaN or infinite values"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_an_integer_tensor_where_the_model_has_floats_is_refused(saved, tmp_path):
    folder = _copy(saved[0], tmp_path)

    def to_int64(tensors, name):
        tensors[name] = (tensors[name] * 100).round().to(torch.int64)

    shard, name = _rewrite(folder, to_int64)
    with pytest.raises(CheckpointError, match=f"{shard.name}: tensor {name} is stored as torch.int64 but the model's is torch.float32"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_saving_keeps_the_folders_other_files_and_loading_still_works(saved, tmp_path):
    """The atomic save replaces the folder: what it does not write itself (a tokenizer, logs) stays; old shards go."""
    folder = _copy(saved[0], tmp_path)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "logs").mkdir()
    (folder / "logs" / "metrics.jsonl").write_text("{}\n")
    model = GPTMoEForCausalLM.from_pretrained(folder)
    os.chmod(folder, 0o750)
    model.save_pretrained(folder)
    names = {p.name for p in folder.iterdir()}
    assert {"tokenizer.json", "logs", "model.safetensors", CHECKSUMS_FILE} <= names
    assert not any(n.startswith("model-") for n in names) and "model.safetensors.index.json" not in names
    assert (folder.stat().st_mode & 0o777) == 0o750 and [p.name for p in tmp_path.iterdir()] == ["model"]
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert all(torch.equal(saved[1][k], v) for k, v in loaded.state_dict().items())
