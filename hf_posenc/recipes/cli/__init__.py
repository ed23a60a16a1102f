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
from pathlib import Path

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
from .common import CommandParser, DefaultsHelpFormatter

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
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=CommandParser
    )
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


def _full_disk(args: argparse.Namespace, error: BaseException) -> str | None:
    """One line for a write that ran out of disk space anywhere in a command (a results file,
    an exported model, a checkpoint): where, and what to do. Result files are written whole or
    not at all (:mod:`..atomic`), so the previous ones are intact."""
    from ..training.space import no_space

    if isinstance(error, PosencError):  # ours are one line already (train's DiskFullError included)
        return None
    folder = next(
        (getattr(args, name) for name in ("output_dir", "output", "out") if getattr(args, name, None)), "."
    )
    where = no_space(error, Path(folder))
    if where is None:
        return None
    return (
        f"no space left on {where} while writing this command's output; files written earlier are intact "
        "and nothing was left half-written: free space there (or choose another output folder), then run the "
        "same command again (with --overwrite where it asks to replace the results written so far)"
    )


def _report(line: str) -> None:
    """``line`` and its newline to stderr in one write (stderr is unbuffered: ``print`` makes two,
    the text and then the newline, strace-checked). The processes of a launch share one stream,
    where two ranks' ``print``s interleaved into one line holding both messages (CI, two pytest
    workers, 2026-11-27: test_every_process_of_a_two_process_launch_refuses_a_folder_in_use)."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


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
        _report(f"hf-posenc {args.command}: interrupted{detail}")
        return 130
    except Exception as error:
        full = None if getattr(args, "traceback", False) else _full_disk(args, error)
        if full is not None:
            _report(f"hf-posenc {args.command}: error: {full}")
            return 2
        if getattr(args, "traceback", False) or not (isinstance(error, USER_ERRORS) or _hub_error(error)):
            raise
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        _report(f"hf-posenc {args.command}: error: {message}")
        return 2
