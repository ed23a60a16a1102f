"""One run per output folder: ``hf-posenc train``, ``study``, ``perplexity``, ``longeval`` and
``bench`` hold a lock on their folder.

The lock is an ``fcntl.flock`` on ``<folder>/.hf-posenc.lock``, held by the live process: the
kernel drops it when the process ends in any way (``kill -9`` included), so a killed run never
leaves it stuck. The file records who holds it (pid, host, command, start time) so a second
launch can say, in one line, which run is using the folder. A process that already holds a
folder's lock may take it again (a study's own steps, a resume in the same interpreter).

Written by hand because nothing in transformers/accelerate/datasets locks an output folder
(``filelock`` would do the locking, but is not a declared dependency; ``flock`` is in the
standard library). On a platform without ``fcntl`` the lock is not taken.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from ..errors import PosencError

LOCK_FILE = ".hf-posenc.lock"


class FolderInUseError(PosencError, RuntimeError):
    """Another live hf-posenc process is writing the output folder."""


#: the folders this process holds: resolved path -> (open lock file, how many holds)
_HELD: dict[str, list] = {}


def _holder(handle: IO[str]) -> str:
    try:
        handle.seek(0)
        info = json.loads(handle.read() or "{}")
    except (OSError, ValueError):
        return "another process"
    return (
        f"pid {info.get('pid', '?')} on {info.get('host', '?')}, started {info.get('started', '?')}: "
        f"{info.get('command', '?')}"
    )


def acquire(folder: Path, what: str = "run") -> None:
    """Hold ``folder``'s lock (creating the folder), or raise :class:`FolderInUseError` in one
    line naming the holder when another live process holds it."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform: nothing to hold
        return
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError:  # not a folder, not writable: the output checks say so in their own words
        return
    key = str(Path(folder).resolve())
    if key in _HELD:
        _HELD[key][1] += 1
        return
    handle = open(Path(key) / LOCK_FILE, "a+")  # noqa: SIM115 - held open for the run's lifetime
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _holder(handle)
        handle.close()
        raise FolderInUseError(
            f"{key!r} is in use by another hf-posenc {what} ({holder}); wait for it to end or stop it, "
            "or choose another output folder (nothing was changed)"
        ) from None
    handle.seek(0)
    handle.truncate()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": started,
        "command": " ".join(sys.argv),
    }
    handle.write(json.dumps(record))
    handle.flush()
    _HELD[key] = [handle, 1]


def release(folder: Path) -> None:
    """Give back one hold of ``folder``'s lock (the last one unlocks it)."""
    key = str(Path(folder).resolve())
    held = _HELD.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        del _HELD[key]
        held[0].close()  # closing the file drops the flock


@contextlib.contextmanager
def holding(folder: Path, what: str = "run") -> Iterator[None]:
    """``folder``'s lock for the duration of the block (:func:`acquire`, then :func:`release`)."""
    acquire(folder, what)
    try:
        yield
    finally:
        release(folder)
