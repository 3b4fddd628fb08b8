"""Mixtral <-> GPT-MoE, both ways; its dense twin is Mistral.

What Mixtral computes (Transformers 5.24, `models/mixtral/modeling_mixtral.py`): every layer an MoE layer; router =
softmax over all E, top-k, always renormalised to sum to one; dropless; jitter multiplies the hidden states that
reach the router *and* the experts; rotary positions, RMSNorm, gated experts act(gate) * up, no biases, one sliding
window for all layers or none. Its checkpoints store one nn.Linear per expert:

    model.layers.{i}.block_sparse_moe.gate                    model.layers.{i}.mlp.gate
    model.layers.{i}.block_sparse_moe.experts.{e}.w1, w3, w2  model.layers.{i}.mlp.experts.gate_up_proj, down_proj
"""

from __future__ import annotations

from .adapter import Architecture, FieldMap, expert_size, moe_layers, routing_reasons, weighting
from .choices import EXPORT_CLASSES
from .llama import MOE, biases, decoder_reasons, expert_rules, llama_names, rotary_config, rotary_fields
from .mapping import rename

FIELDS = MOE | FieldMap.of("sliding_window", num_experts="num_local_experts")


def _fields(c, names=frozenset()):
    return dict(
        rotary_fields(c, attention_bias=False, attention_output_bias=False, mlp_bias=False),
        **FIELDS.ours(c),
        router_type="topk",
        norm_topk_prob=True,  # Mixtral always renormalises its top-k weights
        capacity_factor=None,
        eval_capacity_factor=None,
        moe_layer_frequency=1,
        router_jitter_noise=c.router_jitter_noise,
        router_z_loss_coef=0.0,
    )


def _rules(c, names=frozenset(), **_):
    s, m = "model.layers.{i}.block_sparse_moe.", "model.layers.{i}.mlp."
    return [
        *[rename(n, n) for n in llama_names(_fields(c), dense_mlp=False)],
        rename(s + "gate.weight", m + "gate.weight"),
        *expert_rules(s, m, "w1", "w3", "w2"),
    ]


def _config(c):
    from transformers import MixtralConfig

    return MixtralConfig(**rotary_config(c), **FIELDS.theirs(c), intermediate_size=expert_size(c),
                         router_jitter_noise=0.0)


def _reasons(c) -> list[str]:
    label = "Mixtral"
    renormalized, reasons = weighting(c, label)
    if renormalized == "probabilities":
        what = "norm_topk_prob=False" if c.router_type == "topk" else f"router_type={c.router_type!r}"
        reasons.append(f"the gate weights experts by their softmax probabilities ({what}); {label} always "
                       "renormalises the top-k weights to sum to one")
    dense = [i for i, moe in enumerate(moe_layers(c)) if not moe]
    if dense:
        reasons.append(f"layers {dense} are dense FFNs (moe_layer_frequency={c.moe_layer_frequency}, moe_layers="
                       f"{c.moe_layers}); every {label} layer is an MoE layer (qwen2_moe allows dense layers)")
    if c.shared_expert_intermediate_size:
        reasons.append(f"a shared expert (shared_expert_intermediate_size={c.shared_expert_intermediate_size}); "
                       f"{label} has none (qwen2_moe has one)")
    bias_reason = f"attention biases ({biases(c)}); {label} has none" if c.attention_bias or c.attention_output_bias else None
    return reasons + routing_reasons(c, label, jitters=True) + decoder_reasons(c, label, bias_reason)


ARCHITECTURES = [
    Architecture("mixtral", EXPORT_CLASSES["mixtral"], _fields, _rules, moe=True, twin="mistral", config=_config,
                 reasons=_reasons),
]
