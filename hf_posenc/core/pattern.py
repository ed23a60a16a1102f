"""The text form of a per-layer pattern: entries joined by ``+``, ``NAME*N`` repeating one N times
(``"rope*3+nope"``), as the recipes take it (``--encoding rope*3+nope``, lm-eval
``encoding=rope*3+nope``) and as messages and ``config.posenc`` descriptions write it.

Part of the request language (:mod:`hf_posenc.core.request`, which re-exports these names).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import InvalidParameterError
from .registry import canonical_name


def is_pattern_text(value: Any) -> bool:
    """Whether ``value`` is the text form of a pattern (``"rope*3+nope"``)."""
    return isinstance(value, str) and ("+" in value or "*" in value)


def parse_pattern_runs(text: str) -> list[tuple[str, int]]:
    """``"rope*3+nope"`` -> ``[("rope", 3), ("nope", 1)]``: the counts are read, never expanded, so a
    count of 10**10 costs nothing (a plan refuses a pattern longer than the model's depth)."""
    runs: list[tuple[str, int]] = []
    for item in str(text).split("+"):
        name, star, count = item.strip().partition("*")
        name = name.strip()
        repeat = 1
        if star:
            try:
                repeat = int(count.strip())
            except ValueError:
                repeat = 0
        if not name or repeat < 1:
            raise InvalidParameterError(
                f"encoding pattern {text!r}: entry {item.strip()!r} is not allowed; allowed: NAME or NAME*N "
                "(N >= 1) joined by '+', e.g. 'rope*3+nope'"
            )
        runs.append((name, repeat))
    return runs


def expand_runs(runs: Sequence[tuple[Any, int]], limit: int) -> list[Any]:
    """The first ``limit`` entries of a run-length pattern (fewer when it is shorter)."""
    entries: list[Any] = []
    for entry, count in runs:
        if len(entries) >= limit:
            break
        entries.extend([entry] * min(count, limit - len(entries)))
    return entries


def parse_pattern_text(text: str, limit: int | None = None) -> list[str]:
    """``"rope*3+nope"`` -> ``["rope", "rope", "rope", "nope"]`` (at most ``limit`` entries when given)."""
    runs = parse_pattern_runs(text)
    return expand_runs(runs, sum(count for _, count in runs) if limit is None else limit)


def _run_text(runs: Sequence[tuple[str, int]]) -> str:
    """Runs -> text, neighbouring runs of one name joined: ``[("rope", 2), ("rope", 1)]`` -> ``rope*3``."""
    joined: list[list[Any]] = []
    for name, count in runs:
        if joined and joined[-1][0] == name:
            joined[-1][1] += count
        else:
            joined.append([name, count])
    return "+".join(name if count == 1 else f"{name}*{count}" for name, count in joined)


def pattern_text(names: Sequence[str]) -> str:
    """Per-layer names -> the shortest run-length text (``rope*3+nope+rope*3+nope``)."""
    return _run_text([(name, 1) for name in names])


def canonical_request(text: str) -> str:
    """An encoding name or pattern text with aliases resolved: ``"RoPE*3+NoPE"`` -> ``"rope*3+nope"``."""
    if not is_pattern_text(text):
        return canonical_name(text)
    return _run_text([(canonical_name(name), count) for name, count in parse_pattern_runs(text)])
