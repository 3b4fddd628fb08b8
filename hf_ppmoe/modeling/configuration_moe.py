"""`MoEConfig`: the MoE fields and their validation, shared by both model families' configs."""

from __future__ import annotations

import math

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.utils import logging

from ..moe.experts import EXPERTS_IMPLEMENTATIONS
from ..moe.gates import AUX_LOSS_SCOPES, get_gate_class

logger = logging.get_logger(__name__)


# Parallel plans of an FFN slot named `mlp` (a dense `MLP` or an `MoELayer`), in Transformers' plan strings; each
# family prefixes them with its layer path. Tensor parallel: dense FFNs and the shared expert are split Megatron-style
# (colwise in, rowwise out), MoE layers are PPMoE (experts split over the TP group). The "ppmoe_*" and
# "replicated_input" styles are registered by hf_ppmoe/parallel (see expert_parallel.py, tensor_parallel.py).
# Expert parallel (`DistributedConfig(ep_size=tp_size, ep_implementation="ppmoe")`): the same split through
# Transformers' expert-parallel dispatch; these rules replace the tensor-parallel ones of the experts.
_EXPERT_PARAMS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
MOE_TP_PLAN = {
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
    "mlp.shared_expert.gate_proj": "colwise",
    "mlp.shared_expert.up_proj": "colwise",
    "mlp.shared_expert.down_proj": "rowwise",
    "mlp.shared_expert": "replicated_input",
    "mlp": "ppmoe_ffn",
    **{f"mlp.experts.{name}": "grouped_gemm" for name in _EXPERT_PARAMS},
    "mlp.experts": "ppmoe_experts",
}
MOE_EP_PLAN = {
    **{f"mlp.experts.{name}": "grouped_gemm" for name in _EXPERT_PARAMS},
    "mlp.experts": "ep_dispatch_experts",
}


# positive integer sizes (None allowed for the optional ones) and finite numeric coefficients, of either family
_SIZES = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_decoder_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "moe_intermediate_size", "head_dim", "max_position_embeddings",
    "num_experts", "num_experts_per_tok", "router_num_groups", "moe_layer_frequency", "shared_expert_intermediate_size",
    "num_expert_groups", "topk_expert_groups",
)
_OPTIONAL_SIZES = (
    "num_decoder_layers", "num_key_value_heads", "moe_intermediate_size", "head_dim", "max_position_embeddings",
    "topk_expert_groups",
)
_NUMBERS = (
    "capacity_factor", "eval_capacity_factor", "router_aux_loss_coef", "router_z_loss_coef", "router_jitter_noise",
    "initializer_range", "layer_norm_eps", "router_bias_update_rate", "routed_scaling_factor",
)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


