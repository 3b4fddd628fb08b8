"""Seq2Seq-MoE configuration: a Transformer encoder-decoder (GShard's M4) whose every n-th FFN, in the encoder and in
the decoder, is an MoE layer.

The dense part holds T5 exactly, v1.0 (ReLU FFN, tied embeddings with the d_model**-0.5 output rescaling) and v1.1
(gated GELU, untied): pre-norm RMSNorm without biases, unscaled dot-product attention with T5's bucketed relative
position bias (computed once per stack, shared by its layers; none in cross-attention). `hf_ppmoe.conversion.t5`
maps a `T5Config` onto this one.
"""

from __future__ import annotations

from .configuration_moe import MOE_EP_PLAN, MOE_TP_PLAN, MoEConfig, check


def _stack_tp_plan(stack: str, attentions: tuple[str, ...]) -> dict[str, str]:
    """One stack's tensor-parallel rules: heads split (q/k/v colwise, o rowwise; cross-attention's keys and values
    from the encoder output likewise), the relative position bias table split on the same heads, FFN / MoE as in
    `MOE_TP_PLAN`."""
    plan = {f"{stack}.relative_attention_bias": "head_sharded_bias"}
    for attention in attentions:
        prefix = f"{stack}.layers.*.{attention}"
        plan.update({f"{prefix}.{p}_proj": "colwise" for p in "qkv"})
        plan.update({f"{prefix}.o_proj": "rowwise", prefix: "replicated_input"})
    return {**plan, **{f"{stack}.layers.*.{key}": style for key, style in MOE_TP_PLAN.items()}}


