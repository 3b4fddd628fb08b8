"""Seq2Seq-MoE: a Transformer encoder-decoder (T5 layout; GShard's M4) whose every n-th FFN in each stack is an
`MoELayer`. Single-device code: parallelism is applied from `hf_ppmoe.parallel`.

Legend: B batch, S source length, L target (decoder query) length, P cached target length, N heads, D head dim,
H hidden, V vocabulary.

    input_ids [B, S] ─shared─> encoder: [self-attn (bidirectional) -> FFN | MoE] x layers -> norm ─┐ [B, S, H]
    decoder_input_ids [B, L] ─shared─> decoder: [causal self-attn -> cross-attn -> FFN | MoE] x layers -> norm
                                      ─(x H**-0.5 if scale_decoder_outputs)─> lm_head -> logits [B, L, V]

Each stack computes T5's bucketed relative position bias [1, N, L, P + L] once and every self-attention adds it to
its scores; cross-attention has none. Padding tokens (encoder `attention_mask`; decoder `decoder_attention_mask` and
labels == -100) are kept out of routing statistics and router losses.
"""

import math
from dataclasses import dataclass
from typing import Unpack

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_outputs import (
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqMoEModelOutput,
    Seq2SeqMoEOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import TransformersKwargs

from ..generation.router_stats import MoEGenerationMixin
from ..utils.transformers_private import attention_implementation, register_output_recorders
from .blocks import MoETransformerLayer, attend, capture_moe_outputs, combine_router_losses
from .blocks import eager_attention_forward, head_output, model_forward, output_recorders, run_layers
from .common import MoEPreTrainedModel
from .configuration_seq2seq_moe import Seq2SeqMoEConfig
from .inputs import check_ids, check_tokens, routing_token_mask
from .loss import is_target, lm_targets, model_loss, router_losses_wanted
from .norms import build_norm


@dataclass
class Seq2SeqMoEStackOutput(BaseModelOutputWithPastAndCrossAttentions):
    """Output of the encoder or the decoder stack. `router_logits` / `router_expert_ids`: one `[T, E]` / `[T, K]`
    tensor per MoE layer (with output_router_logits). `router_losses`: (aux_loss, z_loss) averaged over the stack's
    MoE layers; a tuple, not two tensor fields, because `generate` repeats every tensor field of the encoder output
    once per beam, and these are batch-level scalars."""

    router_logits: tuple[torch.Tensor, ...] | None = None
    router_expert_ids: tuple[torch.Tensor, ...] | None = None
    router_losses: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def aux_loss(self) -> torch.Tensor | None:
        return None if self.router_losses is None else self.router_losses[0]

    @property
    def z_loss(self) -> torch.Tensor | None:
        return None if self.router_losses is None else self.router_losses[1]


@dataclass
class Seq2SeqMoEModelOutputWithLosses(Seq2SeqMoEModelOutput):
    """Transformers' `Seq2SeqMoEModelOutput` plus each stack's routes and router losses; `aux_loss` / `z_loss` are
    averaged over the MoE layers of both stacks."""

    encoder_router_expert_ids: tuple[torch.Tensor, ...] | None = None
    decoder_router_expert_ids: tuple[torch.Tensor, ...] | None = None
    encoder_aux_loss: torch.Tensor | None = None
    encoder_z_loss: torch.Tensor | None = None
    decoder_aux_loss: torch.Tensor | None = None
    decoder_z_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None


@dataclass
class Seq2SeqMoELMOutput(Seq2SeqMoEOutput):
    """`loss` (when labels are given): the LM loss `lm_loss` plus the router term of `aux_loss` and `z_loss`, averaged
    over the MoE layers of both stacks (`hf_ppmoe.modeling.loss.model_loss`); `num_target_tokens`: the labels the LM
    loss predicts (not -100)."""

    encoder_router_expert_ids: tuple[torch.Tensor, ...] | None = None
    decoder_router_expert_ids: tuple[torch.Tensor, ...] | None = None
    aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    lm_loss: torch.Tensor | None = None
    num_target_tokens: torch.Tensor | None = None


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int):
    """T5's (Mesh TensorFlow's) bucketing of key_position - query_position: half the buckets are exact small offsets,
    the rest grow logarithmically up to max_distance; bidirectional buckets split the range by sign, causal ones
    keep only the past."""
    buckets = 0
    if bidirectional:
        num_buckets //= 2
        buckets = (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # float32 math exactly as T5 (log of 0 for small distances is discarded by the where below)
    large = max_exact + (
        torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).long()
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, distance, large)


