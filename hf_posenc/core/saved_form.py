"""The saved form of a patch: the ``config.posenc`` entry (``{"encoding": ..., "params": {...},
"format_version": N, "hf_posenc_version": ...}``), how it is written, checked and described, and
whether a recipe's ``--encoding`` names it.

A plain patch is written as format 1 (tensors under ``posenc.``), a per-layer hybrid as
``{"encoding": "hybrid", "params": {"parts": [...], "layers": [...]}}`` (format 2, tensors under
``posenc.parts.<i>.``). Part of the request language (:mod:`hf_posenc.core.request`, which reads
these entries back into plans and re-exports these names).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._version import __version__
from ..errors import InvalidParameterError
from .config import FORMAT_VERSION, HYBRID_FORMAT_VERSION, EncodingConfig
from .pattern import canonical_request, expand_runs, parse_pattern_runs, parse_pattern_text, pattern_text

#: ``config.posenc["encoding"]`` of a hybrid patch
HYBRID = "hybrid"
#: keys of a hybrid's ``params`` in the saved form
HYBRID_KEYS = ("parts", "layers")
#: keys of one hybrid entry in the mapping form
PART_KEYS = ("encoding", "params")
#: keys of the mapping form (what ``config.posenc`` holds)
MAPPING_KEYS = ("encoding", "params", "format_version", "hf_posenc_version")


def check_format_version(version: Any) -> None:
    """Raise for a ``config.posenc`` written in a format this version cannot read."""
    newest = max(FORMAT_VERSION, HYBRID_FORMAT_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= newest:
        raise InvalidParameterError(
            f"config.posenc format_version={version!r} is not supported; allowed: "
            f"{', '.join(str(v) for v in range(1, newest + 1))} (written by hf_posenc <= {__version__}; "
            "a newer hf_posenc may be needed)"
        )


def check_mapping(encoding: Mapping[str, Any]) -> None:
    """Refuse a malformed mapping form (unknown keys, no name, params not a mapping, bad format)."""
    unknown = sorted(set(encoding) - set(MAPPING_KEYS), key=repr)
    if unknown:
        raise InvalidParameterError(
            f"the encoding mapping has unknown key(s) {', '.join(map(repr, unknown))}; "
            f"allowed keys: {', '.join(map(repr, MAPPING_KEYS))}"
        )
    name = encoding.get("encoding")
    if not isinstance(name, str):
        raise InvalidParameterError(
            f"the encoding mapping needs 'encoding': an encoding name (str), got {name!r}"
        )
    params = encoding.get("params", {})
    if params is None or not isinstance(params, Mapping):
        raise InvalidParameterError(
            f"the encoding mapping's 'params' must be a mapping of parameter names to values, got {params!r}"
        )
    if "format_version" in encoding:
        check_format_version(encoding["format_version"])


def saved_entry(
    names: Sequence[str], configs: Sequence[EncodingConfig], layers: Sequence[int]
) -> dict[str, Any]:
    """The ``config.posenc`` entry of a patch whose parts are the encodings ``names`` with resolved
    ``configs``, ``layers`` giving the part of every layer: one part is written as earlier versions
    wrote a plain patch (format 1, tensors under ``posenc.``), several as a hybrid (format 2, tensors
    under ``posenc.parts.<i>.``). :func:`~hf_posenc.core.request.plan_request` reads either back into
    the same parts."""
    if len(names) == 1:
        return {
            "encoding": names[0],
            "params": configs[0].to_dict(),
            "format_version": FORMAT_VERSION,
            "hf_posenc_version": __version__,
        }
    return {
        "encoding": HYBRID,
        "params": {
            "parts": [
                {"encoding": name, "params": config.to_dict()}
                for name, config in zip(names, configs, strict=True)
            ],
            "layers": list(layers),
        },
        "format_version": HYBRID_FORMAT_VERSION,
        "hf_posenc_version": __version__,
    }


def describe_patch(names: Sequence[str], layers: Sequence[int]) -> str:
    """What runs, as messages name it: the encoding, or ``hybrid`` and the per-layer text form."""
    if len(names) == 1:
        return names[0]
    return f"{HYBRID} {pattern_text([names[owner] for owner in layers])}"


def check_saved_entry(saved: Any, where: str = "") -> Mapping[str, Any]:
    """Refuse a ``config.posenc`` that is not a mapping (e.g. hand-edited into a string) or names a
    format this version cannot read, with one line; return it."""
    prefix = f"{where}: " if where else ""
    if not isinstance(saved, Mapping):
        raise InvalidParameterError(
            f"{prefix}config.posenc={saved!r} is not allowed; allowed: the mapping hf_posenc writes "
            "({'encoding': NAME, 'params': {...}, 'format_version': N, ...})"
        )
    if "format_version" in saved:
        check_format_version(saved["format_version"])
    return saved


def saved_description(saved: Mapping[str, Any]) -> str:
    """A saved ``config.posenc``'s encoding as a recipe names it: the name, or the per-layer text."""
    check_saved_entry(saved)
    if saved.get("encoding") != HYBRID:
        return str(saved.get("encoding"))
    params = saved.get("params") or {}
    parts = [part.get("encoding") for part in params.get("parts") or []]
    return pattern_text([str(parts[i]) for i in params.get("layers") or []])


def matches_saved(text: str, saved: Mapping[str, Any]) -> bool:
    """Whether a recipe's ``--encoding`` names the encoding a checkpoint was saved with (a pattern
    matches a hybrid whose layers repeat it)."""
    check_saved_entry(saved)
    requested = canonical_request(text)
    if saved.get("encoding") != HYBRID:
        return requested == saved.get("encoding")
    layers = parse_pattern_text(saved_description(saved))
    runs = parse_pattern_runs(requested)
    length = sum(count for _, count in runs)
    names = expand_runs(runs, min(length, len(layers)))
    return [names[i % len(names)] for i in range(len(layers))] == layers
