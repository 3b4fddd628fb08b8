"""The model families (Transformers `PreTrainedModel` classes)."""

from .configuration_gpt_moe import GPTMoEConfig
from .configuration_seq2seq_moe import Seq2SeqMoEConfig
from .modeling_gpt_moe import GPTMoEForCausalLM, GPTMoEModel, GPTMoEPreTrainedModel
from .modeling_seq2seq_moe import Seq2SeqMoEForConditionalGeneration, Seq2SeqMoEModel, Seq2SeqMoEPreTrainedModel

__all__ = [
    "GPTMoEConfig",
    "GPTMoEForCausalLM",
    "GPTMoEModel",
    "GPTMoEPreTrainedModel",
    "Seq2SeqMoEConfig",
    "Seq2SeqMoEForConditionalGeneration",
    "Seq2SeqMoEModel",
    "Seq2SeqMoEPreTrainedModel",
]
