"""The ``hf-posenc`` command. Each subcommand lives in its own module with a ``register``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__
from ..errors import PosencError
from . import bench as bench_command
from . import inspect as inspect_commands
from . import lm_eval as lm_eval_command
from . import perplexity as perplexity_command
from . import study as study_command
from . import train as train_command

#: modules whose ``register(subparsers)`` adds subcommands, in the order ``--help`` lists them
COMMAND_MODULES = [
    study_command,
    inspect_commands,
    train_command,
    lm_eval_command,
    perplexity_command,
    bench_command,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-posenc", description="Positional encodings for transformers models."
    )
    parser.add_argument("--version", action="version", version=f"hf-posenc {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (
        PosencError,
        FileNotFoundError,
        NotADirectoryError,
        PermissionError,
        argparse.ArgumentTypeError,
    ) as error:
        if getattr(args, "traceback", False):
            raise
        print(f"hf-posenc {args.command}: error: {error}", file=sys.stderr)
        return 2
