"""Every foreign architecture the converters know, by model_type: each family's records (adapter.Architecture),
declared with all their facts in the family's module.

Dense sources are upcycled and merged back into; MoE architectures are imported, exported, or both (Qwen2-MoE:
export only), and an imported one merges into its dense twin.
"""

from __future__ import annotations

from . import glm4_moe, gpt2, llama, mixtral, qwen_moe, t5
from .adapter import Architecture
from .mapping import ConversionError

_FAMILIES = (gpt2, llama, mixtral, qwen_moe, glm4_moe, t5)
ARCHITECTURES: dict[str, Architecture] = {  # dense sources first
    a.model_type: a for a in sorted((a for family in _FAMILIES for a in family.ARCHITECTURES), key=lambda a: a.moe)
}


def _role(arch: Architecture) -> str | None:
    if not arch.moe:
        return "dense"
    return "moe" if arch.fields is not None else None  # an export target ours cannot be read from


def supported() -> str:
    dense = ", ".join(f"{a.model_type} ({a.class_name})" for a in ARCHITECTURES.values() if _role(a) == "dense")
    moe = ", ".join(f"{a.model_type} ({a.class_name})" for a in ARCHITECTURES.values() if _role(a) == "moe")
    return f"dense sources (upcycle, merge_experts): {dense}; MoE sources (import_moe): {moe}"


def get_architecture(model_type: str | None, *, moe: bool) -> Architecture:
    """The architecture of a source to upcycle (or a dense model to merge into), or, `moe`, of one to import."""
    arch = ARCHITECTURES.get(model_type)
    role = _role(arch) if arch is not None else None
    if role != ("moe" if moe else "dense"):
        kind = "MoE source to import" if moe else "dense source to upcycle"
        if role is not None:
            hint = "use import_moe / `hf-ppmoe import`" if role == "moe" else "use upcycle / `hf-ppmoe upcycle`"
            raise ConversionError(f"{model_type!r} is not a {kind}; {hint}. Supported: {supported()}.")
        raise ConversionError(f"Unsupported architecture {model_type!r} as a {kind}. Supported: {supported()}.")
    return arch


__all__ = ["ARCHITECTURES", "Architecture", "get_architecture", "supported"]
