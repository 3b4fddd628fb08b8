"""T5 <-> Seq2Seq-MoE: the config map and a declarative, reversible map of weight names.

A T5 (v1.0 or v1.1) becomes a Seq2Seq-MoE with no MoE layers whose logits and generations equal T5's; that dense
model is what upcycling starts from. Weights are only renamed, never changed ({s}: encoder or decoder):

    shared                                        model.shared  (both stacks' embed_tokens are tied to it)
    lm_head                                       lm_head  (tied to shared and rescaled in v1.0)
    {s}.block.0.layer.0.SelfAttention
        .relative_attention_bias                  model.{s}.relative_attention_bias  (one table per stack)
    {s}.block.{i}.layer.0.layer_norm              model.{s}.layers.{i}.input_layernorm
    {s}.block.{i}.layer.0.SelfAttention.{q,k,v,o} model.{s}.layers.{i}.self_attn.{q,k,v,o}_proj
    decoder.block.{i}.layer.1.layer_norm          model.decoder.layers.{i}.cross_attn_layernorm
    decoder.block.{i}.layer.1.EncDecAttention.*   model.decoder.layers.{i}.cross_attn.*_proj
    {s}.block.{i}.layer.{1|2}.layer_norm          model.{s}.layers.{i}.post_attention_layernorm
    ...DenseReluDense.wi (v1.0)                   ...mlp.up_proj
    ...DenseReluDense.wi_0, wi_1 (v1.1), wo       ...mlp.gate_proj, mlp.up_proj, mlp.down_proj
    {s}.final_layer_norm                          model.{s}.norm
"""

from __future__ import annotations

import re

from transformers import T5Config

from ..modeling.configuration_seq2seq_moe import Seq2SeqMoEConfig
from ..modeling.modeling_seq2seq_moe import Seq2SeqMoEForConditionalGeneration

# T5 keys with no counterpart: tied copies of `shared`, and a bias table T5 itself never uses
T5_IGNORED = re.compile(
    r"(encoder|decoder)\.embed_tokens\.weight"
    r"|decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight"
)


def weight_names(gated: bool) -> list[tuple[str, str]]:
    """(T5 name, Seq2Seq-MoE name) templates; `{i}` stands for a layer index. Each row maps both ways."""
    ffn = [("wi_0", "gate_proj"), ("wi_1", "up_proj")] if gated else [("wi", "up_proj")]
    ffn.append(("wo", "down_proj"))
    rows = [("shared.weight", "model.shared.weight"), ("lm_head.weight", "lm_head.weight")]
    for stack, ffn_sublayer in (("encoder", 1), ("decoder", 2)):
        t5, ours = f"{stack}.block.{{i}}.layer", f"model.{stack}.layers.{{i}}"
        rows += [
            (
                f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                f"model.{stack}.relative_attention_bias.weight",
            ),
            (f"{stack}.final_layer_norm.weight", f"model.{stack}.norm.weight"),
            (f"{t5}.0.layer_norm.weight", f"{ours}.input_layernorm.weight"),
            *[(f"{t5}.0.SelfAttention.{p}.weight", f"{ours}.self_attn.{p}_proj.weight") for p in "qkvo"],
            (f"{t5}.{ffn_sublayer}.layer_norm.weight", f"{ours}.post_attention_layernorm.weight"),
            *[(f"{t5}.{ffn_sublayer}.DenseReluDense.{a}.weight", f"{ours}.mlp.{b}.weight") for a, b in ffn],
        ]
        if stack == "decoder":
            rows += [
                (f"{t5}.1.layer_norm.weight", f"{ours}.cross_attn_layernorm.weight"),
                *[(f"{t5}.1.EncDecAttention.{p}.weight", f"{ours}.cross_attn.{p}_proj.weight") for p in "qkvo"],
            ]
    return rows


def _compile(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)"))


def _rename(state_dict: dict, rows: list[tuple[str, str]], ignored: re.Pattern | None, what: str) -> dict:
    patterns = [(_compile(source), target) for source, target in rows]
    renamed = {}
    for name, tensor in state_dict.items():
        if ignored is not None and ignored.fullmatch(name):
            continue
        for pattern, target in patterns:
            match = pattern.fullmatch(name)
            if match:
                renamed[target.format(**match.groupdict())] = tensor
                break
        else:
            raise ValueError(f"{what}: no mapping for weight {name!r}")
    return renamed


