"""GShard flat beam search (GShard appendix A.5) as a Transformers `custom_generate` callable.

    model.generate(input_ids, num_beams=4, custom_generate=flat_beam_search, ...)

Ordinary beam search keeps one KV-cache row per hypothesis and, after every step, gathers the cache rows of the
chosen parents (`cache.reorder_cache`). Flat beam search keeps ONE token buffer per batch row, shared by its K
hypotheses:

    buffer slot:   0 .. P-1 (prompt) | step 0: K slots | step 1: K slots | ...
    hypothesis k:  a 0/1 mask over the buffer = prompt (without padding) + one slot per step (its ancestors)

Every step appends the K running hypotheses' last tokens to the buffer (the cache only grows, by K slots per row)
and each new token attends through its hypothesis's mask. After selection only the [B, K, slots] masks are
gathered; the cache is never reordered, and the prompt is computed once per row instead of K times.

Selection follows Transformers' `_beam_search` rule for rule (2K candidates, EOS candidates ranked below K
discarded, `length_penalty`, `early_stopping` True/False/"never", `num_return_sequences`, logits processors on
log-probabilities), so results equal `generate(num_beams=K)`: the same sequences, scores up to float rounding.

Applies to models that take a 4D float attention mask and explicit positions: decoder-only models with
`position_ids` (Llama, Mistral, Mixtral, Qwen2, GPT-MoE, ...), encoder-decoders with `decoder_position_ids`, and
decoders with a relative position bias that is corrected inside the mask (T5, and Seq2SeqMoE or any decoder with a
`relative_position_bias(key position - query position)` method: the model computes the bias from buffer slots, the
mask adds the difference to the bias of the true positions). Anything else raises a ValueError.

This file imports only torch and transformers: `save_pretrained` of hf_ppmoe models copies it unchanged as
`custom_generate/generate.py`, whose `generate` entry point is defined at the bottom.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.generation import (
    GenerateBeamDecoderOnlyOutput,
    GenerateBeamEncoderDecoderOutput,
    GenerationMixin,
)
from transformers.generation.configuration_utils import GenerationMode

NEG = -1.0e9  # Transformers' "impossible" beam score


def _gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t [B, N, ...], idx [B, M] -> [B, M, ...]"""
    return torch.take_along_dim(t, idx.view(*idx.shape, *(1,) * (t.dim() - idx.dim())), dim=1)


def _fail(message: str):
    raise ValueError(f"flat_beam_search: {message}")


class _RelativeBias:
    """Decoders whose self-attention adds a relative position bias computed from buffer slots (query slot past + i,
    key slot j): T5, and models whose decoder has a `relative_position_bias(key position - query position)` method
    returning [..., H, Q, KV] (Seq2SeqMoE). The mask adds `bias(true positions) - bias(buffer slots)` to every allowed
    entry, so the sum is the true bias."""

    def __init__(self, bias):
        self._bias = bias  # relative position [..., Q, KV] -> [..., H, Q, KV]

    @classmethod
    def find(cls, model):
        decoder = model.get_decoder()
        method = getattr(decoder, "relative_position_bias", None)
        if inspect.ismethod(method):  # a method, not a module of that name
            return cls(method)
        blocks = getattr(decoder, "block", None)
        attention = getattr(blocks[0].layer[0], "SelfAttention", None) if blocks else None
        if attention is not None and getattr(attention, "has_relative_attention_bias", False):
            return cls(lambda relative_position: _t5_bias(attention, relative_position))
        return None

    def correction(self, query_pos, key_pos, query_slot, key_slot) -> torch.Tensor:
        """positions and slots [B, Q] / [B, KV] -> [B, H, Q, KV]"""
        true = self._bias(key_pos[:, None, :] - query_pos[:, :, None])
        buffer = self._bias(key_slot[:, None, :] - query_slot[:, :, None])
        return true - buffer


def _t5_bias(attention, relative_position: torch.Tensor) -> torch.Tensor:
    """T5's decoder bias (its first self-attention's table): [..., Q, KV] -> [..., H, Q, KV]"""
    buckets = attention._relative_position_bucket(
        relative_position, bidirectional=False, num_buckets=attention.relative_attention_num_buckets,
        max_distance=attention.relative_attention_max_distance,
    )
    return attention.relative_attention_bias(buckets).movedim(-1, -3)


def _learned_positions(config) -> int | None:
    """How many positions a model with a learned (absolute) position table has; None for relative or rotary ones,
    which have no hard end."""
    if getattr(config, "position_embedding_type", None) in ("learned", "absolute") or config.model_type == "gpt2":
        return getattr(config, "max_position_embeddings", None)
    return None


