"""`hf-ppmoe demo`'s flags (hf_ppmoe.training.demo runs it): the standard library only, so that `--help` and flag
errors print before torch is imported."""

from dataclasses import dataclass, field


@dataclass
class DemoArguments:
    output_dir: str = field(default="hf-ppmoe-demo", metadata={"help": "Where models, logs, plots and the report go.", "path": "output_folder"})
    dense_steps: int = field(default=150, metadata={"help": "Steps of dense pre-training."})
    finetune_steps: int = field(default=60, metadata={"help": "Steps of MoE (and dense) fine-tuning, per seed."})
    seeds: int = field(default=3, metadata={"help": "Fine-tuning runs of each model (data orders seed+1, seed+2, ...)."})
    batch_size: int = field(default=16, metadata={"help": "Sequences per step."})
    block_size: int = field(default=128, metadata={"help": "Tokens per sequence."})
    hidden_size: int = field(default=128, metadata={"help": "Model width."})
    num_layers: int = field(default=4, metadata={"help": "Transformer layers."})
    num_experts: int = field(default=8, metadata={"help": "Experts per MoE layer."})
    moe_layer_frequency: int = field(default=1, metadata={"help": "Every n-th FFN becomes an MoE layer (1: all; GShard and PPMoE use 2)."})
    num_experts_per_tok: int = field(default=2, metadata={"help": "Experts each token is routed to (top-k)."})
    num_beams: int = field(default=4, metadata={"help": "Beams for flat beam search."})
    learning_rate: float = field(default=2e-3, metadata={"help": "Peak learning rate of every stage."})
    seed: int = field(default=0, metadata={"help": "Random seed."})
    evaluations: int = field(default=5, metadata={"help": "Held-out evaluations per training run (evenly spaced, the last at its end)."})
    quick: bool = field(default=False, metadata={"help": "Tiny models and a few steps: every stage in seconds (a check, not a result)."})
    seq2seq: bool = field(default=False, metadata={"help": "The seq2seq demo instead: MoE vs dense Seq2Seq models trained on "
                                                   "the standard library's functions -> docstrings (steps: --finetune_steps)."})
    eval_pairs: int = field(default=100, metadata={"help": "--seq2seq: held-out pairs generated for chrF / BLEU."})

    def __post_init__(self):
        """Refuse sizes that cannot work, naming the flag (before anything is trained)."""
        for name in ("dense_steps", "finetune_steps", "seeds", "batch_size", "hidden_size", "num_layers", "num_experts",
                     "num_experts_per_tok", "moe_layer_frequency", "num_beams", "evaluations", "eval_pairs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}.")
        if self.block_size < 8:
            raise ValueError(f"--block_size must be >= 8 (the prompt and the generated tokens fit in it), got {self.block_size}.")
        if self.hidden_size % max(1, self.hidden_size // 32):
            raise ValueError(f"--hidden_size {self.hidden_size}: the model has hidden_size // 32 heads of equal width; use a "
                             "multiple of 32 (or a size below 64).")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"--num_experts_per_tok {self.num_experts_per_tok} exceeds --num_experts {self.num_experts}.")
        if self.moe_layer_frequency > self.num_layers:
            raise ValueError(f"--moe_layer_frequency {self.moe_layer_frequency} exceeds --num_layers {self.num_layers}: no FFN "
                             "would become an MoE layer.")
        if not self.learning_rate > 0:
            raise ValueError(f"--learning_rate must be > 0, got {self.learning_rate}.")
