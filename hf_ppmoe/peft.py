"""LoRA on our models with PEFT, experts included (`pip install -e ".[peft]"` in a clone; hf-ppmoe is not on PyPI).

    from peft import get_peft_model
    from hf_ppmoe.peft import lora_config
    model = get_peft_model(model, lora_config(model, r=8, lora_alpha=16))

Why a helper and not a default registered for our model types: PEFT fills a `LoraConfig()` without targets from
`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING[model_type]`, and that mapping only sets `target_modules`, which
match modules (`nn.Linear`, embeddings, convolutions). Our experts are stacked 3-D parameters of one module
(`Experts.gate_up_proj [E, 2I, H]` or `up_proj [E, I, H]`, and `down_proj [E, H, I]`, Transformers' Mixtral layout);
PEFT reaches them only through `target_parameters`, which it never fills by default (PEFT 0.21). A registered default
would adapt attention and skip the experts without a word, as `target_modules="all-linear"` does, so we register none
(`LoraConfig()` keeps failing with PEFT's "Please specify `target_modules` or `target_parameters`") and `lora_config`
names both: every linear layer but the output head (PEFT's "all-linear": attention, cross-attention, dense FFNs,
shared experts) and every expert weight matrix. The routers (`Gate`, not linear layers) are left as they are.

PEFT adapts a 3-D parameter with one rank-r update per expert (`lora.ParamWrapper`; `lora_dropout` must then be 0) and
reads the `Experts.is_transposed = False` flag for the output-first layout; saving, loading (`PeftModel.from_pretrained`)
and `merge_and_unload` work as for any PEFT model (tested in tests/test_peft.py).
"""

from __future__ import annotations

from peft import LoraConfig
from torch import nn

from .moe.experts import Experts


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The stacked expert weight matrices of `model` as PEFT `target_parameters`, e.g. ["experts.down_proj",
    "experts.gate_up_proj"] (each name matches that parameter in every MoE layer); biases are not matrices and stay."""
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, Experts):
            leaf = module_name.rpartition(".")[2]
            names.update(f"{leaf}.{name}" for name, p in module.named_parameters(recurse=False) if p.dim() == 3)
    return sorted(names)


def lora_config(model: nn.Module, **kwargs) -> LoraConfig:
    """A `peft.LoraConfig` that adapts every linear layer but the output head (`target_modules="all-linear"`, unless
    given) and the experts' weights of `model` (`target_parameters`, added to any given). Other keyword arguments go
    to `LoraConfig` (r, lora_alpha, task_type, ...)."""
    experts = expert_parameter_names(model)
    if not experts:
        raise ValueError(
            f"{type(model).__name__} has no MoE experts; use peft.LoraConfig(target_modules='all-linear') directly."
        )
    kwargs.setdefault("target_modules", "all-linear")
    kwargs["target_parameters"] = sorted(set(kwargs.get("target_parameters") or []) | set(experts))
    return LoraConfig(**kwargs)


__all__ = ["expert_parameter_names", "lora_config"]
