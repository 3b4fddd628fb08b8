"""The `hf-ppmoe` commands, run by the launcher `hf_ppmoe_cli` (the console script; it answers `--help` and
`--version` without importing this package): see its docstring for the commands and exit codes.

`RUNNERS` maps each command to the function that runs it, `runner(argv, prog, description) -> exit code`: a command is
one line there (and its line of help in `hf_ppmoe_cli.COMMANDS`). A runner parses its flags first (refusals before
torch is imported), then imports what it needs."""

from __future__ import annotations

import sys

from .utils.command_line import parse_arguments
from .utils.quiet import quiet_notices


def run(command: str, rest: list[str], description: str | None = None) -> int:
    """Run `hf-ppmoe COMMAND REST...` (`description`: the launcher's line for the command); returns the exit code."""
    quiet_notices()
    return RUNNERS[command](rest, f"hf-ppmoe {command}", description)


def train(argv: list[str], prog: str, description: str | None) -> int:
    from .training.__main__ import cli, end_process

    return end_process(cli(argv, prog=prog))


def megatron(argv: list[str], prog: str, description: str | None) -> int:
    from .megatron.__main__ import megatron_main

    return megatron_main(argv, prog=prog)


def serve(argv: list[str], prog: str, description: str | None) -> int:
    from .serving import ServeArguments, serve

    args = parse_arguments(ServeArguments, argv, prog=prog, description=description, positionals={"model": "MODEL"})
    try:
        serve(args)
    except ValueError as err:  # refused before listening (no such model, an encoder-decoder, no serving extra)
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


def demo(argv: list[str], prog: str, description: str | None) -> int:
    from .demo.options import DemoArguments

    args = parse_arguments(DemoArguments, argv, prog=prog, description=description)
    from .demo.gpt import run_demo  # torch: after the flags were checked

    run_demo(args)
    return 0


def plan(argv: list[str], prog: str, description: str | None) -> int:
    from .planning.command import PlanArguments, run_plan

    return run_plan(parse_arguments(PlanArguments, argv, prog=prog, description=description, positionals={"model": "MODEL"}))


def convert(argv: list[str], prog: str, description: str | None) -> int:
    """upcycle, merge, import, export (hf_ppmoe.conversion.commands)."""
    from .conversion.commands import COMMANDS as CONVERSIONS

    arguments, conversion, description = CONVERSIONS[prog.split()[-1]]
    args = parse_arguments(arguments, argv, prog=prog, description=description,
                           positionals={"source": "SRC", "output": "OUT"})
    from transformers.utils import logging as transformers_logging

    from .conversion.mapping import ConversionError  # torch: after the flags were checked
    from .utils.atomic import OutOfSpaceError
    transformers_logging.disable_progress_bar()  # its per-shard bars flash by; ours shows once a write is long
    from .utils.integrity import CheckpointError

    try:
        out = conversion(args)
    except (ConversionError, CheckpointError, FileExistsError) as err:  # refused: nothing was written
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except OutOfSpaceError as err:  # failed while writing; the previous output (if any) is untouched
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


RUNNERS = {
    "demo": demo,
    "train": train,
    "upcycle": convert,
    "merge": convert,
    "import": convert,
    "export": convert,
    "serve": serve,
    "megatron": megatron,
    "plan": plan,
}

__all__ = ["RUNNERS", "run"]
