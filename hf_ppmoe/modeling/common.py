"""Pieces shared by both model families: norms, input checks, and `MoEPreTrainedModel`
with a guarded, self-contained `save_pretrained` / `from_pretrained`.

Transformers' remote-code loader copies only the files a model's modules import with `from .name import ...`, so
`save_pretrained` writes a flattened copy of every module the model needs (`hf_ppmoe/moe/layer.py` ->
`moe_layer.py`, imports rewritten), the `auto_map` pointing at them, and `custom_generate/generate.py` (flat beam
search). Saving replaces the folder in one step and records the weights' SHA-256; loading refuses weight files outside
the folder, changed checksums, integer tensors for floating-point weights, and NaN or infinity (hf_ppmoe/utils).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init

from ..generation.flat_beam_search import generate as flat_beam_generate
from ..moe.experts import Experts
from ..moe.gates import Gate
from ..moe.layer import MoELayer
from ..utils.atomic import atomic_folder
from ..utils.integrity import (
    WEIGHT_FILE,
    check_finite,
    check_inside,
    check_stored_dtypes,
    stored_dtypes,
    verify_checksums,
    write_checksums,
)
from ..utils.transformers_private import (
    PrivateHooks,
    device_mesh_of,
    is_first_pipeline_stage,
    restrict_instance_plans,
)
from .stages import drop_input_parts, keep_layers


class RMSNorm(nn.Module):
    """Root-mean-square norm (Llama, T5): statistics in float32, no mean subtraction, no bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


def build_norm(norm_type: str, hidden_size: int, eps: float) -> nn.Module:
    return RMSNorm(hidden_size, eps) if norm_type == "rmsnorm" else nn.LayerNorm(hidden_size, eps=eps)


def routing_token_mask(attention_mask: torch.Tensor | None, compute_router_losses: bool) -> torch.Tensor | None:
    """The padding mask the MoE layers route with: a 2D attention mask [B, S] (0 for padding), or None for no
    padding. In inference a mask without padding (every decoding step of `generate`) becomes None, checked once per
    forward, so that no MoE layer spends operators on it. The check reads the mask on the host, so it is made only on
    CPU in eager mode: training, GPUs and torch.compile keep the mask (same numbers) and never wait for the device."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    if (
        not compute_router_losses
        and attention_mask.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and bool(attention_mask.all())
    ):
        return None
    return attention_mask


def check_tokens(shape: torch.Size, name: str) -> None:
    """A batch of B >= 1 sequences of L >= 1 tokens (checked from the shape: no device work)."""
    if len(shape) < 2 or shape[0] == 0 or shape[1] == 0:
        raise ValueError(
            f"{name} has shape {tuple(shape)}: the model takes a batch [batch, sequence length] with at least one "
            "sequence of at least one token."
        )


def check_ids(ids: torch.Tensor, limit: int, what: str, fix: str) -> None:
    """Raise ValueError if an id lies outside [0, limit). Checked on CPU in eager mode only, where it is two
    comparisons: on an accelerator, or under torch.compile, reading the answer would make the host wait for the
    device (or break the graph) on every step, so there the embedding's own device-side index check stops a bad id."""
    if ids.device.type != "cpu" or torch.compiler.is_compiling() or ids.numel() == 0:
        return
    low, high = ids.aminmax()  # one pass
    if low.item() < 0 or high.item() >= limit:
        where = tuple(((ids < 0) | (ids >= limit)).nonzero()[0].tolist())
        raise ValueError(f"{what} must lie in [0, {limit}); got {int(ids[where])} at index {list(where)}. {fix}")


def layer_outputs(hidden_states: torch.Tensor, routing) -> tuple:
    """A layer's outputs: (hidden_states, aux_loss, z_loss), the losses None without a `Routing` or when they were
    not computed. Top-level tensors, because reentrant gradient checkpointing (`use_reentrant=True`, what PEFT's
    k-bit preparation asks for) runs the layer without autograd and gives gradients only to the tensors the layer
    returns directly."""
    if routing is None:
        return hidden_states, None, None
    return hidden_states, routing.aux_loss, routing.z_loss


_RELATIVE_IMPORT = re.compile(r"^(\s*)from\s+(\.+[\w.]*)\s+import\s", flags=re.MULTILINE)
# from_pretrained(..., verify_checksums=False) reaches load_guarded through this
_VERIFY_CHECKSUMS = contextvars.ContextVar("verify_checksums", default=True)


