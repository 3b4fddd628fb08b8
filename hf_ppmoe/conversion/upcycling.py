"""dense -> MoE ("upcycling") and imports of MoE checkpoints (Mixtral, Qwen3-MoE, GLM-4-MoE, Switch Transformers) into
our classes.

Legend: E experts, K routes per token, H hidden, I FFN inner size.

Upcycling is two maps, both declarative and reversible: the source architecture's table (its `Architecture`)
renames its weights into the dense names of our model (GPT-MoE for decoders, Seq2Seq-MoE for encoder-decoders), then
`experts_mapping` turns each chosen dense FFN into E copies plus a router.

Exactness. Identical experts make the MoE output (sum_k w_k) * FFN(x), so the logits equal the dense model's exactly
when the combine weights of every token sum to one. With a zero router (`router_init="zeros"`) every gate sees uniform
probabilities 1/E and its sum is a constant c (switch: 1/E; topk without renormalisation: K/E; prototype: K * K/E;
topk with renormalisation and gshard: 1); the down-projections are scaled by 1/c, so every built-in gate is exact.
A random or hidden-state router is exact only for gates that renormalise their weights (topk with
norm_topk_prob=True, gshard); for the others `upcycle` warns. The default, `router_init="auto"`, takes a random router
where it is exact, and zeros elsewhere (`resolve_router_init`): identical experts that the router cannot tell apart
stay identical in training (a zero router ties every expert, so the first ones take every token), so a random router
is the one that trains. Exactness also needs dropless evaluation
(eval_capacity_factor=None, the default; capacity_factor only applies in training) and no noise. GShard's random
routing only happens in training.

Fine-grained upcycling (`granularity` g > 1) cuts each copy into g slices of the inner dimension, whose outputs sum
to the FFN's. The router's rows are equal within a copy, so a token's g slices of a copy get the same weight and the
top k * g routes are k whole copies (unless two copies' scores tie, which a random or hidden router makes
vanishingly rare and a zero router makes certain: refused); the weights of all routes sum to g times those of the
copies, so the down-projections are scaled by g / (that sum under a uniform router).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..modeling import GPTMoEConfig, GPTMoEForCausalLM, Seq2SeqMoEConfig, Seq2SeqMoEForConditionalGeneration
from ..modeling.configuration_moe import MoEConfig
from ..moe.gates import get_gate_class
from .adapter import Architecture
from .architectures import ARCHITECTURES, get_architecture
from .choices import ROUTER_INITS, default_experts_per_token, granularity_problem
from .io import Checkpoint, open_checkpoint, read_config_dict
from .mapping import (Chain, Concat, ConversionError, Create, FlattenExperts, Identity, Mapping, Op, Replicate, Rule, Scale,
                      Slices, rename)
from .delivery import deliver



# the model class of each target family, by its config's model_type
MODEL_CLASSES = {GPTMoEConfig.model_type: GPTMoEForCausalLM, Seq2SeqMoEConfig.model_type: Seq2SeqMoEForConditionalGeneration}


def moe_config_loader(reader: str):
    """folder -> its GPT-MoE / Seq2Seq-MoE config, for the functions that read our checkpoints (`reader` names the
    function in the error a folder of another model gets)."""

    def load(folder: Path):
        model_type = read_config_dict(folder).get("model_type")
        if model_type not in MODEL_CLASSES:
            raise ConversionError(
                f"{folder} holds a {model_type!r} model; {reader} reads GPT-MoE and Seq2Seq-MoE checkpoints "
                f"(model_type {' or '.join(map(repr, MODEL_CLASSES))}). A Mixtral, Qwen3-MoE, GLM-4-MoE or Switch Transformers checkpoint: import it first (hf-ppmoe import SRC OUT; "
                "in Python, import_moe)."
            )
        return MODEL_CLASSES[model_type].config_class.from_pretrained(folder)

    return load


def _ffns(config) -> list[tuple[str, bool]]:
    """Every FFN of a GPT-MoE or Seq2Seq-MoE config, the encoder's before the decoder's: (name prefix, is MoE)."""
    if isinstance(config, Seq2SeqMoEConfig):
        ffns = [(f"model.encoder.layers.{i}.mlp.", config.is_encoder_moe_layer(i)) for i in range(config.num_hidden_layers)]
        return ffns + [(f"model.decoder.layers.{i}.mlp.", config.is_decoder_moe_layer(i)) for i in range(config.num_decoder_layers)]
    return [(f"model.layers.{i}.mlp.", config.is_moe_layer(i)) for i in range(config.num_hidden_layers)]


def moe_ffns(config) -> dict[int, str]:
    """The MoE layers of a GPT-MoE or Seq2Seq-MoE config: {FFN number: name prefix}. FFNs are numbered in order,
    the encoder's before the decoder's; the number keys `routers` and `merge_weights` and seeds each FFN's noise."""
    return {n: prefix for n, (prefix, is_moe) in enumerate(_ffns(config)) if is_moe}


