"""Result files written whole or not at all.

Each file goes to a hidden partial beside it (``.NAME.partial.EXT``, so tools that read the
extension, as matplotlib's ``savefig`` does, still see it) and is renamed over the target when
complete (``os.replace``: atomic within one folder on POSIX and Windows). A write that fails —
a full disk, an exception while rendering — leaves the previous file as it was and removes
the partial. Written by hand: the standard library has no atomic write, and transformers'
and datasets' own helpers write their formats only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def partial_path(path: Path) -> Path:
    """``folder/name.ext`` -> ``folder/.name.partial.ext``."""
    return path.with_name(f".{path.stem}.partial{path.suffix}")


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """The path to write ``path``'s new content to: it replaces ``path`` when the block ends
    without an error and is removed when it raises."""
    target = Path(path)
    partial = partial_path(target)
    try:
        yield partial
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> Path:
    """``Path.write_text`` (UTF-8), whole or not at all."""
    with replacing(path) as partial:
        partial.write_text(text, encoding="utf-8")
    return Path(path)