class Seq2SeqMoEAttention(nn.Module):
    """Self-attention (encoder: bidirectional, decoder: causal and cached) or cross-attention (keys/values from the
    encoder output, computed once per generation and kept in the cross-attention cache)."""

    def __init__(self, config: Seq2SeqMoEConfig, layer_idx: int, is_causal: bool = False, is_cross: bool = False):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.is_causal, self.is_cross = is_causal, is_cross
        self.head_dim = config.head_dim
        self.scaling = config.attention_scaling if config.attention_scaling is not None else self.head_dim**-0.5
        H, inner, bias = config.hidden_size, config.num_attention_heads * self.head_dim, config.attention_bias
        self.q_proj = nn.Linear(H, inner, bias=bias)
        self.k_proj = nn.Linear(H, inner, bias=bias)
        self.v_proj = nn.Linear(H, inner, bias=bias)
        self.o_proj = nn.Linear(inner, H, bias=bias)

    def _project(self, proj: nn.Linear, states: torch.Tensor) -> torch.Tensor:
        return proj(states).view(*states.shape[:-1], -1, self.head_dim).transpose(1, 2)  # [B, N, len, D]

    def _key_values(self, hidden_states, key_value_states, cache: EncoderDecoderCache | None, kwargs: dict):
        if not self.is_cross:
            k, v = self._project(self.k_proj, hidden_states), self._project(self.v_proj, hidden_states)
            if cache is not None:
                k, v = cache.self_attention_cache.update(k, v, self.layer_idx, kwargs=kwargs)
            return k, v
        if cache is not None and cache.is_updated.get(self.layer_idx):
            layer = cache.cross_attention_cache.layers[self.layer_idx]  # the encoder output does not change
            return layer.keys, layer.values
        k, v = self._project(self.k_proj, key_value_states), self._project(self.v_proj, key_value_states)
        if cache is not None:
            k, v = cache.cross_attention_cache.update(k, v, self.layer_idx, kwargs=kwargs)
            cache.is_updated[self.layer_idx] = True
        return k, v

    def forward(
        self, hidden_states, attention_mask, position_bias=None, key_value_states=None, cache=None, **kwargs
    ):
        """hidden_states [B, L, H], key_value_states [B, S, H] (cross only) -> ([B, L, H], attention weights | None)."""
        q = self._project(self.q_proj, hidden_states)
        k, v = self._key_values(hidden_states, key_value_states, cache, kwargs)  # the cache may fill kwargs in place
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(attention_implementation(self.config), eager_attention_forward)
        return attend(self, attention, q, k, v, attention_mask, position_bias=position_bias, **kwargs)


class Seq2SeqMoEEncoderLayer(MoETransformerLayer):
    """Pre-norm self-attention, then the FFN (dense `MLP` or `MoELayer`), each with a residual connection."""

    def __init__(self, config: Seq2SeqMoEConfig, layer_idx: int, is_moe: bool):
        super().__init__(config, Seq2SeqMoEAttention(config, layer_idx), is_moe)


class Seq2SeqMoEDecoderLayer(MoETransformerLayer):
    """Causal self-attention, cross-attention over the encoder output, then the FFN (dense or MoE)."""

    def __init__(self, config: Seq2SeqMoEConfig, layer_idx: int, is_moe: bool):
        self_attn = Seq2SeqMoEAttention(config, layer_idx, is_causal=True)
        super().__init__(config, self_attn, is_moe, cross_attn=Seq2SeqMoEAttention(config, layer_idx, is_cross=True))


