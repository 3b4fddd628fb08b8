"""Checkpoint converters: dense -> MoE (`upcycle`), MoE -> dense (`merge_experts`),
MoE imports (`import_moe`), for decoders (GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE <-> GPT-MoE;
architectures.py) and encoder-decoders (T5, Switch Transformers <-> Seq2Seq-MoE; t5.py); exports to Transformers' own
MoE classes where a model fits one exactly (`export_moe`: Mixtral, Qwen2-MoE, Qwen3-MoE, Switch Transformers;
export.py); `megatron_checkpoint.py`: GPT-MoE <-> Megatron-LM weights.

Each conversion is a chain of declarative, reversible weight-name tables (`mapping.py`) applied lazily to a source
read with `safe_open`, checked whole on meta tensors, and written tensor by tensor into a temporary folder that is
renamed into place at the end.
"""

from .architectures import ARCHITECTURES, Architecture, get_architecture
from .export import TARGETS, export_moe, export_reasons
from .mapping import ConversionError, Mapping, Rule
from .merge import MERGE_METHODS, expert_usage, merge_experts
from .upcycle import ROUTER_INITS, expert_output_scale, experts_mapping, gate_renormalizes, import_moe, moe_ffns, upcycle

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "ConversionError",
    "MERGE_METHODS",
    "Mapping",
    "ROUTER_INITS",
    "Rule",
    "TARGETS",
    "expert_output_scale",
    "expert_usage",
    "export_moe",
    "export_reasons",
    "experts_mapping",
    "gate_renormalizes",
    "get_architecture",
    "import_moe",
    "merge_experts",
    "moe_ffns",
    "upcycle",
]
