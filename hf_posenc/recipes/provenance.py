"""What produced a results file: package versions, the git commit, the date and the full command."""

from __future__ import annotations

import datetime
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("hf-posenc", "transformers", "torch", "accelerate", "datasets", "peft", "lm-eval")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_commit(directory: Path | None = None) -> str | None:
    """The commit of the hf_posenc source tree (with ``-dirty`` for local changes), if it is a git checkout."""
    folder = directory or Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


_COMMAND: list[str] | None = None


def set_command(argv: list[str]) -> None:
    """Record the command being run (``hf-posenc`` sets it from its arguments)."""
    global _COMMAND
    _COMMAND = list(argv)


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed (shell-quoted), ``hf-posenc`` for the console script."""
    args = list(argv if argv is not None else _COMMAND if _COMMAND is not None else sys.argv)
    if args and Path(args[0]).name in ("hf-posenc", "__main__.py"):
        args[0] = "hf-posenc"
    return shlex.join(args)


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """``{"versions": {...}, "git_commit", "date" (UTC, ISO 8601), "command", "python", "threads"}``
    (``threads``: torch's thread count and why, see :mod:`.threads`)."""
    from .._version import __version__
    from .threads import current_choice

    versions = {name: _version(name) for name in PACKAGES}
    versions["hf-posenc"] = __version__
    return {
        "versions": {k: v for k, v in versions.items() if v is not None},
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(argv),
        "python": sys.version.split()[0],
        "threads": current_choice(),
    }