# the placement fields that make every FFN of a config dense
_NO_MOE = {GPTMoEConfig.model_type: dict(moe_layers=[]),
           Seq2SeqMoEConfig.model_type: dict(encoder_moe_layers=[], decoder_moe_layers=[])}


# -------------------------------------------------------------------------------------------- experts mapping


@dataclass(frozen=True)
class DropReinit(Op):
    """[E, ...] -> [E, ...]: Drop-Upcycling (Nakamura et al., arXiv 2502.19261). In every expert e a share `ratio` of
    the FFN's inner dimensions, drawn from `index_seed + e` (the same draw for the in- and out-projections of one
    expert), is re-initialised from N(mean, std) of the dense weight (per stacked part: gate and up of a fused
    gate_up); the other dimensions stay the dense copy. `dim`: the inner dimension of one expert's weight (0 for
    [parts * F, H], 1 for [H, F]). Biases are not touched. Its inverse leaves the experts as they are (the merge that
    follows averages them: no longer the dense FFN)."""

    ratio: float
    dim: int
    parts: int = 1
    index_seed: int = 0
    value_seed: int = 0

    def __call__(self, xs):
        (x,) = xs
        if self.ratio <= 0 or x.is_meta:
            return [x]
        E, F = x.shape[0], x.shape[1 + self.dim] // self.parts
        kept = x[0].float()
        out = x.clone()
        values = torch.Generator().manual_seed(self.value_seed)
        for e in range(E):
            dropped = torch.randperm(F, generator=torch.Generator().manual_seed(self.index_seed + e))[: round(self.ratio * F)]
            for p in range(self.parts):
                part = kept.narrow(self.dim, p * F, F)
                shape = list(part.shape)
                shape[self.dim] = len(dropped)
                fresh = torch.randn(shape, generator=values) * part.std() + part.mean()
                out[e].index_copy_(self.dim, (dropped + p * F).to(x.device), fresh.to(x.dtype).to(x.device))
        return [out]

    def inverse(self):
        return Identity()


