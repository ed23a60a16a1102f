"""A save that runs out of disk space: one line naming where, and nothing half-written kept.

Checkpoints and the final model are written to a ``*.tmp`` folder and renamed when complete
(see ``checkpoints.py`` / ``outputs.py``). When a write fails for lack of space, the partial
folder is removed at once (it would never be used, and it holds the space the user needs back)
and :class:`DiskFullError` says ``no space left on <path>``. torch reports a full disk inside
``torch.save`` as ``RuntimeError: [enforce fail ...] file write failed`` without the errno, so
that message counts as "full" when the disk has less than :data:`NEARLY_FULL` bytes free.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ...errors import PosencError

#: free bytes below which a failed write is taken for a full disk
NEARLY_FULL = 64 << 20
_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


class DiskFullError(PosencError, OSError):
    """A checkpoint or the final model could not be saved: the disk is full."""


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def no_space(error: BaseException, folder: Path) -> str | None:
    """The path the disk filled up at, when ``error`` (or its cause) is a full disk; else None."""
    for cause in _chain(error):
        if isinstance(cause, OSError) and cause.errno in _NO_SPACE:
            return str(cause.filename or folder)
        text = str(cause)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return str(folder)
        if "file write failed" in text:
            try:
                if shutil.disk_usage(folder if folder.exists() else folder.parent).free < NEARLY_FULL:
                    return str(folder)
            except OSError:
                pass
    return None


@contextmanager
def saving(partial: Path, what: str) -> Iterator[None]:
    """Run the writes of ``what`` into ``partial``; on a full disk remove ``partial`` and raise
    :class:`DiskFullError` in one line."""
    try:
        yield
    except Exception as error:
        where = no_space(error, partial)
        if where is None:
            raise
        shutil.rmtree(partial, ignore_errors=True)
        raise DiskFullError(
            f"no space left on {where} while saving {what}; the partial {partial.name} was removed and "
            "earlier checkpoints are untouched: free space there (or choose another --output-dir), then run "
            "the same command again (with --resume when the run has checkpoints)"
        ) from None


@contextmanager
def saving_together(accelerator, partial: Path, what: str) -> Iterator[None]:
    """:func:`saving` on every process of a launch, which then all stop together: a process whose
    disk filled up tells the others (instead of leaving them waiting at the next barrier), and
    every process raises the same :class:`DiskFullError`. Ends with a barrier."""
    failure = None
    try:
        with saving(partial, what):
            yield
    except DiskFullError as error:
        failure = str(error)
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        failure = next((f for f in gather_object([failure]) if f is not None), None)
    else:
        accelerator.wait_for_everyone()
    if failure is not None:
        shutil.rmtree(partial, ignore_errors=True)
        raise DiskFullError(failure)
