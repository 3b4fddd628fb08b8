"""`hf-ppmoe demo`'s flags (hf_ppmoe.demo runs it): the standard library only, so that `--help` and flag errors print
before torch is imported. The GPT demo's sizes and learning rate are not flags: they are the protocol fixed in
`hf_ppmoe/demo/protocol.py` (`CPU`) before any of its results were seen; `--tokens` sets its budget."""

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class DemoArguments:
    PATHS: ClassVar[dict] = {"output_dir": "output_folder"}  # checked before any work (utils.paths)
    output_dir: str = field(default="hf-ppmoe-demo", metadata={"help": "Where models, logs, plots, report.md and results.json go."})
    seed: int = field(default=0, metadata={"help": "The first seed; the runs use seeds seed, seed+1, ... (model initialisation and data order)."})
    seeds: int = field(default=3, metadata={"help": "Seeds: every arm is trained once per seed."})
    tokens: int = field(default=0, metadata={"help": "Training tokens per from-scratch run (0: the protocol's budget, "
                                              "2.05M; rounded to whole 100 steps of 2,048 tokens). The report says at which "
                                              "budget each claim clears its rule."})
    workers: int = field(default=0, metadata={"help": "Training runs side by side, one CPU thread each (0: one per CPU core, at most 4)."})
    parameter_bound: bool = field(default=False, metadata={"help": "Also train a dense model as wide as all the experts together "
                                                           "(the MoE's parameters at 2.6x its FLOPs; about 1.6x the run time)."})
    quick: bool = field(default=False, metadata={"help": "Tiny models and a few steps: every stage in seconds (a check, not a result)."})
    num_beams: int = field(default=4, metadata={"help": "Beams for flat beam search."})
    seq2seq: bool = field(default=False, metadata={"help": "The seq2seq demo instead: MoE vs dense Seq2Seq models trained on "
                                                   "the standard library's functions -> docstrings."})
    finetune_steps: int = field(default=60, metadata={"help": "--seq2seq: training steps of each model, per seed."})
    batch_size: int = field(default=16, metadata={"help": "--seq2seq: pairs per step."})
    block_size: int = field(default=128, metadata={"help": "--seq2seq: tokens per source."})
    hidden_size: int = field(default=128, metadata={"help": "--seq2seq: model width."})
    num_layers: int = field(default=4, metadata={"help": "--seq2seq: encoder and decoder layers."})
    num_experts: int = field(default=8, metadata={"help": "--seq2seq: experts per MoE layer."})
    num_experts_per_tok: int = field(default=2, metadata={"help": "--seq2seq: experts each token is routed to (top-k)."})
    learning_rate: float = field(default=2e-3, metadata={"help": "--seq2seq: peak learning rate of every model."})
    evaluations: int = field(default=5, metadata={"help": "--seq2seq: held-out evaluations per training run."})
    eval_pairs: int = field(default=100, metadata={"help": "--seq2seq: held-out pairs generated for chrF / BLEU."})

    def __post_init__(self):
        """Refuse sizes that cannot work, naming the flag (before anything is trained)."""
        for name in ("seeds", "num_beams", "finetune_steps", "batch_size", "hidden_size", "num_layers", "num_experts",
                     "num_experts_per_tok", "evaluations", "eval_pairs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}.")
        if not self.learning_rate > 0:
            raise ValueError(f"--learning_rate must be > 0, got {self.learning_rate}.")
        if self.tokens < 0:
            raise ValueError(f"--tokens must be >= 0 (0: the protocol's budget), got {self.tokens}.")
        if self.workers < 0:
            raise ValueError(f"--workers must be >= 0 (0: one per CPU core), got {self.workers}.")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}.")
        if self.block_size < 8:
            raise ValueError(f"--block_size must be >= 8, got {self.block_size}.")
        if self.hidden_size % max(1, self.hidden_size // 32):
            raise ValueError(f"--hidden_size {self.hidden_size}: the model has hidden_size // 32 heads of equal width; use a "
                             "multiple of 32 (or a size below 64).")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"--num_experts_per_tok {self.num_experts_per_tok} exceeds --num_experts {self.num_experts}.")