def experts_mapping(
    config,
    *,
    scale: float = 1.0,
    noise_std: float = 0.0,
    seed: int = 0,
    routers: dict | None = None,
    merge_weights: dict[int, tuple[float, ...]] | None = None,
    reinit_ratio: float = 0.0,
    granularity: int = 1,
) -> Mapping:
    """Dense FFN names -> MoE layer names for each MoE layer of `config` (`moe_ffns`): E / g copies of the FFN, each
    cut into g = `granularity` slices of its inner dimension (`Slices`; expert e = slice e % g of copy e // g; g = 1:
    E whole copies), the down-projection scaled by `scale`, optional noise, `reinit_ratio` of each expert's inner
    dimensions re-initialised (`DropReinit`), and a router made by `routers[n]()`. The inverse merges the copies with
    `merge_weights[n]` (E / g weights, uniform by default), joins the slices and drops the router. Every other tensor
    passes through."""
    E, g = config.num_experts, granularity
    ins = ("gate_proj", "up_proj") if config.gated_mlp else ("up_proj",)
    fused = "gate_up_proj" if config.gated_mlp else "up_proj"
    join = Concat(0, len(ins)) if len(ins) > 1 else Identity()
    rules = []
    for n, d in moe_ffns(config).items():
        w = merge_weights.get(n) if merge_weights else None

        def copies(k: int, dim: int | None, noise: float = noise_std) -> Chain:
            """[...] -> [E, ...]: the slices along `dim` (see `Slices`) of E / g copies."""
            replicate = Replicate(E // g, noise, seed=seed * 1_000_003 + 4 * n + k, merge_weights=w)
            return Chain(Slices(g, dim, len(ins) if dim == 0 else 1), replicate, FlattenExperts(g))

        make_router = routers[n] if routers else _no_router
        drop_seed = seed * 1_000_003 + 4 * n + 1_000
        drop_in = DropReinit(reinit_ratio, 0, len(ins), index_seed=drop_seed * 1_009, value_seed=drop_seed)
        drop_out = DropReinit(reinit_ratio, 1, 1, index_seed=drop_seed * 1_009, value_seed=drop_seed + 1)
        rules += [  # nn.Linear [out, in] -> experts [E, out, in]
            Rule(tuple(f"{d}{p}.weight" for p in ins), (f"{d}experts.{fused}",), Chain(join, copies(0, 0), drop_in)),
            rename(f"{d}down_proj.weight", f"{d}experts.down_proj", Chain(Scale(scale), copies(1, 1), drop_out)),
            Rule((), (f"{d}gate.weight",), Create(make_router)),
        ]
        if config.mlp_bias:  # biases are copied without noise
            rules += [
                Rule(tuple(f"{d}{p}.bias" for p in ins), (f"{d}experts.{fused}_bias",), Chain(join, copies(2, 0, 0.0))),
                rename(f"{d}down_proj.bias", f"{d}experts.down_proj_bias", Chain(Scale(scale), copies(3, None, 0.0))),
            ]
    return Mapping(rules, num_experts=E, passthrough=True)


def _no_router():
    raise AssertionError("a router is only created when upcycling")


# ---------------------------------------------------------------------------------------- gate probes


def _combine_sums(config, weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    gate = get_gate_class(config.router_type)(config).eval()
    gate.capacity_factor = gate.eval_capacity_factor = None  # the sums of dropless routing
    with torch.no_grad():
        gate.weight.copy_(weight)
        return gate(tokens).weights.sum(-1).double()


def expert_output_scale(config) -> float:
    """1 / (the sum of a token's combine weights under a uniform (zero) router): the down-projection scale that makes
    E identical experts sum to the dense FFN."""
    H, E = config.hidden_size, config.num_experts
    sums = _combine_sums(config, torch.zeros(E, H), torch.zeros(4, H))
    if not bool((sums == sums[0]).all()) or float(sums[0]) <= 0:
        raise ConversionError(
            f"router_type={config.router_type!r} gives combine weights {sums.tolist()} under a uniform router; upcycling "
            "needs one positive constant per token to scale the experts by."
        )
    return 1.0 / float(sums[0])


def gate_renormalizes(config) -> bool:
    """Whether the gate's combine weights sum to one for any router (so a non-uniform router keeps exactness)."""
    g = torch.Generator().manual_seed(0)
    H, E = config.hidden_size, config.num_experts
    sums = _combine_sums(config, torch.randn(E, H, generator=g), torch.randn(64, H, generator=g))
    return bool(torch.allclose(sums, torch.ones_like(sums), atol=1e-5))


def resolve_router_init(router_init: str, config, granularity: int = 1) -> str:
    """`router_init="auto"` -> "random" where the gate's combine weights sum to one for any router (topk with
    norm_topk_prob=True, gshard; and fine-grained upcycling, which a zero router cannot do), else "zeros": for switch,
    prototype and topk without renormalisation only a uniform router keeps the logits exact (its ties leave copies
    alike; benchmarks/router_init.py). Any other value is returned as it is."""
    if router_init != "auto":
        return router_init
    return "random" if granularity > 1 or gate_renormalizes(config) else "zeros"


def _warn_if_inexact(config, router_init: str) -> None:
    if config.eval_capacity_factor is not None:
        warnings.warn(
            f"eval_capacity_factor={config.eval_capacity_factor}: evaluation drops tokens past capacity, so the upcycled "
            "model's logits can differ from the dense model's. Leave it None (dropless) for an exact upcycle.",
            stacklevel=3,
        )
    if router_init != "zeros" and not gate_renormalizes(config):
        warnings.warn(
            f"router_init={router_init!r} with router_type={config.router_type!r}"
            + (" and norm_topk_prob=False" if config.router_type == "topk" else "")
            + ": this gate's combine weights do not sum to one for a non-uniform router, so the upcycled model's logits "
            "will differ from the dense model's until it is fine-tuned. Exact: router_init='zeros' with any gate, or "
            "'random'/'hidden' with router_type='topk' (norm_topk_prob=True) or 'gshard' (router_init='auto', the "
            "default, takes the exact one).",
            stacklevel=3,
        )


# ----------------------------------------------------------------------------------------------- routers


def _texts_per_expert(sample_texts, num_experts: int) -> list[list[str]]:
    if not sample_texts or len(sample_texts) != num_experts:
        n = len(sample_texts) if sample_texts else 0
        raise ConversionError(
            f"router_init='hidden' needs sample_texts with one entry per expert (a text or a list of texts; with "
            f"granularity g, per copy of the FFN: num_experts / g), {num_experts} in all; got {n}."
        )
    return [[t] if isinstance(t, str) else list(t) for t in sample_texts]


def sample_ids(tokenizer, text: str, model) -> torch.Tensor:
    """A sample text's token ids [1, S] on the model's device, cut to the model's positions (learned positions)."""
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, : getattr(model.config, "max_position_embeddings", None)]
    if ids.numel() == 0:
        raise ConversionError(f"sample text {text!r} has no tokens")
    return ids.to(model.device)


def run_on_text(model, ids: torch.Tensor, **kwargs):
    """One forward pass over a sample text; an encoder-decoder reads it on both sides (the decoder as its target)."""
    if model.config.is_encoder_decoder:
        return model(input_ids=ids, decoder_input_ids=ids, **kwargs)
    return model(input_ids=ids, **kwargs)


@torch.no_grad()
def hidden_router_rows(model, modules: dict[int, str], sample_texts, tokenizer, num_experts: int) -> dict[int, torch.Tensor]:
    """mergekit's "hidden" gate mode, on what a router actually sees: for each expert e and FFN n (module
    `modules[n]` of the dense `model`), the mean input of that FFN over the tokens of expert e's sample texts
    (averaged per text, then over texts), scaled to unit norm."""
    texts = _texts_per_expert(sample_texts, num_experts)
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        model.get_submodule(module).register_forward_pre_hook(lambda m, args, n=n: captured.__setitem__(n, args[0].detach()))
        for n, module in modules.items()
    ]
    was_training = model.training
    model.eval()
    try:
        rows: dict[int, list[torch.Tensor]] = {n: [] for n in modules}
        for expert_texts in texts:
            per_text: dict[int, list[torch.Tensor]] = {n: [] for n in modules}
            for text in expert_texts:
                run_on_text(model, sample_ids(tokenizer, text, model))
                for n in modules:
                    per_text[n].append(captured[n][0].float().mean(0))
            for n in modules:
                v = torch.stack(per_text[n]).mean(0)
                rows[n].append(v / v.norm().clamp_min(1e-8))
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return {n: torch.stack(r).cpu() for n, r in rows.items()}


