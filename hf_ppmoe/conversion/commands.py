"""`hf-ppmoe upcycle SRC OUT`, `hf-ppmoe merge SRC OUT`, `hf-ppmoe import SRC OUT`, `hf-ppmoe export SRC OUT --to NAME`:
arguments and runners. The arguments need only the standard library (their help and errors print before torch is
imported); the runners import the converters when they run."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import ClassVar
from pathlib import Path

from .choices import EXPORT_CLASSES, MERGE_METHODS, ROUTER_INITS, default_experts_per_token, parse_size


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class _Paths:
    PATHS: ClassVar[dict] = {"source": "model", "output": "output_folder"}  # checked before any work (utils.paths)
    source: str = field(metadata={**_help("Model folder (or Hub id) to convert.")})
    output: str = field(metadata={**_help("Output folder; must not exist yet unless --overwrite.")})


@dataclass
class _Output:
    max_shard_size: str = field(default="5GB", metadata=_help("Largest safetensors shard, e.g. 5GB, 500MB."))
    overwrite: bool = field(default=False, metadata=_help("Replace OUT if it exists (only once the conversion succeeded)."))

    def __post_init__(self):
        """Refuse, before anything is read, what the conversion would refuse only at its end (ValueError)."""
        parse_size(self.max_shard_size)
        output = Path(self.output)  # a file or an unwritable place: utils.paths, after this
        if output.is_dir() and any(output.iterdir()) and not self.overwrite:
            raise ValueError(f"{output} already exists; choose a new output folder or pass --overwrite.")


@dataclass
class UpcycleArguments(_Output, _Paths):
    PATHS: ClassVar[dict] = {"sample_file": "input_file"}  # checked before any work (utils.paths)
    num_experts: int = field(default=8, metadata=_help("Experts per MoE layer."))
    num_experts_per_tok: int | None = field(default=None, metadata=_help("Routes per token (default: 1 for switch, else 2)."))
    router_type: str = field(default="topk", metadata=_help("Gate: topk, switch, gshard, prototype, or a registered one."))
    moe_layer_frequency: int = field(default=2, metadata=_help("Every n-th FFN becomes MoE (1: all)."))
    moe_layers: list[int] | None = field(default=None, metadata=_help("Explicit FFN indices to make MoE (overrides the frequency)."))
    encoder_moe_layers: list[int] | None = field(default=None, metadata=_help("T5: encoder FFNs to make MoE."))
    decoder_moe_layers: list[int] | None = field(default=None, metadata=_help("T5: decoder FFNs to make MoE."))
    no_encoder_moe: bool = field(default=False, metadata=_help("T5: keep every encoder FFN dense."))
    no_decoder_moe: bool = field(default=False, metadata=_help("T5: keep every decoder FFN dense."))
    encoder_moe_layer_frequency: int | None = field(default=None, metadata=_help("T5: every n-th encoder FFN becomes MoE."))
    decoder_moe_layer_frequency: int | None = field(default=None, metadata=_help("T5: every n-th decoder FFN becomes MoE."))
    router_init: str = field(default="zeros", metadata=_help(f"Router initialization: {', '.join(ROUTER_INITS)}."))
    sample_texts: list[str] | None = field(default=None, metadata=_help("router_init=hidden: one text per expert."))
    sample_file: str | None = field(default=None, metadata={**_help("router_init=hidden: a file with one text per expert, one per line.")})
    noise_std: float = field(default=0.0, metadata=_help("Std of the noise added to each expert copy (0: exact copies)."))
    reinit_ratio: float = field(default=0.0, metadata=_help("Drop-Upcycling: share of each expert's FFN dimensions re-initialised (0: exact copies)."))
    seed: int = field(default=0, metadata=_help("Seed for noise and random routers."))
    capacity_factor: float | None = field(default=None, metadata=_help("Training capacity factor (default: dropless)."))
    norm_topk_prob: bool = field(default=True, metadata=_help("topk gate: renormalize the top-k weights."))

    def __post_init__(self):
        """Also the MoE settings the target config refuses whatever the source is (the checks both families share,
        run on a GPT-MoE config), before the source is read."""
        super().__post_init__()
        from ..modeling.configuration_gpt_moe import GPTMoEConfig

        GPTMoEConfig(
            num_experts=self.num_experts,
            num_experts_per_tok=default_experts_per_token(self.router_type, self.num_experts_per_tok),
            router_type=self.router_type,
            moe_layer_frequency=self.moe_layer_frequency,
            capacity_factor=self.capacity_factor,
            norm_topk_prob=self.norm_topk_prob,
        )


@dataclass
class MergeArguments(_Output, _Paths):
    PATHS: ClassVar[dict] = {"sample_file": "input_file"}  # checked before any work (utils.paths)
    method: str = field(default="mean", metadata=_help(f"How experts are merged: {', '.join(MERGE_METHODS)}."))
    expert: int = field(default=0, metadata=_help("method=expert: the expert to keep."))
    sample_texts: list[str] | None = field(default=None, metadata=_help("method=usage: texts to measure router usage on."))
    sample_file: str | None = field(default=None, metadata={**_help("method=usage: a file of texts, one per line.")})


@dataclass
class ImportArguments(_Output, _Paths):
    pass


@dataclass
class _Target:
    to: str = field(metadata={"help": "Transformers class to export to, by model_type: " + ", ".join(
        f"{name} ({class_name})" for name, class_name in EXPORT_CLASSES.items()), "choices": list(EXPORT_CLASSES)})


@dataclass
class ExportArguments(_Output, _Target, _Paths):
    pass


def _texts(args) -> list[str] | None:
    texts = list(args.sample_texts or [])
    if args.sample_file:
        texts += [line for line in Path(args.sample_file).read_text(encoding="utf-8").splitlines() if line.strip()]
    return texts or None


def _stack_placement(args: UpcycleArguments) -> dict:
    """The per-stack options that were given (Seq2SeqMoEConfig fields; a decoder-only source refuses them)."""
    placement = {}
    for stack in ("encoder", "decoder"):
        placement[f"{stack}_moe_layers"] = [] if getattr(args, f"no_{stack}_moe") else getattr(args, f"{stack}_moe_layers")
        placement[f"{stack}_moe_layer_frequency"] = getattr(args, f"{stack}_moe_layer_frequency")
    return {k: v for k, v in placement.items() if v is not None}


def run_upcycle(args: UpcycleArguments) -> Path:
    from .upcycling import upcycle

    return upcycle(
        args.source,
        num_experts=args.num_experts,
        num_experts_per_tok=args.num_experts_per_tok,
        router_type=args.router_type,
        moe_layer_frequency=args.moe_layer_frequency,
        moe_layers=args.moe_layers,
        router_init=args.router_init,
        sample_texts=_texts(args),
        noise_std=args.noise_std,
        reinit_ratio=args.reinit_ratio,
        seed=args.seed,
        capacity_factor=args.capacity_factor,
        norm_topk_prob=args.norm_topk_prob,
        **_stack_placement(args),
        save_directory=args.output,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        progress=True,
    )


def run_merge(args: MergeArguments) -> Path:
    from .merge import merge_experts

    return merge_experts(
        args.source,
        method=args.method,
        expert=args.expert,
        sample_texts=_texts(args),
        save_directory=args.output,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        progress=True,
    )


def run_import(args: ImportArguments) -> Path:
    from .upcycling import import_moe

    return import_moe(
        args.source, save_directory=args.output, max_shard_size=args.max_shard_size, overwrite=args.overwrite, progress=True
    )


def run_export(args: ExportArguments) -> Path:
    from .export import export_moe

    return export_moe(
        args.source, args.output, to=args.to, max_shard_size=args.max_shard_size, overwrite=args.overwrite, progress=True
    )


COMMANDS = {
    "upcycle": (UpcycleArguments, run_upcycle, "Turn a dense checkpoint (GPT-2, Llama, Mistral, Qwen2, Qwen3, T5) into an MoE model."),
    "merge": (MergeArguments, run_merge, "Merge an MoE model's experts back into its dense architecture."),
    "import": (ImportArguments, run_import, "Import an MoE checkpoint (Mixtral, Qwen3-MoE, Switch Transformers) into our classes."),
    "export": (ExportArguments, run_export, "Export a GPT-MoE / Seq2Seq-MoE to Transformers' own MoE class where it "
               "fits exactly (else the list of reasons)."),
}


# ---- `hf-ppmoe megatron to-megatron|to-hf` ----


@dataclass
class ToMegatronArguments:
    PATHS: ClassVar[dict] = {"source": "input_folder", "output": "output_folder"}  # checked before any work (utils.paths)
    source: str = field(metadata={"help": "GPT-MoE folder to convert."})
    output: str = field(metadata={"help": "Megatron-LM checkpoint folder; must not exist yet unless --overwrite."})
    tp: int = field(default=1, metadata={"help": "Tensor-parallel size (= expert-parallel size)."})
    pp: int = field(default=1, metadata={"help": "Pipeline-parallel size."})
    make_vocab_size_divisible_by: int = field(default=128, metadata={"help": "As Megatron-LM's argument."})
    overwrite: bool = field(default=False, metadata={"help": "Replace OUT if it exists."})

    def __post_init__(self):
        for name in ("tp", "pp", "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)}: must be at least 1")


@dataclass
class ToHFArguments:
    PATHS: ClassVar[dict] = {"source": "input_folder", "output": "output_folder", "config": "input"}  # checked before any work (utils.paths)
    source: str = field(metadata={"help": "Megatron-LM checkpoint folder to convert."})
    output: str = field(metadata={"help": "GPT-MoE folder to write."})
    config: str = field(metadata={"help": "GPT-MoE folder or config.json describing the model."})
    trust_checkpoint: bool = field(
        default=False, metadata={"help": "Allow pickled Python objects (Megatron-LM's args) when loading."}
    )


def run_to_megatron(args: ToMegatronArguments) -> Path:
    from .megatron_checkpoint import convert_hf_to_megatron

    return convert_hf_to_megatron(
        args.source, args.output, tp=args.tp, pp=args.pp, overwrite=args.overwrite,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
    )


def run_to_hf(args: ToHFArguments) -> Path:
    from .megatron_checkpoint import convert_megatron_to_hf

    convert_megatron_to_hf(args.source, args.output, args.config, weights_only=not args.trust_checkpoint)
    return Path(args.output)


MEGATRON_COMMANDS = {
    "to-megatron": (ToMegatronArguments, run_to_megatron, "GPT-MoE folder -> Megatron-LM release checkpoint (legacy "
                    "torch format, TP x PP, experts on the TP group)."),
    "to-hf": (ToHFArguments, run_to_hf, "Megatron-LM checkpoint of a GPT-MoE -> GPT-MoE folder."),
}


def megatron_main(argv=None, prog: str = "hf-ppmoe megatron") -> int:
    """`PROG to-megatron SRC OUT [--tp N --pp N ...]` / `PROG to-hf SRC OUT --config CONFIG`. Bad flags and refusals
    end as one `PROG: error: ...` line with exit code 2 (SystemExit, as argparse's own errors)."""
    from ..utils.command_line import parse_arguments

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in MEGATRON_COMMANDS:
        listing = "\n".join(f"  {name:<12} {help}" for name, (_, _, help) in MEGATRON_COMMANDS.items())
        usage = f"usage: {prog} {{{','.join(MEGATRON_COMMANDS)}}} SRC OUT [options] (--help)\n\ncommands:\n{listing}\n"
        if argv and argv[0] in ("-h", "--help"):
            print(usage)
            return 0
        sys.stderr.write(usage)
        raise SystemExit(2)
    arguments, run, description = MEGATRON_COMMANDS[argv[0]]
    args = parse_arguments(arguments, argv[1:], prog=f"{prog} {argv[0]}", description=description,
                           positionals={"source": "SRC", "output": "OUT"})
    from .mapping import ConversionError  # torch: after the flags were checked

    try:
        out = run(args)
    except (ConversionError, OSError, ValueError) as err:  # refusals and missing files: one line, no traceback
        sys.stderr.write(f"{prog}: error: {err}\n")
        raise SystemExit(2) from None
    print(f"wrote {out}")
    return 0
