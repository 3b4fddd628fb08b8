"""`hf-ppmoe` command line: `hf-ppmoe demo [...]`, `hf-ppmoe train [...]` (= `python -m hf_ppmoe.training`),
`hf-ppmoe upcycle|merge|import SRC OUT [...]`, `hf-ppmoe export SRC OUT --to NAME`,
`hf-ppmoe megatron to-megatron|to-hf ...`, `hf-ppmoe --version`; `hf-ppmoe COMMAND --help` for each.

Exit codes: 0 done; 2 bad flags or a refusal (one `hf-ppmoe COMMAND: error: ...` line, nothing written); 1 a
failure while running (a full disk, a diverged training run)."""

from __future__ import annotations

import sys

from .utils.arguments import parse_arguments

COMMANDS = {
    "demo": "Built-in corpus: dense GPT-2 -> upcycled GPT-MoE -> fine-tuned vs dense -> flat beam search -> merged back.",
    "train": "Train or fine-tune a causal LM (data / tensor / expert / pipeline parallel): hf-ppmoe train --help.",
    "upcycle": "Turn a dense checkpoint (GPT-2, Llama, Mistral, Qwen2, Qwen3; T5) into an MoE model: hf-ppmoe upcycle SRC OUT.",
    "merge": "Merge an MoE model's experts back into its dense architecture: hf-ppmoe merge SRC OUT.",
    "import": "Import an MoE checkpoint (Mixtral, Qwen3-MoE; Switch Transformers) into our classes: hf-ppmoe import SRC OUT.",
    "export": "Export to Transformers' own MoE classes (Mixtral, Qwen2-MoE, Qwen3-MoE, Switch): hf-ppmoe export SRC OUT --to NAME.",
    "megatron": "GPT-MoE <-> Megatron-LM checkpoints: hf-ppmoe megatron to-megatron|to-hf ... (--help).",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--version":
        from importlib.metadata import version

        print(f"hf-ppmoe {version('hf-ppmoe')}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        listing = "\n".join(f"  {name:<8} {help}" for name, help in COMMANDS.items())
        print(f"usage: hf-ppmoe COMMAND [--help] | hf-ppmoe --version\n\ncommands:\n{listing}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from .training.__main__ import cli

        return cli(rest, prog="hf-ppmoe train")
    if command == "megatron":
        from .conversion.megatron_checkpoint import main as megatron

        return megatron(rest, prog="hf-ppmoe megatron")
    if command == "demo":
        from .training.demo import DemoArguments, run_demo

        run_demo(parse_arguments(DemoArguments, rest, prog="hf-ppmoe demo", description=COMMANDS["demo"]))
        return 0

    from .conversion.commands import COMMANDS as CONVERSIONS
    from .conversion.mapping import ConversionError
    from .utils.atomic import OutOfSpaceError

    arguments, run, description = CONVERSIONS[command]
    args = parse_arguments(arguments, rest, prog=f"hf-ppmoe {command}", description=description,
                           positionals={"source": "SRC", "output": "OUT"})
    try:
        out = run(args)
    except (ConversionError, FileExistsError) as err:  # refused: nothing was written
        print(f"hf-ppmoe {command}: error: {err}", file=sys.stderr)
        return 2
    except OutOfSpaceError as err:  # failed while writing; the previous output (if any) is untouched
        print(f"hf-ppmoe {command}: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
