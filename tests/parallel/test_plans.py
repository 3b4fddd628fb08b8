"""The parallel plans our models hand to Transformers (single process)."""

import re

import pytest
from helpers import GPT2_STYLE, tiny_gpt_config, tiny_seq2seq_config

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration


def generic_names(model):
    names = {n for n, _ in [*model.named_modules(), *model.named_parameters()]}
    return {re.sub(r"\.\d+(?=\.|$)", ".*", n) for n in names}


@pytest.mark.parametrize("style", [dict(), dict(GPT2_STYLE, shared_expert_intermediate_size=16)], ids=["llama", "gpt2"])
def test_plans_name_only_what_the_model_has(style):
    model = GPTMoEForCausalLM(tiny_gpt_config(moe_layer_frequency=2, **style))
    for plan in (model.tp_plan, model.ep_plan):
        assert plan and set(plan) <= generic_names(model)
    experts = "model.layers.*.mlp.experts"
    assert model.tp_plan[experts] == "ppmoe_experts" and model.ep_plan[experts] == "ep_dispatch_experts"
    assert model.tp_plan["model.layers.*.mlp"] == "ppmoe_ffn"
    split = {k.rsplit(".", 1)[1] for k, v in model.ep_plan.items() if v == "grouped_gemm"}
    expected = {"gate_up_proj", "down_proj"} if not style else {"up_proj", "down_proj", "up_proj_bias", "down_proj_bias"}
    assert split == expected  # every expert weight is split on the expert dim, nothing else


@pytest.mark.parametrize("tied", [False, True])
def test_encoder_decoder_plans(tied):
    model = Seq2SeqMoEForConditionalGeneration(
        tiny_seq2seq_config(moe_layer_frequency=2, tie_word_embeddings=tied, gated_mlp=not tied)
    )
    tp, ep = model.tp_plan, model.ep_plan
    assert set(tp) <= generic_names(model) and set(ep) <= generic_names(model)
    for stack, attentions in (("encoder", ["self_attn"]), ("decoder", ["self_attn", "cross_attn"])):
        prefix = f"model.{stack}"
        assert tp[f"{prefix}.relative_attention_bias"] == "head_sharded_bias"  # split on the heads, like q/k/v
        for attention in attentions:
            assert [tp[f"{prefix}.layers.*.{attention}.{p}_proj"] for p in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
        assert tp[f"{prefix}.layers.*.mlp"] == "ppmoe_ffn" and tp[f"{prefix}.layers.*.mlp.experts"] == "ppmoe_experts"
        assert ep[f"{prefix}.layers.*.mlp.experts"] == "ep_dispatch_experts"
    assert tp["model.shared"] == "embedding_rowwise" and tp["lm_head"] == "colwise_gathered"
    dense = {k.rsplit(".", 1)[1] for k in tp if ".mlp." in k and ".experts" not in k}
    assert dense == ({"up_proj", "down_proj"} if tied else {"gate_proj", "up_proj", "down_proj"})


def test_model_code_knows_nothing_of_torch_distributed():
    """Parallelism is applied from hf_ppmoe.parallel: the MoE core and the model families never name it."""
    from pathlib import Path

    import hf_ppmoe

    root = Path(hf_ppmoe.__file__).parent
    offenders = [
        str(path.relative_to(root))
        for package in ("moe", "modeling")
        for path in (root / package).glob("*.py")
        if "torch.distributed" in path.read_text()
    ]
    assert offenders == []
