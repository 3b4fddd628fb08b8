"""MoE -> dense: round trips are the identity, and each merge method computes what it says."""

import json
import warnings

import pytest
import torch
from converters import SAMPLE_TEXTS, assert_same_outputs, read_tensors, tokenizer
from transformers import AutoModelForCausalLM

from hf_ppmoe.conversion import import_moe, merge_experts, upcycle

ROUND_TRIPS = {
    "gpt2-topk": ("gpt2", dict(router_type="topk")),
    "gpt2-switch": ("gpt2", dict(router_type="switch")),  # down_proj scaled by 4 and back
    "llama-gshard": ("llama", dict(router_type="gshard")),  # biases, tied head
    "mistral-prototype": ("mistral", dict(router_type="prototype", num_experts_per_tok=4, num_experts=8)),  # x 1/2
    "qwen2-topk-unnormalized": ("qwen2", dict(router_type="topk", norm_topk_prob=False)),  # x 2
    "qwen3-switch": ("qwen3", dict(router_type="switch")),  # q/k norms, biases on q/k/v/o, window
}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_dense_moe_dense_is_bit_exact(dense, tmp_path, case):
    arch, options = ROUND_TRIPS[case]
    model, folder = dense(arch)
    moe = upcycle(folder, save_directory=tmp_path / "moe", **(dict(num_experts=4, moe_layer_frequency=1) | options))
    out = merge_experts(moe, save_directory=tmp_path / "dense")
    original, merged = read_tensors(folder), read_tensors(out)
    assert merged.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(merged[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and "auto_map" not in config and not list(out.glob("*.py"))
    # plain Transformers loads it as the original class, with the original tokenizer
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(reloaded) is type(model)
    assert_same_outputs(model, reloaded)
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()


def test_merge_of_a_model_object_returns_the_dense_class(dense):
    model, _ = dense("qwen2")
    merged = merge_experts(upcycle(model, num_experts=4, router_type="switch"))
    assert type(merged) is type(model)
    assert_same_outputs(model, merged)


def _noisy_moe(dense, arch="gpt2", **options):
    """An upcycled model whose experts differ (noise) and whose router is not uniform (random)."""
    _, folder = dense(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # inexact for switch: not the point here
        return upcycle(folder, num_experts=4, noise_std=0.05, router_init="random", initializer_range=1.0, **options)


def test_mean_is_the_mean_of_the_experts(dense):
    moe = _noisy_moe(dense, router_type="switch")  # down_proj was scaled by 4 when upcycling
    merged = merge_experts(moe)
    experts = moe.model.layers[1].mlp.experts
    mlp = merged.transformer.h[1].mlp
    torch.testing.assert_close(mlp.c_fc.weight, experts.up_proj.mean(0).t(), atol=1e-6, rtol=0)  # Conv1D [in, out]
    torch.testing.assert_close(mlp.c_fc.bias, experts.up_proj_bias.mean(0), atol=1e-6, rtol=0)
    torch.testing.assert_close(mlp.c_proj.weight, experts.down_proj.mean(0).t() / 4, atol=1e-6, rtol=0)
    torch.testing.assert_close(mlp.c_proj.bias, experts.down_proj_bias.mean(0) / 4, atol=1e-6, rtol=0)


def test_expert_keeps_one_expert(dense):
    moe = _noisy_moe(dense, "llama")
    merged = merge_experts(moe, method="expert", expert=2)
    experts, mlp = moe.model.layers[1].mlp.experts, merged.model.layers[1].mlp
    gate, up = experts.gate_up_proj[2].chunk(2, dim=0)  # experts are [out, in], as nn.Linear
    assert torch.equal(mlp.gate_proj.weight, gate) and torch.equal(mlp.up_proj.weight, up)
    assert torch.equal(mlp.down_proj.weight, experts.down_proj[2])
    assert torch.equal(mlp.down_proj.bias, experts.down_proj_bias[2])
    with pytest.raises(ValueError, match="expert=4 does not exist"):
        merge_experts(moe, method="expert", expert=4)


def test_usage_weights_the_mean_by_routes_per_expert(dense, tmp_path):
    moe = _noisy_moe(dense, "mistral")
    folder = moe.save_pretrained(tmp_path / "moe") or tmp_path / "moe"
    tokenizer().save_pretrained(folder)
    merged = merge_experts(folder, method="usage", sample_texts=SAMPLE_TEXTS)  # tokenizer read from the folder
    # the routes of layer 1 (the only MoE layer), recounted here from its router logits: top-2 of the softmax
    counts = torch.zeros(4)
    for text in SAMPLE_TEXTS:
        logits = moe(tokenizer()(text, return_tensors="pt")["input_ids"], output_router_logits=True).router_logits[0]
        counts += torch.bincount(logits.softmax(-1).topk(2).indices.flatten(), minlength=4)
    weights = counts / counts.sum()
    assert len(set(counts.tolist())) > 1  # uneven usage, so the test tells "usage" from "mean"
    expected = torch.einsum("e,eij->ij", weights.double(), moe.model.layers[1].mlp.experts.down_proj.double()).float()
    torch.testing.assert_close(merged.model.layers[1].mlp.down_proj.weight, expected, atol=1e-6, rtol=0)


def test_usage_cuts_texts_longer_than_the_positions(dense):
    """GPT-2 has learned positions: a sample text longer than n_positions is counted on its first n_positions tokens."""
    moe = _noisy_moe(dense, "gpt2")
    long_text = " ".join(SAMPLE_TEXTS) * 50
    assert tokenizer()(long_text, return_tensors="pt")["input_ids"].shape[1] > moe.config.max_position_embeddings
    merged = merge_experts(moe, method="usage", sample_texts=[long_text], tokenizer=tokenizer())
    assert type(merged).__name__ == "GPT2LMHeadModel"


def test_usage_needs_sample_texts(dense):
    with pytest.raises(ValueError, match="needs sample_texts"):
        merge_experts(_noisy_moe(dense), method="usage", tokenizer=tokenizer())


def test_mixtral_import_equals_mixtral_and_merges_into_mistral(dense, tmp_path):
    mixtral, folder = dense("mixtral")
    imported = import_moe(folder)
    assert imported.config.router_type == "topk" and imported.config.num_experts == 4
    assert_same_outputs(mixtral, imported)
    assert_same_outputs(mixtral, import_moe(mixtral))  # from the live object too (fused experts in memory)
    merged = merge_experts(imported, save_directory=tmp_path / "mistral")
    mistral = AutoModelForCausalLM.from_pretrained(merged)
    assert type(mistral).__name__ == "MistralForCausalLM"
    w1 = torch.stack([e.float() for k, e in sorted(read_tensors(folder).items()) if k.startswith("model.layers.0.") and k.endswith("w1.weight")])
    torch.testing.assert_close(mistral.model.layers[0].mlp.gate_proj.weight, w1.mean(0), atol=1e-6, rtol=0)


def test_merge_needs_a_record_of_the_dense_architecture():
    from helpers import tiny_gpt_config

    from hf_ppmoe import GPTMoEForCausalLM

    with pytest.raises(ValueError, match="no record of a dense architecture"):
        merge_experts(GPTMoEForCausalLM(tiny_gpt_config()))
