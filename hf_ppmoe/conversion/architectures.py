"""Supported source architectures: how each config becomes a GPT-MoE or Seq2Seq-MoE config, and the table of weight
names between its checkpoints and ours.

Each table is declarative and reversible (see mapping.py): upcycling applies it forward, merging applies its inverse.
GPT-MoE names: model.embed_tokens, model.embed_positions (learned positions), model.layers.{i}.{input_layernorm,
self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.*}, model.norm, lm_head. Seq2Seq-MoE names: see t5.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .mapping import Chain, Concat, ConversionError, Create, Drop, Mapping, Rule, Split, Stack, Transpose, rename
from .t5 import T5_IGNORED, switch_dense_twin, switch_fields, switch_rules, t5_ffn_modules, t5_fields, t5_rules


@dataclass(frozen=True)
class Architecture:
    """A source architecture. `fields` and `rules` read the source config and the names of the source's tensors
    (a T5 checkpoint shows an untied head only by storing it)."""

    model_type: str
    dense_class: str  # the Transformers class of the source (of its dense twin for an MoE source)
    fields: Callable  # (source config, names) -> keyword arguments of the target config
    rules: Callable  # (source config, names) -> list[Rule], source names -> target names
    ffn_modules: Callable  # source config -> the dense FFN module of every FFN, in the target's order (router input)
    family: str = "gpt_moe"  # the target's model_type: "gpt_moe" (decoders) or "seq2seq_moe" (encoder-decoders)
    base_prefix: str = "model."  # some Hub checkpoints were saved from the base model, without this prefix
    ignore: tuple[str, ...] = ()  # source tensors that hold no weights (old checkpoints' buffers)
    moe_class: str | None = None  # set for MoE sources, which are imported rather than upcycled
    dense_twin: Callable | None = None  # MoE source config -> the config of its dense architecture

    def mapping(self, config, names=frozenset()) -> Mapping:
        rules = self.rules(config, names)
        return Mapping(rules, num_layers=config.num_hidden_layers, num_experts=_experts(config), ignore=self.ignore)


def _experts(config) -> int:
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)


def _every_layer(template: str) -> Callable:
    return lambda c: [template.replace("{i}", str(i)) for i in range(c.num_hidden_layers)]


def _common_fields(c) -> dict:
    return dict(
        vocab_size=c.vocab_size,
        num_hidden_layers=c.num_hidden_layers,
        initializer_range=c.initializer_range,
        tie_word_embeddings=c.tie_word_embeddings,
        use_cache=c.use_cache,
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        dtype=c.dtype,
    )


# --------------------------------------------------------------------------------------------------- GPT-2


def _gpt2_fields(c, _names=frozenset()) -> dict:
    unsupported = {
        "scale_attn_weights": (c.scale_attn_weights, True),
        "scale_attn_by_inverse_layer_idx": (c.scale_attn_by_inverse_layer_idx, False),
        "add_cross_attention": (c.add_cross_attention, False),
    }
    for name, (value, supported) in unsupported.items():
        if value != supported:
            raise ConversionError(f"GPT-2 with {name}={value} is not supported: GPT-MoE's attention needs {name}={supported}.")
    return dict(
        _common_fields(c),
        hidden_size=c.n_embd,
        intermediate_size=c.n_inner or 4 * c.n_embd,
        num_attention_heads=c.n_head,
        num_key_value_heads=c.n_head,
        max_position_embeddings=c.n_positions,
        position_embedding_type="learned",
        norm_type="layernorm",
        layer_norm_eps=c.layer_norm_epsilon,
        gated_mlp=False,
        hidden_act=c.activation_function,
        attention_bias=True,
        attention_output_bias=True,
        mlp_bias=True,
        attention_dropout=c.attn_pdrop,
        hidden_dropout=c.resid_pdrop,  # GPT-MoE has one dropout for embeddings and residuals; GPT-2's resid_pdrop
    )


def _gpt2_rules(c, _names=frozenset()) -> list[Rule]:
    h, m = "transformer.h.{i}.", "model.layers.{i}."
    qkv = tuple(f"{m}self_attn.{p}_proj" for p in "qkv")
    rules = [
        rename("transformer.wte.weight", "model.embed_tokens.weight"),
        rename("transformer.wpe.weight", "model.embed_positions.weight"),
        # Conv1D stores [in, out]; c_attn fuses q, k, v along out
        Rule((h + "attn.c_attn.weight",), tuple(f"{n}.weight" for n in qkv), Chain(Transpose(), Split(0, 3))),
        Rule((h + "attn.c_attn.bias",), tuple(f"{n}.bias" for n in qkv), Split(0, 3)),
        rename(h + "attn.c_proj.weight", m + "self_attn.o_proj.weight", Transpose()),
        rename(h + "attn.c_proj.bias", m + "self_attn.o_proj.bias"),
        rename(h + "mlp.c_fc.weight", m + "mlp.up_proj.weight", Transpose()),
        rename(h + "mlp.c_fc.bias", m + "mlp.up_proj.bias"),
        rename(h + "mlp.c_proj.weight", m + "mlp.down_proj.weight", Transpose()),
        rename(h + "mlp.c_proj.bias", m + "mlp.down_proj.bias"),
    ]
    for gpt2, ours in (("h.{i}.ln_1", "layers.{i}.input_layernorm"), ("h.{i}.ln_2", "layers.{i}.post_attention_layernorm"), ("ln_f", "norm")):
        rules += [rename(f"transformer.{gpt2}.{p}", f"model.{ours}.{p}") for p in ("weight", "bias")]
    if not c.tie_word_embeddings:
        rules.append(rename("lm_head.weight", "lm_head.weight"))
    return rules


# ------------------------------------------------------ Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE / GLM-4-MoE


def _rotary_fields(
    c, *, attention_bias: bool, attention_output_bias: bool, mlp_bias: bool, sliding_window, qk_norm: bool = False
) -> dict:
    return dict(
        _common_fields(c),
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None),
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters=dict(c.rope_parameters) if c.rope_parameters else None,
        position_embedding_type="rotary",
        norm_type="rmsnorm",
        layer_norm_eps=c.rms_norm_eps,
        gated_mlp=True,
        hidden_act=c.hidden_act,
        attention_bias=attention_bias,
        attention_output_bias=attention_output_bias,
        qk_norm=qk_norm,
        mlp_bias=mlp_bias,
        attention_dropout=c.attention_dropout,
        sliding_window=sliding_window,
    )


def _llama_names(
    c, *, qkv_bias: bool, o_bias: bool, mlp_bias: bool, dense_mlp: bool = True, qk_norm: bool = False
) -> list[str]:
    """Llama-family checkpoints already use GPT-MoE's names: the table is the list of names to expect."""
    m = "model.layers.{i}."
    names = ["model.embed_tokens.weight", "model.norm.weight", m + "input_layernorm.weight", m + "post_attention_layernorm.weight"]
    names += [f"{m}self_attn.{p}_proj.weight" for p in "qkvo"]
    names += [f"{m}self_attn.{p}_norm.weight" for p in "qk" if qk_norm]
    names += [f"{m}self_attn.{p}_proj.bias" for p in "qkv" if qkv_bias] + [m + "self_attn.o_proj.bias"] * o_bias
    if dense_mlp:
        names += [f"{m}mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        names += [f"{m}mlp.{p}_proj.bias" for p in ("gate", "up", "down") if mlp_bias]
    if not c.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _llama_fields(c, _names=frozenset()):
    return _rotary_fields(
        c, attention_bias=c.attention_bias, attention_output_bias=c.attention_bias, mlp_bias=c.mlp_bias, sliding_window=None
    )


def _llama_rules(c, _names=frozenset()):
    return [rename(n, n) for n in _llama_names(c, qkv_bias=c.attention_bias, o_bias=c.attention_bias, mlp_bias=c.mlp_bias)]


def _mistral_fields(c, _names=frozenset()):
    return _rotary_fields(c, attention_bias=False, attention_output_bias=False, mlp_bias=False, sliding_window=c.sliding_window)


def _mistral_rules(c, _names=frozenset()):
    return [rename(n, n) for n in _llama_names(c, qkv_bias=False, o_bias=False, mlp_bias=False)]


def _uniform_window(c, label: str):
    """The sliding window of a config with per-layer `layer_types` (Qwen2, Qwen3): one for every layer, or None."""
    kinds = set(c.layer_types)
    if len(kinds) > 1:
        raise ConversionError(
            f"{label} with sliding-window attention on some layers only (layer_types={c.layer_types}) is not supported: "
            "GPT-MoE applies one sliding_window to every layer."
        )
    return c.sliding_window if kinds == {"sliding_attention"} else None


def _qwen2_fields(c, _names=frozenset()):
    window = _uniform_window(c, "Qwen2")
    return _rotary_fields(c, attention_bias=True, attention_output_bias=False, mlp_bias=False, sliding_window=window)


def _qwen2_rules(c, _names=frozenset()):
    return [rename(n, n) for n in _llama_names(c, qkv_bias=True, o_bias=False, mlp_bias=False)]


def _qwen3_fields(c, _names=frozenset()):
    # Qwen3 = Qwen2's layout with biases on all of q, k, v, o (or none) and a per-head q/k RMSNorm
    window = _uniform_window(c, "Qwen3")
    return _rotary_fields(c, attention_bias=c.attention_bias, attention_output_bias=c.attention_bias, mlp_bias=False,
                          sliding_window=window, qk_norm=True)


def _qwen3_rules(c, _names=frozenset()):
    bias = c.attention_bias
    return [rename(n, n) for n in _llama_names(c, qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)]


def expert_rules(source: str, target: str, gate: str, up: str, down: str) -> list[Rule]:
    """Per-expert nn.Linear `{source}experts.{e}.{gate|up|down}.weight` (gate, up [I, H]; down [H, I]), as Mixtral and
    the Qwen MoE checkpoints store them -> our stacked `{target}experts.gate_up_proj` [E, 2I, H] ([gate; up]) and
    `{target}experts.down_proj` [E, H, I]."""
    s = f"{source}experts.{{e}}."
    return [
        Rule((f"{s}{gate}.weight", f"{s}{up}.weight"), (f"{target}experts.gate_up_proj",), Chain(Stack(2), Concat(1, 2))),
        Rule((f"{s}{down}.weight",), (f"{target}experts.down_proj",), Stack(1)),
    ]


def _mixtral_fields(c, _names=frozenset()):
    return dict(
        _mistral_fields(c),
        num_experts=c.num_local_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        router_type="topk",
        norm_topk_prob=True,  # Mixtral always renormalises its top-k weights
        capacity_factor=None,
        eval_capacity_factor=None,
        moe_layer_frequency=1,
        router_jitter_noise=c.router_jitter_noise,
        router_aux_loss_coef=c.router_aux_loss_coef,
        router_z_loss_coef=0.0,
        output_router_logits=c.output_router_logits,
    )


def _mixtral_rules(c, _names=frozenset()):
    s, m = "model.layers.{i}.block_sparse_moe.", "model.layers.{i}.mlp."
    return [
        *[rename(n, n) for n in _llama_names(c, qkv_bias=False, o_bias=False, mlp_bias=False, dense_mlp=False)],
        rename(s + "gate.weight", m + "gate.weight"),
        *expert_rules(s, m, "w1", "w3", "w2"),
    ]


def _mixtral_dense_twin(c):
    from transformers import MistralConfig

    shared = (
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
        "hidden_act max_position_embeddings initializer_range rms_norm_eps use_cache pad_token_id bos_token_id "
        "eos_token_id tie_word_embeddings rope_parameters sliding_window attention_dropout dtype"
    ).split()
    twin = MistralConfig(**{name: getattr(c, name) for name in shared})
    twin.architectures = ["MistralForCausalLM"]
    return twin


def qwen_moe_layers(c) -> list[bool]:
    """Which layers of a Qwen2-MoE / Qwen3-MoE config are MoE layers (the others a dense MLP of intermediate_size)."""
    return [
        c.num_experts > 0 and i not in c.mlp_only_layers and (i + 1) % c.decoder_sparse_step == 0
        for i in range(c.num_hidden_layers)
    ]


def _qwen3_moe_fields(c, _names=frozenset()):
    layers = qwen_moe_layers(c)
    placement = dict(moe_layer_frequency=c.decoder_sparse_step)
    if c.mlp_only_layers:
        placement = dict(moe_layers=[i for i, moe in enumerate(layers) if moe])
    return dict(
        # Qwen3-MoE applies its one sliding_window (use_sliding_window) to every layer
        _rotary_fields(c, attention_bias=c.attention_bias, attention_output_bias=c.attention_bias, mlp_bias=False,
                       sliding_window=c.sliding_window, qk_norm=True),
        moe_intermediate_size=c.moe_intermediate_size,
        num_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        router_type="topk",  # softmax over all experts, top-k, renormalised iff norm_topk_prob
        norm_topk_prob=c.norm_topk_prob,
        capacity_factor=None,
        eval_capacity_factor=None,
        **placement,
        router_jitter_noise=0.0,
        router_aux_loss_coef=c.router_aux_loss_coef,
        router_z_loss_coef=0.0,
        output_router_logits=c.output_router_logits,
    )


def _qwen3_moe_rules(c, _names=frozenset()):
    bias = c.attention_bias
    rules = [rename(n, n) for n in _llama_names(c, qkv_bias=bias, o_bias=bias, mlp_bias=False, dense_mlp=False, qk_norm=True)]
    for i, moe in enumerate(qwen_moe_layers(c)):
        m = f"model.layers.{i}.mlp."
        if moe:
            rules += [rename(m + "gate.weight", m + "gate.weight"), *expert_rules(m, m, "gate_proj", "up_proj", "down_proj")]
        else:
            rules += [rename(f"{m}{p}_proj.weight", f"{m}{p}_proj.weight") for p in ("gate", "up", "down")]
    return rules


def _qwen3_moe_dense_twin(c):
    """The dense Qwen3 whose every FFN is one expert, or None when the dense layers (intermediate_size) and the
    experts (moe_intermediate_size) differ in size: no Qwen3 holds both."""
    from transformers import Qwen3Config

    if not all(qwen_moe_layers(c)) and c.intermediate_size != c.moe_intermediate_size:
        return None
    shared = (
        "vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads hidden_act "
        "max_position_embeddings initializer_range rms_norm_eps use_cache pad_token_id bos_token_id eos_token_id "
        "tie_word_embeddings rope_parameters attention_bias attention_dropout dtype"
    ).split()
    window = c.sliding_window is not None
    twin = Qwen3Config(
        **{name: getattr(c, name) for name in shared},
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,  # Qwen3's default is 128
        intermediate_size=c.moe_intermediate_size,
        use_sliding_window=window,
        sliding_window=c.sliding_window,
        layer_types=["sliding_attention" if window else "full_attention"] * c.num_hidden_layers,
    )
    twin.architectures = ["Qwen3ForCausalLM"]
    return twin


def glm4_moe_partial_rotary(c) -> float:
    return (c.rope_parameters or {}).get("partial_rotary_factor", 1.0)


def _glm4_moe_fields(c, _names=frozenset()):
    """GLM-4-MoE: sigmoid scores, a score-correction bias that only chooses, group-limited top-k, scaled weights; its
    first `first_k_dense_replace` layers dense; q/k/v biases only; shared experts n_shared_experts * expert size."""
    if glm4_moe_partial_rotary(c) != 1.0:
        raise ConversionError(
            f"GLM-4-MoE with partial_rotary_factor={glm4_moe_partial_rotary(c)} (rope_parameters) is not supported: "
            "GPT-MoE rotates the whole head (partial_rotary_factor=1.0)."
        )
    return dict(
        _rotary_fields(c, attention_bias=c.attention_bias, attention_output_bias=False, mlp_bias=False,
                       sliding_window=None, qk_norm=c.use_qk_norm),
        moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.n_shared_experts * c.moe_intermediate_size,
        num_experts=c.n_routed_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        router_type="topk",
        router_score_function="sigmoid",
        router_expert_bias=True,  # e_score_correction_bias, always there (zeros until trained)
        norm_topk_prob=c.norm_topk_prob,
        routed_scaling_factor=c.routed_scaling_factor,
        num_expert_groups=c.n_group,
        topk_expert_groups=c.topk_group,
        capacity_factor=None,
        eval_capacity_factor=None,
        moe_layers=list(range(c.first_k_dense_replace, c.num_hidden_layers)),
        router_jitter_noise=0.0,
        router_aux_loss_coef=0.0,  # GLM-4-MoE has no load-balancing loss (it balances with the bias)
        router_z_loss_coef=0.0,
        output_router_logits=c.output_router_logits,
    )


def _glm4_moe_rules(c, _names=frozenset(), dtype=torch.float32, expert_bias: bool = True):
    """For the export of a model without a shared expert or selection bias (its inverse): `dtype`, that of the
    width-0 shared experts (n_shared_experts=0) it creates; `expert_bias`=False: e_score_correction_bias created as
    zeros."""
    rules = [rename(n, n) for n in _llama_names(c, qkv_bias=c.attention_bias, o_bias=False, mlp_bias=False,
                                                 dense_mlp=False, qk_norm=c.use_qk_norm)]
    for i in range(c.num_hidden_layers):
        m = f"model.layers.{i}.mlp."
        if i < c.first_k_dense_replace:
            rules += [rename(f"{m}{p}_proj.weight", f"{m}{p}_proj.weight") for p in ("gate", "up", "down")]
            continue
        rules += [
            rename(m + "gate.weight", m + "gate.weight"),
            rename(m + "gate.e_score_correction_bias", m + "gate.expert_bias") if expert_bias else
            Rule((m + "gate.e_score_correction_bias",), (), Drop(Create(lambda: torch.zeros(c.n_routed_experts)))),
            *expert_rules(m, m, "gate_proj", "up_proj", "down_proj"),
        ]
        shared = [f"{m}shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")]
        if c.n_shared_experts:
            rules += [rename(name, name.replace("shared_experts.", "shared_expert.")) for name in shared]
        else:  # width 0 (its output is exactly zero): ours has no shared expert
            H = c.hidden_size
            rules += [Rule((name,), (), Drop(Create(lambda shape=shape: torch.zeros(shape, dtype=dtype))))
                      for name, shape in zip(shared, ((0, H), (0, H), (H, 0)))]
    return rules


ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in [
        Architecture("gpt2", "GPT2LMHeadModel", _gpt2_fields, _gpt2_rules, _every_layer("transformer.h.{i}.mlp"),
                     base_prefix="transformer.", ignore=(r"\.attn\.(masked_)?bias$",)),
        Architecture("llama", "LlamaForCausalLM", _llama_fields, _llama_rules, _every_layer("model.layers.{i}.mlp"),
                     ignore=(r"rotary_emb\.inv_freq$",)),
        Architecture("mistral", "MistralForCausalLM", _mistral_fields, _mistral_rules, _every_layer("model.layers.{i}.mlp")),
        Architecture("qwen2", "Qwen2ForCausalLM", _qwen2_fields, _qwen2_rules, _every_layer("model.layers.{i}.mlp")),
        Architecture("qwen3", "Qwen3ForCausalLM", _qwen3_fields, _qwen3_rules, _every_layer("model.layers.{i}.mlp")),
        Architecture("t5", "T5ForConditionalGeneration", t5_fields, t5_rules, t5_ffn_modules, "seq2seq_moe",
                     base_prefix="", ignore=T5_IGNORED),
        Architecture("mixtral", "MistralForCausalLM", _mixtral_fields, _mixtral_rules,
                     _every_layer("model.layers.{i}.block_sparse_moe"), moe_class="MixtralForCausalLM",
                     dense_twin=_mixtral_dense_twin),
        Architecture("qwen3_moe", "Qwen3ForCausalLM", _qwen3_moe_fields, _qwen3_moe_rules,
                     _every_layer("model.layers.{i}.mlp"), moe_class="Qwen3MoeForCausalLM",
                     dense_twin=_qwen3_moe_dense_twin),
        Architecture("glm4_moe", "LlamaForCausalLM", _glm4_moe_fields, _glm4_moe_rules,
                     _every_layer("model.layers.{i}.mlp"), moe_class="Glm4MoeForCausalLM",
                     dense_twin=lambda c: None),  # no merge: Llama, Qwen2 or Qwen3 fit only some of its attentions
        Architecture("switch_transformers", "T5ForConditionalGeneration", switch_fields, switch_rules, t5_ffn_modules,
                     "seq2seq_moe", base_prefix="", ignore=T5_IGNORED,
                     moe_class="SwitchTransformersForConditionalGeneration", dense_twin=switch_dense_twin),
    ]
}


def supported() -> str:
    dense = ", ".join(f"{a.model_type} ({a.dense_class})" for a in ARCHITECTURES.values() if not a.moe_class)
    moe = ", ".join(f"{a.model_type} ({a.moe_class})" for a in ARCHITECTURES.values() if a.moe_class)
    return f"dense sources (upcycle, merge_experts): {dense}; MoE sources (import_moe): {moe}"


def get_architecture(model_type: str | None, *, moe: bool) -> Architecture:
    arch = ARCHITECTURES.get(model_type)
    if arch is None or bool(arch.moe_class) != moe:
        role = "MoE source to import" if moe else "dense source to upcycle"
        if arch is not None:
            hint = "use import_moe / `hf-ppmoe import`" if arch.moe_class else "use upcycle / `hf-ppmoe upcycle`"
            raise ConversionError(f"{model_type!r} is not a {role}; {hint}. Supported: {supported()}.")
        raise ConversionError(f"Unsupported architecture {model_type!r} as a {role}. Supported: {supported()}.")
    return arch