def _flat_name(module_name: str) -> str:
    """hf_ppmoe.moe.layer -> moe_layer; hf_ppmoe.modeling.x -> x; an already flattened module keeps its name."""
    parts = module_name.split(".")
    if parts[0] == "hf_ppmoe" and len(parts) == 3 and parts[1] != "modeling":
        return f"{parts[1]}_{parts[2]}"
    return parts[-1]


def write_remote_code(folder: str | os.PathLike, module_names: list[str]) -> list[str]:
    """Write flattened copies of `module_names` and every module they import relatively into `folder`."""
    written, todo = {}, list(module_names)
    while todo:
        name = todo.pop()
        if name in written:
            continue
        module = sys.modules[name]
        source = Path(module.__file__).read_text(encoding="utf-8")

        def rewrite(match, package=module.__package__):
            target = importlib.util.resolve_name(match.group(2), package)
            if importlib.util.find_spec(target) is None or target.count(".") == 0:
                raise ImportError(f"{name}: cannot carry relative import {match.group(2)!r} into a checkpoint")
            todo.append(target)
            return f"{match.group(1)}from .{_flat_name(target)} import "

        written[name] = _RELATIVE_IMPORT.sub(rewrite, source)
    for name, source in written.items():
        Path(folder, f"{_flat_name(name)}.py").write_text(source, encoding="utf-8")
    return [f"{_flat_name(n)}.py" for n in written]


def write_custom_generate(folder: str | os.PathLike) -> None:
    """`custom_generate/generate.py`: flat beam search, whose module imports only torch and transformers."""
    source = Path(sys.modules[flat_beam_generate.__module__].__file__).read_text(encoding="utf-8")
    if _RELATIVE_IMPORT.search(source):
        raise ImportError("custom_generate/generate.py must be self-contained (no relative imports)")
    Path(folder, "custom_generate").mkdir(exist_ok=True)
    Path(folder, "custom_generate", "generate.py").write_text(source, encoding="utf-8")


def add_remote_code(folder: str | os.PathLike, model_class: type, config) -> None:
    """Point `config.auto_map` at `model_class` (and its `_auto_classes`) and write the flattened modules they need
    into `folder`, so the checkpoint there loads with `trust_remote_code=True` where hf_ppmoe is not installed."""
    model_module, config_module = model_class.__module__, type(config).__module__
    config.auto_map = {
        "AutoConfig": f"{_flat_name(config_module)}.{type(config).__name__}",
        **{auto: f"{_flat_name(model_module)}.{cls}" for auto, cls in model_class._auto_classes.items()},
    }
    write_remote_code(folder, [model_module, config_module])


_LAYER_NUMBER = re.compile(r"\.\d+(?=\.|$)")  # "layers.3.mlp" -> "layers.*.mlp", as Transformers' plan keys