class _FlatModel:
    """Runs the model on the flat layout: a prefill of the B prompts, then K new tokens per row and step."""

    MODEL_INPUTS = {"attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep",
                    "encoder_outputs", "output_router_logits", "return_dict"}

    def __init__(self, model, input_ids, K, max_length, model_kwargs):
        self.model, self.K = model, K
        self.enc_dec = bool(model.config.is_encoder_decoder)
        BK, P = input_ids.shape
        self.B, self.P = BK // K, P
        if P == 0:
            _fail("needs a prompt of at least one token per row (for a decoder-only model, e.g. its BOS token).")
        params = inspect.signature(model.forward).parameters
        if model_kwargs.get("inputs_embeds") is not None:
            _fail("inputs_embeds is not supported; pass input_ids.")
        if model_kwargs.get("use_cache") is False:
            _fail("needs the KV cache (use_cache=False was given).")
        if model.config._attn_implementation not in ("eager", "sdpa"):
            _fail(f"needs an attention implementation that takes a 4D float mask (eager or sdpa), not "
                  f"{model.config._attn_implementation!r}.")
        # other model inputs are passed on as they are; per-token tensors have no layout on the flat buffer
        self.extra = {k: v for k, v in model_kwargs.items() if k not in self.MODEL_INPUTS and v is not None}
        tensors = sorted(k for k, v in self.extra.items() if isinstance(v, torch.Tensor))
        if tensors:
            _fail(f"does not know how to lay out the model inputs {tensors} over the flat buffer.")

        cache = model_kwargs.get("cache")
        self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        if not isinstance(self_cache, DynamicCache) or cache.get_seq_length() != 0:
            _fail("needs an empty DynamicCache (the default); a static or pre-filled cache has the wrong layout.")
        self.cache = cache
        slots = P + K * (max_length - P)
        for layer in self_cache.layers:
            window = getattr(layer, "sliding_window", None)
            if window is not None and window < slots:
                _fail(f"a sliding window of {window} tokens would cut the flat buffer of {slots} slots "
                      "(prompt + num_beams slots per step).")

        self.mask_dtype = model.dtype
        self.bias = None
        device = input_ids.device
        if self.enc_dec:
            self.position_key = "decoder_position_ids" if "decoder_position_ids" in params else None
            if self.position_key is None:
                self.bias = _RelativeBias.find(model)
                if self.bias is None:
                    _fail(f"{type(model).__name__} takes no decoder_position_ids and has no relative position bias "
                          "this module can correct (T5's, or a decoder `relative_position_bias` method), so its "
                          "decoder cannot be told the positions of flat buffer slots.")
            encoder_outputs = model_kwargs["encoder_outputs"]
            self.encoder_outputs = type(encoder_outputs)(
                **{k: v[::K] if isinstance(v, torch.Tensor) else v for k, v in encoder_outputs.items()}
            )
            mask = model_kwargs.get("attention_mask")
            self.encoder_mask = mask[::K] if mask is not None else None
            self.prompt_mask = torch.ones(self.B, P, dtype=torch.bool, device=device)
            self.prompt_pos = torch.arange(P, device=device).expand(self.B, P)
        else:
            if "position_ids" not in params:
                _fail(f"{type(model).__name__}.forward takes no position_ids, so it cannot be told the positions "
                      "of flat buffer slots.")
            self.position_key = "position_ids"
            mask = model_kwargs.get("attention_mask")
            self.prompt_mask = mask[::K].bool() if mask is not None else torch.ones(self.B, P, dtype=torch.bool,
                                                                                      device=device)
            pos = model_kwargs.get("position_ids")
            self.prompt_pos = pos[::K] if pos is not None else (self.prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
            self.logits_to_keep = "logits_to_keep" in params
        # in-hypothesis position of every buffer slot (for the relative position bias correction)
        self.slot_pos = self.prompt_pos.clone()
        limit = _learned_positions(model.config)
        highest = int(self.prompt_pos[:, -1].max()) + max_length - P  # of the last token of the longest hypothesis
        if limit is not None and highest >= limit:
            _fail(f"the hypotheses would reach position {highest}, but the model's learned positions end at "
                  f"max_position_embeddings={limit}: lower max_new_tokens (or max_length), or shorten the prompt.")

    def _call(self, ids, **kwargs):
        kwargs.update(cache=self.cache, use_cache=True, return_dict=True, **self.extra)
        if self.enc_dec:
            return self.model(decoder_input_ids=ids, encoder_outputs=self.encoder_outputs,
                              attention_mask=self.encoder_mask, **kwargs)
        return self.model(input_ids=ids, **kwargs)

    def prefill(self, input_ids) -> torch.Tensor:
        """The B prompts, once each -> next-token logits [B, V]."""
        ids = input_ids[:: self.K]
        if self.enc_dec:
            kwargs = {self.position_key: self.prompt_pos} if self.position_key else {}
            out = self._call(ids, **kwargs)
        else:
            mask = None if bool(self.prompt_mask.all()) else self.prompt_mask.long()
            kwargs = {"logits_to_keep": 1} if self.logits_to_keep else {}
            out = self._call(ids, attention_mask=mask, position_ids=self.prompt_pos, **kwargs)
        return out.logits[:, -1, :].float()

    def step(self, tokens, hyp_mask, position) -> torch.Tensor:
        """tokens [B, K] appended at the buffer's end, hyp_mask [B, K, slots] (True = visible, the new slots
        included), position [B] (their in-hypothesis position) -> logits [B * K, V]."""
        B, K = tokens.shape
        positions = position[:, None].expand(B, K)
        allowed = hyp_mask[:, None]  # [B, 1, K, slots]
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=tokens.device)
        if self.bias is not None:
            self.slot_pos = torch.cat([self.slot_pos, positions], 1)
            slots = hyp_mask.shape[-1]
            slot_ids = torch.arange(slots, device=tokens.device).expand(B, slots)
            mask = self.bias.correction(positions, self.slot_pos, slot_ids[:, slots - K:], slot_ids).float()
        mask = mask.masked_fill(~allowed, torch.finfo(self.mask_dtype).min).to(self.mask_dtype)
        if self.enc_dec:
            kwargs = {self.position_key: positions} if self.position_key else {}
            out = self._call(tokens, decoder_attention_mask=mask, **kwargs)
        else:
            out = self._call(tokens, attention_mask=mask, position_ids=positions)
        return out.logits.reshape(B * K, -1).float()


