"""GPT-MoE: a decoder-only transformer (GPT-2 or Llama style) whose every `moe_layer_frequency`-th FFN is an
`MoELayer`. Single-device code: parallelism is applied from `hf_ppmoe.parallel`.

Legend: B batch, L query length, H hidden, T = B * L tokens.
"""

from dataclasses import dataclass
from typing import Unpack

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import TransformersKwargs

from ..generation.router_stats import MoEGenerationMixin
from ..utils.transformers_private import attention_implementation
from .blocks import MoETransformerLayer, attend, capture_moe_outputs, eager_attention_forward
from .blocks import head_output, model_forward, output_recorders, run_layers
from .common import MoEPreTrainedModel
from .configuration_gpt_moe import GPTMoEConfig
from .inputs import check_ids, check_tokens, routing_token_mask
from .loss import lm_targets, model_loss, router_losses_wanted
from .norms import RMSNorm, build_norm


@dataclass
class GPTMoEModelOutput(MoeModelOutputWithPast):
    """`router_logits` / `router_expert_ids`: one `[T, E]` / `[T, K]` tensor per MoE layer (with
    output_router_logits); `aux_loss` / `z_loss`: router losses averaged over the MoE layers."""

    router_expert_ids: tuple[torch.Tensor, ...] | None = None
    aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None


@dataclass
class GPTMoECausalLMOutput(MoeCausalLMOutputWithPast):
    """`loss` (when labels are given): the LM loss `lm_loss` plus the router term of `aux_loss` and `z_loss`
    (`hf_ppmoe.modeling.loss.model_loss`); `num_target_tokens`: the labels the LM loss predicts (not -100)."""

    router_expert_ids: tuple[torch.Tensor, ...] | None = None
    z_loss: torch.Tensor | None = None
    lm_loss: torch.Tensor | None = None
    num_target_tokens: torch.Tensor | None = None


