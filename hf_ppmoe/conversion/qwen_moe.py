"""Qwen2-MoE (export only) and Qwen3-MoE (both ways; its dense twin is Qwen3) <-> GPT-MoE.

What they compute (Transformers 5.24, `models/qwen2_moe`, `models/qwen3_moe`):

- Qwen2-MoE: MoE layers where (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers, the others a gated
  dense MLP of `intermediate_size`; softmax top-k, renormalised iff norm_topk_prob; no jitter; q/k/v biases
  (qkv_bias), none on o_proj or the MLPs; every MoE layer adds a shared expert scaled by a sigmoid gate,
  sigmoid(x . w_g) * shared(x). Ours adds shared(x) ungated: w_g = 0 gives the factor sigmoid(0) = 1/2 exactly, so
  the shared expert's down-projection is exported times 2 (exact: a power of two). A model without a shared expert
  gets one of width 0 (its output is exactly zero). Ours cannot compute the sigmoid gate: no import.
- Qwen3-MoE: Qwen2-MoE's MoE layout (decoder_sparse_step, mlp_only_layers, softmax top-k renormalised iff
  norm_topk_prob, no jitter) without a shared expert; biases on all of q, k, v, o or none (attention_bias); its
  attention RMS-normalises every query and key head over head_dim (q_norm, k_norm, eps rms_norm_eps) before the
  rotary embedding: GPT-MoE with qk_norm=True, and only with it.

Both store one nn.Linear per expert, `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj`; router `mlp.gate`.
"""

from __future__ import annotations

import torch

from .adapter import Architecture, FieldMap, expert_size, moe_layers, renormalizes, routing_reasons, weighting
from .choices import EXPORT_CLASSES
from .llama import (MOE, absent, biases, decoder_reasons, dense_ffn_rules, expert_rules, llama_names, rotary_config,
                    rotary_fields, window_fields)
from .mapping import Rule, Scale, rename

FIELDS = MOE | FieldMap.of("intermediate_size", "num_experts", "sliding_window")


def qwen_moe_layers(c) -> list[bool]:
    """Which layers of a Qwen2-MoE / Qwen3-MoE config are MoE layers (the others a dense MLP of intermediate_size)."""
    return [
        c.num_experts > 0 and i not in c.mlp_only_layers and (i + 1) % c.decoder_sparse_step == 0
        for i in range(c.num_hidden_layers)
    ]


def _placement(c) -> dict:
    """Our MoE layers as Qwen places them."""
    step = c.moe_layer_frequency if c.moe_layers is None else 1
    return dict(decoder_sparse_step=step,
                mlp_only_layers=[i for i, moe in enumerate(moe_layers(c)) if (i + 1) % step == 0 and not moe])


def _config_fields(c) -> dict:
    """Our config -> what Qwen2-MoE's and Qwen3-MoE's configs share."""
    return dict(rotary_config(c), **FIELDS.theirs(c), **_placement(c), moe_intermediate_size=expert_size(c),
                norm_topk_prob=renormalizes(c), use_sliding_window=c.sliding_window is not None)


def _layer_rules(c, shared) -> list[Rule]:
    """Per layer: a dense MLP, or the router, the experts and `shared(m)`."""
    rules = []
    for i, moe in enumerate(qwen_moe_layers(c)):
        m = f"model.layers.{i}.mlp."
        if not moe:
            rules += dense_ffn_rules(m)
            continue
        rules += [rename(m + "gate.weight", m + "gate.weight"), *expert_rules(m, m, "gate_proj", "up_proj", "down_proj")]
        rules += shared(m)
    return rules


# -------------------------------------------------------------------------------------------------- Qwen2-MoE


