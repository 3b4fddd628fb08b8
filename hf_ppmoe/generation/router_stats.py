"""Router statistics through `generate`: `output_router_logits=True, return_dict_in_generate=True` adds, per
generation step, the router logits and the chosen experts of every MoE layer to generate's output.

    out = model.generate(ids, max_new_tokens=8, output_router_logits=True, return_dict_in_generate=True)
    out.router_logits[step][layer]       # [tokens of that step's forward, E], before the softmax
    out.router_expert_ids[step][layer]   # [tokens of that step's forward, k]; `num_experts` = route dropped

A step is one forward of the model, so it works for every decoding method (greedy, sampling, beam search, flat
beam search, custom ones). Step 0 is the prefill: every prompt token, padding included, rows in the order of the
flattened `[rows, prompt length]` input (Transformers' beam search runs each prompt `num_beams` times, flat beam
search once). Later steps hold one token per row that the model ran: `batch` rows for greedy and sampling,
`batch * num_beams` in the order of the running beams for (flat) beam search; map them to the returned
hypotheses with `beam_indices`.

Encoder-decoders record their decoder per step as above, and their encoder once (generate runs it once, on the
unexpanded prompts) in two more fields:

    out.encoder_router_logits[layer]       # [batch * source length, E], padding included
    out.encoder_router_expert_ids[layer]   # [batch * source length, k]; None if `encoder_outputs` were passed in

The routing is the `Routing` each MoE layer returns, observed outside the forward by `hf_ppmoe.moe.observe.RoutingHooks`
(forward hooks on the MoE layers): `output_router_logits` never reaches the model's forward (which would compute
router losses for every step).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
from transformers.generation import (
    GenerateBeamDecoderOnlyOutput,
    GenerateBeamEncoderDecoderOutput,
    GenerateDecoderOnlyOutput,
    GenerateEncoderDecoderOutput,
    GenerationMixin,
)

from ..moe.observe import RoutingHooks
from ..moe.routing import Routing

RouterSteps = tuple[tuple[torch.Tensor, ...], ...]


@dataclass
class MoEGenerateDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`router_logits[step][layer]` [tokens, E] and `router_expert_ids[step][layer]` [tokens, k]."""

    router_logits: RouterSteps | None = None
    router_expert_ids: RouterSteps | None = None


@dataclass
class MoEGenerateBeamDecoderOnlyOutput(GenerateBeamDecoderOnlyOutput):
    router_logits: RouterSteps | None = None
    router_expert_ids: RouterSteps | None = None


@dataclass
class MoEGenerateEncoderDecoderOutput(GenerateEncoderDecoderOutput):
    """The decoder's routing per step, as above, and the encoder's (`[layer]`, one run) in `encoder_router_*`."""

    router_logits: RouterSteps | None = None
    router_expert_ids: RouterSteps | None = None
    encoder_router_logits: tuple[torch.Tensor, ...] | None = None
    encoder_router_expert_ids: tuple[torch.Tensor, ...] | None = None


@dataclass
class MoEGenerateBeamEncoderDecoderOutput(GenerateBeamEncoderDecoderOutput):
    router_logits: RouterSteps | None = None
    router_expert_ids: RouterSteps | None = None
    encoder_router_logits: tuple[torch.Tensor, ...] | None = None
    encoder_router_expert_ids: tuple[torch.Tensor, ...] | None = None


_WITH_ROUTING = {
    GenerateDecoderOnlyOutput: MoEGenerateDecoderOnlyOutput,
    GenerateBeamDecoderOnlyOutput: MoEGenerateBeamDecoderOnlyOutput,
    GenerateEncoderDecoderOutput: MoEGenerateEncoderDecoderOutput,
    GenerateBeamEncoderDecoderOutput: MoEGenerateBeamEncoderDecoderOutput,
}