class Seq2SeqMoEStack(nn.Module):
    """What the encoder and the decoder share: the (tied) token embedding, one relative position bias table, the
    layers, the final norm, and the recording of their outputs (`_can_record_outputs`, `capture_moe_outputs`). A
    pipeline stage holding part of a stack keeps this forward (`hf_ppmoe.modeling.stages.cut_stack`)."""

    bidirectional = True
    _can_record_outputs: dict = {}

    def __init__(self, config: Seq2SeqMoEConfig, embed_tokens: nn.Embedding, layers: list[nn.Module]):
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens
        self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_attention_heads)
        self.layers = nn.ModuleList(layers)
        self.norm = build_norm(config.norm_type, config.hidden_size, config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)  # on the embedded input
        self.output_dropout = nn.Dropout(config.hidden_dropout)  # after the final norm
        self.num_moe_layers = sum(layer.is_moe for layer in self.layers)
        register_output_recorders(self, self._can_record_outputs)

    def position_bias(self, query_length: int, key_length: int, past_length: int, device) -> torch.Tensor:
        """[1, N, query_length, key_length]: the bias of key j for query i (at absolute position past_length + i)."""
        query = torch.arange(query_length, dtype=torch.long, device=device)[:, None] + past_length
        key = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        return self.relative_position_bias(key - query).unsqueeze(0)

    def relative_position_bias(self, relative_position: torch.Tensor) -> torch.Tensor:
        """relative_position (key position - query position) [..., Q, KV] -> bias [..., N, Q, KV]. Flat beam search
        (hf_ppmoe.generation) calls it on the decoder to correct the bias of its buffer slots to true positions."""
        buckets = relative_position_bucket(
            relative_position,
            bidirectional=self.bidirectional,
            num_buckets=self.config.relative_attention_num_buckets,
            max_distance=self.config.relative_attention_max_distance,
        )
        return self.relative_attention_bias(buckets).movedim(-1, -3)

    def _embed(self, input_ids, inputs_embeds):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds (for the decoder: decoder_input_ids or "
                             "decoder_inputs_embeds, or labels).")
        stack = "" if self.bidirectional else "decoder "
        if inputs_embeds is not None:
            check_tokens(inputs_embeds.shape, f"{stack}inputs_embeds")
            return inputs_embeds
        check_tokens(input_ids.shape, f"{stack}input_ids")
        check_ids(input_ids, self.config.vocab_size, f"{stack}token ids".capitalize(), "Use the model's tokenizer.")
        return self.embed_tokens(input_ids)

    def _output(self, hidden_states, aux_loss, z_loss, **fields) -> Seq2SeqMoEStackOutput:
        return Seq2SeqMoEStackOutput(
            last_hidden_state=self.output_dropout(self.norm(hidden_states)),
            router_losses=(aux_loss, z_loss) if aux_loss is not None else None,
            **fields,
        )


class Seq2SeqMoEEncoder(Seq2SeqMoEStack):
    """The bidirectional encoder stack."""
    _can_record_outputs = output_recorders(Seq2SeqMoEEncoderLayer, Seq2SeqMoEAttention)

    def __init__(self, config: Seq2SeqMoEConfig, embed_tokens: nn.Embedding):
        layers = [
            Seq2SeqMoEEncoderLayer(config, i, config.is_encoder_moe_layer(i)) for i in range(config.num_hidden_layers)
        ]
        super().__init__(config, embed_tokens, layers)

    @capture_moe_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        compute_router_losses: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqMoEStackOutput:
        """input_ids [B, S], attention_mask [B, S] (0 for padding) -> last_hidden_state [B, S, H] and router outputs;
        output flags as `capture_moe_outputs` reads them."""
        inputs_embeds = self._embed(input_ids, inputs_embeds)
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask)
        S = inputs_embeds.shape[1]
        position_bias = self.position_bias(S, S, 0, inputs_embeds.device)
        token_mask = routing_token_mask(attention_mask, compute_router_losses)
        hidden_states, aux_loss, z_loss = run_layers(
            self.layers,
            self.dropout(inputs_embeds),
            mask,
            position_bias,
            token_mask=token_mask,
            compute_router_losses=compute_router_losses,
            **kwargs,
        )
        return self._output(hidden_states, aux_loss, z_loss)


