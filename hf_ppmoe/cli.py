"""The `hf-ppmoe` commands, run by the launcher `hf_ppmoe_cli` (the console script; it answers `--help` and
`--version` without importing this package): see its docstring for the commands and exit codes."""

from __future__ import annotations

import sys

from .utils.command_line import parse_arguments


def run(command: str, rest: list[str], description: str | None = None) -> int:
    """Run `hf-ppmoe COMMAND REST...` (`description`: the launcher's line for the command); returns the exit code."""
    if command == "train":
        from .training.__main__ import cli, end_process

        return end_process(cli(rest, prog="hf-ppmoe train"))
    if command == "megatron":
        from .megatron.__main__ import megatron_main

        return megatron_main(rest, prog="hf-ppmoe megatron")
    if command == "serve":
        from .serving import ServeArguments

        args = parse_arguments(ServeArguments, rest, prog="hf-ppmoe serve", description=description,
                               positionals={"model": "MODEL"})
        from .serving import serve

        try:
            serve(args)
        except ValueError as err:  # refused before listening (an encoder-decoder model, no serving extra)
            print(f"hf-ppmoe serve: error: {err}", file=sys.stderr)
            return 2
        return 0
    if command == "plan":
        from .planning.command import PlanArguments, run_plan

        return run_plan(parse_arguments(PlanArguments, rest, prog="hf-ppmoe plan", description=description,
                                        positionals={"model": "MODEL"}))
    if command == "demo":
        from .demo.options import DemoArguments

        args = parse_arguments(DemoArguments, rest, prog="hf-ppmoe demo", description=description)
        from .demo.gpt import run_demo  # torch: after the flags were checked

        run_demo(args)
        return 0

    from .conversion.commands import COMMANDS as CONVERSIONS

    arguments, convert, description = CONVERSIONS[command]
    args = parse_arguments(arguments, rest, prog=f"hf-ppmoe {command}", description=description,
                           positionals={"source": "SRC", "output": "OUT"})
    from transformers.utils import logging as transformers_logging

    from .conversion.mapping import ConversionError  # torch: after the flags were checked
    from .utils.atomic import OutOfSpaceError
    transformers_logging.disable_progress_bar()  # its per-shard bars flash by; ours shows once a write is long
    from .utils.integrity import CheckpointError

    try:
        out = convert(args)
    except (ConversionError, CheckpointError, FileExistsError) as err:  # refused: nothing was written
        print(f"hf-ppmoe {command}: error: {err}", file=sys.stderr)
        return 2
    except OutOfSpaceError as err:  # failed while writing; the previous output (if any) is untouched
        print(f"hf-ppmoe {command}: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


__all__ = ["run"]