class GPTMoERotaryEmbedding(nn.Module):
    """Rotary position embedding (Llama): cos/sin [B, L, head_dim] for the positions, any Transformers rope type."""
    def __init__(self, config: GPTMoEConfig):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters["rope_type"]
        init_fn = self.compute_default_rope_parameters
        if self.rope_type != "default":
            init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config, **kwargs) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x):
    """[x1, x2] -> [-x2, x1] over the last dimension (its two halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """q, k [B, N, L, D] rotated by the angles of cos, sin [B, L, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class GPTMoEAttention(nn.Module):
    """Causal self-attention with grouped-query heads, optional per-head q/k norms (Qwen3), rotary positions and a
    key/value cache; the kernel is the config's attention implementation."""
    def __init__(self, config: GPTMoEConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        H, qkv_bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(H, config.num_attention_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(H, config.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(H, config.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, H, bias=config.attention_output_bias)
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # Qwen3: RMSNorm over each query / key head, before the rotary embedding
            self.q_norm = RMSNorm(self.head_dim, config.layer_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.layer_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape)
        k = self.k_proj(hidden_states).view(shape)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if position_embeddings is not None:
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        if cache is not None:
            # the cache API's own signature: a paged cache (continuous batching) fills `kwargs` in place with what its
            # attention kernel reads (cumulative lengths, block table), so the same dict goes on to the attention
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(attention_implementation(self.config), eager_attention_forward)
        return attend(self, attention, q, k, v, attention_mask, sliding_window=self.config.sliding_window, **kwargs)


class GPTMoEDecoderLayer(MoETransformerLayer):
    """Pre-norm causal self-attention, then the FFN: an `MoELayer` on every `moe_layer_frequency`-th layer."""
    def __init__(self, config: GPTMoEConfig, layer_idx: int):
        super().__init__(config, GPTMoEAttention(config, layer_idx), config.is_moe_layer(layer_idx))


class GPTMoEPreTrainedModel(MoEPreTrainedModel):
    """Base of the GPT-MoE classes: config class, and what `capture_moe_outputs` records."""
    config: GPTMoEConfig
    config_class = GPTMoEConfig
    _no_split_modules = ["GPTMoEDecoderLayer"]
    _can_record_outputs = output_recorders(GPTMoEDecoderLayer, GPTMoEAttention)


class GPTMoEModel(GPTMoEPreTrainedModel):
    """Embeddings (learned or rotary positions), the decoder layers and the final norm: last_hidden_state [B, L, H]."""
    _auto_classes = {"AutoModel": "GPTMoEModel"}

    def __init__(self, config: GPTMoEConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        if config.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        else:
            self.rotary_emb = GPTMoERotaryEmbedding(config)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(GPTMoEDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = build_norm(config.norm_type, config.hidden_size, config.layer_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    @model_forward
    @capture_moe_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        compute_router_losses: bool | None = None,
        router_expert_ids: tuple[torch.Tensor, ...] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> GPTMoEModelOutput:
        """Also takes output_attentions, output_hidden_states and output_router_logits (`capture_moe_outputs`).
        `compute_router_losses` (default: when gradients are enabled or router logits are requested) fills
        `aux_loss` / `z_loss`; inference without gradients skips them, as they only cost time while decoding.
        `router_expert_ids`: router replay (R3), one [batch * length, k] tensor per MoE layer (the shape
        `output_router_logits` returns): every MoE layer routes by its ids; the gates still compute those routes'
        weights, which get gradients, and capacity and padding apply as usual."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        config = self.config
        use_cache = use_cache if use_cache is not None else (config.use_cache and not self.training)

        if inputs_embeds is None:
            check_tokens(input_ids.shape, "input_ids")
            check_ids(input_ids, config.vocab_size, "Token ids", "Use the model's tokenizer (or resize the embeddings).")
            inputs_embeds = self.embed_tokens(input_ids)
        else:
            check_tokens(inputs_embeds.shape, "inputs_embeds")
        if use_cache and cache is None:
            cache = DynamicCache(config=config)
        seq_len = inputs_embeds.shape[1]
        learned = config.position_embedding_type == "learned"
        too_long = f"Learned positions end at max_position_embeddings={config.max_position_embeddings}: shorten the input (and max_new_tokens)."
        # positions and masks are sized by the cache of the first layer this model runs: under Transformers' pipeline
        # parallelism the layers a stage does not hold are stand-ins that keep no cache
        cache_layer = next((layer.self_attn.layer_idx for layer in self.layers if hasattr(layer, "self_attn")), 0)
        # only positions the caller gave reach the mask builder: there they mean packed sequences, which it detects by
        # reading the device (eager) or by building a [B, 1, L, L] mask (compiled) instead of the causal kernel
        given_position_ids = position_ids
        if position_ids is None:
            past_seen = cache.get_seq_length(cache_layer) if cache is not None else 0
            if learned and isinstance(past_seen, int) and past_seen + seq_len > config.max_position_embeddings:
                raise ValueError(f"This input reaches position {past_seen + seq_len - 1}. {too_long}")
            position_ids = torch.arange(past_seen, past_seen + seq_len, device=inputs_embeds.device).unsqueeze(0)
        elif learned:
            check_ids(position_ids, config.max_position_embeddings, "Position ids", too_long)

        hidden_states = inputs_embeds
        position_embeddings = None
        if learned:
            hidden_states = hidden_states + self.embed_positions(position_ids)
        else:
            position_embeddings = self.rotary_emb(hidden_states, position_ids)
        hidden_states = self.dropout(hidden_states)

        make_mask = create_causal_mask if config.sliding_window is None else create_sliding_window_causal_mask
        causal_mask = make_mask(
            config=config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=given_position_ids,
            layer_idx=cache_layer,
        )
        # padding tokens are kept out of routing statistics and router losses (a 4D mask carries no such notion)
        token_mask = routing_token_mask(
            attention_mask[:, -seq_len:] if attention_mask is not None else None, compute_router_losses
        )

        hidden_states, aux_loss, z_loss = run_layers(
            self.layers,
            hidden_states,
            attention_mask=causal_mask,
            position_embeddings=position_embeddings,
            cache=cache,
            token_mask=token_mask,
            compute_router_losses=compute_router_losses,
            router_expert_ids=router_expert_ids,
            position_ids=given_position_ids,
            **kwargs,
        )
        return GPTMoEModelOutput(
            last_hidden_state=self.norm(hidden_states),
            cache=cache if use_cache else None,
            aux_loss=aux_loss,
            z_loss=z_loss,
        )


class GPTMoEForCausalLM(GPTMoEPreTrainedModel, MoEGenerationMixin):
    """`GPTMoEModel` with an LM head (tied to the embeddings if `tie_word_embeddings`); generates with every
    Transformers decoding mode, also `output_router_logits=True` (hf_ppmoe.generation.router_stats)."""
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gathered"}  # hf_ppmoe.parallel: gathered logits, not a view
    _auto_classes = {"AutoModel": "GPTMoEModel", "AutoModelForCausalLM": "GPTMoEForCausalLM"}

    def __init__(self, config: GPTMoEConfig):
        super().__init__(config)
        self.model = GPTMoEModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @model_forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        compute_router_losses: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> GPTMoECausalLMOutput:
        """labels [B, L] give the loss (token t + 1 predicted at position t; -100: ignored); a batch without a target
        (all -100, or one-token sequences) has loss 0 (`model_loss`). Output flags as `GPTMoEModel` takes them;
        `compute_router_losses` defaults to True with labels (False: the LM loss alone, no routing statistics)."""
        out = self.model(
            return_dict=True,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            compute_router_losses=router_losses_wanted(compute_router_losses, labels),
            **kwargs,
        )
        hidden = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])

        losses = {}
        if labels is not None:
            targets = lm_targets(labels, causal=True, shift_labels=kwargs.get("shift_labels"))
            lm_loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
            losses = model_loss(lm_loss, targets, kwargs.get("num_items_in_batch"), self.config, out.aux_loss, out.z_loss)._asdict()
        return head_output(GPTMoECausalLMOutput, out, logits=logits, **losses)


__all__ = ["GPTMoEForCausalLM", "GPTMoEModel", "GPTMoEPreTrainedModel"]
