"""Quantized experts through Transformers' own call: `from_pretrained(path, quantization_config=BitsAndBytesConfig(
load_in_4bit=True | load_in_8bit=True, ...))`, or `TorchAoConfig(...)` with one torchao config (e.g.
`Int8WeightOnlyConfig()`).

Transformers' bitsandbytes path replaces `nn.Linear` layers by `Linear4bit` / `Linear8bitLt` before the weights load
(its torchao path quantizes their weights into torchao tensors) and quantizes each weight as it arrives
(`param_needs_quantization`, `get_quantize_ops`); it does not know stacked expert weights, which would stay in full
precision without a word (as Transformers' own Qwen3-MoE's do). Our models
load their weights with a subclass of Transformers' quantizer (`weight_loading_quantizer`, called by the model's
`_load_pretrained_model` hook) whose `param_needs_quantization` also answers for every stacked expert weight and whose
quantize operation stores it quantized (`hf_ppmoe.moe.quantized`) the moment it is read from the checkpoint, so no
full-precision copy of the experts is held: Transformers' own mxfp4 path does the same for GPT-OSS's experts.
Everything else is Transformers': the attention and dense layers, the deserializers of a pre-quantized folder
(`weight`, `weight.absmax`, ... and `SCB`; torchao's), `save_pretrained`, `get_memory_footprint`,
`is_loaded_in_4bit`.

Routers stay in full precision: a gate's weight is a parameter of the `Gate` module, not an `nn.Linear`, so
Transformers' bitsandbytes path leaves it alone, and this module quantizes experts only. Rounding a router would move
tokens between experts (a top-k choice is discontinuous in the logits), a larger change than rounding an expert's
weights; the router is a tiny share of the weights anyway.

A quantization config that would leave the experts in full precision is refused by name (`check_quantization`):
another method than bitsandbytes or torchao, `llm_int8_skip_modules` (torchao: `modules_to_not_convert`) naming the
experts, `llm_int8_has_fp16_weight=True`, a torchao `FqnToConfig` (layer by layer: the experts' entry is ours to
pick, so one config is asked for).
"""

from __future__ import annotations

import torch
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
from transformers.quantizers.quantizer_bnb_8bit import Bnb8BitHfQuantizer
from transformers.quantizers.quantizer_torchao import TorchAoHfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name, should_convert_module

from ..moe.experts import Experts
from ..moe.quantized import QuantizedExpertsWeight, dequantize_experts, storage_for, store_quantized
from ..utils.integrity import check_finite

SUPPORTED = ("BitsAndBytesConfig(load_in_4bit=True) (NF4 or FP4), BitsAndBytesConfig(load_in_8bit=True), or "
             "TorchAoConfig(Int8WeightOnlyConfig())")


def stacked_weights(experts: Experts) -> dict[str, tuple[int, int, int]]:
    """The stacked weight matrices of `experts` that are quantized, by name, with their [E, O, I] shapes."""
    E, H, I = experts.num_experts, experts.hidden_dim, experts.intermediate_dim
    first = "gate_up_proj" if experts.has_gate else "up_proj"
    return {first: (E, (2 if experts.has_gate else 1) * I, H), "down_proj": (E, H, I)}


def quantization_settings(config) -> dict:
    """What `storage_for` needs: bits and bitsandbytes' 4-bit settings of a `BitsAndBytesConfig`, or the torchao config
    of a `TorchAoConfig`."""
    if config.quant_method == "torchao":
        return {"torchao": config.get_apply_tensor_subclass()}
    if config.load_in_8bit:
        return {"bits": 8}
    return {
        "bits": 4,
        "quant_type": config.bnb_4bit_quant_type,
        "compress_statistics": config.bnb_4bit_use_double_quant,
        "quant_storage": config.bnb_4bit_quant_storage,
    }


def check_quantization(model, config) -> None:
    """Refuse, by name, a quantization config under which the experts would not be stored quantized."""
    name = type(model).__name__
    method = getattr(config.quant_method, "value", config.quant_method)
    if method == "torchao":
        return check_torchao(model, config)
    if method != "bitsandbytes":
        raise ValueError(
            f"{name} cannot honour quantization_config with quant_method={method!r}: Transformers' {method} path "
            f"quantizes nn.Linear layers and would leave the MoE experts, most of the weights, in full precision. Use "
            f"{SUPPORTED}."
        )
    if config.load_in_8bit and config.llm_int8_has_fp16_weight:
        raise ValueError(
            f"{name}: BitsAndBytesConfig(llm_int8_has_fp16_weight=True) keeps float16 weights beside the int8 ones; the "
            "experts are stored int8 only. Drop llm_int8_has_fp16_weight (or load without quantization_config)."
        )
    check_skipped(model, config.llm_int8_skip_modules, "llm_int8_skip_modules")


