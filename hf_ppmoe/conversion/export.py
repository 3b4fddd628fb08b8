"""GPT-MoE / Seq2Seq-MoE -> Transformers' own MoE classes, where the model fits one exactly.

Legend: E experts, K routes per token, H hidden, I expert inner size.

An exported folder loads with plain Transformers (no hf_ppmoe, no remote code) as `MixtralForCausalLM`,
`Qwen2MoeForCausalLM`, `Qwen3MoeForCausalLM`, `Glm4MoeForCausalLM` or `SwitchTransformersForConditionalGeneration`, in the layout Transformers' own
`save_pretrained` writes (per-expert tensors, as on the Hub), and computes what our model computes: the same logits,
and in training the same routing (no capacity, jitter or random routing that the target would do differently).

What each target computes (Transformers 5.24, `models/<name>/modeling_<name>.py`):

- Mixtral: every layer an MoE layer; router = softmax over all E, top-k, always renormalised to sum to one; dropless;
  jitter multiplies the hidden states that reach the router *and* the experts; rotary positions, RMSNorm, gated
  experts act(gate) * up, no biases, one sliding window for all layers or none.
- Qwen2-MoE: MoE layers where (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers, the others a gated
  dense MLP of `intermediate_size`; softmax top-k, renormalised iff norm_topk_prob; no jitter; q/k/v biases
  (qkv_bias), none on o_proj or the MLPs; every MoE layer adds a shared expert scaled by a sigmoid gate,
  sigmoid(x . w_g) * shared(x). Ours adds shared(x) ungated: w_g = 0 gives the factor sigmoid(0) = 1/2 exactly, so
  the shared expert's down-projection is exported times 2 (exact: a power of two). A model without a shared expert
  gets one of width 0 (its output is exactly zero).
- Qwen3-MoE: Qwen2-MoE's MoE layout (decoder_sparse_step, mlp_only_layers, softmax top-k renormalised iff
  norm_topk_prob, no jitter) without a shared expert; biases on all of q, k, v, o or none (attention_bias); its
  attention RMS-normalises every query and key head over head_dim (q_norm, k_norm, eps rms_norm_eps) before the
  rotary embedding: GPT-MoE with qk_norm=True, and only with it.
- GLM-4-MoE: DeepSeek-V3's router: scores sigmoid(W x) in float32; the experts chosen by scores +
  e_score_correction_bias (our expert_bias; zeros for a model without one), weighted by the scores alone,
  renormalised iff norm_topk_prob, times routed_scaling_factor; with n_group groups of E/n_group experts, a group
  scored by the sum of its two best biased scores (as ours) and the choice limited to the topk_group best groups
  (groups of one expert would fail in its topk(2)). Layers < first_k_dense_replace a gated dense MLP of
  intermediate_size, all later ones MoE; shared experts n_shared_experts * moe_intermediate_size wide added
  ungated (as ours; width 0 for none); q/k/v biases or none (attention_bias), no o_proj bias; optional per-head q/k
  RMSNorm (use_qk_norm); no sliding window; rotary on partial_rotary_factor of each head (exported as 1.0: ours
  rotates the whole head); no jitter, no load-balancing loss.
- Switch Transformers: T5 v1.0's layout, top-1 router (softmax in float32, the expert weighted by its probability),
  sparse blocks where i % step == 1 (every block for step 1) with step = num_layers // num_sparse_layers per stack;
  `expert_capacity` tokens per expert and sequence, dropped past it in training and evaluation alike (exported as
  2**31 - 1: dropless, like ours); jitter multiplied in place into the hidden states the experts also read (float32);
  dropout_rate on embeddings, residuals, attention and inside every FFN; the head is tied to the embeddings iff its
  input is rescaled by d_model**-0.5 (tie_word_embeddings), and a stored head that differs unties it.

The weight tables are the import tables (architectures.py, t5.py) run backwards; Qwen2-MoE has no import, so its
table is written in the export direction (its experts with the import's `expert_rules`, inverted). Router losses are the target's own and not part of the check: Mixtral and
Qwen add a load-balancing loss pooled over all layers (for one MoE layer K times ours; only with
output_router_logits=True) and no z-loss; Switch adds its per-sequence aux and z-losses. The coefficients are
carried unchanged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from ..modeling import GPTMoEConfig, Seq2SeqMoEConfig
from .architectures import ARCHITECTURES, _glm4_moe_rules, _llama_names, expert_rules
from .choices import EXPORT_CLASSES
from .io import open_checkpoint
from .mapping import ConversionError, Create, Mapping, Rule, Scale, rename
from .delivery import deliver, expected_tensors
from .t5 import switch_sparse_layers
from .upcycling import moe_config_loader

# Switch Transformers drops tokens past `expert_capacity` per expert and sequence, in evaluation too; ours is dropless
DROPLESS_EXPERT_CAPACITY = 2**31 - 1


# ------------------------------------------------------------------------------------------------------ checks


def _weighting(c, label: str) -> tuple[str | None, list[str]]:
    """How the gate weights a token's K experts, in the terms of Transformers' softmax top-k routers: "renormalized"
    (the top-K softmax probabilities divided by their sum), "probabilities" (as they are), or None with the reasons
    when it computes something else."""
    k, gate = c.num_experts_per_tok, c.router_type
    if gate == "topk":
        if c.topk_weighting == "m6t":
            if k == 1:  # a softmax over one probability is 1, as renormalising it is
                return "renormalized", []
            return None, [f"topk_weighting='m6t' weights the {k} experts by a softmax over their probabilities "
                          f"(M6-T Eq. (1)); {label} weights them by the probabilities"]
        return ("renormalized" if c.norm_topk_prob else "probabilities"), []
    if gate == "switch":
        return "probabilities", []
    if gate == "gshard":
        if c.router_random_routing:
            return None, ["router_type='gshard' drops the second expert at random in training (router_random_routing="
                          f"True); {label} always takes both. router_random_routing=False makes it a renormalised top-2"]
        return "renormalized", []
    if gate == "prototype":
        if k == 1:  # one prototype of all E experts: a top-1 softmax router
            return "probabilities", []
        return None, [f"router_type='prototype' routes top-1 within each of {k} prototypes of {c.num_experts // k} "
                      f"experts (M6-T), one softmax per prototype; {label} has one softmax top-k over all experts"]
    return None, [f"router_type={gate!r} is not a built-in gate; {label}'s router is a softmax top-k"]


def _capacity_reasons(c, label: str) -> list[str]:
    """Every target is dropless in training and evaluation."""
    return [
        f"{name}={value}: ours drops routes past an expert's capacity ({when}); {label} is dropless"
        for name, when in (("capacity_factor", "training"), ("eval_capacity_factor", "evaluation"))
        if (value := getattr(c, name)) is not None
    ]


def _jitter_reasons(c, label: str) -> list[str]:
    """No target jitters as ours does: Mixtral and Switch multiply theirs into the hidden states the experts read
    too, the Qwen and GLM models have none."""
    if c.router_jitter_noise <= 0:
        return []
    target = f"{label} has no jitter" if label.startswith(("Qwen", "GLM")) else (
        f"{label} multiplies the hidden states the experts also read")
    return [f"router_jitter_noise={c.router_jitter_noise}: ours jitters only the router's input; {target}"]


def _routing_reasons(c, label: str) -> list[str]:
    """What the softmax top-k targets (Mixtral, Qwen, Switch) need of routing."""
    softmax = [
        f"{name}={value!r}: {what}; {label}'s router is a softmax top-k with neither"
        for name, default, what in (
            ("router_score_function", "softmax", "sigmoid scores"),
            ("router_expert_bias", False, "a per-expert selection bias"),
            ("num_expert_groups", 1, "group-limited routing"),
            ("routed_scaling_factor", 1.0, "scaled combine weights"),
        )
        if (value := getattr(c, name, default)) != default
    ]
    return _capacity_reasons(c, label) + softmax + _jitter_reasons(c, label)


def _decoder_reasons(c, label: str, bias_reason: str | None, qk_norm: bool = False) -> list[str]:
    """What Mixtral / Qwen-MoE need of GPT-MoE's dense part; `bias_reason`: the target's verdict on the attention
    biases (None: they fit); `qk_norm`: whether the target RMS-normalises every query and key head (Qwen3-MoE)."""
    checks = [
        (c.qk_norm and not qk_norm, f"per-head q/k RMSNorm (qk_norm=True); {label}'s attention has none (qwen3_moe "
         "has it)"),
        (qk_norm and not c.qk_norm, f"no per-head q/k norm (qk_norm=False); {label} RMS-normalises every query and "
         "key head (q_norm, k_norm) before the rotary embedding, which no weights can undo"),
        (c.position_embedding_type != "rotary", f"learned absolute positions (position_embedding_type="
         f"{c.position_embedding_type!r}); {label} uses rotary positions"),
        (c.norm_type != "rmsnorm", f"norm_type={c.norm_type!r}; {label} uses RMSNorm"),
        (not c.gated_mlp, f"a plain MLP (gated_mlp=False); {label}'s FFNs are gated, down(act(gate(x)) * up(x))"),
        (c.mlp_bias, f"FFN biases (mlp_bias=True); {label} has none"),
        (bias_reason is not None, bias_reason),
        (c.hidden_dropout > 0, f"hidden_dropout={c.hidden_dropout} on embeddings and residual branches; {label} has "
         "no such dropout (set it to 0 before exporting)"),
    ]
    return [text for bad, text in checks if bad]


def _biases(c) -> str:
    return f"attention_bias={c.attention_bias}, attention_output_bias={c.attention_output_bias}"


def _gpt_moe_layers(c) -> list[bool]:
    return [c.is_moe_layer(i) for i in range(c.num_hidden_layers)]


def _mixtral_reasons(c) -> list[str]:
    label = "Mixtral"
    weighting, reasons = _weighting(c, label)
    if weighting == "probabilities":
        what = "norm_topk_prob=False" if c.router_type == "topk" else f"router_type={c.router_type!r}"
        reasons.append(f"the gate weights experts by their softmax probabilities ({what}); {label} always "
                       "renormalises the top-k weights to sum to one")
    dense = [i for i, moe in enumerate(_gpt_moe_layers(c)) if not moe]
    if dense:
        reasons.append(f"layers {dense} are dense FFNs (moe_layer_frequency={c.moe_layer_frequency}, moe_layers="
                       f"{c.moe_layers}); every {label} layer is an MoE layer (qwen2_moe allows dense layers)")
    if c.shared_expert_intermediate_size:
        reasons.append(f"a shared expert (shared_expert_intermediate_size={c.shared_expert_intermediate_size}); "
                       f"{label} has none (qwen2_moe has one)")
    biases = c.attention_bias or c.attention_output_bias
    bias_reason = f"attention biases ({_biases(c)}); {label} has none" if biases else None
    return reasons + _routing_reasons(c, label) + _decoder_reasons(c, label, bias_reason)


def _qwen2_moe_reasons(c) -> list[str]:
    label = "Qwen2-MoE"
    _, reasons = _weighting(c, label)
    bias_reason = f"an o_proj bias ({_biases(c)}); {label} has q/k/v biases only" if c.attention_output_bias else None
    return reasons + _routing_reasons(c, label) + _decoder_reasons(c, label, bias_reason)


def _qwen3_moe_reasons(c) -> list[str]:
    label = "Qwen3-MoE"
    _, reasons = _weighting(c, label)
    if c.shared_expert_intermediate_size:
        reasons.append(f"a shared expert (shared_expert_intermediate_size={c.shared_expert_intermediate_size}); "
                       f"{label} has none (qwen2_moe has one)")
    bias_reason = None
    if c.attention_bias != c.attention_output_bias:
        bias_reason = f"attention biases ({_biases(c)}); {label} has biases on all of q, k, v, o or on none"
    return reasons + _routing_reasons(c, label) + _decoder_reasons(c, label, bias_reason, qk_norm=True)


def _glm4_moe_first_dense(c) -> int | None:
    """first_k_dense_replace for which GLM-4-MoE has exactly our MoE layers (layers k.. MoE, 0..k-1 dense), or None."""
    moe = _gpt_moe_layers(c)
    k = moe.index(True) if True in moe else len(moe)
    return k if all(moe[k:]) else None


def _glm4_moe_reasons(c) -> list[str]:
    label = "GLM-4-MoE"
    _, reasons = _weighting(c, label)
    E, N, I = c.num_experts, c.num_expert_groups, _expert_size(c)
    if c.router_score_function != "sigmoid":
        reasons.append(f"router_score_function={c.router_score_function!r}; {label} scores each expert with "
                       "sigmoid(W x) on its own (router_score_function='sigmoid')")
    if E // N < 2:  # all E experts are one group for N = 1
        reasons.append(f"num_expert_groups={N} makes groups of one expert; {label} scores a group by the sum of its "
                       "two best experts, so a group needs 2 or more")
    if _glm4_moe_first_dense(c) is None:
        reasons.append(f"MoE layers {[i for i, m in enumerate(_gpt_moe_layers(c)) if m]} of {c.num_hidden_layers}; "
                       f"{label}'s first first_k_dense_replace layers are dense and every later one is MoE")
    if c.shared_expert_intermediate_size % I:
        reasons.append(f"shared_expert_intermediate_size={c.shared_expert_intermediate_size} is not a multiple of the "
                       f"expert size {I}; {label}'s shared experts are n_shared_experts * moe_intermediate_size wide")
    if c.sliding_window is not None:
        reasons.append(f"sliding_window={c.sliding_window}; {label} attends to every earlier position")
    bias_reason = f"an o_proj bias ({_biases(c)}); {label} has q/k/v biases only" if c.attention_output_bias else None
    return (reasons + _capacity_reasons(c, label) + _jitter_reasons(c, label)
            + _decoder_reasons(c, label, bias_reason, qk_norm=c.qk_norm))  # use_qk_norm is ours


def _switch_sparse_count(moe: list[bool]) -> int | None:
    """num_sparse_layers for which Switch Transformers builds exactly the MoE layers `moe` of a stack, or None."""
    n = len(moe)
    for count in range(n + 1):
        step = n // count if count else n  # SwitchTransformersConfig.__post_init__
        stack = SimpleNamespace(num_layers=n, encoder_sparse_step=step)
        if [i in switch_sparse_layers(stack, "encoder") for i in range(n)] == moe:
            return count
    return None


def _seq2seq_moe_layers(c) -> dict[str, list[bool]]:
    return {
        "encoder": [c.is_encoder_moe_layer(i) for i in range(c.num_hidden_layers)],
        "decoder": [c.is_decoder_moe_layer(i) for i in range(c.num_decoder_layers)],
    }


def _switch_reasons(c) -> list[str]:
    label = "Switch Transformers"
    weighting, reasons = _weighting(c, label)
    if c.num_experts_per_tok != 1:
        reasons.append(f"num_experts_per_tok={c.num_experts_per_tok}; {label} routes every token to one expert")
    elif weighting == "renormalized":
        reasons.append(f"the one route's weight is renormalised to 1 (router_type={c.router_type!r}); {label} "
                       "weights the expert by its probability")
    for stack, moe in _seq2seq_moe_layers(c).items():
        if _switch_sparse_count(moe) is None:
            reasons.append(
                f"{stack} MoE layers {[i for i, m in enumerate(moe) if m]} of {len(moe)}: {label} builds sparse blocks "
                "only where i % step == 1 (all blocks for step 1), step = num_layers // num_sparse_layers"
            )
    checks = [
        (c.gated_mlp, f"a gated FFN (gated_mlp=True); {label}'s FFNs are act(wi x) without a gate"),
        (c.norm_type != "rmsnorm", f"norm_type={c.norm_type!r}; {label} uses T5's RMSNorm"),
        (c.attention_scaling != 1.0, f"attention_scaling={c.attention_scaling} (None: head_dim**-0.5); {label} "
         "does not scale q.k (1.0)"),
        (c.attention_bias or c.mlp_bias, f"biases (attention_bias={c.attention_bias}, mlp_bias={c.mlp_bias}); "
         f"{label} has none"),
        (c.hidden_dropout > 0 or c.attention_dropout > 0, f"dropout (hidden_dropout={c.hidden_dropout}, "
         f"attention_dropout={c.attention_dropout}); {label}'s dropout_rate also drops inside every FFN, ours does "
         "not (set both to 0 before exporting)"),
        (c.shared_expert_intermediate_size > 0, f"a shared expert (shared_expert_intermediate_size="
         f"{c.shared_expert_intermediate_size}); {label} has none"),
        (c.moe_intermediate_size not in (None, c.intermediate_size), f"moe_intermediate_size="
         f"{c.moe_intermediate_size} != intermediate_size={c.intermediate_size}; {label}'s experts have the dense "
         "FFN's size d_ff"),
        (c.tie_word_embeddings and not c.scale_decoder_outputs, f"a head tied to the embeddings without the "
         f"d_model**-0.5 rescaling (tie_word_embeddings=True, scale_decoder_outputs=False); {label} ties its head "
         "only together with that rescaling"),
    ]
    return reasons + [text for bad, text in checks if bad] + _routing_reasons(c, label)


# ------------------------------------------------------------------------------------------ target configs


def _decoder_fields(c) -> dict:
    """GPT-MoE -> the fields Mixtral and Qwen2-MoE share (their names for ours)."""
    fields = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        initializer_range=c.initializer_range,
        rms_norm_eps=c.layer_norm_eps,
        use_cache=c.use_cache,
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        tie_word_embeddings=c.tie_word_embeddings,
        rope_parameters=dict(c.rope_parameters),  # explicit: the targets' default rope_theta is not ours
        attention_dropout=c.attention_dropout,
        num_experts_per_tok=c.num_experts_per_tok,
        router_aux_loss_coef=c.router_aux_loss_coef,
        output_router_logits=c.output_router_logits,
        dtype=c.dtype,
    )
    if c.head_dim is not None:
        fields["head_dim"] = c.head_dim
    return fields


def _expert_size(c) -> int:
    return c.moe_intermediate_size or c.intermediate_size


def _mixtral_config(c):
    from transformers import MixtralConfig

    return MixtralConfig(
        **_decoder_fields(c),
        intermediate_size=_expert_size(c),
        num_local_experts=c.num_experts,
        sliding_window=c.sliding_window,
        router_jitter_noise=0.0,
    )


def _qwen_moe_fields(c) -> dict:
    """GPT-MoE -> the MoE layout fields Qwen2-MoE and Qwen3-MoE share."""
    step = c.moe_layer_frequency if c.moe_layers is None else 1
    return dict(
        _decoder_fields(c),
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=_expert_size(c),
        num_experts=c.num_experts,
        norm_topk_prob=_weighting(c, "")[0] == "renormalized",
        decoder_sparse_step=step,
        mlp_only_layers=[i for i, moe in enumerate(_gpt_moe_layers(c)) if (i + 1) % step == 0 and not moe],
        use_sliding_window=c.sliding_window is not None,
    )


def _qwen2_moe_config(c):
    from transformers import Qwen2MoeConfig

    n = c.num_hidden_layers
    window = c.sliding_window is not None
    return Qwen2MoeConfig(
        **_qwen_moe_fields(c),
        shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        qkv_bias=c.attention_bias,
        sliding_window=c.sliding_window,
        layer_types=[("sliding_attention" if window else "full_attention")] * n,
        max_window_layers=n,
    )


def _qwen3_moe_config(c):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_qwen_moe_fields(c), attention_bias=c.attention_bias, sliding_window=c.sliding_window)


def _glm4_moe_config(c):
    from transformers import Glm4MoeConfig

    I = _expert_size(c)
    fields = _decoder_fields(c)
    fields["rope_parameters"]["partial_rotary_factor"] = 1.0  # ours rotates the whole head; GLM's default is half
    return Glm4MoeConfig(
        **fields,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=I,
        n_routed_experts=c.num_experts,
        n_shared_experts=c.shared_expert_intermediate_size // I,
        norm_topk_prob=_weighting(c, "")[0] == "renormalized",
        routed_scaling_factor=c.routed_scaling_factor,
        n_group=c.num_expert_groups,
        topk_group=c.topk_expert_groups or c.num_expert_groups,
        first_k_dense_replace=_glm4_moe_first_dense(c),
        attention_bias=c.attention_bias,
        use_qk_norm=c.qk_norm,
        num_mtp_layers=0,  # no multi-token-prediction layers
    )


def _switch_config(c):
    from transformers import SwitchTransformersConfig

    layers = _seq2seq_moe_layers(c)
    return SwitchTransformersConfig(
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        d_kv=c.head_dim or c.hidden_size // c.num_attention_heads,
        d_ff=c.intermediate_size,
        expert_capacity=DROPLESS_EXPERT_CAPACITY,
        num_layers=c.num_hidden_layers,
        num_sparse_encoder_layers=_switch_sparse_count(layers["encoder"]),
        num_decoder_layers=c.num_decoder_layers,
        num_sparse_decoder_layers=_switch_sparse_count(layers["decoder"]),
        num_heads=c.num_attention_heads,
        num_experts=c.num_experts,
        router_bias=False,
        router_jitter_noise=0.0,
        router_dtype="float32",  # Switch's only exact choice; ours with router_dtype=None computes the GEMM in the
        # activations' dtype, the same in float32 (the dtype the export checks)
        relative_attention_num_buckets=c.relative_attention_num_buckets,
        relative_attention_max_distance=c.relative_attention_max_distance,
        dropout_rate=c.hidden_dropout,
        layer_norm_epsilon=c.layer_norm_eps,
        router_z_loss_coef=c.router_z_loss_coef,
        router_aux_loss_coef=c.router_aux_loss_coef,
        dense_act_fn=c.hidden_act,
        use_cache=c.use_cache,
        pad_token_id=c.pad_token_id,
        eos_token_id=c.eos_token_id,
        bos_token_id=c.bos_token_id,
        decoder_start_token_id=c.decoder_start_token_id,
        tie_word_embeddings=c.scale_decoder_outputs,  # Switch rescales the head's input iff it says tied
        dtype=c.dtype,
    )


# ------------------------------------------------------------------------------------------------- tables


def _imported(model_type: str) -> Callable:
    """The export table of a target we also import: its import table (architectures.py), inverted."""
    arch = ARCHITECTURES[model_type]
    return lambda ours, target_config, names, dtype: arch.mapping(target_config, names).inverse()


def _qwen2_moe_mapping(ours, c, names, dtype) -> Mapping:
    """GPT-MoE names -> Qwen2-MoE names (as Transformers saves them: one tensor per expert)."""
    H, E = c.hidden_size, c.num_experts
    rules = [rename(n, n) for n in _llama_names(c, qkv_bias=c.qkv_bias, o_bias=False, mlp_bias=False, dense_mlp=False)]
    for i in range(c.num_hidden_layers):
        m = f"model.layers.{i}.mlp."
        if i in c.mlp_only_layers or (i + 1) % c.decoder_sparse_step:
            rules += [rename(f"{m}{p}_proj.weight", f"{m}{p}_proj.weight") for p in ("gate", "up", "down")]
            continue
        rules += [
            rename(m + "gate.weight", m + "gate.weight"),
            *[rule.inverse() for rule in expert_rules(m, m, "gate_proj", "up_proj", "down_proj")],
            # sigmoid(0) = 1/2 exactly: a zero gate and a doubled down-projection give our ungated shared expert
            Rule((), (m + "shared_expert_gate.weight",), Create(lambda: torch.zeros(1, H, dtype=dtype))),
        ]
        shared = [f"{m}shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
        if c.shared_expert_intermediate_size:
            rules += [rename(shared[0], shared[0]), rename(shared[1], shared[1]), rename(shared[2], shared[2], Scale(2.0))]
        else:  # width 0: the shared expert's output is exactly zero
            rules += [Rule((), (name,), Create(lambda shape=shape: torch.zeros(shape, dtype=dtype)))
                      for name, shape in zip(shared, ((0, H), (0, H), (H, 0)))]
    return Mapping(rules, num_layers=c.num_hidden_layers, num_experts=E)


def _glm4_moe_mapping(ours, c, names, dtype) -> Mapping:
    """The import table inverted; a model without a selection bias gets GLM's e_score_correction_bias as zeros (its
    choice is then the scores' own), one without a shared expert GLM's of width 0 (`dtype`)."""
    rules = _glm4_moe_rules(c, names, dtype, expert_bias=ours.router_expert_bias)
    return Mapping(rules, num_layers=c.num_hidden_layers, num_experts=c.n_routed_experts).inverse()


# ---------------------------------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """A Transformers MoE class to export to. `reasons(config)` lists what of our config it cannot express (empty:
    it fits exactly); `config` builds its config; `mapping(config, target_config, target_names, dtype)` maps our
    tensor names to its (`dtype`: of the tensors it creates)."""

    name: str  # `to=` / `--to`: the target's model_type
    family: str  # the model_type of the models it takes
    class_name: str
    reasons: Callable
    config: Callable
    mapping: Callable


TARGETS: dict[str, Target] = {
    t.name: t
    for t in [
        Target("mixtral", GPTMoEConfig.model_type, EXPORT_CLASSES["mixtral"], _mixtral_reasons, _mixtral_config,
               _imported("mixtral")),
        Target("qwen2_moe", GPTMoEConfig.model_type, EXPORT_CLASSES["qwen2_moe"], _qwen2_moe_reasons, _qwen2_moe_config,
               _qwen2_moe_mapping),
        Target("qwen3_moe", GPTMoEConfig.model_type, EXPORT_CLASSES["qwen3_moe"], _qwen3_moe_reasons, _qwen3_moe_config,
               _imported("qwen3_moe")),
        Target("glm4_moe", GPTMoEConfig.model_type, EXPORT_CLASSES["glm4_moe"], _glm4_moe_reasons, _glm4_moe_config,
               _glm4_moe_mapping),
        Target("switch_transformers", Seq2SeqMoEConfig.model_type, EXPORT_CLASSES["switch_transformers"],
               _switch_reasons, _switch_config, _imported("switch_transformers")),
    ]
}


def _target(to: str) -> Target:
    if to not in TARGETS:
        raise ConversionError(f"unknown export target {to!r}; choose one of {', '.join(TARGETS)}")
    return TARGETS[to]


def _config_of(moe):
    config = moe if isinstance(moe, (GPTMoEConfig, Seq2SeqMoEConfig)) else getattr(moe, "config", None)
    if config is None:
        return open_checkpoint(moe, moe_config_loader("exporting (hf-ppmoe export, export_moe)")).config
    return config


def export_reasons(moe, to: str) -> list[str]:
    """Everything that keeps `moe` (a GPT-MoE / Seq2Seq-MoE model, config or folder) from being exported to `to`
    exactly, one sentence per setting (naming it and what the target does instead); empty when it fits."""
    target, config = _target(to), _config_of(moe)
    if config.model_type != target.family:
        fitting = [t.name for t in TARGETS.values() if t.family == config.model_type]
        return [f"a {config.model_type} model cannot become a {target.class_name} (which takes {target.family} "
                f"models); targets for {config.model_type}: {', '.join(fitting)}"]
    return target.reasons(config)


def export_moe(
    moe,
    save_directory: str | Path | None = None,
    *,
    to: str,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    progress: bool = False,
):
    """Export a GPT-MoE or Seq2Seq-MoE (a model object or a folder written by save_pretrained / upcycle /
    import_moe) to Transformers' own class `to`: "mixtral" (MixtralForCausalLM), "qwen2_moe" (Qwen2MoeForCausalLM),
    "qwen3_moe" (Qwen3MoeForCausalLM), "glm4_moe" (Glm4MoeForCausalLM) or "switch_transformers"
    (SwitchTransformersForConditionalGeneration).

    Only a model the target computes exactly is exported; otherwise `ConversionError` lists every reason
    (`export_reasons` gives the list without raising). Returns the target model, or writes the folder there (sharded
    safetensors in the target's Hub layout, its config, the source's tokenizer and generation config) tensor by
    tensor through a temporary folder, and returns its path. The folder loads with `AutoModelForCausalLM` /
    `AutoModelForSeq2SeqLM` without hf_ppmoe."""
    target = _target(to)
    checkpoint = open_checkpoint(moe, moe_config_loader("exporting (hf-ppmoe export, export_moe)"))
    config = checkpoint.config
    reasons = export_reasons(config, to)
    if reasons:
        raise ConversionError(
            f"This {type(config).__name__} cannot be exported to {target.class_name} exactly:\n  - "
            + "\n  - ".join(reasons)
        )
    if config.router_z_loss_coef > 0 and target.name != "switch_transformers":
        warnings.warn(
            f"router_z_loss_coef={config.router_z_loss_coef} is not exported: {target.class_name} has no router z-loss "
            "(the exported model computes the same logits; only training with Transformers' loss differs).",
            stacklevel=2,
        )
    import transformers

    model_class = getattr(transformers, target.class_name)
    target_config = target.config(config)
    target_config.architectures = [target.class_name]
    _, stored = expected_tensors(model_class, target_config)
    ours = checkpoint.tensors
    # our untied head goes into a head the target ties by default (Switch); Transformers unties what differs
    names = frozenset(stored | ({"lm_head.weight"} & set(ours.keys())))
    meta = ours.meta()
    dtype = meta.get(next(k for k in meta.keys() if meta.get(k).is_floating_point())).dtype  # of created tensors
    return deliver(
        target.mapping(config, target_config, names, dtype).apply(ours),
        target_config,
        model_class,
        checkpoint,
        save_directory=save_directory,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        progress=progress,
        conversion="export",
    )


__all__ = ["DROPLESS_EXPERT_CAPACITY", "TARGETS", "Target", "export_moe", "export_reasons"]