def flat_beam_search(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
    """Beam search over one flat buffer per batch row; a `custom_generate` callable (see the module docstring).
    Returns what `generate(num_beams=K)` returns: the sequences, or with `return_dict_in_generate=True` a
    `GenerateBeam*Output` with `sequences_scores` / `scores` (output_scores), `logits` (output_logits),
    `beam_indices` and the cache (in the flat layout: batch B, prompt then K slots per step)."""
    gc = generation_config
    mode = gc.get_generation_mode()
    if mode != GenerationMode.BEAM_SEARCH:
        _fail(f"implements beam search (num_beams > 1, do_sample=False, no beam groups or constraints); this "
              f"call asks for {mode.value}.")
    if gc.output_attentions or gc.output_hidden_states:
        _fail("output_attentions / output_hidden_states are not supported (they would be in the flat layout).")
    K, nrs, lp, es = gc.num_beams, gc.num_return_sequences, gc.length_penalty, gc.early_stopping
    max_length, eos, pad = gc.max_length, gc._eos_token_tensor, gc._pad_token_tensor
    flat = _FlatModel(model, input_ids, K, max_length, model_kwargs)
    B, P, device = flat.B, flat.P, input_ids.device
    C = max(2, 1 + (eos.shape[0] if eos is not None else 0)) * K  # candidates kept per row and step
    fill = pad or eos[0] if eos is not None else -1  # Transformers' fill value, precedence quirk included
    keep_scores, keep_logits = gc.return_dict_in_generate and gc.output_scores, gc.return_dict_in_generate and gc.output_logits

    running_seq = torch.full((B, K, max_length), int(fill), dtype=torch.long, device=device)
    running_seq[:, :, :P] = input_ids.view(B, K, P)
    fin_seq = running_seq.clone()
    running_score = torch.zeros(B, K, device=device)
    running_score[:, 1:] = NEG  # only beam 0 expands at the first step
    fin_score = torch.full((B, K), NEG, device=device)
    fin_flag = torch.zeros(B, K, dtype=torch.bool, device=device)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=device)
    running_bidx = torch.full((B, K, max_length - P), -1, dtype=torch.int32, device=device)
    fin_bidx = running_bidx.clone()
    top_k_rank = torch.arange(C, device=device) < K
    row_offset = torch.arange(B, device=device)[:, None] * K
    # hypothesis masks over the buffer: the prompt without its padding, then one slot per step
    hyp_mask = flat.prompt_mask[:, None, :].expand(B, K, P)
    own_slot = torch.eye(K, dtype=torch.bool, device=device).expand(B, K, K)
    next_pos = flat.prompt_pos[:, -1] + 1
    all_scores, all_logits = [], []

    logits = flat.prefill(input_ids).repeat_interleave(K, 0)  # [B*K, V]: beam k of row b at b*K+k
    cur_len = P
    while True:
        logp = F.log_softmax(logits, dim=-1)
        logp = logits_processor(running_seq.view(B * K, -1)[:, :cur_len], logp)
        if keep_logits:
            all_logits.append(logits)
        if keep_scores:
            all_scores.append(logp)
        V = logp.shape[-1]
        top_lp, top_idx = torch.topk((logp.view(B, K, V) + running_score[:, :, None]).view(B, K * V), C)
        src = top_idx // V
        cand_seq = _gather(running_seq, src)
        cand_seq[:, :, cur_len] = top_idx % V
        cand_bidx = _gather(running_bidx, src)
        cand_bidx[:, :, cur_len - P] = (src + row_offset).int()
        done = stopping_criteria(cand_seq[:, :, : cur_len + 1].reshape(B * C, -1), tuple(all_scores) or None)
        done = done.view(B, C)

        # the next running beams: the best K candidates that did not stop
        alive = top_lp + done.float() * NEG
        nxt = torch.topk(alive, K).indices
        running_seq, running_score, running_bidx = _gather(cand_seq, nxt), _gather(alive, nxt), _gather(cand_bidx, nxt)
        # finished hypotheses: stopped candidates ranked below K, length-normalised, merged into the K best
        just_done = done & top_k_rank
        score = top_lp / (cur_len + 1 - P) ** lp
        score = score + (fin_flag.all(-1, keepdim=True) & (es is True)).float() * NEG
        score = score + (~improvable).float() * NEG + (~just_done).float() * NEG
        merged = torch.topk(torch.cat([fin_score, score], 1), K).indices
        fin_seq = _gather(torch.cat([fin_seq, cand_seq], 1), merged)
        fin_score = _gather(torch.cat([fin_score, score], 1), merged)
        fin_bidx = _gather(torch.cat([fin_bidx, cand_bidx], 1), merged)
        fin_flag = _gather(torch.cat([fin_flag, just_done], 1), merged)

        cur_len += 1
        best_len = (max_length - P) if (es == "never" and lp > 0.0) else (cur_len - P)
        best_running = running_score[:, :1] / best_len**lp
        worst_finished = torch.where(fin_flag, fin_score.min(1, keepdim=True)[0], NEG)
        improvable = improvable & (best_running > worst_finished).any(-1, keepdim=True)
        if not bool(improvable.any() & ~(fin_flag.all() & (es is True)) & ~done.all()):
            break
        # instead of reordering the cache: each new hypothesis takes its parent's mask plus its own new slot
        parent = running_bidx[:, :, cur_len - 1 - P].long() - row_offset
        hyp_mask = torch.cat([_gather(hyp_mask, parent), own_slot], -1)
        logits = flat.step(running_seq[:, :, cur_len - 1], hyp_mask, next_pos + (cur_len - 1 - P))

    sequences = fin_seq[:, :nrs].reshape(B * nrs, -1)
    beam_indices = fin_bidx[:, :nrs].reshape(B * nrs, -1)
    generated = (beam_indices + 1).bool().sum(1).max()
    sequences, beam_indices = sequences[:, : P + generated], beam_indices[:, :generated]
    if not gc.return_dict_in_generate:
        return sequences
    Output = GenerateBeamEncoderDecoderOutput if flat.enc_dec else GenerateBeamDecoderOnlyOutput
    return Output(
        sequences=sequences,
        sequences_scores=fin_score[:, :nrs].reshape(-1) if gc.output_scores else None,
        scores=tuple(all_scores) if keep_scores else None,
        logits=tuple(all_logits) if keep_logits else None,
        beam_indices=beam_indices,
        cache=flat.cache,
    )


def generate(*args, model, **kwargs):
    """Entry point of a checkpoint's `custom_generate/generate.py`: `model.generate(..., custom_generate=<folder
    or repo>, trust_remote_code=True)`, or `from_pretrained(..., trust_remote_code=True)`, which makes it the
    model's `generate`. Beam search runs flat; every other generation mode runs as usual."""
    config, _ = model._prepare_generation_config(kwargs.get("generation_config"),
                                                  **{k: v for k, v in kwargs.items() if k != "generation_config"})
    if config.get_generation_mode(kwargs.get("assistant_model")) == GenerationMode.BEAM_SEARCH:
        kwargs["custom_generate"] = flat_beam_search
    return type(model).generate(model, *args, **kwargs)  # the class's generate: `model.generate` may be this one
