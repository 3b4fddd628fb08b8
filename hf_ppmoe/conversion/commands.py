"""`hf-ppmoe upcycle SRC OUT`, `hf-ppmoe merge SRC OUT`, `hf-ppmoe import SRC OUT`, `hf-ppmoe export SRC OUT --to NAME`:
arguments and runners. The arguments need only the standard library (their help and errors print before torch is
imported); the runners import the converters when they run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar
from pathlib import Path

from .choices import (BUILTIN_GATES, EXPORT_CLASSES, MERGE_METHODS, ROUTER_INITS, default_experts_per_token,
                      granularity_problem, parse_size, routing_problem)


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
    router_type: str = field(default="topk", metadata=_help(f"Gate: {', '.join(BUILTIN_GATES)}."))
    moe_layer_frequency: int = field(default=2, metadata=_help(
        "Every n-th FFN becomes MoE, layers n-1, 2n-1, ... from 0 (default 2, as in GShard and PPMoE: every other "
        "FFN, so a 2-layer model gets one MoE layer; 1: every FFN)."))
    moe_layers: list[int] | None = field(default=None, metadata=_help("Explicit FFN indices to make MoE (overrides the frequency)."))
    encoder_moe_layers: list[int] | None = field(default=None, metadata=_help("T5: encoder FFNs to make MoE."))
    decoder_moe_layers: list[int] | None = field(default=None, metadata=_help("T5: decoder FFNs to make MoE."))
    no_encoder_moe: bool = field(default=False, metadata=_help("T5: keep every encoder FFN dense."))
    no_decoder_moe: bool = field(default=False, metadata=_help("T5: keep every decoder FFN dense."))
    encoder_moe_layer_frequency: int | None = field(default=None, metadata=_help("T5: every n-th encoder FFN becomes MoE."))
    decoder_moe_layer_frequency: int | None = field(default=None, metadata=_help("T5: every n-th decoder FFN becomes MoE."))
    router_init: str = field(default="auto", metadata={**_help(
        f"Router initialization: {', '.join(ROUTER_INITS)}. auto: random for topk and gshard (exact, and the experts "
        "grow apart in training), zeros for switch, prototype and topk without renormalisation (only a uniform router keeps "
        "those exact; its ties route every token to the first experts)."), "choices": list(ROUTER_INITS)})
    sample_texts: list[str] | None = field(default=None, metadata=_help("--router_init hidden: one text per expert."))
    sample_file: str | None = field(default=None, metadata={**_help("--router_init hidden: a file with one text per expert, one per line.")})
    noise_std: float = field(default=0.0, metadata=_help("Std of the noise added to each expert copy (0: exact copies)."))
    reinit_ratio: float = field(default=0.0, metadata=_help("Drop-Upcycling: share of each expert's FFN dimensions re-initialised (0: exact copies)."))
    granularity: int = field(default=1, metadata=_help(
        "Fine-grained upcycling (arXiv 2410.07524): experts are num_experts / g copies of the FFN cut into g slices "
        "of its inner size; a token takes num_experts_per_tok copies (times g experts). Needs --router_init random "
        "or hidden."))
    seed: int = field(default=0, metadata=_help("Seed for noise and random routers."))
    capacity_factor: float | None = field(default=None, metadata=_help("Training capacity factor (default: dropless)."))
    norm_topk_prob: bool = field(default=True, metadata=_help("topk gate: renormalize the top-k weights."))
    chat_template: str | None = field(default=None, metadata=_help(
        "Give OUT's tokenizer a chat template (for chat completions, `hf-ppmoe serve`): chatml, a .jinja file, or Jinja text."))

    def __post_init__(self):
        """Also the MoE settings the target config refuses whatever the source is, before the source is read and
        before torch is imported; in the command's words (flags, and defaults named as defaults)."""
        super().__post_init__()
        if self.chat_template is not None:
            from ..utils.chat_template import chat_template_text

            chat_template_text(self.chat_template)  # an unknown name or a missing file: refused before any work
        if self.num_experts < 2:
            raise ValueError(f"--num_experts {self.num_experts}: an MoE layer needs at least 2 experts (with one, "
                             "every token takes the dense FFN it was copied from); give --num_experts 2 or more.")
        problem = routing_problem(self.router_type, self.num_experts, self.num_experts_per_tok)
        if problem:
            raise ValueError(problem)
        if self.moe_layer_frequency < 1:
            raise ValueError(f"--moe_layer_frequency {self.moe_layer_frequency}: every n-th FFN becomes MoE, so n is 1 "
                             "(every FFN) or more.")
        if self.capacity_factor is not None and not 0 < self.capacity_factor < float("inf"):
            raise ValueError(f"--capacity_factor {self.capacity_factor}: give a finite number > 0, or leave it out for "
                             "dropless routing (no token is dropped).")
        copies_per_token = default_experts_per_token(self.router_type, self.num_experts_per_tok)
        problem = granularity_problem(self.granularity, self.num_experts, copies_per_token, self.router_type,
                                      self.router_init, self.reinit_ratio)
        if problem:
            raise ValueError(problem)  # in upcycle's words: --granularity is granularity=, and so on
        if self.router_init == "hidden":
            _check_sample_texts(self)


