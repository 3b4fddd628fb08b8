"""Thin CLI over `hf_ppmoe.training.main`: every field of `TrainArguments` is a `--flag`."""

import sys

from ..utils.command_line import parse_arguments
from .arguments import TrainArguments


def cli(argv: list[str] | None = None, prog: str = "python -m hf_ppmoe.training") -> int:
    args = parse_arguments(TrainArguments, argv, prog=prog)  # --help and flag errors: before torch is imported
    from .train import main
    try:
        main(args)
    except ValueError as error:  # bad arguments: one clear line, no traceback
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except FloatingPointError as error:  # the run diverged: say where and what to change
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
