"""Thin CLI over `hf_ppmoe.training.main`: every field of `TrainArguments` is a `--flag`."""

import sys

from transformers import HfArgumentParser

from .arguments import TrainArguments
from .train import main


def cli(argv: list[str] | None = None) -> int:
    (args,) = HfArgumentParser(TrainArguments, prog="python -m hf_ppmoe.training").parse_args_into_dataclasses(argv)
    try:
        main(args)
    except ValueError as error:  # bad arguments: one clear line, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