class MoEConfig(PreTrainedConfig):
    r"""
    MoE fields (Transformers' names where one exists: num_experts, num_experts_per_tok, router_aux_loss_coef,
    output_router_logits):
        router_type: a registered gate: "topk", "switch", "gshard", "prototype", or your own.
        capacity_factor / eval_capacity_factor: GShard capacity C = factor * k * S / E per group in training /
            evaluation; None = dropless. Evaluation defaults to dropless so decoding never drops tokens.
        router_num_groups: GShard's local dispatch groups (capacity and aux loss are per group).
        router_jitter_noise: multiplicative router-input noise in training (Switch).
        router_dtype: None (default: the router GEMM in the activations' dtype, as Transformers' Mixtral and
            Qwen3-MoE) or "float32" (the GEMM in float32, as Switch Transformers' router_dtype="float32"). The softmax
            and routing weights are float32 either way.
        router_random_routing: GShard's random routing of the 2nd expert with probability 2 * g2 (training only).
        router_random_routing_takes_capacity: GShard Algorithm 1 read literally (line 24 counts a second route that
            random routing skipped against e2's capacity); default False: the skipped route frees its slot for later
            tokens, which the paper's prose allows and which drops fewer tokens.
        norm_topk_prob: renormalise top-k weights to sum to one ("topk" gate).
        topk_weighting: "probs" (default: the top-k softmax probabilities, renormalised if norm_topk_prob) or "m6t"
            (M6-T Eq. (1): p = softmax(topk(softmax(W x))), a softmax over the k selected probabilities) ("topk" gate).
        moe_layer_frequency: every n-th FFN is MoE (layers n-1, 2n-1, ...); `moe_layers` lists them explicitly.
        moe_intermediate_size: expert inner size (defaults to intermediate_size).
        shared_expert_intermediate_size: > 0 adds a dense shared expert to every MoE layer.
        experts_implementation (Transformers' keyword, kept as `_experts_implementation` and, as the attention's,
            not written to config.json): "index" (PPMoE index_select, the default), "einsum" (GShard one-hot einsums),
            or a Transformers experts kernel ("grouped_mm", "batched_mm"). A config saved with the former name
            `dispatch` loads with one warning.
        router_z_loss_coef: weight of the router z-loss added to the loss.
        router_aux_loss_scope: over which tokens the load-balancing loss counts the routes: "micro_batch" (default:
            each forward's tokens, per GShard group), "sequence" (each sequence on its own, then averaged: DeepSeek-V3's
            sequence-wise loss) or "global_batch" (the fraction counted over the last optimizer step's whole global
            batch, all micro-batches and data-parallel processes, by `hf_ppmoe.moe.balance.LoadBalancer`; Qwen's
            global-batch balance, arXiv 2501.11873, one step late so that it is exact for any layout).
        router_expert_bias: aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores to choose the
            experts (never to the weights), moved after every optimizer step by
            `router_bias_update_rate * sign(mean load - load)` (`LoadBalancer`). "topk" gate only. Default False.
        router_bias_update_rate: that step size (DeepSeek-V3's gamma; default 0.001).
        router_score_function: "softmax" (default) or "sigmoid" (DeepSeek-V3, GLM-4-MoE: each score sigmoid(W x))
            ("topk" gate).
        routed_scaling_factor: the combine weights are multiplied by it (DeepSeek-V3; default 1.0) ("topk" gate).
        num_expert_groups / topk_expert_groups: group-limited routing (DeepSeek-V3's n_group / topk_group): the
            experts form num_expert_groups groups and a token's experts come from its topk_expert_groups best groups
            (None: all). Not GShard's token groups (router_num_groups). ("topk" gate.)
    """

    hidden_act: str = "silu"
    initializer_range: float = 0.02
    num_experts: int = 8
    num_experts_per_tok: int = 2
    router_type: str = "topk"
    capacity_factor: float | None = None
    eval_capacity_factor: float | None = None
    router_num_groups: int = 1
    router_jitter_noise: float = 0.0
    router_dtype: str | None = None
    router_random_routing: bool = True
    router_random_routing_takes_capacity: bool = False
    norm_topk_prob: bool = True
    topk_weighting: str = "probs"
    moe_layer_frequency: int = 2
    moe_layers: list[int] | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.001
    router_aux_loss_scope: str = "micro_batch"
    router_expert_bias: bool = False
    router_bias_update_rate: float = 0.001
    router_score_function: str = "softmax"
    routed_scaling_factor: float = 1.0
    num_expert_groups: int = 1
    topk_expert_groups: int | None = None
    output_router_logits: bool = False

    def __post_init__(self, **kwargs):
        # before 0.2 the experts' kernel was the config field `dispatch`
        legacy = kwargs.pop("dispatch", None)
        if legacy is not None:
            logger.warning_once(
                f"The config field `dispatch={legacy!r}` is now `experts_implementation` (Transformers' name for the "
                "experts' kernel): pass experts_implementation=... to the config or to from_pretrained."
            )
            kwargs.setdefault("experts_implementation", legacy)
        super().__post_init__(**kwargs)

    def validate_numbers(self) -> None:
        """Raise ValueError, naming the field, for sizes that are not positive integers (4.5, "4", None, -1, True) and
        coefficients that are not finite numbers (inf, nan, "0.1"): before any size is used in arithmetic."""
        for name in _SIZES:
            value = getattr(self, name, None)
            if value is None and name in _OPTIONAL_SIZES:
                continue
            check(
                isinstance(value, int) and not isinstance(value, bool),
                f"{name} must be an integer, got {value!r} ({type(value).__name__}).",
            )
            minimum = 0 if name == "shared_expert_intermediate_size" else 1
            if name != "num_experts_per_tok":  # its range, 1..num_experts, is checked with the gates
                check(value >= minimum, f"{name} must be >= {minimum}, got {value}.")
        for name in _NUMBERS:
            value = getattr(self, name, None)
            if value is None and name in ("capacity_factor", "eval_capacity_factor"):  # None: dropless
                continue
            check(
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                f"{name} must be a finite number, got {value!r}.",
            )
        check(self.layer_norm_eps > 0, f"layer_norm_eps must be > 0, got {self.layer_norm_eps}.")

    def validate_moe(self) -> None:
        """Raise ValueError, naming the field and the fix, for MoE settings that cannot work (after
        `validate_numbers`, which checks every size and coefficient on its own)."""
        check(
            1 <= self.num_experts_per_tok <= self.num_experts,
            f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and num_experts={self.num_experts}: "
            "a token cannot be routed to more experts than exist.",
        )
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            check(value is None or value > 0, f"{name}={value} must be > 0, or None for dropless routing (no token is ever dropped).")
        check(
            0.0 <= self.router_jitter_noise < 1.0,
            f"router_jitter_noise={self.router_jitter_noise} must be in [0, 1) (multiplicative noise 1 +- eps).",
        )
        check(
            self.router_dtype in (None, "float32"),
            f"router_dtype={self.router_dtype!r}: use None (the activations' dtype) or 'float32'.",
        )
        check(
            self.topk_weighting in ("probs", "m6t"),
            f"topk_weighting={self.topk_weighting!r}: use 'probs' (top-k softmax probabilities) or 'm6t' (M6-T Eq. (1)).",
        )
        check(
            self.router_aux_loss_scope in AUX_LOSS_SCOPES,
            f"router_aux_loss_scope={self.router_aux_loss_scope!r}: use one of {', '.join(AUX_LOSS_SCOPES)}.",
        )
        check(
            self.router_score_function in ("softmax", "sigmoid"),
            f"router_score_function={self.router_score_function!r}: use 'softmax' or 'sigmoid'.",
        )
        check(self.router_bias_update_rate >= 0, f"router_bias_update_rate must be >= 0, got {self.router_bias_update_rate}.")
        check(self.routed_scaling_factor > 0, f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}.")
        plain_topk = self.router_score_function == "softmax" and self.num_expert_groups == 1 and self.routed_scaling_factor == 1.0
        check(
            self.router_type == "topk" or plain_topk,
            f"router_score_function / num_expert_groups / routed_scaling_factor are options of router_type='topk'; "
            f"router_type={self.router_type!r} would ignore them.",
        )
        get_gate_class(self.router_type).check_config(self)
        known = (*EXPERTS_IMPLEMENTATIONS, "eager", *ALL_EXPERTS_FUNCTIONS.keys())
        check(
            self._experts_implementation in (None, *known),
            f"Unknown experts_implementation {self._experts_implementation!r}; use one of {', '.join(dict.fromkeys(known))}.",
        )
        check(
            self.hidden_act in ACT2FN,
            f"Unknown hidden_act {self.hidden_act!r}; use one of Transformers' activations, e.g. 'gelu_new', 'silu', 'relu'.",
        )
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            check(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}.")

    def is_moe_layer(self, layer_idx: int, moe_layers: list[int] | None = None, frequency: int | None = None) -> bool:
        """Whether FFN `layer_idx` is an MoE layer: listed in `moe_layers`, else every `frequency`-th
        (`moe_layer_frequency` by default; an encoder-decoder passes each stack's own list and frequency)."""
        moe_layers = self.moe_layers if moe_layers is None else moe_layers
        if moe_layers is not None:
            return layer_idx in moe_layers
        return (layer_idx + 1) % (frequency or self.moe_layer_frequency) == 0
