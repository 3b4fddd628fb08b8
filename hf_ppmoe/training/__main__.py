"""Thin CLI over `hf_ppmoe.training.main`: every field of `TrainArguments` is a `--flag`. A process that ran under
torchrun / `accelerate launch` ends through `hf_ppmoe.parallel.exit_distributed` (`end_process`)."""

import sys

from ..utils.command_line import parse_arguments
from ..utils.quiet import quiet_notices
from .arguments import TrainArguments


def cli(argv: list[str] | None = None, prog: str = "python -m hf_ppmoe.training") -> int:
    quiet_notices()  # other libraries' notices that concern no training run (utils/quiet.py)
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


def end_process(code: int) -> int:
    """Return `code`, or, when this process has gloo threads alive (it ran distributed), end it with `code` through
    `hf_ppmoe.parallel.exit_distributed` (the interpreter's finalization could abort it: see there)."""
    if "torch.distributed" not in sys.modules:  # --help, flag errors: torch was never imported
        return code
    from ..parallel.mesh import exit_distributed, gloo_threads

    if gloo_threads() != []:
        exit_distributed(code)
    return code


if __name__ == "__main__":
    sys.exit(end_process(cli()))