@dataclass
class MergeArguments(_Output, _Paths):
    PATHS: ClassVar[dict] = {"sample_file": "input_file"}  # checked before any work (utils.paths)
    method: str = field(default="mean", metadata={**_help(f"How experts are merged: {', '.join(MERGE_METHODS)}."),
                                                  "choices": list(MERGE_METHODS)})
    expert: int = field(default=0, metadata=_help("--method expert: the expert to keep."))
    sample_texts: list[str] | None = field(default=None, metadata=_help("--method usage: texts to measure router usage on."))
    sample_file: str | None = field(default=None, metadata={**_help("--method usage: a file of texts, one per line.")})

    def __post_init__(self):
        super().__post_init__()
        if self.method == "usage" and self.sample_file is None and not self.sample_texts:
            raise ValueError("--method usage needs --sample_file FILE (texts, one per line) to measure how often the "
                             "router picks each expert.")


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


def _check_sample_texts(args: UpcycleArguments) -> None:
    """--router_init hidden reads one sample text per expert (per copy of the FFN with --granularity): refuse a
    missing file, or one with another number of lines, before the source is read (a missing file is utils.paths' to
    name)."""
    copies = args.num_experts // args.granularity
    per = "expert" if args.granularity == 1 else f"copy of the FFN (--num_experts / --granularity {args.granularity})"
    if args.sample_file is None and not args.sample_texts:
        raise ValueError(f"--router_init hidden needs --sample_file FILE with one line of text per {per} "
                         f"({copies} lines for --num_experts {args.num_experts}).")
    if args.sample_file is not None and not Path(args.sample_file).is_file():
        return
    n = len(_texts(args) or [])
    if n != copies:
        given = f"--sample_file {args.sample_file} has {n} non-empty lines" if args.sample_file else f"{n} --sample_texts"
        raise ValueError(f"--router_init hidden takes one sample text per {per}: {given}, and --num_experts is "
                         f"{args.num_experts}; give {copies} lines or set --num_experts {n * args.granularity}.")


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


def _written(args) -> dict:
    """Where and how every command writes its result."""
    return dict(save_directory=args.output, max_shard_size=args.max_shard_size, overwrite=args.overwrite, progress=True)


def run_upcycle(args: UpcycleArguments) -> Path:
    from .upcycling import upcycle

    same = ("num_experts num_experts_per_tok router_type moe_layer_frequency moe_layers router_init noise_std "
            "reinit_ratio granularity seed capacity_factor norm_topk_prob").split()  # upcycle's names for the flags
    options = {name: getattr(args, name) for name in same}
    out = upcycle(args.source, sample_texts=_texts(args), **options, **_stack_placement(args), **_written(args))
    if args.chat_template is not None:
        _write_chat_template(out, args.chat_template)
    return out


def _write_chat_template(folder: Path, template: str) -> None:
    from ..utils.chat_template import write_chat_template
    from .mapping import ConversionError

    if not any((Path(folder) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ConversionError(f"--chat_template: {folder} was written, but without a chat template: it has no tokenizer (the source had none).")
    write_chat_template(folder, template)


def run_merge(args: MergeArguments) -> Path:
    from .merge import merge_experts

    return merge_experts(args.source, method=args.method, expert=args.expert, sample_texts=_texts(args), **_written(args))


def run_import(args: ImportArguments) -> Path:
    from .upcycling import import_moe

    return import_moe(args.source, **_written(args))


def run_export(args: ExportArguments) -> Path:
    from .export import export_moe

    return export_moe(args.source, to=args.to, **_written(args))


COMMANDS = {
    "upcycle": (UpcycleArguments, run_upcycle, "Turn a dense checkpoint (GPT-2, Llama, Mistral, Qwen2, Qwen3, T5) into an MoE model."),
    "merge": (MergeArguments, run_merge, "Merge an MoE model's experts back into its dense architecture."),
    "import": (ImportArguments, run_import, "Import an MoE checkpoint (Mixtral, Qwen3-MoE, GLM-4-MoE, Switch Transformers) into our classes."),
    "export": (ExportArguments, run_export, "Export a GPT-MoE / Seq2Seq-MoE to Transformers' own MoE class where it "
               "fits exactly (else the list of reasons)."),
}
