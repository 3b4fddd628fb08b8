"""The Llama family (Llama, Mistral, Qwen2, Qwen3) <-> GPT-MoE, and what the MoE decoders built on it share.

Their checkpoints already use GPT-MoE's names (model.embed_tokens, model.layers.{i}.{input_layernorm,
self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm,
lm_head): a table maps each name our model has for the config to itself. What differs between them is which biases
and norms they have and where their sliding window applies; `fields` says so once and the table follows from it.
"""

from __future__ import annotations

import torch

from .adapter import COMMON, Architecture, FieldMap, every_layer
from .mapping import Chain, Concat, ConversionError, Create, Drop, Rule, Stack, rename

# the fields every Llama-family decoder carries, MoE ones included
DECODER = COMMON | FieldMap.of("hidden_size", "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                               "hidden_act", "attention_dropout", layer_norm_eps="rms_norm_eps")
# and every MoE decoder (Mixtral, Qwen-MoE, GLM-4-MoE)
MOE = FieldMap.of("num_experts_per_tok", "router_aux_loss_coef", "output_router_logits")


def rotary_fields(c, *, attention_bias: bool, attention_output_bias: bool, mlp_bias: bool, sliding_window=None,
                  qk_norm: bool = False) -> dict:
    """A Llama-family config -> ours: DECODER, and rotary positions, RMSNorm, a gated FFN."""
    return dict(
        DECODER.ours(c),
        intermediate_size=c.intermediate_size,
        head_dim=getattr(c, "head_dim", None),  # Qwen2's config has none
        rope_parameters=dict(c.rope_parameters) if c.rope_parameters else None,
        position_embedding_type="rotary",
        norm_type="rmsnorm",
        gated_mlp=True,
        attention_bias=attention_bias,
        attention_output_bias=attention_output_bias,
        qk_norm=qk_norm,
        mlp_bias=mlp_bias,
        sliding_window=sliding_window,
    )


def rotary_config(c) -> dict:
    """Our config -> the fields of a Llama-family config: DECODER, rope_parameters and head_dim."""
    fields = dict(DECODER.theirs(c), rope_parameters=dict(c.rope_parameters))  # explicit: their default rope_theta is not ours
    if c.head_dim is not None:
        fields["head_dim"] = c.head_dim
    return fields


def uniform_window(c, label: str):
    """The sliding window of a config with per-layer `layer_types` (Qwen2, Qwen3): one for every layer, or None."""
    kinds = set(c.layer_types)
    if len(kinds) > 1:
        raise ConversionError(
            f"{label} with sliding-window attention on some layers only (layer_types={c.layer_types}) is not supported: "
            "GPT-MoE applies one sliding_window to every layer."
        )
    return c.sliding_window if kinds == {"sliding_attention"} else None


def window_fields(c) -> dict:
    """Our sliding window -> a config with per-layer `layer_types` (Qwen2-MoE, Qwen3): the same on every layer."""
    window = c.sliding_window is not None
    return dict(use_sliding_window=window, sliding_window=c.sliding_window,
                layer_types=["sliding_attention" if window else "full_attention"] * c.num_hidden_layers)


def llama_names(f: dict, dense_mlp: bool = True) -> list[str]:
    """The names of a Llama-family checkpoint, which are ours, for our config fields `f` (all but the MoE FFNs when
    not `dense_mlp`)."""
    m = "model.layers.{i}."
    names = ["model.embed_tokens.weight", "model.norm.weight", m + "input_layernorm.weight", m + "post_attention_layernorm.weight"]
    names += [f"{m}self_attn.{p}_proj.weight" for p in "qkvo"]
    names += [f"{m}self_attn.{p}_norm.weight" for p in "qk" if f["qk_norm"]]
    names += [f"{m}self_attn.{p}_proj.bias" for p in "qkv" if f["attention_bias"]]
    names += [m + "self_attn.o_proj.bias"] * f["attention_output_bias"]
    if dense_mlp:
        names += [f"{m}mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        names += [f"{m}mlp.{p}_proj.bias" for p in ("gate", "up", "down") if f["mlp_bias"]]
    if not f["tie_word_embeddings"]:
        names.append("lm_head.weight")
    return names


def dense_ffn_rules(m: str) -> list[Rule]:
    """A gated dense FFN of an MoE decoder (its dense layers)."""
    return [rename(f"{m}{p}_proj.weight", f"{m}{p}_proj.weight") for p in ("gate", "up", "down")]


def absent(name: str, shape, dtype=torch.float32) -> Rule:
    """A tensor of theirs that ours lacks: dropped when read, zeros of `dtype` when written (export)."""
    return Rule((name,), (), Drop(Create(lambda: torch.zeros(shape, dtype=dtype))))


def expert_rules(source: str, target: str, gate: str, up: str, down: str) -> list[Rule]:
    """Per-expert nn.Linear `{source}experts.{e}.{gate|up|down}.weight` (gate, up [I, H]; down [H, I]), as Mixtral and
    the Qwen / GLM MoE checkpoints store them -> our stacked `{target}experts.gate_up_proj` [E, 2I, H] ([gate; up])
    and `{target}experts.down_proj` [E, H, I]."""
    s = f"{source}experts.{{e}}."
    return [
        Rule((f"{s}{gate}.weight", f"{s}{up}.weight"), (f"{target}experts.gate_up_proj",), Chain(Stack(2), Concat(1, 2))),
        Rule((f"{s}{down}.weight",), (f"{target}experts.down_proj",), Stack(1)),
    ]


def decoder_reasons(c, label: str, bias_reason: str | None, qk_norm: bool = False) -> list[str]:
    """What an MoE decoder target needs of GPT-MoE's dense part; `bias_reason`: the target's verdict on the
    attention biases (None: they fit); `qk_norm`: whether the target RMS-normalises every query and key head."""
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


def biases(c) -> str:
    return f"attention_bias={c.attention_bias}, attention_output_bias={c.attention_output_bias}"


# ------------------------------------------------------------------------------------------------ the family


def _llama(c, names=frozenset()):
    b = c.attention_bias
    return rotary_fields(c, attention_bias=b, attention_output_bias=b, mlp_bias=c.mlp_bias)


def _mistral(c, names=frozenset()):
    return rotary_fields(c, attention_bias=False, attention_output_bias=False, mlp_bias=False,
                         sliding_window=c.sliding_window)


def _qwen2(c, names=frozenset()):
    return rotary_fields(c, attention_bias=True, attention_output_bias=False, mlp_bias=False,
                         sliding_window=uniform_window(c, "Qwen2"))


def _qwen3(c, names=frozenset()):
    # Qwen3 = Qwen2's layout with biases on all of q, k, v, o (or none) and a per-head q/k RMSNorm
    b = c.attention_bias
    return rotary_fields(c, attention_bias=b, attention_output_bias=b, mlp_bias=False,
                         sliding_window=uniform_window(c, "Qwen3"), qk_norm=True)


def _mistral_config(c):
    """Ours -> Mistral (what an imported Mixtral merges into)."""
    from transformers import MistralConfig

    return MistralConfig(**rotary_config(c), intermediate_size=c.intermediate_size,
                         sliding_window=c.sliding_window)


def _qwen3_config(c):
    """Ours -> Qwen3 (what an imported Qwen3-MoE merges into)."""
    from transformers import Qwen3Config

    fields = rotary_config(c)
    fields["head_dim"] = c.head_dim or c.hidden_size // c.num_attention_heads  # Qwen3's default is 128
    return Qwen3Config(**fields, intermediate_size=c.intermediate_size, attention_bias=c.attention_bias,
                       **window_fields(c))


def _same_names(fields):
    return lambda c, names=frozenset(), **_: [rename(n, n) for n in llama_names(fields(c, names))]


def _family(model_type: str, class_name: str, fields, **extra) -> Architecture:
    return Architecture(model_type, class_name, fields, _same_names(fields),
                        ffn_modules=every_layer("model.layers.{i}.mlp"), **extra)


ARCHITECTURES = [
    _family("llama", "LlamaForCausalLM", _llama, ignore=(r"rotary_emb\.inv_freq$",)),
    _family("mistral", "MistralForCausalLM", _mistral, config=_mistral_config),
    _family("qwen2", "Qwen2ForCausalLM", _qwen2),
    _family("qwen3", "Qwen3ForCausalLM", _qwen3, config=_qwen3_config),
]