class Seq2SeqMoEDecoder(Seq2SeqMoEStack):
    """The causal decoder stack, cross-attending to the encoder output; its cache is an `EncoderDecoderCache`."""
    bidirectional = False
    _can_record_outputs = output_recorders(Seq2SeqMoEDecoderLayer, Seq2SeqMoEAttention, cross_attention=True)

    def __init__(self, config: Seq2SeqMoEConfig, embed_tokens: nn.Embedding):
        layers = [
            Seq2SeqMoEDecoderLayer(config, i, config.is_decoder_moe_layer(i)) for i in range(config.num_decoder_layers)
        ]
        super().__init__(config, embed_tokens, layers)

    def _cache(self, cache: Cache | None, use_cache: bool) -> EncoderDecoderCache | None:
        if cache is None:
            return EncoderDecoderCache(DynamicCache(), DynamicCache()) if use_cache else None
        if not isinstance(cache, EncoderDecoderCache):
            cache = EncoderDecoderCache(cache, DynamicCache())
        # `generate` sizes its DynamicCache from config.num_hidden_layers, the encoder's depth (T5 in Transformers
        # fails the same way when num_decoder_layers is larger): give a deeper decoder the layers it needs
        for part in (cache.self_attention_cache, cache.cross_attention_cache):
            if type(part) is DynamicCache and part.layer_class_to_replicate is None:
                part.layers.extend(DynamicLayer() for _ in range(len(self.layers) - len(part.layers)))
        return cache

    @capture_moe_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        token_mask: torch.Tensor | None = None,
        compute_router_losses: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqMoEStackOutput:
        """input_ids [B, L] (the new tokens when cache holds P earlier ones), attention_mask [B, P + L],
        encoder_hidden_states [B, S, H], encoder_attention_mask [B, S], token_mask [B, L] (False: not routed for
        losses/statistics) -> last_hidden_state [B, L, H], cache, router outputs."""
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        inputs_embeds = self._embed(input_ids, inputs_embeds)
        cache = self._cache(cache, use_cache)
        self_cache = cache.self_attention_cache if cache is not None else None
        L = inputs_embeds.shape[1]
        P = self_cache.get_seq_length() if self_cache is not None else 0
        if attention_mask is not None and attention_mask.dim() == 2 and isinstance(P, int) and attention_mask.shape[1] != P + L:
            cached = f" after {P} cached ones" if P else ""
            raise ValueError(
                f"decoder_attention_mask has length {attention_mask.shape[1]}, but the decoder input has {L} tokens"
                f"{cached}: the mask needs one entry per decoder token ({P + L})."
            )

        causal_mask = create_causal_mask(
            config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=self_cache
        )
        cross_mask = create_bidirectional_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=encoder_attention_mask,
            encoder_hidden_states=encoder_hidden_states,
        )
        # keys: the cache's length after this step; a static cache always attends over its whole (masked) buffer
        K = self_cache.get_mask_sizes(L, 0)[0] if self_cache is not None and len(self_cache.layers) else P + L
        position_bias = self.position_bias(L, K, P, inputs_embeds.device)
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = attention_mask[:, -L:].bool()
            token_mask = attention_mask if token_mask is None else token_mask.bool() & attention_mask
        token_mask = routing_token_mask(token_mask, compute_router_losses)
        hidden_states, aux_loss, z_loss = run_layers(
            self.layers,
            self.dropout(inputs_embeds),
            causal_mask,
            position_bias,
            encoder_hidden_states,
            cross_mask,
            cache=cache,
            token_mask=token_mask,
            compute_router_losses=compute_router_losses,
            **kwargs,
        )
        return self._output(hidden_states, aux_loss, z_loss, cache=cache if use_cache else None)


# each stack's fields of the model output, prefixed with "encoder_" / "decoder_"
_STACK_FIELDS = ("hidden_states", "attentions", "router_logits", "router_expert_ids", "aux_loss", "z_loss")


class Seq2SeqMoEPreTrainedModel(MoEPreTrainedModel):
    """Base of the Seq2Seq-MoE classes: tied-embedding loading and T5's label shift."""
    config: Seq2SeqMoEConfig
    config_class = Seq2SeqMoEConfig
    _no_split_modules = ["Seq2SeqMoEEncoderLayer", "Seq2SeqMoEDecoderLayer"]
    _supports_flash_attn = False  # the relative position bias is added to the scores; flash kernels take no bias

    def mark_tied_weights_as_initialized(self, loading_info):
        """Transformers marks every tied target (the stacks' `embed_tokens.weight`) as loaded so it is not initialized
        for nothing. Here the stacks' embeddings ARE the module `shared`, so that mark also lands on `shared.weight`;
        when the checkpoint lacks it and everything tied to it, it must stay missing: reported, and initialized on the
        model's device instead of left on the meta device."""
        tied = self.all_tied_weights_keys
        lost = {
            source for source in set(tied.values())
            if {source, *(t for t, s in tied.items() if s == source)} <= loading_info.missing_keys
        }
        super().mark_tied_weights_as_initialized(loading_info)
        for name in lost:
            parameter = self.get_parameter(name)
            if hasattr(parameter, "_is_hf_initialized"):
                del parameter._is_hf_initialized
            loading_info.missing_keys.add(name)

    def _shift_right(self, labels: torch.LongTensor) -> torch.LongTensor:
        """labels [B, L] -> decoder_input_ids [B, L]: decoder_start_token_id, then the labels shifted right by one,
        with -100 (ignored positions) replaced by pad_token_id (as T5)."""
        start, pad = self.config.decoder_start_token_id, self.config.pad_token_id
        if start is None or pad is None:
            raise ValueError(
                f"Making decoder inputs from labels needs config.decoder_start_token_id and config.pad_token_id "
                f"(got {start} and {pad}); set them (T5 uses 0 for both) or pass decoder_input_ids."
            )
        shifted = labels.new_full(labels.shape, start)
        shifted[..., 1:] = labels[..., :-1]
        return shifted.masked_fill(shifted == -100, pad)


