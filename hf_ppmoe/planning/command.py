"""`hf-ppmoe plan MODEL`: arguments (standard library only: `--help` and flag errors come before torch is imported)
and the runner."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from .hardware import GPUS, parse_network


def _help(text: str, **extra) -> dict:
    return {"help": text, **extra}


@dataclass
class PlanArguments:
    PATHS: ClassVar[dict] = {"model": "input"}  # checked before any work (utils.paths)
    model: str = field(metadata=_help("A model folder or its config.json: GPT-MoE, or an architecture hf-ppmoe "
                                      "converts (a dense one as it is, or upcycled with --num_experts)."))
    # the cluster
    gpus: int = field(default=8, metadata=_help("GPUs in all."))
    gpus_per_node: int = field(default=8, metadata=_help("GPUs per node (NVLink inside a node, the network between)."))
    gpu: str = field(default="H100", metadata=_help("GPU preset (data-sheet numbers, hf_ppmoe/planning/hardware.py).",
                                                    choices=list(GPUS)))
    gpu_memory: float | None = field(default=None, metadata=_help("GB per GPU (default: the preset's)."))
    network: str | None = field(default=None, metadata=_help(
        "Network between nodes as NICs x Gb/s per node, e.g. 8x400 (default: V100 1x100, A100 8x200, H100/H200 8x400)."))
    # the run
    seq_len: int = field(default=2048, metadata=_help("Tokens per sequence (hf_ppmoe.training's --block_size)."))
    micro_batch: int | None = field(default=None, metadata=_help(
        "Sequences per GPU per forward (--per_device_train_batch_size; default: the fastest that fits)."))
    global_batch: int | None = field(default=None, metadata=_help("Sequences per optimizer step (default: 16 per GPU)."))
    dtype: str = field(default="bfloat16", metadata=_help("What the layers compute in.",
                                                          choices=["bfloat16", "float16", "float32"]))
    master_weights: bool = field(default=True, metadata=_help(
        "float32 weights, gradients and AdamW state under autocast, as hf_ppmoe.training --mixed_precision runs "
        "(--no_master_weights: weights in --dtype too)."))
    grad_bytes: float | None = field(default=None, metadata=_help("Bytes per gradient element (default: the weights')."))
    optimizer_bytes: float | None = field(default=None, metadata=_help(
        "Optimizer state bytes per trainable parameter (default: AdamW's two moments in the weights' dtype)."))
    recompute: str = field(default="no", metadata=_help("Activation recomputation of every layer: no, yes, or auto "
                                                        "(where nothing fits without).", choices=["no", "yes", "auto"]))
    lora_rank: int = field(default=0, metadata=_help("Train LoRA adapters of this rank on a frozen model (hf_ppmoe.peft)."))
    experts_4bit: bool = field(default=False, metadata=_help("Experts stored 4-bit (bitsandbytes NF4, frozen: with "
                                                             "--lora_rank)."))
    top: int = field(default=10, metadata=_help("Layouts to list."))
    json: bool = field(default=False, metadata=_help("Print the plan as JSON."))
    # upcycling a dense MODEL (hf-ppmoe upcycle's options)
    num_experts: int | None = field(default=None, metadata=_help("Upcycle a dense MODEL to this many experts per MoE layer."))
    num_experts_per_tok: int | None = field(default=None, metadata=_help("Upcycling: routes per token (default: 1 for "
                                                                         "switch, else 2)."))
    router_type: str | None = field(default=None, metadata=_help("Upcycling: the gate (default topk)."))
    moe_layer_frequency: int | None = field(default=None, metadata=_help("Upcycling: every n-th FFN becomes MoE "
                                                                         "(default 2)."))
    moe_layers: list[int] | None = field(default=None, metadata=_help("Upcycling: the FFNs to make MoE."))
    granularity: int | None = field(default=None, metadata=_help("Upcycling: fine-grained experts (slices of the FFN)."))

    def __post_init__(self):
        for name in ("gpus", "gpus_per_node", "seq_len", "top"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("micro_batch", "global_batch", "num_experts_per_tok", "moe_layer_frequency", "granularity"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be >= 1, got {value}.")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"--gpus {self.gpus} is not a whole number of nodes of --gpus_per_node "
                             f"{self.gpus_per_node}.")
        for name in ("gpu_memory", "grad_bytes", "optimizer_bytes"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name} must be > 0, got {value}.")
        if self.network is not None:
            try:
                parse_network(self.network)
            except ValueError as error:
                raise ValueError(f"--{error}") from None
        if self.lora_rank < 0:
            raise ValueError(f"--lora_rank must be >= 0, got {self.lora_rank}.")
        if self.experts_4bit and not self.lora_rank:
            raise ValueError("--experts_4bit: 4-bit experts are frozen; give --lora_rank R to train adapters on them.")
        if self.num_experts is not None and self.num_experts < 2:
            raise ValueError(f"--num_experts {self.num_experts}: an MoE layer needs at least 2 experts.")
        given = [name for name in ("num_experts_per_tok", "router_type", "moe_layer_frequency", "moe_layers",
                                   "granularity") if getattr(self, name) is not None]
        if given and self.num_experts is None:
            raise ValueError(f"--{given[0]} is an upcycling option: give --num_experts N to upcycle the dense MODEL.")

    def upcycle(self) -> dict:
        names = ("num_experts", "num_experts_per_tok", "router_type", "moe_layer_frequency", "moe_layers", "granularity")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def model_flags(self) -> str:
        """How hf_ppmoe.training is told about MODEL (an upcycled one: the folder `upcycle_command` writes)."""
        if self.num_experts is not None:
            return "--model_name_or_path UPCYCLED"
        return f"--config_name {self.model}" if Path(self.model).is_file() else f"--model_name_or_path {self.model}"

    def upcycle_command(self) -> str | None:
        if self.num_experts is None:
            return None
        flags = " ".join(f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in self.upcycle().items())
        return f"hf-ppmoe upcycle {self.model} UPCYCLED {flags}"


def run_plan(args: PlanArguments) -> int:
    """Print the plan (or why it cannot be made: exit code 2)."""
    from .plans import format_plan, plan, plan_dict

    try:
        result = plan(args.model, gpus=args.gpus, gpu=args.gpu, gpus_per_node=args.gpus_per_node,
                      gpu_memory=args.gpu_memory, network=args.network, seq_len=args.seq_len,
                      micro_batch=args.micro_batch, global_batch=args.global_batch, dtype=args.dtype,
                      master_weights=args.master_weights, grad_bytes=args.grad_bytes,
                      optimizer_bytes=args.optimizer_bytes, recompute={"no": False, "yes": True}.get(args.recompute),
                      lora_rank=args.lora_rank, experts_4bit=args.experts_4bit, **args.upcycle())
    except ValueError as error:
        print(f"hf-ppmoe plan: error: {error}", file=sys.stderr)
        return 2
    model = args.model_flags()
    if args.json:
        print(json.dumps(plan_dict(result, model) | {"upcycle_command": args.upcycle_command()}, indent=1))
    else:
        print(format_plan(result, model, args.top, before=args.upcycle_command()))
    return 0


__all__ = ["PlanArguments", "run_plan"]
