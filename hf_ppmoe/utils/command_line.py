"""Command-line parsing shared by every `hf-ppmoe` command: Transformers' `HfArgumentParser` over our argument
dataclasses, plus what argparse users expect and it does not do by itself: positional arguments (`SRC OUT`), help
for the `--no_X` twin of a flag that defaults to true that says what it does, and a one-line argparse error (exit
code 2, no traceback) for an unknown flag or a refused value."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TypeVar

from transformers import HfArgumentParser

from .paths import paths_problem

T = TypeVar("T")


def _options(arguments: type, skip: tuple[str, ...]) -> type:
    """`arguments` without the fields in `skip` (those become positional arguments)."""
    kept = []
    for f in dataclasses.fields(arguments):
        if f.name in skip:
            continue
        default = {"default": f.default} if f.default is not dataclasses.MISSING else {}
        if f.default_factory is not dataclasses.MISSING:
            default = {"default_factory": f.default_factory}
        kept.append((f.name, f.type, dataclasses.field(metadata=f.metadata, **default)))
    options = dataclasses.make_dataclass(arguments.__name__, kept)
    options.__module__ = arguments.__module__  # its string annotations resolve in the original's module
    return options


def build_parser(arguments: type, *, prog: str, description: str | None = None, positionals: dict[str, str] = {}):
    """An HfArgumentParser for `arguments`; `positionals` maps field names to the metavars they take, in order."""
    usage = " ".join([prog, *positionals.values(), "[options]"])  # short: errors print it above their line
    parser = HfArgumentParser(_options(arguments, tuple(positionals)), prog=prog,
                              usage=usage, description=description)
    helps = {f.name: f.metadata.get("help") for f in dataclasses.fields(arguments)}
    for name, metavar in positionals.items():
        parser.add_argument(name, metavar=metavar, help=helps[name])
    for action in parser._actions:
        if any(option.startswith("--no_") for option in action.option_strings) and action.const is False:
            # HfArgumentParser gives `--no_X` the help of `--X`; say what it does instead
            action.help, action.default = f"Turn off --{action.dest} (on by default).", argparse.SUPPRESS
    return parser


def parse_arguments(arguments: type[T], argv: list[str] | None, *, prog: str, description: str | None = None,
                    positionals: dict[str, str] = {}) -> T:
    """argv -> an `arguments` instance. Unknown flags, missing positionals and values the dataclass refuses (a
    ValueError or TypeError from its constructor) end as `prog: error: ...` with exit code 2; so does a path field
    (its class's `PATHS`, see `utils.paths`) that is missing, of the wrong kind or not writable: one line."""
    parser = build_parser(arguments, prog=prog, description=description, positionals=positionals)
    namespace, rest = parser.parse_known_args(argv)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    names = {f.name for f in dataclasses.fields(arguments) if f.init}
    try:
        parsed = arguments(**{name: value for name, value in vars(namespace).items() if name in names})
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    problem = paths_problem(arguments, vars(parsed), positionals)
    if problem:
        print(f"{prog}: error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    return parsed