def _routers(router_init, config, ffns, dtype, seed, checkpoint: Checkpoint, arch: Architecture, sample_texts, tokenizer,
             granularity: int = 1):
    """{FFN number: () -> router [E, H]}: one row per copy of the FFN, repeated for its `granularity` slices (Megatron's
    virtual groups: the slices of a copy score alike, so a top-k of k * granularity takes whole copies)."""
    E, H, std = config.num_experts, config.hidden_size, config.initializer_range
    C = E // granularity  # copies of the FFN
    if router_init == "zeros":
        return {n: (lambda: torch.zeros(E, H, dtype=dtype)) for n in ffns}
    if router_init == "random":
        return {
            n: (lambda n=n: (torch.randn(C, H, generator=torch.Generator().manual_seed(seed * 1_000_003 + n)) * std)
                .repeat_interleave(granularity, dim=0).to(dtype))
            for n in ffns
        }
    if tokenizer is None:
        if checkpoint.folder is None:
            raise ConversionError("router_init='hidden' needs a tokenizer for the sample texts; pass tokenizer=...")
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(checkpoint.folder)
        except (OSError, ValueError) as err:
            raise ConversionError(f"router_init='hidden' needs a tokenizer and {checkpoint.folder} has none ({err}); pass tokenizer=...") from err
    model = checkpoint.model
    if model is None:
        import transformers

        model = getattr(transformers, arch.class_name).from_pretrained(checkpoint.folder)
    modules = arch.ffn_modules(checkpoint.config)
    rows = hidden_router_rows(model, {n: modules[n] for n in ffns}, sample_texts, tokenizer, C)
    del model
    return {n: (lambda r=rows[n]: r.repeat_interleave(granularity, dim=0).to(dtype)) for n in ffns}


