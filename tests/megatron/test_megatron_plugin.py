"""The Accelerate side of the Megatron-LM backend that runs without Megatron: the config parser registered for
"gpt_moe" (through Accelerate's own MegatronLMPlugin lookup), the refusals of what Megatron cannot express, and the
batch conversion of GPTMoETrainStep (same loss as Transformers)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from accelerate.utils import MegatronLMPlugin
from helpers import tiny_gpt_config

from hf_ppmoe import GPTMoEForCausalLM
from hf_ppmoe.moe.losses import router_loss
from hf_ppmoe.megatron.plugin import (
    megatron_batch,
    megatron_incompatibilities,
    megatron_lm_args,
    transformer_config_kwargs,
)


def test_accelerate_finds_our_parser_and_sets_the_ppmoe_layout():
    config = tiny_gpt_config(
        num_hidden_layers=4, moe_layer_frequency=2, router_aux_loss_coef=0.02, router_z_loss_coef=0.0
    )
    plugin = MegatronLMPlugin(tp_degree=2, pp_degree=2, context_parallel_size=1)
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    plugin.set_network_size_args(GPTMoEForCausalLM(config), batch)  # Accelerate's substring lookup over model types
    args = plugin.megatron_lm_default_args
    assert args["model_type_name"] == "gpt" and args["seq_length"] == plugin.seq_length == 16
    assert (
        args["tensor_model_parallel_size"],
        args["expert_model_parallel_size"],
        args["expert_tensor_parallel_size"],
    ) == (2, 2, 1)
    assert args["sequence_parallel"] and args["moe_token_dispatcher_type"] == "allgather"
    assert args["moe_layer_freq"] == [
        0,
        1,
        0,
        1,
    ]  # HF: layer i is MoE when (i + 1) % 2 == 0; Megatron's int would be i % 2
    assert args["moe_aux_loss_coeff"] == pytest.approx(0.01)  # 0.02 averaged over 2 MoE layers -> per-layer sum
    assert args["moe_z_loss_coeff"] is None and args["swiglu"] and args["num_query_groups"] == 2
    assert args["position_embedding_type"] == "rope" and not args["add_position_embedding"]


def test_parser_refuses_context_parallelism_and_seq2seq():
    model = GPTMoEForCausalLM(tiny_gpt_config())
    with pytest.raises(ValueError, match="context_parallel_size=1"):
        MegatronLMPlugin(tp_degree=1, pp_degree=1).set_network_size_args(model)  # Accelerate's default is 2
    seq2seq = SimpleNamespace(config=SimpleNamespace(model_type="seq2seq_moe"))
    with pytest.raises(ValueError, match="seq2seq_moe cannot be trained with Accelerate's Megatron-LM backend"):
        MegatronLMPlugin(context_parallel_size=1).set_network_size_args(seq2seq)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(router_type="gshard", capacity_factor=None), "router_type='gshard'"),
        (dict(router_type="prototype"), "router_type='prototype'"),
        (dict(capacity_factor=1.25), "capacity_factor=1.25"),
        (dict(eval_capacity_factor=2.0), "eval_capacity_factor=2.0"),
        (dict(router_num_groups=2), "router_num_groups=2"),
        (dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
        (dict(topk_weighting="m6t"), "topk_weighting=.m6t."),
        (dict(mlp_bias=True), r"\(attention_bias, attention_output_bias, mlp_bias\)=\(False, False, True\)"),
        (
            dict(attention_bias=True, mlp_bias=True, shared_expert_intermediate_size=16, attention_output_bias=True),
            "shared experts have no biases",
        ),
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}), "rope_parameters"),
        (dict(hidden_act="tanh"), "hidden_act='tanh'"),
        (dict(qk_norm=True, norm_type="layernorm"), "qk_norm=True with norm_type='layernorm'"),
    ],
)
def test_what_megatron_cannot_express_is_refused(overrides, field):
    config = tiny_gpt_config(**overrides)
    problems = megatron_incompatibilities(config)
    assert len(problems) == 1, problems
    with pytest.raises(ValueError, match=field):
        transformer_config_kwargs(config)


def test_router_mapping():
    """Our gates -> Megatron's softmax placement (the numerical equality is checked in test_megatron_model.py)."""
    renormalized = transformer_config_kwargs(tiny_gpt_config())
    plain = transformer_config_kwargs(tiny_gpt_config(norm_topk_prob=False))
    switch = transformer_config_kwargs(tiny_gpt_config(router_type="switch", num_experts_per_tok=1))
    assert (
        not renormalized["moe_router_pre_softmax"]
        and plain["moe_router_pre_softmax"]
        and switch["moe_router_pre_softmax"]
    )
    assert transformer_config_kwargs(tiny_gpt_config(sliding_window=4))["window_size"] == (3, 0)
    qk_norm = tiny_gpt_config(qk_norm=True)  # Qwen3's per-head q/k RMSNorm
    assert transformer_config_kwargs(qk_norm)["qk_layernorm"] and megatron_lm_args(qk_norm)["qk_layernorm"]
    assert not transformer_config_kwargs(tiny_gpt_config())["qk_layernorm"]
    dense = transformer_config_kwargs(tiny_gpt_config(moe_layers=[]))
    assert not any(key.startswith(("moe_", "num_moe", "expert_")) for key in dense)


def test_megatron_batch_gives_the_transformers_loss():
    """Megatron's per-position loss on megatron_batch's labels and mask = Transformers' shifted, -100-masked loss."""
    model = GPTMoEForCausalLM(tiny_gpt_config()).eval()
    ids = torch.randint(3, 97, (2, 9))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 6:] = 0
    labels = ids.masked_fill(attention_mask == 0, -100)
    labels[0, 4] = -100
    with torch.no_grad():
        out = model(ids, attention_mask=attention_mask, labels=labels)
    for batch in (
        {"input_ids": ids, "attention_mask": attention_mask, "labels": labels},
        {"input_ids": ids, "attention_mask": attention_mask},
    ):
        tokens, mlabels, loss_mask, mask, position_ids = megatron_batch(batch)
        per_position = F.cross_entropy(out.logits.transpose(1, 2), mlabels, reduction="none")
        lm_loss = (per_position * loss_mask).sum() / loss_mask.sum()
        expected = out.loss - router_loss(model.config, out.aux_loss, out.z_loss)
        if "labels" not in batch:  # targets from input_ids: only padding is ignored
            shifted = ids.masked_fill(attention_mask == 0, -100)[:, 1:]
            expected = F.cross_entropy(out.logits[:, :-1].transpose(1, 2), shifted, ignore_index=-100)
        torch.testing.assert_close(lm_loss, expected)
        assert torch.equal(tokens, ids) and torch.equal(position_ids[1], torch.arange(9))
        # Megatron's mask: True = masked; causal, plus the padded keys of row 1
        assert mask[0, 0].equal(torch.ones(9, 9, dtype=torch.bool).triu(1)) and mask[1, 0, 8, 6:].all()
    assert megatron_batch({"input_ids": ids})[3] is None  # no padding: Megatron's own causal mask (fused kernels)