def _qwen2_rules(c, names=frozenset(), dtype=torch.float32, **_) -> list[Rule]:
    """Read as an import; export inverts it: zeros of `dtype` for the shared expert's gate (and width-0 weights when
    ours has no shared expert), the down-projection times 2."""
    H = c.hidden_size
    dense = dict(attention_bias=c.qkv_bias, attention_output_bias=False, mlp_bias=False, qk_norm=False,
                 tie_word_embeddings=c.tie_word_embeddings)

    def shared(m):
        gate, up, down = (f"{m}shared_expert.{p}_proj.weight" for p in ("gate", "up", "down"))
        if c.shared_expert_intermediate_size:  # sigmoid(0) = 1/2 exactly: a zero gate, a doubled down-projection
            layer = [rename(gate, gate), rename(up, up), rename(down, down, Scale(0.5))]
        else:  # width 0: the shared expert's output is exactly zero
            layer = [absent(gate, (0, H), dtype), absent(up, (0, H), dtype), absent(down, (H, 0), dtype)]
        return [absent(m + "shared_expert_gate.weight", (1, H), dtype), *layer]

    return [rename(n, n) for n in llama_names(dense, dense_mlp=False)] + _layer_rules(c, shared)


def _qwen2_config(c):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**{**_config_fields(c), **window_fields(c)}, qkv_bias=c.attention_bias,
                          shared_expert_intermediate_size=c.shared_expert_intermediate_size,
                          max_window_layers=c.num_hidden_layers)


def _qwen2_reasons(c) -> list[str]:
    label = "Qwen2-MoE"
    _, reasons = weighting(c, label)
    bias_reason = f"an o_proj bias ({biases(c)}); {label} has q/k/v biases only" if c.attention_output_bias else None
    return reasons + routing_reasons(c, label, jitters=False) + decoder_reasons(c, label, bias_reason)


# -------------------------------------------------------------------------------------------------- Qwen3-MoE


def _qwen3_fields(c, names=frozenset()):
    b = c.attention_bias
    placement = dict(moe_layer_frequency=c.decoder_sparse_step)
    if c.mlp_only_layers:
        placement = dict(moe_layers=[i for i, moe in enumerate(qwen_moe_layers(c)) if moe])
    return dict(
        # Qwen3-MoE applies its one sliding_window (use_sliding_window) to every layer
        rotary_fields(c, attention_bias=b, attention_output_bias=b, mlp_bias=False, qk_norm=True),
        **FIELDS.ours(c),
        **placement,
        moe_intermediate_size=c.moe_intermediate_size,
        router_type="topk",  # softmax over all experts, top-k, renormalised iff norm_topk_prob
        norm_topk_prob=c.norm_topk_prob,
        capacity_factor=None,
        eval_capacity_factor=None,
        router_jitter_noise=0.0,
        router_z_loss_coef=0.0,
    )


def _qwen3_rules(c, names=frozenset(), **_) -> list[Rule]:
    return [rename(n, n) for n in llama_names(_qwen3_fields(c), dense_mlp=False)] + _layer_rules(c, lambda m: [])


def _qwen3_config(c):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_config_fields(c), attention_bias=c.attention_bias)


def _qwen3_reasons(c) -> list[str]:
    label = "Qwen3-MoE"
    _, reasons = weighting(c, label)
    if c.shared_expert_intermediate_size:
        reasons.append(f"a shared expert (shared_expert_intermediate_size={c.shared_expert_intermediate_size}); "
                       f"{label} has none (qwen2_moe has one)")
    bias_reason = None
    if c.attention_bias != c.attention_output_bias:
        bias_reason = f"attention biases ({biases(c)}); {label} has biases on all of q, k, v, o or on none"
    return reasons + routing_reasons(c, label, jitters=False) + decoder_reasons(c, label, bias_reason, qk_norm=True)


ARCHITECTURES = [
    Architecture("qwen2_moe", EXPORT_CLASSES["qwen2_moe"], None, _qwen2_rules, moe=True, config=_qwen2_config,
                 reasons=_qwen2_reasons),
    Architecture("qwen3_moe", EXPORT_CLASSES["qwen3_moe"], _qwen3_fields, _qwen3_rules, moe=True, twin="qwen3",
                 config=_qwen3_config, reasons=_qwen3_reasons),
]
