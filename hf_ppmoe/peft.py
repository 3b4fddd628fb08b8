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
and `merge_and_unload` work as for any PEFT model (tested in tests/test_peft.py). The routers stay frozen, in full
precision; `modules_to_save=["gate"]` trains them whole (E x H numbers a layer).

QLoRA on quantized experts (`from_pretrained(..., quantization_config=BitsAndBytesConfig(...))`, then
`peft.prepare_model_for_kbit_training`): a quantized expert weight is a parametrization (hf_ppmoe.moe.quantized), and
PEFT 0.21's `ParamWrapper` mishandles a LoRA term stacked on one (it removes only its multi-adapter proxy, so its
single-adapter one stays and is added again each forward pass; nested wrappers read a cached value without their term).
`lora_config` of such a model therefore registers `ParamWrapper` for the experts through PEFT's custom-module
API: PEFT's `ParamWrapper` (same adapters, same names in the saved adapter) whose LoRA term is added to the
dequantized weights and removed exactly after each forward pass. An adapter is loaded on a quantized model with
`load_adapter` (PEFT's own `PeftModel.from_pretrained` would use its wrapper; the experts refuse it by name). Merging
into 4-bit weights would round the adapter away, so a QLoRA adapter merges into the dequantized model:
`model.dequantize()`, then `PeftModel.from_pretrained(...)` and `merge_and_unload()` (docs/quantization.md).
"""

from __future__ import annotations

from contextlib import contextmanager

from peft import LoraConfig, PeftModel
from peft.tuners import lora
from torch import nn

from .moe.experts import Experts
from .moe.quantized import LowRankDelta, add_delta, is_quantized, remove_delta


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The stacked expert weight matrices of `model` as PEFT `target_parameters`, by full name (e.g.
    "model.layers.0.mlp.experts.gate_up_proj"): PEFT matches a parametrized weight (a quantized one,
    hf_ppmoe.moe.quantized) only by its module's full name, so an adapter's config holds names that match on a
    full-precision and on a quantized base alike. Biases are not matrices and stay."""
    names = []
    for module_name, module in model.named_modules():
        if isinstance(module, Experts):
            stacked = {name for name, p in module.named_parameters(recurse=False) if p.dim() == 3}
            stacked |= set(getattr(module, "parametrizations", None) or ())  # quantized (hf_ppmoe.moe.quantized)
            names.extend(f"{module_name}.{name}" for name in stacked)
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
    config = LoraConfig(**kwargs)
    if has_quantized_experts(model):
        config._register_custom_module({Experts: ParamWrapper})
    return config


def has_quantized_experts(model: nn.Module) -> bool:
    return any(
        isinstance(m, Experts) and any(is_quantized(m, n) for n in (getattr(m, "parametrizations", None) or ()))
        for m in model.modules()
    )


def load_adapter(model: nn.Module, adapter, **kwargs) -> PeftModel:
    """`PeftModel.from_pretrained(model, adapter, **kwargs)`, with `ParamWrapper` for quantized experts."""
    config = LoraConfig.from_pretrained(adapter)
    if has_quantized_experts(model):
        config._register_custom_module({Experts: ParamWrapper})
    return PeftModel.from_pretrained(model, adapter, config=config, **kwargs)


class ParamWrapper(lora.ParamWrapper):
    """PEFT's `ParamWrapper` for a stacked expert weight stored quantized (PEFT recognises its wrappers by this class
    name, nested ones included, so it keeps it): during a forward pass the adapters' term is
    a `LowRankDelta` parametrization on top of the storage's (the dequantized weights plus `scaling * B_e @ A_e` for
    every expert e), removed exactly afterwards. Training, saving and `disable_adapter` are PEFT's; merging into the
    quantized weights is refused (dequantize the model first)."""

    @contextmanager
    def _activate_lora(self, active_adapters):
        adapters = [a for a in active_adapters if a in self.lora_A]
        if not adapters:
            yield
            return
        base, delta = self.get_base_layer(), LowRankDelta([self._factors(a) for a in adapters])
        add_delta(base, self.parameter_name, delta)
        try:
            yield
        finally:
            remove_delta(base, self.parameter_name, delta)

    def _factors(self, adapter: str):
        """(lhs [E, O, r], rhs [E, r, I], scaling) of `adapter` (PEFT's per-expert split of its lora_A / lora_B)."""
        E = self.num_experts
        A, B = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        return B.reshape(B.shape[0], -1, E).permute(2, 0, 1), A.reshape(E, -1, A.shape[-1]), self.scaling[adapter]

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        if is_quantized(self.get_base_layer(), self.parameter_name):
            raise ValueError(
                f"The experts' {self.parameter_name} is stored quantized: a merged LoRA term would be rounded away. "
                "Dequantize the base model first (model.dequantize()), load the adapter on it, then merge_and_unload()."
            )
        super().merge(safe_merge=safe_merge, adapter_names=adapter_names)


__all__ = ["ParamWrapper", "expert_parameter_names", "has_quantized_experts", "load_adapter", "lora_config"]
