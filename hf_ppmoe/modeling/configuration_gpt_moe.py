"""GPT-MoE configuration: a decoder-only transformer whose every `moe_layer_frequency`-th FFN is an MoE layer.

The dense part can hold GPT-2 (learned positions, LayerNorm, plain GELU MLP, biases, tied embeddings) and
Llama / Mistral / Qwen2 / Qwen3 (rotary positions, RMSNorm, gated SiLU MLP, GQA, untied embeddings, q/k/v-only
biases, sliding window, Qwen3's per-head q/k RMSNorm) exactly.
"""

from __future__ import annotations

from .configuration_moe import MOE_EP_PLAN, MOE_TP_PLAN, MoEConfig, check


class GPTMoEConfig(MoEConfig):
    r"""
    Args (beyond Transformers' usual names: vocab_size, hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, head_dim, hidden_act, max_position_embeddings, rope_parameters,
    attention_bias, mlp_bias, attention_dropout, sliding_window, tie_word_embeddings, num_experts,
    num_experts_per_tok, router_aux_loss_coef, output_router_logits):
        position_embedding_type: "rotary" (Llama) or "learned" (GPT-2 absolute positions).
        norm_type: "rmsnorm" or "layernorm"; `layer_norm_eps` its epsilon.
        gated_mlp: SwiGLU-style gate/up/down MLP (Llama) instead of up/down (GPT-2).
        attention_output_bias: bias on the output projection (defaults to attention_bias; Qwen2 has q/k/v bias only).
        qk_norm: Qwen3's per-head query/key norm: every query and key head is RMS-normalised over head_dim (weights
            `self_attn.q_norm` / `self_attn.k_norm` [head_dim], eps `layer_norm_eps`, statistics in float32) after
            the q/k projections and before the rotary embedding. Default False (Llama, GPT-2, Qwen2).
        hidden_dropout: dropout on the embeddings and on each residual branch (GPT-2's embd/resid pdrop).
        MoE fields: see `MoEConfig`.
    """

    model_type = "gpt_moe"
    keys_to_ignore_at_inference = ["cache"]
    default_theta = 10000.0
    # Transformers' parallel plans (keys relative to GPTMoEModel; styles "ppmoe_*" come from hf_ppmoe.parallel)
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        # per-head q/k norms see only this rank's heads: replicated weights whose gradients are summed over the group
        "layers.*.self_attn.q_norm": "replicated_grad_sum",
        "layers.*.self_attn.k_norm": "replicated_grad_sum",
        "layers.*.self_attn": "replicated_input",
        **{f"layers.*.{key}": style for key, style in MOE_TP_PLAN.items()},
    }
    base_model_ep_plan = {f"layers.*.{key}": style for key, style in MOE_EP_PLAN.items()}

    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    position_embedding_type: str = "rotary"
    rope_parameters: dict | None = None
    norm_type: str = "rmsnorm"
    layer_norm_eps: float = 1e-6
    gated_mlp: bool = True
    attention_bias: bool = False
    attention_output_bias: bool | None = None
    qk_norm: bool = False
    mlp_bias: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    sliding_window: int | None = None
    use_cache: bool = True
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.attention_output_bias is None:
            self.attention_output_bias = self.attention_bias
        super().__post_init__(**kwargs)
        self.validate()
        if self.head_dim is None:  # stated, as Transformers' code (caches, attention helpers, tests) reads it
            self.head_dim = self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        self.validate_numbers()
        check(
            self.head_dim is not None or self.hidden_size % self.num_attention_heads == 0,
            f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}; "
            "change one of them or set head_dim explicitly.",
        )
        head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        check(
            self.position_embedding_type != "rotary" or head_dim % 2 == 0,
            f"head_dim={head_dim} is odd (hidden_size={self.hidden_size} / num_attention_heads="
            f"{self.num_attention_heads} unless set): rotary position embeddings turn pairs of dimensions and need an "
            "even head_dim. Change hidden_size or num_attention_heads, set an even head_dim, or use "
            "position_embedding_type='learned'.",
        )
        check(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads={self.num_attention_heads} is not divisible by num_key_value_heads="
            f"{self.num_key_value_heads}; grouped-query attention needs whole groups of query heads per key/value head.",
        )
        check(
            self.position_embedding_type in ("rotary", "learned"),
            f"Unknown position_embedding_type {self.position_embedding_type!r}; use 'rotary' or 'learned'.",
        )
        check(self.norm_type in ("rmsnorm", "layernorm"), f"Unknown norm_type {self.norm_type!r}; use 'rmsnorm' or 'layernorm'.")
        for name in ("attention_dropout", "hidden_dropout"):
            check(0.0 <= getattr(self, name) < 1.0, f"{name} must be in [0, 1), got {getattr(self, name)}.")
        check(
            self.sliding_window is None or self.sliding_window > 0,
            f"sliding_window must be a positive number of tokens or None, got {self.sliding_window}.",
        )
        self.validate_moe()
        if self.moe_layers is not None:
            bad = [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]
            check(not bad, f"moe_layers {bad} are outside 0..{self.num_hidden_layers - 1} (num_hidden_layers).")


__all__ = ["GPTMoEConfig"]
