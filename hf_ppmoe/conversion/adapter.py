"""What one foreign architecture is to ours: its config fields and its weight names, both ways, in one record.

An `Architecture` holds what the converters know of one Transformers architecture (as torchtitan's state dict
adapters and Transformers' `conversion_mapping.py` do): `fields` reads its config into ours (upcycling, import),
`config` writes ours into its (export, and the dense twin an imported model merges back into), `rules` is the table
of its weight names to ours, which merging and export run backwards (`Mapping.inverse`), and `reasons` says what of
our config it cannot compute. Values that only change name live in a `FieldMap`, read in either direction. Each
family declares its records in its own module (gpt2.py, llama.py, mixtral.py, qwen_moe.py, glm4_moe.py, t5.py);
architectures.py lists them.

Below: what the MoE targets (Transformers' softmax top-k routers) need of our gate, which several families share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .mapping import Mapping


@dataclass(frozen=True)
class FieldMap:
    """Config fields that carry one value under our name and theirs: `pairs` of (our name, their name)."""

    pairs: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, *same: str, **renamed: str) -> FieldMap:
        """`same`: one name on both sides; `renamed`: ours=theirs."""
        return cls(tuple((name, name) for name in same) + tuple(renamed.items()))

    def __or__(self, other: FieldMap) -> FieldMap:
        return FieldMap(self.pairs + other.pairs)

    def ours(self, theirs) -> dict:
        """Their config -> these fields under our names."""
        return {o: getattr(theirs, t) for o, t in self.pairs}

    def theirs(self, ours) -> dict:
        """Our config -> these fields under their names."""
        return {t: getattr(ours, o) for o, t in self.pairs}


@dataclass(frozen=True)
class Architecture:
    """One Transformers architecture and ours (GPT-MoE for decoders, Seq2Seq-MoE for encoder-decoders), both ways.

    fields(their config, their tensor names) -> our config's fields (a T5 checkpoint shows an untied head only by
        storing it); None where ours cannot compute it (Qwen2-MoE's gated shared expert: export only).
    config(our config) -> their config: the export, and the dense twin that merging an imported model writes; None
        where nothing writes it (merging an upcycled model writes back the dense config upcycling recorded).
    rules(their config, their tensor names, **export) -> `Rule`s from their names to ours. An export passes `ours`
        (our config) and `dtype` (of the tensors it creates: what the target has and ours lacks).
    reasons(our config) -> what of it the target cannot compute, one sentence each (export targets).
    """

    model_type: str
    class_name: str  # the Transformers class that holds it
    fields: Callable | None
    rules: Callable
    family: str = "gpt_moe"  # our model_type: "gpt_moe" (decoders) or "seq2seq_moe" (encoder-decoders)
    base_prefix: str = "model."  # some Hub checkpoints were saved from the base model, without this prefix
    ignore: tuple[str, ...] = ()  # source tensors that hold no weights (old checkpoints' buffers)
    ffn_modules: Callable | None = None  # dense sources: their config -> each FFN's module, in our order (router input)
    moe: bool = False  # an MoE architecture: imported and exported, not upcycled
    twin: str | None = None  # an MoE architecture's dense twin (a model_type): what merging its experts writes
    config: Callable | None = None
    reasons: Callable | None = None

    def mapping(self, config, names=frozenset(), **export) -> Mapping:
        experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
        return Mapping(self.rules(config, names, **export), num_layers=config.num_hidden_layers, num_experts=experts,
                       ignore=self.ignore)


# the fields every decoder source carries under one name
COMMON = FieldMap.of("vocab_size", "num_hidden_layers", "initializer_range", "tie_word_embeddings", "use_cache",
                     "pad_token_id", "bos_token_id", "eos_token_id", "dtype")


def every_layer(template: str) -> Callable:
    """`ffn_modules` of a decoder: the module `template` of every layer."""
    return lambda c: [template.replace("{i}", str(i)) for i in range(c.num_hidden_layers)]


# ----------------------------------------------------------------------- what a softmax top-k target needs of ours


def weighting(c, label: str) -> tuple[str | None, list[str]]:
    """How the gate weights a token's K experts, in the terms of Transformers' softmax top-k routers: "renormalized"
    (the top-K softmax probabilities divided by their sum), "probabilities" (as they are), or None with the reasons
    when it computes something else."""
    k, gate = c.num_experts_per_tok, c.router_type
    if gate == "topk":
        if c.topk_weighting == "m6t":
            if k == 1:  # a softmax over one probability is 1, as renormalising it is
                return "renormalized", []
            return None, [f"topk_weighting='m6t' weights the {k} experts by a softmax over their probabilities "
                          f"(M6-T Eq. (1)); {label} weights them by the probabilities"]
        return ("renormalized" if c.norm_topk_prob else "probabilities"), []
    if gate == "switch":
        return "probabilities", []
    if gate == "gshard":
        if c.router_random_routing:
            return None, ["router_type='gshard' drops the second expert at random in training (router_random_routing="
                          f"True); {label} always takes both. router_random_routing=False makes it a renormalised top-2"]
        return "renormalized", []
    if gate == "prototype":
        if k == 1:  # one prototype of all E experts: a top-1 softmax router
            return "probabilities", []
        return None, [f"router_type='prototype' routes top-1 within each of {k} prototypes of {c.num_experts // k} "
                      f"experts (M6-T), one softmax per prototype; {label} has one softmax top-k over all experts"]
    return None, [f"router_type={gate!r} is not a built-in gate; {label}'s router is a softmax top-k"]


def capacity_reasons(c, label: str) -> list[str]:
    """Every target is dropless in training and evaluation."""
    return [
        f"{name}={value}: ours drops routes past an expert's capacity ({when}); {label} is dropless"
        for name, when in (("capacity_factor", "training"), ("eval_capacity_factor", "evaluation"))
        if (value := getattr(c, name)) is not None
    ]


def jitter_reasons(c, label: str, jitters: bool) -> list[str]:
    """No target jitters as ours does: those that jitter (`jitters`: Mixtral, Switch) multiply the noise into the
    hidden states the experts read too, the others have none."""
    if c.router_jitter_noise <= 0:
        return []
    target = f"{label} multiplies the hidden states the experts also read" if jitters else f"{label} has no jitter"
    return [f"router_jitter_noise={c.router_jitter_noise}: ours jitters only the router's input; {target}"]


def routing_reasons(c, label: str, jitters: bool) -> list[str]:
    """What the softmax top-k targets (Mixtral, Qwen, Switch) need of routing."""
    softmax = [
        f"{name}={value!r}: {what}; {label}'s router is a softmax top-k with neither"
        for name, default, what in (
            ("router_score_function", "softmax", "sigmoid scores"),
            ("router_expert_bias", False, "a per-expert selection bias"),
            ("num_expert_groups", 1, "group-limited routing"),
            ("routed_scaling_factor", 1.0, "scaled combine weights"),
        )
        if (value := getattr(c, name, default)) != default
    ]
    return capacity_reasons(c, label) + softmax + jitter_reasons(c, label, jitters)


def renormalizes(c) -> bool:
    """norm_topk_prob for a target that computes our gate (see `weighting`)."""
    return weighting(c, "")[0] == "renormalized"


def expert_size(c) -> int:
    """Our experts' inner size."""
    return c.moe_intermediate_size or c.intermediate_size


def moe_layers(c) -> list[bool]:
    """Which layers of our decoder config are MoE layers."""
    return [c.is_moe_layer(i) for i in range(c.num_hidden_layers)]
