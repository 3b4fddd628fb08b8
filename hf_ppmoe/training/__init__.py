"""`python -m hf_ppmoe.training` / `accelerate launch -m hf_ppmoe.training`: fine-tune GPT-MoE with Accelerate; and
`MoETrainer` / `MoESeq2SeqTrainer` for Transformers' Trainer (hf_ppmoe.training.trainer)."""

from .arguments import TrainArguments
from .train import main
from .trainer import MoESeq2SeqTrainer, MoETrainer, MoETrainerMixin

__all__ = ["MoESeq2SeqTrainer", "MoETrainer", "MoETrainerMixin", "TrainArguments", "main"]
