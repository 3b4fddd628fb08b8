"""`python -m hf_ppmoe.training` / `accelerate launch -m hf_ppmoe.training`: fine-tune GPT-MoE with Accelerate; and
`MoETrainer` / `MoESeq2SeqTrainer` for Transformers' Trainer (hf_ppmoe.training.trainer); `train_tokenizer` (a
byte-level BPE tokenizer for a model of your own, trained offline on your texts) and `builtin_corpus` (hf_ppmoe.training.data).

Names load on first use (module `__getattr__`): `--help` and argument errors of the command print before torch is
imported (the arguments need only the standard library)."""

from ..utils.lazy import lazy_names

_NAMES = {"TrainArguments": "arguments", "main": "train", "MoESeq2SeqTrainer": "trainer", "MoETrainer": "trainer",
          "MoETrainerMixin": "trainer", "train_tokenizer": "data", "builtin_corpus": "data"}

__all__ = ["MoESeq2SeqTrainer", "MoETrainer", "MoETrainerMixin", "TrainArguments", "builtin_corpus", "main",
           "train_tokenizer"]


__getattr__, __dir__ = lazy_names(__name__, _NAMES)
