"""The model families (Transformers `PreTrainedModel` classes)."""

from .configuration_gpt_moe import GPTMoEConfig
from .modeling_gpt_moe import GPTMoEForCausalLM, GPTMoEModel, GPTMoEPreTrainedModel

__all__ = ["GPTMoEConfig", "GPTMoEForCausalLM", "GPTMoEModel", "GPTMoEPreTrainedModel"]
