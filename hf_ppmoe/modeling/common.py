"""Pieces shared by both model families: norms, MoE loss aggregation, and the `save_pretrained` that makes a
checkpoint folder self-contained for `trust_remote_code=True`.

Transformers' remote-code loader copies a model's modeling/configuration files and, recursively, only the files
they import with `from .name import ...` from the same folder. Our modules live in a package tree
(`hf_ppmoe/moe/...`, `hf_ppmoe/modeling/...`), so `save_pretrained` writes a flattened copy of every module the
model needs (`hf_ppmoe/moe/layer.py` -> `moe_layer.py`, imports rewritten to `from .moe_layer import ...`) and the
`auto_map` that points at them. The same code runs again from such a flattened folder, where names are already flat.
It also writes `custom_generate/generate.py` (flat beam search), which Transformers picks up with
`trust_remote_code=True`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init

from ..generation.flat_beam_search import generate as flat_beam_generate
from ..moe.experts import Experts
from ..moe.gates import Gate
from ..moe.layer import MoELayer


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


def mean_router_losses(routings) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Aux and z losses averaged over the MoE layers (so the coefficients do not depend on depth)."""
    if not routings or routings[0].aux_loss is None:  # none, or computed without losses (inference)
        return None, None
    aux = torch.stack([r.aux_loss for r in routings]).mean()
    z = torch.stack([r.z_loss for r in routings]).mean()
    return aux, z


def router_loss_weight(targets: torch.Tensor, num_items_in_batch: torch.Tensor | int | None) -> torch.Tensor | float:
    """The weight of one forward's router losses in its `loss`: 1, or its share of the label tokens (`targets`, -100
    ignored) when the LM loss is normalised by `num_items_in_batch`, the label tokens of a whole optimizer step.

    Transformers' Trainer passes `num_items_in_batch` (all micro-batches of gradient accumulation, and all data-parallel
    replicas unless `average_tokens_across_devices=False`), adds up the micro-batches' losses without dividing by the
    accumulation steps, and multiplies each by the replica count, which the replicas' gradient averaging undoes. A
    router loss added in full would so count once per micro-batch and replica; weighted by the token share, one step's
    router losses add up to their token-weighted mean over micro-batches and replicas: the plain mean our own training
    loop takes when every micro-batch holds as many label tokens, whatever the accumulation and replica counts."""
    if num_items_in_batch is None:
        return 1.0
    return (targets != -100).sum() / num_items_in_batch


_RELATIVE_IMPORT = re.compile(r"^(\s*)from\s+(\.+[\w.]*)\s+import\s", flags=re.MULTILINE)
_WEIGHT_FILE = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")


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


class MoEPreTrainedModel(PreTrainedModel):
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
        """Transformers' `save_pretrained`, written into a temporary folder first and moved into place only once
        complete (a failed save leaves the target untouched), plus the code for `trust_remote_code=True`. In a
        multi-process run only rank 0 writes; the other ranks take part in gathering split weights."""
        if not self.should_save_on_this_rank(is_main_process):
            return super().save_pretrained(save_directory, *args, is_main_process=False, **kwargs)
        target = Path(save_directory)
        if target.is_file():
            raise ValueError(f"save_pretrained needs a directory, but {target} is a file.")
        if kwargs.get("push_to_hub") and not kwargs.get("repo_id"):
            kwargs["repo_id"] = target.name
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.saving-", dir=target.parent))
        try:
            add_remote_code(staging, type(self), self.config)
            write_custom_generate(staging)
            result = super().save_pretrained(staging, *args, **kwargs)
            target.mkdir(exist_ok=True)
            new_files = {p.name for p in staging.iterdir()}
            for stale in target.iterdir():  # weights of an earlier save that this one does not overwrite
                if stale.is_file() and _WEIGHT_FILE.match(stale.name) and stale.name not in new_files:
                    stale.unlink()
            for item in staging.iterdir():
                destination = target / item.name
                if destination.is_dir():
                    shutil.rmtree(destination)
                os.replace(item, destination)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return result
