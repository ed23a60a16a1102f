"""What ``hf-posenc list`` prints, without importing torch on every call.

The encodings and families are Python classes in modules that import torch (about 2 s of CPU),
and their metadata (names, aliases, stages, parameters, papers) only changes when the package's
source does. So the catalogue is built once by importing the registry, stored as JSON in the
user's cache folder under a key made from the package's version and the size and modification
time of every source file, and read from there afterwards. Any edit to the package (a new
encoding, a changed default) changes the key, so a stale catalogue is never shown; a cache that
cannot be read or written is simply rebuilt in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent


def cache_dir() -> Path:
    """``$HF_POSENC_CACHE``, else ``$XDG_CACHE_HOME/hf_posenc``, else ``~/.cache/hf_posenc``."""
    if os.environ.get("HF_POSENC_CACHE"):
        return Path(os.environ["HF_POSENC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hf_posenc"


def source_key() -> str:
    """A digest of the package version and every source file's path, size and mtime."""
    from .._version import __version__

    digest = hashlib.sha1(__version__.encode())
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path.relative_to(PACKAGE_DIR)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def build_catalogue() -> dict[str, Any]:
    """The catalogue from the registry itself (imports every encoding and family)."""
    from ..core.registry import list_encodings, supported_families

    encodings = [
        {
            "name": info.name,
            "aliases": list(info.aliases),
            "stages": list(info.stages),
            "parameters": json.loads(json.dumps(info.parameters, default=str)),
            "summary": info.summary,
            "paper": info.paper,
            "per_layer": info.per_layer,
        }
        for info in list_encodings()
    ]
    return {"encodings": encodings, "families": list(supported_families())}


def catalogue() -> dict[str, Any]:
    """The catalogue, from the cache when it matches the installed source, else built (and cached)."""
    path = cache_dir() / f"catalogue-{source_key()}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    built = build_catalogue()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
            json.dump(built, handle)
        os.replace(handle.name, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass  # read-only home, full disk: the catalogue is still correct, just not cached
    return built
