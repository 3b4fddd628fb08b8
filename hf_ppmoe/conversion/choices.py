"""The names and sizes the converters accept, in one light module (the standard library only): `hf-ppmoe upcycle|merge|export
--help` lists them, and their argument errors print, before torch is imported."""

import math

ROUTER_INITS = ("zeros", "random", "hidden")
MERGE_METHODS = ("mean", "usage", "expert")
# export targets: model_type -> Transformers class (export.TARGETS adds how each one is checked, configured and mapped)
EXPORT_CLASSES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "switch_transformers": "SwitchTransformersForConditionalGeneration",
}


def default_experts_per_token(router_type: str, num_experts_per_tok: int | None) -> int:
    """Routes per token when none is given: 1 for the switch gate, else 2."""
    if num_experts_per_tok is not None:
        return num_experts_per_tok
    return 1 if router_type == "switch" else 2


def parse_size(size: int | str) -> int:
    """5000000, "5GB", "500MB", "2GiB" -> bytes."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    unit = next((u for u in units if text.endswith(u)), "")
    try:
        number = float(text[: len(text) - len(unit)])
    except ValueError:
        number = math.nan
    if not number > 0 or math.isinf(number):
        raise ValueError(f"max_shard_size {size!r}: give a size such as 5GB, 500MB or 2GiB, or a number of bytes.")
    return int(number * units.get(unit, 1))
