"""`python -m hf_ppmoe.training` / `accelerate launch -m hf_ppmoe.training`: fine-tune GPT-MoE with Accelerate."""

from .arguments import TrainArguments
from .train import main

__all__ = ["TrainArguments", "main"]