def check_torchao(model, config) -> None:
    from torchao.quantization import FqnToConfig

    if isinstance(config.quant_type, FqnToConfig):
        raise ValueError(
            f"{type(model).__name__}: TorchAoConfig with an FqnToConfig names layers one by one; the experts are "
            "quantized with the model's one config. Give TorchAoConfig a single config (e.g. Int8WeightOnlyConfig())."
        )
    check_skipped(model, config.modules_to_not_convert, "modules_to_not_convert")


def check_skipped(model, skip, option: str) -> None:
    """Refuse a list of modules to leave in full precision that names the experts or a module holding them."""
    if skip:
        skipped = [
            path for path, module in model.named_modules() if isinstance(module, Experts)
            and any(not should_convert_module(name, skip) for name in (path, *(f"{path}.{w}" for w in stacked_weights(module))))
        ]
        if skipped:
            raise ValueError(
                f"{type(model).__name__}: {option}={list(skip)} names the experts ({', '.join(skipped[:3])}"
                f"{', ...' if len(skipped) > 3 else ''}), which would leave them in full precision; the experts are "
                "always quantized with the model. Remove those entries (routers are never quantized), or load without "
                "quantization_config."
            )


class _QuantizesExperts:
    """The part our quantizers add to Transformers' bitsandbytes quantizers: stacked expert weights need quantizing too
    (on the fly, `QuantizeExperts`), and a pre-quantized expert storage's `weight` is already in its packed shape."""

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module, name = get_module_from_name(model, param_name)
        if isinstance(module, Experts):
            return name in stacked_weights(module)
        if isinstance(module, QuantizedExpertsWeight):
            return name == "weight"
        return super().param_needs_quantization(model, param_name, **kwargs)

    def get_quantize_ops(self):
        return QuantizeExperts(self, super().get_quantize_ops())


class ExpertsBnb4BitHfQuantizer(_QuantizesExperts, Bnb4BitHfQuantizer):
    """Transformers' 4-bit bitsandbytes quantizer, experts included."""


class ExpertsBnb8BitHfQuantizer(_QuantizesExperts, Bnb8BitHfQuantizer):
    """Transformers' 8-bit bitsandbytes quantizer, experts included."""


class ExpertsTorchAoHfQuantizer(_QuantizesExperts, TorchAoHfQuantizer):
    """Transformers' torchao quantizer, experts included."""


class QuantizeExperts(ConversionOps):
    """Transformers' quantize operation for one weight read from a full-precision checkpoint: a stacked expert weight
    becomes its quantized storage on the experts module (nothing left for the loader to set, as in Transformers'
    mxfp4 path); any other weight goes to Transformers' own bitsandbytes operation."""

    def __init__(self, hf_quantizer, others: ConversionOps):
        self.hf_quantizer, self.others = hf_quantizer, others

    def convert(self, input_dict, model=None, full_layer_name=None, missing_keys=None, **kwargs):
        experts, name = get_module_from_name(model, full_layer_name)
        if not isinstance(experts, Experts):
            return self.others.convert(input_dict, model=model, full_layer_name=full_layer_name, missing_keys=missing_keys, **kwargs)
        (value,) = input_dict.values()
        value = value[0] if isinstance(value, list) else value
        check_finite([(str(model.config.name_or_path), full_layer_name, value)])
        storage = storage_for(stacked_weights(experts)[name], **quantization_settings(self.hf_quantizer.quantization_config))
        storage.quantize_(value)
        store_quantized(experts, name, storage)
        if missing_keys is not None:
            missing_keys.discard(full_layer_name)
        return {}


def weight_loading_quantizer(model, hf_quantizer):
    """The quantizer `model` loads its weights with: Transformers' bitsandbytes quantizer taught the experts. A
    pre-quantized checkpoint's expert storage is declared first (on the meta device), so Transformers' deserializers
    fill it by name."""
    config = hf_quantizer.quantization_config
    check_quantization(model, config)
    if config.quant_method == "torchao":
        cls = ExpertsTorchAoHfQuantizer
    else:
        cls = ExpertsBnb8BitHfQuantizer if config.load_in_8bit else ExpertsBnb4BitHfQuantizer
    quantizer = cls.__new__(cls)  # the same quantizer's state (its config, modules_to_not_convert, ...) in our class
    quantizer.__dict__.update(vars(hf_quantizer))
    if hf_quantizer.pre_quantized:
        settings = quantization_settings(config)
        for experts in model.modules():
            if isinstance(experts, Experts):
                for name, shape in stacked_weights(experts).items():
                    store_quantized(experts, name, storage_for(shape, **settings))
    return quantizer


def dequantize_model_experts(model, dtype: torch.dtype | None) -> None:
    """Every quantized expert weight of `model` back to a plain parameter (`PreTrainedModel.dequantize`)."""
    for module in model.modules():
        if isinstance(module, Experts):
            dequantize_experts(module, dtype)


__all__ = ["ExpertsBnb4BitHfQuantizer", "ExpertsBnb8BitHfQuantizer", "check_quantization", "weight_loading_quantizer"]