def config_from_t5(t5: T5Config) -> Seq2SeqMoEConfig:
    """The Seq2Seq-MoE config (no MoE layers) that computes exactly what `t5` does."""
    # Transformers 5 always ties T5's embeddings and records v1.0's rescaled, tied head as scale_decoder_outputs;
    # older versions said the same with tie_word_embeddings
    v1_0_head = getattr(t5, "scale_decoder_outputs", t5.tie_word_embeddings)
    start = getattr(t5, "decoder_start_token_id", None)
    return Seq2SeqMoEConfig(
        vocab_size=t5.vocab_size,
        hidden_size=t5.d_model,
        intermediate_size=t5.d_ff,
        head_dim=t5.d_kv,
        num_hidden_layers=t5.num_layers,
        num_decoder_layers=t5.num_decoder_layers,
        num_attention_heads=t5.num_heads,
        hidden_act=t5.dense_act_fn,
        gated_mlp=t5.is_gated_act,
        attention_scaling=1.0,
        relative_attention_num_buckets=t5.relative_attention_num_buckets,
        relative_attention_max_distance=t5.relative_attention_max_distance,
        norm_type="rmsnorm",
        layer_norm_eps=t5.layer_norm_epsilon,
        hidden_dropout=t5.dropout_rate,
        attention_dropout=t5.dropout_rate,
        tie_word_embeddings=v1_0_head,
        scale_decoder_outputs=v1_0_head,
        pad_token_id=t5.pad_token_id,
        eos_token_id=t5.eos_token_id,
        decoder_start_token_id=start if start is not None else t5.pad_token_id,
        encoder_moe_layers=[],
        decoder_moe_layers=[],
    )


def config_to_t5(config: Seq2SeqMoEConfig) -> T5Config:
    """The T5 config of a dense Seq2Seq-MoE; ValueError where T5 cannot express it."""
    problems = [
        text
        for bad, text in (
            (config.norm_type != "rmsnorm", "norm_type must be 'rmsnorm'"),
            (config.attention_scaling != 1.0, "attention_scaling must be 1.0"),
            (config.attention_bias or config.mlp_bias, "T5 has no biases"),
            (config.tie_word_embeddings != config.scale_decoder_outputs, "T5 ties its head iff it rescales (v1.0)"),
            (config.attention_dropout != config.hidden_dropout, "T5 has one dropout_rate"),
            (any(map(config.is_encoder_moe_layer, range(config.num_hidden_layers))), "the encoder has MoE layers"),
            (any(map(config.is_decoder_moe_layer, range(config.num_decoder_layers))), "the decoder has MoE layers"),
        )
        if bad
    ]
    if problems:
        raise ValueError(f"This Seq2Seq-MoE config is not a T5: {'; '.join(problems)}.")
    act = config.hidden_act
    feed_forward = ("gated-gelu" if act == "gelu_new" else f"gated-{act}") if config.gated_mlp else act
    return T5Config(
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        d_kv=config.head_dim or config.hidden_size // config.num_attention_heads,
        d_ff=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_decoder_layers=config.num_decoder_layers,
        num_heads=config.num_attention_heads,
        relative_attention_num_buckets=config.relative_attention_num_buckets,
        relative_attention_max_distance=config.relative_attention_max_distance,
        dropout_rate=config.hidden_dropout,
        layer_norm_epsilon=config.layer_norm_eps,
        feed_forward_proj=feed_forward,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=config.pad_token_id,
        eos_token_id=config.eos_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
    )


def state_dict_from_t5(state_dict: dict, config: Seq2SeqMoEConfig) -> dict:
    """T5ForConditionalGeneration weights -> Seq2SeqMoEForConditionalGeneration weights (renamed, same tensors)."""
    return _rename(state_dict, weight_names(config.gated_mlp), T5_IGNORED, "T5 -> Seq2Seq-MoE")


def state_dict_to_t5(state_dict: dict, config: Seq2SeqMoEConfig) -> dict:
    """The reverse of `state_dict_from_t5`, for a model without MoE layers (merge the experts first)."""
    rows = [(ours, t5) for t5, ours in weight_names(config.gated_mlp)]
    tied = re.compile(r"model\.(encoder|decoder)\.embed_tokens\.weight")
    return _rename(state_dict, rows, tied, "Seq2Seq-MoE -> T5")


def from_t5(t5_model) -> Seq2SeqMoEForConditionalGeneration:
    """A `T5ForConditionalGeneration` -> the dense Seq2SeqMoEForConditionalGeneration with the same outputs."""
    config = config_from_t5(t5_model.config)
    model = Seq2SeqMoEForConditionalGeneration(config).to(t5_model.dtype)
    missing, unexpected = model.load_state_dict(state_dict_from_t5(t5_model.state_dict(), config), strict=False)
    untied_missing = set(missing) - set(model.all_tied_weights_keys)
    if unexpected or untied_missing:
        raise ValueError(f"T5 weights do not fit: missing {sorted(untied_missing)}, unexpected {sorted(unexpected)}")
    return model.train(t5_model.training)


__all__ = ["config_from_t5", "config_to_t5", "from_t5", "state_dict_from_t5", "state_dict_to_t5", "weight_names"]
