"""What the layers and stacks of both families share: the attention call, the pre-norm residual sublayers (attention
and the FFN, a dense `MLP` or an `MoELayer`), running a stack of layers with its router losses, and the recording of
hidden states, attentions and routes with Transformers' output hooks (`capture_outputs`), as its Mixtral and
Qwen3-MoE models do.

A layer returns `layer_outputs`: (hidden_states, aux_loss, z_loss). What a caller may also ask for (hidden states,
attention weights, routes) is recorded by hooks on the modules that produce it, named in each stack's
`_can_record_outputs`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from ..moe.experts import MLP
from ..moe.layer import MoELayer
from ..moe.losses import losses_wanted, mean_over_layers
from ..moe.observe import ROUTING_INDEX
from .common import layer_outputs
from .norms import build_norm


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, position_bias=None, **_):
    """query [B, N, L, D], key/value [B, N_kv, K, D] (repeated to N heads), position_bias [1, N, L, K] or None
    -> out [B, L, N, D], weights [B, N, L, K]."""
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if position_bias is not None:
        weights = weights + position_bias
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            weights = weights.masked_fill(~attention_mask, torch.finfo(weights.dtype).min)
        else:
            weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def attend(module: nn.Module, attention, query, key, value, attention_mask, **kwargs) -> tuple:
    """`attention` (the config's implementation: eager, sdpa, flex, ...) on [B, N, len, D] heads, then
    `module.o_proj` -> ([B, L, H], attention weights or None)."""
    out, weights = attention(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=module.config.attention_dropout if module.training else 0.0,
        scaling=module.scaling,
        **kwargs,
    )
    return module.o_proj(out.reshape(*out.shape[:2], -1).contiguous()), weights


class MoETransformerLayer(GradientCheckpointingLayer):
    """A pre-norm layer of either family: self-attention, cross-attention over the encoder output (a Seq2Seq-MoE
    decoder's layers only), then the FFN, a dense `MLP` or an `MoELayer`. Each sublayer normalises its input and adds
    its dropped-out output to the residual stream. Subclasses build the attention modules (registered in the order
    they run, so that parameters are listed that way)."""

    def __init__(self, config, self_attn: nn.Module, is_moe: bool, cross_attn: nn.Module | None = None):
        super().__init__()
        H, eps = config.hidden_size, config.layer_norm_eps
        self.input_layernorm = build_norm(config.norm_type, H, eps)
        self.self_attn = self_attn
        self.cross_attn_layernorm = build_norm(config.norm_type, H, eps) if cross_attn is not None else None
        self.cross_attn = cross_attn
        self.post_attention_layernorm = build_norm(config.norm_type, H, eps)
        self.is_moe = is_moe
        self.mlp = MoELayer(config) if is_moe else MLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_bias=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        cache=None,
        token_mask=None,
        compute_router_losses=None,
        router_expert_ids=None,
        **kwargs,
    ) -> tuple:
        """hidden_states [B, L, H] -> `layer_outputs` (hidden_states, aux_loss, z_loss).

        position_bias [1, N, L, K] (T5's relative bias, added to the self-attention scores) and the encoder output
        [B, S, H] come positionally: reentrant gradient checkpointing (GradientCheckpointingLayer) gives gradients only
        to positional tensors. Other keywords (rotary `position_embeddings`, kernel arguments) go to the attentions.
        token_mask [B, L]: tokens that count in the router losses and statistics (None: all).
        router_expert_ids [B * L, K]: router replay (`MoELayer`): this MoE layer's routes are these."""
        hidden_states = self.attention_block(
            hidden_states, self.input_layernorm, self.self_attn, attention_mask=attention_mask,
            position_bias=position_bias, cache=cache, **kwargs,
        )
        if self.cross_attn is not None:
            hidden_states = self.attention_block(
                hidden_states, self.cross_attn_layernorm, self.cross_attn, attention_mask=encoder_attention_mask,
                key_value_states=encoder_hidden_states, cache=cache, **kwargs,
            )
        h = self.post_attention_layernorm(hidden_states)
        routing = None
        if self.is_moe:
            h, routing = self.mlp(h, token_mask, compute_losses=compute_router_losses, expert_ids=router_expert_ids)
        else:
            h = self.mlp(h)
        return layer_outputs(hidden_states + self.dropout(h), routing)

    def attention_block(self, hidden_states, norm: nn.Module, attention: nn.Module, **kwargs) -> torch.Tensor:
        """hidden_states + dropout(attention(norm(hidden_states), **kwargs))."""
        out, _ = attention(norm(hidden_states), **kwargs)
        return hidden_states + self.dropout(out)


def run_layers(
    layers, hidden_states, *args, router_expert_ids=None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Runs `layers` in order, each on the previous one's hidden states with the same other arguments ->
    (hidden_states, aux_loss, z_loss): the router losses averaged over the MoE layers, so that the coefficients do not
    depend on depth (None without MoE layers, or when the losses were not computed).

    router_expert_ids: router replay, one [T, K] tensor per MoE layer in order (what `output_router_logits` returns
    as `router_expert_ids`), each handed to its layer."""
    replay = None
    if router_expert_ids is not None:
        moe = [layer for layer in layers if getattr(layer, "is_moe", False)]
        if len(router_expert_ids) != len(moe):
            raise ValueError(
                f"router_expert_ids holds {len(router_expert_ids)} tensors; replay needs one [tokens, k] tensor per MoE "
                f"layer of this stack ({len(moe)}), as output_router_logits returns them."
            )
        replay = iter(router_expert_ids)
    losses = []
    for layer in layers:
        if replay is not None and getattr(layer, "is_moe", False):
            kwargs["router_expert_ids"] = next(replay)
        hidden_states, aux, z = layer(hidden_states, *args, **kwargs)
        if aux is not None:
            losses.append((aux, z))
    aux, z = mean_over_layers([(aux, z, 1) for aux, z in losses], len(losses))
    return hidden_states, aux, z


def combine_router_losses(*stacks: tuple[tuple[torch.Tensor, torch.Tensor] | None, int]):
    """(router_losses, number of MoE layers) per stack -> (aux_loss, z_loss) averaged over all MoE layers, as if one
    list of layers (`mean_over_layers`)."""
    present = [(losses[0], losses[1], n) for losses, n in stacks if losses is not None]
    return mean_over_layers(present, sum(n for *_, n in present))


def output_recorders(layer: type[nn.Module], attention: type[nn.Module], cross_attention: bool = False) -> dict:
    """A stack's `_can_record_outputs`: hidden states (each layer's input, then the final output), self-attention
    (and cross-attention) weights, and each MoE layer's `Routing` (under "router_logits": `capture_moe_outputs` splits
    it into router_logits and router_expert_ids), read where `hf_ppmoe.moe.observe` reads it outside the forward."""
    recorders = {
        "hidden_states": OutputRecorder(layer, index=0),
        "attentions": OutputRecorder(attention, index=1, layer_name="self_attn"),
        "router_logits": OutputRecorder(MoELayer, index=ROUTING_INDEX),
    }
    if cross_attention:
        recorders["cross_attentions"] = OutputRecorder(attention, index=1, layer_name="cross_attn")
    return recorders


def model_forward(forward):
    """A model's public forward: `return_dict=False` (argument or config) gives the tuple form (`can_return_tuple`),
    and `past_key_values`, the name before Transformers 5.24, is taken for `cache`."""
    return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(can_return_tuple(forward))


def head_output(output_class: type, base_output, **fields):
    """A task head's `output_class` holding the base model's output fields but its last hidden state (which the head
    turned into logits), and `fields`."""
    return output_class(**{key: value for key, value in base_output.items() if key != "last_hidden_state"}, **fields)


_FLAGS = ("output_attentions", "output_hidden_states", "output_router_logits")


def capture_moe_outputs(forward):
    """Decorates a stack's forward with Transformers' `capture_outputs`. The output flags default to the config's and
    are read here only (the layers never see them); `compute_router_losses` defaults to "with gradients, or when
    routes are asked for" (the router losses only cost time while decoding). The forward always returns its
    ModelOutput (`can_return_tuple` outside gives the tuple form)."""

    @functools.wraps(forward)
    def body(self, *args, output_attentions=None, output_hidden_states=None, output_router_logits=None, **kwargs):
        return forward(self, *args, **kwargs)

    captured = capture_outputs(body)

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        kwargs.pop("return_dict", None)
        flags = {name: kwargs.pop(name, None) for name in _FLAGS}
        flags = {name: getattr(self.config, name) if value is None else value for name, value in flags.items()}
        kwargs["compute_router_losses"] = losses_wanted(
            kwargs.get("compute_router_losses"), router_logits=bool(flags["output_router_logits"])
        )
        out = captured(self, *args, return_dict=True, **flags, **kwargs)
        if out.router_logits is not None:  # the recorded Routings
            routings = out.router_logits
            out.router_logits = tuple(r.router_logits for r in routings)
            out.router_expert_ids = tuple(r.expert_ids for r in routings)
        return out

    return wrapper