class RoutingRecorder:
    """Context manager: while active, every forward of `model` is a step and every MoE layer under `stack` (the
    model by default; a decoder for encoder-decoders) appends its router logits and expert ids to that step. The
    layers' `Routing` comes through `hf_ppmoe.moe.observe.RoutingHooks`; the one hook of its own, a pre-hook on
    `model`, only opens a step."""

    def __init__(self, model: torch.nn.Module, stack: torch.nn.Module | None = None):
        self.model = model
        self.stack = stack or model
        self.logits: list[list[torch.Tensor]] = []
        self.expert_ids: list[list[torch.Tensor]] = []
        self.step_hook = self.routing_hooks = None

    def _new_step(self, module, args):
        self.logits.append([])
        self.expert_ids.append([])

    def _record(self, name: str, routing: Routing):
        if self.logits:  # calls outside a forward of the model (an encoder run by generate) are not steps
            self.logits[-1].append(routing.router_logits.detach())
            self.expert_ids[-1].append(routing.expert_ids.detach())

    def __enter__(self):
        self.step_hook = self.model.register_forward_pre_hook(self._new_step)
        self.routing_hooks = RoutingHooks(self.stack, self._record)
        return self

    def __exit__(self, *exc):
        self.step_hook.remove()
        self.routing_hooks.remove()
        self.step_hook = self.routing_hooks = None

    def steps(self) -> tuple[RouterSteps, RouterSteps]:
        return tuple(map(tuple, self.logits)), tuple(map(tuple, self.expert_ids))


class MoEGenerationMixin(GenerationMixin):
    """`GenerationMixin` whose `generate` also takes `output_router_logits=True` (see the module docstring)."""

    def generate(self, *args, output_router_logits: bool = False, **kwargs):
        self._warn_beams_beyond_vocabulary(kwargs)
        if not output_router_logits:
            return super().generate(*args, **kwargs)
        config = kwargs.get("generation_config") or self.generation_config
        if not kwargs.get("return_dict_in_generate", config.return_dict_in_generate):
            raise ValueError("generate(output_router_logits=True) also needs return_dict_in_generate=True: the "
                             "router statistics are fields of the returned output.")
        # encoder-decoders: every forward of the encoder is a step of its own recorder (generate runs it once)
        encoder = RoutingRecorder(self.get_encoder()) if self.config.is_encoder_decoder else None
        with RoutingRecorder(self, self._routing_stack()) as recorder, encoder or contextlib.nullcontext():
            out = super().generate(*args, **kwargs)
        fields = dict(zip(("router_logits", "router_expert_ids"), recorder.steps()))
        if encoder is not None:
            runs = encoder.steps()
            fields.update(encoder_router_logits=runs[0][-1] if runs[0] else None,
                          encoder_router_expert_ids=runs[1][-1] if runs[1] else None)
        cls = _WITH_ROUTING.get(type(out))
        if cls is None:  # a custom generate's own output class
            for name, value in fields.items():
                out[name] = value
            return out
        return cls(**out, **fields)

    def _warn_beams_beyond_vocabulary(self, kwargs: dict) -> None:
        """More beams than tokens cannot all differ after the first step: warn once (Transformers' own beam search,
        and flat beam search, run it anyway, as Transformers does for its models)."""
        beams = kwargs.get("num_beams") or (kwargs.get("generation_config") or self.generation_config).num_beams or 1
        vocab = getattr(self.config.get_text_config(), "vocab_size", None)
        if vocab and beams > vocab:
            warnings.warn(f"num_beams={beams} is more than the vocabulary ({vocab} tokens): the first step has only "
                          f"{vocab} different continuations, so {beams - vocab} beams start as copies that add work "
                          f"and no hypotheses; use num_beams <= {vocab}.", stacklevel=3)

    def _routing_stack(self) -> torch.nn.Module:
        """The modules whose MoE layers are recorded per step (encoder-decoders: their decoder; the encoder is
        recorded apart, once)."""
        return self.get_decoder() if self.config.is_encoder_decoder else self