class Seq2SeqMoEConfig(MoEConfig):
    r"""
    Args (beyond Transformers' usual names: vocab_size, hidden_size, intermediate_size, num_attention_heads, head_dim,
    hidden_act, attention_bias, mlp_bias, attention_dropout, tie_word_embeddings, pad_token_id, eos_token_id,
    decoder_start_token_id, num_experts, num_experts_per_tok, router_aux_loss_coef, output_router_logits):
        num_hidden_layers / num_decoder_layers: encoder / decoder depth (as in T5; the decoder's defaults to the
            encoder's).
        gated_mlp: gate/up/down FFN (T5 v1.1 "gated-gelu") instead of up/down (T5 v1.0 "relu").
        attention_scaling: multiplier of q.k; None means head_dim**-0.5. T5 uses 1.0 (its query init carries the scale).
        relative_attention_num_buckets / relative_attention_max_distance: T5's relative position buckets; the
            encoder's are bidirectional, the decoder's causal.
        norm_type: "rmsnorm" (T5) or "layernorm"; `layer_norm_eps` its epsilon.
        hidden_dropout: dropout on the embeddings, each residual branch and the final norm's output (T5's dropout_rate).
        scale_decoder_outputs: multiply the decoder output by hidden_size**-0.5 before the LM head (T5 v1.0, whose
            head is tied to the embeddings).
        encoder_moe_layers / decoder_moe_layers: explicit MoE layer indices per stack ([] for none);
        encoder_moe_layer_frequency / decoder_moe_layer_frequency: otherwise every n-th FFN of that stack is MoE
            (default `moe_layer_frequency`, 2: every other FFN in both stacks as in GShard's M4).
        MoE fields: see `MoEConfig` (`moe_layers` is refused here: say which stack).
    """

    model_type = "seq2seq_moe"
    keys_to_ignore_at_inference = ["cache"]
    # Transformers' parallel plans (keys relative to Seq2SeqMoEModel; styles "ppmoe_*", "replicated_input" and
    # "head_sharded_bias" come from hf_ppmoe.parallel)
    base_model_tp_plan = {
        "shared": "embedding_rowwise",
        **_stack_tp_plan("encoder", ("self_attn",)),
        **_stack_tp_plan("decoder", ("self_attn", "cross_attn")),
    }
    base_model_ep_plan = {
        f"{stack}.layers.*.{key}": style for stack in ("encoder", "decoder") for key, style in MOE_EP_PLAN.items()
    }

    vocab_size: int = 32128
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_hidden_layers: int = 6
    num_decoder_layers: int | None = None
    num_attention_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "gelu_new"
    gated_mlp: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_scaling: float | None = None
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    norm_type: str = "rmsnorm"
    layer_norm_eps: float = 1e-6
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    tie_word_embeddings: bool = False
    scale_decoder_outputs: bool = False
    encoder_moe_layers: list[int] | None = None
    decoder_moe_layers: list[int] | None = None
    encoder_moe_layer_frequency: int | None = None
    decoder_moe_layer_frequency: int | None = None
    use_cache: bool = True
    is_encoder_decoder: bool = True
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    bos_token_id: int | None = None
    decoder_start_token_id: int | None = 0

    def __post_init__(self, **kwargs):
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_hidden_layers
        super().__post_init__(**kwargs)
        self.validate()
        if self.head_dim is None:  # stated, as Transformers' code (caches, attention helpers) reads it from configs
            self.head_dim = self.hidden_size // self.num_attention_heads

    def is_encoder_moe_layer(self, layer_idx: int) -> bool:
        return self.is_moe_layer(layer_idx, self.encoder_moe_layers, self.encoder_moe_layer_frequency)

    def is_decoder_moe_layer(self, layer_idx: int) -> bool:
        return self.is_moe_layer(layer_idx, self.decoder_moe_layers, self.decoder_moe_layer_frequency)

    def validate(self) -> None:
        self.validate_numbers()
        check(
            self.head_dim is not None or self.hidden_size % self.num_attention_heads == 0,
            f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}; "
            "change one of them or set head_dim explicitly (T5's d_kv).",
        )
        for name in ("num_hidden_layers", "num_decoder_layers"):
            check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}.")
        check(
            self.norm_type in ("rmsnorm", "layernorm"),
            f"Unknown norm_type {self.norm_type!r}; use 'rmsnorm' or 'layernorm'.",
        )
        for name in ("attention_dropout", "hidden_dropout"):
            check(0.0 <= getattr(self, name) < 1.0, f"{name} must be in [0, 1), got {getattr(self, name)}.")
        check(
            self.attention_scaling is None or self.attention_scaling > 0,
            f"attention_scaling must be > 0 (T5: 1.0), or None for head_dim**-0.5; got {self.attention_scaling}.",
        )
        # the causal bucketing keeps num_buckets // 2 exact offsets and spreads the rest logarithmically up to
        # max_distance: fewer than 4 buckets, or a max_distance inside the exact range, leaves no log range (log(0))
        check(
            self.relative_attention_num_buckets >= 4,
            f"relative_attention_num_buckets must be >= 4, got {self.relative_attention_num_buckets}.",
        )
        check(
            self.relative_attention_max_distance > self.relative_attention_num_buckets // 2,
            f"relative_attention_max_distance={self.relative_attention_max_distance} must exceed "
            f"relative_attention_num_buckets // 2 = {self.relative_attention_num_buckets // 2} "
            "(the offsets bucketed exactly).",
        )
        self.validate_moe()
        check(
            self.moe_layers is None,
            f"moe_layers={self.moe_layers} does not say which stack; use encoder_moe_layers and/or decoder_moe_layers.",
        )
        for stack, depth in (("encoder", self.num_hidden_layers), ("decoder", self.num_decoder_layers)):
            frequency = getattr(self, f"{stack}_moe_layer_frequency")
            check(
                frequency is None or frequency >= 1,
                f"{stack}_moe_layer_frequency must be >= 1 (or None for moe_layer_frequency), got {frequency}; "
                f"use {stack}_moe_layers=[] for a stack without MoE layers.",
            )
            layers = getattr(self, f"{stack}_moe_layers")
            if layers is not None:
                bad = [i for i in layers if not 0 <= i < depth]
                check(not bad, f"{stack}_moe_layers {bad} are outside 0..{depth - 1} (the {stack} has {depth} layers).")


__all__ = ["Seq2SeqMoEConfig"]
