"""The ``hf-posenc`` command. Each subcommand lives in its own module with a ``register``.

Subcommand modules import torch, transformers, accelerate, datasets and matplotlib only when
a command runs, so ``--help`` and argument errors come back at once. Every error a user can
cause is one line (``hf-posenc CMD: error: ...``, exit code 2); ``--traceback`` (accepted by
every subcommand) shows the full traceback instead. Ctrl-C exits with code 130.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..._version import __version__
from ...errors import PosencError
from . import bench as bench_command
from . import export as export_command
from . import inspect as inspect_commands
from . import lm_eval as lm_eval_command
from . import longeval as longeval_command
from . import perplexity as perplexity_command
from . import study as study_command
from . import train as train_command
from .common import DefaultsHelpFormatter

#: modules whose ``register(subparsers)`` adds subcommands, in the order ``--help`` lists them
COMMAND_MODULES = [
    study_command,
    inspect_commands,
    train_command,
    lm_eval_command,
    perplexity_command,
    longeval_command,
    export_command,
    bench_command,
]
#: errors that come from the user's input or environment: one line, no traceback
USER_ERRORS = (
    PosencError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    OSError,  # e.g. transformers: a hub id that cannot be reached or does not exist
    argparse.ArgumentTypeError,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-posenc", description="Positional encodings for transformers models."
    )
    parser.add_argument("--version", action="version", version=f"hf-posenc {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(commands)
    for name, subparser in commands.choices.items():
        subparser.formatter_class = DefaultsHelpFormatter
        if name != "lm-eval" and "--traceback" not in subparser._option_string_actions:
            subparser.add_argument(
                "--traceback", action="store_true", help="show the full traceback on error"
            )
    return parser


def _hub_error(error: BaseException) -> bool:
    """A transformers/huggingface_hub error about a missing repo or an unreachable hub."""
    name = type(error).__name__
    return name in (
        "RepositoryNotFoundError",
        "GatedRepoError",
        "LocalEntryNotFoundError",
        "HFValidationError",
    )


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again on the closed
    pipe (the recipe in Python's documentation, "Note on SIGPIPE")."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured in tests)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    from ..provenance import set_command

    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)  # --config: which flags were given
    set_command(["hf-posenc", *args._argv])
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:  # `hf-posenc list | head`: the reader has what it wanted
        _silence_stdout()
        return 0
    except KeyboardInterrupt as stop:
        if getattr(args, "traceback", False):
            raise
        detail = f" ({stop})" if str(stop) else ""
        print(f"hf-posenc {args.command}: interrupted{detail}", file=sys.stderr)
        return 130
    except Exception as error:
        if getattr(args, "traceback", False) or not (isinstance(error, USER_ERRORS) or _hub_error(error)):
            raise
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"hf-posenc {args.command}: error: {message}", file=sys.stderr)
        return 2