# ------------------------------------------------------------------------------------------------- entry points


def _fields_of(config_class) -> set[str]:
    return {f for cls in config_class.__mro__ for f in getattr(cls, "__annotations__", {})}


def _dense_checkpoint(src, moe: bool) -> tuple[Checkpoint, Architecture, frozenset[str]]:
    """The source, its architecture and the names of its tensors (base-model checkpoints renamed)."""
    from transformers import AutoConfig

    def load_config(folder: Path):
        get_architecture(read_config_dict(folder).get("model_type"), moe=moe)
        return AutoConfig.from_pretrained(folder)

    checkpoint = open_checkpoint(src, load_config)
    arch = get_architecture(getattr(checkpoint.config, "model_type", None), moe=moe)
    keys = checkpoint.tensors.keys()
    prefix = arch.base_prefix
    if keys and not any(k.startswith(prefix) for k in keys):  # saved from the base model (e.g. the original "gpt2")
        renamed = Mapping([rename(k, k if k.startswith("lm_head.") else prefix + k) for k in keys])
        checkpoint.tensors = renamed.apply(checkpoint.tensors)
    return checkpoint, arch, frozenset(checkpoint.tensors.keys())


def _moe_config(arch: Architecture, fields: dict, overrides: dict, **extra):
    """The target config; settings it refuses are a ConversionError (before any tensor is converted)."""
    config_class = MODEL_CLASSES[arch.family].config_class
    unknown = sorted(set(overrides) - _fields_of(config_class))
    if unknown:
        raise TypeError(f"unknown {config_class.__name__} field(s) for a {arch.model_type} source: {', '.join(unknown)}")
    try:
        return config_class(**{**fields, **overrides, **extra})
    except ValueError as err:
        raise ConversionError(f"the {config_class.__name__} of the result refuses a setting: {err}") from err


