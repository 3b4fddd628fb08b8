"""What a plan needs to know about a model, read from its config: every parameter with its shape and the tensor-
parallel plan style that splits it (from the model itself, built on the `meta` device: no memory, no weights), and
the sizes the activation and FLOP counts use.

Legend: T tokens of a micro-batch, H hidden, I FFN inner size, E experts, K routes per token, V vocabulary, N / N_kv
query / key-value heads of D dimensions, L layers.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
from transformers.activations import ACT2FN

from ..modeling import GPTMoEConfig, GPTMoEForCausalLM

_LAYER = re.compile(r"\.(\d+)(?=\.|$)")
# how each tensor-parallel plan style splits a parameter: {parameter leaf name: dim}; a style not listed keeps its
# parameters whole (norms, routers, the "replicated_*" and "ppmoe_*" module styles)
_SPLITS = {
    "colwise": {"weight": 0, "bias": 0},
    "rowwise": {"weight": 1},
    "colwise_gathered": {"weight": 0, "bias": 0},  # the LM head (hf_ppmoe.parallel.tensor_parallel)
    "embedding_rowwise": {"weight": 0},
    "grouped_gemm": {"": 0},  # the experts' stacked [E, ...] weights and biases: whole experts over the group
}


@dataclass(frozen=True)
class Param:
    """One parameter: `split` is the dim tensor parallelism (or, for experts, expert parallelism) splits, or None."""

    name: str
    shape: tuple[int, ...]
    split: int | None
    style: str | None
    layer: int | None  # decoder layer, None for the embeddings, the final norm and the head
    expert: bool  # a routed expert's stacked weight or bias

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def part(self) -> str:
        """Where a pipeline puts it: "layer", "input" (first stage) or "output" (last stage)."""
        if self.layer is not None:
            return "layer"
        return "input" if self.name.startswith(("model.embed_tokens", "model.embed_positions")) else "output"


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-MoE config's sizes and parameters, as the planner counts them."""

    config: GPTMoEConfig
    params: tuple[Param, ...]
    tied: bool  # the head shares the input embedding's weight

    @property
    def layers(self) -> int:
        return self.config.num_hidden_layers

    def is_moe(self, layer: int) -> bool:
        return self.config.is_moe_layer(layer)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.layers) if self.is_moe(i)]

    @property
    def expert_inner(self) -> int:
        c = self.config
        return c.moe_intermediate_size or c.intermediate_size

    def total_params(self) -> int:
        return sum(p.numel for p in self.params)

    def active_params(self) -> int:
        """Parameters one token's forward uses (k of E experts in each MoE layer), embeddings included."""
        c, inactive = self.config, 0
        for p in self.params:
            if p.expert:
                inactive += p.numel * (c.num_experts - c.num_experts_per_tok) // c.num_experts
        return self.total_params() - inactive


def _style(plan: dict[str, str], name: str) -> tuple[str | None, int | None]:
    """The plan style of parameter `name` and the dim it splits."""
    generic = _LAYER.sub(".*", name)
    module, _, leaf = generic.rpartition(".")
    for key, tail in ((generic, ""), (module, leaf)):
        style = plan.get(key)
        if style in _SPLITS:
            return style, _SPLITS[style].get(tail)
    return None, None


def model_spec(config: GPTMoEConfig) -> ModelSpec:
    """The parameters of `config`'s `GPTMoEForCausalLM`, built on the meta device."""
    if not isinstance(config, GPTMoEConfig):
        raise ValueError(f"hf_ppmoe.plan plans GPT-MoE (decoder) models; got a {type(config).__name__}. Convert or "
                         "upcycle the model to GPT-MoE first (hf-ppmoe upcycle, hf-ppmoe import).")
    with torch.device("meta"):
        model = GPTMoEForCausalLM(config)
    plan = dict(model.tp_plan or {})
    params = []
    for name, p in model.named_parameters():
        style, split = _style(plan, name)
        layer = _LAYER.search(name)
        params.append(Param(name, tuple(p.shape), split, style, int(layer.group(1)) if layer else None,
                            ".experts." in name))
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return ModelSpec(config, tuple(params), tied)


@functools.cache
def activation_profile(name: str) -> tuple[int, bool, bool]:
    """(tensors of its input's size the activation function saves for backward, whether its input is one of them,
    whether its output is), counted on the meta device: silu (1, True, False), relu (1, False, True), GPT-2's
    gelu_new (4, True, False)."""
    x = torch.empty(2, 4, device="meta", requires_grad=True)
    saved = {}

    def pack(t):
        saved[id(t)] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = ACT2FN[name](x)
    return len(saved), id(x) in saved, id(y) in saved


__all__ = ["ModelSpec", "Param", "activation_profile", "model_spec"]
