"""Every converter's output folder carries a model card that huggingface_hub reads: library, tags, base model and
relation, parameter counts; a README.md of the source is kept, not overwritten."""

from pathlib import Path

import pytest
from converters import build_dense, tiny_t5
from huggingface_hub import ModelCard

import hf_ppmoe.conversion.io as io
from hf_ppmoe.conversion import export_moe, import_moe, merge_experts, upcycle


def _card(folder):
    card = ModelCard.load(folder / "README.md")
    return card, card.data.to_dict()


def test_upcycle_merge_import_export_write_loadable_cards(dense, tmp_path):
    gpt2, folder = dense("gpt2")
    moe = upcycle(folder, num_experts=4, router_type="gshard", save_directory=tmp_path / "moe")
    card, data = _card(moe)
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"hf_ppmoe", "mixture-of-experts", "gate-gshard"} <= set(data["tags"])
    assert "base_model" not in data  # a local folder is not a Hub model
    from hf_ppmoe import GPTMoEForCausalLM

    model = GPTMoEForCausalLM.from_pretrained(moe)
    total, active = model.num_parameters(), model.num_active_parameters()
    assert total > active  # the counts come from the model, and differ for an MoE
    assert f"{total:,}" in card.text and f"{active:,}" in card.text and "trust_remote_code=True" in card.text

    merged = merge_experts(moe, save_directory=tmp_path / "merged")
    _, data = _card(merged)
    assert "mixture-of-experts" not in data["tags"] and "hf_ppmoe" in data["tags"]

    mixtral = build_dense("mixtral")
    mixtral.save_pretrained(tmp_path / "mixtral")
    imported = import_moe(tmp_path / "mixtral", save_directory=tmp_path / "imported")
    _, data = _card(imported)
    assert "mixture-of-experts" in data["tags"]
    exported = export_moe(imported, tmp_path / "exported", to="mixtral")
    card, data = _card(exported)
    assert "mixture-of-experts" in data["tags"] and "trust_remote_code" not in card.text  # plain Transformers class
    total = import_moe(exported).num_parameters()
    assert f"{total:,}" in card.text


def test_seq2seq_upcycle_card(tmp_path):
    t5 = tiny_t5("v1.1")
    t5.save_pretrained(tmp_path / "t5")
    out = upcycle(tmp_path / "t5", num_experts=4, save_directory=tmp_path / "moe")
    _, data = _card(out)
    assert data["pipeline_tag"] == "text2text-generation" and "seq2seq_moe" in data["tags"]


def test_hub_source_becomes_base_model_and_its_readme_is_kept(dense, tmp_path, monkeypatch):
    _, folder = dense("llama")
    source = tmp_path / "snapshot"
    source.mkdir()
    for item in folder.iterdir():
        (source / item.name).write_bytes(item.read_bytes())
    (source / "README.md").write_text("---\nlicense: apache-2.0\nlanguage: en\n---\n\n# The source\n\nWritten by its authors.\n")
    fetched = []
    monkeypatch.setattr(io, "resolve_folder", lambda path: fetched.append(str(path)) or source)
    out = upcycle("some-org/tiny-llama", num_experts=2, save_directory=tmp_path / "moe")
    assert fetched == ["some-org/tiny-llama"]
    card, data = _card(out)
    assert data["base_model"] == "some-org/tiny-llama" and data["base_model_relation"] == "finetune"
    assert data["license"] == "apache-2.0" and data["language"] == "en"  # the source's metadata kept
    assert "Written by its authors." in card.text  # and its text
    monkeypatch.undo()
    merged = merge_experts(out, save_directory=tmp_path / "merged")  # a local folder: no base model, its card kept
    card, data = _card(merged)
    assert "base_model" not in data and card.text.count("Written by its authors.") == 1
    assert data["model_name"] == "merged" and 'from_pretrained("merged")' in card.text


def test_a_failing_card_leaves_no_output(dense, tmp_path, monkeypatch):
    _, folder = dense("gpt2")
    import hf_ppmoe.conversion.delivery as delivery

    def broken(*args, **kwargs):
        raise RuntimeError("card failed")

    monkeypatch.setattr(delivery, "conversion_card", broken)
    with pytest.raises(RuntimeError, match="card failed"):
        upcycle(folder, num_experts=2, save_directory=tmp_path / "moe")
    assert not (tmp_path / "moe").exists()


def test_training_output_card_with_evaluation_and_push(tmp_path, monkeypatch):
    """A training run's folder: the card holds the final evaluation as a model-index, and --push_to_hub uploads the
    folder with it (the Hub calls recorded, not made)."""
    from huggingface_hub import HfApi

    from hf_ppmoe import GPTMoEConfig
    from hf_ppmoe.training import TrainArguments, main
    from hf_ppmoe.training.data import builtin_corpus

    (tmp_path / "train.txt").write_text("\n\n".join(builtin_corpus()[:6]))
    GPTMoEConfig(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64, num_experts=4, num_experts_per_tok=2).to_json_file(tmp_path / "config.json")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    calls = []
    monkeypatch.setattr(HfApi, "whoami", lambda self, *a, **kw: {"name": "me"})  # the login check before training
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("create", repo_id)) or
                        type("Url", (), {"repo_id": f"me/{repo_id}"})())
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: calls.append(("upload", kw["repo_id"], sorted(
        p.name for p in Path(kw["folder_path"]).iterdir()))))
    out = tmp_path / "run"
    summary = main(TrainArguments(
        train_file=[str(tmp_path / "train.txt")], config_name=str(tmp_path / "config.json"), output_dir=str(out),
        max_steps=2, per_device_train_batch_size=2, block_size=32, eval_batches=1, plots=False, push_to_hub=True,
    ))
    card, data = _card(out)
    assert data["library_name"] == "transformers" and "mixture-of-experts" in data["tags"]
    results = {r["metrics"][0]["type"]: r["metrics"][0]["value"] for r in data["model-index"][0]["results"]}
    assert results["loss"] == pytest.approx(summary["eval/loss"], abs=1e-4)
    assert calls[0] == ("create", "run") and calls[1][1] == "me/run" and "README.md" in calls[1][2]
