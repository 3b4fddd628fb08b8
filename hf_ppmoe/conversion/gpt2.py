"""GPT-2 <-> GPT-MoE: learned positions, LayerNorm, a plain FFN, biases everywhere, Conv1D weights.

    transformer.wte, transformer.wpe               model.embed_tokens, model.embed_positions
    transformer.h.{i}.ln_1, ln_2                   model.layers.{i}.input_layernorm, post_attention_layernorm
    transformer.h.{i}.attn.c_attn [H, 3H]          model.layers.{i}.self_attn.{q,k,v}_proj [H, H] (transposed, split)
    transformer.h.{i}.attn.c_proj                  model.layers.{i}.self_attn.o_proj (transposed)
    transformer.h.{i}.mlp.c_fc, c_proj             model.layers.{i}.mlp.up_proj, down_proj (transposed)
    transformer.ln_f                               model.norm
"""

from __future__ import annotations

from .adapter import COMMON, Architecture, FieldMap, every_layer
from .mapping import Chain, ConversionError, Rule, Split, Transpose, rename

FIELDS = COMMON | FieldMap.of("hidden_size", "num_attention_heads", "max_position_embeddings",
                              num_key_value_heads="n_head", layer_norm_eps="layer_norm_epsilon",
                              hidden_act="activation_function", attention_dropout="attn_pdrop",
                              hidden_dropout="resid_pdrop")  # GPT-MoE has one dropout for embeddings and residuals


def _fields(c, names=frozenset()) -> dict:
    unsupported = {
        "scale_attn_weights": (c.scale_attn_weights, True),
        "scale_attn_by_inverse_layer_idx": (c.scale_attn_by_inverse_layer_idx, False),
        "add_cross_attention": (c.add_cross_attention, False),
    }
    for name, (value, supported) in unsupported.items():
        if value != supported:
            raise ConversionError(f"GPT-2 with {name}={value} is not supported: GPT-MoE's attention needs {name}={supported}.")
    return dict(
        FIELDS.ours(c),
        intermediate_size=c.n_inner or 4 * c.n_embd,
        position_embedding_type="learned",
        norm_type="layernorm",
        gated_mlp=False,
        attention_bias=True,
        attention_output_bias=True,
        mlp_bias=True,
    )


def _rules(c, names=frozenset(), **_) -> list[Rule]:
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


ARCHITECTURES = [
    Architecture("gpt2", "GPT2LMHeadModel", _fields, _rules, ffn_modules=every_layer("transformer.h.{i}.mlp"),
                 base_prefix="transformer.", ignore=(r"\.attn\.(masked_)?bias$",)),
]
