"""Arguments of `python -m hf_ppmoe.training` / `accelerate launch -m hf_ppmoe.training`, checked before any work:
the flags on their own when they are parsed (before torch is imported), the files and the Hub in `validate`."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import ClassVar
from pathlib import Path

from ..conversion.choices import BUILTIN_GATES, ROUTER_INITS, default_experts_per_token, routing_problem
from .data import SAMPLE_BY


@dataclass
class TrainArguments:
    # path kinds, checked before any work (utils.paths); "latest" is a word --resume takes, not a path
    PATHS: ClassVar[dict] = {
        "model_name_or_path": "model", "config_name": "input_file", "upcycle_from": "model", "tokenizer_name": "model",
        "train_file": "input_file", "validation_file": "input_file", "dataset_name": "model",
        "data_cache_dir": "output_folder", "output_dir": "output_folder", "resume": ("input_folder", ("latest",)),
    }
    # ---- model: exactly one of model_name_or_path / config_name / upcycle_from (none: a small default GPT-MoE)
    model_name_or_path: str | None = field(default=None, metadata={"help": "Folder or Hub id of a causal LM (GPT-MoE or dense) to continue training."})
    config_name: str | None = field(default=None, metadata={"help": "config.json of a causal LM (GPT-MoE or dense): train from scratch."})
    upcycle_from: str | None = field(default=None, metadata={"help": "Dense checkpoint (GPT-2, Llama, ...) to upcycle."})
    num_experts: int = field(default=8, metadata={"help": "Experts per MoE layer (upcycling / default model)."})
    num_experts_per_tok: int | None = field(default=None, metadata={"help": "Routes per token (upcycling / default model; default: 1 for switch, else 2)."})
    router_type: str = field(default="topk", metadata={"help": f"Gate for upcycling / the default model: {', '.join(BUILTIN_GATES)}."})
    router_init: str = field(default="auto", metadata={"help": "Upcycled router: auto, zeros or random (as hf-ppmoe upcycle --router_init; auto: random where that is exact, topk and gshard, else zeros)."})
    noise_std: float = field(default=0.0, metadata={"help": "Upcycling: std of the noise added to each expert copy (0: exact copies), as `hf-ppmoe upcycle --noise_std`."})
    expert_noise_std: float | None = field(default=None, metadata={"help": "Deprecated name of --noise_std."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer folder (default: the model's)."})
    chat_template: str | None = field(default=None, metadata={"help": "Give the saved tokenizer a chat template (chat completions, `hf-ppmoe serve`): chatml, a .jinja file, or Jinja text."})

    # ---- data (block_data.py): files, a `datasets` dataset, or the built-in corpus; prepared once into a cache, or streamed
    train_file: list[str] | None = field(default=None, metadata={"help": "Files or globs of shards: .txt (see --sample_by), .jsonl/.json, .csv or .parquet."})
    sample_by: str = field(default=SAMPLE_BY[0], metadata={"help": "What a document of a .txt file is: document (the whole file; right for code and prose), paragraph (lines between blank lines) or line.", "choices": list(SAMPLE_BY)})
    validation_file: list[str] | None = field(default=None, metadata={"help": "Held-out files (default: --validation_split_percentage of train)."})
    validation_split_percentage: int = field(default=5, metadata={"help": "Without --validation_file: the last N%% of the training blocks (with --streaming: the documents whose CRC-32 %% 100 < N) are held out."})
    dataset_name: str | None = field(default=None, metadata={"help": "A folder written by Dataset.save_to_disk, or a `datasets` dataset name (the local cache; streamed from the Hub with --streaming)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its configuration name."})
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})
    text_column: str = field(default="text", metadata={"help": "Field holding the text (jsonl / datasets)."})
    block_size: int = field(default=128, metadata={"help": "Tokens per packed training sequence."})
    streaming: bool = field(default=False, metadata={"help": "Pack the documents on the fly (corpora larger than RAM or disk) instead of preparing them into the cache; each data-parallel rank reads its own part, and the stream position is saved in every checkpoint."})
    shuffle_buffer_size: int = field(default=1000, metadata={"help": "--streaming: blocks drawn at random from a buffer of this many."})
    data_cache_dir: str | None = field(default=None, metadata={"help": "Where prepared blocks are cached (default: HF_DATASETS_CACHE/hf_ppmoe_blocks)."})
    # ---- seq2seq data (a Seq2Seq-MoE / encoder-decoder model; none given: the built-in standard-library task)
    source_column: str = field(default="source", metadata={"help": "Seq2seq: the column of the source texts (jsonl / csv / parquet / datasets)."})
    target_column: str = field(default="target", metadata={"help": "Seq2seq: the column of the target texts."})
    source_lang: str | None = field(default=None, metadata={"help": "Seq2seq translation records ({'translation': {lang: text}}): source language."})
    target_lang: str | None = field(default=None, metadata={"help": "Seq2seq translation records: target language."})
    max_source_length: int = field(default=256, metadata={"help": "Seq2seq: source tokens kept (EOS included)."})
    max_target_length: int = field(default=64, metadata={"help": "Seq2seq: target tokens kept (EOS included); also the generation limit."})
    generation_num_beams: int = field(default=4, metadata={"help": "Seq2seq: beams of the flat beam search that generates for chrF / BLEU."})
    generation_eval_pairs: int = field(default=64, metadata={"help": "Seq2seq: validation pairs generated for chrF / BLEU at the end (0: all)."})

    # ---- optimisation
    output_dir: str = field(default="hf-ppmoe-run", metadata={"help": "Checkpoints, logs, plots and the final model."})
    max_steps: int = field(default=100, metadata={"help": "Optimizer steps."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Sequences per process per micro-step."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-steps per optimizer step (with --pp_size: the pipeline's microbatches)."})
    learning_rate: float = field(default=1e-3, metadata={"help": "Peak AdamW learning rate."})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    warmup_steps: int = field(default=10, metadata={"help": "Linear warm-up steps."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Transformers scheduler name (cosine, linear, constant_with_warmup, ...)."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping (0 disables)."})
    mixed_precision: str = field(default="no", metadata={"help": "no, bf16 or fp16 (where the hardware has it)."})
    seed: int = field(default=0, metadata={"help": "Seed for initialisation, data order and dropout."})

    # ---- evaluation, logging, checkpoints
    eval_steps: int = field(default=50, metadata={"help": "Evaluate every N steps (and at the end)."})
    eval_batches: int = field(default=8, metadata={"help": "Validation batches per evaluation (0: all)."})
    logging_steps: int = field(default=1, metadata={"help": "Log metrics every N steps."})
    checkpointing_steps: int = field(default=0, metadata={"help": "Save Accelerate state every N steps (0: never)."})
    resume: str | None = field(default=None, metadata={"help": "'latest' (the newest checkpoint of the run that last trained in output_dir) or a checkpoint folder to continue from."})
    allow_resume_changes: list[str] | None = field(default=None, metadata={"help": "Resume although these settings differ from the checkpoint's (names as the refusal lists them, e.g. learning_rate max_steps config.router_type data); the changes are logged."})
    report_to: list[str] = field(default_factory=lambda: ["jsonl"], metadata={"help": "Trackers: jsonl plus any Accelerate tracker (tensorboard, wandb, ...)."})
    plots: bool = field(default=True, metadata={"help": "Write PNG plots of loss and expert load at the end."})
    push_to_hub: bool = field(default=False, metadata={"help": "Push the final model to the Hub."})
    hub_model_id: str | None = field(default=None, metadata={"help": "Hub repository (default: output_dir's name)."})

    # ---- parallelism beyond data parallel (hf_ppmoe.parallel)
    tp_size: int = field(default=1, metadata={"help": "Tensor-parallel size; experts spread over it (PPMoE); WORLD_SIZE / tp_size replicas."})
    pp_size: int = field(default=1, metadata={"help": "Pipeline stages (GPT-MoE): layers cut into pp_size stages, the micro-steps are the pipeline's microbatches; WORLD_SIZE / (pp_size * tp_size) replicas."})
    fsdp_size: int = field(default=1, metadata={"help": "Processes that shard parameters, gradients and AdamW state (FSDP2); the other WORLD_SIZE / (fsdp_size * pp_size * tp_size) data-parallel processes are replicas of them (HSDP)."})
    fsdp_reshard_after_forward: bool = field(default=True, metadata={"help": "FSDP2: free each layer's gathered parameters after its forward (--no_fsdp_reshard_after_forward: keep them until its backward, as FSDP1's SHARD_GRAD_OP / ZeRO-2: more memory, fewer all-gathers)."})
    ep_size: int | None = field(default=None, metadata={"help": "Processes every MoE layer's experts are split over (default tp_size: PPMoE on the tensor-parallel group). A multiple k * tp_size, with k dividing fsdp_size, spreads them over k tensor-parallel groups that read different batches (Transformers' all-to-all)."})

    def __post_init__(self):
        if self.expert_noise_std is not None:
            warnings.warn("--expert_noise_std is deprecated; use --noise_std (the name upcycle and `hf-ppmoe upcycle` use).",
                          FutureWarning, stacklevel=3)
            self.noise_std, self.expert_noise_std = self.expert_noise_std, None
        if self.chat_template is not None:
            from ..utils.chat_template import chat_template_text

            chat_template_text(self.chat_template)  # an unknown name or a missing file: refused before any work
        if self.train_file is not None and isinstance(self.train_file, str):
            self.train_file = [self.train_file]
        if self.validation_file is not None and isinstance(self.validation_file, str):
            self.validation_file = [self.validation_file]
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        self.check_flags()
        self.num_experts_per_tok = default_experts_per_token(self.router_type, self.num_experts_per_tok)

    def validate(self) -> None:
        """Raise ValueError naming the argument and the fix, before any model or data is built: the flags
        (`check_flags`), then the files they name and, for --push_to_hub, the Hub."""
        self.check_flags()
        for name in ("config_name",):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"--{name} {path} does not exist; pass a JSON file written by config.save_pretrained.")
        from .data import data_files

        for files in (self.train_file, self.validation_file):
            if files:
                data_files(files)
        if self.resume and self.resume != "latest" and not Path(self.resume).is_dir():
            raise ValueError(f"--resume {self.resume}: no such checkpoint folder (or use --resume latest).")
        self._check_sources()
        if self.push_to_hub:
            self._check_hub_login()

    def check_flags(self) -> None:
        """Raise ValueError, naming the flag and the fix, for values that cannot work whatever the files hold: run
        when the flags are parsed, so that the command refuses them before it imports torch."""
        sources = [n for n in ("model_name_or_path", "config_name", "upcycle_from") if getattr(self, n)]
        if len(sources) > 1:
            raise ValueError(f"Give only one of --model_name_or_path, --config_name, --upcycle_from (got {', '.join(sources)}).")
        if self.train_file and self.dataset_name:
            raise ValueError("Give either --train_file or --dataset_name, not both.")
        if self.sample_by not in SAMPLE_BY:
            raise ValueError(f"--sample_by {self.sample_by}: use one of {', '.join(SAMPLE_BY)}.")
        if not 0 <= self.validation_split_percentage < 100:
            raise ValueError(f"--validation_split_percentage must be in [0, 100), got {self.validation_split_percentage}.")
        positive = ("shuffle_buffer_size", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "tp_size", "pp_size",
                    "fsdp_size", "eval_steps", "logging_steps", "max_source_length", "max_target_length", "generation_num_beams")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}.")
        if self.model_name_or_path is None and self.config_name is None:  # upcycling or the default model
            if self.router_init == "hidden":
                raise ValueError("--router_init hidden reads one sample text per expert, which training does not take: "
                                 "upcycle first (hf-ppmoe upcycle SRC OUT --router_init hidden --sample_file FILE), "
                                 "then train OUT with --model_name_or_path.")
            if self.router_init not in ROUTER_INITS:
                raise ValueError(f"--router_init {self.router_init}: use one of auto, zeros or random.")
            if problem := routing_problem(self.router_type, self.num_experts, self.num_experts_per_tok):
                raise ValueError(problem)
        if self.block_size < 2:
            raise ValueError(f"--block_size must be >= 2 (a causal LM predicts each token from those before it), got {self.block_size}.")
        if not self.max_grad_norm >= 0:
            raise ValueError(f"--max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}.")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"--mixed_precision {self.mixed_precision!r}: use no, bf16 or fp16.")
        self._check_expert_parallel()
        if max(self.tp_size, self.pp_size, self.fsdp_size) > 1 and self.mixed_precision == "fp16":
            raise ValueError(
                "--mixed_precision fp16 with --tp_size, --pp_size or --fsdp_size > 1: fp16 needs Accelerate's gradient "
                "scaler, which works through an optimizer Accelerate prepares, and a split model's optimizer is kept "
                "out of Accelerate (each process holds part of its state). Use --mixed_precision bf16."
            )
        if not self.learning_rate > 0:
            raise ValueError(f"--learning_rate must be > 0, got {self.learning_rate}.")

    def _check_sources(self) -> None:
        """A model or tokenizer to read is a local folder or a Hub repository id: anything else (`./nope`, a
        mistyped path) is refused now rather than by the loader."""
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        for name in ("model_name_or_path", "upcycle_from", "tokenizer_name"):
            source = getattr(self, name)
            if not source or Path(source).is_dir():
                continue
            if Path(source).exists():
                raise ValueError(f"--{name} {source} is a file; give the model's folder (written by save_pretrained).")
            try:
                validate_repo_id(source)
            except HFValidationError:
                raise ValueError(f"--{name} {source}: no such folder, and not a Hub repository id (user/name).") from None

    def _check_hub_login(self) -> None:
        """--push_to_hub: the Hub must be reachable with a token, checked before training rather than after it."""
        from huggingface_hub import HfApi

        if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "on", "true", "yes"):
            problem = "HF_HUB_OFFLINE is set: the Hub cannot be reached. Unset HF_HUB_OFFLINE and log in (`hf auth login`)"
        else:
            try:
                HfApi().whoami()
                return
            except Exception as error:  # no token, a refused token, no network: all mean no upload at the end
                reason = " ".join(f"{type(error).__name__}: {error}".split())
                problem = (f"the Hub cannot be reached as a logged-in user ({reason}). Log in (`hf auth login` or "
                           "HF_TOKEN) and check the network")
        raise ValueError(f"--push_to_hub was given but {problem}, or drop --push_to_hub and upload the output folder later.")

    def _check_expert_parallel(self) -> None:
        if self.ep_size is None or self.ep_size == self.tp_size:
            return
        k = self.ep_size // self.tp_size
        if self.ep_size < self.tp_size or self.ep_size % self.tp_size or self.fsdp_size % k:
            choices = sorted(self.tp_size * d for d in range(1, self.fsdp_size + 1) if self.fsdp_size % d == 0)
            raise ValueError(
                f"--ep_size {self.ep_size} with --tp_size {self.tp_size} --fsdp_size {self.fsdp_size}: the experts are "
                "split over whole tensor-parallel groups (PPMoE: --ep_size = --tp_size) or over k of them that shard "
                f"the same replica (--ep_size = k * tp_size, k dividing --fsdp_size). Use --ep_size in {choices}, or "
                "raise --fsdp_size."
            )

    def check_model(self, config) -> None:
        """Checks that need the model config (sizes that cannot work together)."""
        max_positions = getattr(config, "max_position_embeddings", None)
        if getattr(config, "position_embedding_type", "rotary") == "learned" and max_positions and self.block_size > max_positions:
            raise ValueError(
                f"--block_size {self.block_size} exceeds the model's max_position_embeddings={max_positions} "
                "(learned positions); lower --block_size."
            )
        experts = getattr(config, "num_experts", None)
        if self.pp_size > 1 and getattr(config, "is_encoder_decoder", False):
            raise ValueError(
                f"--pp_size {self.pp_size}: the training loop's pipeline schedule sends one stream of token blocks "
                "through the stages (a decoder); an encoder-decoder's pairs of two lengths, whose encoder output every "
                "decoder stage needs, are not scheduled. Train Seq2Seq-MoE with --tp_size (PPMoE experts) and/or "
                "--fsdp_size instead."
            )
        if self.pp_size > 1 and not experts:
            raise ValueError(
                f"--pp_size {self.pp_size} cuts the model into stages with hf_ppmoe.parallel.Pipeline, which knows our "
                f"GPT-MoE models; this {config.model_type} model is not one. Train it data parallel (no --pp_size)."
            )
        if self.pp_size > config.num_hidden_layers:
            raise ValueError(
                f"--pp_size {self.pp_size}: the model has {config.num_hidden_layers} layers, fewer than the pipeline "
                f"stages (every stage needs a layer). Use --pp_size {config.num_hidden_layers} or less."
            )
        if self.tp_size > 1 and not experts:
            raise ValueError(
                f"--tp_size {self.tp_size} splits a model with hf_ppmoe.parallel's plans, which GPT-MoE models carry; "
                f"this {config.model_type} model has none. Train it data parallel (no --tp_size)."
            )
        if self.tp_size > 1 and experts % self.tp_size:
            raise ValueError(
                f"--tp_size {self.tp_size} does not divide num_experts={experts}: PPMoE spreads every MoE layer's "
                f"experts evenly over the tensor-parallel group. Use a tp_size among the divisors of {experts}."
            )
        ep = self.ep_size or self.tp_size
        if ep > self.tp_size and not experts:
            raise ValueError(f"--ep_size {ep} splits experts; this {config.model_type} model has none. Drop --ep_size.")
        if ep > self.tp_size and experts % ep:
            raise ValueError(
                f"--ep_size {ep} does not divide num_experts={experts}: every process gets num_experts / ep_size whole "
                f"experts. Use an ep_size among the divisors of {experts}."
            )

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2, default=str)
