"""hf_ppmoe: Mixture-of-Experts models for Hugging Face Transformers, built the Pipeline-MoE way.

Importing the package registers our configs and models with Transformers' Auto classes.
"""

import torch.distributed
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM

from .modeling import (
    GPTMoEConfig,
    GPTMoEForCausalLM,
    GPTMoEModel,
    Seq2SeqMoEConfig,
    Seq2SeqMoEForConditionalGeneration,
    Seq2SeqMoEModel,
)

if torch.distributed.is_available():
    from . import parallel  # registers the plan styles our configs name ("ppmoe_ffn", ...) with Transformers

__version__ = "0.1.0"

AutoConfig.register(GPTMoEConfig.model_type, GPTMoEConfig, exist_ok=True)
AutoModel.register(GPTMoEConfig, GPTMoEModel, exist_ok=True)
AutoModelForCausalLM.register(GPTMoEConfig, GPTMoEForCausalLM, exist_ok=True)

AutoConfig.register(Seq2SeqMoEConfig.model_type, Seq2SeqMoEConfig, exist_ok=True)
AutoModel.register(Seq2SeqMoEConfig, Seq2SeqMoEModel, exist_ok=True)
AutoModelForSeq2SeqLM.register(Seq2SeqMoEConfig, Seq2SeqMoEForConditionalGeneration, exist_ok=True)

__all__ = [
    "GPTMoEConfig",
    "GPTMoEForCausalLM",
    "GPTMoEModel",
    "Seq2SeqMoEConfig",
    "Seq2SeqMoEForConditionalGeneration",
    "Seq2SeqMoEModel",
]
