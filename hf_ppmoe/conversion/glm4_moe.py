"""GLM-4-MoE <-> GPT-MoE, both ways (no dense twin: Llama, Qwen2 or Qwen3 fit only some of its attentions).

What it computes (Transformers 5.24, `models/glm4_moe`): DeepSeek-V3's router: scores sigmoid(W x) in float32; the
experts chosen by scores + e_score_correction_bias (our expert_bias; zeros for a model without one), weighted by the
scores alone, renormalised iff norm_topk_prob, times routed_scaling_factor; with n_group groups of E/n_group experts,
a group scored by the sum of its two best biased scores (as ours) and the choice limited to the topk_group best
groups (groups of one expert would fail in its topk(2)). Layers < first_k_dense_replace a gated dense MLP of
intermediate_size, all later ones MoE; shared experts n_shared_experts * moe_intermediate_size wide added ungated
(as ours; width 0 for none); q/k/v biases or none (attention_bias), no o_proj bias; optional per-head q/k RMSNorm
(use_qk_norm); no sliding window; rotary on partial_rotary_factor of each head (exported as 1.0: ours rotates the
whole head); no jitter, no load-balancing loss (it balances with the bias).
"""

from __future__ import annotations

import torch

from .adapter import Architecture, FieldMap, capacity_reasons, expert_size, jitter_reasons, moe_layers, renormalizes, weighting
from .choices import EXPORT_CLASSES
from .llama import absent, biases, decoder_reasons, dense_ffn_rules, expert_rules, llama_names, rotary_config, rotary_fields
from .mapping import ConversionError, rename

FIELDS = FieldMap.of("num_experts_per_tok", "output_router_logits", "intermediate_size", "routed_scaling_factor",
                     "attention_bias", num_experts="n_routed_experts", num_expert_groups="n_group", qk_norm="use_qk_norm")


def _partial_rotary(c) -> float:
    return (c.rope_parameters or {}).get("partial_rotary_factor", 1.0)


def _fields(c, names=frozenset()):
    if _partial_rotary(c) != 1.0:
        raise ConversionError(
            f"GLM-4-MoE with partial_rotary_factor={_partial_rotary(c)} (rope_parameters) is not supported: "
            "GPT-MoE rotates the whole head (partial_rotary_factor=1.0)."
        )
    return rotary_fields(c, attention_bias=c.attention_bias, attention_output_bias=False, mlp_bias=False) | FIELDS.ours(c) | dict(
        moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.n_shared_experts * c.moe_intermediate_size,
        router_type="topk",
        router_score_function="sigmoid",
        router_expert_bias=True,  # e_score_correction_bias, always there (zeros until trained)
        norm_topk_prob=c.norm_topk_prob,
        topk_expert_groups=c.topk_group,
        capacity_factor=None,
        eval_capacity_factor=None,
        moe_layers=list(range(c.first_k_dense_replace, c.num_hidden_layers)),
        router_jitter_noise=0.0,
        router_aux_loss_coef=0.0,  # GLM-4-MoE has no load-balancing loss (it balances with the bias)
        router_z_loss_coef=0.0,
    )


def _rules(c, names=frozenset(), ours=None, dtype=torch.float32):
    """Exporting a model without a shared expert or a selection bias (`ours`): GLM's shared experts of width 0 in
    `dtype`, its e_score_correction_bias zeros."""
    expert_bias = ours is None or ours.router_expert_bias
    rules = [rename(n, n) for n in llama_names(_fields(c), dense_mlp=False)]
    for i in range(c.num_hidden_layers):
        m = f"model.layers.{i}.mlp."
        if i < c.first_k_dense_replace:
            rules += dense_ffn_rules(m)
            continue
        rules += [
            rename(m + "gate.weight", m + "gate.weight"),
            rename(m + "gate.e_score_correction_bias", m + "gate.expert_bias") if expert_bias else
            absent(m + "gate.e_score_correction_bias", (c.n_routed_experts,)),
            *expert_rules(m, m, "gate_proj", "up_proj", "down_proj"),
        ]
        shared = [f"{m}shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")]
        if c.n_shared_experts:
            rules += [rename(name, name.replace("shared_experts.", "shared_expert.")) for name in shared]
        else:  # width 0 (its output is exactly zero): ours has no shared expert
            H = c.hidden_size
            rules += [absent(name, shape, dtype) for name, shape in zip(shared, ((0, H), (0, H), (H, 0)))]
    return rules


def _first_dense(c) -> int | None:
    """first_k_dense_replace for which GLM-4-MoE has exactly our MoE layers (layers k.. MoE, 0..k-1 dense), or None."""
    moe = moe_layers(c)
    k = moe.index(True) if True in moe else len(moe)
    return k if all(moe[k:]) else None


def _config(c):
    from transformers import Glm4MoeConfig

    fields = rotary_config(c)
    fields["rope_parameters"]["partial_rotary_factor"] = 1.0  # ours rotates the whole head; GLM's default is half
    return Glm4MoeConfig(
        **fields,
        **FIELDS.theirs(c),
        router_aux_loss_coef=c.router_aux_loss_coef,  # carried, though GLM-4-MoE has no load-balancing loss
        moe_intermediate_size=expert_size(c),
        n_shared_experts=c.shared_expert_intermediate_size // expert_size(c),
        norm_topk_prob=renormalizes(c),
        topk_group=c.topk_expert_groups or c.num_expert_groups,
        first_k_dense_replace=_first_dense(c),
        num_mtp_layers=0,  # no multi-token-prediction layers
    )


def _reasons(c) -> list[str]:
    label = "GLM-4-MoE"
    _, reasons = weighting(c, label)
    E, N, I = c.num_experts, c.num_expert_groups, expert_size(c)
    if c.router_score_function != "sigmoid":
        reasons.append(f"router_score_function={c.router_score_function!r}; {label} scores each expert with "
                       "sigmoid(W x) on its own (router_score_function='sigmoid')")
    if E // N < 2:  # all E experts are one group for N = 1
        reasons.append(f"num_expert_groups={N} makes groups of one expert; {label} scores a group by the sum of its "
                       "two best experts, so a group needs 2 or more")
    if _first_dense(c) is None:
        reasons.append(f"MoE layers {[i for i, m in enumerate(moe_layers(c)) if m]} of {c.num_hidden_layers}; "
                       f"{label}'s first first_k_dense_replace layers are dense and every later one is MoE")
    if c.shared_expert_intermediate_size % I:
        reasons.append(f"shared_expert_intermediate_size={c.shared_expert_intermediate_size} is not a multiple of the "
                       f"expert size {I}; {label}'s shared experts are n_shared_experts * moe_intermediate_size wide")
    if c.sliding_window is not None:
        reasons.append(f"sliding_window={c.sliding_window}; {label} attends to every earlier position")
    bias_reason = f"an o_proj bias ({biases(c)}); {label} has q/k/v biases only" if c.attention_output_bias else None
    return (reasons + capacity_reasons(c, label) + jitter_reasons(c, label, jitters=False)
            + decoder_reasons(c, label, bias_reason, qk_norm=c.qk_norm))  # use_qk_norm is ours


ARCHITECTURES = [
    Architecture("glm4_moe", EXPORT_CLASSES["glm4_moe"], _fields, _rules, moe=True, config=_config, reasons=_reasons),
]