def upcycled_config(
    dense_config,
    names=frozenset(),
    *,
    num_experts: int = 8,
    num_experts_per_tok: int | None = None,
    router_type: str = "topk",
    moe_layer_frequency: int = 2,
    moe_layers: list[int] | None = None,
    granularity: int = 1,
    **config_overrides,
):
    """The config of the MoE model `upcycle` makes from a dense model with config `dense_config` (a Transformers
    config of a supported architecture; `names`: its checkpoint's tensor names, where the architecture reads them)
    and these options (`upcycle`'s), without reading any weight. ConversionError for settings it refuses."""
    arch = get_architecture(getattr(dense_config, "model_type", None), moe=False)
    num_experts_per_tok = default_experts_per_token(router_type, num_experts_per_tok)
    fields = arch.fields(dense_config, names)
    sliced = {}
    if granularity > 1:
        F = fields["intermediate_size"]
        if F % granularity:
            raise ConversionError(f"granularity={granularity} must divide the dense FFN's inner size "
                                  f"intermediate_size={F}; choose a divisor of {F}.")
        sliced = dict(moe_intermediate_size=F // granularity)
    config = _moe_config(
        arch,
        fields,
        config_overrides,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok * granularity,
        router_type=router_type,
        moe_layer_frequency=moe_layer_frequency,
        moe_layers=moe_layers,
        **sliced,
    )
    if granularity > 1 and (num_experts // config.num_expert_groups) % granularity:
        raise ConversionError(
            f"num_expert_groups={config.num_expert_groups}: each routing group of {num_experts // config.num_expert_groups} "
            f"experts must hold whole copies of the FFN ({granularity} slices each, granularity={granularity}); use "
            f"fewer groups."
        )
    if not moe_ffns(config):
        raise ConversionError(
            f"no FFN becomes an MoE layer: moe_layer_frequency={moe_layer_frequency} with {config.num_hidden_layers} "
            "layers" + (" per stack" if arch.family == "seq2seq_moe" else "") + ". Use a smaller frequency or list the "
            "layers (moe_layers; encoder_moe_layers / decoder_moe_layers for an encoder-decoder)."
        )
    return config


def upcycle(
    dense,
    *,
    num_experts: int = MoEConfig.num_experts,
    num_experts_per_tok: int | None = None,
    router_type: str = MoEConfig.router_type,
    moe_layer_frequency: int = MoEConfig.moe_layer_frequency,
    moe_layers: list[int] | None = None,
    router_init: str = "auto",
    sample_texts=None,
    tokenizer=None,
    noise_std: float = 0.0,
    seed: int = 0,
    reinit_ratio: float = 0.0,
    granularity: int = 1,
    save_directory: str | Path | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    progress: bool = False,
    **config_overrides,
) -> GPTMoEForCausalLM | Seq2SeqMoEForConditionalGeneration | Path:
    """Turn a dense model (a model object or a folder / Hub id of safetensors) into an MoE model whose chosen FFNs are
    MoE layers of `num_experts` copies of the dense FFN: a causal LM (GPT-2, Llama, Mistral, Qwen2, Qwen3) into a GPT-MoE,
    a T5 (v1.0 or v1.1) into a Seq2Seq-MoE.

    num_experts_per_tok: routes per token (default 1 for router_type="switch", else 2); with granularity g, copies of
        the FFN per token (g times as many routes).
    moe_layer_frequency / moe_layers: every n-th FFN becomes MoE (layers n-1, 2n-1, ...), or the listed ones. For T5
        the frequency applies to each stack; choose per stack with the Seq2SeqMoEConfig fields encoder_moe_layers /
        decoder_moe_layers (lists, [] for none) or encoder_moe_layer_frequency / decoder_moe_layer_frequency.
    router_init: "auto" (the default: "random" for a gate whose weights sum to one, topk with norm_topk_prob=True
        and gshard, else "zeros"), "zeros" (uniform routing; exact for every gate, but the tied experts are chosen
        alike), "random" (normal, std initializer_range), or "hidden" (mergekit's mode: one row per expert from the FFN inputs of `sample_texts[e]`, a text or a list of
        texts per expert, tokenized with `tokenizer` or the source folder's tokenizer; a T5 reads each text in its
        encoder and, as its target, in its decoder).
    noise_std: N(0, noise_std^2) noise added to each expert's weights to break their symmetry (`seed` draws it).
    reinit_ratio: Drop-Upcycling (arXiv 2502.19261): in every expert this share of the FFN's inner dimensions (its
        rows of the in-projections and columns of the down-projection, a different draw per expert) is re-initialised
        from the dense weight's mean and std; 0 (default) keeps exact copies. The result no longer equals the dense
        model (every other tensor still is the dense one's).
    granularity: fine-grained upcycling (He et al., arXiv 2410.07524; Megatron's --moe-upcycling-granularity) with
        g > 1: the experts are num_experts / g copies of the FFN, each cut into g slices of its inner size F (rows of
        the in-projections, columns of the down-projection): expert e is slice e % g of copy e // g, of size
        moe_intermediate_size = F / g. A token takes num_experts_per_tok copies, num_experts_per_tok * g experts (the
        config's num_experts_per_tok). The router's rows are equal within a copy, so the top-k takes whole copies, and
        the down-projections are scaled by g: with router_type="topk", norm_topk_prob=True and router_init "random"
        or "hidden" the model equals the dense one. Needs g dividing F and num_experts; refuses router_init="zeros"
        (ties) and reinit_ratio > 0.
    config_overrides: any other field of the target config (capacity_factor, norm_topk_prob, experts_implementation,
        router_aux_loss_coef...).

    Returns the model, or, with `save_directory`, writes the checkpoint there (sharded safetensors, config, remote code,
    the source's tokenizer and generation config) tensor by tensor and returns the folder's path.
    """
    if router_init not in ROUTER_INITS:
        raise ConversionError(f"router_init={router_init!r}; use one of {', '.join(ROUTER_INITS)}.")
    if num_experts == 1:  # allowed (a test of the conversion itself), but no MoE: say so once
        warnings.warn("num_experts=1: every MoE layer has one expert, which every token takes, so the model computes "
                      "the dense model with a router added; upcycle to 2 or more experts for an MoE.", stacklevel=2)
    num_experts_per_tok = default_experts_per_token(router_type, num_experts_per_tok)
    problem = granularity_problem(granularity, num_experts, num_experts_per_tok, router_type, router_init, reinit_ratio)
    if problem:
        raise ConversionError(problem)
    checkpoint, arch, names = _dense_checkpoint(dense, moe=False)
    config = upcycled_config(
        checkpoint.config, names, num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
        router_type=router_type, moe_layer_frequency=moe_layer_frequency, moe_layers=moe_layers,
        granularity=granularity, **config_overrides,
    )
    ffns = moe_ffns(config)
    router_init = resolve_router_init(router_init, config, granularity)
    _warn_if_inexact(config, router_init)
    # the combine weights of a token's copies sum to 1/g of all its routes' (a copy's g slices weigh alike)
    scale = granularity * expert_output_scale(config)
    config.conversion = {
        "dense_config": checkpoint.config.to_dict(),
        "expert_output_scale": scale,
        "router_init": router_init,
        "noise_std": noise_std,
        **({"reinit_ratio": reinit_ratio} if reinit_ratio else {}),
        **({"granularity": granularity} if granularity > 1 else {}),
    }
    dense_names = arch.mapping(checkpoint.config, names).apply(checkpoint.tensors)
    dtype = dense_names.meta().get(next(iter(ffns.values())) + "down_proj.weight").dtype
    routers = _routers(router_init, config, ffns, dtype, seed, checkpoint, arch, sample_texts, tokenizer, granularity)
    if not 0.0 <= reinit_ratio <= 1.0:
        raise ConversionError(f"reinit_ratio={reinit_ratio}: a share of each expert's inner dimensions, in [0, 1].")
    experts = experts_mapping(config, scale=scale, noise_std=noise_std, seed=seed, routers=routers,
                              reinit_ratio=reinit_ratio, granularity=granularity)
    return deliver(
        experts.apply(dense_names),
        config,
        MODEL_CLASSES[arch.family],
        checkpoint,
        save_directory=save_directory,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        progress=progress,
        conversion="upcycle",
        tokenizer=tokenizer,
    )


def _dense_twin(arch: Architecture, fields: dict):
    """The config merging an imported model's experts writes: its dense twin's (`arch.twin`) of our config with every
    FFN dense, or None: no twin, or dense layers and experts of two sizes (a dense model has one FFN size)."""
    if arch.twin is None:
        return None
    config_class = MODEL_CLASSES[arch.family].config_class
    moe = config_class(**fields)
    size = moe.moe_intermediate_size or moe.intermediate_size
    if size != moe.intermediate_size and not all(is_moe for _, is_moe in _ffns(moe)):
        return None
    twin = ARCHITECTURES[arch.twin]
    config = twin.config(config_class(**{**fields, **_NO_MOE[arch.family], "intermediate_size": size}))
    config.architectures = [twin.class_name]
    return config


def import_moe(
    moe,
    *,
    save_directory: str | Path | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    progress: bool = False,
    **config_overrides,
) -> GPTMoEForCausalLM | Seq2SeqMoEForConditionalGeneration | Path:
    """Import an MoE checkpoint (a model object or a folder / Hub id: Mixtral, Qwen3-MoE, GLM-4-MoE or Switch
    Transformers) into our classes: same weights, same routing, equal logits; each architecture's module (mixtral.py,
    qwen_moe.py, glm4_moe.py, t5.py) says what it becomes and what it refuses. `merge_experts` turns the result into
    its dense twin (Mistral, Qwen3, T5; none for GLM-4-MoE, nor where dense layers and experts differ in size).
    Returns the model, or writes it to `save_directory` and returns the path (as `upcycle`)."""
    checkpoint, arch, names = _dense_checkpoint(moe, moe=True)
    fields = arch.fields(checkpoint.config, names)
    config = _moe_config(arch, fields, config_overrides)
    twin = _dense_twin(arch, fields)
    config.conversion = {
        "dense_config": twin.to_dict() if twin is not None else None,
        "expert_output_scale": 1.0,
        "imported_from": checkpoint.config.to_dict(),
    }
    return deliver(
        arch.mapping(checkpoint.config, names).apply(checkpoint.tensors),
        config,
        MODEL_CLASSES[arch.family],
        checkpoint,
        save_directory=save_directory,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        progress=progress,
        conversion="import",
    )


__all__ = [
    "MODEL_CLASSES",
    "DropReinit",
    "expert_output_scale",
    "experts_mapping",
    "gate_renormalizes",
    "hidden_router_rows",
    "import_moe",
    "moe_config_loader",
    "moe_ffns",
    "resolve_router_init",
    "run_on_text",
    "sample_ids",
    "upcycle",
]
