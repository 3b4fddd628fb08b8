"""Encoder-decoders through the same machinery as decoders: T5 v1.0 / v1.1 -> Seq2Seq-MoE (upcycle) -> T5
(merge_experts), and Switch Transformers -> Seq2Seq-MoE (import_moe)."""

import json
import warnings

import pytest
import torch
from converters import (
    GATES,
    SAMPLE_TEXTS,
    assert_same_seq2seq_outputs,
    read_tensors,
    seq2seq_inputs,
    tiny_switch,
    tokenizer,
)
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, GenerationConfig, T5ForConditionalGeneration

from hf_ppmoe import Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.conversion import ConversionError, import_moe, merge_experts, upcycle

VERSIONS = ["t5-v1.0", "t5-v1.1"]


def _moe_layers(model):
    return [[layer.is_moe for layer in stack.layers] for stack in (model.model.encoder, model.model.decoder)]


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("version", VERSIONS)
def test_upcycled_t5_equals_t5(dense, version, gate):
    t5, folder = dense(version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zero routers are exact for every gate: no warning
        moe = upcycle(folder, **(dict(num_experts=4, moe_layer_frequency=1) | GATES[gate]))
    assert isinstance(moe, Seq2SeqMoEForConditionalGeneration)
    assert _moe_layers(moe) == [[True] * 3, [True] * 2]
    assert moe.config.scale_decoder_outputs == (version == "t5-v1.0")
    assert_same_seq2seq_outputs(t5, moe)


def test_moe_ffns_are_chosen_per_stack(dense):
    t5, folder = dense("t5-v1.1")
    cases = [
        (dict(), [[False, True, False], [False, True]]),  # every other FFN of each stack
        (dict(encoder_moe_layers=[0, 2], decoder_moe_layers=[]), [[True, False, True], [False, False]]),
        (dict(encoder_moe_layers=[], decoder_moe_layer_frequency=1), [[False] * 3, [True, True]]),
    ]
    for placement, expected in cases:
        moe = upcycle(t5, num_experts=2, **placement)
        assert _moe_layers(moe) == expected, placement
    assert_same_seq2seq_outputs(t5, moe)
    with pytest.raises(ValueError, match="does not say which stack"):
        upcycle(folder, num_experts=2, moe_layers=[0])
    with pytest.raises(ConversionError, match="no FFN becomes an MoE layer"):
        upcycle(folder, num_experts=2, encoder_moe_layers=[], decoder_moe_layers=[])


@pytest.mark.parametrize("router_init", ["random", "hidden"])
def test_learned_router_init_is_exact_for_a_renormalizing_gate(dense, router_init):
    t5, folder = dense("t5-v1.0")
    moe = upcycle(folder, num_experts=4, moe_layer_frequency=1, router_init=router_init, sample_texts=SAMPLE_TEXTS)
    gates = [layer.mlp.gate.weight for stack in (moe.model.encoder, moe.model.decoder) for layer in stack.layers]
    assert all(g.abs().sum() > 0 for g in gates) and not torch.equal(gates[0], gates[-1])
    if router_init == "hidden":  # unit rows, one per expert's text, in encoder and decoder routers alike
        torch.testing.assert_close(torch.stack(gates).norm(dim=-1), torch.ones(5, 4))
    assert_same_seq2seq_outputs(t5, moe)


def test_hidden_rows_are_the_ffn_inputs_of_each_experts_text(dense):
    """Row e of an encoder router is the normalized mean input of that FFN over text e, and of a decoder router the
    same with the text as the decoder's input: checked against T5's own FFN inputs."""
    t5, folder = dense("t5-v1.1")
    moe = upcycle(folder, num_experts=4, encoder_moe_layers=[2], decoder_moe_layers=[0], router_init="hidden",
                  sample_texts=SAMPLE_TEXTS)
    seen = {}
    hooks = [t5.get_submodule(m).register_forward_pre_hook(lambda _, a, m=m: seen.__setitem__(m, a[0][0].mean(0)))
             for m in ("encoder.block.2.layer.1.DenseReluDense", "decoder.block.0.layer.2.DenseReluDense")]
    try:
        for e, text in enumerate(SAMPLE_TEXTS):
            ids = tokenizer()(text, return_tensors="pt")["input_ids"]
            t5(input_ids=ids, decoder_input_ids=ids)
            for stack, i, module in (("encoder", 2, "encoder.block.2.layer.1"), ("decoder", 0, "decoder.block.0.layer.2")):
                row = getattr(moe.model, stack).layers[i].mlp.gate.weight[e]
                torch.testing.assert_close(row, seen[module + ".DenseReluDense"] / seen[module + ".DenseReluDense"].norm())
    finally:
        for hook in hooks:
            hook.remove()


ROUND_TRIPS = {
    "v1.0-topk": ("t5-v1.0", dict(router_type="topk")),
    "v1.1-switch": ("t5-v1.1", dict(router_type="switch")),  # down_proj scaled by 4 and back
    "v1.1-prototype": ("t5-v1.1", dict(router_type="prototype", num_experts_per_tok=4, num_experts=8)),  # x 1/2
}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_t5_moe_t5_is_bit_exact(dense, tmp_path, case):
    version, options = ROUND_TRIPS[case]
    t5, folder = dense(version)
    moe = upcycle(folder, save_directory=tmp_path / "moe", **(dict(num_experts=4, moe_layer_frequency=1) | options))
    assert (moe / "modeling_seq2seq_moe.py").is_file()
    assert AutoTokenizer.from_pretrained(moe).get_vocab() == tokenizer().get_vocab()
    assert_same_seq2seq_outputs(t5, Seq2SeqMoEForConditionalGeneration.from_pretrained(moe))

    out = merge_experts(moe, save_directory=tmp_path / "dense")
    original, merged = read_tensors(folder), read_tensors(out)
    assert merged.keys() == original.keys() and ("lm_head.weight" in merged) == (version == "t5-v1.1")
    for name, tensor in original.items():
        assert torch.equal(merged[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "t5" and "auto_map" not in config and not list(out.glob("*.py"))
    assert GenerationConfig.from_pretrained(out).to_dict() == GenerationConfig.from_pretrained(folder).to_dict()
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(out)  # plain Transformers
    assert type(reloaded) is T5ForConditionalGeneration
    assert (reloaded.lm_head.weight is reloaded.shared.weight) == (version == "t5-v1.0")
    assert_same_seq2seq_outputs(t5, reloaded)


def _noisy_moe(dense, version="t5-v1.1", **options):
    """An upcycled T5 whose experts differ (noise) and whose routers are not uniform (random)."""
    _, folder = dense(version)
    return upcycle(folder, num_experts=4, noise_std=0.05, router_init="random", initializer_range=1.0,
                   encoder_moe_layers=[1], decoder_moe_layers=[0], **options)


def test_merge_methods_on_both_stacks(dense):
    moe = _noisy_moe(dense)
    mean, one = merge_experts(moe), merge_experts(moe, method="expert", expert=3)
    for stack, i, f in (("encoder", 1, 1), ("decoder", 0, 2)):
        experts = getattr(moe.model, stack).layers[i].mlp.experts
        gate, up = experts.gate_up_proj.chunk(2, dim=1)  # [E, I, H] each, as nn.Linear [out, in]
        ffn = getattr(mean, stack).block[i].layer[f].DenseReluDense
        torch.testing.assert_close(ffn.wi_0.weight, gate.mean(0), atol=1e-6, rtol=0)
        torch.testing.assert_close(ffn.wi_1.weight, up.mean(0), atol=1e-6, rtol=0)
        torch.testing.assert_close(ffn.wo.weight, experts.down_proj.mean(0), atol=1e-6, rtol=0)
        ffn = getattr(one, stack).block[i].layer[f].DenseReluDense
        assert torch.equal(ffn.wi_1.weight, up[3]) and torch.equal(ffn.wo.weight, experts.down_proj[3])


def test_usage_counts_the_routes_of_encoder_and_decoder(dense):
    moe = _noisy_moe(dense)
    merged = merge_experts(moe, method="usage", sample_texts=SAMPLE_TEXTS, tokenizer=tokenizer())
    counts = {"encoder": torch.zeros(4), "decoder": torch.zeros(4)}  # recounted: top-2 of the routers' softmax
    for text in SAMPLE_TEXTS:
        ids = tokenizer()(text, return_tensors="pt")["input_ids"]
        out = moe(input_ids=ids, decoder_input_ids=ids, output_router_logits=True)
        for stack, (logits,) in (("encoder", out.encoder_router_logits), ("decoder", out.decoder_router_logits)):
            counts[stack] += torch.bincount(logits.softmax(-1).topk(2).indices.flatten(), minlength=4)
    assert not torch.equal(counts["encoder"], counts["decoder"])  # each layer is weighted by its own routes
    for stack, i, f in (("encoder", 1, 1), ("decoder", 0, 2)):
        weights = (counts[stack] / counts[stack].sum()).double()
        assert len(set(weights.tolist())) > 1  # uneven usage, so the test tells "usage" from "mean"
        down = getattr(moe.model, stack).layers[i].mlp.experts.down_proj.double()
        expected = torch.einsum("e,eij->ij", weights, down).float()
        torch.testing.assert_close(getattr(merged, stack).block[i].layer[f].DenseReluDense.wo.weight, expected, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------ Switch Transformers


@pytest.mark.parametrize("tied", [True, False])
def test_switch_import_equals_switch(tmp_path, tied):
    switch = tiny_switch(tie_word_embeddings=tied)
    switch.save_pretrained(tmp_path / "switch")
    imported = import_moe(tmp_path / "switch")
    c = imported.config
    assert (c.router_type, c.num_experts, c.num_experts_per_tok) == ("switch", 4, 1)
    assert c.capacity_factor is None and c.eval_capacity_factor is None  # dropless
    assert _moe_layers(imported) == [[b.is_sparse for b in switch.encoder.block], [b.is_sparse for b in switch.decoder.block]]
    assert c.conversion["imported_from"]["expert_capacity"] == 64
    assert (c.tie_word_embeddings, c.scale_decoder_outputs) == (tied, tied)
    assert_same_seq2seq_outputs(switch, imported)
    from_object = import_moe(switch)
    assert all(torch.equal(v, from_object.state_dict()[k]) for k, v in imported.state_dict().items())


def test_switch_merges_into_a_t5(tmp_path):
    switch = tiny_switch()
    out = merge_experts(import_moe(switch), save_directory=tmp_path / "t5")
    t5 = AutoModelForSeq2SeqLM.from_pretrained(out)
    assert type(t5) is T5ForConditionalGeneration and t5.config.feed_forward_proj == "relu"
    wi = torch.stack([switch.encoder.block[1].layer[1].mlp.experts[f"expert_{e}"].wi.weight for e in range(4)])
    torch.testing.assert_close(t5.encoder.block[1].layer[1].DenseReluDense.wi.weight, wi.mean(0), atol=1e-6, rtol=0)
    assert torch.equal(t5.encoder.block[0].layer[1].DenseReluDense.wo.weight, switch.encoder.block[0].layer[1].mlp.wo.weight)
    ids = seq2seq_inputs()
    assert t5(**ids).logits.shape == switch(**ids).logits.shape


def test_switch_settings_without_a_counterpart_are_refused(tmp_path):
    with pytest.raises(ConversionError, match=r"router_bias=True \(our gate has no bias\)"):
        import_moe(tiny_switch(router_bias=True))
    with pytest.raises(ConversionError, match=r"router_dtype='bfloat16' \(our router GEMM runs in float32 or in"):
        import_moe(tiny_switch(router_dtype="bfloat16"))
    untied = tiny_switch(tie_word_embeddings=False)
    untied.encoder.embed_tokens.weight = torch.nn.Parameter(untied.shared.weight + 1)  # a second embedding
    with pytest.raises(ConversionError, match=r"encoder.embed_tokens.weight .* into model.shared.weight: tensor 1 differs"):
        import_moe(untied, save_directory=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_switch_and_t5_point_to_the_right_function(dense):
    with pytest.raises(ConversionError, match="use import_moe"):
        upcycle(tiny_switch(), num_experts=4)
    with pytest.raises(ConversionError, match="use upcycle"):
        import_moe(dense("t5-v1.0")[0])
