"""GPT-MoE configuration: a decoder-only transformer whose every `moe_layer_frequency`-th FFN is an MoE layer.

The dense part can hold GPT-2 (learned positions, LayerNorm, plain GELU MLP, biases, tied embeddings) and
Llama / Mistral / Qwen2 (rotary positions, RMSNorm, gated SiLU MLP, GQA, untied embeddings, q/k/v-only biases,
sliding window) exactly.
"""

from __future__ import annotations

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

from ..moe.gates import get_gate_class

DISPATCH_IMPLEMENTATIONS = ("index", "einsum")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_moe_fields(config) -> None:
    """Validation shared by both model families (raises ValueError naming the field and the fix)."""
    _check(config.num_experts >= 1, f"num_experts must be >= 1, got {config.num_experts}.")
    _check(
        1 <= config.num_experts_per_tok <= config.num_experts,
        f"num_experts_per_tok={config.num_experts_per_tok} must be between 1 and num_experts={config.num_experts}: "
        "a token cannot be routed to more experts than exist.",
    )
    for name in ("capacity_factor", "eval_capacity_factor"):
        value = getattr(config, name)
        _check(
            value is None or value > 0,
            f"{name}={value} must be > 0, or None for dropless routing (no token is ever dropped).",
        )
    _check(config.router_num_groups >= 1, f"router_num_groups must be >= 1, got {config.router_num_groups}.")
    _check(
        0.0 <= config.router_jitter_noise < 1.0,
        f"router_jitter_noise={config.router_jitter_noise} must be in [0, 1) (multiplicative noise 1 +- eps).",
    )
    get_gate_class(config.router_type).check_config(config)
    known = DISPATCH_IMPLEMENTATIONS + ("grouped_mm", "batched_mm")
    _check(config.dispatch in known, f"Unknown dispatch {config.dispatch!r}; use one of {', '.join(known)}.")
    _check(
        config.hidden_act in ACT2FN,
        f"Unknown hidden_act {config.hidden_act!r}; use one of Transformers' activations, e.g. 'gelu_new', 'silu', 'relu'.",
    )
    _check(
        config.moe_layer_frequency >= 1,
        f"moe_layer_frequency must be >= 1 (1: every FFN is MoE, 2: every other one), got {config.moe_layer_frequency}.",
    )
    for name in ("router_aux_loss_coef", "router_z_loss_coef"):
        _check(getattr(config, name) >= 0, f"{name} must be >= 0, got {getattr(config, name)}.")


class GPTMoEConfig(PreTrainedConfig):
    r"""
    Args (beyond Transformers' usual names: vocab_size, hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, head_dim, hidden_act, max_position_embeddings, rope_parameters,
    attention_bias, mlp_bias, attention_dropout, sliding_window, tie_word_embeddings, num_experts,
    num_experts_per_tok, router_aux_loss_coef, output_router_logits):
        position_embedding_type: "rotary" (Llama) or "learned" (GPT-2 absolute positions).
        norm_type: "rmsnorm" or "layernorm"; `layer_norm_eps` its epsilon.
        gated_mlp: SwiGLU-style gate/up/down MLP (Llama) instead of up/down (GPT-2).
        attention_output_bias: bias on the output projection (defaults to attention_bias; Qwen2 has q/k/v bias only).
        hidden_dropout: dropout on the embeddings and on each residual branch (GPT-2's embd/resid pdrop).
        router_type: a registered gate: "topk", "switch", "gshard", "prototype", or your own.
        capacity_factor / eval_capacity_factor: GShard capacity C = factor * k * S / E per group in training /
            evaluation; None = dropless. Evaluation defaults to dropless so decoding never drops tokens.
        router_num_groups: GShard's local dispatch groups (capacity and aux loss are per group).
        router_jitter_noise: multiplicative router-input noise in training (Switch).
        router_random_routing: GShard's random routing of the 2nd expert with probability 2 * g2 (training only).
        norm_topk_prob: renormalise top-k weights to sum to one ("topk" gate).
        moe_layer_frequency: every n-th FFN is MoE (layers n-1, 2n-1, ...); `moe_layers` lists them explicitly.
        moe_intermediate_size: expert inner size (defaults to intermediate_size).
        shared_expert_intermediate_size: > 0 adds a dense shared expert to every MoE layer.
        dispatch: "index" (PPMoE index_select, default), "einsum" (GShard one-hot einsums), or a Transformers
            experts kernel ("grouped_mm", "batched_mm").
        router_z_loss_coef: weight of the router z-loss added to the loss.
    """

    model_type = "gpt_moe"
    keys_to_ignore_at_inference = ["past_key_values"]
    default_theta = 10000.0

    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    position_embedding_type: str = "rotary"
    rope_parameters: dict | None = None
    norm_type: str = "rmsnorm"
    layer_norm_eps: float = 1e-6
    gated_mlp: bool = True
    attention_bias: bool = False
    attention_output_bias: bool | None = None
    mlp_bias: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    sliding_window: int | None = None
    initializer_range: float = 0.02
    use_cache: bool = True
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    num_experts: int = 8
    num_experts_per_tok: int = 2
    router_type: str = "topk"
    capacity_factor: float | None = None
    eval_capacity_factor: float | None = None
    router_num_groups: int = 1
    router_jitter_noise: float = 0.0
    router_random_routing: bool = True
    norm_topk_prob: bool = True
    moe_layer_frequency: int = 2
    moe_layers: list[int] | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0
    dispatch: str = "index"
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.001
    output_router_logits: bool = False

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.attention_output_bias is None:
            self.attention_output_bias = self.attention_bias
        super().__post_init__(**kwargs)
        self.validate()

    def validate(self) -> None:
        _check(
            self.head_dim is not None or self.hidden_size % self.num_attention_heads == 0,
            f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}; "
            "change one of them or set head_dim explicitly.",
        )
        _check(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads={self.num_attention_heads} is not divisible by num_key_value_heads="
            f"{self.num_key_value_heads}; grouped-query attention needs whole groups of query heads per key/value head.",
        )
        _check(
            self.position_embedding_type in ("rotary", "learned"),
            f"Unknown position_embedding_type {self.position_embedding_type!r}; use 'rotary' or 'learned'.",
        )
        _check(self.norm_type in ("rmsnorm", "layernorm"), f"Unknown norm_type {self.norm_type!r}; use 'rmsnorm' or 'layernorm'.")
        for name in ("attention_dropout", "hidden_dropout"):
            _check(0.0 <= getattr(self, name) < 1.0, f"{name} must be in [0, 1), got {getattr(self, name)}.")
        _check(
            self.sliding_window is None or self.sliding_window > 0,
            f"sliding_window must be a positive number of tokens or None, got {self.sliding_window}.",
        )
        check_moe_fields(self)
        if self.moe_layers is not None:
            bad = [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]
            _check(not bad, f"moe_layers {bad} are outside 0..{self.num_hidden_layers - 1} (num_hidden_layers).")

    def is_moe_layer(self, layer_idx: int) -> bool:
        if self.moe_layers is not None:
            return layer_idx in self.moe_layers
        return (layer_idx + 1) % self.moe_layer_frequency == 0


__all__ = ["GPTMoEConfig"]
