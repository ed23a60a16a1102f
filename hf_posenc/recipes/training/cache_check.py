"""The token cache is verified before a run (a resume above all) reads it.

``datasets`` reuses a ``map`` cache file by name without looking inside: flipped bytes that stay
in the vocabulary would train a resumed run on other tokens with no message, bytes past it fail
mid-training, and a truncated file fails with a message naming neither the file nor the fix.
When the token cache is written, a manifest ``tokens-<key>.sha256.json`` beside it records the
size and SHA-256 of each of its Arrow files; every later use checks them first and names a
damaged file with what to do (delete it: it is rebuilt from the data). A cache written before
manifests existed is recorded as it is on its next use.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..data import DataError
from .checkpoints import file_digest

MANIFEST_SUFFIX = ".sha256.json"


def manifest_path(cache_file: Path) -> Path:
    """``tokens-<key>.arrow`` -> ``tokens-<key>.sha256.json``."""
    return cache_file.with_name(cache_file.stem + MANIFEST_SUFFIX)


def _damaged(path: Path, what: str, manifest: Path) -> DataError:
    return DataError(
        f"{path}: the token cache {what}; a run would train on other tokens than the data's. Delete it and "
        f"its record (rm {path} {manifest}) and run the same command again: the cache is rebuilt from the data"
    )


def verify_cache(cache_file: Path) -> None:
    """Check every Arrow file the manifest of ``cache_file`` records (no manifest: nothing to check)."""
    manifest = manifest_path(cache_file)
    if not manifest.is_file():
        return
    try:
        recorded = json.loads(manifest.read_text(encoding="utf-8"))
        files = {name: (int(v["bytes"]), str(v["sha256"])) for name, v in recorded["files"].items()}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(
            f"{manifest}: the token cache's record is unreadable ({error}); delete it and the cache files "
            f"beside it (rm {cache_file.parent}/{cache_file.stem}*) and run the same command again"
        ) from None
    for name, (size, digest) in files.items():
        path = cache_file.parent / name
        if not path.is_file():
            raise _damaged(path, "is missing", manifest)
        actual = path.stat().st_size
        if actual != size:
            raise _damaged(path, f"has {actual} bytes where {size} were written (truncated?)", manifest)
        if file_digest(path) != digest:
            raise _damaged(
                path, "does not match the SHA-256 recorded when it was written (damaged)", manifest
            )


def record_cache(cache_file: Path, files: list[Path]) -> None:
    """Write the manifest of ``cache_file`` (the token dataset's Arrow ``files``) unless it exists."""
    manifest = manifest_path(cache_file)
    if manifest.is_file() or not files:
        return
    record = {
        "files": {
            path.name: {"bytes": path.stat().st_size, "sha256": file_digest(path)}
            for path in files
            if path.parent.resolve() == cache_file.parent.resolve()
        }
    }
    if not record["files"]:
        return
    partial = manifest.with_name(manifest.name + ".tmp")
    partial.write_text(json.dumps(record, indent=2), encoding="utf-8")
    partial.replace(manifest)
