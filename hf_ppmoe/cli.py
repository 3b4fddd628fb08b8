"""`hf-ppmoe` command line: `hf-ppmoe demo [--steps N ...]`."""

from __future__ import annotations

import sys

from transformers import HfArgumentParser

COMMANDS = {
    "demo": "Train a small GPT-MoE on the built-in corpus, show expert load, generate text.",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        listing = "\n".join(f"  {name:<8} {help}" for name, help in COMMANDS.items())
        print(f"usage: hf-ppmoe COMMAND [--help]\n\ncommands:\n{listing}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from .training.demo import DemoArguments, run_demo

        (args,) = HfArgumentParser(DemoArguments, prog="hf-ppmoe demo").parse_args_into_dataclasses(rest)
        run_demo(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