@contextlib.contextmanager
def tied_head_kept(model):
    """Ties a head that shares the input embeddings' weight again after the block, which may replace the embedding's
    parameter object (tensor-parallel splitting does)."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embeddings is not None and head.weight is embeddings.weight
    yield
    if tied:
        head.weight = embeddings.weight


class MoEPreTrainedModel(PrivateHooks, PreTrainedModel):
    """Base of both families: MoE weight init and an all-or-nothing, self-contained `save_pretrained`."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _skip_keys_device_placement = ["cache"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # {"AutoModelForCausalLM": "GPTMoEForCausalLM", ...}: Auto classes written into the saved config's auto_map
    _auto_classes: dict[str, str] = {}

    def num_active_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameters that take part in one token's forward pass, the number MoE models are compared by: all of them,
        less the routed experts a token does not reach (each MoE layer runs k of its E experts; a shared expert and the
        router always run). `num_parameters()` gives the total."""
        inactive = 0
        for module in self.modules():
            if isinstance(module, MoELayer):
                E, k = module.experts.num_experts, module.gate.top_k
                inactive += sum(p.numel() for p in module.experts.parameters()) * (E - k) // E
        return self.num_parameters(exclude_embeddings=exclude_embeddings) - inactive

    # Transformers' parallel hooks (`from_pretrained(distributed_config=...)`, and `hf_ppmoe.parallel.parallelize`
    # on a built model). The plan styles our configs name ("ppmoe_ffn", ...) are registered by hf_ppmoe.parallel.

    def init_parallel_plans(self) -> None:
        """Transformers' plan merging, keeping only the rules that name a module or parameter of this model: the
        configs list the rules of every layout a family can build (gated or plain FFN, biases, shared expert)."""
        super().init_parallel_plans()
        names = {_LAYER_NUMBER.sub(".*", n) for n, _ in [*self.named_modules(), *self.named_parameters()]}
        restrict_instance_plans(self, names.__contains__)

    def keep_own_plan_rules(self, plans: tuple) -> tuple:
        """Transformers' resolved plans (`PrivateHooks`) without the rules of tied duplicates (`lm_head.weight` when
        tied to the input embeddings, which Transformers cannot look up once tied): the shared weight is split once,
        by the embedding's rule, which splits the vocabulary as the head's rule would; the head keeps its forward
        rule."""
        names = {n for n, _ in [*self.named_modules(), *self.named_parameters()]}
        return tuple({k: v for k, v in plan.items() if k in names} for plan in plans)

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        """Transformers' `maybe_distribute_model`, keeping a tied head tied; with `pp_size > 1` the GPT-MoE stage is
        completed (`_fit_pipeline_stage`) and an encoder-decoder is refused (Transformers' stages cut the `layers` of
        a decoder-only model)."""
        pipeline = distributed_config is not None and distributed_config.pp_size > 1
        if pipeline and model.config.is_encoder_decoder:
            raise ValueError(
                f"Transformers' pipeline parallelism (DistributedConfig(pp_size={distributed_config.pp_size})) cuts "
                f"the decoder layers of a decoder-only model; {type(model).__name__} has an encoder and a decoder "
                "stack. Use hf_ppmoe.parallel.Pipeline or `python -m hf_ppmoe.training --pp_size N`, which cut both "
                "stacks."
            )
        with tied_head_kept(model):
            model = super().maybe_distribute_model(model, distributed_config, mesh_manager)
        if pipeline:
            model._fit_pipeline_stage()
        return model

    def _fit_pipeline_stage(self) -> None:
        """Completes a GPT-MoE stage of Transformers' pipeline parallelism (`DistributedConfig(pp_size=N)`).

        Transformers keeps this rank's slice of `model.layers` and puts an identity that returns the hidden states
        alone in place of the others; our layers also return their routing and router losses (`layer_outputs`), so
        those identities become `LayerOfAnotherStage`. A stage after the first receives hidden states that already
        carry the learned position embeddings and the embedding dropout, and drops its own. The stages pass
        activations without gradients, so a forward in training is refused (on every rank, before any stage
        communicates) instead of silently updating the last stage alone."""
        base = self.model
        keep_layers(base.layers, range(len(base.layers)))  # Transformers' identities (PipelineIdentityLayer)
        if not is_first_pipeline_stage(self):
            drop_input_parts(base)
        self.register_forward_pre_hook(_refuse_pipeline_training)

    def _distributed_config_of_this_model(self, distributed_config):
        """`config.distributed_config` where this model was split (`_device_mesh`, set by `parallelize` and
        `from_pretrained(distributed_config=...)`), else None: a config shared with, or copied from, a split model
        must not make a model that is whole gather or wait for other ranks when one rank saves it."""
        return distributed_config if device_mesh_of(self) is not None else None

    def gather_sharded_state_dict_for_save(self, model_to_save, state_dict, distributed_config, **kwargs):
        distributed_config = self._distributed_config_of_this_model(distributed_config)
        return super().gather_sharded_state_dict_for_save(model_to_save, state_dict, distributed_config, **kwargs)

    def barrier_after_gathered_checkpoint_save(self, distributed_config) -> None:
        super().barrier_after_gathered_checkpoint_save(self._distributed_config_of_this_model(distributed_config))

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, Experts):
            init.normal_(module.in_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
            if module.has_bias:
                init.zeros_(module.in_proj_bias)
                init.zeros_(module.down_proj_bias)
        elif isinstance(module, Gate):
            init.normal_(module.weight, mean=0.0, std=std)

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        """Transformers' `save_pretrained` into a temporary folder that then replaces `save_directory` in one step
        (hf_ppmoe.utils.atomic: a failed or killed save leaves the previous folder as it was; files of the folder
        that this save does not write, e.g. a tokenizer, are kept, earlier weight files are not), plus the code for
        `trust_remote_code=True` and the weights' SHA-256 in `checksums.sha256`. In a multi-process run only rank 0
        writes; the other ranks take part in gathering split weights."""
        if not self.should_save_on_this_rank(is_main_process):
            return super().save_pretrained(save_directory, *args, is_main_process=False, **kwargs)
        target = Path(save_directory)
        if target.is_file():
            raise ValueError(f"save_pretrained needs a directory, but {target} is a file.")
        if kwargs.get("push_to_hub") and not kwargs.get("repo_id"):
            kwargs["repo_id"] = target.name
        with atomic_folder(target, overwrite=True, keep=lambda entry: not WEIGHT_FILE.match(entry.name)) as staging:
            add_remote_code(staging, type(self), self.config)
            write_custom_generate(staging)
            result = super().save_pretrained(staging, *args, **kwargs)
            write_checksums(staging, [p.name for p in staging.iterdir() if WEIGHT_FILE.match(p.name)])
        return result

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path, *args, verify_checksums: bool = True, strict_moe: bool = True, **kwargs
    ):
        """Transformers' `from_pretrained`, with the checks of `load_guarded`. `verify_checksums=False`
        skips comparing the weight files with `checksums.sha256` (which reads every byte once more).

        A router or expert tensor that the checkpoint lacks, or holds beyond the model's, is an error naming the
        tensors (`check_moe_tensors_loaded`): Transformers would initialise it anew (or drop it) with a load report
        only, which for an MoE is another model. `strict_moe=False`, or `output_loading_info=True` (the caller then
        reads the report), keeps Transformers' behaviour."""
        wants_info = kwargs.pop("output_loading_info", False)
        token = _VERIFY_CHECKSUMS.set(verify_checksums)
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs
            )
        finally:
            _VERIFY_CHECKSUMS.reset(token)
        if strict_moe and not wants_info:
            check_moe_tensors_loaded(model, info, pretrained_model_name_or_path)
        return (model, info) if wants_info else model

    def load_guarded(self, checkpoint_files, source, subfolder: str, load: Callable):
        """Transformers' loading of the weights (`load`, through `PrivateHooks`), guarded: every weight file must lie
        inside a local checkpoint's folder (no `../`, absolute names or symlinks out of it in the shard index), match
        `checksums.sha256` when the folder has one, and hold no integer tensor where the model has a floating-point
        one; the loaded weights must be finite."""
        model = self
        files, stored = [Path(f) for f in checkpoint_files or [] if f is not None], {}
        if files:
            local = source is not None and os.path.isdir(source)
            # a Hub repository's file names were checked by huggingface_hub; its files live in one snapshot folder
            folder = Path(source, subfolder) if local else files[0].parent
            names = [os.path.relpath(f, folder) for f in files]
            if local:
                check_inside(folder, names, "weight file")
            if _VERIFY_CHECKSUMS.get():
                verify_checksums(folder, names)
            stored = stored_dtypes(f for f in files if f.suffix == ".safetensors")
            check_stored_dtypes(stored, model.state_dict(keep_vars=True))
        result = load()
        check_finite((stored[name][0], name, t) for name, t in model.state_dict().items() if name in stored)
        return result


