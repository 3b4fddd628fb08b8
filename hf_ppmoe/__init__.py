"""hf_ppmoe: Mixture-of-Experts models for Hugging Face Transformers, built the Pipeline-MoE way.

Importing the package registers our configs and models with Transformers' Auto classes.
"""

import torch.distributed
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .modeling import GPTMoEConfig, GPTMoEForCausalLM, GPTMoEModel

if torch.distributed.is_available():
    from . import parallel  # registers the plan styles our configs name ("ppmoe_ffn", ...) with Transformers

__version__ = "0.1.0"

AutoConfig.register(GPTMoEConfig.model_type, GPTMoEConfig, exist_ok=True)
AutoModel.register(GPTMoEConfig, GPTMoEModel, exist_ok=True)
AutoModelForCausalLM.register(GPTMoEConfig, GPTMoEForCausalLM, exist_ok=True)

__all__ = ["GPTMoEConfig", "GPTMoEForCausalLM", "GPTMoEModel"]