class Seq2SeqMoEModel(Seq2SeqMoEPreTrainedModel):
    """The shared embedding, the encoder and the decoder: the decoder's last_hidden_state [B, L, H] and both stacks'
    outputs."""
    _auto_classes = {"AutoModel": "Seq2SeqMoEModel"}
    _tied_weights_keys = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
    }

    def __init__(self, config: Seq2SeqMoEConfig):
        super().__init__(config)
        # no padding_idx: the pad id is also T5's decoder start token, whose embedding must train
        self.shared = nn.Embedding(config.vocab_size, config.hidden_size)
        self.encoder = Seq2SeqMoEEncoder(config, self.shared)
        self.decoder = Seq2SeqMoEDecoder(config, self.shared)
        self.post_init()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        # both stacks always read the shared embedding; tie_word_embeddings only decides about the LM head
        if all_submodels:
            return super().get_expanded_tied_weights_keys(all_submodels=True)
        return dict(self._tied_weights_keys)

    def get_input_embeddings(self):
        return self.shared

    def set_input_embeddings(self, new_embeddings):
        self.shared = self.encoder.embed_tokens = self.decoder.embed_tokens = new_embeddings

    def decode(
        self,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        decoder_token_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> Seq2SeqMoEStackOutput:
        """The decoder stack on the encoder's output [B, S, H], the model's arguments given the decoder's names
        (attention_mask is the encoder's); `kwargs` go to the decoder as they are (cache, use_cache,
        compute_router_losses, router_expert_ids, output flags). `forward` calls it, and so does a pipeline stage that
        holds decoder layers (hf_ppmoe.parallel.pipeline)."""
        return self.decoder(
            input_ids=decoder_input_ids, attention_mask=decoder_attention_mask, inputs_embeds=decoder_inputs_embeds,
            encoder_hidden_states=encoder_hidden_states, encoder_attention_mask=attention_mask,
            token_mask=decoder_token_mask, **kwargs,
        )

    @model_forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: Seq2SeqMoEStackOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        decoder_token_mask: torch.Tensor | None = None,
        compute_router_losses: bool | None = None,
        encoder_router_expert_ids: tuple[torch.Tensor, ...] | None = None,
        decoder_router_expert_ids: tuple[torch.Tensor, ...] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqMoEModelOutputWithLosses:
        """The encoder runs unless `encoder_outputs` is given (as `generate` does after its first step).
        decoder_token_mask [B, L]: decoder tokens that count in router losses/statistics (besides the mask).
        encoder_router_expert_ids / decoder_router_expert_ids: router replay per stack, one [tokens, k] tensor per MoE
        layer, as `output_router_logits` returns them (see `GPTMoEModel.forward`).
        output_attentions, output_hidden_states, output_router_logits: keyword flags for both stacks
        (`capture_moe_outputs`)."""
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids, attention_mask, inputs_embeds, compute_router_losses=compute_router_losses,
                router_expert_ids=encoder_router_expert_ids, **kwargs,
            )
        elif isinstance(encoder_outputs, (tuple, list)):  # return_dict=False style: (last_hidden_state, ...)
            encoder_outputs = Seq2SeqMoEStackOutput(last_hidden_state=encoder_outputs[0])
        decoder_outputs = self.decode(
            encoder_outputs.last_hidden_state, attention_mask, decoder_input_ids, decoder_attention_mask,
            decoder_inputs_embeds, decoder_token_mask, cache=cache, use_cache=use_cache,
            compute_router_losses=compute_router_losses, router_expert_ids=decoder_router_expert_ids, **kwargs,
        )
        aux_loss, z_loss = combine_router_losses(
            (getattr(encoder_outputs, "router_losses", None), self.encoder.num_moe_layers),
            (decoder_outputs.router_losses, self.decoder.num_moe_layers),
        )
        stacks = {"encoder": encoder_outputs, "decoder": decoder_outputs}
        return Seq2SeqMoEModelOutputWithLosses(
            last_hidden_state=decoder_outputs.last_hidden_state,
            cache=decoder_outputs.cache,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            **{f"{name}_{field}": getattr(out, field, None) for name, out in stacks.items() for field in _STACK_FIELDS},
            aux_loss=aux_loss,
            z_loss=z_loss,
        )


