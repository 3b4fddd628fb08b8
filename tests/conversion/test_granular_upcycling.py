"""Fine-grained upcycling (`upcycle(..., granularity=g)`, arXiv 2410.07524): E / g copies of each dense FFN cut into g
slices of its inner size (expert e = slice e % g of copy e // g), k * g routes per token taking whole copies (router
rows equal within a copy), down-projections scaled by g: equal to the dense model at step 0, merged back bit for bit,
and every setting where that cannot hold refused with the fix."""

import warnings

import pytest
import torch
from converters import SAMPLE_TEXTS, assert_same_outputs, assert_same_seq2seq_outputs, input_ids, read_tensors, tokenizer
from transformers import AutoModelForCausalLM

from hf_ppmoe import GPTMoEForCausalLM
from hf_ppmoe.conversion import ConversionError, merge_experts, upcycle
from hf_ppmoe_cli import main

E = 8


def _granular(folder, g: int, k: int, **options):
    """An upcycle with a decisive random router (rows of std 1), so that tokens take different copies."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a renormalising top-k with a non-uniform router is exact: no warning
        return upcycle(folder, num_experts=E, num_experts_per_tok=k, granularity=g, router_init="random",
                       initializer_range=1.0, moe_layer_frequency=1, seed=3, **options)


@pytest.mark.parametrize("g, k", [(2, 2), (4, 1)])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gated, no biases; ungated with biases
def test_granular_upcycle_equals_dense(dense, arch, g, k):
    model, folder = dense(arch)
    moe = _granular(folder, g, k)
    c = moe.config
    assert (c.num_experts_per_tok, c.moe_intermediate_size) == (k * g, c.intermediate_size // g)
    ids = input_ids(length=10)
    with torch.no_grad():
        out = moe(ids, output_router_logits=True)
        torch.testing.assert_close(out.logits, model(ids).logits, atol=1e-5, rtol=0)
    chosen = set()
    for n, expert_ids in enumerate(out.router_expert_ids):  # every token takes k whole copies: g consecutive experts
        copies = expert_ids.sort(dim=-1).values.view(-1, k, g)
        assert torch.equal(copies, copies[..., :1] + torch.arange(g)) and (copies[..., 0] % g == 0).all()
        chosen |= {(n, *row.tolist()) for row in copies[..., 0]}
    assert len(chosen) > len(out.router_expert_ids)  # in some layer, tokens take different copies
    assert_same_outputs(model, moe, ids)
    original, merged = model.state_dict(), merge_experts(moe).state_dict()  # the slices joined, the copies averaged
    assert all(torch.equal(merged[name], value) for name, value in original.items() if name in merged)


def test_granular_t5_equals_it_and_merges_back(dense):
    t5, folder = dense("t5-v1.1")  # gated GELU FFNs in both stacks
    moe = _granular(folder, 2, 2)
    assert_same_seq2seq_outputs(t5, moe)
    merged = merge_experts(moe).state_dict()
    assert all(torch.equal(merged[k], v) for k, v in t5.state_dict().items() if k in merged)


def test_experts_are_the_slices_of_the_dense_ffn(dense):
    model, folder = dense("llama")
    g, F = 4, model.config.intermediate_size
    moe = _granular(folder, g, 1)
    assert moe.config.moe_intermediate_size == F // g and moe.config.num_experts_per_tok == g
    assert moe.config.conversion["granularity"] == g and moe.config.conversion["expert_output_scale"] == g
    dense_mlp, layer = model.model.layers[1].mlp, moe.model.layers[1].mlp
    for e in range(E):
        rows = slice((e % g) * F // g, (e % g + 1) * F // g)  # expert e: slice e % g of copy e // g
        gate_up = torch.cat([dense_mlp.gate_proj.weight[rows], dense_mlp.up_proj.weight[rows]])
        assert torch.equal(layer.experts.gate_up_proj[e], gate_up)
        assert torch.equal(layer.experts.down_proj[e], g * dense_mlp.down_proj.weight[:, rows])
        assert torch.equal(layer.gate.weight[e], layer.gate.weight[e - e % g])  # one router row per copy
    assert not torch.equal(layer.gate.weight[0], layer.gate.weight[g])


def test_ungated_biases_are_sliced_and_the_output_bias_shared(dense):
    model, folder = dense("gpt2")
    g, F = 2, 4 * model.config.n_embd
    layer, mlp = _granular(folder, g, 2).model.layers[0].mlp, model.transformer.h[0].mlp
    for e in range(E):
        cols = slice((e % g) * F // g, (e % g + 1) * F // g)
        assert torch.equal(layer.experts.up_proj[e], mlp.c_fc.weight[:, cols].T)
        assert torch.equal(layer.experts.up_proj_bias[e], mlp.c_fc.bias[cols])
        assert torch.equal(layer.experts.down_proj_bias[e], mlp.c_proj.bias)  # b / g per slice, times the scale g


def test_hidden_router_reads_one_text_per_copy_and_merges_by_copy(dense, tmp_path):
    model, folder = dense("qwen2")
    moe = upcycle(folder, num_experts=E, granularity=2, router_init="hidden", sample_texts=SAMPLE_TEXTS)
    assert moe.config.num_experts_per_tok == 4
    assert_same_outputs(model, moe)
    for method in ("usage", "expert"):
        merged = merge_experts(moe, method=method, expert=5, sample_texts=SAMPLE_TEXTS, tokenizer=tokenizer())
        assert all(torch.equal(merged.state_dict()[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ConversionError, match="per copy of the FFN: num_experts / g\\), 4 in all; got 8"):
        upcycle(folder, num_experts=E, granularity=2, router_init="hidden", sample_texts=SAMPLE_TEXTS * 2)


@pytest.mark.parametrize("options, message", [
    (dict(granularity=0), "granularity=0: a positive integer"),
    (dict(granularity=3), "granularity=3 must divide num_experts=8"),
    (dict(granularity=4, num_experts_per_tok=3), r"num_experts_per_tok=3 copies per token take 3 \* granularity = 12"),
    (dict(granularity=2, router_type="gshard"), "granularity=2 needs router_type='topk', not 'gshard'"),
    (dict(granularity=2, router_init="zeros"), "torch.topk's order among ties"),
    (dict(granularity=2, reinit_ratio=0.5), "Drop-Upcycling of sliced experts is not built"),
    (dict(granularity=5, num_experts=10, num_experts_per_tok=1), "must divide the dense FFN's inner size "
                                                                   "intermediate_size=48"),
    (dict(granularity=4, num_expert_groups=4, num_experts_per_tok=1), "each routing group of 2 experts must hold "
                                                                       "whole copies"),
])
def test_settings_that_cannot_be_exact_are_refused(dense, tmp_path, options, message):
    _, folder = dense("llama")
    options = dict(num_experts=E, router_init="random", moe_layers=[1]) | options
    with pytest.raises(ConversionError, match=message):
        upcycle(folder, save_directory=tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def test_cli_granularity(dense, tmp_path, capsys):
    model, folder = dense("llama")
    args = ["--num_experts", "8", "--granularity", "2", "--moe_layer_frequency", "1"]
    assert main(["upcycle", str(folder), str(tmp_path / "moe"), *args, "--router_init", "random"]) == 0
    moe = GPTMoEForCausalLM.from_pretrained(tmp_path / "moe")
    assert (moe.config.num_experts_per_tok, moe.config.moe_intermediate_size) == (4, 24)
    assert_same_outputs(model, moe)
    assert main(["merge", str(tmp_path / "moe"), str(tmp_path / "dense")]) == 0
    original, merged = read_tensors(folder), read_tensors(tmp_path / "dense")
    assert all(torch.equal(merged[k], v) for k, v in original.items())
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "dense")).__name__ == "LlamaForCausalLM"
    assert main(["upcycle", str(folder), str(tmp_path / "auto"), *args]) == 0  # the default, auto: a random router
    assert_same_outputs(model, GPTMoEForCausalLM.from_pretrained(tmp_path / "auto"))
    with pytest.raises(SystemExit) as exit:  # zeros: refused before the source is read
        main(["upcycle", str(folder), str(tmp_path / "zeros"), *args, "--router_init", "zeros"])
    assert exit.value.code == 2 and "granularity=2 with router_init='zeros'" in capsys.readouterr().err
