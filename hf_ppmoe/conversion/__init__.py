"""Checkpoint converters: dense -> MoE (`upcycle`), MoE -> dense (`merge_experts`), MoE imports (`import_moe`) and
exports to Transformers' own MoE classes where a model fits one exactly (`export_moe`), for decoders (GPT-MoE) and
encoder-decoders (Seq2Seq-MoE). Each foreign architecture is one record of its config fields and weight names, both
ways, in its family's module (adapter.py says what a record holds; architectures.py lists them). GPT-MoE <->
Megatron-LM weights: hf_ppmoe.megatron.

Each conversion is a chain of declarative, reversible weight-name tables (`mapping.py`) applied lazily to a source
read with `safe_open`, checked whole on meta tensors, and written tensor by tensor into a temporary folder that is
renamed into place at the end.

Names load on first use (module `__getattr__`): `hf-ppmoe upcycle|merge|import|export --help` and their argument
errors print before torch is imported (commands.py and choices.py need only the standard library).
"""

from ..utils.lazy import lazy_names

_NAMES = {
    "ARCHITECTURES": "architectures", "Architecture": "adapter", "get_architecture": "architectures",
    "TARGETS": "export", "export_moe": "export", "export_reasons": "export",
    "ConversionError": "mapping", "Mapping": "mapping", "Rule": "mapping",
    "MERGE_METHODS": "choices", "ROUTER_INITS": "choices",
    "expert_usage": "merge", "merge_experts": "merge",
    "expert_output_scale": "upcycling", "experts_mapping": "upcycling", "gate_renormalizes": "upcycling",
    "import_moe": "upcycling", "moe_ffns": "upcycling", "upcycle": "upcycling", "upcycled_config": "upcycling",
}

__all__ = sorted(_NAMES)


__getattr__, __dir__ = lazy_names(__name__, _NAMES)