class Seq2SeqMoEForConditionalGeneration(Seq2SeqMoEPreTrainedModel, MoEGenerationMixin):
    """`generate(output_router_logits=True, return_dict_in_generate=True)` also returns the routing of both stacks
    (hf_ppmoe.generation.router_stats)."""

    _tied_weights_keys = {"lm_head.weight": "model.shared.weight"}
    _auto_classes = {"AutoModel": "Seq2SeqMoEModel", "AutoModelForSeq2SeqLM": "Seq2SeqMoEForConditionalGeneration"}
    _tp_plan = {"lm_head": "colwise_gathered"}  # hf_ppmoe.parallel: gathered logits, not a view

    def __init__(self, config: Seq2SeqMoEConfig):
        super().__init__(config)
        self.model = Seq2SeqMoEModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        # `loss_function`: the decoder predicts its labels as they are (no causal shift), Transformers' masked-LM loss
        self.loss_type = "ForMaskedLM"

    def init_continuous_batching(self, *args, **kwargs):
        """Transformers' continuous batching (`generate_batch`, `transformers serve --continuous-batching`) packs
        decoder-only requests into one paged cache; it has no place for an encoder's output."""
        raise NotImplementedError(
            "Continuous batching (generate_batch, paged attention) is decoder-only in Transformers: an "
            "encoder-decoder has no place in its paged cache for the encoder output. Use model.generate(...) with a "
            "padded batch (or flat beam search) for Seq2Seq-MoE; GPT-MoE supports generate_batch."
        )

    def get_input_embeddings(self):
        return self.model.shared

    def set_input_embeddings(self, new_embeddings):
        self.model.set_input_embeddings(new_embeddings)

    def lm_logits(self, decoder_output: torch.Tensor) -> torch.Tensor:
        """The LM head on the decoder's output [B, L, H] -> [B, L, V] (also a pipeline's last stage's)."""
        if self.config.scale_decoder_outputs:
            # T5 v1.0: the LM head is the embedding matrix, whose init std is 1; this keeps logits at unit scale
            decoder_output = decoder_output * self.config.hidden_size**-0.5
        return self.lm_head(decoder_output)

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Used by DataCollatorForSeq2Seq to build decoder_input_ids."""
        return self._shift_right(labels)

    @model_forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: Seq2SeqMoEStackOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        compute_router_losses: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqMoELMOutput:
        """labels [B, L] (-100: ignored) give the loss and, unless decoder inputs are passed, the decoder inputs
        (`_shift_right`). Router losses count the tokens the LM loss counts. A batch without a target label has loss 0
        (`model_loss`). `compute_router_losses` defaults to True with labels (False: the LM loss alone)."""
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = self._shift_right(labels)
        out = self.model(
            return_dict=True,
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            cache=cache,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            decoder_token_mask=is_target(labels) if labels is not None else None,
            compute_router_losses=router_losses_wanted(compute_router_losses, labels),
            **kwargs,
        )
        logits = self.lm_logits(out.last_hidden_state)

        losses = {}
        if labels is not None:
            lm_loss = self.loss_function(logits, labels.contiguous(), self.config.vocab_size, num_items_in_batch=num_items_in_batch)
            targets = lm_targets(labels, causal=False)
            losses = model_loss(lm_loss, targets, num_items_in_batch, self.config, out.aux_loss, out.z_loss)._asdict()
        return head_output(Seq2SeqMoELMOutput, out, logits=logits, **losses)


__all__ = [
    "Seq2SeqMoEForConditionalGeneration",
    "Seq2SeqMoEModel",
    "Seq2SeqMoEPreTrainedModel",
]
