"""`hf-ppmoe megatron to-megatron|to-hf` (also `python -m hf_ppmoe.megatron ...`): GPT-MoE folders <-> Megatron-LM
checkpoints (weights.py). The arguments need only the standard library (their help and errors print before torch is
imported); the runners import the converters when they run."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar


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
    from .weights import convert_hf_to_megatron

    return convert_hf_to_megatron(
        args.source, args.output, tp=args.tp, pp=args.pp, overwrite=args.overwrite,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
    )


def run_to_hf(args: ToHFArguments) -> Path:
    from .weights import convert_megatron_to_hf

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
    from ..conversion.mapping import ConversionError  # torch: after the flags were checked

    try:
        out = run(args)
    except (ConversionError, OSError, ValueError) as err:  # refusals and missing files: one line, no traceback
        sys.stderr.write(f"{prog}: error: {err}\n")
        raise SystemExit(2) from None
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(megatron_main(prog="python -m hf_ppmoe.megatron"))