def _is_moe_tensor(name: str, moe_prefixes: tuple[str, ...]) -> bool:
    """A tensor of an MoE layer of the model (router or experts), or one that names a router or experts."""
    return name.startswith(moe_prefixes) or not {"experts", "gate", "router"}.isdisjoint(name.split("."))


def check_moe_tensors_loaded(model, loading_info: dict, source) -> None:
    """Raise `ValueError` naming the router / expert tensors that `loading_info` (Transformers' load report) lists as
    missing from the checkpoint or unexpected in it."""
    prefixes = tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, MoELayer))
    problems = {
        what: sorted(name for name in loading_info.get(key, ()) if _is_moe_tensor(name, prefixes))
        for what, key in (("missing from the checkpoint", "missing_keys"), ("not in the model", "unexpected_keys"))
    }
    if not any(problems.values()):
        return
    listed = "; ".join(f"{what}: {', '.join(names)}" for what, names in problems.items() if names)
    raise ValueError(
        f"{source} does not hold this MoE model's router and expert weights ({listed}). Loading it would initialise "
        "those anew (or drop them) and give another model. Load the checkpoint it was saved as, or pass "
        "from_pretrained(..., strict_moe=False) to load anyway with Transformers' load report."
    )


def _refuse_pipeline_training(model, args):
    if model.training and torch.is_grad_enabled():
        raise RuntimeError(
            "Transformers' pipeline parallelism (DistributedConfig(pp_size=...)) runs inference only: its stages pass "
            "activations without gradients, so the earlier stages would never learn. Call model.eval() or use "
            "torch.no_grad(); to train with pipeline stages use hf_ppmoe.parallel.Pipeline or "
            "`python -m hf_ppmoe.training --pp_size N`."
        )
